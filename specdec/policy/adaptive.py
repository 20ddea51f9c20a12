"""``AdaptiveDraftLength``: the k that maximises expected emitted tokens per second.

Every round it picks k under an online model of acceptance and cost (see docs/adaptive.md):

    rate(k) = E[tokens](k) / (t_draft(k) + t_verify(k)),
    E[tokens](k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i      (= (1 - a^(k+1)) / (1 - a) if alpha_i = a)
    t_draft(k)   = draft call overhead (round trip) + k * per-token draft time, 0 for k = 0
    t_verify(k)  = measured per-k running mean (incl. the verifier round trip), isotonic in k,
                   interpolated / extrapolated linearly for k not seen yet.

k = 0 (plain decoding) competes in the same units, and while it wins the policy probes with a
small k now and then (exponential backoff) so it notices when drafting pays again. Decisions are
a pure function of the observations (no randomness). Its tunables are ``AdaptiveConfig``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any

from specdec.policy.base import DraftLengthPolicy, FixedDraftLength, PolicyMemory, RoundObservation
from specdec.policy.confidence import ConfidenceDraftLength
from specdec.policy.config import AdaptiveConfig
from specdec.policy.estimators import AcceptanceEstimator, DraftCostModel, VerifyCostModel


def _tunable(name: str) -> property:
    """Read-only attribute for a config field (the policy's attributes before ``AdaptiveConfig``)."""
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}``")


