"""``report.md`` of a bench run and ``concurrency.md`` of a concurrency sweep (Markdown tables)."""

from __future__ import annotations

import math
from pathlib import Path

from specdec.bench.breakdown import describe as describe_breakdown
from specdec.bench.runners import LLAMACPP


def fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    return f"{value * scale:.{digits}f}"


def format_round_ratios(by_round: dict) -> str:
    """``0.96, 1.04, 0.95 (mean 0.983 ± 0.028 s.e.)``"""
    spread = f" ± {by_round['stderr']:.3f} s.e." if by_round.get("stderr") is not None else ""
    return ", ".join(f"{r:.2f}" for r in by_round["ratios"]) + f" (mean {by_round['mean']:.3f}{spread})"


def render_k0_rounds(k0_rounds: dict) -> list[str]:
    """Each system's rounds without drafts against the baseline's plain rounds (the tax of being
    speculative while not drafting); nothing when no system other than the baseline has them."""
    if not any(name != "baseline" for name in k0_rounds):
        return []
    lines = ["The k = 0 round (verified no drafts) against the plain round: the mean wait for the verdict "
             "plus the loop's own time per round, each system's own rounds; ÷ plain is against the baseline's "
             "rounds measured the same way.", "",
             "| system | k = 0 rounds / all rounds | shadow probes | k = 0 round (ms) | ÷ plain |",
             "|---|---:|---:|---:|---:|"]
    for name, r in k0_rounds.items():
        lines.append(f"| {name} | {r['k0_rounds']} / {r['rounds']} | {r['shadow_probes']} "
                     f"| {fmt(r['k0_round_s'], 1e3, 2)} | {fmt(r['over_plain'], digits=3)} |")
    lines.append("")
    return lines


