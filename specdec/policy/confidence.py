"""``ConfidenceDraftLength``: the draft length of drafters that estimate their own acceptance.

A suffix drafter knows, per round, how likely its draft is right (how long the match it continues
is, how often that continuation followed it before): one round it has nothing, the next a long
copy it is almost sure of. A policy that picks k from the acceptance of past rounds alone, as
``AdaptiveDraftLength`` does, averages those apart: it settles at k = 0 after a few misses and
then never drafts the copy, or drafts every guess. Here the drafter is asked for up to ``max_k``
and the loop verifies the prefix of the best expected rate:

    n* = argmax_n (1 + sum_{i<=n} P_i) / t(n),   n = 0 (plain) unless it wins by ``margin``

with P_i the drafter's estimate that drafts 1..i are all accepted, scaled by how this session's
verified drafts fared against their estimates (``trust``: a drafter's estimates are learned over
all sessions, and one request may follow its cached text less than most), and t(n) the round's
cost (``RoundCosts``). In a shared pass my drafts also lengthen the other sessions' rounds; that is
counted as my cost too (goodput, as SmartSpec and ``AdaptiveDraftLength`` count it):
t(n) + others x (t(n) - t(0)).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from specdec.costs import extend_curve
from specdec.policy.base import DraftLengthPolicy, PolicyMemory, RoundObservation
from specdec.policy.estimators import DecayedMean

# After rounds without drafts, the longest plain run (rounds the verifier decodes without a block
# each, and the drafter is not asked): a copy that begins meanwhile is drafted at most this late.
IDLE_RUN_CAP = 8

# This policy learns no acceptance (the drafter estimates its own); what it reports to the memory.
NO_ACCEPTANCE = {"successes": 0.0, "trials": 0.0, "pos_successes": [], "pos_trials": []}


class RoundCosts:
    """What a round costs as the loop sees it (drafting and verifying): a plain round its measured mean; a round verifying
    n drafts the verifier's forward over n + 1 tokens plus the mean of what drafted rounds cost
    beyond their forward. Two means, not a line through per-n means: plain rounds are cheaper than
    their forward (the verifier fed their token ahead, while the verdict travelled) and a drafted
    round right after one dearer (it waits for that pass, then runs its own), so a line through
    both slopes steeply and makes every long draft look unaffordable. The shape in n is the
    verifier's own measured curve, read beside ``other_rows`` tokens of other sessions."""

    def __init__(self, forward_curve: Sequence[float] | None, decay: float = 0.95) -> None:
        self.forward_curve = [float(t) for t in forward_curve] if forward_curve else None
        self.plain = DecayedMean(decay)
        self.drafted_beyond = DecayedMean(decay)
        self.other_rows = 0.0

    def forward(self, n: int) -> float:
        return extend_curve(self.forward_curve, n + self.other_rows) if self.forward_curve else 0.0

    def update(self, n: int, seconds: float) -> None:
        if n == 0:
            self.plain.add(seconds)
        else:
            self.drafted_beyond.add(seconds - self.forward(n))

    def costs(self, n: int) -> list[float] | None:
        """Seconds for 0..n drafts; None before a plain round was seen and without a curve."""
        if self.plain.value is None and not self.forward_curve:
            return None
        plain = self.plain.value if self.plain.value is not None else self.forward(0)
        beyond = self.drafted_beyond.value
        if beyond is None:  # no drafted round yet: as much beyond the forward as a plain round
            beyond = plain - self.forward(0)
        return [plain] + [self.forward(k) + beyond for k in range(1, n + 1)]

    def state(self) -> dict:
        means, weights = {}, {}
        for k, mean in ((0, self.plain), (1, self.drafted_beyond)):
            if mean.value is not None:
                means[k], weights[k] = mean.value, mean.weight
        return {"means": means, "weights": weights}

    def load(self, state: dict, max_weight: float) -> None:
        for k, mean in ((0, self.plain), (1, self.drafted_beyond)):
            if k in state.get("means", {}):
                mean.value = float(state["means"][k])
                mean.weight = min(float(state["weights"][k]), max_weight)


