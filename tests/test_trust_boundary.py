"""The drafter and verifier as an untrusted client finds them (issue #29): raw streams on loopback,
no gateway in between. Malformed draft distributions are refused naming the field and leave
nothing behind; the verifier enforces its own limits (max_new_tokens, sessions per client host,
session ids, context) whatever the caller asks; cancels only reach the caller's own sessions;
cancelled streams log no unretrieved task exceptions; models whose cache cannot roll back are
refused at load; and real sampled drafts still pass through the real gateway."""

from __future__ import annotations

import queue
import socket
import time

import grpc
import pytest
import torch

from specdec.client import GatewayClient
from specdec.rpc.server import error_field
from specdec.wire_types import DraftProposal, SparseDistribution
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, types_pb2, verifier_pb2, verifier_pb2_grpc
from tests.harness import scrape_metric, start_service
from tests.test_services import active_sessions
from tests.tiny_models import build_noisy_copy

CAP = 64  # the verifier's --max-new-tokens-cap here
MAX_SESSIONS, PER_PEER = 4, 2


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


IPV6 = _ipv6_loopback()
# Channels of one process to one address share a connection (gRPC's global subchannel pool), hence
# one context.peer(); this option gives a channel its own connection: another peer (another port).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Raw:
    """One raw bidirectional stream (sync gRPC): ``ask`` sends a message and reads one answer."""

    def __init__(self, method, timeout: float = 30) -> None:
        self._requests: queue.Queue = queue.Queue()
        self.call = method(iter(self._requests.get, None), timeout=timeout)

    def ask(self, message):
        self._requests.put(message)
        return next(self.call)

    def close(self) -> None:
        self._requests.put(None)  # half-close: the service ends the session
        for _ in self.call:
            pass


def wait_idle(address: str, role: str, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := active_sessions(address, role)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def start(session_id: str = "", prompt=(5, 6, 7), **sampling) -> verifier_pb2.VerifyRequest:
    sampling = {"temperature": 1.0, "seed": 1, "max_new_tokens": 32, **sampling}
    return verifier_pb2.VerifyRequest(start=verifier_pb2.VerifyStart(
        session_id=session_id, prompt_token_ids=list(prompt), sampling=types_pb2.SamplingParams(**sampling)))


def block(tokens, probs=None) -> verifier_pb2.VerifyRequest:
    """``probs``: one (ids, probs) pair per draft, or None (one-hot q)."""
    dists = [types_pb2.SparseDistribution(token_ids=ids, probs=ps) for ids, ps in probs or []]
    return verifier_pb2.VerifyRequest(block=verifier_pb2.VerifyBlock(round=1, draft_token_ids=list(tokens),
                                                                     draft_probs=dists))


def draft_start(session_id: str = "", prompt=(5, 6, 7)) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(
        session_id=session_id, prompt_token_ids=list(prompt),
        sampling=types_pb2.SamplingParams(temperature=1.0, seed=1, max_new_tokens=32)))


def propose(committed=(), k: int = 2) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(round=1, committed_token_ids=list(committed),
                                                                     num_draft_tokens=k))


@pytest.fixture(scope="module")
def noisy(tiny_pair, tmp_path_factory):
    return build_noisy_copy(tmp_path_factory.mktemp("trust-noisy") / "draft", tiny_pair[1], noise_std=0.3)


@pytest.fixture(scope="module")
def services(tiny_pair, noisy, tmp_path_factory):
    logs = tmp_path_factory.mktemp("trust")
    host = ["--host", "[::]"] if IPV6 else []  # dual stack: 127.0.0.1 and ::1 are two client hosts
    verifier = start_service("verifier", ["--target", str(tiny_pair[1]), "--max-new-tokens-cap", str(CAP),
                                          "--max-sessions", str(MAX_SESSIONS),
                                          "--max-sessions-per-peer", str(PER_PEER), *host], logs)
    drafter = start_service("drafter", ["--method", "model", "--draft-model", str(noisy)], logs, metrics=True)
    try:
        verifier.wait_serving()
        drafter.wait_serving()
        yield verifier, drafter
    finally:
        verifier.stop()
        drafter.stop()


