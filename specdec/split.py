"""What the split buys: speculative rounds across two machines, with and without draft-ahead.

A model of one stream's steady rounds at a fixed k, from measured costs, for any network delay:

- V(k): the verifier's answer to k drafts (its forward over k + 1 tokens and the work around it),
  network excluded; d(n) = o + n * s: the drafter's answer for n tokens (call overhead o, step s);
  g: the gateway's own time per round; delta: the one-way delay of every message.
- Without draft-ahead a round asks the drafter, then the verifier:
      T = (2 delta + d(k)) + (2 delta + V(k)) + g.
- With draft-ahead the drafter, having answered, drafts the next block (its guess of the bonus token
  and k drafts: d(k + 1)) while the gateway has this one verified. The block is used when the verdict
  commits exactly what it assumed: all k drafts and the guessed bonus token, probability
  h = alpha^(k + 1) at a per-token acceptance alpha. Timed from the gateway sending a verify request,
  the verdict is back at V + 2 delta; the block arrives at d(k + 1) if the drafter began it after
  answering a proposal (it began delta before the gateway had that answer) and at d(k + 1) + 2 delta
  if it began on the gateway's "continue" (sent with the verify request). Either way the gateway
  waits for the block before the next round (on a miss it is discarded, and a proposal follows):
      w_P = max(0, d(k + 1) - V - 2 delta),  w_C = max(0, d(k + 1) - V),
      E[T] = V + 2 delta + g + (1 - h) w_P + h w_C + (1 - h) (2 delta + d(k)),
  the last round a hit with probability h (the chain's stationary share of "continue" rounds).
- Tokens per round are the same either way: E[tokens](k) = (1 - alpha^(k+1)) / (1 - alpha).
  Plain decoding: one token per 2 delta + V(0) + g.

Assumptions, stated so that a measurement can refute them: acceptance independent per token (a real
draft's is burstier, which raises h at the same mean); the drafter on hardware of its own (on shared
cores its ahead block slows the verifier); one stream (no batching).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from specdec.costs import extend_curve
from specdec.speedup import expected_tokens


@dataclass(frozen=True)
class SplitCosts:
    """Measured costs of a split deployment, network excluded (seconds)."""

    verify_s: tuple[float, ...]  # V(k) for k = 0.. (extended along its last half's slope past its end)
    draft_overhead_s: float  # o: the drafter's cost per call
    draft_token_s: float  # s: the drafter's cost per drafted token
    gateway_s: float = 0.0  # g: the gateway's own time per round

    def verify(self, k: int) -> float:
        return extend_curve(self.verify_s, k)

    def draft(self, num_tokens: int) -> float:
        return self.draft_overhead_s + self.draft_token_s * num_tokens if num_tokens > 0 else 0.0


def round_time(costs: SplitCosts, k: int, one_way_s: float, alpha: float, ahead: bool) -> float:
    """Expected seconds of a steady round drafting k tokens (k = 0: plain decoding, no drafter call)."""
    rtt, v, g = 2.0 * one_way_s, costs.verify(k), costs.gateway_s
    if k == 0:
        return rtt + v + g
    ask = rtt + costs.draft(k)
    if not ahead:
        return ask + rtt + v + g
    hit = alpha ** (k + 1)
    block = costs.draft(k + 1)
    wait_after_proposal, wait_after_continue = max(0.0, block - v - rtt), max(0.0, block - v)
    return rtt + v + g + (1.0 - hit) * (wait_after_proposal + ask) + hit * wait_after_continue


def tokens_per_s(costs: SplitCosts, k: int, one_way_s: float, alpha: float, ahead: bool) -> float:
    return expected_tokens(k, alpha) / round_time(costs, k, one_way_s, alpha, ahead)


def best_rate(costs: SplitCosts, one_way_s: float, alpha: float, ahead: bool, max_k: int = 16) -> tuple[int, float]:
    """(k, tokens/s) of the best fixed k in 1..max_k."""
    return max(((k, tokens_per_s(costs, k, one_way_s, alpha, ahead)) for k in range(1, max_k + 1)),
               key=lambda kr: kr[1])


def predict(costs: SplitCosts, alpha: float, one_way_delays_s: Sequence[float], max_k: int = 16) -> list[dict]:
    """Per one-way delay: plain decoding's tokens/s, and speculation's at its best k without and with
    draft-ahead, with the ratios a user decides on."""
    rows = []
    for delay in one_way_delays_s:
        plain = tokens_per_s(costs, 0, delay, alpha, ahead=False)
        k_no, no_ahead = best_rate(costs, delay, alpha, ahead=False, max_k=max_k)
        k_ahead, ahead = best_rate(costs, delay, alpha, ahead=True, max_k=max_k)
        rows.append({"one_way_delay_s": delay, "baseline_tokens_per_s": plain,
                     "noahead_tokens_per_s": no_ahead, "noahead_k": k_no,
                     "ahead_tokens_per_s": ahead, "ahead_k": k_ahead,
                     "noahead_vs_baseline": no_ahead / plain, "ahead_vs_baseline": ahead / plain,
                     "ahead_vs_noahead": ahead / no_ahead})
    return rows


def acceptance_needed(costs: SplitCosts, one_way_s: float, gain: float, compare: str = "baseline",
                      max_k: int = 16, resolution: float = 0.005) -> float | None:
    """The lowest per-token acceptance at which speculation with draft-ahead reaches ``gain`` x plain
    decoding (``compare="baseline"``) or x speculation without draft-ahead (``"noahead"``); None if
    not even alpha 0.995 does."""
    alpha = 0.0
    while alpha < 1.0:
        ahead = best_rate(costs, one_way_s, alpha, ahead=True, max_k=max_k)[1]
        if compare == "baseline":
            reference = tokens_per_s(costs, 0, one_way_s, alpha, ahead=False)
        else:
            reference = best_rate(costs, one_way_s, alpha, ahead=False, max_k=max_k)[1]
        if ahead >= gain * reference:
            return alpha
        alpha = round(alpha + resolution, 6)
    return None


def with_draft_speed(costs: SplitCosts, token_fraction: float) -> SplitCosts:
    """The same deployment with a drafter whose step is ``token_fraction`` of the target's one-token
    answer V(0) (a faster or slower draft GPU or model)."""
    return replace(costs, draft_token_s=token_fraction * costs.verify(0))


def injected_delay_s(config: dict) -> float:
    """The one-way delay a bench run injected on every message (its summary's config)."""
    return 1e-3 * float(config.get("net_delay_ms") or 0.0) if config.get("net_delay_injected") else 0.0


def costs_from_bench(summary: dict) -> tuple[SplitCosts, float]:
    """Costs and the first-position acceptance from a ``specdec bench`` summary (its bound): the round
    costs per k less the network delay the bench injected (two messages per call)."""
    from specdec.costs import isotonic, weighted_line

    bound, cfg = summary.get("bound") or {}, summary.get("config") or {}
    if not bound.get("t_verify_s") or not bound.get("t_draft_s"):
        raise ValueError("the bench summary has no round costs (bound.t_verify_s / t_draft_s): rerun the bench")
    rtt = 2.0 * injected_delay_s(cfg)
    gateway = float(bound.get("overhead_s") or 0.0)
    verify = [max(0.0, v - rtt) for v in bound["t_verify_s"]]
    if bound.get("t_plain_s"):  # the baseline's own plain round (a speculative system's k = 0 rounds share
        verify[0] = max(0.0, bound["t_plain_s"] - rtt - gateway)  # the machine with its shadow probes)
    verify = tuple(isotonic(verify))
    ks = list(range(1, min(9, len(bound["t_draft_s"]))))
    line = weighted_line(ks, [max(0.0, bound["t_draft_s"][k] - rtt) for k in ks], [1.0] * len(ks))
    overhead, per_token = (max(0.0, line[0]), max(0.0, line[1])) if line else (0.0, 0.0)
    return SplitCosts(verify, overhead, per_token, gateway), float(bound["alpha"])


def add_arguments(parser) -> None:
    """``specdec sim --split``'s options."""
    group = parser.add_argument_group("the split (--split): what two machines and draft-ahead buy, from measured costs")
    group.add_argument("--split", action="store_true", help="predict split deployments instead of simulating policies")
    group.add_argument("--bench", default=None, help="costs from this `specdec bench` output directory (its summary.json)")
    group.add_argument("--verify-ms", default=None, help="V(k) for k = 0, 1, ...: the verifier's answer, network excluded")
    group.add_argument("--draft-ms", default=None, help="OVERHEAD,PER_TOKEN: the drafter's answer for n tokens")
    group.add_argument("--gateway-ms", type=float, default=None, help="the gateway's own time per round")
    group.add_argument("--alpha", type=float, action="append", default=None,
                       help="per-token acceptance (repeatable; default: the bench's first-position acceptance)")
    group.add_argument("--delays-ms", default="0,1,5,20", help="one-way network delays to predict")
    group.add_argument("--draft-fractions", default="0.02,0.05,0.1,0.2",
                       help="drafter steps, as fractions of the target's V(0), for the acceptance-needed table")
    group.add_argument("--gain", type=float, default=1.1, help="the gain the acceptance-needed table asks for")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_from_args(args) -> dict:
    if args.bench:
        import json
        from pathlib import Path

        costs, measured_alpha = costs_from_bench(json.loads((Path(args.bench) / "summary.json").read_text()))
    else:
        if not (args.verify_ms and args.draft_ms):
            raise ValueError("--split needs --bench, or --verify-ms and --draft-ms")
        overhead, per_token = (_floats(args.draft_ms) + [0.0])[:2]
        costs = SplitCosts(tuple(v / 1e3 for v in _floats(args.verify_ms)), overhead / 1e3, per_token / 1e3, 0.0)
        measured_alpha = None
    if args.gateway_ms is not None:
        costs = replace(costs, gateway_s=args.gateway_ms / 1e3)
    alphas = args.alpha or ([measured_alpha] if measured_alpha is not None else [0.6])
    delays = [d / 1e3 for d in _floats(args.delays_ms)]
    needed = []
    for fraction in _floats(args.draft_fractions):
        faster = with_draft_speed(costs, fraction)
        for delay in delays:
            needed.append({"draft_fraction": fraction, "one_way_delay_s": delay,
                           "alpha_for_gain_vs_baseline": acceptance_needed(faster, delay, args.gain),
                           "alpha_for_gain_vs_noahead": acceptance_needed(faster, delay, args.gain, compare="noahead")})
    return {"costs": {"verify_s": list(costs.verify_s), "draft_overhead_s": costs.draft_overhead_s,
                      "draft_token_s": costs.draft_token_s, "gateway_s": costs.gateway_s},
            "predictions": {str(a): predict(costs, a, delays) for a in alphas}, "gain": args.gain,
            "acceptance_needed": needed}


def format_table(result: dict) -> str:
    c = result["costs"]
    lines = [f"costs: V(0) {c['verify_s'][0] * 1e3:.2f} ms, V(1) {c['verify_s'][1] * 1e3:.2f} ms, drafter "
             f"{c['draft_overhead_s'] * 1e3:.2f} ms + {c['draft_token_s'] * 1e3:.2f} ms per token, gateway "
             f"{c['gateway_s'] * 1e3:.2f} ms per round (network excluded)", ""]
    for alpha, rows in result["predictions"].items():
        lines.append(f"alpha {float(alpha):.3f}: one-way delay | baseline tok/s | no ahead tok/s (k) | ahead tok/s (k) "
                     "| no ahead / baseline | ahead / baseline | ahead / no ahead")
        for r in rows:
            lines.append(f"  {r['one_way_delay_s'] * 1e3:5.1f} ms | {r['baseline_tokens_per_s']:8.2f} | "
                         f"{r['noahead_tokens_per_s']:8.2f} ({r['noahead_k']}) | {r['ahead_tokens_per_s']:8.2f} "
                         f"({r['ahead_k']}) | {r['noahead_vs_baseline']:.3f} | {r['ahead_vs_baseline']:.3f} | "
                         f"{r['ahead_vs_noahead']:.3f}")
        lines.append("")
    gain = result["gain"]
    lines.append(f"acceptance needed for {gain:g}x: drafter step / V(0) | one-way delay | vs plain decoding | "
                 "ahead vs no ahead")

    def show(a):
        return "never" if a is None else f"{a:.3f}"

    for row in result["acceptance_needed"]:
        lines.append(f"  {row['draft_fraction']:.3f} | {row['one_way_delay_s'] * 1e3:5.1f} ms | "
                     f"{show(row['alpha_for_gain_vs_baseline'])} | {show(row['alpha_for_gain_vs_noahead'])}")
    return "\n".join(lines)
