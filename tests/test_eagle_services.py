"""Feature-level drafting (EAGLE) end to end: the verifier streams the target's features with each
verdict, the gateway passes them on, the ``eagle`` drafter drafts from them. Exactness through the
real services (greedy equality, the sampled distribution, a drafter killed mid-stream), the feature
invariant against teacher forcing, the wire's accounting, and bad features refused by name."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specdec.client import GatewayClient
from specdec.drafting import NgramDrafter
from specdec.eagle.features import teacher_force
from specdec.completion import CompletionBuilder
from specdec.eagle.drafter import EagleDrafter
from specdec.engine import LocalDrafter, LocalVerifier, collect, generate, run_sync
from specdec.local import LocalEngine
from specdec.policy import make_policy
from specdec.models import load_model
from specdec.prompts import encode_chat, encode_text
from specdec.rpc import convert
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.target_features import TargetFeatures, decode_features
from specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.verification import PendingForward, PrefillChunk, TargetSession, verify_batch
from tests.harness import start_stack
from tests.test_distribution import assert_first_three_follow_target
from tests.test_reliability import stream_in_thread
from tests.test_services import reference_greedy
from tests.tiny_models import build_eagle_head

PROMPTS = ["the quick brown fox", "def add(a, b):", "numbers 0 1 2 3", "exactness is sacred"]
CHATS = [[("user", "hello there")], [("system", "be brief"), ("user", "count to five")]]
NEW_TOKENS = 48
SAMPLED_PROMPT = "the quick brown fox jumps"


def head_prompts(tokenizer) -> list[list[int]]:
    """The prompts the test head learns the target's continuations of."""
    return [encode_text(tokenizer, p) for p in PROMPTS + [SAMPLED_PROMPT]] + [encode_chat(tokenizer, c) for c in CHATS]


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tiny_target, tmp_path_factory):
    return build_eagle_head(tmp_path_factory.mktemp("eagle") / "head", tiny_pair[1], head_prompts(tiny_target.tokenizer))


@pytest.fixture(scope="module")
def stack(tiny_pair, head_dir, tmp_path_factory):
    stack = start_stack(tiny_pair[1], head_dir, tmp_path_factory.mktemp("eagle-logs"), drafter_method="eagle")
    yield stack
    stack.stop()


@pytest.mark.parametrize("runtime", ["lean", "hf"])
def test_verdicts_carry_each_committed_position_feature_once_as_teacher_forcing_computes_it(tiny_pair, runtime):
    """Prefill (in chunks, as a busy verifier feeds a long prompt) then rounds that accept none, some
    and all drafts: the verdicts' features tile positions 0 .. n - 2 exactly once, in order, and
    equal the target's features over the final text (bf16 on the wire, so within its rounding)."""
    target = load_model(str(tiny_pair[1]), runtime=runtime)
    prompt = [5, 17, 33, 2, 9, 41, 7, 12, 90, 4, 61]
    session = TargetSession(target, prompt, SamplingParams(max_new_tokens=40), want_features=True)
    assert verify_batch(target, [PrefillChunk(session, 4)]) == [None]
    assert verify_batch(target, [PrefillChunk(session, 8)]) == [None]
    verdicts = [session.prefill()]
    assert (verdicts[0].features.start, len(verdicts[0].features)) == (0, len(prompt))
    reference = TargetSession(target, prompt, SamplingParams(max_new_tokens=40))
    reference.prefill()
    for round_index in range(8):
        greedy = reference.verify(DraftProposal()).tokens  # the token plain decoding commits next
        drafts = [greedy[0], 3, 4] if round_index % 3 == 1 else ([] if round_index % 3 == 0 else [1, 2])
        verdict = session.verify(DraftProposal(drafts))
        reference = TargetSession(target, list(session.tokens), SamplingParams(max_new_tokens=40))
        reference.prefill()
        reference.tokens.pop()  # back to the committed text: the next verify commits the next token
        reference.kv.rollback(len(session.tokens) - 1)
        verdicts.append(verdict)
        assert verdict.features.start == verdicts[-2].features.end
        assert len(verdict.features) == verdict.num_accepted + 1
    assert any(v.num_accepted for v in verdicts[1:])
    streamed = torch.cat([v.features.values for v in verdicts]).float()
    assert streamed.shape[0] == len(session.tokens) - 1
    forced = teacher_force(target, [session.tokens])[0]["features"].float()[:-1]
    torch.testing.assert_close(streamed, forced, rtol=5e-3, atol=2e-3)


