"""The analytic speedup bound of a bench run: the acceptance measured, the verify-cost curve (fitted to the
gateway's stats or measured on the local target), the draft's cost, and the target's step against the
memory-bandwidth bound. The formulas themselves are ``specdec.speedup``'s."""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Sequence

from specdec.bench.metrics import bound_acceptance, ratio, spec_reference
from specdec.bench.runners import describe_error
from specdec.costs import FORWARD_CURVE_PREFIX, measure_forward_curve
from specdec.speedup import speedup_bound

log = logging.getLogger(__name__)

VERIFY_CURVE_TOKENS = 16  # the target's forward is timed over 1..16 tokens (k = 0..15)


def fit_verify_cost(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """Least squares of verify_s = a * rounds + b * drafted over requests ``(rounds, drafted, verify_s)``:
    t_verify(k) = a + b * k. None unless both coefficients come out well defined and a > 0, b >= 0."""
    import numpy as np

    rows = [(r, d, v) for r, d, v in samples if r > 0]
    if len(rows) < 2:
        return None
    x = np.array([[r, d] for r, d, _ in rows], dtype=float)
    y = np.array([v for _, _, v in rows], dtype=float)
    if np.linalg.matrix_rank(x) < 2:
        return None
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if not (a > 0 and b >= 0):
        return None
    return float(a), float(b)


def memory_roofline(target, t_step: float | None) -> dict:
    """The target's single-token step against the memory-bandwidth bound: every weight is read once
    per forward, so the step cannot beat weight bytes / bandwidth (measured here by streaming a
    buffer larger than the caches through a reduction, the same access pattern)."""
    import torch

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


def compute_bound(args, summaries: dict, all_records: dict, models, reference: str | None = None,
                  with_roofline: bool = True) -> dict:
    """The analytic speedup bound from measured acceptance and costs, and measured / bound.
    ``models``: the command's ``ModelCache`` (the local target and draft, loaded when first asked for).
    ``reference``: the speculative system whose acceptance and draft cost to use (default
    ``spec_reference``); ``with_roofline``: also time the target's step against memory bandwidth."""
    out: dict = {"measured_over_bound": None}
    ref = reference or spec_reference(summaries)
    base = "baseline" if "baseline" in summaries else ("hf" if "hf" in summaries else None)
    if ref is None or summaries[ref].get("acceptance_rate") is None:
        out["note"] = "no speculative system with acceptance stats was run"
        return out
    s = summaries[ref]
    out["acceptance_from"] = ref
    out.update(bound_acceptance(s))
    alpha, alpha_pooled, alphas = out["acceptance_rate"], out["alpha"], out["alphas_by_position"]

    # Verify-cost curve and draft cost.
    t_verify, t_draft, source = None, None, None
    if not args.local:
        samples = [(int(r.stats.get("rounds", 0)), int(r.stats.get("draft_tokens", 0)), float(r.stats.get("verify_s", 0.0)))
                   for name, rs in all_records.items() if summaries[name]["kind"] == "gateway"
                   for r in rs if r.error is None and r.stats]
        fit = fit_verify_cost(samples)
        if fit is not None:
            a, b = fit
            t_verify = [a + b * k for k in range(VERIFY_CURVE_TOKENS)]
            source = f"gateway stats: least squares verify_s = a*rounds + b*drafts (a={a * 1e3:.2f} ms, b={b * 1e3:.2f} ms)"
    if t_verify is None:
        try:
            t_verify = measure_forward_curve(models.target(), VERIFY_CURVE_TOKENS)
            source = (f"local measurement: target forward over 1..{VERIFY_CURVE_TOKENS} tokens after a "
                      f"{FORWARD_CURVE_PREFIX}-token KV prefix (minimum of 5 sweeps, made non-decreasing)")
        except Exception as exc:  # noqa: BLE001 - no local target: no bound
            out["note"] = f"no verify-cost curve: {describe_error(exc)}"
            return out
    if s.get("draft_tokens"):
        t_draft = s.get("draft_s", 0.0) / s["draft_tokens"]
        draft_source = f"{ref} stats: draft_s / draft_tokens"
    else:
        t_draft, draft_source = 0.0, "no drafts"
    if args.local and args.draft_model:
        try:
            t_draft = measure_draft_cost(models.draft())
            draft_source = "local measurement: draft forward over 1 token after a KV prefix"
        except Exception as exc:  # noqa: BLE001
            log.warning("draft cost measurement failed: %s", exc)
    result = speedup_bound(t_verify, t_draft, alpha=alpha_pooled, alphas=alphas or None)
    geometric = speedup_bound(t_verify, t_draft, alpha=alpha)
    try:
        if with_roofline:
            out["roofline"] = memory_roofline(models.target(), t_verify[0])
    except Exception as exc:  # noqa: BLE001 - no local target: no roofline
        out["roofline"] = {"note": describe_error(exc)}
    out.update({
        "t_verify_s": t_verify,
        "t_verify_source": source,
        "t_draft_s": t_draft,
        "t_draft_source": draft_source,
        "best_k": result["best_k"],
        "bound": result["bound"],
        "curve": result["curve"],
        "bound_geometric_acceptance_rate": geometric["bound"],
        "best_k_geometric_acceptance_rate": geometric["best_k"],
    })
    if base is not None and summaries[base].get("tokens_per_s"):
        measured = ratio(summaries[ref]["tokens_per_s"], summaries[base]["tokens_per_s"])
        out.update({"measured": measured, "measured_pair": [ref, base],
                    "measured_over_bound": ratio(measured, result["bound"])})
    else:
        out["note"] = "no baseline (or hf) system: measured speedup unknown"
    return out
