"""The gateway's drafter and verifier replicas: each one's channel, readiness and load, and the
least-loaded pick (static addresses, or a live EndpointSlice set from ``gateway.discovery``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from specdec.rpc.server import open_channel
from specdec.v1 import drafter_pb2, verifier_pb2

log = logging.getLogger("specdec.gateway")


@dataclass
class Backend:
    """One drafter or verifier replica and its load."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0  # this gateway's open sessions on it
    info: object = None  # the last GetInfo answer; None = not ready
    reported_active: int = 0  # sessions it reported at the last refresh (all gateways)
    opened_since_report: int = 0
    removed: bool = False
    tokenizer_mismatch_logged: bool = False
    refusal_logged: bool = False  # it refused our credentials (logged once until it accepts them)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_active + self.opened_since_report)


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class BackendPool:
    """The replicas of one role: static addresses or a live EndpointSlice set, refreshed by GetInfo."""

    def __init__(self, role: str, stub_cls, max_message_bytes: int, tls=None,
                 service_token: str | None = None) -> None:
        self.role = role
        self.tls = tls
        self.service_token = service_token  # presented on every call (open_channel adds it)
        self.server_name: str | None = None  # the TLS name discovered pods' certificates carry
        self.stub_cls = stub_cls
        self.max_message_bytes = max_message_bytes
        self.backends: list[Backend] = []
        self.fingerprint: str | None = None  # the gateway's tokenizer; mismatching replicas are never used

    def set_addresses(self, addresses) -> None:
        wanted = set(addresses)
        for backend in self.backends:
            if backend.address not in wanted:
                backend.removed = True  # new sessions avoid it; open ones finish there
        known = {b.address for b in self.backends if not b.removed}
        for address in sorted(wanted - known):
            channel = open_channel(address, self.tls, self.max_message_bytes, service_token=self.service_token,
                                   server_name=self.server_name)
            self.backends.append(Backend(address=address, channel=channel, stub=self.stub_cls(channel)))
        for backend in [b for b in self.backends if b.removed and b.in_flight == 0]:
            self.backends.remove(backend)
            asyncio.ensure_future(backend.channel.close())

    async def refresh(self, timeout: float = 2.0) -> None:
        """Ask every replica for its info and load; unreachable or mismatched ones are not ready."""
        request = verifier_pb2.GetVerifierInfoRequest() if self.role == "verifier" else drafter_pb2.GetDrafterInfoRequest()

        async def one(backend: Backend) -> None:
            try:
                info = await backend.stub.GetInfo(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                backend.info = None
                if exc.code() in _REFUSED and not backend.refusal_logged:
                    # Our service token or certificate is wrong: say so here, not only in its log.
                    log.error("%s %s refuses this gateway (%s: %s); not using it", self.role, backend.address,
                              exc.code().name, exc.details())
                    backend.refusal_logged = True
                return
            backend.refusal_logged = False
            fingerprint = info.model.tokenizer_fingerprint
            if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
                if not backend.tokenizer_mismatch_logged:
                    log.error("%s %s serves %r with a different tokenizer; not using it",
                              self.role, backend.address, info.model.model)
                    backend.tokenizer_mismatch_logged = True
                backend.info = None
                return
            if backend.info is None:
                log.info("%s %s ready (%s)", self.role, backend.address, info.model.model or getattr(info, "method", ""))
            backend.info = info
            backend.reported_active = info.load.active_sessions
            backend.opened_since_report = 0

        await asyncio.gather(*(one(b) for b in list(self.backends)))

    def ready(self, method: str | None = None) -> list[Backend]:
        return [b for b in self.backends
                if b.info is not None and not b.removed and (method is None or b.info.method == method)]

    def pick(self, method: str | None = None, exclude: set[str] = frozenset()) -> Backend | None:
        """The least-loaded ready replica (of ``method`` if given, not in ``exclude``)."""
        ready = [b for b in self.ready(method) if b.address not in exclude]
        if not ready:
            return None
        backend = min(ready, key=lambda b: b.load)
        backend.opened_since_report += 1
        return backend
