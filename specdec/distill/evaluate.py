"""Greedy acceptance from teacher-forced agreement, and the shipped draft's export.

Under greedy decoding the draft's proposals in a round are conditioned on the target's accepted text,
so the draft proposes token ``j`` correctly exactly when its top token after the target's first ``j``
answer tokens equals the target's token ``j``. One teacher-forced pass over the target's answer
therefore gives every round's accepted length without running the loop.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_lengths(agree: Sequence[bool], k: int) -> list[int]:
    """Tokens produced per verification (accepted drafts + the one recovered or bonus token)."""
    lengths = []
    position, n = 0, len(agree)
    while position < n:
        run = 0
        while run < k and position + run < n and agree[position + run]:
            run += 1
        produced = min(run + 1, n - position)
        lengths.append(produced)
        position += produced
    return lengths


def mean_accepted_length(lengths: Sequence[int]) -> float | None:
    return sum(lengths) / len(lengths) if lengths else None


def benchmark_items(limit: int | None = None) -> list[dict]:
    """MT-bench (both turns) and HumanEval prompts from the bench's built-in sets, in file order."""
    from specdec.bench.prompts import load_prompts

    items = []
    for conv in load_prompts("mt_bench,humaneval"):
        items.append({"id": conv.id, "category": conv.category, "source": conv.source, "turns": conv.turns,
                      "chat": conv.chat})
    return items[:limit] if limit else items


def target_answers(lm, items: list[dict], max_new_tokens: int, batch_size: int) -> list[dict]:
    """The target's greedy answers, batched: every turn of every item (turn 2 sees its own turn-1 answer)."""
    from tqdm import tqdm

    from specdec.distill.generate import generate_batch
    from specdec.distill.prompts import TrainingPrompt
    from specdec.prompts import encode_chat, encode_text

    results: list[dict] = []
    history = {i: [] for i in range(len(items))}  # item -> [(role, content)]
    turns = max(len(item["turns"]) for item in items)
    bar = tqdm(total=sum(len(item["turns"]) for item in items), desc="target answers", unit="turn")
    for turn in range(turns):
        todo = []
        for i, item in enumerate(items):
            if turn >= len(item["turns"]):
                continue
            if item["chat"]:
                history[i].append(("user", item["turns"][turn]))
                ids = encode_chat(lm.tokenizer, history[i])
            else:
                ids = encode_text(lm.tokenizer, item["turns"][turn])
            todo.append((i, ids))
        todo.sort(key=lambda x: len(x[1]))
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            batch = [(TrainingPrompt(items[i]["category"], "", items[i]["chat"]), ids) for i, ids in chunk]
            records = generate_batch(lm, batch, max_new_tokens, 1, 0.0, 0)
            for (i, ids), record in zip(chunk, records):
                text = lm.tokenizer.decode(record["output_ids"], skip_special_tokens=True)
                if items[i]["chat"]:
                    history[i].append(("assistant", text))
                results.append({"id": items[i]["id"], "category": items[i]["category"], "source": items[i]["source"],
                                "turn": turn + 1, "prompt_ids": ids, "output_ids": record["output_ids"]})
            bar.update(len(chunk))
    bar.close()
    return results


def draft_agreement(draft, prompt_ids: list[int], output_ids: list[int]) -> list[bool]:
    """Per answer token: does the draft's top token after the target's prefix equal the target's token?"""
    import torch

    n = len(output_ids)
    with torch.inference_mode():
        logits = draft.forward(prompt_ids + output_ids, draft.new_cache(), n + 1)[:n]
    return (logits.argmax(-1) == torch.tensor(output_ids)).tolist()


def summarize(lengths_by_key: dict[str, list[int]], k: int) -> dict:
    out = {}
    for key, lengths in sorted(lengths_by_key.items()):
        accepted = sum(min(x - 1, k) for x in lengths)
        drafted = k * len(lengths)
        out[key] = {"rounds": len(lengths), "tokens": sum(lengths),
                    "mean_accepted_length": mean_accepted_length(lengths),
                    "acceptance_rate": accepted / drafted if drafted else None}
    return out


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    import torch

    from specdec.models import check_compatible, load_model

    p = argparse.ArgumentParser(description="Greedy acceptance of a draft on MT-bench + HumanEval (teacher-forced)")
    p.add_argument("--draft", default="embedded-draft")
    p.add_argument("--target", default="embedded")
    p.add_argument("--answers", type=Path, required=True,
                   help="cache of the target's greedy answers (written on the first run, then reused)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N conversations only")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, device="cpu")
    if args.answers.exists():
        answers = json.loads(args.answers.read_text())
    else:
        answers = target_answers(target, benchmark_items(args.limit), args.max_new_tokens, args.batch_size)
        args.answers.parent.mkdir(parents=True, exist_ok=True)
        args.answers.write_text(json.dumps(answers))
    draft = load_model(args.draft, device="cpu")
    check_compatible(target, draft)
    by_key: dict[str, list[int]] = {}
    agree_total = count = 0
    for answer in answers:
        if not answer["output_ids"]:
            continue
        agree = draft_agreement(draft, answer["prompt_ids"], answer["output_ids"])
        agree_total += sum(agree)
        count += len(agree)
        lengths = accepted_lengths(agree, args.num_draft_tokens)
        for key in ("all", answer["source"], f"{answer['source']}/{answer['category']}",
                    f"{answer['source']}/turn{answer['turn']}"):
            by_key.setdefault(key, []).extend(lengths)
    report = {"draft": args.draft, "target": args.target, "k": args.num_draft_tokens,
              "answers": len(answers), "answer_tokens": count, "top1_agreement": agree_total / max(count, 1),
              "by": summarize(by_key, args.num_draft_tokens)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
