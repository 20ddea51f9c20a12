"""Draft-length policies on synthetic observation sequences (no models, no clock)."""

from __future__ import annotations

import random
import threading

import pytest

from specdec.policy import (
    AcceptanceEstimator,
    AcceptanceMemory,
    AdaptiveDraftLength,
    DraftCostModel,
    FixedDraftLength,
    HeuristicDraftLength,
    RoundObservation,
    VerifyCostModel,
    make_policy,
)

STEP = 0.025  # one target step, seconds
# A CPU forward over 1, 2, ... tokens: a step from one token to two, flat, then compute-bound growth of
# a step's worth per token past 13 tokens.
CPU_FORWARD = [0.056] + [0.087] * 12 + [0.087 + 0.031 * i for i in range(1, 8)]


def costs(k: int, c: float = 0.1, beta: float = 0.05, rtt: float = 0.05) -> tuple[float, float]:
    """(draft_s, verify_s) of a k round: remote drafter and verifier, linear verify cost."""
    draft = (rtt + c * k) * STEP if k > 0 else 0.0
    return draft, (rtt + 1.0 + beta * k) * STEP


def drive(policy, rounds: int, accepted, max_k: int = 16, **cost_kw) -> list[int]:
    """Run ``rounds`` rounds; ``accepted(k, i)`` says how many of k drafts round i accepts."""
    ks = []
    for i in range(rounds):
        k = policy.choose(max_k)
        assert 0 <= k <= max_k
        d, v = costs(k, **cost_kw)
        policy.observe(RoundObservation(k, accepted(k, i) if k else 0, d, v))
        ks.append(k)
    return ks


def drive_costs(policy, rounds: int, accepted, draft_s, verify_s, batch_size: int = 0) -> list[int]:
    """Like ``drive`` with the round costs as functions of k (no draft time at k = 0) and the
    verifier's reported batch size."""
    ks = []
    for i in range(rounds):
        k = policy.choose(16)
        n = accepted(k, i) if k else 0
        policy.observe(RoundObservation(k, n, draft_s(k) if k else 0.0, verify_s(k), batch_size))
        ks.append(k)
    return ks


def geometric(alpha: float, seed: int = 0):
    rng = random.Random(seed)

    def accepted(k: int, i: int) -> int:
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        return n

    return accepted


# --- the existing policies keep working --------------------------------------------------------


def test_fixed_and_heuristic_unchanged():
    assert FixedDraftLength(5).choose(3) == 3
    assert FixedDraftLength(5).choose(16) == 5
    with pytest.raises(ValueError):
        FixedDraftLength(-1)
    h = HeuristicDraftLength()
    assert h.choose(16) == 5
    h.observe(RoundObservation(5, 5, 0.0, 0.0))
    assert h.choose(16) == 7
    h.observe(RoundObservation(7, 2, 0.0, 0.0))
    assert h.choose(16) == 6
    h.observe(RoundObservation(0, 0, 0.0, 0.0))  # k = 0 rounds are ignored
    assert h.choose(16) == 6
    for _ in range(10):
        h.observe(RoundObservation(h.choose(16), 0, 0.0, 0.0))
    assert h.choose(16) == 1  # never below 1


def test_make_policy():
    assert isinstance(make_policy(4), FixedDraftLength)
    assert make_policy(40, max_k=16).choose(100) == 16  # server bound
    memory = AcceptanceMemory()
    p = make_policy(0, memory=memory, key=("model", "draft", "target"), max_k=8)
    assert isinstance(p, AdaptiveDraftLength)
    assert p.max_k == 8 and p.memory is memory
    with pytest.raises(ValueError):
        make_policy(-1)
    FixedDraftLength(3).close()  # every policy can be closed


# --- acceptance estimator ----------------------------------------------------------------------


def test_estimator_is_the_truncated_geometric_mle():
    est = AcceptanceEstimator(decay=1.0, prior_trials=0.0, change_threshold=0)
    est.update(4, 4)  # 4 successes, no failure observed
    assert est.alpha == pytest.approx(1.0)
    est.update(4, 1)  # 1 success, then a failure
    assert (est.successes, est.trials) == (5, 6)
    est.update(0, 0)  # k = 0 teaches nothing
    assert (est.successes, est.trials) == (5, 6)
    assert est.expected_tokens(2) == pytest.approx([1.0, 1 + 5 / 6, 1 + 5 / 6 + (5 / 6) ** 2])


@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.9])
def test_estimator_converges_for_any_k(alpha):
    est = AcceptanceEstimator(decay=0.999, change_threshold=0)
    draw = geometric(alpha, seed=1)
    for i in range(3000):
        k = 1 + i % 8
        est.update(k, draw(k, i))
    assert est.alpha == pytest.approx(alpha, abs=0.03)


