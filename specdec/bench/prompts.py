"""The prompt sets of ``specdec bench``: built-in MT-bench and HumanEval, or JSONL files in either format."""

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


def builtin_prompt_path(name: str) -> Path:
    from importlib.resources import files

    folder, filename = BUILTIN_PROMPTS[name]
    return Path(str(files("specdec") / "data" / folder / filename))


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_record(record: dict, source: str, index: int) -> Conversation:
    """MT-bench (``question_id``, ``category``, ``turns``) or HumanEval (``task_id``, ``prompt``)."""
    if "turns" in record:
        turns = [str(t) for t in record["turns"]]
        if not turns:
            raise ValueError(f"{source}: record {index} has no turns")
        qid = record.get("question_id", index)
        return Conversation(str(qid), str(record.get("category", "default")), turns, True, source)
    if "prompt" in record:
        tid = record.get("task_id", index)
        return Conversation(str(tid), str(record.get("category", "humaneval")), [str(record["prompt"])], False, source)
    raise ValueError(f"{source}: record {index} has neither 'turns' (MT-bench) nor 'prompt' (HumanEval)")


def select_round_robin(items: list[Conversation], limit: int | None) -> list[Conversation]:
    """The first ``limit`` items taking categories in turn (file order within a category)."""
    if limit is None or limit >= len(items):
        return list(items)
    by_category: dict[str, list[Conversation]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    queues = list(by_category.values())
    chosen: list[Conversation] = []
    depth = 0
    while len(chosen) < limit:
        for queue in queues:
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return chosen


def load_prompts(spec: str, limit: int | None = None) -> list[Conversation]:
    """``spec``: comma-separated built-in names (``BUILTIN_PROMPTS``) or JSONL paths (.gz ok).

    ``limit`` applies to each set, taking its categories in turn.
    """
    conversations: list[Conversation] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part in BUILTIN_PROMPTS:
            path, source = builtin_prompt_path(part), part
        else:
            path, source = Path(part), Path(part).name
            if not path.exists():
                raise ValueError(f"--prompts: {part!r} is neither {' nor '.join(BUILTIN_PROMPTS)} nor a file")
        items = [parse_record(r, source, i) for i, r in enumerate(read_jsonl(path))]
        conversations.extend(select_round_robin(items, limit))
    if not conversations:
        raise ValueError("--prompts: no prompts")
    return conversations
