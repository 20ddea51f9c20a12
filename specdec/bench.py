"""``specdec bench``: load benchmarks of speculative decoding against plain decoding.

Runs prompt sets (MT-bench, HumanEval, or JSONL files in either format) through one or more
*systems* and writes ``summary.json``, ``report.md``, ``requests.jsonl`` and PNG plots:

- ``spec``: the gateway with adaptive draft length (``num_draft_tokens=0``);
- ``spec-k=N``: the gateway with a fixed draft length N;
- ``spec-ahead`` / ``spec-noahead``: ``spec`` with draft-ahead forced on / off for the request
  (``spec`` takes the gateway's ``--draft-ahead`` default);
- ``baseline``: the same stack with ``method=none`` (plain decoding);
- ``inprocess``: the core loop without gRPC (``specdec.local.LocalEngine``, adaptive k);
- ``hf``: transformers ``generate`` on the target alone;
- ``hf-assisted``: transformers assisted generation with the same draft model (needs --draft-model).

With ``--local`` there is no gateway: ``spec``, ``spec-k=N`` and ``baseline`` run the same loop
in-process (so ``spec`` and ``inprocess`` coincide there).

Metrics follow the usual serving benchmarks: TTFT; TPOT = (latency - TTFT) / (tokens - 1);
ITL counted per token (a chunk of n tokens arriving g after the previous one gives n samples of
g / n, since speculative chunks carry several tokens); end-to-end latency; output tokens/s and
requests/s over the wall time of the run; plus the speculation figures from the final stats.

The analytic bound: with per-position acceptance alpha_i, per-token draft cost t_draft and the
verify-cost curve t_verify(k) (the target's forward over k + 1 tokens),

    bound = max_k E[tokens](k) * t_verify(0) / (k * t_draft + t_verify(k)),
    E[tokens](k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i   (= (1 - a^(k+1)) / (1 - a) for alpha_i = a),

and ``measured_over_bound`` = (spec tokens/s / baseline tokens/s) / bound.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import platform
import random
import re
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.costs import FORWARD_CURVE_PREFIX, measure_forward_curve
from specdec.speedup import conditional_alphas, speedup_bound

log = logging.getLogger(__name__)

BUILTIN_PROMPTS = {
    "mt_bench": ("mt_bench", "question.jsonl"),
    "humaneval": ("humaneval", "HumanEval.jsonl.gz"),
}
SYSTEM_KINDS = ("spec", "spec-k=N", "spec-ahead", "spec-noahead", "baseline", "inprocess", "hf", "hf-assisted")
DEFAULT_GATEWAY_SYSTEMS = "spec,baseline"
DEFAULT_LOCAL_SYSTEMS = "inprocess,baseline,hf"
VERIFY_CURVE_TOKENS = 16  # the target's forward is timed over 1..16 tokens (k = 0..15)
WARMUP_TOKENS = 4
# Per-position acceptance feeds the bound only where that position was drafted this often; deeper
# positions use the pooled per-token alpha (deep positions are drafted mostly in easy stretches).
MIN_POSITION_DRAFTS = 20


# -- prompts --------------------------------------------------------------------------------------
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
    """``spec``: comma-separated built-in names (mt_bench, humaneval) or JSONL paths (.gz ok).

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


# -- systems --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str  # "gateway" | "local" | "hf"
    method: str = "auto"  # gateway: auto | none; local: draft | none
    num_draft_tokens: int = 0  # 0 = adaptive
    assisted: bool = False
    draft_ahead: bool | None = None  # gateway: None = the gateway's default


def parse_systems(text: str, local: bool) -> list[SystemSpec]:
    specs: list[SystemSpec] = []
    stack = "local" if local else "gateway"
    for name in [s.strip() for s in text.split(",") if s.strip()]:
        if name == "spec":
            spec = SystemSpec(name, stack, "auto", 0)
        elif m := re.fullmatch(r"spec-k=(\d+)", name):
            k = int(m.group(1))
            if k < 1:
                raise ValueError("--systems: spec-k=N needs N >= 1")
            spec = SystemSpec(name, stack, "auto", k)
        elif name in ("spec-ahead", "spec-noahead"):
            if local:
                raise ValueError(f"--systems: {name} needs a gateway (draft-ahead overlaps separate services)")
            spec = SystemSpec(name, stack, "auto", 0, draft_ahead=name == "spec-ahead")
        elif name == "baseline":
            spec = SystemSpec(name, stack, "none", 0)
        elif name == "inprocess":
            spec = SystemSpec(name, "local", "auto", 0)
        elif name == "hf":
            spec = SystemSpec(name, "hf")
        elif name == "hf-assisted":
            spec = SystemSpec(name, "hf", assisted=True)
        else:
            raise ValueError(f"--systems: unknown system {name!r} (choose from {', '.join(SYSTEM_KINDS)})")
        if any(s.name == name for s in specs):
            raise ValueError(f"--systems: {name!r} given twice")
        specs.append(spec)
    if not specs:
        raise ValueError("--systems: none given")
    return specs


# -- one generation -------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one generation returned, with client-side timestamps (perf_counter seconds)."""

    start: float
    end: float
    chunk_times: list[float]
    chunk_tokens: list[int]
    text: str
    finish_reason: str = ""
    stats: dict | None = None


