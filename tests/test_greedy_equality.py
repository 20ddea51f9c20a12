"""Greedy speculative decoding is token-identical to the target alone (HF ``generate``).

Every draft method and draft length must give exactly the target's greedy tokens; the target as
its own draft must accept everything; drafts that are partly right must make the loop reject
and roll back many times (and still match). KV rollback keeps the accepted prefix.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from specdec.drafters import ModelDrafter
from specdec.drafting import NgramDrafter, ScriptedDrafter
from specdec.suffix import SuffixConfig, SuffixDrafter
from specdec.completion import CompletionBuilder
from specdec.engine import LocalDrafter, LocalVerifier, collect, generate, run_sync
from specdec import kv as kv_module
from specdec.kv import KVSession
from specdec.local import LocalEngine
from specdec.policy import DraftLengthPolicy, FixedDraftLength, RoundObservation
from specdec.prompts import encode_chat
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.verification import TargetSession
from tests.tiny_models import TEST_DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 64

PROMPTS = [
    "the quick brown fox",
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):",
    "for i in range(10):\n    print(i * i)\n",
    "Hello! How can I help you today?",
    "speculative decoding drafts tokens",
    "the target verifies them in one pass",
    "exactness is sacred: greedy outputs are token identical",
    "numbers 0 1 2 3 4 5 6 7 8 9",
    "letters a b c d e f g",
    "ünïcödé bytes: 日本語のテキスト",
    "emoji 🎉 and accents é à ç",
    "a",
    "the the the the the the",
    "1 2 1 2 1 2 1 2",
    "I am a small assistant. I am a small",
    "print(i)",
    "lazy dog lazy dog lazy",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "quick quick brown brown fox fox",
]


def hf_greedy(lm, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target alone through transformers' ``generate``.

    ``eos_token_id=None`` so that EOS neither stops the reference nor is suppressed: the engine's
    ``ignore_eos`` keeps generating past EOS but still emits it (``min_new_tokens`` would instead
    forbid EOS, changing the greedy tokens wherever the argmax is EOS).
    """
    input_ids = torch.tensor([prompt_ids], device=lm.device)
    output = lm.model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=lm.tokenizer.pad_token_id,
    )
    return output[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def references(tiny_target):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs = []
    for text in PROMPTS:
        ids = tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"]
        refs.append((ids, hf_greedy(tiny_target, ids, NEW_TOKENS)))
    torch.set_num_threads(threads)
    return refs


class RecordingPolicy(FixedDraftLength):
    """A fixed draft length that records every round's outcome."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.rounds: list[RoundObservation] = []

    def observe(self, outcome: RoundObservation) -> None:
        self.rounds.append(outcome)


def corrupting_script(prompt_ids: list[int], reference: list[int], vocab: int, rate: float = 0.3):
    """Propose the true continuation with random corruptions (and sometimes a shorter block)."""
    truth = prompt_ids + reference

    def script(tokens: list[int], k: int, params: SamplingParams) -> DraftProposal:
        position = len(tokens)
        rng = random.Random(position * 7919 + k)
        length = k if rng.random() < 0.8 else rng.randint(0, k)
        drafts = []
        for j in range(length):
            true = truth[position + j] if position + j < len(truth) else rng.randrange(vocab)
            drafts.append((true + rng.randrange(1, vocab)) % vocab if rng.random() < rate else true)
        return DraftProposal(drafts, None)

    return script


DRAFTERS = ["tiny_random_draft", "ngram", "target_itself", "scripted_corrupted", "noisy_copy", "suffix", "suffix_misled"]


def misled_suffix_drafter(references, vocab: int) -> SuffixDrafter:
    """A suffix drafter whose cache already holds every reference with a quarter of its tokens
    changed: its drafts are right for a while, then wrong (partial acceptance, rollbacks)."""
    drafter = SuffixDrafter(SuffixConfig(min_token_prob=0.0))
    rng = random.Random(11)
    for serial, (ids, reference) in enumerate(references, start=1_000_000):
        corrupted = [(t + 1) % vocab if rng.random() < 0.25 else t for t in reference]
        drafter.cache.add("", serial, ids[-4:] + corrupted, new=True)
    return drafter


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_speculative_equals_target_generate(kind, k, references, tiny_target, tiny_draft, tiny_noisy_draft):
    assert len(references) >= 20
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    fixed = {
        "tiny_random_draft": ModelDrafter(tiny_draft),
        "ngram": NgramDrafter(),
        "target_itself": ModelDrafter(tiny_target),
        "noisy_copy": ModelDrafter(tiny_noisy_draft),
        # One drafter over every prompt: later requests draft from what the earlier ones wrote.
        "suffix": SuffixDrafter(),
        "suffix_misled": misled_suffix_drafter(references, tiny_target.vocab_size),
    }

    async def run_all():
        out = []
        for ids, reference in references:
            if kind == "scripted_corrupted":
                drafter = ScriptedDrafter(corrupting_script(ids, reference, tiny_target.vocab_size))
            else:
                drafter = fixed[kind]
            policy = RecordingPolicy(k)
            result = await collect(LocalEngine(tiny_target, drafter).stream(ids, params, policy=policy))
            out.append((ids, reference, result, policy.rounds))
        return out

    all_rounds = []
    for ids, reference, result, rounds in run_sync(run_all()):
        assert result.token_ids == reference, f"prompt {ids}"
        assert result.finish_reason == "length"
        stats = result.stats
        assert stats.completion_tokens == NEW_TOKENS == 1 + stats.emitted_in_rounds
        assert stats.rounds == len(rounds) and stats.draft_tokens == sum(r.num_drafts for r in rounds)
        assert stats.accepted_tokens == sum(r.num_accepted for r in rounds)
        assert all(r.num_drafts <= k for r in rounds)
        if kind == "target_itself":
            assert stats.acceptance_rate == 1.0
            assert stats.draft_tokens > 0
        all_rounds.extend(rounds)
    drafted_rounds = [r for r in all_rounds if r.num_drafts]
    assert drafted_rounds, "speculation never happened"
    if kind in ("scripted_corrupted", "noisy_copy", "suffix_misled"):
        rejected = [r for r in drafted_rounds if r.num_accepted < r.num_drafts]
        accepted = [r for r in drafted_rounds if r.num_accepted > 0]
        assert len(rejected) >= 20 and len(accepted) >= 20, (len(rejected), len(accepted))
        if k > 1:  # rollbacks that keep part of the block
            partial = [r for r in drafted_rounds if 0 < r.num_accepted < r.num_drafts]
            assert len(partial) >= 10, len(partial)


class ProbingPolicy(DraftLengthPolicy):
    """Every 3rd round a probe of k drafts (one at a time), every 5th k real drafts; records the
    order of drafter calls and every outcome."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.n = 0
        self.kind = ""
        self.pending = False
        self.calls: list[str] = []  # "probe" / "real", in the order the drafter is asked
        self.shadows: list[tuple[int, int]] = []
        self.shadow_draft_s: list[float | None] = []  # the drafter's time for each probe
        self.rounds: list[RoundObservation] = []

    def choose(self, max_k: int) -> int:
        self.n += 1
        k = min(self.k, max_k)
        self.kind = "real" if self.n % 5 == 0 and k > 0 else "probe" if self.n % 3 == 0 and not self.pending else "zero"
        if self.kind == "real":
            self.calls.append("real")
        return k if self.kind != "zero" else 0

    @property
    def probing(self) -> bool:
        return self.kind == "probe"

    def start_shadow_probe(self) -> None:
        self.pending = True
        self.calls.append("probe")

    def observe_shadow(self, num_drafts: int, num_accepted: int, draft_s: float | None = None,
                       beside_s: float = 0.0, beside_rounds: int = 0) -> None:
        self.pending = False
        self.shadows.append((num_drafts, num_accepted))
        self.shadow_draft_s.append(draft_s)

    def observe(self, outcome: RoundObservation) -> None:
        self.rounds.append(outcome)


class ConcurrentLocalDrafter(LocalDrafter):
    """An in-process drafter that answers a moment later, as a drafter service would."""

    concurrent = True

    async def propose(self, committed: list[int], num_draft_tokens: int):
        await asyncio.sleep(0.001)
        return await super().propose(committed, num_draft_tokens)


def test_shadow_probes_score_what_verification_would_accept(references, tiny_target):
    """A probe drafted beside a plain round is scored by the committed tokens: its score equals what
    verifying the same drafts accepts (checked on the same script's real rounds), its round verifies
    nothing, and the output stays the target's."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    k = 3

    def prefix_match(drafts, truth, position):
        n = 0
        while n < len(drafts) and position + n < len(truth) and drafts[n] == truth[position + n]:
            n += 1
        return len(drafts), n

    async def run(ids, reference):
        truth = ids + reference
        script = corrupting_script(ids, reference, tiny_target.vocab_size)
        calls = []

        def logged(tokens, num, p):
            proposal = script(tokens, num, p)
            calls.append(prefix_match(proposal.draft_tokens, truth, len(tokens)))
            return proposal

        policy = ProbingPolicy(k)
        session = TargetSession(tiny_target, ids, params)
        try:
            result = await collect(generate(
                prompt_tokens=len(ids),
                completion=CompletionBuilder(tiny_target.tokenizer, params, tiny_target.eos_token_ids),
                verifier=LocalVerifier(session), policy=policy, draft_method="scripted",
                drafter=ConcurrentLocalDrafter(ScriptedDrafter(logged).start(ids, params)),
            ))
        finally:
            session.close()
        return result, policy, calls

    probes = scored_rounds = 0
    for ids, reference in references[:8]:
        result, policy, calls = run_sync(run(ids, reference))
        assert result.token_ids == reference
        # A probe launched in the last round may be cancelled before the drafter ran it.
        assert len(calls) == len(policy.calls) or (len(calls) == len(policy.calls) - 1 and policy.calls[-1] == "probe")
        expected_shadows = [c for c, kind in zip(calls, policy.calls) if kind == "probe"]
        expected_real = [c for c, kind in zip(calls, policy.calls) if kind == "real" and c[0] > 0]
        # The last probe may still be undecided when the generation ends.
        assert policy.shadows == expected_shadows[: len(policy.shadows)]
        assert len(expected_shadows) - len(policy.shadows) <= 1
        assert [(r.num_drafts, r.num_accepted) for r in policy.rounds if r.num_drafts] == expected_real
        assert sum(r.num_drafts for r in policy.rounds) == result.stats.draft_tokens == sum(d for d, _ in expected_real)
        assert result.stats.shadow_probes == len(policy.shadows)
        assert result.stats.shadow_accepted == sum(a for _, a in policy.shadows)
        # Each probe is timed from its call to the drafter's answer (which sleeps 1 ms first).
        assert all(d is not None and 0.001 <= d < 5.0 for d in policy.shadow_draft_s), policy.shadow_draft_s
        probes += len(policy.shadows)
        scored_rounds += len(expected_real)
    assert probes >= 40 and scored_rounds >= 40


# ---------------------------------------------------------------------------------------------
# KV rollback


@pytest.mark.parametrize("temperature", [1.1754943508222875e-38, 1e-30, 5e-6])
def test_vanishing_temperature_decodes_greedily(temperature, references, tiny_target, tiny_noisy_draft):
    """T → 0 is greedy decoding: a tiny positive temperature (the smallest fp32 normal, found by the fuzz
    test) must neither produce NaN probabilities nor leave the greedy tokens."""
    ids, reference = references[0]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, ignore_eos=True, seed=3)
    for drafter in (None, ModelDrafter(tiny_noisy_draft)):
        result = run_sync(collect(LocalEngine(tiny_target, drafter).stream(ids, params, num_draft_tokens=3)))
        assert result.token_ids == reference


def test_kv_rollback_matches_a_fresh_forward(tiny_target):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, tiny_target.vocab_size, (12,), generator=g).tolist()
    branch_a = torch.randint(0, tiny_target.vocab_size, (5,), generator=g).tolist()
    branch_b = torch.randint(0, tiny_target.vocab_size, (4,), generator=g).tolist()
    session = KVSession(tiny_target)
    session.forward(prefix + branch_a, num_logits=6)
    assert session.cache.get_seq_length() == len(prefix + branch_a)
    rolled = session.forward(prefix + branch_b, num_logits=5)
    assert session.cache.get_seq_length() == len(prefix + branch_b) == len(session)
    fresh = KVSession(tiny_target).forward(prefix + branch_b, num_logits=5)
    assert torch.allclose(rolled, fresh, atol=1e-5)
    # Rolling back into the prefix itself, and asking for logits of already cached positions.
    again = session.forward(prefix[:8], num_logits=3)
    assert torch.allclose(again, KVSession(tiny_target).forward(prefix[:8], num_logits=3), atol=1e-5)
    assert session.cache.get_seq_length() == 8
    with pytest.raises(ValueError):
        session.forward(prefix, num_logits=0)


def test_verification_feeds_only_the_new_suffix(tiny_target, tiny_noisy_draft, references, monkeypatch):
    """After each verification the target keeps the accepted prefix in its cache and is fed
    exactly the pending token plus the k new drafts; the draft model is fed at most 2 tokens."""
    fed: list[tuple[str, int, int]] = []

    def recording(lm, tag):
        original = lm.forward

        def forward(input_ids, cache, num_logits, on_device=False):
            before = cache.get_seq_length()
            logits = original(input_ids, cache, num_logits, on_device)
            assert cache.get_seq_length() == before + len(input_ids)
            fed.append((tag, len(input_ids), before))
            return logits

        return forward

    monkeypatch.setattr(tiny_target, "forward", recording(tiny_target, "target"))
    monkeypatch.setattr(tiny_noisy_draft, "forward", recording(tiny_noisy_draft, "draft"))
    compared: list[int] = []  # tokens each forward compares with its cache: what changed since, not the context

    def comparing(cached, tokens, original=kv_module.common_prefix_length):
        compared.append(min(len(cached), len(tokens)))
        return original(cached, tokens)

    monkeypatch.setattr(kv_module, "common_prefix_length", comparing)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ids, reference = references[1]
    k = 4
    target = TargetSession(tiny_target, ids, params)
    drafter = ModelDrafter(tiny_noisy_draft).start(ids, params)
    verdict = target.prefill()
    assert fed == [("target", len(ids), 0)]
    partial_rounds = 0
    while len(target.tokens) - len(ids) < NEW_TOKENS:
        drafter.extend(verdict.tokens)
        fed.clear()
        proposal = drafter.propose(k)
        draft_feeds = [n for tag, n, _ in fed if tag == "draft"]
        assert len(draft_feeds) == k
        if len(drafter.tokens) > len(ids) + 1:
            assert max(draft_feeds) <= 2, draft_feeds
        committed = len(target.tokens)
        fed.clear()
        verdict = target.verify(proposal)
        assert fed == [("target", 1 + k, committed - 1)], fed
        partial_rounds += 0 < verdict.num_accepted < k
    assert target.tokens[len(ids) : len(ids) + NEW_TOKENS] == reference
    assert partial_rounds > 0
    assert len(target.tokens) > 2 * (k + 2) and max(compared) <= k + 2, max(compared)
    target.close()
    drafter.close()


# ---------------------------------------------------------------------------------------------
# The real embedded target


@pytest.mark.embedded
def test_embedded_target_greedy_equals_generate(embedded_target):
    lm = embedded_target
    prompt = encode_chat(lm.tokenizer, [("user", "List three facts about the moon, one per line.")])
    reference = hf_greedy(lm, prompt, NEW_TOKENS)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for drafter, k in ((NgramDrafter(), 4), (ModelDrafter(lm), 8)):
        result = run_sync(collect(LocalEngine(lm, drafter).stream(prompt, params, num_draft_tokens=k)))
        assert result.token_ids == reference, drafter.name
        assert result.stats.rounds > 0
        if isinstance(drafter, ModelDrafter):  # the target as its own draft
            assert result.stats.acceptance_rate == 1.0


@pytest.mark.embedded
def test_shipped_draft_with_embedded_target_greedy_equals_generate(embedded_target):
    """The distilled draft shipped in the package: loads by name, pairs with the embedded target,
    keeps greedy output identical, and is a real draft (accepts a share of its drafts on chat and code)."""
    from specdec.models import EMBEDDED_DRAFT, EMBEDDED_DRAFT_DIR, check_compatible, default_draft_model, load_model

    assert default_draft_model("embedded") == EMBEDDED_DRAFT
    assert (EMBEDDED_DRAFT_DIR / "model.safetensors").stat().st_size <= 30 * 1000 * 1000
    draft = load_model(EMBEDDED_DRAFT, device=TEST_DEVICE)
    check_compatible(embedded_target, draft)
    assert draft.head_token_ids is not None and len(draft.head_token_ids) < draft.logits_width  # FR-Spec head
    lm = embedded_target
    prompts = [
        encode_chat(lm.tokenizer, [("user", "Give me three tips for staying focused while studying.")]),
        lm.tokenizer("def is_palindrome(text: str) -> bool:\n    \"\"\"Return True if text reads the same "
                     "backwards.\"\"\"\n")["input_ids"],
    ]
    drafted = accepted = 0
    for prompt in prompts:
        reference = hf_greedy(lm, prompt, NEW_TOKENS)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        result = run_sync(collect(LocalEngine(lm, ModelDrafter(draft)).stream(prompt, params, num_draft_tokens=5)))
        assert result.token_ids == reference
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    # Measured 65 / 286 = 0.227 at k = 5 here (0.136 over all of MT-bench + HumanEval, its model card;
    # the stage-2 draft got 58 / 321, stage 1 47 / 371); an untrained draft of this shape accepts about nothing.
    assert drafted > 0 and accepted / drafted > 0.12, (accepted, drafted)


def test_generation_ends_by_length_where_the_model_context_is_full(tiny_target, tiny_noisy_draft):
    """max_new_tokens past the model's context: the generation commits tokens up to the last
    position (as plain decoding to max_length would) and ends with finish_reason "length", instead
    of asking the verifier for a block past the context (regression: INVALID_ARGUMENT on the gateway)."""
    context = tiny_target.max_positions
    ids = tiny_target.tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=context + 50, temperature=0.0, ignore_eos=True)
    result = run_sync(collect(LocalEngine(tiny_target, ModelDrafter(tiny_noisy_draft)).stream(
        ids, params, num_draft_tokens=4)))
    assert result.finish_reason == "length"
    assert len(ids) + len(result.token_ids) == context
    assert result.token_ids == hf_greedy(tiny_target, ids, context - len(ids))
    assert result.text == tiny_target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
