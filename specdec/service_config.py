"""Each service's settings, built once from its flags and the environment.

``specdec serve verifier|drafter|gateway`` takes the flags ``add_role_parsers`` defines, and
``service_config(args, environ)`` turns them and the environment variables below into one frozen
``VerifierConfig``, ``DrafterConfig`` or ``GatewayConfig``, which the service's ``serve`` takes. A
flag wins over its variable. No other module reads these variables.

==============================  ============================  =========  ==========================================
variable                        flag                          default    meaning
==============================  ============================  =========  ==========================================
SPECDEC_HOST                    --host                        127.0.0.1  address the service listens on
SPECDEC_THREADS                 --threads                     0          torch's CPU threads (0: ``service_threads``)
SPECDEC_HEALTH_PORT             --health-port                 none       plaintext grpc.health.v1 port (probes)
SPECDEC_TRACE_DETAIL            --trace-detail                request    request: a span per request; round: per round
SPECDEC_TLS_CERT                --tls-cert                    none       PEM certificate: serve (and call) over TLS
SPECDEC_TLS_KEY                 --tls-key                     none       its PEM private key
SPECDEC_TLS_CA                  --tls-ca                      none       PEM CA bundle that verifies peers
SPECDEC_TLS_CLIENT_AUTH         --tls-client-auth             off        1 or true: require client certificates
SPECDEC_TLS_ALLOWED_PEERS       --tls-allowed-peers           any        client certificate names taken (a,b)
SPECDEC_SERVICE_TOKEN_FILE      --service-token-file          none       service tokens, one per line
SPECDEC_SERVICE_TOKEN           (none)                        none       more service tokens, comma-separated
SPECDEC_API_KEYS_FILE           --api-keys-file (gateway)     none       client API keys, one per line
SPECDEC_API_KEYS                (none)                        none       more client API keys, comma-separated
SPECDEC_LOG_LEVEL               --log-level (every command)   INFO       logging level
SPECDEC_API_KEY                 --api-key (specdec generate)  none       the key the client presents to a gateway
==============================  ============================  =========  ==========================================

Read elsewhere, each in one place: how a model runs (``SPECDEC_DTYPE``, ``SPECDEC_RUNTIME``,
``SPECDEC_STATIC_KV``, ...: ``specdec.pass_options``, whose flags become those variables so that
the services ``specdec up`` starts inherit them, and which the model loader reads), OpenTelemetry's
own ``OTEL_*`` variables (``specdec.telemetry.export``), the cache directory (``specdec.cache``),
a forced matmul backend (``specdec.lean.matmul``) and the gguf runtime's switches (``specdec.gguf``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.pass_options import add_model_flags
from specdec.suffix import SuffixConfig
from specdec.telemetry.export import DETAILS
from specdec.wire_types import MAX_NEW_TOKENS_CAP

if TYPE_CHECKING:  # the option types' modules import torch; the parser must not
    from gateway.generation import GatewayLimits, LinkOptions
    from gateway.http_limits import HttpLimits
    from specdec.rpc.scheduler import BatchingOptions
    from specdec.rpc.security import TLSConfig
    from specdec.rpc.server import ServeOptions

HOST_ENV = "SPECDEC_HOST"
THREADS_ENV = "SPECDEC_THREADS"
HEALTH_PORT_ENV = "SPECDEC_HEALTH_PORT"
TRACE_DETAIL_ENV = "SPECDEC_TRACE_DETAIL"
TLS_CERT_ENV = "SPECDEC_TLS_CERT"
TLS_KEY_ENV = "SPECDEC_TLS_KEY"
TLS_CA_ENV = "SPECDEC_TLS_CA"
TLS_CLIENT_AUTH_ENV = "SPECDEC_TLS_CLIENT_AUTH"
TLS_ALLOWED_PEERS_ENV = "SPECDEC_TLS_ALLOWED_PEERS"
SERVICE_TOKEN_FILE_ENV = "SPECDEC_SERVICE_TOKEN_FILE"
SERVICE_TOKEN_ENV = "SPECDEC_SERVICE_TOKEN"
API_KEYS_FILE_ENV = "SPECDEC_API_KEYS_FILE"
API_KEYS_ENV = "SPECDEC_API_KEYS"
LOG_LEVEL_ENV = "SPECDEC_LOG_LEVEL"
CLIENT_API_KEY_ENV = "SPECDEC_API_KEY"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_TARGET = "embedded"
ROLE_PORTS = {"gateway": 50051, "drafter": 50052, "verifier": 50053}

security_log = logging.getLogger("specdec.security")


@dataclass(frozen=True)
class ServiceConfig:
    """What every service takes: where and how it serves, its torch threads, its telemetry."""

    role: str
    serve: ServeOptions
    threads: int | None  # None: torch's default (one per core)
    otlp_endpoint: str | None  # None: $OTEL_EXPORTER_OTLP_ENDPOINT, else telemetry off
    trace_detail: str
    target: str


@dataclass(frozen=True)
class ModelServiceConfig(ServiceConfig):
    """A drafter's or a verifier's: a model on a device, sessions batched into passes."""

    device: str | None
    max_sessions: int
    max_sessions_per_peer: int | None
    idle_timeout_s: float
    batching: BatchingOptions


@dataclass(frozen=True)
class VerifierConfig(ModelServiceConfig):
    max_new_tokens_cap: int
    verify_ahead: bool


@dataclass(frozen=True)
class DrafterConfig(ModelServiceConfig):
    method: str
    draft_model: str | None
    replay_file: str | None
    suffix: SuffixConfig  # --method suffix


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    verifiers: tuple[str, ...]
    drafters: tuple[str, ...]
    discover_verifiers: str | None
    discover_drafters: str | None
    namespace: str | None
    limits: GatewayLimits
    link: LinkOptions
    http_port: int | None  # None: no HTTP front
    http_limits: HttpLimits
    suffix: SuffixConfig  # suffix drafting in the gateway


# -- flags -------------------------------------------------------------------------------------------

def optional_port(text: str) -> int:
    """A port flag that can be turned off: ``off`` (or 0) is 0, which means none."""
    if text.strip().lower() in ("off", "none", "0"):
        return 0
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', not {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port {port} is outside 1-65535")
    return port


def _add_serve_flags(p: argparse.ArgumentParser, role: str) -> None:
    """Every service's flags. Those with a variable default to None here: ``service_config`` reads
    the variable, so the parser reads no environment."""
    p.add_argument("--host", default=None, help=f"address to listen on (env {HOST_ENV}; default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=ROLE_PORTS[role])
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
    p.add_argument("--threads", type=int, default=None,
                   help=f"CPU threads for the model's operations (env {THREADS_ENV}; 0, the default: one for the "
                        "gateway and beside a GPU model, else torch's default, one per core of the machine, which "
                        "in a container is not its CPU share)")
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
    p.add_argument("--tls-cert", default=None, help=f"PEM certificate (env {TLS_CERT_ENV}); serves TLS")
    p.add_argument("--tls-key", default=None, help=f"PEM private key (env {TLS_KEY_ENV})")
    p.add_argument("--tls-ca", default=None, help=f"PEM CA bundle to verify peers (env {TLS_CA_ENV})")
    p.add_argument("--tls-client-auth", action="store_true",
                   help=f"require client certificates signed by --tls-ca (mTLS; env {TLS_CLIENT_AUTH_ENV}=1)")
    p.add_argument("--tls-allowed-peers", action="append", default=[], metavar="NAMES",
                   help="with --tls-client-auth: take calls only from client certificates naming one of these "
                        "(comma-separated, repeatable; matched against the SANs and the CN; env "
                        f"{TLS_ALLOWED_PEERS_ENV}), e.g. the gateway's on drafters and verifiers")
    p.add_argument("--service-token-file", default=None,
                   help="drafter/verifier: take calls only with one of these tokens (one per line, for rotation) "
                        "in x-specdec-service-token; gateway: present the first to drafters and verifiers "
                        f"(env {SERVICE_TOKEN_FILE_ENV}, or the tokens in {SERVICE_TOKEN_ENV}). "
                        "Without one, drafters and verifiers take calls from anyone who reaches them")
    p.add_argument("--health-port", type=int, default=None,
                   help="also serve grpc.health.v1 alone on this plaintext port (Kubernetes' grpc probes "
                        f"cannot speak TLS; env {HEALTH_PORT_ENV})")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/gRPC collector for traces and metrics, e.g. http://localhost:4317 "
                        "(default $OTEL_EXPORTER_OTLP_ENDPOINT; telemetry is off when neither is set)")
    p.add_argument("--trace-detail", choices=DETAILS, default=None,
                   help=f"request (default): one span per request/stream, rounds as events; round: a span per "
                        f"round (env {TRACE_DETAIL_ENV})")


def add_role_parsers(roles) -> None:
    """``specdec serve``'s three roles and their flags, on the subparsers action ``roles``."""
    verifier = roles.add_parser("verifier")
    verifier.add_argument("--target", default=DEFAULT_TARGET)
    verifier.add_argument("--max-new-tokens-cap", type=int, default=MAX_NEW_TOKENS_CAP,
                          help="the most tokens one session may generate, whatever its request asks (a larger "
                               "sampling.max_new_tokens is refused)")
    verifier.add_argument("--no-verify-ahead", action="store_true",
                          help="do not feed a session's pending token right after a plain round (by default it "
                               "is fed while the next block is on its way: a plain round then needs no pass)")
    _add_serve_flags(verifier, "verifier")
    drafter = roles.add_parser("drafter")
    drafter.add_argument("--method", choices=["model", "ngram", "eagle", "suffix", "replay"], default="model",
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
    add_suffix_arguments(drafter)
    _add_serve_flags(drafter, "drafter")
    gateway = roles.add_parser("gateway")
    from gateway.http_limits import add_http_limit_arguments

    gateway.add_argument("--target", default=DEFAULT_TARGET, help="model whose tokenizer and chat template to use")
    gateway.add_argument("--verifier", action="append", default=[], help="verifier address (repeatable)")
    gateway.add_argument("--drafter", action="append", default=[], help="drafter address (repeatable)")
    gateway.add_argument("--discover-verifiers", default=None, metavar="SERVICE",
                         help="in Kubernetes: watch this Service's EndpointSlices for verifier pods")
    gateway.add_argument("--discover-drafters", default=None, metavar="SERVICE")
    gateway.add_argument("--namespace", default=None, help="namespace to watch (default: the pod's own)")
    gateway.add_argument("--api-keys-file", default=None,
                         help=f"require one of these API keys (one per line; env {API_KEYS_FILE_ENV}; also the "
                              f"comma-separated keys in {API_KEYS_ENV})")
    gateway.add_argument("--max-prompt-tokens", type=int, default=4096)
    gateway.add_argument("--max-new-tokens-cap", type=int, default=MAX_NEW_TOKENS_CAP)
    gateway.add_argument("--default-max-new-tokens", type=int, default=128)
    gateway.add_argument("--max-draft-tokens", type=int, default=16)
    gateway.add_argument("--verifier-wait", type=float, default=30.0,
                         help="seconds a request waits for a ready verifier (one restarting) before UNAVAILABLE")
    gateway.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False,
                         help="drafters draft the next block while a verification is in flight "
                              "(requests may override with speculation.draft_ahead)")
    gateway.add_argument("--no-plain-runs", action="store_true",
                         help="ask the verifier for every plain round with a block of its own, instead of "
                              "letting it decode a run of them (what runs save, measured)")
    gateway.add_argument("--net-delay-ms", type=float, default=0.0,
                         help="inject this one-way delay on every message to drafters and verifiers "
                              "(benchmarks of cross-machine round trips; keep 0 in production)")
    gateway.add_argument("--http-port", type=optional_port, default=None,
                         help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                              "/v1/models, /health) on this port (off unless set; 'off' or 0: none)")
    add_http_limit_arguments(gateway)
    add_suffix_arguments(gateway)
    _add_serve_flags(gateway, "gateway")


