"""The metrics of ``specdec bench``: per-request records, latency distributions (TTFT, TPOT, ITL per
token), throughput, speculation figures per system and category, and the speedups between systems."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.bench.breakdown import round_breakdown
from specdec.bench.runners import LLAMACPP
from specdec.speedup import conditional_alphas

# Per-position acceptance feeds the bound only where that position was drafted this often; deeper
# positions use the pooled per-token alpha (deep positions are drafted mostly in easy stretches).
MIN_POSITION_DRAFTS = 20


@dataclass
class RequestRecord:
    system: str
    conversation_id: str
    category: str
    source: str
    turn: int
    start_s: float  # since the system's run began
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    chunk_offsets_s: list[float] = field(default_factory=list)  # each chunk's arrival since start
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    stats: dict | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the output (gateway and in-process systems)
    prompt_token_ids: list[int] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict:
    values = [float(v) for v in values if v is not None]
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def tpot(latency_s: float, ttft_s: float, num_tokens: int) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (num_tokens - 1)."""
    if num_tokens < 2 or latency_s is None or ttft_s is None:
        return None
    return (latency_s - ttft_s) / (num_tokens - 1)


def itl_per_token(chunk_offsets_s: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Inter-token latencies counted per token: a chunk of n tokens arriving g after the previous
    chunk contributes n samples of g / n. The first chunk's tokens belong to TTFT."""
    samples: list[float] = []
    for i in range(1, len(chunk_offsets_s)):
        n = chunk_tokens[i]
        if n <= 0:
            continue
        gap = chunk_offsets_s[i] - chunk_offsets_s[i - 1]
        samples.extend([gap / n] * n)
    return samples


def position_counts(stats: dict) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per draft position for one request, rebuilt from its final stats.

    Position i was drafted in every round whose k exceeded i (``k_history`` holds the drafted
    lengths); ``per_position_acceptance[i]`` is accepted_i / drafted_i.
    """
    ks = [int(k) for k in stats.get("k_history") or []]
    rates = list(stats.get("per_position_acceptance") or [])
    width = max(ks, default=0)
    drafted = [sum(1 for k in ks if k > i) for i in range(width)]
    accepted = [int(round((rates[i] if i < len(rates) else 0.0) * drafted[i])) for i in range(width)]
    return drafted, accepted


def merge_position_counts(stats_list: Sequence[dict]) -> tuple[list[int], list[int]]:
    drafted: list[int] = []
    accepted: list[int] = []
    for stats in stats_list:
        d, a = position_counts(stats)
        for i in range(len(d)):
            if i >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d[i]
            accepted[i] += a[i]
    return drafted, accepted


def output_tokens_per_s(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Output tokens of the completed requests over the wall time that ran them (a system's
    ``tokens_per_s``, and each interleaved round's)."""
    tokens = sum(r.output_tokens for r in records if r.error is None)
    return tokens / duration_s if duration_s > 0 else 0.0


def steady_tokens_per_s(records: Sequence[RequestRecord]) -> float | None:
    """Tokens after each request's first over the time after its first token, summed over requests."""
    pairs = [(r.output_tokens - 1, r.latency_s - r.ttft_s) for r in records
             if r.ttft_s is not None and r.output_tokens > 1 and r.latency_s > r.ttft_s]
    seconds = sum(s for _, s in pairs)
    return sum(n for n, _ in pairs) / seconds if seconds > 0 else None


def summarize_records(records: Sequence[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for r in ok if (t := tpot(r.latency_s, r.ttft_s, r.output_tokens)) is not None]
    itls = [x for r in ok for x in itl_per_token(r.chunk_offsets_s, r.chunk_tokens)]
    latencies = [r.latency_s for r in ok]
    out = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "output_tokens": tokens,
        "duration_s": duration_s,
        "tokens_per_s": output_tokens_per_s(ok, duration_s),
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        # Per request: tokens over its own latency (unaffected by queueing between requests).
        "decode_tokens_per_s": tokens / sum(latencies) if latencies and sum(latencies) > 0 else 0.0,
        # After the first token (prefill and TTFT excluded): the steady rate a round model predicts.
        "steady_tokens_per_s": steady_tokens_per_s(ok),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("latency", latencies)):
        for stat, value in distribution(values).items():
            out[f"{name}_{stat}_s"] = value
    stats = [r.stats for r in ok if r.stats]
    out["round_breakdown"] = round_breakdown(stats)
    if stats and any(s.get("draft_method", "none") != "none" or s.get("draft_tokens") for s in stats):
        drafted = sum(int(s.get("draft_tokens", 0)) for s in stats)
        accepted = sum(int(s.get("accepted_tokens", 0)) for s in stats)
        rounds = sum(int(s.get("rounds", 0)) for s in stats)
        emitted = sum(float(s.get("mean_accepted_length", 0.0)) * int(s.get("rounds", 0)) for s in stats)
        pos_drafted, pos_accepted = merge_position_counts(stats)
        ks = [int(k) for s in stats for k in s.get("k_history") or []]
        methods = Counter(str(s.get("draft_method")) for s in stats)  # auto may choose per request
        out.update({
            "draft_method": methods.most_common(1)[0][0],
            "draft_method_counts": dict(methods),
            "rounds": rounds,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": emitted / rounds if rounds else 0.0,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(pos_accepted, pos_drafted)],
            "per_position_drafted": pos_drafted,
            "k_mean": sum(ks) / len(ks) if ks else 0.0,
            "k_counts": {str(k): ks.count(k) for k in sorted(set(ks))},
            "draft_s": sum(float(s.get("draft_s", 0.0)) for s in stats),
            "verify_s": sum(float(s.get("verify_s", 0.0)) for s in stats),
            "ahead_blocks": sum(int(s.get("ahead_blocks", 0)) for s in stats),
            "ahead_hits": sum(int(s.get("ahead_hits", 0)) for s in stats),
            "shadow_probes": sum(int(s.get("shadow_probes", 0)) for s in stats),
            "shadow_accepted": sum(int(s.get("shadow_accepted", 0)) for s in stats),
        })
    else:
        out.update({"acceptance_rate": None, "mean_accepted_length": None})
    batched = [s for s in stats if s.get("mean_batch_size")]
    if batched:  # the verifier's batching across sessions, weighted by rounds
        rounds = sum(max(1, int(s.get("rounds", 0))) for s in batched)
        out["mean_batch_size"] = sum(float(s["mean_batch_size"]) * max(1, int(s.get("rounds", 0))) for s in batched) / rounds
        out["verify_queue_wait_s"] = sum(float(s.get("verify_queue_wait_s", 0.0)) for s in batched)
    return out


def summarize_by_category(records: Sequence[RequestRecord]) -> dict:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.category].append(r)
    out = {}
    for category, rs in sorted(groups.items()):
        s = summarize_records(rs, sum(r.latency_s or 0.0 for r in rs))
        out[category] = {key: s[key] for key in (
            "requests", "errors", "output_tokens", "tokens_per_s", "ttft_p50_s", "tpot_p50_s",
            "latency_p50_s", "acceptance_rate", "mean_accepted_length")}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def spec_reference(summaries: dict) -> str | None:
    """The speculative system whose acceptance and round costs feed the bound: spec, else inprocess,
    else a spec-k=N, else one without draft-ahead (spec-k=N-noahead, spec-noahead), else one with it
    (whose drafter's time is partly hidden behind the verifier's)."""
    for name in ("spec", "inprocess"):
        if name in summaries:
            return name
    for suffix in ("", "-noahead", "-ahead"):
        fixed = next((n for n in summaries if n.startswith("spec-k=") and n.endswith(suffix)
                      and n.count("-") == 1 + bool(suffix)), None)
        if fixed:
            return fixed
        if suffix and f"spec{suffix}" in summaries:
            return f"spec{suffix}"
    return None


