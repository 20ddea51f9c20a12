"""The three services as real subprocesses on loopback: exactness through the gateway,
cancellation, bad input, health, drain, and the wire size of a round."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from specdec.client import ChunkEvent, FinalEvent, GatewayClient, build_request
from specdec.rpc.server import error_field
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.harness import health_status, metrics_text, scrape_metric, start_service, start_stack
from tests.test_greedy_equality import hf_greedy
from tests.tiny_models import build_noisy_copy

PROMPTS = [
    "the quick brown fox",
    "def add(a, b):",
    "speculative decoding drafts tokens",
    "Hello! How can I help",
    "numbers 0 1 2 3",
    "for i in range(10):",
    "exactness is sacred",
    "ünïcödé bytes: 日本語",
]
CHATS = [
    [("user", "hello there")],
    [("system", "be brief"), ("user", "count to five")],
    [("user", "what is speculative decoding?")],
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def noisy_draft(tiny_pair, tmp_path_factory):
    return build_noisy_copy(tmp_path_factory.mktemp("noisy") / "draft", tiny_pair[1], noise_std=0.3)


@pytest.fixture(scope="module")
def stack(tiny_pair, noisy_draft, tmp_path_factory):
    stack = start_stack(tiny_pair[1], noisy_draft, tmp_path_factory.mktemp("logs"), metrics=True)
    yield stack
    stack.stop()


def reference_greedy(target, prompt_ids: list[int], n: int) -> list[int]:
    """transformers ``generate`` on the target alone (stops at EOS like the gateway does)."""
    out = target.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt_ids):].tolist()


def active_sessions(address: str, role: str) -> int:
    with grpc.insecure_channel(address) as channel:
        if role == "verifier":
            info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)
        else:
            info = drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5)
    return info.load.active_sessions


@pytest.mark.parametrize("method", ["model", "ngram", "none"])
def test_greedy_through_gateway_equals_target_only(stack, tiny_target, method):
    inputs = [dict(prompt=p) for p in PROMPTS] + [dict(messages=m) for m in CHATS]
    accepted = 0
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for i, given in enumerate(inputs):
            k = (1, 3, 5)[i % 3]
            result = client.generate(**given, max_new_tokens=NEW_TOKENS, method=method, num_draft_tokens=k)
            expected = reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS)
            assert result.token_ids == expected, given
            assert result.finish_reason == ("length" if len(expected) == NEW_TOKENS and expected[-1] not in tiny_target.eos_token_ids else "stop")
            assert result.stats["draft_method"] == method
            assert result.text == tiny_target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            accepted += result.stats["accepted_tokens"]
            # A round's time splits: the passes that served it within the verifier's service time
            # within the gateway's wait for the verdict (the rest of that wait is the wire). A plain
            # round's pending token was fed ahead (verify-ahead): its wait holds only what was left of
            # that pass, none if it had finished; a round with drafts waits for their pass.
            stats = result.stats
            assert stats["rounds"] > 0 and 0 <= stats["verify_pass_s"] <= stats["verify_service_s"] < stats["verify_s"]
            assert (stats["verify_pass_s"] > 0) or stats["draft_tokens"] == 0, stats
            if method == "none":
                assert result.stats["draft_tokens"] == 0
    if method == "model":  # the noisy draft agrees often: the rounds really did accept and roll back
        assert accepted > 0


def test_adaptive_sessions_probe_in_the_shadow_and_stay_exact(tiny_pair, tiny_target, tmp_path):
    """With a draft that never agrees (random weights), adaptive greedy sessions fall back to plain
    decoding and keep measuring acceptance with shadow probes: drafted beside plain rounds, scored
    against the committed tokens, never verified. A session opens its drafter session only when it
    drafts or probes (none at all if it ends before a probe, or if no probe could repay its measured
    cost in what the request has left)."""
    stack = start_stack(tiny_pair[1], tiny_pair[2], tmp_path, metrics=True)
    drafter_sessions = 'specdec_requests_total{role="drafter"}'
    try:
        with GatewayClient(stack.gateway.address, timeout=120) as client:
            probes = opened = 0
            for prompt in PROMPTS[:4]:
                result = client.generate(prompt=prompt, max_new_tokens=96, method="model", num_draft_tokens=0,
                                         ignore_eos=True)
                assert result.token_ids == hf_greedy(tiny_target, list(result.prompt_token_ids), 96)
                stats = result.stats
                probes += stats["shadow_probes"]
                opened += stats["shadow_probes"] > 0 or stats["draft_tokens"] > 0
                assert stats["shadow_accepted"] <= stats["shadow_probes"]
                # After the first rounds (the initial k), no round verifies drafts: probes ran beside.
                history = stats["k_history"]
                assert sum(history[len(history) // 4:]) == 0, history
            assert probes > 0  # the first session probed: nothing was known of what probes cost
            assert scrape_metric(stack.drafters[0], drafter_sessions) == opened

            # Three tokens: prefill and two plain rounds, fewer than the rounds before a first probe.
            short = client.generate(prompt=PROMPTS[4], max_new_tokens=3, method="model", num_draft_tokens=0,
                                    ignore_eos=True)
            assert short.token_ids == hf_greedy(tiny_target, list(short.prompt_token_ids), 3)
            assert short.stats["k_history"] == [0, 0] and short.stats["shadow_probes"] == 0
            assert scrape_metric(stack.drafters[0], drafter_sessions) == opened  # never opened

            late = client.generate(prompt=PROMPTS[5], max_new_tokens=48, method="model", num_draft_tokens=0,
                                   ignore_eos=True)
            assert late.token_ids == hf_greedy(tiny_target, list(late.prompt_token_ids), 48)
            assert late.stats["draft_tokens"] == 0  # the gateway had learned: plain decoding from the start
            # Opened at its first probe if it had one (the drafter prefilled then, and caught up after).
            assert scrape_metric(stack.drafters[0], drafter_sessions) == opened + (late.stats["shadow_probes"] > 0)
        assert active_sessions(stack.drafters[0].address, "drafter") == 0
    finally:
        stack.stop()


def test_verifier_reports_its_forward_cost_curve(stack):
    """The verifier times its forward over 1..17 tokens at start-up; the gateway's policies build on it."""
    with grpc.insecure_channel(stack.verifiers[0].address) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)
    curve = list(info.forward_cost_s)
    assert len(curve) == 17
    assert all(t > 0 for t in curve)
    assert all(b >= a for a, b in zip(curve, curve[1:]))  # non-decreasing by construction


