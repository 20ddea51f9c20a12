"""The lean forward curve before/after a change, in one run: old and new alternate pass by pass.

    git worktree add /tmp/layer-before 749b008
    .venv/bin/python scripts/layer_curve.py --before /tmp/layer-before            # the curve
    .venv/bin/python scripts/layer_curve.py --before /tmp/layer-before --numpy-overhead
    .venv/bin/python scripts/layer_curve.py --compile default --tokens 1,8          # item 2: torch.compile

One process loads the target with the lean runtime, then loads the old checkout's
``specdec/lean/forward.py`` and ``numpy_pass.py`` beside this checkout's (``load_old_forward``) and
builds the old ``LeanModel`` on the same prepared weights and product backends, so only the code
around the products differs. For each ``sessions`` x ``tokens`` cell, after a ``--prefix``-token
context per session, old and new passes alternate (rolled back after each), so the noise of a
shared machine hits both alike; the table gives the fastest wall time, the median CPU time of the
process (at one thread it leaves out the waits for a core) and the largest logit difference.
``--numpy-overhead`` times the numpy pass with stub products (the code around them only).
``--compile MODE`` times today's eager passes against the static body under
``torch.compile(dynamic=False)`` (``compiled_static``), the last column the compile (first pass).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
NEW = HERE.parents[1]


def weights_as_before(weights):
    """``weights`` as 749b008's code reads them (its LM head was ``head``), sharing every tensor."""
    before = type("WeightsBefore", (type(weights),), {"head": property(lambda self: self.lm_head)})
    view = copy.copy(weights)
    view.__class__ = before
    return view


