"""The analytic speedup bound of a bench run: what the measured acceptance and the measured costs of a round allow.

A round that drafts k tokens costs what the run's own rounds with k drafts cost (``round_costs`` in the
stats: verify time, steady draft time, plus the gateway's own time per round); a k the run drafted too
rarely is modelled: the target's forward over k + 1 tokens (measured in the bench process) plus the
verify round's measured cost beyond it, and the draft time's line in k (call overhead + per token). The
plain round is the baseline's own. Tokens per round: where a draft model ran greedy, a fixed-k run replayed
exactly on the target's outputs (``teacher_forced``), else from the system's verified rounds' acceptance.
The target's step is set against the memory-bandwidth bound too. The formulas are ``specdec.speedup``'s."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Sequence

from specdec.bench.metrics import RequestRecord, bound_acceptance, ratio, spec_reference
from specdec.bench.runners import SUFFIX_METHOD, describe_error
from specdec.bench.teacher_forced import teacher_forced_acceptance
from specdec.costs import FORWARD_CURVE_PREFIX, extend_curve, isotonic, measure_forward_curve, weighted_line
from specdec.speedup import speedup_bound_from_rounds

log = logging.getLogger(__name__)

VERIFY_CURVE_TOKENS = 16  # the target's forward is timed over 1..16 tokens (k = 0..15)
MIN_ROUNDS_PER_K = 20  # a k drafted in fewer rounds takes the cost model's value, not its own mean


def _completed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.error is None and r.stats]


def pooled_round_costs(records: Sequence[RequestRecord]) -> dict[int, dict]:
    """The requests' ``round_costs`` summed per number of drafts verified: {k: rounds, verify_s,
    steady_rounds, steady_draft_s} (empty from a gateway older than the field)."""
    out: dict[int, dict] = {}
    for r in _completed(records):
        for cost in r.stats.get("round_costs") or []:
            pooled = out.setdefault(int(cost["num_drafts"]), dict.fromkeys(("rounds", "verify_s", "steady_rounds", "steady_draft_s"), 0))
            for name in pooled:
                pooled[name] += cost[name]
    return out


def overhead_per_round(records: Sequence[RequestRecord]) -> float:
    """The loop's own time per round, beyond waiting for drafter and verifier (gateway work, streaming)."""
    done = _completed(records)
    rounds = sum(int(r.stats.get("rounds", 0)) for r in done)
    if not rounds:
        return 0.0
    own = sum(float(r.stats["total_s"]) - float(r.stats["ttft_s"]) - float(r.stats["draft_s"]) - float(r.stats["verify_s"])
              for r in done)
    return max(0.0, own / rounds)


def decode_round_s(records: Sequence[RequestRecord]) -> float | None:
    """Seconds per round after the first token: (total_s - ttft_s) summed over rounds summed."""
    done = _completed(records)
    rounds = sum(int(r.stats.get("rounds", 0)) for r in done)
    if not rounds:
        return None
    return sum(float(r.stats["total_s"]) - float(r.stats["ttft_s"]) for r in done) / rounds



def k0_round_s(records: Sequence[RequestRecord]) -> tuple[int, float] | None:
    """(rounds, seconds) of the rounds that verified no drafts: their mean wait for the verdict plus
    the loop's own time per round; None without such rounds (a gateway older than ``round_costs``)."""
    plain = pooled_round_costs(records).get(0)
    if not plain or not plain["rounds"]:
        return None
    return plain["rounds"], plain["verify_s"] / plain["rounds"] + overhead_per_round(records)


def k0_rounds_against_plain(summaries: dict, all_records: dict) -> dict:
    """Per system, its rounds without drafts against plain decoding's (the baseline's, measured the
    same way): what a session that is not drafting pays for being speculative (issue #46's tax)."""
    plain = k0_round_s(all_records.get("baseline", [])) if "baseline" in summaries else None
    out = {}
    for name in summaries:
        own = k0_round_s(all_records.get(name, []))
        if own is None:
            continue
        done = _completed(all_records[name])
        out[name] = {"k0_rounds": own[0], "k0_round_s": own[1],
                     "rounds": sum(int(r.stats.get("rounds", 0)) for r in done),
                     "shadow_probes": sum(int(r.stats.get("shadow_probes", 0)) for r in done),
                     "over_plain": ratio(own[1], plain[1]) if plain else None}
    return out


