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
rounds cost beyond it, read beside the other sessions' rows in a shared pass).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.policy.base import DraftLengthPolicy, RoundObservation
from specdec.policy.estimators import VerifyCostModel


class ConfidenceDraftLength(DraftLengthPolicy):
    name = "confidence"

    def __init__(self, max_k: int = 16, forward_curve: Sequence[float] | None = None, margin: float = 0.02,
                 cost_decay: float = 0.95, co_batched: float = 0.0) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.margin = margin
        self.cost_decay = cost_decay
        self.verify = VerifyCostModel(decay=cost_decay, forward_curve=forward_curve)
        self.other_rows = max(0.0, float(co_batched))  # other sessions' tokens in this session's passes
        self.verify.set_other_rows(self.other_rows)

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
            rate = expected / max(costs[i], 1e-9)
            if rate > best_rate:
                best, best_rate = i, rate
        return best

    def observe(self, outcome: RoundObservation) -> None:
        k = max(0, int(outcome.num_drafts))
        others = None
        if outcome.batch_size > 0:
            others = max(0.0, float(outcome.batch_tokens - (k + 1))) if outcome.batch_tokens > 0 else float(outcome.batch_size - 1)
        self.verify.update(k, float(outcome.verify_s), others)
        if others is not None:
            self.other_rows = self.cost_decay * self.other_rows + (1.0 - self.cost_decay) * others
            self.verify.set_other_rows(self.other_rows)
