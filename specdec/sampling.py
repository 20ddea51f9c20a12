"""Sampling parameters, logits processing and the sparse draft distributions sent on the wire.

Everything here computes in fp32 (the inverse CDF's running sums in fp64): probabilities in fp16
lose the small masses that the acceptance ratio p/q depends on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

DEFAULT_DRAFT_TOP_K = 64

# Independent random streams per position: draft sampling and verification never share draws.
# A draw is keyed by (request seed, absolute position, stream, draw index) (specdec.randomness).
STREAM_DRAFT = 1
STREAM_VERIFY = 2

# Draw indices inside one (seed, position, stream) key. The verifier's acceptance test and its
# resampling (recovered or bonus token) at a position use different draws, so they are independent;
# a draft token is drawn with DRAW_TOKEN of STREAM_DRAFT, independent of both.
DRAW_ACCEPT = 0  # the acceptance test's r: accept x iff r * q(x) < p(x)
DRAW_TOKEN = 1  # the single uniform that picks a token by inverse CDF


# What the wire's types hold (types.proto): a value past them cannot be sent downstream, so it is
# the request's error, caught where the request is validated (not at a peer, not as a peer's fault).
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)

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
        """Raise ``ValueError`` naming the offending field. Every value must also fit the type the
        wire carries it in (uint32 counts and ids, float32 temperature and top_p, UTF-8 strings)."""
        if not 1 <= self.max_new_tokens <= UINT32_MAX:
            raise ValueError(f"sampling.max_new_tokens must be in [1, {UINT32_MAX}]")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError("sampling.temperature must be a finite number >= 0 (within float32)")
        # top_p travels as float32: a value that rounds to 0 there (1e-46) is out of range too.
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0 or np.float32(self.top_p) == 0:
            raise ValueError("sampling.top_p must be in (0, 1] (and above 0 as a float32)")
        if not 0 <= self.top_k <= UINT32_MAX:
            raise ValueError(f"sampling.top_k must be in [0, {UINT32_MAX}] (0 disables it)")
        if self.seed is not None and not 0 <= self.seed <= UINT64_MAX:
            raise ValueError(f"sampling.seed must be in [0, {UINT64_MAX}]")
        if self.draft_top_k < 1:
            raise ValueError("sampling.draft_top_k must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop must not contain empty strings")
        if not all(is_utf8(s) for s in self.stop):
            raise ValueError("sampling.stop: strings must be valid Unicode (no lone surrogates)")
        if any(not 0 <= t <= UINT32_MAX for t in self.stop_token_ids):
            raise ValueError("sampling.stop_token_ids must be >= 0")

    def resolved_seed(self) -> int:
        return self.seed if self.seed is not None else 0


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (a lone surrogate, which JSON's escapes allow, does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The index that one uniform ``u`` in [0, 1) picks from ``weights`` (a 1-D distribution, or
    unnormalised weights such as a residual): index i with probability weights[i] / sum(weights).

    Inverse CDF: the first index whose running sum exceeds ``u * total``. The running sum is fp64 over
    the (fp32) weights, so each index's share of [0, total) is its weight up to fp64 rounding (~1e-16
    relative; the uniform itself has 53 bits). A weight of exactly 0 leaves the running sum unchanged,
    so its index can never be the first to exceed: zero-probability tokens are never drawn. For
    u < 1 the rounded product ``u * total`` stays below the total, so some index always exceeds it.
    Weights must be finite and >= 0 with a positive sum (``ValueError`` otherwise). One uniform per
    token, whatever the vocabulary size (``torch.multinomial`` draws V of them).
    """
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u!r}")
    flat = weights.detach().reshape(-1)
    if flat.dtype not in (torch.float16, torch.float32, torch.float64):
        flat = flat.float()  # bf16 and the like: fp32 holds them exactly
    # On this thread: numpy casts to fp64, torch's CPU cumsum of one row is one sequential pass (the
    # running sum never decreases and adding 0 leaves it unchanged). A torch cast of V elements would
    # wake the intra-op thread pool: milliseconds per token on a busy host, for microseconds of work.
    w = torch.from_numpy(flat.cpu().numpy().astype(np.float64))
    n = w.numel()
    if n == 0:
        raise ValueError("cannot sample from an empty distribution")
    cdf = torch.cumsum(w, 0)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0.0):
        raise ValueError(f"cannot sample: weights sum to {total}")
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index >= n or not float(w[index]) > 0.0:
        # Unreachable with a sequential running sum (see above); kept so that a summation that
        # rounds differently still never returns a zero-weight index: the next positive one.
        positive = (w > 0).nonzero().flatten()
        later = positive[positive >= index]
        index = int(later[0]) if later.numel() else int(positive[-1])
    return index


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

    def to_dense(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Dense fp32 vector over ``vocab_size`` ids (on ``device``, default the host); support ids
        >= vocab_size are dropped (the target gives them p = 0, so they only ever reject)."""
        keep = self.token_ids < vocab_size
        dense = torch.zeros(vocab_size, dtype=torch.float32)
        dense[self.token_ids[keep]] = self.probs[keep].float()
        return dense if device is None else dense.to(device)

    def sample(self, u: float) -> int:
        """The id that the uniform ``u`` in [0, 1) picks by inverse CDF (never an id with q = 0)."""
        return int(self.token_ids[inverse_cdf(self.probs, u)])


def truncate_top_k(probs: torch.Tensor, k: int) -> SparseDistribution:
    """Keep the k most likely ids of a 1-D distribution, renormalised.

    Sampling from this truncated distribution and reporting it as q is exact: the acceptance
    rule needs q to be the distribution the draft was actually drawn from, nothing more.
    """
    k = min(k, probs.shape[-1])
    top = torch.topk(probs.float(), k)
    values, ids = top.values.cpu(), top.indices.cpu()  # the support is what the host keeps (k entries)
    keep = values > 0
    values, ids = values[keep], ids[keep]
    return SparseDistribution(ids.long(), values / values.sum())


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
