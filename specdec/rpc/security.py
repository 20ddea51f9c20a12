"""TLS / mutual TLS for every hop, and API keys at the gateway.

One identity per service: its certificate and key serve its port and, for the gateway, identify
it to drafters and verifiers; one CA verifies peers. With ``client_auth`` a server refuses
clients without a certificate signed by the CA (mTLS). Paths come from flags or the
``SPECDEC_TLS_CERT`` / ``SPECDEC_TLS_KEY`` / ``SPECDEC_TLS_CA`` environment variables.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

# Calls that must work without credentials: probes and discovery of the API.
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


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
        def pick(value, env):
            value = value or os.environ.get(env)
            return Path(value) if value else None

        config = TLSConfig(pick(cert, "SPECDEC_TLS_CERT"), pick(key, "SPECDEC_TLS_KEY"), pick(ca, "SPECDEC_TLS_CA"),
                           client_auth or os.environ.get("SPECDEC_TLS_CLIENT_AUTH", "") in ("1", "true"))
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


def load_api_keys(path: str | None = None) -> list[bytes]:
    """Keys from a file (one per line) or ``SPECDEC_API_KEYS`` (comma-separated). None = open."""
    keys: list[str] = []
    path = path or os.environ.get("SPECDEC_API_KEYS_FILE")
    if path:
        keys += [line.strip() for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]
    keys += [k.strip() for k in os.environ.get("SPECDEC_API_KEYS", "").split(",") if k.strip()]
    return [k.encode() for k in keys]


def presented_key(metadata) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip().encode()
        if key == "x-api-key":
            return value.strip().encode()
    return None


def key_is_valid(presented: bytes | None, keys: list[bytes]) -> bool:
    """Constant-time over every configured key (no early exit that would leak which matched)."""
    if presented is None:
        return False
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid API key with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_METHODS) or key_is_valid(presented_key(handler_call_details.invocation_metadata), self.keys):
            return await continuation(handler_call_details)
        return _deny_handler(await continuation(handler_call_details))


def _deny_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        yield  # pragma: no cover - abort raises

    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer, handler.response_serializer)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        deny, handler.request_deserializer if handler else None, handler.response_serializer if handler else None
    )
