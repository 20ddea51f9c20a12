"""The replay drafter: a draft of chosen acceptance, for benchmarks only (``specdec bench --acceptance-sweep``).

Papers and engines sweep acceptance with synthetic drafts, which separates the system's efficiency
from the draft's quality. For each prompt this drafter proposes the target's own greedy
continuation, recorded by a plain-decoding run of the same prompt, keeping each recorded token with
probability alpha and otherwise proposing a token that differs from it; q is one-hot. The verifier
still decides every token, so the output stays exactly the target's, whatever is proposed. Under
greedy decoding a kept token is accepted and a changed one rejected, so every drafted position is
accepted with probability alpha, independently (its keep draw is keyed by prompt and position).

Its cost is emulated: each draft step sleeps ``cost_s`` (the bench sets it to a fraction c of the
target's measured step), once per step for a whole batch of sessions, as a draft model's batched
step would take; sleeping uses no CPU, as a draft on hardware of its own would not.

Settings and recordings live in one JSON file (``ReplayScript``) that the bench writes: a drafter
service (``--method replay --replay-file PATH``) rereads it whenever it changes, at the start of a
session, so one stack serves every alpha of a sweep. ``auto`` never chooses this drafter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.drafting import Drafter, DraftSession
from specdec.randomness import uniform
from specdec.wire_types import DraftProposal, SamplingParams

log = logging.getLogger(__name__)

REPLAY_FORMAT = "specdec-replay/1"
# The gateway knows the draft methods auto, model, ngram and none; a drafter service is reached with
# "model", so a replay drafter advertises that method and the bench asks for it. (Adding "replay" to
# the gateway's methods would let a stack hold both; then this constant becomes "replay".)
REPLAY_WIRE_METHOD = "model"
# The keep draws have a key of their own (a seed derived from the replay seed and the prompt), so
# this stream number only has to be fixed, not distinct from the sampler's.
STREAM_REPLAY_KEEP = 0


def prompt_key(prompt_ids: list[int]) -> str:
    """The recordings' key: sha256 of the prompt's token ids."""
    return hashlib.sha256(",".join(str(int(t)) for t in prompt_ids).encode()).hexdigest()


def wrong_token(token: int) -> int:
    """A token that is not ``token`` and is in any vocabulary that holds ``token`` (and id 1)."""
    return token - 1 if token > 0 else token + 1


@dataclass(frozen=True)
class ReplaySettings:
    acceptance: float  # alpha: the probability that a recorded token is proposed as it is
    cost_s: float = 0.0  # seconds each draft step takes (emulated)
    seed: int = 0  # keys the keep draws: the same seed gives the same drafts
    cost_fraction: float | None = None  # what cost_s stands for, when the bench set it: c ...
    target_step_s: float | None = None  # ... times the target's measured step

    def validate(self) -> None:
        if not (isinstance(self.acceptance, (int, float)) and 0.0 <= self.acceptance <= 1.0):
            raise ValueError(f"acceptance: {self.acceptance!r} must be in [0, 1]")
        if not (isinstance(self.cost_s, (int, float)) and math.isfinite(self.cost_s) and self.cost_s >= 0):
            raise ValueError(f"cost_s: {self.cost_s!r} must be a finite number >= 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed: {self.seed!r} must be an integer")

    @property
    def label(self) -> str:
        """How a drafter with these settings names itself (stats, traces, the gateway's warm starts)."""
        cost = f"c={self.cost_fraction:g}" if self.cost_fraction is not None else f"cost={self.cost_s * 1e3:.3g}ms"
        return f"replay alpha={self.acceptance:g} {cost} seed={self.seed}"


@dataclass
class ReplayScript:
    """What a replay drafter proposes from: settings and, per prompt, the recorded continuation."""

    settings: ReplaySettings
    continuations: dict[str, list[int]] = field(default_factory=dict)  # prompt_key -> output token ids

    def to_json(self) -> dict:
        return {"format": REPLAY_FORMAT, "settings": asdict(self.settings), "continuations": self.continuations}

    @classmethod
    def from_json(cls, data: dict) -> ReplayScript:
        """``ValueError`` naming the field that is wrong."""
        if not isinstance(data, dict) or data.get("format") != REPLAY_FORMAT:
            raise ValueError(f"format: a replay file starts with {{\"format\": \"{REPLAY_FORMAT}\"}}")
        raw = data.get("settings")
        if not isinstance(raw, dict) or "acceptance" not in raw:
            raise ValueError("settings: needs at least acceptance")
        known = set(ReplaySettings.__dataclass_fields__)
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"settings: unknown fields {', '.join(unknown)}")
        settings = ReplaySettings(**raw)
        settings.validate()
        continuations = data.get("continuations", {})
        if not isinstance(continuations, dict):
            raise ValueError("continuations: must map prompt keys to lists of token ids")
        for key, ids in continuations.items():
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"continuations[{key}]: must be a list of token ids")
        return cls(settings, {str(k): list(v) for k, v in continuations.items()})


