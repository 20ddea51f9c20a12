"""Per-service session bookkeeping: bounded admission and guaranteed release."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from specdec import telemetry
from specdec.rpc.scheduler import BatchingOptions, BatchScheduler
from specdec.rpc.security import peer_host
from specdec.rpc.server import Overloaded, SessionNotFound
from specdec.telemetry import ServiceMetrics
from specdec.gguf import SequencesExhausted
from specdec.wire_types import FieldError

log = logging.getLogger(__name__)


MAX_SESSION_ID_CHARS = 128  # a session id is a request id or a minted token, never a payload


def validate_session_id(session_id: str) -> None:
    """``FieldError`` naming ``session_id`` when it is longer than ``MAX_SESSION_ID_CHARS``."""
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise FieldError("session_id", f"{len(session_id)} characters exceed the limit of {MAX_SESSION_ID_CHARS}")


class ModelThread(ThreadPoolExecutor):
    """The one thread a service's model runs on; ``waiting`` counts the calls queued for it (a
    session's start, a batched pass, a close), so that work which holds the thread for a while (a
    solo plain run) can give it up as soon as anything else needs it."""

    def __init__(self, role: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=f"{role}-model")
        self._lock = threading.Lock()
        self.waiting = 0

    def submit(self, fn, /, *args, **kwargs):
        queued = [True]

        def leave() -> None:  # once per call: when it starts, or when it ends without starting (cancelled)
            with self._lock:
                if queued[0]:
                    queued[0] = False
                    self.waiting -= 1

        def started():
            leave()
            return fn(*args, **kwargs)

        with self._lock:
            self.waiting += 1
        try:
            future = super().submit(started)
        except BaseException:
            leave()
            raise
        future.add_done_callback(lambda _: leave())
        return future


class SessionRegistry:
    """Live sessions of one service, at most ``max_sessions`` at once and at most
    ``max_sessions_per_peer`` per client host (so one client cannot take every session).

    Each session remembers the ``context.peer()`` of the stream that opened it (the full string:
    host and source port, i.e. that connection): ``cancel()`` acts only on sessions the caller opened,
    and answers another caller exactly as for an unknown session (nothing is revealed, nothing ends).
    """

    def __init__(self, max_sessions: int, metrics: ServiceMetrics, release=None,
                 max_sessions_per_peer: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_sessions_per_peer = max_sessions if max_sessions_per_peer is None else max_sessions_per_peer
        self.metrics = metrics
        self.release = release or (lambda session: session.close())  # frees a closed session's state
        self._sessions: dict[str, object] = {}
        self._cancel_events: dict[str, asyncio.Event] = {}
        self._owners: dict[str, str] = {}  # key -> the opener's full peer string

    def __len__(self) -> int:
        return len(self._sessions)

    def held_by(self, host: str) -> int:
        """Sessions open from client host ``host`` (a ``peer_host``)."""
        return sum(1 for owner in self._owners.values() if peer_host(owner) == host)

    def admit(self, peer: str = "") -> None:
        """``Overloaded`` unless a session opened now by ``peer`` is within the limits (services check
        before they build a session's state, ``open`` checks again)."""
        if len(self._sessions) >= self.max_sessions:
            raise Overloaded(f"session limit reached ({self.max_sessions})")
        if self.held_by(peer_host(peer)) >= self.max_sessions_per_peer:
            raise Overloaded(f"session limit per client reached ({self.max_sessions_per_peer} of "
                             f"{self.max_sessions}; --max-sessions-per-peer)")

    def open(self, session_id: str, session: object, cancelled: asyncio.Event | None = None, peer: str = "") -> str:
        """Register a session opened by ``peer`` (``context.peer()``); returns the key to close it
        with. ``cancel()`` (by the same peer) sets ``cancelled``."""
        validate_session_id(session_id)
        self.admit(peer)
        key = session_id if session_id and session_id not in self._sessions else f"{session_id}#{uuid.uuid4().hex[:8]}"
        self._sessions[key] = session
        self._owners[key] = peer
        if cancelled is not None:
            self._cancel_events[key] = cancelled
        self.metrics.active_sessions.set(len(self._sessions))
        self.metrics.requests.inc()
        return key

    def cancel(self, session_id: str, peer: str = "") -> None:
        """End the streams serving ``session_id`` that ``peer`` opened (their ``finally`` frees the
        state). ``SessionNotFound`` when there is none: unknown, finished, or another peer's."""
        validate_session_id(session_id)
        keys = [k for k in self._cancel_events
                if (k == session_id or k.startswith(f"{session_id}#")) and self._owners.get(k) == peer]
        if not session_id or not keys:
            raise SessionNotFound(f"session_id: no live session {session_id!r}")
        for key in keys:
            self._cancel_events[key].set()

    def close(self, key: str) -> None:
        self._cancel_events.pop(key, None)
        self._owners.pop(key, None)
        session = self._sessions.pop(key, None)
        if session is not None and hasattr(session, "close"):
            self.release(session)
        self.metrics.active_sessions.set(len(self._sessions))


class ModelWorkerService:
    """What the drafter and verifier services share: session registry with its metrics, the idle
    limit, and one model worker thread (forward passes run off the event loop, one at a time).
    Sessions' per-message work goes through a ``BatchScheduler`` that serves concurrent sessions
    in one batched pass (``_run_batch``)."""

    role = "service"

    def __init__(self, runtime, max_sessions: int = 64, max_draft_tokens: int = 32,
                 idle_timeout_s: float | None = 300.0, batching: BatchingOptions | None = None,
                 max_sessions_per_peer: int | None = None) -> None:
        self.runtime = runtime
        self.idle_timeout_s = idle_timeout_s
        self.max_draft_tokens = max_draft_tokens
        # Prometheus series on the service's registry, and OTel instruments when a meter is installed.
        self.metrics = ServiceMetrics(runtime.registry, self.role, telemetry.current())
        self.executor = ModelThread(self.role)
        # A session's KV cache is freed on the model thread, after any pass that is using it.
        self.sessions = SessionRegistry(max_sessions, self.metrics,
                                        release=lambda session: self.executor.submit(session.close),
                                        max_sessions_per_peer=max_sessions_per_peer)
        self.batching = batching or BatchingOptions()
        self.batcher = BatchScheduler(self._run_batch, self.executor, self.batching,
                                      on_pass=self._observe_pass, expected=lambda: len(self.sessions))

    def fit_sessions_to(self, lm) -> None:
        """On the gguf runtime each session holds one of the context's sequences: admit no more."""
        sequences = lm.gguf.context.sequences if getattr(lm, "gguf", None) is not None else None
        if sequences is not None and sequences < self.sessions.max_sessions:
            self.sessions.max_sessions = sequences
            log.info("%s: %d sessions at most (the gguf context's sequences; $SPECDEC_GGUF_SEQUENCES)",
                     self.role, sequences)

    async def start_session(self, peer: str, session_id: str, make, cancelled: asyncio.Event | None = None):
        """``(session, key)``: ``make()``'s new session, registered, once ``peer`` may open one
        (``Overloaded`` otherwise, before any state is made). ``make`` runs on the model thread, so
        the sessions closed before it have returned their state (a gguf context's sequence) by then;
        a context out of sequences all the same is overload too."""
        self.sessions.admit(peer)
        making = asyncio.ensure_future(self._run(make))
        try:
            session = await asyncio.shield(making)
        except SequencesExhausted as exc:
            raise Overloaded(str(exc)) from exc
        except asyncio.CancelledError:  # the stream ended meanwhile: what was made is freed when it is done
            making.add_done_callback(lambda done: done.cancelled() or done.exception() is not None
                                     or self.sessions.release(done.result()))
            raise
        try:
            return session, self.sessions.open(session_id, session, cancelled, peer=peer)
        except BaseException:  # another stream took the last slot while this one was made
            self.sessions.release(session)
            raise

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _batched(self, job, num_tokens: int):
        """``(result, BatchInfo)`` of ``job`` served in a batched pass with other sessions' jobs."""
        result, info = await self.batcher.submit(job, num_tokens)
        self.metrics.batch_queue_wait_seconds.observe(info.queue_wait_s)
        return result, info

    def _run_batch(self, jobs: list) -> list:
        """One pass over ``jobs`` (on the model thread): one result or exception per job."""
        raise NotImplementedError

    def _observe_pass(self, size: int, num_tokens: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.batch_pass_seconds.observe(seconds)
