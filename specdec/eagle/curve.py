"""The EAGLE head's learning curve: held-out agreement at each depth against the tokens it trained on.

``specdec train-draft eagle-curve --run DIR [--run DIR ...] --out curve.png`` reads each run's
``train_log.jsonl`` (stages of one curriculum, in order: a later stage's tokens count on from the
earlier's) and plots teacher-forced agreement at depths 1..3 on the held-out target answers, with
optional reference lines (``--reference "independent draft=0.46"``) and other learners' curves read
from their own logs (``--series "LABEL=TOKENS:AGREEMENT,..."``, or ``--draft-run LABEL=DIR`` for a
``train-draft train`` run). Also prints the points as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve_points(runs: list[Path]) -> list[dict]:
    """``{"stage", "step", "tokens", "acc1", "acc2", "acc3"}`` per held-out evaluation, tokens cumulative."""
    points, offset = [], 0
    for stage, run in enumerate(runs, start=1):
        last = 0
        for line in (Path(run) / "train_log.jsonl").read_text().splitlines():
            entry = json.loads(line)
            last = max(last, entry.get("tokens_seen", 0))
            if "eval" in entry:
                points.append({"stage": stage, "step": entry["step"], "tokens": offset + entry.get("tokens_seen", 0),
                               **{k: entry["eval"][k] for k in ("acc1", "acc2", "acc3") if k in entry["eval"]}})
        offset += last
    return points


def draft_points(run: Path) -> list[tuple[float, float]]:
    """(tokens seen, held-out agreement with the target's top token) per evaluation of a ``train-draft
    train`` run (the independent draft), read from its ``train_log.jsonl``."""
    points = []
    for line in (Path(run) / "train_log.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "eval" in entry and "greedy_agree" in entry["eval"]:
            points.append((float(entry["tokens_seen"]), float(entry["eval"]["greedy_agree"])))
    if not points:
        raise ValueError(f"{run}: no evaluation with tokens_seen and greedy_agree in its train_log.jsonl")
    return points


def parse_series(text: str) -> tuple[str, list[tuple[float, float]]]:
    """``"LABEL=TOKENS:VALUE,TOKENS:VALUE"`` -> (label, [(tokens, value), ...])."""
    label, _, pairs = text.rpartition("=")
    if not label or not pairs:
        raise ValueError(f"--series {text!r}: expected LABEL=TOKENS:VALUE,...")
    return label, [(float(t), float(v)) for t, v in (pair.split(":") for pair in pairs.split(","))]


def plot(points: list[dict], references: dict[str, float], out: Path, title: str,
         series: dict[str, list[tuple[float, float]]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for depth, style in (("acc1", "o-"), ("acc2", "s--"), ("acc3", "^:")):
        xs = [p["tokens"] / 1e3 for p in points if depth in p]
        ax.plot(xs, [p[depth] for p in points if depth in p], style, markersize=3, label=f"head, depth {depth[-1]}")
    for stage in sorted({p["stage"] for p in points})[1:]:
        start = min(p["tokens"] for p in points if p["stage"] == stage) / 1e3
        ax.axvline(start, color="grey", linewidth=0.6)
        ax.text(start, ax.get_ylim()[1] * 0.98, f" stage {stage}", va="top", fontsize=8, color="grey")
    colors = ("black", "tab:red", "tab:purple", "tab:brown")
    for i, (label, values) in enumerate((series or {}).items()):
        ax.plot([t / 1e3 for t, _ in values], [v for _, v in values], "D-", color=colors[i % len(colors)],
                markersize=3, label=label)
    for label, value in references.items():
        ax.axhline(value, color="black", linewidth=0.8, linestyle="-.")
        ax.text(0, value, f" {label}", va="bottom", fontsize=8)
    ax.set_xlabel("training tokens seen (thousands)")
    ax.set_ylabel("held-out agreement with the target's greedy token")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft eagle-curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, action="append", required=True, help="an eagle-train --out directory (repeatable, in order)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--reference", action="append", default=[], metavar="LABEL=VALUE", help="a horizontal line")
    p.add_argument("--series", action="append", default=[], metavar="LABEL=TOKENS:VALUE,...",
                   help="another learner's curve (e.g. the independent draft's held-out top-1 by tokens seen)")
    p.add_argument("--draft-run", action="append", default=[], metavar="LABEL=DIR",
                   help="an independent draft's `train-draft train --out` directory, plotted from its log")
    p.add_argument("--title", default="EAGLE head: held-out agreement against training tokens")
    args = p.parse_args(argv)
    references = {}
    for item in args.reference:
        label, _, value = item.rpartition("=")
        references[label] = float(value)
    points = curve_points(args.run)
    series = dict(parse_series(item) for item in args.series)
    for item in args.draft_run:
        label, _, run = item.rpartition("=")
        series[label or "independent draft"] = draft_points(Path(run))
    plot(points, references, args.out, args.title, series)
    print(json.dumps(points))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
