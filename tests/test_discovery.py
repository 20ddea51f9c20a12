"""EndpointSlice discovery through the real kubernetes client against a loopback API server, and
least-loaded routing across live verifier replicas."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from gateway.discovery import EndpointSliceWatcher, discovery_api, ready_addresses

NAMESPACE = "specdec"
SERVICE = "specdec-verifier"


def endpoint_slice(name: str, endpoints: list[tuple[str, bool]], version: str, port: int = 50053) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": version,
                     "labels": {"kubernetes.io/service-name": SERVICE}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}, {"name": "metrics", "port": 9090}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints],
    }


class FakeApiServer:
    """Just enough of the Kubernetes API: list and watch EndpointSlices in one namespace."""

    def __init__(self, initial: list[dict]) -> None:
        self.initial = initial
        self.events: queue.Queue = queue.Queue()
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                from urllib.parse import parse_qs, urlsplit

                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                outer.requests.append(query)
                if (url.path != f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
                        or query.get("labelSelector") != f"kubernetes.io/service-name={SERVICE}"):
                    self.send_error(404)
                    return
                if query.get("watch") == "true":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while True:
                        event = outer.events.get()
                        if event is None:
                            self.wfile.write(b"0\r\n\r\n")
                            return
                        line = (json.dumps(event) + "\n").encode()
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                   "metadata": {"resourceVersion": "1"}, "items": outer.initial}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.events.put(None)
        self.server.shutdown()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_ready_addresses_filters_not_ready_and_picks_the_grpc_port():
    s = endpoint_slice("a", [("10.0.0.1", True), ("10.0.0.2", False)], "1")
    s["endpoints"].append({"addresses": ["10.0.0.3"], "conditions": {}})  # unset = ready
    assert ready_addresses(s, "grpc") == {"10.0.0.1:50053", "10.0.0.3:50053"}
    assert ready_addresses(s, "nope") == set()


def test_watch_events_added_modified_not_ready_deleted():
    api_server = FakeApiServer([endpoint_slice("slice-a", [("10.0.0.1", True)], "1")])
    seen: list[set[str]] = []
    watcher = EndpointSliceWatcher(discovery_api(api_server.host), NAMESPACE, SERVICE, on_change=lambda a: seen.append(set(a)))
    watcher.start()
    try:
        wait_for(lambda: seen and seen[-1] == {"10.0.0.1:50053"})
        api_server.events.put({"type": "ADDED", "object": endpoint_slice("slice-b", [("10.0.0.2", True)], "2")})
        wait_for(lambda: seen[-1] == {"10.0.0.1:50053", "10.0.0.2:50053"})
        # A pod going not-ready (e.g. draining) leaves the routing set at once.
        api_server.events.put({"type": "MODIFIED", "object": endpoint_slice("slice-a", [("10.0.0.1", False)], "3")})
        wait_for(lambda: seen[-1] == {"10.0.0.2:50053"})
        api_server.events.put({"type": "DELETED", "object": endpoint_slice("slice-b", [("10.0.0.2", True)], "4")})
        wait_for(lambda: seen[-1] == set())
        assert any(r.get("watch") == "true" and r.get("resourceVersion") == "1" for r in api_server.requests)
    finally:
        watcher.stop()
        api_server.close()


@pytest.fixture(scope="module")
def two_verifiers(tiny_pair, tmp_path_factory):
    from tests.harness import start_stack

    stack = start_stack(tiny_pair[1], None, tmp_path_factory.mktemp("disc"), verifiers=2)
    yield stack
    stack.stop()


def test_least_loaded_routing_across_live_verifiers(two_verifiers):
    """Sessions held open on the gateway spread over both replicas; an extra one goes to the idler."""
    from specdec.client import build_request
    from specdec.v1 import gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    def active(address):
        with grpc.insecure_channel(address) as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)
        return info.load.active_sessions

    two_verifiers.wait_gateway_sees_every_verifier()  # it serves once one is ready, and polls the rest
    channel = grpc.insecure_channel(two_verifiers.gateway.address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    calls = []
    for _ in range(4):
        call = stub.Generate(build_request(prompt="the", max_new_tokens=2000, ignore_eos=True, method="none"), timeout=60)
        next(call)  # the session is open once the first token arrived
        calls.append(call)
    loads = [active(v.address) for v in two_verifiers.verifiers]
    assert loads == [2, 2], loads
    for call in calls:
        call.cancel()
    wait_for(lambda: [active(v.address) for v in two_verifiers.verifiers] == [0, 0])
    channel.close()


def test_pool_follows_discovered_addresses():
    """ReplicaPool.set_addresses (the watcher's callback) adds new replicas and retires removed ones."""
    import asyncio

    from gateway.pools import ReplicaPool
    from specdec.v1 import verifier_pb2_grpc

    async def scenario():
        pool = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, 1 << 20)
        pool.set_addresses({"127.0.0.1:1", "127.0.0.1:2"})
        assert sorted(b.address for b in pool.replicas) == ["127.0.0.1:1", "127.0.0.1:2"]
        busy = next(b for b in pool.replicas if b.address == "127.0.0.1:2")
        busy.in_flight = 1
        pool.set_addresses({"127.0.0.1:3"})
        # The busy one stays (retired) until its sessions end; the idle one is gone.
        assert sorted((b.address, b.removed) for b in pool.replicas) == [("127.0.0.1:2", True), ("127.0.0.1:3", False)]
        await pool.refresh(timeout=0.5)  # nothing listens there: no replica is ready
        assert pool.pick() is None
        for b in pool.replicas:
            await b.channel.close()

    asyncio.run(scenario())
