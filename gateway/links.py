"""Engine links over gRPC streams: the gateway's side of the drafter and verifier sessions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from specdec.rpc import convert
from specdec.sampling import DraftProposal, SamplingParams
from specdec.v1 import drafter_pb2, verifier_pb2
from specdec.verification import Verdict

log = logging.getLogger("specdec.gateway")

CLOSE_WAIT_S = 1.0
# What a drafter link survives by proposing nothing from then on.
_DRAFTER_FAILURES = (grpc.aio.AioRpcError, ConnectionError, ValueError, grpc.aio.UsageError)


async def _read(call, what: str, delay_s: float = 0.0):
    response = await call.read()
    if response is grpc.aio.EOF:
        # The server ended the stream without a status error: treat as unavailable.
        raise ConnectionError(f"{what} stream ended early")
    if delay_s:
        await asyncio.sleep(delay_s)  # injected one-way network delay (--net-delay-ms)
    return response


async def _write(call, message, delay_s: float = 0.0) -> None:
    if delay_s:
        await asyncio.sleep(delay_s)
    await call.write(message)


async def _close(call, reader: asyncio.Task | None = None) -> None:
    """Half-close so the service ends the session normally (finishing what it still owes); cancel if
    it does not end promptly. ``reader``: the task already reading this stream, which sees the end."""
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
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError, asyncio.InvalidStateError):
        pass
    finally:
        if reader is not None and not reader.done():
            reader.cancel()
        if not call.done():
            call.cancel()


class RemoteVerifier:
    """``VerifierLink`` over one ``Verifier.Verify`` stream."""

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None, metadata=None, net_delay_s: float = 0.0) -> None:
        self.call = stub.Verify(timeout=timeout, metadata=metadata)
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.round = 0
        self.prefill_service_s = 0.0  # time inside the verifier, from its service_time_us (tracing)
        self.service_s = 0.0

    async def prefill(self) -> Verdict:
        start = verifier_pb2.VerifyStart(
            session_id=self.session_id,
            prompt_token_ids=self.prompt_ids,
            sampling=convert.sampling_to_pb(self.params),
        )
        await _write(self.call, verifier_pb2.VerifyRequest(start=start), self.net_delay_s)
        response = await _read(self.call, "verifier", self.net_delay_s)
        self.prefill_service_s = response.service_time_us * 1e-6
        return convert.verdict_from_pb(response)

    async def verify(self, proposal: DraftProposal) -> Verdict:
        self.round += 1
        block = verifier_pb2.VerifyBlock(round=self.round, **convert.proposal_fields(proposal))
        await _write(self.call, verifier_pb2.VerifyRequest(block=block), self.net_delay_s)
        response = await _read(self.call, "verifier", self.net_delay_s)
        self.service_s += response.service_time_us * 1e-6
        return convert.verdict_from_pb(response)

    async def close(self) -> None:
        await _close(self.call)


class RemoteDrafter:
    """``DrafterLink`` (and ``AheadDrafterLink``) over one ``Drafter.Draft`` stream.

    A drafter failure never fails the request: the link reports itself broken and proposes
    nothing from then on, so the loop continues as plain decoding (k = 0) and stays exact.

    One reader task takes every message off the stream as it arrives and releases it after the
    injected one-way delay, so messages sent back to back (a proposal, then its DraftAhead block)
    are delayed side by side, as on a real link.
    """

    concurrent = True  # the drafter service drafts while the verifier verifies

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 time_remaining: Callable[[], float | None], metadata=None, draft_top_k: int = 0,
                 net_delay_s: float = 0.0) -> None:
        # The stream opens in begin(): a session that never drafts costs the drafter nothing, and
        # one opened late gets the deadline's remaining time then.
        self._stub = stub
        self._time_remaining = time_remaining
        self._metadata = metadata
        self.call = None
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.draft_top_k = draft_top_k
        self.round = 0
        self.service_s = 0.0  # time inside the drafter, from its service_time_us (tracing)
        self.broken: BaseException | None = None
        self._start_task: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._inbox: asyncio.Queue = asyncio.Queue()  # (release time, message or exception)
        self._ahead_owed = False  # a DraftAhead message is on its way
        self._continue_write: asyncio.Task | None = None

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
        if self._start_task is None:
            self.call = self._stub.Draft(timeout=self._time_remaining(), metadata=self._metadata)
            self._reader = asyncio.ensure_future(self._read_loop())
            self._start_task = asyncio.ensure_future(self._start())

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    # The server ended the stream without a status error: treat as unavailable.
                    self._inbox.put_nowait((0.0, ConnectionError("drafter stream ended early")))
                    return
                self._inbox.put_nowait((loop.time() + self.net_delay_s, message))
        except _DRAFTER_FAILURES as exc:
            self._inbox.put_nowait((0.0, exc))

    async def _next(self):
        release, item = await self._inbox.get()
        if isinstance(item, BaseException):
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
        log.warning("drafter failed for session %s (%s); continuing without drafts", self.session_id, exc)
        self.broken = exc
        self.call.cancel()

    async def propose(self, committed: list[int], num_draft_tokens: int, ahead_tokens: int = 0) -> DraftProposal:
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
            await _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s)
            response = await self._next()
            if response.WhichOneof("kind") != "proposal":
                raise ValueError("drafter: expected a DraftProposal message")
            self.service_s += response.proposal.service_time_us * 1e-6
            self._ahead_owed = ahead_tokens > 0
            return convert.proposal_from_pb(response.proposal)
        except _DRAFTER_FAILURES as exc:
            self._fail(exc)
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
                    raise ValueError("drafter: expected a DraftAhead message")
                self.service_s += response.ahead.proposal.service_time_us * 1e-6
                assumed = [int(t) for t in response.ahead.assumed_token_ids]
                return (assumed, convert.proposal_from_pb(response.ahead.proposal)) if assumed else None
        except _DRAFTER_FAILURES as exc:
            self._fail(exc)
            return None

    async def continue_ahead(self, committed: list[int], used: int, ahead_tokens: int) -> None:
        """``used`` tokens of the last ahead block are being verified: draft the block after them.

        Returns at once (the write goes out in the background, after the injected delay)."""
        if self.broken is not None:
            return
        self.round += 1
        propose = drafter_pb2.DraftPropose(round=self.round, committed_token_ids=committed, num_draft_tokens=0,
                                           ahead_tokens=ahead_tokens, ahead_used=used)
        self._continue_write = asyncio.ensure_future(
            _write(self.call, drafter_pb2.DraftRequest(propose=propose), self.net_delay_s))
        self._ahead_owed = True

    async def close(self) -> None:
        """Let the drafter finish what it owes (a block drafted ahead) and end the session normally;
        a broken stream owes nothing and is cancelled at once."""
        if not self.started:
            return  # never opened: no stream to end
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        if self._continue_write is not None:
            await asyncio.gather(self._continue_write, return_exceptions=True)
        if self.broken is not None and not self.call.done():
            self.call.cancel()
        await _close(self.call, self._reader)


# Failures that mean "this verifier is gone", not "this request is bad".
_MIGRATABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
               grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class MigratingVerifier:
    """``VerifierLink`` that survives the loss of its verifier while another replica is ready.

    It tracks the committed text (prompt + tokens so far). When the stream breaks, it opens a
    session on another replica whose prompt is that committed text; the new session's prefill
    yields the next token, exactly the token plain decoding would produce there (random draws are
    keyed by absolute position, so sampling continues identically distributed). The round whose
    drafts were in flight counts as fully rejected. With no other replica, the error propagates
    (the client gets UNAVAILABLE after the tokens already streamed).
    """

    def __init__(self, pool, backend, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 remaining_s, metadata=None, net_delay_s: float = 0.0) -> None:
        self.pool = pool
        self.net_delay_s = net_delay_s
        self.session_id = session_id
        self.params = params
        self.remaining_s = remaining_s  # callable: the client's remaining deadline, or None
        self.metadata = metadata
        self.committed: list[int] = list(prompt_ids)
        self.migrations = 0
        self.backend = backend
        self.link = self._open(backend, self.committed)

    def _open(self, backend, prompt_ids: list[int]) -> RemoteVerifier:
        backend.in_flight += 1
        return RemoteVerifier(backend.stub, self.session_id, list(prompt_ids), self.params,
                              self.remaining_s(), self.metadata, self.net_delay_s)

    async def _migrate(self, error: BaseException) -> Verdict:
        failed = self.backend
        replacement = self.pool.pick(exclude={failed.address})
        if replacement is None:
            raise error
        log.warning("verifier %s failed for session %s (%s); re-prefilling %d tokens on %s",
                    failed.address, self.session_id, error, len(self.committed), replacement.address)
        failed.in_flight -= 1
        failed.info = None  # not ready until its next successful refresh
        self.link.call.cancel()
        self.backend = replacement
        self.link = self._open(replacement, self.committed)
        self.migrations += 1
        return await self.link.prefill()

    async def _guarded(self, operation) -> Verdict:
        try:
            return await operation()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _MIGRATABLE:
                raise
            return await self._migrate(exc)
        except ConnectionError as exc:
            return await self._migrate(exc)

    async def prefill(self) -> Verdict:
        verdict = await self._guarded(self.link.prefill)
        self.committed.extend(verdict.tokens)
        return verdict

    async def verify(self, proposal: DraftProposal) -> Verdict:
        link = self.link
        verdict = await self._guarded(lambda: link.verify(proposal))
        if self.link is not link:  # migrated mid-round: the drafts in flight count as rejected
            verdict = Verdict(len(proposal), 0, verdict.tokens, verdict.committed_length)
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
