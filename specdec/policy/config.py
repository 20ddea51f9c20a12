"""``AdaptiveConfig``: every tunable of ``AdaptiveDraftLength`` in one place.

The defaults are the values the simulation (``specdec sim``) and the benchmarks were run with;
docs/adaptive.md describes the rules they tune and the measurements behind several of them.
``AdaptiveDraftLength(config=..., **overrides)`` overrides single fields by keyword.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveConfig:
    """Tunables of the adaptive draft-length policy (one frozen value, shareable by sessions)."""

    # -- Cold start and warm start ----------------------------------------------------------

    initial_k: int = 4
    """k of the first rounds, while no verify time has been seen: a middling k that drafts, so that
    draft and verify costs get measured at all."""

    prior_alpha: float = 0.6
    """Acceptance prior when the memory has nothing: a typical rate for a matched draft model."""

    prior_trials: float = 2.0
    """Weight of that prior, in trials: two rounds of evidence already outweigh it."""

    warm_trials: float = 60.0
    """Cap on the acceptance trials a memory warm start brings: about what one window of the
    session's own rounds holds (20 rounds of ~3 trials), faded by ``alpha_decay`` as they come in."""

    warm_cost_weight: float = 4.0
    """Cap on the weight of the memory's verify means and draft-cost fit: a hint that a few of the
    session's own rounds override (the load may differ from the sessions that reported)."""

    # -- Acceptance estimate (``AcceptanceEstimator``) ----------------------------------------

    alpha_decay: float = 0.95
    """Per-round decay of the acceptance counts: a window of about 1 / (1 - 0.95) = 20 rounds."""

    change_threshold: float = 5.0
    """CUSUM threshold (log-likelihood ratio) for a fall of acceptance; crossing it restarts the
    estimate from the change point. 0 disables detection (drifting and bursty text then fall 5-6%
    below the heuristic in the simulation)."""

    up_threshold: float | None = 3.0
    """CUSUM threshold for a rise (None: ``change_threshold``). Lower than for a fall on purpose: a
    missed rise keeps the policy at k = 0 or a small k, a false fall costs only a few short rounds."""

    position_effects: bool = False
    """Model per-position conditional acceptance. Off: in the simulation it never helped, and it
    hurt bursty acceptance (deep positions' rates come from the easy spans)."""

    # -- Cost estimates (``VerifyCostModel``, ``DraftCostModel``) -----------------------------

    cost_decay: float = 0.95
    """Per-observation decay of the verify and draft cost estimates and of the co-batched sessions'
    mean: the same ~20-round window as acceptance."""

    draft_token_prior: float = 0.1
    """Draft seconds per token as a fraction of a target step (``t_verify(0)``), while no draft time
    has been seen and for the probe-interval cap when the measured extra cost is not positive: a
    draft model about a tenth of the target's size."""

    # -- Choosing k ---------------------------------------------------------------------------

    shared_pass_sessions: float = 0.5
    """With at least this many other sessions in its verify passes on average (and the verifier's
    forward curve known), a session chooses k as if every session in them drafted the same k
    (``AdaptiveDraftLength._shared_pass_rates``); below it, as a session alone."""

    draft_margin: float = 0.0
    """A k >= 1 is chosen only if its rate beats k = 0 by more than this fraction. A margin leaves
    room for costs of drafting the model cannot see per round (the drafter's catch-up after k = 0
    rounds, its CPU beside the verifier's on a shared machine). 0: a tie goes to plain decoding,
    whose cost the model knows best (probes keep acceptance measured); ties within 5% used to go
    to drafting, and with a weak draft that kept sessions drafting at a loss."""

    paid_gain: float = 1.25
    """Drafting "clearly paid" in this session once the best rate reached this multiple of
    rate(0); from then on probes get ``paid_probe_budget`` (high acceptance tends to come back)."""

    close_call: float = 1.5
    """A chosen k >= 1 whose rate is below this multiple of rate(0) is a close call: the k = 0
    refresh rounds below apply, since the choice then hinges on t_verify(0), which drafting rounds
    only extrapolate (on a CPU that extrapolation kept sessions at k = 1 at 0.63 x plain decoding)."""

    k0_measured_weight: float = 1.0
    """t_verify(0) counts as measured once k = 0's decayed weight in the verify model reaches this
    (one recent plain round)."""

    k0_refresh_every: int = 8
    """On close calls while t_verify(0) is unmeasured, every this-many-th drafting round is a k = 0
    round instead: measures it within a few rounds, at the cost of one round in eight."""

    explore_every: int = 32
    """Every this-many k > 0 rounds use a neighbouring k (k +/- 1, alternating) so that the draft
    cost's overhead / per-token split and the verify curve stay identifiable (cheap: rate(k) is flat
    near its maximum); halfway between those, a close call takes a k = 0 round. 0 disables both
    (not the exploring while the draft-cost fit lacks spread)."""

    explore_every_no_spread: int = 3
    """Explore every this-many k > 0 rounds instead while the draft-cost fit has no spread in k
    (below ``min_draft_spread``): the split is not identifiable until neighbouring k are seen."""

    min_draft_spread: float = 0.1
    """Weighted variance of the drafted k values (``DraftCostModel.spread``) below which the
    draft-cost fit counts as having no spread (0.1: almost every round drafted the same k)."""

    # -- Probing while k = 0 wins -------------------------------------------------------------

    probe_k: int = 1
    """Drafts per probe (at least 1): one token measures acceptance at the least cost."""

    probe_interval: int = 4
    """k = 0 rounds before the first probe, and the shortest interval between probes (at least 1);
    a probe with nothing accepted doubles the interval, one with acceptances halves it."""

    max_probe_interval: int = 256
    """Longest interval between probes, whatever the cost-derived cap says: even where a probe costs
    a lot, a regime change is noticed within a few hundred rounds."""

    k0_recheck_every: int = 16
    """Settled at k = 0 (this many plain rounds in a row) with no new acceptance evidence, the policy
    re-evaluates its rates only every this-many rounds (and when a probe falls due): between probes
    only the k = 0 cost moves, slowly, and the evaluation's Python runs on the cores the verifier's
    pass needs when both share a machine."""

    probe_budget: float = 0.02
    """The interval stops doubling where the probes' extra cost (to this session and the sessions
    batched with it) is this fraction of the time between them: never probing could gain at most
    2% (a probe every ~10 rounds in the simulation's "none" scenario, 0.975 x plain decoding)."""

    paid_probe_budget: float = 0.05
    """The budget once drafting clearly paid earlier in the session (``paid_gain``): acceptance that
    was high once tends to come back, as in drifting and bursty text."""