def prefill_per_token(prefill_records: Sequence[RequestRecord], records: Sequence[RequestRecord]) -> float:
    """The time before the first token, per decoded token: the mean TTFT of ``prefill_records`` (the
    baseline's, whose prefill is plain) times the number of ``records``, over their decoded tokens."""
    ttfts = [float(r.stats["ttft_s"]) for r in _completed(prefill_records)]
    done = _completed(records)
    decoded = sum(max(0, r.output_tokens - 1) for r in done)
    if not ttfts or not decoded:
        return 0.0
    return sum(ttfts) / len(ttfts) * len(done) / decoded



def same_drafter(a: dict, b: dict) -> bool:
    """Whether two systems' summaries drafted with the same drafter (method, and replay or not)."""
    return a.get("method") == b.get("method") and (a.get("replay_acceptance") is None) == (b.get("replay_acceptance") is None)


def borrow_draft_costs(costs: dict[int, dict], others: Sequence[RequestRecord]) -> None:
    """Add the steady draft rounds of ``others`` (the same drafter in other systems of the run) to
    ``costs``: a system that drafted too little to time its drafter (an adaptive one at low
    acceptance) would otherwise be bounded with free drafts."""
    for k, c in pooled_round_costs(others).items():
        if k > 0:
            mine = costs.setdefault(k, {"rounds": 0, "verify_s": 0.0, "steady_rounds": 0, "steady_draft_s": 0.0})
            mine["steady_rounds"] += c["steady_rounds"]
            mine["steady_draft_s"] += c["steady_draft_s"]

def round_cost_curve(costs: dict[int, dict], overhead_s: float, forward: Sequence[float] | None,
                     draft_step_s: float | None, max_k: int) -> dict | None:
    """A round's cost for k = 0..max_k: verify + draft + ``overhead_s``.

    Verify: a k verified in at least MIN_ROUNDS_PER_K rounds keeps its own mean; another k is the target's
    ``forward`` over k + 1 tokens plus the measured rounds' mean cost beyond their forward (without a
    forward curve: the weighted line through the measured means). Draft: a k with at least
    MIN_ROUNDS_PER_K steady rounds keeps its mean; another k takes the weighted line (overhead + per
    token) through them, or with one such k, ``draft_step_s`` (the draft's own step) per token and
    the rest as overhead. Both are made non-decreasing in k. None without a measured verify cost."""
    measured = {k: c for k, c in costs.items() if c["rounds"] >= MIN_ROUNDS_PER_K}
    if not measured:
        return None
    verify_mean = {k: c["verify_s"] / c["rounds"] for k, c in measured.items()}
    if forward:
        beyond = sum(c["rounds"] * (verify_mean[k] - extend_curve(forward, k)) for k, c in measured.items())
        beyond /= sum(c["rounds"] for c in measured.values())
        model = [extend_curve(forward, k) + beyond for k in range(max_k + 1)]
        how = "the target's forward over k + 1 tokens + the measured rounds' mean cost beyond it"
    else:
        ks = sorted(measured)
        line = weighted_line(ks, [verify_mean[k] for k in ks], [measured[k]["rounds"] for k in ks])
        a, b = line if line is not None else (next(iter(verify_mean.values())), 0.0)
        model = [a + max(0.0, b) * k for k in range(max_k + 1)]
        how = "the weighted line through the measured means"
    verify = [verify_mean.get(k, model[k]) for k in range(max_k + 1)]
    weights = [float(measured[k]["rounds"]) if k in measured else 1.0 for k in range(max_k + 1)]
    verify = isotonic(verify, weights)

    steady = {k: c["steady_draft_s"] / c["steady_rounds"] for k, c in costs.items()
              if k > 0 and c["steady_rounds"] >= MIN_ROUNDS_PER_K}
    ks = sorted(steady)
    line = weighted_line(ks, [steady[k] for k in ks], [costs[k]["steady_rounds"] for k in ks])
    if line is not None:
        d0, d1 = max(0.0, line[0]), max(0.0, line[1])
    elif steady:
        (k1, mean), = steady.items()
        d1 = min(draft_step_s, mean / k1) if draft_step_s else mean / k1
        d0 = mean - d1 * k1
    else:
        d0, d1 = 0.0, draft_step_s or 0.0
    draft = isotonic([0.0] + [steady.get(k, d0 + d1 * k) for k in range(1, max_k + 1)])
    return {
        "round_s": [v + d + overhead_s for v, d in zip(verify, draft)],
        "verify_s": verify, "draft_s": draft, "overhead_s": overhead_s,
        "measured_rounds": {k: costs[k]["rounds"] for k in sorted(costs)},
        "source": (f"the run's rounds per k (own mean where >= {MIN_ROUNDS_PER_K} rounds); other k: verify = {how}, "
                   f"draft = {d0 * 1e3:.2f} ms + {d1 * 1e3:.2f} ms per token; + {overhead_s * 1e3:.2f} ms of the loop's own per round"),
    }


