"""Engine links over gRPC streams: the gateway's side of the drafter and verifier sessions.

Every way a downstream stream can end under a request (a status error, an end without one, a write
to a stream that already finished, a reset connection, a message that does not parse, the call
cancelled beneath us) is a *lost stream*: a drafter link then proposes nothing (the request goes on
at k = 0, still exact), a verifier link migrates to another replica or raises ``StreamLost``
(``UNAVAILABLE`` for the client). Only a cancel of the request's own task passes through as one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from specdec.rpc import convert
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
from specdec.telemetry.logs import printable
from specdec.v1 import drafter_pb2, verifier_pb2
from specdec.wire_types import DraftProposal, EncodedFeatures, SamplingParams, Verdict

from gateway.feature_relay import FeatureRelay

log = logging.getLogger("specdec.gateway")

CLOSE_WAIT_S = 1.0


class StreamLost(ConnectionError):
    """A downstream stream ended mid-request (the client sees ``UNAVAILABLE``)."""


# How a peer's stream fails under us, as opposed to a bug here or a request's bad value: grpc
# statuses and usage errors, ``InvalidStateError`` from a write to a finished call, OS-level
# connection errors (resets), and messages that do not parse (DecodeError; a message that parses
# but makes no sense is turned into ``StreamLost`` where it is read). A ``ValueError`` is not one:
# building our own message from a request's value raises it, and that is the request's error.
STREAM_FAILURES = (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError, OSError, EOFError,
                   DecodeError)


def own_cancel() -> bool:
    """True when the running task itself is being cancelled (a client cancel, a deadline, the
    loop closing), as opposed to a ``CancelledError`` that a cancelled grpc call raised beneath it.
    (Python 3.10 cannot tell the two apart: every ``CancelledError`` counts as our own there.)"""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    return task is None or cancelling is None or cancelling() > 0


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _read(call, what: str, delay_s: float = 0.0):
    response = await call.read()
    if response is grpc.aio.EOF:
        # The server ended the stream without a status error: treat as unavailable.
        raise StreamLost(f"{what} stream ended early")
    if response is None:  # grpc logs the parse failure and hands us None
        raise StreamLost(f"{what} sent a message that does not parse")
    if delay_s:
        await asyncio.sleep(delay_s)  # injected one-way network delay (--net-delay-ms)
    return response


async def _write(call, message, delay_s: float = 0.0) -> None:
    if delay_s:
        await asyncio.sleep(delay_s)
    await call.write(message)


async def _end_stream(call, reader: asyncio.Task | None, start: asyncio.Future | None) -> None:
    """A drafter session's stream ended as ``_close`` ends one, its start cancelled (or its failure
    retrieved: a failed start is not "never retrieved")."""
    if start is not None:
        if not start.done():
            start.cancel()
        elif not start.cancelled():
            start.exception()
    if call is not None:
        await _close(call, reader)


async def _close(call, reader: asyncio.Task | None = None) -> None:
    """Half-close so the service ends the session normally (finishing what it still owes); cancel if
    it does not end promptly. ``reader``: the task already reading this stream, which sees the end.
    Never raises for the stream's sake: whatever state the stream is in, it ends here."""
    try:
        if call.done():
            return
        await call.done_writing()
        if reader is not None:
            await asyncio.wait_for(asyncio.shield(reader), CLOSE_WAIT_S)
        else:
            await asyncio.wait_for(call.wait_for_connection(), CLOSE_WAIT_S)
            while await asyncio.wait_for(call.read(), CLOSE_WAIT_S) is not grpc.aio.EOF:
                pass
    except asyncio.CancelledError:
        if own_cancel():
            raise
    except (asyncio.TimeoutError, *STREAM_FAILURES):
        pass
    finally:
        if reader is not None and not reader.done():
            reader.cancel()
        if not call.done():
            call.cancel()


