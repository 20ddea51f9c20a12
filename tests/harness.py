"""Start specdec services as real subprocesses on loopback and wait until they serve."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(address: str, service: str = "", timeout: float = 1.0) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
    except grpc.RpcError:
        return None


@dataclass
class Service:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    metrics_port: int | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if health_status(self.address) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING after {timeout}s:\n{self.log()}")

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Until its health service answers at all (SERVING or not: a gateway with no ready verifier)."""
        deadline = time.monotonic() + timeout
        while health_status(self.address) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not listening after {timeout}s:\n{self.log()}")
            time.sleep(0.2)

    def stop(self, timeout: float = 40.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_service(role: str, args: list[str], log_dir: Path, name: str | None = None,
                  metrics: bool = False, env: dict | None = None, port: int | None = None) -> Service:
    port = port or free_port()
    metrics_port = free_port() if metrics else None
    name = name or role
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "specdec.cli", "--log-level", "INFO", "serve", role,
           "--host", "127.0.0.1", "--port", str(port), "--grace", "10", *args]
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=full_env)
    return Service(name, f"127.0.0.1:{port}", proc, log_path, metrics_port)


@dataclass
class Stack:
    gateway: Service
    verifiers: list[Service]
    drafters: list[Service] = field(default_factory=list)

    @property
    def all(self) -> list[Service]:
        return [self.gateway, *self.verifiers, *self.drafters]

    def stop(self) -> None:
        for service in self.all:
            service.stop()

    def wait_gateway_sees_every_verifier(self, timeout: float = 120.0) -> None:
        """Until the gateway has found each verifier ready (its log says so once per replica): it
        serves as soon as one is, and polls the others. The timeout is a hang guard."""
        deadline = time.monotonic() + timeout
        while not all(f"verifier {v.address} ready" in self.gateway.log() for v in self.verifiers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway did not see every verifier ready:\n{self.gateway.log()}")
            time.sleep(0.05)


def start_stack(target: Path | str, draft: Path | str | None, log_dir: Path, *, verifiers: int = 1,
                gateway_args: list[str] = (), verifier_args: list[str] = (), drafter_args: list[str] = (),
                metrics: bool = False, drafter_method: str = "model",
                env: dict | None = None) -> Stack:
    """A verifier (or several), a drafter of ``drafter_method`` (if ``draft``: the draft model, or
    for eagle the head's directory) and a gateway over them; ``env`` is added to every service's environment."""
    vs = [start_service("verifier", ["--target", str(target), *verifier_args], log_dir, name=f"verifier{i}",
                        metrics=metrics, env=env)
          for i in range(verifiers)]
    ds = []
    if draft is not None:
        method_args = ["--method", drafter_method, "--draft-model", str(draft)]
        if drafter_method == "eagle":
            method_args += ["--target", str(target)]
        ds.append(start_service("drafter", [*method_args, *drafter_args], log_dir, metrics=metrics, env=env))
    gw_args = ["--target", str(target), *gateway_args]
    for v in vs:
        gw_args += ["--verifier", v.address]
    for d in ds:
        gw_args += ["--drafter", d.address]
    gw = start_service("gateway", gw_args, log_dir, metrics=metrics, env=env)
    stack = Stack(gw, vs, ds)
    try:
        for service in stack.all:
            service.wait_serving()
    except Exception:
        stack.stop()
        raise
    return stack


def metrics_text(service: "Service") -> str:
    """A service's Prometheus /metrics page."""
    return urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10).read().decode()


def scrape_metric(service: "Service", series: str) -> float:
    """The value of one Prometheus series (name with its labels) on a service's /metrics."""
    match = re.search(rf"^{re.escape(series)} ([0-9.e+-]+)$", metrics_text(service), re.MULTILINE)
    assert match, series
    return float(match.group(1))
