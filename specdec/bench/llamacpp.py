"""The llama.cpp peer of ``specdec bench``: the systems ``llamacpp`` and ``llamacpp-lookup``.

Both decode greedily in llama.cpp itself, in this process, through specdec's binding
(``specdec.gguf``: one context of the GGUF file, passes through ``GgufModel.forward`` over
``LlamaContext.decode``), on the same GGUF file the target runs (``--target``: a ``.gguf`` file, or
``embedded``, the shipped one) and with the verifier's thread count (``--threads``, else the cores
this process may use). At concurrency N, N sequences of one context step together, one batch per
step, a newcomer's prompt in the same batch as the others' next tokens, which is how a llama.cpp
server with N slots decodes; a request beyond N waits for a free slot.

- ``llamacpp``: plain decoding, one token per sequence per step.
- ``llamacpp-lookup``: prompt-lookup speculation. This mirrors llama.cpp's ``lookup`` example
  (``examples/lookup/lookup.cpp`` and ``common/ngram-cache.cpp`` of the llama.cpp that
  llama-cpp-python 0.3.36 vendors) in Python on the same binding; it does not run that C++ example.
  Mirrored: the context n-gram cache (n-grams of ``LLAMA_NGRAM_MIN`` .. ``LLAMA_NGRAM_MAX`` = 1..4
  tokens of the prompt and every token since, each counting the tokens that followed it); a draft
  of up to n_draft = 3 tokens (``speculative.draft.n_max``'s default there), each the most frequent
  follower of the longest n-gram ending the text + draft so far whose counts pass the example's lax
  thresholds (at least 2, 2, 1, 1 samples and a 66, 50, 50, 50 % share for sizes 1..4), else of the
  next shorter one, stopping at the first position none passes; the pending token and the draft
  verified in one batch, the greedy-matching prefix kept plus the target's token after it, the
  rejected positions removed. Not mirrored: the dynamic and static caches (empty unless files are
  named); a tie between followers goes to the first seen (the C++ walks an unordered_map); a draft is
  cut to the tokens the request may still emit, as llama.cpp's server cuts it.

Greedy only; a request stops at an end-of-sequence token or ``max_new_tokens`` exactly as the other
systems do (``CompletionBuilder``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from pathlib import Path

from specdec.bench.runners import (
    LLAMACPP_KIND,
    LOOKUP_METHOD,
    ChunkClock,
    Outcome,
    Runner,
    SystemSpec,
    describe_error,
    encode,
)
from specdec.sampling import greedy_tokens

log = logging.getLogger(__name__)

NGRAM_MIN, NGRAM_MAX = 1, 4  # LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX
NGRAM_STATIC = 2  # LLAMA_NGRAM_STATIC: no draft from a text shorter than this
N_DRAFT = 3  # common_params_speculative_draft::n_max
# draft_min_sample_size_lax / draft_min_percent_lax, by n-gram size 1..4
MIN_SAMPLES = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)
# The forward curve's points in the report (summary.json keeps every size up to the last).
CURVE_POINTS = (1, 2, 4, 8, 16)


def is_llamacpp(spec: SystemSpec) -> bool:
    return spec.kind == LLAMACPP_KIND


def check_greedy(systems, temperature: float) -> None:
    """``ValueError`` when a llama.cpp system is asked to sample."""
    from specdec.wire_types import GREEDY_TEMPERATURE

    names = [s.name for s in systems if is_llamacpp(s)]
    if names and temperature >= GREEDY_TEMPERATURE:
        raise ValueError(f"--temperature {temperature:g}: {', '.join(names)} decode greedily only (temperature 0)")


def gguf_file(target: str) -> Path:
    """The GGUF file of ``--target``: a ``.gguf`` path, or the shipped file of the embedded default."""
    from specdec.models import EMBEDDED_ALIASES, GGUF_SUFFIX, _embedded_gguf_path

    if target in EMBEDDED_ALIASES:
        return _embedded_gguf_path()
    if target.endswith(GGUF_SUFFIX):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"--target: no file {path}")
        return path
    raise ValueError(f"--target {target!r}: the llamacpp systems run a GGUF file: name a .gguf file or 'embedded'")


def llamacpp_threads(args) -> tuple[int, str]:
    """llama.cpp's thread count for the peer and where it came from: the verifier's, ``--threads``
    if given, else the cores this process may use."""
    if getattr(args, "threads", None):
        return int(args.threads), "--threads"
    return len(os.sched_getaffinity(0)), "the cores this process may use"


def requested_slots(args) -> int:
    """Sequences stepped together: ``--concurrency`` (unbounded with --request-rate: as many as the
    gguf runtime's context holds by default)."""
    from specdec.gguf.runtime import DEFAULT_SEQUENCES

    if isinstance(args.concurrency, int):
        return args.concurrency
    return DEFAULT_SEQUENCES if args.request_rate else 1


class NgramCache:
    """llama.cpp's context n-gram cache (``common_ngram_cache``) and its drafting
    (``common_ngram_cache_draft`` with the context cache only)."""

    def __init__(self) -> None:
        self.followers: dict[tuple[int, ...], dict[int, int]] = {}
        self.seen = 0  # tokens of the text already counted

    def update(self, tokens: list[int]) -> None:
        """Count the n-grams that end in the tokens appended since the last call (``tokens`` only grows)."""
        for size in range(NGRAM_MIN, NGRAM_MAX + 1):
            for i in range(max(self.seen, size), len(tokens)):
                counts = self.followers.setdefault(tuple(tokens[i - size:i]), {})
                counts[tokens[i]] = counts.get(tokens[i], 0) + 1
        self.seen = len(tokens)

    def _follower(self, tail: list[int]) -> int | None:
        for size in range(min(NGRAM_MAX, len(tail)), NGRAM_MIN - 1, -1):
            counts = self.followers.get(tuple(tail[-size:]))
            if not counts:
                continue
            best, best_count = None, 0
            for token, count in counts.items():
                if count > best_count:
                    best, best_count = token, count
            total = sum(counts.values())
            if total >= MIN_SAMPLES[size - 1] and 100 * best_count >= MIN_PERCENT[size - 1] * total:
                return best
        return None

    def draft(self, tokens: list[int], n_draft: int) -> list[int]:
        """Up to ``n_draft`` tokens to follow ``tokens`` (the text so far, its last token the pending one)."""
        if len(tokens) < NGRAM_STATIC:
            return []
        tail, drafted = list(tokens[-NGRAM_MAX:]), []
        while len(drafted) < n_draft:
            token = self._follower(tail)
            if token is None:
                break
            drafted.append(token)
            tail = (tail + [token])[-NGRAM_MAX:]
        return drafted


class _Request:
    """One generation in a slot: its prompt, what it emitted, its pending token and draft."""

    def __init__(self, prompt: list[int], builder, lookup: bool) -> None:
        self.prompt = prompt
        self.builder = builder
        self.clock = ChunkClock()
        self.kv = None  # the slot's GgufKV while it runs
        self.text = list(prompt)  # prompt + emitted tokens: what lookup drafts from
        self.ngrams = NgramCache() if lookup else None
        self.pending: int | None = None  # the last emitted token, fed by the next step
        self.drafts: list[int] = []
        self.rounds = 0
        self.k_history: list[int] = []
        self.position_counts: list[list[int]] = []  # [drafted, accepted] per draft position
        self.round_tokens = 0
        self.draft_s = 0.0
        self.batch_sizes = 0  # summed over its steps
        self.steps = 0
        self.done = threading.Event()
        self.error: BaseException | None = None

    def feed(self) -> tuple[list[int], int]:
        """The tokens this step feeds and how many logits it reads."""
        if self.pending is None:
            return self.prompt, 1
        return [self.pending, *self.drafts], 1 + len(self.drafts)

    def advance(self, greedy: list[int], start_length: int) -> None:
        """Take the step's greedy tokens: the prompt's next token, or the draft's matching prefix + one."""
        if self.pending is None:
            emitted = greedy
        else:
            accepted = 0
            while accepted < len(self.drafts) and greedy[accepted] == self.drafts[accepted]:
                accepted += 1
            emitted = greedy[:accepted + 1]
            self.kv.crop(start_length + 1 + accepted)  # keep the pending token and the accepted drafts
            self.rounds += 1
            self.k_history.append(len(self.drafts))
            for i in range(len(self.drafts)):
                if i == len(self.position_counts):
                    self.position_counts.append([0, 0])
                self.position_counts[i][0] += 1
                self.position_counts[i][1] += i < accepted
        chunk = self.builder.add(emitted)
        self.clock.chunk(len(chunk.token_ids))
        if self.pending is not None:
            self.round_tokens += len(chunk.token_ids)
        if self.builder.finished:
            return
        self.pending = emitted[-1]
        self.text.extend(emitted)
        self.drafts = []
        if self.ngrams is not None:
            start = time.perf_counter()
            self.ngrams.update(self.text)
            left = self.builder.params.max_new_tokens - len(self.builder.token_ids)
            self.drafts = self.ngrams.draft(self.text, min(N_DRAFT, left - 1))  # a step emits drafts + 1 at most
            self.draft_s += time.perf_counter() - start

    def outcome(self, method: str) -> Outcome:
        outcome = self.clock.outcome(self.builder.text, self.builder.finish_reason or "")
        drafted = sum(self.k_history)
        accepted = sum(a for _, a in self.position_counts)
        outcome.stats = {
            "draft_method": method, "rounds": self.rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
            "mean_accepted_length": self.round_tokens / self.rounds if self.rounds else 0.0,
            "k_history": self.k_history,
            "per_position_acceptance": [a / d if d else 0.0 for d, a in self.position_counts],
            "draft_s": self.draft_s, "mean_batch_size": self.batch_sizes / self.steps if self.steps else 0.0,
            "ttft_s": outcome.chunk_times[0] - outcome.start if outcome.chunk_times else None,
            "total_s": outcome.end - outcome.start,
        }
        outcome.token_ids, outcome.prompt_token_ids = list(self.builder.token_ids), list(self.prompt)
        return outcome


class LlamaCppRunner(Runner):
    """Greedy decoding of every request in flight, stepped together in one llama.cpp context.

    ``generate`` (from any thread) queues the request and waits; one stepping thread admits queued
    requests to free sequences, runs one pass over every running request's feed, and hands each its
    tokens."""

    def __init__(self, lm, threads: int, lookup: bool = False) -> None:
        self.lm = lm
        self.model = lm.gguf
        self.model.context.set_threads(threads)
        self.lookup = lookup
        self.method = LOOKUP_METHOD if lookup else "none"
        self._free = [self.model.new_kv() for _ in range(self.model.context.sequences)][::-1]
        self.slots = len(self._free)
        self.batch_sizes: Counter[int] = Counter()  # steps by the number of sequences they stepped
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="llamacpp-steps", daemon=True)
        self._thread.start()

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        from specdec.wire_types import GREEDY_TEMPERATURE

        if temperature >= GREEDY_TEMPERATURE:
            raise ValueError("temperature: llama.cpp's systems decode greedily only")
        return self.result(self.submit(encode(self.lm.tokenizer, messages, prompt), max_new_tokens))

    def submit(self, prompt_ids: list[int], max_new_tokens: int) -> _Request:
        """Queue a greedy generation of ``prompt_ids``; ``result`` waits for it."""
        from specdec.completion import CompletionBuilder
        from specdec.wire_types import SamplingParams

        positions = self.model.max_positions
        if not prompt_ids:
            raise ValueError("prompt: empty")
        if len(prompt_ids) + max_new_tokens > positions:
            raise ValueError(f"max_new_tokens: a prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceed "
                             f"the {positions} positions of a sequence (the gguf runtime's $SPECDEC_GGUF_POSITIONS)")
        builder = CompletionBuilder(self.lm.tokenizer, SamplingParams(max_new_tokens=max_new_tokens),
                                    self.lm.eos_token_ids)
        request = _Request(list(prompt_ids), builder, self.lookup)
        with self._cv:
            if self._closed:
                raise RuntimeError("the llamacpp runner is closed")
            self._waiting.append(request)
            self._cv.notify()
        return request

    def result(self, request: _Request) -> Outcome:
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.outcome(self.method)

    @contextmanager
    def held(self):
        """Hold the stepping between two steps: requests submitted meanwhile start in the same step."""
        with self._cv:
            yield

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._running:
                    self._cv.wait()
                if self._closed:
                    for request in [*self._waiting, *self._running]:
                        self._finish(request, RuntimeError("the llamacpp runner closed"))
                    return
                while self._waiting and self._free:
                    request = self._waiting.popleft()
                    request.kv = self._free.pop()
                    self._running.append(request)
                batch = list(self._running)
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - the loop outlives a failed step: its requests fail
                for request in batch:
                    if not request.done.is_set():
                        self._finish(request, exc)

    def _step(self, batch: list[_Request]) -> None:
        feeds, reads = zip(*(request.feed() for request in batch))
        starts = [request.kv.length for request in batch]
        try:
            logits = self.model.forward([request.kv for request in batch], list(feeds), list(reads))
            greedy = greedy_tokens(logits, self.lm.vocab_size).tolist()
        except Exception as exc:  # noqa: BLE001 - every request of the failed pass fails with it
            for request in batch:
                self._finish(request, exc)
            return
        self.batch_sizes[len(batch)] += 1
        row = 0
        for request, start, n in zip(batch, starts, reads):
            request.steps += 1
            request.batch_sizes += len(batch)
            try:
                request.advance(greedy[row:row + n], start)
            except Exception as exc:  # noqa: BLE001 - that request fails; the others go on
                self._finish(request, exc)
            else:
                if request.builder.finished:
                    self._finish(request)
            row += n

    def _finish(self, request: _Request, error: BaseException | None = None) -> None:
        request.error = error
        if request.kv is not None:
            try:
                request.kv.crop(0)
            except Exception:  # noqa: BLE001 - a sequence that cannot be cleared is not reused
                log.exception("llamacpp: cannot clear sequence %d", request.kv.seq_id)
            else:
                with self._cv:
                    self._free.append(request.kv)
            request.kv = None
        with self._cv:
            if request in self._running:
                self._running.remove(request)
        request.done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()
        for kv in self._free:
            kv.release()
        self._free = []
        self.model.close()