def add_suffix_arguments(p: argparse.ArgumentParser) -> None:
    """Suffix drafting's flags (the gateway's own, or a drafter service's with --method suffix)."""
    defaults = SuffixConfig()
    p.add_argument("--suffix-cache-tokens", type=int, default=defaults.max_cached_tokens,
                   help="tokens of earlier outputs the suffix cache keeps over every tenant, least recently used "
                        "first out (0: drafts from the request's own text only)")
    p.add_argument("--suffix-min-token-prob", type=float, default=defaults.min_token_prob,
                   help="a suffix draft ends where its estimated probability of acceptance falls below this")
    p.add_argument("--suffix-spec-factor", type=float, default=defaults.spec_factor,
                   help="a suffix draft is at most this many tokens per token of the match it continues")


def suffix_config(args: argparse.Namespace) -> SuffixConfig:
    try:
        return SuffixConfig(max_cached_tokens=args.suffix_cache_tokens, min_token_prob=args.suffix_min_token_prob,
                            spec_factor=args.suffix_spec_factor)
    except ValueError as exc:
        raise SystemExit(f"--suffix-*: {exc}") from None


# -- from flags and environment ----------------------------------------------------------------------

def _whole_number(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"${name} must be a whole number, not {value!r}") from None


def tls_config(environ: Mapping[str, str], cert: str | None = None, key: str | None = None, ca: str | None = None,
               client_auth: bool = False) -> TLSConfig:
    """TLS from the flags' paths, each falling back to its variable."""
    from specdec.rpc.security import TLSConfig

    return TLSConfig.from_sources(cert or environ.get(TLS_CERT_ENV), key or environ.get(TLS_KEY_ENV),
                                  ca or environ.get(TLS_CA_ENV),
                                  client_auth or environ.get(TLS_CLIENT_AUTH_ENV, "") in ("1", "true"))


