"""``specdec up``'s process manager: three services as child processes, each restarted when it dies.

Like a process manager (systemd's ``Restart=always``, supervisord): a child that exits while the
stack is up is started again after a backoff that doubles with each quick death (1 s, 2 s, 4 s ...
up to ``max_backoff_s``; a child that stayed up ``healthy_after_s`` starts over at 1 s), logged and
counted, while the others keep serving. A gateway whose verifier or drafter restarts reconnects to
the same address (gRPC channels reconnect by themselves); a request in flight on a dead drafter
goes on without drafts, one on a dead verifier ends UNAVAILABLE.

SIGINT/SIGTERM drains in dependency order: the gateway first (it stops taking requests and lets
its streams finish, which still need the model services), then the drafter and verifier.

Children die with their supervisor: each starts through ``specdec.child_init``, which arms the
parent-death signal (SIGTERM) and sets the child's CPU affinity before it execs the service, so a
supervisor killed by SIGKILL (which drains nothing) leaves no service behind holding its port.
The kernel signals a child when the thread that started it ends: ``start_all`` and ``run`` (which
restarts children) belong on the thread that lives as long as the supervisor, as in ``specdec up``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.child_init import child_command

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 10.0
HEALTHY_AFTER_S = 30.0  # a child that lived this long restarts after FIRST_BACKOFF_S again
POLL_S = 0.2


@dataclass
class ChildSpec:
    """One service: its command, its gRPC address (for readiness) and what to do once started."""

    name: str
    command: list[str]
    address: str
    drain_order: int  # lower drains first
    after_ready: Callable[[int], None] | None = None  # once it serves (health SERVING), by pid
    env: dict[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None  # the cores it may run on (None: all), from before its first instruction


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float | None = None  # when a dead child is due to start again


class Supervisor:
    """Starts, watches and restarts ``children``; ``run`` blocks until ``stop`` is set."""

    def __init__(self, children: list[ChildSpec], *, log: Callable[[str], None] | None = None,
                 max_backoff_s: float = MAX_BACKOFF_S, healthy_after_s: float = HEALTHY_AFTER_S,
                 grace_s: float = 35.0, credentials=None) -> None:
        self.children = {spec.name: _Child(spec) for spec in children}
        self.log = log or (lambda line: print(f"[up      ] {line}", file=sys.stderr, flush=True))
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.grace_s = grace_s
        self.stop = threading.Event()
        self.credentials = credentials  # grpc channel credentials for health checks of TLS services

    # -- lifecycle ---------------------------------------------------------------------------

    def start_all(self) -> None:
        for child in self.children.values():
            self._spawn(child)

    def _spawn(self, child: _Child) -> None:
        spec = child.spec
        env = {**os.environ, **spec.env} if spec.env else None
        child.proc = subprocess.Popen(child_command(spec.command, os.getpid(), spec.cpus), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
        child.started_at = time.monotonic()
        child.restart_at = None
        if spec.after_ready is not None and spec.address:
            threading.Thread(target=self._when_ready, args=(spec, child.proc), daemon=True).start()
        threading.Thread(target=_pump, args=(f"[{spec.name:8}]", child.proc.stdout), daemon=True).start()

    def _when_ready(self, spec: ChildSpec, proc: subprocess.Popen) -> None:
        from specdec.stack import wait_serving

        try:
            wait_serving(spec.address, proc, timeout=900, stop=self.stop, credentials=self.credentials)
        except RuntimeError:
            return  # exited or stopped first
        spec.after_ready(proc.pid)

    def poll_once(self) -> None:
        """Notice children that exited and restart those whose backoff is over."""
        now = time.monotonic()
        for child in self.children.values():
            proc = child.proc
            if child.restart_at is None and proc is not None and proc.poll() is not None:
                lived = now - child.started_at
                if lived >= self.healthy_after_s:
                    child.backoff_s = FIRST_BACKOFF_S
                child.restart_at = now + child.backoff_s
                self.log(f"{child.spec.name} exited (code {proc.returncode}) after {lived:.1f} s; "
                         f"restart #{child.restarts + 1} in {child.backoff_s:.1f} s")
                child.backoff_s = min(self.max_backoff_s, 2 * child.backoff_s)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)
                self.log(f"{child.spec.name} restarted (pid {child.proc.pid}; {child.restarts} restart(s) so far)")

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll_once()
            self.stop.wait(POLL_S)

    def shutdown(self) -> dict[str, int | None]:
        """Drain in ``drain_order`` (SIGTERM, wait up to ``grace_s``, then SIGKILL); exit codes."""
        for order in sorted({c.spec.drain_order for c in self.children.values()}):
            group = [c for c in self.children.values() if c.spec.drain_order == order and c.proc is not None]
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.log(f"{child.spec.name} did not stop within {self.grace_s:.0f} s; killing it")
                    child.proc.kill()
                    child.proc.wait()
        return {name: (c.proc.returncode if c.proc else None) for name, c in self.children.items()}

    # -- status ------------------------------------------------------------------------------

    def restarts(self) -> dict[str, int]:
        return {name: child.restarts for name, child in self.children.items()}

    def pids(self) -> dict[str, int | None]:
        return {name: (c.proc.pid if c.proc and c.proc.poll() is None else None) for name, c in self.children.items()}


def _pump(prefix: str, stream) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()
