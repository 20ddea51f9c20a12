"""The gateway's drafter and verifier replicas: each one's channel, readiness and load, and the
least-loaded pick (static addresses, or a live EndpointSlice set from ``gateway.discovery``).

A replica is *ready* when its ``grpc.health.v1`` status for its own service is SERVING (model loaded
and warmed up, not draining) and its ``GetInfo`` answers with this gateway's tokenizer. A replica
that answers ``GetInfo`` while still warming up, or while draining, is not picked.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.server import open_channel
from specdec.telemetry.logs import printable
from specdec.v1 import drafter_pb2, verifier_pb2

log = logging.getLogger("specdec.gateway")


@dataclass
class Replica:
    """One drafter or verifier replica and its load."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    health: object  # grpc.health.v1 stub on the same channel
    in_flight: int = 0  # this gateway's open sessions on it
    info: object = None  # the last GetInfo answer while ready; None = not ready
    known_method: str | None = None  # the draft method it reported last (kept while it is not ready)
    # When it last became ready, from one counter per pool: a session that failed on a replica takes
    # that address again only once it became ready since (a restart at the same address, even as a
    # new Replica after discovery dropped and re-added it), never on the strength of an old answer.
    ready_epoch: int = 0
    not_serving_logged: bool = False
    reported_active: int = 0  # sessions it reported at the last refresh (all gateways)
    opened_since_report: int = 0
    removed: bool = False
    tokenizer_mismatch_logged: bool = False
    refusal_logged: bool = False  # it refused our credentials (logged once until it accepts them)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_active + self.opened_since_report)


_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


# The service each role's health is checked for (the name the replicas register themselves under).
SERVICE_NAMES = {"verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
                 "drafter": drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name}


class ReplicaPool:
    """The replicas of one role: static addresses or a live EndpointSlice set, refreshed by health
    checks and GetInfo."""

    def __init__(self, role: str, stub_cls, max_message_bytes: int, tls=None,
                 service_token: str | None = None) -> None:
        self.role = role
        self.service_name = SERVICE_NAMES[role]
        self._refreshed = asyncio.Condition()  # notified after every refresh (waiters re-pick)
        self._epochs = itertools.count(1)  # Replica.ready_epoch
        self.tls = tls
        self.service_token = service_token  # presented on every call (open_channel adds it)
        self.server_name: str | None = None  # the TLS name discovered pods' certificates carry
        self.stub_cls = stub_cls
        self.max_message_bytes = max_message_bytes
        self.replicas: list[Replica] = []
        self.fingerprint: str | None = None  # the gateway's tokenizer; mismatching replicas are never used

    def set_addresses(self, addresses) -> None:
        wanted = set(addresses)
        for replica in self.replicas:
            if replica.address not in wanted:
                replica.removed = True  # new sessions avoid it; open ones finish there
        known = {b.address for b in self.replicas if not b.removed}
        for address in sorted(wanted - known):
            channel = open_channel(address, self.tls, self.max_message_bytes, service_token=self.service_token,
                                   server_name=self.server_name)
            self.replicas.append(Replica(address=address, channel=channel, stub=self.stub_cls(channel),
                                         health=health_pb2_grpc.HealthStub(channel)))
        for replica in [b for b in self.replicas if b.removed and b.in_flight == 0]:
            self.replicas.remove(replica)
            asyncio.ensure_future(replica.channel.close())

    async def refresh(self, timeout: float = 2.0) -> None:
        """Ask every replica for its health, info and load; unreachable, warming, draining or
        mismatched ones are not ready."""
        request = verifier_pb2.GetVerifierInfoRequest() if self.role == "verifier" else drafter_pb2.GetDrafterInfoRequest()
        health_request = health_pb2.HealthCheckRequest(service=self.service_name)

        async def one(replica: Replica) -> None:
            try:
                health, info = await asyncio.gather(replica.health.Check(health_request, timeout=timeout),
                                                    replica.stub.GetInfo(request, timeout=timeout))
            except grpc.aio.AioRpcError as exc:
                self.mark_not_ready(replica)
                if exc.code() in _REFUSED and not replica.refusal_logged:
                    # Our service token or certificate is wrong: say so here, not only in its log.
                    log.error("%s %s refuses this gateway (%s: %s); not using it", self.role, replica.address,
                              exc.code().name, printable(exc.details()))
                    replica.refusal_logged = True
                return
            replica.refusal_logged = False
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                # Loaded but warming up, or draining: answers GetInfo, takes no new session.
                if not replica.not_serving_logged:
                    log.info("%s %s is not serving yet (warming up or draining)", self.role, replica.address)
                    replica.not_serving_logged = True
                self.mark_not_ready(replica)
                return
            replica.not_serving_logged = False
            fingerprint = info.model.tokenizer_fingerprint
            if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
                if not replica.tokenizer_mismatch_logged:
                    log.error("%s %s serves %s with a different tokenizer; not using it",
                              self.role, replica.address, printable(info.model.model))
                    replica.tokenizer_mismatch_logged = True
                replica.known_method = ""  # it answered, and offers nothing this gateway can use
                self.mark_not_ready(replica)
                return
            replica.known_method = getattr(info, "method", None)
            if replica.info is None:
                replica.ready_epoch = next(self._epochs)
                log.info("%s %s ready (%s)", self.role, replica.address,
                         printable(info.model.model or getattr(info, "method", "")))
            replica.info = info
            replica.reported_active = info.load.active_sessions
            replica.opened_since_report = 0

        await asyncio.gather(*(one(b) for b in list(self.replicas)))
        async with self._refreshed:
            self._refreshed.notify_all()

    @staticmethod
    def mark_not_ready(replica: Replica) -> None:
        """Not ready until a refresh finds it serving again: a refresh that found it unreachable,
        warming up, draining or mismatched, or a stream on it that failed (new requests then wait for
        it or take another instead of failing on it in turn)."""
        replica.info = None

    def offers(self, method: str) -> bool | None:
        """Whether some replica drafts with ``method``: True, False (every replica has said what it
        drafts with, and none this), or None (some never answered yet: unknown)."""
        methods = [b.known_method for b in self.replicas if not b.removed]
        if method in methods:
            return True
        return None if None in methods else False

    def ready(self, method: str | None = None) -> list[Replica]:
        return [b for b in self.replicas
                if b.info is not None and not b.removed and (method is None or b.info.method == method)]

    def pick(self, method: str | None = None, failed: dict[str, int] | None = None) -> Replica | None:
        """The least-loaded ready replica (of ``method`` if given); ``failed``: address -> the
        ``ready_epoch`` it had when a stream on it failed; such a replica is skipped until it has
        become ready again since."""
        failed = failed or {}
        ready = [b for b in self.ready(method) if b.ready_epoch > failed.get(b.address, -1)]
        if not ready:
            return None
        replica = min(ready, key=lambda b: b.load)
        replica.opened_since_report += 1
        return replica

    async def wait_pick(self, wait_s: float, method: str | None = None,
                        failed: dict[str, int] | None = None) -> Replica | None:
        """``pick``, waiting up to ``wait_s`` for a replica to become ready (a restart, a rollout);
        None if none did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            replica = self.pick(method, failed)
            remaining = deadline - loop.time()
            if replica is not None or remaining <= 0:
                return replica
            async with self._refreshed:
                try:
                    await asyncio.wait_for(self._refreshed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
