"""One session's pass with every op but the products in numpy: the lean runtime's CPU hot path.

At one stream every pass is one session's: a one-token decode step or a verify pass of a few tokens.
Around the products such a pass runs ~30 small ops per layer (norms, RoPE, the KV write,
attention, activation, residuals). Through torch most of their cost is per-op dispatch (more at
two threads, where each op may wake the OpenMP pool); numpy's ufuncs on a few hidden-wide rows
cost about a microsecond each (docs/benchmarks.md). So a single-session pass on CPU runs the one
layer body (``specdec.lean.layer``) with numpy's array ops and hands only the products to the
backend the load-time table picked for its row count (numpy's BLAS directly; torch's MKL or oneDNN
on zero-copy tensors). The KV buffers are the session's ``LeanKV`` tensors seen through
``Tensor.numpy()`` (same memory), so this pass and the torch forward (several sessions in one
pass, or a GPU) read and write the same cache.

Only the rounding differs from the torch forward, as between any two BLAS (tests hold both forwards
to transformers' logits within 1e-4). Attention runs over blocks of query rows
(``specdec.lean.attention.query_block_rows``), so a long prefill needs memory linear in its length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.lean import attention
from specdec.lean.kv import LeanKV
from specdec.lean.layer import NUMPY, BoundLayers, LayerShape, decoder_layer, rope_tables
from specdec.lean.matmul import Backend
from specdec.lean.weights import LeanWeights


class NumpyPass:
    """``run(kv, tokens, num_logits, backend)``: feed ``tokens`` after what ``kv`` holds; fp32
    logits [num_logits, LM head rows] (numpy) for the last ``num_logits`` of them.

    Holds numpy views (no copy) of the norms and the embedding, and the forward's ``Linear``s, whose
    handles the backend multiplies by. ``kv.length`` moves only after the whole pass."""

    def __init__(self, weights: LeanWeights, layers, lm_head) -> None:
        """``layers``: the forward's (LayerWeights, qkv, o, gate_up, down) entries; ``lm_head``: its LM head ``Linear``."""
        w = weights
        self.shape = LayerShape.of(w)
        self.kernel = attention.NumpyKernel(w.head_dim ** -0.5)
        self.embed = w.embed.numpy()
        self.final_norm = w.final_norm.numpy()
        self.bound_layers = BoundLayers(layers, NUMPY)
        self.lm_head = lm_head
        self.inv_freq = w.inv_freq.float().numpy()
        self.rope_scale = w.rope_scale

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
        cos, sin = rope_tables(np.arange(past, total, dtype=np.float32), self.inv_freq, self.rope_scale, NUMPY)
        cos, sin = cos[:, None], sin[:, None]
        shape, kernel = self.shape, self.kernel
        block = attention.query_block_rows(shape.heads, total, kernel.entry_bytes)
        # A pass of one block (decode steps and verify passes, as a rule) builds its causal bias once.
        mask = kernel.causal(past, 0, count) if block >= count else None
        mm, name = backend.mm_numpy, backend.name
        params = self.bound_layers(name)
        attend_session, heads = attention.attend_session, shape.heads
        x = self.embed[ids]
        for index, p in enumerate(params):
            layer_keys, layer_values = keys[index], values[index]

            def attend(q_and_k, v):
                return attend_session(q_and_k, v, layer_keys, layer_values, past, heads, kernel, NUMPY, block, mask)

            x = decoder_layer(x, p, shape, mm, attend, cos, sin, NUMPY)
        if feature_sink is not None:
            feature_sink(torch.from_numpy(x.copy()))
        logits = mm(NUMPY.rms_norm(x[count - num_logits :], self.final_norm, shape.eps), self.lm_head.handles[name])
        kv.length = total
        return logits
