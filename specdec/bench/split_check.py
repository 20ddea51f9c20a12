"""The split model (``specdec sim --split``, ``specdec.split``) beside a bench run's measured systems:
its prediction at the run's delay from the run's own costs, and, for each fixed-k system and the
baseline, its prediction on that system's own terms."""

from __future__ import annotations

from specdec import split
from specdec.bench.runners import FIXED_K_SYSTEM
from specdec.speedup import alpha_for_tokens


def split_prediction(summary: dict) -> dict | None:
    """``specdec sim --split``'s prediction for this run's delay from its own measured costs, to set
    beside the measured systems (None without round costs)."""
    try:
        costs, alpha = split.costs_from_bench(summary)
    except (ValueError, KeyError, TypeError):
        return None
    delay = split.injected_delay_s(summary["config"])
    return {"alpha": alpha, "one_way_delay_s": delay, **split.predict(costs, alpha, [delay])[0],
            "fixed_k": fixed_k_predictions(summary, costs, delay)}


def fixed_k_predictions(summary: dict, costs, delay: float) -> dict:
    """The split model's tokens/s for each measured fixed-k system (spec-k=N, spec-k=N-ahead,
    spec-k=N-noahead) and the baseline beside its measured steady rate (after the first token: the
    model leaves prefill out): the model's timing checked on its own terms. Its acceptance is the one
    that gives the measured tokens per round at that k (from the run of the same k without
    draft-ahead where there is one: an ahead round's count is the same rounds')."""
    systems = summary.get("systems") or {}
    out = {}
    for name, system in systems.items():
        m = FIXED_K_SYSTEM.fullmatch(name)
        if not m or not system.get("steady_tokens_per_s"):
            continue
        k = int(m.group(1))
        ahead = m.group(2) == "-ahead" if m.group(2) else bool(summary["config"].get("draft_ahead_default"))
        source = systems.get(f"spec-k={k}-noahead") or system
        if not source.get("mean_accepted_length"):
            continue
        alpha = alpha_for_tokens(k, source["mean_accepted_length"])
        predicted = split.tokens_per_s(costs, k, delay, alpha, ahead)
        out[name] = {"k": k, "ahead": ahead, "alpha": alpha, "predicted_tokens_per_s": predicted,
                     "measured_tokens_per_s": system["steady_tokens_per_s"],
                     "measured_over_predicted": system["steady_tokens_per_s"] / predicted if predicted else None}
    if (base := systems.get("baseline")) and base.get("steady_tokens_per_s"):
        predicted = split.tokens_per_s(costs, 0, delay, 0.0, False)
        out["baseline"] = {"k": 0, "ahead": False, "alpha": None, "predicted_tokens_per_s": predicted,
                           "measured_tokens_per_s": base["steady_tokens_per_s"],
                           "measured_over_predicted": base["steady_tokens_per_s"] / predicted if predicted else None}
    return out
