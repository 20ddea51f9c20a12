"""The public Gateway service: validates a request, opens drafter and verifier sessions, runs the
speculative loop and streams committed tokens to the client."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

import grpc

from specdec import telemetry
from specdec.completion import CompletionBuilder
from specdec.drafters import NgramDrafter
from specdec.engine import GenerationResult, LocalDrafter, generate
from specdec.models import load_tokenizer, tokenizer_fingerprint
from specdec.policy import AcceptanceMemory, make_policy
from specdec.prompts import encode_chat, encode_text
from specdec.rpc import convert
from specdec.rpc.server import NotReady, Overloaded, ServeOptions, ServiceRuntime, map_errors, open_channel
from specdec.sampling import with_random_seed
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from gateway.links import MigratingVerifier, RemoteDrafter

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
class LinkOptions:
    """How the gateway drives its downstream streams."""

    draft_ahead: bool = False  # default for requests that leave speculation.draft_ahead unspecified
    net_delay_s: float = 0.0  # injected one-way delay per message (benchmarks of cross-machine links)


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

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_active + self.opened_since_report)


class BackendPool:
    """The replicas of one role: static addresses or a live EndpointSlice set, refreshed by GetInfo."""

    def __init__(self, role: str, stub_cls, max_message_bytes: int, tls=None) -> None:
        self.role = role
        self.tls = tls
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
            channel = open_channel(address, self.tls, self.max_message_bytes)
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
            except grpc.aio.AioRpcError:
                backend.info = None
                return
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


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, runtime: ServiceRuntime, tokenizer, limits: GatewayLimits,
                 verifiers: BackendPool, drafters: BackendPool, link_options: LinkOptions | None = None) -> None:
        self.runtime = runtime
        self.link_options = link_options or LinkOptions()
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = len(tokenizer)
        self.limits = limits
        self.verifiers = verifiers
        self.drafters = drafters
        self.telemetry = telemetry.current()
        self.metrics = telemetry.ServiceMetrics(runtime.registry, "gateway", self.telemetry)
        self.genai_metrics = telemetry.GenAIMetrics(runtime.registry, self.telemetry)
        self.model_name = ""  # gen_ai.request.model: the gateway's --target
        self.active = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_positions = 1 << 30
        # Warm starts for adaptive draft lengths, per (draft method, draft model, target model).
        self.acceptance_memory = AcceptanceMemory()

    # -- startup -------------------------------------------------------------------------------
    async def connect(self, poll_s: float = 0.5, refresh_s: float = 2.0, startup_wait_s: float = 15.0) -> None:
        """Serve once every configured replica is ready (or, after ``startup_wait_s``, once any
        verifier is); then keep every replica's readiness and load fresh."""
        self.verifiers.fingerprint = self.drafters.fingerprint = self.fingerprint
        serving = False
        started = asyncio.get_running_loop().time()
        while True:
            await asyncio.gather(self.verifiers.refresh(), self.drafters.refresh())
            ready = self.verifiers.ready()
            if ready:
                model = ready[0].info.model
                self.eos_token_ids = tuple(model.eos_token_ids)
                self.max_positions = model.max_positions or self.max_positions
            all_ready = all(b.info is not None for b in self.verifiers.backends + self.drafters.backends)
            waited = asyncio.get_running_loop().time() - started > startup_wait_s
            should_serve = bool(ready) and (serving or all_ready or waited)
            if should_serve != serving:
                serving = should_serve
                await self.runtime.set_serving(serving)
            await asyncio.sleep(refresh_s if serving and all_ready else poll_s)

    # -- request validation ----------------------------------------------------------------------
    def _prompt_ids(self, request) -> list[int]:
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(request, n)]
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
        if method == "model" and not self.drafters.backends:
            raise ValueError("speculation.method: 'model' needs a drafter service and none is configured")
        k = request.speculation.num_draft_tokens
        if k > limits.max_draft_tokens:
            raise ValueError(f"speculation.num_draft_tokens: {k} exceeds the limit of {limits.max_draft_tokens}")
        prompt_ids = self._prompt_ids(request)
        if len(prompt_ids) + 1 >= self.max_positions:
            raise ValueError("prompt: no room left in the model context")
        if method == "auto":
            method = "model" if self.drafters.ready("model") else "ngram"
        mode = request.speculation.draft_ahead
        if mode not in gateway_pb2.DraftAheadMode.values():
            raise ValueError(f"speculation.draft_ahead: unknown value {mode}")
        draft_ahead = self.link_options.draft_ahead if mode == gateway_pb2.DRAFT_AHEAD_MODE_UNSPECIFIED \
            else mode == gateway_pb2.DRAFT_AHEAD_MODE_ON
        return prompt_ids, params, method, k, draft_ahead

    # -- the RPC ---------------------------------------------------------------------------------
    @map_errors
    async def Generate(self, request, context):
        operation = "chat" if len(request.messages) else "text_completion"
        obs = telemetry.RequestTelemetry(self.telemetry, self.genai_metrics, operation, self.model_name)
        try:
            async for response in self._generate(request, context, obs):
                yield response
        except BaseException as exc:
            obs.fail(exc)
            raise
        finally:
            obs.end()

    async def _generate(self, request, context, obs: telemetry.RequestTelemetry):
        try:
            prompt_ids, params, method, k, draft_ahead = self._validate(request)
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
        obs.begin(request_id=request_id, params=params, prompt_tokens=len(prompt_ids), method=method, requested_k=k)
        metadata = obs.metadata()  # W3C trace context for both downstream streams (None: tracing off)
        self.active += 1
        self.metrics.active_sessions.set(self.active)
        self.metrics.requests.inc()
        links = self.link_options
        verifier = MigratingVerifier(self.verifiers, verifier_backend, request_id, prompt_ids, params,
                                     context.time_remaining, metadata, links.net_delay_s)
        # A drafter service of that method if one runs; n-gram lookup can also run right here.
        drafter_backend = self.drafters.pick(method) if method in ("model", "ngram") else None
        drafter_link, remote_drafter = None, None
        draft_model = drafter_backend.info.model.model if drafter_backend is not None else ""
        policy = make_policy(k, memory=self.acceptance_memory, max_k=self.limits.max_draft_tokens,
                             key=AcceptanceMemory.make_key(method, draft_model, verifier_backend.info.model.model),
                             forward_curve=list(verifier_backend.info.forward_cost_s) or None,
                             co_batched=max(0, verifier_backend.load - 1))  # its other sessions, this one opened
        if drafter_backend is not None:
            drafter_backend.in_flight += 1
            remote_drafter = RemoteDrafter(drafter_backend.stub, request_id, prompt_ids, params,
                                           context.time_remaining, metadata, net_delay_s=links.net_delay_s)
            if policy.expects_to_draft():
                # The drafter's prefill overlaps the verifier's. When plain decoding is expected to
                # win (what this draft pair measured before), the session opens at the first
                # proposal instead: its prefill then cannot delay the first token.
                remote_drafter.begin()
            obs.drafter_opened_at_prefill(remote_drafter.started)
            drafter_link = remote_drafter
        elif method == "ngram":
            drafter_link = LocalDrafter(NgramDrafter().start(prompt_ids, params))
        obs.links(verifier, drafter_link, verifier_backend.address,
                  drafter_backend.address if drafter_backend is not None else None,
                  (drafter_backend.info.model.model or None) if drafter_backend is not None else None)
        try:
            obs.generation_started()
            events = generate(
                prompt_tokens=len(prompt_ids),
                completion=CompletionBuilder(self.tokenizer, params, self.eos_token_ids),
                verifier=verifier,
                drafter=drafter_link,
                policy=policy,
                draft_method=method,
                max_context=self.max_positions,
                on_round=obs.on_round,
                draft_ahead=(remote_drafter is not None and draft_ahead
                             and drafter_backend.info is not None and drafter_backend.info.supports_draft_ahead),
            )
            async for event in events:
                if isinstance(event, GenerationResult):
                    obs.finish(event)
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
            if log.isEnabledFor(logging.DEBUG) and hasattr(policy, "estimates"):
                log.debug("request %s: draft-length model at the end %s", request_id, policy.estimates(4))
            policy.close()
            self.active -= 1
            self.metrics.active_sessions.set(self.active)
            closers = [verifier.close()]
            if remote_drafter is not None:
                drafter_backend.in_flight -= 1
                closers.append(remote_drafter.close())
            await asyncio.shield(asyncio.gather(*closers, return_exceptions=True))


