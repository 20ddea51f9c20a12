"""Draft-length policies: how many tokens to draft in the next round.

The loop asks ``choose(max_k)`` before each round and reports the outcome with ``observe``.
When the session ends the owner calls ``close()`` (adaptive policies report what they learned
to their ``AcceptanceMemory`` there).

``AdaptiveDraftLength`` picks, every round, the k that maximises expected emitted tokens per
second under an online model of acceptance and cost (see docs/adaptive.md):

    rate(k) = E[tokens](k) / (t_draft(k) + t_verify(k)),
    E[tokens](k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i      (= (1 - a^(k+1)) / (1 - a) if alpha_i = a)
    t_draft(k)   = draft call overhead (round trip) + k * per-token draft time, 0 for k = 0
    t_verify(k)  = measured per-k running mean (incl. the verifier round trip), isotonic in k,
                   interpolated / extrapolated linearly for k not seen yet.

k = 0 (plain decoding) competes in the same units, and while it wins the policy probes with a
small k now and then (exponential backoff) so it notices when drafting pays again. Decisions are
a pure function of the observations (no randomness).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from specdec.costs import extend_curve, isotonic
from specdec.speedup import expected_tokens_curve


@dataclass(frozen=True)
class RoundObservation:
    num_drafts: int
    num_accepted: int
    draft_s: float
    verify_s: float
    batch_size: int = 0  # sessions in the verifier's batched pass for this round (0: not reported)


class DraftLengthPolicy(ABC):
    name = "policy"

    @abstractmethod
    def choose(self, max_k: int) -> int:
        """Draft length for the next round, 0 <= k <= max_k."""

    def observe(self, outcome: RoundObservation) -> None:
        """Learn from the round just verified."""

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

    def start_shadow_probe(self) -> None:
        """The loop runs the probe just chosen beside a plain round instead (see ``observe_shadow``):
        this round verifies no drafts."""

    def observe_shadow(self, num_drafts: int, num_accepted: int, draft_s: float | None = None) -> None:
        """Outcome of a shadow probe: of ``num_drafts`` drafted, the leading ``num_accepted`` equal
        what the target committed there (under greedy decoding exactly what verifying them would have
        accepted). ``draft_s``: how long the drafter took to answer it (None: not a fair measure,
        e.g. the probe that opened the drafter's session)."""


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


# --------------------------------------------------------------------------------------------
# Estimators
# --------------------------------------------------------------------------------------------


class AcceptanceEstimator:
    """Exponentially weighted MLE of the per-token acceptance rate, with change detection.

    A round with k drafts and n accepted is a truncated geometric observation: n successes and,
    if n < k, one failure. The MLE of a geometric is successes / trials with
    trials = n + (1 if n < k else 0); both sums decay by ``decay`` per observed round (window
    ~ 1 / (1 - decay) rounds). Rounds with k = 0 carry no information and change nothing.

    A long window is precise but slow after a change of regime (easy text -> hard text), so two
    one-sided CUSUM tests run on the same trials, against alpha halving and against the gap to 1
    halving. When one crosses ``change_threshold`` (log-likelihood ratio) the sums restart from
    the trials since that test last stood at zero (the CUSUM estimate of the change point),
    plus ``restart_prior`` pseudo-trials at the alternative rate that fired. ``change_threshold``
    (alpha fell) and ``up_threshold`` (alpha rose) are asymmetric on purpose: a missed rise
    keeps the policy at k = 0 or a small k, a false fall costs a few short rounds.
    ``change_threshold`` <= 0 turns detection off.

    Position effects: the conditional rate alpha_i = P(accept i | accepted 1..i-1) has its own
    decayed counts; its ratio to the pooled rate (shrunk to 1 with ``position_shrinkage``
    pseudo-trials) multiplies the current rate.
    """

    def __init__(
        self,
        decay: float = 0.95,
        prior_alpha: float = 0.6,
        prior_trials: float = 2.0,
        position_effects: bool = False,
        position_shrinkage: float = 8.0,
        max_positions: int = 64,
        change_threshold: float = 5.0,
        up_threshold: float | None = 3.0,
        restart_prior: float = 2.0,
        restart_at_alternative: bool = True,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.successes = prior_alpha * prior_trials
        self.trials = prior_trials
        self.position_effects = position_effects
        self.position_shrinkage = position_shrinkage
        self.max_positions = max_positions
        self.change_threshold = change_threshold
        self.up_threshold = change_threshold if up_threshold is None else up_threshold
        self.restart_prior = restart_prior
        self.restart_at_alternative = restart_at_alternative
        self.pos_successes: list[float] = []
        self.pos_trials: list[float] = []
        # CUSUM statistics and the (successes, trials) since each last stood at zero.
        self._down = [0.0, 0.0, 0.0]
        self._up = [0.0, 0.0, 0.0]
        self.changes = 0

    @staticmethod
    def _cusum(stat: list[float], a0: float, a1: float, n: int, f: int, threshold: float) -> bool:
        llr = n * math.log(a1 / a0) + f * math.log((1.0 - a1) / (1.0 - a0))
        stat[0] += llr
        stat[1] += n
        stat[2] += n + f
        if stat[0] <= 0.0:
            stat[0] = stat[1] = stat[2] = 0.0
            return False
        return stat[0] > threshold

    def update(self, num_drafts: int, num_accepted: int) -> None:
        k = int(num_drafts)
        if k <= 0:
            return
        n = max(0, min(int(num_accepted), k))
        f = 1 if n < k else 0
        trials = n + f
        a0 = min(0.98, max(0.02, self.alpha))
        restart = None
        if self.change_threshold > 0:
            for stat, a1, h in (
                (self._down, a0 / 2.0, self.change_threshold),
                (self._up, (1.0 + a0) / 2.0, self.up_threshold),
            ):
                if self._cusum(stat, a0, a1, n, f, h):
                    restart = (stat[1], stat[2], a1 if self.restart_at_alternative else a0)
        d = self.decay
        scale = d
        if restart is not None:
            m = self.restart_prior
            new_s, new_t = restart[0] + m * restart[2], restart[1] + m
            scale = min(1.0, new_t / (self.trials + trials))
            self.successes, self.trials = new_s, new_t
            self._down = [0.0, 0.0, 0.0]
            self._up = [0.0, 0.0, 0.0]
            self.changes += 1
        else:
            self.successes = d * self.successes + n
            self.trials = d * self.trials + trials
        ps, pt = self.pos_successes, self.pos_trials
        for i in range(len(pt)):
            ps[i] *= scale
            pt[i] *= scale
        reach = min(trials, self.max_positions)
        while len(pt) < reach:
            ps.append(0.0)
            pt.append(0.0)
        for i in range(reach):
            pt[i] += 1.0
            if i < n:
                ps[i] += 1.0

    @property
    def alpha(self) -> float:
        if self.trials <= 1e-12:
            return 0.0
        return min(1.0, max(0.0, self.successes / self.trials))

    def conditional_rates(self, k: int) -> list[float]:
        """alpha_1 .. alpha_k (conditional acceptance at each draft position)."""
        a = self.alpha
        if not self.position_effects or not self.pos_trials or a <= 1e-9:
            return [a] * k
        pt, ps = self.pos_trials, self.pos_successes
        pooled = sum(ps) / sum(pt) if sum(pt) > 1e-9 else a
        if pooled <= 1e-6:
            return [a] * k
        m = self.position_shrinkage
        out = []
        for i in range(k):
            if i < len(pt):
                out.append(min(1.0, a * (ps[i] + m * pooled) / ((pt[i] + m) * pooled)))
            else:
                out.append(a)
        return out

    def upper_alpha(self, z: float = 2.0) -> float:
        """An optimistic acceptance: the Wilson upper bound (``z`` standard errors) of the rate over
        the decayed trials. Wide while few trials are in the window (the prior alone allows about
        0.94), tight after many (0.35 over 60 trials: about 0.48)."""
        n = self.trials
        if n <= 1e-12:
            return 1.0
        p = self.alpha
        z2 = z * z
        centre = p + z2 / (2.0 * n)
        spread = z * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n))
        return min(1.0, (centre + spread) / (1.0 + z2 / n))

    def expected_tokens(self, k_max: int, alpha: float | None = None) -> list[float]:
        """E[emitted tokens](k) for k = 0..k_max (drafts accepted + the recovered/bonus token);
        ``alpha``: at that acceptance at every position instead of the estimate."""
        return expected_tokens_curve(self.conditional_rates(k_max) if alpha is None else [alpha] * k_max)

    def state(self) -> dict:
        return {
            "successes": self.successes,
            "trials": self.trials,
            "pos_successes": list(self.pos_successes),
            "pos_trials": list(self.pos_trials),
        }

    def load(self, state: dict, max_trials: float) -> None:
        """Warm start from a memory state, scaled down to at most ``max_trials`` trials."""
        trials = float(state.get("trials", 0.0))
        if trials <= 0:
            return
        scale = min(1.0, max_trials / trials)
        self.successes = state["successes"] * scale
        self.trials = trials * scale
        self.pos_successes = [s * scale for s in state.get("pos_successes", [])][: self.max_positions]
        self.pos_trials = [t * scale for t in state.get("pos_trials", [])][: self.max_positions]


