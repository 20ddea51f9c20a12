"""Re-rank a saved EAGLE head's FR-Spec ids by how often the target emits them in some data.

    specdec train-draft eagle-ids --head DIR --features D [--features D ...] --out DIR2 [--head-tokens N]

A head whose LM head is the target's own (frozen) rows (``train_lm_head`` false, the default) scores
any id the same way whichever ids it keeps, so its id list can follow the data it will meet: the
drafter keeps the first ``DRAFTING_HEAD_TOKENS`` of the list, and ids ranked on one kind of text
cover another kind less well. ``DIR2`` gets a copy of the head with ``head_token_ids.json`` holding
the ``--head-tokens`` ids most often the target's greedy token in the ``--features`` shards
(end-of-sequence ids first, then most frequent first). Reports the coverage of the first 4 096 / 8 192
/ all kept ids before and after.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from specdec.eagle.features import read_feature_shards
from specdec.eagle.head import CONFIG_FILE
from specdec.eagle.train import by_frequency, frequent_ids, id_counts
from specdec.lm import HEAD_TOKEN_IDS_FILE


def coverage(ids: list[int], counts: torch.Tensor, prefixes: tuple[int, ...]) -> dict[int, float]:
    """The share of the counted tokens the first n ids cover, for each n in ``prefixes``."""
    total = float(counts.sum()) or 1.0
    return {n: float(counts[torch.tensor(ids[:n], dtype=torch.long)].sum()) / total for n in prefixes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specdec train-draft eagle-ids", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, type=Path, help="a saved head (its LM head the target's rows)")
    p.add_argument("--features", type=Path, action="append", required=True, help="eagle-features shards (repeatable)")
    p.add_argument("--out", required=True, type=Path, help="where the re-ranked copy of the head goes")
    p.add_argument("--head-tokens", type=int, default=None, help="ids to keep (default: as many as the head has)")
    p.add_argument("--target", default="embedded", help="for its end-of-sequence ids and vocabulary")
    args = p.parse_args(argv)
    config = json.loads((args.head / CONFIG_FILE).read_text())
    if config.get("train_lm_head"):
        raise SystemExit(f"{args.head}: its LM head was trained for its own ids; they cannot change")
    from specdec.models import load_model

    target = load_model(args.target, device="cpu", runtime="hf")
    vocab, eos = target.vocab_size, list(target.eos_token_ids)
    old = json.loads((args.head / HEAD_TOKEN_IDS_FILE).read_text())
    size = args.head_tokens or len(old)
    counts = id_counts(read_feature_shards(args.features), vocab)
    new = by_frequency(frequent_ids(counts, size, eos), counts, eos)
    if args.out.resolve() != args.head.resolve():
        shutil.copytree(args.head, args.out, dirs_exist_ok=True)
    (args.out / HEAD_TOKEN_IDS_FILE).write_text(json.dumps(new))
    prefixes = (4096, 8192, size)
    print(json.dumps({"ids": len(new), "coverage_before": coverage(old, counts, prefixes),
                      "coverage_after": coverage(new, counts, prefixes)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
