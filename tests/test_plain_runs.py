"""Plain runs (``VerifyBlock.plain_steps``): the verifier decodes rounds without a block each, one
verdict per round, and says in each how many are still to come; the run ends early, and says so, at
the session's max_new_tokens and at a committed stop token; a cancel stops it; the tokens are the
target's, token for token, whichever way the rounds were asked for. Through the gateway, a request
without drafts is one run, and ``--no-plain-runs`` asks for every round with its own block."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest

from specdec.client import GatewayClient
from specdec.rpc import convert
from specdec.rpc.sessions import ModelThread
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from specdec.wire_types import SamplingParams
from tests.harness import start_stack
from tests.test_services import reference_greedy
from tests.test_verify_ahead import serve_recording_verifier
from specdec.verification import TargetSession

NEW_TOKENS = 14


@contextlib.asynccontextmanager
async def _verifier(target: str):
    """An in-process verifier whose passes are recorded (each pass's job kinds), and a stub to it."""
    runtime, service, passes, address = await serve_recording_verifier(target)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield service, passes, verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await runtime.server.stop(0)


async def _start(stub, prompt: list[int], params: SamplingParams, session_id: str = "run"):
    """A Verify stream past its prefill: (the call, the prefill's tokens)."""
    call = stub.Verify()
    await call.write(verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(
        session_id=session_id, prompt_token_ids=prompt, sampling=convert.sampling_to_pb(params))))
    return call, list((await call.read()).token_ids)


async def _read_run(call) -> list[verifier_pb2.VerifyResponse]:
    """A block's verdict and every verdict of the run it asked for (until plain_steps_left is 0)."""
    verdicts = [await call.read()]
    while verdicts[-1].plain_steps_left:
        verdicts.append(await call.read())
    return verdicts


@pytest.fixture
def prompt(tiny_target) -> list[int]:
    return tiny_target.tokenizer("def add(a, b):")["input_ids"]


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "beside-another-session"])
async def test_a_plain_run_streams_its_rounds_without_blocks(tiny_pair, tiny_target, prompt, alone):
    reference = reference_greedy(tiny_target, prompt, NEW_TOKENS)
    async with _verifier(str(tiny_pair[1])) as (service, passes, stub):
        other = None if alone else await _start(stub, prompt, SamplingParams(max_new_tokens=4), "other")
        call, tokens = await _start(stub, prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        # Two right drafts and a run of 5 after them: 6 verdicts, rounds 7 .. 12, counting down.
        drafts = reference[len(tokens): len(tokens) + 2]
        before = len(passes)
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(
            round=7, draft_token_ids=drafts, plain_steps=5)))
        verdicts = await _read_run(call)
        assert [v.round for v in verdicts] == list(range(7, 13))
        assert [v.plain_steps_left for v in verdicts] == [5, 4, 3, 2, 1, 0]
        assert verdicts[0].num_accepted == 2 and all(v.num_drafts == 0 for v in verdicts[1:])
        assert all(len(v.token_ids) == 1 for v in verdicts[1:])
        # The block's pass and the first run round's pending token, started as the block's verdict
        # went out; then, alone, the rest back to back on the model thread, outside the batched passes;
        # beside another session, one batched pass per round (where that session's work would join).
        # (Before the block: the prefills' own ahead passes, wherever they fell.)
        runs_passes = [["PendingForward"]] if alone else [["PendingForward"]] * 5
        after = passes[before:]
        block_pass = after.index(["verify:2"])
        assert all(kinds == ["PendingForward"] for kinds in after[:block_pass]), after
        assert after[block_pass + 1:] == runs_passes, after
        for verdict in verdicts:
            tokens += verdict.token_ids
        # After the run the verifier reads blocks again.
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=13)))
        last = await call.read()
        assert last.round == 13 and last.plain_steps_left == 0
        tokens += last.token_ids
        await call.done_writing()
        if other is not None:
            await other[0].done_writing()
    assert tokens == reference[:len(tokens)] and len(tokens) == 1 + 3 + 5 + 1


async def test_a_run_ends_at_max_new_tokens_and_says_so(tiny_pair, tiny_target, prompt):
    reference = reference_greedy(tiny_target, prompt, NEW_TOKENS)
    async with _verifier(str(tiny_pair[1])) as (service, passes, stub):
        call, tokens = await _start(stub, prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, plain_steps=1000)))
        verdicts = await _read_run(call)
        # The budget leaves 13 rounds after the prefill; the first verdict already says 12 follow.
        assert len(verdicts) == NEW_TOKENS - 1
        assert verdicts[0].plain_steps_left == NEW_TOKENS - 2
        for verdict in verdicts:
            tokens += verdict.token_ids
        assert tokens == reference[:NEW_TOKENS]
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=99)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_new_tokens" in refused.value.details()