def _weighted_slope(xs: list[float], ys: list[float], ws: list[float]) -> float | None:
    sw = sum(ws)
    if sw <= 0:
        return None
    mx = sum(w * x for x, w in zip(xs, ws)) / sw
    my = sum(w * y for y, w in zip(ys, ws)) / sw
    sxx = sum(w * (x - mx) ** 2 for x, w in zip(xs, ws))
    if sxx <= 1e-12:
        return None
    return sum(w * (x - mx) * (y - my) for x, y, w in zip(xs, ys, ws)) / sxx


class VerifyCostModel:
    """Verify time (as the loop sees it, round trip included) as a function of k.

    Keeps an exponentially weighted running mean per k (weight saturates at 1 / (1 - decay)).
    ``curve`` shrinks each k's mean towards the weighted least-squares line through all of them
    (``line_weight`` pseudo-observations: a k seen once or twice is mostly the line, so one
    unlucky measurement does not make a k look expensive forever), makes the result
    non-decreasing in k (isotonic regression: verifying more tokens never costs less),
    interpolates linearly between seen k and extrapolates beyond them with the line's slope
    (>= 0; with a single seen k, ``prior_slope`` times its cost per token). A k measured often
    keeps its own mean, so a curve that is flat and then steps up is represented as measured.

    With the verifier's measured ``forward_curve`` (seconds of its forward over k + 1 tokens,
    ``costs.measure_forward_curve``), all of the above applies to what the round costs on top of
    the forward (round trip, queueing, the work around the pass), and the curve is that plus the
    forward: the shape in k comes from the verifier's own timing, not from a handful of noisy
    rounds (pooling a noisy k = 0 mean with k = 1 would otherwise make a draft token look free).
    """

    def __init__(self, decay: float = 0.95, prior_slope: float = 0.03, line_weight: float = 2.0,
                 forward_curve: Sequence[float] | None = None) -> None:
        self.decay = decay
        self.prior_slope = prior_slope
        self.line_weight = line_weight
        self.forward_curve = [float(t) for t in forward_curve] if forward_curve else None
        self.means: dict[int, float] = {}
        self.weights: dict[int, float] = {}
        self._cache: tuple[int, list[float]] | None = None

    def update(self, k: int, seconds: float) -> None:
        k = int(k)
        w = self.weights.get(k, 0.0) * self.decay + 1.0
        m = self.means.get(k, seconds)
        self.means[k] = m + (seconds - m) / w
        self.weights[k] = w
        self._cache = None

    @property
    def empty(self) -> bool:
        return not self.means

    def forward(self, k: int) -> float:
        """The verifier's measured forward over k + 1 tokens (0 without a curve)."""
        return extend_curve(self.forward_curve, k) if self.forward_curve else 0.0

    def _residuals(self) -> tuple[list[int], list[float], list[float]]:
        ks = sorted(self.means)
        return ks, [self.means[k] - self.forward(k) for k in ks], [self.weights[k] for k in ks]

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the weighted least-squares line through the per-k means (with a
        forward curve: through what they cost beyond the forward)."""
        if not self.means:
            return None
        ks, ys, ws = self._residuals()
        sw = sum(ws)
        mk = sum(w * k for k, w in zip(ks, ws)) / sw
        my = sum(w * y for y, w in zip(ys, ws)) / sw
        slope = _weighted_slope([float(k) for k in ks], ys, ws)
        if slope is None:
            # One k seen: the forward curve carries the shape; without one, the prior does.
            slope = 0.0 if self.forward_curve else self.prior_slope * my / (1.0 + self.prior_slope * mk)
        slope = max(0.0, slope)
        return my - slope * mk, slope

    def curve(self, k_max: int) -> list[float] | None:
        """Estimated verify seconds for k = 0..k_max, or None before any observation."""
        if not self.means:
            return None
        if self._cache is not None and self._cache[0] >= k_max:
            return self._cache[1][: k_max + 1]
        intercept, slope = self.line()
        ks, residuals, ws = self._residuals()
        w0 = self.line_weight
        shrunk = [(w * r + w0 * (intercept + slope * k)) / (w + w0) for k, r, w in zip(ks, residuals, ws)]
        ys = isotonic(shrunk, ws)
        lo_k, lo_y, hi_k, hi_y = ks[0], ys[0], ks[-1], ys[-1]
        lo_total = lo_y + self.forward(lo_k)
        top = max(k_max, hi_k)
        out: list[float] = []
        j = 0
        for k in range(top + 1):
            if k <= lo_k:
                y = max(lo_y - slope * (lo_k - k) + self.forward(k), 0.5 * lo_total)
            elif k >= hi_k:
                y = hi_y + slope * (k - hi_k) + self.forward(k)
            else:
                while ks[j + 1] < k:
                    j += 1
                k0, k1 = ks[j], ks[j + 1]
                y = ys[j] + (ys[j + 1] - ys[j]) * (k - k0) / (k1 - k0) + self.forward(k)
            out.append(y)
        self._cache = (top, out)
        return out[: k_max + 1]

    def state(self) -> dict:
        return {"means": dict(self.means), "weights": dict(self.weights)}

    def load(self, state: dict, max_weight: float) -> None:
        for k, m in state.get("means", {}).items():
            self.means[int(k)] = float(m)
            self.weights[int(k)] = min(float(state["weights"][k]), max_weight)
        self._cache = None


class DraftCostModel:
    """Draft time of a k-token proposal: overhead (call round trip) + k * per-token time.

    Exponentially weighted least squares over rounds with k > 0. With too little spread in k
    the split is not identifiable and everything is attributed to the per-token term (the
    policy explores neighbouring k to get the spread). Rounds where the drafter first has to
    catch up on tokens it has not seen (the first round of a session, the first after k = 0
    rounds) are kept aside and used only while nothing else is known.
    """

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.sw = self.sk = self.skk = self.sy = self.sky = 0.0
        self.fallback: tuple[int, float] | None = None

    def update(self, k: int, seconds: float) -> None:
        if k <= 0:
            return
        d = self.decay
        self.sw = d * self.sw + 1.0
        self.sk = d * self.sk + k
        self.skk = d * self.skk + k * k
        self.sy = d * self.sy + seconds
        self.sky = d * self.sky + k * seconds

    def note_catch_up(self, k: int, seconds: float) -> None:
        """Keep the cheapest catch-up seen (per draft token) as the stand-in: each one overstates
        drafting, by feeding the tokens the drafter had not seen (at a session's start, the whole
        prompt) and, for a shadow probe, by sharing the machine with the verifier's pass."""
        if k > 0 and (self.fallback is None or seconds / k < self.fallback[1] / self.fallback[0]):
            self.fallback = (k, seconds)

    @property
    def spread(self) -> float:
        """Weighted variance of the k values seen."""
        if self.sw <= 0:
            return 0.0
        mk = self.sk / self.sw
        return max(0.0, self.skk / self.sw - mk * mk)

    def coefficients(self) -> tuple[float, float] | None:
        """(overhead_s, per_token_s), or None before any observation."""
        if self.sw <= 1e-9:
            if self.fallback is None:
                return None
            k, s = self.fallback
            return 0.0, s / k
        mk, my = self.sk / self.sw, self.sy / self.sw
        var = self.skk / self.sw - mk * mk
        if var > 0.05:
            slope = (self.sky / self.sw - mk * my) / var
            intercept = my - slope * mk
            if slope < 0:
                return my, 0.0
            if intercept < 0:
                return 0.0, self.sky / self.skk
            return intercept, slope
        return 0.0, my / mk

    def predict(self, k: int) -> float:
        c = self.coefficients()
        if c is None or k <= 0:
            return 0.0
        return c[0] + c[1] * k

    def state(self) -> dict:
        return {"sums": [self.sw, self.sk, self.skk, self.sy, self.sky], "fallback": self.fallback}

    def load(self, state: dict, max_weight: float) -> None:
        sums = state.get("sums")
        if sums and sums[0] > 0:
            scale = min(1.0, max_weight / sums[0])
            self.sw, self.sk, self.skk, self.sy, self.sky = (s * scale for s in sums)
        if state.get("fallback") and self.fallback is None:
            self.fallback = tuple(state["fallback"])


