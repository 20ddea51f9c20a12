"""The lean forward of a Llama-family causal LM over one or several sessions' new tokens.

On CPU a pass of one session runs ``NumpyPass`` (the same math with its activations in numpy,
where a small op costs ~1 us instead of torch's ~5-30); what follows is the torch forward, which
runs passes of several sessions and every pass on a GPU.

One pass packs every session's new tokens into one sequence of T rows (each at its own
positions): embedding, then the one layer body (``specdec.lean.layer.decoder_layer``) per layer,
then the final norm and the LM head over only the rows whose logits are wanted. The products go
through the backend the load-time table picked for T rows (``specdec.lean.matmul``). RoPE tables
and the attention mask are built once per pass. One session attends over views of its buffer
(``attention.attend_session``, long prefills in query blocks); several sessions over their
concatenated keys/values with a block mask (``attention.attend_ragged``). Which path runs when:
the table in ``specdec.lean.layer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from specdec.lean import attention
from specdec.lean.kv import LeanKV
from specdec.lean.layer import TORCH, BoundLayers, LayerShape, decoder_layer, rope_tables
from specdec.lean.matmul import BUCKETS, Linear, MatmulPlan
from specdec.lean.numpy_pass import NumpyPass
from specdec.lean.static import SlotPool, StaticPasses
from specdec.lean.weights import LeanWeights

log = logging.getLogger(__name__)

TIMED_BYTES = 96 << 20  # the load-time backend table times this much of the layers' weights (plus the LM head)


class LeanModel:
    def __init__(self, weights: LeanWeights, device: torch.device, backend: str | None = None,
                 buckets=BUCKETS, reps: int = 3, timed_bytes: int | None = TIMED_BYTES,
                 table_dir=None) -> None:
        """``backend``: force one (torch, mkldnn, numpy) instead of measuring; ``timed_bytes``: the
        load-time table times layers until their weights pass this size (None: every layer);
        ``table_dir``: where measured backend tables are kept for later loads (``MatmulPlan``)."""
        self.w = weights
        self.device = torch.device(device)
        self.dtype = weights.embed.dtype
        self.shape = LayerShape.of(weights)
        self.groups = self.shape.groups
        self.scaling = weights.head_dim ** -0.5
        self.kernel = attention.SdpaKernel(self.groups, self.scaling, self.device)
        self.layers = [(layer, Linear(layer.qkv), Linear(layer.o), Linear(layer.gate_up), Linear(layer.down))
                       for layer in weights.layers]
        self.lm_head = Linear(weights.lm_head)
        self.lm_head_ids: torch.Tensor | None = None
        linears = [linear for entry in self.layers for linear in entry[1:]] + [self.lm_head]
        self.plan = MatmulPlan(linears, self.device, backend=backend, buckets=buckets, reps=reps,
                               timed=self._timed_subset(timed_bytes), table_dir=table_dir)
        self._inv_freq = weights.inv_freq.to(self.device)
        self.bound_layers = BoundLayers(self.layers, TORCH)
        # On CPU a single session's pass keeps its activations in numpy (numpy_pass: per-op cost).
        self.numpy_pass = (NumpyPass(weights, self.layers, self.lm_head)
                           if self.device.type == "cpu" and self.dtype == torch.float32 else None)
        # Set while a caller wants the target's features (``LoadedModel.captured_features``): each pass
        # hands it the final-norm input of every fed token, packed as fed ([sum(fed), H], fp32, CPU).
        self.feature_sink: Callable[[torch.Tensor], None] | None = None
        self.static: StaticPasses | None = None  # ``use_static_kv``: slot pool, bucketed passes, CUDA graphs
        # Each session's rows in a pass of their own: a session's tokens then never depend on which
        # sessions shared its pass (in half precision a product's rounding depends on its row count).
        self.batch_invariant = False

    @classmethod
    def from_hf(cls, model, **options) -> LeanModel:
        weights = LeanWeights.from_hf(model)
        return cls(weights, weights.embed.device, **options)

    def _timed_subset(self, timed_bytes: int | None) -> list[Linear] | None:
        """The first layers whose weights pass ``timed_bytes`` (far past any cache), plus the LM head."""
        if timed_bytes is None:
            return None
        timed, size = [], 0
        for entry in self.layers:
            if size >= timed_bytes:
                break
            timed.extend(entry[1:])
            size += sum(linear.weight.numel() * linear.weight.element_size() for linear in entry[1:])
        return timed + [self.lm_head]

    @property
    def logits_width(self) -> int:
        return int(self.w.lm_head.shape[0])

    def use_static_kv(self, slots: int, slot_tokens: int, graphs: bool) -> None:
        """Sessions take slots of one preallocated KV pool, and passes that fit a bucket run
        static-shape (``specdec.lean.static``), replayed as CUDA graphs when ``graphs``."""
        w = self.w
        pool = SlotPool(len(self.layers), w.kv_heads, w.head_dim, self.dtype, self.device, slots,
                        min(slot_tokens, w.max_positions))
        self.static = StaticPasses(self, pool, graphs)

    def new_kv(self, capacity: int = 0) -> LeanKV:
        if self.static is not None:
            kv = self.static.new_kv(self.w.max_positions)
            if kv is not None:  # else every slot is taken: this session's passes run eagerly
                return kv
        return LeanKV(len(self.layers), self.w.kv_heads, self.w.head_dim, self.dtype, self.device,
                      capacity=capacity, max_capacity=self.w.max_positions)

    def restrict_lm_head(self, token_ids: torch.Tensor) -> None:
        """FR-Spec: logits only for ``token_ids`` (sorted); every other id gets -inf."""
        self.lm_head_ids = token_ids.to(self.device)
        self.lm_head = Linear(self.w.lm_head[self.lm_head_ids].contiguous())
        self.plan.prepare(self.lm_head)
        if self.static is not None:
            self.static.forget_graphs()  # they read the old LM head
        if self.numpy_pass is not None:
            self.numpy_pass.lm_head = self.lm_head

    @torch.inference_mode()
    def forward(self, kvs: Sequence[LeanKV], feeds: Sequence[Sequence[int]], num_logits: Sequence[int]) -> torch.Tensor:
        """Feed ``feeds[i]`` after what ``kvs[i]`` holds, for every i in one pass; fp32 logits
        [sum(num_logits), V] on the model's device: the last ``num_logits[i]`` positions of each feed,
        session after session (callers decide on the device and read back only tokens).

        Each ``kvs[i]`` holds ``feeds[i]`` afterwards; a pass that raises leaves every one unchanged."""
        w = self.w
        pasts = [kv.length for kv in kvs]
        fed = [len(feed) for feed in feeds]
        if not kvs or min(fed) < 1 or any(not 1 <= k <= n for k, n in zip(num_logits, fed)):
            raise ValueError("every session needs at least one token fed and 1..fed logits")
        if len({id(kv) for kv in kvs}) != len(kvs):
            raise ValueError("a session appears twice in one pass")
        if self.batch_invariant and len(kvs) > 1:
            return self._session_by_session(kvs, feeds, num_logits)
        if self.static is not None:
            shape = self.static.shape_for(kvs, fed)
            if shape is not None:
                return self._full_width(self.static.run(kvs, feeds, num_logits, shape, self.feature_sink))
        if self.numpy_pass is not None and len(kvs) == 1:
            backend = self.plan.backend(fed[0])
            with self.plan.regime(backend):
                logits = self.numpy_pass.run(kvs[0], feeds[0], num_logits[0], backend, self.feature_sink)
            return self._full_width(torch.from_numpy(logits))
        total = sum(fed)
        device = self.device
        ids = torch.tensor([token for feed in feeds for token in feed], dtype=torch.long, device=device)
        starts, keep = [], []
        start = 0
        for n, k in zip(fed, num_logits):
            starts.append(start)
            keep.extend(range(start + n - k, start + n))
            start += n
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(pasts, fed)]).to(device)
        for kv, p, n in zip(kvs, pasts, fed):
            kv.reserve(p + n)
        cos, sin = rope_tables(positions.float(), self._inv_freq, w.rope_scale)
        cos, sin = cos[:, None].to(self.dtype), sin[:, None].to(self.dtype)  # [T, 1, head_dim]
        attend = self._session_attention(kvs[0], pasts[0], fed[0]) if len(kvs) == 1 else \
            self._ragged_attention(kvs, pasts, fed, starts)
        backend = self.plan.backend(total)
        params = self.bound_layers(backend.name)
        with self.plan.regime(backend):
            x = F.embedding(ids, w.embed)
            for index, p in enumerate(params):
                x = decoder_layer(x, p, self.shape, backend.mm, partial(attend, index=index), cos, sin)
            if self.feature_sink is not None:
                self.feature_sink(x.float().cpu())
            rows = x[torch.tensor(keep, device=device)] if len(keep) < total else x
            h = F.rms_norm(rows, (w.hidden,), w.final_norm, w.eps)
            logits = backend.mm(h, self.lm_head.handles[backend.name]).float()
        for kv, p, n in zip(kvs, pasts, fed):  # the pass succeeded: every session now holds its feed
            kv.length = p + n
        return self._full_width(logits)

    def _session_by_session(self, kvs, feeds, num_logits) -> torch.Tensor:
        """``forward`` as one pass per session (batch-invariant mode), all or nothing as one pass."""
        lengths = [kv.length for kv in kvs]
        try:
            return torch.cat([self.forward([kv], [feed], [k]) for kv, feed, k in zip(kvs, feeds, num_logits)])
        except BaseException:
            for kv, length in zip(kvs, lengths):
                kv.length = length
            raise

    def _full_width(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: a reduced LM head's rows in place, -inf elsewhere."""
        if self.lm_head_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.logits_width), -torch.inf, device=logits.device)
        full[:, self.lm_head_ids] = logits
        return full

    def _session_attention(self, kv: LeanKV, past: int, count: int) -> Callable:
        """``attend(q_and_k, v, index)`` for a pass of one session: views of its buffers; a long
        prefill attends in blocks of query rows whose mask (bool, then SDPA's float bias) stays
        within the budget."""
        kernel, heads = self.kernel, self.w.heads
        block = attention.query_block_rows(self.groups, past + count, entry_bytes=1 + self.dtype.itemsize)
        mask = kernel.causal(past, 0, count) if block >= count else None
        return lambda q_and_k, v, index: attention.attend_session(
            q_and_k, v, kv.keys[index], kv.values[index], past, heads, kernel, TORCH, block, mask)

    def _ragged_attention(self, kvs, pasts, fed, starts) -> Callable:
        """``attend(q_and_k, v, index)`` for a pass of several sessions (one block mask per pass)."""
        kernel, heads = self.kernel, self.w.heads
        mask = attention.ragged_mask(pasts, fed, starts, self.groups, self.device)
        return lambda q_and_k, v, index: attention.attend_ragged(
            q_and_k, v, kvs, index, pasts, fed, starts, heads, kernel, mask)
