"""Keyed randomness (specdec.randomness) and one-uniform sampling (specdec.sampling.inverse_cdf).

Every random draw of a request is Philox4x64-10 of (seed, position, stream, draw index): checked
against the published known answers and numpy's implementation; no two keys of a request share a
draw (the old per-position Mersenne Twister kept 32 bits of its key, so some did); a token is picked
by inverse CDF from one uniform, with the target's distribution, and never with probability 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.randomness import MASK64, DrawKey, philox4x64_10, position_keys, uniform, uniforms
from specdec.sampling import (
    DRAW_ACCEPT,
    DRAW_TOKEN,
    STREAM_DRAFT,
    STREAM_VERIFY,
    inverse_cdf,
    process_logits,
    sample_sparse,
    sparse_to_dense,
    truncate_top_k,
)
from specdec.wire_types import SamplingParams, SparseDistribution
from tests.test_distribution import ALPHA, chi2_pvalue

# ---------------------------------------------------------------------------------------------
# The generator

# Random123's kat_vectors, philox4x64 with 10 rounds: (counter c0..c3, key k0 k1) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x16554D9ECA36314C, 0xDB20FE9D672D0FDC, 0xD7E772CEE186176B, 0x7E68B68AEC7BA23B)),
    (
        (MASK64, MASK64, MASK64, MASK64),
        (MASK64, MASK64),
        (0x87B092C3013FE90B, 0x438C3C67BE8D0224, 0x9CC7D7C69CD777B6, 0xA09CAEBF594F0BA0),
    ),
    (
        (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89),
        (0x452821E638D01377, 0xBE5466CF34E90C6C),
        (0xA528F45403E61D95, 0x38C72DBD566E9788, 0xA5A1610E72FD18B5, 0x57BD43B5E52B7FE6),
    ),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox4x64_10_known_answers(counter, key, expected):
    assert philox4x64_10(counter, key) == expected


def test_uniforms_match_numpy_philox():
    """numpy's Philox bit generator is Philox4x64-10 too; it steps its counter before each block,
    so a counter one below ours gives our block first."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(3)
    cases = [(0, 0, STREAM_DRAFT), (MASK64, MASK64, STREAM_VERIFY), ((1 << 63) | 5, 1 << 40, STREAM_VERIFY)]
    cases += [(int(torch.randint(0, 2**62, (1,), generator=g)) << 2 | 3, i * 977, 1 + i % 2) for i in range(20)]
    for seed, position, stream in cases:
        counter = ((stream << 128) | (position << 64)) - 1  # words (draw block, position, stream, 0)
        bits = np.random.Philox(key=seed, counter=counter)
        expected = [(int(w) >> 11) * 2.0**-53 for w in bits.random_raw(10)]
        assert uniforms(seed, position, stream, 10) == expected, (seed, position, stream)


def test_draws_are_pure_functions_of_their_key():
    first = uniforms(42, 7, STREAM_VERIFY, 11)
    assert uniforms(42, 7, STREAM_VERIFY, 11) == first
    assert [uniform(42, 7, STREAM_VERIFY, d) for d in range(11)] == first
    assert uniforms(42, 7, STREAM_VERIFY, 6, first=5) == first[5:]
    assert [DrawKey(42, 7, STREAM_VERIFY).uniform(d) for d in range(11)] == first
    assert position_keys(42, 5, 3, STREAM_VERIFY)[2] == DrawKey(42, 7, STREAM_VERIFY)
    assert uniforms(42, 7, STREAM_VERIFY, 0) == []
    # The seed is taken modulo 2**64, the wire's uint64.
    assert uniforms(-1, 7, STREAM_VERIFY, 3) == uniforms(MASK64, 7, STREAM_VERIFY, 3)
    for bad in (dict(position=-1), dict(stream=-1), dict(position=1 << 64), dict(first=-1)):
        args = dict(seed=1, position=0, stream=1, count=1) | bad
        with pytest.raises(ValueError):
            uniforms(**args)


