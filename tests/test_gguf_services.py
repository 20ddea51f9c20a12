"""The services on the gguf runtime (issue #43): a verifier on a tiny q4_1 GGUF, a drafter on its f32
sibling, a gateway; and `specdec up` on the embedded default, which picks the gguf runtime itself.

Through the services, greedy and seeded sampling decode exactly what the runtime decodes in-process;
the verifier admits no more sessions than its context has sequences, and refuses the next one as
overload, not as a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specdec.client import GatewayClient
from specdec.drafters import ModelDrafter
from specdec.engine import collect, run_sync
from specdec.gguf.runtime import SEQUENCES_ENV
from specdec.local import LocalEngine
from specdec.models import CACHE_ENV, load_model
from specdec.pass_options import RUNTIME_ENV
from specdec.wire_types import SamplingParams
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from tests.harness import Stack, health_status, start_service
from tests.test_gguf_runtime import gguf_env, tiny_gguf_files

PROMPTS = [
    "the quick brown fox",
    "def add(a, b):",
    "1 2 1 2 1 2 1 2 1 2 1 2",
    "the the the the the the the the",
    "lazy dog lazy dog lazy dog lazy",
]
NEW_TOKENS = 40
SEQUENCES = 2  # the verifier's context: at most this many sessions at once

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def environment(tmp_path_factory):
    env = gguf_env(tmp_path_factory)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.delenv(SEQUENCES_ENV, raising=False)
        yield env


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_gguf_files(tmp_path_factory)


@pytest.fixture(scope="module")
def target(files, environment):
    return load_model(str(files["q4_1"]), device="cpu", runtime="gguf")


@pytest.fixture(scope="module")
def stack(files, environment, tmp_path_factory):
    """Each service names the gguf runtime: the suite pins SPECDEC_RUNTIME=torch, which children inherit."""
    logs = tmp_path_factory.mktemp("gguf-services")
    env = {**environment, RUNTIME_ENV: "gguf"}
    verifier = start_service("verifier", ["--target", str(files["q4_1"]), "--runtime", "gguf"], logs,
                             env={**env, SEQUENCES_ENV: str(SEQUENCES)})
    drafter = start_service("drafter", ["--method", "model", "--draft-model", str(files["f32"])], logs, env=env)
    gateway = start_service("gateway", ["--target", str(files["q4_1"]), "--verifier", verifier.address,
                                        "--drafter", drafter.address], logs, env=env)
    stack = Stack(gateway, [verifier], [drafter])
    try:
        for service in stack.all:
            service.wait_serving()
        yield stack
    finally:
        stack.stop()


def in_process(lm, prompt_ids: list[int], params: SamplingParams, drafter=None, k: int = 0) -> list[int]:
    engine = LocalEngine(lm, drafter)
    return run_sync(collect(engine.stream(list(prompt_ids), params, num_draft_tokens=k))).token_ids


def assert_greedy_exact(stack, target, method: str, prompts: list[str] = PROMPTS) -> None:
    """Greedy completions through the gateway equal the runtime's own plain decoding."""
    drafted = accepted = 0
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for i, prompt in enumerate(prompts):
            k = (1, 3, 6)[i % 3]
            result = client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, method=method,
                                     num_draft_tokens=k)
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert result.token_ids == in_process(target, result.prompt_token_ids, params), prompt
            assert result.stats["draft_method"] == method
            if method == "none":  # one plain run: the verifier decoded every round after the first on its own
                assert result.stats["plain_runs"] == 1 and result.stats["plain_run_rounds"] == NEW_TOKENS - 2
            drafted += result.stats["draft_tokens"]
            accepted += result.stats["accepted_tokens"]
    if method != "none":  # drafts were verified, and some of them rejected
        assert 0 < drafted and accepted < drafted, (drafted, accepted)
    if method == "model":  # the f32 sibling often agrees with the q4_1 target
        assert accepted > drafted // 10, (drafted, accepted)


@pytest.mark.parametrize("method", ["model", "ngram", "none"])
def test_greedy_through_the_services_equals_in_process_gguf_decoding(method, stack, target):
    assert_greedy_exact(stack, target, method)