def write_replay_file(path: str | os.PathLike, script: ReplayScript) -> None:
    """Write ``script`` atomically (a drafter reading the file sees the old or the new one, whole)."""
    script.settings.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".replay-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(script.to_json(), f)
    os.replace(staging, path)


def read_replay_file(path: str | os.PathLike) -> ReplayScript:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"replay file {path}: not JSON ({exc})") from None
    try:
        return ReplayScript.from_json(data)
    except ValueError as exc:
        raise ValueError(f"replay file {path}: {exc}") from None


class ReplayDraftSession(DraftSession):
    def __init__(self, prompt_ids: list[int], params: SamplingParams, script: ReplayScript | None,
                 sleep: Callable[[float], None]) -> None:
        super().__init__(prompt_ids, params)
        self.prompt_length = len(prompt_ids)
        self.settings = script.settings if script is not None else None
        key = prompt_key(prompt_ids)
        self.recorded = script.continuations.get(key) if script is not None else None
        self.sleep = sleep
        # One seed per (replay seed, prompt): the keep draw of a position repeats on every rerun.
        seed_text = f"{self.settings.seed if self.settings else 0}:{key}"
        self.keep_seed = int.from_bytes(hashlib.sha256(seed_text.encode()).digest()[:8], "little")
        self.matched = 0  # committed output tokens already found equal to the recording (compared once)

    def replay(self, num_draft_tokens: int) -> DraftProposal:
        """The drafts, without the emulated cost. None when there is no recording for this prompt,
        the committed text left the recorded one (then the recording says nothing about the
        target's next tokens), or the recording ends here."""
        if self.recorded is None or self.settings is None:
            return DraftProposal()
        done = len(self.tokens) - self.prompt_length  # output tokens committed (or assumed, drafting ahead)
        start = self.prompt_length + self.matched
        if self.tokens[start:] != self.recorded[self.matched:done]:
            return DraftProposal()
        # Only committed tokens count as matched: draft-ahead's assumed ones may still be rejected.
        self.matched = max(self.matched, min(done, self.committed_length - self.prompt_length))
        drafts = []
        for index in range(done, min(done + num_draft_tokens, len(self.recorded))):
            token = self.recorded[index]
            keep = uniform(self.keep_seed, self.prompt_length + index, STREAM_REPLAY_KEEP) < self.settings.acceptance
            drafts.append(token if keep else wrong_token(token))
        return DraftProposal(drafts, None)

    def propose(self, num_draft_tokens: int) -> DraftProposal:
        proposal = self.replay(num_draft_tokens)
        if len(proposal) and self.settings.cost_s > 0:
            self.sleep(self.settings.cost_s * len(proposal))
        return proposal


class ReplayDrafter(Drafter):
    """Proposes recorded continuations at a chosen acceptance (``ReplayScript``), from a script or
    from a file that is reread when it changes (checked as each session starts)."""

    name = "replay"

    def __init__(self, source: ReplayScript | str | os.PathLike, sleep: Callable[[float], None] = time.sleep) -> None:
        self.sleep = sleep
        self._lock = threading.Lock()
        self._version = None  # the file's (inode, mtime, size) when last read
        if isinstance(source, ReplayScript):
            source.settings.validate()
            self.path, self.script = None, source
        else:
            self.path, self.script = Path(source), None
            self.refresh()

    def refresh(self) -> ReplayScript | None:
        """The current script: the file is read again if it changed since the last read. A missing
        file (the bench writes it after its recording pass) means nothing to propose yet."""
        if self.path is None:
            return self.script
        with self._lock:
            try:
                stat = self.path.stat()
            except FileNotFoundError:
                if self.script is not None or self._version != "missing":
                    log.warning("replay file %s does not exist (yet): proposing nothing", self.path)
                self.script, self._version = None, "missing"
                return None
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if version != self._version:
                self.script = read_replay_file(self.path)
                self._version = version
                log.info("replay file %s: %s, %d recorded prompts", self.path, self.script.settings.label,
                         len(self.script.continuations))
            return self.script

    @property
    def label(self) -> str:
        script = self.refresh()
        return script.settings.label if script is not None else "replay (no file yet)"

    def start(self, prompt_ids: list[int], params: SamplingParams) -> DraftSession:
        return ReplayDraftSession(prompt_ids, params, self.refresh(), self.sleep)

    def propose_batch(self, requests: list[tuple[DraftSession, int]]) -> list[DraftProposal]:
        """One emulated step per draft position for the whole batch, as a batched draft model's."""
        proposals = [session.replay(k) for session, k in requests]
        steps = max((len(p) for p in proposals), default=0)
        costs = [session.settings.cost_s for session, _ in requests if session.settings is not None]
        if steps and costs and max(costs) > 0:
            self.sleep(max(costs) * steps)
        return proposals
