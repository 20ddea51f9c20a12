"""What the adaptive policy's per-round Python costs in the gateway (issue #46).

A session settled at k = 0 on the Q8_0 forward curve of docs/benchmarks.md (probes answered now and
then, nothing accepted): microseconds per round of ``choose`` + ``observe``, alone and co-batched.

    .venv/bin/python scripts/policy_round_cost.py
"""

from __future__ import annotations

import random
import time

from specdec.policy import RoundObservation, make_policy

Q8_0_CURVE = [0.0107, 0.0191, 0.0280, 0.0369, 0.0420, 0.0470, 0.0520, 0.0576, 0.0630, 0.0680, 0.0730,
              0.0780, 0.0830, 0.0880, 0.0930, 0.0990]


def per_round_us(batch: int, rounds: int = 3000, warm: int = 3000) -> float:
    rng = random.Random(0)
    policy = make_policy(0, max_k=16, forward_curve=Q8_0_CURVE, co_batched=batch - 1)

    def one(i: int) -> None:
        k = policy.choose(200)
        if policy.probing:
            policy.start_shadow_probe()
            k = 0
        policy.observe(RoundObservation(k, 0, 0.0, 0.0125 + 0.001 * rng.random(), batch, batch))
        if getattr(policy, "_shadow_pending", False) and i % 20 == 0:
            policy.observe_shadow(1, 0, 0.004, beside_s=0.030, beside_rounds=2)

    for i in range(warm):
        one(i)
    start = time.perf_counter()
    for i in range(rounds):
        one(i)
    return (time.perf_counter() - start) / rounds * 1e6


if __name__ == "__main__":
    for batch in (1, 8):
        print(f"co-batched sessions {batch}: {per_round_us(batch):.1f} us of policy per round")
