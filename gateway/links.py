"""Engine links over gRPC streams: the gateway's side of the drafter and verifier sessions.

Every way a downstream stream can end under a request (a status error, an end without one, a write
to a stream that already finished, a reset connection, a message that does not parse, the call
cancelled beneath us) is a *lost stream*: a drafter link then proposes nothing (the request goes on
at k = 0, still exact), a verifier link migrates to another replica or raises ``StreamLost``
(``UNAVAILABLE`` for the client). Only a cancel of the request's own task passes through as one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from specdec.rpc import convert
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, REQUEST_STATUSES
from specdec.sampling import DraftProposal, SamplingParams
from specdec.target_features import EncodedFeatures, FeatureRelay, TargetFeatures
from specdec.telemetry.logs import printable
from specdec.v1 import drafter_pb2, verifier_pb2
from specdec.verification import Verdict

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


def _proposal(message) -> DraftProposal:
    """A drafter's proposal message; one that parses but makes no sense is the drafter's failure."""
    try:
        return convert.proposal_from_pb(message)
    except (ValueError, TypeError) as exc:
        raise StreamLost(f"drafter sent a malformed proposal ({describe(exc)})") from exc


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

    async def _verdict(self) -> tuple[Verdict, float]:
        response = await _read(self.call, "verifier", self.net_delay_s)
        try:
            return convert.verdict_from_pb(response), response.service_time_us * 1e-6
        except (ValueError, TypeError, AttributeError) as exc:
            raise StreamLost(f"verifier sent a malformed verdict ({describe(exc)})") from exc

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

    async def verify(self, proposal: DraftProposal) -> Verdict:
        self.round += 1
        block = verifier_pb2.VerifyBlock(round=self.round, **convert.proposal_fields(proposal))
        await _write(self.call, verifier_pb2.VerifyRequest(block=block), self.net_delay_s)
        verdict, service_s = await self._verdict()
        self.service_s += service_s
        return verdict

    async def close(self) -> None:
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
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        # The stream opens in begin(): a session that never drafts costs the drafter nothing, and
        # one opened late gets the deadline's remaining time then.
        self._stub = stub
        self._time_remaining = time_remaining
        self._metadata = metadata
        self.call = None
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.request_id = request_id or session_id  # for the logs: the client's id
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
        self._continue_write: asyncio.Task | None = None
        # A feature-level drafter (EAGLE): verdicts' target features wait here for the next proposal,
        # the newest of them only, never more than one message holds (``FeatureRelay``).
        self.reads_features = reads_features
        self.holds_features = True  # the relay is bounded, and each proposal takes it as it starts
        self.max_message_bytes = max_message_bytes  # what the channel to the drafter sends at most
        self._features = FeatureRelay(max_message_bytes)

    def add_features(self, features: EncodedFeatures | TargetFeatures) -> None:
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
        self._reader = asyncio.ensure_future(self._read_loop())
        self._start_task = asyncio.ensure_future(self._start())

    async def _read_loop(self) -> None:
        """Every message (or the one failure that ends the stream) goes to the inbox: whoever waits
        there always gets an answer."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = await _read(self.call, "drafter")
                self._inbox.put_nowait((loop.time() + self.net_delay_s, message))
        except asyncio.CancelledError:
            self._inbox.put_nowait((0.0, StreamLost("drafter stream cancelled")))
            if own_cancel():
                raise
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, which decides
            self._inbox.put_nowait((0.0, exc))

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
            propose = drafter_pb2.DraftPropose(
                round=self.round, committed_token_ids=committed, num_draft_tokens=num_draft_tokens,
                ahead_tokens=ahead_tokens,
            )
            convert.attach_features(propose, features, self.max_message_bytes)
            await _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s)
            response = await self._next()
            if response.WhichOneof("kind") != "proposal":
                raise StreamLost("drafter: expected a DraftProposal message")
            self.service_s += response.proposal.service_time_us * 1e-6
            self._ahead_owed = ahead_tokens > 0
            return _proposal(response.proposal)
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
                return (assumed, _proposal(response.ahead.proposal)) if assumed else None
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
        propose = drafter_pb2.DraftPropose(round=self.round, committed_token_ids=committed, num_draft_tokens=0,
                                           ahead_tokens=ahead_tokens, ahead_used=used)
        convert.attach_features(propose, features, self.max_message_bytes)
        self._continue_write = asyncio.ensure_future(
            _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s))
        self._ahead_owed = True

    async def close(self) -> None:
        """Let the drafter finish what it owes (a block drafted ahead) and end the session normally;
        a broken stream owes nothing and is cancelled at once."""
        if not self.started:
            return  # never opened: no stream to end
        if not self._start_task.done():
            self._start_task.cancel()
        elif not self._start_task.cancelled():
            self._start_task.exception()  # retrieved: a failed start is not "never retrieved"
        if self._continue_write is not None:
            await asyncio.gather(self._continue_write, return_exceptions=True)
        if self.call is None:
            return
        if self.broken is not None and not self.call.done():
            self.call.cancel()
        await _close(self.call, self._reader)


