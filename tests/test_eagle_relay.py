"""The EAGLE feature relay (verifier -> gateway -> drafter), bounded and overflow-free.

A session that drafts nothing for a long stretch keeps at most one message of features in the
gateway and its next proposal fits the message limit (a wide target, real services on loopback);
the drafter then starts afresh at the window, exactly as a windowed prefill would. Features of a
bf16 target past float16's range cross the wire finite and the request stays exact; a malformed
feature payload ends that request's drafting only, never the verifier replica. The drafter reads
only its target's embedding and LM head rows, not the whole model."""

from __future__ import annotations

import re
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.links import RemoteDrafter, RemoteVerifier
from specdec.client import GatewayClient
from specdec.completion import CompletionBuilder
from specdec.eagle.drafter import EagleDrafter
from specdec.eagle.head import EagleHead
from specdec.engine import collect, generate, run_sync
from specdec.local import LocalEngine
from specdec.models import load_model
from specdec.policy.base import DraftLengthPolicy
from specdec.rpc import convert
from specdec.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from specdec.wire_types import SamplingParams
from specdec.target_features import TargetFeatures, decode_features
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.verification import TargetSession
from tests.harness import Service, start_service

WIDE = 2048  # 2 000 positions of features: 8 MB, twice the default message limit
STRETCH = 2000  # rounds that draft nothing
MARK = [7, 7, 7, 7]  # a prompt starting so gets a malformed feature payload from the proxy verifier


