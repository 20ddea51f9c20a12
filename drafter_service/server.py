"""gRPC drafter: proposes draft tokens with their exact draft distributions, one session per stream."""

from __future__ import annotations

import asyncio
import logging
import time

from specdec import telemetry
from specdec.drafters import ModelDrafter
from specdec.drafting import Drafter, DraftSession, NgramDrafter
from specdec.eagle.drafter import EagleDrafter
from specdec.eagle.target_rows import read_target
from specdec.lm import keep_torch_to_one_thread, model_threads
from specdec.models import EMBEDDED_DRAFT, EMBEDDED_TARGET, LoadedModel, default_eagle_head, load_model, load_tokenizer, tokenizer_fingerprint
from specdec.replay import REPLAY_WIRE_METHOD, ReplayDrafter
from specdec.rpc import convert
from specdec.rpc.server import NotReady, idle_guard, ServiceRuntime, map_errors, map_unary_errors
from specdec.rpc.sessions import ModelWorkerService, validate_session_id
from specdec.suffix import MAX_SCOPE_KEY_BYTES, SuffixConfig, SuffixDrafter
from specdec.wire_types import DraftProposal, FieldError, SamplingParams, with_random_seed
from specdec.service_config import DrafterConfig
from specdec.target_features import decode_features
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, types_pb2

log = logging.getLogger("specdec.drafter")
SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
# The longest session an n-gram drafter holds (it has no model context; its lookup scans the session).
NGRAM_MAX_CONTEXT = 32768


