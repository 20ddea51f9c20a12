"""The lean runtime's forward against transformers', and the matrix-product backends behind it.

    OPENBLAS_CORETYPE= OPENBLAS_L2_SIZE= python scripts/forward_backends.py [--target embedded] [--threads 2]

Prints, in one run: the backend table (ms for every product of a forward -- each layer's fused QKV,
O, fused gate/up and down, plus the LM head -- per row count and backend, min of reps, and the
backend picked); transformers' forward against the lean one over 1..16 new tokens after a 64-token
prefix (logits for every new token, min of reps, interleaved so that load hits both alike); and
the lean forward's matrix products alone on the backend it uses for that row count; and the same
pass through the torch forward (torch's ops around the products) beside the numpy pass it runs.
(Unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for the benchmark only: they are there for old
OpenBLAS builds and slow numpy's.)
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch


def openblas_config() -> str:
    from threadpoolctl import threadpool_info

    for library in threadpool_info():
        if library["internal_api"] == "openblas":
            return (f"OpenBLAS {library['version']} {library['architecture']} {library['threading_layer']} "
                    f"(threads {library['num_threads']})")
    return "OpenBLAS not found"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--real-prompts", type=int, default=8,
                        help="also compare logits on this many MT-bench and as many HumanEval prompts (0: skip)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens decoded one by one per real prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import numpy  # noqa: F401

    from specdec.kv import KVSession
    from specdec.lean import LeanModel
    from specdec.models import load_model

    lm = load_model(args.target, device="cpu", dtype=torch.float32, runtime="hf")
    buckets = (1, 2, 4, 8, 16)
    start = time.perf_counter()
    lean = LeanModel.from_hf(lm.model, buckets=buckets, reps=5, timed_bytes=None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; numpy {numpy.__version__}: {openblas_config()}")
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')!r} OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE')!r}")
    print(f"lean load (fuse + backend table): {time.perf_counter() - start:.1f} s")
    plan = lean.plan
    names = list(next(iter(plan.table.values())))
    print("\nbackend table: ms for all products of one forward (30 layers' QKV, O, gate/up, down + LM head)")
    print("rows " + "".join(f"{name:>9}" for name in names) + "   picked")
    for bucket, row in plan.table.items():
        print(f"{bucket:>4} " + "".join(f"{row[name] * 1e3:9.1f}" for name in names) + f"   {plan.choice[bucket]}")

    rng = random.Random(0)
    vocab = min(lm.vocab_size, 1000)
    prefix = [rng.randrange(1, vocab) for _ in range(args.prefix)]
    hf_session = KVSession(lm)
    hf_session.forward(prefix + [1, 2], 1)
    kv = lean.new_kv()
    lean.forward([kv], [prefix + [1, 2]], [1])
    sizes = range(1, args.max_tokens + 1)
    hf_best = {n: float("inf") for n in sizes}
    lean_best = dict(hf_best)
    mm_best = dict(hf_best)
    torch_ops_best = dict(hf_best)  # the same pass with torch's ops around the products (before numpy_pass)
    worst = 0.0
    for _ in range(args.reps):
        for n in sizes:
            extra = [rng.randrange(1, vocab) for _ in range(n)]
            hf_session.rollback(args.prefix)
            t0 = time.perf_counter()
            expected = hf_session.forward(prefix + extra, n)
            hf_best[n] = min(hf_best[n], time.perf_counter() - t0)
            kv.crop(args.prefix)
            t0 = time.perf_counter()
            got = lean.forward([kv], [extra], [n])
            lean_best[n] = min(lean_best[n], time.perf_counter() - t0)
            worst = max(worst, float((got - expected).abs().max()))
            numpy_pass, lean.numpy_pass = lean.numpy_pass, None
            kv.crop(args.prefix)
            t0 = time.perf_counter()
            lean.forward([kv], [extra], [n])
            torch_ops_best[n] = min(torch_ops_best[n], time.perf_counter() - t0)
            lean.numpy_pass = numpy_pass
            backend = plan.backend(n)
            mm_best[n] = min(mm_best[n], plan.time_products(backend, n, reps=1))
    print(f"\nforward over n new tokens after a {args.prefix}-token prefix, logits for all n, min of {args.reps} "
          f"(max |lean - transformers| logit diff {worst:.2e})")
    print("(lean: one session's pass as it runs, activations in numpy; torch ops: the same pass through the torch forward)")
    print("   n  transformers ms  lean ms  lean/hf  backend  products ms  lean/products  torch ops ms  torch ops/products")
    for n in sizes:
        print(f"{n:>4} {hf_best[n] * 1e3:16.1f} {lean_best[n] * 1e3:8.1f} {lean_best[n] / hf_best[n]:8.2f}"
              f"  {plan.backend(n).name:>7} {mm_best[n] * 1e3:12.1f} {lean_best[n] / mm_best[n]:14.2f}"
              f" {torch_ops_best[n] * 1e3:13.1f} {torch_ops_best[n] / mm_best[n]:19.2f}")

    if args.real_prompts:
        real_prompt_diff(lm, lean, args.real_prompts, args.decode_tokens)


def real_prompt_diff(lm, lean, count: int, decode_tokens: int) -> None:
    """Largest |lean - transformers| logit on real prompts: the prompt's prefill (every position's
    logits) and then ``decode_tokens`` greedy steps of one token (the decode path's backend)."""
    from specdec.bench.prompts import load_prompts
    from specdec.prompts import encode_chat, encode_text

    prompts = []
    for name in ("mt_bench", "humaneval"):
        for conv in load_prompts(name, count):
            text = conv.turns[0]
            prompts.append(encode_chat(lm.tokenizer, [("user", text)]) if conv.chat else encode_text(lm.tokenizer, text))
    worst_prefill = worst_decode = 0.0
    near_ties = 0
    for ids in prompts:
        kv = lean.new_kv()
        with torch.inference_mode():
            want = lm.model(input_ids=torch.tensor([ids])).logits[0].float()
        got = lean.forward([kv], [ids], [len(ids)])
        worst_prefill = max(worst_prefill, float((got - want).abs().max()))
        tokens = list(ids)
        for _ in range(decode_tokens):
            tokens.append(int(got[-1].argmax()))
            got = lean.forward([kv], [tokens[-1:]], [1])
            with torch.inference_mode():
                want = lm.model(input_ids=torch.tensor([tokens])).logits[0, -1:].float()
            worst_decode = max(worst_decode, float((got - want).abs().max()))
            top = want[0].topk(2).values
            near_ties += int(float(top[0] - top[1]) <= 1e-4)
    print(f"\nreal prompts ({len(prompts)}: MT-bench turn 1 with the chat template, HumanEval as text): max |lean - "
          f"transformers| logit {worst_prefill:.2e} over every prefill position, {worst_decode:.2e} over "
          f"{decode_tokens} one-token decode steps each ({near_ties} steps with the top two logits within 1e-4)")


if __name__ == "__main__":
    main()
