"""A verifier session that survives the loss of its verifier (``MigratingVerifier``): the
gateway's side of a ``Verifier.Verify`` stream, moved to another ready replica (or the same one
restarted) when the stream is lost (``gateway/links.py`` says what counts as lost)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from specdec.rpc.server import REQUEST_STATUSES, error_field
from specdec.telemetry.logs import printable
from specdec.wire_types import DraftProposal, SamplingParams, Verdict

from gateway.links import STREAM_FAILURES, RemoteVerifier, StreamLost, describe, own_cancel

log = logging.getLogger("specdec.gateway")

# A request moves to another verifier at most this many times per replica in the pool.
MAX_MIGRATIONS_PER_REPLICA = 2
# The block fields only a drafter writes: a verifier's INVALID_ARGUMENT naming one is the drafter's fault.
DRAFTER_FIELDS = ("draft_probs",)


def refused_drafter_field(exc: BaseException) -> str | None:
    """The drafter-written field a verifier's refusal names (its status carries it), else None."""
    field = error_field(exc)
    return field if field is not None and field.split("[")[0].split(".")[0] in DRAFTER_FIELDS else None


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

    The gateway relays each draft's q unread, so a drafter's malformed q reaches the verifier, which
    refuses the block (INVALID_ARGUMENT naming ``draft_probs...``) and ends the session: that is the
    drafter's fault, not the client's nor the replica's. The session reopens on the same replica (the
    round counts as fully rejected, as after a move) and, for the rest of the request, blocks that
    carry a q go out without their drafts (plain decoding there: exact).
    """

    def __init__(self, pool, replica, session_id: str, prompt_ids: list[int], params: SamplingParams,
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
        # What one request may spend on failed verifiers, so that a request whose text makes every
        # verifier fail (a crash on this input) cannot cycle through the pool, or through one
        # restarting replica, for ever: one --verifier-wait of waiting in all, and a few moves.
        self.max_migrations = MAX_MIGRATIONS_PER_REPLICA * max(1, len(pool.replicas))
        self._wait_until: float | None = None  # loop time the waiting budget ends (set at the first wait)
        self.link = self._open(replica, self.committed)
        self.replica = replica
        self.q_refused: str | None = None  # the field a verifier refused in this request's drafter's q
        self.run_left = 0  # plain rounds the engine has promised after the current one

    def _open(self, replica, prompt_ids: list[int]) -> RemoteVerifier:
        link = RemoteVerifier(replica.stub, self.session_id, list(prompt_ids), self.params,
                              self.remaining_s(), self.metadata, self.net_delay_s, self.want_features)
        replica.in_flight += 1  # once the link exists: close() lowers it again
        return link

    async def _replace(self, error: BaseException, failed: dict[str, int]) -> None:
        """Move the session to another ready replica (waiting for one if none is), or raise
        ``VerifierUnavailable``."""
        lost = self.replica
        failed[lost.address] = lost.ready_epoch
        self.pool.mark_not_ready(lost)
        self.link.call.cancel()
        if self.migrations >= self.max_migrations:
            log.warning("verifier %s failed for request %s (verifier session %s): %s; %d moves already, giving up",
                        lost.address, self.request_id, self.session_id, describe(error), self.migrations)
            raise VerifierUnavailable(f"verifier {lost.address} failed mid-request ({describe(error)}) after "
                                      f"{self.migrations} moves to other replicas") from error
        replacement = self.pool.pick(failed=failed)
        if replacement is None:
            loop = asyncio.get_running_loop()
            if self._wait_until is None:
                self._wait_until = loop.time() + self.wait_s()
            wait_s = max(0.0, min(self._wait_until - loop.time(), self.wait_s()))
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
        self.replica = replacement
        self.migrations += 1

    def _reopen_after_refused_q(self, exc: grpc.aio.AioRpcError, field: str) -> None:
        """The same replica, a new session over the committed text (see the class docstring)."""
        log.warning("verifier %s refused the drafter's q for request %s (%s: %s); re-prefilling %d tokens there, "
                    "no more sampled drafts for this request", self.replica.address, self.request_id, field,
                    exc.details(), len(self.committed))
        self.q_refused = field
        self.link.call.cancel()
        self.link = self._open(self.replica, self.committed)
        self.replica.in_flight -= 1  # _open counted the new link; the old one's count passes to it

    async def _guarded(self, operation) -> Verdict:
        failed: dict[str, int] = {}
        while True:
            try:
                return await operation()
            except grpc.aio.AioRpcError as exc:
                field = refused_drafter_field(exc) if self.q_refused is None else None
                if field is not None:
                    self._reopen_after_refused_q(exc, field)
                    operation = self.link.prefill
                    continue
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

    async def verify(self, proposal: DraftProposal, plain_steps: int = 0) -> Verdict:
        """One round (``RemoteVerifier.verify``); a plain run survives a move, the new replica's
        session asked for the rest of it."""
        if self.q_refused is not None and proposal.draft_probs is not None:
            proposal = DraftProposal()  # this drafter's q was refused once: verify without its drafts
        if plain_steps:
            self.run_left = plain_steps
        elif self.run_left > 0:
            self.run_left -= 1
            plain_steps = self.run_left  # a link that is not in the run (a new replica's) asks for its rest
        link = self.link
        verdict = await self._guarded(lambda: link.verify(proposal, plain_steps))
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
        self.replica.in_flight -= 1
        await self.link.close()
