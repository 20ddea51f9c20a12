"""Online estimators behind the adaptive policy: acceptance (with change detection), verify cost
as a function of k, and draft cost (call overhead + per-token time). See docs/adaptive.md."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.costs import extend_curve, isotonic, weighted_line
from specdec.speedup import expected_tokens_curve


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

    The forward curve is one session's; in a pass the verifier batches, this session's k + 1 tokens
    ride on ``other_rows`` tokens of the other sessions, so its k is read at ``k + other_rows`` on
    the curve: on a CPU whose cost steps up from one row to two, a draft is expensive alone and
    nearly free beside seven other sessions' rows (the step is behind the pass already).
    """

    def __init__(self, decay: float = 0.95, prior_slope: float = 0.03, line_weight: float = 2.0,
                 forward_curve: Sequence[float] | None = None) -> None:
        self.decay = decay
        self.prior_slope = prior_slope
        self.line_weight = line_weight
        self.forward_curve = [float(t) for t in forward_curve] if forward_curve else None
        self.other_rows = 0.0  # the other sessions' tokens in this session's passes (set by the policy)
        self.means: dict[int, float] = {}  # per k: the rounds' mean cost beyond the forward (all of it without a curve)
        self.weights: dict[int, float] = {}
        self._cache: tuple[int, list[float]] | None = None

    def update(self, k: int, seconds: float, other_rows: float | None = None) -> None:
        """One round verifying k drafts took ``seconds``; kept as what it cost beyond the forward, read
        where this round's pass put the session (``other_rows``: the other sessions' tokens in it;
        None: ``self.other_rows``), so that a change of load moves the forward part and leaves the
        learned part (round trip, queueing, work around the pass) as it was."""
        k = int(k)
        others = self.other_rows if other_rows is None else max(0.0, float(other_rows))
        beyond = seconds - self.pass_forward(k + 1 + others)
        w = self.weights.get(k, 0.0) * self.decay + 1.0
        m = self.means.get(k, beyond)
        self.means[k] = m + (beyond - m) / w
        self.weights[k] = w
        self._cache = None

    @property
    def empty(self) -> bool:
        return not self.means

    def forward(self, k: int) -> float:
        """The verifier's measured forward over k + 1 tokens beside ``other_rows`` others (0 without a curve)."""
        return self.pass_forward(k + 1 + self.other_rows)

    def pass_forward(self, tokens: float) -> float:
        """The verifier's measured forward over ``tokens`` tokens in all (0 without a curve)."""
        return extend_curve(self.forward_curve, tokens - 1) if self.forward_curve else 0.0

    def set_other_rows(self, rows: float) -> None:
        if rows != self.other_rows:
            self.other_rows = max(0.0, float(rows))
            self._cache = None

    def _residuals(self) -> tuple[list[int], list[float], list[float]]:
        ks = sorted(self.means)
        return ks, [self.means[k] for k in ks], [self.weights[k] for k in ks]

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the weighted least-squares line through the per-k means (with a
        forward curve: through what they cost beyond the forward)."""
        if not self.means:
            return None
        ks, ys, ws = self._residuals()
        sw = sum(ws)
        mk = sum(w * k for k, w in zip(ks, ws)) / sw
        my = sum(w * y for y, w in zip(ys, ws)) / sw
        fitted = weighted_line([float(k) for k in ks], ys, ws)
        slope = fitted[1] if fitted is not None else None
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


class DecayedMean:
    """An exponentially weighted mean (None before any sample); its weight saturates at 1 / (1 - decay)."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.value: float | None = None
        self.weight = 0.0

    def add(self, sample: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        previous = sample if self.value is None else self.value
        self.value = previous + (sample - previous) / self.weight



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
        # What this session's shadow probes cost the rounds beside them (seconds beyond their plain
        # cost): the drafter's catch-up on the verifier's cores when both share a machine, ~0 apart.
        # The probe that opens the drafter's session (its prompt's prefill) apart from the others.
        # A deployment's figures across sessions live in the memory (``note_probe_cost``).
        self.probe = DecayedMean(decay)
        self.opening = DecayedMean(decay)

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