@pytest.mark.parametrize("runtime", ["lean"])
def test_features_of_pending_tokens_fed_ahead_reach_the_next_verdicts(tiny_pair, runtime):
    """Verify-ahead for a session that streams features: the pass that feeds the pending token ahead
    (``PendingForward``) keeps its feature, the next verdict (no pass for a plain round, the drafts'
    pass otherwise) sends it; the features still tile every committed position once and equal the
    target's over the final text."""
    target = load_model(str(tiny_pair[1]), runtime=runtime)
    prompt = [5, 17, 33, 2, 9, 41, 7, 12, 90, 4, 61]
    session = TargetSession(target, prompt, SamplingParams(max_new_tokens=40), want_features=True)
    verdicts = [session.prefill()]
    passes = 0
    for round_index in range(10):
        assert verify_batch(target, [PendingForward(session)]) == [None] and session.has_ahead
        drafts = [] if round_index % 3 else [1, 2]
        passes += session.needs_pass(DraftProposal(drafts))
        verdict = session.verify(DraftProposal(drafts))
        assert verdict.features.start == verdicts[-1].features.end
        assert len(verdict.features) == verdict.num_accepted + 1
        verdicts.append(verdict)
    assert passes == 4  # only the rounds with drafts took a pass of their own
    streamed = torch.cat([v.features.values for v in verdicts]).float()
    assert streamed.shape[0] == len(session.tokens) - 1
    forced = teacher_force(target, [session.tokens])[0]["features"].float()[:-1]
    torch.testing.assert_close(streamed, forced, rtol=5e-3, atol=2e-3)


def test_a_windowed_prefill_sends_the_prompt_tail_and_the_head_drafts_from_it(tiny_target, head_dir):
    """A verifier caps a verdict's features (a long prompt on a wide target would pass gRPC's message
    limit): the prefill then carries the prompt's last positions only, the head starts its cache
    there, and the output stays the target's."""
    prompt = encode_text(tiny_target.tokenizer, PROMPTS[0])
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    session = TargetSession(tiny_target, prompt, params, want_features=True, feature_window=3)
    first = session.prefill()
    assert (first.features.start, len(first.features)) == (len(prompt) - 3, 3)
    session.close()
    # Chunked (a busy verifier): the chunks before the window compute no features; the verdict is the same.
    chunked = TargetSession(tiny_target, prompt, params, want_features=True, feature_window=3)
    rows = [PrefillChunk(chunked, 2).forward_row(), PrefillChunk(chunked, len(prompt) - 2).forward_row()]
    assert [row.num_features for row in rows] == [0, 1]
    assert verify_batch(tiny_target, [PrefillChunk(chunked, 2)]) == [None] and chunked.unsent is None
    assert verify_batch(tiny_target, [PrefillChunk(chunked, len(prompt) - 2)]) == [None]
    again = chunked.prefill()
    assert again.tokens == first.tokens and (again.features.start, len(again.features)) == (len(prompt) - 3, 3)
    torch.testing.assert_close(again.features.values.float(), first.features.values.float(), rtol=2e-3, atol=2e-3)
    chunked.close()
    drafter = EagleDrafter.load(head_dir, tiny_target)
    results = {}
    for window in (None, 3):
        target_session = TargetSession(tiny_target, prompt, params, want_features=True, feature_window=window)
        events = generate(prompt_tokens=len(prompt), completion=CompletionBuilder(tiny_target.tokenizer, params, tiny_target.eos_token_ids),
                          verifier=LocalVerifier(target_session), drafter=LocalDrafter(drafter.start(prompt, params)),
                          policy=make_policy(3), draft_method="eagle")
        results[window] = run_sync(collect(events))
    alone = run_sync(collect(LocalEngine(tiny_target).stream(prompt, params)))
    assert results[None].token_ids == results[3].token_ids == alone.token_ids
    assert results[3].stats.accepted_tokens > 0  # the head drafts from the tail alone, and is accepted