def allowed_peers(environ: Mapping[str, str], flags: list[str] | None = None) -> tuple[str, ...]:
    """``--tls-allowed-peers`` (repeatable, comma-separated) or, when none is given, the variable."""
    from specdec.rpc.security import parse_allowed_peers

    return parse_allowed_peers(list(flags or []) or [environ.get(TLS_ALLOWED_PEERS_ENV, "")])


def service_tokens(environ: Mapping[str, str], path: str | None = None) -> list[bytes]:
    """The flag's token file (else the variable's), then the comma-separated tokens."""
    from specdec.rpc.security import load_service_tokens

    return load_service_tokens(path or environ.get(SERVICE_TOKEN_FILE_ENV), environ.get(SERVICE_TOKEN_ENV, ""))


def api_keys(environ: Mapping[str, str], path: str | None = None) -> list[bytes]:
    """The flag's key file (else the variable's), then the comma-separated keys."""
    from specdec.rpc.security import load_api_keys

    return load_api_keys(path or environ.get(API_KEYS_FILE_ENV), environ.get(API_KEYS_ENV, ""))


def serve_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeOptions:
    """Where and how a service serves, and whom it admits; SystemExit naming what is wrong."""
    from specdec.rpc.server import ServeOptions

    tls = tls_config(environ, args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    peers = allowed_peers(environ, args.tls_allowed_peers)
    if peers and not (tls.enabled and tls.client_auth):
        raise SystemExit("--tls-allowed-peers needs TLS with client certificates (--tls-cert/--tls-key/--tls-ca "
                         "and --tls-client-auth)")
    tokens = service_tokens(environ, args.service_token_file)
    model_service = args.role in ("verifier", "drafter")
    if model_service and not tokens and not peers:
        security_log.warning("%s: no service token (--service-token-file, %s) and no --tls-allowed-peers: anyone who "
                    "reaches this port can call it. Set one in production (README, Security; specdec up sets "
                    "one itself)", args.role, SERVICE_TOKEN_ENV)
    health_port = args.health_port if args.health_port is not None else _whole_number(environ, HEALTH_PORT_ENV)
    return ServeOptions(
        host=args.host or environ.get(HOST_ENV) or DEFAULT_HOST, port=args.port, metrics_port=args.metrics_port,
        max_message_bytes=args.max_message_bytes, grace_s=args.grace, tls=tls,
        api_keys=tuple(api_keys(environ, args.api_keys_file)) if args.role == "gateway" else (),
        service_tokens=tuple(tokens) if model_service else (),
        allowed_peers=peers,
        outbound_service_token=tokens[0].decode() if tokens and not model_service else None,
        health_port=health_port,
    )


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


def _batching(args: argparse.Namespace) -> BatchingOptions:
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


def _model_service_fields(args: argparse.Namespace) -> dict:
    if args.max_sessions_per_peer is not None and args.max_sessions_per_peer < 1:
        raise SystemExit("--max-sessions-per-peer must be >= 1")
    return dict(device=args.device, max_sessions=args.max_sessions, max_sessions_per_peer=args.max_sessions_per_peer,
                idle_timeout_s=args.idle_timeout, batching=_batching(args))


def _gateway_fields(args: argparse.Namespace) -> dict:
    from gateway.generation import GatewayLimits, LinkOptions
    from gateway.http_limits import http_limits_from_args

    limits = GatewayLimits(max_sessions=args.max_sessions, max_prompt_tokens=args.max_prompt_tokens,
                           max_new_tokens=args.max_new_tokens_cap, default_max_new_tokens=args.default_max_new_tokens,
                           max_draft_tokens=args.max_draft_tokens, verifier_wait_s=args.verifier_wait)
    return dict(verifiers=tuple(args.verifier), drafters=tuple(args.drafter),
                discover_verifiers=args.discover_verifiers, discover_drafters=args.discover_drafters,
                namespace=args.namespace, limits=limits,
                link=LinkOptions(draft_ahead=args.draft_ahead, net_delay_s=args.net_delay_ms / 1000,
                                 plain_runs=not args.no_plain_runs),
                http_port=args.http_port or None, http_limits=http_limits_from_args(args), suffix=suffix_config(args))


def log_level(flag: str | None, environ: Mapping[str, str]) -> str:
    """Every command's logging level: ``--log-level``, else the variable, else INFO."""
    return (flag or environ.get(LOG_LEVEL_ENV) or DEFAULT_LOG_LEVEL).upper()


def client_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key ``specdec generate`` presents to a gateway: ``--api-key``, else the variable."""
    return flag or environ.get(CLIENT_API_KEY_ENV) or None


def service_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServiceConfig:
    """The config of ``args.role`` from ``specdec serve``'s parsed flags and ``environ``; SystemExit
    naming the flag or variable that is wrong."""
    threads = args.threads if args.threads is not None else _whole_number(environ, THREADS_ENV) or 0
    detail = args.trace_detail or environ.get(TRACE_DETAIL_ENV, "").strip() or DETAILS[0]
    if detail not in DETAILS:
        raise SystemExit(f"${TRACE_DETAIL_ENV} must be one of {', '.join(DETAILS)}, not {detail!r}")
    common = dict(role=args.role, serve=serve_options(args, environ),
                  threads=service_threads(args.role, threads, args.device), otlp_endpoint=args.otlp_endpoint,
                  trace_detail=detail, target=args.target)
    if args.role == "verifier":
        if args.max_new_tokens_cap < 1:
            raise SystemExit("--max-new-tokens-cap must be >= 1")
        return VerifierConfig(**common, **_model_service_fields(args), max_new_tokens_cap=args.max_new_tokens_cap,
                              verify_ahead=not args.no_verify_ahead)
    if args.role == "drafter":
        return DrafterConfig(**common, **_model_service_fields(args), method=args.method,
                             draft_model=args.draft_model, replay_file=args.replay_file, suffix=suffix_config(args))
    if not args.verifier and not args.discover_verifiers:
        raise SystemExit("the gateway needs --verifier addresses or --discover-verifiers SERVICE")
    return GatewayConfig(**common, **_gateway_fields(args))