class ChunkClock:
    """Collects (time, token count) per non-empty chunk."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[int] = []

    def chunk(self, n: int) -> None:
        if n > 0:
            self.times.append(time.perf_counter())
            self.tokens.append(n)

    def outcome(self, text: str, finish_reason: str = "", stats: dict | None = None) -> Outcome:
        return Outcome(self.start, time.perf_counter(), self.times, self.tokens, text, finish_reason, stats)


Messages = list[tuple[str, str]]


class Runner:
    """Generates one completion for ``messages`` (chat) or ``prompt`` (plain text)."""

    def generate(self, *, messages: Messages | None, prompt: str | None, max_new_tokens: int,
                 temperature: float, seed: int) -> Outcome:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GatewayRunner(Runner):
    def __init__(self, client, method: str, num_draft_tokens: int, draft_ahead: bool | None = None) -> None:
        self.client = client
        self.method = method
        self.num_draft_tokens = num_draft_tokens
        self.draft_ahead = draft_ahead

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        from specdec.client import ChunkEvent

        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                      method=self.method, num_draft_tokens=self.num_draft_tokens, draft_ahead=self.draft_ahead)
        if messages is not None:
            kwargs["messages"] = messages
        else:
            kwargs["prompt"] = prompt
        clock = ChunkClock()
        text, final = "", None
        for event in self.client.stream(**kwargs):
            if isinstance(event, ChunkEvent):
                clock.chunk(len(event.token_ids))
                text += event.text
            else:
                final = event
        if final is None:
            raise RuntimeError("the stream ended without a final message")
        return clock.outcome(text, final.finish_reason, dict(final.stats))


def encode(tokenizer, messages: Messages | None, prompt: str | None) -> list[int]:
    from specdec.prompts import encode_chat, encode_text

    return encode_chat(tokenizer, messages) if messages is not None else encode_text(tokenizer, prompt)


class LocalRunner(Runner):
    """The core loop in this process (``LocalEngine``); each call runs its own event loop."""

    def __init__(self, target, drafter, num_draft_tokens: int) -> None:
        from specdec.local import LocalEngine

        self.target = target
        self.engine = LocalEngine(target, drafter)
        self.num_draft_tokens = num_draft_tokens

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        import asyncio

        from specdec.completion import Chunk
        from specdec.sampling import SamplingParams

        prompt_ids = encode(self.target.tokenizer, messages, prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

        async def consume() -> Outcome:
            clock = ChunkClock()
            result = None
            async for event in self.engine.stream(prompt_ids, params, self.num_draft_tokens):
                if isinstance(event, Chunk):
                    clock.chunk(len(event.token_ids))
                else:
                    result = event
            return clock.outcome(result.text, result.finish_reason, result.stats.to_dict())

        return asyncio.run(consume())


class HFRunner(Runner):
    """transformers ``generate`` on the target, optionally with ``assistant_model``."""

    def __init__(self, target, draft=None) -> None:
        self.target = target
        self.draft = draft

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        import torch
        from transformers.generation.streamers import BaseStreamer

        from specdec.sampling import GREEDY_TEMPERATURE

        tokenizer = self.target.tokenizer
        prompt_ids = encode(tokenizer, messages, prompt)
        eos = list(self.target.eos_token_ids)

        class Streamer(BaseStreamer):
            def __init__(self, clock: ChunkClock) -> None:
                self.clock = clock
                self.seen_prompt = False

            def put(self, value) -> None:
                if not self.seen_prompt:  # generate() first streams the prompt itself
                    self.seen_prompt = True
                    return
                self.clock.chunk(int(value.numel()))

            def end(self) -> None:
                pass

        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                      pad_token_id=(eos[0] if eos else tokenizer.pad_token_id))
        if temperature >= GREEDY_TEMPERATURE:  # as the engine: below it, greedy
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kwargs.update(do_sample=False)
        if self.draft is not None:
            kwargs["assistant_model"] = self.draft.model
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.target.device)
        clock = ChunkClock()
        with torch.inference_mode():
            output = self.target.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), streamer=Streamer(clock), **kwargs
            )
        new_tokens = output[0, len(prompt_ids):].tolist()
        outcome = clock.outcome(tokenizer.decode(new_tokens, skip_special_tokens=True))
        finished_on_eos = bool(new_tokens) and new_tokens[-1] in eos
        outcome.finish_reason = "stop" if finished_on_eos else "length"
        # The streamer saw exactly the new tokens; trust generate's output if they disagree.
        if sum(outcome.chunk_tokens) != len(new_tokens) and outcome.chunk_times:
            outcome.chunk_tokens[-1] += len(new_tokens) - sum(outcome.chunk_tokens)
        return outcome


# -- running a system over the prompts ------------------------------------------------------------
@dataclass
class RequestRecord:
    system: str
    conversation_id: str
    category: str
    source: str
    turn: int
    start_s: float  # since the system's run began
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    chunk_offsets_s: list[float] = field(default_factory=list)  # each chunk's arrival since start
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str | None = None
    stats: dict | None = None
    text: str = ""


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n arrivals of a Poisson process of ``rate`` per second (first at 0)."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i > 0:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def describe_error(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {exc.details()}"
        except Exception:  # noqa: BLE001 - any failure to describe falls back to repr
            pass
    return f"{type(exc).__name__}: {exc}"


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

    if cfg.request_rate:
        arrivals = poisson_arrivals(len(conversations), cfg.request_rate, cfg.seed)
        workers = cfg.concurrency or len(conversations)
    else:
        arrivals = [0.0] * len(conversations)
        workers = cfg.concurrency or 1
    results: list[list[RequestRecord]] = [[] for _ in conversations]
    t0 = time.perf_counter()

    def job(i: int) -> None:
        results[i] = run_conversation(runner, system, conversations[i], indices[i], cfg, t0, done)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(conversations)))) as pool:
        futures = []
        for i, offset in enumerate(arrivals):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(job, i))
        for f in futures:
            f.result()
    duration = time.perf_counter() - t0
    bar.close()
    return [r for rs in results for r in rs], duration


# -- metric math ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict:
    values = [float(v) for v in values if v is not None]
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def tpot(latency_s: float, ttft_s: float, tokens: int) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (tokens - 1)."""
    if tokens < 2 or latency_s is None or ttft_s is None:
        return None
    return (latency_s - ttft_s) / (tokens - 1)


