"""The gateway's request path, shared by its two fronts: the gRPC ``Generate`` (``gateway/server.py``)
and the OpenAI-compatible HTTP API (``gateway/http.py``).

Each front translates its wire format into a ``GenerationRequest`` at its edge; here the request is
validated (``FieldError`` naming the field, in the gRPC API's names: ``sampling.temperature``),
admitted, tokenized off the event loop, and generated over a verifier and a drafter session. The
front turns the events (``Chunk`` ... ``Finished``) back into its wire format. Nothing here builds a
protobuf.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdec import telemetry
from specdec.completion import Chunk, CompletionBuilder
from specdec.drafting import NgramDrafter
from specdec.engine import GenerationResult, LocalDrafter, generate
from specdec.policy import AcceptanceMemory, make_policy
from specdec.policy.method_choice import MethodChooser
from specdec.prompts import encode_chat, encode_text
from specdec.rpc.server import NotReady, Overloaded, ServiceRuntime
from specdec.suffix import MAX_CACHE_SCOPE_LENGTH, SuffixConfig, SuffixDrafter, cache_scope_key
from specdec.telemetry.logs import printable
from specdec.tokenizer import tokenizer_fingerprint
from specdec.wire_types import MAX_NEW_TOKENS_CAP, FieldError, SamplingParams, is_utf8, with_random_seed

from gateway.links import RemoteDrafter
from gateway.migration import MigratingVerifier
from gateway.pools import ReplicaPool

log = logging.getLogger("specdec.gateway")
METHODS = ("auto", "model", "eagle", "ngram", "suffix", "none")
DRAFTING_METHODS = ("model", "eagle", "ngram", "suffix")  # what ``auto_methods`` may name
# What "auto" chooses among, in this order while unmeasured (``MethodChooser``): a draft model or
# an EAGLE head (a ready drafter service of the method) and suffix lookup (here, or a drafter
# service of it); n-gram lookup only when a request's auto_methods leave nothing else.
AUTO_DRAFT_METHODS = ("model", "eagle", "suffix")
REMOTE_ONLY_METHODS = ("model", "eagle")  # the methods only a drafter service drafts
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system messages (both fronts take it)


@dataclass
class GatewayLimits:
    max_sessions: int = 64
    max_prompt_tokens: int = 4096
    max_new_tokens: int = MAX_NEW_TOKENS_CAP
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
    plain_runs: bool = True  # the verifier decodes runs of plain rounds without a block each (--no-plain-runs)


@dataclass
class GenerationRequest:
    """One request as a front hands it over. Exactly one of ``prompt``, ``messages`` (``(role,
    content)`` pairs; any sized iterable, read only after its length passed the limit) and
    ``prompt_token_ids`` is set. ``sampling`` is not validated yet; its ``max_new_tokens`` 0 means
    the gateway's default. ``method`` "" = auto; ``draft_ahead`` None = the gateway's default.
    ``tenant`` is the front's to set from the credentials it checked, never from the body."""

    request_id: str = ""
    prompt: str = ""
    messages: Sequence[tuple[str, str]] = ()
    prompt_token_ids: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=0))
    method: str = ""
    num_draft_tokens: int = 0
    draft_ahead: bool | None = None
    cache_scope: str = ""  # narrows the tenant's suffix cache ("" = the tenant's shared scope)
    auto_methods: Sequence[str] = ()  # what "auto" may choose among (() = every method this stack has)
    tenant: str = ""  # set by the front from the API key it checked (``tenant_of``), never by the client

    @property
    def operation(self) -> str:
        """gen_ai.operation.name"""
        return "chat" if len(self.messages) else "text_completion"


@dataclass
class Finished:
    """The last event of a generation."""

    request_id: str
    prompt_token_ids: list[int]
    result: GenerationResult


def new_request_id() -> str:
    return uuid.uuid4().hex


