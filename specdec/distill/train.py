"""Distil a small Llama draft from the target's own answers (forward KL to the target's top-K).

The draft shares the target's tokenizer and vocabulary; its tied embedding starts as the target's
embedding projected onto its top singular directions, so that the draft begins in the target's token
geometry rather than at random. Loss on answer positions: cross-entropy against the target's
renormalised top-K distribution (forward KL up to a constant), which for greedy decoding mostly teaches
the target's top token; on prompt positions: plain next-token loss at a small weight (code prompts are
copied from a lot). Checkpoints every ``--checkpoint-every`` steps; rerunning resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.distill.evaluate import accepted_lengths, mean_accepted_length
from specdec.distill.generate import keyed_records


def draft_config(target_config, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps, rope_parameters=dict(target_config.rope_parameters),
        tie_word_embeddings=True, bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id, pad_token_id=target_config.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


@torch.no_grad()
def init_from_target(draft, target) -> None:
    """Tied embedding := target embedding projected on its top-``hidden`` right singular vectors.

    The final norm's gain is set so the first logits have about unit spread instead of saturating.
    """
    embedding = target.get_input_embeddings().weight.float()
    hidden = draft.config.hidden_size
    _, _, vh = torch.linalg.svd(embedding, full_matrices=False)
    projected = embedding @ vh[:hidden].T
    draft.get_input_embeddings().weight.copy_(projected)
    spread = (torch.randn(64, hidden) @ projected.T).std()  # unit-RMS hidden states, as after the norm
    draft.model.norm.weight.fill_(1.0 / float(spread))


def frequent_tokens(records: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` ids seen most in the data (target answers and prompts), plus ``always``: FR-Spec's
    reduced draft head. The draft never proposes other ids, which exact acceptance handles (q = 0)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in records:
        ids = torch.tensor(record["prompt_ids"] + record["output_ids"])
        counts += torch.bincount(ids, minlength=counts.numel())
        counts += torch.bincount(record["topk_ids"][:, :4].reshape(-1).long(), minlength=counts.numel())
    chosen = set(counts.topk(min(size, vocab_size)).indices.tolist()) | set(always)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def load_records(data_dir: Path) -> list[dict]:
    """The answered records of a data directory, each with its ``key`` (``keyed_records``)."""
    return [{**r, "key": key} for key, r in keyed_records(data_dir) if r["output_ids"]]


def split_records(directories: list[Path], holdout: int, holdout_from: list[Path],
                  rng: random.Random, holdout_keys: set[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(held-out, training) records, shuffled; the held-out ones come from ``holdout_from`` if given,
    or are exactly the records named by ``holdout_keys`` (another run's held-out set)."""
    unknown = set(holdout_from) - set(directories)
    if unknown:
        raise SystemExit(f"--holdout-from {', '.join(map(str, sorted(unknown)))} is not among --data")
    pools = {directory: load_records(directory) for directory in directories}
    candidates = [r for directory in (holdout_from or directories) for r in pools[directory]]
    rng.shuffle(candidates)
    if holdout_keys is not None:
        candidates = [r for r in candidates if r["key"] in holdout_keys]
        missing = holdout_keys - {r["key"] for r in candidates}
        if missing:
            raise SystemExit(f"--heldout-keys: {len(missing)} keys are not answered records of --data "
                             f"(e.g. {sorted(missing)[0]})")
        if len(candidates) != len(holdout_keys):  # keys name a directory by its last component only
            raise SystemExit("--heldout-keys: two --data directories share a name, so their keys collide")
        holdout = len(candidates)
    held = candidates[:holdout]
    held_ids = {id(r) for r in held}
    train = [r for records in pools.values() for r in records if id(r) not in held_ids]
    rng.shuffle(train)
    return held, train


def budget_batches(items, size, token_budget: int, rng: random.Random, order_key=None) -> list[list]:
    """``items`` in length-sorted buckets of at most ``token_budget`` padded tokens (``size(item)``
    tokens each; sorted by ``order_key``, default ``size``), in random order."""
    batches, current, width = [], [], 0
    for item in sorted(items, key=order_key or size):
        length = size(item)
        if current and max(width, length) * (len(current) + 1) > token_budget:
            batches.append(current)
            current, width = [], 0
        current.append(item)
        width = max(width, length)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def make_batches(records: list[dict], token_budget: int, rng: random.Random) -> list[list[dict]]:
    """Length-sorted buckets of at most ``token_budget`` padded tokens, in random order."""
    return budget_batches(records, lambda r: len(r["prompt_ids"]) + len(r["output_ids"]), token_budget, rng)


