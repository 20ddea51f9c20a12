"""Local text the EAGLE head learns from by teacher forcing: far more tokens than the target can write.

The head learns to read the target's next token from the target's own features, and the labels are
always the target's greedy tokens (``features.teacher_force``), so any text teaches it; this is EAGLE's
original recipe (fixed text, not regenerated). Generation on two CPU cores gives ~100 tokens/s,
teacher forcing over text ~1 000/s. The text here is what any machine has on disk: source code
(``.py``) and documentation (``.txt``, ``.md``, ``.rst``), each chunk framed as a chat answer so the
head sees the chat template's positions. Never the benchmark sets: a path under one is refused.
"""

from __future__ import annotations

import random
from pathlib import Path

TEXT_SUFFIXES = {".py": "code", ".txt": "prose", ".md": "prose", ".rst": "prose"}
CODE_ASKS = ["Show me the Python code for {name}.", "Write the module {name} in Python.",
             "Can you implement {name}?", "Give me a Python implementation of {name}."]
PROSE_ASKS = ["Explain {name}.", "Write the documentation for {name}.", "Tell me about {name}.",
              "What should I know about {name}?"]
MIN_CHUNK_TOKENS = 32


def text_files(paths: list[Path], refused: list[Path]) -> list[Path]:
    """Every text file under ``paths`` (files or directories), sorted; none under a ``refused`` path."""
    refused = [r.resolve() for r in refused]
    found: set[Path] = set()
    for path in paths:
        path = Path(path).resolve()
        if any(path == r or r in path.parents or path in r.parents for r in refused):
            raise ValueError(f"{path} overlaps the benchmark data ({', '.join(map(str, refused))}): never train on it")
        candidates = [path] if path.is_file() else path.rglob("*")
        found.update(p for p in candidates if p.suffix in TEXT_SUFFIXES and p.is_file())
    return sorted(found)


def _chunks(text: str, chunk_chars: int) -> list[str]:
    """Line-aligned pieces of about ``chunk_chars`` characters (a line longer than that is its own piece)."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > chunk_chars:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        pieces.append("".join(current))
    return pieces


def text_records(paths: list[Path], tokenizer, max_tokens: int, chunk_tokens: int = 512, seed: int = 0,
                 refused: list[Path] = ()) -> list[dict]:
    """Up to ``max_tokens`` answer tokens of local text, as ``{"key", "source", "prompt_ids", "output_ids"}``
    records (the shape ``features.write_feature_shards`` takes): files in a seeded order, each cut into
    line-aligned chunks of at most ``chunk_tokens`` tokens, each chunk the answer to a short request
    naming the file (rendered with the target's chat template)."""
    from tqdm import tqdm

    from specdec.prompts import encode_chat

    rng = random.Random(seed)
    files = text_files(paths, list(refused))
    rng.shuffle(files)
    records, total = [], 0
    bar = tqdm(total=max_tokens, desc="text chunks", unit="tok")
    for path in files:
        if total >= max_tokens:
            break
        kind = TEXT_SUFFIXES[path.suffix]
        text = path.read_text(encoding="utf-8", errors="ignore")
        name = path.stem if kind == "prose" else ".".join(path.with_suffix("").parts[-2:])
        for index, piece in enumerate(_chunks(text, chunk_tokens * 3)):
            ids = tokenizer.encode(piece, add_special_tokens=False)[:chunk_tokens]
            if len(ids) < MIN_CHUNK_TOKENS:
                continue
            ask = rng.choice(CODE_ASKS if kind == "code" else PROSE_ASKS).format(name=name)
            records.append({"key": f"text:{path}:{index}", "source": f"text-{kind}",
                            "prompt_ids": encode_chat(tokenizer, [("user", ask)]), "output_ids": ids})
            total += len(ids)
            bar.update(len(ids))
            if total >= max_tokens:
                break
    bar.close()
    return records
