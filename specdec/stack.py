"""A local drafter + verifier + gateway stack as one child process (``specdec up``), for the demo and
``specdec bench --up``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port_block(size: int = 4) -> int:
    """A port p with p .. p+size-1 all free on loopback (``LocalStack``: gateway, +1 drafter, +2
    verifier, +3 the gateway's HTTP API)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + size - 1 < 65535:
            try:
                for p in range(port + 1, port + size):
                    with socket.socket() as t:
                        t.bind(("127.0.0.1", p))
                return port
            except OSError:
                continue
    raise RuntimeError("no free ports")


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 600, stop=None,
                 credentials=None) -> None:
    """Poll grpc.health.v1 on ``address`` until SERVING (or ``proc`` exits, ``stop`` is set, or
    ``timeout``). ``credentials``: grpc channel credentials for a TLS service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # Reconnect quickly: a service that is restarting refuses connections for a while, and grpc's
    # default backoff (up to 120 s) would see it come back long after it did.
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 500)]
    channel = grpc.secure_channel(address, credentials, options) if credentials else \
        grpc.insecure_channel(address, options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the stack exited early (code {proc.returncode})")
            if stop is not None and stop.is_set():
                raise RuntimeError("stopped while waiting")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{address} did not become ready within {timeout:.0f} s")


class LocalStack:
    """``with LocalStack(["--net-delay-ms", "5"]) as address: ...``: ``specdec up`` on free ports, entered
    once the gateway, the drafter and the verifier all answer SERVING. The gateway's OpenAI-compatible
    HTTP API is at ``http_url`` (on a free port too: two stacks must not compete for 8000)."""

    def __init__(self, up_args: list[str] = (), quiet: bool = False, output=None) -> None:
        self.up_args = list(up_args)
        self.quiet = quiet
        self.output = output  # a file for the stack's log (default: this process's stdout, or none if quiet)
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.http_url = ""

    def __enter__(self) -> str:
        port = free_port_block()
        self.address = f"127.0.0.1:{port}"
        self.http_url = f"http://127.0.0.1:{port + 3}/v1"
        output = self.output if self.output is not None else (subprocess.DEVNULL if self.quiet else None)
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--port", str(port),
                                      "--http-port", str(port + 3), *self.up_args],
                                     start_new_session=True, stdout=output, stderr=output)
        try:
            # All three: the gateway serves before its drafter is ready (and would draft by n-gram).
            for offset in range(3):
                wait_serving(f"127.0.0.1:{port + offset}", self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self.address

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def service_pids(self) -> dict[str, int]:
        """The live service processes of this stack by role (``specdec up``'s children, from /proc)."""
        return {} if self.proc is None else service_pids(self.proc.pid)


def service_pids(up_pid: int) -> dict[str, int]:
    """The live service processes of the ``specdec up`` process ``up_pid`` by role (its children, from /proc)."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{up_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:  # that thread ended between the listing and the read
            continue
        for child in children:
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:  # exited meanwhile
                continue
            if b"serve" in argv[:-1]:
                found[argv[argv.index(b"serve") + 1].decode()] = int(child)
    return found
