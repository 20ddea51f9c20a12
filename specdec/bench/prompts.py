"""The prompt sets of ``specdec bench``: built-in MT-bench and HumanEval, ``repetitive`` (generated from
them), or JSONL files in either format."""

from __future__ import annotations

from pathlib import Path

from specdec.bench.conversation import BUILTIN_PROMPTS, Conversation, builtin_prompt_path, group_spans, read_jsonl
from specdec.bench.repetitive import build_repetitive

# Sets built in code from the shipped files (specdec.bench.repetitive), not read from a file of their own.
GENERATED_PROMPTS = ("repetitive",)  # ours: text repeats across requests (issue #45, suffix drafting)
BUILTIN_NAMES = (*BUILTIN_PROMPTS, *GENERATED_PROMPTS)


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
    """The first ``limit`` groups taking categories in turn (file order within a category), each group
    whole; an item outside a group is a group of its own, so ungrouped sets give ``limit`` items."""
    groups = [items[span.start:span.stop] for span in group_spans(items)]
    if limit is None or limit >= len(groups):
        return list(items)
    by_category: dict[str, list[list[Conversation]]] = {}
    for group in groups:
        by_category.setdefault(group[0].category, []).append(group)
    queues = list(by_category.values())
    chosen: list[list[Conversation]] = []
    depth = 0
    while len(chosen) < limit:
        for queue in queues:
            if depth < len(queue) and len(chosen) < limit:
                chosen.append(queue[depth])
        depth += 1
    return [item for group in chosen for item in group]


def load_prompts(spec: str, limit: int | None = None) -> list[Conversation]:
    """``spec``: comma-separated built-in names (``BUILTIN_NAMES``) or JSONL paths (.gz ok).

    ``limit`` applies to each set: that many groups (items, where a set has no groups), taking its
    categories in turn.
    """
    conversations: list[Conversation] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part in GENERATED_PROMPTS:
            items = build_repetitive()
        else:
            if part in BUILTIN_PROMPTS:
                path, source = builtin_prompt_path(part), part
            else:
                path, source = Path(part), Path(part).name
                if not path.exists():
                    raise ValueError(f"--prompts: {part!r} is neither {' nor '.join(BUILTIN_NAMES)} nor a file")
            items = [parse_record(r, source, i) for i, r in enumerate(read_jsonl(path))]
        conversations.extend(select_round_robin(items, limit))
    if not conversations:
        raise ValueError("--prompts: no prompts")
    return conversations
