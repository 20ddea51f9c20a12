"""Counter-based randomness: every draw is a pure function of (seed, position, stream, draw index).

Speculative decoding does work that is later thrown away (rejected drafts, drafted-ahead blocks,
re-proposals after a rejection) and batches unrelated requests together. Draws therefore must not
come from a sequential generator whose state that work would advance: a draw is computed from its
key alone, so the same key gives the same uniform whatever ran before it or beside it.

The generator is Philox4x64-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
1, 2, 3", SC 2011), checked against the Random123 known-answer vectors and against numpy's
``numpy.random.Philox`` (the same function). Philox is a keyed bijection of a 256-bit counter, so
under one key distinct counters never give the same 256-bit output. Layout:

    key     = (seed mod 2**64, 0)                          the request's full 64-bit seed
    counter = (draw // 4, position, stream, 0)             one 64-bit word each
    output  = 4 words; draw d is word d % 4 of block d // 4, as a double (top 53 bits) * 2**-53

Everything that varies inside one request (position, stream, draw) sits in the counter: no two of
its keys share a draw. A draw costs a few dozen Python integer operations (one Philox block gives
four), no ``torch.Generator`` and no per-position generator state.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK64 = (1 << 64) - 1

# Philox4x64 multipliers and Weyl key increments (Salmon et al. 2011, Random123's philox.h).
_M0 = 0xD2E7470EE14C6C93
_M1 = 0xCA5A826395121157
_W0 = 0x9E3779B97F4A7C15
_W1 = 0xBB67AE8584CAA73B
_ROUNDS = 10
_WORDS_PER_BLOCK = 4
_TO_UNIT = 2.0**-53


def philox4x64_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x64 with 10 rounds: four 64-bit words from a four-word counter and a two-word key."""
    c0, c1, c2, c3 = (w & MASK64 for w in counter)
    k0, k1 = key[0] & MASK64, key[1] & MASK64
    for round_ in range(_ROUNDS):
        if round_:
            k0 = (k0 + _W0) & MASK64
            k1 = (k1 + _W1) & MASK64
        p0 = _M0 * c0  # 128-bit products: hi = p >> 64, lo = p & MASK64
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & MASK64
    return c0, c1, c2, c3


def _check_key(position: int, stream: int, first: int, count: int) -> None:
    if position < 0 or position > MASK64 or stream < 0 or stream > MASK64:
        raise ValueError("position and stream must be in [0, 2**64)")
    if first < 0 or count < 0 or (first + count) // _WORDS_PER_BLOCK > MASK64:
        raise ValueError("draw indices must be in [0, 2**66)")


def uniforms(seed: int, position: int, stream: int, count: int, first: int = 0) -> list[float]:
    """Draws ``first`` .. ``first + count - 1`` of key (seed, position, stream): independent U[0, 1)
    doubles with 53 random bits each (k * 2**-53, k < 2**53: never 1.0, 0.0 with probability 2**-53).

    ``seed`` is taken modulo 2**64 (the wire's uint64): seeds that differ in any of the 64 bits give
    unrelated draws. ``position`` (the token's absolute index in the sequence) and ``stream`` are in
    [0, 2**64).
    """
    _check_key(position, stream, first, count)
    key = (seed & MASK64, 0)
    out: list[float] = []
    draw = first
    end = first + count
    while draw < end:
        block, offset = divmod(draw, _WORDS_PER_BLOCK)
        words = philox4x64_10((block, position, stream, 0), key)
        take = words[offset : min(_WORDS_PER_BLOCK, offset + end - draw)]
        out.extend((w >> 11) * _TO_UNIT for w in take)
        draw += len(take)
    return out


def uniform(seed: int, position: int, stream: int, draw: int = 0) -> float:
    """One draw: ``uniforms(seed, position, stream, 1, draw)[0]``."""
    return uniforms(seed, position, stream, 1, draw)[0]


@dataclass(frozen=True)
class DrawKey:
    """The randomness of one (request seed, absolute position, stream): draw ``i`` is ``uniform(i)``.

    A plain value (three ints): creating one costs nothing and holds no generator state, and any
    number of copies give the same draws. Tests may pass any object with a ``uniforms(count)`` method.
    """

    seed: int
    position: int
    stream: int

    def uniform(self, draw: int = 0) -> float:
        return uniform(self.seed, self.position, self.stream, draw)

    def uniforms(self, count: int, first: int = 0) -> list[float]:
        return uniforms(self.seed, self.position, self.stream, count, first)


def position_keys(seed: int, start: int, count: int, stream: int) -> list[DrawKey]:
    """The keys of positions ``start`` .. ``start + count - 1`` of one stream."""
    return [DrawKey(seed, start + i, stream) for i in range(count)]