@pytest.fixture
def verifier(services):
    v = services[0]
    assert wait_idle(v.address, "verifier") == 0
    with grpc.insecure_channel(v.address) as channel:
        yield v, verifier_pb2_grpc.VerifierStub(channel)
    assert wait_idle(v.address, "verifier") == 0, "a session leaked"


@pytest.fixture
def drafter(services):
    d = services[1]
    with grpc.insecure_channel(d.address) as channel:
        yield d, drafter_pb2_grpc.DrafterStub(channel)
    assert wait_idle(d.address, "drafter") == 0, "a session leaked"


D = 9  # the draft token of the malformed blocks
MALFORMED_Q = [
    ("sum 7.3", [D], [([D, 10], [7.0, 0.3])], "draft_probs[0].probs: sum 7.3"),
    ("sums overflow fp32", [D], [([D, 10], [3e38, 3e38])], "draft_probs[0].probs: sum 6e+38"),
    ("sum below 1", [D, D], [([D], [1.0]), ([D, 10], [0.25, 0.25])], "draft_probs[1].probs: sum 0.5"),
    ("repeated id", [D], [([D, D], [0.5, 0.5])], "draft_probs[0].token_ids: repeated id"),
    ("draft token missing from its q", [D], [([10, 11], [0.5, 0.5])], "draft_probs[0]: draft token 9"),
    ("draft token with q = 0", [D], [([D, 10], [0.0, 1.0])], "draft_probs[0]: draft token 9"),
    ("support id outside the vocabulary", [D], [([D, 10**6], [0.5, 0.5])], "draft_probs[0].token_ids: id 1000000"),
    ("nan", [D], [([D, 10], [float("nan"), 1.0])], "draft_probs[0].probs: not finite"),
    ("inf", [D], [([D], [float("inf")])], "draft_probs[0].probs: not finite"),
    ("negative", [D], [([D, 10], [1.5, -0.5])], "draft_probs[0].probs: negative"),
    ("fewer q than drafts", [D, D], [([D], [1.0])], "draft_probs: 1 distributions for 2 draft tokens"),
    ("ids and probs differ in length", [D], [([D, 10], [1.0])], "draft_probs[0]: need as many probs"),
    ("empty support", [D], [([], [])], "draft_probs[0]: need as many probs"),
    ("draft id outside the vocabulary", [10**6], None, "draft_token_ids: id 1000000"),
    ("too many drafts", [D] * 33, None, "draft_token_ids: 33 drafts"),
]