class AdaptiveDraftLength(DraftLengthPolicy):
    """Goodput-maximising draft length with k = 0 allowed (one instance per session).

    Args:
        max_k: server bound on k (``choose``'s argument bounds it further per request).
        memory, key: shared ``AcceptanceMemory`` to warm-start from and report to on ``close``.
        forward_curve: the verifier's measured forward cost over k + 1 tokens (its
            ``GetInfo.forward_cost_s``); the verify-cost model takes its shape in k from it.
        co_batched: the other sessions expected in this session's verify passes until its own
            rounds say (the gateway passes the verifier's other open sessions). Learned from 0
            instead, every session arriving at a loaded verifier believed itself alone for its
            first rounds, drafted, and kept 15 others waiting for its drafter and its longer pass.
        config: the tunables (``AdaptiveConfig``; default: its defaults).
        **overrides: single ``AdaptiveConfig`` fields by name, applied over ``config``
            (``initial_k=2``, ``draft_margin=0.05``, ...); an unknown name is a TypeError.
    """

    name = "adaptive"

    initial_k = _tunable("initial_k")
    explore_every = _tunable("explore_every")
    probe_budget = _tunable("probe_budget")
    paid_probe_budget = _tunable("paid_probe_budget")
    draft_margin = _tunable("draft_margin")
    cost_decay = _tunable("cost_decay")
    paid_gain = _tunable("paid_gain")

    def __init__(
        self,
        max_k: int = 16,
        *,
        memory: PolicyMemory | None = None,
        key: Hashable | None = None,
        forward_curve: Sequence[float] | None = None,
        co_batched: float = 0.0,
        config: AdaptiveConfig | None = None,
        **overrides: Any,
    ) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        cfg = config if config is not None else AdaptiveConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self.max_k = max_k
        self.memory = memory
        self.key = key
        self.probe_k = max(1, cfg.probe_k)
        self.base_probe_interval = max(1, cfg.probe_interval)
        self.max_probe_interval = max(self.base_probe_interval, cfg.max_probe_interval)
        self.acceptance = AcceptanceEstimator(
            decay=cfg.alpha_decay,
            prior_alpha=cfg.prior_alpha,
            prior_trials=cfg.prior_trials,
            position_effects=cfg.position_effects,
            change_threshold=cfg.change_threshold,
            up_threshold=cfg.up_threshold,
        )
        self.verify = VerifyCostModel(decay=cfg.cost_decay, forward_curve=forward_curve)
        self.draft = DraftCostModel(decay=cfg.cost_decay)
        self.co_batched = max(0.0, float(co_batched))  # recent mean of other sessions in this session's verify passes
        # ... and of their tokens in those passes (until a pass reports it: one each, plain decoding)
        self.other_rows = self.co_batched
        self.verify.set_other_rows(self.other_rows)
        self.warm_started = False
        if memory is not None and key is not None:
            entry = memory.get(key)
            if entry is not None:
                self.acceptance.load(entry.acceptance, cfg.warm_trials)
                self.verify.load(entry.verify, cfg.warm_cost_weight)
                self.draft.load(entry.draft, cfg.warm_cost_weight)
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
        self._recheck_at = 0  # settled at k = 0: the round of the next full evaluation (``k0_recheck_every``)
        self._settled = False  # k = 0, and no probe worth its measured cost in what the request has left
        self._drafter_open = False  # a proposal was made in this session (the drafter has its prompt)
        self._closed = False
        self.paid = False  # speculation clearly paid earlier in this session

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
            coef = (0.0, self.config.draft_token_prior * vcurve[0])  # prior: no draft time seen yet
        overhead, per_token = coef
        if optimistic and self.verify.forward_curve:
            forward0 = self.verify.forward(0)
            vcurve = [vcurve[0] + min(v - vcurve[0], self.verify.forward(k) - forward0)
                      for k, v in enumerate(vcurve)]
        tokens = self.acceptance.expected_tokens(k_max, self.acceptance.upper_alpha() if optimistic else None)
        if self.co_batched >= self.config.shared_pass_sessions and self.verify.forward_curve:
            return self._shared_pass_rates(tokens, vcurve[0] - self.verify.forward(0), overhead, per_token)
        rates = []
        for k in range(k_max + 1):
            t = vcurve[k] + (overhead + per_token * k if k > 0 else 0.0)
            # Goodput under load (SmartSpec): my drafts lengthen the batched pass for every session
            # sharing it, by what they cost me (the verify curve's rise over k = 0); counted as my cost.
            t += self.co_batched * (vcurve[k] - vcurve[0])
            rates.append(tokens[k] / max(t, 1e-9))
        return rates

    def _shared_pass_rates(self, tokens: list[float], beyond_forward: float, overhead: float,
                           per_token: float) -> list[float]:
        """Rates for k = 0..len(tokens) - 1 when passes are shared: as if every session in them drafted
        the same k (the verifier's forward over all their tokens, plus this session's measured cost
        beyond its forward, plus its drafting).

        Judged alone, a draft in a pass of plain rounds costs its session a pass of its own (it comes
        back from its drafter after the others' pass left) and lengthens the others' passes, so every
        session kept k = 0 although all drafting the same k paid: on a 1B target at 8 streams, α 0.7,
        the adaptive sessions settled at k = 0 (0.87x plain decoding) where a fixed k = 4 gave 1.12x.
        Sessions with the same draft and the same estimates reach the same choice, which makes it true;
        the total goodput of symmetric sessions is their count times this rate."""
        sessions = 1.0 + self.co_batched
        rates = []
        for k, expected in enumerate(tokens):
            t = beyond_forward + self.verify.pass_forward(sessions * (k + 1)) + (overhead + per_token * k if k > 0 else 0.0)
            rates.append(expected / max(t, 1e-9))
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
            "other_rows": self.other_rows,
            "warm_started": self.warm_started,
        }

    def probe_interval_cap(self) -> int:
        """Longest backoff: a probe's extra cost (to this session and, through its longer pass, to
        the sessions batched with it) spread over the k = 0 rounds between probes stays within
        ``probe_budget`` of their time (so never probing could gain at most that)."""
        cap = self.max_probe_interval
        budget = self.config.paid_probe_budget if self.paid else self.config.probe_budget
        vcurve = self.verify.curve(self.probe_k)
        if vcurve is not None and budget > 0 and vcurve[0] > 0:
            # What a probe adds to this session's round, and to the co-batched sessions' pass: as
            # measured for shadow probes (the rounds beside them), else a verified probe's cost.
            measured = self._probe_cost(opening=False)
            if measured is not None:
                extra = (1.0 + self.co_batched) * measured
            else:
                extra = (1.0 + self.co_batched) * (vcurve[self.probe_k] - vcurve[0]) + self.draft.predict(self.probe_k)
            if extra <= 0:
                extra = self.config.draft_token_prior * vcurve[0]  # prior: as if no draft time were seen
            cap = min(cap, math.ceil(extra / (budget * vcurve[0])))
        return max(self.base_probe_interval, cap)

    # -- policy ------------------------------------------------------------------------------

    def _best_k(self, rates: list[float]) -> int:
        """The k >= 1 of the best expected rate (ties to the shorter), or 0 unless it beats plain
        decoding by more than ``draft_margin``."""
        best = max(range(1, len(rates)), key=lambda k: (rates[k], -k))
        return best if rates[best] > rates[0] * (1.0 + self.config.draft_margin) else 0

    def _probe_could_pay(self, optimistic: list[float] | None) -> bool:
        """Would drafting beat plain decoding in the best case (``optimistic``: the rates of
        ``expected_rates(optimistic=True)``)? If not, the verifier's side alone makes every draft
        token a loss (under load: the pass it lengthens is shared by many sessions, SmartSpec's
        point), and a probe would only spend drafter and verifier time: whatever it measured, k = 0
        would stay."""
        return optimistic is not None and self._best_k(optimistic) > 0

    def _probe_cost(self, opening: bool) -> float | None:
        """What a shadow probe costs on this deployment: the memory's live figure (every session's
        probes, this one's included), else this session's own."""
        kind = "opening" if opening else "probe"
        if self.memory is not None and self.key is not None:
            shared = self.memory.probe_cost(self.key, kind)
            if shared is not None:
                return shared
        return getattr(self.draft, kind).value

    def _probe_worth_its_cost(self, optimistic: list[float] | None, tokens_left: int, rates: list[float]) -> bool:
        """A shadow probe's measured cost (``DraftCostModel.probe``, or ``.opening`` for the probe that
        opens the drafter's session: the rounds beside it, beyond their plain cost; times the sessions
        sharing those passes) against the most it could gain: the time per token drafting would save
        at its best case (``optimistic``: ``expected_rates(optimistic=True)``), over the tokens this
        request has left. Unmeasured, a probe is worth it (it measures)."""
        cost = self._probe_cost(opening=not self._drafter_open)
        if cost is None:
            return True
        best = max(optimistic[1:], default=0.0) if optimistic is not None else 0.0
        if best <= rates[0] or rates[0] <= 0:
            return False
        return (1.0 / rates[0] - 1.0 / best) * tokens_left > (1.0 + self.co_batched) * cost

    def expects_to_draft(self) -> bool:
        """``choose``'s rule without its bookkeeping: ``initial_k`` with nothing known about costs,
        otherwise the best expected rate (plain decoding winning means no draft before the first
        probe, ``probe_interval`` rounds later)."""
        if self.max_k <= 0:
            return False
        rates = self.expected_rates(self.max_k)
        return self.config.initial_k > 0 if rates is None else self._best_k(rates) > 0

    def choose(self, max_k: int) -> int:
        cfg = self.config
        bound = min(self.max_k, max_k)
        if bound <= 0:
            self._kind = "forced"
            return 0
        self.rounds += 1
        if self._kind == "zero" and self.rounds < self._recheck_at:
            # Settled at k = 0, no acceptance evidence since the last evaluation, no probe due.
            if not self._shadow_pending:
                self.zero_run += 1
            return 0
        rates = self.expected_rates(bound)
        if rates is None:
            self._kind = "initial"
            return min(cfg.initial_k, bound)
        best = self._best_k(rates)
        if best == 0:
            self._kind = "zero"
            if self._shadow_pending:  # one probe at a time (its outcome asks for an evaluation)
                return 0
            self.zero_run += 1
            if self.zero_run > self.probe_interval:
                optimistic = self.expected_rates(bound, optimistic=True)
                self._settled = not self._probe_worth_its_cost(optimistic, max_k + 1, rates)
                if self._settled or not self._probe_could_pay(optimistic):
                    # Its answer could not change the choice, or could not repay what it costs:
                    # skip it (asked again at the next evaluation, as the costs move with the load).
                    self.probes_skipped += 1
                    self._recheck_at = self.rounds + cfg.k0_recheck_every
                    return 0
                self.zero_run = 0
                self.probes += 1
                self._kind = "probe"
                return min(self.probe_k, bound)
            if self.zero_run >= cfg.k0_recheck_every:  # a settled stretch: again where the probe falls due, or sooner
                self._recheck_at = self.rounds + min(cfg.k0_recheck_every, self.probe_interval + 1 - self.zero_run)
            return 0
        self._settled = False
        self.zero_run = 0
        self.probe_interval = self.base_probe_interval
        if rates[best] >= cfg.paid_gain * rates[0]:
            self.paid = True
        self._spec_rounds += 1
        # On a close call, measure k = 0 now and then: otherwise its cost is only extrapolated from
        # drafting rounds, and a verify curve steeper than the prior keeps drafting that does not pay.
        unmeasured = self.verify.weights.get(0, 0.0) < cfg.k0_measured_weight
        every = cfg.explore_every
        refresh = every > 0 and self._spec_rounds % every == every // 2
        if rates[best] < cfg.close_call * rates[0] and (
            (unmeasured and self._spec_rounds % cfg.k0_refresh_every == 0) or refresh
        ):
            self._kind = "explore"
            return 0
        explore = (every > 0 and self._spec_rounds % every == 0) or (
            self.draft.spread < cfg.min_draft_spread and self._spec_rounds % cfg.explore_every_no_spread == 0
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

    def plain_run(self, limit: int) -> int:
        """At k = 0 with no probe pending: the rounds before this policy would look again, counted as
        ``choose`` counts them. Settled, the rounds before the next evaluation (``k0_recheck_every``);
        otherwise those before the next probe falls due (``probe_interval``), which ``choose`` would
        leave plain unless the plain rounds' own costs moved the best k, a move the next evaluation
        after the run still sees."""
        if self._kind != "zero" or self._shadow_pending or limit <= 0:
            return 0
        if self.rounds < self._recheck_at:
            rounds = self._recheck_at - self.rounds - 1
        else:
            rounds = self.probe_interval - self.zero_run
        rounds = min(limit, rounds)
        if rounds <= 0:
            return 0
        self.rounds += rounds
        self.zero_run += rounds
        return rounds

    def observe(self, outcome: RoundObservation) -> None:
        k = max(0, int(outcome.num_drafts))
        n = max(0, min(int(outcome.num_accepted), k))
        self.acceptance.update(k, n)
        others = None  # the other sessions' tokens in this round's pass (None: not reported)
        if outcome.batch_size > 0:
            decay = self.config.cost_decay
            self.co_batched = decay * self.co_batched + (1.0 - decay) * float(outcome.batch_size - 1)
            others = outcome.other_tokens(self.co_batched)
        if not (outcome.beside_probe and k == 0):  # a plain round slowed by the drafter's probe is the probe's cost
            self.verify.update(k, float(outcome.verify_s), others)
        if others is not None:
            self.other_rows = decay * self.other_rows + (1.0 - decay) * others
            self.verify.set_other_rows(self.other_rows)  # the next rounds' passes: the recent mean
        if k > 0:
            if self._catch_up:
                self.draft.note_catch_up(k, float(outcome.draft_s))
            else:
                self.draft.update(k, float(outcome.draft_s))
        self._catch_up = k == 0
        if k > 0:
            self._recheck_at = 0  # new acceptance evidence: evaluate next round
            self._drafter_open = True
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

    @property
    def settled(self) -> bool:
        return self._settled and self._kind in ("zero", "forced")

    def drafter_closed(self) -> None:
        self._drafter_open = False

    def start_shadow_probe(self) -> None:
        self._kind = "shadow"
        self._shadow_pending = True

    def observe_shadow(self, num_drafts: int, num_accepted: int, draft_s: float | None = None,
                       beside_s: float = 0.0, beside_rounds: int = 0) -> None:
        """A shadow probe's outcome; ``beside_s``: the time of the ``beside_rounds`` plain rounds
        verified while the drafter worked on it (what they cost beyond plain rounds is the probe's cost)."""
        k = max(0, int(num_drafts))
        n = max(0, min(int(num_accepted), k))
        self._shadow_pending = False
        self._recheck_at = 0
        plain = self.verify.curve(0)
        if beside_rounds > 0 and plain is not None:
            cost = max(0.0, beside_s - beside_rounds * plain[0])
            kind = "probe" if self._drafter_open else "opening"
            getattr(self.draft, kind).add(cost)
            if self.memory is not None and self.key is not None:
                self.memory.note_probe_cost(self.key, kind, cost)
        self._drafter_open = True
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
    memory: PolicyMemory | None = None,
    key: Hashable | None = None,
    max_k: int = 16,
    drafter_estimates: bool = False,
    **kwargs,
) -> DraftLengthPolicy:
    """``num_draft_tokens`` > 0: that fixed k (capped at ``max_k``); 0: ``AdaptiveDraftLength``, or
    with ``drafter_estimates`` (the drafter estimates its own acceptance, as suffix lookup does)
    ``ConfidenceDraftLength``."""
    if num_draft_tokens < 0:
        raise ValueError("num_draft_tokens must be >= 0")
    if num_draft_tokens > 0:
        return FixedDraftLength(min(num_draft_tokens, max_k))
    if drafter_estimates:
        return ConfidenceDraftLength(max_k=max_k, forward_curve=kwargs.get("forward_curve"),
                                     co_batched=kwargs.get("co_batched", 0.0), memory=memory, key=key)
    return AdaptiveDraftLength(max_k=max_k, memory=memory, key=key, **kwargs)
