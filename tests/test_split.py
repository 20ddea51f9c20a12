"""``specdec.split``: the model of rounds across two machines, with and without draft-ahead, checked
against its own limits and against an event-by-event replay of the gateway's draft-ahead protocol."""

from __future__ import annotations

import json
import random

import pytest

from specdec import split
from specdec.cli import main as cli_main
from specdec.speedup import expected_tokens

COSTS = split.SplitCosts(verify_s=(0.020, 0.026, 0.027, 0.028, 0.029, 0.030), draft_overhead_s=0.002,
                         draft_token_s=0.0015, gateway_s=0.0005)


def test_rounds_without_draft_ahead_ask_drafter_then_verifier():
    delay = 0.005
    assert split.round_time(COSTS, 0, delay, 0.7, ahead=False) == pytest.approx(0.010 + 0.020 + 0.0005)
    assert split.round_time(COSTS, 3, delay, 0.7, ahead=False) == pytest.approx(
        (0.010 + 0.002 + 3 * 0.0015) + (0.010 + 0.028) + 0.0005)
    assert split.tokens_per_s(COSTS, 3, delay, 0.7, ahead=False) == pytest.approx(
        expected_tokens(3, 0.7) / split.round_time(COSTS, 3, delay, 0.7, ahead=False))


def test_draft_ahead_limits():
    delay, k = 0.005, 3
    no_ahead = split.round_time(COSTS, k, delay, 0.6, ahead=False)
    # Every block used and ready before the verdict: the drafter's round trip and time disappear.
    assert split.round_time(COSTS, k, delay, 1.0, ahead=True) == pytest.approx(0.010 + 0.028 + 0.0005)
    # No block ever used: the same rounds (the block was ready before the verdict: no wait either).
    assert split.round_time(COSTS, k, delay, 0.0, ahead=True) == pytest.approx(no_ahead)
    # A slow drafter's block is waited for even when it is discarded: draft-ahead can cost.
    slow = split.with_draft_speed(COSTS, 1.0)
    assert split.round_time(slow, k, delay, 0.1, ahead=True) > split.round_time(slow, k, delay, 0.1, ahead=False)


def _replayed_round_time(costs, k, delay, alpha, rounds=200_000, seed=0) -> float:
    """Mean round time from the protocol's events, one round after another: the gateway sends a verify
    request; the verdict comes back after 2 delay + V; it waits for the ahead block (the drafter began it
    on answering a proposal, delay before the gateway had that answer, or on the gateway's continue,
    sent with the verify request); a hit (all k drafts and the guessed bonus token accepted) verifies
    the block at once, a miss asks the drafter for a proposal first."""
    rng = random.Random(seed)
    block = costs.draft(k + 1)
    v, g = costs.verify(k), costs.gateway_s
    began = -delay  # when the drafter began the block in flight, relative to the verify request
    total = 0.0
    for _ in range(rounds):
        verdict = 2 * delay + v
        arrives = began + block + delay
        wait = max(0.0, arrives - verdict)
        hit = all(rng.random() < alpha for _ in range(k + 1))
        if hit:
            elapsed = verdict + wait + g
            began = delay  # begun on the continue, sent with the next verify request
        else:
            ask = 2 * delay + costs.draft(k)
            elapsed = verdict + wait + ask + g
            began = -delay
        total += elapsed
    return total / rounds


@pytest.mark.parametrize("delay, alpha, k, fraction", [(0.0, 0.7, 4, 0.05), (0.005, 0.8, 6, 0.2),
                                                        (0.020, 0.5, 2, 0.6), (0.001, 0.9, 8, 0.4)])
def test_draft_ahead_formula_matches_the_protocol_replayed(delay, alpha, k, fraction):
    costs = split.with_draft_speed(COSTS, fraction)
    replayed = _replayed_round_time(costs, k, delay, alpha)
    assert split.round_time(costs, k, delay, alpha, ahead=True) == pytest.approx(replayed, rel=0.01)


def test_predictions_and_the_acceptance_a_gain_needs():
    rows = split.predict(COSTS, 0.7, [0.0, 0.005, 0.020])
    assert [r["one_way_delay_s"] for r in rows] == [0.0, 0.005, 0.020]
    assert all(r["ahead_tokens_per_s"] >= r["noahead_tokens_per_s"] * 0.999 for r in rows)
    # Without draft-ahead a round pays two round trips and plain decoding one: at a fixed k the gain falls
    # with the delay (the best k grows with it, which can hold the best gain up).
    def gain(delay):
        return (split.tokens_per_s(COSTS, 2, delay, 0.7, ahead=False)
                / split.tokens_per_s(COSTS, 0, delay, 0.7, ahead=False))

    assert gain(0.0) > gain(0.005) > gain(0.020)
    assert rows[-1]["noahead_k"] >= rows[0]["noahead_k"]
    needed = split.acceptance_needed(COSTS, 0.005, 1.1)
    assert needed is not None and 0.0 < needed < 1.0
    k, rate = split.best_rate(COSTS, 0.005, needed, ahead=True)
    assert rate >= 1.1 * split.tokens_per_s(COSTS, 0, 0.005, needed, ahead=False)
    k, rate = split.best_rate(COSTS, 0.005, needed - 0.005, ahead=True)
    assert rate < 1.1 * split.tokens_per_s(COSTS, 0, 0.005, needed, ahead=False)


def test_costs_from_a_bench_summary_take_out_the_injected_delay(tmp_path, capsys):
    summary = {"config": {"net_delay_ms": 5.0, "net_delay_injected": True},
               "bound": {"t_verify_s": [0.035, 0.041, 0.042, 0.043], "t_draft_s": [0.0, 0.0135, 0.015, 0.0165],
                         "overhead_s": 0.0005, "t_plain_s": 0.0345, "alpha": 0.55}}
    costs, alpha = split.costs_from_bench(summary)
    assert alpha == 0.55
    assert costs.verify_s[:2] == pytest.approx((0.0345 - 0.010 - 0.0005, 0.031))
    assert (costs.draft_overhead_s, costs.draft_token_s) == pytest.approx((0.002, 0.0015))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert cli_main(["sim", "--split", "--bench", str(tmp_path), "--delays-ms", "0,5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["predictions"]) == ["0.55"] and len(out["predictions"]["0.55"]) == 2
    assert cli_main(["sim", "--split"]) == 2  # no costs given
