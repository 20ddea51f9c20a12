"""`specdec up` under kill -9: the stack survives the death of a model service.

A drafter killed mid-stream: the stream completes token-identical to plain decoding, the drafter is
restarted and serving within 30 s, and the next request drafts with it again. A verifier killed
mid-stream: the stream waits for the restarted verifier and completes token-identical, and requests
sent meanwhile wait for it and are served exactly.
"""

from __future__ import annotations

import os
import signal
import threading
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
        assert error is None, error
        assert tokens == expected
        wait_serving(_port(address, 1), timeout=120)  # restarted, loaded and serving (120 s: a hang guard)
        assert stack.service_pids()["drafter"] != pid
        # The gateway sees it again at its next refresh (every 2 s) and the next request drafts; the
        # ceiling is a hang guard, not a bound on the refresh.
        deadline = time.monotonic() + 60
        while True:
            result = client.generate(prompt=PROMPT, max_new_tokens=24, ignore_eos=True, method="model",
                                     num_draft_tokens=3)
            if result.stats["draft_tokens"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert result.stats["draft_tokens"] > 0, result.stats
        assert result.token_ids == _plain(client, 24)


def test_a_verifier_killed_mid_stream_is_waited_for_and_every_request_is_served_exactly(up_stack):
    """kill -9 of the verifier mid-stream: the stream waits for the restarted verifier (--verifier-wait)
    and completes token-identical; requests sent 0 s, 2 s and 10 s after the kill (the first reaches
    the dead address before the gateway's next refresh notices) are served exactly too."""
    stack, address = up_stack
    with GatewayClient(address, timeout=120) as client:
        # 200 tokens: a migrated session's re-prefill is one pass over the committed text, whose fp32
        # rounding differs from incremental decoding's; this tiny model has a near-tie past 300
        # tokens of this prompt where that flips the argmax (README: "Failures and security").
        expected_long, expected_short = _plain(client, 200), _plain(client, 16)
        pid = stack.service_pids()["verifier"]
        results: dict[float, object] = {}

        def send_after(delay_s: float, killed_at: float) -> None:
            time.sleep(max(0.0, killed_at + delay_s - time.monotonic()))
            try:
                with GatewayClient(address, timeout=120) as other:
                    results[delay_s] = other.generate(prompt=PROMPT, max_new_tokens=16, ignore_eos=True,
                                                      method="none").token_ids
            except grpc.RpcError as exc:
                results[delay_s] = exc

        senders: list[threading.Thread] = []

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            for delay_s in (0.0, 2.0, 10.0):
                senders.append(threading.Thread(target=send_after, args=(delay_s, killed_at)))
                senders[-1].start()

        tokens, error, seen = [], None, 0
        try:
            for event in client.stream(prompt=PROMPT, max_new_tokens=200, ignore_eos=True, method="model",
                                       num_draft_tokens=2):
                if isinstance(event, ChunkEvent):
                    tokens += event.token_ids
                    seen += 1
                    if seen == 3:
                        kill()
        except grpc.RpcError as exc:
            error = exc
        for sender in senders:
            sender.join(90)
        assert error is None, (error.code(), error.details())
        assert tokens == expected_long
        assert stack.service_pids()["verifier"] != pid
        for delay_s in (0.0, 2.0, 10.0):
            outcome = results[delay_s]
            # Served, not UNAVAILABLE: a verifier was ready within --verifier-wait (the gateway's
            # own bound; timing it here too would only add the load of this machine).
            assert not isinstance(outcome, grpc.RpcError), (delay_s, outcome.code(), outcome.details())
            assert outcome == expected_short, delay_s



def test_without_a_verifier_a_request_waits_then_fails_unavailable(tiny_pair, tmp_path):
    """Past --verifier-wait (or its deadline, if shorter) a request with no ready verifier fails."""
    from tests.harness import free_port, start_service

    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", f"127.0.0.1:{free_port()}",
                                        "--verifier-wait", "1.5"], tmp_path)
    try:
        # It listens (health answers NOT_SERVING: no verifier is ready).
        gateway.wait_listening()
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
