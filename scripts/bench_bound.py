"""Recompute a finished bench run's analytic bound from its saved requests (no rerun).

    .venv/bin/python scripts/bench_bound.py bench-out [--reference spec]

Reads OUT/summary.json and OUT/requests.jsonl, loads the run's target and draft model here (they time the
target's forward curve and replay the draft on the outputs), and prints the bound as `specdec bench` would
compute it now, with its table. For runs made before a change to the bound's recipe: the requests keep
everything it needs (per-k round costs need a gateway that reports them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.bound import compute_bound
from specdec.bench.cli import ModelCache
from specdec.bench.metrics import RequestRecord


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="a `specdec bench` output directory")
    p.add_argument("--reference", action="append", default=None,
                   help="a speculative system to bound (repeatable; default: the one the bench picks)")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    summary = json.loads((args.out / "summary.json").read_text())
    records: dict[str, list[RequestRecord]] = {}
    with (args.out / "requests.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            records.setdefault(row["system"], []).append(RequestRecord(**row))
    cfg = summary["config"]
    run = argparse.Namespace(local=cfg.get("mode") == "local", target=cfg["target"], draft_model=cfg.get("draft_model"),
                             device=args.device, temperature=cfg.get("temperature", 0.0))
    models = ModelCache(run)
    for reference in args.reference or [None]:
        bound = compute_bound(run, summary["systems"], records, models, reference=reference, with_roofline=False)
        print(f"\n== {bound.get('acceptance_from')}")
        report(bound)
    return 0


def report(bound: dict) -> None:
    if bound.get("bound") is None:
        print(f"no bound: {bound.get('note')}")
        return
    print(f"acceptance: {bound['acceptance_source']}")
    print(f"costs: {bound['costs_source']}; t_plain {bound['t_plain_s'] * 1e3:.2f} ms ({bound['plain_round_source']})")
    print(f"prefill per decoded token {bound['prefill_per_token_s'] * 1e3:.2f} ms; decoding alone: bound "
          f"{bound['bound_decoding']:.3f} at k = {bound['best_k_decoding']}")
    if bound.get("draft_costs_from"):
        print(f"draft costs: {bound['draft_costs_from']}")
    print(f"bound {bound['bound']:.3f} at k = {bound['best_k']}; measured {bound.get('measured') or float('nan'):.3f} "
          f"({' / '.join(bound.get('measured_pair') or [])}); measured / bound {bound.get('measured_over_bound') or float('nan'):.3f}")
    if bound.get("bound_own_rounds_acceptance") is not None:
        print(f"with the acceptance of the system's own rounds: {bound['bound_own_rounds_acceptance']:.3f}")
    print(" k  rounds  t_round ms  E[tokens]  speedup")
    for point in bound["curve"]:
        k = point["k"]
        print(f"{k:>2} {bound['measured_rounds'].get(k, 0):>7} {bound['t_round_s'][k] * 1e3:11.2f} "
              f"{point['expected_tokens']:10.3f} {point['speedup']:8.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
