"""The ragged batched forward: one forward pass over several sessions' new tokens.

Each session keeps its own KV cache (``KVSession`` with ``GrowingKVLayer``s). A batched pass feeds
every session's new tokens, packed into one sequence, at that session's own positions; all the
matrix products (projections, MLP, LM head) run once over exactly the tokens fed, while attention
runs per row over that session's own cache, which grows in place: nothing is padded, and nothing
is copied per pass beyond the new tokens. The logits of a row equal (up to floating-point
rounding of a differently shaped matrix product) what the session's own ``KVSession.forward``
returns; tokens, acceptance and sampling stay per session and position-keyed, so batching changes
no output distribution.

Here: the attention (``specdec_ragged_sdpa``, registered with transformers' ``AttentionInterface``;
the loader switches every model to it, see ``specdec.models.load_model``), the cache layer of a
pass, and ``batched_forward``. The scheduler that gathers sessions' work into passes is
``specdec.rpc.scheduler``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.kv import KVSession
from specdec.lm import LoadedModel, logits_to

log = logging.getLogger(__name__)

# The attention implementation models run under (set at load): transformers' SDPA attention, plus
# per-row attention when a batched pass hands it ``RaggedKV``.
RAGGED_ATTENTION = "specdec_ragged_sdpa"


@dataclass
class ForwardRow:
    """One session's part of a pass: the full token list it wants logits for (the cache supplies
    what it already holds), how many trailing positions need logits, and how many leading tokens
    are committed (never change: later passes skip comparing them with the cache; 0 promises nothing)."""

    kv: KVSession
    tokens: list[int]
    num_logits: int = 1
    committed: int = 0
    # Also wanted: the target's features (final-norm inputs) of the last ``num_features`` tokens of
    # ``tokens``; after the pass ``features`` holds those the pass fed (it may feed fewer: the cache
    # had the rest), from position ``features_start`` on.
    num_features: int = 0
    features: torch.Tensor | None = None
    features_start: int = 0


def batched_forward(lm: LoadedModel, rows: Sequence[ForwardRow], on_device: bool = False) -> list[torch.Tensor]:
    """Logits (fp32, [num_logits, V]) per row, from one forward pass of ``lm`` over all rows, on the
    host or (``on_device``) where the model runs; rows that ask for ``num_features`` get their
    ``features`` too (see ``ForwardRow``)."""
    if not any(row.num_features for row in rows):
        return _batched_logits(lm, rows, on_device)
    with lm.captured_features() as passes:
        logits = _batched_logits(lm, rows, on_device)
    # One packed pass or one pass per row: either way every row's fed tokens, row after row.
    packed = torch.cat(passes) if len(passes) != 1 else passes[0]
    fed = [row.kv.last_fed for row in rows]
    offset = 0
    for row, n in zip(rows, fed):
        wanted = min(row.num_features, n)
        row.features = packed[offset + n - wanted: offset + n]
        row.features_start = len(row.kv) - wanted
        offset += n
    return logits


def _batched_logits(lm: LoadedModel, rows: Sequence[ForwardRow], on_device: bool) -> list[torch.Tensor]:
    """Logits (fp32, [num_logits, V]) per row, from one forward pass of ``lm`` over all rows.

    Invariant: afterwards each row's KV session holds exactly ``row.tokens``, as after
    ``row.kv.forward(row.tokens, row.num_logits, row.committed)``, and the returned logits are that call's.
    Models without the ragged attention (or caches of other layer kinds) run row by row.

    The rows' new tokens are packed into one sequence (row after row, each at its own positions):
    the pass's matrix products cover exactly the tokens fed, so a row verifying several drafts adds
    its own tokens to the pass and nothing to the other rows (padding to the longest row would
    widen every row to it).
    """
    if len(rows) > 1 and lm.packed_runtime is not None and all(row.kv.packed_cache is not None for row in rows):
        return _packed_batched_forward(lm, rows, on_device)
    if len(rows) == 1 or not lm.ragged_attention or any(row.kv.growing_layers is None for row in rows):
        return [row.kv.forward(row.tokens, row.num_logits, row.committed, on_device) for row in rows]
    feeds = [row.kv.prepare(row.tokens, row.num_logits) for row in rows]
    past_lengths = [len(row.kv) for row in rows]
    fed = [len(feed) for feed in feeds]
    starts = [0]
    for n in fed[:-1]:
        starts.append(starts[-1] + n)
    device = lm.device
    ids = torch.tensor([[token for feed in feeds for token in feed]], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(past, past + n) for past, n in zip(past_lengths, fed)])[None].to(device)
    keep = torch.cat([torch.arange(start + n - row.num_logits, start + n)
                      for start, n, row in zip(starts, fed, rows)]).to(device)
    cache = lm.new_cache()
    cache.layers = [_RaggedBatchLayer([row.kv.growing_layers[layer] for row in rows], starts, fed, max(past_lengths))
                    for layer in range(len(rows[0].kv.cache.layers))]
    try:
        # A 4D mask skips transformers' mask building; the ragged attention masks each row itself.
        logits = lm.forward_rows(ids, cache, keep, position_ids=position_ids,
                                 attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                                 on_device=on_device)
    except BaseException:
        for row, past in zip(rows, past_lengths):  # layers the pass reached grew: roll every row back
            row.kv.rollback_to(past)
        raise
    return _hand_out(rows, feeds, logits[0])


def _hand_out(rows: Sequence[ForwardRow], feeds: list[list[int]], logits: torch.Tensor) -> list[torch.Tensor]:
    """After a successful pass: each row's slice of the packed logits [sum(num_logits), V], and each
    row's cache told what it was fed."""
    out = []
    first = 0
    for row, feed in zip(rows, feeds):
        out.append(logits[first : first + row.num_logits])
        first += row.num_logits
        row.kv.fed(feed, row.committed)
    return out


