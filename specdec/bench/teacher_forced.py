"""A draft model's acceptance by position, measured on the target's own text by teacher forcing.

Under greedy decoding draft token j of a round is accepted exactly when it equals the target's token
there, and the drafter's context is the committed text. One forward of the draft over prompt + the
target's output therefore says, for every output position t, whether the draft's argmax equals the
target's token (m_t); a round starting at t has its first j drafts accepted iff m_t .. m_{t+j-1} all
hold. Averaged over every start position,

    P(drafts 1..j accepted) = mean_t  prod_{i<j} m_{t+i}

is the draft's acceptance by position, free of any policy's choice of where to draft: an adaptive
policy drafts deep only in easy stretches, so its own verified rounds overstate the deep positions
(seen: conditional acceptance 0.62 / 0.80 / 1.0 at positions 2-4 from the adaptive system's rounds,
0.48 / 0.56 / 0.67 from a fixed k = 4 run of the same prompts).

Rounds do not start at average positions, though: a round starts right after the previous one ended,
often at a rejection, where the next token is hard too. So the expected tokens per round at a fixed k
are not taken from the position averages but replayed: the same bits say exactly where each round of
a fixed-k run would end (``fixed_k_rounds``). On three fixed-k runs of 24 requests (k = 1, 2, 4) the
replay gave every request's round count exactly; the position averages overstated tokens per round.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.kv import KVSession
from specdec.sampling import greedy_tokens
from specdec.speedup import conditional_alphas


def match_bits(draft, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[bool]:
    """m_t for t = 1 .. len(output) - 1: does the draft's greedy token after prompt + output[:t] equal
    output[t]? (Output token 0 is the target's prefill token: no round drafts it.)"""
    if len(output_ids) < 2:
        return []
    tokens = list(prompt_ids) + list(output_ids[:-1])
    session = KVSession(draft)
    try:
        logits = session.forward(tokens, len(output_ids) - 1)
    finally:
        session.close()
    predicted = greedy_tokens(logits, draft.vocab_size).tolist()
    return [int(p) == int(t) for p, t in zip(predicted, output_ids[1:])]


def prefix_acceptance(bit_lists: Sequence[Sequence[bool]], max_positions: int) -> tuple[list[float], list[int]]:
    """P(drafts 1..j accepted) for j = 1..max_positions over every start position of every list, and
    the number of start positions behind each (a start needs j tokens after it)."""
    hits, starts = [0] * max_positions, [0] * max_positions
    for bits in bit_lists:
        n = len(bits)
        for t in range(n):
            run = 0  # accepted drafts from start t
            while run < max_positions and t + run < n and bits[t + run]:
                run += 1
            for j in range(min(max_positions, n - t)):
                starts[j] += 1
                if j < run:
                    hits[j] += 1
    rates = [h / s for h, s in zip(hits, starts) if s > 0]
    return rates, starts[: len(rates)]


def fixed_k_rounds(bits: Sequence[bool], k: int) -> tuple[int, int]:
    """(rounds, tokens) that greedy speculation at a fixed k takes over one output, replayed exactly:
    ``bits`` are the output's match bits (``match_bits``: m_t for t = 1..); the first round starts at
    output token 1 (token 0 is the prefill's), accepts the run of matches from there (at most k) and
    commits it plus the target's own token, and the next round starts after those."""
    n = len(bits)
    t, rounds = 0, 0
    while t < n:
        run = 0
        while run < k and t + run < n and bits[t + run]:
            run += 1
        rounds += 1
        t += run + 1
    return rounds, n


def teacher_forced_acceptance(draft, outputs: Sequence[tuple[Sequence[int], Sequence[int]]],
                              max_k: int) -> dict | None:
    """The draft's acceptance over ``outputs`` ((prompt ids, the target's greedy output ids) pairs):
    ``tokens_per_round[k]`` for k = 0..max_k (a fixed-k run replayed exactly, ``fixed_k_rounds``: the
    tokens its rounds commit / its rounds), ``prefix_rates`` (P(1..j) over every start position),
    ``alphas_by_position`` (conditional), ``starts`` (samples per position) and ``alpha`` (the first
    position's rate). None without any output of two tokens."""
    bit_lists = [b for b in (match_bits(draft, prompt, output) for prompt, output in outputs) if b]
    rates, starts = prefix_acceptance(bit_lists, max_k)
    if not rates:
        return None
    tokens = sum(len(b) for b in bit_lists)
    per_round = [tokens / sum(fixed_k_rounds(b, k)[0] for b in bit_lists) for k in range(max_k + 1)]
    return {"tokens_per_round": per_round, "prefix_rates": rates, "alphas_by_position": conditional_alphas(rates),
            "starts": starts, "alpha": rates[0], "outputs": len(bit_lists), "tokens": tokens}