def load_old_forward(before: Path):
    """The old checkout's ``LeanModel`` and ``NumpyPass`` classes, loaded beside this one: its
    ``specdec/lean/forward.py`` and ``numpy_pass.py`` as modules of their own; everything else they import (weights, matmul, kv,
    static) is this checkout's, which the change left as it was (``git diff`` says so)."""
    import importlib.util

    from specdec.lean import attention, numpy_pass

    def load(name: str, path: Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    old_numpy_pass = load("old_numpy_pass", before / "specdec/lean/numpy_pass.py")
    saved = numpy_pass.NumpyPass
    numpy_pass.NumpyPass, numpy_pass.query_block_rows = old_numpy_pass.NumpyPass, attention.query_block_rows
    try:
        return load("old_forward", before / "specdec/lean/forward.py").LeanModel, old_numpy_pass.NumpyPass
    finally:
        numpy_pass.NumpyPass = saved
        del numpy_pass.query_block_rows


def alternate(args) -> None:
    """Two forwards in one process on the same prepared weights, pass by pass: the old code against
    this checkout's, or (``--compile``) this checkout's eager passes against its static body compiled."""
    import statistics

    sys.path.insert(0, str(NEW))  # this checkout, ahead of whatever the environment installed
    import torch

    import specdec
    from specdec.models import cache_dir, load_model

    assert Path(specdec.__file__).is_relative_to(NEW), specdec.__file__
    torch.set_num_threads(args.threads)
    new = load_model(args.target, device="cpu", runtime="lean").lean
    if args.compile:
        first, second = "eager", "compiled"
        models = {first: new, second: compiled_static(new, args, args.compile)}
    else:
        first, second = "before", "after"
        old_model, old_numpy_pass = load_old_forward(args.before)
        old = old_model(weights_as_before(new.w), new.device, table_dir=cache_dir() / "lean-matmul")
        # One set of prepared (packed) weights for both, so that only the code around the products differs.
        old.layers, old.head, old.plan = new.layers, new.lm_head, new.plan
        old.numpy_pass = old_numpy_pass(weights_as_before(new.w), new.layers, new.lm_head)
        models = {first: old, second: new}
    print(f"lean forward ms, {args.target}, CPU ({cpu_model()}), prefix {args.prefix}, {args.threads} thread(s); "
          f"{first} and {second} alternate pass by pass, {args.reps} passes each; product backends "
          + ", ".join(f"{rows}: {new.plan.backend(rows).name}" for rows in (1, 2, 4, 8, 16, 64)))
    print("                    wall ms, fastest pass             CPU ms of the process, median pass")
    print(f"sessions x tokens   {first:>6}     {second:>8}    ratio       {first:>6}     {second:>8}    ratio"
          f"   max |logit diff|   first pass s")
    for sessions in args.sessions:
        kvs = {name: [m.new_kv() for _ in range(sessions)] for name, m in models.items()}
        for name, m in models.items():
            for kv in kvs[name]:
                m.forward([kv], [list(range(1, args.prefix + 1))], [1])
        for tokens in args.tokens:
            feeds = [[7 + i] * tokens for i in range(sessions)]
            times = {name: [] for name in models}
            cpu = {name: [] for name in models}
            logits = {}
            for rep in range(args.reps + 1):
                for name in ((first, second) if rep % 2 else (second, first)):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    logits[name] = models[name].forward(kvs[name], feeds, [tokens] * sessions)
                    times[name].append(1000 * (time.perf_counter() - start))
                    cpu[name].append(1000 * (time.process_time() - start_cpu))
                    for kv in kvs[name]:
                        kv.crop(args.prefix)
            low = {name: min(t[1:]) for name, t in times.items()}  # the first pass warms up (compiles)
            mid = {name: statistics.median(t[1:]) for name, t in cpu.items()}
            diff = float((logits[first] - logits[second]).abs().max())
            print(f"{sessions:>8} x {tokens:<6}  {low[first]:10.2f} {low[second]:10.2f} {low[second] / low[first]:6.3f}"
                  f"   {mid[first]:10.2f} {mid[second]:10.2f} {mid[second] / mid[first]:6.3f}   {diff:.2e}"
                  f"          {times[second][0] / 1000:6.1f}")


def numpy_overhead(args) -> None:
    """The numpy pass around its products, old and new alternating pass by pass: every product is a
    stub (zeros of the product's shape), so what is timed is the code this change touched."""
    import statistics

    sys.path.insert(0, str(NEW))
    import numpy as np
    import torch

    from specdec.lean.numpy_pass import NumpyPass
    from specdec.models import load_model

    torch.set_num_threads(args.threads)
    lean = load_model(args.target, device="cpu", runtime="lean").lean

    class Stub:
        name = "stub"

        @staticmethod
        def mm_numpy(x, rows_out):
            return np.zeros((x.shape[0], rows_out), dtype=np.float32)

    for linear in [entry[i] for entry in lean.layers for i in range(1, 5)] + [lean.lm_head]:
        linear.handles["stub"] = int(linear.weight.shape[0])
    passes = {"before": load_old_forward(args.before)[1](weights_as_before(lean.w), lean.layers, lean.lm_head),
              "after": NumpyPass(lean.w, lean.layers, lean.lm_head)}
    print(f"numpy pass without its products, ms, {args.target}, CPU ({cpu_model()}), prefix {args.prefix}, "
          f"{args.threads} thread(s), {args.reps} passes each, alternating")
    print("tokens   before min  after min  ratio   before med  after med  ratio")
    for tokens in args.tokens:
        kvs = {name: lean.new_kv() for name in passes}
        for name, numpy_pass in passes.items():
            numpy_pass.run(kvs[name], list(range(1, args.prefix + 1)), 1, Stub)
        times = {name: [] for name in passes}
        for rep in range(args.reps + 1):
            for name in (("before", "after") if rep % 2 else ("after", "before")):
                start = time.perf_counter()
                passes[name].run(kvs[name], [7] * tokens, tokens, Stub)
                if rep:
                    times[name].append(1000 * (time.perf_counter() - start))
                kvs[name].crop(args.prefix)
        low = {name: min(t) for name, t in times.items()}
        mid = {name: statistics.median(t) for name, t in times.items()}
        print(f"{tokens:>6}  {low['before']:10.3f} {low['after']:10.3f} {low['after'] / low['before']:6.3f}"
              f"   {mid['before']:10.3f} {mid['after']:10.3f} {mid['after'] / mid['before']:6.3f}")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")


def compiled_static(lean, args, mode: str):
    """A model on ``lean``'s weights whose passes run the static body (``StaticPasses._body``: the one
    layer body at fixed (sessions, tokens) bucket shapes) under ``torch.compile(dynamic=False)``, one
    graph per bucket, with torch's products (inductor cannot trace the numpy or oneDNN handles)."""
    import torch

    from specdec.lean import LeanModel

    model = LeanModel(lean.w, lean.device, backend="torch")
    model.use_static_kv(max(args.sessions), args.prefix + max(args.tokens) + 16, graphs=False)
    torch._dynamo.config.cache_size_limit = 64  # one graph per bucket
    model.static._body = torch.compile(model.static._body, dynamic=False, mode=None if mode == "default" else mode)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, help="a checkout of the code to compare with")
    p.add_argument("--target", default="embedded")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    p.add_argument("--threads", type=int, default=1, help="torch threads (OpenBLAS gets as many)")
    p.add_argument("--compile", default=None, metavar="MODE",
                   help="eager against the static body under torch.compile (a mode, or 'default')")
    p.add_argument("--numpy-overhead", action="store_true",
                   help="the numpy pass with stub products: the code around them, old against new")
    args = p.parse_args()
    if args.numpy_overhead:
        numpy_overhead(args)
    else:
        alternate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
