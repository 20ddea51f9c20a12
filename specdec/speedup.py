"""The arithmetic of speculative decoding: how many tokens a round yields and what that can buy.

One round drafts k tokens (q = the draft's distribution) and verifies them in one target forward
over k + 1 tokens (p = the target's). With alpha_i the probability that draft token i is accepted
given that tokens 1..i-1 were, the round emits the accepted drafts plus one recovered or bonus
token:

    E[tokens](k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i      (= (1 - a^(k+1)) / (1 - a) if alpha_i = a)

and, with each round's whole cost t_round(k) (drafting, verifying, the hops between), a plain
round's t_plain and the time before the first token spread over the decoded tokens P (the same
prefill for both), the best speedup over plain decoding is

    bound = max_k (P + t_plain) / (P + t_round(k) / E[tokens](k))

(the textbook form, max_k E[tokens](k) * t_verify(0) / (k * t_draft + t_verify(k)), is the case
t_round(k) = t_verify(k) + k * t_draft, t_plain = t_verify(0), P = 0).

The benchmark's bound, the adaptive policy's expected rates and the simulator all use these
functions; nothing else spells the formulas out.
"""

from __future__ import annotations

from collections.abc import Sequence


def conditional_alphas(prefix_rates: Sequence[float]) -> list[float]:
    """alpha_i = P(accept i | accepted 1..i-1) from prefix acceptance rates P(accepted 1..i)."""
    alphas, previous = [], 1.0
    for rate in prefix_rates:
        alphas.append(min(1.0, max(0.0, rate / previous)) if previous > 0 else 0.0)
        previous = rate
    return alphas


def expected_tokens_curve(alphas: Sequence[float]) -> list[float]:
    """E[tokens](k) for k = 0..len(alphas), with ``alphas[i]`` the conditional acceptance of draft
    position i + 1. Element 0 is 1: a round without drafts still emits the target's own token."""
    out, survive = [1.0], 1.0
    for alpha in alphas:
        survive *= alpha
        out.append(out[-1] + survive)
    return out


def expected_tokens_positional(k: int, alphas: Sequence[float], tail_alpha: float) -> float:
    """E[tokens](k) with conditional acceptance ``alphas`` per position; positions past ``alphas``
    use ``tail_alpha``."""
    rates = [alphas[j] if j < len(alphas) else tail_alpha for j in range(k)]
    return expected_tokens_curve(rates)[k]


def expected_tokens(k: int, alpha: float) -> float:
    """E[tokens](k) at the same acceptance ``alpha`` at every position: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_tokens(k: int, tokens_per_round: float) -> float:
    """The per-position acceptance at which ``expected_tokens(k, alpha)`` equals ``tokens_per_round``
    (clamped to [0, 1]; ``expected_tokens`` rises with alpha, so bisection finds it)."""
    if k < 1 or tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(k, middle) < tokens_per_round else (low, middle)
    return (low + high) / 2


def speedup_bound_from_rounds(round_s: Sequence[float], plain_round_s: float, alpha: float | None = None,
                              alphas: Sequence[float] | None = None,
                              tokens_per_round: Sequence[float] | None = None,
                              prefill_per_token_s: float = 0.0) -> dict:
    """max over k of (P + plain_round_s) / (P + round_s[k] / E[tokens](k)).

    ``round_s[k]``: what a round that drafts and verifies k tokens costs, everything included;
    ``plain_round_s``: a plain-decoding round (one token); P = ``prefill_per_token_s``: the time before
    the first token spread over the decoded tokens, the same for both (0: decoding alone, where the
    ratio is E[tokens](k) * plain_round_s / round_s[k]). E[tokens](k): ``tokens_per_round[k]`` where
    given (measured, e.g. a fixed-k run replayed), else positional in ``alphas`` (conditional acceptance
    per position, tail: ``alpha``), else geometric in ``alpha``. Returns ``best_k``, ``bound`` and the
    whole ``curve``."""
    if not round_s or plain_round_s <= 0:
        raise ValueError("need round costs and a positive plain round")
    if tokens_per_round is None and alpha is None and not alphas:
        raise ValueError("need tokens_per_round, alpha or alphas")
    tail = alpha if alpha is not None else (alphas[-1] if alphas else None)
    curve = []
    for k, cost in enumerate(round_s[: len(tokens_per_round)] if tokens_per_round is not None else round_s):
        if tokens_per_round is not None:
            e = tokens_per_round[k]
        else:
            e = expected_tokens_positional(k, alphas, tail) if alphas else expected_tokens(k, tail)
        p = prefill_per_token_s
        curve.append({"k": k, "expected_tokens": e, "speedup": (p + plain_round_s) / (p + cost / e)})
    best = max(curve, key=lambda c: c["speedup"])
    return {"best_k": best["k"], "bound": best["speedup"], "curve": curve}