def load_gguf_target(args, sequences: int):
    """The GGUF file of ``--target`` on the gguf runtime, its context holding ``sequences`` sequences."""
    from specdec.models import load_model

    path = gguf_file(args.target)
    return load_model(str(path), device="cpu", runtime="gguf", sessions=sequences)


def make_runner(spec: SystemSpec, args) -> LlamaCppRunner:
    """The runner of ``llamacpp`` / ``llamacpp-lookup`` for this bench run."""
    slots = requested_slots(args)
    lm = load_gguf_target(args, slots)
    runner = LlamaCppRunner(lm, llamacpp_threads(args)[0], lookup=spec.method == LOOKUP_METHOD)
    if runner.slots < slots:
        log.warning("%s: %d slots (the gguf runtime's sequences, $SPECDEC_GGUF_SEQUENCES), not %d: the other "
                    "requests wait for a free one", spec.name, runner.slots, slots)
    return runner


def forward_curves(args, models) -> dict:
    """The GGUF file's forward over 1..VERIFY_CURVE_TOKENS tokens in llama.cpp at the peer's threads,
    and the fp32 lean runtime's of the same target where there is one (the embedded default)."""
    import torch

    from specdec.bench.bound import VERIFY_CURVE_TOKENS
    from specdec.costs import FORWARD_CURVE_PREFIX, measure_forward_curve
    from specdec.models import EMBEDDED_ALIASES, load_model

    threads, _ = llamacpp_threads(args)
    out: dict = {"tokens": list(range(1, VERIFY_CURVE_TOKENS + 1)), "prefix_tokens": FORWARD_CURVE_PREFIX}
    lm = load_gguf_target(args, 1)
    try:
        lm.gguf.context.set_threads(threads)
        out["gguf"] = {"seconds": measure_forward_curve(lm, VERIFY_CURVE_TOKENS), "threads": threads}
    finally:
        lm.gguf.close()
    out["lean_fp32"] = None
    if args.target not in EMBEDDED_ALIASES:
        out["lean_note"] = "no fp32 model of this GGUF file on the lean runtime (only the embedded default has one)"
        return out
    try:
        loaded = models.loaded_target
        if loaded is not None and loaded.runtime == "lean" and loaded.device.type == "cpu" \
                and next(loaded.model.parameters()).dtype == torch.float32:
            curve = models.forward_curve()
        else:
            curve = measure_forward_curve(load_model(args.target, device="cpu", dtype=torch.float32, runtime="lean"),
                                          VERIFY_CURVE_TOKENS)
        out["lean_fp32"] = {"seconds": curve, "threads": torch.get_num_threads()}
    except Exception as exc:  # noqa: BLE001 - the GGUF curve stands alone
        out["lean_note"] = describe_error(exc)
    return out


