"""The ``specdec`` command line: generate (in-process or through a gateway), serve, up, sim."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from specdec.pass_options import add_model_flags, apply_model_flags

DEFAULT_TARGET = "embedded"


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true", help="apply the target's chat template to PROMPT")
    p.add_argument("--draft", choices=["auto", "model", "eagle", "ngram", "none"], default="auto",
                   help="draft method (eagle: an EAGLE head over the target's features)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=0, help="draft tokens per round (0 = adaptive)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _add_serve_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default=os.environ.get("SPECDEC_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus HTTP port (off when unset)")
    p.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--grace", type=float, default=30.0, help="seconds in-flight streams get on SIGTERM")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--max-sessions-per-peer", type=int, default=None,
                   help="drafter/verifier: sessions one client host may hold (default: all of --max-sessions; "
                        "set it below that where several gateways share a drafter or verifier, so that one "
                        "of them cannot take every session)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    add_model_flags(p)
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="drafter/verifier: free a session whose stream is silent this long (seconds)")
    p.add_argument("--threads", type=int, default=os.environ.get("SPECDEC_THREADS", "0"),
                   help="CPU threads for the model's operations (env SPECDEC_THREADS; 0: one for the gateway "
                        "and beside a GPU model, else torch's default, one per core of the machine, which in "
                        "a container is not its CPU share)")
    p.add_argument("--max-batch-size", type=int, default=16,
                   help="drafter/verifier: sessions served by one batched forward pass (1 = no batching)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="drafter/verifier: hold a pass up to this long for open sessions whose next message "
                        "has not arrived yet (0: only what queued during the last pass)")
    p.add_argument("--batch-wait-fraction", type=float, default=0.1,
                   help="drafter/verifier: ... or up to this fraction of the recent pass time where that is "
                        "longer (a session that misses a pass waits a whole one; 0: --batch-wait-ms only)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="verifier: while other sessions decode, feed a longer prompt in chunks of this many "
                        "tokens that share their passes (default 64; 0: one pass per prompt)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (env SPECDEC_TLS_CERT); serves TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key (env SPECDEC_TLS_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify peers (env SPECDEC_TLS_CA)")
    p.add_argument("--tls-client-auth", action="store_true", help="require client certificates signed by --tls-ca (mTLS)")
    p.add_argument("--tls-allowed-peers", action="append", default=[], metavar="NAMES",
                   help="with --tls-client-auth: take calls only from client certificates naming one of these "
                        "(comma-separated, repeatable; matched against the SANs and the CN; env "
                        "SPECDEC_TLS_ALLOWED_PEERS), e.g. the gateway's on drafters and verifiers")
    p.add_argument("--service-token-file", default=None,
                   help="drafter/verifier: take calls only with one of these tokens (one per line, for rotation) "
                        "in x-specdec-service-token; gateway: present the first to drafters and verifiers "
                        "(env SPECDEC_SERVICE_TOKEN_FILE, or the tokens in SPECDEC_SERVICE_TOKEN). "
                        "Without one, drafters and verifiers take calls from anyone who reaches them")
    p.add_argument("--health-port", type=int, default=os.environ.get("SPECDEC_HEALTH_PORT") or None,
                   help="also serve grpc.health.v1 alone on this plaintext port (Kubernetes' grpc probes "
                        "cannot speak TLS; env SPECDEC_HEALTH_PORT)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/gRPC collector for traces and metrics, e.g. http://localhost:4317 "
                        "(default $OTEL_EXPORTER_OTLP_ENDPOINT; telemetry is off when neither is set)")
    p.add_argument("--trace-detail", choices=["request", "round"], default=os.environ.get("SPECDEC_TRACE_DETAIL", "request"),
                   help="request: one span per request/stream, rounds as events; round: a span per round")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact distributed speculative decoding")
    parser.add_argument("--log-level", default=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in-process (--local) or through a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--local", action="store_true", help="run the models in this process")
    gen.add_argument("--gateway", default="localhost:50051", help="gateway address (default localhost:50051)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help="target model: hub id, local dir or 'embedded'")
    gen.add_argument("--draft-model", default=None, help="draft model: hub id or local dir")
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (gateway mode)")
    gen.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), help="gateway API key")
    add_model_flags(gen)
    gen.add_argument("--tls-ca", default=None, help="CA to verify the gateway (enables TLS)")
    gen.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    gen.add_argument("--tls-key", default=None, help="client key (mTLS)")
    _add_sampling_flags(gen)

    serve = sub.add_parser("serve", help="run one service")
    roles = serve.add_subparsers(dest="role", required=True)
    verifier = roles.add_parser("verifier")
    verifier.add_argument("--target", default=DEFAULT_TARGET)
    verifier.add_argument("--max-new-tokens-cap", type=int, default=2048,
                          help="the most tokens one session may generate, whatever its request asks (a larger "
                               "sampling.max_new_tokens is refused)")
    verifier.add_argument("--no-verify-ahead", action="store_true",
                          help="do not feed a session's pending token right after a plain round (by default it "
                               "is fed while the next block is on its way: a plain round then needs no pass)")
    _add_serve_flags(verifier, 50053)
    drafter = roles.add_parser("drafter")
    drafter.add_argument("--method", choices=["model", "ngram", "eagle", "replay"], default="model",
                         help="eagle: an EAGLE head over the target's streamed features (--draft-model: the head's "
                              "directory; --target: its target); replay: benchmarks only, recorded continuations at "
                              "a chosen acceptance (--replay-file)")
    drafter.add_argument("--draft-model", default=None,
                         help="hub id or local dir (default for --method model: the shipped draft of the embedded target)")
    drafter.add_argument("--target", default=DEFAULT_TARGET,
                         help="--method eagle: the target the head drafts for (its embedding and LM head rows)")
    drafter.add_argument("--replay-file", default=None,
                         help="--method replay: the JSON file specdec bench writes (recordings, acceptance, cost); "
                              "reread whenever it changes")
    _add_serve_flags(drafter, 50052)
    gateway = roles.add_parser("gateway")
    from specdec.up import optional_port
    gateway.add_argument("--target", default=DEFAULT_TARGET, help="model whose tokenizer and chat template to use")
    gateway.add_argument("--verifier", action="append", default=[], help="verifier address (repeatable)")
    gateway.add_argument("--drafter", action="append", default=[], help="drafter address (repeatable)")
    gateway.add_argument("--discover-verifiers", default=None, metavar="SERVICE",
                         help="in Kubernetes: watch this Service's EndpointSlices for verifier pods")
    gateway.add_argument("--discover-drafters", default=None, metavar="SERVICE")
    gateway.add_argument("--namespace", default=None, help="namespace to watch (default: the pod's own)")
    gateway.add_argument("--api-keys-file", default=None,
                         help="require one of these API keys (one per line; also env SPECDEC_API_KEYS)")
    gateway.add_argument("--max-prompt-tokens", type=int, default=4096)
    gateway.add_argument("--max-new-tokens-cap", type=int, default=2048)
    gateway.add_argument("--default-max-new-tokens", type=int, default=128)
    gateway.add_argument("--max-draft-tokens", type=int, default=16)
    gateway.add_argument("--verifier-wait", type=float, default=30.0,
                         help="seconds a request waits for a ready verifier (one restarting) before UNAVAILABLE")
    gateway.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                         help="drafters draft the next block while a verification is in flight "
                              "(requests may override with speculation.draft_ahead)")
    gateway.add_argument("--net-delay-ms", type=float, default=0.0,
                         help="inject this one-way delay on every message to drafters and verifiers "
                              "(benchmarks of cross-machine round trips; keep 0 in production)")
    gateway.add_argument("--http-port", type=optional_port, default=None,
                         help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                              "/v1/models, /health) on this port (off unless set; 'off' or 0: none)")
    from gateway.http_limits import add_http_limit_arguments
    add_http_limit_arguments(gateway)
    _add_serve_flags(gateway, 50051)

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
    from specdec.drafters import ModelDrafter, NgramDrafter
    from specdec.models import check_compatible, default_draft_model, load_model
    from specdec.prompts import encode_chat, encode_text
    from specdec.local import LocalEngine
    from specdec.sampling import SamplingParams

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
        with GatewayClient(args.gateway, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca,
                           tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
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


def _batching(args):
    from specdec.rpc.scheduler import BatchingOptions

    if args.max_batch_size < 1:
        raise SystemExit("--max-batch-size must be >= 1")
    if args.batch_wait_ms < 0:
        raise SystemExit("--batch-wait-ms must be >= 0")
    if not 0 <= args.batch_wait_fraction <= 1:
        raise SystemExit("--batch-wait-fraction must be in [0, 1]")
    chunking = {}
    if args.prefill_chunk_tokens is not None:
        if args.prefill_chunk_tokens < 0:
            raise SystemExit("--prefill-chunk-tokens must be >= 0")
        chunking["prefill_chunk_tokens"] = args.prefill_chunk_tokens
        # Chunks share passes only if they are not "long jobs" that run alone.
        chunking["max_row_tokens"] = max(BatchingOptions.max_row_tokens, args.prefill_chunk_tokens)
    return BatchingOptions(max_batch_size=args.max_batch_size, max_wait_s=args.batch_wait_ms / 1e3,
                           max_wait_fraction=args.batch_wait_fraction, **chunking)


def _sessions_per_peer(args) -> int | None:
    if args.max_sessions_per_peer is not None and args.max_sessions_per_peer < 1:
        raise SystemExit("--max-sessions-per-peer must be >= 1")
    if args.role == "verifier" and args.max_new_tokens_cap < 1:
        raise SystemExit("--max-new-tokens-cap must be >= 1")
    return args.max_sessions_per_peer


def service_threads(role: str, threads: int, device: str | None) -> int | None:
    """CPU threads for a service's torch operations; None leaves torch's default (one per core).

    ``--threads`` wins. Otherwise the gateway, and a drafter or verifier whose model runs on an
    accelerator, use one: their CPU work is per-token vectors, and a pool of one worker per core
    wakes its sleeping workers for every such operation after each wait (for the GPU, for the next
    request): on a small host that wake costs more than the operation (scripts/thread_wake_cost.py
    measures it; docs/sweeps/2026-12-03-batching-across-sessions.md, "On a GPU").
    """
    if threads > 0:
        return threads
    if role == "gateway":
        return 1
    import torch

    from specdec.models import default_device

    on_cpu = (torch.device(device) if device else default_device()).type == "cpu"
    return None if on_cpu else 1


def _serve(args) -> int:
    from specdec.rpc.server import ServeOptions

    from specdec.rpc.security import TLSConfig, load_api_keys, load_service_tokens, parse_allowed_peers

    tls = TLSConfig.from_sources(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    allowed_peers = parse_allowed_peers(args.tls_allowed_peers)
    if allowed_peers and not (tls.enabled and tls.client_auth):
        raise SystemExit("--tls-allowed-peers needs TLS with client certificates (--tls-cert/--tls-key/--tls-ca "
                         "and --tls-client-auth)")
    tokens = load_service_tokens(args.service_token_file)
    model_service = args.role in ("verifier", "drafter")
    options = ServeOptions(
        host=args.host, port=args.port, metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_bytes, grace_s=args.grace,
        tls=tls,
        api_keys=tuple(load_api_keys(args.api_keys_file)) if args.role == "gateway" else (),
        service_tokens=tuple(tokens) if model_service else (),
        allowed_peers=allowed_peers,
        outbound_service_token=tokens[0].decode() if tokens and not model_service else None,
        health_port=args.health_port,
    )
    if model_service and not tokens and not allowed_peers:
        logging.getLogger("specdec.security").warning(
            "%s: no service token (--service-token-file, SPECDEC_SERVICE_TOKEN) and no --tls-allowed-peers: "
            "anyone who reaches this port can call it. Set one in production (README, Security; "
            "specdec up sets one itself)", args.role)
    threads = service_threads(args.role, args.threads, args.device)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if args.role == "verifier":
        from verifier_service.server import serve

        coro = serve(args.target, options, max_sessions=args.max_sessions, device=args.device,
                     idle_timeout_s=args.idle_timeout, batching=_batching(args),
                     max_sessions_per_peer=_sessions_per_peer(args), max_new_tokens_cap=args.max_new_tokens_cap,
                     verify_ahead=not args.no_verify_ahead)
    elif args.role == "drafter":
        from drafter_service.server import serve

        coro = serve(args.method, args.draft_model, options, max_sessions=args.max_sessions, device=args.device,
                     idle_timeout_s=args.idle_timeout, batching=_batching(args),
                     max_sessions_per_peer=_sessions_per_peer(args), replay_file=args.replay_file,
                     target=args.target)
    else:
        from gateway.http_limits import http_limits_from_args
        from gateway.server import GatewayLimits, LinkOptions, serve

        http_limits = http_limits_from_args(args)
        limits = GatewayLimits(
            max_sessions=args.max_sessions,
            max_prompt_tokens=args.max_prompt_tokens,
            max_new_tokens=args.max_new_tokens_cap,
            default_max_new_tokens=args.default_max_new_tokens,
            max_draft_tokens=args.max_draft_tokens,
            verifier_wait_s=args.verifier_wait,
        )
        coro = serve(args.target, args.verifier, args.drafter, options, limits,
                     discover_verifiers=args.discover_verifiers, discover_drafters=args.discover_drafters,
                     namespace=args.namespace,
                     link_options=LinkOptions(draft_ahead=args.draft_ahead, net_delay_s=args.net_delay_ms / 1000),
                     http_port=args.http_port or None, http_limits=http_limits)
    from specdec import telemetry

    telemetry.setup(f"specdec-{args.role}", endpoint=args.otlp_endpoint, detail=args.trace_detail)
    try:
        asyncio.run(coro)
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
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
