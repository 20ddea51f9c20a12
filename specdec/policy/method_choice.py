"""``MethodChooser``: which draft method ``auto`` gives a request, from what each method measured.

A method's measure is the rate its finished requests emitted tokens in their verification rounds:
emitted tokens / (verify time + draft time) over the rounds, blended across requests (recent ones
weigh more). That is the quantity speculation exists to raise, in the units every method shares,
and it already holds each method's acceptance, draft length and drafting cost; an acceptance rate
alone would rank a method that drafts rarely but right (suffix lookup) above one that drafts every
round at lower acceptance (a draft model) whatever their throughput.

A method not measured yet is tried first; after that the fastest wins, and each other method is
tried again once every ``explore_every`` choices of its key so a change in the traffic is noticed
(deterministic: no randomness). Measures are kept per (method, draft model, target model).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass
class MethodMeasure:
    rate: float  # tokens per second of round time, blended
    weight: float  # requests it stands for, decayed
    since_tried: int = 0  # auto choices made since a request last ran this method


class MethodChooser:
    """Thread-safe. ``choose(candidates)`` with ``candidates`` as (method, key) in preference order
    (the first wins among the unmeasured); ``report(key, emitted, round_s)`` when a request ends."""

    def __init__(self, keep: float = 0.8, explore_every: int = 16, min_round_s: float = 1e-3) -> None:
        self.keep = keep
        self.explore_every = explore_every
        self.min_round_s = min_round_s  # a request with less round time than this says nothing
        self.measures: dict[Hashable, MethodMeasure] = {}
        self.trying: set[Hashable] = set()  # unmeasured keys a running request is measuring
        self._lock = threading.Lock()

    def choose(self, candidates: Sequence[tuple[str, Hashable]]) -> str | None:
        if not candidates:
            return None
        with self._lock:
            for method, key in candidates:
                if key not in self.measures and key not in self.trying:
                    self.trying.add(key)
                    return method
            measured = [(method, key, self.measures[key]) for method, key in candidates if key in self.measures]
            if not measured:  # every candidate is being measured by a request still running
                return candidates[0][0]
            for _, _, measure in measured:
                measure.since_tried += 1
            stale = [m for m in measured if m[2].since_tried > self.explore_every]
            if stale:
                method, _, measure = max(stale, key=lambda m: m[2].since_tried)
            else:
                method, _, measure = max(measured, key=lambda m: m[2].rate)
            measure.since_tried = 0
            return method

    def report(self, key: Hashable, emitted: int, round_s: float) -> None:
        """A finished request of ``key``: ``emitted`` tokens over ``round_s`` seconds of rounds."""
        if round_s < self.min_round_s or emitted <= 0:
            with self._lock:
                self.trying.discard(key)
            return
        rate = emitted / round_s
        with self._lock:
            self.trying.discard(key)
            measure = self.measures.get(key)
            if measure is None:
                self.measures[key] = MethodMeasure(rate, 1.0)
                return
            weight = self.keep * measure.weight + 1.0
            measure.rate = (self.keep * measure.weight * measure.rate + rate) / weight
            measure.weight = weight

    def release(self, key: Hashable) -> None:
        """A request of ``key`` ended without a report (an error, a cancel): an unmeasured method it
        was measuring may be tried again."""
        with self._lock:
            self.trying.discard(key)

    def rates(self) -> dict[Hashable, float]:
        with self._lock:
            return {key: m.rate for key, m in self.measures.items()}
