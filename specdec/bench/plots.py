"""PNG plots for ``specdec bench`` (matplotlib, Agg backend: no display needed).

Every plot is always written; one without data says so on the canvas.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from specdec.bench.metrics import MIN_POSITION_DRAFTS, tpot

PLOTS = ("speedup_by_category.png", "acceptance_by_position.png", "latency_cdf.png", "k_over_time.png")
ACCEPTANCE_SWEEP_PLOT = "acceptance_sweep.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _category_rates(records) -> dict[str, float]:
    """Output tokens over summed request latency, per category (successful requests)."""
    tokens, seconds = defaultdict(int), defaultdict(float)
    for r in records:
        if r.error is None and r.latency_s:
            tokens[r.category] += r.output_tokens
            seconds[r.category] += r.latency_s
    return {c: tokens[c] / seconds[c] for c in tokens if seconds[c] > 0}


def plot_speedup_by_category(path: Path, summary: dict, records: dict) -> None:
    plt = _pyplot()
    systems = list(summary["systems"])
    ref = "baseline" if "baseline" in systems else ("hf" if "hf" in systems else None)
    rates = {name: _category_rates(records.get(name, [])) for name in systems}
    categories = sorted({c for r in rates.values() for c in r})
    shown = [n for n in systems if n != ref] if ref else systems
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.9 * len(categories) * max(1, len(shown)) / 2), 4.5))
    if not categories or not shown:
        _empty(ax, "no data (a speedup needs two systems)")
    else:
        width = 0.8 / len(shown)
        for j, name in enumerate(shown):
            values = []
            for c in categories:
                value = rates[name].get(c)
                if ref:
                    base = rates[ref].get(c)
                    value = value / base if value is not None and base else None
                values.append(value if value is not None else 0.0)
            xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(categories))]
            ax.bar(xs, values, width=width, label=name)
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories, rotation=30, ha="right")
        if ref:
            ax.axhline(1.0, color="0.3", lw=1, ls="--")
            ax.set_ylabel(f"speedup over {ref} (tokens/s ratio)")
            ax.set_title(f"Speedup per category vs {ref}")
        else:
            ax.set_ylabel("output tokens/s (per request)")
            ax.set_title("Tokens/s per category (no baseline or hf system to compare with)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance_by_position(path: Path, summary: dict) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    drawn = False
    for name, s in summary["systems"].items():
        rates = s.get("per_position_acceptance") or []
        drafted = s.get("per_position_drafted") or [MIN_POSITION_DRAFTS] * len(rates)
        if not rates:
            continue
        xs = list(range(1, len(rates) + 1))
        line, = ax.plot(xs, rates, lw=1, ls=":", alpha=0.6)
        firm = [i for i in range(len(rates)) if drafted[i] >= MIN_POSITION_DRAFTS]
        thin = [i for i in range(len(rates)) if drafted[i] < MIN_POSITION_DRAFTS]
        ax.plot([xs[i] for i in firm], [rates[i] for i in firm], "o", color=line.get_color(), label=name)
        ax.plot([xs[i] for i in thin], [rates[i] for i in thin], "o", mfc="none", color=line.get_color())
        drawn = True
    if drawn:
        ax.set_xlabel(f"draft position i (hollow: drafted < {MIN_POSITION_DRAFTS} times)")
        ax.set_ylabel("P(drafts 1..i all accepted)")
        ax.set_ylim(0, 1.05)
        ax.set_title("Acceptance by draft position")
        ax.grid(alpha=0.3)
        ax.legend()
    else:
        _empty(ax, "no speculative system with drafts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ecdf(ax, values, label) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdfs(path: Path, summary: dict, records: dict) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (
        ("TTFT (ms)", lambda r: r.ttft_s * 1e3 if r.ttft_s is not None else None),
        ("TPOT (ms)", lambda r: (t * 1e3) if (t := tpot(r.latency_s, r.ttft_s, r.output_tokens)) is not None else None),
        ("end-to-end latency (s)", lambda r: r.latency_s),
    )
    for ax, (title, get) in zip(axes, panels):
        drawn = False
        for name in summary["systems"]:
            values = [v for r in records.get(name, []) if r.error is None and (v := get(r)) is not None]
            if values:
                _ecdf(ax, values, name)
                drawn = True
        if drawn:
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        else:
            _empty(ax, f"no {title}")
        ax.set_title(f"CDF: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_k_over_time(path: Path, summary: dict, records: dict) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for name in summary["systems"]:
        histories = [list(r.stats.get("k_history") or []) for r in records.get(name, [])
                     if r.error is None and r.stats and r.stats.get("draft_method", "none") != "none"]
        histories = [h for h in histories if h]
        if not histories:
            continue
        longest = max(len(h) for h in histories)
        mean = [sum(h[i] for h in histories if i < len(h)) / sum(1 for h in histories if i < len(h))
                for i in range(longest)]
        line, = ax.plot(range(1, longest + 1), mean, lw=2, label=f"{name} (mean over requests)")
        for h in histories:
            ax.plot(range(1, len(h) + 1), h, lw=0.5, alpha=0.25, color=line.get_color())
        drawn = True
    if drawn:
        ax.set_xlabel("verification round")
        ax.set_ylabel("k (draft tokens in the round)")
        ax.set_title("Draft length over the generation")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no speculative system with rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(out_dir: Path, summary: dict, records: dict) -> list[str]:
    """Write every plot into ``out_dir``; returns their file names."""
    out_dir = Path(out_dir)
    plot_speedup_by_category(out_dir / PLOTS[0], summary, records)
    plot_acceptance_by_position(out_dir / PLOTS[1], summary)
    plot_latency_cdfs(out_dir / PLOTS[2], summary, records)
    plot_k_over_time(out_dir / PLOTS[3], summary, records)
    if summary.get("acceptance_sweep"):
        plot_acceptance_sweep(out_dir / ACCEPTANCE_SWEEP_PLOT, summary["acceptance_sweep"])
        return [*PLOTS, ACCEPTANCE_SWEEP_PLOT]
    return list(PLOTS)


def plot_acceptance_sweep(path: Path, sweep: dict) -> None:
    """Per draft-length mode against the acceptance set: tokens/s (baseline as a line), the measured
    speedup beside the bound, and measured / bound."""
    plt = _pyplot()
    fig, (rate, speed, share) = plt.subplots(1, 3, figsize=(15, 4.5))
    modes: dict[str, list[dict]] = defaultdict(list)
    for point in sweep["points"]:
        modes["adaptive k" if point["k"] == "adaptive" else f"k = {point['k']}"].append(point)
    for i, (mode, points) in enumerate(modes.items()):
        alphas = [p["alpha_set"] for p in points]
        color = f"C{i}"

        def values(key):
            return [p[key] if p[key] is not None else float("nan") for p in points]

        rate.plot(alphas, values("tokens_per_s"), marker="o", color=color, label=mode)
        speed.plot(alphas, values("speedup"), marker="o", color=color, label=f"{mode}: measured")
        speed.plot(alphas, values("bound"), marker="x", ls="--", color=color, label=f"{mode}: bound")
        share.plot(alphas, values("measured_over_bound"), marker="o", color=color, label=mode)
    if sweep.get("baseline_tokens_per_s"):
        rate.axhline(sweep["baseline_tokens_per_s"], color="0.3", lw=1, ls="--", label="baseline")
    speed.axhline(1.0, color="0.3", lw=1, ls=":")
    share.axhline(1.0, color="0.3", lw=1, ls=":")
    for ax, label, title in ((rate, "output tokens/s", "Throughput"),
                             (speed, "speedup over baseline", "Measured speedup and its bound"),
                             (share, "measured / bound", "Share of the bound reached")):
        ax.set_xlabel("acceptance α set for the replay drafter")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_concurrency_scaling(path: Path, sweep: dict) -> str:
    """Aggregate tokens/s per system against concurrency, and spec / baseline at each level."""
    plt = _pyplot()
    levels = sweep["levels"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in sweep["systems"].items():
        left.plot(levels, [p["tokens_per_s"] or 0.0 for p in points], marker="o", label=name)
    first = next(iter(sweep["systems"].values()), [])
    if first and first[0]["tokens_per_s"]:
        left.plot(levels, [first[0]["tokens_per_s"] * level / levels[0] for level in levels], color="0.6", ls=":",
                  label="linear in streams")
    left.set_xscale("log", base=2)
    left.set_xticks(levels, [str(level) for level in levels])
    left.set_xlabel("concurrent streams")
    left.set_ylabel("aggregate output tokens/s")
    left.set_title("Throughput under concurrency")
    left.legend(fontsize=8)
    ratios = sweep.get("spec_vs_baseline") or []
    if any(r is not None for r in ratios):
        right.plot(levels, [r if r is not None else float("nan") for r in ratios], marker="o", color="C3",
                   label="whole run")
        # Each interleaved round's own ratio: the spread the machine's drift leaves on the whole-run figure.
        by_round = sweep.get("spec_vs_baseline_by_round") or []
        scatter = [(level, r) for level, b in zip(levels, by_round) if b for r in b["ratios"]]
        if scatter:
            right.scatter([x for x, _ in scatter], [y for _, y in scatter], s=14, color="C3", alpha=0.35,
                          label="each round")
            right.legend(fontsize=8)
        right.axhline(1.0, color="0.3", lw=1, ls="--")
        right.set_xscale("log", base=2)
        right.set_xticks(levels, [str(level) for level in levels])
        right.set_xlabel("concurrent streams")
        right.set_ylabel("spec / baseline (tokens/s)")
        right.set_title("Speculation's speedup under load")
    else:
        _empty(right, "no spec and baseline systems")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