def memory_roofline(target, t_step: float | None) -> dict:
    """The target's single-token step against the memory-bandwidth bound: every weight is read once
    per forward, so the step cannot beat weight bytes / bandwidth (measured here by streaming a
    buffer larger than the caches through a reduction, the same access pattern)."""
    import torch

    if target.gguf is not None:  # llama.cpp's tensors as the file holds them (quantized)
        weight_bytes = target.gguf.context.model_bytes
    else:
        weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    buffer = torch.ones(max(weight_bytes, 256 << 20) // 4, dtype=torch.float32, device=target.device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - start)
    bandwidth = buffer.numel() * 4 / best
    bound = weight_bytes / bandwidth
    return {"weight_bytes": weight_bytes, "bandwidth_gb_s": bandwidth / 1e9, "memory_bound_step_s": bound,
            "measured_step_s": t_step, "step_over_memory_bound": ratio(t_step, bound)}


def measure_draft_cost(draft, reps: int = 7) -> float:
    """Seconds of the draft model's one-token forward after a KV prefix (minimum over reps)."""
    return measure_forward_curve(draft, 1, reps=reps)[0]


def machine_info(device: str | None = None) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if device:
        info["device"] = device
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _teacher_forced(args, summary: dict, records: Sequence[RequestRecord], models) -> dict | None:
    """The draft model's acceptance by position on the reference system's outputs (greedy runs of a draft
    model: not the replay drafter, whose acceptance is independent of position by construction, nor n-gram)."""
    if getattr(args, "temperature", 0.0) != 0.0 or summary.get("replay_acceptance") is not None:
        return None
    done = _completed(records)
    if not done or any(r.stats.get("draft_method") != "model" for r in done):
        return None
    try:
        draft = models.draft()
        if draft is None:
            return None
        return teacher_forced_acceptance(draft, [(r.prompt_token_ids, r.token_ids) for r in done if r.token_ids],
                                         VERIFY_CURVE_TOKENS - 1)
    except Exception as exc:  # noqa: BLE001 - no local draft: the verified rounds' acceptance stands
        log.warning("teacher-forced acceptance failed: %s", describe_error(exc))
        return None


def compute_bound(args, summaries: dict, all_records: dict, models, reference: str | None = None,
                  with_roofline: bool = True) -> dict:
    """The analytic speedup bound from measured acceptance and costs, and measured / bound.
    ``models``: the command's ``ModelCache`` (the local target and draft, loaded when first asked for).
    ``reference``: the speculative system whose acceptance and costs to use (default
    ``spec_reference``); ``with_roofline``: also time the target's step against memory bandwidth."""
    out: dict = {"measured_over_bound": None}
    ref = reference or spec_reference(summaries)
    base = "baseline" if "baseline" in summaries else ("hf" if "hf" in summaries else None)
    if ref is None or summaries[ref].get("acceptance_rate") is None:
        out["note"] = "no speculative system with acceptance stats was run"
        return out
    s, records = summaries[ref], all_records.get(ref, [])
    out["acceptance_from"] = ref
    own = bound_acceptance(s)
    out.update(own)
    alpha, alphas = own["alpha"], own["alphas_by_position"] or None
    forced = _teacher_forced(args, s, records, models)
    if forced is not None:
        out["teacher_forced"] = forced
        out["acceptance_source"] = (f"teacher forcing: the draft's greedy tokens against {ref}'s outputs "
                                    f"({forced['tokens']} tokens), E[tokens](k) from a fixed-k run replayed on them")
        alpha, alphas = forced["alphas_by_position"][-1], forced["alphas_by_position"]
        out["alpha"], out["alphas_by_position"] = forced["alpha"], forced["alphas_by_position"]
    else:
        out["acceptance_source"] = f"{ref}'s verified rounds (and shadow probes for the first position)"

    forward = None
    try:
        forward = models.forward_curve()
    except Exception as exc:  # noqa: BLE001 - no local target: the run's own rounds must do
        out["forward_note"] = describe_error(exc)
    draft_step = None
    if s.get("replay_acceptance") is None and getattr(args, "draft_model", None):
        try:
            draft_step = measure_draft_cost(models.draft()) if models.draft() is not None else None
        except Exception as exc:  # noqa: BLE001
            log.warning("draft cost measurement failed: %s", exc)
    own_costs = pooled_round_costs(records)
    if not any(k > 0 and c["steady_rounds"] >= MIN_ROUNDS_PER_K for k, c in own_costs.items()):
        borrow_draft_costs(own_costs, [r for name, rs in all_records.items()
                                       if name != ref and name in summaries and same_drafter(summaries[name], s)
                                       for r in rs])
        out["draft_costs_from"] = "the run's other systems of this draft method (this one drafted too little)"
    costs = round_cost_curve(own_costs, overhead_per_round(records), forward, draft_step, VERIFY_CURVE_TOKENS - 1)
    if costs is not None:
        base_round = decode_round_s(all_records.get(base, [])) if base == "baseline" else None
        plain = base_round or costs["round_s"][0]
        out["plain_round_source"] = "baseline's rounds" if base_round else f"{ref}'s rounds without drafts"
    elif forward is not None:  # stats without round_costs: the local forward and the mean draft time per token
        t_draft = s["draft_s"] / s["draft_tokens"] if s.get("draft_tokens") else 0.0
        costs = {"round_s": [f + k * t_draft for k, f in enumerate(forward)], "verify_s": list(forward),
                 "draft_s": [k * t_draft for k in range(len(forward))], "overhead_s": 0.0, "measured_rounds": {},
                 "source": (f"no round costs in the stats: the target's forward over 1..{VERIFY_CURVE_TOKENS} tokens "
                            f"after a {FORWARD_CURVE_PREFIX}-token prefix, in process, + draft_s / draft_tokens per draft")}
        plain = forward[0]
        out["plain_round_source"] = "the target's one-token forward"
    else:
        out["note"] = f"no round costs: {out.get('forward_note', 'no stats')}"
        return out
    prefill = prefill_per_token(all_records.get(base if base == "baseline" else ref, []), records)
    per_round = forced["tokens_per_round"] if forced is not None else None
    result = speedup_bound_from_rounds(costs["round_s"], plain, alpha=alpha, alphas=alphas, tokens_per_round=per_round,
                                       prefill_per_token_s=prefill)
    decoding = speedup_bound_from_rounds(costs["round_s"], plain, alpha=alpha, alphas=alphas, tokens_per_round=per_round)
    out.update({
        "t_round_s": costs["round_s"], "t_verify_s": costs["verify_s"], "t_draft_s": costs["draft_s"],
        "overhead_s": costs["overhead_s"], "measured_rounds": costs["measured_rounds"],
        "costs_source": costs["source"], "t_plain_s": plain, "target_forward_s": forward,
        "best_k": result["best_k"], "bound": result["bound"], "curve": result["curve"],
        "prefill_per_token_s": prefill, "bound_decoding": decoding["bound"], "best_k_decoding": decoding["best_k"],
    })
    if forced is not None:  # what the system's own verified rounds would have made of it
        selected = speedup_bound_from_rounds(costs["round_s"], plain, alpha=own["alpha"], alphas=own["alphas_by_position"] or None,
                                             prefill_per_token_s=prefill)
        out["bound_own_rounds_acceptance"] = selected["bound"]
        out["own_rounds_alphas_by_position"] = own["alphas_by_position"]
    try:
        if with_roofline:
            out["roofline"] = memory_roofline(models.target(), forward[0] if forward else None)
    except Exception as exc:  # noqa: BLE001 - no local target: no roofline
        out["roofline"] = {"note": describe_error(exc)}
    counts = s.get("draft_method_counts") or {}
    if counts.get(SUFFIX_METHOD, 0) * 2 > sum(counts.values()):
        # Suffix drafts only the rounds it is confident about: their acceptance taken as every round's
        # bounds no policy that could be run.
        out["selective_note"] = (f"{ref} drafted mostly with {SUFFIX_METHOD}, which drafts only where it is confident: "
                                 "the bound takes those rounds' acceptance as every round's, so it overstates what "
                                 "any policy could reach, and measured / bound understates the loop")
    if base is not None and summaries[base].get("tokens_per_s"):
        measured = ratio(summaries[ref]["tokens_per_s"], summaries[base]["tokens_per_s"])
        out.update({"measured": measured, "measured_pair": [ref, base],
                    "measured_over_bound": ratio(measured, result["bound"])})
    else:
        out["note"] = "no baseline (or hf) system: measured speedup unknown"
    return out
