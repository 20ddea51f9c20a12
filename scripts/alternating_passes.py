"""Passes of different sizes in alternation, as a verifier runs them, against each size alone.

    OPENBLAS_CORETYPE= python scripts/alternating_passes.py [--backend auto|mkldnn|numpy|torch] [--sizes 1,3]

The backend table times each backend alone. A verifier alternates a plain round's one-token pass
with a speculative round's k + 1-token pass; if the two sizes run on different threading runtimes
(OpenBLAS's threads, torch's OpenMP pool), each pass finds the other runtime's workers still
spinning. This prints the median ms of each size alone and in alternation, after a 64-token prefix,
for the plan ``--backend`` gives (``auto``: the measured plan; ``--mixed``: OpenBLAS for one row and
oneDNN for more, whatever the table says).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--mixed", action="store_true", help="OpenBLAS for one row, oneDNN for more")
    parser.add_argument("--sizes", default="1,3")
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.lean import LeanModel
    from specdec.lean.matmul import available_backends
    from specdec.models import load_model

    lm = load_model(args.target, device="cpu", dtype=torch.float32, runtime="hf")
    lean = LeanModel.from_hf(lm.model, backend=None if args.backend == "auto" else args.backend)
    if args.mixed:  # what the table picked before plans kept to one runtime
        every = available_backends(torch.device("cpu"))
        lean.plan.backends = {name: every[name] for name in ("numpy", "mkldnn")}
        for linear in lean.plan.linears:
            linear.prepare(lean.plan.backends.values())
        lean.plan.choice = {bucket: "numpy" if bucket == 1 else "mkldnn" for bucket in lean.plan.choice}
        lean.plan._by_rows.clear()
    print("plan:", {bucket: lean.plan.backend(bucket).name for bucket in lean.plan.buckets})
    sizes = [int(n) for n in args.sizes.split(",")]
    kv = lean.new_kv()
    lean.forward([kv], [list(range(100, 164))], [1])

    def median_ms(pattern: list[int]) -> dict[int, float]:
        times: dict[int, list[float]] = {n: [] for n in pattern}
        for _ in range(args.reps):
            for n in pattern:
                kv.crop(64)
                start = time.perf_counter()
                lean.forward([kv], [list(range(5, 5 + n))], [n])
                times[n].append(time.perf_counter() - start)
        return {n: sorted(v)[len(v) // 2] * 1e3 for n, v in times.items()}

    for n in sizes:
        print(f"{n} tokens alone: {median_ms([n])[n]:.1f} ms")
    alternating = median_ms(sizes)
    print("alternating " + ", ".join(map(str, sizes)) + ": " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in alternating.items()))


if __name__ == "__main__":
    main()
