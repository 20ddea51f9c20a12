"""The public Gateway service: validates a request, opens drafter and verifier sessions, runs the
speculative loop and streams committed tokens to the client."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from specdec.completion import CompletionBuilder
from specdec.drafters import NgramDrafter
from specdec.engine import GenerationResult, LocalDrafter, generate
from specdec.local import make_policy
from specdec.models import load_tokenizer, tokenizer_fingerprint
from specdec.prompts import encode_chat, encode_text
from specdec.rpc import convert
from specdec.rpc.server import NotReady, Overloaded, ServeOptions, ServiceRuntime, channel_options, map_errors
from specdec.rpc.sessions import ServiceMetrics
from specdec.sampling import with_random_seed
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from gateway.links import RemoteDrafter, RemoteVerifier

log = logging.getLogger("specdec.gateway")
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
METHODS = ("auto", "model", "ngram", "none")
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class GatewayLimits:
    max_sessions: int = 64
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 2048
    default_max_new_tokens: int = 128
    max_draft_tokens: int = 16
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_request_id_length: int = 256


@dataclass
class Backend:
    """One drafter or verifier replica and how many of this gateway's sessions it holds."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    in_flight: int = 0
    info: object = None


@dataclass
class BackendPool:
    backends: list[Backend] = field(default_factory=list)

    def pick(self, method: str | None = None) -> Backend | None:
        """Least-loaded ready replica (by this gateway's open sessions on it), of ``method`` if given."""
        ready = [b for b in self.backends if b.info is not None and (method is None or b.info.method == method)]
        return min(ready, key=lambda b: b.in_flight) if ready else None


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, runtime: ServiceRuntime, tokenizer, limits: GatewayLimits,
                 verifiers: BackendPool, drafters: BackendPool) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = len(tokenizer)
        self.limits = limits
        self.verifiers = verifiers
        self.drafters = drafters
        self.metrics = ServiceMetrics(runtime.registry, "gateway")
        self.active = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_positions = 1 << 30

    # -- startup -------------------------------------------------------------------------------
    async def connect(self, poll_s: float = 0.5) -> None:
        """Wait for every backend's info, check that its tokenizer matches, then serve."""
        pending = [(b, "verifier") for b in self.verifiers.backends] + [(b, "drafter") for b in self.drafters.backends]
        while pending:
            still = []
            for backend, role in pending:
                try:
                    request = verifier_pb2.GetVerifierInfoRequest() if role == "verifier" else drafter_pb2.GetDrafterInfoRequest()
                    info = await backend.stub.GetInfo(request, timeout=5)
                except grpc.aio.AioRpcError:
                    still.append((backend, role))
                    continue
                model = info.model
                if model.tokenizer_fingerprint and model.tokenizer_fingerprint != self.fingerprint:
                    raise SystemExit(f"{role} at {backend.address} serves {model.model!r} whose tokenizer differs from the gateway's")
                if role == "verifier":
                    self.eos_token_ids = tuple(model.eos_token_ids)
                    self.max_positions = min(self.max_positions, model.max_positions or self.max_positions)
                backend.info = info
                log.info("%s %s ready (%s)", role, backend.address, model.model or getattr(info, "method", ""))
            pending = still
            if pending:
                await asyncio.sleep(poll_s)
        await self.runtime.set_serving(True)

    # -- request validation ----------------------------------------------------------------------
    def _prompt_ids(self, request) -> list[int]:
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if (getattr(request, n) if n == "prompt" else len(getattr(request, n)))]
        if len(given) != 1:
            raise ValueError("input: set exactly one of prompt, messages, prompt_token_ids")
        if request.prompt:
            ids = encode_text(self.tokenizer, request.prompt)
        elif request.messages:
            for i, message in enumerate(request.messages):
                if message.role not in ROLES:
                    raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
            ids = encode_chat(self.tokenizer, [(m.role, m.content) for m in request.messages])
        else:
            ids = [int(t) for t in request.prompt_token_ids]
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: id {bad} is outside the vocabulary (size {self.vocab_size})")
        if not ids:
            raise ValueError(f"{given[0]}: encodes to no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ValueError(f"{given[0]}: {len(ids)} prompt tokens exceed the limit of {self.limits.max_prompt_tokens}")
        return ids

    def _validate(self, request):
        limits = self.limits
        if len(request.request_id) > limits.max_request_id_length:
            raise ValueError(f"request_id: longer than {limits.max_request_id_length} characters")
        sampling = request.sampling
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise ValueError(f"sampling.max_new_tokens: {sampling.max_new_tokens} exceeds the limit of {limits.max_new_tokens}")
        if len(sampling.stop) > limits.max_stop_strings or any(len(s) > limits.max_stop_length for s in sampling.stop):
            raise ValueError(f"sampling.stop: at most {limits.max_stop_strings} strings of <= {limits.max_stop_length} characters")
        if any(t >= self.vocab_size for t in sampling.stop_token_ids):
            raise ValueError("sampling.stop_token_ids: ids must be below the vocabulary size")
        params = with_random_seed(convert.sampling_from_pb(sampling, limits.default_max_new_tokens))
        method = request.speculation.method or "auto"
        if method not in METHODS:
            raise ValueError(f"speculation.method: {method!r} is not one of {', '.join(METHODS)}")
        if method == "model" and not any(b.info is not None and b.info.method == "model" for b in self.drafters.backends):
            raise ValueError("speculation.method: 'model' needs a model drafter service and none is configured")
        k = request.speculation.num_draft_tokens
        if k > limits.max_draft_tokens:
            raise ValueError(f"speculation.num_draft_tokens: {k} exceeds the limit of {limits.max_draft_tokens}")
        prompt_ids = self._prompt_ids(request)
        if len(prompt_ids) + 1 >= self.max_positions:
            raise ValueError("prompt: no room left in the model context")
        if method == "auto":
            ready = [b.info.method for b in self.drafters.backends if b.info is not None]
            method = "model" if "model" in ready else "ngram"
        return prompt_ids, params, method, k

    # -- the RPC ---------------------------------------------------------------------------------
    @map_errors
    async def Generate(self, request, context):
        try:
            prompt_ids, params, method, k = self._validate(request)
        except ValueError:
            self.metrics.rejected.labels("gateway", "INVALID_ARGUMENT").inc()
            raise
        if self.active >= self.limits.max_sessions:
            self.metrics.rejected.labels("gateway", "RESOURCE_EXHAUSTED").inc()
            raise Overloaded(f"gateway at capacity ({self.limits.max_sessions} concurrent requests)")
        verifier_backend = self.verifiers.pick()
        if verifier_backend is None:
            raise NotReady("no verifier is ready")
        request_id = request.request_id or uuid.uuid4().hex
        timeout = context.time_remaining()  # the client's deadline, passed on as remaining time
        self.active += 1
        self.metrics.active_sessions.set(self.active)
        self.metrics.requests.inc()
        verifier_backend.in_flight += 1
        verifier = RemoteVerifier(verifier_backend.stub, request_id, prompt_ids, params, timeout)
        drafter_link, drafter_backend, remote_drafter = None, None, None
        if method in ("model", "ngram"):
            # A drafter service of that method if one runs; n-gram lookup can also run right here.
            drafter_backend = self.drafters.pick(method)
            if drafter_backend is not None:
                drafter_backend.in_flight += 1
                remote_drafter = RemoteDrafter(drafter_backend.stub, request_id, prompt_ids, params, timeout)
                remote_drafter.begin()
                drafter_link = remote_drafter
            elif method == "ngram":
                drafter_link = LocalDrafter(NgramDrafter().start(prompt_ids, params))
        try:
            events = generate(
                prompt_tokens=len(prompt_ids),
                completion=CompletionBuilder(self.tokenizer, params, self.eos_token_ids),
                verifier=verifier,
                drafter=drafter_link,
                policy=make_policy(k),
                draft_method=method,
                max_context=self.max_positions,
            )
            async for event in events:
                if isinstance(event, GenerationResult):
                    self.metrics.draft_tokens.inc(event.stats.draft_tokens)
                    self.metrics.accepted_tokens.inc(event.stats.accepted_tokens)
                    yield gateway_pb2.GenerateResponse(
                        request_id=request_id,
                        prompt_token_ids=prompt_ids,
                        finish_reason=convert.FINISH_REASON_TO_PB[event.finish_reason],
                        usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=len(event.token_ids)),
                        stats=convert.stats_to_pb(event.stats),
                    )
                else:
                    self.metrics.tokens.inc(len(event.token_ids))
                    yield gateway_pb2.GenerateResponse(request_id=request_id, token_ids=event.token_ids, text=event.text)
        finally:
            # Finish, client cancel, deadline or error: release both downstream sessions.
            self.active -= 1
            self.metrics.active_sessions.set(self.active)
            verifier_backend.in_flight -= 1
            closers = [verifier.close()]
            if remote_drafter is not None:
                drafter_backend.in_flight -= 1
                closers.append(remote_drafter.close())
            await asyncio.shield(asyncio.gather(*closers, return_exceptions=True))


def make_pool(addresses: list[str], stub_cls, max_message_bytes: int) -> BackendPool:
    pool = BackendPool()
    for address in addresses:
        channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
        pool.backends.append(Backend(address=address, channel=channel, stub=stub_cls(channel)))
    return pool


async def serve(target: str, verifier_addresses: list[str], drafter_addresses: list[str],
                options: ServeOptions, limits: GatewayLimits) -> None:
    if not verifier_addresses:
        raise SystemExit("the gateway needs at least one --verifier address")
    runtime = ServiceRuntime(SERVICE_NAME, options)
    tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, target)
    service = GatewayService(
        runtime, tokenizer, limits,
        make_pool(verifier_addresses, verifier_pb2_grpc.VerifierStub, options.max_message_bytes),
        make_pool(drafter_addresses, drafter_pb2_grpc.DrafterStub, options.max_message_bytes),
    )
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, runtime.server)
    port = await runtime.start()
    runtime.install_signal_handlers()
    print(f"specdec gateway listening on {options.host}:{port}", flush=True)
    await service.connect()
    await runtime.wait_and_drain()
