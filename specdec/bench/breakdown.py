"""Where a round's time goes, from the gateway's per-request stats (services only).

A round is the gateway's wait for the drafter (``draft_s``), then for the verdict (``verify_s``),
then the gateway's own work (the stop check, the policy, the stream write). The verdict's wait
splits by what the verifier reports: its service time (``verify_service_s``: from receiving the
block to sending the verdict), and within it the wait for a batched pass (``verify_queue_wait_s``)
and the pass itself (``verify_pass_s``: the forward over every session's tokens, then acceptance).
What the service time does not cover is the wire (gRPC, serialisation, the network).

``outside_forward`` is what the issue that asked for this calls overhead: the round minus the
target's pass and the drafting, i.e. the gateway's own time, the wire and the verifier's
bookkeeping and queueing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

PARTS = ("pass", "verifier_other", "queue", "wire", "draft", "gateway")


def round_breakdown(stats: Iterable[Mapping]) -> dict | None:
    """Mean ms per round of each part (``PARTS``), the round itself, and ``outside_forward`` as a
    fraction of the round; None when no request reported the verifier's times (an in-process run,
    or a verifier too old to send them)."""
    totals = dict.fromkeys(("round", "draft", "verify", "service", "pass", "queue"), 0.0)
    rounds = 0
    for s in stats:
        if not s.get("rounds") or not s.get("verify_service_s"):
            continue
        rounds += int(s["rounds"])
        totals["round"] += float(s["total_s"]) - float(s["ttft_s"])
        totals["draft"] += float(s.get("draft_s", 0.0))
        totals["verify"] += float(s["verify_s"])
        totals["service"] += float(s["verify_service_s"])
        totals["pass"] += float(s.get("verify_pass_s", 0.0))
        totals["queue"] += float(s.get("verify_queue_wait_s", 0.0))
    if not rounds:
        return None
    ms = {key: value / rounds * 1e3 for key, value in totals.items()}
    parts = {
        "pass": ms["pass"],
        "verifier_other": ms["service"] - ms["pass"] - ms["queue"],
        "queue": ms["queue"],
        "wire": ms["verify"] - ms["service"],
        "draft": ms["draft"],
        "gateway": ms["round"] - ms["draft"] - ms["verify"],
    }
    outside = ms["round"] - parts["pass"] - parts["draft"]
    return {"rounds": rounds, "round_ms": ms["round"], "parts_ms": parts,
            "outside_forward": outside / ms["round"] if ms["round"] > 0 else 0.0}


def describe(breakdown: Mapping) -> str:
    """One line: ``round 21.3 ms = pass 18.9 + verifier other 0.4 + ... (outside the forward 9 %)``."""
    parts = " + ".join(f"{name.replace('_', ' ')} {breakdown['parts_ms'][name]:.2f}" for name in PARTS)
    return (f"round {breakdown['round_ms']:.2f} ms = {parts} "
            f"(outside the target's pass and the drafting: {breakdown['outside_forward']:.1%})")
