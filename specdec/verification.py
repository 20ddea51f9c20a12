"""The target side of speculative decoding: one verification session per generation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.acceptance import accept_greedy, accept_speculative
from specdec.kv import KVSession
from specdec.lm import LoadedModel
from specdec.ragged import ForwardRow, batched_forward
from specdec.randomness import position_keys
from specdec.sampling import STREAM_VERIFY, greedy_tokens, process_logits
from specdec.wire_types import DraftProposal, FieldError, SamplingParams, Verdict
from specdec.target_features import WIRE_DTYPE, TargetFeatures


class TargetSession:
    """The target model's state for one generation: committed tokens plus a KV cache.

    ``prefill()`` yields the first token; each ``verify(proposal)`` runs one forward pass over
    the pending token and the k drafts and commits ``num_accepted + 1`` tokens.

    ``want_features``: each verdict also carries the target's features (``TargetFeatures``) at the
    committed positions no earlier verdict covered, up to the last committed token's predecessor
    (the last token's own feature comes from the next pass). Invariant: after a verdict, features
    for positions 0 .. len(tokens) - 2 have been handed out exactly once, in order, except that the
    prefill verdict carries at most ``feature_window`` positions (the prompt's last ones), so that
    one message stays within gRPC's size limit whatever the prompt's length and the target's width.
    """

    def __init__(self, target: LoadedModel, prompt_ids: list[int], params: SamplingParams,
                 want_features: bool = False, feature_window: int | None = None) -> None:
        if not prompt_ids:
            raise FieldError("prompt_token_ids", "must not be empty")
        if want_features and not target.feature_size:
            raise FieldError("want_features", "this target has no features to stream")
        self.target = target
        self.params = params
        self.prompt_length = len(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)
        self.kv = KVSession(target)
        self.want_features = want_features
        self.feature_window = feature_window
        self.unsent: TargetFeatures | None = None  # features computed but not yet in a verdict
        self.features_sent = 0  # positions 0 .. features_sent - 1 went out in verdicts
        # The pending token's logits [1, V], computed ahead of the next block (``PendingForward``)
        # while ``len(tokens) == ahead_at``: that block's pass then feeds only its drafts, and a
        # block without drafts needs no pass at all.
        self.ahead_logits: torch.Tensor | None = None
        self.ahead_at = -1

    def prefill(self) -> Verdict:
        return self.verify(DraftProposal())

    def verify(self, proposal: DraftProposal) -> Verdict:
        if not self.needs_pass(proposal):
            return self.commit(proposal, None)
        row = self.forward_row(proposal)
        return self.commit(proposal, batched_forward(self.target, [row], on_device=True)[0], row)

    def forward_row(self, proposal: DraftProposal) -> ForwardRow:
        """The forward this verification needs: the pending token and the drafts, k + 1 logits (and,
        wanting features, those of every position the pass feeds: prefill's whole prompt). With the
        pending token's logits computed ahead, only the drafts and their k logits."""
        drafts = [int(t) for t in proposal.draft_tokens]
        tokens = self.tokens + drafts
        ahead = 1 if self.has_ahead else 0
        return ForwardRow(self.kv, tokens, len(drafts) + 1 - ahead, committed=len(self.tokens),
                          num_features=self.features_wanted(len(tokens)))

    @property
    def has_ahead(self) -> bool:
        """Whether the pending token's logits were computed ahead (``PendingForward``) and still hold."""
        return self.ahead_logits is not None and self.ahead_at == len(self.tokens)

    def needs_pass(self, proposal: DraftProposal) -> bool:
        """Whether verifying ``proposal`` takes a forward pass (not: no drafts, logits computed ahead)."""
        return len(proposal.draft_tokens) > 0 or not self.has_ahead

    def keep_ahead(self, logits: torch.Tensor) -> None:
        """The logits a ``PendingForward`` pass computed for the pending token."""
        self.ahead_logits, self.ahead_at = logits, len(self.tokens)

    def features_wanted(self, length: int) -> int:
        """How many trailing positions of a pass over the first ``length`` tokens a verdict will still
        send: from the first unsent position (the prefill: the start of the prompt's window) on."""
        if not self.want_features:
            return 0
        return max(0, length - self._first_unsent())

    def _first_unsent(self) -> int:
        if self.features_sent == 0 and self.feature_window is not None:  # the prefill: the prompt's tail
            return max(0, self.prompt_length - self.feature_window)
        return self.features_sent

    def take_features(self, row: ForwardRow) -> None:
        """Keep the features a pass computed for this session (a prefill chunk's, or a verification's
        before its commit) until a verdict sends them; a rerun position overwrites its row."""
        if row.features is None:
            return
        computed = TargetFeatures(row.features_start, row.features.to(WIRE_DTYPE))
        self.unsent = computed if self.unsent is None else self.unsent.then(computed)

    def _verdict_features(self) -> TargetFeatures | None:
        """The unsent features of committed positions up to len(tokens) - 2 (the rest are drafts the
        verdict rejected, or not computed yet), cut from the kept ones."""
        if not self.want_features:
            return None
        end = len(self.tokens) - 1
        start = self._first_unsent()
        kept = self.unsent
        if kept is None or kept.start > start or kept.end < end:
            raise RuntimeError(f"target features: positions {start}..{end - 1} were not computed")
        sent = TargetFeatures(start, kept.values[start - kept.start: end - kept.start])
        self.unsent, self.features_sent = None, end
        return sent

    def commit(self, proposal: DraftProposal, logits, row: ForwardRow | None = None) -> Verdict:
        """Accept or reject ``proposal`` given the target's logits at its k + 1 positions (``row``:
        the pass's row, whose features a session that wants them sends).

        ``logits`` stay where the pass left them (the GPU, in a GPU verifier): greedy reads back the
        k + 1 argmax tokens, sampling the k values p_i(x_i) and one row (``accept_speculative``).
        With the pending token's logits computed ahead, ``logits`` are the drafts' k rows (None: no
        drafts, no pass) and the pending row goes first."""
        if row is not None:
            self.take_features(row)
        if self.has_ahead:
            logits = self.ahead_logits if logits is None else torch.cat([self.ahead_logits, logits])
        self.ahead_logits = None
        drafts = [int(t) for t in proposal.draft_tokens]
        k = len(drafts)
        if self.params.greedy:
            argmax = greedy_tokens(logits, self.target.vocab_size).tolist()
            result = accept_greedy(argmax, drafts)
        else:
            p = process_logits(logits, self.params, self.target.vocab_size)
            draws = position_keys(self.params.resolved_seed(), len(self.tokens), k + 1, STREAM_VERIFY)
            q = [proposal.q(i) for i in range(k)]
            result = accept_speculative(p, drafts, q, draws)
        self.tokens.extend(result.tokens)
        return Verdict(result.num_drafts, result.num_accepted, result.tokens, len(self.tokens),
                       features=self._verdict_features())

    def close(self) -> None:
        self.kv.close()


# A reported q must sum to 1 within this (the drafter sends its fp32 renormalised support: ~1e-6 off).
Q_SUM_TOLERANCE = 1e-3


def check_draft_probs(proposal: DraftProposal, support_bound: int | None = None) -> None:
    """``FieldError`` naming the field unless every reported draft distribution is well formed.

    The rule: with ``draft_probs`` present there is exactly one distribution per draft token; each
    one's ids are unique (and below ``support_bound`` when given), its probabilities finite, >= 0 and
    summing to 1 within ``Q_SUM_TOLERANCE``, and its own draft token is in its support with q > 0.

    Why no floor under q(draft token). Acceptance is exact for any q the draft token was truly drawn
    from, and nothing the verifier sees can show whether it was: a forged q (say q(x) = 1e-45, which
    makes x all but certain to pass u * q(x) < p(x)) is indistinguishable from a real draw of an
    unlikely token. A real sampler does emit such values: ``truncate_top_k`` keeps every positive
    entry of an fp32 softmax, denormals included, and samples them with their probability. A floor f
    would therefore refuse legitimate requests (up to K * f of a K-entry support per draft), and would
    buy little: a forger claiming q(x) = f still forces every token with p(x) >= f. What does bound a
    lying client is enforced elsewhere and holds for any q: no token with p(x) = 0 under the request's
    own processed distribution is ever accepted (strict compare), a session only ever affects its own
    output (per-session state, position-keyed draws), and its work is bounded (draft count,
    max_new_tokens, context). Who may send proposals at all is the services' authentication.
    """
    probs = proposal.draft_probs
    if probs is None:
        return
    k = len(proposal.draft_tokens)
    if len(probs) != k:
        raise FieldError("draft_probs", f"{len(probs)} distributions for {k} draft tokens "
                         "(need one per draft token, or none)")
    # Plain Python over each support (a few dozen entries): no tensor operations on the caller's thread.
    for i, (token, q) in enumerate(zip(proposal.draft_tokens, probs)):
        ids, values = q.token_ids.tolist(), q.probs.tolist()
        if len(ids) != len(values) or not ids:
            raise FieldError(f"draft_probs[{i}]", f"need as many probs as token_ids (>= 1), "
                             f"got {len(values)} and {len(ids)}")
        if min(ids) < 0:
            raise FieldError(f"draft_probs[{i}].token_ids", f"negative id {min(ids)}")
        if support_bound is not None and max(ids) >= support_bound:
            raise FieldError(f"draft_probs[{i}].token_ids", f"id {max(ids)} is outside the vocabulary "
                             f"(ids below {support_bound})")
        if len(set(ids)) != len(ids):
            raise FieldError(f"draft_probs[{i}].token_ids", "repeated id")
        if not all(map(math.isfinite, values)):
            raise FieldError(f"draft_probs[{i}].probs", "not finite")
        if min(values) < 0:
            raise FieldError(f"draft_probs[{i}].probs", f"negative probability {min(values):g}")
        total = math.fsum(values)  # float64 and exact: fp32 values cannot overflow it
        if abs(total - 1.0) > Q_SUM_TOLERANCE:
            raise FieldError(f"draft_probs[{i}].probs", f"sum {total:.6g}, not 1 within {Q_SUM_TOLERANCE:g}")
        at = ids.index(int(token)) if int(token) in ids else None
        if at is None or values[at] <= 0:
            raise FieldError(f"draft_probs[{i}]", f"draft token {int(token)} is not in its support with q > 0 "
                             f"(draft_token_ids[{i}] must have been sampled from draft_probs[{i}])")


@dataclass(frozen=True)
class PrefillChunk:
    """A job that feeds the first ``end`` prompt tokens of ``session`` to its cache and decides
    nothing (chunked prefill): a long prompt shares passes with decoding sessions instead of
    stalling them for a pass of its own. The session's prefill verdict then feeds only the rest."""

    session: TargetSession
    end: int

    def forward_row(self) -> ForwardRow:
        return ForwardRow(self.session.kv, self.session.tokens[: self.end], 1, committed=self.end,
                          num_features=self.session.features_wanted(self.end))


@dataclass(frozen=True)
class PendingForward:
    """A job that feeds a session's pending token (its last committed one) right after a verdict,
    before the next block arrives, and keeps that position's logits (``TargetSession.keep_ahead``).

    The pending token is fed by every next verification whatever its drafts, so the pass is never
    wasted: it runs while the verdict travels to the gateway and the next block comes back, a
    block without drafts is then answered without a pass, and one with k drafts feeds k tokens.
    A position's logits are the same whether it is fed alone or with the drafts after it on a
    pass-invariant runtime (gguf), and up to rounding on the torch runtimes, as in batching; plain
    decoding feeds one token per pass, so the greedy reference is this pass's shape."""

    session: TargetSession

    def forward_row(self) -> ForwardRow:
        """The pending token, and (a session that wants them) its features, which the next verdict sends."""
        tokens = self.session.tokens
        return ForwardRow(self.session.kv, tokens, 1, committed=len(tokens),
                          num_features=self.session.features_wanted(len(tokens)))


VerifyJob = tuple[TargetSession, DraftProposal] | PrefillChunk | PendingForward


def _job_session(job: VerifyJob) -> TargetSession:
    return job[0] if isinstance(job, tuple) else job.session


def verify_batch(target: LoadedModel, jobs: list[VerifyJob]) -> list[Verdict | Exception | None]:
    """Verify several sessions' proposals in one forward pass of ``target``; one verdict (or the
    error of that job alone) per job, each equal to what ``session.verify(proposal)`` decides.
    A ``PrefillChunk`` or ``PendingForward`` job's result is None: it only fills its session's
    cache (and keeps the pending token's logits). A job whose session was closed meanwhile fails
    alone, before the pass."""
    closed = [_job_session(job).kv.cache is None for job in jobs]
    passless = [isinstance(job, tuple) and not job[0].needs_pass(job[1]) for job in jobs]
    verdicts = iter(_verify_live(target, [job for job, gone, free in zip(jobs, closed, passless) if not (gone or free)]))
    results: list[Verdict | Exception | None] = []
    for job, gone, free in zip(jobs, closed, passless):
        if gone:
            results.append(RuntimeError("the session was closed"))
        elif free:
            try:
                results.append(job[0].commit(job[1], None))
            except Exception as exc:  # one session's failure is its own
                results.append(exc)
        else:
            results.append(next(verdicts))
    return results


def _verify_live(target: LoadedModel, jobs: list[VerifyJob]) -> list[Verdict | Exception | None]:
    if not jobs:
        return []
    rows = [job[0].forward_row(job[1]) if isinstance(job, tuple) else job.forward_row() for job in jobs]
    results: list[Verdict | Exception | None] = []
    for job, row, logits in zip(jobs, rows, batched_forward(target, rows, on_device=True), strict=True):
        if isinstance(job, PrefillChunk):
            job.session.take_features(row)
            results.append(None)
            continue
        if isinstance(job, PendingForward):
            job.session.take_features(row)
            job.session.keep_ahead(logits)
            results.append(None)
            continue
        session, proposal = job
        try:
            results.append(session.commit(proposal, logits, row))
        except Exception as exc:  # one session's failure is its own
            results.append(exc)
    return results
