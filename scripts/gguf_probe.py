"""What llama.cpp's CPU kernels give a GGUF file, before a runtime is built on them (issue #43).

    python scripts/gguf_probe.py [--gguf FILE] [--threads 2] [--out probe.json]

Needs llama-cpp-python (its low-level ctypes API; see docs/benchmarks.md for the build used). It
answers the two questions the runtime's design depends on:

1. Exactness: is a position's logits vector independent of how passes are cut and of the other
   sequences sharing a pass? Each prompt is decoded one token at a time (the reference), then its
   same tokens are fed in passes of 2, 4, 8 and 16 (verify passes), and four sequences decode in
   one pass; every row is compared with the reference bit for bit. If all are equal, greedy
   speculation on this runtime equals its own one-token-at-a-time decoding, token for token.
2. Cost: the forward curve (milliseconds for a pass of 1, 2, 4, 8, 16 tokens at a 100-token
   context, median of 15) and plain decoding's tokens per second.

The CPU model and llama.cpp's system info are printed with the figures: they differ by host.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

PROMPTS = ("def fibonacci(n):", "Explain KV caches to a new engineer in two paragraphs.",
           "Write a haiku about the sea.", "What is the capital of France? Answer briefly.")
PASS_SIZES = (2, 4, 8, 16)
CURVE_SIZES = (1, 2, 4, 8, 16)
NEW_TOKENS = 48
CONTEXT = 100


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Context:
    """One llama.cpp context with several sequences, fed through ``llama_batch``."""

    def __init__(self, gguf: str, threads: int, sequences: int = 8, n_ctx: int = 4096) -> None:
        import llama_cpp as lib

        self.lib = lib
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(gguf.encode(), lib.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp cannot load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 512, 512, sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(512, 0, sequences)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Feed ``(token, position, sequence, wants_logits)`` rows in one pass; the wanted rows' logits."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, position, sequence, wanted) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, wanted
            batch.seq_id[i][0] = sequence
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.vocab_size,)).copy()
                for i, item in enumerate(items) if item[3]]

    def forget(self, sequence: int, start: int = 0) -> None:
        """Drop ``sequence``'s positions from ``start`` on (a rollback)."""
        self.lib.llama_memory_seq_rm(self.memory, sequence, start, -1)

    def prefill(self, sequence: int, prompt: list[int]) -> np.ndarray:
        self.forget(sequence)
        return self.decode([(t, i, sequence, i == len(prompt) - 1) for i, t in enumerate(prompt)])[0]


def reference(context: Context, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding one token at a time: the tokens fed and the logits after each."""
    token = int(np.argmax(context.prefill(0, prompt)))
    tokens, rows = [], []
    for position in range(len(prompt), len(prompt) + NEW_TOKENS):
        tokens.append(token)
        rows.append(context.decode([(token, position, 0, True)])[0])
        token = int(np.argmax(rows[-1]))
    return tokens, rows


def compare(got: np.ndarray, expected: np.ndarray, tally: dict) -> None:
    difference = float(np.max(np.abs(got - expected)))
    tally["rows"] += 1
    tally["bitwise_equal"] += int(np.array_equal(got, expected))
    tally["argmax_differs"] += int(np.argmax(got) != np.argmax(expected))
    tally["max_abs_difference"] = max(tally["max_abs_difference"], difference)


def exactness(context: Context, prompts: list[list[int]]) -> dict:
    references = [reference(context, prompt) for prompt in prompts]
    cut = {"rows": 0, "bitwise_equal": 0, "argmax_differs": 0, "max_abs_difference": 0.0}
    for size in PASS_SIZES:
        for prompt, (tokens, rows) in zip(prompts, references):
            context.prefill(0, prompt)
            for first in range(0, NEW_TOKENS, size):
                got = context.decode([(t, len(prompt) + first + j, 0, True)
                                      for j, t in enumerate(tokens[first:first + size])])
                for j, row in enumerate(got):
                    compare(row, rows[first + j], cut)
    shared = {"rows": 0, "bitwise_equal": 0, "argmax_differs": 0, "max_abs_difference": 0.0}
    for sequence, prompt in enumerate(prompts):
        context.prefill(sequence, prompt)
    for step in range(NEW_TOKENS):
        got = context.decode([(references[s][0][step], len(prompts[s]) + step, s, True) for s in range(len(prompts))])
        for s, row in enumerate(got):
            compare(row, references[s][1][step], shared)
    return {"passes_of_2_to_16_tokens": cut, "four_sequences_in_one_pass": shared}


def cost(context: Context, prompt: list[int], reps: int = 15) -> dict:
    base = (prompt * (CONTEXT // len(prompt) + 1))[:CONTEXT]
    context.prefill(0, base)
    curve = {}
    for size in CURVE_SIZES:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            context.decode([(base[j % CONTEXT], CONTEXT + j, 0, True) for j in range(size)])
            times.append(time.perf_counter() - started)
            context.forget(0, CONTEXT)
        curve[size] = round(statistics.median(times) * 1e3, 2)
    token = int(np.argmax(context.prefill(0, prompt)))
    started = time.perf_counter()
    for position in range(len(prompt), len(prompt) + 128):
        token = int(np.argmax(context.decode([(token, position, 0, True)])[0]))
    return {"forward_ms_by_tokens": curve, "plain_decoding_tokens_per_s": round(128 / (time.perf_counter() - started), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the embedded target's Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    from specdec.models import _embedded_gguf_path, load_tokenizer

    gguf = args.gguf or str(_embedded_gguf_path())
    tokenizer = load_tokenizer("embedded")
    context = Context(gguf, args.threads)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    result = {"gguf": Path(gguf).name, "cpu": cpu_model(), "threads": args.threads,
              "llama_cpp": context.lib.llama_print_system_info().decode().strip(),
              "exactness": exactness(context, prompts), "cost": cost(context, prompts[1])}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