def test_chat_prompt_uses_template(stack, tiny_target):
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        result = client.generate(messages=[("user", "hi")], max_new_tokens=4, ignore_eos=True)
    expected = tiny_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert tiny_target.tokenizer.decode(result.prompt_token_ids) == expected


def test_stop_token_mid_block_finishes_with_stop(stack):
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        free = client.generate(prompt="the quick", max_new_tokens=NEW_TOKENS, ignore_eos=True, method="model", num_draft_tokens=4)
        # Make the 5th generated token a stop token: the output must end right there.
        stop_at = free.token_ids[4]
        request = build_request(prompt="the quick", max_new_tokens=NEW_TOKENS, ignore_eos=True, method="model", num_draft_tokens=4)
        request.sampling.stop_token_ids.append(stop_at)
        events = list(_stream(client, request))
    final = events[-1]
    tokens = [t for e in events[:-1] for t in e.token_ids]
    first = free.token_ids.index(stop_at)
    assert tokens == free.token_ids[: first + 1]
    assert final.finish_reason == "stop" and final.completion_tokens == first + 1


def _stream(client: GatewayClient, request):
    from specdec.client import event_from_pb

    for response in client.stub.Generate(request, timeout=60):
        yield event_from_pb(response)


def test_seeded_sampling_repeats_and_seeds_differ(stack):
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        runs = [
            client.generate(prompt="the quick brown", max_new_tokens=32, ignore_eos=True, temperature=1.0,
                            top_p=0.95, seed=seed, method="model", num_draft_tokens=3)
            for seed in (7, 7, 8)
        ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids


def test_chunks_arrive_before_the_end(stack):
    arrivals = []
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for event in client.stream(prompt="the quick", max_new_tokens=64, ignore_eos=True, method="model", num_draft_tokens=2):
            arrivals.append((time.monotonic(), event))
    chunks = [(t, e) for t, e in arrivals if isinstance(e, ChunkEvent)]
    assert isinstance(arrivals[-1][1], FinalEvent)
    assert len(chunks) > 5
    # The first chunk (the prefill token) came well before the final message.
    assert chunks[0][1].token_ids and arrivals[-1][0] - chunks[0][0] > 0


def test_cancel_mid_stream_frees_every_session(stack):
    channel = grpc.insecure_channel(stack.gateway.address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    call = stub.Generate(build_request(prompt="the quick", max_new_tokens=2000, ignore_eos=True, method="model",
                                       num_draft_tokens=2), timeout=60)
    next(call)
    next(call)
    assert active_sessions(stack.verifiers[0].address, "verifier") == 1
    call.cancel()
    cancelled_at = time.monotonic()
    while time.monotonic() - cancelled_at < 1.0:
        if (active_sessions(stack.verifiers[0].address, "verifier") == 0
                and active_sessions(stack.drafters[0].address, "drafter") == 0):
            break
        time.sleep(0.02)
    assert active_sessions(stack.verifiers[0].address, "verifier") == 0
    assert active_sessions(stack.drafters[0].address, "drafter") == 0
    channel.close()


MALFORMED = [
    ("no input", dict(), "input"),
    ("two inputs", dict(prompt="x", prompt_token_ids=[1, 2]), "input"),
    ("unknown role", dict(messages=[("wizard", "hi")]), "messages[0].role"),
    ("token id beyond vocab", dict(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
    ("negative temperature", dict(prompt="x", temperature=-1.0), "sampling.temperature"),
    ("nan temperature", dict(prompt="x", temperature=float("nan")), "sampling.temperature"),
    ("top_p zero", dict(prompt="x", top_p=0.0), "sampling.top_p"),
    ("top_p above one", dict(prompt="x", top_p=1.5), "sampling.top_p"),
    ("max_new_tokens over cap", dict(prompt="x", max_new_tokens=10**6), "sampling.max_new_tokens"),
    ("empty stop string", dict(prompt="x", stop=[""]), "sampling.stop"),
    ("too many stop strings", dict(prompt="x", stop=[str(i) for i in range(100)]), "sampling.stop"),
    ("unknown method", dict(prompt="x", method="telepathy"), "speculation.method"),
    ("too many draft tokens", dict(prompt="x", num_draft_tokens=10**4), "speculation.num_draft_tokens"),
    ("prompt too long", dict(prompt_token_ids=[5] * 5000), "prompt_token_ids"),
    ("request_id too long", dict(prompt="x", request_id="r" * 1000), "request_id"),
]


@pytest.mark.parametrize("name,kwargs,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_request_is_invalid_argument(stack, name, kwargs, field):
    with GatewayClient(stack.gateway.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(**kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        assert error_field(info.value) == field  # as data, in the status's rich error
        # ... and the service still serves.
        ok = client.generate(prompt="the", max_new_tokens=3, ignore_eos=True)
        assert len(ok.token_ids) == 3


def test_internal_streams_reject_bad_messages(stack):
    """Drafter and verifier validate their own streams too (a gateway is not the only client)."""
    with grpc.insecure_channel(stack.verifiers[0].address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        block_first = [verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(draft_token_ids=[1]))]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Verify(iter(block_first), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        bad_ids = [verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(prompt_token_ids=[10**6]))]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Verify(iter(bad_ids), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(stack.drafters[0].address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        start = drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(prompt_token_ids=[1, 2]))
        too_many = drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(num_draft_tokens=10**4))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Draft(iter([start, too_many]), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert active_sessions(stack.verifiers[0].address, "verifier") == 0
    assert active_sessions(stack.drafters[0].address, "drafter") == 0


def test_metrics_endpoint_counts(stack):
    with GatewayClient(stack.gateway.address, timeout=30) as client:
        client.generate(prompt="the", max_new_tokens=5, ignore_eos=True, method="model", num_draft_tokens=2)
    for service in (stack.gateway, stack.verifiers[0], stack.drafters[0]):
        body = metrics_text(service)
        assert "specdec_active_sessions" in body
        assert "specdec_requests_total" in body
    gateway_body = metrics_text(stack.gateway)
    assert "specdec_accepted_tokens_total" in gateway_body


def test_health_serving_only_after_load_and_sigterm_lets_stream_finish(tiny_pair, tmp_path):
    verifier = start_service("verifier", ["--target", str(tiny_pair[1])], tmp_path)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = health_status(verifier.address)
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
        time.sleep(0.02)
    assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING, verifier.log()
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
    # Once SERVING, the model answers.
    assert active_sessions(verifier.address, "verifier") == 0

    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", verifier.address], tmp_path)
    gateway.wait_serving()
    outcome = {}

    def long_stream():
        with GatewayClient(gateway.address, timeout=120) as client:
            events = []
            for event in client.stream(prompt="the", max_new_tokens=400, ignore_eos=True, method="none"):
                events.append(event)
                if len(events) == 3:
                    outcome["mid_stream"].set()
            outcome["events"] = events

    outcome["mid_stream"] = threading.Event()
    thread = threading.Thread(target=long_stream)
    thread.start()
    assert outcome["mid_stream"].wait(60)
    # SIGTERM both services mid-stream: health drops, the stream still completes, exit 0.
    gateway.proc.send_signal(15)
    verifier.proc.send_signal(15)
    thread.join(120)
    events = outcome["events"]
    assert isinstance(events[-1], FinalEvent) and events[-1].completion_tokens == 400
    assert gateway.proc.wait(60) == 0
    assert verifier.proc.wait(60) == 0


def test_round_on_the_wire_fits_8kb(embedded_target):
    """8 sampled drafts with K = 64 from the embedded model (real ids, real probabilities)."""
    from specdec.drafters import ModelDrafter
    from specdec.rpc import convert
    from specdec.wire_types import SamplingParams

    prompt = embedded_target.tokenizer("Once upon a time, in a quiet village,")["input_ids"]
    params = SamplingParams(temperature=1.0, seed=1, draft_top_k=64)
    session = ModelDrafter(embedded_target).start(prompt, params)
    proposal = session.propose(8)
    session.close()
    assert len(proposal) == 8 and all(len(q.token_ids) == 64 for q in proposal.draft_probs)
    drafter_message = drafter_pb2.DraftResponse(proposal=drafter_pb2.DraftProposal(round=1, **convert.proposal_fields(proposal)))
    verifier_message = verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, **convert.proposal_fields(proposal)))
    grpc_frame_overhead = 5  # compressed flag + length prefix per message
    for message in (drafter_message, verifier_message):
        assert message.ByteSize() + grpc_frame_overhead <= 8 * 1024, message.ByteSize()
    # And it round-trips exactly: q on the verifier is the q the drafter sampled from.
    back = convert.proposal_from_pb(verifier_message.block)
    for sent, received in zip(proposal.draft_probs, back.draft_probs):
        assert np.array_equal(sent.token_ids, received.token_ids) and np.array_equal(sent.probs, received.probs)
        assert received.probs.dtype == np.float32  # as the drafter sampled from (fp32 on the wire)


def test_serve_threads_flag_sets_the_model_threads(tiny_pair, tmp_path):
    # `specdec up` runs the drafter on one thread so that its spinning OpenMP workers do not take
    # cores from the verifier's passes; the flag must win over the environment's default.
    env = {"OMP_NUM_THREADS": "2"}
    pinned = start_service("drafter", ["--method", "model", "--draft-model", str(tiny_pair[2]), "--threads", "1"],
                           tmp_path, name="pinned", env=env)
    default = start_service("verifier", ["--target", str(tiny_pair[1])], tmp_path, name="default", env=env)
    try:
        pinned.wait_serving()
        default.wait_serving()
        deadline = time.monotonic() + 30  # the line is logged right after the health status flips
        while time.monotonic() < deadline and not ("threads=" in pinned.log() and "threads=" in default.log()):
            time.sleep(0.1)
        assert "drafter serving method=model" in pinned.log() and "threads=1" in pinned.log()
        assert "threads=2" in default.log()
    finally:
        pinned.stop()
        default.stop()


def test_services_beside_a_gpu_and_the_gateway_default_to_one_thread():
    """Their CPU work is per-token vectors: a pool of one worker per core only adds wake-ups."""
    from specdec.service_config import service_threads

    assert service_threads("gateway", 0, None) == 1
    assert service_threads("verifier", 0, "cuda") == 1
    assert service_threads("drafter", 0, "cuda:1") == 1
    assert service_threads("verifier", 0, "cpu") is None  # torch's default: the forward needs the cores
    assert service_threads("verifier", 3, "cuda") == 3  # --threads / SPECDEC_THREADS wins


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_up_puts_the_drafter_below_the_verifier_for_all_its_threads():
    """`specdec up` lowers the drafter once it serves: niceness and SCHED_IDLE, both per thread on
    Linux, so every thread it already runs is lowered and the threads it starts later inherit it."""
    from specdec.up import deprioritise

    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, threading, time\n"
         "go = threading.Event()\n"
         "def report():\n"
         "    go.wait()\n"
         "    print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0), flush=True)\n"
         "before = threading.Thread(target=report); before.start()\n"  # running before the parent lowers it
         "print('started', flush=True)\n"
         "sys.stdin.readline()\n"
         "go.set(); before.join()\n"
         "after = threading.Thread(target=report); after.start(); after.join()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert child.stdout.readline().strip() == "started"
        deprioritise(7, idle=True)(child.pid)
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
    reports = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
    assert reports == [(os.SCHED_IDLE, min(19, base + 7))] * 2


def test_a_generation_past_the_model_context_ends_by_length(stack, tiny_target):
    """Through the services: max_new_tokens past the context ends with finish_reason "length" at the
    last position (regression: the gateway asked the verifier for a block past the context and the
    request failed with INVALID_ARGUMENT)."""
    context = tiny_target.max_positions
    with GatewayClient(stack.gateway.address, timeout=120) as client:
        result = client.generate(prompt=PROMPTS[0], max_new_tokens=context, method="model", num_draft_tokens=3,
                                 ignore_eos=True)
    assert result.finish_reason == "length"
    assert len(result.prompt_token_ids) + len(result.token_ids) == context
    assert result.token_ids == hf_greedy(tiny_target, list(result.prompt_token_ids), len(result.token_ids))
