"""TLS / mutual TLS for every hop, API keys at the gateway, service tokens inside.

One identity per service: its certificate and key serve its port and, for the gateway, identify
it to drafters and verifiers; one CA verifies peers. With ``client_auth`` a server refuses
clients without a certificate signed by the CA (mTLS). Paths, keys and tokens come from flags or
the environment, read in ``specdec.service_config``; this module only checks and uses them.

Clients authenticate to the gateway with API keys. Drafters and verifiers take calls only from a
gateway, which proves itself with credentials of its own, never a client's API key:

- a service token in the ``x-specdec-service-token`` metadata header (several accepted at once
  for rotation, the first is the one a gateway presents), compared in constant time; refused with
  UNAUTHENTICATED;
- with mTLS, an allow-list of peer identities (``--tls-allowed-peers``, matched against the
  client certificate's subject alternative names and common name), so that a certificate from
  the same CA that is not a gateway's is refused with PERMISSION_DENIED.

Health and reflection stay open (probes, grpcurl ``list``).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("specdec.security")

# Calls that must work without credentials: probes and discovery of the API.
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
SERVICE_TOKEN_HEADER = "x-specdec-service-token"
MIN_SERVICE_TOKEN_LENGTH = 16
# auth_context() entries that name the peer's certificate (never ssl_requested_server_name: that
# is the name the client asked for, not who it is).
PEER_IDENTITY_KEYS = ("x509_subject_alternative_name", "x509_common_name", "peer_dns", "peer_spiffe_id")


@dataclass(frozen=True)
class TLSConfig:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_auth: bool = False  # require and verify client certificates (mTLS)

    @property
    def enabled(self) -> bool:
        return self.cert is not None and self.key is not None

    @staticmethod
    def from_sources(cert=None, key=None, ca=None, client_auth: bool = False) -> "TLSConfig":
        """From paths (None or empty: not given); SystemExit for a combination that cannot work."""
        config = TLSConfig(*(Path(path) if path else None for path in (cert, key, ca)), client_auth)
        if (config.cert is None) != (config.key is None):
            raise SystemExit("TLS needs both a certificate and a key")
        if config.client_auth and config.ca is None:
            raise SystemExit("mutual TLS (client auth) needs --tls-ca to verify client certificates")
        return config

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = self.ca.read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for calling another service: trust the CA, present our own certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )

    @property
    def secures_channels(self) -> bool:
        return self.ca is not None or self.enabled


def load_api_keys(path: str | None = None, listed: str = "") -> list[bytes]:
    """Keys from a file (one per line) and ``listed`` (comma-separated). [] = open."""
    keys: list[str] = []
    if path:
        keys += [line.strip() for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]
    keys += [k.strip() for k in listed.split(",") if k.strip()]
    return [k.encode() for k in keys]


def presented_key(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip().encode()
        if key == "x-api-key":
            return value.strip().encode()
    return None


def tenant_of(presented: bytes | None, keys_checked: bool) -> str:
    """Who a request's text belongs to, for what the gateway remembers across requests (the suffix
    cache): a digest of the API key it presented when the gateway checks keys (never the key
    itself), else "" (one tenant: without keys the gateway cannot tell clients apart)."""
    if not keys_checked or presented is None:
        return ""
    return hashlib.sha256(b"specdec-tenant\0" + presented).hexdigest()[:32]


def key_is_valid(presented: bytes | None, keys: list[bytes]) -> bool:
    """Constant-time over every configured key (no early exit that would leak which matched)."""
    if presented is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


def load_service_tokens(path: str | None = None, listed: str = "") -> list[bytes]:
    """Service tokens from a file (one per line, ``#`` comments) and ``listed`` (comma-separated), in
    that order. The first is the one a gateway presents; drafters and verifiers accept any. [] = none set."""
    tokens: list[str] = []
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SystemExit(f"cannot read the service token file {path}: {exc}") from exc
        tokens += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not tokens:
            raise SystemExit(f"the service token file {path} holds no token")
    tokens += [t.strip() for t in listed.split(",") if t.strip()]
    for token in tokens:
        if len(token) < MIN_SERVICE_TOKEN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
            raise SystemExit(f"a service token must be at least {MIN_SERVICE_TOKEN_LENGTH} printable ASCII characters "
                             "without spaces; generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return [t.encode() for t in tokens]


def parse_allowed_peers(values=()) -> tuple[str, ...]:
    """Peer identities from comma-separated ``values``."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


def peer_host(peer: str) -> str:
    """The client host of a gRPC ``context.peer()`` string: ``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``,
    ``ipv6:[::1]:51234`` (or its percent-encoded form) -> ``ipv6:[::1]``. Other transports (``unix:``)
    are kept whole: they name no port."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return f"{scheme}:{rest.rpartition(':')[0]}"
    return peer


def presented_service_token(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == SERVICE_TOKEN_HEADER:
            return (value if isinstance(value, bytes) else value.strip().encode())
    return None


def peer_identities(auth_context: dict) -> set[str]:
    """The names a TLS peer's certificate carries (SANs, common name); empty without a certificate."""
    return {value.decode(errors="replace") for key in PEER_IDENTITY_KEYS for value in auth_context.get(key, ())}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid API key with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_METHODS) or key_is_valid(presented_key(handler_call_details.invocation_metadata), self.keys):
            return await continuation(handler_call_details)
        return _deny_handler(await continuation(handler_call_details))