# --------------------------------------------------------------------------------------------
# Shared memory across sessions
# --------------------------------------------------------------------------------------------

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
            }
            e.sessions += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

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


# --------------------------------------------------------------------------------------------
# The adaptive policy
# --------------------------------------------------------------------------------------------


class AdaptiveDraftLength(DraftLengthPolicy):
    """Goodput-maximising draft length with k = 0 allowed (one instance per session).

    Args:
        max_k: server bound on k (``choose``'s argument bounds it further per request).
        memory, key: shared ``AcceptanceMemory`` to warm-start from and report to on ``close``.
        initial_k: k of the first round when nothing at all is known about costs.
        prior_alpha, prior_trials: acceptance prior used when the memory has nothing.
        alpha_decay: per-round decay of the acceptance counts (window ~ 1 / (1 - decay) rounds).
        change_threshold, up_threshold: CUSUM thresholds (log-likelihood ratio) for a fall / a
            rise of acceptance; crossing one restarts the estimate (0 disables detection).
        cost_decay: per-observation decay of the cost estimates.
        position_effects: model per-position conditional acceptance.
        probe_k, probe_interval, max_probe_interval: while k = 0 wins, draft ``probe_k`` tokens
            after ``probe_interval`` k = 0 rounds; a probe with nothing accepted doubles the
            interval, one with acceptances resets it and probes again at once.
        probe_budget, paid_probe_budget: the interval stops doubling where the probes' extra
            cost is this fraction of the time between them (the larger budget once drafting
            clearly paid earlier in the session: acceptance that was high tends to come back).
        explore_every: every this many k > 0 rounds use a neighbouring k (k +/- 1, alternating)
            so the draft overhead / per-token split and the verify curve stay identifiable;
            done more often (every 3rd round) while the draft cost model has no spread in k.
        draft_margin: a k >= 1 is chosen only if its rate beats k = 0 by more than this fraction
            (a near tie goes to plain decoding: the model leaves out costs of drafting it cannot
            see per round, such as the drafter's catch-up after k = 0 rounds and its CPU beside
            the verifier's on a shared machine; probes keep acceptance measured).
        warm_trials, warm_cost_weight: caps on how much a memory warm start weighs.
        forward_curve: the verifier's measured forward cost over k + 1 tokens (its
            ``GetInfo.forward_cost_s``); the verify-cost model takes its shape in k from it.
        co_batched: the other sessions expected in this session's verify passes until its own
            rounds say (the gateway passes the verifier's other open sessions). Learned from 0
            instead, every session arriving at a loaded verifier believed itself alone for its
            first rounds, drafted, and kept 15 others waiting for its drafter and its longer pass.
    """

    name = "adaptive"

    def __init__(
        self,
        max_k: int = 16,
        *,
        memory: AcceptanceMemory | None = None,
        key: MemoryKey | None = None,
        initial_k: int = 4,
        prior_alpha: float = 0.6,
        prior_trials: float = 2.0,
        alpha_decay: float = 0.95,
        change_threshold: float = 5.0,
        up_threshold: float | None = 3.0,
        cost_decay: float = 0.95,
        position_effects: bool = False,
        probe_k: int = 1,
        probe_interval: int = 4,
        max_probe_interval: int = 256,
        probe_budget: float = 0.02,
        paid_probe_budget: float = 0.05,
        explore_every: int = 32,
        draft_margin: float = 0.0,
        warm_trials: float = 60.0,
        warm_cost_weight: float = 4.0,
        forward_curve: Sequence[float] | None = None,
        co_batched: float = 0.0,
    ) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.memory = memory
        self.key = key
        self.initial_k = initial_k
        self.probe_k = max(1, probe_k)
        self.base_probe_interval = max(1, probe_interval)
        self.max_probe_interval = max(self.base_probe_interval, max_probe_interval)
        self.explore_every = explore_every
        self.probe_budget = probe_budget
        self.paid_probe_budget = paid_probe_budget
        self.acceptance = AcceptanceEstimator(
            decay=alpha_decay,
            prior_alpha=prior_alpha,
            prior_trials=prior_trials,
            position_effects=position_effects,
            change_threshold=change_threshold,
            up_threshold=up_threshold,
        )
        self.draft_margin = draft_margin
        self.verify = VerifyCostModel(decay=cost_decay, forward_curve=forward_curve)
        self.draft = DraftCostModel(decay=cost_decay)
        self.cost_decay = cost_decay
        self.co_batched = max(0.0, float(co_batched))  # recent mean of other sessions in this session's verify passes
        self.warm_started = False
        if memory is not None and key is not None:
            entry = memory.get(key)
            if entry is not None:
                self.acceptance.load(entry.acceptance, warm_trials)
                self.verify.load(entry.verify, warm_cost_weight)
                self.draft.load(entry.draft, warm_cost_weight)
                self.warm_started = True
        self.probe_interval = self.base_probe_interval
        self.zero_run = 0  # consecutive rounds where k = 0 was the choice
        self.rounds = 0
        self.probes = 0
        self.probes_skipped = 0  # rounds a probe was due but could not have changed the choice
        self._kind = "none"  # what the last choice was: initial / zero / probe / best / explore / forced
        self._explore_sign = 1
        self._spec_rounds = 0
        self._catch_up = True  # the drafter has unseen tokens (session start, after k = 0 rounds)
        self._shadow_pending = False  # a shadow probe's outcome is still to come
        self._closed = False
        self.paid = False  # speculation clearly paid earlier in this session
        self.paid_gain = 1.25

    # -- model -------------------------------------------------------------------------------

    def expected_rates(self, k_max: int, optimistic: bool = False) -> list[float] | None:
        """Estimated emitted tokens per second for k = 0..k_max (None: no cost data yet).

        ``optimistic``: the best case the data allow, for deciding whether a probe could change
        anything: acceptance at its upper bound (``upper_alpha``), drafts free (the draft cost is
        the uncertain part: a stand-in from a catch-up can be far too high, and only probes
        correct it), and verifying k drafts costing no more over k = 0 than the verifier's own
        measured forward says (the learned curve can hold a k last seen under another load)."""
        vcurve = self.verify.curve(k_max)
        if vcurve is None:
            return None
        coef = (0.0, 0.0) if optimistic else self.draft.coefficients()
        if coef is None:
            coef = (0.0, 0.1 * vcurve[0])  # prior: a draft token costs a tenth of a target step
        overhead, per_token = coef
        if optimistic and self.verify.forward_curve:
            forward0 = self.verify.forward(0)
            vcurve = [vcurve[0] + min(v - vcurve[0], self.verify.forward(k) - forward0)
                      for k, v in enumerate(vcurve)]
        tokens = self.acceptance.expected_tokens(k_max, self.acceptance.upper_alpha() if optimistic else None)
        rates = []
        for k in range(k_max + 1):
            t = vcurve[k] + (overhead + per_token * k if k > 0 else 0.0)
            # Goodput under load (SmartSpec): my drafts lengthen the batched pass for every session
            # sharing it, by what they cost me (the verify curve's rise over k = 0); counted as my cost.
            t += self.co_batched * (vcurve[k] - vcurve[0])
            rates.append(tokens[k] / max(t, 1e-9))
        return rates

    def estimates(self, k_max: int | None = None) -> dict:
        """Current model, for tests, logs and traces."""
        k_max = self.max_k if k_max is None else k_max
        coef = self.draft.coefficients()
        return {
            "alpha": self.acceptance.alpha,
            "conditional_alpha": self.acceptance.conditional_rates(k_max),
            "verify_s": self.verify.curve(k_max),
            "draft_overhead_s": coef[0] if coef else None,
            "draft_per_token_s": coef[1] if coef else None,
            "rates": self.expected_rates(k_max),
            "probe_interval": self.probe_interval,
            "alpha_upper": self.acceptance.upper_alpha(),
            "probes_skipped": self.probes_skipped,
            "co_batched_sessions": self.co_batched,
            "warm_started": self.warm_started,
        }

    def probe_interval_cap(self) -> int:
        """Longest backoff: a probe's extra cost (to this session and, through its longer pass, to
        the sessions batched with it) spread over the k = 0 rounds between probes stays within
        ``probe_budget`` of their time (so never probing could gain at most that)."""
        cap = self.max_probe_interval
        budget = self.paid_probe_budget if self.paid else self.probe_budget
        vcurve = self.verify.curve(self.probe_k)
        if vcurve is not None and budget > 0 and vcurve[0] > 0:
            # What a probe adds to this session's round, and to the co-batched sessions' pass.
            extra = (1.0 + self.co_batched) * (vcurve[self.probe_k] - vcurve[0]) + self.draft.predict(self.probe_k)
            if extra <= 0:
                extra = 0.1 * vcurve[0]  # prior: a draft token costs a tenth of a target step
            cap = min(cap, math.ceil(extra / (budget * vcurve[0])))
        return max(self.base_probe_interval, cap)

    # -- policy ------------------------------------------------------------------------------

    def _best_k(self, rates: list[float]) -> int:
        """The k >= 1 of the best expected rate (ties to the shorter), or 0 unless it beats plain
        decoding by more than ``draft_margin``."""
        best = max(range(1, len(rates)), key=lambda k: (rates[k], -k))
        return best if rates[best] > rates[0] * (1.0 + self.draft_margin) else 0

    def _probe_could_pay(self, bound: int) -> bool:
        """Would drafting beat plain decoding in the best case (``expected_rates(optimistic=True)``)?
        If not, the verifier's side alone makes every draft token a loss (under load: the pass it
        lengthens is shared by many sessions, SmartSpec's point), and a probe would only spend
        drafter and verifier time: whatever it measured, k = 0 would stay."""
        rates = self.expected_rates(bound, optimistic=True)
        return rates is not None and self._best_k(rates) > 0

    def expects_to_draft(self) -> bool:
        """``choose``'s rule without its bookkeeping: ``initial_k`` with nothing known about costs,
        otherwise the best expected rate (plain decoding winning means no draft before the first
        probe, ``probe_interval`` rounds later)."""
        if self.max_k <= 0:
            return False
        rates = self.expected_rates(self.max_k)
        return self.initial_k > 0 if rates is None else self._best_k(rates) > 0

    def choose(self, max_k: int) -> int:
        bound = min(self.max_k, max_k)
        if bound <= 0:
            self._kind = "forced"
            return 0
        self.rounds += 1
        rates = self.expected_rates(bound)
        if rates is None:
            self._kind = "initial"
            return min(self.initial_k, bound)
        best = self._best_k(rates)
        if best == 0:
            if self._shadow_pending:  # one probe at a time
                self._kind = "zero"
                return 0
            self.zero_run += 1
            if self.zero_run > self.probe_interval:
                if not self._probe_could_pay(bound):
                    # Its answer could not change the choice: skip it (asked again next round, as
                    # the costs move with the load).
                    self.probes_skipped += 1
                    self._kind = "zero"
                    return 0
                self.zero_run = 0
                self.probes += 1
                self._kind = "probe"
                return min(self.probe_k, bound)
            self._kind = "zero"
            return 0
        self.zero_run = 0
        self.probe_interval = self.base_probe_interval
        if rates[best] >= self.paid_gain * rates[0]:
            self.paid = True
        self._spec_rounds += 1
        # On a close call, measure k = 0 now and then: otherwise its cost is only extrapolated from
        # drafting rounds, and a verify curve steeper than the prior keeps drafting that does not pay.
        unmeasured = self.verify.weights.get(0, 0.0) < 1.0
        refresh = self.explore_every > 0 and self._spec_rounds % self.explore_every == self.explore_every // 2
        if rates[best] < 1.5 * rates[0] and ((unmeasured and self._spec_rounds % 8 == 0) or refresh):
            self._kind = "explore"
            return 0
        explore = (self.explore_every > 0 and self._spec_rounds % self.explore_every == 0) or (
            self.draft.spread < 0.1 and self._spec_rounds % 3 == 0
        )
        if explore:
            self._explore_sign = -self._explore_sign
            k = best + self._explore_sign
            if k < 1 or k > bound:
                k = best - self._explore_sign
            if 1 <= k <= bound:
                self._kind = "explore"
                return k
        self._kind = "best"
        return best

    def observe(self, outcome: RoundObservation) -> None:
        k = max(0, int(outcome.num_drafts))
        n = max(0, min(int(outcome.num_accepted), k))
        self.acceptance.update(k, n)
        self.verify.update(k, float(outcome.verify_s))
        if outcome.batch_size > 0:
            others = float(outcome.batch_size - 1)
            self.co_batched = self.cost_decay * self.co_batched + (1.0 - self.cost_decay) * others
        if k > 0:
            if self._catch_up:
                self.draft.note_catch_up(k, float(outcome.draft_s))
            else:
                self.draft.update(k, float(outcome.draft_s))
        self._catch_up = k == 0
        if self._kind == "probe":
            self._probe_outcome(n)

    def _probe_outcome(self, num_accepted: int) -> None:
        if num_accepted > 0:
            # Probe again at once (a real rise shows as successes in a row), but halve the
            # interval rather than reset it: at a moderate alpha probes succeed often while
            # k = 0 still wins, and a reset kept sessions probing every few rounds (a fifth
            # of all rounds at alpha 0.37).
            self.probe_interval = max(self.base_probe_interval, self.probe_interval // 2)
            self.zero_run = self.probe_interval
        else:
            self.probe_interval = min(2 * self.probe_interval, self.probe_interval_cap())

    @property
    def probing(self) -> bool:
        return self._kind == "probe"

    def start_shadow_probe(self) -> None:
        self._kind = "shadow"
        self._shadow_pending = True

    def observe_shadow(self, num_drafts: int, num_accepted: int, draft_s: float | None = None) -> None:
        k = max(0, int(num_drafts))
        n = max(0, min(int(num_accepted), k))
        self._shadow_pending = False
        self.acceptance.update(k, n)  # the verify costs stay as measured: the round verified no drafts
        if draft_s is not None:
            # A probe is a catch-up too (the drafter first feeds the tokens committed since the
            # last one). Without it, while probes run in the shadow the stand-in for the draft cost
            # would stay the first catch-up (often with the drafter's whole-prompt prefill), and a
            # cost that high keeps k = 0 winning for good.
            self.draft.note_catch_up(k, float(draft_s))
        self._probe_outcome(n)

    def close(self) -> None:
        """Report this session's estimates to the memory (once)."""
        if self._closed:
            return
        self._closed = True
        if self.memory is not None and self.key is not None:
            self.memory.report(self.key, self.acceptance.state(), self.verify.state(), self.draft.state())


def make_policy(
    num_draft_tokens: int,
    memory: AcceptanceMemory | None = None,
    key: MemoryKey | None = None,
    max_k: int = 16,
    **kwargs,
) -> DraftLengthPolicy:
    """``num_draft_tokens`` > 0: that fixed k (capped at ``max_k``); 0: ``AdaptiveDraftLength``."""
    if num_draft_tokens < 0:
        raise ValueError("num_draft_tokens must be >= 0")
    if num_draft_tokens > 0:
        return FixedDraftLength(min(num_draft_tokens, max_k))
    return AdaptiveDraftLength(max_k=max_k, memory=memory, key=key, **kwargs)
