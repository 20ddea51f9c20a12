"""The ``repetitive`` prompt set (issue #45): a workload where text repeats across requests, which a
suffix drafter (the request's own text plus a cache of what the target wrote before) can exploit and
MT-bench and HumanEval, each question asked once, barely show.

Built deterministically from the files we ship (MT-bench's questions, HumanEval's problems); nothing
is downloaded. Three categories, each a list of *groups* whose items plausibly share output text:

- ``revise``: an MT-bench question's turn 1, then a turn 2 asking to rewrite or repeat that answer
  (the turn-1 answer is in turn 2's prompt, so its output repeats its own context). One two-turn item
  per group.
- ``samples``: one HumanEval problem asked several times, each time in another wrapper (raw text,
  after an instruction comment, as a chat message): the completions share the function.
- ``docqa``: a HumanEval prompt as a document and several chat questions that each quote it (explain
  it, test it, implement it): the answers share the document's names, signature and examples.

``samples`` and ``docqa`` take disjoint problems (even and odd places in the file), so one category's
groups cannot warm another's. Items of a group follow each other; ``--limit`` and ``--rounds`` keep
groups whole (``Conversation.group``). An item's id is ``<group>#<member>``.
"""

from __future__ import annotations

from specdec.bench.conversation import Conversation, builtin_prompt_path, read_jsonl

SOURCE = "repetitive"
GROUP_SEPARATOR = "#"  # item id = group + GROUP_SEPARATOR + member name

# revise: turn 2 after the question's turn 1, chosen by the question's place in the set (so all four
# appear in any four consecutive revise groups). Each keeps most of the first answer's text.
REVISE_TEMPLATES = (
    ("fix", "Rewrite your answer above with the same content but fix any mistakes."),
    ("title", "Repeat your answer above, adding a short title at the top."),
    ("summary", "Repeat your answer above word for word, then add a one-sentence summary at the end."),
    ("numbered", "Rewrite your answer above with its paragraphs numbered, keeping their text unchanged."),
)

# samples: (member name, chat, template); {prompt} is the HumanEval prompt (signature and docstring).
# Different wrappers, so that greedy decoding does not answer the same request twice.
SAMPLE_WRAPPERS = (
    ("raw", False, "{prompt}"),
    ("comment", False, "# Complete the function below; keep its signature and docstring.\n{prompt}"),
    ("chat", True, "Complete the following Python function.\n\n```python\n{prompt}```"),
    ("chat-body", True, "Write the body of this Python function and return the whole function.\n\n"
                        "```python\n{prompt}```"),
)
DEFAULT_SAMPLES_PER_PROBLEM = 3

# docqa: each question quotes the whole document, as a retrieval-augmented prompt would.
DOCQA_PREFACE = "Here is a Python function from our codebase:\n\n```python\n{document}```\n\n"
DOCQA_QUESTIONS = (
    ("explain", "Explain what this function does."),
    ("tests", "Write three test cases for this function."),
    ("implement", "Implement this function."),
)

CATEGORIES = ("revise", "samples", "docqa")


def item_id(group: str, member: str) -> str:
    return f"{group}{GROUP_SEPARATOR}{member}"


def interleave_categories(questions: list[dict]) -> list[dict]:
    """MT-bench's questions taking its categories in turn (file order within each), so that the first
    few revise groups, which ``--limit`` takes, cover writing, roleplay, reasoning, math, ... alike."""
    by_category: dict[str, list[dict]] = {}
    for question in questions:
        by_category.setdefault(str(question.get("category", "")), []).append(question)
    queues = list(by_category.values())
    return [queue[depth] for depth in range(max(map(len, queues), default=0)) for queue in queues if depth < len(queue)]


def revise_groups(questions: list[dict]) -> list[Conversation]:
    """One two-turn chat per MT-bench question (categories in turn): its turn 1, then a revise
    template as turn 2."""
    items = []
    for place, question in enumerate(interleave_categories(questions)):
        member, instruction = REVISE_TEMPLATES[place % len(REVISE_TEMPLATES)]
        group = f"revise/mt-{question['question_id']}"
        items.append(Conversation(item_id(group, member), "revise", [str(question["turns"][0]), instruction],
                                  chat=True, source=SOURCE, group=group))
    return items


def sample_groups(problems: list[dict], samples_per_problem: int) -> list[Conversation]:
    """Each problem asked ``samples_per_problem`` times in a row, in the first that many wrappers."""
    items = []
    for problem in problems:
        group = f"samples/{problem['task_id']}"
        for member, chat, template in SAMPLE_WRAPPERS[:samples_per_problem]:
            items.append(Conversation(item_id(group, member), "samples", [template.format(prompt=problem["prompt"])],
                                      chat=chat, source=SOURCE, group=group))
    return items


def docqa_groups(documents: list[dict]) -> list[Conversation]:
    """Every question of ``DOCQA_QUESTIONS`` on each document in a row, each quoting the document."""
    items = []
    for document in documents:
        group = f"docqa/{document['task_id']}"
        preface = DOCQA_PREFACE.format(document=document["prompt"])
        for member, question in DOCQA_QUESTIONS:
            items.append(Conversation(item_id(group, member), "docqa", [preface + question],
                                      chat=True, source=SOURCE, group=group))
    return items


def build_repetitive(samples_per_problem: int = DEFAULT_SAMPLES_PER_PROBLEM) -> list[Conversation]:
    """The whole set, category by category, each group's items consecutive: 80 revise groups (one
    two-turn item each), 82 samples groups and 82 docqa groups (three items each by default)."""
    if not 1 <= samples_per_problem <= len(SAMPLE_WRAPPERS):
        raise ValueError(f"samples per problem: 1 to {len(SAMPLE_WRAPPERS)} (one per wrapper)")
    questions = read_jsonl(builtin_prompt_path("mt_bench"))
    problems = read_jsonl(builtin_prompt_path("humaneval"))
    return (revise_groups(questions) + sample_groups(problems[0::2], samples_per_problem)
            + docqa_groups(problems[1::2]))