class ServiceAuthInterceptor(grpc.aio.ServerInterceptor):
    """Drafters and verifiers: refuse calls that are not from a gateway.

    ``service_tokens``: a call must carry one in ``x-specdec-service-token`` (UNAUTHENTICATED otherwise).
    ``allowed_peers``: the client certificate (mTLS) must name one of these in its subject
    alternative names or common name (PERMISSION_DENIED otherwise). Health and reflection stay open.
    """

    def __init__(self, service_tokens: list[bytes] | tuple[bytes, ...] = (), allowed_peers: tuple[str, ...] = ()) -> None:
        self.service_tokens = list(service_tokens)
        self.allowed_peers = frozenset(allowed_peers)
        self._refusals = _RefusalLog()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(UNAUTHENTICATED_METHODS):
            return handler
        if self.service_tokens and not key_is_valid(presented_service_token(handler_call_details.invocation_metadata),
                                                   self.service_tokens):
            return _deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 f"missing or invalid service token ({SERVICE_TOKEN_HEADER}): this service takes "
                                 "calls from a specdec gateway only", self._refusals, method)
        if self.allowed_peers:
            return _with_peer_check(handler, self.allowed_peers, self._refusals, method)
        return handler


class _RefusalLog:
    """One WARNING per refused caller and reason per minute (a scanner must not flood the log)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}

    def note(self, context, method: str, reason: str) -> None:
        host = peer_host(context.peer())
        now = time.monotonic()
        if now - self._last.get((host, reason), -self.every_s) >= self.every_s:
            if len(self._last) > 1024:
                self._last.clear()
            self._last[(host, reason)] = now
            log.warning("refused %s from %s: %s", method, context.peer(), reason)


def _with_peer_check(handler: grpc.RpcMethodHandler, allowed: frozenset[str], refusals: _RefusalLog,
                     method: str) -> grpc.RpcMethodHandler:
    """``handler`` run only for peers whose certificate names one of ``allowed`` (the auth context
    exists only inside a call, so the check wraps the handler rather than deciding up front)."""

    async def check(context) -> None:
        names = peer_identities(context.auth_context())
        if names & allowed:
            return
        shown = ", ".join(sorted(names)) or "no client certificate"
        reason = f"peer ({shown}) is not an allowed caller ({', '.join(sorted(allowed))})"
        refusals.note(context, method, reason)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{reason}: this service takes calls from a specdec gateway only")

    def wrap(behavior, response_streaming: bool):
        if response_streaming and inspect.isasyncgenfunction(behavior):
            async def guarded_stream(request, context):
                await check(context)
                async for response in behavior(request, context):
                    yield response

            return guarded_stream

        async def guarded(request, context):
            await check(context)
            return await behavior(request, context)

        return guarded

    serdes = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), *serdes)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), *serdes)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), *serdes)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), *serdes)


def _deny_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
                  message: str = "missing or invalid API key", refusals: "_RefusalLog | None" = None,
                  method: str = "") -> grpc.RpcMethodHandler:
    async def deny(request, context):
        if refusals is not None:
            refusals.note(context, method, message.split(":")[0])
        await context.abort(code, message)

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - abort raises

    # No request deserializer: a refused call's request is never parsed (a caller without
    # credentials costs no parsing, and bytes that do not parse cannot turn the refusal into UNKNOWN).
    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, None, handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(deny_stream, None, handler.response_serializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, None, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny, None, handler.response_serializer if handler else None)


def with_service_token(channel: grpc.aio.Channel, token: str | bytes | None) -> grpc.aio.Channel:
    """``channel`` with ``x-specdec-service-token: token`` added to every call made on it (a stub
    built on it cannot forget the token). None: the channel as is."""
    if not token:
        return channel
    return _MetadataChannel(channel, ((SERVICE_TOKEN_HEADER, token.decode() if isinstance(token, bytes) else token),))


def _with_metadata(metadata, extra: tuple[tuple[str, str], ...]):
    names = {key for key, _ in extra}
    if metadata is None:
        return extra
    if isinstance(metadata, grpc.aio.Metadata):
        merged = grpc.aio.Metadata(*((k, v) for k, v in metadata if k not in names))
        for key, value in extra:
            merged.add(key, value)
        return merged
    return tuple((k, v) for k, v in metadata if k not in names) + extra


class _MetadataMultiCallable:
    """A multicallable that adds fixed metadata to each call and is otherwise the original (the
    call objects are grpc's own: no interceptor task or request queue in the streams' path)."""

    def __init__(self, inner, extra: tuple[tuple[str, str], ...], metadata_position: int) -> None:
        self._inner = inner
        self._extra = extra
        self._position = metadata_position  # where metadata sits among positional arguments

    def __call__(self, *args, **kwargs):
        if len(args) > self._position:
            args = (*args[:self._position], _with_metadata(args[self._position], self._extra), *args[self._position + 1:])
        else:
            kwargs["metadata"] = _with_metadata(kwargs.get("metadata"), self._extra)
        return self._inner(*args, **kwargs)


class _MetadataChannel(grpc.aio.Channel):
    """A grpc.aio channel whose calls all carry ``extra`` metadata.

    Not a client interceptor on purpose: grpc.aio's intercepted stream calls feed ``write()``
    through a queue and a task of their own and report a write on a finished stream as
    InvalidStateError instead of the RPC's error, which would change what the gateway's links
    see on their hot path. Here the calls are grpc's own.
    """

    def __init__(self, channel: grpc.aio.Channel, extra: tuple[tuple[str, str], ...]) -> None:
        self._channel = channel
        self._extra = extra

    # unary requests: (request, *, timeout, metadata, ...): metadata only by keyword;
    # streamed requests: (request_iterator, timeout, metadata, ...): third positionally.
    def unary_unary(self, *args, **kwargs):
        return _MetadataMultiCallable(self._channel.unary_unary(*args, **kwargs), self._extra, 1)

    def unary_stream(self, *args, **kwargs):
        return _MetadataMultiCallable(self._channel.unary_stream(*args, **kwargs), self._extra, 1)

    def stream_unary(self, *args, **kwargs):
        return _MetadataMultiCallable(self._channel.stream_unary(*args, **kwargs), self._extra, 2)

    def stream_stream(self, *args, **kwargs):
        return _MetadataMultiCallable(self._channel.stream_stream(*args, **kwargs), self._extra, 2)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, exc_type, exc_val, exc_tb):
        return await self._channel.__aexit__(exc_type, exc_val, exc_tb)

    async def close(self, grace: float | None = None):
        return await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False):
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state):
        return await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        return await self._channel.channel_ready()