async def serve(target: str, verifier_addresses: list[str], drafter_addresses: list[str],
                options: ServeOptions, limits: GatewayLimits, discover_verifiers: str | None = None,
                discover_drafters: str | None = None, namespace: str | None = None,
                link_options: LinkOptions | None = None) -> None:
    if not verifier_addresses and not discover_verifiers:
        raise SystemExit("the gateway needs --verifier addresses or --discover-verifiers SERVICE")
    runtime = ServiceRuntime(SERVICE_NAME, options)
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, load_tokenizer, target)
    verifiers = BackendPool("verifier", verifier_pb2_grpc.VerifierStub, options.max_message_bytes, options.tls)
    drafters = BackendPool("drafter", drafter_pb2_grpc.DrafterStub, options.max_message_bytes, options.tls)
    verifiers.set_addresses(verifier_addresses)
    drafters.set_addresses(drafter_addresses)
    watchers = []
    if discover_verifiers or discover_drafters:
        from gateway.discovery import EndpointSliceWatcher, discovery_api

        api = discovery_api()
        namespace = namespace or _pod_namespace()
        for service_name, pool in ((discover_verifiers, verifiers), (discover_drafters, drafters)):
            if service_name:
                watcher = EndpointSliceWatcher(
                    api, namespace, service_name,
                    on_change=lambda addresses, pool=pool: loop.call_soon_threadsafe(pool.set_addresses, addresses),
                )
                watcher.start()
                watchers.append(watcher)
    service = GatewayService(runtime, tokenizer, limits, verifiers, drafters, link_options)
    service.model_name = target
    gateway_pb2_grpc.add_GatewayServicer_to_server(service, runtime.server)
    port = await runtime.start()
    runtime.install_signal_handlers()
    print(f"specdec gateway listening on {options.host}:{port}", flush=True)
    connector = asyncio.ensure_future(service.connect())
    try:
        await runtime.wait_and_drain()
    finally:
        connector.cancel()
        for watcher in watchers:
            watcher.stop()


def _pod_namespace() -> str:
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "default"