def test_no_two_keys_of_a_request_share_a_draw():
    """10^5 positions x 2 streams: every first draw differs (as 64-bit words and as doubles), and the
    draws are uniform on [0, 1) (Kolmogorov-Smirnov)."""
    seed, positions = 0x5EED_0000_0000_0001, 100_000
    words, doubles = set(), []
    for position in range(positions):
        for stream in (STREAM_DRAFT, STREAM_VERIFY):
            word = philox4x64_10((0, position, stream, 0), (seed, 0))[0]  # draw 0 of the key
            words.add(word)
            doubles.append((word >> 11) * 2.0**-53)
    assert doubles[-4:] == [uniform(seed, positions - 2 + i // 2, 1 + i % 2, DRAW_ACCEPT) for i in range(4)]
    assert len(words) == 2 * positions
    assert len(set(doubles)) == 2 * positions
    assert all(0.0 <= u < 1.0 for u in doubles)
    n = len(doubles)
    ordered = torch.tensor(sorted(doubles), dtype=torch.float64)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = float(torch.maximum(ranks / n - ordered, ordered - (ranks - 1) / n).max())
    assert ks < 1.95 / math.sqrt(n), ks  # p-value 0.001


def _old_key(seed: int, position: int, stream: int) -> int:
    """The key the old ``keyed_generator`` gave ``torch.Generator.manual_seed`` (splitmix64 chain)."""

    def splitmix64(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        return x ^ (x >> 31)

    return splitmix64(splitmix64(splitmix64(seed & MASK64) ^ position) ^ stream) & ((1 << 63) - 1)


# Two positions of one request (seed 0, the verifier's stream) whose old keys agree in the low 32
# bits: the first such pair of a search over positions 0, 1, 2, ... (one pair is due per ~77 000).
COLLIDING = (0, STREAM_VERIFY, 17_998, 54_591)


def test_the_old_32_bit_key_collision_is_gone():
    seed, stream, a, b = COLLIDING
    old_a, old_b = _old_key(seed, a, stream), _old_key(seed, b, stream)
    assert old_a != old_b and old_a & 0xFFFFFFFF == old_b & 0xFFFFFFFF
    # The old code: the CPU Mersenne Twister keeps 32 bits of its seed, so both positions drew alike.
    gen_a, gen_b = torch.Generator().manual_seed(old_a), torch.Generator().manual_seed(old_b)
    assert torch.equal(torch.rand(8, generator=gen_a), torch.rand(8, generator=gen_b))
    # Now the two positions' draws are unrelated, in both streams and every draw index.
    for s in (STREAM_DRAFT, STREAM_VERIFY):
        draws_a, draws_b = uniforms(seed, a, s, 8), uniforms(seed, b, s, 8)
        assert all(x != y for x, y in zip(draws_a, draws_b))


def test_seeds_that_differ_only_above_bit_32_sample_differently():
    g = torch.Generator().manual_seed(8)
    probs = torch.softmax(torch.randn(1000, generator=g), 0)
    base = 0x0BAD_F00D

    def path(seed: int) -> tuple[int, ...]:
        return tuple(inverse_cdf(probs, uniform(seed, pos, STREAM_VERIFY, DRAW_TOKEN)) for pos in range(40))

    seeds = [base] + [base | (1 << bit) for bit in (32, 33, 47, 62, 63)]
    assert len({tuple(uniforms(s, 0, STREAM_VERIFY, 4)) for s in seeds}) == len(seeds)
    assert len({path(s) for s in seeds}) == len(seeds)


def test_the_acceptance_test_and_the_resample_use_different_draws():
    for position in range(200):
        key = DrawKey(3, position, STREAM_VERIFY)
        draft = DrawKey(3, position, STREAM_DRAFT)
        assert len({key.uniform(DRAW_ACCEPT), key.uniform(DRAW_TOKEN), draft.uniform(DRAW_TOKEN)}) == 3


# ---------------------------------------------------------------------------------------------
# Inverse CDF


def _counts(weights: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    counts = torch.zeros(weights.numel(), dtype=torch.long)
    for position in range(n):
        counts[inverse_cdf(weights, uniform(seed, position, STREAM_VERIFY, DRAW_TOKEN))] += 1
    return counts


def test_inverse_cdf_follows_the_distribution():
    g = torch.Generator().manual_seed(17)
    weights = torch.softmax(torch.randn(200, generator=g) * 2, 0)
    weights[torch.randperm(200, generator=g)[:60]] = 0.0  # zero cells, left unnormalised on purpose
    counts = _counts(weights, 40_000, seed=5)
    assert chi2_pvalue(counts, weights / weights.sum()) > ALPHA  # fails at once on a p = 0 count


def test_inverse_cdf_follows_a_processed_distribution_over_the_full_vocabulary():
    """V = 49152 (the embedded target's vocabulary) after top-p: most ids have p = 0."""
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(1, 49152, generator=g) * 3
    probs = process_logits(logits, SamplingParams(temperature=0.8, top_p=0.9), 49152)[0]
    assert (probs == 0).sum() > 40_000
    counts = _counts(probs, 20_000, seed=6)
    assert chi2_pvalue(counts, probs) > ALPHA


def test_sparse_distribution_sample_follows_q():
    g = torch.Generator().manual_seed(29)
    q = truncate_top_k(torch.softmax(torch.randn(500, generator=g) * 1.5, 0), 64)
    counts = torch.zeros(500, dtype=torch.long)
    for position in range(20_000):
        counts[sample_sparse(q, uniform(11, position, STREAM_DRAFT, DRAW_TOKEN))] += 1
    assert chi2_pvalue(counts, sparse_to_dense(q, 500)) > ALPHA


def test_zero_probability_tokens_are_never_drawn():
    w = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.25, 0.5, 0.0, 0.0])
    top = 1.0 - 2.0**-53  # the largest uniform
    assert inverse_cdf(w, 0.0) == 2  # not a leading zero
    assert inverse_cdf(w, 0.25) == 4  # exactly on a boundary: the next positive id, not id 3
    assert inverse_cdf(w, 0.5) == 5
    assert inverse_cdf(w, top) == 5  # not a trailing zero
    # u just below 1 against totals that are not powers of two: u * total rounds below the total.
    for scale in (0.3, 1.7, 3.0, 1e-30, 1e30, 49152.0):
        assert inverse_cdf(w * scale, top) == 5
    # Every boundary of a random distribution with many zeros, and the doubles either side of it.
    g = torch.Generator().manual_seed(31)
    probs = torch.rand(300, generator=g)
    probs[torch.rand(300, generator=g) < 0.6] = 0.0
    probs[-5:] = 0.0
    cdf = torch.cumsum(probs.double(), 0)
    total = float(cdf[-1])
    for edge in cdf.tolist():
        for u in (edge / total, math.nextafter(edge / total, 0.0), math.nextafter(edge / total, 1.0)):
            if 0.0 <= u < 1.0:
                assert probs[inverse_cdf(probs, u)] > 0, u
    # A denormal fp32 probability is a positive probability: it may be drawn, a 0 never.
    tiny = torch.tensor([0.0, 1e-45, 0.0, 1.0, 0.0])
    assert tiny[1] > 0 and inverse_cdf(tiny, 0.0) == 1 and inverse_cdf(tiny, 0.5) == 3


def test_a_zero_weight_is_skipped_even_if_the_running_sum_rounded_otherwise(monkeypatch):
    """The guard behind the sequential sum: a running sum that rose across a zero weight (as a
    differently ordered summation might) still never yields that index."""
    weights = torch.tensor([0.5, 0.0, 0.5])
    monkeypatch.setattr(torch, "cumsum", lambda w, dim: torch.tensor([0.4, 0.6, 1.0], dtype=torch.float64))
    assert inverse_cdf(weights, 0.45) == 2  # 0.45 falls in the 0.4..0.6 step of the zero weight
    assert inverse_cdf(weights, 0.3) == 0 and inverse_cdf(weights, 0.7) == 2


def test_inverse_cdf_rejects_what_is_not_a_distribution():
    for weights in (torch.zeros(4), torch.tensor([0.5, float("nan")]), torch.tensor([1.0, float("inf")]),
                    torch.zeros(0)):
        with pytest.raises(ValueError):
            inverse_cdf(weights, 0.5)
    for u in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError):
            inverse_cdf(torch.ones(3), u)
    assert sample_sparse(SparseDistribution.one_hot(9), 0.999) == 9
