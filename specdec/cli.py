"""The ``specdec`` command line: generate (in-process or through a gateway), serve, up, sim."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from specdec.pass_options import add_model_flags, apply_model_flags
from specdec.service_config import (CLIENT_API_KEY_ENV, DEFAULT_LOG_LEVEL, DEFAULT_TARGET, LOG_LEVEL_ENV,
                                    add_role_parsers, client_api_key, log_level, service_config)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true", help="apply the target's chat template to PROMPT")
    p.add_argument("--draft", choices=["auto", "model", "eagle", "ngram", "suffix", "none"], default="auto",
                   help="draft method (eagle: an EAGLE head over the target's features; suffix: lookup in the "
                        "request's own text and, through a gateway, this tenant's earlier outputs)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=0, help="draft tokens per round (0 = adaptive)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact distributed speculative decoding")
    parser.add_argument("--log-level", default=None, help=f"env {LOG_LEVEL_ENV}; default {DEFAULT_LOG_LEVEL}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in-process (--local) or through a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", help="run the models in this process")
    gen.add_argument("--gateway", default="localhost:50051", help="gateway address (default localhost:50051)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help="target model: hub id, local dir or 'embedded'")
    gen.add_argument("--draft-model", default=None, help="draft model: hub id or local dir")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (gateway mode)")
    gen.add_argument("--api-key", default=None, help=f"gateway API key (env {CLIENT_API_KEY_ENV})")
    add_model_flags(gen)
    gen.add_argument("--tls-ca", default=None, help="CA to verify the gateway (enables TLS)")
    gen.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    gen.add_argument("--tls-key", default=None, help="client key (mTLS)")
    _add_sampling_flags(gen)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    add_role_parsers(roles)

    up = sub.add_parser("up", help="start drafter, verifier and gateway locally, supervised")
    from specdec.up import add_arguments as _add_up_arguments

    _add_up_arguments(up, DEFAULT_TARGET)
    add_model_flags(up)

    bench = sub.add_parser("bench", help="benchmark spec decoding vs baselines (gateway or --local)")
    from specdec.bench.cli import add_arguments as _add_bench_arguments

    _add_bench_arguments(bench)

    train = sub.add_parser("train-draft", help="distil a draft model from a target (data, then training)",
                           description="Steps of the recipe behind the shipped draft (see its model card): "
                                       "'queries' has the target write user requests (Magpie), 'data' has the target answer "
                                       "offline prompts (or those requests), 'train' distils the draft, "
                                       "'eval' measures greedy acceptance; 'eagle-features', 'eagle-train', 'eagle-eval', 'eagle-ids' and 'eagle-curve' "
                                       "build the EAGLE head (specdec/eagle/). Each step's --help lists its options.")
    train.add_argument("step", choices=["queries", "data", "train", "eval", "eagle-features", "eagle-train", "eagle-eval",
                                        "eagle-ids", "eagle-curve"])
    train.add_argument("step_args", nargs=argparse.REMAINDER)

    sim = sub.add_parser("sim", help="simulate draft-length policies (no models)")
    from specdec import sim as sim_module

    sim_module.add_arguments(sim)
    return parser


def _sampling_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _emit_json(text, token_ids, prompt_token_ids, finish_reason, stats) -> None:
    print(json.dumps({
        "text": text,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_token_ids,
        "finish_reason": finish_reason,
        "stats": stats,
    }))


def _generate_local(args) -> int:
    import torch

    from specdec.completion import Chunk
    from specdec.drafters import ModelDrafter
    from specdec.drafting import NgramDrafter
    from specdec.suffix import SuffixDrafter
    from specdec.models import check_compatible, default_draft_model, load_model
    from specdec.prompts import encode_chat, encode_text
    from specdec.local import LocalEngine
    from specdec.wire_types import SamplingParams

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target = load_model(args.target)
    method = args.draft
    draft_model = args.draft_model or default_draft_model(args.target)
    if method == "auto":
        method = "model" if draft_model else "ngram"
    drafter = None
    if method == "model":
        if not draft_model:
            print("error: --draft model needs --draft-model (no shipped draft for this target)", file=sys.stderr)
            return 2
        draft = load_model(draft_model)
        check_compatible(target, draft)
        drafter = ModelDrafter(draft)
    elif method == "eagle":
        from specdec.eagle.drafter import EagleDrafter
        from specdec.models import default_eagle_head

        head = args.draft_model or default_eagle_head(args.target)
        if not head:
            print("error: --draft eagle needs --draft-model: an EAGLE head directory", file=sys.stderr)
            return 2
        drafter = EagleDrafter.load(head, target)
    elif method == "ngram":
        drafter = NgramDrafter()
    elif method == "suffix":
        drafter = SuffixDrafter()
    tokenizer = target.tokenizer
    prompt_ids = encode_chat(tokenizer, [("user", args.prompt)]) if args.chat else encode_text(tokenizer, args.prompt)
    kwargs = _sampling_kwargs(args)
    if kwargs["top_p"] is None:
        kwargs["top_p"] = 1.0
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def run():
        result = None
        async for event in LocalEngine(target, drafter).stream(prompt_ids, params, args.num_draft_tokens):
            if isinstance(event, Chunk):
                if not args.json:
                    print(event.text, end="", flush=True)
            else:
                result = event
        return result

    result = asyncio.run(run())
    if args.json:
        _emit_json(result.text, result.token_ids, prompt_ids, result.finish_reason, result.stats.to_dict())
    else:
        print()
        print(_stats_line(result.finish_reason, result.stats.to_dict()), file=sys.stderr)
    return 0


def _stats_line(finish_reason: str, stats: dict) -> str:
    return (
        f"[{finish_reason}] draft={stats['draft_method']} rounds={stats['rounds']} "
        f"acceptance={stats['acceptance_rate']:.2f} mean_accepted_length={stats['mean_accepted_length']:.2f} "
        f"ttft={stats['ttft_s'] * 1000:.0f}ms tokens/s={stats['tokens_per_s']:.1f}"
    )


def _generate_remote(args) -> int:
    import grpc

    from specdec.client import ChunkEvent, Completion, GatewayClient, fold

    kwargs = _sampling_kwargs(args)
    request = dict(method=args.draft, num_draft_tokens=args.num_draft_tokens, **kwargs)
    if args.chat:
        request["messages"] = [("user", args.prompt)]
    else:
        request["prompt"] = args.prompt
    completion = Completion()
    try:
        with GatewayClient(args.gateway, timeout=args.timeout, api_key=client_api_key(args.api_key, os.environ),
                           tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            for event in client.stream(**request):
                fold(completion, event)
                if isinstance(event, ChunkEvent) and not args.json:
                    print(event.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        _emit_json(completion.text, completion.token_ids, completion.prompt_token_ids,
                   completion.finish_reason, completion.stats)
    else:
        print()
        print(_stats_line(completion.finish_reason, completion.stats), file=sys.stderr)
    return 0


def _serve(args) -> int:
    config = service_config(args, os.environ)
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    if config.role == "verifier":
        from verifier_service.server import serve
    elif config.role == "drafter":
        from drafter_service.server import serve
    else:
        from gateway.server import serve
    from specdec import telemetry

    telemetry.setup(f"specdec-{config.role}", endpoint=config.otlp_endpoint, detail=config.trace_detail)
    try:
        asyncio.run(serve(config))
    finally:
        telemetry.shutdown()  # flush spans and metrics still batched
    return 0


def _up(args) -> int:
    from specdec import up

    return up.run(args)


def _train_draft(args) -> int:
    from specdec.distill import evaluate, generate, queries, train

    if args.step.startswith("eagle-"):
        from specdec.eagle import curve as eagle_curve, evaluate as eagle_evaluate, features as eagle_features
        from specdec.eagle import ids as eagle_ids, train as eagle_train

        eagle = {"eagle-features": eagle_features.main, "eagle-train": eagle_train.main, "eagle-eval": eagle_evaluate.main,
                 "eagle-ids": eagle_ids.main, "eagle-curve": eagle_curve.main}
        return eagle[args.step](args.step_args)
    steps = {"queries": queries.main, "data": generate.main, "train": train.main, "eval": evaluate.main}
    return steps[args.step](args.step_args)


def _sim(args) -> int:
    from specdec import sim

    return sim.run_cli(args) or 0


def _bench(args) -> int:
    from specdec.bench import cli as bench

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=log_level(args.log_level, os.environ), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_model_flags(args)
    if args.command == "generate":
        return _generate_local(args) if args.local else _generate_remote(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "up":
        return _up(args)
    if args.command == "train-draft":
        return _train_draft(args)
    if args.command == "sim":
        return _sim(args)
    if args.command == "bench":
        return _bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