class VerifierUnavailable(StreamLost):
    """The verifier's stream broke and no other replica could take the session over."""


class MigratingVerifier:
    """``VerifierLink`` that survives the loss of its verifier.

    It tracks the committed text (prompt + tokens so far). When the stream breaks (any lost stream,
    see the module's docstring, or a status that is not about the request: anything outside
    ``REQUEST_STATUSES``, a refused service credential included), it opens a session on another
    ready replica, or, while none is ready, waits for one (a restart, a rollout) up to ``wait_s()``
    (the gateway's ``--verifier-wait`` within the request's deadline); the new session's prompt is
    that committed text, and its prefill yields the next token, exactly the token plain decoding
    would produce there (random draws are keyed by absolute position, so sampling continues
    identically distributed). The round whose drafts were in flight counts as fully rejected. A
    replica whose stream failed is taken again only once it has become ready again since (a
    restart at the same address). With none ready in time, ``VerifierUnavailable`` (the client gets
    UNAVAILABLE after the tokens already streamed). Other statuses (DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, INVALID_ARGUMENT, ...) pass on, and so does any error that is not the
    stream's (a request's bad value).
    """

    def __init__(self, pool, backend, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 remaining_s, metadata=None, net_delay_s: float = 0.0, request_id: str = "",
                 want_features: bool = False, wait_s: Callable[[], float] = lambda: 0.0) -> None:
        self.pool = pool
        self.want_features = want_features  # every replica's session streams the target's features
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.request_id = printable(request_id or session_id)  # for the logs: the client's id
        self.params = params
        self.remaining_s = remaining_s  # callable: the client's remaining deadline, or None
        self.wait_s = wait_s  # callable: how long to wait for a ready replica now
        self.metadata = metadata
        self.committed: list[int] = list(prompt_ids)
        self.migrations = 0
        self.link = self._open(backend, self.committed)
        self.backend = backend

    def _open(self, backend, prompt_ids: list[int]) -> RemoteVerifier:
        link = RemoteVerifier(backend.stub, self.session_id, list(prompt_ids), self.params,
                              self.remaining_s(), self.metadata, self.net_delay_s, self.want_features)
        backend.in_flight += 1  # once the link exists: close() lowers it again
        return link

    async def _replace(self, error: BaseException, failed: dict[str, int]) -> None:
        """Move the session to another ready replica (waiting for one if none is), or raise
        ``VerifierUnavailable``."""
        lost = self.backend
        failed[lost.address] = lost.ready_epoch
        self.pool.mark_failed(lost)
        self.link.call.cancel()
        replacement = self.pool.pick(failed=failed)
        if replacement is None:
            wait_s = self.wait_s()
            log.warning("verifier %s failed for request %s (verifier session %s): %s; no other replica is ready, "
                        "waiting up to %.0f s for one", lost.address, self.request_id, self.session_id,
                        describe(error), wait_s)
            replacement = await self.pool.wait_pick(wait_s, failed=failed)
            if replacement is None:
                raise VerifierUnavailable(f"verifier {lost.address} failed mid-request ({describe(error)}) "
                                          f"and no verifier replica was ready within {wait_s:.0f} s") from error
        log.warning("verifier %s failed for request %s (verifier session %s): %s; re-prefilling %d tokens on %s",
                    lost.address, self.request_id, self.session_id, describe(error), len(self.committed),
                    replacement.address)
        self.link = self._open(replacement, self.committed)
        lost.in_flight -= 1
        self.backend = replacement
        self.migrations += 1

    async def _guarded(self, operation) -> Verdict:
        failed: dict[str, int] = {}
        while True:
            try:
                return await operation()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in REQUEST_STATUSES:
                    raise
                error: BaseException = exc
            except asyncio.CancelledError:
                if own_cancel():
                    raise
                error = StreamLost("verifier stream cancelled")
            except STREAM_FAILURES as exc:
                error = exc
            await self._replace(error, failed)
            operation = self.link.prefill  # the new session's prefill yields the next token

    async def prefill(self) -> Verdict:
        verdict = await self._guarded(self.link.prefill)
        self.committed.extend(verdict.tokens)
        return verdict

    async def verify(self, proposal: DraftProposal) -> Verdict:
        link = self.link
        verdict = await self._guarded(lambda: link.verify(proposal))
        if self.link is not link:  # migrated mid-round: the drafts in flight count as rejected
            verdict = Verdict(len(proposal), 0, verdict.tokens, verdict.committed_length, features=verdict.features)
        self.committed.extend(verdict.tokens)
        return verdict

    @property
    def service_s(self) -> float:
        return getattr(self.link, "service_s", 0.0)

    @property
    def prefill_service_s(self) -> float:
        return getattr(self.link, "prefill_service_s", 0.0)

    async def close(self) -> None:
        self.backend.in_flight -= 1
        await self.link.close()
