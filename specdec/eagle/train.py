"""Train the EAGLE head on the target's teacher-forced features (``eagle-features`` shards).

Row i of a sequence x_0..x_{T-1} is the head's position s = i + 1: input (x_s, f_{s-1}), targets the
target's feature f_s and its greedy token ``labels[s]`` (mapped into the reduced head; a label outside
the head carries no token loss). Loss per step d of EAGLE-3's training-time test (``EagleHead.unroll``,
d = 1..``--depth``, weight ``--depth-decay``^(d-1)): cross-entropy on the target's greedy token plus
``--feature-weight`` x smooth-L1 on the feature, both features divided by the batch's feature RMS
(scale-free across targets). Prompt rows weigh ``--prompt-weight``, answer rows 1.

AdamW on the fusion and the layer (and the LM head and norm with ``--train-lm-head``), warm-up then
cosine to 10 %. Deterministic for a seed: batch order is a function of (seed, epoch), so a rerun
resumes from ``checkpoint.pt`` at the saved step with the same batches as an uninterrupted run.
Logs ``train_log.jsonl`` (train loss, held-out loss and per-depth agreement); writes ``best/`` (best
held-out score) and ``head/`` (the weights the run ended with) in the head's save format.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.distill.train import budget_batches, head_rows
from specdec.eagle.features import read_feature_shards
from specdec.eagle.head import EagleHead
from specdec.lm import HEAD_TOKEN_IDS_FILE


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, N] x_s at row i = s - 1
    features_in: torch.Tensor  # [B, N, H] the target's f_{s-1}
    features_out: torch.Tensor  # [B, N, H] the target's f_s
    labels: torch.Tensor  # [B, N] the target's greedy token after x_0..x_s
    mask: torch.Tensor  # [B, N] real rows
    answer: torch.Tensor  # [B, N] rows inside the target's answer
    positions: torch.Tensor  # [N] = 1..N


def collate(records: list[dict]) -> Batch:
    n = max(len(r["input_ids"]) for r in records) - 1
    hidden = records[0]["features"].shape[-1]
    b = len(records)
    tokens = torch.zeros((b, n), dtype=torch.long)
    labels = torch.zeros((b, n), dtype=torch.long)
    f_in = torch.zeros((b, n, hidden), dtype=torch.float32)
    f_out = torch.zeros((b, n, hidden), dtype=torch.float32)
    mask = torch.zeros((b, n), dtype=torch.bool)
    answer = torch.zeros((b, n), dtype=torch.bool)
    for row, r in enumerate(records):
        t = len(r["input_ids"]) - 1
        tokens[row, :t] = r["input_ids"][1:].long()
        labels[row, :t] = r["labels"][1:].long()
        f_in[row, :t] = r["features"][:-1].float()
        f_out[row, :t] = r["features"][1:].float()
        mask[row, :t] = True
        answer[row, :t] = torch.arange(1, t + 1) >= r["answer_start"]
    return Batch(tokens, f_in, f_out, labels, mask, answer, torch.arange(1, n + 1))


def make_batches(records: list[dict], token_budget: int, rng: random.Random) -> list[list[int]]:
    """Indices into ``records`` in length-sorted buckets of at most ``token_budget`` padded rows, shuffled."""
    return budget_batches(range(len(records)), lambda i: len(records[i]["input_ids"]), token_budget, rng,
                          order_key=lambda i: (len(records[i]["input_ids"]), records[i]["key"]))


def batch_loss(head: EagleHead, batch: Batch, position_of: torch.Tensor, depth: int, depth_decay: float = 0.8,
               feature_weight: float = 1.0, prompt_weight: float = 1.0, soft_labels: bool = False,
               served_head_tokens: int | None = None) -> tuple[torch.Tensor, dict]:
    """The training-time-test loss and per-depth teacher-forced agreement (answer rows).

    Token loss: cross-entropy against the target's greedy token, or (``soft_labels``, EAGLE-1's
    classification loss) against the target's whole distribution over the head's ids, read from the
    target's own feature f_s through the head's frozen norm and LM head (the target's rows): p itself,
    restricted to the head, at no cost beyond one product, and far more signal per token than its argmax.
    ``served_head_tokens``: logits over the head's first N ids only, as a drafter keeping N serves it
    (labels past them carry no token loss)."""
    unrolled = head.unroll(batch.tokens, batch.features_in, batch.positions, depth)
    soft = None
    if soft_labels:
        if head.config.train_lm_head:
            raise ValueError("soft labels read p through the head's LM head: it must stay the target's (frozen)")
        with torch.no_grad():
            soft = torch.softmax(head.token_logits(batch.features_out, served_head_tokens).float(), dim=-1)  # [B, N, head ids]
    scale = batch.features_out[batch.mask].pow(2).mean().sqrt().clamp(min=1e-6)
    rows = torch.arange(batch.tokens.shape[1])
    weights = torch.where(batch.answer, 1.0, prompt_weight)
    total = torch.zeros(())
    info: dict = {}
    for d, g in enumerate(unrolled.outputs, start=1):
        valid = batch.mask & (rows >= d - 1)[None, :]
        w = weights[valid]
        target_rows = position_of[batch.labels[valid]]  # -1: the label is outside the head
        if served_head_tokens is not None:
            target_rows = torch.where(target_rows < served_head_tokens, target_rows, -1)
        logits = head.token_logits(g[valid], served_head_tokens).float()
        known = target_rows >= 0
        if soft is not None:
            known = torch.ones_like(known)
            ce = -(soft[valid] * F.log_softmax(logits, dim=-1)).sum(-1)
        else:
            ce = F.cross_entropy(logits[known], target_rows[known], reduction="none")
        ce = (ce * w[known]).sum() / w[known].sum().clamp(min=1e-6)
        feat = F.smooth_l1_loss(g[valid].float() / scale, batch.features_out[valid] / scale, reduction="none").mean(-1)
        feat = (feat * w).sum() / w.sum().clamp(min=1e-6)
        total = total + depth_decay ** (d - 1) * (ce + feature_weight * feat)
        hit = (logits.argmax(-1) == target_rows) & batch.answer[valid]
        info[f"ce{d}"] = float(ce.detach())
        info[f"feat{d}"] = float(feat.detach())
        info[f"acc{d}"] = float(hit.sum()) / max(1, int(batch.answer[valid].sum()))
        info[f"n{d}"] = int(batch.answer[valid].sum())
    info["loss"] = float(total.detach())
    return total, info


@torch.no_grad()
def evaluate(head: EagleHead, records: list[dict], position_of: torch.Tensor, depth: int, token_budget: int,
             **loss_kwargs) -> dict:
    """Held-out loss and teacher-forced agreement per depth; ``score`` = 1 + sum_j prod_{e<=j} acc_e
    (the mean accepted length those conditional agreements imply)."""
    was_training = head.training
    head.eval()
    totals: dict[str, float] = {}
    for indices in make_batches(records, token_budget, random.Random(0)):
        _, info = batch_loss(head, collate([records[i] for i in indices]), position_of, depth, **loss_kwargs)
        for d in range(1, depth + 1):
            n = info[f"n{d}"]
            totals[f"hits{d}"] = totals.get(f"hits{d}", 0.0) + info[f"acc{d}"] * n
            totals[f"n{d}"] = totals.get(f"n{d}", 0) + n
        weight = info["n1"]
        totals["loss"] = totals.get("loss", 0.0) + info["loss"] * weight
        totals["weight"] = totals.get("weight", 0) + weight
    head.train(was_training)
    out = {"loss": totals.get("loss", 0.0) / max(1, totals.get("weight", 0))}
    product, score = 1.0, 1.0
    for d in range(1, depth + 1):
        out[f"acc{d}"] = totals.get(f"hits{d}", 0.0) / max(1, totals.get(f"n{d}", 0))
        product *= out[f"acc{d}"]
        score += product
    out["score"] = score
    return out


def split_records(records: list[dict], holdout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held-out, training): a seeded shuffle of the records by key; the first ``holdout`` of the target's
    own answers are held out (what a served head meets; local text, ``text-*``, only trains)."""
    order = sorted(records, key=lambda r: r["key"])
    random.Random(seed).shuffle(order)
    answers = [r for r in order if not r["source"].startswith("text-")]
    held = {id(r) for r in (answers or order)[:holdout]}
    return [r for r in order if id(r) in held], [r for r in order if id(r) not in held]


def id_counts(records: list[dict], vocab: int) -> torch.Tensor:
    """How often each id occurs among the records' tokens and labels."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        counts += torch.bincount(r["labels"].long().clamp(max=vocab - 1), minlength=vocab)
        counts += torch.bincount(r["input_ids"].long().clamp(max=vocab - 1), minlength=vocab)
    return counts


def frequent_ids(counts: torch.Tensor, size: int, always: list[int]) -> list[int]:
    """FR-Spec: the ``size`` ids most frequent by ``counts`` (``id_counts``), plus ``always``."""
    vocab = len(counts)
    chosen = set(counts.topk(min(size, vocab)).indices.tolist()) | set(always)
    return sorted(chosen)


def by_frequency(ids: list[int], counts: torch.Tensor, first: list[int]) -> list[int]:
    """``ids`` with ``first`` (end-of-sequence ids) leading, then most frequent first: a drafter may
    keep a prefix of the saved list as a smaller head (``EagleHead.load(max_head_tokens=)``)."""
    leading = [i for i in first if i in set(ids)]
    rest = sorted(set(ids) - set(leading), key=lambda i: (-int(counts[i]), i))
    return leading + rest


def default_head_ids_file(target: str) -> Path | None:
    """The shipped draft's FR-Spec ids for the embedded target (16 384 ids, 99.1 % of answer tokens)."""
    from specdec.models import EMBEDDED_ALIASES, EMBEDDED_DRAFT_DIR, HEAD_TOKEN_IDS_FILE

    path = EMBEDDED_DRAFT_DIR / HEAD_TOKEN_IDS_FILE
    return path if target in EMBEDDED_ALIASES and path.exists() else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--features", required=True, type=Path, action="append", help="an eagle-features directory (repeatable)")
    p.add_argument("--out", required=True, type=Path, help="working directory: checkpoint, log, best/ and head/")
    p.add_argument("--target", default="embedded")
    p.add_argument("--head-ids", type=Path, default=None,
                   help="FR-Spec ids (JSON list); default: the shipped draft's for the embedded target, else "
                        "the --head-tokens most frequent ids in the training data")
    p.add_argument("--head-tokens", type=int, default=16384)
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the reduced LM head and final norm too (then they are saved: +2*H*ids bytes)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this saved head (a later stage of a curriculum: text first, then the target's answers)")
    p.add_argument("--heldout-from", type=Path, default=None,
                   help="an earlier stage's heldout.json: hold out exactly its sequences (instead of --holdout)")
    p.add_argument("--served-head-tokens", type=int, default=None, metavar="N",
                   help="token loss and agreement over the head's first N ids only (most frequent first), as a "
                        "drafter keeping N serves it (4 096: specdec.eagle.drafter.DRAFTING_HEAD_TOKENS); a frozen "
                        "LM head's saved ids stay all of them. At 4 096 of 16 384 a step is ~3x cheaper on CPU")
    p.add_argument("--soft-labels", action="store_true",
                   help="token loss against the target's distribution over the head's ids (EAGLE-1), not its argmax")
    p.add_argument("--depth", type=int, default=3, help="training-time-test steps (EAGLE-3)")
    p.add_argument("--depth-decay", type=float, default=0.8)
    p.add_argument("--feature-weight", type=float, default=1.0)
    p.add_argument("--prompt-weight", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--token-budget", type=int, default=2048, help="padded tokens per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--holdout", type=int, default=32, help="sequences kept out of training")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=180.0, help="stop (with a checkpoint) after this long")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop (with a checkpoint) after N steps of this run; rerun to continue")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="matmul precision (autocast; weights and optimizer stay float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft eagle-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    from tqdm import tqdm

    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    records = read_feature_shards(args.features)
    if args.heldout_from:  # a later stage keeps the earlier stage's held-out sequences out
        keys = set(json.loads(args.heldout_from.read_text())["keys"])
        held, train = [r for r in records if r["key"] in keys], [r for r in records if r["key"] not in keys]
    else:
        held, train = split_records(records, args.holdout, args.seed)
    if not train:
        raise SystemExit("no training sequences (check --features and --holdout)")
    (args.out / "heldout.json").write_text(json.dumps({"features": [str(f) for f in args.features],
                                                      "keys": [r["key"] for r in held]}) + "\n")
    print(f"{len(train)} training sequences ({sum(len(r['input_ids']) for r in train)} tokens, "
          f"{sum(len(r['input_ids']) - r['answer_start'] for r in train)} answer tokens), {len(held)} held out")
    target = load_model(args.target, device="cpu", runtime="hf")
    checkpoint_path = args.out / "checkpoint.pt"
    state = torch.load(checkpoint_path, weights_only=False) if checkpoint_path.exists() else None
    if state is not None:
        ids = state["head_token_ids"]
    elif args.init:  # a later stage: the earlier head's ids, in its order
        ids = json.loads((args.init / HEAD_TOKEN_IDS_FILE).read_text())
    elif args.head_ids or default_head_ids_file(args.target):
        ids = json.loads((args.head_ids or default_head_ids_file(args.target)).read_text())
    else:
        ids = None
    if state is None and not args.init:
        counts = id_counts(train, target.vocab_size)
        if ids is None:
            ids = frequent_ids(counts, args.head_tokens, list(target.eos_token_ids))
        ids = by_frequency(ids, counts, list(target.eos_token_ids))
    if state is None and args.init:
        head = EagleHead.load(args.init, target)
        print(f"stage starts from {args.init}")
    else:
        train_lm_head = state["config"]["train_lm_head"] if state is not None else args.train_lm_head
        head = EagleHead.from_target(target, ids, train_lm_head=train_lm_head)
    position_of = head_rows(head.head_token_ids, head.config.vocab_size)
    trainable = [q for q in head.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [q for q in trainable if q.ndim >= 2], "weight_decay": args.weight_decay},
         {"params": [q for q in trainable if q.ndim < 2], "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    step, epoch, batch_index, elapsed_before, tokens_seen = 0, 0, 0, 0.0, 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, batch_index = state["step"], state["epoch"], state["batch_index"]
        elapsed_before, tokens_seen = state["elapsed_s"], state["tokens_seen"]
        print(f"resumed at step {step}")
    elif not args.init:
        sample = torch.cat([r["features"] for r in train[:64]])
        embedding_rms = float(head.embed_weight.float().pow(2).mean(-1).sqrt().mean())
        print(f"fusion: features' mean RMS {head.calibrate(sample):.3f}, embeddings' {embedding_rms:.4f}")
    print(f"head: {sum(q.numel() for q in trainable) / 1e6:.2f} M trainable parameters, {len(ids)} head ids")
    loss_kwargs = dict(depth_decay=args.depth_decay, feature_weight=args.feature_weight, prompt_weight=args.prompt_weight,
                       soft_labels=args.soft_labels, served_head_tokens=args.served_head_tokens)
    budget_s = args.max_minutes * 60

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        progress = min(1.0, (s - args.warmup) / max(1, args.steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def save_checkpoint() -> None:
        tmp = checkpoint_path.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
                    "batch_index": batch_index, "elapsed_s": time.monotonic() - start, "tokens_seen": tokens_seen,
                    "head_token_ids": head.head_token_ids.tolist(), "config": asdict(head.config)}, tmp)
        tmp.rename(checkpoint_path)

    best_file = args.out / "best" / "eval.json"
    best = json.loads(best_file.read_text())["score"] if best_file.exists() else -1.0
    log = open(args.out / "train_log.jsonl", "a")
    batches = make_batches(train, args.token_budget, random.Random(args.seed * 1000 + epoch))
    start = time.monotonic() - elapsed_before
    if step == 0 and held:  # the warm start's held-out numbers, the curve's first point
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            initial = evaluate(head, held, position_of, args.depth, args.token_budget, **loss_kwargs)
        print(f"step 0: held-out {json.dumps({k: round(v, 4) for k, v in initial.items()})}")
        log.write(json.dumps({"step": 0, "tokens_seen": 0, "eval": initial}) + "\n")
    head.train()
    first_step, paused = step, False
    bar = tqdm(total=args.steps, initial=step, desc="training EAGLE head", unit="step")
    while step < args.steps:
        if batch_index >= len(batches):
            epoch, batch_index = epoch + 1, 0
            batches = make_batches(train, args.token_budget, random.Random(args.seed * 1000 + epoch))
        batch = collate([train[i] for i in batches[batch_index]])
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            loss, info = batch_loss(head, batch, position_of, args.depth, **loss_kwargs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step, batch_index, tokens_seen = step + 1, batch_index + 1, tokens_seen + int(batch.mask.sum())
        bar.update(1)
        bar.set_postfix(loss=f"{info['loss']:.3f}", acc1=f"{info['acc1']:.3f}")
        entry = {"step": step, "epoch": epoch, "tokens_seen": tokens_seen, "lr": lr,
                 "elapsed_s": round(time.monotonic() - start, 1),
                 **{k: v for k, v in info.items() if not k.startswith("n")}}
        out_of_time = time.monotonic() - start > budget_s
        paused = args.stop_after is not None and step - first_step >= args.stop_after and step < args.steps
        if held and (step % args.eval_every == 0 or step == args.steps or out_of_time):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                entry["eval"] = evaluate(head, held, position_of, args.depth, args.token_budget, **loss_kwargs)
            bar.write(f"step {step}: held-out {json.dumps({k: round(v, 4) for k, v in entry['eval'].items()})}")
            if entry["eval"]["score"] > best:
                best = entry["eval"]["score"]
                head.save(args.out / "best")
                best_file.write_text(json.dumps({"step": step, **entry["eval"]}) + "\n")
        log.write(json.dumps(entry) + "\n")
        log.flush()
        if step % args.checkpoint_every == 0 or step == args.steps or out_of_time or paused:
            save_checkpoint()
        if out_of_time or paused:
            bar.write(f"{'time budget reached' if out_of_time else 'stopped'} at step {step}; rerun to resume")
            break
    bar.close()
    if not paused:  # head/: the weights the run ended with (finished, or out of time)
        head.save(args.out / "head")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