def test_seeded_sampling_through_the_services_equals_in_process_gguf_decoding(stack, target, files):
    """Every draw is keyed by (seed, position): a seeded request decodes the same tokens through the
    services as in this process, without drafts and with the same draft model's drafts."""
    draft = load_model(str(files["f32"]), device="cpu", runtime="gguf", sessions=1)
    accepted = 0
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for seed, prompt in enumerate(PROMPTS[:3]):
            params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=20, seed=seed, ignore_eos=True)
            kwargs = dict(prompt=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, top_k=20,
                          seed=seed)
            plain = client.generate(**kwargs, method="none")
            assert plain.stats["plain_runs"] == 1
            assert plain.token_ids == in_process(target, plain.prompt_token_ids, params)
            drafted = client.generate(**kwargs, method="model", num_draft_tokens=3)
            assert drafted.token_ids == in_process(target, drafted.prompt_token_ids, params, ModelDrafter(draft), 3)
            accepted += drafted.stats["accepted_tokens"]
    assert accepted > 0


def _verify_info(address: str) -> verifier_pb2.GetVerifierInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)


@contextlib.contextmanager
def sessions_held(verifier, count: int):
    """``count`` sessions opened on the verifier and held (each past its prefill) until the block ends,
    once the gateway's sessions of earlier requests have ended there."""
    _until_idle(verifier)
    release = threading.Event()

    def held(session_id: str):
        yield verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(session_id=session_id,
                                                                        prompt_token_ids=[5, 6, 7]))
        release.wait(30)

    with grpc.insecure_channel(verifier.address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        calls = [stub.Verify(held(f"held{i}"), timeout=60) for i in range(count)]
        try:
            for call in calls:
                assert len(next(call).token_ids) == 1
            yield stub
        finally:
            release.set()
            for call in calls:
                call.cancel()
    _until_idle(verifier)


def _until_idle(verifier, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _verify_info(verifier.address).load.active_sessions and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(scope="module")
def refusals(stack) -> tuple[grpc.RpcError, grpc.RpcError]:
    """With every sequence held: the verifier's answer to one more session, and the gateway's to a request."""
    with sessions_held(stack.verifiers[0], SEQUENCES) as stub:
        assert _verify_info(stack.verifiers[0].address).load.active_sessions == SEQUENCES
        with pytest.raises(grpc.RpcError) as direct:
            next(stub.Verify(iter([verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(
                session_id="one-too-many", prompt_token_ids=[5, 6, 7]))]), timeout=30))
        with GatewayClient(stack.gateway.address, timeout=30) as client, pytest.raises(grpc.RpcError) as through:
            client.generate(prompt=PROMPTS[0], max_new_tokens=4, method="none")
    return direct.value, through.value


def test_the_verifier_holds_as_many_sessions_as_its_context_has_sequences(stack, target, refusals):
    """SPECDEC_GGUF_SEQUENCES=2: the verifier reports (and admits) 2 sessions at once; one more is
    refused, and once they end their sequences serve the next sessions, exactly."""
    verifier = stack.verifiers[0]
    assert health_status(verifier.address) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(stack.gateway.address) == health_pb2.HealthCheckResponse.SERVING
    info = _verify_info(verifier.address)
    assert info.load.max_sessions == SEQUENCES and info.load.active_sessions == 0
    assert (info.model.vocab_size, list(info.model.eos_token_ids), info.model.tokenizer_fingerprint) == \
        (target.vocab_size, list(target.eos_token_ids), target.fingerprint)
    assert all(isinstance(refused, grpc.RpcError) for refused in refusals)
    assert_greedy_exact(stack, target, "model", PROMPTS[2:4])
    for service in stack.all:
        assert service.proc.poll() is None, service.log()


def test_a_session_past_the_context_s_sequences_is_refused_as_overload(stack, refusals):
    direct, through = refusals
    assert direct.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, direct.details()
    assert through.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, through.details()
    assert "Traceback" not in stack.verifiers[0].log()


@pytest.mark.embedded
def test_specdec_up_on_the_embedded_default_serves_it_on_gguf(monkeypatch, tmp_path):
    """`specdec up` with no runtime named: the verifier runs the embedded default on the gguf runtime
    (auto), and greedy decoding through the stack equals the gguf runtime's in-process decoding."""
    from specdec.stack import LocalStack

    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    monkeypatch.delenv(CACHE_ENV)  # the machine's cache: the embedded model's files are converted once there
    lm = load_model("embedded", device="cpu", runtime="gguf")
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log, LocalStack(["--target", "embedded", "--drafter-nice", "0", "--max-sessions", "4"],
                                              output=log) as address:
        with GatewayClient(address, timeout=120) as client:
            result = client.generate(messages=[("user", "Name three colors.")], max_new_tokens=24, ignore_eos=True,
                                     num_draft_tokens=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == in_process(lm, result.prompt_token_ids, params)
    assert result.stats["draft_tokens"] > 0
    assert "gguf runtime" in log_path.read_text()


async def test_a_session_started_as_another_closes_gets_its_sequence(files, monkeypatch):
    """One sequence, and the model thread busy while a session ends: its sequence goes back on that
    thread, after the pass in progress. A session started once the slot is free waits for that, not
    refused as if the context were full."""
    from specdec.rpc import convert
    from specdec.rpc.server import ServeOptions, ServiceRuntime
    from tests.harness import free_port
    from verifier_service.server import SERVICE_NAME, VerifierService

    monkeypatch.setenv(RUNTIME_ENV, "gguf")
    runtime = ServiceRuntime(SERVICE_NAME, ServeOptions(port=free_port()))
    service = VerifierService(runtime, max_sessions=1)
    verifier_pb2_grpc.add_VerifierServicer_to_server(service, runtime.server)
    port = await runtime.start()
    busy = threading.Event()
    try:
        await service.load(str(files["q4_1"]), device="cpu")
        assert service.lm.gguf is not None and service.lm.gguf.context.sequences == 1
        params = convert.sampling_to_pb(SamplingParams(max_new_tokens=8, ignore_eos=True))

        def start(session_id: str) -> verifier_pb2.VerifyRequest:
            return verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(
                session_id=session_id, prompt_token_ids=[5, 6, 7], sampling=params))

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            first = stub.Verify()
            await first.write(start("first"))
            assert len((await first.read()).token_ids) == 1
            # A pass that lasts until this test ends it: the first session's close queues behind it.
            service.executor.submit(busy.wait, 600)
            first.cancel()
            deadline = time.monotonic() + 60  # a hang guard, well inside the busy pass
            while len(service.sessions):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            # The first one's close is queued on the model thread (submitted as it left the sessions);
            # what the model thread is given next is the second session's making.
            queued = []
            submit = service.executor.submit
            monkeypatch.setattr(service.executor, "submit", lambda fn, *args: (queued.append(fn), submit(fn, *args))[1])
            second = stub.Verify()
            await second.write(start("second"))
            deadline = time.monotonic() + 60  # until the start has reached the model thread's queue (or failed)
            while not queued and not second.done():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            busy.set()
            assert len((await second.read()).token_ids) == 1
            await second.done_writing()
    finally:
        busy.set()
        await runtime.server.stop(0)


def test_concurrent_long_prompts_decode_what_each_decodes_alone(stack, target):
    """Two sessions at once with prompts past 64 tokens: the verifier prefills them in chunks beside
    each other's rounds, and each still decodes exactly what it decodes alone in this process
    (``MAX_TOKENS_PER_DECODE``: llama.cpp's rows do not depend on how a prompt was split)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) * 4 for i in range(4)]

    def one(prompt: str):
        with GatewayClient(stack.gateway.address, timeout=60) as client:
            return client.generate(prompt=prompt, max_new_tokens=24, ignore_eos=True, method="none")

    with ThreadPoolExecutor(SEQUENCES) as pool:
        results = list(pool.map(one, prompts))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for result in results:
        assert len(result.prompt_token_ids) > 100
        assert result.token_ids == in_process(target, result.prompt_token_ids, params)