def test_features_round_trip_the_wire_and_bad_ones_name_their_field():
    values = torch.randn(3, 8).to(torch.bfloat16)
    pb = convert.features_to_pb(TargetFeatures(5, values))
    assert len(pb.bf16_data) == 3 * 8 * 2
    back = decode_features(convert.encoded_features_from_pb(pb), "features", 8)
    assert back.start == 5 and torch.equal(back.values, values)
    with pytest.raises(ValueError, match="features.hidden_size"):
        decode_features(convert.encoded_features_from_pb(pb), "features", 16)
    pb.bf16_data = pb.bf16_data[:-2]
    with pytest.raises(ValueError, match="features.bf16_data"):
        decode_features(convert.encoded_features_from_pb(pb), "features")
    pb.bf16_data = torch.full((3, 8), float("nan"), dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(ValueError, match="features.bf16_data: not finite"):
        decode_features(convert.encoded_features_from_pb(pb), "features")
    with pytest.raises(ValueError, match="target_features"):  # a token-level drafter refuses features
        NgramDrafter().start([1, 2, 3], SamplingParams()).add_features(TargetFeatures(0, values))


@pytest.mark.parametrize("given", [dict(prompt=p) for p in PROMPTS] + [dict(messages=m) for m in CHATS])
def test_greedy_with_the_eagle_drafter_equals_the_target_alone(stack, tiny_target, given):
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for k in (1, 3, 5):
            result = client.generate(**given, max_new_tokens=NEW_TOKENS, method="eagle", num_draft_tokens=k)
            assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS), (given, k)
            stats = result.stats
            assert stats["draft_method"] == "eagle" and stats["draft_tokens"] > 0
            # Every committed position's feature crossed the wire once: prefill's prompt, then per
            # round the pending token's and the accepted drafts' (a stop may end the count early).
            hidden = tiny_target.model.config.hidden_size
            streamed = len(result.prompt_token_ids) + stats["rounds"] + stats["accepted_tokens"]
            assert stats["feature_bytes"] >= streamed * hidden * 2 - (k + 1) * hidden * 2
            assert stats["feature_bytes"] <= streamed * hidden * 2 + (k + 1) * hidden * 2
            assert stats["feature_bytes_per_round"] == pytest.approx(stats["feature_bytes"] / stats["rounds"])


def test_the_eagle_head_accepts_and_rejects_and_plain_methods_stream_no_features(stack):
    accepted = drafted = 0
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for prompt in PROMPTS:
            stats = client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, method="eagle", num_draft_tokens=4).stats
            accepted, drafted = accepted + stats["accepted_tokens"], drafted + stats["draft_tokens"]
        plain = client.generate(prompt=PROMPTS[0], max_new_tokens=16, method="ngram", num_draft_tokens=2).stats
    assert 0 < accepted < drafted  # rounds really accepted, rejected and rolled back
    assert plain["feature_bytes"] == 0 and plain["draft_method"] == "ngram"


