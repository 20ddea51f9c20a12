"""The value types that cross between the services (gateway, drafter, verifier) and the error that
names a request's bad field. No torch here: the gateway and ``specdec.rpc`` import this module and
never load a model runtime. What a type carries is what travels (numpy arrays, bytes, lists); the
core converts to torch where it computes (``specdec.sampling``, ``specdec.target_features``).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class FieldError(ValueError):
    """A request's value that cannot be taken, with the path of its field (``sampling.top_p``,
    ``messages[2].content``, ``draft_probs[0].probs``): every hop reports the field as data
    (``specdec.rpc.field_errors``), never to be recovered from the message text."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


DEFAULT_DRAFT_TOP_K = 64

# What the wire's types hold (types.proto): a value past them cannot be sent downstream, so it is
# the request's error, caught where the request is validated (not at a peer, not as a peer's fault).
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)

# Temperatures below this sample greedily (as vLLM's sampling epsilon): a smaller T would turn
# logits / T into inf (NaN probabilities) for any logit spread, and its distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (a lone surrogate, which JSON's escapes allow, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# The most tokens one request may ask for by default (the gateway's and the verifier's
# --max-new-tokens-cap): a session's KV and its time on a replica stay bounded.
MAX_NEW_TOKENS_CAP = 2048


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) means greedy
    decoding: the limit of sampling as T → 0, and logits / T would overflow fp32 long before T = 0."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Size of the draft's truncated support (the exact q reported for sampled drafts).
    draft_top_k: int = DEFAULT_DRAFT_TOP_K

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise ``FieldError`` naming the offending field. Every value must also fit the type the
        wire carries it in (uint32 counts and ids, float32 temperature and top_p, UTF-8 strings)."""
        if not 1 <= self.max_new_tokens <= UINT32_MAX:
            raise FieldError("sampling.max_new_tokens", f"must be in [1, {UINT32_MAX}]")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise FieldError("sampling.temperature", "must be a finite number >= 0 (within float32)")
        # top_p travels as float32: a value that rounds to 0 there (1e-46) is out of range too.
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0 or np.float32(self.top_p) == 0:
            raise FieldError("sampling.top_p", "must be in (0, 1] (and above 0 as a float32)")
        if not 0 <= self.top_k <= UINT32_MAX:
            raise FieldError("sampling.top_k", f"must be in [0, {UINT32_MAX}] (0 disables it)")
        if self.seed is not None and not 0 <= self.seed <= UINT64_MAX:
            raise FieldError("sampling.seed", f"must be in [0, {UINT64_MAX}]")
        if self.draft_top_k < 1:
            raise FieldError("sampling.draft_top_k", "must be >= 1")
        if any(not s for s in self.stop):
            raise FieldError("sampling.stop", "must not contain empty strings")
        if not all(is_utf8(s) for s in self.stop):
            raise FieldError("sampling.stop", "strings must be valid Unicode (no lone surrogates)")
        if any(not 0 <= t <= UINT32_MAX for t in self.stop_token_ids):
            raise FieldError("sampling.stop_token_ids", "must be >= 0")

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else 0

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The token ids that end this request when committed: ``stop_token_ids``, and the model's
        end-of-sequence ids unless ``ignore_eos``."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def with_random_seed(params: SamplingParams) -> SamplingParams:
    """Fix a seed for an unseeded request so that drafter and verifier share one key."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbelow(2**62))


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution given by its support: ``probs[i]`` is the probability of ``token_ids[i]``.

    Ids outside the support have probability exactly 0. Probabilities sum to 1 (fp32). Held as
    numpy arrays (int64 ids, float32 probabilities, as sent); ``specdec.sampling`` computes with them.
    """

    token_ids: np.ndarray  # int64 [n]
    probs: np.ndarray  # float32 [n]

    def __post_init__(self) -> None:
        # Anything array-like (lists, numpy, CPU tensors): the same values, in the wire's dtypes.
        object.__setattr__(self, "token_ids", np.asarray(self.token_ids, dtype=np.int64).reshape(-1))
        object.__setattr__(self, "probs", np.asarray(self.probs, dtype=np.float32).reshape(-1))

    @staticmethod
    def one_hot(token_id: int) -> SparseDistribution:
        return SparseDistribution(np.array([token_id], dtype=np.int64), np.ones(1, dtype=np.float32))

    def prob_of(self, token_id: int) -> float:
        hit = np.flatnonzero(self.token_ids == token_id)
        return float(self.probs[hit[0]]) if hit.size else 0.0


@dataclass
class DraftProposal:
    """Draft tokens and, for each, the exact distribution q it was sampled from.

    ``draft_probs`` is None for deterministic drafts (greedy model drafts, n-gram lookup):
    q is then one-hot on each draft token.
    """

    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: list[SparseDistribution] | None = None
    # The drafter's estimate, per i, that drafts 1..i + 1 are all accepted (drafters that can tell:
    # suffix lookup); the loop then verifies the prefix of the best expected rate. None: no estimate.
    acceptance_estimates: list[float] | None = None

    def __len__(self) -> int:
        return len(self.draft_tokens)

    def prefix(self, n: int) -> DraftProposal:
        """The first ``n`` drafts (a draft's q does not depend on later drafts)."""
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        estimates = None if self.acceptance_estimates is None else self.acceptance_estimates[:n]
        return DraftProposal(self.draft_tokens[:n], probs, estimates)

    def q(self, i: int) -> SparseDistribution:
        if self.draft_probs is None:
            return SparseDistribution.one_hot(self.draft_tokens[i])
        return self.draft_probs[i]


@dataclass(frozen=True)
class BatchInfo:
    """How a job was served: the pass it rode in and its wait for it."""

    size: int  # jobs in the pass
    num_tokens: int  # tokens the pass fed (the jobs' sizes, padding excluded)
    queue_wait_s: float  # from submit to the pass starting
    pass_s: float = 0.0  # the pass itself: the forward over every job's tokens, then each job's acceptance

    def trace_attributes(self) -> dict:
        """The step attributes services add to their traces."""
        return {"batch_size": self.size, "batch_tokens": self.num_tokens, "queue_wait_ms": round(self.queue_wait_s * 1e3, 3),
                "pass_ms": round(self.pass_s * 1e3, 3)}


# The wire's feature dtype is bfloat16 (types.proto TargetFeatures.bf16_data): 2 bytes a value.
FEATURE_WIRE_BYTES = 2


@dataclass(frozen=True)
class EncodedFeatures:
    """The target's features as they travel (``specdec.target_features`` says what they are):
    ``count`` rows of ``width`` bfloat16 values from position ``start``, row-major, little-endian in
    ``data``. Whether ``data`` holds what the header says is checked only where they are decoded
    (``target_features.decode_features``, the drafter): a relay passes them on unread."""

    start: int
    count: int
    width: int
    data: bytes

    def __len__(self) -> int:
        return self.count

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def wire_bytes(self) -> int:
        return len(self.data)

    @property
    def row_bytes(self) -> int:
        return self.width * FEATURE_WIRE_BYTES

    def tail(self, rows: int) -> EncodedFeatures:
        """The last ``rows`` rows (all when it has fewer; none for rows <= 0)."""
        drop = self.count - max(0, min(rows, self.count))
        if drop == 0:
            return self
        return EncodedFeatures(self.start + drop, self.count - drop, self.width, self.data[drop * self.row_bytes:])

    def head(self, rows: int) -> EncodedFeatures:
        """The first ``rows`` rows (0 <= rows <= count)."""
        return EncodedFeatures(self.start, rows, self.width, self.data[: rows * self.row_bytes])


class VerdictFeatures(Protocol):
    """What a verdict's features are to whoever only relays or counts them: ``EncodedFeatures``
    (received over the wire) or, in process, the core's ``target_features.TargetFeatures``."""

    start: int

    def __len__(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def wire_bytes(self) -> int: ...


@dataclass(frozen=True)
class Verdict:
    """What one verification pass decided.

    ``tokens`` are the newly committed tokens: the accepted drafts then the recovered or bonus
    token (after prefill: just the first generated token). A drafter rolls back to
    ``committed_length - len(tokens) + num_accepted`` and appends ``tokens[-1]``.
    """

    num_drafts: int
    num_accepted: int
    tokens: list[int]
    committed_length: int  # prompt + generated, after this verdict
    batch: BatchInfo | None = None  # the batched pass that computed it (verifier service), if known
    # A session that wants features: the target's at positions committed_length - len(tokens) - 1 ..
    # committed_length - 2 (prefill: the whole prompt, 0 .. committed_length - 2; see ``TargetSession``).
    # Encoded (as received, not decoded) where a relay got the verdict over the wire.
    features: VerdictFeatures | None = None