def _packed_batched_forward(lm: LoadedModel, rows: Sequence[ForwardRow], on_device: bool) -> list[torch.Tensor]:
    """The lean or gguf runtime's pass: its ``forward`` packs the rows itself (lean: one attention call
    per layer with a block mask; gguf: one llama.cpp batch); a pass that fails leaves every cache at
    its prepared length."""
    feeds = [row.kv.prepare(row.tokens, row.num_logits) for row in rows]
    logits = logits_to(lm.packed_runtime.forward([row.kv.packed_cache for row in rows], feeds,
                                                 [row.num_logits for row in rows]), on_device)
    return _hand_out(rows, feeds, logits)


class RaggedKV:
    """A batched pass's keys (or values) for one layer: row i's own [1, heads, length_i, dim], of
    which the last ``fed[i]`` positions are the row's new tokens, fed at ``starts[i]`` of the
    packed sequence."""

    def __init__(self, rows: list[torch.Tensor], starts: list[int], fed: list[int]) -> None:
        self.rows = rows
        self.starts = starts
        self.fed = fed


def _ragged_layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


class _RaggedBatchLayer(_ragged_layer_base()):
    """A cache layer for one batched pass: appends each row's fed keys/values (its slice of the
    packed sequence) to that session's own layer and hands attention every row's full keys/values."""

    is_sliding = False
    is_compileable = False

    def __init__(self, layers, starts: list[int], fed: list[int], past: int) -> None:
        super().__init__()
        self.is_initialized = True
        self.layers = layers
        self.starts = starts
        self.fed = fed
        self.past = past

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = [], []
        for layer, start, n in zip(self.layers, self.starts, self.fed):
            k, v = layer.update(key_states[:, :, start : start + n], value_states[:, :, start : start + n])
            keys.append(k)
            values.append(v)
        return RaggedKV(keys, self.starts, self.fed), RaggedKV(values, self.starts, self.fed)

    def get_seq_length(self) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def lazy_initialization(self, key_states, value_states) -> None:  # the rows' own layers hold the state
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a batched pass's layer is not cropped; its rows' sessions are")


def _ragged_sdpa_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA attention; for ``RaggedKV`` (a batched pass over a packed sequence), SDPA
    row by row: each row's queries over that row's own keys, causal over its fed tokens."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(key, RaggedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _, heads, total_fed, dim = query.shape
    groups = heads // key.rows[0].shape[1]  # query heads per key/value head (GQA)
    out = query.new_empty((1, total_fed, heads, dim))
    for k, v, start, n in zip(key.rows, value.rows, key.starts, key.fed):
        if n == 1:  # decoding: the group's query heads become queries of their shared key/value head
            q = query[:, :, start : start + 1].reshape(1, heads // groups, groups, dim)
            out[0, start] = sdpa(q, k, v, scale=scaling).reshape(heads, dim)
            continue
        total = k.shape[2]  # query j sees the cached prefix and fed tokens 0..j
        mask = torch.ones((n, total), dtype=torch.bool, device=query.device).tril(total - n)
        row = sdpa(query[:, :, start : start + n], k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
        out[0, start : start + n] = row[0].transpose(0, 1)
    return out, None


def enable_ragged_attention(model) -> bool:
    """Switch ``model`` (if it runs transformers' SDPA attention) to the ragged variant, which is the
    same function outside batched passes. Returns whether batched passes are possible."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(RAGGED_ATTENTION, _ragged_sdpa_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)
    try:
        model.set_attn_implementation(RAGGED_ATTENTION)
    except (ValueError, ImportError) as exc:
        log.info("batched passes off for %s: %s", type(model).__name__, exc)
        return False
    return model.config._attn_implementation == RAGGED_ATTENTION