def build_llama(directory: Path, tokenizer_dir: Path, *, hidden: int, layers: int = 1, tie: bool = False,
                embedding_scale: float = 1.0, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random Llama of width ``hidden`` with small attention and MLP (2 heads of 16, 64 wide), so a
    wide target stays cheap; ``embedding_scale`` makes its residual stream (its features) that large."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
                         initializer_range=0.25, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def build_head(directory: Path, target_dir: Path) -> Path:
    """An untrained EAGLE head for the target (warm-started from its last layer): it drafts, and
    what it drafts does not matter here (the verifier decides)."""
    if not (directory / "config.json").exists():
        target = load_model(str(target_dir), device="cpu", runtime="hf")
        EagleHead.from_target(target, list(range(target.vocab_size))).save(directory)
    return directory


class DraftAfterStretch(DraftLengthPolicy):
    """Drafts nothing for ``stretch`` rounds (plain decoding: a token each), then 3 a round."""

    def __init__(self, stretch: int) -> None:
        self.stretch, self.rounds = stretch, 0

    def choose(self, max_k: int) -> int:
        return 0 if self.rounds < self.stretch else min(3, max_k)

    def observe(self, outcome) -> None:
        self.rounds += 1


@pytest.fixture(scope="module")
def wide(tiny_pair, tmp_path_factory):
    """A verifier and an eagle drafter over a 2048-wide target."""
    root = tmp_path_factory.mktemp("wide")
    target_dir = build_llama(root / "target", tiny_pair[0], hidden=WIDE)
    head_dir = build_head(root / "head", target_dir)
    logs = tmp_path_factory.mktemp("wide-logs")
    verifier = start_service("verifier", ["--target", str(target_dir)], logs)
    drafter = start_service("drafter", ["--method", "eagle", "--draft-model", str(head_dir), "--target", str(target_dir)],
                            logs)
    try:
        verifier.wait_serving()
        drafter.wait_serving()
        yield target_dir, verifier, drafter
    finally:
        verifier.stop()
        drafter.stop()


def test_a_stretch_without_drafts_keeps_the_relay_bounded_and_the_next_proposal_fits(wide, monkeypatch):
    """2 000 rounds at k = 0 (the policy finds plain decoding wins) on a 2048-wide target: the
    features the gateway holds for the drafter never pass the message limit, every message to the
    drafter fits it, and the first proposal after the stretch drafts (the drafter's stream lives on,
    from the window of the newest features) while the output stays the target's."""
    target_dir, verifier, drafter = wide
    import gateway.links as links

    sizes = []
    write = links._write

    async def recorded(call, message, delay_s=0.0):
        if isinstance(message, drafter_pb2.DraftRequest):
            sizes.append(message.ByteSize())
        await write(call, message, delay_s)

    monkeypatch.setattr(links, "_write", recorded)
    target = load_model(str(target_dir))
    prompt = [5, 17, 33, 2, 9, 41]
    params = SamplingParams(max_new_tokens=STRETCH + 24, ignore_eos=True)
    held = []

    async def run():
        options = channel_options()
        async with grpc.aio.insecure_channel(verifier.address, options=options) as v_channel, \
                grpc.aio.insecure_channel(drafter.address, options=options) as d_channel:
            remote_verifier = RemoteVerifier(verifier_pb2_grpc.VerifierStub(v_channel), uuid.uuid4().hex, prompt, params,
                                             120.0, want_features=True)
            remote_drafter = RemoteDrafter(drafter_pb2_grpc.DrafterStub(d_channel), uuid.uuid4().hex, prompt, params,
                                           lambda: 120.0, reads_features=True)
            add = remote_drafter.add_features

            def add_and_measure(features):
                add(features)
                held.append(remote_drafter.feature_bytes_held)

            remote_drafter.add_features = add_and_measure
            try:
                events = generate(prompt_tokens=len(prompt),
                                  completion=CompletionBuilder(target.tokenizer, params, target.eos_token_ids),
                                  verifier=remote_verifier, drafter=remote_drafter,
                                  policy=DraftAfterStretch(STRETCH), draft_method="eagle")
                return await collect(events), remote_drafter.broken
            finally:
                await remote_drafter.close()
                await remote_verifier.close()

    result, broken = run_sync(run())
    assert broken is None
    assert result.stats.draft_tokens > 0  # drafting resumed after the stretch, on the same stream
    assert len(held) > STRETCH and max(held) <= DEFAULT_MAX_MESSAGE_BYTES
    assert sizes and max(sizes) <= DEFAULT_MAX_MESSAGE_BYTES
    assert max(sizes) > DEFAULT_MAX_MESSAGE_BYTES // 2  # the proposal after the stretch carried a full window
    alone = run_sync(collect(LocalEngine(target).stream(prompt, params)))
    assert result.token_ids == alone.token_ids


def test_the_drafter_takes_a_window_past_its_history_as_a_fresh_start(wide, tiny_target, tmp_path):
    """Features that start past what the drafter holds (the relay dropped those between) are not an
    error: the drafter drafts from them, exactly as a session that only ever got that window."""
    target_dir, _, drafter = wide
    with grpc.insecure_channel(drafter.address, options=channel_options()) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        start = drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(session_id="jump", prompt_token_ids=[5, 6, 7]))

        def propose(start_position: int, rows: int, committed):
            features = convert.features_to_pb(TargetFeatures(start_position, torch.randn(rows, WIDE)))
            return drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(
                round=1, committed_token_ids=list(committed), num_draft_tokens=2, target_features=features))

        answers = list(stub.Draft(iter([start, propose(0, 3, (8,)), propose(5, 2, (9, 10, 11, 12))]), timeout=30))
        assert [len(a.proposal.draft_token_ids) for a in answers[1:]] == [2, 2]
    # In process, on the tiny target: the drafts after a jump are those of a session fed the window alone.
    head_dir = build_head(tmp_path / "head", Path(tiny_target.name))
    eagle = EagleDrafter.load(head_dir, tiny_target)
    params = SamplingParams(max_new_tokens=16)
    tokens = [5, 17, 33, 2, 9, 41, 7, 12, 90, 4]
    window = TargetSession(tiny_target, tokens, params, want_features=True).prefill().features  # positions 0 .. 9
    jumped, fresh = eagle.start(tokens[:3], params), eagle.start(tokens, params)
    jumped.add_features(TargetFeatures(0, window.values[:2]))
    jumped.extend([tokens[3]])
    assert len(jumped.propose(3)) == 3
    jumped.extend(tokens[4:])
    jumped.add_features(TargetFeatures(6, window.values[6:9]))  # positions 4 and 5 never arrive
    fresh.add_features(TargetFeatures(6, window.values[6:9]))
    assert jumped.propose(3).draft_tokens == fresh.propose(3).draft_tokens


def test_bf16_features_past_float16_range_cross_the_wire_unchanged(tiny_pair, tmp_path):
    """A bf16 target whose residual stream passes 65 504 (float16's largest value): its verdict's
    features arrive at the drafter finite and bit-equal to the target's."""
    target_dir = build_llama(tmp_path / "loud", tiny_pair[0], hidden=64, layers=2, embedding_scale=1e6,
                             dtype=torch.bfloat16)
    target = load_model(str(target_dir), dtype=torch.bfloat16, runtime="hf")
    session = TargetSession(target, [5, 17, 33, 2, 9], SamplingParams(max_new_tokens=8), want_features=True)
    verdict = session.prefill()
    assert verdict.features.values.float().abs().max() > 65504
    response = verifier_pb2.VerifyResponse(**convert.verdict_fields(verdict))
    relayed = convert.verdict_from_pb(verifier_pb2.VerifyResponse.FromString(response.SerializeToString())).features
    arrived = decode_features(convert.encoded_features_from_pb(convert.features_to_pb(relayed)), "target_features", 64)
    assert torch.isfinite(arrived.values).all()
    assert torch.equal(arrived.values, verdict.features.values.to(torch.bfloat16))


