"""The verifier feeds a session's pending token right after a plain round (``PendingForward``): the
next plain round is answered without a pass, the next block with drafts feeds only its drafts, and
the output stays the target's, token for token."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from specdec.rpc import convert
from specdec.rpc.server import ServeOptions, ServiceRuntime
from specdec.wire_types import SamplingParams
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from tests.harness import free_port
from tests.test_services import reference_greedy
from verifier_service.server import SERVICE_NAME, VerifierService

NEW_TOKENS = 14


async def serve_recording_verifier(target: str, verify_ahead: bool = True):
    """An in-process verifier whose passes are recorded: one list of job kinds per pass, and the
    tokens each pass fed."""
    runtime = ServiceRuntime(SERVICE_NAME, ServeOptions(port=free_port()))
    service = VerifierService(runtime, verify_ahead=verify_ahead)
    passes: list[list[str]] = []
    run_batch = service.batcher.run_batch

    def recorded(jobs):
        passes.append([type(job).__name__ if not isinstance(job, tuple) else f"verify:{len(job[1])}" for job in jobs])
        return run_batch(jobs)

    service.batcher.run_batch = recorded
    verifier_pb2_grpc.add_VerifierServicer_to_server(service, runtime.server)
    port = await runtime.start()
    await service.load(target, device="cpu")
    return runtime, service, passes, f"127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _session(tiny_pair, tiny_target, text: str, verify_ahead: bool):
    """A greedy session on ``text`` over one Verify stream of a recording verifier (``_serve``):
    (the call, the prefill's tokens, the passes, the target's own greedy continuation)."""
    prompt = tiny_target.tokenizer(text)["input_ids"]
    reference = reference_greedy(tiny_target, prompt, NEW_TOKENS)
    runtime, service, passes, address = await serve_recording_verifier(str(tiny_pair[1]), verify_ahead=verify_ahead)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = verifier_pb2_grpc.VerifierStub(channel).Verify()
            params = convert.sampling_to_pb(SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            await call.write(verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(
                session_id="ahead", prompt_token_ids=prompt, sampling=params)))
            yield call, list((await call.read()).token_ids), passes, reference
            await call.done_writing()
    finally:
        await runtime.server.stop(0)


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def test_plain_rounds_after_an_ahead_pass_need_no_pass_and_blocks_feed_only_their_drafts(tiny_pair, tiny_target):
    async with _session(tiny_pair, tiny_target, "def add(a, b):", verify_ahead=True) as (call, tokens, passes,
                                                                                       reference):
        vocab = tiny_target.vocab_size
        aheads = 1  # the prefill's verdict sets off the first ahead pass

        def ahead_passes() -> int:
            return sum(kinds == ["PendingForward"] for kinds in passes)

        for round_number, k in enumerate([0, 0, 3, 0, 1, 0, 0], start=1):
            drafts = reference[len(tokens): len(tokens) + k]
            if k > 1:  # the last one wrong: a rejection, the cache rolled back
                drafts[-1] = (drafts[-1] + 1) % vocab
            await _until(lambda: ahead_passes() == aheads)
            before = len(passes)
            block = verifier_pb2.VerifyBlock(round=round_number, draft_token_ids=drafts)
            await call.write(verifier_pb2.VerifyRequest(block=block))
            tokens += (await call.read()).token_ids
            if not drafts:  # answered from the logits computed ahead (the next ahead pass may have started)
                assert all(kinds == ["PendingForward"] for kinds in passes[before:]), passes[before:]
                aheads += 1
                continue
            # one pass over the drafts alone (the pending token's row came from ahead), and after a
            # block with drafts nothing runs ahead: the next plain block takes a pass of its own
            assert passes[before:] == [[f"verify:{len(drafts)}"]], passes[before:]
            before = len(passes)
            await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=100 + round_number)))
            tokens += (await call.read()).token_ids
            assert passes[before] == ["verify:0"], passes[before:]
            aheads += 1
    assert tokens == reference[: len(tokens)] and len(tokens) >= 10


async def test_without_verify_ahead_every_round_is_its_own_pass(tiny_pair, tiny_target):
    async with _session(tiny_pair, tiny_target, "the quick brown", verify_ahead=False) as (call, tokens, passes,
                                                                                         reference):
        for round_number in range(1, 6):
            before = len(passes)
            await call.write(verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=round_number)))
            tokens += (await call.read()).token_ids
            assert passes[before:] == [["verify:0"]]
    assert tokens == reference[: len(tokens)]
