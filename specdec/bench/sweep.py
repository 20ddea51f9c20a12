"""Benchmarks at controlled acceptance (``--acceptance-sweep``, ``--replay-acceptance``): the replay
drafter's systems, the recording pass that gives it the target's continuations and step, the
settings file the drafter service rereads, and the bound and exactness of each alpha."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from pathlib import Path

from specdec.bench.bound import compute_bound
from specdec.bench.metrics import RequestRecord, paired_round_ratios
from specdec.bench.runners import SystemSpec, describe_error
from specdec.replay import REPLAY_WIRE_METHOD, ReplayScript, ReplaySettings, prompt_key, write_replay_file

log = logging.getLogger(__name__)

# The gateway asks its drafters for GetInfo every 2 s (gateway.server GatewayService.connect) and keys
# its adaptive warm starts by the name a replay drafter gives there, which names the acceptance. After
# the acceptance changes the bench waits this long, so that the next requests start from their own
# alpha's memory, not the previous one's.
SETTINGS_SETTLE_S = 4.5


def parse_acceptances(text: str) -> list[float]:
    """``--acceptance-sweep 0.5,0.7,0.9``: distinct values in [0, 1], in the order given."""
    try:
        values = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--acceptance-sweep: {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError("--acceptance-sweep: every acceptance must be in [0, 1]")
    if len(set(values)) != len(values):
        raise ValueError("--acceptance-sweep: an acceptance is given twice")
    return values


def replay_requested(args) -> bool:
    return getattr(args, "acceptance_sweep", None) is not None or getattr(args, "replay_acceptance", None) is not None


def validate_replay_args(args) -> None:
    """The replay flags of ``specdec bench`` (``ValueError`` naming the flag); parses --acceptance-sweep."""
    if isinstance(args.acceptance_sweep, str):
        args.acceptance_sweep = parse_acceptances(args.acceptance_sweep)
    if not math.isfinite(args.replay_cost) or args.replay_cost < 0:
        raise ValueError("--replay-cost must be a number >= 0 (a fraction of the target's step)")
    if args.sweep_fixed_k < 1:
        raise ValueError("--sweep-fixed-k must be >= 1")
    if not replay_requested(args):
        return
    if args.acceptance_sweep is not None and args.replay_acceptance is not None:
        raise ValueError("--acceptance-sweep and --replay-acceptance exclude each other")
    if args.replay_acceptance is not None and not 0.0 <= args.replay_acceptance <= 1.0:
        raise ValueError("--replay-acceptance must be in [0, 1]")
    if args.acceptance_sweep is not None and args.systems:
        raise ValueError("--acceptance-sweep chooses its own systems (baseline, spec@a=A, spec-k=N@a=A): "
                         "not with --systems")
    if args.local:
        raise ValueError("the replay drafter runs in a drafter service: --up or --gateway, not --local")
    if isinstance(args.concurrency, list):
        raise ValueError("--acceptance-sweep / --replay-acceptance run at one --concurrency level")
    if not args.up and not args.replay_file:
        raise ValueError("--replay-file: against a running gateway, name the file its drafter was started with "
                         "(specdec up --draft-method replay --replay-file FILE)")


def replay_systems(args, parsed: list[SystemSpec]) -> list[SystemSpec]:
    """The systems of a replay run: the sweep's, or --systems drafted by replay."""
    if args.acceptance_sweep is not None:
        return sweep_systems(args.acceptance_sweep, args.sweep_fixed_k)
    return with_replay(parsed, args.replay_acceptance)


def sweep_systems(acceptances: list[float], fixed_k: int) -> list[SystemSpec]:
    """Plain decoding, then per alpha the replay drafter with adaptive k and with k = ``fixed_k``."""
    systems = [SystemSpec("baseline", "gateway", "none", 0)]
    for alpha in acceptances:
        systems.append(SystemSpec(f"spec@a={alpha:g}", "gateway", REPLAY_WIRE_METHOD, 0, replay_acceptance=alpha))
        systems.append(SystemSpec(f"spec-k={fixed_k}@a={alpha:g}", "gateway", REPLAY_WIRE_METHOD, fixed_k,
                                  replay_acceptance=alpha))
    return systems


def with_replay(systems: list[SystemSpec], alpha: float) -> list[SystemSpec]:
    """``--replay-acceptance``: the speculative gateway systems of ``--systems`` drafted by replay."""
    out = []
    for spec in systems:
        if spec.kind != "gateway":
            raise ValueError(f"--replay-acceptance: {spec.name} does not run through the gateway")
        if spec.method != "none":
            spec = replace(spec, method=REPLAY_WIRE_METHOD, replay_acceptance=alpha)
        out.append(spec)
    if not any(spec.replay_acceptance is not None for spec in out):
        raise ValueError("--replay-acceptance: --systems has no speculative system (spec, spec-k=N, ...)")
    if not any(spec.method == "none" for spec in out):
        out.insert(0, SystemSpec("baseline", "gateway", "none", 0))  # the recording pass compares against it
    return out


