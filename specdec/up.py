"""``specdec up``: drafter, verifier and gateway on one machine, supervised (``specdec.supervisor``).

The gateway listens on ``--port``, the drafter on ``--drafter-port`` (default +1), the verifier on
``--verifier-port`` (default +2); metrics, when asked for, on ``--metrics-port`` +0/+1/+2 in the same
order. The gateway's OpenAI-compatible HTTP API listens on ``--http-port``: 8000 unless that is taken
(then off, with a note), ``off`` for none. Flags that the services take one by one (keys, TLS,
limits, timeouts) are passed to the child that uses them.

The stack is closed by default: each run draws a random service token and hands it to the three
children in their environment (``SPECDEC_SERVICE_TOKEN``; never on a command line, which other
users can read), so that the drafter and the verifier take calls from this gateway only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import threading

from specdec.service_config import SERVICE_TOKEN_ENV, SERVICE_TOKEN_FILE_ENV, optional_port, service_tokens, tls_config
from specdec.supervisor import ChildSpec, Supervisor

LOG_PREFIX = "[up      ]"
DEFAULT_HTTP_PORT = 8000  # where OpenAI-compatible servers usually listen
DRAIN_MARGIN_S = 5.0  # the supervisor waits this long past the services' --grace before it kills one


def add_arguments(up: argparse.ArgumentParser, default_target: str) -> None:
    up.add_argument("--target", default=default_target)
    up.add_argument("--draft-model", default=None,
                    help="draft model (default: the shipped draft for the embedded target, else n-gram lookup)")
    up.add_argument("--draft-method", choices=["auto", "model", "eagle", "ngram", "suffix", "replay"], default="auto",
                    help="the drafter service's method. auto: model if there is a draft model, else ngram (never "
                         "replay, which is for benchmarks); eagle: --draft-model is an EAGLE head directory for "
                         "--target; suffix: a suffix drafter service (the gateway drafts suffix itself anyway: "
                         "docs/suffix.md)")
    up.add_argument("--replay-file", default=None,
                    help="--draft-method replay: the file specdec bench writes (recordings, acceptance, cost)")
    up.add_argument("--draft-ahead", action=argparse.BooleanOptionalAction, default=False)
    up.add_argument("--net-delay-ms", type=float, default=0.0, help="gateway: injected one-way delay per message")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051,
                    help="gateway port; the drafter's and the verifier's default to +1 and +2")
    up.add_argument("--drafter-port", type=int, default=None, help="the drafter's port (default --port + 1)")
    up.add_argument("--verifier-port", type=int, default=None, help="the verifier's port (default --port + 2)")
    up.add_argument("--http-port", type=optional_port, default=None,
                    help=f"the gateway's OpenAI-compatible HTTP API (default {DEFAULT_HTTP_PORT} when free, "
                         "else off; 'off' or 0: none)")
    up.add_argument("--metrics-port", type=int, default=None,
                    help="Prometheus ports: gateway on this one, drafter +1, verifier +2 (off when unset)")
    up.add_argument("--drafter-nice", type=int, default=19,
                    help="niceness added to the drafter process: on one machine the verifier is the shared "
                         "bottleneck, so where the two compete for cores (the drafter's prefill beside the "
                         "verifier's, shadow probes beside its passes) the verifier goes first; the drafter "
                         "still has the cores whenever the verifier waits for it (0: equal)")
    up.add_argument("--drafter-sched", choices=["idle", "normal"], default="normal",
                    help="Linux scheduling class of the drafter: idle (SCHED_IDLE) never preempts the "
                         "verifier when it wakes, but under full load a drafter in it waits seconds for a "
                         "core; measured no better than niceness +19 on the whole (docs/benchmarks.md)")
    up.add_argument("--drafter-device", default=None,
                    help="the drafter's device (default: as the verifier's, cuda if present). With both on one "
                         "GPU, 'cpu' keeps a small draft's launch-bound passes out of the verifier's way")
    up.add_argument("--emulate-machines", action="store_true",
                    help="two machines on one: the verifier on the first half of this process's cores, the drafter "
                         "and the gateway on the others (CPU affinity; the verifier's threads set to its cores). "
                         "Memory bandwidth and caches stay shared. With --net-delay-ms for the links' latency")
    up.add_argument("--drafter-threads", type=int, default=1,
                    help="CPU threads of the drafter: on one machine its spinning worker threads take cores "
                         "from the verifier's forward passes (0: torch's default, one per core)")
    up.add_argument("--max-sessions", type=int, default=None, help="each service's session limit")
    up.add_argument("--idle-timeout", type=float, default=None,
                    help="drafter and verifier: free a session whose stream is silent this long (seconds; "
                         "default: theirs)")
    up.add_argument("--grace", type=float, default=None,
                    help="seconds each service gives in-flight streams on shutdown (default: theirs); the "
                         f"supervisor kills one still running {DRAIN_MARGIN_S:g} s later")
    up.add_argument("--max-new-tokens-cap", type=int, default=None, help="gateway: largest max_new_tokens")
    up.add_argument("--no-verify-ahead", action="store_true",
                    help="verifier: do not feed a session's pending token right after a plain round")
    up.add_argument("--no-plain-runs", action="store_true",
                    help="gateway: a block for every plain round (no runs the verifier decodes on its own)")
    up.add_argument("--max-prompt-tokens", type=int, default=None, help="gateway: longest prompt")
    up.add_argument("--api-keys-file", default=None, help="gateway: client API keys, one per line")
    up.add_argument("--tls-cert", default=None, help="PEM certificate every service serves (and presents)")
    up.add_argument("--tls-key", default=None)
    up.add_argument("--tls-ca", default=None, help="CA bundle that verifies peers")
    up.add_argument("--tls-client-auth", action="store_true", help="require client certificates (mTLS)")
    up.add_argument("--service-token-file", default=None,
                    help="the token the gateway presents to drafter and verifier (default: a random one per run, "
                         "which nothing outside the stack knows)")


def default_http_port(host: str) -> int:
    """``DEFAULT_HTTP_PORT`` if it is free on ``host``, else 0 (off): a second stack on one machine,
    or anything else on 8000, must not keep the gateway from starting."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway will bind it
            probe.bind((host, DEFAULT_HTTP_PORT))
    except OSError:
        return 0
    return DEFAULT_HTTP_PORT


