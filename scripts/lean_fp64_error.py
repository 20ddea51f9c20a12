"""How far the lean forward's fp32 logits are from the same model in float64, beside transformers' fp32.

    .venv/bin/python scripts/lean_fp64_error.py [--target embedded] [--threads 2] [--prompts 4]

A difference between two fp32 forwards says only that they round differently; the float64 forward
says which is closer. Prefill logits at every position of MT-bench turn-1 prompts (chat template) and
HumanEval prompts; the lean forward with its measured backend table and with every product on each
backend alone.
"""

from __future__ import annotations

import argparse
import copy

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts from each of MT-bench and HumanEval")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.prompts import load_prompts
    from specdec.lean import LeanModel
    from specdec.lean.matmul import available_backends
    from specdec.models import load_model
    from specdec.prompts import encode_chat, encode_text

    lm = load_model(args.target, device="cpu", dtype=torch.float32, runtime="hf")
    reference = copy.deepcopy(lm.model).double()
    prompts = []
    for name in ("mt_bench", "humaneval"):
        for conv in load_prompts(name, args.prompts):
            text = conv.turns[0]
            prompts.append(encode_chat(lm.tokenizer, [("user", text)]) if conv.chat else encode_text(lm.tokenizer, text))
    with torch.inference_mode():
        exact = [reference(input_ids=torch.tensor([ids])).logits[0] for ids in prompts]
        hf = max(float((lm.model(input_ids=torch.tensor([ids])).logits[0].double() - want).abs().max())
                 for ids, want in zip(prompts, exact))
    print(f"{len(prompts)} prompts, {args.threads} threads: max |logit - float64 logit|")
    print(f"  transformers fp32: {hf:.2e}")
    variants = [("lean, measured backend table", None)] + [(f"lean, every product on {name}", name)
                                                            for name in available_backends(torch.device("cpu"))]
    for label, backend in variants:
        lean = LeanModel.from_hf(lm.model, backend=backend) if backend else LeanModel.from_hf(lm.model)
        worst = max(float((lean.forward([lean.new_kv()], [ids], [len(ids)]).double() - want).abs().max())
                    for ids, want in zip(prompts, exact))
        print(f"  {label}: {worst:.2e}")


if __name__ == "__main__":
    main()
