"""The target's pass cost per (sessions, new tokens) bucket: eager lean forward against static-shape
passes (CUDA graphs on a GPU), one JSON file and a table. Part of the GPU check (scripts/gpu_sweep.sh).

    python scripts/pass_curve.py --device cuda --dtype float32 --out gpu-out/pass_curve_fp32.json

Each cell: sessions of a ``--prefix``-token context each feed ``tokens`` new tokens in one pass,
rolled back after it (so every repetition sees the same context); median of ``--reps`` passes
after warm-up (capture included in warm-up), timed with a device sync. The first lines say what
the 1-token pass costs, how a verify of 8 compares with it, and how far graphs moved them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

SESSIONS = (1, 2, 4, 8, 16)
TOKENS = (1, 2, 4, 8, 16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cell(lean, sessions: int, tokens: int, prefix: int, reps: int, warmup: int = 3) -> float:
    """Median seconds of one pass of ``sessions`` x ``tokens`` after a ``prefix``-token context."""
    kvs = [lean.new_kv() for _ in range(sessions)]
    for kv in kvs:
        lean.forward([kv], [list(range(1, prefix + 1))], [1])
    feeds = [[7 + i] * tokens for i in range(sessions)]
    times = []
    for rep in range(warmup + reps):
        sync(lean.device)
        start = time.perf_counter()
        lean.forward(kvs, feeds, [tokens] * sessions)
        sync(lean.device)
        if rep >= warmup:
            times.append(time.perf_counter() - start)
        for kv in kvs:
            kv.crop(prefix)
    del kvs
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="embedded")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sessions", default=",".join(map(str, SESSIONS)))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from specdec import pass_options

    os.environ[pass_options.DTYPE_ENV] = args.dtype
    os.environ[pass_options.STATIC_KV_ENV] = "off"  # the loader builds the eager model; static variants below
    from specdec.lean import LeanModel
    from specdec.models import load_model

    lm = load_model(args.target, device=args.device, runtime="lean")
    sessions = [int(s) for s in args.sessions.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    graphs = lm.device.type == "cuda"
    variants = {"eager": lm.lean}
    static = LeanModel(lm.lean.w, lm.lean.device, backend="torch")
    static.use_static_kv(max(sessions), args.prefix + max(tokens) + 16, graphs=graphs)
    variants["graphs" if graphs else "static"] = static
    results: dict = {"target": args.target, "device": str(lm.device), "dtype": args.dtype, "prefix": args.prefix,
                     "reps": args.reps, "ms": {}}
    if lm.device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(lm.device)
    for name, lean in variants.items():
        table = results["ms"].setdefault(name, {})
        for s in sessions:
            for t in tokens:
                table[f"{s}x{t}"] = round(1000 * time_cell(lean, s, t, args.prefix, args.reps), 3)
    names = list(variants)
    print(f"pass ms, {args.target} on {results.get('gpu', results['device'])} ({args.dtype}), "
          f"prefix {args.prefix}, median of {args.reps}")
    print("sessions x tokens  " + "  ".join(f"{n:>9}" for n in names))
    for key in results["ms"][names[0]]:
        print(f"{key:>17}  " + "  ".join(f"{results['ms'][n][key]:9.3f}" for n in names))
    for n in names:
        one, eight = results["ms"][n].get("1x1"), results["ms"][n].get("1x8")
        if one and eight:
            print(f"{n}: one token {one:.3f} ms, verify of 8 / one token = {eight / one:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