def _proposal(message, max_tokens: int, vocab_size: int | None) -> DraftProposal:
    """A drafter's proposal message, its tokens checked as the verifier will check them (at most the
    drafts asked for, ids in the vocabulary): one that fails is the drafter's failure (the request
    goes on without drafts), never a verifier's refusal passed on to the client. Each q goes on as
    received: the verifier, which reads it, checks it (``MigratingVerifier`` handles its refusal).
    ``vocab_size`` None: ids are not checked (a link driven without a tokenizer)."""
    proposal = convert.proposal_from_pb(message)
    if len(proposal) > max_tokens:
        raise StreamLost(f"drafter proposed {len(proposal)} tokens where {max_tokens} were asked for")
    bad = None if vocab_size is None else next((t for t in proposal.draft_tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise StreamLost(f"drafter proposed id {bad}, outside the vocabulary (size {vocab_size})")
    estimates = list(message.acceptance_estimates)
    if estimates:
        if len(estimates) != len(proposal) or not all(0.0 <= e <= 1.0 for e in estimates):
            raise StreamLost("drafter sent acceptance estimates that are not one probability per draft")
        proposal.acceptance_estimates = estimates
    return proposal


class RemoteVerifier:
    """``VerifierLink`` over one ``Verifier.Verify`` stream."""

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None, metadata=None, net_delay_s: float = 0.0, want_features: bool = False) -> None:
        self.call = stub.Verify(timeout=timeout, metadata=metadata)
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.want_features = want_features
        self.round = 0
        self.prefill_service_s = 0.0  # time inside the verifier, from its service_time_us (tracing)
        self.service_s = 0.0
        self.run_left = 0  # verdicts of a plain run the verifier still owes (it reads no block until then)

    async def _verdict(self, max_run: int = 0) -> tuple[Verdict, float]:
        response = await _read(self.call, "verifier", self.net_delay_s)
        if response.plain_steps_left > max_run:
            raise StreamLost(f"verifier announced {response.plain_steps_left} plain-run verdicts where at most "
                             f"{max_run} were asked for")
        try:
            verdict = convert.verdict_from_pb(response)
        except (ValueError, TypeError, AttributeError) as exc:
            raise StreamLost(f"verifier sent a malformed verdict ({describe(exc)})") from exc
        self.run_left = response.plain_steps_left
        return verdict, response.service_time_us * 1e-6

    async def prefill(self) -> Verdict:
        start = verifier_pb2.VerifyStart(
            session_id=self.session_id,
            prompt_token_ids=self.prompt_ids,
            sampling=convert.sampling_to_pb(self.params),
            want_features=self.want_features,
        )
        await _write(self.call, verifier_pb2.VerifyRequest(start=start), self.net_delay_s)
        verdict, self.prefill_service_s = await self._verdict()
        return verdict

    async def verify(self, proposal: DraftProposal, plain_steps: int = 0) -> Verdict:
        """This round's verdict. ``plain_steps``: the caller's promise that the next that many rounds
        are plain (empty proposals): the block asks for a plain run, and those rounds' verdicts come
        without a block each (``VerifyBlock.plain_steps``). During a run ``plain_steps`` is ignored."""
        self.round += 1
        started = time.perf_counter()
        if self.run_left > 0:
            if len(proposal):
                raise RuntimeError("drafts to verify during a plain run (the caller promised plain rounds)")
            verdict, service_s = await self._verdict(self.run_left - 1)
        else:
            block = verifier_pb2.VerifyBlock(round=self.round, plain_steps=plain_steps,
                                             **convert.proposal_fields(proposal))
            self.run_left = plain_steps  # owed from the write on: a close before the verdict cancels the run
            await _write(self.call, verifier_pb2.VerifyRequest(block=block), self.net_delay_s)
            verdict, service_s = await self._verdict(plain_steps)
        # A run's round was under way in the verifier before this wait began (its pass starts as the
        # verdict before it goes out): of its service and pass time, count what this wait held.
        service_s = min(service_s, time.perf_counter() - started)
        if verdict.batch is not None and verdict.batch.pass_s > service_s:
            verdict = dataclasses.replace(verdict, batch=dataclasses.replace(verdict.batch, pass_s=service_s))
        self.service_s += service_s
        return verdict

    async def close(self) -> None:
        if self.run_left > 0:  # the verifier reads the half-close only after its run: stop it now
            self.call.cancel()
        await _close(self.call)


class RemoteDrafter:
    """``DrafterLink`` (and ``AheadDrafterLink``) over one ``Drafter.Draft`` stream.

    A drafter failure never fails the request: whatever ends the stream (see the module's
    docstring; even an unexpected error here, logged with its traceback), the link reports itself
    broken and proposes nothing from then on, so the loop continues as plain decoding (k = 0) and
    stays exact. Only a cancel of the request itself propagates.

    One reader task takes every message off the stream as it arrives and releases it after the
    injected one-way delay, so messages sent back to back (a proposal, then its DraftAhead block)
    are delayed side by side, as on a real link.
    """

    concurrent = True  # the drafter service drafts while the verifier verifies

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 time_remaining: Callable[[], float | None], metadata=None, draft_top_k: int = 0,
                 net_delay_s: float = 0.0, request_id: str = "", reads_features: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, vocab_size: int | None = None,
                 cache_scope: str = "") -> None:
        # The stream opens in begin(): a session that never drafts costs the drafter nothing, and
        # one opened late gets the deadline's remaining time then.
        self._stub = stub
        self._time_remaining = time_remaining
        self._metadata = metadata
        self.call = None
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.request_id = printable(request_id or session_id)  # for the logs: the client's id, escaped
        self.prompt_ids = prompt_ids
        self.params = params
        self.draft_top_k = draft_top_k
        self.round = 0
        self.service_s = 0.0  # time inside the drafter, from its service_time_us (tracing)
        self.broken: BaseException | None = None
        self._start_task: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()  # (release time, message or exception)
        self._ahead_owed = False  # a DraftAhead message is on its way
        self._ahead_tokens = 0  # the size of the block asked to be drafted ahead
        self.vocab_size = vocab_size  # the proposals' ids are checked against it (None: not checked)
        self.cache_scope = cache_scope  # a suffix drafter's scope for this request's text
        self._continue_write: asyncio.Task | None = None
        # A feature-level drafter (EAGLE): verdicts' target features wait here for the next proposal,
        # the newest of them only, never more than one message holds (``FeatureRelay``).
        self.reads_features = reads_features
        self.holds_features = True  # the relay is bounded, and each proposal takes it as it starts
        self.max_message_bytes = max_message_bytes  # what the channel to the drafter sends at most
        self._features = FeatureRelay(max_message_bytes)
        self._told: list[int] = []  # tokens the proposals carried to the drafter (its context past the prompt)
        self._ending: list[asyncio.Future] = []  # streams of suspended sessions, ending

    def add_features(self, features: EncodedFeatures) -> None:
        if self.broken is None:
            self._features.add(features)

    @property
    def feature_bytes_held(self) -> int:
        """Bytes of features waiting for the next proposal (at most ``max_message_bytes``)."""
        return self._features.nbytes

    @property
    def started(self) -> bool:
        """The session was opened (``begin``, or the first ``propose``)."""
        return self._start_task is not None

    @property
    def ready(self) -> bool:
        """The session is open and its prompt prefilled: a proposal now costs only drafting."""
        return self._start_task is not None and self._start_task.done()

    def begin(self) -> None:
        """Open the session now so the drafter's prefill overlaps the verifier's."""
        if self._start_task is not None:
            return
        try:
            self.call = self._stub.Draft(timeout=self._time_remaining(), metadata=self._metadata)
        except Exception as exc:  # noqa: BLE001 - e.g. its channel closed under us: draft nothing
            self._start_task = asyncio.get_running_loop().create_future()
            self._start_task.set_result(None)
            self._fail(exc)
            return
        self._reader = asyncio.ensure_future(self._read_loop(self.call, self._inbox))
        self._start_task = asyncio.ensure_future(self._start())

    async def _read_loop(self, call, inbox: asyncio.Queue) -> None:
        """Every message of ``call`` (or the one failure that ends it) goes to ``inbox``, its session's:
        whoever waits there always gets an answer, and a suspended session's end reaches no later one."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = await _read(call, "drafter")
                inbox.put_nowait((loop.time() + self.net_delay_s, message))
        except asyncio.CancelledError:
            inbox.put_nowait((0.0, StreamLost("drafter stream cancelled")))
            if own_cancel():
                raise
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, which decides
            inbox.put_nowait((0.0, exc))

    async def _next(self):
        release, item = await self._inbox.get()
        if isinstance(item, BaseException):
            self._inbox.put_nowait((release, item))  # the stream stays ended for every later reader
            raise item
        wait = release - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)  # injected one-way network delay (--net-delay-ms)
        return item

    async def _start(self) -> None:
        start = drafter_pb2.DraftStart(
            session_id=self.session_id,
            prompt_token_ids=self.prompt_ids,
            sampling=convert.sampling_to_pb(self.params),
            draft_top_k=self.draft_top_k,
            cache_scope=self.cache_scope,
        )
        await _write(self.call, drafter_pb2.DraftRequest(start=start), self.net_delay_s)
        await self._next()

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            if isinstance(exc, STREAM_FAILURES):
                log.warning("drafter failed for request %s (drafter session %s): %s; continuing without drafts",
                            self.request_id, self.session_id, describe(exc))
            else:  # not the stream's doing: a bug here, shown as one (the request still completes)
                log.error("drafter link error for request %s (drafter session %s); continuing without drafts",
                          self.request_id, self.session_id, exc_info=exc)
            self.broken = exc
        if self.call is not None:
            self.call.cancel()

    def _lost(self, exc: BaseException) -> None:
        """``exc`` ended a drafter operation: fail the link, unless the request itself is being
        cancelled (then ``exc`` propagates)."""
        if isinstance(exc, asyncio.CancelledError):
            if own_cancel():
                raise exc
            exc = StreamLost("drafter stream cancelled")
        self._fail(exc)

    async def propose(self, committed: list[int], num_draft_tokens: int, ahead_tokens: int = 0) -> DraftProposal:
        # The features handed over so far belong to ``committed``: taken now, before any await lets a
        # later verdict's features in.
        features = self._features.take()
        if self.broken is not None:
            return DraftProposal()
        try:
            self.begin()
            await self._start_task
            if self._ahead_owed:  # a block nobody used (rounds with k = 0): it comes first on the stream
                await self.take_ahead()
            if self.broken is not None:
                return DraftProposal()
            self.round += 1
            propose = drafter_pb2.ProposalRequest(
                round=self.round, committed_token_ids=committed, num_draft_tokens=num_draft_tokens,
                ahead_tokens=ahead_tokens,
            )
            convert.attach_features(propose, features, self.max_message_bytes)
            await _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s)
            self._told.extend(committed)
            response = await self._next()
            if response.WhichOneof("kind") != "proposal":
                raise StreamLost("drafter: expected a DraftProposal message")
            self.service_s += response.proposal.service_time_us * 1e-6
            self._ahead_owed, self._ahead_tokens = ahead_tokens > 0, ahead_tokens
            return _proposal(response.proposal, num_draft_tokens, self.vocab_size)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - only the request's own cancel escapes
            self._lost(exc)
            return DraftProposal()

    async def take_ahead(self) -> tuple[list[int], DraftProposal] | None:
        """The block drafted ahead during the last verification (waits for it if still coming)."""
        if not self._ahead_owed or self.broken is not None:
            return None
        self._ahead_owed = False
        try:
            if self._continue_write is not None:
                write, self._continue_write = self._continue_write, None
                await write
            while True:
                response = await self._next()
                kind = response.WhichOneof("kind")
                if kind == "proposal":  # the empty answer to a continue_ahead request
                    continue
                if kind != "ahead":
                    raise StreamLost("drafter: expected a DraftAhead message")
                self.service_s += response.ahead.proposal.service_time_us * 1e-6
                assumed = [int(t) for t in response.ahead.assumed_token_ids]
                return (assumed, _proposal(response.ahead.proposal, self._ahead_tokens, self.vocab_size)) if assumed else None
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - see _lost
            self._lost(exc)
            return None

    async def continue_ahead(self, committed: list[int], used: int, ahead_tokens: int) -> None:
        """``used`` tokens of the last ahead block are being verified: draft the block after them.

        Returns at once (the write goes out in the background, after the injected delay; a failed
        write surfaces in ``take_ahead``)."""
        features = self._features.take()
        if self.broken is not None:
            return
        self.round += 1
        propose = drafter_pb2.ProposalRequest(round=self.round, committed_token_ids=committed, num_draft_tokens=0,
                                           ahead_tokens=ahead_tokens, ahead_used=used)
        convert.attach_features(propose, features, self.max_message_bytes)
        self._continue_write = asyncio.ensure_future(
            _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s))
        self._told.extend(committed)
        self._ahead_owed, self._ahead_tokens = True, ahead_tokens

    def suspend(self) -> None:
        """End the session now (in the background), keeping the link: a request settled on plain
        decoding holds no drafter state. A later proposal opens a new session whose prompt is
        everything the drafter had been told (this session's prompt, then the proposals' tokens),
        so it drafts as the old one would have. Not while a block drafted ahead is owed."""
        if not self.started or self.broken is not None or self._ahead_owed:
            return
        call, reader, start = self.call, self._reader, self._start_task
        self.prompt_ids = [*self.prompt_ids, *self._told]
        self._told = []
        self.call = self._reader = self._start_task = self._continue_write = None
        self._inbox = asyncio.Queue()
        self._ending.append(asyncio.ensure_future(_end_stream(call, reader, start)))

    async def close(self) -> None:
        """Let the drafter finish what it owes (a block drafted ahead) and end the session normally;
        a broken stream owes nothing and is cancelled at once."""
        if self._ending:
            await asyncio.gather(*self._ending, return_exceptions=True)
        if not self.started:
            return  # never opened (or suspended since): no stream to end
        if self._continue_write is not None:
            await asyncio.gather(self._continue_write, return_exceptions=True)
        if self.broken is not None and self.call is not None and not self.call.done():
            self.call.cancel()
        await _end_stream(self.call, self._reader, self._start_task)
