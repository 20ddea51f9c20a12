"""Engine links over gRPC streams: the gateway's side of the drafter and verifier sessions."""

from __future__ import annotations

import asyncio
import logging

import grpc

from specdec.rpc import convert
from specdec.sampling import DraftProposal, SamplingParams
from specdec.v1 import drafter_pb2, verifier_pb2
from specdec.verification import Verdict

log = logging.getLogger("specdec.gateway")

CLOSE_WAIT_S = 1.0


async def _read(call, what: str):
    response = await call.read()
    if response is grpc.aio.EOF:
        # The server ended the stream without a status error: treat as unavailable.
        raise ConnectionError(f"{what} stream ended early")
    return response


async def _close(call) -> None:
    """Half-close so the service ends the session normally; cancel if it does not end promptly."""
    if call.done():
        return
    try:
        await call.done_writing()
        await asyncio.wait_for(call.wait_for_connection(), CLOSE_WAIT_S)
        while await asyncio.wait_for(call.read(), CLOSE_WAIT_S) is not grpc.aio.EOF:
            pass
    except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError, asyncio.InvalidStateError):
        pass
    finally:
        if not call.done():
            call.cancel()


class RemoteVerifier:
    """``VerifierLink`` over one ``Verifier.Verify`` stream."""

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None, metadata=None) -> None:
        self.call = stub.Verify(timeout=timeout, metadata=metadata)
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.round = 0

    async def prefill(self) -> Verdict:
        start = verifier_pb2.VerifyStart(
            session_id=self.session_id,
            prompt_token_ids=self.prompt_ids,
            sampling=convert.sampling_to_pb(self.params),
        )
        await self.call.write(verifier_pb2.VerifyRequest(start=start))
        return convert.verdict_from_pb(await _read(self.call, "verifier"))

    async def verify(self, proposal: DraftProposal) -> Verdict:
        self.round += 1
        block = verifier_pb2.VerifyBlock(round=self.round, **convert.proposal_fields(proposal))
        await self.call.write(verifier_pb2.VerifyRequest(block=block))
        return convert.verdict_from_pb(await _read(self.call, "verifier"))

    async def close(self) -> None:
        await _close(self.call)


class RemoteDrafter:
    """``DrafterLink`` over one ``Drafter.Draft`` stream.

    A drafter failure never fails the request: the link reports itself broken and proposes
    nothing from then on, so the loop continues as plain decoding (k = 0) and stays exact.
    """

    def __init__(self, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 timeout: float | None, metadata=None, draft_top_k: int = 0) -> None:
        self.call = stub.Draft(timeout=timeout, metadata=metadata)
        self.session_id = session_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.draft_top_k = draft_top_k
        self.round = 0
        self.broken: BaseException | None = None
        self._start_task: asyncio.Task | None = None

    def begin(self) -> None:
        """Open the session now so the drafter's prefill overlaps the verifier's."""
        if self._start_task is None:
            self._start_task = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        start = drafter_pb2.DraftStart(
            session_id=self.session_id,
            prompt_token_ids=self.prompt_ids,
            sampling=convert.sampling_to_pb(self.params),
            draft_top_k=self.draft_top_k,
        )
        await self.call.write(drafter_pb2.DraftRequest(start=start))
        await _read(self.call, "drafter")

    async def propose(self, committed: list[int], num_draft_tokens: int) -> DraftProposal:
        if self.broken is not None:
            return DraftProposal()
        try:
            self.begin()
            await self._start_task
            self.round += 1
            propose = drafter_pb2.DraftPropose(
                round=self.round, committed_token_ids=committed, num_draft_tokens=num_draft_tokens
            )
            await self.call.write(drafter_pb2.DraftRequest(propose=propose))
            response = await _read(self.call, "drafter")
            return convert.proposal_from_pb(response.proposal)
        except (grpc.aio.AioRpcError, ConnectionError, ValueError, grpc.aio.UsageError) as exc:
            log.warning("drafter failed for session %s (%s); continuing without drafts", self.session_id, exc)
            self.broken = exc
            self.call.cancel()
            return DraftProposal()

    async def close(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        await _close(self.call)