@pytest.mark.parametrize("name,tokens,probs,field", MALFORMED_Q, ids=[m[0] for m in MALFORMED_Q])
def test_malformed_q_is_invalid_argument_naming_the_field(verifier, name, tokens, probs, field):
    _, stub = verifier
    stream = Raw(stub.Verify)
    assert len(stream.ask(start(f"bad-q-{name}")).token_ids) == 1
    with pytest.raises(grpc.RpcError) as info:
        stream.ask(block(tokens, probs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details(), info.value.details()
    assert error_field(info.value) == field.split(":")[0]  # the field travels as data, not only as text
    # The stream is gone with its session (the fixture checks active sessions return to 0) and a
    # fresh session verifies a well-formed block of the same shape.
    fresh = Raw(stub.Verify)
    fresh.ask(start(f"good-q-{name}"))
    verdict = fresh.ask(block([D], [([D, 10], [0.75, 0.25])]))
    assert verdict.num_drafts == 1 and 1 <= len(verdict.token_ids) <= 2
    fresh.close()


def test_a_refused_block_leaves_the_session_untouched(tiny_target):
    """Validation runs before anything of the block is applied: the same session, refused a block,
    decides the next one exactly as a session that never saw it."""
    from specdec.rpc import convert
    from specdec.wire_types import SamplingParams
    from specdec.verification import TargetSession, check_draft_probs
    from specdec.wire_types import FieldError

    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=16)
    refused, clean = TargetSession(tiny_target, [5, 6, 7], params), TargetSession(tiny_target, [5, 6, 7], params)
    assert refused.prefill() == clean.prefill()
    tokens, cached = list(refused.tokens), list(refused.kv.cached_tokens)
    with pytest.raises(FieldError, match=r"draft_probs\[0\]\.probs: sum 7\.3") as refusal:
        check_draft_probs(convert.proposal_from_pb(block([D], [([D, 10], [7.0, 0.3])]).block))
    assert refusal.value.field == "draft_probs[0].probs"
    assert refused.tokens == tokens and refused.kv.cached_tokens == cached
    good = convert.proposal_from_pb(block([D], [([D, 10], [0.75, 0.25])]).block)
    assert refused.verify(good) == clean.verify(good)


def test_a_tiny_but_well_formed_q_is_legal(verifier):
    """No floor under q(draft token): a real sampler's top-K support keeps denormal entries and can
    draw them (see verification.check_draft_probs); such a q is well formed and verified."""
    _, stub = verifier
    stream = Raw(stub.Verify)
    stream.ask(start("tiny-q"))
    verdict = stream.ask(block([D], [([D, 10], [1e-45, 1.0])]))
    assert verdict.num_drafts == 1
    stream.close()


def test_max_new_tokens_is_enforced_on_a_raw_stream(verifier):
    _, stub = verifier
    for temperature in (0.0, 1.0):
        stream = Raw(stub.Verify)
        committed = list(stream.ask(start(f"two-{temperature}", max_new_tokens=2, temperature=temperature)).token_ids)
        # Ten drafts after one generated token: only the first draft is verified (a verdict never
        # commits past max_new_tokens) ...
        verdict = stream.ask(block([D] * 10))
        assert verdict.num_drafts <= 1 and len(verdict.token_ids) == 1
        committed += verdict.token_ids
        assert len(committed) == 2 and verdict.committed_length == 3 + 2
        # ... and then no further block, drafts or not.
        with pytest.raises(grpc.RpcError) as info:
            stream.ask(block([]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_new_tokens" in info.value.details()


def test_the_verifier_caps_max_new_tokens_whatever_the_caller_asks(verifier):
    _, stub = verifier
    with pytest.raises(grpc.RpcError) as info:
        Raw(stub.Verify).ask(start("greedy-asker", max_new_tokens=CAP + 1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.max_new_tokens" in info.value.details() and str(CAP) in info.value.details()
    # Unset, the default fits under the cap; a session generates at most CAP tokens in all.
    stream = Raw(stub.Verify)
    generated = len(stream.ask(start("free-runner", max_new_tokens=CAP, temperature=0.0)).token_ids)
    with pytest.raises(grpc.RpcError) as info:
        while True:
            generated += len(stream.ask(block([])).token_ids)
    assert "max_new_tokens" in info.value.details() and generated == CAP


def test_sessions_per_client_host(verifier):
    v, stub = verifier
    port = v.address.rpartition(":")[2]
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=OWN_CONNECTION) for _ in range(PER_PEER + 1)]
    try:
        streams = []
        for i, channel in enumerate(channels[:PER_PEER]):  # separate connections (ports), one host
            streams.append(Raw(verifier_pb2_grpc.VerifierStub(channel).Verify))
            streams[-1].ask(start(f"hog-{i}"))
        with pytest.raises(grpc.RpcError) as info:
            Raw(verifier_pb2_grpc.VerifierStub(channels[-1]).Verify).ask(start("hog-extra"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per client" in info.value.details()
        if IPV6:  # another host still gets a session
            with grpc.insecure_channel(f"[::1]:{port}") as other:
                stream = Raw(verifier_pb2_grpc.VerifierStub(other).Verify)
                assert len(stream.ask(start("other-host")).token_ids) == 1
                stream.close()
        for stream in streams:
            stream.close()
    finally:
        for channel in channels:
            channel.close()


def test_a_cancel_from_another_peer_does_nothing(verifier, drafter):
    v, stub = verifier
    d, draft_stub = drafter
    with grpc.insecure_channel(v.address, options=OWN_CONNECTION) as other_v, \
            grpc.insecure_channel(d.address, options=OWN_CONNECTION) as other_d:
        thief, draft_thief = verifier_pb2_grpc.VerifierStub(other_v), drafter_pb2_grpc.DrafterStub(other_d)
        stream = Raw(stub.Verify)
        stream.ask(start("victim"))
        drafting = Raw(draft_stub.Draft)
        assert drafting.ask(draft_start("victim")).started.session_id == "victim"

        def refusal(call) -> tuple:
            with pytest.raises(grpc.RpcError) as info:
                call()
            return info.value.code(), info.value.details()

        stolen = refusal(lambda: thief.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id="victim"), timeout=5))
        stolen_d = refusal(lambda: draft_thief.CancelDraft(drafter_pb2.CancelDraftRequest(session_id="victim"),
                                                           timeout=5))
        # Both sessions live on, and serve their owner.
        assert active_sessions(v.address, "verifier") == 1 and active_sessions(d.address, "drafter") == 1
        assert stream.ask(block([])).token_ids
        assert drafting.ask(propose([1], 2)).proposal.draft_token_ids
        # Another client may open a session of the same id (not told that the id is taken); its cancel
        # ends its own session only.
        twin = Raw(draft_thief.Draft)
        assert twin.ask(draft_start("victim")).started.session_id == "victim"
        draft_thief.CancelDraft(drafter_pb2.CancelDraftRequest(session_id="victim"), timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            next(twin.call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert drafting.ask(propose([2], 2)).proposal.draft_token_ids
        # The owner's own cancel ends them (same channel, same peer).
        stub.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id="victim"), timeout=5)
        draft_stub.CancelDraft(drafter_pb2.CancelDraftRequest(session_id="victim"), timeout=5)
        for raw in (stream, drafting):
            with pytest.raises(grpc.RpcError) as info:
                next(raw.call)
            assert info.value.code() == grpc.StatusCode.CANCELLED
        assert wait_idle(v.address, "verifier") == 0 and wait_idle(d.address, "drafter") == 0
        # What the other peer was told is exactly what an unknown session gets: nothing leaks.
        gone = refusal(lambda: thief.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id="victim"), timeout=5))
        gone_d = refusal(lambda: draft_thief.CancelDraft(drafter_pb2.CancelDraftRequest(session_id="victim"),
                                                         timeout=5))
        assert stolen == gone and stolen[0] == grpc.StatusCode.NOT_FOUND
        assert stolen_d == gone_d and stolen_d[0] == grpc.StatusCode.NOT_FOUND


def test_session_ids_are_bounded(verifier, drafter):
    _, stub = verifier
    _, draft_stub = drafter
    huge = "x" * (3 * 1024 * 1024)
    for session_id in (huge, "y" * 129):
        for ask in (lambda: Raw(stub.Verify).ask(start(session_id)),
                    lambda: Raw(draft_stub.Draft).ask(draft_start(session_id)),
                    lambda: stub.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id=session_id), timeout=10),
                    lambda: draft_stub.CancelDraft(drafter_pb2.CancelDraftRequest(session_id=session_id), timeout=10)):
            with pytest.raises(grpc.RpcError) as info:
                ask()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in info.value.details()
    stream = Raw(stub.Verify)
    assert stream.ask(start("z" * 128)).token_ids
    stream.close()


