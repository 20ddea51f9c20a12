"""Faults at the gateway's edges (issue #42): readiness means SERVING, and a fault is blamed on whoever
made it. A verifier that answers GetInfo while still warming up receives no session; a request's
bad value is that request's INVALID_ARGUMENT / 400 naming the field, and the replica stays ready; a
draft method the stack lacks is refused; both fronts take the same roles; client text cannot forge a
log line. Real services on loopback, tiny models."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specdec.client import GatewayClient
from specdec.rpc.server import ServeOptions, ServiceRuntime
from specdec.v1 import verifier_pb2_grpc
from tests.harness import free_port, health_status, start_service, start_stack
from tests.test_services import reference_greedy
from verifier_service.server import SERVICE_NAME, VerifierService

PROMPT = "the quick brown fox"


class GatedVerifier(VerifierService):
    """The real verifier, whose warm-up waits for the test's gate (a slow warm-up, as the embedded
    target's forward-curve timing is), and which counts its Verify streams."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        super().__init__(runtime)
        self.gate = threading.Event()
        self.verify_streams = 0

    def _warm_up(self) -> None:
        self.gate.wait(120)
        super()._warm_up()

    async def Verify(self, request_iterator, context):
        self.verify_streams += 1
        async for response in super().Verify(request_iterator, context):
            yield response


def serve_in_thread(target: str, port: int):
    """A ``GatedVerifier`` on ``port`` in a thread of its own; returns (service, stop)."""
    started = threading.Event()
    holder = {}

    def run() -> None:
        async def main() -> None:
            runtime = ServiceRuntime(SERVICE_NAME, ServeOptions(port=port))
            service = GatedVerifier(runtime)
            verifier_pb2_grpc.add_VerifierServicer_to_server(service, runtime.server)
            await runtime.start()
            holder["service"], holder["loop"], holder["stop"] = service, asyncio.get_running_loop(), asyncio.Event()
            started.set()
            await service.load(target)  # loaded (GetInfo answers) long before the warm-up ends
            await holder["stop"].wait()
            await runtime.server.stop(0)

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)

    def stop() -> None:
        holder["service"].gate.set()
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(30)

    return holder["service"], stop


