"""`make demo`: start drafter, verifier and gateway on the embedded default, stream one generation
through the gateway, print the stats, stop everything."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

PROMPT = "Write a short Python function that checks whether a number is prime, then explain it."


def _free_port_block() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 2 < 65535:
            try:
                for p in (port + 1, port + 2):
                    with socket.socket() as t:
                        t.bind(("127.0.0.1", p))
                return port
            except OSError:
                continue
    raise RuntimeError("no free ports")


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit("specdec up exited early")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise SystemExit("the gateway did not become ready")


def main() -> int:
    from specdec.models import embedded_model_dir

    print("== preparing the embedded target (SmolLM2-135M-Instruct; converted once, then cached)", flush=True)
    embedded_model_dir()
    port = _free_port_block()
    address = f"127.0.0.1:{port}"
    print(f"== starting drafter, verifier and gateway (`specdec up --port {port}`)", flush=True)
    up = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--port", str(port)], start_new_session=True)
    try:
        _wait_serving(address, up)
        print(f"== streaming a chat generation through the gateway at {address}\n", flush=True)
        from specdec.client import ChunkEvent, GatewayClient

        with GatewayClient(address, timeout=600) as client:
            for event in client.stream(messages=[("user", PROMPT)], max_new_tokens=160):
                if isinstance(event, ChunkEvent):
                    print(event.text, end="", flush=True)
                else:
                    print(f"\n\n== finish_reason={event.finish_reason} prompt_tokens={event.prompt_tokens} "
                          f"completion_tokens={event.completion_tokens}")
                    print(json.dumps(event.stats, indent=2))
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