class GatewayCore:
    """Validation, admission, replica choice and the speculative loop of every request."""

    def __init__(self, runtime: ServiceRuntime, tokenizer, limits: GatewayLimits,
                 verifiers: ReplicaPool, drafters: ReplicaPool, link_options: LinkOptions | None = None,
                 suffix: SuffixConfig | None = None) -> None:
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
        self.serving = False  # what grpc.health.v1 says (a verifier is ready)
        self.active = 0
        self.waiting = 0  # requests admitted that wait for a ready verifier (they count against max_sessions)
        self.eos_token_ids: tuple[int, ...] = ()
        self.max_positions = 1 << 30
        # Warm starts for adaptive draft lengths, per (draft method, draft model, target model).
        self.acceptance_memory = AcceptanceMemory()
        # Suffix drafting here (no round trip) when no drafter service of it runs; its cache of
        # earlier outputs is this gateway's (docs/suffix.md: where it runs, and why).
        self.suffix_drafter = SuffixDrafter(suffix)
        self.method_chooser = MethodChooser()
        # Tokenizing (up to limits.prompt_chars characters) runs here, never on the event loop, so
        # a long prompt cannot stall the other streams. One thread: the tokenizer is shared.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-tokenize")

    # -- startup -------------------------------------------------------------------------------
    async def connect(self, poll_s: float = 0.5, refresh_s: float = 2.0, startup_wait_s: float = 15.0) -> None:
        """Serve once every configured replica is ready (or, after ``startup_wait_s``, once any
        verifier is); then keep every replica's readiness and load fresh."""
        self.verifiers.fingerprint = self.drafters.fingerprint = self.fingerprint
        started = asyncio.get_running_loop().time()
        while True:
            await asyncio.gather(self.verifiers.refresh(), self.drafters.refresh())
            ready = self.verifiers.ready()
            if ready:
                model = ready[0].info.model
                self.eos_token_ids = tuple(model.eos_token_ids)
                self.max_positions = model.max_positions or self.max_positions
            all_ready = all(b.info is not None for b in self.verifiers.replicas + self.drafters.replicas)
            waited = asyncio.get_running_loop().time() - started > startup_wait_s
            should_serve = bool(ready) and (self.serving or all_ready or waited)
            if should_serve != self.serving:
                self.serving = should_serve
                await self.runtime.set_serving(should_serve)
            await asyncio.sleep(refresh_s if self.serving and all_ready else poll_s)

    # -- request validation ----------------------------------------------------------------------
    async def off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenizer's thread (work a request's size could make long)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def rejected_invalid(self) -> None:
        """Count a request refused as INVALID_ARGUMENT (a front's own checks call it too)."""
        self.metrics.rejected.labels("gateway", "INVALID_ARGUMENT").inc()

    def _input(self, request: GenerationRequest):
        """The request's input, checked for size before any tokenizing: ``("prompt", text)``,
        ``("messages", [(role, content)])`` or ``("prompt_token_ids", ids)``."""
        limits = self.limits
        text = request.prompt
        inputs = (("prompt", text), ("messages", request.messages), ("prompt_token_ids", request.prompt_token_ids))
        given = [name for name, value in inputs if len(value)]
        if len(given) != 1:
            raise FieldError("input", "set exactly one of prompt, messages, prompt_token_ids")
        if given[0] == "prompt":
            if len(text) > limits.prompt_chars:
                raise FieldError("prompt", f"{len(text)} characters exceed the limit of {limits.prompt_chars}")
            if not is_utf8(text):
                raise FieldError("prompt", "not valid Unicode (a lone surrogate)")
            return "prompt", text
        if given[0] == "messages":
            if len(request.messages) > limits.max_prompt_tokens:  # each message costs tokens
                raise FieldError("messages", f"{len(request.messages)} messages exceed the limit of {limits.max_prompt_tokens}")
            messages, chars = [], 0
            for i, (role, content) in enumerate(request.messages):
                role = ROLE_ALIASES.get(role, role)
                if role not in ROLES:
                    raise FieldError(f"messages[{i}].role", f"must be one of {', '.join(ROLES + tuple(ROLE_ALIASES))}")
                chars += len(content)
                messages.append((role, content))
            if chars > limits.prompt_chars:
                raise FieldError("messages", f"{chars} characters of content exceed the limit of {limits.prompt_chars}")
            bad = next((i for i, (_, content) in enumerate(messages) if not is_utf8(content)), None)
            if bad is not None:
                raise FieldError(f"messages[{bad}].content", "not valid Unicode (a lone surrogate)")
            return "messages", messages
        if len(request.prompt_token_ids) > limits.max_prompt_tokens:
            raise FieldError("prompt_token_ids", f"{len(request.prompt_token_ids)} prompt tokens exceed the limit "
                             f"of {limits.max_prompt_tokens}")
        ids = [int(t) for t in request.prompt_token_ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise FieldError("prompt_token_ids", f"id {bad} is outside the vocabulary (size {self.vocab_size})")
        return "prompt_token_ids", ids

    async def _prompt_ids(self, field: str, value) -> list[int]:
        """Token ids of an input from ``_input``; tokenizing runs off the event loop."""
        if field == "prompt":
            ids = await self.off_loop(encode_text, self.tokenizer, value)
        elif field == "messages":
            try:
                ids = await self.off_loop(encode_chat, self.tokenizer, value)
            except ValueError:
                raise
            except Exception as exc:
                if type(exc).__module__.startswith("jinja2"):  # the template refused them (raise_exception)
                    raise FieldError("messages", str(exc)) from exc
                raise
        else:
            ids = value
        if not ids:
            raise FieldError(field, "encodes to no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise FieldError(field, f"{len(ids)} prompt tokens exceed the limit of {self.limits.max_prompt_tokens}")
        if len(ids) + 1 >= self.max_positions:
            raise FieldError(field, "no room left in the model context")
        return ids

    def _validate(self, request: GenerationRequest):
        """Every check that costs next to nothing (sizes included); tokenizing comes after."""
        limits = self.limits
        if len(request.request_id) > limits.max_request_id_length:
            raise FieldError("request_id", f"longer than {limits.max_request_id_length} characters")
        sampling = request.sampling
        if sampling.max_new_tokens > limits.max_new_tokens:
            raise FieldError("sampling.max_new_tokens", f"{sampling.max_new_tokens} exceeds the limit of {limits.max_new_tokens}")
        if len(sampling.stop) > limits.max_stop_strings or any(len(s) > limits.max_stop_length for s in sampling.stop):
            raise FieldError("sampling.stop", f"at most {limits.max_stop_strings} strings of <= {limits.max_stop_length} characters")
        if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
            raise FieldError("sampling.stop_token_ids", f"at most {limits.max_stop_token_ids} ids")
        if any(t >= self.vocab_size for t in sampling.stop_token_ids):
            raise FieldError("sampling.stop_token_ids", "ids must be below the vocabulary size")
        params = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens or limits.default_max_new_tokens)
        params.validate()
        params = with_random_seed(params)
        method = request.method or "auto"
        if method not in METHODS:
            raise FieldError("speculation.method", f"{method!r} is not one of {', '.join(METHODS)}")
        # Refused when no drafter of this stack drafts with it (a drafter that never answered yet may:
        # the request then goes on, and drafts if one comes up).
        if method in ("model", "eagle") and self.drafters.offers(method) is False:
            raise FieldError("speculation.method", f"{method!r} needs a drafter service of that method and "
                             "this gateway has none")
        if len(request.cache_scope) > MAX_CACHE_SCOPE_LENGTH or not is_utf8(request.cache_scope):
            raise FieldError("speculation.cache_scope", f"at most {MAX_CACHE_SCOPE_LENGTH} characters of valid Unicode")
        unknown = next((m for m in request.auto_methods if m not in DRAFTING_METHODS), None)
        if unknown is not None:
            raise FieldError("speculation.auto_methods", f"{unknown!r} is not one of {', '.join(DRAFTING_METHODS)}")
        k = request.num_draft_tokens
        if k < 0:
            raise FieldError("speculation.num_draft_tokens", f"{k} is negative")
        if k > limits.max_draft_tokens:
            raise FieldError("speculation.num_draft_tokens", f"{k} exceeds the limit of {limits.max_draft_tokens}")
        draft_ahead = self.link_options.draft_ahead if request.draft_ahead is None else request.draft_ahead
        field, value = self._input(request)
        return (field, value), params, method, k, draft_ahead

    def _admit(self) -> None:
        if self.active + self.waiting >= self.limits.max_sessions:
            self.metrics.rejected.labels("gateway", "RESOURCE_EXHAUSTED").inc()
            raise Overloaded(f"gateway at capacity ({self.limits.max_sessions} concurrent requests)")

    def verifier_wait_s(self, time_remaining: Callable[[], float | None]) -> float:
        """How long a request may wait for a ready verifier now: ``verifier_wait_s`` within its deadline."""
        remaining = time_remaining()
        wait_s = self.limits.verifier_wait_s
        return wait_s if remaining is None else max(0.0, min(wait_s, remaining))

    async def _pick_verifier(self, time_remaining: Callable[[], float | None]):
        """The least-loaded ready verifier; while none is ready (one restarting, a rollout), wait up
        to ``verifier_wait_s`` and the request's deadline for one instead of failing at once.
        UNAVAILABLE after that."""
        replica = self.verifiers.pick()
        if replica is not None:
            return replica
        wait_s = self.verifier_wait_s(time_remaining)
        self.waiting += 1
        try:
            replica = await self.verifiers.wait_pick(wait_s)
        finally:
            self.waiting -= 1
        if replica is None:
            raise NotReady(f"no verifier is ready (waited {wait_s:.0f} s)")
        return replica

    # -- the draft method of "auto" ------------------------------------------------------------------
    def _auto_method(self, allowed: Sequence[str], target_model: str, draft_ahead_asked: bool = False) -> str:
        """What ``auto`` drafts with for a request (``allowed``: its auto_methods, () = any):
        among the methods this stack has, the one its finished requests measured fastest. A request
        that asked for draft-ahead gets a drafter service's method when one is ready (only those
        draft ahead; suffix lookup here takes microseconds, with nothing to hide)."""
        allowed = allowed or DRAFTING_METHODS
        if draft_ahead_asked and any(self.drafters.ready(m) for m in REMOTE_ONLY_METHODS if m in allowed):
            allowed = [m for m in allowed if m in REMOTE_ONLY_METHODS]
        candidates = []
        for method in AUTO_DRAFT_METHODS:
            if method not in allowed:
                continue
            replicas = self.drafters.ready(method)
            if method in REMOTE_ONLY_METHODS and not replicas:
                continue
            draft_model = replicas[0].info.model.model if replicas else ""
            candidates.append((method, AcceptanceMemory.make_key(method, draft_model, target_model)))
        chosen = self.method_chooser.choose(candidates)
        if chosen is not None:
            return chosen
        return "ngram" if "ngram" in allowed else "none"

    # -- one request -------------------------------------------------------------------------------
    def request_telemetry(self, request: GenerationRequest, attributes: dict | None = None) -> telemetry.RequestTelemetry:
        """The request's span and metrics; ``attributes``: the front's own (route, protocol).
        The front calls ``fail`` and ``end`` on it around ``generate``."""
        return telemetry.RequestTelemetry(self.telemetry, self.genai_metrics, request.operation, self.model_name,
                                          attributes)

    async def generate(self, request: GenerationRequest, obs: telemetry.RequestTelemetry,
                       time_remaining: Callable[[], float | None] = lambda: None) -> AsyncIterator[Chunk | Finished]:
        """``Chunk``s as tokens commit, then one ``Finished``. Errors before the first event are the
        request's (ValueError, Overloaded, NotReady); closing the iterator early (a client that
        went away) frees the sessions on every service. ``time_remaining``: the client's deadline."""
        try:
            prompt_input, params, method, k, draft_ahead = self._validate(request)
        except ValueError:
            self.rejected_invalid()
            raise
        self._admit()  # before tokenizing: a full gateway refuses at once
        try:
            prompt_ids = await self._prompt_ids(*prompt_input)
        except ValueError:
            self.rejected_invalid()
            raise
        verifier_replica = await self._pick_verifier(time_remaining)
        target_model = verifier_replica.info.model.model
        if method == "auto":
            method = self._auto_method(request.auto_methods, target_model, request.draft_ahead is True)
        self._admit()  # again: others may have been admitted meanwhile (no await from here to active += 1)
        request_id = request.request_id or new_request_id()
        # Downstream session ids are ours, unguessable, never the client's request_id (which another
        # client could choose too, or use to cancel a session that is not its own).
        verifier_session, drafter_session = uuid.uuid4().hex, uuid.uuid4().hex
        obs.begin(request_id=request_id, params=params, prompt_tokens=len(prompt_ids), method=method, requested_k=k)
        metadata = obs.metadata()  # W3C trace context for both downstream streams (None: tracing off)
        verifier, policy, drafter_replica, remote_drafter, method_key = None, None, None, None, None
        scope = cache_scope_key(request.tenant, request.cache_scope)  # of the suffix cache
        self.active += 1
        try:
            self.metrics.active_sessions.set(self.active)
            self.metrics.requests.inc()
            links = self.link_options
            # A drafter service of that method if one runs; n-gram lookup can also run right here.
            drafter_replica = self.drafters.pick(method) if method in DRAFTING_METHODS else None
            feature_size = drafter_replica.info.feature_size if drafter_replica is not None else 0
            if feature_size and feature_size != verifier_replica.info.feature_size:
                log.warning("request %s: drafter %s reads features of width %d, verifier %s streams %d; no drafts",
                            printable(request_id), drafter_replica.address, feature_size, verifier_replica.address,
                            verifier_replica.info.feature_size)
                drafter_replica, feature_size = None, 0
            verifier = MigratingVerifier(self.verifiers, verifier_replica, verifier_session, prompt_ids, params,
                                         time_remaining, metadata, links.net_delay_s, request_id=request_id,
                                         want_features=feature_size > 0,
                                         wait_s=lambda: self.verifier_wait_s(time_remaining))
            drafter_link = None
            draft_model = drafter_replica.info.model.model if drafter_replica is not None else ""
            method_key = AcceptanceMemory.make_key(method, draft_model, target_model)
            policy = make_policy(k, memory=self.acceptance_memory, max_k=self.limits.max_draft_tokens, key=method_key,
                                 forward_curve=list(verifier_replica.info.forward_cost_s) or None,
                                 co_batched=max(0, verifier_replica.load - 1),  # its other sessions, this one opened
                                 drafter_estimates=method == "suffix")
            if drafter_replica is not None:
                drafter_replica.in_flight += 1
                remote_drafter = RemoteDrafter(drafter_replica.stub, drafter_session, prompt_ids, params,
                                               time_remaining, metadata, net_delay_s=links.net_delay_s,
                                               request_id=request_id, reads_features=feature_size > 0,
                                               max_message_bytes=self.drafters.max_message_bytes,
                                               vocab_size=self.vocab_size,
                                               cache_scope=scope)
                if policy.expects_to_draft():
                    # The drafter's prefill overlaps the verifier's. When plain decoding is expected to
                    # win (what this draft pair measured before), the session opens at the first
                    # proposal instead: its prefill then cannot delay the first token.
                    remote_drafter.begin()
                obs.drafter_opened_at_prefill(remote_drafter.started)
                drafter_link = remote_drafter
            elif method == "ngram":
                drafter_link = LocalDrafter(NgramDrafter().start(prompt_ids, params))
            elif method == "suffix":
                drafter_link = LocalDrafter(self.suffix_drafter.start_in_scope(prompt_ids, params, scope))
            obs.links(verifier, drafter_link, verifier_replica.address,
                      drafter_replica.address if drafter_replica is not None else None,
                      (drafter_replica.info.model.model or None) if drafter_replica is not None else None)
            log.info("request %s: verifier session %s on %s, drafter session %s", printable(request_id),
                     verifier_session, verifier_replica.address,
                     f"{drafter_session} on {drafter_replica.address}" if remote_drafter else "none")
            if obs.span is not None:
                obs.span.set_attribute("specdec.verifier.session_id", verifier_session)
                if remote_drafter is not None:
                    obs.span.set_attribute("specdec.drafter.session_id", drafter_session)
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
                plain_runs=self.link_options.plain_runs,
                draft_ahead=(remote_drafter is not None and draft_ahead
                             and drafter_replica.info is not None and drafter_replica.info.supports_draft_ahead),
            )
            async for event in events:
                if isinstance(event, GenerationResult):
                    obs.finish(event)
                    stats = event.stats
                    if not (method == "suffix" and remote_drafter is None):  # this cache has those as they came
                        self.suffix_drafter.remember(scope, prompt_ids, event.token_ids)
                    self.method_chooser.report(method_key, stats.emitted_in_rounds, stats.verify_s + stats.draft_s)
                    self.metrics.draft_tokens.inc(stats.draft_tokens)
                    self.metrics.accepted_tokens.inc(stats.accepted_tokens)
                    yield Finished(request_id, prompt_ids, event)
                else:
                    self.metrics.tokens.inc(len(event.token_ids))
                    yield event
        finally:
            # Finish, client cancel or disconnect, deadline or error: release both downstream sessions,
            # and every count raised above (each only if it was raised).
            self.active -= 1
            self.metrics.active_sessions.set(self.active)
            if method_key is not None:
                self.method_chooser.release(method_key)
            closers = []
            if policy is not None:
                if log.isEnabledFor(logging.DEBUG) and hasattr(policy, "estimates"):
                    log.debug("request %s: draft-length model at the end %s", printable(request_id),
                              policy.estimates(4))
                policy.close()
            if verifier is not None:
                closers.append(verifier.close())
            if remote_drafter is not None:
                drafter_replica.in_flight -= 1
                closers.append(remote_drafter.close())
            await asyncio.shield(asyncio.gather(*closers, return_exceptions=True))
