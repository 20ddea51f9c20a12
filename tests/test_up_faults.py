"""`specdec up` under kill -9: the stack survives the death of a model service.

A drafter killed mid-stream: the stream completes token-identical to plain decoding, the drafter is
restarted and serving within 30 s, and the next request drafts with it again. A verifier killed
mid-stream: the stream ends UNAVAILABLE within 2 s; a request sent meanwhile waits for the restarted
verifier and is served.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from specdec.client import ChunkEvent, GatewayClient
from specdec.stack import LocalStack, wait_serving

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def up_stack(tiny_pair, tmp_path_factory):
    _, target, draft = tiny_pair
    log = open(tmp_path_factory.mktemp("up") / "up.log", "w")
    stack = LocalStack(["--target", str(target), "--draft-model", str(draft), "--drafter-nice", "0"], output=log)
    with stack as address:
        yield stack, address
    log.close()


def _port(address: str, offset: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + offset}"


def _plain(client: GatewayClient, max_new_tokens: int) -> list[int]:
    return client.generate(prompt=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True, method="none").token_ids


def _kill_after_chunks(client: GatewayClient, pid: int, chunks: int, **request):
    """Stream ``request``, kill -9 ``pid`` after ``chunks`` chunks; returns (tokens, error, seconds
    from the kill to the error)."""
    tokens, seen, killed_at = [], 0, None
    try:
        for event in client.stream(**request):
            if isinstance(event, ChunkEvent):
                tokens += event.token_ids
                seen += 1
                if seen == chunks:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    except grpc.RpcError as exc:
        return tokens, exc, time.monotonic() - killed_at if killed_at else None
    assert killed_at is not None, "the stream ended before the kill"
    return tokens, None, None


def test_a_drafter_killed_mid_stream_costs_no_token_and_comes_back(up_stack):
    stack, address = up_stack
    with GatewayClient(address, timeout=120) as client:
        expected = _plain(client, 96)
        pid = stack.service_pids()["drafter"]
        tokens, error, _ = _kill_after_chunks(client, pid, 3, prompt=PROMPT, max_new_tokens=96, ignore_eos=True,
                                              method="model", num_draft_tokens=3)
        killed = time.monotonic()
        assert error is None, error
        assert tokens == expected
        wait_serving(_port(address, 1), timeout=30)  # restarted, loaded and serving
        assert time.monotonic() - killed < 30
        assert stack.service_pids()["drafter"] != pid
        # The gateway sees it again at its next refresh (every 2 s) and the next request drafts.
        deadline = time.monotonic() + 5
        while True:
            result = client.generate(prompt=PROMPT, max_new_tokens=24, ignore_eos=True, method="model",
                                     num_draft_tokens=3)
            if result.stats["draft_tokens"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert result.stats["draft_tokens"] > 0, result.stats
        assert result.token_ids == _plain(client, 24)


def test_a_verifier_killed_mid_stream_fails_fast_and_comes_back(up_stack):
    stack, address = up_stack
    with GatewayClient(address, timeout=120) as client:
        pid = stack.service_pids()["verifier"]
        _, error, seconds = _kill_after_chunks(client, pid, 3, prompt=PROMPT, max_new_tokens=400, ignore_eos=True,
                                               method="model", num_draft_tokens=2)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert seconds < 2.0
        # A request sent while the verifier restarts waits for it (--verifier-wait) instead of failing.
        sent = time.monotonic()
        result = client.generate(prompt=PROMPT, max_new_tokens=16, ignore_eos=True)
        assert len(result.token_ids) == 16
        assert stack.service_pids()["verifier"] != pid
        assert time.monotonic() - sent < 30


def test_without_a_verifier_a_request_waits_then_fails_unavailable(tiny_pair, tmp_path):
    """Past --verifier-wait (or its deadline, if shorter) a request with no ready verifier fails."""
    from tests.harness import free_port, health_status, start_service

    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", f"127.0.0.1:{free_port()}",
                                        "--verifier-wait", "1.5"], tmp_path)
    try:
        # It listens (health answers NOT_SERVING: no verifier is ready).
        deadline = time.monotonic() + 60
        while health_status(gateway.address) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        with GatewayClient(gateway.address, timeout=30) as client:
            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                client.generate(prompt=PROMPT, max_new_tokens=4)
            waited = time.monotonic() - sent
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no verifier is ready (waited 2 s)" in info.value.details()
        assert 1.5 <= waited < 10
    finally:
        gateway.stop()
