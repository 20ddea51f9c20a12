"""Sampling parameters, logits processing and the sparse draft distributions sent on the wire.

Everything here computes in fp32: probabilities in fp16 lose the small masses that the
acceptance ratio p/q depends on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

DEFAULT_DRAFT_TOP_K = 64

# Independent random streams per position: draft sampling and verification never share draws.
STREAM_DRAFT = 1
STREAM_VERIFY = 2


# Temperatures below this sample greedily (as vLLM's sampling epsilon): a smaller T would turn
# logits / T into inf (NaN probabilities) for any logit spread, and its distribution is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


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
        """Raise ``ValueError`` naming the offending field."""
        if self.max_new_tokens < 1:
            raise ValueError("sampling.max_new_tokens must be >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError("sampling.temperature must be a finite number >= 0")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError("sampling.top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("sampling.top_k must be >= 0 (0 disables it)")
        if self.draft_top_k < 1:
            raise ValueError("sampling.draft_top_k must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("sampling.stop_token_ids must be >= 0")

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else 0


def with_random_seed(params: SamplingParams) -> SamplingParams:
    """Fix a seed for an unseeded request so that drafter and verifier share one key."""
    if params.seed is not None:
        return params
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return dataclasses.replace(params, seed=seed)


def mask_beyond_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padded embedding rows (ids >= the tokenizer's vocabulary) must never be emitted."""
    if logits.shape[-1] > vocab_size:
        logits = logits.clone()
        logits[..., vocab_size:] = -math.inf
    return logits


def greedy_tokens(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return mask_beyond_vocab(logits.float(), vocab_size).argmax(dim=-1)


def process_logits(logits: torch.Tensor, params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """The request's final distribution: temperature, then top-k, then top-p, then softmax (fp32).

    Rows of ``logits`` are positions; the result has the same shape and each row sums to 1.
    Greedy requests get the one-hot distribution of the argmax.
    """
    logits = mask_beyond_vocab(logits.float(), vocab_size)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Drop a token once the tokens ranked above it already cover top_p (the first always stays).
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(dim=-1)


@dataclass(frozen=True)
class SparseDistribution:
    """A distribution given by its support: ``probs[i]`` is the probability of ``token_ids[i]``.

    Ids outside the support have probability exactly 0. Probabilities sum to 1 (fp32).
    """

    token_ids: torch.Tensor  # int64 [n]
    probs: torch.Tensor  # float32 [n]

    @staticmethod
    def one_hot(token_id: int) -> "SparseDistribution":
        return SparseDistribution(torch.tensor([token_id], dtype=torch.long), torch.ones(1))

    def prob_of(self, token_id: int) -> float:
        hit = (self.token_ids == token_id).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """Dense fp32 vector over ``vocab_size`` ids; support ids >= vocab_size are dropped
        (the target gives them p = 0, so they only ever reject)."""
        dense = torch.zeros(vocab_size, dtype=torch.float32)
        keep = self.token_ids < vocab_size
        dense[self.token_ids[keep]] = self.probs[keep].float()
        return dense

    def sample(self, generator: torch.Generator) -> int:
        index = torch.multinomial(self.probs, 1, generator=generator)
        return int(self.token_ids[index])


def truncate_top_k(probs: torch.Tensor, k: int) -> SparseDistribution:
    """Keep the k most likely ids of a 1-D distribution, renormalised.

    Sampling from this truncated distribution and reporting it as q is exact: the acceptance
    rule needs q to be the distribution the draft was actually drawn from, nothing more.
    """
    k = min(k, probs.shape[-1])
    top = torch.topk(probs.float(), k)
    keep = top.values > 0
    values, ids = top.values[keep], top.indices[keep]
    return SparseDistribution(ids.long(), values / values.sum())


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A generator keyed by (request seed, absolute token position, stream).

    Keying draws by position rather than consuming one sequential stream keeps a seeded request
    reproducible whatever else runs beside it, and makes discarded work (rejected or
    drafted-ahead tokens) unable to shift later draws.
    """
    key = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)
    generator = torch.Generator()
    generator.manual_seed(key & ((1 << 63) - 1))
    return generator


def position_generators(seed: int, start: int, count: int, stream: int) -> list[torch.Generator]:
    return [keyed_generator(seed, start + i, stream) for i in range(count)]


@dataclass
class DraftProposal:
    """Draft tokens and, for each, the exact distribution q it was sampled from.

    ``draft_probs`` is None for deterministic drafts (greedy model drafts, n-gram lookup):
    q is then one-hot on each draft token.
    """

    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: list[SparseDistribution] | None = None

    def __len__(self) -> int:
        return len(self.draft_tokens)

    def prefix(self, n: int) -> "DraftProposal":
        """The first ``n`` drafts (a draft's q does not depend on later drafts)."""
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        return DraftProposal(self.draft_tokens[:n], probs)

    def q(self, i: int) -> SparseDistribution:
        if self.draft_probs is None:
            return SparseDistribution.one_hot(self.draft_tokens[i])
        return self.draft_probs[i]
