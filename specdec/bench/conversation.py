"""A ``specdec bench`` item (``Conversation``) and its groups, and the shipped prompt files: what the
prompt sets (``specdec.bench.prompts``, ``specdec.bench.repetitive``) are made of."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

BUILTIN_PROMPTS = {
    "mt_bench": ("mt_bench", "question.jsonl"),
    "humaneval": ("humaneval", "HumanEval.jsonl.gz"),
    "translation": ("translation", "prompts.jsonl"),  # ours: where drafts are weak (issue #46)
}


@dataclass
class Conversation:
    """One benchmark item: a single text prompt, or chat turns asked one after another."""

    id: str
    category: str
    turns: list[str]
    chat: bool  # True: messages with the chat template; False: plain text prompt (no template)
    source: str = ""
    # Items of one group follow each other in the list and are run one after another in one stream, in
    # the same round: a later item may reuse what an earlier one wrote (a suffix cache). "" = on its own.
    group: str = ""


def group_spans(items: list[Conversation]) -> list[range]:
    """The positions of each group in ``items``: a run of consecutive items with the same non-empty
    ``group``, or one item outside any group."""
    spans: list[range] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or not items[i].group or items[i].group != items[start].group:
            spans.append(range(start, i))
            start = i
    return spans


def builtin_prompt_path(name: str) -> Path:
    from importlib.resources import files

    folder, filename = BUILTIN_PROMPTS[name]
    return Path(str(files("specdec") / "data" / folder / filename))


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
