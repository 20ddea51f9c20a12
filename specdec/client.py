"""A small Python client for the gateway (sync and asyncio). The CLI uses it.

    from specdec.client import GatewayClient
    with GatewayClient("localhost:50051") as client:
        for event in client.stream(prompt="Hello", max_new_tokens=32):
            print(event)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.rpc import convert
from specdec.rpc.server import channel_options
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

DEFAULT_GATEWAY = "localhost:50051"


@dataclass
class ChunkEvent:
    token_ids: list[int]
    text: str


@dataclass
class FinalEvent:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    chunks: int = 0


def build_request(
    prompt: str | None = None,
    messages: Sequence[tuple[str, str] | dict] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    method: str = "auto",
    num_draft_tokens: int = 0,
    draft_ahead: bool | None = None,
    request_id: str = "",
    cache_scope: str = "",
    auto_methods: Sequence[str] = (),
) -> gateway_pb2.GenerateRequest:
    """``draft_ahead``: None = the gateway's default; True/False = on/off for this request.
    ``cache_scope``: a scope of the suffix cache within this client's tenant; ``auto_methods``: what
    ``method="auto"`` may choose among (empty: every method the stack has)."""
    sampling = types_pb2.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, stop=list(stop), ignore_eos=ignore_eos
    )
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    request = gateway_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        speculation=gateway_pb2.SpeculationParams(
            method=method, num_draft_tokens=num_draft_tokens,
            draft_ahead={None: gateway_pb2.DRAFT_AHEAD_MODE_UNSPECIFIED, True: gateway_pb2.DRAFT_AHEAD_MODE_ON,
                         False: gateway_pb2.DRAFT_AHEAD_MODE_OFF}[draft_ahead],
            cache_scope=cache_scope, auto_methods=list(auto_methods),
        ),
    )
    if prompt is not None:
        request.prompt = prompt
    for message in messages or ():
        role, content = (message["role"], message["content"]) if isinstance(message, dict) else message
        request.messages.add(role=role, content=content)
    if prompt_token_ids is not None:
        request.prompt_token_ids.extend(prompt_token_ids)
    return request


def event_from_pb(response: gateway_pb2.GenerateResponse) -> ChunkEvent | FinalEvent:
    if response.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED:
        return FinalEvent(
            finish_reason=convert.FINISH_REASON_FROM_PB[response.finish_reason],
            prompt_tokens=response.usage.prompt_tokens,
            completion_tokens=response.usage.completion_tokens,
            stats=convert.stats_from_pb(response.stats),
            prompt_token_ids=list(response.prompt_token_ids),
        )
    return ChunkEvent(list(response.token_ids), response.text)


def fold(completion: Completion, event: ChunkEvent | FinalEvent) -> None:
    if isinstance(event, ChunkEvent):
        completion.token_ids.extend(event.token_ids)
        completion.text += event.text
        completion.chunks += 1
    else:
        completion.finish_reason = event.finish_reason
        completion.prompt_tokens = event.prompt_tokens
        completion.prompt_token_ids = event.prompt_token_ids
        completion.stats = event.stats


def _credentials(tls_ca, tls_cert, tls_key):
    if not (tls_ca or tls_cert):
        return None
    read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class GatewayClient:
    """Blocking client. TLS when ``tls_ca`` is given (mTLS with ``tls_cert``/``tls_key``)."""

    def __init__(self, address: str = DEFAULT_GATEWAY, timeout: float | None = None, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        credentials = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = (grpc.secure_channel(address, credentials, options=channel_options()) if credentials
                        else grpc.insecure_channel(address, options=channel_options()))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)

    def stream(self, *args, **kwargs) -> Iterator[ChunkEvent | FinalEvent]:
        for response in self.stub.Generate(build_request(*args, **kwargs), timeout=self.timeout, metadata=self.metadata):
            yield event_from_pb(response)

    def generate(self, *args, **kwargs) -> Completion:
        completion = Completion()
        for event in self.stream(*args, **kwargs):
            fold(completion, event)
        return completion

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncGatewayClient:
    """asyncio client."""

    def __init__(self, address: str = DEFAULT_GATEWAY, timeout: float | None = None, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        credentials = _credentials(tls_ca, tls_cert, tls_key)
        self.channel = (grpc.aio.secure_channel(address, credentials, options=channel_options()) if credentials
                        else grpc.aio.insecure_channel(address, options=channel_options()))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.timeout = timeout
        self.metadata = _metadata(api_key)

    async def stream(self, *args, **kwargs) -> AsyncIterator[ChunkEvent | FinalEvent]:
        async for response in self.stub.Generate(build_request(*args, **kwargs), timeout=self.timeout,
                                                 metadata=self.metadata):
            yield event_from_pb(response)

    async def generate(self, *args, **kwargs) -> Completion:
        completion = Completion()
        async for event in self.stream(*args, **kwargs):
            fold(completion, event)
        return completion

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
