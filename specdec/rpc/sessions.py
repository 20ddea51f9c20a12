"""Per-service session bookkeeping: bounded admission and guaranteed release."""

from __future__ import annotations

import asyncio
import uuid

from prometheus_client import CollectorRegistry, Counter, Gauge

from specdec.rpc.server import Overloaded, SessionNotFound


class ServiceMetrics:
    """The Prometheus series every service exports (names shared across roles)."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.active_sessions = Gauge(
            "specdec_active_sessions", "Generation sessions holding state on this service", ["role"], registry=registry
        ).labels(role)
        self.requests = Counter(
            "specdec_requests", "Sessions (or gateway requests) started", ["role"], registry=registry
        ).labels(role)
        self.rejected = Counter(
            "specdec_rejected_requests", "Requests refused (bad input or overload)", ["role", "code"], registry=registry
        )
        self.tokens = Counter(
            "specdec_tokens", "Tokens produced: committed on verifier/gateway, drafted on drafter", ["role"], registry=registry
        ).labels(role)
        self.draft_tokens = Counter(
            "specdec_draft_tokens", "Draft tokens verified", ["role"], registry=registry
        ).labels(role)
        self.accepted_tokens = Counter(
            "specdec_accepted_tokens", "Draft tokens accepted", ["role"], registry=registry
        ).labels(role)


class SessionRegistry:
    """Live sessions of one service, at most ``max_sessions`` at once."""

    def __init__(self, max_sessions: int, metrics: ServiceMetrics) -> None:
        self.max_sessions = max_sessions
        self.metrics = metrics
        self._sessions: dict[str, object] = {}
        self._cancel_events: dict[str, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, session: object, cancelled: asyncio.Event | None = None) -> str:
        """Register a session; returns the key to close it with. ``cancel()`` sets ``cancelled``."""
        if len(self._sessions) >= self.max_sessions:
            raise Overloaded(f"session limit reached ({self.max_sessions})")
        key = session_id if session_id and session_id not in self._sessions else f"{session_id}#{uuid.uuid4().hex[:8]}"
        self._sessions[key] = session
        if cancelled is not None:
            self._cancel_events[key] = cancelled
        self.metrics.active_sessions.set(len(self._sessions))
        self.metrics.requests.inc()
        return key

    def cancel(self, session_id: str) -> None:
        """End the streams serving ``session_id`` (their ``finally`` frees the state)."""
        keys = [k for k in self._cancel_events if k == session_id or k.startswith(f"{session_id}#")]
        if not session_id or not keys:
            raise SessionNotFound(f"session_id: no live session {session_id!r}")
        for key in keys:
            self._cancel_events[key].set()

    def close(self, key: str) -> None:
        self._cancel_events.pop(key, None)
        session = self._sessions.pop(key, None)
        if session is not None and hasattr(session, "close"):
            session.close()
        self.metrics.active_sessions.set(len(self._sessions))


class ModelWorkerService:
    """What the drafter and verifier services share: session registry with its metrics, the idle
    limit, and one model worker thread (forward passes run off the event loop, one at a time)."""

    role = "service"

    def __init__(self, runtime, max_sessions: int = 64, max_draft_tokens: int = 32,
                 idle_timeout_s: float | None = 300.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from specdec import telemetry

        self.runtime = runtime
        self.idle_timeout_s = idle_timeout_s
        self.max_draft_tokens = max_draft_tokens
        self.metrics = ServiceMetrics(runtime.registry, self.role)
        self.sessions = SessionRegistry(max_sessions, self.metrics)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-model")
        telemetry.current().observe_active_sessions(self.role, lambda: len(self.sessions))

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