def render_report(summary: dict) -> str:
    cfg, systems, speed, bound = summary["config"], summary["systems"], summary["speedup"], summary["bound"]
    machine = summary["machine"]
    lines = ["# specdec bench report", ""]
    lines.append(f"- mode: **{cfg['mode']}**" + (f" (gateway {cfg['gateway']})" if cfg["gateway"] else ""))
    local_draft = cfg["draft_model"] or "none (n-gram drafter)"
    if cfg["mode"] == "local":
        lines.append(f"- target: `{cfg['target']}`; draft model: `{local_draft}`")
    else:
        methods = sorted({s["draft_method"] for s in systems.values() if s.get("draft_method")})
        lines.append(f"- gateway systems: the gateway's models (draft methods seen: {', '.join(methods) or 'none'}); "
                     f"local systems (if any): target `{cfg['target']}`, draft `{local_draft}`")
    lines.append(f"- prompts: `{cfg['prompts']}`, limit {cfg['limit']} per set → {cfg['conversations']} conversations, "
                 f"{cfg['requests_per_system']} requests per system")
    lines.append(f"- max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, seed {cfg['seed']}, "
                 f"concurrency {cfg['concurrency'] or ('unbounded' if cfg['request_rate'] else 1)}, "
                 f"request rate {cfg['request_rate'] or 'back to back'}")
    if cfg["net_delay_ms"] and cfg.get("net_delay_injected"):
        lines.append(f"- net delay: {cfg['net_delay_ms']} ms one way on every gateway↔drafter/verifier message "
                     "(injected by the gateway this bench started)")
    elif cfg["net_delay_ms"]:
        lines.append(f"- net delay: {cfg['net_delay_ms']} ms (recorded; injected only if the gateway was started "
                     "with --net-delay-ms)")
    else:
        lines.append("- net delay: 0 ms")
    if partition := cfg.get("machine_partition"):
        lines.append(f"- two machines on one: the verifier on cores {partition['verifier_cpus']}, the drafter and the "
                     f"gateway on {partition['drafter_gateway_cpus']} (CPU affinity), every system alike; memory "
                     "bandwidth and caches are still shared")
    lines.append(f"- machine: {machine.get('cpu_model', machine.get('processor'))}, {machine.get('cpu_count')} CPUs, "
                 f"{machine.get('torch_threads')} torch threads"
                 + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
                 + f"; torch {machine.get('torch')}, transformers {machine.get('transformers')}")
    lines.append("")
    for name, reason in summary.get("skipped", {}).items():
        lines.append(f"> **{name}** {reason}")
        lines.append("")

    peer = (systems.get(LLAMACPP) or {}).get("tokens_per_s")
    lines += ["## Systems", "",
              "| system | kind | tok/s |" + (f" ÷ {LLAMACPP} |" if peer else "")
              + " req/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) "
              "| latency p50 / p99 (s) | acceptance | mean accepted len | mean k | errors |",
              "|---|---|---:|" + ("---:|" if peer else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in systems.items():
        versus = f" {fmt(1.0 if name == LLAMACPP else speed.get(f'{name}_vs_{LLAMACPP}'), digits=3)} |" if peer else ""
        lines.append(
            f"| {name} | {s.get('kind')} | {fmt(s['tokens_per_s'])} |{versus} {fmt(s['requests_per_s'], digits=3)} "
            f"| {fmt(s['ttft_p50_s'], 1e3, 0)} / {fmt(s['ttft_p90_s'], 1e3, 0)} / {fmt(s['ttft_p99_s'], 1e3, 0)} "
            f"| {fmt(s['tpot_p50_s'], 1e3, 1)} / {fmt(s['tpot_p99_s'], 1e3, 1)} "
            f"| {fmt(s['itl_p50_s'], 1e3, 1)} / {fmt(s['itl_p99_s'], 1e3, 1)} "
            f"| {fmt(s['latency_p50_s'])} / {fmt(s['latency_p99_s'])} "
            f"| {fmt(s.get('acceptance_rate'), digits=3)} | {fmt(s.get('mean_accepted_length'))} "
            f"| {fmt(s.get('k_mean'))} | {s['errors']} |")
    lines.append("")
    lines.append("TTFT, TPOT = (latency − TTFT)/(tokens − 1), ITL counted per token (a chunk of n tokens "
                 "after a gap g counts n × g/n), latency: mean / p50 / p90 / p99 of each are in summary.json. "
                 "tok/s and req/s are over the wall time of the system's run.")
    lines.append("")
    breakdowns = {n: s["round_breakdown"] for n, s in systems.items() if s.get("round_breakdown")}
    if breakdowns:
        lines += ["Where a round's time goes (mean per round, from the gateway's stats and the verifier's "
                  "service and pass times; the pass is the target's forward plus acceptance):", ""]
        lines += [f"- {name}: {describe_breakdown(b)}" for name, b in breakdowns.items()]
        lines.append("")
    lines += render_k0_rounds(summary.get("k0_rounds") or {})
    errors = {n: s["first_error"] for n, s in systems.items() if s.get("first_error")}
    for name, err in errors.items():
        lines.append(f"- first error of {name}: `{err}`")
    if errors:
        lines.append("")

    lines += ["## Speedup (output tokens/s ratio)", "", "| comparison | speedup |", "|---|---:|"]
    for key, value in speed.items():
        lines.append(f"| {key} | {fmt(value, digits=3)} |")
    lines.append("")
    for by_round in (summary.get("spec_vs_baseline_by_round"), summary.get("suffix_vs_nosuffix_by_round")):
        if by_round:
            lines += [f"{by_round['pair'][0]} / {by_round['pair'][1]} within each interleaved round: "
                      f"{format_round_ratios(by_round)}", ""]
    if summary.get("llamacpp"):
        lines += render_llamacpp(summary["llamacpp"])

    lines += ["## Analytic bound", ""]
    if bound.get("bound") is not None:
        alphas = ", ".join(f"{a:.2f}" for a in bound.get("alphas_by_position", [])) or "–"
        lines += [
            f"- acceptance from **{bound['acceptance_from']}** ({bound['acceptance_source']}): first position "
            f"{fmt(bound['alpha'], digits=3)}, conditional α by position: {alphas} (the system's acceptance rate: "
            f"{fmt(bound['acceptance_rate'], digits=3)})",
            f"- a round's cost t_round(k): {bound['costs_source']}; the plain round t_plain = "
            f"{fmt(bound['t_plain_s'], 1e3, 2)} ms ({bound['plain_round_source']})",
            f"- bound = max_k (P + t_plain)/(P + t_round(k)/E[tokens](k)) = **{fmt(bound['bound'], digits=3)}×** at "
            f"k = {bound['best_k']}, with P = {fmt(bound['prefill_per_token_s'], 1e3, 2)} ms the baseline's time to first "
            f"token per decoded token (decoding alone, P = 0: {fmt(bound['bound_decoding'], digits=3)}× at "
            f"k = {bound['best_k_decoding']})",
        ]
        if bound.get("draft_costs_from"):
            lines.append(f"- draft costs: {bound['draft_costs_from']}")
        if bound.get("bound_own_rounds_acceptance") is not None:
            own = ", ".join(f"{a:.2f}" for a in bound.get("own_rounds_alphas_by_position") or []) or "–"
            lines.append(f"- with the acceptance of the system's own verified rounds instead ({own}): "
                         f"{fmt(bound['bound_own_rounds_acceptance'], digits=3)}× (an adaptive policy drafts deep "
                         "where acceptance is high, so its rounds overstate the deep positions)")
        roof = bound.get("roofline") or {}
        if roof.get("memory_bound_step_s"):
            lines.append(f"- target step vs memory bandwidth: {roof['weight_bytes'] / 1e6:.0f} MB of weights ÷ "
                         f"{roof['bandwidth_gb_s']:.1f} GB/s measured = {fmt(roof['memory_bound_step_s'], 1e3, 1)} ms; "
                         f"the one-token forward = {fmt(roof['measured_step_s'], 1e3, 1)} ms "
                         f"(**{fmt(roof['step_over_memory_bound'], digits=2)}×** the bound)")
        if bound.get("measured") is not None:
            pair = bound["measured_pair"]
            lines.append(f"- measured = {pair[0]} tok/s ÷ {pair[1]} tok/s = {fmt(bound['measured'], digits=3)}×; "
                         f"measured / bound = **{fmt(bound['measured_over_bound'], digits=3)}**")
            if bound.get("selective_note"):
                lines.append(f"- {bound['selective_note']}")
        forward = bound.get("target_forward_s") or []
        measured = bound.get("measured_rounds") or {}
        lines += ["", "| k | rounds measured | verify (ms) | draft (ms) | t_round(k) (ms) | target forward, k + 1 tokens (ms) "
                  "| E[tokens](k) | speedup(k) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for point in bound["curve"]:
            k = point["k"]
            lines.append(f"| {k} | {measured.get(k, 0)} | {fmt(bound['t_verify_s'][k], 1e3, 2)} | {fmt(bound['t_draft_s'][k], 1e3, 2)} "
                         f"| {fmt(bound['t_round_s'][k], 1e3, 2)} | {fmt(forward[k] if k < len(forward) else None, 1e3, 2)} "
                         f"| {fmt(point['expected_tokens'], digits=3)} | {fmt(point['speedup'], digits=3)} |")
    if split := summary.get("split_prediction"):
        def measured(name):
            return fmt((systems.get(name) or {}).get("tokens_per_s"))

        lines += ["", f"Split model (`specdec sim --split`, `specdec/split.py`) from this run's costs, per-token acceptance "
                  f"{fmt(split['alpha'], digits=3)}, one-way delay {fmt(split['one_way_delay_s'], 1e3, 1)} ms: baseline "
                  f"{fmt(split['baseline_tokens_per_s'])} tok/s (measured {measured('baseline')}), speculation without "
                  f"draft-ahead {fmt(split['noahead_tokens_per_s'])} at k = {split['noahead_k']} (spec-noahead measured "
                  f"{measured('spec-noahead')}), with draft-ahead {fmt(split['ahead_tokens_per_s'])} at k = {split['ahead_k']} "
                  f"(spec-ahead measured {measured('spec-ahead')}); decoding only, acceptance independent per token."]
        if split.get("fixed_k"):
            lines += ["", "| system | k | draft-ahead | acceptance (from its tokens per round) | predicted tok/s "
                      "| measured tok/s after the first token | measured / predicted |", "|---|---:|---|---:|---:|---:|---:|"]
            for name, row in split["fixed_k"].items():
                lines.append(f"| {name} | {row['k']} | {'on' if row['ahead'] else 'off'} | {fmt(row['alpha'], digits=3)} "
                             f"| {fmt(row['predicted_tokens_per_s'])} | {fmt(row['measured_tokens_per_s'])} "
                             f"| {fmt(row['measured_over_predicted'], digits=3)} |")
    lines.append("")
    if bound.get("note"):
        lines += [f"Note: {bound['note']}", ""]

    if summary.get("acceptance_sweep"):
        lines += render_acceptance_sweep(summary["acceptance_sweep"])

    categories = sorted({c for s in systems.values() for c in s.get("per_category", {})})
    if categories and systems:
        names = list(systems)
        lines += ["## Per category (tokens/s over summed request latency; acceptance)", "",
                  "| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for c in categories:
            cells = []
            for n in names:
                pc = systems[n].get("per_category", {}).get(c)
                if pc is None:
                    cells.append("–")
                    continue
                cell = fmt(pc["tokens_per_s"])
                if pc.get("acceptance_rate") is not None:
                    cell += f" (α {pc['acceptance_rate']:.2f})"
                cells.append(cell)
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")

    plots = summary.get("plots") or []
    if plots:
        lines += ["## Plots", ""]
        for p in plots:
            lines.append(f"![{Path(p).stem}]({p})")
        lines.append("")
    return "\n".join(lines)


def render_llamacpp(peer: dict) -> list[str]:
    """The llama.cpp systems' settings and the forward curves of the GGUF file and of the fp32 model."""
    from specdec.bench.llamacpp import CURVE_POINTS

    lookup = peer["lookup"]
    lines = ["## llama.cpp in process (the peer)", "",
             f"- {', '.join(peer['systems'])}: greedy decoding in llama.cpp (this process, specdec's binding, "
             f"ggml-cpu {peer['cpu_variant']}) on `{peer['file']}`, the target's GGUF file; {peer['threads']} threads "
             f"({peer['threads_from']}); {peer['slots_requested']} sequences stepped together in one batch per step "
             f"(slots: {', '.join(f'{n} {v}' for n, v in peer['slots'].items()) or '–'})",
             f"- llamacpp-lookup mirrors {lookup['mirrors']}: drafts up to {lookup['n_draft']} tokens from "
             f"{lookup['ngram_min']}..{lookup['ngram_max']}-grams of the prompt and output", ""]
    curves = peer.get("forward_curves") or {}
    gguf, lean = curves.get("gguf"), curves.get("lean_fp32")
    if gguf is None:
        return lines + [f"No forward curve: {curves.get('note', '–')}", ""]
    tokens = curves["tokens"]
    lines += [f"The target's forward over n new tokens after a {curves['prefix_tokens']}-token prefix, in process "
              "(minimum over reps, made non-decreasing):", "",
              f"| tokens | GGUF file, llama.cpp ({gguf['threads']} threads) (ms) | fp32, lean runtime"
              + (f" ({lean['threads']} torch threads)" if lean else "") + " (ms) | fp32 / GGUF |", "|---:|---:|---:|---:|"]
    for n in CURVE_POINTS:
        if n > len(tokens):
            break
        g = gguf["seconds"][n - 1]
        f = lean["seconds"][n - 1] if lean else None
        lines.append(f"| {n} | {fmt(g, 1e3, 2)} | {fmt(f, 1e3, 2)} | {fmt(f / g if f and g else None)} |")
    if curves.get("lean_note"):
        lines += ["", f"No fp32 curve: {curves['lean_note']}"]
    return lines + [""]


def render_acceptance_sweep(sweep: dict) -> list[str]:
    """The controlled-acceptance section: the replay drafter's settings, per system the measured
    acceptance, speedup, bound and measured / bound, and the target's forward curve."""
    replay = sweep["replay"]
    lines = ["## Controlled acceptance (replay drafter)", "",
             f"- draft cost emulated: c = {fmt(replay['cost_fraction'], digits=3)} × the target's step "
             f"{fmt(replay['target_step_s'], 1e3, 1)} ms (verify time per round of the recording pass, plain "
             f"decoding through the gateway) = {fmt(replay['cost_s'], 1e3, 2)} ms per draft step (a sleep: no CPU); "
             f"seed {replay['seed']}; {replay['recorded_prompts']} prompts recorded",
             f"- baseline: {fmt(sweep.get('baseline_tokens_per_s'))} tok/s", "",
             "| system | α set | k | tok/s | α measured (per token) | mean accepted len | mean k | spec / baseline "
             "| per round mean ± s.e. | bound (best k) | bound at this k | measured / bound | outputs = plain decoding |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sweep["points"]:
        by_round = p.get("speedup_by_round")
        spread = "–" if not by_round else (f"{by_round['mean']:.3f} ± {by_round['stderr']:.3f}"
                                          if by_round.get("stderr") is not None else f"{by_round['mean']:.3f}")
        lines.append(f"| {p['system']} | {p['alpha_set']:g} | {p['k']} | {fmt(p['tokens_per_s'])} "
                     f"| {fmt(p['alpha_measured'], digits=3)} | {fmt(p['mean_accepted_length'])} | {fmt(p['k_mean'])} "
                     f"| {fmt(p['speedup'], digits=3)} | {spread} | {fmt(p['bound'], digits=3)} ({p['best_k']}) "
                     f"| {fmt(p['bound_at_k'], digits=3)} "
                     f"| **{fmt(p['measured_over_bound'], digits=3)}** "
                     f"| {p['outputs']['identical']} / {p['outputs']['compared']} |")
    costed = [p for p in sweep["points"] if p.get("t_round_s")]
    forward = sweep.get("target_forward_curve_s") or []
    if costed:
        lines += ["", f"A round's cost t_round(k) for each system's bound: {costed[0]['costs_source']}.", "",
                  "| k | target forward over k + 1 tokens, in process (ms) | "
                  + " | ".join(f"t_round {p['system']} (ms)" for p in costed) + " |",
                  "|---:|---:|" + "---:|" * len(costed)]
        for k in range(max(len(forward), max(len(p["t_round_s"]) for p in costed))):
            cells = [fmt(p["t_round_s"][k] if k < len(p["t_round_s"]) else None, 1e3, 2) for p in costed]
            lines.append(f"| {k} | {fmt(forward[k] if k < len(forward) else None, 1e3, 2)} | " + " | ".join(cells) + " |")
    if sweep.get("target_forward_curve_note"):
        lines.append(f"\nNo in-process forward curve: {sweep['target_forward_curve_note']}")
    return lines + [""]


def render_sweep(sweep: dict) -> str:
    cfg = sweep["config"]
    lines = ["# specdec bench: concurrency sweep", "",
             f"- prompts `{cfg['prompts']}`, limit {cfg['limit']} → {cfg['requests_per_system']} requests per system "
             f"and level; max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}",
             f"- levels (conversations in flight): {', '.join(map(str, sweep['levels']))}; each level's full report "
             "is in c<N>/report.md", "",
             "| system | concurrency | tok/s (aggregate) | × level 1 | TTFT p50 (ms) | TPOT p50 (ms) "
             "| mean accepted len | mean k | mean verifier batch | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, points in sweep["systems"].items():
        for p in points:
            lines.append(f"| {name} | {p['concurrency']} | {fmt(p['tokens_per_s'])} | {fmt(p['scaling_vs_first_level'])} "
                         f"| {fmt(p['ttft_p50_s'], 1e3, 0)} | {fmt(p['tpot_p50_s'], 1e3, 1)} "
                         f"| {fmt(p['mean_accepted_length'])} | {fmt(p['k_mean'])} | {fmt(p['mean_batch_size'])} "
                         f"| {p['errors']} |")
    lines += ["", "| concurrency | " + " | ".join(map(str, sweep["levels"])) + " |",
              "|---|" + "---:|" * len(sweep["levels"]),
              "| spec / baseline | " + " | ".join(fmt(v, digits=3) for v in sweep["spec_vs_baseline"]) + " |"]
    by_round = sweep.get("spec_vs_baseline_by_round") or []
    if any(by_round):
        lines += ["| per round: min – max | " + " | ".join(
                      f"{b['min']:.2f} – {b['max']:.2f}" if b else "–" for b in by_round) + " |",
                  "| per round: mean ± s.e. | " + " | ".join(
                      (f"{b['mean']:.3f} ± {b['stderr']:.3f}" if b.get("stderr") is not None else f"{b['mean']:.3f}")
                      if b else "–" for b in by_round) + " |"]
    for name, ratios in (sweep.get("vs_llamacpp") or {}).items():
        lines.append(f"| {name} / {LLAMACPP} | " + " | ".join(fmt(v, digits=3) for v in ratios) + " |")
    for name, ratios in (sweep.get("k0_over_plain") or {}).items():
        lines.append(f"| {name}: k = 0 round ÷ plain round | " + " | ".join(fmt(v, digits=3) for v in ratios) + " |")
    lines += ["", f"![concurrency scaling]({sweep['plot']})", ""]
    return "\n".join(lines)
