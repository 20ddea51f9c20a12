"""The speculative decoding loop, written once for every deployment.

``generate()`` drives a verifier link and an optional drafter link: prefill, then rounds of
draft -> verify -> commit, streaming committed tokens as chunks and ending with a result that
carries the stats. In-process links call the sessions directly; the gateway supplies links that
talk gRPC to the drafter and verifier services. Either way the output is the target's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from specdec.completion import Chunk, CompletionBuilder
from specdec.policy import DraftLengthPolicy, RoundObservation
from specdec.wire_types import DraftProposal, Verdict, VerdictFeatures

if TYPE_CHECKING:  # the in-process links' sessions; the loop itself runs without torch (the gateway's)
    from specdec.drafting import DraftSession
    from specdec.verification import TargetSession


class VerifierLink(Protocol):
    async def prefill(self) -> Verdict: ...

    async def verify(self, proposal: DraftProposal, plain_steps: int = 0) -> Verdict:
        """This round's verdict. ``plain_steps`` > 0 promises that many plain rounds (empty
        proposals) after this one: a remote verifier then decodes them without a block each."""
        ...


class DrafterLink(Protocol):
    # True when proposals are drafted elsewhere (another process or machine), so one can be in
    # flight while a verification is: what shadow probes need.
    concurrent: bool
    # True for a feature-level drafter (EAGLE): the loop hands it every verdict's target features
    # (``add_features``) before the next proposal.
    reads_features: bool
    # True for a link that only holds features until its next proposal (a bounded relay, taken the
    # moment a proposal starts): the loop hands them over as verdicts arrive instead of holding
    # every one of a long k = 0 stretch itself.
    holds_features: bool

    async def propose(self, committed: list[int], num_draft_tokens: int) -> DraftProposal:
        """``committed``: tokens committed since the previous call (first call: none)."""
        ...

    def add_features(self, features: VerdictFeatures) -> None:
        """(``reads_features`` links) The target's features from a verdict, for the next proposal."""
        ...


class AheadDrafterLink(DrafterLink, Protocol):
    """A drafter link that can draft the next block while a verification is in flight.

    ``propose(..., ahead_tokens=n)`` also starts drafting ``n`` tokens past the proposal;
    ``take_ahead()`` returns that block as ``(assumed, proposal)`` (None if there is none);
    ``continue_ahead(committed, used, n)`` tells the drafter that the first ``used`` tokens of its
    last block went to verification and starts the block after them.
    """

    async def propose(self, committed: list[int], num_draft_tokens: int, ahead_tokens: int = 0) -> DraftProposal: ...

    async def take_ahead(self) -> tuple[list[int], DraftProposal] | None: ...

    async def continue_ahead(self, committed: list[int], used: int, ahead_tokens: int) -> None: ...