class MalformingVerifier(verifier_pb2_grpc.VerifierServicer):
    """A proxy verifier: passes everything on, but a session whose prompt starts with ``MARK`` gets
    its first round's features as NaNs (a verifier bug, or a bad payload on the way)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    def Verify(self, request_iterator, context):
        marked = []

        def requests():
            for request in request_iterator:
                if request.WhichOneof("kind") == "start":
                    marked.append(list(request.start.prompt_token_ids[:len(MARK)]) == MARK)
                yield request

        for index, response in enumerate(self.stub.Verify(requests(), timeout=context.time_remaining())):
            if marked and marked[0] and index == 1 and response.HasField("features"):
                response.features.bf16_data = b"\xc0\x7f" * (len(response.features.bf16_data) // 2)  # bf16 NaN
            yield response

    def GetInfo(self, request, context):
        return self.stub.GetInfo(request, timeout=context.time_remaining())

    def CancelVerify(self, request, context):
        return self.stub.CancelVerify(request, timeout=context.time_remaining())


@pytest.fixture(scope="module")
def loud(tiny_pair, tmp_path_factory):
    """A bf16 target with features past float16's range behind a proxy verifier, its eagle drafter
    and a gateway: (the gateway, the target's directory)."""
    root = tmp_path_factory.mktemp("loud")
    target_dir = build_llama(root / "target", tiny_pair[0], hidden=64, layers=2, embedding_scale=1e6,
                             dtype=torch.bfloat16)
    head_dir = build_head(root / "head", target_dir)
    env = {"SPECDEC_DTYPE": "bfloat16"}
    verifier = start_service("verifier", ["--target", str(target_dir)], root, env=env)
    drafter = start_service("drafter", ["--method", "eagle", "--draft-model", str(head_dir), "--target", str(target_dir)],
                            root, env=env)
    services: list[Service] = [verifier, drafter]
    server = proxy = None
    try:
        verifier.wait_serving()
        server = grpc.server(futures.ThreadPoolExecutor(8), options=channel_options())
        proxy = MalformingVerifier(verifier.address)
        verifier_pb2_grpc.add_VerifierServicer_to_server(proxy, server)
        health_servicer = health.HealthServicer()
        for name in ("", verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        gateway = start_service("gateway", ["--target", str(target_dir), "--verifier", f"127.0.0.1:{port}",
                                            "--drafter", drafter.address], root, env=env)
        services.append(gateway)
        drafter.wait_serving()
        gateway.wait_serving()
        yield gateway, target_dir
    finally:
        for service in services:
            service.stop()
        if server is not None:
            server.stop(0)
        if proxy is not None:
            proxy.channel.close()


def test_a_bf16_target_past_float16_range_stays_exact_with_eagle_drafts(loud):
    """Through the services: the verdicts' features (past 65 504) reach the drafter, which drafts
    every round; the output is the bf16 target's own and no stream failed."""
    gateway, target_dir = loud
    target = load_model(str(target_dir), dtype=torch.bfloat16, runtime="hf")
    prompt = [5, 17, 33, 2, 9, 41]
    with GatewayClient(gateway.address, timeout=60) as client:
        result = client.generate(prompt_token_ids=prompt, max_new_tokens=32, ignore_eos=True, method="eagle",
                                 num_draft_tokens=3)
    alone = run_sync(collect(LocalEngine(target).stream(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))))
    assert result.token_ids == alone.token_ids
    assert result.stats["draft_method"] == "eagle" and result.stats["draft_tokens"] > 3  # drafted past round 1
    assert not re.search(r"(drafter|verifier \S+) failed", gateway.log())


def test_a_malformed_feature_payload_ends_the_requests_drafting_not_the_verifier(loud):
    """The verifier's first round carries NaN features: the gateway passes them on unread, the
    drafter refuses them by name, and the request completes exactly without drafts; the verifier
    replica is never blamed and the next request drafts as usual."""
    gateway, target_dir = loud
    target = load_model(str(target_dir), dtype=torch.bfloat16, runtime="hf")
    params = dict(max_new_tokens=32, ignore_eos=True, method="eagle", num_draft_tokens=3)
    with GatewayClient(gateway.address, timeout=60) as client:
        marked = client.generate(prompt_token_ids=MARK + [9, 41], **params)
        after = client.generate(prompt_token_ids=[5, 17, 33, 2, 9, 41], **params)
    alone = run_sync(collect(LocalEngine(target).stream(MARK + [9, 41], SamplingParams(max_new_tokens=32,
                                                                                        ignore_eos=True))))
    assert marked.token_ids == alone.token_ids
    assert marked.stats["draft_tokens"] == 3  # round 1's drafts only: the features after it were refused
    assert after.stats["draft_tokens"] > 3
    log = gateway.log()
    assert "drafter failed" in log and "target_features.bf16_data: not finite" in log
    assert not re.search(r"verifier \S+ failed", log)


@pytest.mark.parametrize("tie", [False, True])
def test_the_eagle_drafter_reads_only_the_embedding_and_lm_head_of_its_target(tiny_pair, tmp_path, monkeypatch, tie):
    """``read_target`` builds no model with weights (``load_model`` is never called, the module tree
    is on the meta device) and reads two tensors of the checkpoint (one when the LM head is tied to
    the embedding); the head it gives drafts exactly as one loaded over the whole target."""
    import safetensors

    import specdec.eagle.target_rows as target_rows

    target_dir = build_llama(tmp_path / "target", tiny_pair[0], hidden=64, layers=2, tie=tie)
    head_dir = build_head(tmp_path / "head", target_dir)
    whole = load_model(str(target_dir))
    reference = EagleDrafter.load(head_dir, whole)
    read, opened = [], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = opened(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    def refuse(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    monkeypatch.setattr(target_rows, "load_model", refuse)
    facts, tensors = target_rows.read_target(str(target_dir), "cpu")
    drafter = EagleDrafter.load(head_dir, tensors)
    assert sorted(read) == (["model.embed_tokens.weight"] if tie else ["lm_head.weight", "model.embed_tokens.weight"])
    assert all(p.device.type == "meta" for p in facts.model.parameters())
    assert (facts.vocab_size, facts.eos_token_ids, facts.max_positions, facts.fingerprint) == \
        (whole.vocab_size, whole.eos_token_ids, whole.max_positions, whole.fingerprint)
    tokens = [5, 17, 33, 2, 9, 41, 7]
    features = TargetSession(whole, tokens, SamplingParams(), want_features=True).prefill().features
    drafts = []
    for eagle in (reference, drafter):
        session = eagle.start(tokens, SamplingParams())
        session.add_features(TargetFeatures(0, features.values[: len(tokens) - 1]))
        drafts.append(session.propose(4).draft_tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 4


def test_the_relay_keeps_the_newest_features_within_its_bound_and_a_resend_replaces_what_it_covers():
    from gateway.feature_relay import FeatureRelay

    width = 4
    values = torch.randn(40, width).to(torch.bfloat16)
    row = width * 2
    relay = FeatureRelay(max_bytes=10 * row)
    for position in range(30):  # one row a verdict, as rounds without drafts bring them
        relay.add(TargetFeatures(position, values[position: position + 1]).encode())
        assert relay.nbytes <= 10 * row
    taken = relay.take()
    assert (taken.start, len(taken), relay.take()) == (20, 10, None)
    assert torch.equal(decode_features(taken, "f", width).values, values[20:30])
    relay = FeatureRelay(max_bytes=20 * row)
    relay.add(TargetFeatures(0, values[:8]).encode())
    relay.add(TargetFeatures(8, values[8:9]).encode())
    relay.add(TargetFeatures(5, values[5:12] + 1).encode())  # a migrated verifier's prefill resends from 5
    resent = decode_features(relay.take(), "f", width)
    assert resent.start == 0 and torch.equal(resent.values, torch.cat([values[:5], values[5:12] + 1]))
    relay.add(TargetFeatures(0, values[:3]).encode())
    relay.add(TargetFeatures(7, values[7:9]).encode())  # a gap: the older rows can never join these
    assert decode_features(relay.take(), "f", width).start == 7
    # The proposal that carries them fits its message, however many committed ids ride along.
    relay = FeatureRelay(max_bytes=4096)
    relay.add(TargetFeatures(0, torch.randn(600, width)).encode())
    propose = drafter_pb2.ProposalRequest(round=1, committed_token_ids=[50_000] * 1000, num_draft_tokens=3)
    convert.attach_features(propose, relay.take(), max_message_bytes=5000)
    request = drafter_pb2.DraftRequest(propose=propose)
    assert request.ByteSize() <= 5000 and propose.target_features.num_positions > 0
    assert propose.target_features.start_position + propose.target_features.num_positions == 600
