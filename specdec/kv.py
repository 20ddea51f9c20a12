"""KV-cached sessions with rollback to an accepted prefix."""

from __future__ import annotations

import torch

from specdec.models import LoadedModel


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVSession:
    """One sequence's KV cache on one model.

    The cache always holds the keys/values of ``cached_tokens``. A forward over a new token list
    first rolls the cache back to the longest prefix it shares with that list, so the accepted
    prefix is never recomputed and rejected drafts are dropped: after a verification only the
    recovered/bonus token (plus new drafts) is fed.
    """

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.cache = lm.new_cache()
        self.cached_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.cached_tokens)

    def rollback(self, length: int) -> None:
        """Drop cached positions at and after ``length``."""
        excess = len(self.cached_tokens) - length
        if excess > 0:
            self.cache.crop(-excess)
            del self.cached_tokens[length:]

    def prepare(self, tokens: list[int], num_logits: int) -> list[int]:
        """Roll back to the prefix ``tokens`` shares with the cache (leaving ``num_logits`` positions
        to compute) and return the tokens still to feed."""
        if not 1 <= num_logits <= len(tokens):
            raise ValueError("num_logits must be between 1 and len(tokens)")
        keep = min(common_prefix_length(self.cached_tokens, tokens), len(tokens) - num_logits)
        self.rollback(keep)
        return tokens[keep:]

    def forward(self, tokens: list[int], num_logits: int = 1) -> torch.Tensor:
        """Logits (fp32, [num_logits, V]) for the last ``num_logits`` positions of ``tokens``."""
        logits = self.lm.forward(self.prepare(tokens, num_logits), self.cache, num_logits)
        self.cached_tokens = list(tokens)
        return logits

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, the cached (keys, values) [1, heads, len, head_dim], or None while empty."""
        return [(layer.keys, layer.values) if layer.is_initialized and layer.keys.numel() else None
                for layer in self.cache.layers]

    def adopt(self, states: list[tuple[torch.Tensor, torch.Tensor]], tokens: list[int]) -> None:
        """Replace the cache with ``states`` (per layer keys/values computed elsewhere, e.g. by a
        batched forward), which hold exactly ``tokens``."""
        for layer, (keys, values) in zip(self.cache.layers, states, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        self.cached_tokens = list(tokens)

    def close(self) -> None:
        self.cache = None
        self.cached_tokens = []
