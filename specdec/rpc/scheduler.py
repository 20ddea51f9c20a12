"""The scheduler that gathers concurrent sessions' work into batched passes (continuous batching),
one pass at a time on the service's model thread. The pass itself is ``specdec.ragged``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from specdec.wire_types import BatchInfo

log = logging.getLogger(__name__)


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
    num_tokens: int
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
        self.on_pass = on_pass  # (size, num_tokens, seconds) after each pass: metrics
        self.expected = expected or (lambda: 1)  # sessions that may send work (open sessions)
        self._pending: deque[_Pending] = deque()
        self._wakeup: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def submit(self, job, num_tokens: int):
        """Run ``job`` in a pass; returns ``(result, BatchInfo)`` or raises the job's exception."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._arrived = asyncio.Event()
            self._task = loop.create_task(self._serve(), name="batch-scheduler")
        entry = _Pending(job, num_tokens, loop.create_future())
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
            if not live or live[0].num_tokens > self.max_row_tokens:
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
        batch, batch_tokens = [first], first.num_tokens
        if first.num_tokens > self.max_row_tokens:
            return batch
        kept: deque[_Pending] = deque()
        while self._pending and len(batch) < self.max_batch_size:
            entry = self._pending.popleft()
            if entry.future.done():
                continue
            if entry.num_tokens > self.max_row_tokens or batch_tokens + entry.num_tokens > self.max_batch_tokens:
                kept.append(entry)  # waits, in order, for a later pass
                continue
            batch.append(entry)
            batch_tokens += entry.num_tokens
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
            batch_tokens = sum(e.num_tokens for e in batch)
            if self.on_pass is not None:
                self.on_pass(len(batch), batch_tokens, pass_s)
            for entry, result in zip(batch, results, strict=True):
                if entry.future.done():
                    continue
                if isinstance(result, BaseException):
                    entry.future.set_exception(result)
                else:
                    info = BatchInfo(len(batch), batch_tokens, started - entry.submitted, pass_s)
                    entry.future.set_result((result, info))