def test_a_warming_verifier_receives_no_request_before_it_reports_serving(tiny_pair, tiny_target, tmp_path):
    port = free_port()
    verifier, stop = serve_in_thread(str(tiny_pair[1]), port)
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", f"127.0.0.1:{port}",
                                        "--verifier-wait", "60"], tmp_path)
    try:
        gateway.wait_listening()
        # The model is loaded: GetInfo answers, health says NOT_SERVING (warming up).
        assert verifier.lm is not None
        assert health_status(f"127.0.0.1:{port}", SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        outcome = {}

        def send() -> None:
            with GatewayClient(gateway.address, timeout=120) as client:
                outcome["result"] = client.generate(prompt=PROMPT, max_new_tokens=8, ignore_eos=True, method="none")

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(4.0)  # two gateway refreshes and more
        assert verifier.verify_streams == 0, "a warming verifier was sent a session"
        assert sender.is_alive(), "the request should wait for the verifier"
        assert health_status(gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        verifier.gate.set()  # warm-up ends: SERVING
        sender.join(60)
        result = outcome["result"]
        assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, 8)
        assert verifier.verify_streams == 1
        assert "not serving yet (warming up or draining)" in gateway.log()
    finally:
        gateway.stop()
        stop()


@pytest.fixture(scope="module")
def http_stack(tiny_pair, tmp_path_factory):
    http_port = free_port()
    stack = start_stack(tiny_pair[1], tiny_pair[2], tmp_path_factory.mktemp("blame"),
                        gateway_args=["--http-port", str(http_port)])
    stack.http_port = http_port
    yield stack
    stack.stop()


def post(stack, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("field, value", [
    ("top_k", 4294967296),  # past the wire's uint32
    ("temperature", 1e39),  # a float64 that is inf as the wire's float32
    ("top_p", 1e-46),  # 0 as a float32
    ("stop", ["ok", "\ud800"]),  # a lone surrogate: cannot be encoded as UTF-8
])
def test_a_request_s_bad_value_is_its_400_and_the_verifier_stays_ready(http_stack, field, value):
    status, body = post(http_stack, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.5, field: value})
    assert status == 400, body
    assert body["error"]["param"] == field, body
    assert body["error"]["type"] == "invalid_request_error"
    log = http_stack.gateway.log()
    assert "failed mid-request" not in log and "failed for request" not in log, log[-2000:]
    # The replica was not dropped: the next request is served at once, the gateway still SERVING.
    status, body = post(http_stack, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200, body
    assert health_status(http_stack.gateway.address) == health_pb2.HealthCheckResponse.SERVING


def test_a_lone_surrogate_in_the_prompt_is_a_400_naming_it(http_stack):
    status, body = post(http_stack, {"prompt": "hi \ud800 there", "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt", body


def test_a_draft_method_the_stack_lacks_is_refused(http_stack):
    with GatewayClient(http_stack.gateway.address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt=PROMPT, max_new_tokens=4, method="eagle")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("speculation.method: 'eagle'"), info.value.details()
        assert client.generate(prompt=PROMPT, max_new_tokens=4, method="model").token_ids
    status, body = post(http_stack, {"prompt": PROMPT, "max_tokens": 4, "speculation": {"method": "eagle"}})
    assert status == 400 and body["error"]["param"] == "speculation.method", body


def test_the_developer_role_is_a_system_message_on_both_fronts(http_stack):
    with GatewayClient(http_stack.gateway.address, timeout=60) as client:
        as_developer = client.generate(messages=[("developer", "be brief"), ("user", "count")], max_new_tokens=6,
                                       ignore_eos=True)
        as_system = client.generate(messages=[("system", "be brief"), ("user", "count")], max_new_tokens=6,
                                    ignore_eos=True)
    assert as_developer.prompt_token_ids == as_system.prompt_token_ids
    assert as_developer.token_ids == as_system.token_ids


def test_client_text_cannot_forge_a_log_line(http_stack):
    with GatewayClient(http_stack.gateway.address, timeout=60) as client:
        client.generate(prompt=PROMPT, max_new_tokens=2, request_id="abc\nFORGED specdec.gateway: all good")
    log = http_stack.gateway.log()
    assert "request abc\\nFORGED specdec.gateway: all good" in log
    assert not re.search(r"^FORGED", log, re.MULTILINE)


async def test_capacity_counts_come_back_when_opening_a_request_s_sessions_fails(tiny_pair):
    """A request that fails between admission and its first round (here: its verifier's channel was
    closed under it) gives back every count it raised: the gateway's active requests (else, at
    max_sessions = 1, the next request would be refused as over capacity) and the replica's load."""
    from gateway.generation import GatewayCore, GatewayLimits, GenerationRequest
    from gateway.pools import ReplicaPool
    from specdec.models import load_tokenizer
    from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
    from specdec.v1 import drafter_pb2_grpc, types_pb2, verifier_pb2

    verifiers = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, DEFAULT_MAX_MESSAGE_BYTES)
    drafters = ReplicaPool("drafter", drafter_pb2_grpc.DrafterStub, DEFAULT_MAX_MESSAGE_BYTES)
    verifiers.set_addresses(["127.0.0.1:1"])
    replica = verifiers.replicas[0]
    replica.info = verifier_pb2.GetVerifierInfoResponse(model=types_pb2.ModelInfo(model="tiny"))  # as if ready
    replica.ready_epoch = 1
    await replica.channel.close()
    core = GatewayCore(ServiceRuntime("specdec.v1.Gateway", ServeOptions()), load_tokenizer(str(tiny_pair[1])),
                       GatewayLimits(max_sessions=1, verifier_wait_s=0), verifiers, drafters)
    for _ in range(3):
        request = GenerationRequest(prompt=PROMPT)
        with pytest.raises(Exception) as info:
            async for _ in core.generate(request, core.request_telemetry(request)):
                pass
        assert "capacity" not in str(info.value)
        assert core.active == 0 and core.waiting == 0
        assert replica.in_flight == 0
