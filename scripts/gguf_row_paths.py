"""Where llama.cpp's rows stop being the one-token rows (issue #46's exactness finding).

Feeds the first n tokens of a sequence in one decode call (``MAX_TOKENS_PER_DECODE`` lifted), the
rest one at a time, and counts the rows bitwise equal to one-token decoding: on llama-cpp-python
0.3.36's llama.cpp every row up to n = 63, one row from n = 64 on. The runtime therefore feeds a
sequence at most 63 tokens per decode call.

    .venv/bin/python scripts/gguf_row_paths.py [GGUF]   (default: the embedded Q4_1 file)
"""

from __future__ import annotations

import random
import sys

import torch

import specdec.gguf.runtime as gguf_runtime
from specdec.models import load_model


def main(model: str = "embedded") -> None:
    lm = load_model(model, device="cpu", runtime="gguf", sessions=2)
    rng = random.Random(0)
    tokens = [rng.randrange(1000, min(9000, lm.vocab_size)) for _ in range(160)]
    gguf_runtime.MAX_TOKENS_PER_DECODE = 10**6  # what llama.cpp does when handed the whole chunk

    def rows(first: int) -> torch.Tensor:
        kv = lm.gguf.new_kv()
        try:
            chunks = [tokens[:first]] + [[t] for t in tokens[first:]]
            return torch.cat([lm.gguf.forward([kv], [chunk], [len(chunk)]) for chunk in chunks])
        finally:
            kv.release()

    reference = rows(1)
    for first in (8, 32, 63, 64, 96, 160):
        equal = int((rows(first) == reference).all(dim=1).sum())
        print(f"first {first:3d} tokens in one call: {equal} of {len(tokens)} rows bitwise equal to one-token decoding")


if __name__ == "__main__":
    main(*sys.argv[1:])
