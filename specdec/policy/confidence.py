"""``ConfidenceDraftLength``: the draft length of drafters that estimate their own acceptance.

A suffix drafter knows, per round, how likely its draft is right (how long the match it continues
is, how often that continuation followed it before): one round it has nothing, the next a long
copy it is almost sure of. A policy that picks k from the acceptance of past rounds alone, as
``AdaptiveDraftLength`` does, averages those apart: it settles at k = 0 after a few misses and
then never drafts the copy, or drafts every guess. Here the drafter is asked for up to ``max_k``
and the loop verifies the prefix of the best expected rate:

    n* = argmax_n (1 + sum_{i<=n} P_i) / t_verify(n),   n = 0 (plain) unless it wins by ``margin``

with P_i the drafter's estimate that drafts 1..i are all accepted and t_verify the round's cost
for n drafts (``VerifyCostModel``: the verifier's measured forward curve plus what this session's
rounds cost beyond it, read beside the other sessions' rows in a shared pass). In a shared pass my
drafts also lengthen the other sessions' rounds; that is counted as my cost too (goodput, as
SmartSpec and ``AdaptiveDraftLength`` count it): t(n) = t_verify(n) + others x (t_verify(n) - t_verify(0)).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from specdec.policy.base import DraftLengthPolicy, PolicyMemory, RoundObservation
from specdec.policy.estimators import VerifyCostModel

# This policy learns no acceptance (the drafter estimates its own); what it reports to the memory.
NO_ACCEPTANCE = {"successes": 0.0, "trials": 0.0, "pos_successes": [], "pos_trials": []}


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
        self.verify = VerifyCostModel(decay=cost_decay, forward_curve=forward_curve)
        self.co_batched = max(0.0, float(co_batched))  # other sessions in this session's passes, recent mean
        self.other_rows = self.co_batched  # ... and their tokens
        self.verify.set_other_rows(self.other_rows)
        # What earlier sessions of this key paid per draft count (a drafted round after a plain one
        # also waits for the verifier's verify-ahead pass): from the first round, not after a few.
        entry = memory.get(key) if memory is not None and key is not None else None
        if entry is not None:
            self.verify.load(entry.verify, warm_cost_weight)
        self._closed = False

    def close(self) -> None:
        if self._closed or self.memory is None or self.key is None:
            return
        self._closed = True
        self.memory.report(self.key, NO_ACCEPTANCE, self.verify.state(), {})

    def choose(self, max_k: int) -> int:
        return max(0, min(self.max_k, max_k))

    def expects_to_draft(self) -> bool:
        return self.max_k > 0

    def costs(self, n: int) -> list[float] | None:
        """Estimated round seconds for 0..n drafts: learned, else the forward curve alone; None
        without either (the first round of a verifier that measured no curve)."""
        curve = self.verify.curve(n)
        if curve is None and self.verify.forward_curve:
            curve = [self.verify.forward(k) for k in range(n + 1)]
        return curve

    def prefix_length(self, acceptance_estimates: Sequence[float]) -> int:
        """How many of the proposed drafts to verify."""
        n = len(acceptance_estimates)
        costs = self.costs(n)
        if costs is None:
            return n
        best, best_rate = 0, (1.0 + self.margin) / max(costs[0], 1e-9)
        expected = 1.0
        for i, p in enumerate(acceptance_estimates, start=1):
            expected += p
            rate = expected / max(costs[i] + self.co_batched * (costs[i] - costs[0]), 1e-9)
            if rate > best_rate:
                best, best_rate = i, rate
        return best

    def observe(self, outcome: RoundObservation) -> None:
        k = max(0, int(outcome.num_drafts))
        others = None
        if outcome.batch_size > 0:
            self.co_batched = self.cost_decay * self.co_batched + (1.0 - self.cost_decay) * float(outcome.batch_size - 1)
            others = max(0.0, float(outcome.batch_tokens - (k + 1))) if outcome.batch_tokens > 0 else float(outcome.batch_size - 1)
        self.verify.update(k, float(outcome.verify_s), others)
        if others is not None:
            self.other_rows = self.cost_decay * self.other_rows + (1.0 - self.cost_decay) * others
            self.verify.set_other_rows(self.other_rows)
