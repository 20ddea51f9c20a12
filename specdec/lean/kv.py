"""One session's KV cache in the lean runtime: every layer's keys and values in one buffer.

``keys`` / ``values`` are [layers, kv_heads, capacity, head_dim]; positions ``0..length`` are the
session's. A forward writes its new positions past ``length`` and moves ``length`` only once the
whole pass has succeeded, so a pass that fails part-way leaves the session where it was; rolling
back to an earlier prefix is setting ``length`` (O(1)). Capacity grows by doubling (amortised
O(1) per token; nothing is copied per step).
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64


class _LayerView:
    """What callers that walk ``cache.layers`` (transformers' cache shape) see of one layer."""

    __slots__ = ("kv", "index")

    def __init__(self, kv: LeanKV, index: int) -> None:
        self.kv, self.index = kv, index

    def get_seq_length(self) -> int:
        return self.kv.length

    def crop(self, tokens_to_remove: int) -> None:
        self.kv.crop(tokens_to_remove)


class LeanKV:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 0, max_capacity: int | None = None) -> None:
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        if capacity:
            self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` positions (keeping the first ``length``)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, MIN_CAPACITY)
        if self.max_capacity is not None:
            capacity = max(needed, min(capacity, self.max_capacity))
        layers, heads, dim = self.shape
        keys = torch.empty((layers, heads, capacity, dim), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        if self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' semantics: negative drops that many trailing positions, non-negative keeps that many."""
        keep = self.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        self.length = max(0, min(self.length, keep))

    def reset(self) -> None:
        self.length = 0

    @property
    def layers(self) -> list[_LayerView]:
        return [_LayerView(self, index) for index in range(self.shape[0])]
