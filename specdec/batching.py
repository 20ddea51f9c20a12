"""Batching across sessions: one forward pass over several sessions' new tokens, and the scheduler
that gathers concurrent sessions' work into such passes.

Each session keeps its own KV cache (``KVSession``). A batched pass lays the sessions' cached keys and
values side by side, right-aligned and left-padded to the longest, feeds every session's new tokens
(right-padded) at that session's own positions, and masks padding out, so each row attends exactly
to its own prefix. Afterwards every session adopts its row of the grown cache. The logits of a row
equal (up to floating-point rounding of a differently shaped matrix product) what the session's own
``KVSession.forward`` returns; tokens, acceptance and sampling stay per session and position-keyed,
so batching changes no output distribution.
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


@dataclass
class ForwardRow:
    """One session's part of a pass: the full token list it wants logits for (the cache supplies
    what it already holds) and how many trailing positions need logits."""

    kv: KVSession
    tokens: list[int]
    num_logits: int = 1


def _batchable(kv: KVSession) -> bool:
    from transformers.cache_utils import DynamicLayer

    # Sliding-window or other special layers keep extra state: those models run row by row.
    return all(type(layer) is DynamicLayer for layer in kv.cache.layers)


def batched_forward(lm: LoadedModel, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
    """Logits (fp32, [num_logits, V]) per row, from one forward pass of ``lm`` over all rows.

    Invariant: afterwards each row's KV session holds exactly ``row.tokens``, as after
    ``row.kv.forward(row.tokens, row.num_logits)``, and the returned logits are that call's.
    """
    if len(rows) == 1 or not all(_batchable(row.kv) for row in rows):
        return [row.kv.forward(row.tokens, row.num_logits) for row in rows]
    feeds = [row.kv.prepare(row.tokens, row.num_logits) for row in rows]
    past_lengths = [len(row.kv) for row in rows]
    past, width = max(past_lengths), max(len(feed) for feed in feeds)
    device = lm.device
    ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, feed in enumerate(feeds):
        ids[i, : len(feed)] = torch.tensor(feed, dtype=torch.long)
    columns = torch.arange(width, device=device)
    position_ids = torch.tensor(past_lengths, device=device)[:, None] + columns[None, :]
    mask = _attention_mask(past_lengths, [len(feed) for feed in feeds], past, width, lm.model.dtype, device)
    cache = lm.new_cache()
    cache.layers = [_PaddedPastLayer([row.kv.layer_states()[layer] for row in rows], past)
                    for layer in range(len(rows[0].kv.cache.layers))]
    # Logits for the window covering every row's last num_logits fed positions.
    window = width - min(len(feed) - row.num_logits for feed, row in zip(feeds, rows))
    logits = lm.forward_rows(ids, cache, window, position_ids=position_ids, attention_mask=mask)
    out = []
    for i, (row, feed) in enumerate(zip(rows, feeds)):
        end = len(feed) - (width - window)
        out.append(logits[i, end - row.num_logits : end])
        start = past - past_lengths[i]
        row.kv.adopt([(layer.keys[i : i + 1, :, start : past + len(feed)],
                       layer.values[i : i + 1, :, start : past + len(feed)]) for layer in cache.layers], row.tokens)
    return out


def _attention_mask(past_lengths: list[int], fed: list[int], past: int, width: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """Additive mask [B, 1, width, past + width]: a row sees its own cached prefix (the last
    ``past_lengths[i]`` of the padded past) and its fed tokens causally; a padding query sees itself only
    (a fully masked row would turn into NaN)."""
    rows = len(fed)
    key = torch.arange(past + width, device=device)
    query = torch.arange(width, device=device)
    first_cached = past - torch.tensor(past_lengths, device=device)
    n_fed = torch.tensor(fed, device=device)
    sees_past = (key[None, None, :] < past) & (key[None, None, :] >= first_cached[:, None, None])
    new_key = key[None, None, :] - past  # index among fed tokens
    sees_new = (new_key >= 0) & (new_key <= query[None, :, None]) & (new_key < n_fed[:, None, None])
    padding_query = query[None, :, None] >= n_fed[:, None, None]
    sees_self = padding_query & (new_key == query[None, :, None])
    allowed = (sees_past | sees_new | sees_self).expand(rows, width, past + width)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class _PaddedPastLayer:
    """A cache layer for one batched pass: on ``update`` it lays the rows' cached keys/values
    right-aligned into a zero-padded [B, heads, past + new, head_dim] tensor followed by the new ones."""

    is_sliding = False
    is_compileable = False

    def __init__(self, pasts: list[tuple[torch.Tensor, torch.Tensor] | None], past: int) -> None:
        self.pasts = pasts
        self.past = past
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def _assemble(self, new: torch.Tensor, which: int) -> torch.Tensor:
        rows, heads, width, dim = new.shape
        out = new.new_empty((rows, heads, self.past + width, dim))
        out[:, :, self.past :] = new
        for i, states in enumerate(self.pasts):
            cached = 0 if states is None else states[which].shape[-2]
            if cached:
                out[i, :, self.past - cached : self.past] = states[which][0]
            if cached < self.past:  # padding: masked out, but must not hold NaN (0 * NaN is NaN)
                out[i, :, : self.past - cached] = 0
        return out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = self._assemble(key_states, 0), self._assemble(value_states, 1)
        self.is_initialized = True
        self.pasts = []
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.past if self.keys is None else int(self.keys.shape[-2])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


@dataclass(frozen=True)
class BatchInfo:
    """How a job was served: the pass it rode in and its wait for it."""

    size: int  # jobs in the pass
    tokens: int  # tokens the pass fed (the jobs' sizes, padding excluded)
    queue_wait_s: float  # from submit to the pass starting
    pass_s: float  # the pass, start to end


@dataclass(frozen=True)
class BatchingOptions:
    """How a service batches sessions' work (``--max-batch-size``, ``--batch-wait-ms``)."""

    max_batch_size: int = 16  # 1: every message gets its own pass
    max_wait_s: float = 0.0  # extra wait for a pass to fill; 0: take what queued while the last pass ran
    max_batch_tokens: int = 256
    max_row_tokens: int = 32  # longer jobs (prefills) run alone: padding every row to them wastes work


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
    alone, because padding every row to its length would multiply the pass's work. Jobs that arrive
    while a pass runs wait for the next one (continuous batching); ``max_wait_s`` optionally holds a
    pass back that long for more jobs to arrive (the bound on the extra latency batching adds).
    ``run_batch(jobs)`` returns one result or exception per job.
    """

    def __init__(self, run_batch: Callable[[list], list], executor: Executor,
                 options: BatchingOptions = BatchingOptions(),
                 on_pass: Callable[[int, int, float], None] | None = None) -> None:
        if options.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch_size = options.max_batch_size
        self.max_batch_tokens = options.max_batch_tokens
        self.max_row_tokens = options.max_row_tokens
        self.max_wait_s = options.max_wait_s
        self.on_pass = on_pass  # (size, tokens, seconds) after each pass: metrics
        self._pending: deque[_Pending] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, job, tokens: int):
        """Run ``job`` in a pass; returns ``(result, BatchInfo)`` or raises the job's exception."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._serve(), name="batch-scheduler")
        entry = _Pending(job, tokens, loop.create_future())
        self._pending.append(entry)
        self._wakeup.set()
        # A cancelled caller leaves a cancelled future behind; the scheduler skips it.
        return await entry.future

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for entry in self._pending:
            if not entry.future.done():
                entry.future.cancel()
        self._pending.clear()

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
            if self.max_wait_s > 0 and len(self._pending) < self.max_batch_size:
                await asyncio.sleep(self.max_wait_s)
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
            tokens = sum(e.tokens for e in batch)
            if self.on_pass is not None:
                self.on_pass(len(batch), tokens, pass_s)
            for entry, result in zip(batch, results, strict=True):
                if entry.future.done():
                    continue
                if isinstance(result, BaseException):
                    entry.future.set_exception(result)
                else:
                    info = BatchInfo(len(batch), tokens, started - entry.submitted, pass_s)
                    entry.future.set_result((result, info))
