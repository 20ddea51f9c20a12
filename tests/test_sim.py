"""The simulated comparison of draft-length policies (``specdec sim``)."""

from __future__ import annotations

import json

import pytest

from specdec.sim import default_scenarios, format_table, main, run_simulation

REQUIRED = {"high", "medium", "low", "none", "drifting", "bursty", "expensive_draft", "high_rtt"}
FIELDS = {
    "name",
    "adaptive_tokens_per_s",
    "heuristic_tokens_per_s",
    "k0_tokens_per_s",
    "best_fixed_k",
    "best_fixed_tokens_per_s",
}


@pytest.fixture(scope="module")
def result() -> dict:
    return run_simulation(seed=0)


@pytest.fixture(scope="module")
def scenarios(result) -> dict[str, dict]:
    return {s["name"]: s for s in result["scenarios"]}


def test_scenarios_and_fields(result, scenarios):
    assert REQUIRED <= set(scenarios)
    for s in result["scenarios"]:
        assert FIELDS <= set(s)
        assert 1 <= s["best_fixed_k"] <= 16
        fixed = {int(k): v for k, v in s["fixed_tokens_per_s"].items()}
        assert s["best_fixed_tokens_per_s"] == max(v for k, v in fixed.items() if k >= 1)
        assert s["k0_tokens_per_s"] == fixed[0]
        assert sum(s["adaptive_k_histogram"].values()) > 0
    json.dumps(result)  # plain data


@pytest.mark.parametrize("name", sorted(s.name for s in default_scenarios()))
def test_adaptive_close_to_best_fixed_and_not_worse_than_heuristic(scenarios, name):
    s = scenarios[name]
    assert s["adaptive_tokens_per_s"] >= 0.9 * s["best_fixed_tokens_per_s"]
    assert s["adaptive_tokens_per_s"] >= s["heuristic_tokens_per_s"]


@pytest.mark.parametrize("name", ["drifting", "low", "none"])
def test_adaptive_strictly_better_than_heuristic(scenarios, name):
    s = scenarios[name]
    assert s["adaptive_tokens_per_s"] > s["heuristic_tokens_per_s"]


def test_no_speculation_scenario_stays_near_plain_decoding(scenarios):
    s = scenarios["none"]
    assert s["adaptive_tokens_per_s"] >= 0.95 * s["k0_tokens_per_s"]
    hist = {int(k): v for k, v in s["adaptive_k_histogram"].items()}
    assert hist.get(0, 0) > 0.85 * sum(hist.values())  # the rest: k = 1 probes


@pytest.mark.parametrize("name", sorted(s.name for s in default_scenarios()))
def test_shadow_probes_cost_nothing_where_blocking_probes_cost_a_little(scenarios, name):
    s = scenarios[name]
    assert s["adaptive_shadow_probes_tokens_per_s"] >= 0.995 * s["adaptive_tokens_per_s"]
    if name == "none":  # probing without drafting that pays: plain decoding's speed, less the noise
        assert s["adaptive_shadow_probes_tokens_per_s"] >= 0.99 * s["k0_tokens_per_s"]
        assert s["adaptive_shadow_probes_tokens_per_s"] > s["adaptive_tokens_per_s"]


def test_sanity_of_the_synthetic_world(scenarios):
    # Speculation pays with high acceptance and long round trips, not with none.
    assert scenarios["high"]["best_fixed_tokens_per_s"] > 2 * scenarios["high"]["k0_tokens_per_s"]
    assert scenarios["none"]["best_fixed_tokens_per_s"] < scenarios["none"]["k0_tokens_per_s"]
    assert scenarios["high_rtt"]["k0_tokens_per_s"] < 0.6 * scenarios["high"]["k0_tokens_per_s"]
    assert scenarios["expensive_draft"]["best_fixed_k"] <= 3


def test_deterministic(scenarios):
    again = run_simulation(seed=0, only=["drifting", "none"])
    for s in again["scenarios"]:
        assert s == scenarios[s["name"]]


def test_cli_json_and_table(capsys, result):
    assert main(["--json", "--scenario", "none", "--requests", "2", "--tokens", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in out["scenarios"]] == ["none"]
    assert main(["--scenario", "high", "--requests", "2", "--tokens", "64"]) == 0
    assert "high" in capsys.readouterr().out
    assert "drifting" in format_table(result)
