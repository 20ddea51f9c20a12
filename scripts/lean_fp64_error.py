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
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="then this many one-token steps (the float64 model's greedy tokens) per prompt")
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
        # The float64 model's greedy continuation, and its logits at each decode step.
        continuations, exact_steps = [], []
        for ids, logits in zip(prompts, exact):
            tokens, steps = list(ids), []
            for _ in range(args.decode_tokens):
                tokens.append(int(logits[-1].argmax()))
                logits = reference(input_ids=torch.tensor([tokens])).logits[0]
                steps.append(logits[-1])
            continuations.append(tokens[len(ids):])
            exact_steps.append(steps)

        def worst_errors(prefill, step) -> tuple[float, float]:
            """Largest |fp32 - float64| logit over every prefill position and over the decode steps."""
            worst_prefill = worst_decode = 0.0
            for ids, want, tokens, wants in zip(prompts, exact, continuations, exact_steps):
                state, logits = prefill(ids)
                worst_prefill = max(worst_prefill, float((logits.double() - want).abs().max()))
                for token, want_step in zip(tokens, wants):
                    logits = step(state, token)
                    worst_decode = max(worst_decode, float((logits[-1].double() - want_step).abs().max()))
            return worst_prefill, worst_decode

        def hf_prefill(ids):
            out = lm.model(input_ids=torch.tensor([ids]), use_cache=True)
            return {"cache": out.past_key_values}, out.logits[0]

        def hf_step(state, token):
            out = lm.model(input_ids=torch.tensor([[token]]), past_key_values=state["cache"], use_cache=True)
            state["cache"] = out.past_key_values
            return out.logits[0]

        hf = worst_errors(hf_prefill, hf_step)
    print(f"{len(prompts)} prompts, {args.threads} threads: max |logit - float64 logit| over every prefill position; "
          f"over {args.decode_tokens} one-token steps each")
    print(f"  transformers fp32: {hf[0]:.2e}; {hf[1]:.2e}")
    variants = [("lean, measured backend table", None)] + [(f"lean, every product on {name}", name)
                                                            for name in available_backends(torch.device("cpu"))]
    for label, backend in variants:
        lean = LeanModel.from_hf(lm.model, backend=backend) if backend else LeanModel.from_hf(lm.model)

        def lean_prefill(ids, lean=lean):
            kv = lean.new_kv()
            return kv, lean.forward([kv], [ids], [len(ids)])

        def lean_step(kv, token, lean=lean):
            return lean.forward([kv], [[token]], [1])

        prefill, decode = worst_errors(lean_prefill, lean_step)
        print(f"  {label}: {prefill:.2e}; {decode:.2e}")

if __name__ == "__main__":
    main()