def test_the_drafter_bounds_a_session_to_its_context(drafter, noisy):
    from transformers import AutoConfig

    service, stub = drafter
    context = AutoConfig.from_pretrained(noisy).max_position_embeddings  # 1024
    with pytest.raises(grpc.RpcError) as info:
        Raw(stub.Draft).ask(draft_start("long-prompt", prompt=[5] * context))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in info.value.details()
    stream = Raw(stub.Draft)
    stream.ask(draft_start("grower", prompt=[5] * 10))
    # Up to the context: drafts are cut to what still fits ("up to k").
    proposal = stream.ask(propose([7] * (context - 10 - 4), 8)).proposal
    assert len(proposal.draft_token_ids) == 4
    # Past it: refused before any work, so no forward pass ran for it (the pass count is updated
    # before a pass's answers are sent, so the one above is already counted).
    passes = 'specdec_batch_size_count{role="drafter"}'
    before = scrape_metric(service, passes)
    with pytest.raises(grpc.RpcError) as info:
        stream.ask(propose([7] * 8000, 2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "committed_token_ids" in info.value.details() and str(context) in info.value.details()
    assert scrape_metric(service, passes) == before


def test_cancelled_streams_leave_no_unretrieved_task_exception(verifier, drafter):
    v, stub = verifier
    d, draft_stub = drafter
    for i in range(6):
        stream = Raw(stub.Verify)
        stream.ask(start(f"cut-{i}"))
        stream.call.cancel()  # the client goes away mid-session
        drafting = Raw(draft_stub.Draft)
        drafting.ask(draft_start(f"cut-{i}"))
        drafting.call.cancel()
    for i in range(2):  # ended out of band and by an error
        stream = Raw(stub.Verify)
        stream.ask(start(f"oob-{i}"))
        stub.CancelVerify(verifier_pb2.CancelVerifyRequest(session_id=f"oob-{i}"), timeout=5)
        with pytest.raises(grpc.RpcError):
            next(stream.call)
        stream = Raw(stub.Verify)
        stream.ask(start(f"err-{i}"))
        with pytest.raises(grpc.RpcError):
            stream.ask(block([10**6]))
    assert wait_idle(v.address, "verifier") == 0 and wait_idle(d.address, "drafter") == 0
    time.sleep(0.5)
    # More traffic, so that the event loops run (and collect) what the cancelled streams left behind.
    stream = Raw(stub.Verify)
    stream.ask(start("after"))
    stream.close()
    for service in (v, d):
        log = service.log()
        assert "never retrieved" not in log and "StopAsyncIteration" not in log, log[-3000:]


def test_legit_sampled_drafts_pass_validation_through_the_gateway(services, tiny_pair, tmp_path):
    verifier, drafter = services
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", verifier.address,
                                        "--drafter", drafter.address, "--max-new-tokens-cap", str(CAP)], tmp_path)
    try:
        gateway.wait_serving()
        drafted = accepted = 0
        with GatewayClient(gateway.address, timeout=60) as client:
            for i, (temperature, top_p) in enumerate([(1.0, None), (0.7, 0.9), (0.05, None), (1.5, None)]):
                result = client.generate(prompt=f"the quick brown fox {i}", max_new_tokens=CAP, ignore_eos=True,
                                         method="model", num_draft_tokens=4, temperature=temperature, top_p=top_p,
                                         seed=i)
                assert len(result.token_ids) == CAP
                assert result.stats["draft_method"] == "model"
                drafted += result.stats["draft_tokens"]
                accepted += result.stats["accepted_tokens"]
        assert drafted > 0 and accepted > 0
        assert "drafter failed" not in gateway.log() and "INVALID_ARGUMENT" not in gateway.log()
    finally:
        gateway.stop()
        assert wait_idle(verifier.address, "verifier") == 0