def test_sampled_drafts_with_features_keep_the_target_distribution(stack, tiny_target):
    """The first three tokens over many seeds through the services follow the target's own joint
    distribution (T 0.9, top-k 3), with the eagle drafter's sampled drafts and their exact q."""
    def run(seed: int):
        with GatewayClient(stack.gateway.address, timeout=60) as client:
            result = client.generate(prompt=SAMPLED_PROMPT, max_new_tokens=4, temperature=0.9, top_k=3, seed=seed,
                                     ignore_eos=True, method="eagle", num_draft_tokens=2)
        return tuple(result.token_ids[:3]), result.stats["accepted_tokens"], result.prompt_token_ids

    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(run, range(600)))
    assert sum(accepted >= 1 for _, accepted, _ in runs) > len(runs) // 10  # drafts really were accepted
    prompt_ids = runs[0][2]
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=0, ignore_eos=True)
    assert_first_three_follow_target(tiny_target, prompt_ids, params, [outcome for outcome, _, _ in runs])


def test_adaptive_sessions_probe_in_the_shadow_with_the_features_of_their_own_tokens(stack, tiny_target):
    """Adaptive greedy sessions (k = 0: the policy chooses) probe acceptance beside plain rounds. A probe
    goes out while the next verdict is in flight: it must carry the features of the tokens it carries
    and no later verdict's (the drafter refuses features past its committed text, which would end the
    drafter session). Probes are scored and accepted, the drafter never fails, output stays exact."""
    probes = accepted = 0
    with GatewayClient(stack.gateway.address, timeout=60) as client:
        for prompt in PROMPTS:
            result = client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, method="eagle", num_draft_tokens=0)
            assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS)
            probes += result.stats["shadow_probes"]
            accepted += result.stats["shadow_accepted"] + result.stats["accepted_tokens"]
    assert probes > 0 and accepted > 0
    assert "drafter failed" not in stack.gateway.log()