class DrafterService(ModelWorkerService, drafter_pb2_grpc.DrafterServicer):
    role = "drafter"

    def __init__(self, runtime: ServiceRuntime, **kwargs) -> None:
        super().__init__(runtime, **kwargs)
        self.drafter: Drafter | None = None
        self.lm: LoadedModel | None = None  # the draft model (eagle: the target's facts only, no weights)
        self.tokenizer = None  # n-gram drafting needs no model, only the vocabulary
        self.tokenizer_fingerprint = ""

    async def load(self, method: str, draft_model: str | None, device: str | None = None,
                   replay_file: str | None = None, target: str | None = None,
                   suffix: SuffixConfig | None = None) -> None:
        loop = asyncio.get_running_loop()
        if method == "eagle":
            draft_model = draft_model or default_eagle_head(target or EMBEDDED_TARGET)
            if not draft_model:
                raise SystemExit("--method eagle needs --draft-model: an EAGLE head directory (specdec train-draft "
                                 "eagle-train); only the embedded target has a shipped one")
            # Only what the head reads of the target (its embedding and LM head rows) and its vocabulary facts.
            self.lm, tensors = await loop.run_in_executor(self.executor, read_target, target or EMBEDDED_TARGET, device)
            self.drafter = await loop.run_in_executor(self.executor, EagleDrafter.load, draft_model, tensors)
        elif method == "model":
            draft_model = draft_model or EMBEDDED_DRAFT
            sessions = self.sessions.max_sessions  # a GGUF draft's context holds that many sequences
            self.lm = await loop.run_in_executor(self.executor,
                                                 lambda: load_model(draft_model, device=device, sessions=sessions))
            self.fit_sessions_to(self.lm)
            await loop.run_in_executor(self.executor, keep_torch_to_one_thread, self.lm)
            self.drafter = ModelDrafter(self.lm)
        elif method in ("ngram", "suffix", "replay"):
            if draft_model:  # only the tokenizer: it identifies the vocabulary for the gateway's pairing check
                self.tokenizer = await loop.run_in_executor(self.executor, load_tokenizer, draft_model)
                self.tokenizer_fingerprint = tokenizer_fingerprint(self.tokenizer)
            if method == "ngram":
                self.drafter = NgramDrafter()
            elif method == "suffix":
                self.drafter = SuffixDrafter(suffix)
            elif replay_file:  # benchmarks only (specdec.replay): proposals from recordings, at a chosen acceptance
                self.drafter = ReplayDrafter(replay_file)
            else:
                raise SystemExit("--method replay needs --replay-file")
        else:
            raise SystemExit(f"unknown draft method {method!r}")
        await loop.run_in_executor(self.executor, self._warm_up)
        await self.runtime.set_serving(True)
        log.info("drafter serving method=%s model=%s threads=%d", method, draft_model,
                 await self._run(model_threads, getattr(self, "lm", None)))

    def _warm_up(self) -> None:
        session = self.drafter.start([0, 1, 2, 3], SamplingParams(max_new_tokens=4))
        session.propose(3)
        session.close()
        if self.lm is not None and self.lm.capture_graphs():
            log.info("captured the CUDA graphs of every pass bucket")

    @property
    def max_context(self) -> int:
        """The most tokens a session may hold: the draft model's positions (n-gram: NGRAM_MAX_CONTEXT)."""
        return self.lm.max_positions if self.lm is not None else NGRAM_MAX_CONTEXT

    def _require_drafter(self) -> Drafter:
        if self.drafter is None:
            raise NotReady("drafter is still loading")
        return self.drafter

    @map_errors
    async def Draft(self, request_iterator, context):
        drafter = self._require_drafter()
        key = None
        cancelled = asyncio.Event()  # set by an out-of-band cancel of this session
        session: DraftSession | None = None
        ahead_block: list[int] = []  # the last block drafted ahead (draft-ahead)
        trace = telemetry.current().session_trace(context, SERVICE_NAME, "Draft", "drafter")  # None: off
        try:
            async for request in idle_guard(request_iterator, self.idle_timeout_s, cancelled):
                received = time.perf_counter()
                kind = request.WhichOneof("kind")
                if kind == "start":
                    if session is not None:
                        raise FieldError("start", "a stream carries exactly one session")
                    start = request.start
                    validate_session_id(start.session_id)
                    prompt = [int(t) for t in start.prompt_token_ids]
                    scope = start.cache_scope
                    if len(scope.encode()) > MAX_SCOPE_KEY_BYTES:
                        raise FieldError("cache_scope", f"longer than {MAX_SCOPE_KEY_BYTES} bytes")
                    self._validate_ids(prompt, "prompt_token_ids")
                    if len(prompt) >= self.max_context:
                        raise FieldError("prompt_token_ids", f"{len(prompt)} tokens exceed the draft context "
                                         f"({self.max_context})")
                    # Unseeded (a direct client; the gateway always seeds): a fresh seed, not resolved_seed()'s 0.
                    params = with_random_seed(convert.sampling_from_pb(start.sampling, draft_top_k=start.draft_top_k))
                    session, key = await self.start_session(context.peer(), start.session_id,
                                                            lambda: drafter.start_in_scope(prompt, params, scope),
                                                            cancelled)
                    await self._run(session.prefill)
                    if trace is not None:
                        trace.set(session_id=key, prompt_tokens=len(prompt), **{"draft.method": drafter.name})
                        if self.lm is not None:
                            trace.set(**{"draft.model": self.lm.name})
                        trace.step("prefill", received, prompt_tokens=len(prompt))
                    # The id as given: the registry key (which may carry a suffix when the id is already
                    # taken, perhaps by another client) would tell a caller that the id is in use.
                    yield drafter_pb2.DraftResponse(started=drafter_pb2.DraftStarted(session_id=start.session_id))
                elif kind == "propose":
                    if session is None:
                        raise FieldError("propose", "send start first")
                    propose = request.propose
                    k = propose.num_draft_tokens
                    if k > self.max_draft_tokens:
                        raise FieldError("num_draft_tokens", f"{k} exceeds this drafter's limit ({self.max_draft_tokens})")
                    ahead_n, used = propose.ahead_tokens, propose.ahead_used
                    if ahead_n > self.max_draft_tokens:
                        raise FieldError("ahead_tokens", f"{ahead_n} exceeds this drafter's limit ({self.max_draft_tokens})")
                    if used and (k or not ahead_n):
                        raise FieldError("ahead_used", "only with num_draft_tokens = 0 and ahead_tokens > 0")
                    if used > len(ahead_block):
                        raise FieldError("ahead_used", f"{used} exceeds the last ahead block ({len(ahead_block)} tokens)")
                    held = len(session.tokens) + len(propose.committed_token_ids)
                    if held > self.max_context:  # checked before any work: the session cannot hold them
                        raise FieldError("committed_token_ids", f"the session would hold {held} tokens, past the "
                                         f"draft context ({self.max_context})")
                    committed = [int(t) for t in propose.committed_token_ids]
                    if committed:
                        self._validate_ids(committed, "committed_token_ids")
                    if propose.HasField("target_features"):
                        if not drafter.feature_size:
                            raise FieldError("target_features", f"the {drafter.name} drafter does not read target features")
                        encoded = convert.encoded_features_from_pb(propose.target_features)
                        if encoded is not None:
                            features = decode_features(encoded, "target_features", drafter.feature_size)
                            if features.end > held - 1:
                                raise FieldError("target_features", f"positions up to {features.end - 1} for {held} "
                                                 f"committed tokens (at most {held - 2})")
                            session.add_features(features)
                    k = min(k, self.max_context - held)  # drafts past the context: fewer (legal: "up to k")
                    previous_block = ahead_block
                    proposal, batch = await self._batched((session, committed, k), len(committed) + k)
                    self.metrics.tokens.inc(len(proposal))
                    if trace is not None:
                        trace.step("propose", received, round=propose.round, k=k, drafted=len(proposal),
                                   committed=len(committed), **batch.trace_attributes())
                    yield drafter_pb2.DraftResponse(proposal=drafter_pb2.DraftProposal(
                        round=propose.round, service_time_us=int((time.perf_counter() - received) * 1e6),
                        batch_size=batch.size, queue_wait_us=int(batch.queue_wait_s * 1e6),
                        acceptance_estimates=proposal.acceptance_estimates or (),
                        **convert.proposal_fields(proposal),
                    ))
                    ahead_block = []  # a block is only ever continued from the message right after it
                    if ahead_n:
                        # Draft the next block while the gateway has this one verified; always answer
                        # (possibly empty): the gateway waits for exactly one DraftAhead.
                        started = time.perf_counter()
                        in_flight = proposal.draft_tokens if k else previous_block[:used]
                        # the block must fit the draft context
                        ahead_n = min(ahead_n, self.max_context - len(session.tokens) - len(in_flight) - 1)
                        block = None
                        if in_flight and ahead_n > 0:
                            block = await self._run(session.propose_ahead, in_flight, ahead_n)
                        assumed, ahead = block if block is not None else ([], DraftProposal())
                        ahead_block = list(ahead.draft_tokens)
                        self.metrics.tokens.inc(len(ahead))
                        if trace is not None:
                            trace.step("draft_ahead", started, round=propose.round, drafted=len(ahead))
                        yield drafter_pb2.DraftResponse(ahead=drafter_pb2.DraftAhead(
                            round=propose.round, assumed_token_ids=assumed,
                            proposal=drafter_pb2.DraftProposal(
                                round=propose.round, service_time_us=int((time.perf_counter() - started) * 1e6),
                                **convert.proposal_fields(ahead)),
                        ))
                else:
                    raise FieldError("kind", "set start or propose")
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise
        finally:
            if key is not None:
                self.sessions.close(key)
            if trace is not None:
                trace.end()

    def _validate_ids(self, ids: list[int], field: str) -> None:
        if self.lm is not None:
            self.lm.validate_prompt(ids, field)
            return
        if not ids:
            raise FieldError(field, "must not be empty")
        if self.tokenizer is not None and any(t >= len(self.tokenizer) for t in ids):
            raise FieldError(field, f"ids must be below the vocabulary size {len(self.tokenizer)}")

    def _model_info(self) -> types_pb2.ModelInfo:
        if self.lm is not None:
            info = convert.model_info_pb(self.lm)
            if isinstance(self.drafter, EagleDrafter):  # the target's vocabulary, the head's name
                info.model = self.drafter.head_name
            return info
        # A replay drafter names its current settings: the gateway keys its warm starts by this name,
        # so that one alpha's acceptance does not start the next one's sessions.
        name = self.drafter.label if isinstance(self.drafter, ReplayDrafter) else ""
        if self.tokenizer is not None:
            return types_pb2.ModelInfo(model=name, tokenizer_fingerprint=self.tokenizer_fingerprint,
                                       vocab_size=len(self.tokenizer))
        return types_pb2.ModelInfo(model=name)

    def _run_batch(self, jobs: list[tuple[DraftSession, list[int], int]]) -> list:
        """Proposals for several sessions in batched draft passes (the model thread)."""
        for session, committed, _ in jobs:
            session.extend(committed)
        return self.drafter.propose_batch([(session, k) for session, _, k in jobs])

    @map_unary_errors
    async def CancelDraft(self, request, context):
        self.sessions.cancel(request.session_id, context.peer())  # only the opener's own sessions
        return drafter_pb2.CancelDraftResponse()

    @map_unary_errors
    async def GetInfo(self, request, context):
        drafter = self._require_drafter()
        return drafter_pb2.GetDrafterInfoResponse(
            method=REPLAY_WIRE_METHOD if isinstance(drafter, ReplayDrafter) else drafter.name,
            model=self._model_info(),
            load=types_pb2.LoadReport(active_sessions=len(self.sessions), max_sessions=self.sessions.max_sessions),
            supports_draft_ahead=drafter.supports_draft_ahead,
            feature_size=drafter.feature_size,
        )


async def serve(config: DrafterConfig) -> None:
    options = config.serve
    runtime = ServiceRuntime(SERVICE_NAME, options)
    service = DrafterService(runtime, max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s,
                             batching=config.batching, max_sessions_per_peer=config.max_sessions_per_peer)
    drafter_pb2_grpc.add_DrafterServicer_to_server(service, runtime.server)
    port = await runtime.start()
    runtime.install_signal_handlers()
    print(f"specdec drafter listening on {options.host}:{port}", flush=True)
    await service.load(config.method, config.draft_model, device=config.device, replay_file=config.replay_file,
                       suffix=config.suffix,
                       target=config.target)
    await runtime.wait_and_drain()