def itl_per_token(chunk_offsets_s: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Inter-token latencies counted per token: a chunk of n tokens arriving g after the previous
    chunk contributes n samples of g / n. The first chunk's tokens belong to TTFT."""
    samples: list[float] = []
    for i in range(1, len(chunk_offsets_s)):
        n = chunk_tokens[i]
        if n <= 0:
            continue
        gap = chunk_offsets_s[i] - chunk_offsets_s[i - 1]
        samples.extend([gap / n] * n)
    return samples


def position_counts(stats: dict) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per draft position for one request, rebuilt from its final stats.

    Position i was drafted in every round whose k exceeded i (``k_history`` holds the drafted
    lengths); ``per_position_acceptance[i]`` is accepted_i / drafted_i.
    """
    ks = [int(k) for k in stats.get("k_history") or []]
    rates = list(stats.get("per_position_acceptance") or [])
    width = max(ks, default=0)
    drafted = [sum(1 for k in ks if k > i) for i in range(width)]
    accepted = [int(round((rates[i] if i < len(rates) else 0.0) * drafted[i])) for i in range(width)]
    return drafted, accepted


def merge_position_counts(stats_list: Sequence[dict]) -> tuple[list[int], list[int]]:
    drafted: list[int] = []
    accepted: list[int] = []
    for stats in stats_list:
        d, a = position_counts(stats)
        for i in range(len(d)):
            if i >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d[i]
            accepted[i] += a[i]
    return drafted, accepted


def fit_verify_cost(samples: Sequence[tuple[int, float, float]]) -> tuple[float, float] | None:
    """Least squares of verify_s = a * rounds + b * drafted over requests ``(rounds, drafted, verify_s)``:
    t_verify(k) = a + b * k. None unless both coefficients come out well defined and a > 0, b >= 0."""
    import numpy as np

    rows = [(r, d, v) for r, d, v in samples if r > 0]
    if len(rows) < 2:
        return None
    x = np.array([[r, d] for r, d, _ in rows], dtype=float)
    y = np.array([v for _, _, v in rows], dtype=float)
    if np.linalg.matrix_rank(x) < 2:
        return None
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    if not (a > 0 and b >= 0):
        return None
    return float(a), float(b)


def output_tokens_per_s(records: Sequence[RequestRecord], duration_s: float) -> float:
    """Output tokens of the completed requests over the wall time that ran them (a system's
    ``tokens_per_s``, and each interleaved round's)."""
    tokens = sum(r.output_tokens for r in records if r.error is None)
    return tokens / duration_s if duration_s > 0 else 0.0


def summarize_records(records: Sequence[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for r in ok if (t := tpot(r.latency_s, r.ttft_s, r.output_tokens)) is not None]
    itls = [x for r in ok for x in itl_per_token(r.chunk_offsets_s, r.chunk_tokens)]
    latencies = [r.latency_s for r in ok]
    out = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "output_tokens": tokens,
        "duration_s": duration_s,
        "tokens_per_s": output_tokens_per_s(ok, duration_s),
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        # Per request: tokens over its own latency (unaffected by queueing between requests).
        "decode_tokens_per_s": tokens / sum(latencies) if latencies and sum(latencies) > 0 else 0.0,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("latency", latencies)):
        for stat, value in distribution(values).items():
            out[f"{name}_{stat}_s"] = value
    stats = [r.stats for r in ok if r.stats]
    if stats and any(s.get("draft_method", "none") != "none" or s.get("draft_tokens") for s in stats):
        drafted = sum(int(s.get("draft_tokens", 0)) for s in stats)
        accepted = sum(int(s.get("accepted_tokens", 0)) for s in stats)
        rounds = sum(int(s.get("rounds", 0)) for s in stats)
        emitted = sum(float(s.get("mean_accepted_length", 0.0)) * int(s.get("rounds", 0)) for s in stats)
        pos_drafted, pos_accepted = merge_position_counts(stats)
        ks = [int(k) for s in stats for k in s.get("k_history") or []]
        out.update({
            "draft_method": stats[0].get("draft_method"),
            "rounds": rounds,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": emitted / rounds if rounds else 0.0,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(pos_accepted, pos_drafted)],
            "per_position_drafted": pos_drafted,
            "k_mean": sum(ks) / len(ks) if ks else 0.0,
            "k_counts": {str(k): ks.count(k) for k in sorted(set(ks))},
            "draft_s": sum(float(s.get("draft_s", 0.0)) for s in stats),
            "verify_s": sum(float(s.get("verify_s", 0.0)) for s in stats),
            "ahead_blocks": sum(int(s.get("ahead_blocks", 0)) for s in stats),
            "ahead_hits": sum(int(s.get("ahead_hits", 0)) for s in stats),
            "shadow_probes": sum(int(s.get("shadow_probes", 0)) for s in stats),
            "shadow_accepted": sum(int(s.get("shadow_accepted", 0)) for s in stats),
        })
    else:
        out.update({"acceptance_rate": None, "mean_accepted_length": None})
    batched = [s for s in stats if s.get("mean_batch_size")]
    if batched:  # the verifier's batching across sessions, weighted by rounds
        rounds = sum(max(1, int(s.get("rounds", 0))) for s in batched)
        out["mean_batch_size"] = sum(float(s["mean_batch_size"]) * max(1, int(s.get("rounds", 0))) for s in batched) / rounds
        out["verify_queue_wait_s"] = sum(float(s.get("verify_queue_wait_s", 0.0)) for s in batched)
    return out


def summarize_by_category(records: Sequence[RequestRecord]) -> dict:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.category].append(r)
    out = {}
    for category, rs in sorted(groups.items()):
        s = summarize_records(rs, sum(r.latency_s or 0.0 for r in rs))
        out[category] = {key: s[key] for key in (
            "requests", "errors", "output_tokens", "tokens_per_s", "ttft_p50_s", "tpot_p50_s",
            "latency_p50_s", "acceptance_rate", "mean_accepted_length")}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- models and measurements ----------------------------------------------------------------------
def memory_roofline(target, t_step: float | None) -> dict:
    """The target's single-token step against the memory-bandwidth bound: every weight is read once
    per forward, so the step cannot beat weight bytes / bandwidth (measured here by streaming a
    buffer larger than the caches through a reduction, the same access pattern)."""
    import torch

    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    buffer = torch.ones(max(weight_bytes, 256 << 20) // 4, dtype=torch.float32, device=target.device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - start)
    bandwidth = buffer.numel() * 4 / best
    bound = weight_bytes / bandwidth
    return {"weight_bytes": weight_bytes, "bandwidth_gb_s": bandwidth / 1e9, "memory_bound_step_s": bound,
            "measured_step_s": t_step, "step_over_memory_bound": ratio(t_step, bound)}


def measure_draft_cost(draft, reps: int = 7) -> float:
    """Seconds of the draft model's one-token forward after a KV prefix (minimum over reps)."""
    return measure_forward_curve(draft, 1, reps=reps)[0]


def machine_info(device: str | None = None) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if device:
        info["device"] = device
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


# -- the command ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=None, help="gateway address HOST:PORT (default localhost:50051)")
    p.add_argument("--local", action="store_true", help="no gateway: run every system in this process")
    p.add_argument("--target", default="embedded", help="target model for local systems (hub id, dir, 'embedded')")
    p.add_argument("--draft-model", default=None, help="draft model for local systems (default: the shipped draft for the embedded target, else n-gram)")
    p.add_argument("--device", default=None, help="device for local models (default: cuda if present)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for local models (default: torch's; 1 is faster on a busy machine)")
    p.add_argument("--prompts", default="mt_bench",
                   help="comma-separated: mt_bench, humaneval or JSONL paths (MT-bench or HumanEval format)")
    p.add_argument("--limit", type=int, default=None, help="items per prompt set (categories taken in turn)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="request seeds and Poisson arrivals")
    p.add_argument("--concurrency", default=None,
                   help="conversations in flight (default 1; unbounded with --request-rate); a comma-separated "
                        "list (1,2,4,8,16) runs the systems at each level into OUT/c<N>/ and writes a scaling "
                        "table and plot (OUT/concurrency.md, concurrency_scaling.png)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: back to back)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated from {', '.join(SYSTEM_KINDS)} "
                        f"(default {DEFAULT_GATEWAY_SYSTEMS}; --local: {DEFAULT_LOCAL_SYSTEMS})")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds (gateway)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype for local models and the --up stack (default $SPECDEC_DTYPE, else auto)")
    p.add_argument("--up", action="store_true",
                   help="start a local stack (`specdec up` with --target/--draft-model/--net-delay/--draft-ahead) "
                        "for the gateway systems, and stop it afterwards")
    p.add_argument("--net-delay", type=float, default=0.0, metavar="MS",
                   help="with --up: one-way delay the gateway injects on every message to drafter and verifier "
                        "(cross-machine round trips); without --up, only recorded (start the gateway with "
                        "--net-delay-ms yourself)")
    p.add_argument("--drafter-device", default=None,
                   help="--up: the drafter service's device (default: as the verifier's; see specdec up)")
    p.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                   help="with --up: the gateway's default for draft-ahead (systems spec-ahead/spec-noahead force it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the systems: split the prompts into this many rounds and run every system "
                        "on each round, in alternating order (ratios between systems then resist a machine whose "
                        "speed drifts during the run); capped at conversations / concurrency")
    p.add_argument("--no-warmup", action="store_true", help="skip the one short warm-up request per system")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def validate_args(args) -> None:
    if args.local and args.gateway:
        raise ValueError("--local and --gateway exclude each other")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    levels = args.concurrency if isinstance(args.concurrency, list) else parse_concurrency(args.concurrency)
    if levels is not None and len(levels) > 1 and args.request_rate is not None:
        raise ValueError("--concurrency with several levels excludes --request-rate")
    args.concurrency = levels[0] if levels is not None and len(levels) == 1 else levels
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.net_delay < 0:
        raise ValueError("--net-delay must be >= 0")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.up and (args.local or args.gateway):
        raise ValueError("--up starts its own gateway: not with --local or --gateway")


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


class ModelCache:
    """Loads --target / --draft-model once, only when a system or a measurement needs them."""

    def __init__(self, args) -> None:
        self.args = args
        self._target = None
        self._draft = None

    def target(self):
        if self._target is None:
            from specdec.models import load_model

            self._target = load_model(self.args.target, device=self.args.device)
        return self._target

    def draft(self):
        from specdec.models import check_compatible, load_model

        if self._draft is None and self.args.draft_model:
            self._draft = load_model(self.args.draft_model, device=self.args.device)
            check_compatible(self.target(), self._draft)
        return self._draft

    def drafter(self):
        from specdec.drafters import ModelDrafter, NgramDrafter

        draft = self.draft()
        return ModelDrafter(draft) if draft is not None else NgramDrafter()


def start_local_stack(args):
    """``--up``: a local stack (``specdec up``) for the gateway systems; returns (stack, address)."""
    from specdec.stack import LocalStack

    up_args = ["--target", args.target, "--net-delay-ms", str(args.net_delay),
               "--draft-ahead" if args.draft_ahead else "--no-draft-ahead"]
    if args.draft_model:
        up_args += ["--draft-model", args.draft_model]
    if getattr(args, "drafter_device", None):
        up_args += ["--drafter-device", args.drafter_device]
    stack = LocalStack(up_args, quiet=True)
    log.info("starting a local stack: specdec up %s", " ".join(up_args))
    return stack, stack.__enter__()


def effective_rounds(rounds: int, conversations: int, concurrency: int | None) -> int:
    """--rounds, capped so that every round keeps ``concurrency`` conversations in flight."""
    per_round = concurrency if isinstance(concurrency, int) and concurrency > 0 else 1
    return max(1, min(rounds, conversations // per_round))


def _gateway_client(spec: SystemSpec, gateway_address: str | None, args):
    """The gateway client, opened for the first gateway system (None for local systems)."""
    if spec.kind != "gateway":
        return None
    from specdec.client import GatewayClient

    return GatewayClient(gateway_address, timeout=args.timeout)


def _make_runner(spec: SystemSpec, client, models: ModelCache, first: Conversation, args) -> Runner:
    """The runner of one system, warmed up with one short request (unless --no-warmup)."""
    if spec.kind == "gateway":
        runner: Runner = GatewayRunner(client, spec.method, spec.num_draft_tokens, spec.draft_ahead)
    elif spec.kind == "local":
        drafter = models.drafter() if spec.method != "none" else None
        runner = LocalRunner(models.target(), drafter, spec.num_draft_tokens)
    else:
        runner = HFRunner(models.target(), models.draft() if spec.assisted else None)
    if not args.no_warmup:
        try:
            runner.generate(messages=[("user", first.turns[0])] if first.chat else None,
                            prompt=None if first.chat else first.turns[0],
                            max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens),
                            temperature=args.temperature, seed=args.seed)
        except Exception as exc:  # noqa: BLE001 - the measured requests will show it
            log.warning("%s: warm-up failed: %s", spec.name, describe_error(exc))
    return runner


def run_bench(args) -> dict:
    """Run the benchmark described by ``args`` (the ``bench`` subcommand's namespace); returns the summary."""
    from specdec.models import default_draft_model

    validate_args(args)
    args.draft_model = args.draft_model or default_draft_model(args.target)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = load_prompts(args.prompts, args.limit)
    systems = parse_systems(args.systems or (DEFAULT_LOCAL_SYSTEMS if args.local else DEFAULT_GATEWAY_SYSTEMS),
                            args.local)
    gateway_address = None if args.local else (args.gateway or "localhost:50051")
    models = ModelCache(args)
    client = None
    stack = None
    if args.up and any(spec.kind == "gateway" for spec in systems):
        stack, gateway_address = start_local_stack(args)
    skipped: dict[str, str] = {}
    all_records: dict[str, list[RequestRecord]] = {}
    summaries: dict[str, dict] = {}
    progress = not args.no_progress
    runners: dict[str, Runner] = {}
    durations: dict[str, float] = {}
    round_rates: dict[str, list[float]] = {}  # output tokens/s of each round, per system
    rounds = effective_rounds(args.rounds, len(conversations), args.concurrency)
    try:
        for spec in systems:
            if spec.assisted and not args.draft_model:
                skipped[spec.name] = "skipped: hf-assisted needs --draft-model (assisted generation with the same draft)"
                log.warning("%s", skipped[spec.name])
        measured = [spec for spec in systems if spec.name not in skipped]
        # Interleaved rounds: conversation i belongs to round i % R; each round runs every system,
        # in reverse order every other round (A B, B A, ...), so a machine that slows down or speeds
        # up during the run weighs on all systems alike instead of on whichever ran last.
        for r in range(rounds):
            block = list(range(r, len(conversations), rounds))
            for spec in measured if r % 2 == 0 else measured[::-1]:
                if spec.name not in runners:
                    client = client or _gateway_client(spec, gateway_address, args)
                    runners[spec.name] = _make_runner(spec, client, models, conversations[0], args)
                label = spec.name if rounds == 1 else f"{spec.name} {r + 1}/{rounds}"
                records, duration = run_system(runners[spec.name], label, [conversations[i] for i in block],
                                               args, progress, indices=block)
                for record in records:
                    record.system = spec.name
                all_records.setdefault(spec.name, []).extend(records)
                durations[spec.name] = durations.get(spec.name, 0.0) + duration
                round_rates.setdefault(spec.name, []).append(output_tokens_per_s(records, duration))
        for spec in measured:
            records = all_records[spec.name]
            summary = summarize_records(records, durations[spec.name])
            summary["kind"] = {"gateway": "gateway", "local": "in-process loop", "hf": "transformers"}[spec.kind]
            if spec.kind != "hf":
                summary["num_draft_tokens"] = spec.num_draft_tokens
                summary["method"] = spec.method
            summary["per_category"] = summarize_by_category(records)
            summary["round_tokens_per_s"] = round_rates[spec.name]
            summaries[spec.name] = summary
            first_error = next((r.error for r in records if r.error), None)
            if first_error:
                summary["first_error"] = first_error
    finally:
        if client is not None:
            client.close()
        if stack is not None:
            stack.__exit__()

    speedup = compute_speedups(summaries)
    bound = compute_bound(args, summaries, all_records, models)
    speedup["measured_over_bound"] = bound.get("measured_over_bound")
    summary = {
        "config": {
            "mode": "local" if args.local else "gateway",
            "gateway": gateway_address,
            "target": args.target,
            "draft_model": args.draft_model,
            "dtype": os.environ.get("SPECDEC_DTYPE", "auto"),
            "prompts": args.prompts,
            "limit": args.limit,
            "conversations": len(conversations),
            "requests_per_system": sum(len(c.turns) for c in conversations),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "systems": [s.name for s in systems],
            "rounds": rounds,
            "net_delay_ms": args.net_delay,
            "net_delay_injected": (stack is not None or getattr(args, "stack_started", False)) and args.net_delay > 0,
            "draft_ahead_default": args.draft_ahead if stack is not None or getattr(args, "stack_started", False) else None,
        },
        "machine": machine_info(args.device),
        "systems": summaries,
        "skipped": skipped,
        "speedup": speedup,
        # The headline ratio's spread over the interleaved rounds (None with one round).
        "spec_vs_baseline_by_round": paired_round_ratios(summaries, spec_reference(summaries)) if rounds > 1 else None,
        "bound": bound,
    }
    from specdec import bench_plots

    summary["plots"] = bench_plots.write_plots(out_dir, summary, all_records)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as f:
        for records in all_records.values():
            for r in records:
                f.write(json.dumps(asdict(r)) + "\n")
    (out_dir / "report.md").write_text(render_report(summary))
    return summary


def spec_reference(summaries: dict) -> str | None:
    """The speculative system whose acceptance feeds the bound: spec, else inprocess, else a spec-k."""
    for name in ("spec", "inprocess"):
        if name in summaries:
            return name
    return next((n for n in summaries if n.startswith("spec-k=")), None)


def compute_speedups(summaries: dict) -> dict:
    def tps(name):
        s = summaries.get(name)
        return s["tokens_per_s"] if s and s.get("completed") else None

    out = {
        "spec_vs_baseline": ratio(tps("spec"), tps("baseline")),
        "spec_vs_hf": ratio(tps("spec"), tps("hf")),
        "spec_vs_hf_assisted": ratio(tps("spec"), tps("hf-assisted")),
        "spec_vs_inprocess": ratio(tps("spec"), tps("inprocess")),
        "inprocess_vs_baseline": ratio(tps("inprocess"), tps("baseline")),
        "inprocess_vs_hf": ratio(tps("inprocess"), tps("hf")),
        "hf_assisted_vs_hf": ratio(tps("hf-assisted"), tps("hf")),
    }
    for name in summaries:
        if name.startswith("spec-k=") or name in ("spec-ahead", "spec-noahead"):
            out[f"{name}_vs_baseline"] = ratio(tps(name), tps("baseline"))
    out["ahead_vs_noahead"] = ratio(tps("spec-ahead"), tps("spec-noahead"))
    return out


def paired_round_ratios(summaries: dict, a: str | None, b: str = "baseline") -> dict | None:
    """``a`` / ``b`` tokens/s within each interleaved round (the same requests, run back to back),
    and their spread: on a machine whose speed drifts, the rounds' ratios show how far the one
    aggregate ratio can be trusted. ``mean`` and ``stderr`` are of the per-round ratios (stderr None
    for one round); None unless both systems ran."""
    if a not in summaries or b not in summaries:
        return None
    ratios = [x / y for x, y in zip(summaries[a]["round_tokens_per_s"], summaries[b]["round_tokens_per_s"]) if y > 0]
    if not ratios:
        return None
    n = len(ratios)
    mean = sum(ratios) / n
    stderr = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1) / n) if n > 1 else None
    return {"pair": [a, b], "ratios": ratios, "mean": mean, "stderr": stderr, "min": min(ratios), "max": max(ratios)}


def format_round_ratios(by_round: dict) -> str:
    """``0.96, 1.04, 0.95 (mean 0.983 ± 0.028 s.e.)``"""
    spread = f" ± {by_round['stderr']:.3f} s.e." if by_round.get("stderr") is not None else ""
    return ", ".join(f"{r:.2f}" for r in by_round["ratios"]) + f" (mean {by_round['mean']:.3f}{spread})"


def bound_acceptance(summary: dict) -> dict:
    """The acceptance the bound assumes, from one system's summary: ``alphas_by_position`` (conditional
    acceptance of the positions drafted at least MIN_POSITION_DRAFTS times), ``alpha`` (their pooled
    value: the tail of the positional curve) and ``acceptance_rate`` (accepted / drafted).

    Shadow probes draft one token (the policy's probe_k) beside plain rounds, whatever the policy expects
    of them: first-position samples it did not pick for looking promising. They join the first position;
    otherwise an adaptive policy that drafts rarely, and only where it expects acceptance, makes the
    drafts it did verify look far better than the draft is (seen: 51 of 51 accepted, a 4x "bound").
    """
    drafted, rates = summary.get("per_position_drafted") or [], summary.get("per_position_acceptance") or []
    reliable = [r for r, d in zip(rates, drafted) if d >= MIN_POSITION_DRAFTS]
    alphas = conditional_alphas(reliable) if reliable else []
    weights = list(drafted[: len(alphas)])
    out: dict = {"acceptance_rate": summary["acceptance_rate"]}
    probes, probe_hits = int(summary.get("shadow_probes") or 0), int(summary.get("shadow_accepted") or 0)
    if probes:
        first_drafted = (drafted[0] if drafted else 0) + probes
        first_accepted = (rates[0] * drafted[0] if drafted else 0.0) + probe_hits
        if first_drafted >= MIN_POSITION_DRAFTS:
            alphas = [first_accepted / first_drafted] + alphas[1:]
            weights = [first_drafted] + weights[1:]
        out["first_position_samples"] = {"drafted_rounds": drafted[0] if drafted else 0, "shadow_probes": probes,
                                         "accepted": round(first_accepted), "alpha": first_accepted / first_drafted}
    alpha = sum(a * w for a, w in zip(alphas, weights)) / sum(weights) if alphas else summary["acceptance_rate"]
    out.update({"alpha": alpha, "alphas_by_position": alphas})
    return out


def compute_bound(args, summaries: dict, all_records: dict, models: ModelCache) -> dict:
    """The analytic speedup bound from measured acceptance and costs, and measured / bound."""
    out: dict = {"measured_over_bound": None}
    ref = spec_reference(summaries)
    base = "baseline" if "baseline" in summaries else ("hf" if "hf" in summaries else None)
    if ref is None or summaries[ref].get("acceptance_rate") is None:
        out["note"] = "no speculative system with acceptance stats was run"
        return out
    s = summaries[ref]
    out["acceptance_from"] = ref
    out.update(bound_acceptance(s))
    alpha, alpha_pooled, alphas = out["acceptance_rate"], out["alpha"], out["alphas_by_position"]

    # Verify-cost curve and draft cost.
    t_verify, t_draft, source = None, None, None
    if not args.local:
        samples = [(int(r.stats.get("rounds", 0)), int(r.stats.get("draft_tokens", 0)), float(r.stats.get("verify_s", 0.0)))
                   for name, rs in all_records.items() if summaries[name]["kind"] == "gateway"
                   for r in rs if r.error is None and r.stats]
        fit = fit_verify_cost(samples)
        if fit is not None:
            a, b = fit
            t_verify = [a + b * k for k in range(VERIFY_CURVE_TOKENS)]
            source = f"gateway stats: least squares verify_s = a*rounds + b*drafts (a={a * 1e3:.2f} ms, b={b * 1e3:.2f} ms)"
    if t_verify is None:
        try:
            t_verify = measure_forward_curve(models.target(), VERIFY_CURVE_TOKENS)
            source = (f"local measurement: target forward over 1..{VERIFY_CURVE_TOKENS} tokens after a "
                      f"{FORWARD_CURVE_PREFIX}-token KV prefix (minimum of 5 sweeps, made non-decreasing)")
        except Exception as exc:  # noqa: BLE001 - no local target: no bound
            out["note"] = f"no verify-cost curve: {describe_error(exc)}"
            return out
    if s.get("draft_tokens"):
        t_draft = s.get("draft_s", 0.0) / s["draft_tokens"]
        draft_source = f"{ref} stats: draft_s / draft_tokens"
    else:
        t_draft, draft_source = 0.0, "no drafts"
    if args.local and args.draft_model:
        try:
            t_draft = measure_draft_cost(models.draft())
            draft_source = "local measurement: draft forward over 1 token after a KV prefix"
        except Exception as exc:  # noqa: BLE001
            log.warning("draft cost measurement failed: %s", exc)
    result = speedup_bound(t_verify, t_draft, alpha=alpha_pooled, alphas=alphas or None)
    geometric = speedup_bound(t_verify, t_draft, alpha=alpha)
    try:
        out["roofline"] = memory_roofline(models.target(), t_verify[0])
    except Exception as exc:  # noqa: BLE001 - no local target: no roofline
        out["roofline"] = {"note": describe_error(exc)}
    out.update({
        "t_verify_s": t_verify,
        "t_verify_source": source,
        "t_draft_s": t_draft,
        "t_draft_source": draft_source,
        "best_k": result["best_k"],
        "bound": result["bound"],
        "curve": result["curve"],
        "bound_geometric_acceptance_rate": geometric["bound"],
        "best_k_geometric_acceptance_rate": geometric["best_k"],
    })
    if base is not None and summaries[base].get("tokens_per_s"):
        measured = ratio(summaries[ref]["tokens_per_s"], summaries[base]["tokens_per_s"])
        out.update({"measured": measured, "measured_pair": [ref, base],
                    "measured_over_bound": ratio(measured, result["bound"])})
    else:
        out["note"] = "no baseline (or hf) system: measured speedup unknown"
    return out


# -- report ---------------------------------------------------------------------------------------
def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    return f"{value * scale:.{digits}f}"


def render_report(summary: dict) -> str:
    cfg, systems, speed, bound = summary["config"], summary["systems"], summary["speedup"], summary["bound"]
    machine = summary["machine"]
    lines = ["# specdec bench report", ""]
    lines.append(f"- mode: **{cfg['mode']}**" + (f" (gateway {cfg['gateway']})" if cfg["gateway"] else ""))
    local_draft = cfg["draft_model"] or "none (n-gram drafter)"
    if cfg["mode"] == "local":
        lines.append(f"- target: `{cfg['target']}`; draft model: `{local_draft}`")
    else:
        methods = sorted({s["draft_method"] for s in systems.values() if s.get("draft_method")})
        lines.append(f"- gateway systems: the gateway's models (draft methods seen: {', '.join(methods) or 'none'}); "
                     f"local systems (if any): target `{cfg['target']}`, draft `{local_draft}`")
    lines.append(f"- prompts: `{cfg['prompts']}`, limit {cfg['limit']} per set → {cfg['conversations']} conversations, "
                 f"{cfg['requests_per_system']} requests per system")
    lines.append(f"- max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, seed {cfg['seed']}, "
                 f"concurrency {cfg['concurrency'] or ('unbounded' if cfg['request_rate'] else 1)}, "
                 f"request rate {cfg['request_rate'] or 'back to back'}")
    if cfg["net_delay_ms"] and cfg.get("net_delay_injected"):
        lines.append(f"- net delay: {cfg['net_delay_ms']} ms one way on every gateway↔drafter/verifier message "
                     "(injected by the gateway this bench started)")
    elif cfg["net_delay_ms"]:
        lines.append(f"- net delay: {cfg['net_delay_ms']} ms (recorded; injected only if the gateway was started "
                     "with --net-delay-ms)")
    else:
        lines.append("- net delay: 0 ms")
    lines.append(f"- machine: {machine.get('cpu_model', machine.get('processor'))}, {machine.get('cpu_count')} CPUs, "
                 f"{machine.get('torch_threads')} torch threads"
                 + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
                 + f"; torch {machine.get('torch')}, transformers {machine.get('transformers')}")
    lines.append("")
    for name, reason in summary.get("skipped", {}).items():
        lines.append(f"> **{name}** {reason}")
        lines.append("")

    lines += ["## Systems", "",
              "| system | kind | tok/s | req/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) "
              "| latency p50 / p99 (s) | acceptance | mean accepted len | mean k | errors |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in systems.items():
        lines.append(
            f"| {name} | {s.get('kind')} | {_fmt(s['tokens_per_s'])} | {_fmt(s['requests_per_s'], digits=3)} "
            f"| {_fmt(s['ttft_p50_s'], 1e3, 0)} / {_fmt(s['ttft_p90_s'], 1e3, 0)} / {_fmt(s['ttft_p99_s'], 1e3, 0)} "
            f"| {_fmt(s['tpot_p50_s'], 1e3, 1)} / {_fmt(s['tpot_p99_s'], 1e3, 1)} "
            f"| {_fmt(s['itl_p50_s'], 1e3, 1)} / {_fmt(s['itl_p99_s'], 1e3, 1)} "
            f"| {_fmt(s['latency_p50_s'])} / {_fmt(s['latency_p99_s'])} "
            f"| {_fmt(s.get('acceptance_rate'), digits=3)} | {_fmt(s.get('mean_accepted_length'))} "
            f"| {_fmt(s.get('k_mean'))} | {s['errors']} |")
    lines.append("")
    lines.append("TTFT, TPOT = (latency − TTFT)/(tokens − 1), ITL counted per token (a chunk of n tokens "
                 "after a gap g counts n × g/n), latency: mean / p50 / p90 / p99 of each are in summary.json. "
                 "tok/s and req/s are over the wall time of the system's run.")
    lines.append("")
    errors = {n: s["first_error"] for n, s in systems.items() if s.get("first_error")}
    for name, err in errors.items():
        lines.append(f"- first error of {name}: `{err}`")
    if errors:
        lines.append("")

    lines += ["## Speedup (output tokens/s ratio)", "", "| comparison | speedup |", "|---|---:|"]
    for key, value in speed.items():
        lines.append(f"| {key} | {_fmt(value, digits=3)} |")
    lines.append("")
    if by_round := summary.get("spec_vs_baseline_by_round"):
        lines += [f"{by_round['pair'][0]} / {by_round['pair'][1]} within each interleaved round: "
                  f"{format_round_ratios(by_round)}", ""]

    lines += ["## Analytic bound", ""]
    if bound.get("bound") is not None:
        alphas = ", ".join(f"{a:.2f}" for a in bound.get("alphas_by_position", [])) or "–"
        lines += [
            f"- acceptance from **{bound['acceptance_from']}**: per-token α = {_fmt(bound['alpha'], digits=3)} "
            f"(acceptance rate {_fmt(bound['acceptance_rate'], digits=3)}); conditional α by position: {alphas}",
            f"- t_draft per token = {_fmt(bound['t_draft_s'], 1e3, 2)} ms ({bound['t_draft_source']})",
            f"- t_verify(k): {bound['t_verify_source']}",
            f"- bound = max_k E[tokens](k)·t_verify(0)/(k·t_draft + t_verify(k)) = **{_fmt(bound['bound'], digits=3)}×** "
            f"at k = {bound['best_k']} (geometric in the acceptance rate: {_fmt(bound['bound_geometric_acceptance_rate'], digits=3)}× "
            f"at k = {bound['best_k_geometric_acceptance_rate']})",
        ]
        roof = bound.get("roofline") or {}
        if roof.get("memory_bound_step_s"):
            lines.append(f"- target step vs memory bandwidth: {roof['weight_bytes'] / 1e6:.0f} MB of weights ÷ "
                         f"{roof['bandwidth_gb_s']:.1f} GB/s measured = {_fmt(roof['memory_bound_step_s'], 1e3, 1)} ms; "
                         f"t_verify(0) = {_fmt(roof['measured_step_s'], 1e3, 1)} ms "
                         f"(**{_fmt(roof['step_over_memory_bound'], digits=2)}×** the bound)")
        if bound.get("measured") is not None:
            pair = bound["measured_pair"]
            lines.append(f"- measured = {pair[0]} tok/s ÷ {pair[1]} tok/s = {_fmt(bound['measured'], digits=3)}×; "
                         f"measured / bound = **{_fmt(bound['measured_over_bound'], digits=3)}**")
        lines += ["", "| k | t_verify(k) (ms) | E[tokens](k) | speedup(k) |", "|---:|---:|---:|---:|"]
        for point in bound["curve"]:
            k = point["k"]
            lines.append(f"| {k} | {_fmt(bound['t_verify_s'][k], 1e3, 2)} | {_fmt(point['expected_tokens'], digits=3)} "
                         f"| {_fmt(point['speedup'], digits=3)} |")
    lines.append("")
    if bound.get("note"):
        lines += [f"Note: {bound['note']}", ""]

    categories = sorted({c for s in systems.values() for c in s.get("per_category", {})})
    if categories and systems:
        names = list(systems)
        lines += ["## Per category (tokens/s over summed request latency; acceptance)", "",
                  "| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for c in categories:
            cells = []
            for n in names:
                pc = systems[n].get("per_category", {}).get(c)
                if pc is None:
                    cells.append("–")
                    continue
                cell = _fmt(pc["tokens_per_s"])
                if pc.get("acceptance_rate") is not None:
                    cell += f" (α {pc['acceptance_rate']:.2f})"
                cells.append(cell)
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")

    plots = summary.get("plots") or []
    if plots:
        lines += ["## Plots", ""]
        for p in plots:
            lines.append(f"![{Path(p).stem}]({p})")
        lines.append("")
    return "\n".join(lines)


SCALING_FIELDS = ("tokens_per_s", "ttft_p50_s", "tpot_p50_s", "latency_p50_s", "acceptance_rate",
                  "mean_accepted_length", "k_mean", "mean_batch_size", "errors")


def run_sweep(args) -> dict:
    """``--concurrency 1,2,4,...``: every system at every level (one stack for all with ``--up``),
    each level's full report under ``OUT/c<N>/``, and the scaling table and plot in ``OUT``."""
    import copy

    levels = list(args.concurrency)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stack = None
    base = copy.copy(args)
    from specdec.models import default_draft_model

    base.draft_model = base.draft_model or default_draft_model(base.target)
    if args.up:
        stack, base.gateway = start_local_stack(base)
        base.up, base.stack_started = False, True
    runs: dict[int, dict] = {}
    try:
        for level in levels:
            run_args = copy.copy(base)
            run_args.concurrency, run_args.out = level, str(out_dir / f"c{level}")
            log.info("concurrency %d", level)
            runs[level] = run_bench(run_args)
    finally:
        if stack is not None:
            stack.__exit__()
    systems = list(runs[levels[0]]["systems"])
    sweep = {
        "levels": levels,
        "config": {**runs[levels[0]]["config"], "concurrency": levels},
        "machine": runs[levels[0]]["machine"],
        "systems": {name: [{"concurrency": level, **{f: runs[level]["systems"].get(name, {}).get(f) for f in SCALING_FIELDS}}
                           for level in levels] for name in systems},
        "spec_vs_baseline": [runs[level]["speedup"].get("spec_vs_baseline") for level in levels],
        "spec_vs_baseline_by_round": [runs[level].get("spec_vs_baseline_by_round") for level in levels],
    }
    for name, points in sweep["systems"].items():
        first = points[0]["tokens_per_s"]
        for point in points:
            point["scaling_vs_first_level"] = ratio(point["tokens_per_s"], first)
    from specdec import bench_plots

    sweep["plot"] = bench_plots.plot_concurrency_scaling(out_dir / "concurrency_scaling.png", sweep)
    (out_dir / "concurrency.json").write_text(json.dumps(sweep, indent=2) + "\n")
    (out_dir / "concurrency.md").write_text(render_sweep(sweep))
    return sweep


def render_sweep(sweep: dict) -> str:
    cfg = sweep["config"]
    lines = ["# specdec bench: concurrency sweep", "",
             f"- prompts `{cfg['prompts']}`, limit {cfg['limit']} → {cfg['requests_per_system']} requests per system "
             f"and level; max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}",
             f"- levels (conversations in flight): {', '.join(map(str, sweep['levels']))}; each level's full report "
             "is in c<N>/report.md", "",
             "| system | concurrency | tok/s (aggregate) | × level 1 | TTFT p50 (ms) | TPOT p50 (ms) "
             "| mean accepted len | mean k | mean verifier batch | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, points in sweep["systems"].items():
        for p in points:
            lines.append(f"| {name} | {p['concurrency']} | {_fmt(p['tokens_per_s'])} | {_fmt(p['scaling_vs_first_level'])} "
                         f"| {_fmt(p['ttft_p50_s'], 1e3, 0)} | {_fmt(p['tpot_p50_s'], 1e3, 1)} "
                         f"| {_fmt(p['mean_accepted_length'])} | {_fmt(p['k_mean'])} | {_fmt(p['mean_batch_size'])} "
                         f"| {p['errors']} |")
    lines += ["", "| concurrency | " + " | ".join(map(str, sweep["levels"])) + " |",
              "|---|" + "---:|" * len(sweep["levels"]),
              "| spec / baseline | " + " | ".join(_fmt(v, digits=3) for v in sweep["spec_vs_baseline"]) + " |"]
    by_round = sweep.get("spec_vs_baseline_by_round") or []
    if any(by_round):
        lines += ["| per round: min – max | " + " | ".join(
                      f"{b['min']:.2f} – {b['max']:.2f}" if b else "–" for b in by_round) + " |",
                  "| per round: mean ± s.e. | " + " | ".join(
                      (f"{b['mean']:.3f} ± {b['stderr']:.3f}" if b.get("stderr") is not None else f"{b['mean']:.3f}")
                      if b else "–" for b in by_round) + " |"]
    lines += ["", f"![concurrency scaling]({sweep['plot']})", ""]
    return "\n".join(lines)


def main(args) -> int:
    """The ``specdec bench`` entry point (``args`` from ``add_arguments``)."""
    from specdec.models import ModelLoadError

    try:
        validate_args(args)
        if isinstance(args.concurrency, list):
            sweep = run_sweep(args)
            print(f"wrote {Path(args.out) / 'concurrency.md'} (and c<N>/ per level)")
            for name, points in sweep["systems"].items():
                print(f"  {name:>12}: " + ", ".join(f"c={p['concurrency']} {p['tokens_per_s']:.2f} tok/s" for p in points))
            print("  spec/baseline: " + ", ".join(_fmt(v, digits=3) for v in sweep["spec_vs_baseline"]))
            return 1 if any(p["errors"] for points in sweep["systems"].values() for p in points) else 0
        summary = run_bench(args)
    except (ValueError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'summary.json'} and report.md")
    for name, s in summary["systems"].items():
        print(f"  {name:>12}: {s['tokens_per_s']:.2f} tok/s, TTFT p50 {_fmt(s['ttft_p50_s'], 1e3, 0)} ms, "
              f"acceptance {_fmt(s.get('acceptance_rate'), digits=3)}, errors {s['errors']}")
    for name, reason in summary["skipped"].items():
        print(f"  {name:>12}: {reason}")
    sp = {k: v for k, v in summary["speedup"].items() if v is not None}
    if sp:
        print("  speedup: " + ", ".join(f"{k} {v:.3f}" for k, v in sp.items()))
    if by_round := summary.get("spec_vs_baseline_by_round"):
        print(f"  {by_round['pair'][0]}/{by_round['pair'][1]} by round: {format_round_ratios(by_round)}")
    return 1 if any(s["errors"] for s in summary["systems"].values()) else 0
