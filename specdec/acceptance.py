"""Acceptance math for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary: the drafter proposes **draft tokens** x_1..x_k sampled from the draft distributions
q_1..q_k; the target's verification pass gives p_1..p_{k+1}. A prefix of the drafts is
**accepted**; at the first rejection a **recovered** token is resampled from the residual
norm(max(0, p_i - q_i)) and the remaining drafts are discarded; when every draft is accepted a
**bonus** token is sampled from p_{k+1}.

Invariant: every emitted token is distributed exactly as the target's own sample at that
position, P(x) = min(p, q)(x) + (1 - sum min(p, q)) * residual(x) = p(x). Under greedy decoding
the emitted tokens equal the target's argmax tokens.

This module is pure: torch tensors in, tokens out, no I/O and no model code. Probabilities are fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.sampling import DRAW_ACCEPT, DRAW_TOKEN, inverse_cdf, sparse_to_dense
from specdec.wire_types import SparseDistribution


class Draws(Protocol):
    """The randomness of one block position: ``uniform(i)`` is its draw i, a U[0, 1) double that
    depends on nothing but the position's key (``specdec.randomness.DrawKey``)."""

    def uniform(self, draw: int = 0) -> float: ...


@dataclass(frozen=True)
class AcceptanceResult:
    """Outcome of verifying one block of drafts.

    ``tokens`` = the accepted draft tokens followed by exactly one more token: the recovered
    token if a draft was rejected, else the bonus token. So ``len(tokens) == num_accepted + 1``.
    """

    num_accepted: int
    num_drafts: int
    tokens: list[int]

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted == self.num_drafts

    @property
    def next_token(self) -> int:
        """The recovered or bonus token."""
        return self.tokens[-1]


def accept_greedy(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> AcceptanceResult:
    """Greedy verification: accept while the draft equals the target's argmax.

    ``target_argmax`` has ``len(draft_tokens) + 1`` entries: the target's choice after the
    committed prefix and after each draft. The first mismatch emits the target's argmax there
    (recovered); with no mismatch the last entry is the bonus token.
    """
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError("target_argmax needs one entry per draft token plus one")
    accepted = 0
    for draft, target in zip(draft_tokens, target_argmax):
        if draft != target:
            break
        accepted += 1
    tokens = [int(t) for t in draft_tokens[:accepted]] + [int(target_argmax[accepted])]
    return AcceptanceResult(accepted, len(draft_tokens), tokens)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) in fp32.

    When p == q (or p <= q everywhere by rounding) the residual has no mass; rejection then has
    probability 0 in exact arithmetic, and we fall back to p rather than divide by zero.
    """
    residual = torch.clamp(p.float() - q.float(), min=0.0)
    total = residual.sum()
    if not torch.isfinite(total) or total <= 0:
        return p.float() / p.float().sum()
    return residual / total


def accept_speculative(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: Sequence[SparseDistribution],
    draws: Sequence[Draws],
) -> AcceptanceResult:
    """Speculative sampling over one block.

    ``target_probs``: [k+1, V] fp32, the request's final target distributions (temperature,
    top-k, top-p applied) after the prefix and after each draft. ``draft_probs[i]`` is exactly the
    distribution x_i was drawn from (a sparse support; ids outside it have q = 0).
    ``draws[i]`` supplies the randomness at block position i (k+1 of them): the verifier's keys
    (seed, absolute position, STREAM_VERIFY).

    Draft i is accepted iff r < p_i(x_i) / q_i(x_i) with r = draws[i].uniform(DRAW_ACCEPT) in [0, 1):
    strict, so r = 0 never accepts a token the target forbids, and q_i(x_i) <= 0 always rejects.
    The recovered token (from the residual) or the bonus token (from p_{k+1}) is picked by inverse
    CDF with the position's other draw, DRAW_TOKEN: independent of r, one uniform per token.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1 or len(draft_probs) != k or len(draws) != k + 1:
        raise ValueError("need k+1 target rows and draw keys and k draft distributions")
    vocab_size = target_probs.shape[-1]
    p = target_probs.float()
    # ``p`` may live on an accelerator: the host reads p_i(x_i) of every draft at once (k values), then
    # at most one row (the residual or p_{k+1}) for the inverse CDF; never the whole [k+1, V] block.
    p_at_drafts = _probs_at(p, draft_tokens)
    for i, token in enumerate(draft_tokens):
        r = draws[i].uniform(DRAW_ACCEPT)
        q_token = draft_probs[i].prob_of(token)
        if q_token > 0.0 and r * q_token < p_at_drafts[i]:  # r < p/q without dividing
            continue
        residual = residual_distribution(p[i], sparse_to_dense(draft_probs[i], vocab_size, device=p.device))
        recovered = inverse_cdf(residual, draws[i].uniform(DRAW_TOKEN))
        return AcceptanceResult(i, k, [int(t) for t in draft_tokens[:i]] + [recovered])
    bonus = inverse_cdf(p[k], draws[k].uniform(DRAW_TOKEN))
    return AcceptanceResult(k, k, [int(t) for t in draft_tokens] + [bonus])


def _probs_at(p: torch.Tensor, draft_tokens: Sequence[int]) -> list[float]:
    """p_i(x_i) for each draft i, read in one gather (0 for an id outside p's vocabulary)."""
    vocab_size = p.shape[-1]
    inside = [0 <= int(t) < vocab_size for t in draft_tokens]
    if not any(inside):
        return [0.0] * len(draft_tokens)
    ids = torch.tensor([int(t) if ok else 0 for t, ok in zip(draft_tokens, inside)], device=p.device)
    values = p[torch.arange(len(draft_tokens), device=p.device), ids].tolist()
    return [v if ok else 0.0 for v, ok in zip(values, inside)]