def test_services_report_features_and_refuse_bad_ones_by_name(stack):
    with grpc.insecure_channel(stack.verifiers[0].address) as channel:
        info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5)
        assert info.feature_size == 64
    with grpc.insecure_channel(stack.drafters[0].address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        info = stub.GetInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5)
        assert (info.method, info.feature_size, info.supports_draft_ahead) == ("eagle", 64, False)
        start = drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(session_id="s1", prompt_token_ids=[5, 6, 7]))

        def propose(start_position: int, rows: int, width: int = 64, committed=(8,)):
            features = convert.features_to_pb(TargetFeatures(start_position, torch.zeros(rows, width)))
            return drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(
                round=1, committed_token_ids=list(committed), num_draft_tokens=2, target_features=features))

        ok = list(stub.Draft(iter([start, propose(0, 3)]), timeout=10))
        assert len(ok[1].proposal.draft_token_ids) == 2
        for message, field in [(propose(0, 3, width=32), "target_features.hidden_size"),
                               (propose(1, 3), "target_features: positions up to 3"),
                               (propose(0, 5), "target_features: positions up to 4")]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Draft(iter([start, message]), timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details(), info.value.details()


def test_a_prompt_whose_features_pass_the_message_limit_streams_its_tail(tiny_pair, head_dir, tiny_target, tmp_path):
    """With 64 KiB messages a 700-token prompt's features (700 x 64 x 2 bytes) do not fit one verdict:
    the verifier sends the prompt's last 256 positions, and the request completes exactly."""
    limit = ["--max-message-bytes", str(64 * 1024)]
    stack = start_stack(tiny_pair[1], head_dir, tmp_path, drafter_method="eagle", verifier_args=limit,
                        drafter_args=limit, gateway_args=limit)
    try:
        prompt = [3 + (i * 37) % (tiny_target.vocab_size - 3) for i in range(700)]
        with GatewayClient(stack.gateway.address, timeout=60) as client:
            result = client.generate(prompt_token_ids=prompt, max_new_tokens=24, method="eagle", num_draft_tokens=3)
        assert result.token_ids == reference_greedy(tiny_target, prompt, 24)
        row = tiny_target.model.config.hidden_size * 2
        assert 256 * row <= result.stats["feature_bytes"] < (256 + 24 + 3 * result.stats["rounds"]) * row
    finally:
        stack.stop()


def test_eagle_drafter_killed_mid_generation_output_stays_exact(tiny_pair, head_dir, tiny_target, tmp_path):
    stack = start_stack(tiny_pair[1], head_dir, tmp_path, drafter_method="eagle")
    try:
        started, outcome = threading.Event(), {}
        thread = stream_in_thread(stack.gateway.address, started, outcome, prompt=PROMPTS[0], max_new_tokens=300,
                                  ignore_eos=True, method="eagle", num_draft_tokens=3)
        assert started.wait(60)
        stack.drafters[0].proc.send_signal(signal.SIGKILL)
        thread.join(120)
        assert "error" not in outcome, outcome.get("error")
        events = outcome["events"]
        final = events[-1]
        tokens = [t for e in events[:-1] for t in e.token_ids]
        # The target decoding alone, past EOS as the request asked (transformers' generate cannot).
        alone = run_sync(collect(LocalEngine(tiny_target).stream(
            final.prompt_token_ids, SamplingParams(max_new_tokens=300, ignore_eos=True))))
        assert len(tokens) == 300 and tokens == alone.token_ids
        assert final.stats["draft_method"] == "eagle"
    finally:
        stack.stop()


def test_specdec_up_serves_an_eagle_head_and_auto_drafts_with_it(tiny_pair, head_dir, tiny_target):
    """``specdec up --draft-method eagle``: the drafter serves the head over the target, and a request
    that leaves the method to the gateway (auto) drafts with it, exactly."""
    from specdec.cli import build_parser
    from specdec.stack import LocalStack
    from specdec.up import children

    args = ["--target", str(tiny_pair[1]), "--draft-method", "eagle", "--draft-model", str(head_dir)]
    drafter = next(spec for spec in children(build_parser().parse_args(["up", *args])) if spec.name == "drafter")
    assert drafter.command[drafter.command.index("--method") + 1] == "eagle"
    assert drafter.command[drafter.command.index("--draft-model") + 1] == str(head_dir.resolve())
    with pytest.raises(SystemExit, match="needs --draft-model"):
        children(build_parser().parse_args(["up", "--target", str(tiny_pair[1]), "--draft-method", "eagle"]))
    with LocalStack(args, quiet=True) as address, GatewayClient(address, timeout=60) as client:
        result = client.generate(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_draft_tokens=3)
    assert result.stats["draft_method"] == "eagle" and result.stats["accepted_tokens"] > 0
    assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS)


def test_the_shipped_head_drafts_for_the_embedded_target_exactly(embedded_target):
    """``embedded-eagle`` (specdec/drafts/smollm2-135m-eagle) is the default head of the embedded target:
    it loads over the target's embedding, serves 4 096 LM head ids, and its drafts are accepted often
    on a real chat prompt while the output stays the target's."""
    from specdec.eagle.drafter import DRAFTING_HEAD_TOKENS
    from specdec.models import EMBEDDED_EAGLE, default_eagle_head

    assert default_eagle_head("embedded") == EMBEDDED_EAGLE and default_eagle_head("some/other-model") is None
    drafter = EagleDrafter.load(EMBEDDED_EAGLE, embedded_target)
    assert len(drafter.head.head_token_ids) == DRAFTING_HEAD_TOKENS == 4096
    prompt = encode_chat(embedded_target.tokenizer, [("user", "Write a Python function that reverses a string.")])
    params = SamplingParams(max_new_tokens=64)
    spec = run_sync(collect(LocalEngine(embedded_target, drafter).stream(prompt, params, num_draft_tokens=3)))
    alone = run_sync(collect(LocalEngine(embedded_target).stream(prompt, params)))
    assert spec.token_ids == alone.token_ids
    assert spec.stats.accepted_tokens >= 0.25 * spec.stats.draft_tokens  # ~0.3-0.5 measured (model card)
