"""Serving plumbing shared by the drafter, verifier and gateway.

grpc.aio server with grpc.health.v1 (NOT_SERVING until the model is loaded and warmed; also on a
plaintext health-only port where the main one is TLS, for Kubernetes' grpc probes),
reflection, a message-size limit, the callers' credentials (API keys, service tokens, allowed TLS
peers: ``specdec.rpc.security``), Prometheus metrics on their own HTTP port, error mapping in
one place, and a graceful drain on SIGTERM/SIGINT: NOT_SERVING first, then ``server.stop(grace)``
lets in-flight streams finish.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from specdec.rpc.security import ApiKeyInterceptor, ServiceAuthInterceptor, TLSConfig, with_service_token
from specdec.wire_types import FieldError

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Liveness probes check this name: it stays SERVING while the process lives (draining included),
# whereas readiness ("" and the service's own name) turns NOT_SERVING as soon as a drain begins.
LIVENESS_SERVICE = "specdec.v1.Liveness"


class Overloaded(Exception):
    """Admission refused: RESOURCE_EXHAUSTED."""


class NotReady(Exception):
    """The model is not loaded yet: UNAVAILABLE."""


class SessionNotFound(Exception):
    """NOT_FOUND."""


class SessionIdle(Exception):
    """No message on a session stream for longer than the idle timeout: DEADLINE_EXCEEDED."""


class SessionCancelled(Exception):
    """Ended out of band (CancelDraft / CancelVerify): CANCELLED."""


async def idle_guard(request_iterator, idle_timeout_s: float | None, cancelled: asyncio.Event):
    """Yield the stream's requests until it ends, ``cancelled`` is set, or the peer stays silent
    longer than ``idle_timeout_s``.

    The idle limit is the reaper for sessions whose gateway vanished without a cancel reaching us
    (a partition, a hung peer): their KV caches would otherwise live until TCP gives up.
    """
    iterator = request_iterator.__aiter__()
    stop = asyncio.ensure_future(cancelled.wait())
    following: asyncio.Future | None = None
    try:
        while True:
            following = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({following, stop}, timeout=idle_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if following not in done:
                if stop in done:
                    raise SessionCancelled("session cancelled")
                raise SessionIdle(f"session idle for more than {idle_timeout_s:g}s; state freed")
            try:
                request = following.result()
            except StopAsyncIteration:
                return
            yield request
    finally:
        stop.cancel()
        # The stream may end (cancelled RPC, idle, out-of-band cancel, the handler's error) while a read
        # is pending: cancel it, and retrieve its outcome whenever it settles, so that its exception
        # (StopAsyncIteration, the RPC's cancellation) is never reported as "never retrieved".
        if following is not None:
            following.cancel()
            following.add_done_callback(lambda read: read.cancelled() or read.exception())


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, SessionIdle):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, SessionCancelled):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream failure
        code = exc.code()
        # What says something about the request (or its deadline) passes on; a peer that failed,
        # vanished or refused us (UNAUTHENTICATED there is our credential, not the client's) is
        # the service being unavailable, never INTERNAL (that is for bugs here).
        return code if code in REQUEST_STATUSES else grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ConnectionError):  # a peer's stream or connection was lost
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


# The statuses of a downstream call that describe the request (its input, its deadline, the load it
# met), not the peer: a gateway passes them on to its client and does not move the session to
# another replica for them. Any other status means the peer failed, vanished or refused us.
REQUEST_STATUSES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.OUT_OF_RANGE})


def error_message(exc: BaseException) -> str:
    """What the client is told about ``exc`` (a downstream failure says so)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"downstream: {exc.details()}"
    return str(exc) or type(exc).__name__


# The field of an INVALID_ARGUMENT travels as gRPC's standard rich error (what Google's APIs send, and
# grpcio-status reads): a google.rpc.Status in this trailer, its details one google.rpc.BadRequest
# whose field violation names the field. Every hop reads it here (``error_field``), never from the text.
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_field(exc: BaseException) -> str | None:
    """The request field ``exc`` is about: a ``FieldError``'s, or the one a downstream service's
    status named (``status_details``); None when it names none."""
    if isinstance(exc, FieldError):
        return exc.field
    # A downstream status (aio) or a client's (sync): both carry the trailer.
    if not (isinstance(exc, grpc.RpcError) and hasattr(exc, "trailing_metadata")
            and exc.code() == grpc.StatusCode.INVALID_ARGUMENT):
        return None
    raw = next((value for key, value in exc.trailing_metadata() or () if key == STATUS_DETAILS_KEY), None)
    if not isinstance(raw, bytes):
        return None
    try:
        status = status_pb2.Status.FromString(raw)
        for detail in status.details:
            bad_request = error_details_pb2.BadRequest()
            if detail.Unpack(bad_request) and bad_request.field_violations:
                return bad_request.field_violations[0].field or None
    except Exception:  # noqa: BLE001 - a peer's malformed trailer names no field; the status still stands
        return None
    return None


def status_details(code: grpc.StatusCode, message: str, field: str | None) -> tuple:
    """The trailing metadata of a status: the rich error naming ``field`` (none without one)."""
    if field is None:
        return ()
    violation = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)])
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(violation)
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