@dataclass
class GenerationStats:
    """Speculation figures for one generation (all counts stop at the finish point)."""

    draft_method: str = "none"
    rounds: int = 0  # verification passes after prefill
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_in_rounds: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    k_history: list[int] = field(default_factory=list)
    shadow_probes: int = 0  # probes drafted beside plain rounds and scored against the committed tokens
    shadow_accepted: int = 0  # ... their drafts that matched
    ttft_s: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    completion_tokens: int = 0
    ahead_blocks: int = 0  # draft-ahead blocks received
    ahead_hits: int = 0  # ... whose assumption held, so they were verified without drafting
    batched_rounds: int = 0  # rounds whose verdict reported the verifier's batched pass
    batch_size_sum: int = 0  # ... and the sessions in those passes, summed
    verify_queue_wait_s: float = 0.0  # ... and the rounds' wait for them
    verify_service_s: float = 0.0  # of verify_s: time inside the verifier service (remote verifiers report it)
    verify_pass_s: float = 0.0  # ... of which in the batched passes that served the rounds
    feature_bytes: int = 0  # target features streamed verifier -> gateway -> drafter (prefill included)
    drafter_closes: int = 0  # drafter sessions closed once the policy settled on plain decoding
    plain_runs: int = 0  # plain runs asked of the verifier (rounds it decoded without a block each)
    plain_run_rounds: int = 0  # ... and the rounds they promised
    # Per number of drafts verified: [rounds, verify_s, steady rounds, their draft_s]. "Steady": the
    # drafter had only the previous verdict's tokens to feed (not a catch-up after k = 0 rounds or at
    # the start), so its draft_s is what drafting k tokens costs round after round.
    round_costs: dict[int, list] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    @property
    def feature_bytes_per_round(self) -> float:
        return self.feature_bytes / self.rounds if self.rounds else 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.batched_rounds if self.batched_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0

    def record_round(self, k: int, verdict: Verdict, emitted: int) -> None:
        """Count a verified round; ``emitted`` is how many of its tokens survived the stop check.

        A stop inside the block ends the count there: drafts past the stop are neither drafted
        nor accepted for the stats (``k_history`` keeps the k that was asked for)."""
        accepted = min(verdict.num_accepted, emitted)
        if verdict.batch is not None:
            self.batched_rounds += 1
            self.batch_size_sum += verdict.batch.size
            self.verify_queue_wait_s += verdict.batch.queue_wait_s
            self.verify_pass_s += verdict.batch.pass_s
        self.rounds += 1
        self.k_history.append(k)
        if emitted < len(verdict.tokens):
            k = min(k, emitted)
        self.draft_tokens += k
        self.accepted_tokens += accepted
        self.emitted_in_rounds += emitted
        while len(self.per_position_drafted) < k:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(k):
            self.per_position_drafted[i] += 1
            if i < accepted:
                self.per_position_accepted[i] += 1

    def record_cost(self, drafted: int, verify_s: float, draft_s: float, steady: bool) -> None:
        """Add one round's times to ``round_costs[drafted]``."""
        cost = self.round_costs.setdefault(drafted, [0, 0.0, 0, 0.0])
        cost[0] += 1
        cost[1] += verify_s
        if steady:
            cost[2] += 1
            cost[3] += draft_s

    def to_dict(self) -> dict:
        return {
            "draft_method": self.draft_method,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "k_history": list(self.k_history),
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            "total_s": self.total_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "shadow_probes": self.shadow_probes,
            "shadow_accepted": self.shadow_accepted,
            "ahead_blocks": self.ahead_blocks,
            "ahead_hits": self.ahead_hits,
            "mean_batch_size": self.mean_batch_size,
            "verify_queue_wait_s": self.verify_queue_wait_s,
            "verify_service_s": self.verify_service_s,
            "verify_pass_s": self.verify_pass_s,
            "feature_bytes": self.feature_bytes,
            "feature_bytes_per_round": self.feature_bytes_per_round,
            "drafter_closes": self.drafter_closes,
            "plain_runs": self.plain_runs,
            "plain_run_rounds": self.plain_run_rounds,
            "round_costs": [{"num_drafts": k, "rounds": c[0], "verify_s": c[1], "steady_rounds": c[2],
                             "steady_draft_s": c[3]} for k, c in sorted(self.round_costs.items())],
        }


@dataclass
class ShadowProbe:
    """A probe drafted while a plain round verifies, scored against what the target then commits.

    Under greedy decoding a draft token is accepted exactly when it equals the target's token, and
    the committed tokens are the target's: the leading drafts that match them are what verifying
    the probe would have accepted, learned without making the session wait for the drafter.
    """

    task: asyncio.Future  # the drafter's proposal
    start: int  # index in the committed tokens of the first token the proposal predicts
    timed: bool = True  # its time measures drafting (False: it also opened the drafter's session)
    sent_s: float = field(default_factory=time.perf_counter)
    answered_s: float | None = None
    beside_s: float = 0.0  # time of the plain rounds verified while the drafter worked on it
    beside_rounds: int = 0

    def note_round(self, verify_started: float, verify_s: float) -> bool:
        """Count a plain round whose verification began before the drafter answered; True if it did."""
        if self.answered_s is not None and self.answered_s <= verify_started:
            return False
        self.beside_s += verify_s
        self.beside_rounds += 1
        return True

    def __post_init__(self) -> None:
        self.task.add_done_callback(lambda _: setattr(self, "answered_s", time.perf_counter()))

    @property
    def draft_s(self) -> float | None:
        """How long the drafter took to answer (None if unanswered or not a fair measure)."""
        if not self.timed or self.answered_s is None or self.task.cancelled() or self.task.exception():
            return None
        return self.answered_s - self.sent_s

    def outcome(self, committed: list[int]) -> tuple[int, int] | None:
        """(drafted, accepted) once the proposal is back and enough tokens are committed to decide."""
        if not self.task.done():
            return None
        drafts = self.task.result().draft_tokens
        for i, token in enumerate(drafts):
            if self.start + i >= len(committed):
                return None
            if committed[self.start + i] != token:
                return len(drafts), i
        return len(drafts), len(drafts)


@dataclass
class RoundRecord:
    """One verification round, handed to ``generate(on_round=...)`` (tracing, metrics)."""

    round: int  # 1-based, as counted in the stats
    k: int  # draft length the policy chose
    drafted: int  # drafts actually verified (a failed drafter proposes none)
    accepted: int  # accepted drafts, as counted in the stats (cut at the finish point)
    emitted: int  # tokens this round committed that survived the stop check
    draft_s: float  # time in drafter.propose (0 when k = 0)
    verify_s: float  # time in verifier.verify
    started: float  # time.perf_counter() when the round began
    feature_bytes: int = 0  # target features its verdict carried (feature-level drafting)


