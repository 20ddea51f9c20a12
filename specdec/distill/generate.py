"""The target's own answers to the training prompts, with its top-K log-probabilities per position.

On-policy data is what makes a distilled draft agree with its target (DistillSpec; REFERENCES §7):
the draft is trained on exactly the text the target writes, scored by the target's full distribution
(kept as the top K entries, which hold nearly all of the mass). Output: shards ``shard-NNNNN.pt`` under
``--out``; an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from specdec.distill.prompts import TrainingPrompt, build_prompts


class TopKRecorder:
    """A logits processor that keeps the target's top-K log-probabilities at every generated position.

    It runs before any temperature warper (transformers appends those after custom processors), so it
    records the target's untempered distribution.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(scores.float(), dim=-1)
        top = logprobs.topk(self.k, dim=-1)
        self.ids.append(top.indices.to(torch.int32))
        self.logprobs.append(top.values.to(torch.float16))
        return scores


def encode(tokenizer, prompt: TrainingPrompt) -> list[int]:
    from specdec.prompts import encode_chat, encode_text

    return encode_chat(tokenizer, [("user", prompt.text)]) if prompt.chat else encode_text(tokenizer, prompt.text)


def follow_up_prompts(first_turns: Path, tokenizer, limit: int, seed: int) -> list[tuple[TrainingPrompt, list[int]]]:
    """Second turns (as in multi-turn chat): a first prompt, the target's own answer, a follow-up request."""
    from specdec.distill.prompts import follow_up
    from specdec.prompts import encode_chat

    rng = random.Random(seed)
    records = [r for r in read_shards(first_turns) if r["chat"] and r["temperature"] == 0.0 and r["output_ids"]]
    rng.shuffle(records)
    out = []
    for record in records[:limit]:
        first = tokenizer.decode(record["prompt_ids"], skip_special_tokens=False)
        answer = tokenizer.decode(record["output_ids"], skip_special_tokens=True)
        question = follow_up(rng)
        # The first turn's rendered text already ends with the assistant header: append the answer and
        # the next user turn through the template by re-rendering the whole conversation.
        user = _first_user_message(first)
        ids = encode_chat(tokenizer, [("user", user), ("assistant", answer), ("user", question)])
        out.append((TrainingPrompt(f"follow-up/{record['source']}", question, True), ids))
    return out


def _first_user_message(rendered: str) -> str:
    start = rendered.rfind("<|im_start|>user\n")
    end = rendered.find("<|im_end|>", start)
    return rendered[start + len("<|im_start|>user\n"):end] if start >= 0 and end > start else rendered


def read_shards(directory: Path) -> list[dict]:
    """Every record in a data directory's shards, in shard order (answers left empty included)."""
    return [r for shard in sorted(directory.glob("shard-*.pt")) for r in torch.load(shard, weights_only=False)]


def keyed_records(directory: Path) -> list[tuple[str, dict]]:
    """``read_shards`` with each record's key, ``"<directory name>/<shard>:<index in shard>"``: what
    names one answer across tools (the draft's and the EAGLE head's held-out sets share them)."""
    directory = Path(directory)
    return [(f"{directory.name}/{shard.stem}:{i}", record) for shard in sorted(directory.glob("shard-*.pt"))
            for i, record in enumerate(torch.load(shard, weights_only=False))]


def answered_prompts(directories: list[Path]) -> set[tuple[int, ...]]:
    return {tuple(r["prompt_ids"]) for directory in directories for r in read_shards(directory)}


def plan_batches(prompts: list[TrainingPrompt], tokenizer, batch_size: int, max_prompt_tokens: int,
                 encoded: list | None = None):
    """Batches of similar prompt length (less padding), in the prompts' shuffled order by window."""
    encoded = encoded if encoded is not None else [(p, encode(tokenizer, p)) for p in prompts]
    encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
    window = batch_size * 8
    batches = []
    for start in range(0, len(encoded), window):
        chunk = sorted(encoded[start:start + window], key=lambda item: len(item[1]))
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    return batches


