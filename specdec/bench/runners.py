"""The systems ``specdec bench`` compares, and the runners that generate one completion each
(through the gateway, the in-process loop, or transformers ``generate``) with client-side chunk times."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

SYSTEM_KINDS = ("spec", "spec-k=N", "spec-k=N-ahead", "spec-k=N-noahead", "spec-ahead", "spec-noahead", "spec-suffix",
                "spec-nosuffix", "baseline", "inprocess", "hf", "hf-assisted", "llamacpp", "llamacpp-lookup")
# spec-k=N, spec-k=N-ahead, spec-k=N-noahead: a fixed draft length, draft-ahead as the gateway's default / on / off.
FIXED_K_SYSTEM = re.compile(r"spec-k=(\d+)(-ahead|-noahead)?")
DEFAULT_GATEWAY_SYSTEMS = "spec,baseline"
DEFAULT_LOCAL_SYSTEMS = "inprocess,baseline,hf"
# The suffix drafter (issue #45) against auto over every other method: what suffix drafting adds.
SUFFIX_METHOD = "suffix"
NON_SUFFIX_METHODS = ("model", "eagle", "ngram")
SUFFIX_SYSTEMS = {"spec-suffix": (SUFFIX_METHOD, ()), "spec-nosuffix": ("auto", NON_SUFFIX_METHODS)}
# llama.cpp in this process on the target's GGUF file (specdec.bench.llamacpp): plain, and prompt lookup
LLAMACPP_KIND = "llamacpp"
LOOKUP_METHOD = "lookup"
LLAMACPP = "llamacpp"  # the plain system: when it ran, every system's tokens/s is also set against its
LLAMACPP_SYSTEMS = {LLAMACPP: "none", f"{LLAMACPP}-lookup": LOOKUP_METHOD}  # name -> method


@dataclass(frozen=True)
class SystemSpec:
    name: str
    kind: str  # "gateway" | "local" | "hf" | "llamacpp"
    method: str = "auto"  # gateway: auto | none | suffix; local: draft | none; llamacpp: none | lookup
    num_draft_tokens: int = 0  # 0 = adaptive
    assisted: bool = False
    draft_ahead: bool | None = None  # gateway: None = the gateway's default
    replay_acceptance: float | None = None  # gateway: drafted by the replay drafter at this acceptance
    auto_methods: tuple[str, ...] = ()  # gateway, method auto: what auto may choose among (() = all)


def parse_systems(text: str, local: bool) -> list[SystemSpec]:
    specs: list[SystemSpec] = []
    stack = "local" if local else "gateway"
    for name in [s.strip() for s in text.split(",") if s.strip()]:
        if name == "spec":
            spec = SystemSpec(name, stack, "auto", 0)
        elif m := FIXED_K_SYSTEM.fullmatch(name):
            k = int(m.group(1))
            if k < 1:
                raise ValueError("--systems: spec-k=N needs N >= 1")
            if m.group(2) and local:
                raise ValueError(f"--systems: {name} needs a gateway (draft-ahead overlaps separate services)")
            spec = SystemSpec(name, stack, "auto", k, draft_ahead=None if not m.group(2) else m.group(2) == "-ahead")
        elif name in ("spec-ahead", "spec-noahead"):
            if local:
                raise ValueError(f"--systems: {name} needs a gateway (draft-ahead overlaps separate services)")
            spec = SystemSpec(name, stack, "auto", 0, draft_ahead=name == "spec-ahead")
        elif name in SUFFIX_SYSTEMS:
            if local:
                raise ValueError(f"--systems: {name} needs a gateway (the suffix drafter and its cache live there)")
            method, auto_methods = SUFFIX_SYSTEMS[name]
            spec = SystemSpec(name, stack, method, 0, auto_methods=auto_methods)
        elif name == "baseline":
            spec = SystemSpec(name, stack, "none", 0)
        elif name == "inprocess":
            spec = SystemSpec(name, "local", "auto", 0)
        elif name == "hf":
            spec = SystemSpec(name, "hf")
        elif name == "hf-assisted":
            spec = SystemSpec(name, "hf", assisted=True)
        elif name in LLAMACPP_SYSTEMS:  # any stack: it runs in this process
            spec = SystemSpec(name, LLAMACPP_KIND, LLAMACPP_SYSTEMS[name], 0)
        else:
            raise ValueError(f"--systems: unknown system {name!r} (choose from {', '.join(SYSTEM_KINDS)})")
        if any(s.name == name for s in specs):
            raise ValueError(f"--systems: {name!r} given twice")
        specs.append(spec)
    if not specs:
        raise ValueError("--systems: none given")
    return specs


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
    token_ids: list[int] = field(default_factory=list)  # the output
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt as the target saw it


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
    """Requests through the gateway. ``cache_scope``: the suffix cache scope every request names (the
    bench sets one per system and round, ``specdec.bench.cli``); ``auto_methods``: what auto may choose."""

    def __init__(self, client, method: str, num_draft_tokens: int, draft_ahead: bool | None = None,
                 auto_methods: tuple[str, ...] = (), cache_scope: str = "") -> None:
        self.client = client
        self.method = method
        self.num_draft_tokens = num_draft_tokens
        self.draft_ahead = draft_ahead
        self.auto_methods = tuple(auto_methods)
        self.cache_scope = cache_scope

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        from specdec.client import ChunkEvent

        kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                      method=self.method, num_draft_tokens=self.num_draft_tokens, draft_ahead=self.draft_ahead,
                      cache_scope=self.cache_scope, auto_methods=self.auto_methods)
        if messages is not None:
            kwargs["messages"] = messages
        else:
            kwargs["prompt"] = prompt
        clock = ChunkClock()
        text, final, token_ids = "", None, []
        for event in self.client.stream(**kwargs):
            if isinstance(event, ChunkEvent):
                clock.chunk(len(event.token_ids))
                text += event.text
                token_ids.extend(event.token_ids)
            else:
                final = event
        if final is None:
            raise RuntimeError("the stream ended without a final message")
        outcome = clock.outcome(text, final.finish_reason, dict(final.stats))
        outcome.token_ids, outcome.prompt_token_ids = token_ids, list(final.prompt_token_ids)
        return outcome


def cache_scope(run_id: str, system: str, round_name: str) -> str:
    """The suffix cache scope of one system's round (issue #45). A scope of its own per system, so that
    no system drafts from another's outputs of the same prompts (greedy: the very same text); per
    round, so that every round starts cold and rounds stay alike (a later round does not reuse an
    earlier one's, and the alternating order is not tilted); per run (``run_id``, random), so that a
    gateway that outlives a bench does not feed the next one."""
    return f"{run_id}/{system}/{round_name}"


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
        from specdec.wire_types import SamplingParams

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
            outcome = clock.outcome(result.text, result.finish_reason, result.stats.to_dict())
            outcome.token_ids, outcome.prompt_token_ids = list(result.token_ids), list(prompt_ids)
            return outcome

        return asyncio.run(consume())


def hf_unavailable(target, draft=None) -> str | None:
    """Why transformers' ``generate`` cannot run ``target`` (with ``draft`` as its assistant), both
    ``LoadedModel``s; None when it can."""
    for role, lm in (("target", target), ("draft", draft)):
        if lm is not None and lm.model is None:
            return (f"transformers' generate needs torch weights, and the {role} {lm.name!r} runs on the gguf "
                    "runtime (llama.cpp: a .gguf file, or the embedded default on a CPU; SPECDEC_RUNTIME=lean runs "
                    "the embedded default on torch)")
    return None


class HFRunner(Runner):
    """transformers ``generate`` on the target, optionally with ``assistant_model``."""

    def __init__(self, target, draft=None) -> None:
        if (why := hf_unavailable(target, draft)) is not None:
            raise ValueError(why)
        self.target = target
        self.draft = draft

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed) -> Outcome:
        import torch
        from transformers.generation.streamers import BaseStreamer

        from specdec.wire_types import GREEDY_TEMPERATURE

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


def describe_error(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {exc.details()}"
        except Exception:  # noqa: BLE001 - any failure to describe falls back to repr
            pass
    return f"{type(exc).__name__}: {exc}"
