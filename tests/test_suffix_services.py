"""Suffix drafting through the real services: in the gateway and as a drafter service, exact under
greedy decoding, a repeated request drafted from the first one's output, and tenants (API keys)
and cache scopes that never draft from each other's text."""

from __future__ import annotations

import json
import urllib.request

import pytest

from specdec.client import GatewayClient
from tests.harness import free_port, start_stack
from tests.test_services import reference_greedy

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
PROMPTS = ["the quick brown fox", "def add(a, b):", "numbers 0 1 2 3", "speculative decoding drafts tokens"]
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=["gateway", "drafter"])
def suffix_stack(request, tiny_pair, tmp_path_factory):
    """Suffix drafting in the gateway (no drafter service), or in a drafter service (--method suffix)."""
    http_port = free_port()
    gateway_args = ["--http-port", str(http_port)]
    if request.param == "gateway":
        stack = start_stack(tiny_pair[1], None, tmp_path_factory.mktemp("logs"), gateway_args=gateway_args,
                            env={"SPECDEC_API_KEYS": f"{KEY_A},{KEY_B}"})
    else:
        stack = start_stack(tiny_pair[1], tiny_pair[1], tmp_path_factory.mktemp("logs"), drafter_method="suffix",
                            gateway_args=gateway_args, env={"SPECDEC_API_KEYS": f"{KEY_A},{KEY_B}"})
    stack.http_port = http_port
    stack.placement = request.param
    yield stack
    stack.stop()


def generate(stack, key: str, prompt: str, method_override: str = "suffix", **kwargs):
    with GatewayClient(stack.gateway.address, timeout=60, api_key=key) as client:
        return client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, method=method_override, num_draft_tokens=4,
                               ignore_eos=True, **kwargs)


def test_suffix_is_exact_and_a_repeat_drafts_the_first_output(suffix_stack, tiny_target):
    for prompt in PROMPTS:
        scope = f"repeat-{prompt}"
        first = generate(suffix_stack, KEY_A, prompt, cache_scope=scope)
        again = generate(suffix_stack, KEY_A, prompt, cache_scope=scope)
        plain = generate(suffix_stack, KEY_A, prompt, cache_scope=scope, method_override="none")
        expected = reference_greedy(tiny_target, first.prompt_token_ids, NEW_TOKENS)  # stops at EOS
        assert first.token_ids[:len(expected)] == expected and len(first.token_ids) == NEW_TOKENS
        assert again.token_ids == first.token_ids == plain.token_ids
        assert first.stats["draft_method"] == again.stats["draft_method"] == "suffix"
        # The repeat drafts the first output from its first round: every round drafts all four
        # (but the last, shorter one) and the target accepts them all.
        stats = again.stats
        assert stats["accepted_tokens"] == stats["draft_tokens"] >= NEW_TOKENS - 1 - stats["rounds"], (prompt, stats)
        assert stats["rounds"] <= (NEW_TOKENS - 1 + 4) // 5 + 1, stats


def test_tenants_and_scopes_never_draft_from_each_other(suffix_stack):
    """What tenant A's request drafts from its cache, tenant B (another API key) and A under another
    cache scope never see: their first request drafts exactly what a request in an empty scope
    drafts (its own text only), while A's repeat drafts far more."""
    prompt = "for i in range(10):"
    scope = "isolation"
    a_first = generate(suffix_stack, KEY_A, prompt, cache_scope=scope)
    a_repeat = generate(suffix_stack, KEY_A, prompt, cache_scope=scope)
    b_first = generate(suffix_stack, KEY_B, prompt, cache_scope=scope)
    a_elsewhere = generate(suffix_stack, KEY_A, prompt, cache_scope=scope + "-other")
    own_text_only = a_first.stats["draft_tokens"]
    assert a_repeat.stats["accepted_tokens"] > own_text_only + 10
    assert b_first.stats["draft_tokens"] == own_text_only, (b_first.stats, a_first.stats)
    assert a_elsewhere.stats["draft_tokens"] == own_text_only
    assert b_first.token_ids == a_first.token_ids == a_repeat.token_ids
    # The HTTP front scopes by the same key: A's output (over gRPC) is there for A's HTTP request, not B's.
    generate(suffix_stack, KEY_A, prompt, cache_scope="http")
    b_http = http_completion(suffix_stack, KEY_B, prompt, "http")
    a_http = http_completion(suffix_stack, KEY_A, prompt, "http")
    assert b_http["speculation_stats"]["draft_tokens"] == own_text_only, b_http["speculation_stats"]
    assert a_http["speculation_stats"]["accepted_tokens"] > own_text_only + 10


def http_completion(stack, key: str, prompt: str, scope: str) -> dict:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "speculation": {"method": "suffix", "num_draft_tokens": 4, "cache_scope": scope}}
    request = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_bad_suffix_fields_are_invalid_argument_naming_them(suffix_stack):
    import grpc

    from specdec.rpc.server import error_field

    for kwargs, field in ((dict(cache_scope="x" * 129), "speculation.cache_scope"),
                          (dict(method="auto", auto_methods=["suffix", "telepathy"]), "speculation.auto_methods")):
        with pytest.raises(grpc.RpcError) as info:
            with GatewayClient(suffix_stack.gateway.address, timeout=30, api_key=KEY_A) as client:
                client.generate(prompt="hi", max_new_tokens=4, **kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(info.value) == field


def test_auto_restricted_to_suffix_drafts_with_it(suffix_stack):
    result = None
    with GatewayClient(suffix_stack.gateway.address, timeout=60, api_key=KEY_A) as client:
        result = client.generate(prompt="numbers 0 1 2 3", max_new_tokens=8, method="auto", auto_methods=["suffix"])
    assert result.stats["draft_method"] == "suffix"


def test_sampled_suffix_drafts_through_the_services_follow_the_target(suffix_stack, tiny_target):
    """Seeded sampling through the services, each request drafted from what the earlier ones sampled
    (one cache scope): the first three tokens follow the target's own joint distribution."""
    from specdec.wire_types import SamplingParams
    from tests.test_distribution import assert_first_three_follow_target

    prompt = tiny_target.tokenizer("the quick brown fox jumps")["input_ids"]
    outcomes, accepted = [], 0
    with GatewayClient(suffix_stack.gateway.address, timeout=60, api_key=KEY_A) as client:
        for seed in range(300):
            result = client.generate(prompt_token_ids=prompt, max_new_tokens=4, temperature=0.9, top_k=3, seed=seed,
                                     ignore_eos=True, method="suffix", num_draft_tokens=2, cache_scope="sampled")
            outcomes.append(tuple(result.token_ids[:3]))
            accepted += result.stats["accepted_tokens"]
    assert accepted > 75, accepted  # the drafts really came from the earlier samples and were taken
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=0, ignore_eos=True)
    assert_first_three_follow_target(tiny_target, prompt, params, outcomes)
