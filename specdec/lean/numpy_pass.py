"""One session's pass with every op but the products in numpy: the lean runtime's CPU hot path.

At one stream every pass is one session's: a one-token decode step or a verify pass of a few tokens.
Around the products such a pass runs ~30 small ops per layer (norms, RoPE, the KV write,
attention, activation, residuals). Through torch they took 3-4.5 ms of a 16 ms one-token step
(~100 us a layer, most of it per-op dispatch; more at two threads, where each op may wake the
OpenMP pool); numpy's ufuncs on a few 576-wide rows cost ~1-2 us each (docs/benchmarks.md). So a
single-session pass on CPU keeps its activations in numpy and hands only the products to the
backend the load-time table picked for its row count (numpy's BLAS directly; torch's MKL or oneDNN
on zero-copy tensors). The KV buffers are the session's ``LeanKV`` tensors seen through
``Tensor.numpy()`` (same memory), so this pass and the torch forward (several sessions in one
pass, or a GPU) read and write the same cache.

The math is the torch forward's (``specdec.lean.forward``): RMSNorm, fused QKV, RoPE as one product
with each position's rotation matrix, grouped-query attention with the G query heads of a key/value
head stacked and a causal bias when several tokens are fed, softmax, fused gate/up, SiLU * up, down,
the final norm and the head over only the rows whose logits are wanted. Only the rounding differs,
as between any two BLAS (tests hold both forwards to transformers' logits within 1e-4).

Attention runs over blocks of query rows (``query_block_rows``): a block's scores, every head's,
stay under ``SCORE_BYTES`` however long the pass, so a long prefill needs memory linear in its
length, not quadratic. Decode steps and verify passes stay one block (64 MiB holds 16 rows of 32
heads over 32 k keys).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.lean.kv import LeanKV
from specdec.lean.matmul import Backend
from specdec.lean.weights import LeanWeights

SCORE_BYTES = 64 << 20  # one attention block's scores (all heads) stay under this, however long the pass


def query_block_rows(heads: int, keys: int, entry_bytes: int = 4) -> int:
    """Query rows per attention block: ``heads`` x rows x ``keys`` entries of ``entry_bytes`` each
    within ``SCORE_BYTES`` (one row at least)."""
    return max(1, SCORE_BYTES // (heads * keys * entry_bytes))


class NumpyPass:
    """``run(kv, tokens, num_logits, backend)``: feed ``tokens`` after what ``kv`` holds; fp32
    logits [num_logits, head rows] (numpy) for the last ``num_logits`` of them.

    Holds numpy views (no copy) of the norms and the embedding, and the forward's ``Linear``s, whose
    handles the backend multiplies by. ``kv.length`` moves only after the whole pass."""

    def __init__(self, weights: LeanWeights, layers, head) -> None:
        """``layers``: the forward's (LayerWeights, qkv, o, gate_up, down) entries; ``head``: its head ``Linear``."""
        w = weights
        self.hidden, self.eps = w.hidden, w.eps
        self.heads, self.kv_heads, self.dim = w.heads, w.kv_heads, w.head_dim
        self.groups = w.heads // w.kv_heads
        self.scale = np.float32(w.head_dim ** -0.5)
        self.q_width, self.kv_width, self.intermediate = w.q_width, w.kv_width, w.intermediate
        self.embed = w.embed.numpy()
        self.final_norm = w.final_norm.numpy()
        self.layers = [(layer.input_norm.numpy(), qkv, None if layer.qkv_bias is None else layer.qkv_bias.numpy(),
                        o, layer.post_norm.numpy(), gate_up, down)
                       for layer, qkv, o, gate_up, down in layers]
        self.head = head
        self.inv_freq = w.inv_freq.float().numpy()
        self.rope_scale = np.float32(w.rope_scale)

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        # transformers' order: x * rsqrt(mean(x^2) + eps), then the weight.
        mean_square = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(self.hidden)
        return x * (np.float32(1.0) / np.sqrt(mean_square + np.float32(self.eps))) * weight

    def _rotations(self, past: int, count: int) -> np.ndarray:
        """[count, dim, dim]: a row vector times the t-th is RoPE at position ``past + t``
        (x * [cos, cos] + rotate_half(x) * [sin, sin])."""
        half = self.dim // 2
        positions = np.arange(past, past + count, dtype=np.float32)
        angles = positions[:, None] * self.inv_freq[None]  # fp32, as the torch forward's
        cos, sin = np.cos(angles), np.sin(angles)
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        rotation = np.zeros((count, self.dim, self.dim), dtype=np.float32)
        index = np.arange(half)
        rotation[:, index, index] = cos
        rotation[:, index + half, index + half] = cos
        rotation[:, index + half, index] = -sin  # out[j] gets -x[j + half] * sin[j] (j < half)
        rotation[:, index, index + half] = sin  # out[j + half] gets x[j] * sin[j]
        return rotation

    def run(self, kv: LeanKV, tokens: Sequence[int], num_logits: int, backend: Backend,
            feature_sink: Callable[[torch.Tensor], None] | None = None) -> np.ndarray:
        """Logits [num_logits, V] of the last positions fed; ``feature_sink`` gets every fed position's
        final-norm input [count, H] (``LeanModel.feature_sink``)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= len(self.embed):  # numpy would wrap a negative index round
            raise IndexError(f"a token id is out of range for a vocabulary of {len(self.embed)}")
        past, count = kv.length, len(ids)
        total = past + count
        kv.reserve(total)
        keys, values = kv.keys.numpy(), kv.values.numpy()
        rotation = self._rotations(past, count)
        heads, kv_heads, dim, groups = self.heads, self.kv_heads, self.dim, self.groups
        block = query_block_rows(heads, total)
        # A pass of one block (decode steps and verify passes, as a rule) builds its causal bias once.
        bias = self._causal_bias(past, 0, count) if block >= count else None
        split_q, split_v = self.q_width + self.kv_width, self.intermediate
        mm, name = backend.mm_numpy, backend.name
        x = self.embed[ids]
        for index, (input_norm, qkv_w, qkv_bias, o_w, post_norm, gate_up_w, down_w) in enumerate(self.layers):
            qkv = mm(self._norm(x, input_norm), qkv_w.handles[name])
            if qkv_bias is not None:
                qkv = qkv + qkv_bias
            rotated = np.matmul(qkv[:, :split_q].reshape(count, heads + kv_heads, dim), rotation)
            keys[index, :, past:total] = rotated[:, heads:].transpose(1, 0, 2)
            values[index, :, past:total] = qkv[:, split_q:].reshape(count, kv_heads, dim).transpose(1, 0, 2)
            # [kv_heads, groups, count, dim] queries against [kv_heads, 1, dim, total] keys.
            query = rotated[:, :heads].reshape(count, kv_heads, groups, dim).transpose(1, 2, 0, 3)
            if block >= count:
                attended = self._attend(query, keys[index], values[index], total, bias)
            else:  # a block's rows see no position past its last row's
                attended = np.concatenate(
                    [self._attend(query[:, :, first:end], keys[index], values[index], past + end,
                                  self._causal_bias(past, first, end))
                     for first, end in ((f, min(f + block, count)) for f in range(0, count, block))], axis=2)
            x = x + mm(np.ascontiguousarray(attended.transpose(2, 0, 1, 3)).reshape(count, self.q_width),
                       o_w.handles[name])
            gate_up = mm(self._norm(x, post_norm), gate_up_w.handles[name])
            gate = gate_up[:, :split_v]
            act = gate / (np.float32(1.0) + np.exp(-gate)) * gate_up[:, split_v:]
            x = x + mm(act, down_w.handles[name])
        if feature_sink is not None:
            feature_sink(torch.from_numpy(x.copy()))
        logits = mm(self._norm(x[count - num_logits :], self.final_norm), self.head.handles[name])
        kv.length = total
        return logits

    @staticmethod
    def _causal_bias(past: int, first: int, end: int) -> np.ndarray | None:
        """[end - first, past + end]: fed row t (first <= t < end) sees positions up to past + t. None
        for one row, which sees them all."""
        if end - first == 1:
            return None
        return np.triu(np.full((end - first, past + end), -np.inf, dtype=np.float32), past + first + 1)

    def _attend(self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, seen: int,
                bias: np.ndarray | None) -> np.ndarray:
        """Softmax attention of ``query`` [kv_heads, groups, rows, dim] over the first ``seen`` positions of
        one layer's ``keys`` and ``values`` [kv_heads, capacity, dim]: [kv_heads, groups, rows, dim]."""
        scores = np.matmul(query, keys[:, None, :seen].transpose(0, 1, 3, 2))
        scores *= self.scale
        if bias is not None:
            scores += bias
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return np.matmul(scores, values[:, None, :seen])
