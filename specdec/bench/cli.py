"""The ``specdec bench`` command: its arguments, the models it loads, a run over every system (in
interleaved rounds) with its outputs, and the concurrency sweep."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import secrets
import shlex
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from specdec.bench import llamacpp, plots
from specdec.bench.bound import compute_bound, k0_rounds_against_plain, machine_info
from specdec.bench.conversation import Conversation, group_spans
from specdec.bench.load import effective_rounds, parse_concurrency, round_blocks, run_system
from specdec.bench.model_cache import ModelCache
from specdec.bench.metrics import (
    RequestRecord,
    compute_speedups,
    output_tokens_per_s,
    paired_round_ratios,
    ratio,
    spec_reference,
    summarize_by_category,
    summarize_records,
)
from specdec.bench.prompts import load_prompts
from specdec.bench.split_check import split_prediction
from specdec.pass_options import DTYPE_ENV
from specdec.synthetic import is_synthetic, parse_synthetic
from specdec.bench.report import fmt, format_round_ratios, render_report, render_sweep
from specdec.bench.sweep import ReplayControl, replay_requested, replay_systems, sweep_results, validate_replay_args
from specdec.bench.runners import (
    DEFAULT_GATEWAY_SYSTEMS,
    DEFAULT_LOCAL_SYSTEMS,
    LLAMACPP,
    LLAMACPP_KIND,
    SYSTEM_KINDS,
    GatewayRunner,
    HFRunner,
    LocalRunner,
    Runner,
    SystemSpec,
    cache_scope,
    describe_error,
    hf_unavailable,
    parse_systems,
)

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=None, help="gateway address HOST:PORT (default localhost:50051)")
    p.add_argument("--local", action="store_true", help="no gateway: run every system in this process")
    p.add_argument("--target", default="embedded", help="target model for local systems (hub id, dir, 'embedded')")
    p.add_argument("--draft-model", default=None, help="draft model for local systems (default: the shipped draft for the embedded target, else n-gram)")
    p.add_argument("--device", default=None, help="device for local models (default: cuda if present)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for local models (default: torch's; 1 is faster on a busy machine)")
    p.add_argument("--prompts", default="mt_bench",
                   help="comma-separated: mt_bench, humaneval, translation (ours: drafts weak there), repetitive "
                        "(ours: text repeats across requests, for suffix drafting) or JSONL paths (MT-bench or "
                        "HumanEval format)")
    p.add_argument("--limit", type=int, default=None,
                   help="items per prompt set (categories taken in turn; repetitive: whole groups of items)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="request seeds and Poisson arrivals")
    p.add_argument("--concurrency", default=None,
                   help="conversations in flight (default 1; unbounded with --request-rate); a comma-separated "
                        "list (1,2,4,8,16) runs the systems at each level into OUT/c<N>/ and writes a scaling "
                        "table and plot (OUT/concurrency.md, concurrency_scaling.png)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: back to back)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated from {', '.join(SYSTEM_KINDS)} "
                        f"(default {DEFAULT_GATEWAY_SYSTEMS}; --local: {DEFAULT_LOCAL_SYSTEMS})")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds (gateway)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype for local models and the --up stack (default $SPECDEC_DTYPE, else auto)")
    p.add_argument("--eagle-head", default=None, metavar="DIR",
                   help="with --up: the stack's drafter is this EAGLE head (gateway systems draft with it; "
                        "hf-assisted keeps the independent draft)")
    p.add_argument("--up-args", default=None, metavar="FLAGS",
                   help="with --up: more flags for the stack's `specdec up`, e.g. '--no-verify-ahead'")
    p.add_argument("--up", action="store_true",
                   help="start a local stack (`specdec up` with --target/--draft-model/--net-delay/--draft-ahead) "
                        "for the gateway systems, and stop it afterwards")
    p.add_argument("--net-delay", type=float, default=0.0, metavar="MS",
                   help="with --up: one-way delay the gateway injects on every message to drafter and verifier "
                        "(cross-machine round trips); without --up, only recorded (start the gateway with "
                        "--net-delay-ms yourself)")
    p.add_argument("--drafter-device", default=None,
                   help="--up: the drafter service's device (default: as the verifier's; see specdec up)")
    p.add_argument("--emulate-machines", action="store_true",
                   help="with --up: two machines on one (specdec up --emulate-machines): the verifier on half the "
                        "cores, the drafter and gateway on the others; every system runs on that partition")
    p.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                   help="with --up: the gateway's default for draft-ahead (systems spec-ahead/spec-noahead force it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the systems: split the prompts into this many rounds and run every system "
                        "on each round, in alternating order (ratios between systems then resist a machine whose "
                        "speed drifts during the run); capped at conversations / concurrency")
    p.add_argument("--no-warmup", action="store_true", help="skip the one short warm-up request per system")
    p.add_argument("--acceptance-sweep", default=None, metavar="A1,A2,...",
                   help="controlled acceptance: a recording pass (plain decoding) records the target's continuations "
                        "and step; then baseline and, per acceptance, the replay drafter with adaptive k and with "
                        "k = --sweep-fixed-k, in interleaved rounds; bound and measured/bound per acceptance "
                        "(with --up, or --gateway over `specdec up --draft-method replay --replay-file FILE`)")
    p.add_argument("--replay-acceptance", type=float, default=None, metavar="A",
                   help="the speculative systems of --systems drafted by the replay drafter at acceptance A")
    p.add_argument("--replay-cost", type=float, default=0.05, metavar="C",
                   help="the replay drafter's cost per draft step: C times the target's step measured by the "
                        "recording pass (emulated by sleeping; default 0.05)")
    p.add_argument("--replay-seed", type=int, default=0, help="keys which recorded tokens the replay drafter keeps")
    p.add_argument("--replay-file", default=None, help="the replay drafter's file (default OUT/replay.json)")
    p.add_argument("--sweep-fixed-k", type=int, default=4, help="--acceptance-sweep: the fixed draft length (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def validate_args(args) -> None:
    if args.local and args.gateway:
        raise ValueError("--local and --gateway exclude each other")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    levels = args.concurrency if isinstance(args.concurrency, list) else parse_concurrency(args.concurrency)
    if levels is not None and len(levels) > 1 and args.request_rate is not None:
        raise ValueError("--concurrency with several levels excludes --request-rate")
    args.concurrency = levels[0] if levels is not None and len(levels) == 1 else levels
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.net_delay < 0:
        raise ValueError("--net-delay must be >= 0")
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.up and (args.local or args.gateway):
        raise ValueError("--up starts its own gateway: not with --local or --gateway")
    if getattr(args, "emulate_machines", False) and not args.up:
        raise ValueError("--emulate-machines partitions the stack --up starts: it needs --up")
    if getattr(args, "eagle_head", None) and not args.up:
        raise ValueError("--eagle-head is the drafter of the stack --up starts: it needs --up")
    if is_synthetic(args.target):
        parse_synthetic(args.target)  # a bad name fails before any stack starts
    validate_replay_args(args)


def machine_partition_config(args, stack) -> dict | None:
    """``--emulate-machines`` with ``--up``: the cores of the verifier and of the drafter and gateway."""
    if not getattr(args, "emulate_machines", False) or stack is None:
        return None
    from specdec.up import machine_partition

    verifier, drafter = machine_partition(os.sched_getaffinity(0))
    return {"verifier_cpus": sorted(verifier), "drafter_gateway_cpus": sorted(drafter)}


def start_local_stack(args):
    """``--up``: a local stack (``specdec up``) for the gateway systems; returns (stack, address)."""
    from specdec.stack import LocalStack

    up_args = ["--target", args.target, "--net-delay-ms", str(args.net_delay),
               "--draft-ahead" if args.draft_ahead else "--no-draft-ahead"]
    if args.draft_model and not getattr(args, "eagle_head", None):  # the eagle head is the stack's drafter
        up_args += ["--draft-model", args.draft_model]
    if getattr(args, "drafter_device", None):
        up_args += ["--drafter-device", args.drafter_device]
    if getattr(args, "emulate_machines", False):
        up_args += ["--emulate-machines"]
    if replay_requested(args):
        up_args += ["--draft-method", "replay", "--replay-file", args.replay_file]
    elif getattr(args, "eagle_head", None):
        up_args += ["--draft-method", "eagle", "--draft-model", args.eagle_head]
    up_args += shlex.split(getattr(args, "up_args", None) or "")
    stack = LocalStack(up_args, quiet=True)
    log.info("starting a local stack: specdec up %s", " ".join(up_args))
    return stack, stack.__enter__()


def _gateway_client(spec: SystemSpec, gateway_address: str | None, args):
    """The gateway client, opened for the first gateway system (None for local systems)."""
    if spec.kind != "gateway":
        return None
    from specdec.client import GatewayClient

    return GatewayClient(gateway_address, timeout=args.timeout)


def _make_runner(spec: SystemSpec, client, models: ModelCache, first: Conversation, args, run_id: str) -> Runner:
    """The runner of one system, warmed up with one short request (unless --no-warmup) in a cache scope
    of its own, which no measured round reads."""
    if spec.kind == "gateway":
        runner: Runner = GatewayRunner(client, spec.method, spec.num_draft_tokens, spec.draft_ahead,
                                       auto_methods=spec.auto_methods,
                                       cache_scope=cache_scope(run_id, spec.name, "warmup"))
    elif spec.kind == "local":
        drafter = models.drafter() if spec.method != "none" else None
        runner = LocalRunner(models.target(), drafter, spec.num_draft_tokens)
    elif spec.kind == LLAMACPP_KIND:
        runner = llamacpp.make_runner(spec, args)
    else:
        runner = HFRunner(models.target(), models.draft() if spec.assisted else None)
    if not args.no_warmup:
        try:
            runner.generate(messages=[("user", first.turns[0])] if first.chat else None,
                            prompt=None if first.chat else first.turns[0],
                            max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens),
                            temperature=args.temperature, seed=args.seed)
        except Exception as exc:  # noqa: BLE001 - the measured requests will show it
            log.warning("%s: warm-up failed: %s", spec.name, describe_error(exc))
    return runner


def run_bench(args) -> dict:
    """Run the benchmark described by ``args`` (the ``bench`` subcommand's namespace); returns the summary."""
    from specdec.models import default_draft_model

    validate_args(args)
    args.draft_model = args.draft_model or default_draft_model(args.target)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = load_prompts(args.prompts, args.limit)
    run_id = secrets.token_hex(6)  # names this run's suffix cache scopes (cache_scope)
    systems = parse_systems(args.systems or (DEFAULT_LOCAL_SYSTEMS if args.local else DEFAULT_GATEWAY_SYSTEMS),
                            args.local)
    llamacpp.check_greedy(systems, args.temperature)
    control = None
    if replay_requested(args):
        systems = replay_systems(args, systems)
        args.replay_file = os.path.abspath(args.replay_file or out_dir / "replay.json")
        control = ReplayControl(Path(args.replay_file), args.replay_cost, args.replay_seed)
    gateway_address = None if args.local else (args.gateway or "localhost:50051")
    models = ModelCache(args)
    client = None
    stack = None
    if args.up and any(spec.kind == "gateway" for spec in systems):
        stack, gateway_address = start_local_stack(args)
    skipped: dict[str, str] = {}
    all_records: dict[str, list[RequestRecord]] = {}
    summaries: dict[str, dict] = {}
    progress = not args.no_progress
    runners: dict[str, Runner] = {}
    durations: dict[str, float] = {}
    round_rates: dict[str, list[float]] = {}  # output tokens/s of each round, per system
    rounds = effective_rounds(args.rounds, len(group_spans(conversations)), args.concurrency)
    try:
        for spec in systems:
            if spec.assisted and not args.draft_model:
                skipped[spec.name] = "skipped: hf-assisted needs --draft-model (assisted generation with the same draft)"
                log.warning("%s", skipped[spec.name])
            elif spec.kind == "hf" and (why := hf_unavailable(models.target(),
                                                              models.draft() if spec.assisted else None)):
                skipped[spec.name] = f"skipped: {why}"
                log.warning("%s: %s", spec.name, skipped[spec.name])
        measured = [spec for spec in systems if spec.name not in skipped]
        if control is not None:  # plain decoding records what the replay drafter proposes, and the target's step
            recording = SystemSpec("recording", "gateway", "none", 0)
            client = client or _gateway_client(recording, gateway_address, args)
            recorder = _make_runner(recording, client, models, conversations[0], args, run_id)
            recorder.cache_scope = cache_scope(run_id, recording.name, "all")
            records, _ = run_system(recorder, "recording", conversations, args, progress)
            control.record(records)
        # Interleaved rounds: group g (conversation g, where the prompts have no groups) belongs to round
        # g % R; each round runs every system, in reverse order every other round (A B, B A, ...), so a
        # machine that slows down or speeds up during the run weighs on all systems alike instead of on
        # whichever ran last.
        for r, block in enumerate(round_blocks(conversations, rounds)):
            for spec in measured if r % 2 == 0 else measured[::-1]:
                if control is not None:
                    control.activate(spec)
                if spec.name not in runners:
                    client = client or _gateway_client(spec, gateway_address, args)
                    runners[spec.name] = _make_runner(spec, client, models, conversations[0], args, run_id)
                if isinstance(runners[spec.name], GatewayRunner):
                    runners[spec.name].cache_scope = cache_scope(run_id, spec.name, str(r + 1))
                label = spec.name if rounds == 1 else f"{spec.name} {r + 1}/{rounds}"
                records, duration = run_system(runners[spec.name], label, [conversations[i] for i in block],
                                               args, progress, indices=block)
                for record in records:
                    record.system = spec.name
                all_records.setdefault(spec.name, []).extend(records)
                durations[spec.name] = durations.get(spec.name, 0.0) + duration
                round_rates.setdefault(spec.name, []).append(output_tokens_per_s(records, duration))
        for spec in measured:
            records = all_records[spec.name]
            summary = summarize_records(records, durations[spec.name])
            summary["kind"] = {"gateway": "gateway", "local": "in-process loop", "hf": "transformers",
                               LLAMACPP_KIND: "llama.cpp in process"}[spec.kind]
            if spec.kind != "hf":
                summary["num_draft_tokens"] = spec.num_draft_tokens
                summary["method"] = spec.method
                if spec.auto_methods:
                    summary["auto_methods"] = list(spec.auto_methods)
                if spec.replay_acceptance is not None:
                    summary["replay_acceptance"] = spec.replay_acceptance
            summary["per_category"] = summarize_by_category(records)
            summary["round_tokens_per_s"] = round_rates[spec.name]
            summaries[spec.name] = summary
            first_error = next((r.error for r in records if r.error), None)
            if first_error:
                summary["first_error"] = first_error
    finally:
        for runner in runners.values():
            runner.close()
        if client is not None:
            client.close()
        if stack is not None:
            stack.__exit__()

    speedup = compute_speedups(summaries)
    bound = compute_bound(args, summaries, all_records, models)
    speedup["measured_over_bound"] = bound.get("measured_over_bound")
    summary = {
        "config": {
            "mode": "local" if args.local else "gateway",
            "gateway": gateway_address,
            "run_id": run_id,  # the gateway systems' suffix cache scopes are RUN_ID/SYSTEM/ROUND
            "target": args.target,
            "draft_model": args.draft_model,
            "dtype": os.environ.get(DTYPE_ENV, "auto"),
            "prompts": args.prompts,
            "limit": args.limit,
            "conversations": len(conversations),
            "requests_per_system": sum(len(c.turns) for c in conversations),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "concurrency": args.concurrency,
            "request_rate": args.request_rate,
            "systems": [s.name for s in systems],
            "rounds": rounds,
            "net_delay_ms": args.net_delay,
            "net_delay_injected": (stack is not None or getattr(args, "stack_started", False)) and args.net_delay > 0,
            "draft_ahead_default": args.draft_ahead if stack is not None or getattr(args, "stack_started", False) else None,
            "machine_partition": machine_partition_config(args, stack),
        },
        "machine": machine_info(args.device),
        "systems": summaries,
        "skipped": skipped,
        "speedup": speedup,
        # The headline ratio's spread over the interleaved rounds (None with one round).
        "spec_vs_baseline_by_round": paired_round_ratios(summaries, spec_reference(summaries)) if rounds > 1 else None,
        # suffix drafting's gain (issue #45) within each round, where both systems ran
        "suffix_vs_nosuffix_by_round": (paired_round_ratios(summaries, "spec-suffix", "spec-nosuffix")
                                        if rounds > 1 else None),
        "bound": bound,
        "k0_rounds": k0_rounds_against_plain(summaries, all_records),
        # llama.cpp's systems: the file and threads they ran with, the GGUF and fp32 forward curves
        "llamacpp": llamacpp.peer_summary(args, models, measured, runners),
    }
    summary["split_prediction"] = split_prediction(summary)
    if control is not None:
        summary["config"]["replay"] = control.config()
        summary["acceptance_sweep"] = sweep_results(args, systems, summaries, all_records, models, control)
    summary["plots"] = plots.write_plots(out_dir, summary, all_records)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as f:
        for records in all_records.values():
            for r in records:
                f.write(json.dumps(asdict(r)) + "\n")
    (out_dir / "report.md").write_text(render_report(summary))
    return summary


SCALING_FIELDS = ("tokens_per_s", "ttft_p50_s", "tpot_p50_s", "latency_p50_s", "acceptance_rate",
                  "mean_accepted_length", "k_mean", "mean_batch_size", "errors")


def run_sweep(args) -> dict:
    """``--concurrency 1,2,4,...``: every system at every level (one stack for all with ``--up``),
    each level's full report under ``OUT/c<N>/``, and the scaling table and plot in ``OUT``."""
    levels = list(args.concurrency)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stack = None
    base = copy.copy(args)
    from specdec.models import default_draft_model

    base.draft_model = base.draft_model or default_draft_model(base.target)
    if args.up:
        stack, base.gateway = start_local_stack(base)
        base.up, base.stack_started = False, True
    runs: dict[int, dict] = {}
    try:
        for level in levels:
            run_args = copy.copy(base)
            run_args.concurrency, run_args.out = level, str(out_dir / f"c{level}")
            log.info("concurrency %d", level)
            runs[level] = run_bench(run_args)
    finally:
        if stack is not None:
            stack.__exit__()
    systems = list(runs[levels[0]]["systems"])
    sweep = {
        "levels": levels,
        "config": {**runs[levels[0]]["config"], "concurrency": levels},
        "machine": runs[levels[0]]["machine"],
        "systems": {name: [{"concurrency": level, **{f: runs[level]["systems"].get(name, {}).get(f) for f in SCALING_FIELDS}}
                           for level in levels] for name in systems},
        "spec_vs_baseline": [runs[level]["speedup"].get("spec_vs_baseline") for level in levels],
        "spec_vs_baseline_by_round": [runs[level].get("spec_vs_baseline_by_round") for level in levels],
        "vs_llamacpp": {name: [runs[level]["speedup"].get(f"{name}_vs_{LLAMACPP}") for level in levels]
                        for name in systems if any(LLAMACPP in runs[level]["systems"] for level in levels)
                        and name != LLAMACPP},
        "k0_over_plain": {name: [(runs[level].get("k0_rounds") or {}).get(name, {}).get("over_plain") for level in levels]
                          for name in systems if name != "baseline"
                          and any(name in (runs[level].get("k0_rounds") or {}) for level in levels)},
    }
    for name, points in sweep["systems"].items():
        first = points[0]["tokens_per_s"]
        for point in points:
            point["scaling_vs_first_level"] = ratio(point["tokens_per_s"], first)
    sweep["plot"] = plots.plot_concurrency_scaling(out_dir / "concurrency_scaling.png", sweep)
    (out_dir / "concurrency.json").write_text(json.dumps(sweep, indent=2) + "\n")
    (out_dir / "concurrency.md").write_text(render_sweep(sweep))
    return sweep


def _stop_on_sigterm(signum, frame) -> None:
    # A bench stopped by SIGTERM unwinds like Ctrl-C, so a stack it started (``--up``, in a session of
    # its own, which a signal to the bench does not reach) is stopped by the ``finally`` that owns it.
    raise SystemExit(128 + signum)


def main(args) -> int:
    """The ``specdec bench`` entry point (``args`` from ``add_arguments``)."""
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args) -> int:
    from specdec.models import ModelLoadError

    try:
        validate_args(args)
        if isinstance(args.concurrency, list):
            sweep = run_sweep(args)
            print(f"wrote {Path(args.out) / 'concurrency.md'} (and c<N>/ per level)")
            for name, points in sweep["systems"].items():
                print(f"  {name:>12}: " + ", ".join(f"c={p['concurrency']} {p['tokens_per_s']:.2f} tok/s" for p in points))
            print("  spec/baseline: " + ", ".join(fmt(v, digits=3) for v in sweep["spec_vs_baseline"]))
            for name, ratios in sweep["k0_over_plain"].items():
                print(f"  {name} k = 0 round ÷ plain round: " + ", ".join(fmt(v, digits=3) for v in ratios))
            return 1 if any(p["errors"] for points in sweep["systems"].values() for p in points) else 0
        summary = run_bench(args)
    except (ValueError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'summary.json'} and report.md")
    for name, s in summary["systems"].items():
        print(f"  {name:>12}: {s['tokens_per_s']:.2f} tok/s, TTFT p50 {fmt(s['ttft_p50_s'], 1e3, 0)} ms, "
              f"acceptance {fmt(s.get('acceptance_rate'), digits=3)}, errors {s['errors']}")
    for name, reason in summary["skipped"].items():
        print(f"  {name:>12}: {reason}")
    sp = {k: v for k, v in summary["speedup"].items() if v is not None}
    if sp:
        print("  speedup: " + ", ".join(f"{k} {v:.3f}" for k, v in sp.items()))
    if by_round := summary.get("spec_vs_baseline_by_round"):
        print(f"  {by_round['pair'][0]}/{by_round['pair'][1]} by round: {format_round_ratios(by_round)}")
    for name, r in (summary.get("k0_rounds") or {}).items():
        if name != "baseline":
            print(f"  {name:>12}: k = 0 round {fmt(r['k0_round_s'], 1e3, 2)} ms ({r['k0_rounds']} of {r['rounds']} "
                  f"rounds), ÷ plain round {fmt(r['over_plain'], digits=3)}")
    for point in (summary.get("acceptance_sweep") or {}).get("points", []):
        print(f"  {point['system']:>16}: α measured {fmt(point['alpha_measured'], digits=3)}, "
              f"spec/baseline {fmt(point['speedup'], digits=3)}, bound {fmt(point['bound'], digits=3)}, "
              f"measured/bound {fmt(point['measured_over_bound'], digits=3)}, outputs = plain decoding "
              f"{point['outputs']['identical']}/{point['outputs']['compared']}")
    return 1 if any(s["errors"] for s in summary["systems"].values()) else 0
