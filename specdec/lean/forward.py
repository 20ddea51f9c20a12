"""The lean forward of a Llama-family causal LM over one or several sessions' new tokens.

On CPU a pass of one session runs ``NumpyPass`` (the same math with its activations in numpy,
where a small op costs ~1 us instead of torch's ~5-30); what follows is the torch forward, which
runs passes of several sessions and every pass on a GPU.

One pass packs every session's new tokens into one sequence of T rows (each at its own
positions): embedding, then per layer RMSNorm -> fused QKV product -> RoPE on q and k together ->
the new keys/values written into each session's ``LeanKV`` -> one attention call -> O product ->
RMSNorm -> fused gate/up product -> SiLU * up -> down product, then the final norm and the LM head
over only the rows whose logits are wanted. The products go through the backend the load-time
table picked for T rows (``specdec.lean.matmul``). RoPE tables and the attention mask are built
once per pass.

Attention is one SDPA call per layer. Grouped-query heads are folded into the query length (the
G query heads sharing a key/value head become G x T queries of it), so keys and values are never
repeated. One session: its keys/values are views of its buffer (no copy), with a causal mask only
when it feeds more than one token. Several sessions: their keys/values are concatenated and a
block mask (each row sees its own session's prefix and its own fed tokens up to itself) keeps
the sessions apart.

SDPA's kernels (flash on CPU, memory-efficient on CUDA) never hold the [T, S] scores, but the mask
is [G x T, S] (and SDPA converts it to a float bias of that size): one session's long prefill
attends over blocks of query rows (``query_block_rows``), each with its own mask, so that memory
stays bounded as in ``NumpyPass``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.lean.kv import LeanKV
from specdec.lean.matmul import BUCKETS, Linear, MatmulPlan
from specdec.lean.numpy_pass import NumpyPass, query_block_rows
from specdec.lean.static import SlotPool, StaticPasses
from specdec.lean.weights import LeanWeights

log = logging.getLogger(__name__)

TIMED_BYTES = 96 << 20  # the load-time backend table times this much of the layers' weights (plus the head)


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
        self.groups = weights.heads // weights.kv_heads
        self.scaling = weights.head_dim ** -0.5
        self.layers = [(layer, Linear(layer.qkv), Linear(layer.o), Linear(layer.gate_up), Linear(layer.down))
                       for layer in weights.layers]
        self.head = Linear(weights.head)
        self.head_ids: torch.Tensor | None = None
        linears = [linear for entry in self.layers for linear in entry[1:]] + [self.head]
        self.plan = MatmulPlan(linears, self.device, backend=backend, buckets=buckets, reps=reps,
                               timed=self._timed_subset(timed_bytes), table_dir=table_dir)
        self._inv_freq = weights.inv_freq.to(self.device)
        # On CPU a single session's pass keeps its activations in numpy (numpy_pass: per-op cost).
        self.numpy_pass = (NumpyPass(weights, self.layers, self.head)
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
        """The first layers whose weights pass ``timed_bytes`` (far past any cache), plus the head."""
        if timed_bytes is None:
            return None
        timed, size = [], 0
        for entry in self.layers:
            if size >= timed_bytes:
                break
            timed.extend(entry[1:])
            size += sum(linear.weight.numel() * linear.weight.element_size() for linear in entry[1:])
        return timed + [self.head]

    @property
    def logits_width(self) -> int:
        return int(self.w.head.shape[0])

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

    def restrict_head(self, token_ids: torch.Tensor) -> None:
        """FR-Spec: logits only for ``token_ids`` (sorted); every other id gets -inf."""
        self.head_ids = token_ids.to(self.device)
        self.head = Linear(self.w.head[self.head_ids].contiguous())
        self.plan.prepare(self.head)
        if self.static is not None:
            self.static.forget_graphs()  # they read the old head
        if self.numpy_pass is not None:
            self.numpy_pass.head = self.head

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
        freqs = positions[:, None].float() * self._inv_freq[None]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # [T, 1, head_dim / 2]
        if w.rope_scale != 1.0:
            cos, sin = cos * w.rope_scale, sin * w.rope_scale
        # RoPE as x * [cos, cos] + [second half, first half] * [-sin, sin]: three ops per layer.
        cos, sin = torch.cat((cos, cos), dim=-1).to(self.dtype), torch.cat((-sin, sin), dim=-1).to(self.dtype)
        block = self._query_block(pasts, fed)
        mask = self._mask(pasts, fed, starts) if block is None else None
        backend = self.plan.backend(total)
        with self.plan.regime(backend):
            x = F.embedding(ids, w.embed)
            for index, (layer, qkv_w, o_w, gate_up_w, down_w) in enumerate(self.layers):
                h = F.rms_norm(x, (w.hidden,), layer.input_norm, w.eps)
                qkv = backend.mm(h, qkv_w.handles[backend.name])
                if layer.qkv_bias is not None:
                    qkv = qkv + layer.qkv_bias
                attn = self._attention(qkv, cos, sin, mask, kvs, pasts, fed, starts, block, index)
                x = x + backend.mm(attn, o_w.handles[backend.name])
                h = F.rms_norm(x, (w.hidden,), layer.post_norm, w.eps)
                gate_up = backend.mm(h, gate_up_w.handles[backend.name])
                act = F.silu(gate_up[:, : w.intermediate]).mul_(gate_up[:, w.intermediate :])
                x = x + backend.mm(act, down_w.handles[backend.name])
            if self.feature_sink is not None:
                self.feature_sink(x.float().cpu())
            rows = x[torch.tensor(keep, device=device)] if len(keep) < total else x
            h = F.rms_norm(rows, (w.hidden,), w.final_norm, w.eps)
            logits = backend.mm(h, self.head.handles[backend.name]).float()
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
        """Logits over the whole vocabulary: a reduced head's rows in place, -inf elsewhere."""
        if self.head_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.logits_width), -torch.inf, device=logits.device)
        full[:, self.head_ids] = logits
        return full

    def _query_block(self, pasts, fed) -> int | None:
        """Query rows per attention block of a single session whose mask (bool, then SDPA's float bias)
        would pass the budget; None: the pass attends in one call."""
        if len(fed) > 1:
            return None
        rows = query_block_rows(self.groups, pasts[0] + fed[0], entry_bytes=1 + self.dtype.itemsize)
        return rows if rows < fed[0] else None

    def _mask(self, pasts, fed, starts) -> torch.Tensor | None:
        """Bool [G * T, S] (True: attend), rows ordered (group, token); None when every row sees
        every key (one session feeding one token)."""
        total = sum(fed)
        if len(fed) == 1:
            return self._causal_mask(pasts[0], 0, fed[0])
        mask = torch.zeros((total, sum(pasts) + total), dtype=torch.bool, device=self.device)
        column = 0
        for p, n, start in zip(pasts, fed, starts):
            mask[start : start + n, column : column + p + n] = torch.ones(
                (n, p + n), dtype=torch.bool, device=self.device).tril(p)
            column += p + n
        return mask.repeat(self.groups, 1) if self.groups > 1 else mask

    def _causal_mask(self, past: int, first: int, end: int) -> torch.Tensor | None:
        """Bool [G * (end - first), past + end]: one session's fed rows first .. end - 1, row t seeing
        positions up to past + t; None for one row, which sees them all."""
        if end - first == 1:
            return None
        mask = torch.ones((end - first, past + end), dtype=torch.bool, device=self.device).tril(past + first)
        return mask.repeat(self.groups, 1) if self.groups > 1 else mask

    def _attention(self, qkv, cos, sin, mask, kvs, pasts, fed, starts, block: int | None, index: int) -> torch.Tensor:
        w = self.w
        total, dim, kv_heads = qkv.shape[0], w.head_dim, w.kv_heads
        q_and_k = qkv[:, : w.q_width + w.kv_width].view(total, w.heads + kv_heads, dim)
        half = dim // 2
        swapped = torch.cat((q_and_k[..., half:], q_and_k[..., :half]), dim=-1)
        rotated = torch.addcmul(q_and_k * cos, swapped, sin)
        q, k = rotated[:, : w.heads], rotated[:, w.heads :]
        v = qkv[:, w.q_width + w.kv_width :].view(total, kv_heads, dim)
        keys, values = [], []
        for kv, p, n, start in zip(kvs, pasts, fed, starts):
            kv.keys[index, :, p : p + n] = k[start : start + n].transpose(0, 1)
            kv.values[index, :, p : p + n] = v[start : start + n].transpose(0, 1)
            keys.append(kv.keys[index, :, : p + n])
            values.append(kv.values[index, :, : p + n])
        if len(kvs) == 1:
            key, value = keys[0], values[0]
        else:
            key, value = torch.cat(keys, dim=1), torch.cat(values, dim=1)
        if block is None:
            return self._attend(q, key, value, mask)
        past = pasts[0]  # one session's long pass: a block's rows see no position past its last row's
        return torch.cat([self._attend(q[first:end], key[:, : past + end], value[:, : past + end],
                                       self._causal_mask(past, first, end))
                          for first, end in ((f, min(f + block, total)) for f in range(0, total, block))])

    def _attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One SDPA call: rows ``q`` [rows, heads, dim] over ``key``/``value`` [kv_heads, S, dim]: [rows, q_width]."""
        w = self.w
        rows, dim, kv_heads, groups = q.shape[0], w.head_dim, w.kv_heads, self.groups
        # Query head j * G + g shares key/value head j: fold the G heads into the query length.
        query = q.reshape(rows, kv_heads, groups, dim).permute(1, 2, 0, 3).reshape(kv_heads, groups * rows, dim)
        out = F.scaled_dot_product_attention(query[None], key[None], value[None], attn_mask=mask, scale=self.scaling)
        return out[0].view(kv_heads, groups, rows, dim).permute(2, 0, 1, 3).reshape(rows, w.q_width)
