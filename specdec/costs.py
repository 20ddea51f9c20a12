"""What a forward pass costs: the measured curve the verifier reports and the policy builds on.

Verification cost as a function of the draft length k is the target's forward over k + 1 new
tokens. Its shape depends on the hardware (nearly flat on a GPU, step-shaped on a CPU whose GEMM
kernels switch paths with the row count), so it is measured, not assumed: the verifier times its
own forward once at start-up and reports the curve (``GetInfo.forward_cost_s``); the gateway's
draft-length policy takes the curve's shape from it and learns only the round trip on top.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

FORWARD_CURVE_PREFIX = 64  # tokens of KV prefix in front of the timed forwards


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators): a forward over more
    tokens never costs less, so a measured dip is noise."""
    values = [float(v) for v in values]
    if all(a <= b for a, b in zip(values, values[1:])):
        return values
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    blocks: list[list[float]] = []  # [sum w*y, sum w, count]
    for y, w in zip(values, weights):
        blocks.append([y * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    out: list[float] = []
    for total, weight, count in blocks:
        out.extend([total / weight] * int(count))
    return out


def measure_forward_curve(lm, max_tokens: int, prefix: int = FORWARD_CURVE_PREFIX, reps: int = 5) -> list[float]:
    """Seconds of ``lm``'s forward over n = 1..max_tokens new tokens after a ``prefix``-token KV
    cache; element k is the cost of verifying k drafts (k drafts + the pending token).

    Each rep sweeps every n (so a burst of load from other processes hits all sizes alike); the
    minimum over reps is kept (load only ever adds time) and the curve is made non-decreasing.
    """
    from specdec.kv import KVSession
    from specdec.sampling import greedy_tokens

    vocab = max(2, min(lm.vocab_size, 1000))
    rng = random.Random(0)
    prefix_ids = [rng.randrange(1, vocab) for _ in range(prefix)]
    session = KVSession(lm)
    try:
        session.forward(prefix_ids + [1, 2], 1)  # prefill, and warm the kernels for multi-token shapes
        best = [math.inf] * max_tokens
        for _ in range(reps):
            for n in range(1, max_tokens + 1):
                extra = [rng.randrange(1, vocab) for _ in range(n)]
                session.rollback(prefix)
                start = time.perf_counter()
                # Feeds only ``extra`` after the cached prefix; reads back tokens, not logits, as a
                # verdict does (on a GPU the read is also what waits for the pass).
                greedy_tokens(session.forward(prefix_ids + extra, n, on_device=True), lm.vocab_size).tolist()
                best[n - 1] = min(best[n - 1], time.perf_counter() - start)
    finally:
        session.close()
    return isotonic(best)


def extend_curve(curve: Sequence[float], k: float) -> float:
    """``curve[k]`` (linearly interpolated for a fractional k), continued past its end along the slope
    of its last measured half (a forward over more tokens than were timed)."""
    last = len(curve) - 1
    if k <= 0:
        return float(curve[0])
    if k <= last:
        lo = int(k)
        if lo == k or lo == last:
            return float(curve[lo])
        return float(curve[lo]) + (float(curve[lo + 1]) - float(curve[lo])) * (k - lo)
    base = last // 2
    slope = (curve[last] - curve[base]) / (last - base) if last > base else 0.0
    return float(curve[last]) + max(0.0, slope) * (k - last)


def weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x: (a, b), or None without two distinct x (or any weight)."""
    sw = sum(ws)
    if sw <= 0:
        return None
    mx = sum(w * x for x, w in zip(xs, ws)) / sw
    my = sum(w * y for y, w in zip(ys, ws)) / sw
    sxx = sum(w * (x - mx) ** 2 for x, w in zip(xs, ws))
    if sxx <= 1e-12:
        return None
    b = sum(w * (x - mx) * (y - my) for x, y, w in zip(xs, ys, ws)) / sxx
    return my - b * mx, b