@dataclass
class GenerationResult:
    """The final event of a generation."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats


async def generate(
    *,
    prompt_tokens: int,
    completion: CompletionBuilder,
    verifier: VerifierLink,
    drafter: DrafterLink | None,
    policy: DraftLengthPolicy,
    draft_method: str = "none",
    max_context: int | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    draft_ahead: bool = False,
    shadow_probes: bool = True,
    plain_runs: bool = True,
) -> AsyncIterator[Chunk | GenerationResult]:
    """Run one generation; yields ``Chunk``s as tokens commit, then one ``GenerationResult``.

    ``on_round``, if given, is called once per verification round (observability hooks; the
    loop itself never depends on it). ``draft_ahead`` (with an ``AheadDrafterLink``): the drafter
    drafts the next block while each verification is in flight; when the verdict commits exactly
    what that block assumed, the block is verified at once (no drafting round trip).
    ``shadow_probes`` (greedy requests without draft-ahead): a probe the policy asks for is drafted
    beside a plain round and scored against the tokens the target commits (``ShadowProbe``), so
    measuring acceptance while drafting does not pay never makes the session wait for the drafter.
    ``plain_runs``: plain rounds the policy (or the absence of a drafter) commits to in a row go to
    the verifier as one plain run (``VerifierLink.verify(..., plain_steps)``), each still a round here.
    """
    stats = GenerationStats(draft_method=draft_method if drafter is not None else "none")
    draft_ahead = draft_ahead and drafter is not None and hasattr(drafter, "take_ahead")
    shadow_probes = (shadow_probes and drafter is not None and getattr(drafter, "concurrent", False)
                     and not draft_ahead and completion.params.greedy)
    relay_features = drafter is not None and getattr(drafter, "reads_features", False)
    # A session settled on plain decoding closes its drafter session (``suspend``); not a feature-level
    # drafter's (a new session would need the target's features of everything committed) nor one
    # drafting ahead (its block is owed on the stream).
    suspend = getattr(drafter, "suspend", None) if drafter is not None and not (relay_features or draft_ahead) else None
    hand_at_once = relay_features and getattr(drafter, "holds_features", False)
    unsent_features: list[VerdictFeatures] = []  # verdicts' features, with ``pending``: not yet told to the drafter

    def take_features(verdict: Verdict) -> None:
        if verdict.features is not None:
            stats.feature_bytes += verdict.features.wire_bytes
            if hand_at_once:
                drafter.add_features(verdict.features)
            elif relay_features:
                unsent_features.append(verdict.features)

    def hand_features() -> None:
        """Right before a proposal: the features of exactly the committed tokens it carries (a later
        verdict's would reach a drafter that does not have its tokens yet)."""
        for features in unsent_features:
            drafter.add_features(features)
        unsent_features.clear()

    start = time.perf_counter()
    verdict = await verifier.prefill()
    stats.ttft_s = time.perf_counter() - start
    take_features(verdict)
    chunk = completion.add(verdict.tokens)
    yield chunk
    pending = list(verdict.tokens)  # committed but not yet told to the drafter
    committed = list(verdict.tokens)  # everything committed so far (scores shadow probes)
    shadow: ShadowProbe | None = None
    length = verdict.committed_length
    run_left = 0  # plain rounds promised to the verifier after the current one (a plain run)
    try:
        while not completion.finished:
            remaining = completion.params.max_new_tokens - len(completion.token_ids)
            # The verification always commits one token beyond the drafts.
            max_k = remaining - 1
            if max_context is not None:
                if length >= max_context:  # no position left to verify at: done, as plain decoding would be
                    yield completion.end_at_context()
                    break
                max_k = min(max_k, max_context - length - 1)
            in_run = run_left > 0  # a round of a plain run: the policy counted it when the run began
            run_left = max(0, run_left - 1)
            k = policy.choose(max(0, max_k)) if drafter is not None and not in_run else 0
            proposal = DraftProposal()
            t0 = time.perf_counter()
            if shadow_probes and k > 0 and policy.probing and shadow is None:
                policy.start_shadow_probe()
                timed = getattr(drafter, "ready", True)  # opening the session would count its prefill
                hand_features()
                shadow = ShadowProbe(asyncio.ensure_future(drafter.propose(pending, k)), len(committed), timed)
                pending = []
                k = 0
            if k > 0 and shadow is not None:
                await asyncio.wait([shadow.task])  # the drafter answers in order: the probe first
            if draft_ahead and k > 0:
                # (With k = 0 the block stays on the stream; the next proposal discards it.)
                block = await drafter.take_ahead()
                if block is not None:
                    stats.ahead_blocks += 1
                    assumed, ahead = block
                    if k > 0 and len(ahead) > 0 and list(verdict.tokens) == assumed:
                        proposal = ahead.prefix(k)
                        stats.ahead_hits += 1
                        hand_features()
                        await drafter.continue_ahead(pending, len(proposal), k)
                        pending = []
            # Steady: the drafter feeds only the last verdict's tokens (its first call also prefills the prompt).
            steady = stats.rounds > 0 and len(pending) <= len(verdict.tokens)
            if k > 0 and len(proposal) == 0:
                hand_features()
                if draft_ahead:
                    proposal = await drafter.propose(pending, k, ahead_tokens=k)
                else:
                    proposal = await drafter.propose(pending, k)
                pending = []
                if proposal.acceptance_estimates is not None and len(proposal):
                    proposal = proposal.prefix(policy.prefix_length(proposal.acceptance_estimates))
            plain_steps = 0
            if plain_runs and not in_run and len(proposal) == 0 and shadow is None and max_k > 0:
                # Plain rounds that no choice can interrupt: the verifier decodes them without a block each.
                plain_steps = max_k if drafter is None else policy.plain_run(max_k)
                if plain_steps > 0:
                    run_left = plain_steps
                    stats.plain_runs += 1
                    stats.plain_run_rounds += plain_steps
            t1 = time.perf_counter()
            verdict = await verifier.verify(proposal, plain_steps)
            t2 = time.perf_counter()
            take_features(verdict)
            chunk = completion.add(verdict.tokens)
            pending.extend(verdict.tokens)
            committed.extend(verdict.tokens)
            length = verdict.committed_length
            drafted = len(proposal)
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.record_round(drafted, verdict, len(chunk.token_ids))
            stats.record_cost(drafted, t2 - t1, t1 - t0, steady)
            if on_round is not None:
                emitted = len(chunk.token_ids)
                on_round(RoundRecord(stats.rounds, k, drafted, min(verdict.num_accepted, emitted), emitted,
                                     t1 - t0, t2 - t1, t0,
                                     verdict.features.wire_bytes if verdict.features is not None else 0))
            batch = verdict.batch
            beside_probe = shadow is not None and drafted == 0 and shadow.note_round(t1, t2 - t1)
            policy.observe(RoundObservation(drafted, verdict.num_accepted, t1 - t0, t2 - t1,
                                            batch.size if batch is not None else 0, batch.num_tokens if batch is not None else 0,
                                            beside_probe))
            outcome = shadow.outcome(committed) if shadow is not None else None
            if outcome is not None:
                policy.observe_shadow(*outcome, draft_s=shadow.draft_s, beside_s=shadow.beside_s,
                                      beside_rounds=shadow.beside_rounds)
                stats.shadow_probes += 1
                stats.shadow_accepted += outcome[1]
                shadow = None
            if suspend is not None and shadow is None and policy.settled and drafter.started:
                suspend()
                policy.drafter_closed()
                stats.drafter_closes += 1
            yield chunk
        finish = getattr(drafter, "finish", None)
        if finish is not None:  # what the drafter was never told (its last proposal came before these)
            finish(pending)
    finally:
        if shadow is not None and not shadow.task.done():
            shadow.task.cancel()  # the session is over; the drafter's answer is not needed
    stats.total_s = time.perf_counter() - start
    stats.verify_service_s = float(getattr(verifier, "service_s", 0.0))  # rounds only (prefill is apart)
    stats.completion_tokens = len(completion.token_ids)
    yield GenerationResult(
        token_ids=list(completion.token_ids),
        text=completion.text,
        finish_reason=completion.finish_reason,
        prompt_tokens=prompt_tokens,
        stats=stats,
    )


class LocalVerifier:
    """In-process verifier link over a ``TargetSession``."""

    def __init__(self, session: TargetSession) -> None:
        self.session = session

    async def prefill(self) -> Verdict:
        return self.session.prefill()

    async def verify(self, proposal: DraftProposal, plain_steps: int = 0) -> Verdict:
        return self.session.verify(proposal)  # in process a round costs no hop: a run is just rounds


class LocalDrafter:
    """In-process drafter link over a ``DraftSession``."""

    concurrent = False  # drafting blocks the loop: nothing to overlap

    def __init__(self, session: DraftSession) -> None:
        self.session = session
        self.reads_features = session.reads_features

    def add_features(self, features: VerdictFeatures) -> None:
        self.session.add_features(features)

    async def propose(self, committed: list[int], num_draft_tokens: int) -> DraftProposal:
        self.session.extend(committed)
        return self.session.propose(num_draft_tokens)

    def finish(self, committed: list[int]) -> None:
        self.session.finish(committed)


async def collect(events: AsyncIterator[Chunk | GenerationResult]) -> GenerationResult:
    """Drain a generation, returning its result."""
    result = None
    async for event in events:
        if isinstance(event, GenerationResult):
            result = event
    assert result is not None
    return result


def run_sync(coro):
    """Run a coroutine from synchronous code (CLI, tests)."""
    return asyncio.run(coro)
