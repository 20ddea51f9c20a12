"""Static-shape passes for the lean runtime: a KV pool of session slots, passes padded up to
(sessions, tokens) buckets, and on CUDA one captured graph per bucket.

A GPU pass of a small model is launch-bound: the eager forward issues hundreds of small kernels
and Python work between them (docs/benchmarks.md: 22 ms for a pass whose weights read in 0.1 ms).
A CUDA graph replays all of a pass's kernels in one launch, but only for fixed shapes and fixed
memory. So here:

- ``SlotPool``: every layer's keys and values for ``slots`` sessions of up to ``slot_tokens``
  positions, allocated once: [layers, slots + 1, kv_heads, slot_tokens, head_dim]. Slot 0 is
  scratch for the padded sessions of a bucket; a session owns one of the others.
- ``StaticKV``: a ``LeanKV`` whose buffers are views of its slot, so the eager forward and the
  numpy pass work on it unchanged. Rollback is still setting ``length`` (O(1)). A session that
  outgrows its slot moves to buffers of its own and gives the slot back; from then on its passes
  are eager. The slot returns to the pool when the session's cache is dropped.
- ``StaticPasses.run``: a pass over sessions that all hold slots, padded to the smallest bucket
  of ``SESSION_BUCKETS`` x ``TOKEN_BUCKETS`` that holds it. Padded token rows of a session sit at
  the positions after its fed tokens (their keys land past its new length, where nothing reads
  them before they are overwritten), padded sessions use the scratch slot, and the attention mask
  is built inside the pass from the positions (row at position i sees keys 0..i of its own slot),
  so every shape, index and address is the same from one pass of a bucket to the next. A pass
  larger than every bucket, or one whose padding would run past a slot, is the eager forward's.

Batch-invariant mode (``LeanModel.batch_invariant``): every pass is one session's, at the largest
token bucket, so every product has one shape and a row's result depends on its own inputs only: a
token's logits are bitwise the same whether it was decoded alone or verified among drafts, in any
precision (the prompt's prefill runs eagerly, the same way in both).

Invariant: for the rows a caller keeps, a static pass computes what the eager forward computes
(the same products on the same rows, padded rows never reaching a real row: a real row's keys are
its own session's positions up to itself). Tests check token equality on CPU, where the same code
runs without graphs (``--static-kv on``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.lean import attention
from specdec.lean.kv import LeanKV
from specdec.lean.layer import decoder_layer, rope_tables
from specdec.lean.matmul import smallest_bucket

log = logging.getLogger(__name__)

SESSION_BUCKETS = (1, 2, 4, 8, 16)  # sessions per pass a graph is captured for
TOKEN_BUCKETS = (1, 2, 4, 8, 16)  # new tokens per session a graph is captured for (decode, verify of k <= 15)
SCRATCH_SLOT = 0


class SlotPool:
    """Preallocated keys/values for ``slots`` sessions (plus the scratch slot) of ``slot_tokens`` each."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 slots: int, slot_tokens: int) -> None:
        if slots < 1 or slot_tokens < max(TOKEN_BUCKETS):
            raise ValueError(f"a KV pool needs at least one slot of at least {max(TOKEN_BUCKETS)} positions")
        shape = (num_layers, slots + 1, kv_heads, slot_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_tokens = slot_tokens
        self._free = list(range(slots, SCRATCH_SLOT, -1))  # pop() hands out slot 1 first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)


class StaticKV(LeanKV):
    """A ``LeanKV`` living in a ``SlotPool`` slot (``pool`` is None once it has left for its own buffers)."""

    def __init__(self, pool: SlotPool, slot: int, max_capacity: int | None) -> None:
        layers, _, kv_heads, _, head_dim = pool.keys.shape
        super().__init__(layers, kv_heads, head_dim, pool.keys.dtype, pool.keys.device, max_capacity=max_capacity)
        self.pool: SlotPool | None = pool
        self.slot = slot
        self.keys, self.values = pool.keys[:, slot], pool.values[:, slot]
        self._give_back = weakref.finalize(self, pool.release, slot)

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        super().reserve(needed)  # copies the first ``length`` positions out of the slot
        if self.pool is not None:
            self.pool = None
            self._give_back()


@dataclass
class _Bucket:
    """One bucket's fixed inputs and outputs (a captured graph reads and writes exactly these)."""

    ids: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T] each row's position in its slot
    slots: torch.Tensor  # [B] the slot of each session (scratch for padded ones)
    features: torch.Tensor | None = None  # [B, T, H] the final norm's input
    logits: torch.Tensor | None = None  # [B, T, head rows]
    graph: object | None = None  # torch.cuda.CUDAGraph once captured


