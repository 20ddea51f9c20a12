"""gRPC verifier: prefill and verify drafts against the target model, one session per stream."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from specdec import telemetry
from specdec.costs import measure_forward_curve
from specdec.lm import keep_torch_to_one_thread, model_threads
from specdec.models import MAX_VOCAB_PADDING, LoadedModel, load_model
from specdec.rpc import convert
from specdec.rpc.server import NotReady, SessionCancelled, idle_guard, ServiceRuntime, map_errors, map_unary_errors
from specdec.rpc.sessions import ModelWorkerService, validate_session_id
from specdec.wire_types import MAX_NEW_TOKENS_CAP, BatchInfo, DraftProposal, FieldError, with_random_seed
from specdec.service_config import VerifierConfig
from specdec.target_features import WIRE_DTYPE
from specdec.v1 import types_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.verification import (PendingForward, PrefillChunk, TargetSession, Verdict, VerifyJob, check_draft_probs,
                                  verify_batch)

log = logging.getLogger("specdec.verifier")
SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
FORWARD_CURVE_MAX_DRAFTS = 16  # the start-up timing covers k = 0..16 (the policy extends it beyond)
FORWARD_CURVE_REPS = 3
# A solo run computes at most this many verdicts ahead of the handler that sends them: the work a
# stream that ends (a stop string, a cancel) leaves behind stays small, and a verdict's service time
# holds no long wait in a queue.
SOLO_RUN_LEAD = 4


class VerifierService(ModelWorkerService, verifier_pb2_grpc.VerifierServicer):
    role = "verifier"

    def __init__(self, runtime: ServiceRuntime, max_new_tokens_cap: int = MAX_NEW_TOKENS_CAP,
                 verify_ahead: bool = True, **kwargs) -> None:
        super().__init__(runtime, **kwargs)
        self.max_new_tokens_cap = max_new_tokens_cap
        self.verify_ahead = verify_ahead  # feed the pending token after a plain round (PendingForward)
        self.lm: LoadedModel | None = None
        self.forward_cost_s: list[float] = []  # measured at start-up; reported by GetInfo

    async def load(self, target: str, device: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        sessions = self.sessions.max_sessions  # the gguf runtime's context holds that many sequences
        self.lm = await loop.run_in_executor(self.executor,
                                             lambda: load_model(target, device=device, sessions=sessions))
        self.fit_sessions_to(self.lm)
        await loop.run_in_executor(self.executor, keep_torch_to_one_thread, self.lm)
        await loop.run_in_executor(self.executor, self._warm_up)
        await self.runtime.set_serving(True)
        log.info("verifier serving %s threads=%d", target, await self._run(model_threads, self.lm))

    def _warm_up(self) -> None:
        from specdec.wire_types import SamplingParams

        session = TargetSession(self.lm, [0, 1, 2, 3], SamplingParams(max_new_tokens=4))
        session.prefill()
        session.verify(DraftProposal([1, 2, 3]))
        session.close()
        if self.lm.capture_graphs():
            log.info("captured the CUDA graphs of every pass bucket")
        # The verify-cost curve the gateways' draft-length policies build on (seconds for k + 1 tokens).
        sizes = min(self.max_draft_tokens, FORWARD_CURVE_MAX_DRAFTS) + 1
        self.forward_cost_s = measure_forward_curve(self.lm, sizes, reps=FORWARD_CURVE_REPS)
        log.info("forward cost over 1..%d tokens: %s ms", sizes,
                 " ".join(f"{t * 1e3:.1f}" for t in self.forward_cost_s))

    def feature_window(self, lm: LoadedModel) -> int | None:
        """The most feature positions a prefill verdict carries (a long prompt's tail): half the
        message size limit (the gateway joins a few verdicts' features into one ProposalRequest)."""
        row_bytes = WIRE_DTYPE.itemsize * lm.feature_size
        return max(64, self.runtime.options.max_message_bytes // 2 // row_bytes) if lm.feature_size else None

    def _require_model(self) -> LoadedModel:
        if self.lm is None:
            raise NotReady("verifier model is still loading")
        return self.lm

    @map_errors
    async def Verify(self, request_iterator, context):
        lm = self._require_model()
        key = None
        cancelled = asyncio.Event()  # set by an out-of-band cancel of this session
        session: TargetSession | None = None
        ahead: asyncio.Task | None = None  # the pending token's pass, run while the next block is on its way
        budget = 0  # the committed length (prompt + max_new_tokens) this session never passes
        stop_ids: frozenset[int] = frozenset()
        solo_stop = threading.Event()  # set when the stream ends: a solo run on the model thread stops
        trace = telemetry.current().session_trace(context, SERVICE_NAME, "Verify", "verifier")  # None: off
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
                    lm.validate_prompt(prompt)
                    # Unseeded (a direct client; the gateway always seeds): a fresh seed, not resolved_seed()'s 0.
                    params = with_random_seed(convert.sampling_from_pb(start.sampling, min(128, self.max_new_tokens_cap)))
                    if params.max_new_tokens > self.max_new_tokens_cap:
                        raise FieldError("sampling.max_new_tokens", f"{params.max_new_tokens} exceeds this verifier's "
                                         f"cap ({self.max_new_tokens_cap}; --max-new-tokens-cap)")
                    budget = len(prompt) + params.max_new_tokens  # the committed length never passes it
                    stop_ids = params.stop_ids(lm.eos_token_ids)  # where a plain run ends
                    session, key = await self.start_session(context.peer(), start.session_id, lambda: TargetSession(
                        lm, prompt, params, want_features=start.want_features, feature_window=self.feature_window(lm)),
                        cancelled)
                    verdict, chunks = await self._prefill(session)
                    self.metrics.tokens.inc(len(verdict.tokens))
                    if trace is not None:
                        trace.set(session_id=key, prompt_tokens=len(prompt))
                        trace.step("prefill", received, prompt_tokens=len(prompt), tokens=len(verdict.tokens),
                                   prefill_chunks=chunks, **_feature_attributes(verdict), **verdict.batch.trace_attributes())
                    ahead = self._start_ahead(session, verdict, budget, lm)
                    yield _response(verdict, 0, received, 0)
                elif kind == "block":
                    if session is None:
                        raise FieldError("block", "send start first")
                    block = request.block
                    proposal = self._validate_block(block, session, lm, budget)
                    verdict, steps_left, ahead = await self._round(session, proposal, block.plain_steps, ahead,
                                                                   budget, lm, stop_ids, trace, block.round, received)
                    yield _response(verdict, block.round, received, steps_left)
                    # A plain run: the next rounds need no block. Alone on this verifier, they run back to
                    # back on the model thread (``_solo_run``); beside other sessions, each is a job of the
                    # batched passes, started as the verdict before it goes out.
                    round_number = block.round
                    solo_gave_way = False  # the last solo run decoded nothing (the model thread was wanted)
                    while steps_left:
                        if cancelled.is_set():
                            raise SessionCancelled("session cancelled")
                        if len(self.sessions) == 1 and not solo_gave_way:
                            await _settle(ahead)
                            ahead = None
                            solo_gave_way = True  # unless it decodes a round: then the next round goes solo again
                            async for verdict, steps_left, started in self._solo_run(
                                    session, steps_left, budget, lm, stop_ids, solo_stop):
                                solo_gave_way = False
                                round_number += 1
                                self._count(verdict, trace, round_number, started)
                                yield _response(verdict, round_number, started, steps_left)
                                if cancelled.is_set():
                                    raise SessionCancelled("session cancelled")
                            continue
                        solo_gave_way = False
                        received = time.perf_counter()
                        round_number += 1
                        verdict, steps_left, ahead = await self._round(session, DraftProposal(), steps_left - 1, ahead,
                                                                       budget, lm, stop_ids, trace, round_number, received)
                        yield _response(verdict, round_number, received, steps_left)
                else:
                    raise FieldError("kind", "set start or block")
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise
        finally:
            solo_stop.set()  # a solo run stops after its current pass (the close below queues behind it)
            if ahead is not None:  # skipped unless its pass already started (the close waits for that pass)
                ahead.cancel()
            # Normal end, client cancel, deadline or error: the KV cache goes with the stream.
            if key is not None:
                self.sessions.close(key)
            if trace is not None:
                trace.end()

    async def _round(self, session: TargetSession, proposal: DraftProposal, steps: int, ahead: asyncio.Task | None,
                     budget: int, lm: LoadedModel, stop_ids: frozenset[int], trace, round_number: int,
                     received: float) -> tuple[Verdict, int, asyncio.Task | None]:
        """Verify one block (a plain run's rounds: an empty one) after the session's ahead pass, if
        any, settled, with ``steps`` plain rounds asked for after it: the verdict, the plain-run
        verdicts that follow it (``_run_left``), and the next ahead pass."""
        ahead_batch = await _settle(ahead)
        if session.needs_pass(proposal):
            verdict = await self._verify(session, proposal, len(proposal) + (0 if session.has_ahead else 1))
        else:  # a plain round whose pending token was fed ahead: no pass
            verdict = dataclasses.replace(session.commit(proposal, None), batch=ahead_batch)
        self._count(verdict, trace, round_number, received)
        steps_left = self._run_left(session, verdict, steps, budget, lm, stop_ids)
        return verdict, steps_left, self._start_ahead(session, verdict, budget, lm, run=steps_left > 0)

    def _count(self, verdict: Verdict, trace, round_number: int, received: float) -> None:
        """A round's verdict in the metrics and on the session's trace."""
        self.metrics.tokens.inc(len(verdict.tokens))
        self.metrics.draft_tokens.inc(verdict.num_drafts)
        self.metrics.accepted_tokens.inc(verdict.num_accepted)
        if trace is not None:
            trace.step("verify", received, round=round_number, drafted=verdict.num_drafts,
                       accepted=verdict.num_accepted, tokens=len(verdict.tokens),
                       **_feature_attributes(verdict), **verdict.batch.trace_attributes())

    async def _solo_run(self, session: TargetSession, steps: int, budget: int, lm: LoadedModel,
                        stop_ids: frozenset[int], stop: threading.Event):
        """A plain run's rounds back to back on the model thread, as one-session decoding runs them:
        each pass starts as soon as the one before it committed, without a trip through the event
        loop (what that trip costs, against the pass, is what a session decoding alone feels). Yields
        ``(verdict, steps left, started)`` as they come. The thread stops once the run is done, once
        anything else waits for the model thread (a session starting or closing) or another session
        is open (the rest goes through the batched passes, which it then shares), or once ``stop`` is
        set (the stream ended)."""
        loop = asyncio.get_running_loop()
        verdicts: asyncio.Queue = asyncio.Queue()
        lead = threading.Semaphore(SOLO_RUN_LEAD)  # verdicts computed but not yet sent

        def emit(item) -> None:
            loop.call_soon_threadsafe(verdicts.put_nowait, item)

        def may_go_on() -> bool:
            while not lead.acquire(timeout=0.05):  # the stream is that far behind: wait for it
                if stop.is_set():
                    return False
            return not stop.is_set() and len(self.sessions) == 1 and not self.executor.waiting

        def run() -> None:
            left = steps
            try:
                while left and may_go_on():
                    started = time.perf_counter()
                    passed = session.needs_pass(DraftProposal())  # not the first round after an ahead pass
                    verdict = session.verify(DraftProposal())
                    info = BatchInfo(1, 1, 0.0, time.perf_counter() - started if passed else 0.0)
                    if passed:
                        self._observe_pass(info.size, info.num_tokens, info.pass_s)
                    left = self._run_left(session, verdict, left - 1, budget, lm, stop_ids)
                    emit((dataclasses.replace(verdict, batch=info), left, started))
            except Exception as exc:  # noqa: BLE001 - the stream's error, raised where it is read
                emit(exc)
            finally:
                emit(None)

        loop.run_in_executor(self.executor, run)
        while (item := await verdicts.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item
            lead.release()

    @staticmethod
    def _run_left(session: TargetSession, verdict: Verdict, steps: int, budget: int, lm: LoadedModel,
                  stop_ids: frozenset[int]) -> int:
        """How many plain-run verdicts follow this one: ``steps``, cut to the rounds the session's
        max_new_tokens and the context leave (one token each), and 0 after a committed stop token
        (the one end that cannot be told in advance)."""
        if any(t in stop_ids for t in verdict.tokens):
            return 0
        length = len(session.tokens)
        return max(0, min(steps, budget - length, lm.max_positions - length))

    async def _prefill(self, session: TargetSession) -> tuple[Verdict, int]:
        """The first token, and how many prompt chunks went ahead of it: while other sessions are
        decoding, a long prompt is fed in chunks that share their passes (``PrefillChunk``), so
        their decoding does not stop for it. Once a chunk's pass had no one else in it, the rest
        goes in one pass (more chunks would only add passes)."""
        chunk = min(self.batching.prefill_chunk_tokens, self.batching.max_row_tokens)
        fed = chunks = 0
        shared = len(self.sessions) > 1
        while shared and chunk > 0 and len(session.tokens) - fed > chunk:
            fed += chunk
            _, batch = await self._batched(PrefillChunk(session, fed), chunk)
            shared = batch.size > 1
            self.metrics.prefill_chunks.inc()
            chunks += 1
        return await self._verify(session, DraftProposal(), len(session.tokens) - fed), chunks

    def _start_ahead(self, session: TargetSession, verdict: Verdict, budget: int,
                     lm: LoadedModel, run: bool = False) -> asyncio.Task | None:
        """After a plain round (or the prefill), feed the pending token now (``PendingForward``): the
        next round feeds it whatever it drafts, and a plain round is likely followed by another (a
        session streaming features gets the pending token's from this pass). Not where no further
        block can come. ``run``: inside a plain run the next round is certain, so always (even after
        a drafted round, and with verify-ahead off)."""
        if ((not run and (not self.verify_ahead or verdict.num_drafts > 0))
                or len(session.tokens) >= budget or len(session.tokens) + 1 >= lm.max_positions):
            return None
        return asyncio.ensure_future(self._batched(PendingForward(session), 1))

    async def _verify(self, session: TargetSession, proposal: DraftProposal, num_tokens: int) -> Verdict:
        """Verify in a batched pass with other sessions' pending messages (prefill: empty proposal)."""
        verdict, info = await self._batched((session, proposal), num_tokens)
        return dataclasses.replace(verdict, batch=info)

    def _run_batch(self, jobs: list[VerifyJob]) -> list:
        return verify_batch(self.lm, jobs)

    def _validate_block(self, block, session: TargetSession, lm: LoadedModel, budget: int) -> DraftProposal:
        """The block's proposal, checked before anything of it is applied (``FieldError`` naming the
        field; the session is untouched): the draft count within this verifier's limit, ids in the
        vocabulary, each q well formed (``verification.check_draft_probs``, which says why there is
        no floor under q), the context, and the session's max_new_tokens (capped by
        ``--max-new-tokens-cap``): a session that has generated them all gets no more verdicts, and a
        block whose verdict could pass them is verified on its first drafts only (a prefix of a
        proposal is a proposal: exact), so no verdict commits past them."""
        k = len(block.draft_token_ids)
        if k > self.max_draft_tokens:
            raise FieldError("draft_token_ids", f"{k} drafts exceed this verifier's limit ({self.max_draft_tokens})")
        bad = next((t for t in block.draft_token_ids if t >= lm.vocab_size), None)
        if bad is not None:
            raise FieldError("draft_token_ids", f"id {bad} is outside the vocabulary (size {lm.vocab_size})")
        if len(session.tokens) + k >= lm.max_positions:
            raise FieldError("draft_token_ids", "the block would exceed the model context")
        remaining = budget - len(session.tokens)
        if remaining <= 0:
            raise FieldError("max_new_tokens", f"the session has generated its {session.params.max_new_tokens} "
                             "tokens (sampling.max_new_tokens); no further blocks")
        proposal = convert.proposal_from_pb(block)
        check_draft_probs(proposal, support_bound=lm.vocab_size + MAX_VOCAB_PADDING)  # the gateway relays q unread
        return proposal.prefix(remaining - 1) if k + 1 > remaining else proposal

    @map_unary_errors
    async def CancelVerify(self, request, context):
        self.sessions.cancel(request.session_id, context.peer())  # only the opener's own sessions
        return verifier_pb2.CancelVerifyResponse()

    @map_unary_errors
    async def GetInfo(self, request, context):
        lm = self._require_model()
        return verifier_pb2.GetVerifierInfoResponse(
            model=convert.model_info_pb(lm),
            load=types_pb2.LoadReport(active_sessions=len(self.sessions), max_sessions=self.sessions.max_sessions),
            forward_cost_s=self.forward_cost_s,
            feature_size=lm.feature_size,
        )


async def _settle(ahead: asyncio.Task | None) -> BatchInfo | None:
    """Wait for a session's ahead pass; its BatchInfo as the round saw it (the part of the pass it
    waited for), or None if there was none or it failed (the verification then feeds the pending
    token itself)."""
    if ahead is None:
        return None
    started = time.perf_counter()
    try:
        _, info = await ahead
    except Exception:  # noqa: BLE001 - the verification redoes what the pass did not
        return None
    return BatchInfo(info.size, info.num_tokens, 0.0, min(info.pass_s, time.perf_counter() - started))


def _response(verdict: Verdict, round_number: int, received: float, steps_left: int) -> verifier_pb2.VerifyResponse:
    """A round's verdict on the wire (``received``: when the verifier started on the round)."""
    return verifier_pb2.VerifyResponse(round=round_number, service_time_us=_us_since(received),
                                       plain_steps_left=steps_left, **convert.verdict_fields(verdict))


def _feature_attributes(verdict: Verdict) -> dict:
    """A verdict's target features on its trace step (sessions that asked for them)."""
    if verdict.features is None:
        return {}
    return {"feature_positions": len(verdict.features), "feature_bytes": verdict.features.wire_bytes}


def _us_since(started: float) -> int:
    """Microseconds since ``started`` (``time.perf_counter()``): the response's service_time_us."""
    return int((time.perf_counter() - started) * 1e6)


async def serve(config: VerifierConfig) -> None:
    options = config.serve
    runtime = ServiceRuntime(SERVICE_NAME, options)
    service = VerifierService(runtime, max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s,
                              batching=config.batching, max_sessions_per_peer=config.max_sessions_per_peer,
                              max_new_tokens_cap=config.max_new_tokens_cap, verify_ahead=config.verify_ahead)
    verifier_pb2_grpc.add_VerifierServicer_to_server(service, runtime.server)
    port = await runtime.start()
    runtime.install_signal_handlers()
    log.info("verifier listening on %s:%d (metrics %s)", options.host, port, runtime.metrics_port)
    print(f"specdec verifier listening on {options.host}:{port}", flush=True)
    await service.load(config.target, device=config.device)
    await runtime.wait_and_drain()