def compute_speedups(summaries: dict) -> dict:
    def tps(name):
        s = summaries.get(name)
        return s["tokens_per_s"] if s and s.get("completed") else None

    out = {
        "spec_vs_baseline": ratio(tps("spec"), tps("baseline")),
        "spec_vs_hf": ratio(tps("spec"), tps("hf")),
        "spec_vs_hf_assisted": ratio(tps("spec"), tps("hf-assisted")),
        "spec_vs_inprocess": ratio(tps("spec"), tps("inprocess")),
        "inprocess_vs_baseline": ratio(tps("inprocess"), tps("baseline")),
        "inprocess_vs_hf": ratio(tps("inprocess"), tps("hf")),
        "hf_assisted_vs_hf": ratio(tps("hf-assisted"), tps("hf")),
    }
    for name in summaries:
        if name.startswith("spec-k=") or name in ("spec-ahead", "spec-noahead", "spec-suffix", "spec-nosuffix"):
            out[f"{name}_vs_baseline"] = ratio(tps(name), tps("baseline"))
    out["ahead_vs_noahead"] = ratio(tps("spec-ahead"), tps("spec-noahead"))
    if "spec-suffix" in summaries or "spec-nosuffix" in summaries:  # what suffix drafting adds (issue #45)
        out["suffix_vs_nosuffix"] = ratio(tps("spec-suffix"), tps("spec-nosuffix"))
    if tps(LLAMACPP):  # llama.cpp's plain decoding: the ratio a CPU user compares with
        for name in summaries:
            if name != LLAMACPP:
                out[f"{name}_vs_{LLAMACPP}"] = ratio(tps(name), tps(LLAMACPP))
    return out


