"""Sampling parameters, logits processing and the sparse draft distributions sent on the wire.

Everything here computes in fp32 (the inverse CDF's running sums in fp64): probabilities in fp16
lose the small masses that the acceptance ratio p/q depends on.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# The value types live with the wire's (no torch there).
from specdec.wire_types import SamplingParams, SparseDistribution

# Independent random streams per position: draft sampling and verification never share draws.
# A draw is keyed by (request seed, absolute position, stream, draw index) (specdec.randomness).
STREAM_DRAFT = 1
STREAM_VERIFY = 2

# Draw indices inside one (seed, position, stream) key. The verifier's acceptance test and its
# resampling (recovered or bonus token) at a position use different draws, so they are independent;
# a draft token is drawn with DRAW_TOKEN of STREAM_DRAFT, independent of both.
DRAW_ACCEPT = 0  # the acceptance test's r: accept x iff r * q(x) < p(x)
DRAW_TOKEN = 1  # the single uniform that picks a token by inverse CDF


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


def sparse_to_dense(dist: SparseDistribution, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``dist`` as a dense fp32 vector over ``vocab_size`` ids (on ``device``, default the host);
    support ids >= vocab_size are dropped (the target gives them p = 0, so they only ever reject)."""
    ids, probs = torch.from_numpy(dist.token_ids), torch.from_numpy(dist.probs)
    keep = ids < vocab_size
    dense = torch.zeros(vocab_size, dtype=torch.float32)
    dense[ids[keep]] = probs[keep]
    return dense if device is None else dense.to(device)


def sample_sparse(dist: SparseDistribution, u: float) -> int:
    """The id of ``dist`` that the uniform ``u`` in [0, 1) picks by inverse CDF (never an id with q = 0)."""
    return int(dist.token_ids[inverse_cdf(torch.from_numpy(dist.probs), u)])


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
    return SparseDistribution(ids.long().numpy(), (values / values.sum()).numpy())