async def _abort_with_status(exc: Exception, context, handler_name: str) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:  # a bug here: the traceback is what fixes it
        log.exception("internal error in %s", handler_name)
    message = error_message(exc)
    field = error_field(exc) if code == grpc.StatusCode.INVALID_ARGUMENT else None
    await context.abort(code, message, trailing_metadata=status_details(code, message, field))


def map_errors(handler: Callable) -> Callable:
    """Map exceptions of a unary-stream or stream-stream async-generator handler to statuses.

    Cancellation is re-raised untouched (cleanup happens in the handlers' ``finally``).
    """

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            async for response in handler(self, request, context):
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - one place maps every failure to a status
            await _abort_with_status(exc, context, handler.__name__)

    return wrapper


def map_unary_errors(handler: Callable) -> Callable:
    """The same mapping for unary handlers."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort_with_status(exc, context, handler.__name__)

    return wrapper


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 30.0
    tls: "TLSConfig | None" = None  # serve TLS (and require client certificates with client_auth)
    api_keys: tuple[bytes, ...] = ()  # gateway only: UNAUTHENTICATED without one of these
    # Drafter/verifier: calls must carry one of these in x-specdec-service-token (UNAUTHENTICATED
    # otherwise); () = open (the CLI warns).
    service_tokens: tuple[bytes, ...] = ()
    # With mTLS: the client certificate must name one of these (SAN or CN; PERMISSION_DENIED otherwise).
    allowed_peers: tuple[str, ...] = ()
    # Gateway: the token it presents on every call to drafters and verifiers (open_channel adds it).
    outbound_service_token: str | None = None
    # A plaintext port serving grpc.health.v1 only (Kubernetes' grpc probes cannot speak TLS).
    health_port: int | None = None


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(address: str, tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *, service_token: str | None = None,
                 server_name: str | None = None) -> grpc.aio.Channel:
    """An aio channel to another specdec service: TLS (presenting our certificate) when configured,
    and ``service_token`` on every call made on it.

    ``server_name``: the name the server's certificate must carry when ``address`` is not it (a
    pod IP from discovery: the Service's DNS name instead).
    """
    options = channel_options(max_message_bytes)
    if tls is not None and tls.secures_channels:
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        channel = grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    return with_service_token(channel, service_token)


class ServiceRuntime:
    """One gRPC server with health, reflection and metrics, for one service."""

    def __init__(self, service_name: str, options: ServeOptions) -> None:
        self.service_name = service_name  # fully qualified, e.g. "specdec.v1.Verifier"
        self.options = options
        interceptors = []
        if options.api_keys:
            interceptors.append(ApiKeyInterceptor(list(options.api_keys)))
        if options.service_tokens or options.allowed_peers:
            interceptors.append(ServiceAuthInterceptor(options.service_tokens, options.allowed_peers))
        # No SO_REUSEPORT (gRPC's default on Linux): a second server on a taken port would otherwise
        # bind silently and the kernel would split connections between the two.
        self.server = grpc.aio.server(options=[*channel_options(options.max_message_bytes), ("grpc.so_reuseport", 0)],
                                      interceptors=interceptors)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.registry = CollectorRegistry()
        self.port = 0
        self.metrics_port: int | None = None
        self._stopping = asyncio.Event()

    async def start(self, extra_service_names: tuple[str, ...] = ()) -> int:
        reflection.enable_server_reflection(
            (self.service_name, *extra_service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        address = f"{self.options.host}:{self.options.port}"
        tls = self.options.tls
        cannot_listen = f"{self.service_name}: cannot listen on {address} (in use?)"
        try:
            if tls is not None and tls.enabled:
                self.port = self.server.add_secure_port(address, tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio raises on a failed bind (older versions return port 0)
            raise SystemExit(f"{cannot_listen}: {exc}") from exc
        if not self.port:
            raise SystemExit(cannot_listen)
        await self.server.start()
        if self.options.health_port is not None:
            await self._start_health_server()
        await self.set_serving(False)
        await _maybe_await(self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING))
        if self.options.metrics_port is not None:
            http_server, _ = start_http_server(self.options.metrics_port, addr=self.options.host, registry=self.registry)
            self.metrics_port = http_server.server_port
        return self.port

    async def _start_health_server(self) -> None:
        """grpc.health.v1 alone on a plaintext port (the same servicer: the same statuses)."""
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        address = f"{self.options.host}:{self.options.health_port}"
        try:
            self.health_port = self.health_server.add_insecure_port(address)
        except RuntimeError as exc:
            raise SystemExit(f"{self.service_name}: cannot listen on {address} for health (in use?): {exc}") from exc
        if not self.health_port:
            raise SystemExit(f"{self.service_name}: cannot listen on {address} for health (in use?)")
        await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.service_name):
            await _maybe_await(self.health.set(name, status))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)

    async def wait_and_drain(self) -> None:
        """Block until SIGTERM/SIGINT (or ``request_stop``), then drain within the grace period."""
        await self._stopping.wait()
        await self.drain()

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop_requested(self) -> None:
        """Return once SIGTERM/SIGINT (or ``request_stop``) asked for a drain (other listeners of
        the service, such as the gateway's HTTP front, drain beside the gRPC server)."""
        await self._stopping.wait()

    async def drain(self) -> None:
        log.info("%s draining (grace %.1fs)", self.service_name, self.options.grace_s)
        await self.set_serving(False)
        await self.server.stop(self.options.grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


async def _maybe_await(value):
    if asyncio.iscoroutine(value):
        return await value
    return value
