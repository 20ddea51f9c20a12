"""``AcceptanceMemory``: what recent sessions learned, per (draft method, draft model, target
model), for warm-starting new adaptive policies (see docs/adaptive.md, "Memory across sessions")."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from specdec.policy.adaptive import AdaptiveDraftLength

MemoryKey = Hashable  # conventionally (draft_method, draft_model, target_model)


@dataclass
class MemoryEntry:
    """What recent sessions of one (draft method, draft model, target model) learned."""

    acceptance: dict = field(default_factory=dict)
    verify: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    sessions: int = 0

    @property
    def alpha(self) -> float | None:
        t = self.acceptance.get("trials", 0.0)
        return self.acceptance["successes"] / t if t > 0 else None


def _blend_sums(old: list[float], new: list[float], keep: float) -> list[float]:
    n = max(len(old), len(new))
    old = list(old) + [0.0] * (n - len(old))
    new = list(new) + [0.0] * (n - len(new))
    return [keep * o + x for o, x in zip(old, new)]


PROBE_COST_KEEP = 0.9  # each measured probe cost weighs as much as the last ten together, decayed


def _blend_mean(old: list | None, sample: float, keep: float) -> list:
    """A [mean, weight] pair with ``sample`` blended in at weight one, the old weight decayed by ``keep``."""
    if not old:
        return [sample, 1.0]
    weight = keep * old[1] + 1.0
    return [(keep * old[1] * old[0] + sample) / weight, weight]


class AcceptanceMemory:
    """Thread-safe registry of per-key acceptance and cost estimates from recent sessions.

    Policies are created from it (``create(key, ...)``, warm-started from the entry) and report
    back on ``close()``. Each report blends the session's final estimates into the entry; older
    sessions fade by ``session_decay`` per report. At most ``max_entries`` keys are kept (LRU).
    """

    def __init__(self, session_decay: float = 0.7, max_entries: int = 256) -> None:
        self.session_decay = session_decay
        self.max_entries = max_entries
        self._entries: OrderedDict[MemoryKey, MemoryEntry] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def make_key(draft_method: str, draft_model: str, target_model: str) -> tuple[str, str, str]:
        return (str(draft_method), str(draft_model), str(target_model))

    def get(self, key: MemoryKey) -> MemoryEntry | None:
        """A copy of the entry for ``key`` (None if no session reported yet)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return None
            self._entries.move_to_end(key)
            return MemoryEntry(
                acceptance={
                    "successes": e.acceptance.get("successes", 0.0),
                    "trials": e.acceptance.get("trials", 0.0),
                    "pos_successes": list(e.acceptance.get("pos_successes", [])),
                    "pos_trials": list(e.acceptance.get("pos_trials", [])),
                },
                verify={"means": dict(e.verify.get("means", {})), "weights": dict(e.verify.get("weights", {}))},
                draft={"sums": list(e.draft.get("sums", [])), "fallback": e.draft.get("fallback")},
                sessions=e.sessions,
            )

    def report(self, key: MemoryKey, acceptance: dict, verify: dict, draft: dict) -> None:
        """Blend one finished session's estimator states (``*.state()``) into the entry."""
        g = self.session_decay
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                e = MemoryEntry()
                self._entries[key] = e
            self._entries.move_to_end(key)
            a = e.acceptance
            e.acceptance = {
                "successes": g * a.get("successes", 0.0) + acceptance["successes"],
                "trials": g * a.get("trials", 0.0) + acceptance["trials"],
                "pos_successes": _blend_sums(a.get("pos_successes", []), acceptance["pos_successes"], g),
                "pos_trials": _blend_sums(a.get("pos_trials", []), acceptance["pos_trials"], g),
            }
            means, weights = dict(e.verify.get("means", {})), dict(e.verify.get("weights", {}))
            for k, m in verify.get("means", {}).items():
                w_new = verify["weights"][k]
                w_old = g * weights.get(k, 0.0)
                total = w_old + w_new
                if total > 0:
                    means[k] = (w_old * means.get(k, m) + w_new * m) / total
                    weights[k] = total
            for k in list(weights):
                if k not in verify.get("means", {}):
                    weights[k] *= g
            e.verify = {"means": means, "weights": weights}
            sums = draft.get("sums") or [0.0] * 5
            e.draft = {
                "sums": _blend_sums(e.draft.get("sums", []), sums, g),
                "fallback": draft.get("fallback") or e.draft.get("fallback"),
                # Probe costs arrive as they are measured (``note_probe_cost``), not at the close.
                "probe": e.draft.get("probe"),
                "opening": e.draft.get("opening"),
            }
            e.sessions += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def note_probe_cost(self, key: MemoryKey, kind: str, seconds: float) -> None:
        """One shadow probe's measured cost (``kind``: "probe", or "opening" for the probe that opened
        the drafter's session), blended in at once: sessions running beside the one that measured it
        read it at their next probe, not only sessions opened after it closes (under load most
        sessions start before any has closed)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                e = MemoryEntry()
                self._entries[key] = e
            e.draft[kind] = _blend_mean(e.draft.get(kind), float(seconds), PROBE_COST_KEEP)

    def probe_cost(self, key: MemoryKey, kind: str) -> float | None:
        """The deployment's measured cost of a shadow probe of ``kind`` (None: none measured yet)."""
        with self._lock:
            e = self._entries.get(key)
            value = e.draft.get(kind) if e is not None else None
            return float(value[0]) if value else None

    def create(self, key: MemoryKey | None = None, **kwargs) -> AdaptiveDraftLength:
        """A new adaptive policy for ``key`` that reports back here on ``close()``."""
        return AdaptiveDraftLength(memory=self, key=key, **kwargs)

    def summary(self) -> dict:
        """Plain-data view for metrics and debugging."""
        with self._lock:
            keys = list(self._entries)
        out = {}
        for key in keys:
            e = self.get(key)
            if e is not None:
                out[str(key)] = {"alpha": e.alpha, "sessions": e.sessions}
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

