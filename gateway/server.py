"""The public Gateway service: validates a request, opens drafter and verifier sessions, runs the
speculative loop and streams committed tokens to the client."""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
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
from gateway.requests import UndecodableRequest, add_gateway_service

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
    # Checked before tokenizing (what the event loop can afford for any request): the prompt's
    # characters, or the message contents' in all; None = 16 per prompt token (a token of real text
    # averages about 4), so a prompt far past max_prompt_tokens is refused without tokenizing it.
    max_prompt_chars: int | None = None
    max_stop_token_ids: int = 256
    # A request that arrives while no verifier is ready (one restarting, a rollout) waits this long,
    # within its deadline, for one instead of failing at once.
    verifier_wait_s: float = 30.0

    @property
    def prompt_chars(self) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 16 * self.max_prompt_tokens


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
        self.waiting = 0  # requests admitted that wait for a ready verifier (they count against max_sessions)
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_positions = 1 << 30
        # Warm starts for adaptive draft lengths, per (draft method, draft model, target model).
        self.acceptance_memory = AcceptanceMemory()
        # Tokenizing (up to limits.prompt_chars characters) runs here, never on the event loop, so
        # a long prompt cannot stall the other streams. One thread: the tokenizer is shared.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize")

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
    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _input(self, request):
        """The request's input, checked for size before any tokenizing: ``("prompt", text)``,
        ``("messages", [(role, content)])`` or ``("prompt_token_ids", ids)``."""
        limits = self.limits
        text = request.prompt  # (each access to a string field builds a new str: once)
        inputs = (("prompt", text), ("messages", request.messages), ("prompt_token_ids", request.prompt_token_ids))
        given = [name for name, value in inputs if len(value)]
        if len(given) != 1:
            raise ValueError("input: set exactly one of prompt, messages, prompt_token_ids")
        if given[0] == "prompt":
            if len(text) > limits.prompt_chars:
                raise ValueError(f"prompt: {len(text)} characters exceed the limit of {limits.prompt_chars}")
            return "prompt", text
        if given[0] == "messages":
            if len(request.messages) > limits.max_prompt_tokens:  # each message costs tokens
                raise ValueError(f"messages: {len(request.messages)} messages exceed the limit of {limits.max_prompt_tokens}")
            messages, chars = [], 0
            for i, message in enumerate(request.messages):
                role, content = message.role, message.content
                if role not in ROLES:
                    raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
                chars += len(content)
                messages.append((role, content))
            if chars > limits.prompt_chars:
                raise ValueError(f"messages: {chars} characters of content exceed the limit of {limits.prompt_chars}")
            return "messages", messages
        if len(request.prompt_token_ids) > limits.max_prompt_tokens:
            raise ValueError(f"prompt_token_ids: {len(request.prompt_token_ids)} prompt tokens exceed the limit "
                             f"of {limits.max_prompt_tokens}")
        ids = [int(t) for t in request.prompt_token_ids]
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: id {bad} is outside the vocabulary (size {self.vocab_size})")
        return "prompt_token_ids", ids

    async def _prompt_ids(self, field: str, value) -> list[int]:
        """Token ids of an input from ``_input``; tokenizing runs off the event loop."""
        if field == "prompt":
            ids = await self._off_loop(encode_text, self.tokenizer, value)
        elif field == "messages":
            try:
                ids = await self._off_loop(encode_chat, self.tokenizer, value)
            except ValueError:
                raise
            except Exception as exc:
                if type(exc).__module__.startswith("jinja2"):  # the template refused them (raise_exception)
                    raise ValueError(f"messages: {exc}") from exc
                raise
        else:
            ids = value
        if not ids:
            raise ValueError(f"{field}: encodes to no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ValueError(f"{field}: {len(ids)} prompt tokens exceed the limit of {self.limits.max_prompt_tokens}")
        if len(ids) + 1 >= self.max_positions:
            raise ValueError(f"{field}: no room left in the model context")
        return ids

    def _validate(self, request):
        """Every check that costs next to nothing (sizes included); tokenizing comes after."""
        limits = self.limits
        if len(request.request_id) > limits.max_request_id_length:
            raise ValueError(f"request_id: longer than {limits.max_request_id_length} characters")
        sampling = request.sampling
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise ValueError(f"sampling.max_new_tokens: {sampling.max_new_tokens} exceeds the limit of {limits.max_new_tokens}")
        if len(sampling.stop) > limits.max_stop_strings or any(len(s) > limits.max_stop_length for s in sampling.stop):
            raise ValueError(f"sampling.stop: at most {limits.max_stop_strings} strings of <= {limits.max_stop_length} characters")
        if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
            raise ValueError(f"sampling.stop_token_ids: at most {limits.max_stop_token_ids} ids")
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
        mode = request.speculation.draft_ahead
        if mode not in gateway_pb2.DraftAheadMode.values():
            raise ValueError(f"speculation.draft_ahead: unknown value {mode}")
        draft_ahead = self.link_options.draft_ahead if mode == gateway_pb2.DRAFT_AHEAD_MODE_UNSPECIFIED \
            else mode == gateway_pb2.DRAFT_AHEAD_MODE_ON
        field, value = self._input(request)
        return (field, value), params, method, k, draft_ahead

    def _admit(self) -> None:
        if self.active + self.waiting >= self.limits.max_sessions:
            self.metrics.rejected.labels("gateway", "RESOURCE_EXHAUSTED").inc()
            raise Overloaded(f"gateway at capacity ({self.limits.max_sessions} concurrent requests)")

    # -- the RPC ---------------------------------------------------------------------------------
    @map_errors
    async def Generate(self, request, context):
        if isinstance(request, UndecodableRequest):  # bytes that do not parse (see gateway/requests.py)
            self.metrics.rejected.labels("gateway", "INVALID_ARGUMENT").inc()
            raise ValueError(await self._off_loop(request.explain))
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

    async def _wait_for_verifier(self, context, poll_s: float = 0.1) -> None:
        """Wait, up to ``verifier_wait_s`` and the request's deadline, until a verifier is ready: a
        restart or a rollout then delays requests instead of failing them. UNAVAILABLE after that."""
        if self.verifiers.ready():
            return
        remaining = context.time_remaining()
        wait_s = self.limits.verifier_wait_s if remaining is None else min(self.limits.verifier_wait_s, remaining)
        deadline = asyncio.get_running_loop().time() + wait_s
        self.waiting += 1
        try:
            while not self.verifiers.ready():
                if asyncio.get_running_loop().time() >= deadline:
                    raise NotReady(f"no verifier is ready (waited {wait_s:.0f} s)")
                await asyncio.sleep(poll_s)
        finally:
            self.waiting -= 1

    async def _generate(self, request, context, obs: telemetry.RequestTelemetry):
        try:
            prompt_input, params, method, k, draft_ahead = self._validate(request)
        except ValueError:
            self.metrics.rejected.labels("gateway", "INVALID_ARGUMENT").inc()
            raise
        self._admit()  # before tokenizing: a full gateway refuses at once
        try:
            prompt_ids = await self._prompt_ids(*prompt_input)
        except ValueError:
            self.metrics.rejected.labels("gateway", "INVALID_ARGUMENT").inc()
            raise
        if method == "auto":
            method = "model" if self.drafters.ready("model") else "ngram"
        await self._wait_for_verifier(context)
        self._admit()  # again: others may have been admitted meanwhile (no await from here to active += 1)
        verifier_backend = self.verifiers.pick()
        if verifier_backend is None:
            raise NotReady("no verifier is ready")
        request_id = request.request_id or uuid.uuid4().hex
        # Downstream session ids are ours, unguessable, never the client's request_id (which another
        # client could choose too, or use to cancel a session that is not its own).
        verifier_session, drafter_session = uuid.uuid4().hex, uuid.uuid4().hex
        obs.begin(request_id=request_id, params=params, prompt_tokens=len(prompt_ids), method=method, requested_k=k)
        metadata = obs.metadata()  # W3C trace context for both downstream streams (None: tracing off)
        self.active += 1
        self.metrics.active_sessions.set(self.active)
        self.metrics.requests.inc()
        links = self.link_options
        verifier = MigratingVerifier(self.verifiers, verifier_backend, verifier_session, prompt_ids, params,
                                     context.time_remaining, metadata, links.net_delay_s, request_id=request_id)
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
            remote_drafter = RemoteDrafter(drafter_backend.stub, drafter_session, prompt_ids, params,
                                           context.time_remaining, metadata, net_delay_s=links.net_delay_s,
                                           request_id=request_id)
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
        log.info("request %s: verifier session %s on %s, drafter session %s", request_id, verifier_session,
                  verifier_backend.address, f"{drafter_session} on {drafter_backend.address}" if remote_drafter else "none")
        if obs.span is not None:
            obs.span.set_attribute("specdec.verifier.session_id", verifier_session)
            if remote_drafter is not None:
                obs.span.set_attribute("specdec.drafter.session_id", drafter_session)
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
    verifiers = BackendPool("verifier", verifier_pb2_grpc.VerifierStub, options.max_message_bytes, options.tls,
                            options.outbound_service_token)
    drafters = BackendPool("drafter", drafter_pb2_grpc.DrafterStub, options.max_message_bytes, options.tls,
                           options.outbound_service_token)
    verifiers.set_addresses(verifier_addresses)
    drafters.set_addresses(drafter_addresses)
    watchers = []
    if discover_verifiers or discover_drafters:
        from gateway.discovery import EndpointSliceWatcher, discovery_api

        api = discovery_api()
        namespace = namespace or _pod_namespace()
        for service_name, pool in ((discover_verifiers, verifiers), (discover_drafters, drafters)):
            if service_name:
                # Discovered replicas are pod IPs: their certificates name the Service instead.
                pool.server_name = f"{service_name}.{namespace}.svc"
                watcher = EndpointSliceWatcher(
                    api, namespace, service_name,
                    on_change=lambda addresses, pool=pool: loop.call_soon_threadsafe(pool.set_addresses, addresses),
                )
                watcher.start()
                watchers.append(watcher)
    service = GatewayService(runtime, tokenizer, limits, verifiers, drafters, link_options)
    service.model_name = target
    add_gateway_service(service, runtime.server)  # Generate with a deserializer that tolerates bad bytes
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
