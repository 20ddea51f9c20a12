"""What a draft-length policy is, and the two simple ones.

The loop asks ``choose(max_k)`` before each round and reports the outcome with ``observe``.
When the session ends the owner calls ``close()`` (adaptive policies report what they learned
to their ``AcceptanceMemory`` there). The adaptive policy is in ``specdec.policy.adaptive``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


class WarmStart(Protocol):
    """A memory entry as the policy reads it: its estimators' ``state()`` dicts."""

    acceptance: dict
    verify: dict
    draft: dict


class PolicyMemory(Protocol):
    """What the policy needs of its memory; ``specdec.policy.memory.AcceptanceMemory`` is the one.
    (A protocol, not an import: that module imports the adaptive policy for ``AcceptanceMemory.create``.)"""

    def get(self, key: Hashable) -> WarmStart | None: ...

    def report(self, key: Hashable, acceptance: dict, verify: dict, draft: dict) -> None: ...

    def note_probe_cost(self, key: Hashable, kind: str, seconds: float) -> None: ...

    def probe_cost(self, key: Hashable, kind: str) -> float | None: ...


@dataclass(frozen=True)
class RoundObservation:
    num_drafts: int
    num_accepted: int
    draft_s: float
    verify_s: float
    batch_size: int = 0  # sessions in the verifier's batched pass for this round (0: not reported)
    batch_tokens: int = 0  # tokens that pass fed, every session's (0: not reported)
    beside_probe: bool = False  # verified while the drafter worked on a shadow probe (its cost, not a plain round's)

    def other_tokens(self, fallback: float) -> float:
        """The other sessions' tokens in this round's pass: what it fed beyond this round's drafts
        and their one extra token, or ``fallback`` where the verifier did not report its tokens."""
        if self.batch_tokens > 0:
            return max(0.0, float(self.batch_tokens - (max(0, self.num_drafts) + 1)))
        return max(0.0, float(fallback))


class DraftLengthPolicy(ABC):
    name = "policy"

    @abstractmethod
    def choose(self, max_k: int) -> int:
        """Draft length for the next round, 0 <= k <= max_k."""

    def observe(self, outcome: RoundObservation) -> None:
        """Learn from the round just verified."""

    def prefix_length(self, acceptance_estimates: list[float]) -> int:
        """How many drafts of a proposal that carries the drafter's acceptance estimates to verify
        (``ConfidenceDraftLength`` weighs them against the round's cost; the others keep all)."""
        return len(acceptance_estimates)

    def plain_run(self, limit: int) -> int:
        """Before a round that verifies no drafts (``choose`` returned 0, or the proposal came back
        empty): how many further rounds, at most ``limit``, to leave plain without asking (a settled
        stretch before the next evaluation). The policy counts them as chosen now; the loop then asks
        the verifier to decode them without a block each and calls ``observe`` for each but not
        ``choose``. 0 (the default): choose round by round."""
        return 0

    def expects_to_draft(self) -> bool:
        """Whether the first rounds will likely draft (k > 0), asked before prefill without changing
        anything: a drafter session that will not be needed soon can open later, so that its prefill
        does not compete with the target's for time to first token. (Policies whose ``choose`` has
        side effects override this.)"""
        return self.choose(1 << 30) > 0

    def close(self) -> None:
        """The session is over (adaptive policies report to their memory here)."""

    @property
    def probing(self) -> bool:
        """The last ``choose`` asked for a probe: a few drafts only to measure acceptance."""
        return False

    @property
    def settled(self) -> bool:
        """Plain decoding from here on, as far as this policy can tell: no draft, and no probe worth
        its cost in what the request has left (the loop may then close the drafter's session)."""
        return False

    def drafter_closed(self) -> None:
        """The loop closed the drafter's session: a later proposal opens a new one (its prefill)."""

    def start_shadow_probe(self) -> None:
        """The loop runs the probe just chosen beside a plain round instead (see ``observe_shadow``):
        this round verifies no drafts."""

    def observe_shadow(self, num_drafts: int, num_accepted: int, draft_s: float | None = None,
                       beside_s: float = 0.0, beside_rounds: int = 0) -> None:
        """Outcome of a shadow probe: of ``num_drafts`` drafted, the leading ``num_accepted`` equal
        what the target committed there (under greedy decoding exactly what verifying them would have
        accepted). ``draft_s``: how long the drafter took to answer it (None: not a fair measure,
        e.g. the probe that opened the drafter's session). ``beside_s``: the time of the
        ``beside_rounds`` plain rounds verified while the drafter worked on it."""


class FixedDraftLength(DraftLengthPolicy):
    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("num_draft_tokens must be >= 0")
        self.k = k

    def choose(self, max_k: int) -> int:
        return min(self.k, max_k)


class HeuristicDraftLength(DraftLengthPolicy):
    """transformers' rule: all accepted -> k + 2, else k = max(1, k - 1)."""

    name = "heuristic"

    def __init__(self, initial_k: int = 5, max_k: int = 16) -> None:
        self.k = initial_k
        self.max_k = max_k

    def choose(self, max_k: int) -> int:
        return min(self.k, max_k)

    def observe(self, outcome: RoundObservation) -> None:
        if outcome.num_drafts == 0:
            return
        if outcome.num_accepted == outcome.num_drafts:
            self.k = min(self.k + 2, self.max_k)
        else:
            self.k = max(1, self.k - 1)
