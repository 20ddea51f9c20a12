"""KV-cached sessions with rollback to an accepted prefix."""

from __future__ import annotations

import torch

from specdec.gguf.runtime import GgufKV
from specdec.lean.kv import LeanKV
from specdec.lm import PACKED_CACHES, LoadedModel


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _growing_layer_base():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class GrowingKVLayer(_growing_layer_base()):
    """One layer's keys/values for one sequence, in buffers that grow by doubling.

    Appending writes in place and rolling back only moves the length, so a decoding step copies
    its new keys/values only (transformers' ``DynamicLayer`` concatenates, copying the whole cache
    every step). ``keys`` / ``values`` are views of the first ``length`` positions.
    """

    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self.length = 0

    def _reserve(self, needed: int, like: torch.Tensor) -> None:
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[2]
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 64)
        rows, heads, _, dim = like.shape
        keys = like.new_empty((rows, heads, capacity, dim))
        values = like.new_empty((rows, heads, capacity, dim))
        if self.length:
            keys[:, :, : self.length] = self._key_buffer[:, :, : self.length]
            values[:, :, : self.length] = self._value_buffer[:, :, : self.length]
        self._key_buffer, self._value_buffer = keys, values
        self.device = like.device
        self.is_initialized = True

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        self._reserve(end, key_states)
        self._key_buffer[:, :, self.length : end] = key_states
        self._value_buffer[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many trailing positions; non-negative (legacy): keep that many."""
        keep = self.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        if self._key_buffer is not None:
            self._set_length(max(0, min(self.length, keep)))

    def reset(self) -> None:
        if self._key_buffer is not None:
            self._set_length(0)


def new_session_cache(lm: LoadedModel):
    """A KV cache for one sequence: the lean (gguf) runtime's ``LeanKV`` (``GgufKV``) where the model
    runs on it; else ``GrowingKVLayer``s where the model's layers are plain (full-attention) ones,
    transformers' own cache otherwise (sliding windows, linear attention)."""
    if lm.packed_runtime is not None:
        return lm.new_cache()
    from transformers.cache_utils import DynamicLayer


    cache = lm.new_cache()
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingKVLayer() for _ in cache.layers]
    return cache


class KVSession:
    """One sequence's KV cache on one model.

    The cache always holds the keys/values of ``cached_tokens``. A forward over a new token list
    first rolls the cache back to the longest prefix it shares with that list, so the accepted
    prefix is never recomputed and rejected drafts are dropped: after a verification only the
    recovered/bonus token (plus new drafts) is fed.

    Work per forward does not grow with the context: a caller says how many leading tokens of
    its list are committed (``committed``: they never change, so the next forward need not
    compare them), the prefix is compared only from the last forward's committed length on (the
    drafts and tokens committed since), and ``cached_tokens`` changes only at its tail.
    """

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.cache = new_session_cache(lm)
        self.cached_tokens: list[int] = []
        self.committed = 0  # leading cached tokens that are committed (equal in every later token list)
        self.last_fed = 0  # tokens the last successful pass fed (the rest of its list was cached)

    def __len__(self) -> int:
        return len(self.cached_tokens)

    def rollback(self, length: int) -> None:
        """Drop cached positions at and after ``length``."""
        excess = len(self.cached_tokens) - length
        if excess > 0:
            self.cache.crop(-excess)
            del self.cached_tokens[length:]
        self.committed = min(self.committed, length)

    def rollback_to(self, length: int) -> None:
        """Make cache and ``cached_tokens`` agree on the first ``length`` positions (after a failed
        pass, which may have grown some layers and not others)."""
        if self.packed_cache is not None:  # a failed pass never moved the length; a rollback may
            self.cache.crop(min(self.cache.length, length))
        else:
            for layer in self.cache.layers if self.cache is not None else ():
                if isinstance(layer, GrowingKVLayer):
                    layer.crop(min(layer.length, length))
                elif hasattr(layer, "get_seq_length") and layer.get_seq_length() > length:
                    layer.crop(length - layer.get_seq_length())  # transformers' layers: drop that many
        del self.cached_tokens[length:]
        self.committed = min(self.committed, length)

    def prepare(self, tokens: list[int], num_logits: int) -> list[int]:
        """Roll back to the prefix ``tokens`` shares with the cache (leaving ``num_logits`` positions
        to compute) and return the tokens still to feed."""
        if not 1 <= num_logits <= len(tokens):
            raise ValueError("num_logits must be between 1 and len(tokens)")
        limit = len(tokens) - num_logits
        start = min(self.committed, len(self.cached_tokens), limit)  # tokens[:start] are the cache's
        keep = start + common_prefix_length(self.cached_tokens[start:limit], tokens[start:limit])
        self.rollback(keep)
        return tokens[keep:]

    def fed(self, feed: list[int], committed: int) -> None:
        """After a successful pass over ``feed``: the cache holds it too; ``committed`` leading
        tokens of the pass's token list are committed (see the class docstring)."""
        self.cached_tokens.extend(feed)
        self.last_fed = len(feed)
        self.committed = min(committed, len(self.cached_tokens))

    def forward(self, tokens: list[int], num_logits: int = 1, committed: int = 0, on_device: bool = False) -> torch.Tensor:
        """Logits (fp32, [num_logits, V]; on the host, or where the model runs when ``on_device``) for
        the last ``num_logits`` positions of ``tokens``, whose first ``committed`` tokens are committed
        (0: nothing is promised; the whole prefix is compared).

        A forward that fails part-way (some layers grew, others not) leaves the cache where it was
        before the new tokens, as a failed batched pass does."""
        feed = self.prepare(tokens, num_logits)
        kept = len(self.cached_tokens)
        try:
            logits = self.lm.forward(feed, self.cache, num_logits, on_device)
        except BaseException:
            self.rollback_to(kept)
            raise
        self.fed(feed, committed)
        return logits

    @property
    def packed_cache(self) -> LeanKV | GgufKV | None:
        """The cache when it is the lean or gguf runtime's (batched passes run that runtime's
        ``forward``), else None."""
        return self.cache if isinstance(self.cache, PACKED_CACHES) else None

    @property
    def growing_layers(self) -> list[GrowingKVLayer] | None:
        """The cache's layers when they are ``GrowingKVLayer``s (what batched passes need), else None."""
        layers = self.cache.layers
        return layers if layers and all(isinstance(layer, GrowingKVLayer) for layer in layers) else None

    def close(self) -> None:
        if isinstance(self.cache, GgufKV):  # its sequence goes back to the model's context
            self.cache.release()
        self.cache = None
        self.cached_tokens = []
        self.committed = 0
