"""Load generation: conversations through a runner, back to back or on Poisson arrivals, with a bounded
number of conversations in flight; the conversations of one group (``Conversation.group``) one after
another in one stream, and split into interleaved rounds whole."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from specdec.bench.metrics import RequestRecord
from specdec.bench.conversation import Conversation, group_spans
from specdec.bench.runners import Messages, Runner, describe_error


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n arrivals of a Poisson process of ``rate`` per second (first at 0)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i > 0:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def run_conversation(runner: Runner, system: str, conv: Conversation, index: int, cfg, t0: float,
                     on_done: Callable[[int], None]) -> list[RequestRecord]:
    """Ask every turn; a chat turn > 1 gets the system's own previous answers as assistant messages."""
    records = []
    history: Messages = []
    for turn, text in enumerate(conv.turns, start=1):
        record = RequestRecord(system, conv.id, conv.category, conv.source, turn, 0.0)
        if conv.chat:
            messages, prompt = history + [("user", text)], None
        else:
            messages, prompt = None, text
        begin = time.perf_counter()
        record.start_s = begin - t0
        try:
            out = runner.generate(messages=messages, prompt=prompt, max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, seed=cfg.seed + 1000 * index + turn)
        except Exception as exc:  # noqa: BLE001 - a failed request is counted, the run goes on
            record.error = describe_error(exc)
            record.latency_s = time.perf_counter() - begin
            records.append(record)
            on_done(len(conv.turns) - turn + 1)  # later turns depend on this one: not asked
            break
        record.latency_s = out.end - out.start
        record.chunk_offsets_s = [t - out.start for t in out.chunk_times]
        record.chunk_tokens = list(out.chunk_tokens)
        record.output_tokens = sum(out.chunk_tokens)
        record.ttft_s = record.chunk_offsets_s[0] if record.chunk_offsets_s else None
        record.finish_reason = out.finish_reason
        record.stats = out.stats
        record.text = out.text
        record.token_ids, record.prompt_token_ids = list(out.token_ids), list(out.prompt_token_ids)
        records.append(record)
        history = (messages or []) + [("assistant", out.text)]
        on_done(1)
    return records


def run_system(runner: Runner, system: str, conversations: list[Conversation], cfg,
               progress: bool = True, indices: Sequence[int] | None = None) -> tuple[list[RequestRecord], float]:
    """Every conversation through ``runner``; returns the records and the wall time (s).
    ``indices``: each conversation's place in the whole prompt list (its requests' seeds)."""
    indices = list(range(len(conversations))) if indices is None else list(indices)
    from tqdm.auto import tqdm

    total = sum(len(c.turns) for c in conversations)
    bar = tqdm(total=total, desc=f"{system:>12}", unit="req", disable=not progress, leave=True, file=sys.stderr)
    lock = threading.Lock()

    def done(n: int) -> None:
        with lock:
            bar.update(n)

    # A group is one job: its items run one after another in one worker (a later item may reuse what
    # an earlier one wrote), and arrives as one. An item outside a group is a group of its own.
    groups = group_spans(conversations)
    if cfg.request_rate:
        arrivals = poisson_arrivals(len(groups), cfg.request_rate, cfg.seed)
        workers = cfg.concurrency or len(groups)
    else:
        arrivals = [0.0] * len(groups)
        workers = cfg.concurrency or 1
    results: list[list[RequestRecord]] = [[] for _ in conversations]
    t0 = time.perf_counter()

    def job(g: int) -> None:
        for i in groups[g]:
            results[i] = run_conversation(runner, system, conversations[i], indices[i], cfg, t0, done)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(groups)))) as pool:
        futures = []
        for g, offset in enumerate(arrivals):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(job, g))
        for f in futures:
            f.result()
    duration = time.perf_counter() - t0
    bar.close()
    return [r for rs in results for r in rs], duration


def effective_rounds(rounds: int, groups: int, concurrency: int | None) -> int:
    """--rounds, capped so that every round keeps ``concurrency`` groups (conversations, where the
    prompts have no groups) in flight."""
    per_round = concurrency if isinstance(concurrency, int) and concurrency > 0 else 1
    return max(1, min(rounds, groups // per_round))


def round_blocks(conversations: list[Conversation], rounds: int) -> list[list[int]]:
    """The positions each interleaved round runs: group g (an item outside a group is its own) goes to
    round g % rounds, whole, so that a group's later items follow its earlier ones in the same round
    (each round's suffix cache starts cold: ``specdec.bench.cli``)."""
    blocks: list[list[int]] = [[] for _ in range(rounds)]
    for g, span in enumerate(group_spans(conversations)):
        blocks[g % rounds].extend(span)
    return blocks


def parse_concurrency(value) -> list[int] | None:
    """``--concurrency``: None, an int, or a comma-separated list of levels (each >= 1)."""
    if value is None:
        return None
    try:
        levels = [int(part) for part in str(value).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: {value!r} is not an integer or a comma-separated list of them") from None
    if not levels or any(level < 1 for level in levels):
        raise ValueError("--concurrency must be >= 1")
    return levels