class _MalformedQDrafter:
    """A drafter link whose every proposal carries a q that does not sum to 1 (a buggy drafter)."""

    concurrent = reads_features = holds_features = False

    def __init__(self) -> None:
        self.proposals = 0

    async def propose(self, committed, num_draft_tokens):
        self.proposals += 1
        return DraftProposal([D], [SparseDistribution([D, 10], [7.0, 0.3])])


def test_a_drafter_s_malformed_q_is_refused_by_the_verifier_and_the_request_goes_on_exactly(services, tiny_pair):
    """The gateway relays q unread: the verifier refuses the block (INVALID_ARGUMENT naming
    draft_probs[0].probs, as data in the status); the gateway's verifier link takes that as the
    drafter's fault, reopens the session on the same replica and verifies no more of its drafts, so
    the client gets exactly the tokens of plain decoding and the replica is never blamed."""
    import asyncio

    from gateway.migration import MigratingVerifier
    from gateway.pools import ReplicaPool
    from specdec.completion import CompletionBuilder
    from specdec.engine import collect, generate
    from specdec.policy import FixedDraftLength
    from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES
    from specdec.tokenizer import ServingTokenizer
    from specdec.wire_types import SamplingParams

    tokenizer = ServingTokenizer.from_directory(tiny_pair[1])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)

    async def run(drafter):
        pool = ReplicaPool("verifier", verifier_pb2_grpc.VerifierStub, DEFAULT_MAX_MESSAGE_BYTES)
        pool.set_addresses([services[0].address])
        await pool.refresh()
        replica = pool.replicas[0]
        verifier = MigratingVerifier(pool, replica, f"q-{drafter is None}", [5, 6, 7], params, lambda: None)
        try:
            result = await collect(generate(prompt_tokens=3, completion=CompletionBuilder(tokenizer, params),
                                            verifier=verifier, drafter=drafter, policy=FixedDraftLength(1)))
        finally:
            await verifier.close()
            await replica.channel.close()
        return result, verifier

    buggy = _MalformedQDrafter()
    refused, link = asyncio.run(run(buggy))
    plain, _ = asyncio.run(run(None))
    assert link.q_refused == "draft_probs[0].probs" and link.migrations == 0
    assert buggy.proposals > 1 and refused.stats.accepted_tokens == 0  # later blocks went without its drafts
    assert refused.token_ids == plain.token_ids
    assert wait_idle(services[0].address, "verifier") == 0