def head_rows(head_ids, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: each token's row in a reduced head over ``head_ids`` (in that order), -1 outside it."""
    ids = torch.as_tensor(head_ids, dtype=torch.long)
    rows = torch.full((vocab_size,), -1, dtype=torch.long)
    rows[ids] = torch.arange(len(ids))
    return rows


def batch_loss(model, batch: list[dict], head_ids: torch.Tensor, position_of: torch.Tensor,
               prompt_weight: float, prompt_fraction: float, rng: torch.Generator) -> tuple[torch.Tensor, dict]:
    """``head_ids``: the draft head's token ids; ``position_of[token]``: its row there, or -1."""
    width = max(len(r["prompt_ids"]) + len(r["output_ids"]) for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    answer_rows, answer_cols, soft_ids, soft_logprobs = [], [], [], []
    prompt_rows, prompt_cols, prompt_labels = [], [], []
    for row, record in enumerate(batch):
        sequence = record["prompt_ids"] + record["output_ids"]
        ids[row, : len(sequence)] = torch.tensor(sequence)
        p = len(record["prompt_ids"])
        n = len(record["output_ids"])
        # The hidden state at position p-1+j predicts answer token j.
        answer_rows.append(torch.full((n,), row))
        answer_cols.append(torch.arange(p - 1, p - 1 + n))
        soft_ids.append(record["topk_ids"].long())
        soft_logprobs.append(record["topk_logprobs"].float())
        if p > 1 and prompt_weight > 0:
            cols = torch.arange(0, p - 1)
            keep = torch.rand(len(cols), generator=rng) < prompt_fraction
            prompt_rows.append(torch.full((int(keep.sum()),), row))
            prompt_cols.append(cols[keep])
            prompt_labels.append(torch.tensor(record["prompt_ids"][1:])[keep])
    hidden = model.model(input_ids=ids).last_hidden_state  # right padding never reaches real positions
    head = model.get_input_embeddings().weight[head_ids]  # tied, reduced to the frequent tokens
    answer_hidden = hidden[torch.cat(answer_rows), torch.cat(answer_cols)]
    logq = F.log_softmax((answer_hidden @ head.T).float(), dim=-1)
    teacher_rows = position_of[torch.cat(soft_ids)]  # -1 where the head lacks the token
    # A position whose whole top-K lies outside the head has nothing the draft could propose (its
    # renormalised teacher would be 0/0): it stays out of the loss.
    in_head = (teacher_rows >= 0).any(-1)
    logq, teacher_rows = logq[in_head], teacher_rows[in_head]
    teacher_logprobs = torch.cat(soft_logprobs)[in_head].masked_fill(teacher_rows < 0, float("-inf"))
    teacher = torch.softmax(teacher_logprobs, dim=-1)  # renormalised top-K within the head
    kd = -(teacher * logq.gather(1, teacher_rows.clamp(min=0))).sum(-1).mean()
    top1 = teacher_rows[:, 0]
    agree = (logq.argmax(-1) == top1).float().mean()
    loss = kd
    if prompt_rows and sum(len(r) for r in prompt_rows):
        prompt_hidden = hidden[torch.cat(prompt_rows), torch.cat(prompt_cols)]
        labels = position_of[torch.cat(prompt_labels)]
        known = labels >= 0
        lm = F.cross_entropy((prompt_hidden[known] @ head.T).float(), labels[known])
        loss = loss + prompt_weight * lm
    return loss, {"kd": float(kd.detach()), "top1_agree": float(agree)}


@torch.no_grad()
def evaluate(model, records: list[dict], head_ids: torch.Tensor, k: int = 5) -> dict:
    """Teacher-forced top-1 agreement on held-out answers, and the greedy accepted length it implies."""
    model.eval()
    agree_total, greedy_total, count, lengths = 0, 0, 0, []
    head = model.get_input_embeddings().weight[head_ids]
    for record in records:
        sequence = torch.tensor([record["prompt_ids"] + record["output_ids"]])
        p, n = len(record["prompt_ids"]), len(record["output_ids"])
        hidden = model.model(input_ids=sequence).last_hidden_state[0, p - 1 : p - 1 + n]
        predicted = head_ids[(hidden @ head.T).argmax(-1)]
        agree = (predicted == torch.tensor(record["output_ids"])).tolist()
        agree_total += sum(agree)
        greedy_total += int((predicted == record["topk_ids"][:, 0].long()).sum())
        count += n
        if record.get("temperature", 0.0) == 0.0:
            lengths.extend(accepted_lengths(agree, k))
    model.train()
    # greedy_agree: against the target's own top token at each position (what the EAGLE head's held-out
    # agreement counts), which differs from the answer's token where the answer was sampled.
    return {"top1_agree": agree_total / max(count, 1), "greedy_agree": greedy_total / max(count, 1),
            f"mean_accepted_length_k{k}": mean_accepted_length(lengths)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", required=True, type=Path, action="append",
                   help="a directory of shards from `specdec train-draft data` (repeatable)")
    p.add_argument("--out", required=True, type=Path, help="working directory (checkpoint, log, final model)")
    p.add_argument("--target", default="embedded")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=640)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-tokens", type=int, default=16384, help="FR-Spec: the draft head covers this many frequent ids")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--token-budget", type=int, default=4096, help="padded tokens per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--prompt-weight", type=float, default=0.2)
    p.add_argument("--prompt-fraction", type=float, default=0.25)
    p.add_argument("--holdout", type=int, default=48, help="records kept out of training for evaluation")
    p.add_argument("--holdout-from", type=Path, action="append", default=[],
                   help="draw the held-out records from these --data directories only (with --init-from: "
                        "data the earlier draft never saw, so held-out agreement is not inflated by memory)")
    p.add_argument("--heldout-keys", type=Path, default=None,
                   help="hold out exactly the records a JSON file's \"keys\" name (e.g. an EAGLE head's "
                        "--heldout-from file), so that two methods are scored on the same answers")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--max-minutes", type=float, default=180.0, help="stop (with a checkpoint) after this long")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export", type=Path, default=None, help="write the shippable fp16 draft here at the end")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue from a trained draft (a `best`/`final` folder or a shipped draft) with a fresh "
                        "schedule, e.g. after growing the data; its head ids are kept so its weights still fit")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="matmul precision (autocast; weights and optimizer stay float32): bfloat16 is faster "
                        "per step where the CPU has bf16 matmuls")
    args = p.parse_args(argv)
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    holdout_keys = set(json.loads(args.heldout_keys.read_text())["keys"]) if args.heldout_keys else None
    holdout, train = split_records(args.data, args.holdout, args.holdout_from, random.Random(args.seed), holdout_keys)
    answer_tokens = sum(len(r["output_ids"]) for r in train)
    print(f"{len(train)} training records ({answer_tokens} answer tokens), {len(holdout)} held out")

    target = load_model(args.target, device="cpu")
    head_ids = None
    if args.init_from:  # its weights only fit its own head ids: keep them
        from specdec.models import HEAD_TOKEN_IDS_FILE

        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        head_ids = torch.tensor(json.loads((args.init_from / HEAD_TOKEN_IDS_FILE).read_text()), dtype=torch.long)
    else:
        model = LlamaForCausalLM(draft_config(target.model.config, args.hidden, args.layers, args.intermediate,
                                              args.heads, args.kv_heads))
    config = model.config
    checkpoint = args.out / "checkpoint.pt"
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n], "weight_decay": 0.01},
         {"params": [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98),
    )
    step, tokens_seen = 0, 0  # tokens_seen: positions trained on (prompt and answer), as eagle-train counts
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state.get("tokens_seen", 0)
        print(f"resumed at step {step}")
    elif not args.init_from:
        init_from_target(model, target.model)
    if head_ids is None:
        head_ids = frequent_tokens(train, args.head_tokens, config.vocab_size, list(target.eos_token_ids))
    position_of = head_rows(head_ids, config.vocab_size)
    covered = sum(int((position_of[torch.tensor(r["output_ids"])] >= 0).sum()) for r in holdout)
    print(f"head: {len(head_ids)} ids cover {covered / max(1, sum(len(r['output_ids']) for r in holdout)):.4f} of held-out answer tokens")
    (args.out / "head_token_ids.json").write_text(json.dumps(head_ids.tolist()))
    del target
    print(f"draft: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")

    budget_s = args.max_minutes * 60

    def lr_at(s: int, elapsed_s: float) -> float:
        """Warm-up, then cosine to 10% over whichever runs out first: the steps or the time budget."""
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        progress = max((s - args.warmup) / max(1, args.steps - args.warmup), elapsed_s / budget_s)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    generator = torch.Generator().manual_seed(args.seed)
    epoch_rng = random.Random(args.seed + step)
    batches: list[list[dict]] = []
    log = open(args.out / "train_log.jsonl", "a")
    elapsed_before = 0.0  # time spent in earlier (interrupted) runs counts against the budget
    if (args.out / "train_log.jsonl").stat().st_size:
        *_, last = (args.out / "train_log.jsonl").read_text().splitlines()
        elapsed_before = json.loads(last).get("elapsed_s", 0.0)
    best_file = args.out / "best" / "eval.json"
    best_score = json.loads(best_file.read_text())["top1_agree"] if best_file.exists() else -1.0
    start = time.monotonic() - elapsed_before
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="distilling draft", unit="step")
    skipped_in_a_row = 0
    while step < args.steps:
        if not batches:
            batches = make_batches(train, args.token_budget, epoch_rng)
        batch = batches.pop()
        lr = lr_at(step, time.monotonic() - start)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            loss, info = batch_loss(model, batch, head_ids, position_of, args.prompt_weight, args.prompt_fraction, generator)
        if not torch.isfinite(loss):  # one bad batch must not poison the weights: skip it, say so
            skipped_in_a_row += 1
            bar.write(f"step {step + 1}: non-finite loss, batch skipped")
            if skipped_in_a_row >= 10:
                raise SystemExit("10 batches in a row gave a non-finite loss: the weights are broken")
            continue
        skipped_in_a_row = 0
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += sum(len(r["prompt_ids"]) + len(r["output_ids"]) - 1 for r in batch)
        bar.update(1)
        bar.set_postfix(kd=f"{info['kd']:.3f}", agree=f"{info['top1_agree']:.3f}")
        entry = {"step": step, "tokens_seen": tokens_seen, "lr": lr, "elapsed_s": round(time.monotonic() - start, 1), **info}
        out_of_time = time.monotonic() - start > budget_s
        if step % args.eval_every == 0 or step == args.steps or out_of_time:  # the last step is a candidate too
            entry["eval"] = evaluate(model, holdout, head_ids)
            bar.write(f"step {step}: {entry['eval']}")
            score = entry["eval"]["top1_agree"]
            if score > best_score:  # keep the best held-out checkpoint (small data overfits late)
                best_score = score
                model.save_pretrained(args.out / "best", safe_serialization=True)
                (args.out / "best" / "eval.json").write_text(json.dumps({"step": step, **entry["eval"]}))
        log.write(json.dumps(entry) + "\n")
        log.flush()
        if step % args.checkpoint_every == 0 or step == args.steps or out_of_time:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "tokens_seen": tokens_seen}, tmp)
            tmp.rename(checkpoint)
        if out_of_time:
            bar.write(f"time budget reached at step {step}; rerun to resume")
            break
    bar.close()
    model.save_pretrained(args.out / "final", safe_serialization=True)
    if args.export:
        chosen = args.out / "best" if (args.out / "best").exists() else args.out / "final"
        print(f"exported {chosen.name} to {export_draft(chosen, args.out / 'head_token_ids.json', args.target, args.export)}")
    return 0



def export_draft(trained_dir: Path, head_ids_file: Path, target: str, dest: Path) -> Path:
    """The shippable draft: fp16 safetensors, config, FR-Spec head ids and the target's tokenizer."""
    import shutil

    from transformers import AutoTokenizer, LlamaForCausalLM

    from specdec.models import HEAD_TOKEN_IDS_FILE, resolve_model_path

    model = LlamaForCausalLM.from_pretrained(trained_dir, dtype=torch.float32)
    model.to(torch.float16)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    shutil.copyfile(head_ids_file, dest / HEAD_TOKEN_IDS_FILE)
    AutoTokenizer.from_pretrained(resolve_model_path(target)).save_pretrained(dest)
    return dest


if __name__ == "__main__":
    raise SystemExit(main())