def paired_round_ratios(summaries: dict, a: str | None, b: str = "baseline") -> dict | None:
    """``a`` / ``b`` tokens/s within each interleaved round (the same requests, run back to back),
    and their spread: on a machine whose speed drifts, the rounds' ratios show how far the one
    aggregate ratio can be trusted. ``mean`` and ``stderr`` are of the per-round ratios (stderr None
    for one round); None unless both systems ran."""
    if a not in summaries or b not in summaries:
        return None
    ratios = [x / y for x, y in zip(summaries[a]["round_tokens_per_s"], summaries[b]["round_tokens_per_s"]) if y > 0]
    if not ratios:
        return None
    n = len(ratios)
    mean = sum(ratios) / n
    stderr = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1) / n) if n > 1 else None
    return {"pair": [a, b], "ratios": ratios, "mean": mean, "stderr": stderr, "min": min(ratios), "max": max(ratios)}


def bound_acceptance(summary: dict) -> dict:
    """The acceptance the bound assumes, from one system's summary: ``alphas_by_position`` (conditional
    acceptance of the positions drafted at least MIN_POSITION_DRAFTS times), ``alpha`` (their pooled
    value: the tail of the positional curve) and ``acceptance_rate`` (accepted / drafted).

    Shadow probes draft one token (the policy's probe_k) beside plain rounds, whatever the policy expects
    of them: first-position samples it did not pick for looking promising. They join the first position;
    otherwise an adaptive policy that drafts rarely, and only where it expects acceptance, makes the
    drafts it did verify look far better than the draft is (seen: 51 of 51 accepted, a 4x "bound").
    """
    drafted, rates = summary.get("per_position_drafted") or [], summary.get("per_position_acceptance") or []
    reliable = [r for r, d in zip(rates, drafted) if d >= MIN_POSITION_DRAFTS]
    alphas = conditional_alphas(reliable) if reliable else []
    weights = list(drafted[: len(alphas)])
    out: dict = {"acceptance_rate": summary["acceptance_rate"]}
    probes, probe_hits = int(summary.get("shadow_probes") or 0), int(summary.get("shadow_accepted") or 0)
    if probes:
        first_drafted = (drafted[0] if drafted else 0) + probes
        first_accepted = (rates[0] * drafted[0] if drafted else 0.0) + probe_hits
        if first_drafted >= MIN_POSITION_DRAFTS:
            alphas = [first_accepted / first_drafted] + alphas[1:]
            weights = [first_drafted] + weights[1:]
        out["first_position_samples"] = {"drafted_rounds": drafted[0] if drafted else 0, "shadow_probes": probes,
                                         "accepted": round(first_accepted), "alpha": first_accepted / first_drafted}
    alpha = sum(a * w for a, w in zip(alphas, weights)) / sum(weights) if alphas else summary["acceptance_rate"]
    out.update({"alpha": alpha, "alphas_by_position": alphas})
    return out