class ReplayControl:
    """The replay file of one bench run: recorded continuations, and the acceptance of the system
    about to run (rewritten, with a pause for the gateway to notice, only when it changes)."""

    def __init__(self, path: Path, cost_fraction: float, seed: int, settle_s: float | None = None) -> None:
        self.path = Path(path)
        self.cost_fraction = cost_fraction
        self.seed = seed
        self.settle_s = SETTINGS_SETTLE_S if settle_s is None else settle_s
        self.continuations: dict[str, list[int]] = {}
        self.recording: list[RequestRecord] = []
        self.target_step_s: float | None = None
        self.acceptance: float | None = None

    def record(self, records: list[RequestRecord]) -> None:
        """Take continuations and the target's step from the recording pass (plain decoding): the
        step is verify time per round, the gRPC round trip included, as the gateway sees it."""
        failed = [r for r in records if r.error is not None]
        if failed:
            raise RuntimeError(f"the recording pass failed: {failed[0].error}")
        self.recording = records
        self.continuations = {prompt_key(r.prompt_token_ids): list(r.token_ids) for r in records}
        rounds = sum(int(r.stats.get("rounds", 0)) for r in records if r.stats)
        verify_s = sum(float(r.stats.get("verify_s", 0.0)) for r in records if r.stats)
        if not rounds:
            raise RuntimeError("the recording pass verified no rounds: no target step to scale the draft cost by")
        self.target_step_s = verify_s / rounds

    @property
    def cost_s(self) -> float:
        return self.cost_fraction * (self.target_step_s or 0.0)

    def activate(self, spec: SystemSpec) -> None:
        """Before ``spec`` runs: the replay file holds its acceptance."""
        if spec.replay_acceptance is None or spec.replay_acceptance == self.acceptance:
            return
        settings = ReplaySettings(acceptance=spec.replay_acceptance, cost_s=self.cost_s, seed=self.seed,
                                  cost_fraction=self.cost_fraction, target_step_s=self.target_step_s)
        write_replay_file(self.path, ReplayScript(settings, self.continuations))
        self.acceptance = spec.replay_acceptance
        log.info("replay: %s (draft step %.2f ms) for %s", settings.label, self.cost_s * 1e3, spec.name)
        time.sleep(self.settle_s)

    def config(self) -> dict:
        return {"file": str(self.path), "cost_fraction": self.cost_fraction, "target_step_s": self.target_step_s,
                "cost_s": self.cost_s, "seed": self.seed, "recorded_prompts": len(self.continuations)}


def identical_outputs(records: list[RequestRecord], recording: list[RequestRecord]) -> dict:
    """How many of a system's outputs equal plain decoding's (the recording pass) token for token."""
    reference = {(r.conversation_id, r.turn): r.token_ids for r in recording}
    compared = [(r.token_ids == reference[(r.conversation_id, r.turn)])
                for r in records if r.error is None and (r.conversation_id, r.turn) in reference]
    return {"identical": sum(compared), "compared": len(compared)}


def sweep_results(args, systems: list[SystemSpec], summaries: dict, all_records: dict, models,
                  control: ReplayControl) -> dict:
    """Per replay system: tokens/s, speedup over baseline, the measured acceptance, the bound from it
    and the verify-cost curve, measured / bound, and whether its outputs equal plain decoding's."""
    points = []
    for spec in systems:
        if spec.replay_acceptance is None or spec.name not in summaries:
            continue
        s = summaries[spec.name]
        bound = compute_bound(args, summaries, all_records, models, reference=spec.name, with_roofline=False)
        by_round = paired_round_ratios(summaries, spec.name)
        points.append({
            "system": spec.name, "alpha_set": spec.replay_acceptance,
            "k": spec.num_draft_tokens or "adaptive",
            "tokens_per_s": s["tokens_per_s"], "acceptance_rate": s.get("acceptance_rate"),
            "alpha_measured": bound.get("alpha"), "mean_accepted_length": s.get("mean_accepted_length"),
            "k_mean": s.get("k_mean"), "speedup": bound.get("measured"), "bound": bound.get("bound"),
            "best_k": bound.get("best_k"), "measured_over_bound": bound.get("measured_over_bound"),
            # A fixed k can reach at most the bound's curve at that k (the bound takes the best k).
            "bound_at_k": (bound["curve"][spec.num_draft_tokens]["speedup"]
                           if spec.num_draft_tokens and bound.get("curve") and spec.num_draft_tokens < len(bound["curve"])
                           else None),
            "t_round_s": bound.get("t_round_s"), "costs_source": bound.get("costs_source"),
            "speedup_by_round": by_round,
            "outputs": identical_outputs(all_records.get(spec.name, []), control.recording),
            "note": bound.get("note"),
        })
    out = {"points": points, "baseline_tokens_per_s": (summaries.get("baseline") or {}).get("tokens_per_s"),
           "replay": control.config()}
    try:  # the target's own forward over 1..16 tokens, without gRPC (after the stack stopped)
        out["target_forward_curve_s"] = models.forward_curve()
    except Exception as exc:  # noqa: BLE001 - no local target: the fitted curve stands alone
        out["target_forward_curve_s"] = None
        out["target_forward_curve_note"] = describe_error(exc)
    return out
