"""One Llama decoder layer, written once: the body every forward of the house runs.

``decoder_layer`` is RMSNorm -> fused QKV product (+ bias) -> RoPE on q and k together -> attention
-> O product -> residual -> RMSNorm -> fused gate/up product -> SiLU * up -> down product ->
residual, over rows ``x`` [..., hidden]. It is built from three kinds of operation that a caller
binds once per pass:

- ``mm(x, weight)``: ``x @ W.T`` through the product backend the load-time table picked for the
  pass's row count (``specdec.lean.matmul``; the EAGLE head's layer: its ``nn.Linear`` modules);
- ``attend(q_and_k, v)``: the attention of one cache layout (``specdec.lean.attention``), which
  also writes the new keys/values wherever that layout keeps them;
- ``xp``: the array module's few ops that numpy and torch spell differently (``TORCH``, ``NUMPY``).

RoPE is one formula (``rope_tables`` + ``apply_rope``): x * [cos, cos] + [x2, x1] * [-sin, sin].

Which forward runs when (``LeanModel.forward`` decides; every row runs this body):

====================================  ==========  ==================================================
pass                                  array ops   attention (``specdec.lean.attention``)
====================================  ==========  ==================================================
one session, CPU fp32                 NUMPY       ``attend_session`` + ``NumpyKernel`` (query blocks)
one session, GPU or no numpy pass     TORCH       ``attend_session`` + ``SdpaKernel`` (query blocks)
several sessions (eager)              TORCH       ``attend_ragged`` + ``SdpaKernel`` (block mask)
sessions in a slot pool, fits bucket  TORCH       ``attend_slots`` (SDPA on GPU, written out on CPU);
  (``--static-kv on``)                            CUDA graphs on a GPU
EAGLE head, drafting                  TORCH       ``HeadCache`` + ``specdec.eagle.head.attention``
EAGLE head, training (unroll)         TORCH       ``attention`` with the diagonal chain keys
====================================  ==========  ==================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    """The sizes a layer body reads (q width = heads x head_dim, and so on)."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def of(cls, weights) -> LayerShape:
        """Of a ``LeanWeights``."""
        return cls(weights.heads, weights.kv_heads, weights.head_dim, weights.intermediate, weights.eps)


class LayerParams(NamedTuple):
    """One layer's tensors as a body reads them: norms and bias as arrays of the pass's module, the
    products as whatever its ``mm`` takes (a backend handle, a module)."""

    input_norm: object
    qkv: object
    qkv_bias: object | None
    o: object
    post_norm: object
    gate_up: object
    down: object


class ArrayOps(NamedTuple):
    """What a body needs of its array module beyond the operators numpy and torch share."""

    name: str
    cat: Callable  # cat(parts, axis)
    permute: Callable  # permute(x, axes)
    cos: Callable
    sin: Callable
    mul_add: Callable  # mul_add(a, b, c) = a + b * c (b may be overwritten)
    rms_norm: Callable  # rms_norm(x, weight, eps): transformers' order (normalise, then the weight)
    silu_mul: Callable  # silu_mul(gate_up, split) = silu(gate_up[..., :split]) * gate_up[..., split:]


# The numpy ops reuse their temporaries (out=, in place): at a few rows an allocation costs as much
# as the arithmetic. The order of the arithmetic is the formula's, so the rounding is the same.
def _numpy_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    # Rows [n, hidden] (the numpy pass's only shape): einsum's two-index form parses fastest.
    mean_square = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    out = x * (np.float32(1.0) / np.sqrt(mean_square + np.float32(eps)))
    out *= weight
    return out