def test_change_detection_tracks_a_drop_and_a_rise():
    est = AcceptanceEstimator()
    draw = geometric(0.9, seed=2)
    for i in range(60):
        est.update(8, draw(8, i))
    assert est.alpha > 0.8
    for i in range(4):  # acceptance collapses
        est.update(8, 0)
    assert est.alpha < 0.4 and est.changes >= 1
    for i in range(4):  # ... and comes back (rounds of k = 2, all accepted)
        est.update(2, 2)
    assert est.alpha > 0.7


# --- the adaptive policy -----------------------------------------------------------------------


def test_drops_to_zero_on_zero_acceptance():
    p = AdaptiveDraftLength()
    ks = drive(p, 60, lambda k, i: 0)
    assert ks[0] > 0  # nothing known yet: the initial k
    assert ks[-20:].count(0) >= 15  # plain decoding, apart from rare probes
    assert max(ks[-20:]) <= p.probe_k


def test_climbs_on_full_acceptance():
    p = AdaptiveDraftLength()
    ks = drive(p, 12, lambda k, i: k)
    assert ks == sorted(ks)
    assert ks[-1] == 16
    assert ks.index(16) <= 4


def test_respects_server_and_request_bounds():
    p = AdaptiveDraftLength(max_k=6)
    ks = drive(p, 20, lambda k, i: k, max_k=16)
    assert max(ks) == 6
    assert p.choose(3) <= 3  # per-request / remaining-tokens bound
    p.observe(RoundObservation(3, 3, *costs(3)))
    assert p.choose(0) == 0
    p.observe(RoundObservation(0, 0, *costs(0)))
    ks = drive(p, 5, lambda k, i: k, max_k=2)
    assert max(ks) <= 2


