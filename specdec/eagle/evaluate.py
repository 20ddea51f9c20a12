"""Offline greedy acceptance of the EAGLE head, by teacher forcing, and its step cost.

For a sequence whose answer starts at position P, an anchor n >= P is a round's start: the tokens
x_0..x_n are committed and the target's features f_0..f_{n-1} are known. The head drafts d_1..d_k
greedily (its own features past f_{n-1}); draft j is accepted iff d_1..d_j equal the target's greedy
tokens labels[n]..labels[n+j-1]. Drafting conditions draft j on d_1..d_{j-1}; on an accepted prefix
those are the text's tokens, so one unroll of the training-time test over the text (``EagleHead.unroll``,
depth k) gives every anchor's drafts at once, identical to ``HeadSession`` drafting (tested). That holds
where the text is the target's greedy path: a window in which the text leaves it (x_{m+1} != labels[m],
e.g. answers generated in bfloat16) is left out and counted (``off_greedy_windows``).

Reported: prefix acceptance P(1..j), conditional acceptance P(j | 1..j-1), E = 1 + sum_j P(1..j)
(tokens per round at a fixed k), the mean accepted length of simulated greedy rounds over each answer
(as ``train-draft eval`` reports for the independent draft), and first-draft agreement.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from specdec.eagle.drafting import HeadSession
from specdec.eagle.head import EagleHead
from specdec.eagle.train import collate, make_batches


@torch.no_grad()
def greedy_drafts(head: EagleHead, records: list[dict], k: int, token_budget: int = 4096) -> list[torch.Tensor]:
    """Per record, [k, T-1]: row d-1, column i is the depth-d greedy draft from the anchor at position
    i - d + 2 (the head's step-d output at position i + 1)."""
    out: list[torch.Tensor | None] = [None] * len(records)
    for indices in make_batches(records, token_budget, random.Random(0)):
        batch = collate([records[i] for i in indices])
        unrolled = head.unroll(batch.tokens, batch.features_in, batch.positions, k)
        ids = torch.stack([head.greedy_tokens(g) for g in unrolled.outputs], dim=1)  # [B, k, N]
        for row, i in enumerate(indices):
            out[i] = ids[row, :, : len(records[i]["input_ids"]) - 1]
    return out


def anchor_acceptance(drafts: torch.Tensor, record: dict, k: int) -> tuple[list[list[bool]], list[bool]]:
    """For each anchor n = P..T-2: the accepted flags of depths 1..min(k, T-1-n) (stopping at the first
    rejection), and whether the text stays on the target's greedy path over that window."""
    x = record["input_ids"].long()
    labels = record["labels"].long()
    t = len(x)
    accepted, on_path = [], []
    for n in range(record["answer_start"], t - 1):
        flags, ok = [], True
        for d in range(1, min(k, t - 1 - n) + 1):
            if flags and not flags[-1]:  # past the first rejection nothing is accepted
                flags.append(False)
                continue
            if d >= 2 and int(x[n + d - 1]) != int(labels[n + d - 2]):
                ok = False  # the text left the greedy path: drafting would have fed other tokens
            flags.append(int(drafts[d - 1, n + d - 2]) == int(labels[n + d - 1]))
        accepted.append(flags)
        on_path.append(ok)
    return accepted, on_path


def acceptance_stats(windows: list[list[bool]], k: int) -> dict:
    """P(1..j) over anchors with a full k-window, conditional acceptance, E = 1 + sum_j P(1..j)."""
    full = [w for w in windows if len(w) == k]
    prefix = [sum(w[j] for w in full) / len(full) if full else None for j in range(k)]
    conditional = [prefix[0]] + [prefix[j] / prefix[j - 1] if prefix[j - 1] else None for j in range(1, k)] if full else []
    return {"anchors": len(full), "prefix_acceptance": prefix, "conditional_acceptance": conditional,
            "expected_tokens_per_round": 1 + sum(prefix) if full else None}


def simulated_rounds(windows: list[list[bool]], k: int) -> list[int]:
    """Tokens per greedy round over one answer (accepted drafts + the recovered/bonus token), walking
    from the first anchor: a round at anchor n produces a + 1 tokens (a = its accepted drafts)."""
    lengths, n = [], 0
    while n < len(windows):
        window = windows[n]
        accepted = next((j for j, ok in enumerate(window[:k]) if not ok), len(window[:k]))
        produced = min(accepted + 1, len(windows) - n)  # the answer's tokens still to come
        lengths.append(produced)
        n += produced
    return lengths


def evaluate_records(head: EagleHead, records: list[dict], k: int, token_budget: int = 4096) -> dict:
    """The report over ``records`` (feature records with ``answer_start``), overall and per ``source``."""
    groups: dict[str, dict] = {}
    for record, drafts in zip(records, greedy_drafts(head, records, k, token_budget)):
        windows, on_path = anchor_acceptance(drafts, record, k)
        keys = ["all", str(record.get("source", "?"))] + ([f"{record['source']}/turn{record['turn']}"] if "turn" in record else [])
        for key in keys:
            g = groups.setdefault(key, {"windows": [], "off": 0, "first": [0, 0], "rounds": []})
            g["windows"].extend(w for w, ok in zip(windows, on_path) if ok)
            g["off"] += sum(1 for ok in on_path if not ok)
            g["first"][0] += sum(1 for w in windows if w and w[0])
            g["first"][1] += sum(1 for w in windows if w)
            g["rounds"].extend(simulated_rounds(windows, k))
    report = {}
    for key, g in sorted(groups.items()):
        report[key] = {"first_draft_agreement": g["first"][0] / max(1, g["first"][1]), "answer_positions": g["first"][1],
                       **acceptance_stats(g["windows"], k), "off_greedy_windows": g["off"],
                       "rounds": len(g["rounds"]),
                       "mean_accepted_length_rounds": sum(g["rounds"]) / len(g["rounds"]) if g["rounds"] else None}
    return report


@torch.inference_mode()
def step_times(head: EagleHead, target, prefix: int = 64, reps: int = 30) -> dict:
    """Seconds of one head drafting step and of one target step (one token), both after a ``prefix``-
    token cache, fp32, minimum over ``reps`` (the target's through the repo's forward path)."""
    from specdec.costs import measure_forward_curve

    gen = torch.Generator().manual_seed(0)
    vocab = min(head.config.token_vocab_size, 1000)
    tokens = torch.randint(1, vocab, (prefix + 2,), generator=gen).tolist()
    features = torch.randn((prefix, head.config.hidden_size), generator=gen)
    session = HeadSession(head)
    with torch.inference_mode():  # as drafting runs it
        g = session.step(tokens[1: prefix + 1], features)[-1]
        token = int(head.greedy_tokens(g))  # the draft a step feeds comes from the step before
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            out = session.step([token], g[None])[-1]  # one drafting step: fusion, layer, norm, LM head, argmax
            int(head.greedy_tokens(out))
            best = min(best, time.perf_counter() - start)
            session.cache.crop(prefix)
    target_s = measure_forward_curve(target, 1, prefix=prefix, reps=reps)[0]
    return {"head_step_ms": best * 1e3, "target_step_ms": target_s * 1e3, "ratio": best / target_s,
            "prefix": prefix, "threads": torch.get_num_threads(), "target_runtime": target.runtime}


def benchmark_records(target, path: Path, per_source: int, max_new_tokens: int, batch_size: int) -> list[dict]:
    """MT-bench (both turns) and HumanEval answers of the target (evaluation only), cached at ``path``
    in ``train-draft eval``'s format, teacher-forced into feature records."""
    from specdec.distill.evaluate import benchmark_items, target_answers
    from specdec.eagle.features import teacher_force

    if path.exists():
        answers = json.loads(path.read_text())
    else:
        items, queues = [], {}
        for item in benchmark_items():  # categories in turn within each set (MT-bench's file is by category)
            queues.setdefault(item["source"], {}).setdefault(item["category"], []).append(item)
        for by_category in queues.values():
            ranked = sorted(((depth, order, item) for order, queue in enumerate(by_category.values())
                             for depth, item in enumerate(queue)), key=lambda x: x[:2])
            items.extend(item for _, _, item in ranked[:per_source])
        answers = target_answers(target, items, max_new_tokens, batch_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(answers))
    answers = [a for a in answers if a["output_ids"]]
    forced = teacher_force(target, [a["prompt_ids"] + a["output_ids"] for a in answers])
    return [{"key": f"{a['source']}/{a['id']}/{a['turn']}", "source": a["source"], "turn": a["turn"],
             "answer_start": len(a["prompt_ids"]), **f} for a, f in zip(answers, forced)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft eagle-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, type=Path, help="a saved head (eagle-train's best/ or head/)")
    p.add_argument("--target", default="embedded")
    p.add_argument("--heldout", type=Path, default=None, help="eagle-train's heldout.json: its held-out sequences")
    p.add_argument("--features", type=Path, action="append", default=[], help="also every sequence in these feature dirs")
    p.add_argument("--benchmark-answers", type=Path, default=None,
                   help="MT-bench + HumanEval answers of the target (JSON, as `train-draft eval --answers`): "
                        "generated there on the first run, evaluation only")
    p.add_argument("--benchmark-per-source", type=int, default=16, help="conversations per benchmark set when generating")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("-k", "--num-draft-tokens", type=int, default=5)
    p.add_argument("--timing", action="store_true", help="time one head step against one target step")
    p.add_argument("--max-head-tokens", type=int, default=None,
                   help="keep the head's first N ids (most frequent first), as the eagle drafter does "
                        "(specdec.eagle.drafter.DRAFTING_HEAD_TOKENS)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    from specdec.eagle.features import read_feature_shards
    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, device="cpu")
    head = EagleHead.load(args.head, target, args.max_head_tokens).for_drafting()
    report: dict = {"head": str(args.head), "target": args.target, "k": args.num_draft_tokens,
                    "head_tokens": len(head.head_token_ids)}
    sets: dict[str, list[dict]] = {}
    if args.heldout:
        held = json.loads(args.heldout.read_text())
        keys = set(held["keys"])
        sets["heldout"] = [r for r in read_feature_shards([Path(f) for f in held["features"]]) if r["key"] in keys]
    if args.features:
        sets["features"] = read_feature_shards(args.features)
    if args.benchmark_answers:
        sets["benchmark"] = benchmark_records(target, args.benchmark_answers, args.benchmark_per_source,
                                              args.max_new_tokens, args.batch_size)
    for name, records in sets.items():
        report[name] = evaluate_records(head, records, args.num_draft_tokens) if records else {}
        report[name]["sequences"] = len(records)
    if args.timing:
        report["timing"] = step_times(head, target)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