async def test_a_run_ends_at_a_committed_stop_token(tiny_pair, tiny_target, prompt):
    reference = reference_greedy(tiny_target, prompt, NEW_TOKENS)
    stop = reference[6]
    first = reference.index(stop)  # where the stop token is committed first
    assert first >= 1, "the stop token must come after the prefill's token"
    async with _verifier(str(tiny_pair[1])) as (service, passes, stub):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,), ignore_eos=True)
        call, tokens = await _start(stub, prompt, params)
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, plain_steps=1000)))
        for verdict in await _read_run(call):
            tokens += verdict.token_ids
        assert tokens == reference[:first + 1]  # the run's last verdict committed the stop token
        await call.done_writing()


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "beside-another-session"])
async def test_a_cancel_stops_a_run_and_frees_the_session(tiny_pair, tiny_target, prompt, alone, monkeypatch):
    async with _verifier(str(tiny_pair[1])) as (service, passes, stub):
        other = None if alone else await _start(stub, prompt, SamplingParams(max_new_tokens=4), "other")
        held = threading.Event()
        rounds = []  # the run's rounds, wherever they are computed
        plain_round, run_batch = TargetSession.verify, service.batcher.run_batch

        def hold_after_three():
            rounds.append(1)
            if len(rounds) > 3:  # the run's fourth round waits until the cancel is in
                held.wait(10)

        def solo_round(session, proposal):
            hold_after_three()
            return plain_round(session, proposal)

        def batched(jobs):
            if any(type(job).__name__ == "PendingForward" for job in jobs):
                hold_after_three()
            return run_batch(jobs)

        monkeypatch.setattr(TargetSession, "verify", solo_round)
        service.batcher.run_batch = batched
        call, _ = await _start(stub, prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                               session_id="cancelled-run")
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, plain_steps=1000)))
        read = [await call.read(), await call.read()]
        assert read[-1].plain_steps_left > 0
        await stub.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id="cancelled-run"))
        held.set()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                read.append(await call.read())
                assert read[-1].plain_steps_left > 0, "the run went on to its end after the cancel"
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert len(read) < NEW_TOKENS - 1
        deadline = asyncio.get_running_loop().time() + 10
        while len(service.sessions) > (0 if alone else 1):
            assert asyncio.get_running_loop().time() < deadline, "the session was not freed"
            await asyncio.sleep(0.01)
        if other is not None:
            await other[0].done_writing()


async def test_a_session_that_starts_during_a_solo_run_is_not_kept_waiting(tiny_pair, tiny_target, prompt,
                                                                             monkeypatch):
    """A solo run gives the model thread up as soon as another session's start waits for it."""
    long_run = 100
    plain_round = TargetSession.verify
    solo_rounds = []

    def slow_round(session, proposal):  # rounds that take a while, so the run would last about 2 s
        solo_rounds.append(1)
        time.sleep(0.02)
        return plain_round(session, proposal)

    async with _verifier(str(tiny_pair[1])) as (service, passes, stub):
        monkeypatch.setattr(TargetSession, "verify", slow_round)
        call, _ = await _start(stub, prompt, SamplingParams(max_new_tokens=long_run + 1, ignore_eos=True))
        await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, plain_steps=long_run)))
        for _ in range(3):
            await call.read()
        _, other_tokens = await _start(stub, prompt, SamplingParams(max_new_tokens=4), "newcomer")
        assert len(other_tokens) == 1  # its prefill came back ...
        assert len(solo_rounds) < long_run // 2, solo_rounds  # ... long before the solo run could have ended
        call.cancel()


def test_the_model_thread_counts_the_calls_waiting_for_it_and_a_cancelled_one_leaves():
    """What a solo run asks before each round: a call queued behind it counts until it starts, or
    until it is cancelled without starting (else the run would give way for ever)."""
    thread = ModelThread("test")
    running, release = threading.Event(), threading.Event()

    def busy():
        running.set()
        release.wait(10)

    try:
        thread.submit(busy)
        assert running.wait(10)
        assert thread.waiting == 0  # the running call is not waiting
        queued = [thread.submit(lambda: None) for _ in range(2)]
        assert thread.waiting == 2
        assert queued[0].cancel()
        assert thread.waiting == 1
        release.set()
        queued[1].result(10)
        assert thread.waiting == 0
    finally:
        release.set()
        thread.shutdown(wait=True)


@pytest.fixture(scope="module")
def stacks(tiny_pair, tmp_path_factory):
    """Two stacks on the tiny pair: the default gateway (plain runs) and one with --no-plain-runs."""
    started = []
    try:
        for name, extra in (("runs", []), ("no-runs", ["--no-plain-runs"])):
            stack = start_stack(tiny_pair[1], None, tmp_path_factory.mktemp(f"plain-{name}"),
                                gateway_args=extra)
            started.append(stack)
        yield started
    finally:
        for stack in started:
            stack.stop()


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, top_k=20, seed=11)], ids=["greedy", "seeded"])
def test_through_the_gateway_a_request_without_drafts_is_one_run_and_decodes_the_same(stacks, sampling):
    runs, no_runs = stacks
    prompts = ["the quick brown fox", "def add(a, b):", "1 2 1 2 1 2"]
    for prompt in prompts:
        kwargs = dict(prompt=prompt, max_new_tokens=24, ignore_eos=True, method="none", **sampling)
        with GatewayClient(runs.gateway.address, timeout=60) as client:
            in_runs = client.generate(**kwargs)
        with GatewayClient(no_runs.gateway.address, timeout=60) as client:
            by_blocks = client.generate(**kwargs)
        assert in_runs.token_ids == by_blocks.token_ids and len(in_runs.token_ids) == 24
        assert in_runs.stats["plain_runs"] == 1 and in_runs.stats["plain_run_rounds"] == 23 - 1
        assert by_blocks.stats["plain_runs"] == 0
        assert in_runs.stats["rounds"] == by_blocks.stats["rounds"] == 23