def test_probes_after_a_while_at_zero_with_backoff():
    p = AdaptiveDraftLength(probe_interval=4)
    ks = drive(p, 300, lambda k, i: 0)
    zero_from = next(i for i, k in enumerate(ks) if k == 0)
    probes = [i for i in range(zero_from, len(ks)) if ks[i] > 0]
    assert probes, "never probed"
    assert all(ks[i] == p.probe_k for i in probes)
    assert probes[0] - zero_from <= 4 + 1  # the first probe comes soon
    gaps = [b - a for a, b in zip([zero_from - 1] + probes, probes)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # failed probes back off ...
    assert p.probe_interval <= p.probe_interval_cap()  # ... up to the cost-derived cap
    # The cap keeps probing within the budget: extra probe cost / time between probes.
    v = p.verify.curve(1)
    extra = v[1] - v[0] + p.draft.predict(1)
    assert extra / (gaps[-1] * v[0]) <= p.probe_budget * 1.5


def test_a_plain_run_is_the_rounds_choose_would_leave_plain():
    """Two policies see the same rounds; one is asked round by round, the other takes every plain run
    it offers (``plain_run``) and is not asked during it. Their choices agree round for round, and the
    runs cover most plain rounds."""
    by_round, in_runs = AdaptiveDraftLength(probe_interval=4), AdaptiveDraftLength(probe_interval=4)
    rounds = 300
    expected = drive(by_round, rounds, lambda k, i: 0)
    ks: list[int] = []
    runs: list[int] = []
    run_left = 0
    while len(ks) < rounds:
        if run_left:
            k, run_left = 0, run_left - 1
        else:
            k = in_runs.choose(16)
            if k == 0:
                run_left = in_runs.plain_run(rounds - len(ks) - 1)
                runs += [run_left] if run_left else []
        in_runs.observe(RoundObservation(k, 0, *costs(k)))
        ks.append(k)
    assert ks == expected
    assert sum(runs) >= expected.count(0) // 2 and max(runs) >= 8, runs
    assert in_runs.plain_run(0) == 0  # nothing left to promise


def test_no_plain_run_while_drafting_or_before_anything_is_known():
    p = AdaptiveDraftLength()
    assert p.choose(16) > 0 and p.plain_run(16) == 0  # the initial k
    drive(p, 20, lambda k, i: k)
    assert p.choose(16) > 0 and p.plain_run(16) == 0  # drafting pays
    assert FixedDraftLength(3).plain_run(16) == 0


def test_notices_when_speculation_pays_again():
    p = AdaptiveDraftLength()
    drive(p, 100, lambda k, i: 0)
    assert p.choose(16) in (0, p.probe_k)
    p.observe(RoundObservation(0, 0, *costs(0)))
    ks = drive(p, 40, lambda k, i: k)  # acceptance is back
    first = next(i for i, k in enumerate(ks) if k > p.probe_k)
    assert first <= p.probe_interval_cap() + 4
    assert ks[-1] >= 12


def drive_with_shadow_probes(policy, rounds: int, accepted, delay: int = 2,
                             timed: bool = False) -> tuple[list[int], list[int]]:
    """Like ``drive``, with probes run as the engine runs them for greedy requests: beside a k = 0
    round, their outcome ``delay`` rounds later (with ``timed``, also the drafter's time for them,
    as ``costs`` has it). Returns (k verified per round, rounds that started a shadow probe)."""
    ks, started, pending = [], [], None
    for i in range(rounds):
        k = policy.choose(16)
        if k > 0 and policy.probing:
            assert pending is None, "a second probe while one is in flight"
            policy.start_shadow_probe()
            pending, k = (i + delay, k, accepted(k, i), costs(k)[0] if timed else None), 0
            started.append(i)
        d, v = costs(k)
        policy.observe(RoundObservation(k, accepted(k, i) if k else 0, d, v))
        if pending is not None and pending[0] == i:
            policy.observe_shadow(pending[1], pending[2], draft_s=pending[3])
            pending = None
        ks.append(k)
    return ks, started


def test_shadow_probes_back_off_and_never_verify_drafts_that_do_not_pay():
    p = AdaptiveDraftLength(probe_interval=4)
    ks, started = drive_with_shadow_probes(p, 300, lambda k, i: 0)
    zero_from = next(i for i, k in enumerate(ks) if k == 0)
    assert all(k == 0 for k in ks[zero_from:])  # every probe ran in the shadow
    probes = [i for i in started if i >= zero_from]
    assert len(probes) >= 4
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # failed probes back off as blocking ones do
    assert p.acceptance.alpha < 0.1  # ... and their outcomes reached the estimate


def test_shadow_probes_notice_when_speculation_pays_again():
    p = AdaptiveDraftLength()
    drive_with_shadow_probes(p, 100, lambda k, i: 0)
    ks, _ = drive_with_shadow_probes(p, 60, lambda k, i: k)  # acceptance is back
    first = next(i for i, k in enumerate(ks) if k > p.probe_k)
    assert first <= p.probe_interval_cap() + 12
    assert ks[-1] >= 12


def test_shadow_probes_replace_a_stale_catch_up_cost():
    """Until rounds draft, the draft cost stands in from a catch-up: here the session's first round,
    whose drafter call also prefilled the whole prompt (20 steps for 4 drafts). The probes that then
    run in the shadow time the drafter as well, so that figure does not keep k = 0 winning once
    acceptance is high; untimed probes (as before) leave it in place for good."""

    def run(timed: bool) -> list[int]:
        p = AdaptiveDraftLength(probe_interval=4)
        k = p.choose(16)
        assert k == p.initial_k  # nothing known: the first round drafts
        p.observe(RoundObservation(k, k, 20.0 * STEP, costs(k)[1]))
        ks, started = drive_with_shadow_probes(p, 80, lambda k, i: k, timed=timed)
        assert started  # probes ran either way
        return ks

    assert all(k == 0 for k in run(timed=False))
    ks = run(timed=True)
    assert max(ks) >= 4 and min(ks[-20:]) >= 1


def test_no_speculation_when_drafting_is_too_expensive():
    # alpha 0.5 with a draft token costing as much as a target step: k = 0 wins.
    p = AdaptiveDraftLength()
    ks = drive(p, 80, geometric(0.5), c=1.0)
    assert ks[-30:].count(0) >= 25
    # ... but with cheap drafts the same acceptance pays.
    p = AdaptiveDraftLength()
    ks = drive(p, 80, geometric(0.5), c=0.02)
    assert min(ks[-30:]) >= 1


def test_high_round_trip_favours_longer_drafts():
    cheap = drive(AdaptiveDraftLength(), 80, geometric(0.8, 3), rtt=0.0)
    slow = drive(AdaptiveDraftLength(), 80, geometric(0.8, 3), rtt=1.0)
    assert sum(slow[-40:]) > sum(cheap[-40:])


def test_measures_k0_on_a_close_call_instead_of_extrapolating():
    """Verifying any draft costs a step more than verifying none (a step-shaped curve), and drafting
    looks worth it only while k = 0's cost is extrapolated from drafting rounds (flat there). The
    policy measures k = 0 and settles on it."""
    ks = drive_costs(AdaptiveDraftLength(), 80, geometric(0.35, 2),
                     draft_s=lambda k: 0.004 + 0.003 * k, verify_s=lambda k: 0.040 if k == 0 else 0.058)
    assert 0 in ks[:24]  # measured early
    assert ks[-30:].count(0) >= 20, ks[-30:]  # (accepted probes come back quickly)


def test_shorter_drafts_when_the_verifier_batch_is_shared():
    """Goodput under load: with 7 other sessions in each verify pass, a draft token's pass cost is paid
    by all 8, so a draft that pays alone (steep CPU-like verify curve, α 0.7) no longer does."""

    def run(batch_size: int) -> list[int]:
        # This session's view: its own drafts lengthen the pass by 0.15 step each.
        return drive_costs(AdaptiveDraftLength(), 120, geometric(0.7, 5), draft_s=lambda k: 0.02 * k * STEP,
                           verify_s=lambda k: (1.0 + 0.15 * k) * STEP, batch_size=batch_size)

    alone, shared = run(1), run(8)
    assert sum(alone[-40:]) / 40 >= 2  # (exploration moves k by one now and then)
    # k = 0, apart from one-token probes (accepted probes keep the probe interval short).
    assert max(shared[-40:]) <= 1 and shared[-40:].count(0) >= 20, shared[-40:]
    assert sum(shared[-40:]) <= 0.25 * sum(alone[-40:])
    assert run(0)[-40:] == alone[-40:]  # a verifier that reports no batch size: as alone


def test_warm_start_from_memory_changes_the_first_choice():
    memory = AcceptanceMemory()
    key = AcceptanceMemory.make_key("draft_model", "tiny-draft", "target")
    cold = AdaptiveDraftLength(memory=memory, key=key)
    assert not cold.warm_started
    assert cold.choose(16) == cold.initial_k
    drive(cold, 30, lambda k, i: k)
    cold.close()
    cold.close()  # idempotent
    assert memory.get(key).sessions == 1
    assert memory.get(key).alpha > 0.9

    warm = memory.create(key)
    assert warm.warm_started
    assert warm.choose(16) >= 12  # knows drafting pays and costs are known

    other = AcceptanceMemory.make_key("ngram", "", "target")
    bad = AdaptiveDraftLength(memory=memory, key=other)
    drive(bad, 40, lambda k, i: 0)
    bad.close()
    assert memory.create(other).choose(16) == 0  # recent sessions say: do not draft
    assert memory.create(key).choose(16) >= 12  # keys do not mix
    assert len(memory) == 2 and set(memory.summary()) == {str(key), str(other)}


def test_expects_to_draft_previews_the_first_choice_without_side_effects():
    """The gateway asks before prefill whether to open the drafter session at once."""
    assert FixedDraftLength(3).expects_to_draft() and not FixedDraftLength(0).expects_to_draft()
    assert HeuristicDraftLength().expects_to_draft()
    memory = AcceptanceMemory()
    good, bad = (AcceptanceMemory.make_key(m, "draft", "target") for m in ("draft_model", "ngram"))
    assert AdaptiveDraftLength(memory=memory, key=good).expects_to_draft()  # nothing known: initial k
    for key, accepted in ((good, lambda k, i: k), (bad, lambda k, i: 0)):
        policy = memory.create(key)
        drive(policy, 40, accepted)
        policy.close()
    assert memory.create(good).expects_to_draft()
    assert not memory.create(bad).expects_to_draft()

    # Asking changes nothing: the same choices (probes included) as a policy never asked.
    asked, plain = memory.create(bad), memory.create(bad)
    ks_asked = []
    for i in range(40):
        asked.expects_to_draft()
        ks_asked.append(asked.choose(16))
        asked.observe(RoundObservation(ks_asked[-1], 0, *costs(ks_asked[-1])))
    assert ks_asked == drive(plain, 40, lambda k, i: 0)
    assert asked.probes == plain.probes > 0


def test_memory_is_thread_safe_and_bounded():
    memory = AcceptanceMemory(max_entries=4)

    def worker(j: int) -> None:
        for i in range(20):
            p = memory.create(("m", str(j % 6), "t"))
            drive(p, 5, lambda k, r: k)
            p.close()

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(memory) == 4
    assert sum(memory.get(("m", str(j), "t")).sessions for j in range(6) if memory.get(("m", str(j), "t"))) <= 120


def test_decisions_are_deterministic():
    def run():
        p = AdaptiveDraftLength()
        return drive(p, 200, geometric(0.6, seed=7))

    assert run() == run()


# --- cost models -------------------------------------------------------------------------------


def test_verify_curve_interpolates_and_extrapolates_linear_costs():
    m = VerifyCostModel()
    for _ in range(10):
        m.update(2, 1.1)
        m.update(8, 1.4)
    curve = m.curve(12)
    assert curve[2] == pytest.approx(1.1)
    assert curve[8] == pytest.approx(1.4)
    assert curve[5] == pytest.approx(1.25)  # between seen k
    assert curve[12] == pytest.approx(1.6)  # beyond: the fitted slope
    assert curve[0] == pytest.approx(1.0)


def test_verify_curve_is_monotone_and_keeps_a_measured_step():
    m = VerifyCostModel()
    for _ in range(20):
        for k in range(0, 11):
            m.update(k, 1.0 if k < 6 else 1.5)  # flat, then one step (a kernel tile)
    m.update(3, 0.5)  # one outlier cannot make k = 3 cheaper than k = 2
    curve = m.curve(12)
    assert all(b >= a - 1e-12 for a, b in zip(curve, curve[1:]))
    assert curve[5] == pytest.approx(1.0, abs=0.05)
    assert curve[6] == pytest.approx(1.5, abs=0.05)
    assert curve[12] == pytest.approx(1.5, abs=0.4)


def test_verify_curve_single_point_uses_the_prior_slope():
    m = VerifyCostModel(prior_slope=0.05)
    assert m.curve(4) is None
    m.update(4, 1.2)
    curve = m.curve(8)
    assert curve[4] == pytest.approx(1.2)
    assert curve[0] < curve[4] < curve[8]
    assert curve[0] == pytest.approx(1.0, rel=0.02)


def test_forward_curve_gives_the_verify_curve_its_shape():
    # The verifier timed its forward: +6 ms for a second token, a step at 4 tokens.
    forward = [0.050, 0.056, 0.058, 0.080, 0.082]
    m = VerifyCostModel(forward_curve=forward)
    for _ in range(30):
        m.update(1, 0.066)  # round trip: 10 ms on top of the forward
    for _ in range(2):
        m.update(0, 0.070)  # two unlucky plain rounds
    curve = m.curve(6)
    # Without the forward curve the noisy k = 0 pools with k = 1 and a draft token looks free.
    plain = VerifyCostModel()
    for _ in range(30):
        plain.update(1, 0.066)
    for _ in range(2):
        plain.update(0, 0.070)
    assert plain.curve(1)[1] - plain.curve(1)[0] < 0.001
    assert curve[1] - curve[0] == pytest.approx(0.006, abs=0.001)
    assert curve[3] - curve[2] == pytest.approx(0.022, abs=0.002)  # the measured step, never seen in a round
    assert curve[1] == pytest.approx(0.066, abs=0.002)
    # Past the timed sizes: the last half's slope.
    assert curve[6] > curve[4]


def test_sessions_sharing_passes_draft_where_all_drafting_pays(monkeypatch):
    """On a CPU-like curve (one token 100 ms, two 150 ms, then +2 ms per token), sessions among 8 that
    each verify 5 tokens pay ~2 ms per draft token, not the one-to-two-token step. At α 0.7 they
    draft. A session judging alone, reading the curve at its own k, charged the step to itself and,
    as the others' delay, seven times more: k = 0. Reading it past the others' rows (the pass's
    reported tokens minus its own) already fixes that here; the shared-pass model (as if all drafted
    the same k) is what also holds when the others do not draft yet."""

    def forward(tokens: float) -> float:
        return 0.100 if tokens <= 1 else 0.150 + 0.002 * (tokens - 2)

    curve = [forward(n) for n in range(1, 18)]
    others = 7 * 5  # seven sessions verifying 4 drafts each

    def run(**config) -> list[int]:
        policy = AdaptiveDraftLength(forward_curve=curve, co_batched=7, **config)
        accepted, ks = geometric(0.7, 3), []
        for i in range(150):
            k = policy.choose(16)
            n = accepted(k, i) if k else 0
            policy.observe(RoundObservation(k, n, 0.002 * k + (0.001 if k else 0.0), forward(others + k + 1),
                                            batch_size=8, batch_tokens=others + k + 1))
            ks.append(k)
        return ks

    shared = run()
    assert sum(shared[-50:]) / 50 >= 3, shared[-50:]
    alone_past_others = run(shared_pass_sessions=1e9)
    assert sum(alone_past_others[-50:]) / 50 >= 3, alone_past_others[-50:]
    monkeypatch.setattr(VerifyCostModel, "set_other_rows", lambda self, rows: None)  # the curve read at the own k
    own_k = run(shared_pass_sessions=1e9)
    assert own_k[-50:].count(0) >= 40, own_k[-50:]


def test_sessions_of_a_batch_that_does_not_draft_yet_start_drafting_together():
    """The 8-stream case measured on a 1B target: every session at k = 0, so a session that drafts
    alone comes back from its drafter after the others' pass and waits for a pass of its own (its
    rounds measured 190 ms at k = 0, 272 ms at k = 2). Judged alone, drafting never paid; judged as
    all sessions drafting the same k over the verifier's curve, it does at α 0.7."""
    curve = [0.100] + [0.150] * 7 + [0.150 + 0.01 * i for i in range(1, 10)]  # steps at 1 -> 2, grows past 8

    def verify_s(k: int) -> float:  # the others stay at k = 0: a drafting session misses their pass
        return 0.160 if k == 0 else 0.160 + 0.080 + 0.010 * k

    def run(**config) -> list[int]:
        policy = AdaptiveDraftLength(forward_curve=curve, co_batched=3, **config)
        accepted, ks = geometric(0.7, 4), []
        for i in range(200):
            k = policy.choose(16)
            policy.observe(RoundObservation(k, accepted(k, i) if k else 0, 0.008 * k + 0.002 if k else 0.0,
                                            verify_s(k), batch_size=4 if k == 0 else 1,
                                            batch_tokens=4 if k == 0 else k + 1))
            ks.append(k)
        return ks

    together = run()
    assert sum(1 for k in together[-100:] if k >= 2) >= 80, together[-100:]
    alone = run(shared_pass_sessions=1e9)
    assert alone[-100:].count(0) >= 70, alone[-100:]


def test_forward_curve_keeps_a_weak_draft_off():
    """A draft accepting 15 % per token on a verifier whose k = 0 rounds happened to be slow:
    with the measured forward curve the policy settles on plain decoding (probes aside)."""
    forward = [0.050, 0.056, 0.062, 0.068, 0.074]

    def verify_s(k):  # what the loop sees: forward + 10 ms round trip, k = 0 rounds unlucky (+8 ms)
        return forward[min(k, 4)] + 0.010 + (0.008 if k == 0 else 0.0)

    def run(curve):
        return drive_costs(AdaptiveDraftLength(forward_curve=curve), 200, geometric(0.15, 1),
                           draft_s=lambda k: 0.004 + 0.002 * k, verify_s=verify_s)

    with_curve, without = run(forward), run(None)
    assert with_curve[-100:].count(0) >= 70, with_curve[-100:]
    assert without[-100:].count(0) < with_curve[-100:].count(0)


def test_probes_back_off_further_when_they_lengthen_a_shared_pass():
    """A probe's extra verify time is paid by every session in its pass: with 7 co-batched sessions
    the probe interval may grow further than alone (same acceptance, same costs)."""
    caps = {}
    for batch in (1, 8):
        p = AdaptiveDraftLength()
        drive_costs(p, 60, lambda k, i: 0, draft_s=lambda k: 0.004 + 0.002 * k,
                    verify_s=lambda k: 0.100 + 0.010 * k, batch_size=batch)
        caps[batch] = p.probe_interval_cap()
    assert caps[8] > 2 * caps[1], caps


def test_probes_skipped_where_not_even_a_high_acceptance_would_pay():
    """On a CPU verifier the forward steps up from one token to two (56 -> 87 ms here, the embedded
    target's under the hf runtime), stays flat, and past ~13 tokens grows by a step's worth per token
    (compute-bound). Alone, a draft costs the step once, so deep drafts could pay at a high
    acceptance and probes go on. Under load, with 13 others in the pass, the pass is on the steep
    part: every draft token of every session costs 31 ms, and drafting loses even at the upper bound
    of the acceptance, so probing (which costs drafter and verifier time) stops; when the load goes,
    probing comes back."""
    forward = CPU_FORWARD

    def fwd(index: int) -> float:
        return forward[min(index, len(forward) - 1)]

    accepted = geometric(0.3, 2)

    def run(p, rounds: int, batch: int) -> list[int]:
        """Rounds with shadow probes (outcome a round later); the rounds that started one."""
        started, pending = [], None
        for i in range(rounds):
            k = p.choose(16)
            if k > 0 and p.probing:
                p.start_shadow_probe()
                pending, k = (k, accepted(k, i)), 0
                started.append(i)
            others = batch - 1  # one token each
            verify_s = (0.200 if batch > 1 else 0.060) + fwd(others + k) - fwd(others)
            p.observe(RoundObservation(k, accepted(k, i) if k else 0, 0.003 * k, verify_s, batch))
            if pending is not None and i - started[-1] >= 1:
                p.observe_shadow(*pending, draft_s=0.003 * pending[0])
                pending = None
        return started

    loaded = AdaptiveDraftLength(forward_curve=forward)
    first = run(loaded, 300, batch=14)
    # 14 sessions drafting even one token each put 28 tokens in the pass: not even acceptance 1 pays
    # for that, so no probe is worth its cost (before the shared-pass model: a few, while the
    # acceptance estimate was loose).
    assert all(i < 200 for i in first), first
    # Once settled, a skipped probe is asked again at each evaluation (every k0_recheck_every rounds).
    assert loaded.probes_skipped > 100 // loaded.config.k0_recheck_every
    alone = AdaptiveDraftLength(forward_curve=forward)
    assert len([i for i in run(alone, 300, batch=1) if i >= 200]) >= 2  # same acceptance: probes go on
    assert alone.probes_skipped == 0
    assert run(loaded, 150, batch=1), "the load went and probing did not come back"


def test_a_session_joining_a_loaded_verifier_starts_from_its_load():
    """The memory holds a pair that pays alone (acceptance 0.7, the CPU forward curve). A new
    session told that 13 others share the verifier (its tokens then sit on the curve's steep part)
    expects plain decoding from its first round (so the gateway does not open its drafter at prefill
    either); told nothing, it drafts."""
    forward = CPU_FORWARD
    memory = AcceptanceMemory()
    key = AcceptanceMemory.make_key("model", "draft", "target")
    first = memory.create(key, forward_curve=forward)
    drive_costs(first, 60, geometric(0.7, 3), draft_s=lambda k: 0.002 + 0.001 * k,
                verify_s=lambda k: 0.062 + forward[min(k, 8)] - forward[0])
    first.close()
    alone = memory.create(key, forward_curve=forward)
    assert alone.expects_to_draft() and alone.choose(16) > 0
    loaded = memory.create(key, forward_curve=forward, co_batched=13)
    assert not loaded.expects_to_draft() and loaded.choose(16) == 0


def test_verify_curve_shrinks_rare_k_towards_the_line():
    m = VerifyCostModel()
    for _ in range(30):
        m.update(4, 1.2)
        m.update(8, 1.4)
    m.update(6, 2.0)  # a single unlucky measurement
    assert m.curve(8)[6] < 1.65  # mostly the line (1.3), not the outlier


def test_draft_cost_split_into_overhead_and_per_token():
    m = DraftCostModel()
    assert m.coefficients() is None
    m.note_catch_up(4, 9.0)  # drafter catching up: only a fallback
    assert m.coefficients() == (0.0, 9.0 / 4)
    for k in (2, 6, 4, 8) * 5:
        m.update(k, 0.5 + 0.1 * k)
    overhead, per_token = m.coefficients()
    assert overhead == pytest.approx(0.5)
    assert per_token == pytest.approx(0.1)
    assert m.predict(0) == 0.0


def test_policy_learns_costs_from_observations():
    p = AdaptiveDraftLength()
    drive(p, 60, geometric(0.7, 5), rtt=0.2)
    est = p.estimates()
    assert est["draft_per_token_s"] == pytest.approx(0.1 * STEP, rel=0.15)
    assert est["draft_overhead_s"] == pytest.approx(0.2 * STEP, rel=0.3)
    v = est["verify_s"]
    assert v[4] == pytest.approx((0.2 + 1.0 + 0.05 * 4) * STEP, rel=0.03)


# --- in the real loop --------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
class _TickClock:
    """``time.perf_counter`` for the engine that advances one millisecond per reading: the round costs
    the policy sees become a function of the code path alone, so its decisions repeat run after run
    (the tiny models' real timings are noise, and the policy's probing depends on them)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


def test_adaptive_policy_in_the_engine_keeps_output_exact(tiny_target, monkeypatch):
    import types

    import specdec.engine
    from specdec.drafting import ScriptedDrafter
    from specdec.engine import collect, run_sync
    from specdec.local import LocalEngine
    from specdec.wire_types import DraftProposal, SamplingParams

    ids = tiny_target.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    plain = run_sync(collect(LocalEngine(tiny_target).stream(ids, params)))
    truth = ids + plain.token_ids
    vocab = tiny_target.vocab_size

    def right(tokens, k, p):
        return DraftProposal(truth[len(tokens) : len(tokens) + k], None)

    def wrong(tokens, k, p):
        return DraftProposal([(truth[len(tokens) + j] + 1) % vocab for j in range(k)], None)

    memory = AcceptanceMemory()
    monkeypatch.setattr(specdec.engine, "time", types.SimpleNamespace(perf_counter=_TickClock().perf_counter))
    for script, name in ((right, "right"), (wrong, "wrong")):
        key = AcceptanceMemory.make_key("scripted", name, "tiny")
        for _ in range(2):  # the second session starts from the first one's memory
            policy = make_policy(0, memory=memory, key=key, max_k=16)
            engine = LocalEngine(tiny_target, ScriptedDrafter(script))
            try:
                result = run_sync(collect(engine.stream(ids, params, policy=policy)))
            finally:
                policy.close()
            assert result.token_ids == plain.token_ids  # k never changes the output
            history = result.stats.k_history
            assert all(0 <= k <= 16 for k in history)
        if name == "right":
            assert max(history) >= 8 and result.stats.acceptance_rate == 1.0
        else:
            assert result.stats.accepted_tokens == 0
            assert history[0] == 0, history  # the second session starts from the memory: no draft to begin with
    assert memory.get(AcceptanceMemory.make_key("scripted", "right", "tiny")).alpha > 0.9
    # From the 0.6 prior to the wrong drafter's probes: every one failed (with the tick clock, 0.117 every run).
    assert memory.get(AcceptanceMemory.make_key("scripted", "wrong", "tiny")).alpha < 0.15


def test_shadow_probes_stop_where_their_measured_cost_outweighs_what_they_could_gain():
    """Each shadow probe's cost is measured as what the plain rounds beside it cost beyond plain rounds.
    With the drafter on the verifier's machine its catch-up slows those rounds: probes back off as far
    as that cost says, the slowed rounds do not pass for plain ones, and a probe that could not repay
    its cost even if drafting paid at its best for the rest of the request is skipped (settled at
    k = 0). With the drafter elsewhere (no slowdown) the same session probes far more often. The next
    session starts from the memory's measured costs."""
    forward = [0.010, 0.014, 0.018, 0.022, 0.026, 0.030]  # a draft token costs 40 % of a step
    accepted = geometric(0.35, 3)

    def run(p, rounds: int, beside_extra_s: float) -> tuple[list[int], list[float]]:
        """A request of ``rounds`` tokens with shadow probes answered a round later; the rounds that
        started one, and the plain round's cost the policy has learned after each round."""
        started, learned, probe = [], [], None
        for i in range(rounds):
            k = p.choose(rounds - i - 1)
            if k > 0 and p.probing:
                p.start_shadow_probe()
                probe, k = [k, accepted(k, i), 0.0, 0], 0
                started.append(i)
            beside = probe is not None and k == 0
            verify_s = 0.012 + 0.004 * k + (beside_extra_s if beside else 0.0)
            if beside:
                probe[2] += verify_s
                probe[3] += 1
            p.observe(RoundObservation(k, accepted(k, i), 0.002 * k, verify_s, 1, k + 1, beside))
            if probe is not None and i - started[-1] >= 1:
                p.observe_shadow(probe[0], probe[1], draft_s=0.002, beside_s=probe[2], beside_rounds=probe[3])
                probe = None
            learned.append(p.verify.curve(0)[0])
        return started, learned

    memory = AcceptanceMemory()
    key = ("model", "draft", "target")
    shared = AdaptiveDraftLength(forward_curve=forward, memory=memory, key=key)
    probes, learned = run(shared, 600, beside_extra_s=0.060)  # a probe: two rounds at +60 ms
    apart = AdaptiveDraftLength(forward_curve=forward)
    probes_apart, _ = run(apart, 600, beside_extra_s=0.0)
    assert 0 < 2 * len(probes) < len(probes_apart), (probes, probes_apart)
    assert max(learned[50:]) < 0.0125  # the slowed rounds are the probes' cost, not the plain round's
    assert shared.draft.probe.value == pytest.approx(0.120, rel=0.05)
    shared.close()
    # The next sessions on this deployment start from what probes cost. A request of 60 tokens: the
    # first opens the drafter's session with its first probe (that cost unmeasured yet), then could
    # not repay another; the one after it does not open the drafter at all.
    for opening_probes in (1, 0):
        short = AdaptiveDraftLength(forward_curve=forward, memory=memory, key=key)
        assert short._probe_cost(opening=False) == pytest.approx(0.120, rel=0.05)
        probes_short, _ = run(short, 60, beside_extra_s=0.060)
        assert len(probes_short) == opening_probes and short.settled and short.probes_skipped > 0
        short.close()


def test_a_probe_cost_one_session_measures_reaches_the_sessions_beside_it_at_once():
    """Under load sessions start before any has closed: a shadow probe's measured cost goes into the
    shared memory as it is measured, and a session running beside reads it for its next probe."""
    memory = AcceptanceMemory()
    key = ("model", "draft", "target")
    forward = [0.010, 0.014, 0.018, 0.022, 0.026, 0.030]
    first, beside = (AdaptiveDraftLength(forward_curve=forward, memory=memory, key=key) for _ in range(2))
    for p in (first, beside):
        p.observe(RoundObservation(0, 0, 0.0, 0.012, 1, 1))
    assert beside._probe_cost(opening=True) is None  # nothing measured: a probe is worth it (it measures)
    first.start_shadow_probe()
    first.observe_shadow(1, 0, draft_s=None, beside_s=0.012 * 2 + 0.150, beside_rounds=2)  # it opened the drafter
    first.start_shadow_probe()
    first.observe_shadow(1, 0, draft_s=0.002, beside_s=0.012 * 2 + 0.030, beside_rounds=2)
    assert beside._probe_cost(opening=True) == pytest.approx(0.150)
    assert beside._probe_cost(opening=False) == pytest.approx(0.030)
    # ... and a short request beside it, where drafting rarely agrees, skips the probe that would
    # open its drafter session.
    for _ in range(20):
        beside.acceptance.update(1, 0)
    beside.zero_run = beside.probe_interval
    assert beside.choose(20) == 0 and beside.settled and beside.probes == 0