class StaticPasses:
    """Bucketed static-shape passes of a ``LeanModel`` over sessions in ``pool``; CUDA graphs when ``graphs``."""

    def __init__(self, model, pool: SlotPool, graphs: bool) -> None:
        if graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.pool = pool
        self.graphs = graphs
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        # The RoPE tables of every position a slot has (gathered by position in a pass).
        positions = torch.arange(pool.slot_tokens, device=model.device).float()
        cos, sin = rope_tables(positions, model._inv_freq, model.w.rope_scale)
        self._cos, self._sin = cos.to(model.dtype), sin.to(model.dtype)
        # SDPA on a GPU; on CPU written out (``attention.WrittenKernel`` says why).
        kernel = attention.SdpaKernel if model.device.type != "cpu" else attention.WrittenKernel
        self._kernel = kernel(model.groups, model.scaling, model.device)

    def forget_graphs(self) -> None:
        """Drop every bucket (and its graph): the next passes rebuild them (after the weights changed)."""
        self._buckets.clear()

    def capture_all(self) -> int:
        """Capture every bucket the pool can fill now (a service's warm-up), not at its first pass;
        the number of buckets run. Nothing without graphs (the CPU has none to capture)."""
        if not self.graphs:
            return 0
        kvs = [kv for kv in (self.new_kv(None) for _ in range(max(SESSION_BUCKETS))) if kv is not None]
        shapes = [(s, t) for s in SESSION_BUCKETS if s <= len(kvs) for t in TOKEN_BUCKETS]
        for sessions, tokens in shapes:
            self.run(kvs[:sessions], [[0] * tokens] * sessions, [1] * sessions, (sessions, tokens), None)
            for kv in kvs:
                kv.length = 0
        for kv in kvs:  # the slots go back now, not whenever the collector gets to them
            kv._give_back()
        return len(shapes)

    def new_kv(self, max_capacity: int | None) -> StaticKV | None:
        slot = self.pool.acquire()
        return None if slot is None else StaticKV(self.pool, slot, max_capacity)

    def shape_for(self, kvs: Sequence[LeanKV], fed: Sequence[int]) -> tuple[int, int] | None:
        """The (sessions, tokens) bucket of this pass, or None when it must run eagerly."""
        sessions, tokens = smallest_bucket(len(kvs), SESSION_BUCKETS), smallest_bucket(max(fed), TOKEN_BUCKETS)
        if self.model.batch_invariant and tokens is not None:
            # One shape for every pass: a row's products then never depend on how many rows came
            # with it, so a token verified among drafts gets the logits it gets decoded alone.
            tokens = max(TOKEN_BUCKETS)
        if sessions is None or tokens is None:
            return None
        for kv in kvs:
            if not isinstance(kv, StaticKV) or kv.pool is not self.pool or kv.length + tokens > self.pool.slot_tokens:
                return None
        return sessions, tokens

    @torch.inference_mode()
    def run(self, kvs: Sequence[StaticKV], feeds: Sequence[Sequence[int]], num_logits: Sequence[int],
            shape: tuple[int, int], feature_sink: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        """The kept rows' logits [sum(num_logits), head rows] (as ``LeanModel.forward`` before widening),
        on the model's device; every session holds its feed afterwards."""
        b = self._bucket(shape)
        ids, positions, slots = self._inputs(kvs, feeds, shape)
        b.ids.copy_(ids, non_blocking=True)
        b.positions.copy_(positions, non_blocking=True)
        b.slots.copy_(slots, non_blocking=True)
        if b.graph is not None:
            b.graph.replay()
            features, all_logits = b.features, b.logits
        elif self.graphs:  # the bucket's first pass: run on a side stream as the warm-up, then capture
            side = torch.cuda.Stream(device=self.model.device)
            side.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(side):
                features, all_logits = self._body(b)
            torch.cuda.current_stream(self.model.device).wait_stream(side)
            try:
                self._capture(b)
            except Exception:  # a capture this stack cannot do must not take the service down: eager from now on
                log.exception("CUDA graph capture failed for %d x %d; static passes run eagerly from now on", *b.ids.shape)
                self.graphs = False
                self.forget_graphs()
        else:  # on CPU through the product backend the load-time table picked for this many rows
            backend = self.model.plan.backend(b.ids.numel())
            with self.model.plan.regime(backend):
                features, all_logits = self._body(b, backend)
        rows = [(i, t) for i, (feed, k) in enumerate(zip(feeds, num_logits)) for t in range(len(feed) - k, len(feed))]
        index_b = torch.tensor([i for i, _ in rows], device=self.model.device)
        index_t = torch.tensor([t for _, t in rows], device=self.model.device)
        logits = all_logits[index_b, index_t].float()
        if feature_sink is not None:
            feature_sink(torch.cat([features[i, : len(feed)] for i, feed in enumerate(feeds)]).float().cpu())
        for kv, feed in zip(kvs, feeds):
            kv.length += len(feed)
        return logits

    def _inputs(self, kvs, feeds, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sessions, tokens = shape
        ids = torch.zeros((sessions, tokens), dtype=torch.long)
        positions = torch.arange(tokens).repeat(sessions, 1)  # padded sessions: scratch positions 0..T-1
        slots = torch.full((sessions,), SCRATCH_SLOT, dtype=torch.long)
        for i, (kv, feed) in enumerate(zip(kvs, feeds)):
            ids[i, : len(feed)] = torch.tensor(feed, dtype=torch.long)
            positions[i] += kv.length
            slots[i] = kv.slot
        return ids, positions, slots

    def _bucket(self, shape: tuple[int, int]) -> _Bucket:
        b = self._buckets.get(shape)
        if b is None:
            device = self.model.device
            sessions, tokens = shape
            b = _Bucket(ids=torch.zeros(shape, dtype=torch.long, device=device),
                        positions=torch.arange(tokens, device=device).repeat(sessions, 1),
                        slots=torch.full((sessions,), SCRATCH_SLOT, dtype=torch.long, device=device))
            self._buckets[shape] = b
        return b

    def _capture(self, b: _Bucket) -> None:
        """Capture ``_body`` on ``b``'s tensors (recorded, not run: the pass just run on the same inputs
        was the warm-up, as torch's docs ask); the next pass of this bucket replays it. Every graph
        shares one memory pool; each bucket's outputs stay referenced, so no capture reuses them."""
        torch.cuda.synchronize(self.model.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            b.features, b.logits = self._body(b)
        b.graph = graph
        log.info("captured a CUDA graph for %d session(s) x %d token(s)", *b.ids.shape)

    def _body(self, b: _Bucket, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass on ``b``'s inputs, rows flattened to [B x T, ...]; only fixed-shape ops on fixed
        tensors (capturable). ``backend``: the product backend (None: torch's)."""
        m, w = self.model, self.model.w
        sessions, tokens = b.ids.shape
        name = "torch" if backend is None else backend.name
        mm = F.linear if backend is None else backend.mm
        cos, sin = self._cos[b.positions].view(sessions * tokens, 1, -1), self._sin[b.positions].view(sessions * tokens, 1, -1)
        mask = attention.slot_mask(b.positions, self.pool.slot_tokens, m.groups)
        slot_rows = b.slots[:, None].expand(sessions, tokens)
        kernel, heads = self._kernel, w.heads
        x = F.embedding(b.ids.view(sessions * tokens), w.embed)
        for index, p in enumerate(m.bound_layers(name)):
            keys, values = self.pool.keys[index], self.pool.values[index]  # [slots, kv_heads, S, dim]

            def attend(q_and_k, v):
                return attention.attend_slots(q_and_k, v, keys, values, b.slots, b.positions, slot_rows, heads,
                                              kernel, mask)

            x = decoder_layer(x, p, m.shape, mm, attend, cos, sin)
        h = F.rms_norm(x, (w.hidden,), w.final_norm, w.eps)
        return x.view(sessions, tokens, -1), mm(h, m.lm_head.handles[name]).view(sessions, tokens, -1)
