"""The target's features by teacher forcing: what the EAGLE head trains and is evaluated on.

Invariant, per sequence x_0..x_{T-1} (a prompt followed by the target's answer): ``features[s]`` is
the target's last decoder layer output at position s, before its final norm (fp16 on disk), and
``labels[s]`` is the target's greedy next token after x_0..x_s (the argmax of its logits over the
tokenizer's ids, what the verifier would commit). ``answer_start`` is the prompt's length.

Text: the target's own answers (``specdec train-draft data`` shards, or answers this step generates
for the offline training prompts of ``specdec.distill.prompts``), and local text framed as chat answers
(``--text``, ``text_corpus``: far more tokens, at teacher-forcing speed). Never the benchmark sets.
Output: ``feat-NNNNN.pt`` shards under ``--out`` (``--records-per-shard`` sequences each, in a fixed
order); a rerun skips the shards already written, and generation resumes at the first missing
answer shard (``--out/answers``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

FEATURE_SHARD = "feat-{:05d}.pt"
META_FILE = "meta.json"


@torch.inference_mode()
def teacher_force(target, sequences: list[list[int]], token_budget: int = 8192) -> list[dict]:
    """``{"input_ids", "features", "labels"}`` per sequence (int32, fp16 [T, H], int32), in input order.

    Right-padded batches of similar length (a causal model's real positions never see the padding);
    the feature is the final norm's input, caught by a pre-hook, so no layer is run twice."""
    causal = target.model
    base = causal.base_model
    head = causal.get_output_embeddings()
    vocab = target.vocab_size
    device = target.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches, current = [], []
    for index in order:
        width = len(sequences[index])
        if current and width * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    captured: dict[str, torch.Tensor] = {}
    hook = base.norm.register_forward_pre_hook(lambda module, args: captured.__setitem__("f", args[0]))
    out: list[dict | None] = [None] * len(sequences)
    try:
        for batch in batches:
            width = max(len(sequences[i]) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                ids[row, : len(sequences[index])] = torch.tensor(sequences[index])
            normed = base(input_ids=ids.to(device), use_cache=False).last_hidden_state
            features = captured.pop("f")
            for row, index in enumerate(batch):
                length = len(sequences[index])
                logits = head(normed[row, :length]).float()
                out[index] = {
                    "input_ids": ids[row, :length].to(torch.int32),
                    "features": features[row, :length].to("cpu", torch.float16),
                    "labels": logits[:, :vocab].argmax(-1).to("cpu", torch.int32),
                }
    finally:
        hook.remove()
    return out


def answer_records(directories: list[Path]) -> list[dict]:
    """Every answered record in these ``train-draft data`` directories (shard order), keyed by origin."""
    from specdec.distill.generate import keyed_records

    return [{"key": key, "source": record["source"], "prompt_ids": list(record["prompt_ids"]),
             "output_ids": list(record["output_ids"])}
            for directory in directories for key, record in keyed_records(directory) if record["output_ids"]]


def generate_answers(target_name: str, out: Path, prompts: int, seed: int, batch_size: int, max_new_tokens: int,
                     max_prompt_tokens: int, max_minutes: float, dtype: str) -> None:
    """The target's greedy answers to ``prompts`` offline training prompts, as ``train-draft data``
    shards under ``out`` (resumes at the first missing shard; stops starting batches after ``max_minutes``)."""
    from tqdm import tqdm

    from specdec.distill.generate import generate_batch, plan_batches
    from specdec.distill.prompts import build_prompts
    from specdec.models import load_model

    lm = load_model(target_name, device="cpu", dtype=getattr(torch, dtype), runtime="hf")
    batches = plan_batches(build_prompts(prompts, seed=seed), lm.tokenizer, batch_size, max_prompt_tokens)
    out.mkdir(parents=True, exist_ok=True)
    start, tokens = time.monotonic(), 0
    bar = tqdm(batches, desc="target answers", unit="batch")
    for index, batch in enumerate(bar):
        shard = out / f"shard-{index:05d}.pt"
        if shard.exists():
            continue
        if time.monotonic() - start > max_minutes * 60:
            bar.write(f"generation budget ({max_minutes} min) spent after {index} batches; rerun to continue")
            break
        records = generate_batch(lm, batch, max_new_tokens, 1, 0.0, seed * 100003 + index)
        tmp = shard.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(shard)  # a shard is either complete or absent
        tokens += sum(len(r["output_ids"]) for r in records)
        bar.set_postfix(tokens=tokens, tok_s=f"{tokens / (time.monotonic() - start):.0f}")
    bar.close()


def write_feature_shards(target, records: list[dict], out: Path, per_shard: int, token_budget: int) -> int:
    """Feature shards for ``records`` (each ``{"key", "source", "prompt_ids", "output_ids"}``); a shard
    already on disk for the same keys is kept. Returns the number of sequences written now."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    written = 0
    chunks = [records[i:i + per_shard] for i in range(0, len(records), per_shard)]
    bar = tqdm(chunks, desc="target features", unit="shard")
    for index, chunk in enumerate(bar):
        path = out / FEATURE_SHARD.format(index)
        keys = [r["key"] for r in chunk]
        if path.exists() and [r["key"] for r in torch.load(path, weights_only=False)] == keys:
            continue
        forced = teacher_force(target, [r["prompt_ids"] + r["output_ids"] for r in chunk], token_budget)
        shard = [{"key": r["key"], "source": r["source"], "answer_start": len(r["prompt_ids"]), **f}
                 for r, f in zip(chunk, forced)]
        tmp = path.with_suffix(".tmp")
        torch.save(shard, tmp)
        tmp.rename(path)
        written += len(chunk)
        bar.set_postfix(sequences=written)
    for stale in sorted(out.glob("feat-*.pt"))[len(chunks):]:  # shards past the planned ones (a shorter plan)
        stale.unlink()
    return written


def read_feature_shards(directories: list[Path]) -> list[dict]:
    return [r for d in directories for shard in sorted(Path(d).glob("feat-*.pt"))
            for r in torch.load(shard, weights_only=False)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="feature shards go here (answers generated here go to OUT/answers)")
    p.add_argument("--target", default="embedded")
    p.add_argument("--answers", type=Path, action="append", default=[],
                   help="a directory of `specdec train-draft data` shards (repeatable)")
    p.add_argument("--text", type=Path, action="append", default=[],
                   help="also local text files or directories (.py, .txt, .md, .rst), framed as chat answers (repeatable)")
    p.add_argument("--text-tokens", type=int, default=1_000_000, help="answer tokens taken from --text at most")
    p.add_argument("--text-chunk-tokens", type=int, default=512, help="tokens per text answer at most")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="first have the target answer N offline training prompts (greedy; into OUT/answers, resumable)")
    p.add_argument("--generate-minutes", type=float, default=20.0, help="stop starting answer batches after this long")
    p.add_argument("--batch-size", type=int, default=32, help="answers generated per batch")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--generate-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the target's weights while generating (labels and features always use --dtype)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the target's weights for teacher forcing (float32: what the CPU verifier runs)")
    p.add_argument("--token-budget", type=int, default=8192, help="padded tokens per teacher-forcing batch")
    p.add_argument("--records-per-shard", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft eagle-features", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    directories = list(args.answers)
    if args.generate:
        generated = args.out / "answers"
        generate_answers(args.target, generated, args.generate, args.seed, args.batch_size, args.max_new_tokens,
                         args.max_prompt_tokens, args.generate_minutes, args.generate_dtype)
        directories.append(generated)
    records = answer_records(directories)
    target = load_model(args.target, device="cpu", dtype=getattr(torch, args.dtype), runtime="hf")
    if args.text:
        from importlib.resources import files

        from specdec.eagle.text_corpus import text_records

        benchmark_sets = [Path(str(files("specdec") / "data")), Path(__file__).resolve().parents[3] / "shared" / "data"]
        records += text_records(args.text, target.tokenizer, args.text_tokens, args.text_chunk_tokens, args.seed,
                                refused=[d for d in benchmark_sets if d.exists()])
    if not records:
        raise SystemExit("nothing to teacher-force: give --answers DIR (from `specdec train-draft data`), --generate N or --text PATH")
    hidden = int(target.model.config.hidden_size)
    meta_path = args.out / META_FILE
    meta = {"target": args.target, "hidden_size": hidden, "dtype": args.dtype}
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise SystemExit(f"{meta_path} was written for {json.loads(meta_path.read_text())}, not {meta}: use another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(meta) + "\n")
    start = time.monotonic()
    written = write_feature_shards(target, records, args.out, args.records_per_shard, args.token_budget)
    tokens = sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in records)
    answer_tokens = sum(len(r["output_ids"]) for r in records)
    print(json.dumps({"sequences": len(records), "tokens": tokens, "answer_tokens": answer_tokens,
                      "written_now": written, "seconds": round(time.monotonic() - start, 1),
                      "disk_mb": round(sum(f.stat().st_size for f in args.out.glob("feat-*.pt")) / 1e6, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
