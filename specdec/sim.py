"""Draft-length policies on a simulated clock (``specdec sim``).

No models: a synthetic drafter and verifier with controlled acceptance and cost curves. Time is
computed, never slept. Every policy sees the same requests (common random numbers), so their
differences are the policies', not the dice's.

Acceptance: each output position t of a request is drafted correctly with probability alpha(t)
(one uniform per position, fixed per request). With exact speculative decoding the committed
sequence is the target's whatever k is, so whether the draft at position t is accepted is a
property of the position (exactly so for greedy decoding): a round drafting positions t..t+k-1
accepts the run of correct positions from t, up to k, and commits one more token.

Costs (in target steps, ``target_step_s`` seconds each; every call gets multiplicative noise):
    verify(k) = rtt + verify_curve(k)   (default 1 + verify_slope * k)
    draft(k)  = rtt + draft_cost * k + catch-up            (no draft call when k = 0)
    catch-up  = draft_cost * (0.5 + unseen / 64) when the drafter has more than one unseen token
                (the prompt on its first call, tokens committed in k = 0 rounds)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec import split
from specdec.policy import (
    AcceptanceMemory,
    AdaptiveDraftLength,
    DraftLengthPolicy,
    HeuristicDraftLength,
    RoundObservation,
)

MAX_FIXED_K = 16


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    # alpha as piecewise-constant spans over output positions: ((start, alpha), ...); with a
    # period the pattern repeats every ``period`` positions.
    spans: tuple[tuple[int, float], ...] = ((0, 0.6),)
    period: int | None = None
    draft_cost: float = 0.1  # c: one draft token, in target steps
    verify_slope: float = 0.05  # beta: verify(k) = 1 + beta * k target steps
    rtt: float = 0.05  # round trip per call (drafter and verifier), in target steps
    verify_curve: Callable[[int], float] | None = field(default=None, compare=False)  # overrides slope

    def alpha_at(self, t: int) -> float:
        if self.period:
            t %= self.period
        a = self.spans[0][1]
        for start, value in self.spans:
            if t >= start:
                a = value
            else:
                break
        return a

    def verify_steps(self, k: int) -> float:
        if self.verify_curve is not None:
            return self.verify_curve(k)
        return 1.0 + self.verify_slope * k


def _step_curve(k: int) -> float:
    # Flat while the k + 1 positions fit one kernel tile, then a jump per tile.
    return 1.0 + 0.25 * ((k + 1) // 6) + 0.01 * k


def default_scenarios(tokens_per_request: int = 256) -> list[Scenario]:
    third = tokens_per_request // 3
    return [
        Scenario("high", "alpha 0.9", spans=((0, 0.9),)),
        Scenario("medium", "alpha 0.6", spans=((0, 0.6),)),
        Scenario("low", "alpha 0.2", spans=((0, 0.2),)),
        Scenario("none", "alpha 0.0", spans=((0, 0.0),)),
        Scenario(
            "drifting",
            "alpha 0.9 -> 0.2 -> 0.9 within each request",
            spans=((0, 0.9), (third, 0.2), (2 * third, 0.9)),
        ),
        Scenario(
            "bursty",
            "alternating spans: 40 positions at 0.95, 24 at 0.1",
            spans=((0, 0.95), (40, 0.1)),
            period=64,
        ),
        Scenario(
            "expensive_draft",
            "alpha 0.8, draft token costs c = 0.5 target steps",
            spans=((0, 0.8),),
            draft_cost=0.5,
        ),
        Scenario("high_rtt", "alpha 0.8, round trip 1 target step per call", spans=((0, 0.8),), rtt=1.0),
        Scenario(
            "step_verify",
            "alpha 0.75, verify cost flat within tiles of 6 positions, +25% per tile",
            spans=((0, 0.75),),
            verify_curve=_step_curve,
        ),
    ]


@dataclass
class _Request:
    run: list[int]  # run[t]: consecutive correctly drafted positions starting at t
    noise_draft: list[float]
    noise_verify: list[float]


def _make_requests(scenario: Scenario, seed: int, num_requests: int, tokens_per_request: int, noise: float) -> list[_Request]:
    out = []
    for r in range(num_requests):
        rng = random.Random(f"{seed}/{scenario.name}/{r}")
        n = tokens_per_request + MAX_FIXED_K + 2
        ok = [rng.random() < scenario.alpha_at(t) for t in range(n)]
        run = [0] * (n + 1)
        for t in range(n - 1, -1, -1):
            run[t] = run[t + 1] + 1 if ok[t] else 0
        nd = [math.exp(rng.gauss(0.0, noise)) for _ in range(tokens_per_request + 1)]
        nv = [math.exp(rng.gauss(0.0, noise)) for _ in range(tokens_per_request + 1)]
        out.append(_Request(run, nd, nv))
    return out


def _simulate_request(
    policy: DraftLengthPolicy | None,
    fixed_k: int,
    req: _Request,
    sc: Scenario,
    tokens_per_request: int,
    max_k: int,
    step_s: float,
    prompt_tokens: int,
    k_hist: dict[int, int] | None,
    shadow_probes: bool = False,
) -> float:
    """Simulated seconds to generate ``tokens_per_request`` tokens (policy None: fixed ``fixed_k``).

    ``shadow_probes``: the policy's probes run as the gateway runs them for greedy requests, beside
    a k = 0 round (the drafter on its own machine: the probe adds no time), scored at the round's
    end by the positions it drafted."""
    t = 0
    clock = 0.0
    r = 0
    unseen = prompt_tokens  # tokens the drafter has not processed yet
    c, rtt = sc.draft_cost, sc.rtt

    def drafter_call_s(k: int, unseen: int, r: int) -> float:
        """A drafter call of k drafts in round r: round trip, drafting, and feeding ``unseen`` tokens."""
        catch_up = c * (0.5 + unseen / 64.0) if unseen > 1 else 0.0
        return (rtt + c * k + catch_up) * step_s * req.noise_draft[r]

    if policy is None and k_hist is None:
        # Fast path for fixed k (the same arithmetic, no policy calls).
        verify = [(rtt + sc.verify_steps(k)) * step_s for k in range(fixed_k + 1)]
        run, nv = req.run, req.noise_verify
        while t < tokens_per_request:
            k = min(fixed_k, max_k, tokens_per_request - t - 1)
            if k > 0:
                clock += drafter_call_s(k, unseen, r)
                unseen = 1
            else:
                k = 0
                unseen += 1
            clock += verify[k] * nv[r]
            n = run[t]
            t += (n if n < k else k) + 1
            r += 1
        return clock
    drafter_open = False
    while t < tokens_per_request:
        bound = min(max_k, tokens_per_request - t - 1)
        k = min(fixed_k, bound) if policy is None else policy.choose(bound)
        shadow = None
        if shadow_probes and policy is not None and k > 0 and policy.probing:
            policy.start_shadow_probe()
            # The probe that opens the drafter's session is not timed (the engine's rule).
            probe_s = drafter_call_s(k, unseen, r) if drafter_open else None
            # What verifying the probe would have accepted, and the drafter's time for it.
            shadow = (k, min(k, req.run[t]), probe_s)
            k, unseen, drafter_open = 0, 0, True  # the probe's call caught the drafter up
        n = min(k, req.run[t])
        draft_s = 0.0
        if k > 0:
            draft_s = drafter_call_s(k, unseen, r)
            unseen, drafter_open = 1, True
        else:
            unseen += 1
        verify_s = (rtt + sc.verify_steps(k)) * step_s * req.noise_verify[r]
        if policy is not None:
            policy.observe(RoundObservation(k, n, draft_s, verify_s))
            if shadow is not None:
                policy.observe_shadow(shadow[0], shadow[1], draft_s=shadow[2])
        if k_hist is not None:
            k_hist[k] = k_hist.get(k, 0) + 1
        clock += draft_s + verify_s
        t += n + 1
        r += 1
    return clock


def _run_policy(
    make: Callable[[], DraftLengthPolicy] | None,
    fixed_k: int,
    requests: Sequence[_Request],
    sc: Scenario,
    tokens_per_request: int,
    max_k: int,
    step_s: float,
    prompt_tokens: int,
    k_hist: dict[int, int] | None = None,
    shadow_probes: bool = False,
) -> float:
    total = 0.0
    for req in requests:
        policy = make() if make is not None else None
        total += _simulate_request(policy, fixed_k, req, sc, tokens_per_request, max_k, step_s, prompt_tokens, k_hist,
                                   shadow_probes)
        if policy is not None:
            policy.close()
    return len(requests) * tokens_per_request / total


def run_scenario(
    sc: Scenario,
    *,
    seed: int = 0,
    num_requests: int = 20,
    tokens_per_request: int = 256,
    max_k: int = MAX_FIXED_K,
    target_step_s: float = 0.025,
    noise: float = 0.05,
    prompt_tokens: int = 128,
) -> dict:
    requests = _make_requests(sc, seed, num_requests, tokens_per_request, noise)
    args = (requests, sc, tokens_per_request, max_k, target_step_s, prompt_tokens)
    fixed = {k: _run_policy(None, k, *args) for k in range(0, min(MAX_FIXED_K, max_k) + 1)}
    heuristic = _run_policy(lambda: HeuristicDraftLength(max_k=max_k), 0, *args)
    memory = AcceptanceMemory()
    key = ("synthetic", sc.name, "target")
    hist: dict[int, int] = {}
    adaptive = _run_policy(lambda: AdaptiveDraftLength(max_k=max_k, memory=memory, key=key), 0, *args, k_hist=hist)
    shadow_memory = AcceptanceMemory()
    shadow = _run_policy(lambda: AdaptiveDraftLength(max_k=max_k, memory=shadow_memory, key=key), 0, *args,
                         shadow_probes=True)
    best_k = max((k for k in fixed if k >= 1), key=lambda k: fixed[k])
    entry = memory.get(key)
    return {
        "name": sc.name,
        "description": sc.description,
        "adaptive_tokens_per_s": adaptive,
        "adaptive_shadow_probes_tokens_per_s": shadow,
        "heuristic_tokens_per_s": heuristic,
        "k0_tokens_per_s": fixed[0],
        "best_fixed_k": best_k,
        "best_fixed_tokens_per_s": fixed[best_k],
        "adaptive_vs_best_fixed": adaptive / fixed[best_k],
        "adaptive_vs_heuristic": adaptive / heuristic,
        "adaptive_vs_k0": adaptive / fixed[0],
        "fixed_tokens_per_s": {str(k): v for k, v in fixed.items()},
        "adaptive_k_histogram": {str(k): hist[k] for k in sorted(hist)},
        "memory_alpha": entry.alpha if entry else None,
    }


def run_simulation(
    seed: int = 0,
    *,
    num_requests: int = 20,
    tokens_per_request: int = 256,
    max_k: int = MAX_FIXED_K,
    target_step_s: float = 0.025,
    noise: float = 0.05,
    scenarios: Sequence[Scenario] | None = None,
    only: Sequence[str] | None = None,
) -> dict:
    """Run every scenario; deterministic for a given seed."""
    scs = list(scenarios) if scenarios is not None else default_scenarios(tokens_per_request)
    if only:
        scs = [s for s in scs if s.name in set(only)]
    return {
        "seed": seed,
        "num_requests": num_requests,
        "tokens_per_request": tokens_per_request,
        "max_k": max_k,
        "target_step_s": target_step_s,
        "scenarios": [
            run_scenario(
                s,
                seed=seed,
                num_requests=num_requests,
                tokens_per_request=tokens_per_request,
                max_k=max_k,
                target_step_s=target_step_s,
                noise=noise,
            )
            for s in scs
        ],
    }


def format_table(result: dict) -> str:
    head = (
        f"{'scenario':<16}{'adaptive':>10}{'shadow':>8}{'heuristic':>11}{'k=0':>9}{'best k':>8}"
        f"{'best fixed':>12}{'vs best':>9}{'vs heur':>9}"
    )
    lines = [
        f"tokens/s, {result['num_requests']} requests x {result['tokens_per_request']} tokens, "
        f"target step {result['target_step_s'] * 1000:g} ms, seed {result['seed']}",
        head,
        "-" * len(head),
    ]
    for s in result["scenarios"]:
        lines.append(
            f"{s['name']:<16}{s['adaptive_tokens_per_s']:>10.1f}{s['adaptive_shadow_probes_tokens_per_s']:>8.1f}"
            f"{s['heuristic_tokens_per_s']:>11.1f}"
            f"{s['k0_tokens_per_s']:>9.1f}{s['best_fixed_k']:>8d}{s['best_fixed_tokens_per_s']:>12.1f}"
            f"{s['adaptive_vs_best_fixed']:>9.3f}{s['adaptive_vs_heuristic']:>9.3f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=20, help="requests per scenario")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--max-k", type=int, default=MAX_FIXED_K)
    parser.add_argument("--noise", type=float, default=0.05, help="log-normal sigma on call costs")
    parser.add_argument("--scenario", action="append", help="run only this scenario (repeatable)")
    split.add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace) -> dict:
    return run_simulation(
        seed=args.seed,
        num_requests=args.requests,
        tokens_per_request=args.tokens,
        max_k=args.max_k,
        noise=args.noise,
        only=args.scenario,
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run and print (``--json``: the result dict as JSON; else the table). For ``specdec sim``
    (``--split``: ``specdec.split``'s predictions instead of the policies' simulation)."""
    module = split if getattr(args, "split", False) else sys.modules[__name__]
    try:
        result = module.run_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else module.format_table(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="specdec sim", description=__doc__.split("\n")[0]))
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
