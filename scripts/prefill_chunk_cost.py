"""What chunked prefill saves: one pass over decoding sessions' rows, a prompt chunk alone, and both
packed in one pass, in-process on the embedded target (docs/benchmarks.md, third sweep).

    .venv/bin/python scripts/prefill_chunk_cost.py [--sessions 7] [--reps 5] [--chunks 32,64,128,300]

Each figure is the best of --reps passes; between passes every decoding session rolls back to its
context, so each pass does the same work.
"""

from __future__ import annotations

import argparse
import random
import time

from specdec.kv import KVSession
from specdec.models import load_model
from specdec.ragged import ForwardRow, batched_forward

VOCAB = 1000  # ids drawn below this: timing does not depend on which tokens they are


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=7, help="decoding sessions in the pass")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunks", default="32,64,128,300", help="prompt chunk lengths (tokens)")
    args = parser.parse_args()
    rng = random.Random(0)
    lm = load_model("embedded")

    decoding = []
    for _ in range(args.sessions):  # contexts of 200-400 tokens, as in an MT-bench second turn
        kv, context = KVSession(lm), [rng.randrange(VOCAB) for _ in range(rng.randrange(200, 400))]
        kv.forward(context, 1)
        decoding.append((kv, context))

    def decode_rows() -> list[ForwardRow]:
        return [ForwardRow(kv, context + [rng.randrange(VOCAB)], 1) for kv, context in decoding]

    def best_ms(pass_rows) -> float:
        times = []
        for _ in range(args.reps):
            rows = pass_rows()
            started = time.perf_counter()
            batched_forward(lm, rows)
            times.append(time.perf_counter() - started)
            for kv, context in decoding:
                kv.rollback(len(context))  # back to the context alone
        return min(times) * 1e3

    chunks = [int(n) for n in args.chunks.split(",")]
    decode_ms = best_ms(decode_rows)
    print(f"{args.sessions} decoding rows: {decode_ms:.0f} ms")
    print("| chunk (tokens) | alone | with the decoding rows | as separate passes |")
    print("|---:|---:|---:|---:|")
    prompt = [rng.randrange(VOCAB) for _ in range(max(chunks))]
    for n in chunks:
        alone = best_ms(lambda: [ForwardRow(KVSession(lm), prompt[:n], 1)])
        mixed = best_ms(lambda: decode_rows() + [ForwardRow(KVSession(lm), prompt[:n], 1)])
        print(f"| {n} | {alone:.0f} ms | {mixed:.0f} ms | {alone + decode_ms:.0f} ms |")


if __name__ == "__main__":
    main()