def _numpy_mul_add(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    b *= c  # b is apply_rope's fresh swapped copy: reused, not reallocated
    b += a
    return b


def _numpy_silu_mul(gate_up: np.ndarray, split: int) -> np.ndarray:
    gate = gate_up[..., :split]
    out = np.negative(gate)
    np.exp(out, out=out)
    out += np.float32(1.0)
    np.divide(gate, out, out=out)
    out *= gate_up[..., split:]
    return out


# permute through the methods: numpy's np.transpose function wraps the method (~0.5 us a call).
NUMPY = ArrayOps("numpy", np.concatenate, np.ndarray.transpose, np.cos, np.sin, _numpy_mul_add, _numpy_rms_norm,
                 _numpy_silu_mul)
TORCH = ArrayOps(
    "torch", torch.cat, torch.Tensor.permute, torch.cos, torch.sin, torch.addcmul,
    lambda x, weight, eps: F.rms_norm(x, (x.shape[-1],), weight, eps),
    lambda gate_up, split: F.silu(gate_up[..., :split]) * gate_up[..., split:],
)


def rope_tables(positions, inv_freq, rope_scale: float, xp: ArrayOps = TORCH):
    """(cos, signed sin), each [len(positions), head_dim] in fp32: ``apply_rope``'s tables for
    ``positions`` (fp32) from ``inv_freq`` [head_dim / 2] and transformers' ``attention_scaling``."""
    angles = positions[:, None] * inv_freq[None]
    cos, sin = xp.cos(angles), xp.sin(angles)
    if rope_scale != 1.0:
        cos, sin = cos * rope_scale, sin * rope_scale
    return xp.cat((cos, cos), -1), xp.cat((-sin, sin), -1)


def apply_rope(x, cos, sin, xp: ArrayOps = TORCH):
    """RoPE on ``x`` [..., head_dim]: x * [cos, cos] + [second half, first half] * [-sin, sin]."""
    half = x.shape[-1] // 2
    return xp.mul_add(x * cos, xp.cat((x[..., half:], x[..., :half]), -1), sin)


def decoder_layer(x, p: LayerParams, shape: LayerShape, mm: Callable, attend: Callable, cos, sin,
                  xp: ArrayOps = TORCH):
    """One Llama decoder layer over rows ``x`` [..., hidden]; ``cos``/``sin`` broadcast against
    [..., heads, head_dim] (``rope_tables``); ``attend(q_and_k, v)`` gets the rotated queries and
    keys [..., heads + kv_heads, head_dim] and the values [..., kv_heads, head_dim] and returns
    [..., heads x head_dim]."""
    qkv = mm(xp.rms_norm(x, p.input_norm, shape.eps), p.qkv)
    if p.qkv_bias is not None:
        qkv = qkv + p.qkv_bias
    lead, dim = qkv.shape[:-1], shape.head_dim
    split = (shape.heads + shape.kv_heads) * dim
    q_and_k = apply_rope(qkv[..., :split].reshape(*lead, shape.heads + shape.kv_heads, dim), cos, sin, xp)
    x = x + mm(attend(q_and_k, qkv[..., split:].reshape(*lead, shape.kv_heads, dim)), p.o)
    gate_up = mm(xp.rms_norm(x, p.post_norm, shape.eps), p.gate_up)
    return x + mm(xp.silu_mul(gate_up, shape.intermediate), p.down)


class BoundLayers:
    """``bound(backend_name)``: a lean model's layers as ``LayerParams`` for that backend, bound at its
    first pass and kept (the plan's handles are fixed once it is made)."""

    def __init__(self, layers, xp: ArrayOps) -> None:
        self.layers, self.xp = layers, xp
        self._by_backend: dict[str, list[LayerParams]] = {}

    def __call__(self, backend_name: str) -> list[LayerParams]:
        params = self._by_backend.get(backend_name)
        if params is None:
            params = self._by_backend[backend_name] = bind_layers(self.layers, backend_name, self.xp)
        return params


def bind_layers(layers, backend_name: str, xp: ArrayOps) -> list[LayerParams]:
    """``LayerParams`` for a lean model's ``(LayerWeights, qkv, o, gate_up, down)`` entries: the
    ``Linear``s' handles for one backend, norms and bias as ``xp``'s arrays (numpy: views, no copy)."""
    array = (lambda t: t.numpy()) if xp is NUMPY else (lambda t: t)
    return [LayerParams(array(layer.input_norm), qkv.handles[backend_name],
                        None if layer.qkv_bias is None else array(layer.qkv_bias), o.handles[backend_name],
                        array(layer.post_norm), gate_up.handles[backend_name], down.handles[backend_name])
            for layer, qkv, o, gate_up, down in layers]
