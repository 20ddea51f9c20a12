"""Cost of the observability hooks on the generation loop, in-process on the tiny test models.

    .venv/bin/python scripts/tracing_overhead.py [--reps 40] [--tokens 64] [-k 3]

Variants, run interleaved (round-robin, the order shuffled each repetition) so machine noise hits
them alike; each runs one greedy generation per repetition:

- absent:  ``specdec.engine.generate`` with the ``on_round`` hook lines removed from its source
           (the loop as it was before the hook);
- off:     the same loop with ``on_round=None`` (tracing not configured, no observer);
- metrics: what the gateway does with tracing off: a ``RequestTelemetry`` whose per-round observer
           records the Prometheus histograms (no tracer, no meter);
- traced:  tracing on at detail ``request`` (span + 1 event per round), spans batched to an exporter
           that drops them, for reference.

Prints, for each variant, the median wall and CPU (``time.process_time``: less disturbed by other
processes on a shared machine) time per generation and the median over repetitions of its CPU time
divided by ``absent``'s in the same repetition; then the cost of one ``on_round`` call measured
directly, as a share of a round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def engine_without_hooks() -> types.ModuleType:
    """``specdec.engine`` compiled from its source minus the ``if on_round is not None:`` block."""
    import specdec.engine as engine

    source = Path(engine.__file__).read_text()
    stripped, n = re.subn(r"\n        if on_round is not None:\n(?:            .*\n|                .*\n)+", "\n", source)
    if n != 1:
        raise SystemExit("could not find the on_round block in specdec/engine.py")
    module = types.ModuleType("engine_without_hooks")
    module.__file__ = engine.__file__
    sys.modules[module.__name__] = module
    exec(compile(stripped, "engine_without_hooks", "exec"), module.__dict__)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args()

    import torch
    from prometheus_client import CollectorRegistry

    from specdec import telemetry
    from specdec.completion import CompletionBuilder
    from specdec.drafters import ModelDrafter
    from specdec.engine import LocalDrafter, LocalVerifier, RoundRecord, collect, generate
    from specdec.models import load_model
    from specdec.policy import FixedDraftLength
    from specdec.wire_types import SamplingParams
    from specdec.verification import TargetSession
    from tests.tiny_models import build_pair

    torch.set_num_threads(1)
    _, target_dir, draft_dir = build_pair(Path(tempfile.gettempdir()) / "specdec-tiny-bench")
    target = load_model(str(target_dir), device="cpu")
    drafter = ModelDrafter(load_model(str(draft_dir), device="cpu"))
    prompt = target.tokenizer.encode("the quick brown fox jumps over")
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, seed=0)
    absent = engine_without_hooks()

    off_tel = telemetry.Telemetry("bench")  # what setup() leaves when nothing is configured
    metrics = telemetry.GenAIMetrics(CollectorRegistry(), off_tel)
    traced_tel = traced_telemetry()
    traced_metrics = telemetry.GenAIMetrics(CollectorRegistry(), traced_tel)

    async def run(variant: str) -> float:
        session = TargetSession(target, prompt, params)
        draft = drafter.start(prompt, params)
        kwargs = dict(prompt_tokens=len(prompt), completion=CompletionBuilder(target.tokenizer, params, target.eos_token_ids),
                      verifier=LocalVerifier(session), drafter=LocalDrafter(draft), policy=FixedDraftLength(args.k),
                      draft_method="model")
        start, cpu = time.perf_counter(), time.process_time()
        if variant == "absent":
            await absent.collect(absent.generate(**kwargs))
        elif variant == "off":
            await collect(generate(**kwargs, on_round=None))
        else:
            tel, m = (off_tel, metrics) if variant == "metrics" else (traced_tel, traced_metrics)
            obs = telemetry.RequestTelemetry(tel, m, "text_completion", "tiny")
            obs.begin(request_id="bench", params=params, prompt_tokens=len(prompt), method="model", requested_k=args.k)
            obs.links(kwargs["verifier"], kwargs["drafter"], "local", None, None)
            obs.generation_started()
            obs.finish(await collect(generate(**kwargs, on_round=obs.on_round)))
            obs.end()
        elapsed = time.perf_counter() - start, time.process_time() - cpu
        session.close()
        draft.close()
        return elapsed

    variants = ["absent", "off", "metrics", "traced"]
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    rng = random.Random(0)

    async def bench() -> None:
        for v in variants:  # warm up
            await run(v)
        for _ in range(args.reps):
            order = variants[:]
            rng.shuffle(order)
            for v in order:
                times[v].append(await run(v))

    asyncio.run(bench())
    rounds = asyncio.run(collect(generate(
        prompt_tokens=len(prompt), completion=CompletionBuilder(target.tokenizer, params, target.eos_token_ids),
        verifier=LocalVerifier(TargetSession(target, prompt, params)), drafter=LocalDrafter(drafter.start(prompt, params)),
        policy=FixedDraftLength(args.k), draft_method="model"))).stats.rounds

    base = statistics.median(t[0] for t in times["absent"])
    print(f"tiny pair, greedy, {args.tokens} tokens, k={args.k}, {rounds} rounds per generation, "
          f"{args.reps} interleaved repetitions, 1 torch thread")
    for v in variants:
        wall = statistics.median(t[0] for t in times[v])
        cpu = statistics.median(t[1] for t in times[v])
        paired = statistics.median(t[1] / a[1] for t, a in zip(times[v], times["absent"]))
        print(f"  {v:8} wall {wall * 1e3:8.2f} ms  cpu {cpu * 1e3:8.2f} ms  "
              f"cpu vs absent (paired median) {100 * (paired - 1):+6.2f}%")

    # The hook's own cost, measured directly (no model noise).
    record = RoundRecord(1, 3, 3, 1, 2, 0.001, 0.002, time.perf_counter())
    for label, tel, m in (("metrics", off_tel, metrics), ("traced", traced_tel, traced_metrics)):
        obs = telemetry.RequestTelemetry(tel, m, "text_completion", "tiny")
        obs.begin(request_id="bench", params=params, prompt_tokens=len(prompt), method="model", requested_k=args.k)
        samples = []
        for _ in range(20):
            obs.recorded = 0  # stay under the per-request cap
            start = time.perf_counter()
            for _ in range(50):
                obs.on_round(record)
            samples.append((time.perf_counter() - start) / 50)
        obs.end()
        per_round_ms = base * 1e3 / rounds
        cost = statistics.median(samples) * 1e6
        print(f"  on_round ({label}): {cost:.1f} us per call = {100 * cost / 1e3 / per_round_ms:.3f}% "
              f"of a {per_round_ms:.2f} ms round")
    traced_tel.shutdown()
    return 0


def traced_telemetry():
    """Tracing on, with a BatchSpanProcessor whose exporter drops everything (no collector needed)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from specdec import telemetry

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tel = telemetry.Telemetry("bench", "request")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tel.tracer = provider.get_tracer("bench")
    tel._providers.append(provider)
    from opentelemetry import propagate

    tel._propagate = propagate
    return tel


if __name__ == "__main__":
    sys.exit(main())
