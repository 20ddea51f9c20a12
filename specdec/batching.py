"""Batching across sessions: one forward pass over several sessions' new tokens, and the scheduler
that gathers concurrent sessions' work into such passes.

Each session keeps its own KV cache (``KVSession`` with ``GrowingKVLayer``s). A batched pass feeds
every session's new tokens, packed into one sequence, at that session's own positions; all the
matrix products (projections, MLP, LM head) run once over exactly the tokens fed, while attention
runs per row over that session's own cache, which grows in place: nothing is padded, and nothing
is copied per pass beyond the new tokens. The logits of a row equal (up to floating-point
rounding of a differently shaped matrix product) what the session's own ``KVSession.forward`` returns; tokens, acceptance and
sampling stay per session and position-keyed, so batching changes no output distribution.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from specdec.kv import KVSession
from specdec.models import LoadedModel

log = logging.getLogger(__name__)

# The attention implementation models run under (set at load): transformers' SDPA attention, plus
# per-row attention when a batched pass hands it ``RaggedKV``.
RAGGED_ATTENTION = "specdec_ragged_sdpa"


@dataclass
class ForwardRow:
    """One session's part of a pass: the full token list it wants logits for (the cache supplies
    what it already holds) and how many trailing positions need logits."""

    kv: KVSession
    tokens: list[int]
    num_logits: int = 1


def batched_forward(lm: LoadedModel, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
    """Logits (fp32, [num_logits, V]) per row, from one forward pass of ``lm`` over all rows.

    Invariant: afterwards each row's KV session holds exactly ``row.tokens``, as after
    ``row.kv.forward(row.tokens, row.num_logits)``, and the returned logits are that call's.
    Models without the ragged attention (or caches of other layer kinds) run row by row.

    The rows' new tokens are packed into one sequence (row after row, each at its own positions):
    the pass's matrix products cover exactly the tokens fed, so a row verifying several drafts adds
    its own tokens to the pass and nothing to the other rows (padding to the longest row would
    widen every row to it).
    """
    if len(rows) == 1 or not lm.ragged_attention or any(row.kv.growing_layers is None for row in rows):
        return [row.kv.forward(row.tokens, row.num_logits) for row in rows]
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
                                 attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device))
    except BaseException:
        for row, past in zip(rows, past_lengths):  # layers the pass reached grew: roll every row back
            row.kv.rollback_to(past)
        raise
    out = []
    first = 0
    for row in rows:
        out.append(logits[0, first : first + row.num_logits])
        first += row.num_logits
        row.kv.cached_tokens = list(row.tokens)
    return out


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


@dataclass(frozen=True)
class BatchInfo:
    """How a job was served: the pass it rode in and its wait for it."""

    size: int  # jobs in the pass
    tokens: int  # tokens the pass fed (the jobs' sizes, padding excluded)
    queue_wait_s: float  # from submit to the pass starting

    def trace_attributes(self) -> dict:
        """The step attributes services add to their traces."""
        return {"batch_size": self.size, "batch_tokens": self.tokens, "queue_wait_ms": round(self.queue_wait_s * 1e3, 3)}


@dataclass(frozen=True)
class BatchingOptions:
    """How a service batches sessions' work (``--max-batch-size``, ``--batch-wait-ms``,
    ``--batch-wait-fraction``, ``--prefill-chunk-tokens``)."""

    max_batch_size: int = 16  # 1: every message gets its own pass
    # Longest a pass waits for sessions that are open but have nothing queued (their next message is
    # on its way: a pass's sessions come back after a round trip). Without it, two streams alternate
    # passes forever instead of sharing them. 0: take only what queued while the last pass ran.
    max_wait_s: float = 0.005
    # ... or up to this fraction of the recent pass time, where that is longer. A session that misses
    # a pass waits a whole pass, while holding one costs its sessions this fraction of one; under load
    # on a slow (CPU) verifier a pass's verdicts take the gateway longer than max_wait_s to turn
    # around (about half a millisecond each), and the last of 16 sessions kept missing their pass.
    max_wait_fraction: float = 0.1
    max_batch_tokens: int = 256
    max_row_tokens: int = 64  # longer jobs (prefills) run alone: decoding sessions do not wait for them
    # While other sessions are decoding, the verifier feeds a longer prompt in chunks of this many
    # tokens (at most max_row_tokens), each riding in a pass with their rows, instead of one pass that
    # stalls them all (chunked prefill). 0: a prompt is always prefilled in one pass.
    prefill_chunk_tokens: int = 64


@dataclass
class _Pending:
    job: object
    tokens: int
    future: asyncio.Future
    submitted: float = field(default_factory=time.perf_counter)


class BatchScheduler:
    """Gathers jobs that concurrent sessions submit into passes, one pass at a time on ``executor``.

    A pass takes the oldest pending job and, while under ``max_batch_size`` jobs and
    ``max_batch_tokens`` tokens, the next ones; a job over ``max_row_tokens`` (a long prefill) runs
    alone, so that the decoding sessions' short pass does not take its length. Jobs that arrive
    while a pass runs wait for the next one (continuous batching). While fewer jobs are queued than
    ``expected()`` sessions are open, a pass waits up to ``max_wait_s`` (or ``max_wait_fraction``
    of the recent pass time, if longer) for theirs to arrive (the bound on the latency batching
    adds); a long job does not wait. ``run_batch(jobs)`` returns one
    result or exception per job.
    """

    def __init__(self, run_batch: Callable[[list], list], executor: Executor,
                 options: BatchingOptions = BatchingOptions(),
                 on_pass: Callable[[int, int, float], None] | None = None,
                 expected: Callable[[], int] | None = None) -> None:
        if options.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch_size = options.max_batch_size
        self.max_batch_tokens = options.max_batch_tokens
        self.max_row_tokens = options.max_row_tokens
        self.max_wait_s = options.max_wait_s
        self.max_wait_fraction = options.max_wait_fraction
        self.recent_pass_s = 0.0  # moving average of pass times
        self.on_pass = on_pass  # (size, tokens, seconds) after each pass: metrics
        self.expected = expected or (lambda: 1)  # sessions that may send work (open sessions)
        self._pending: deque[_Pending] = deque()
        self._wakeup: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, job, tokens: int):
        """Run ``job`` in a pass; returns ``(result, BatchInfo)`` or raises the job's exception."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._arrived = asyncio.Event()
            self._task = loop.create_task(self._serve(), name="batch-scheduler")
        entry = _Pending(job, tokens, loop.create_future())
        self._pending.append(entry)
        self._wakeup.set()
        self._arrived.set()
        # A cancelled caller leaves a cancelled future behind; the scheduler skips it.
        return await entry.future

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for entry in self._pending:
            if not entry.future.done():
                entry.future.cancel()
        self._pending.clear()

    @property
    def wait_bound_s(self) -> float:
        """Longest a pass waits for open sessions' messages."""
        return max(self.max_wait_s, self.max_wait_fraction * self.recent_pass_s)

    async def _wait_for_sessions(self, loop) -> None:
        """Hold the pass while open sessions have nothing queued yet (up to ``wait_bound_s``)."""
        deadline = loop.time() + self.wait_bound_s
        while True:
            live = [e for e in self._pending if not e.future.done()]
            if not live or live[0].tokens > self.max_row_tokens:
                return
            if len(live) >= min(self.expected(), self.max_batch_size):
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Pending]:
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
        if not self._pending:
            return []
        first = self._pending.popleft()
        batch, tokens = [first], first.tokens
        if first.tokens > self.max_row_tokens:
            return batch
        kept: deque[_Pending] = deque()
        while self._pending and len(batch) < self.max_batch_size:
            entry = self._pending.popleft()
            if entry.future.done():
                continue
            if entry.tokens > self.max_row_tokens or tokens + entry.tokens > self.max_batch_tokens:
                kept.append(entry)  # waits, in order, for a later pass
                continue
            batch.append(entry)
            tokens += entry.tokens
        kept.extend(self._pending)
        self._pending = kept
        return batch

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            await self._wait_for_sessions(loop)
            batch = self._take()
            if not self._pending:
                self._wakeup.clear()
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [e.job for e in batch])
            except asyncio.CancelledError:
                for entry in batch:
                    if not entry.future.done():
                        entry.future.cancel()
                raise
            except Exception as exc:  # the pass itself failed: every job in it fails with it
                log.exception("batched pass of %d jobs failed", len(batch))
                results = [exc] * len(batch)
            pass_s = time.perf_counter() - started
            self.recent_pass_s = pass_s if self.recent_pass_s == 0.0 else 0.8 * self.recent_pass_s + 0.2 * pass_s
            tokens = sum(e.tokens for e in batch)
            if self.on_pass is not None:
                self.on_pass(len(batch), tokens, pass_s)
            for entry, result in zip(batch, results, strict=True):
                if entry.future.done():
                    continue
                if isinstance(result, BaseException):
                    entry.future.set_exception(result)
                else:
                    info = BatchInfo(len(batch), tokens, started - entry.submitted)
                    entry.future.set_result((result, info))