@torch.inference_mode()
def generate_batch(lm, batch, max_new_tokens: int, top_k: int, temperature: float, seed: int) -> list[dict]:
    pad = lm.eos_token_ids[0]
    width = max(len(ids) for _, ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, ids) in enumerate(batch):  # left padding: every row's next token sits in the last column
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        mask[row, width - len(ids):] = 1
    recorder = TopKRecorder(top_k)
    torch.manual_seed(seed)
    sampled = temperature > 0
    out = lm.model.generate(
        input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sampled,
        temperature=temperature if sampled else None, top_p=None, top_k=None, logits_processor=[recorder],
        pad_token_id=pad, eos_token_id=list(lm.eos_token_ids),
    )
    generated = out[:, width:]
    ids = torch.stack(recorder.ids, dim=1)  # [B, T, K]
    logprobs = torch.stack(recorder.logprobs, dim=1)
    records = []
    eos = set(lm.eos_token_ids)
    for row, (prompt, prompt_ids) in enumerate(batch):
        tokens = generated[row].tolist()
        length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        records.append({
            "source": prompt.source, "chat": prompt.chat, "temperature": temperature,
            "prompt_ids": prompt_ids, "output_ids": tokens[:length],
            "topk_ids": ids[row, :length].clone(), "topk_logprobs": logprobs[row, :length].clone(),
        })
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--target", default="embedded")
    p.add_argument("--prompts", type=int, default=4000, help="prompts to plan (generation can stop earlier)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--sampled-every", type=int, default=5, help="every N-th batch samples at --temperature (else greedy)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-batches", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--follow-ups-from", type=Path, default=None,
                   help="second turns: follow-up requests after the target's own answers in these shards")
    p.add_argument("--queries", type=Path, default=None,
                   help="answer the user requests in this queries.jsonl (from 'train-draft queries') instead of "
                        "the built-in prompt templates")
    p.add_argument("--exclude", type=Path, action="append", default=[],
                   help="skip prompts already answered in these shard directories (to grow a data set)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's weights while generating: bfloat16 is faster where the CPU has bf16 "
                        "matmuls (AMX); top-K differ from float32's only near ties")
    args = p.parse_args(argv)
    from tqdm import tqdm

    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.target, device="cpu", dtype=getattr(torch, args.dtype))
    if args.follow_ups_from:
        encoded = follow_up_prompts(args.follow_ups_from, lm.tokenizer, args.prompts, args.seed)
        batches = plan_batches([], lm.tokenizer, args.batch_size, args.max_prompt_tokens + 256, encoded)
    else:
        if args.queries:
            from specdec.distill.queries import read_queries

            prompts = [TrainingPrompt("self-instruct", text, True) for text in read_queries(args.queries)[: args.prompts]]
        else:
            prompts = build_prompts(args.prompts, seed=args.seed)
        batches = plan_batches(prompts, lm.tokenizer, args.batch_size, args.max_prompt_tokens)
    if args.exclude:
        done = answered_prompts(args.exclude)
        encoded = [item for batch in batches for item in batch if tuple(item[1]) not in done]
        print(f"{sum(map(len, batches)) - len(encoded)} prompts already answered in {', '.join(map(str, args.exclude))}")
        batches = plan_batches([], lm.tokenizer, args.batch_size, 1 << 30, encoded)
    if args.max_batches is not None:
        batches = batches[: args.max_batches]
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = 0
    start = time.monotonic()
    bar = tqdm(batches, desc="target answers", unit="batch")
    for index, batch in enumerate(bar):
        shard = args.out / f"shard-{index:05d}.pt"
        if shard.exists():
            continue
        temperature = args.temperature if (index % args.sampled_every == args.sampled_every - 1) else 0.0
        records = generate_batch(lm, batch, args.max_new_tokens, args.top_k, temperature, args.seed * 100003 + index)
        tmp = shard.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(shard)  # a shard is either complete or absent
        tokens += sum(len(r["output_ids"]) for r in records)
        bar.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.monotonic() - start):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