class ConfidenceDraftLength(DraftLengthPolicy):
    name = "confidence"

    def __init__(self, max_k: int = 16, forward_curve: Sequence[float] | None = None, margin: float = 0.02,
                 cost_decay: float = 0.95, co_batched: float = 0.0, memory: PolicyMemory | None = None,
                 key: Hashable | None = None, warm_cost_weight: float = 8.0) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.memory = memory
        self.key = key
        self.margin = margin
        self.cost_decay = cost_decay
        self.round_costs = RoundCosts(forward_curve, cost_decay)
        self.co_batched = max(0.0, float(co_batched))  # other sessions in this session's passes, recent mean
        self.round_costs.other_rows = self.co_batched  # ... and their tokens
        # What earlier sessions of this key paid (a drafted round after a plain one also waits for
        # the verifier's verify-ahead pass): from the first round, not after a few.
        entry = memory.get(key) if memory is not None and key is not None else None
        if entry is not None:
            self.round_costs.load(entry.verify, warm_cost_weight)
        # This session's verified drafts: accepted, and the estimates said (decayed sums, one of each as a prior).
        self.accepted_sum = 1.0
        self.expected_sum = 1.0
        self._expected_last = 0.0  # what the estimates of the prefix just chosen expect accepted
        self.plain_streak = 0  # rounds in a row without drafts
        self._closed = False

    def close(self) -> None:
        if self._closed or self.memory is None or self.key is None:
            return
        self._closed = True
        self.memory.report(self.key, NO_ACCEPTANCE, self.round_costs.state(), {})

    def choose(self, max_k: int) -> int:
        return max(0, min(self.max_k, max_k))

    def expects_to_draft(self) -> bool:
        return self.max_k > 0

    @property
    def trust(self) -> float:
        """Accepted over expected, this session's verified drafts (at most 1)."""
        return min(1.0, self.accepted_sum / self.expected_sum)

    def prefix_length(self, acceptance_estimates: Sequence[float]) -> int:
        """How many of the proposed drafts to verify."""
        n = len(acceptance_estimates)
        costs = self.round_costs.costs(n)
        estimates = [self.trust * p for p in acceptance_estimates]
        best = n
        if costs is not None:
            best, best_rate = 0, (1.0 + self.margin) / max(costs[0], 1e-9)
            expected = 1.0
            for i, p in enumerate(estimates, start=1):
                expected += p
                rate = expected / max(costs[i] + self.co_batched * (costs[i] - costs[0]), 1e-9)
                if rate > best_rate:
                    best, best_rate = i, rate
        self._expected_last = sum(estimates[:best])
        return best

    def plain_run(self, limit: int) -> int:
        """After a round without drafts: half the rounds in a row that had none, up to
        ``IDLE_RUN_CAP`` (text that has not repeated for a while likely goes on not repeating)."""
        return max(0, min(limit, IDLE_RUN_CAP, self.plain_streak // 2))

    def observe(self, outcome: RoundObservation) -> None:
        k = max(0, int(outcome.num_drafts))
        self.plain_streak = 0 if k > 0 else self.plain_streak + 1
        if outcome.batch_size > 0:
            decay = self.cost_decay
            self.co_batched = decay * self.co_batched + (1.0 - decay) * float(outcome.batch_size - 1)
            others = outcome.other_tokens(outcome.batch_size - 1)
            self.round_costs.other_rows = decay * self.round_costs.other_rows + (1.0 - decay) * others
        if not outcome.beside_probe:
            # The whole round: with a drafter service every round waits for its answer, one it trims
            # to nothing too (while the verifier's verify-ahead pass runs, so its verify wait is short).
            self.round_costs.update(k, float(outcome.draft_s + outcome.verify_s))
        if k > 0:
            keep = self.cost_decay
            self.accepted_sum = keep * self.accepted_sum + min(int(outcome.num_accepted), k)
            self.expected_sum = keep * self.expected_sum + self._expected_last
        self._expected_last = 0.0
