"""User requests written by the target itself (Magpie): the widest prompt source available offline.

An instruction-tuned model given its chat template up to the start of a user turn writes a user
message from the distribution it was tuned on. Those requests are far more varied than templates
over hand-written topics, and the target's answers to them are exactly the text a draft must learn
to predict. Output: ``queries.jsonl`` (one ``{"text": ...}`` per line), appended batch by batch, so
an interrupted run resumes where it stopped.

Kept: requests that end within the token limit, 4-160 tokens, not repeated, and sharing no run of
``--decontaminate-words`` words with any prompt of the benchmark sets (MT-bench, HumanEval): the
target could in principle recall a benchmark question, and no such text may reach the training data.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Iterable
from pathlib import Path

import torch

USER_HEADER_MARK = "\x00USER\x00"  # rendered through the chat template, then cut: the user turn's opening


# System prompts that steer which requests the target writes (the answers are then generated under the
# template's default system prompt, as served). None: the template's own default.
STEERING_SYSTEM_PROMPTS = (
    None,
    "You are a programming assistant: users ask you to write, fix and explain code.",
    "You are a tutor for mathematics and logic puzzles: users bring you problems to solve step by step.",
    "You are a creative writing assistant: users ask for stories, poems, emails, speeches and blog posts.",
    "You are an expert in science, history and the humanities: users ask you questions to learn.",
    "You are an assistant that works on text users paste in: summarising, extracting facts, rewriting.",
    "You are a role-play partner: users ask you to act as a character or a professional.",
    "You are a Python assistant: users give you a function's signature and docstring to complete, "
    "or describe a function to write.",
)
# The general mix a run rotates through unless told otherwise (the recipes of the shipped draft and
# head's stages 3-4); later entries are for runs that ask for them (``--steering``).
DEFAULT_STEERING = tuple(range(7))


def user_turn_prefix(tokenizer, system: str | None = None) -> list[int]:
    """The chat template's rendering up to where the first user message begins (system prompt included)."""
    from specdec.prompts import encode_chat

    messages = ([("system", system)] if system else []) + [("user", USER_HEADER_MARK)]
    rendered = tokenizer.decode(encode_chat(tokenizer, messages), skip_special_tokens=False)
    cut = rendered.find(USER_HEADER_MARK)
    if cut < 0:
        raise ValueError("the chat template does not render the user message verbatim")
    return list(tokenizer(rendered[:cut], add_special_tokens=False)["input_ids"])


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def repeat_key(text: str) -> str:
    """What two requests share when one repeats the other (case, punctuation and spacing aside)."""
    return " ".join(_words(text))


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def benchmark_ngrams(n: int) -> set[tuple[str, ...]]:
    """Every ``n``-word run in the benchmark prompts (both MT-bench turns, HumanEval): the decontamination set."""
    from specdec.bench.prompts import load_prompts

    grams: set[tuple[str, ...]] = set()
    for conversation in load_prompts("mt_bench,humaneval"):
        for turn in conversation.turns:
            grams |= word_ngrams(turn, n)
    return grams


class QueryFilter:
    """Decides which sampled requests are kept; remembers the kept ones so that repeats are dropped."""

    def __init__(self, contamination: set[tuple[str, ...]], n: int, min_tokens: int = 4,
                 max_tokens: int = 160) -> None:
        self.contamination = contamination
        self.n = n
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.seen: set[str] = set()
        self.rejected: dict[str, int] = {}

    def remember(self, text: str) -> None:
        """Count ``text`` as kept already (a resumed run's earlier requests)."""
        self.seen.add(repeat_key(text))

    def keep(self, text: str, num_tokens: int, finished: bool) -> bool:
        reason = None
        key = repeat_key(text)
        if not finished:
            reason = "unfinished"
        elif not self.min_tokens <= num_tokens <= self.max_tokens or not key:
            reason = "length"
        elif key in self.seen:
            reason = "repeat"
        elif word_ngrams(text, self.n) & self.contamination:
            reason = "benchmark overlap"
        if reason:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return False
        self.seen.add(key)
        return True


def read_queries(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


@torch.inference_mode()
def sample_requests(lm, prefix: list[int], batch_size: int, max_new_tokens: int, temperature: float,
                    top_p: float, seed: int) -> Iterable[tuple[str, int, bool]]:
    """``(text, tokens, finished)`` for one batch of user requests sampled after ``prefix``."""
    input_ids = torch.tensor([prefix] * batch_size)
    torch.manual_seed(seed)
    out = lm.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                            top_p=top_p, top_k=0, pad_token_id=lm.eos_token_ids[0],
                            eos_token_id=list(lm.eos_token_ids))
    eos = set(lm.eos_token_ids)
    for row in out[:, len(prefix):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        tokens = row[:end] if end is not None else row
        yield lm.tokenizer.decode(tokens, skip_special_tokens=True).strip(), len(tokens), end is not None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Sample user requests from the target itself (Magpie), filtered "
                                            "and decontaminated against the benchmark prompts")
    p.add_argument("--out", required=True, type=Path, help="directory; queries.jsonl is written (and resumed) there")
    p.add_argument("--target", default="embedded")
    p.add_argument("--count", type=int, default=2000, help="requests to keep")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--decontaminate-words", type=int, default=8,
                   help="drop a request sharing a run of this many words with any benchmark prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--steering", type=int, nargs="+", default=None, metavar="INDEX",
                   help="which STEERING_SYSTEM_PROMPTS the batches rotate through (0: the template's default, "
                        "1: programming, 2: mathematics, ..., 7: Python functions from a signature and "
                        "docstring); default 0-6, the general mix")
    args = p.parse_args(argv)
    steering = args.steering if args.steering is not None else DEFAULT_STEERING
    if not steering or any(not 0 <= i < len(STEERING_SYSTEM_PROMPTS) for i in steering):
        p.error(f"--steering: indices 0..{len(STEERING_SYSTEM_PROMPTS) - 1}")
    from tqdm import tqdm

    from specdec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "queries.jsonl"
    kept = read_queries(path)
    lm = load_model(args.target, device="cpu", dtype=getattr(torch, args.dtype))
    keep = QueryFilter(benchmark_ngrams(args.decontaminate_words), args.decontaminate_words,
                       max_tokens=args.max_new_tokens)
    for text in kept:
        keep.remember(text)
    prefixes = [user_turn_prefix(lm.tokenizer, STEERING_SYSTEM_PROMPTS[i]) for i in steering]
    bar = tqdm(total=args.count, initial=min(len(kept), args.count), desc="user requests", unit="request")
    batch_index = len(kept)  # a resumed run draws different seeds
    start = time.monotonic()
    sampled = 0
    with open(path, "a") as f:
        while len(kept) < args.count:
            prefix = prefixes[batch_index % len(prefixes)]  # batches rotate through the steering prompts
            for text, num_tokens, finished in sample_requests(lm, prefix, args.batch_size, args.max_new_tokens,
                                                              args.temperature, args.top_p,
                                                              args.seed * 1_000_003 + batch_index):
                sampled += 1
                if len(kept) < args.count and keep.keep(text, num_tokens, finished):
                    kept.append(text)
                    f.write(json.dumps({"text": text}) + "\n")
                    bar.update(1)
            f.flush()
            batch_index += 1
            bar.set_postfix(sampled=sampled, rejected=sum(keep.rejected.values()),
                            per_min=f"{60 * sampled / (time.monotonic() - start):.0f}")
    bar.close()
    print(json.dumps({"kept": len(kept), "sampled_this_run": sampled, "rejected": keep.rejected}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
