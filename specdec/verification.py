"""The target side of speculative decoding: one verification session per generation."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.acceptance import AcceptanceResult, accept_greedy, accept_speculative
from specdec.kv import KVSession
from specdec.lm import LoadedModel
from specdec.ragged import BatchInfo, ForwardRow, batched_forward
from specdec.sampling import (
    STREAM_VERIFY,
    DraftProposal,
    SamplingParams,
    greedy_tokens,
    position_generators,
    process_logits,
)


@dataclass(frozen=True)
class Verdict:
    """What one verification pass decided.

    ``tokens`` are the newly committed tokens: the accepted drafts then the recovered or bonus
    token (after prefill: just the first generated token). A drafter rolls back to
    ``committed_length - len(tokens) + num_accepted`` and appends ``tokens[-1]``.
    """

    num_drafts: int
    num_accepted: int
    tokens: list[int]
    committed_length: int  # prompt + generated, after this verdict
    batch: BatchInfo | None = None  # the batched pass that computed it (verifier service), if known

    @staticmethod
    def from_acceptance(result: AcceptanceResult, committed_length: int) -> "Verdict":
        return Verdict(result.num_drafts, result.num_accepted, result.tokens, committed_length)


class TargetSession:
    """The target model's state for one generation: committed tokens plus a KV cache.

    ``prefill()`` yields the first token; each ``verify(proposal)`` runs one forward pass over
    the pending token and the k drafts and commits ``num_accepted + 1`` tokens.
    """

    def __init__(self, target: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.target = target
        self.params = params
        self.tokens: list[int] = list(prompt_ids)
        self.kv = KVSession(target)

    def prefill(self) -> Verdict:
        return self.verify(DraftProposal())

    def verify(self, proposal: DraftProposal) -> Verdict:
        row = self.forward_row(proposal)
        return self.commit(proposal, row.kv.forward(row.tokens, row.num_logits))

    def forward_row(self, proposal: DraftProposal) -> ForwardRow:
        """The forward this verification needs: the pending token and the drafts, k + 1 logits."""
        drafts = [int(t) for t in proposal.draft_tokens]
        return ForwardRow(self.kv, self.tokens + drafts, len(drafts) + 1)

    def commit(self, proposal: DraftProposal, logits) -> Verdict:
        """Accept or reject ``proposal`` given the target's logits at its k + 1 positions."""
        drafts = [int(t) for t in proposal.draft_tokens]
        k = len(drafts)
        if self.params.greedy:
            argmax = greedy_tokens(logits, self.target.vocab_size).tolist()
            result = accept_greedy(argmax, drafts)
        else:
            p = process_logits(logits, self.params, self.target.vocab_size)
            generators = position_generators(
                self.params.resolved_seed(), len(self.tokens), k + 1, STREAM_VERIFY
            )
            q = [proposal.q(i) for i in range(k)]
            result = accept_speculative(p, drafts, q, generators)
        self.tokens.extend(result.tokens)
        return Verdict.from_acceptance(result, len(self.tokens))

    def close(self) -> None:
        self.kv.close()



@dataclass(frozen=True)
class PrefillChunk:
    """A job that feeds the first ``end`` prompt tokens of ``session`` to its cache and decides
    nothing (chunked prefill): a long prompt shares passes with decoding sessions instead of
    stalling them for a pass of its own. The session's prefill verdict then feeds only the rest."""

    session: TargetSession
    end: int

    def forward_row(self) -> ForwardRow:
        return ForwardRow(self.session.kv, self.session.tokens[: self.end], 1)


VerifyJob = tuple[TargetSession, DraftProposal] | PrefillChunk


def verify_batch(target: LoadedModel, jobs: list[VerifyJob]) -> list[Verdict | Exception | None]:
    """Verify several sessions' proposals in one forward pass of ``target``; one verdict (or the
    error of that job alone) per job, each equal to what ``session.verify(proposal)`` decides.
    A ``PrefillChunk`` job's result is None: it only fills its session's cache."""
    rows = [job.forward_row() if isinstance(job, PrefillChunk) else job[0].forward_row(job[1]) for job in jobs]
    results: list[Verdict | Exception | None] = []
    for job, logits in zip(jobs, batched_forward(target, rows), strict=True):
        if isinstance(job, PrefillChunk):
            results.append(None)
            continue
        session, proposal = job
        try:
            results.append(session.commit(proposal, logits))
        except Exception as exc:  # one session's failure is its own
            results.append(exc)
    return results