def peer_summary(args, models, systems, runners: dict) -> dict | None:
    """What the llama.cpp systems ran on (``runners``: the run's, by system name), and the forward
    curves; None when none of them ran."""
    from specdec.gguf.binding import library

    names = [s.name for s in systems if is_llamacpp(s)]
    if not names:
        return None
    threads, source = llamacpp_threads(args)
    out = {"systems": names, "file": str(gguf_file(args.target)), "threads": threads, "threads_from": source,
           "slots_requested": requested_slots(args), "cpu_variant": library().variant,
           "slots": {name: runners[name].slots for name in names if name in runners},
           "steps_by_batch_size": {name: dict(sorted(runners[name].batch_sizes.items())) for name in names
                                   if name in runners},
           "lookup": {"mirrors": "llama.cpp examples/lookup + common/ngram-cache.cpp (llama-cpp-python 0.3.36), "
                                 "context n-gram cache only", "n_draft": N_DRAFT, "ngram_min": NGRAM_MIN,
                      "ngram_max": NGRAM_MAX, "min_samples": list(MIN_SAMPLES), "min_percent": list(MIN_PERCENT)}}
    try:
        out["forward_curves"] = forward_curves(args, models)
    except Exception as exc:  # noqa: BLE001 - the run's figures stand without the curves
        out["forward_curves"] = {"note": describe_error(exc)}
    return out