def test_a_verifier_s_refusal_keeps_its_field_through_the_gateway(services, tiny_pair, tmp_path):
    """The gateway allows more new tokens than the verifier's cap: the verifier refuses the session
    (INVALID_ARGUMENT naming sampling.max_new_tokens) and the gateway's client gets that status with
    the field still named as data, from the verifier's status across the hop."""
    verifier, drafter = services
    gateway = start_service("gateway", ["--target", str(tiny_pair[1]), "--verifier", verifier.address,
                                        "--max-new-tokens-cap", str(4 * CAP)], tmp_path)
    try:
        gateway.wait_serving()
        with GatewayClient(gateway.address, timeout=60) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate(prompt="the quick brown fox", max_new_tokens=2 * CAP)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("downstream: sampling.max_new_tokens"), info.value.details()
        assert error_field(info.value) == "sampling.max_new_tokens"
    finally:
        gateway.stop()
        assert wait_idle(verifier.address, "verifier") == 0


def _tiny_sliding_window_model(directory, tokenizer_dir):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           sliding_window=16)
    MistralForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def test_models_whose_cache_cannot_roll_back_are_refused_at_load(tiny_pair, tmp_path):
    from transformers import MambaConfig, MistralConfig, Qwen2Config

    from specdec.models import ModelLoadError, check_rollback, load_model

    sliding = _tiny_sliding_window_model(tmp_path / "sliding", tiny_pair[0])
    with pytest.raises(ModelLoadError, match="sliding-window attention.*16 < the context of 1024"):
        load_model(str(sliding), device="cpu")
    with pytest.raises(ModelLoadError, match="recurrent"):
        check_rollback(MambaConfig(num_hidden_layers=1), "mamba")
    with pytest.raises(ModelLoadError, match="layer 0 uses sliding_attention"):
        check_rollback(Qwen2Config(num_hidden_layers=1, use_sliding_window=True, sliding_window=16,
                                   max_window_layers=0), "qwen2")
    check_rollback(Qwen2Config(num_hidden_layers=1), "qwen2")  # sliding_window set, but not used
    check_rollback(MistralConfig(num_hidden_layers=1, sliding_window=4096, max_position_embeddings=1024))  # never full
    # A service given one exits with the reason.
    service = start_service("verifier", ["--target", str(sliding)], tmp_path, name="sliding-verifier")
    assert service.proc.wait(120) != 0
    assert "cannot serve speculative decoding" in service.log()


def test_a_failed_single_session_forward_rolls_its_cache_back(tiny_target, monkeypatch):
    from specdec.kv import KVSession

    session, reference = KVSession(tiny_target), KVSession(tiny_target)
    session.forward([5, 6, 7, 8], 1)
    last = len(tiny_target.model.model.layers) - 1

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    if tiny_target.lean is not None:  # the lean runtime's single-session pass: the last layer's first product fails
        backend, products = tiny_target.lean.plan.backend(2), []
        multiply = backend.mm_numpy

        def failing(x, handle):
            products.append(x.shape)
            return broken() if len(products) == 4 * last + 1 else multiply(x, handle)

        monkeypatch.setattr(backend, "mm_numpy", failing)
    else:
        monkeypatch.setattr(tiny_target.model.model.layers[last], "forward", broken)  # the first layers grow
    with pytest.raises(RuntimeError, match="device lost"):
        session.forward([5, 6, 7, 8, 9, 10], 2)
    monkeypatch.undo()
    assert session.cached_tokens == [5, 6, 7, 8]
    assert all(layer.get_seq_length() == 4 for layer in session.cache.layers)
    assert torch.allclose(session.forward([5, 6, 7, 8, 9, 10], 2), reference.forward([5, 6, 7, 8, 9, 10], 2),
                          atol=1e-5)
