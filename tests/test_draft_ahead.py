"""Draft-ahead: the drafter drafts the next block while a verification is in flight.

The block is used only when the verifier commits exactly what it assumed, and then it must be the
very proposal a fresh drafting round would have made (same context, same position-keyed draws);
so outputs are unchanged: greedy equals the target alone, and seeded sampling with a fixed draft
length gives the same tokens with draft-ahead on or off. Runs through real services on loopback,
with an injected network delay on the gateway's links.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from specdec.client import GatewayClient
from specdec.drafters import ModelDrafter
from specdec.drafting import NgramDrafter
from specdec.wire_types import SamplingParams
from specdec.v1 import drafter_pb2, drafter_pb2_grpc
from tests.harness import start_stack
from tests.test_services import reference_greedy
from tests.tiny_models import build_noisy_copy

PROMPTS = ["the quick brown fox", "def add(a, b):", "numbers 0 1 2 3", "for i in range(10):"]
NEW_TOKENS = 40


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ahead_block_is_the_fresh_proposal(tiny_target, tiny_noisy_draft, temperature, one_thread):
    """propose_ahead(in_flight) == extend(in_flight + [guess]); propose(): same tokens, same q."""
    params = SamplingParams(max_new_tokens=32, temperature=temperature, seed=11, draft_top_k=16)
    prompt = tiny_target.tokenizer("the quick brown fox")["input_ids"]
    for drafter in (ModelDrafter(tiny_noisy_draft), NgramDrafter()):
        ahead_session = drafter.start(prompt + prompt, params)
        in_flight = ahead_session.propose(3).draft_tokens
        result = ahead_session.propose_ahead(in_flight, 4)
        if result is None:  # n-gram lookup may find nothing to guess
            assert drafter.name == "ngram"
            continue
        assumed, block = result
        assert assumed[:-1] == in_flight and len(assumed) == len(in_flight) + 1
        assert ahead_session.tokens == prompt + prompt  # the committed text is untouched
        fresh_session = drafter.start(prompt + prompt, params)
        fresh_session.extend(assumed)
        fresh = fresh_session.propose(4)
        assert block.draft_tokens == fresh.draft_tokens
        if fresh.draft_probs is not None:
            for a, b in zip(block.draft_probs, fresh.draft_probs):
                assert a.token_ids.tolist() == b.token_ids.tolist()
                # Same context, cached in different chunks: equal up to float summation order. (Exactness
                # rests on each block carrying the q it was sampled from, which holds either way.)
                assert np.allclose(a.probs, b.probs, atol=1e-5)


@pytest.fixture(scope="module")
def ahead_stack(tiny_pair, tmp_path_factory):
    noisy = build_noisy_copy(tmp_path_factory.mktemp("ahead-noisy") / "draft", tiny_pair[1], noise_std=0.05)
    stack = start_stack(tiny_pair[1], noisy, tmp_path_factory.mktemp("ahead-logs"),
                        gateway_args=["--draft-ahead", "--net-delay-ms", "2"])
    yield stack
    stack.stop()


def test_greedy_with_draft_ahead_equals_target_only(ahead_stack, tiny_target):
    hits = blocks = 0
    with GatewayClient(ahead_stack.gateway.address, timeout=120) as client:
        for i, prompt in enumerate(PROMPTS):
            k = (0, 2, 4, 6)[i % 4]  # adaptive and fixed draft lengths
            result = client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, method="model", num_draft_tokens=k)
            assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS), prompt
            hits += result.stats["ahead_hits"]
            blocks += result.stats["ahead_blocks"]
            assert result.stats["ahead_hits"] <= result.stats["ahead_blocks"] <= result.stats["rounds"]
    # The near-copy draft is often right about a whole block and the bonus token: blocks get used.
    assert hits > 0 and blocks > hits


def test_seeded_sampling_same_with_and_without_draft_ahead(ahead_stack):
    with GatewayClient(ahead_stack.gateway.address, timeout=120) as client:
        for seed, prompt in enumerate(PROMPTS):
            runs = [client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, temperature=0.9, seed=seed,
                                    method="model", num_draft_tokens=3, draft_ahead=ahead, ignore_eos=True)
                    for ahead in (True, False)]
            assert runs[0].token_ids == runs[1].token_ids, prompt
            assert runs[1].stats["ahead_blocks"] == 0


def test_drafter_rejects_ahead_used_without_a_block(ahead_stack):
    drafter_address = ahead_stack.drafters[0].address
    with grpc.insecure_channel(drafter_address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        requests = [
            drafter_pb2.DraftRequest(start=drafter_pb2.DraftStart(session_id="ahead-bad", prompt_token_ids=[5, 6, 7])),
            drafter_pb2.DraftRequest(propose=drafter_pb2.ProposalRequest(round=1, num_draft_tokens=0, ahead_used=2,
                                                                      ahead_tokens=2)),
        ]
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Draft(iter(requests), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ahead_used" in info.value.details()