def deprioritise(nice: int, idle: bool):
    """Lower a child below the other services, every thread of it: ``nice`` added to its niceness
    and, with ``idle``, the SCHED_IDLE class (Linux). Both are per thread, and threads started
    later inherit them from the thread that starts them.

    ``specdec up`` applies it once the drafter serves, not at its start: at niceness +19 beside a
    busy verifier a (re)starting drafter gets ~1.5 % of a core, and its imports and model load
    took over a minute instead of seconds."""

    def apply(pid: int) -> None:
        use_idle = idle
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            threads = [pid]
        for tid in threads:
            try:
                if nice:
                    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
                if use_idle and hasattr(os, "SCHED_IDLE"):
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            except PermissionError as exc:  # SCHED_IDLE not permitted here: niceness alone
                print(f"{LOG_PREFIX} drafter stays in the normal scheduling class ({exc})", file=sys.stderr)
                use_idle = False

    return apply


def machine_partition(cpus: set[int] | frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
    """``--emulate-machines``: (the verifier's cores, the drafter's and gateway's), the first half of
    ``cpus`` (rounded up) and the rest. Needs two cores at least."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        raise SystemExit(f"error: --emulate-machines needs two cores or more (this process may use {len(ordered)})")
    half = (len(ordered) + 1) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def _flags(args, names: list[str]) -> list[str]:
    """``--name value`` for each of ``names`` set on ``args`` (booleans: ``--name`` when true)."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name.replace("-", "_"), None)
        if value is None or value is False:
            continue
        out += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return out


def service_ports(args) -> tuple[int, int, int]:
    """(gateway, drafter, verifier) ports: ``--drafter-port``/``--verifier-port``, else ``--port`` +1/+2.
    Raises SystemExit when two of them, or one and ``--http-port``, are the same port."""
    ports = {"--port": args.port,
             "--drafter-port": args.port + 1 if args.drafter_port is None else args.drafter_port,
             "--verifier-port": args.port + 2 if args.verifier_port is None else args.verifier_port}
    if getattr(args, "http_port", None):
        ports["--http-port"] = args.http_port
    for flag, port in ports.items():
        if not 0 < port < 65536:
            raise SystemExit(f"error: {flag} {port} is outside 1-65535")
        clash = [other for other, taken in ports.items() if taken == port and other != flag]
        if clash:
            raise SystemExit(f"error: {flag} and {clash[0]} are both port {port}")
    return ports["--port"], ports["--drafter-port"], ports["--verifier-port"]


def service_token_env(args) -> dict[str, str]:
    """The children's environment for the service token: ``--service-token-file`` when given, else a
    fresh random token (and no inherited token file, so the three agree on exactly this one)."""
    path = getattr(args, "service_token_file", None)
    if path:
        service_tokens({}, path)  # a bad file stops here, not in three children restarting forever
        return {SERVICE_TOKEN_FILE_ENV: os.path.abspath(path), SERVICE_TOKEN_ENV: ""}
    return {SERVICE_TOKEN_ENV: secrets.token_urlsafe(32), SERVICE_TOKEN_FILE_ENV: ""}


def children(args) -> list[ChildSpec]:
    """The three services' commands (raises SystemExit for a draft method that cannot run)."""
    from specdec.models import EMBEDDED_EAGLE, default_draft_model, default_eagle_head, requested_runtime

    host = args.host
    gateway_port, drafter_port, verifier_port = service_ports(args)
    base = [sys.executable, "-m", "specdec.cli", "serve"]
    tls = _flags(args, ["tls-cert", "tls-key", "tls-ca", "tls-client-auth"])
    common = tls + _flags(args, ["max-sessions", "grace"])
    model_service = _flags(args, ["idle-timeout"])  # the drafter's and the verifier's alone

    def metrics(offset: int) -> list[str]:
        return [] if args.metrics_port is None else ["--metrics-port", str(args.metrics_port + offset)]

    draft_model = args.draft_model or default_draft_model(args.target)
    method = args.draft_method if args.draft_method != "auto" else ("model" if draft_model else "ngram")
    if method == "model" and not draft_model:
        raise SystemExit("error: --draft-method model needs --draft-model (no shipped draft for this target)")
    eagle_head = args.draft_model or default_eagle_head(args.target)
    if method == "eagle" and not eagle_head:
        raise SystemExit("error: --draft-method eagle needs --draft-model: an EAGLE head directory "
                         "(only the embedded target has a shipped one)")
    if method == "replay" and not getattr(args, "replay_file", None):
        raise SystemExit("error: --draft-method replay needs --replay-file")
    # --draft-model: the draft; for eagle the head (over --target's embedding); else only the vocabulary.
    if method == "model":
        drafter_model = draft_model
    elif method == "eagle":
        drafter_model = eagle_head if eagle_head == EMBEDDED_EAGLE else os.path.abspath(eagle_head)
    else:
        drafter_model = args.target
    drafter_cmd = base + ["drafter", "--host", host, "--port", str(drafter_port), "--threads",
                          str(args.drafter_threads), "--method", method,
                          "--draft-model", drafter_model, "--target", args.target]
    if method == "replay":
        drafter_cmd += ["--replay-file", os.path.abspath(args.replay_file)]
    if args.drafter_device:
        drafter_cmd += ["--device", args.drafter_device]
    # A TLS stack's gateway names its peers by host name so that certificates verify; loopback here.
    peer_host = "localhost" if args.tls_cert else host
    env = service_token_env(args)  # one token for the three (and the same after a restart)
    verifier_cpus = drafter_cpus = None
    verifier_threads: list[str] = []
    if getattr(args, "emulate_machines", False):
        verifier_cpus, drafter_cpus = machine_partition(os.sched_getaffinity(0))
        verifier_threads = ["--threads", str(len(verifier_cpus))]
    # An EAGLE head reads the target's features, which the gguf runtime does not give: its verifier runs
    # a torch runtime unless one was named.
    verifier_runtime = ["--runtime", "torch"] if method == "eagle" and requested_runtime(None) == "auto" else []
    return [
        ChildSpec("verifier", base + ["verifier", "--target", args.target, "--host", host, "--port",
                                      str(verifier_port), *verifier_threads, *verifier_runtime, *common,
                                      *model_service, *metrics(2),
                                      *_flags(args, ["max-new-tokens-cap", "no-verify-ahead"])],
                  f"{peer_host}:{verifier_port}", drain_order=1, env=env, cpus=verifier_cpus),
        ChildSpec("drafter", drafter_cmd + common + model_service + metrics(1), f"{peer_host}:{drafter_port}",
                  drain_order=1, after_ready=deprioritise(args.drafter_nice, idle=args.drafter_sched == "idle"),
                  env=env, cpus=drafter_cpus),
        ChildSpec("gateway", base + ["gateway", "--target", args.target, "--host", host, "--port", str(gateway_port),
                                     "--verifier", f"{peer_host}:{verifier_port}",
                                     "--drafter", f"{peer_host}:{drafter_port}",
                                     "--draft-ahead" if args.draft_ahead else "--no-draft-ahead",
                                     "--net-delay-ms", str(args.net_delay_ms), *common, *metrics(0),
                                     *_flags(args, ["http-port"]),
                                     *_flags(args, ["max-new-tokens-cap", "max-prompt-tokens", "api-keys-file", "no-plain-runs"])],
                  f"{peer_host}:{gateway_port}", drain_order=0, env=env, cpus=drafter_cpus),
    ]


def _health_credentials(args):
    """Channel credentials for the health checks of a TLS stack (None: plaintext)."""
    if not args.tls_cert:
        return None
    return tls_config(os.environ, args.tls_cert, args.tls_key, args.tls_ca).channel_credentials()


def _announce_ready(supervisor: Supervisor, specs: list[ChildSpec]) -> None:
    """Log once every service answers SERVING on grpc.health.v1 (what LocalStack waits for too)."""
    from specdec.stack import wait_serving

    try:
        for spec in specs:
            wait_serving(spec.address, timeout=900, stop=supervisor.stop, credentials=supervisor.credentials)
    except RuntimeError:
        return
    if not supervisor.stop.is_set():
        supervisor.log("all three services ready")


def run(args) -> int:
    """Start the three services supervised; Ctrl-C (or SIGTERM) drains them and returns."""
    from specdec.models import ModelLoadError, resolve_model_path

    try:
        resolve_model_path(args.target)  # convert the embedded model once, before three processes race
    except ModelLoadError as exc:  # e.g. a synthetic:... name that does not parse
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.http_port is None:
        args.http_port = default_http_port(args.host)
        if not args.http_port:
            print(f"{LOG_PREFIX} port {DEFAULT_HTTP_PORT} is taken: no HTTP API (--http-port to choose one)",
                  file=sys.stderr, flush=True)
    specs = children(args)
    drain = {} if args.grace is None else {"grace_s": args.grace + DRAIN_MARGIN_S}
    supervisor = Supervisor(specs, log=lambda line: print(f"{LOG_PREFIX} {line}", file=sys.stderr, flush=True),
                            credentials=_health_credentials(args), **drain)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop.set())
    # Also when started in the background, where the shell leaves SIGINT ignored.
    signal.signal(signal.SIGINT, lambda *_: supervisor.stop.set())
    supervisor.start_all()
    scheme = "https" if args.tls_cert else "http"
    http_note = f", OpenAI-compatible HTTP API on {scheme}://{args.host}:{args.http_port}/v1" if args.http_port else ""
    print(f"{LOG_PREFIX} gateway will listen on {args.host}:{args.port}{http_note}", flush=True)
    cores = {spec.name: spec.cpus for spec in specs}
    if cores["verifier"]:  # --emulate-machines: the partition children() gave the services
        print(f"{LOG_PREFIX} two machines on one: verifier on cores {sorted(cores['verifier'])}, drafter and gateway "
              f"on {sorted(cores['drafter'])} (memory bandwidth and caches still shared)", flush=True)
    threading.Thread(target=_announce_ready, args=(supervisor, specs), daemon=True).start()
    try:
        supervisor.run()
    except KeyboardInterrupt:
        pass
    codes = supervisor.shutdown()
    restarts = supervisor.restarts()
    if any(restarts.values()):
        supervisor.log("restarts: " + ", ".join(f"{name} {n}" for name, n in restarts.items()))
    failed = {name: code for name, code in codes.items() if code not in (0, -signal.SIGTERM, None)}
    return 1 if failed else 0
