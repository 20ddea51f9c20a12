"""Stops that land inside an accepted block, streamed text, and seeds.

The target is its own draft with k = 8 so that (greedy) every draft is accepted and each
verification commits 9 tokens: a stop at a position that is not a multiple of 9 falls inside a
block. Output must end exactly where target-only decoding ends, with nothing emitted or counted
past it.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from specdec.completion import FINISH_LENGTH, FINISH_STOP, Chunk, CompletionBuilder
from specdec.drafters import ModelDrafter
from specdec.engine import GenerationResult, run_sync
from specdec.local import LocalEngine
from specdec.policy import DraftLengthPolicy
from specdec.wire_types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

K = 8
BLOCK = K + 1
NEW_TOKENS = 64

PROMPTS = [
    "the quick brown fox",
    "a",
    "emoji 🎉 and accents é à ç",
    "I am a small assistant. I am a small",
    "numbers 0 1 2 3 4 5 6 7 8 9",
    "for i in range(10):\n",
    "def add(a, b):\n",
    "Hello! How can I help you today?",
]


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


async def _stream(engine, prompt, params, k=K, policy=None):
    chunks, result = [], None
    async for event in engine.stream(prompt, params, num_draft_tokens=k, policy=policy):
        if isinstance(event, GenerationResult):
            result = event
        else:
            assert isinstance(event, Chunk)
            chunks.append(event)
    return chunks, result


def stream(engine, prompt, params, k=K, policy=None):
    return run_sync(_stream(engine, prompt, params, k, policy))


@pytest.fixture(scope="module")
def own_engine(tiny_target):
    return LocalEngine(tiny_target, ModelDrafter(tiny_target))


@pytest.fixture(scope="module")
def greedy_refs(tiny_target):
    """Target-only greedy decoding (no drafter), ignoring EOS: the ground truth."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LocalEngine(tiny_target, None)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    refs = []
    for text in PROMPTS:
        ids = tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"]
        _, result = stream(engine, ids, params, k=0)
        refs.append((ids, result.token_ids))
    torch.set_num_threads(threads)
    return refs


def mid_block(j: int) -> bool:
    """Index j of the completion is inside a block of 9 (prefill gives index 0; block r gives
    indices 9r-8 .. 9r) and is not its last token."""
    return j > 0 and j % BLOCK != 0


def check_consistent(result, chunks, tokenizer, expected_ids, finish, k=K):
    """Output equals ``expected_ids``; stats count exactly what was emitted; chunks add up."""
    assert result.token_ids == expected_ids
    assert result.finish_reason == finish
    assert [t for c in chunks for t in c.token_ids] == expected_ids
    assert "".join(c.text for c in chunks) == result.text
    stats = result.stats
    assert stats.completion_tokens == len(expected_ids) == 1 + stats.emitted_in_rounds
    # Every draft is accepted (target as its own draft), so round r emits min(k_r + 1, left)
    # tokens of which min(k_r, emitted) are accepted drafts.
    left, accepted = len(expected_ids) - 1, 0
    for k_r in stats.k_history:
        emitted = min(k_r + 1, left)
        accepted += min(k_r, emitted)
        left -= emitted
    assert left == 0
    assert stats.accepted_tokens == accepted == sum(stats.per_position_accepted)
    assert stats.accepted_tokens <= stats.emitted_in_rounds
    assert max(stats.k_history) <= k


# ---------------------------------------------------------------------------------------------
# Through the engine, greedy


def assert_stopped_inside_block(result) -> None:
    """The last round asked for more drafts than survived the stop, and the drafts past the stop
    were counted neither as drafted nor as accepted (the self-draft accepts all that count)."""
    stats = result.stats
    counted_before_last = sum(stats.k_history[:-1])
    last_counted = stats.draft_tokens - counted_before_last
    assert stats.k_history[-1] > last_counted
    assert stats.draft_tokens == stats.accepted_tokens and stats.acceptance_rate == 1.0


def test_eos_inside_an_accepted_block(own_engine, greedy_refs, tiny_target):
    eos = set(tiny_target.eos_token_ids)
    cases = []
    for ids, ref in greedy_refs:
        first = next((j for j, t in enumerate(ref) if t in eos), None)
        if first is not None and mid_block(first):
            cases.append((ids, ref, first))
    assert len(cases) >= 2, "no prompt puts EOS inside a block; add prompts"
    for ids, ref, j in cases:
        chunks, result = stream(own_engine, ids, SamplingParams(max_new_tokens=NEW_TOKENS))
        check_consistent(result, chunks, tiny_target.tokenizer, ref[: j + 1], FINISH_STOP)
        assert result.token_ids[-1] in eos  # EOS is kept in token_ids (as generate does)
        assert result.text == decode(tiny_target.tokenizer, ref[:j])
        assert_stopped_inside_block(result)


def test_stop_token_id_inside_an_accepted_block(own_engine, greedy_refs, tiny_target):
    tested = 0
    for ids, ref in greedy_refs:
        for j in (5, 13, 21):
            token = ref[j]
            if ref.index(token) != j or not mid_block(j):
                continue
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=(token,))
            chunks, result = stream(own_engine, ids, params)
            check_consistent(result, chunks, tiny_target.tokenizer, ref[: j + 1], FINISH_STOP)
            assert_stopped_inside_block(result)
            tested += 1
    assert tested >= 5


def _stop_string_at(tokenizer, ref: list[int], j: int, length: int) -> str | None:
    """A stop string completed by token j: the last ``length`` chars of the text through j,
    found in no shorter prefix, free of U+FFFD and whitespace-only strings."""
    text = decode(tokenizer, ref[: j + 1])
    s = text[-length:]
    if len(s) < length or "\ufffd" in s or not s.strip():
        return None
    if any(s in decode(tokenizer, ref[: i + 1]) for i in range(j)):
        return None
    return s


def test_stop_string_inside_an_accepted_block(own_engine, greedy_refs, tiny_target):
    tok = tiny_target.tokenizer
    tested = 0
    for ids, ref in greedy_refs:
        for j in range(3, 40):
            if not mid_block(j) or (s := _stop_string_at(tok, ref, j, 2)) is None:
                continue
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=(s, "never-seen-stop"))
            chunks, result = stream(own_engine, ids, params)
            check_consistent(result, chunks, tok, ref[: j + 1], FINISH_STOP)
            full = decode(tok, ref[: j + 1])
            assert result.text == full[: full.index(s)]
            assert s not in result.text and s not in "".join(c.text for c in chunks)
            tested += 1
            break
    assert tested >= 4


def test_stop_string_spanning_two_blocks_is_held_back(own_engine, greedy_refs, tiny_target):
    """Token j-1 ends one block and token j starts the next; the stop string starts in j-1's text.
    The chunk of the first block must not stream the stop string's beginning."""
    tok = tiny_target.tokenizer
    tested = 0
    for ids, ref in greedy_refs:
        for j in range(BLOCK + 1, 50, BLOCK):  # j - 1 is a block's last token
            before, through = decode(tok, ref[:j]), decode(tok, ref[: j + 1])
            if not through.startswith(before) or len(through) == len(before) or not before:
                continue
            s = before[-1] + through[len(before)]
            if "\ufffd" in s or not s.strip() or any(s in decode(tok, ref[: i + 1]) for i in range(j)):
                continue
            params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop=(s,))
            chunks, result = stream(own_engine, ids, params)
            check_consistent(result, chunks, tok, ref[: j + 1], FINISH_STOP)
            assert result.text == before[:-1]
            streamed_before_last = "".join(c.text for c in chunks[:-1])
            assert streamed_before_last == before[: len(streamed_before_last)]
            assert len(streamed_before_last) <= len(before) - 1  # s[0] was held back
            tested += 1
            break
    assert tested >= 2


@pytest.mark.parametrize("max_new_tokens", [2, 5, 13, 30])
def test_max_new_tokens(own_engine, greedy_refs, tiny_target, max_new_tokens):
    for ids, ref in greedy_refs[:3]:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        chunks, result = stream(own_engine, ids, params)
        check_consistent(result, chunks, tiny_target.tokenizer, ref[:max_new_tokens], FINISH_LENGTH)
        assert result.stats.acceptance_rate == (1.0 if result.stats.draft_tokens else 0.0)


class OvershootingPolicy(DraftLengthPolicy):
    """Ignores ``max_k``: blocks then run past max_new_tokens, which must cut them."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, max_k: int) -> int:
        return self.k


def test_max_new_tokens_inside_a_block(own_engine, greedy_refs, tiny_target):
    for ids, ref in greedy_refs[:3]:
        for n in (2, 4, 12):
            params = SamplingParams(max_new_tokens=n, ignore_eos=True)
            chunks, result = stream(own_engine, ids, params, policy=OvershootingPolicy(K))
            check_consistent(result, chunks, tiny_target.tokenizer, ref[:n], FINISH_LENGTH)
            assert result.stats.k_history[-1] == K  # the last block was longer than what was left


def test_eos_at_the_length_limit_reports_stop(own_engine, greedy_refs, tiny_target):
    eos = set(tiny_target.eos_token_ids)
    for ids, ref in greedy_refs:
        first = next((j for j, t in enumerate(ref) if t in eos), None)
        if first is None:
            continue
        params = SamplingParams(max_new_tokens=first + 1)
        _, result = stream(own_engine, ids, params)
        assert result.token_ids == ref[: first + 1] and result.finish_reason == FINISH_STOP
        return
    pytest.fail("no prompt produces EOS")


def test_streamed_text_never_splits_characters(own_engine, greedy_refs, tiny_target):
    """Chunks concatenate to the final text: a partial UTF-8 character streamed as U+FFFD would
    stay in the concatenation while the final decode has the real character (or vice versa)."""
    tok = tiny_target.tokenizer
    for ids, ref in greedy_refs:
        for k in (1, K):
            chunks, result = stream(own_engine, ids, SamplingParams(max_new_tokens=40, ignore_eos=True), k=k)
            assert "".join(c.text for c in chunks) == result.text == decode(tok, ref[:40])


# ---------------------------------------------------------------------------------------------
# Sampled: the stop does not change what precedes it


def test_sampled_stops_inside_blocks(own_engine, tiny_target):
    tok = tiny_target.tokenizer
    ids = tok("the quick brown fox", add_special_tokens=False)["input_ids"]
    base = dict(temperature=1.0, ignore_eos=True, draft_top_k=tiny_target.vocab_size)
    tested = 0
    for seed in range(4):
        _, free = stream(own_engine, ids, SamplingParams(max_new_tokens=40, seed=seed, **base))
        ref = free.token_ids
        assert len(ref) == 40
        j = next(j for j in range(4, 40) if mid_block(j) and ref.index(ref[j]) == j)
        params = SamplingParams(max_new_tokens=40, seed=seed, stop_token_ids=(ref[j],), **base)
        chunks, result = stream(own_engine, ids, params)
        assert result.token_ids == ref[: j + 1] and result.finish_reason == FINISH_STOP
        assert "".join(c.text for c in chunks) == result.text
        # max_new_tokens = j + 1 shortens the last block, so token j becomes that block's bonus
        # (a different draw); everything before it is unchanged.
        _, short = stream(own_engine, ids, SamplingParams(max_new_tokens=j + 1, seed=seed, **base))
        assert short.token_ids[:j] == ref[:j] and len(short.token_ids) == j + 1
        assert short.finish_reason == FINISH_LENGTH
        tested += 1
    assert tested == 4


# ---------------------------------------------------------------------------------------------
# Seeds


def test_same_seed_repeats_and_seeds_differ(tiny_target, tiny_noisy_draft):
    engine = LocalEngine(tiny_target, ModelDrafter(tiny_noisy_draft))
    ids = tiny_target.tokenizer("Hello! How can I help", add_special_tokens=False)["input_ids"]

    def params(seed):
        return SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)

    outputs = {}
    for seed in range(5):
        _, first = stream(engine, ids, params(seed), k=3)
        _, again = stream(engine, ids, params(seed), k=3)
        assert first.token_ids == again.token_ids and first.text == again.text
        assert first.stats.rounds > 0
        outputs[seed] = tuple(first.token_ids)
    assert len(set(outputs.values())) == 5

    # Concurrent requests do not disturb each other's draws.
    async def both():
        return await asyncio.gather(
            _stream(engine, ids, params(1), 3), _stream(engine, ids, params(2), 3), _stream(engine, ids, params(1), 3)
        )

    (_, one), (_, two), (_, one_again) = run_sync(both())
    assert tuple(one.token_ids) == outputs[1] == tuple(one_again.token_ids)
    assert tuple(two.token_ids) == outputs[2]


# ---------------------------------------------------------------------------------------------
# CompletionBuilder directly


@pytest.fixture(scope="module")
def tok(tiny_target):
    return tiny_target.tokenizer


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def feed(builder: CompletionBuilder, ids: list[int], sizes=None) -> list[Chunk]:
    chunks, i = [], 0
    sizes = sizes or [1] * len(ids)
    for size in sizes:
        chunks.append(builder.add(ids[i : i + size]))
        i += size
    return chunks


def test_builder_stop_token_mid_block(tok):
    ids = encode(tok, "the quick brown fox")
    stop = ids[2]
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, stop_token_ids=(stop,)))
    chunk = builder.add(ids)
    assert chunk.token_ids == ids[:3] and builder.token_ids == ids[:3]
    assert builder.finish_reason == FINISH_STOP and builder.finished
    assert chunk.text == decode(tok, ids[:3]) == builder.text
    assert builder.add(ids) == Chunk([], "")  # nothing after the stop


def test_builder_eos_and_ignore_eos(tok):
    eos = tok.eos_token_id
    ids = encode(tok, "hello") + [eos] + encode(tok, " world")
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50), eos_token_ids=(eos,))
    chunk = builder.add(ids)
    assert builder.token_ids[-1] == eos and len(builder.token_ids) == ids.index(eos) + 1
    assert builder.finish_reason == FINISH_STOP and chunk.text == "hello" == builder.text
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, ignore_eos=True), eos_token_ids=(eos,))
    builder.add(ids)
    assert not builder.finished and builder.text == "hello world"
    # an explicit stop token id still stops with ignore_eos
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, stop_token_ids=(eos,))
    builder = CompletionBuilder(tok, params, eos_token_ids=(eos,))
    builder.add(ids)
    assert builder.finish_reason == FINISH_STOP


def test_builder_max_new_tokens_mid_block(tok):
    ids = encode(tok, "the quick brown fox jumps")
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=3))
    chunk = builder.add(ids[:2])
    assert not builder.finished and chunk.token_ids == ids[:2]
    chunk = builder.add(ids[2:])
    assert chunk.token_ids == [ids[2]] and builder.finish_reason == FINISH_LENGTH
    assert builder.text == decode(tok, ids[:3])
    # EOS as the last allowed token: "stop" wins
    eos = tok.eos_token_id
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=3), eos_token_ids=(eos,))
    builder.add(ids[:2] + [eos] + ids[2:])
    assert builder.finish_reason == FINISH_STOP and builder.token_ids == ids[:2] + [eos]


def test_builder_stop_string_mid_block(tok):
    text = "the quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, stop=("fox",)))
    chunk = builder.add(ids)
    assert builder.finish_reason == FINISH_STOP
    assert builder.text == chunk.text == "the quick brown "
    # the token completing the stop string is the last kept, nothing after it
    n = len(builder.token_ids)
    assert "fox" in decode(tok, ids[:n]) and "fox" not in decode(tok, ids[: n - 1])
    assert chunk.token_ids == ids[:n]


def test_builder_earliest_stop_string_wins(tok):
    ids = encode(tok, "the quick brown fox jumps")
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, stop=("jumps", "quick")))
    builder.add(ids)
    assert builder.text == "the "


def test_builder_stop_string_spanning_two_tokens_is_held_back(tok):
    text = "the quick brown fox jumps over the lazy dog"
    ids = encode(tok, text)
    tested = 0
    for j in range(1, len(ids)):
        before, through = decode(tok, ids[:j]), decode(tok, ids[: j + 1])
        s = before[-2:] + through[len(before) : len(before) + 2]
        if len(s) < 4 or text.index(s) < len(before) - 2:
            continue
        builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, stop=(s,)))
        streamed = "".join(c.text for c in feed(builder, ids[:j]))
        assert not builder.finished
        assert streamed == before[:-2]  # the stop string's beginning is not streamed
        last = builder.add(ids[j:])
        assert builder.finish_reason == FINISH_STOP and builder.token_ids == ids[: j + 1]
        assert streamed + last.text == builder.text == before[:-2]
        tested += 1
    assert tested >= 5


def test_builder_releases_held_back_text_when_stop_does_not_complete(tok):
    ids = encode(tok, "the quick brown fox jumps")
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=50, stop=("fox!",)))
    deltas = [c.text for c in feed(builder, ids)]
    joined = "".join(deltas)
    assert not builder.finished
    assert joined == "the quick brown fox jumps" == builder.text
    # while "fox" was the tail it was held back
    n = next(i for i in range(len(ids)) if decode(tok, ids[: i + 1]).endswith("fox"))
    assert "".join(deltas[: n + 1]).endswith("brown ")


MULTIBYTE = "ok 日本語 ß 中文 🎉 ñ ü → ∑ done"


@pytest.mark.parametrize("seed", range(4))
def test_builder_never_splits_utf8_characters(tok, seed):
    ids = encode(tok, MULTIBYTE)
    assert decode(tok, ids) == MULTIBYTE
    assert any("\ufffd" in decode(tok, ids[:i]) for i in range(len(ids)))  # splits do happen
    rng = random.Random(seed)
    sizes, left = [], len(ids)
    while left:
        sizes.append(min(left, rng.randint(1, 4) if seed else 1))
        left -= sizes[-1]
    for stop in ((), ("never",), ("∑!",)):
        # Finishing by length on the last token releases any text held back for a stop string.
        builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=len(ids), stop=stop))
        deltas = [c.text for c in feed(builder, ids, sizes)]
        assert builder.finish_reason == FINISH_LENGTH
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == MULTIBYTE == builder.text


@pytest.mark.parametrize("stop", ["中", "ß 中", "中文", "🎉", "日本語", "∑"])
def test_builder_stop_string_ending_in_a_split_character(tok, stop):
    """A stop string whose last character arrives byte by byte must still be found
    (regression: the search started after the U+FFFD that the new token completed)."""
    ids = encode(tok, MULTIBYTE)
    builder = CompletionBuilder(tok, SamplingParams(max_new_tokens=200, stop=(stop,)))
    deltas = [c.text for c in feed(builder, ids)]
    expected = MULTIBYTE[: MULTIBYTE.index(stop)]
    assert builder.finish_reason == FINISH_STOP
    assert builder.text == expected == "".join(deltas)
    n = len(builder.token_ids)
    assert stop in decode(tok, ids[:n]) and stop not in decode(tok, ids[: n - 1])


# ---------------------------------------------------------------------------------------------
# Incremental detokenization: bounded work per token, the same text as a full decode

LONG_TEXTS = [
    MULTIBYTE * 3,
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n# 日本語 🎉🎉 done",
    " leading spaces,   runs of   spaces\tand\ttabs\n\n\nand newlines ü→∑ ",
]


class CountingTokenizer:
    """A tokenizer whose ``decode`` records how many ids each call covers."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.widths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.widths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_incremental_text_equals_the_full_decode_with_bounded_windows(which, tiny_target, embedded_target):
    tokenizer = (tiny_target if which == "tiny" else embedded_target).tokenizer
    special = tokenizer.eos_token_id
    for text in LONG_TEXTS:
        ids = encode(tokenizer, text) * 20  # a long completion: ~1-2k tokens
        ids[len(ids) // 3 : len(ids) // 3] = [special] * 40  # skipped special tokens (ignore_eos)
        counting = CountingTokenizer(tokenizer)
        builder = CompletionBuilder(counting, SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=("never",)))
        deltas = [c.text for c in feed(builder, ids, [1 + i % 5 for i in range(len(ids))][: len(ids)])]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert builder.finish_reason == FINISH_LENGTH
        assert "".join(deltas) == builder.text == full
        assert all("\ufffd" not in d for d in deltas)
        # Each token costs decodes of a few tokens, never of the completion so far.
        assert len(ids) > 500 and max(counting.widths) <= 16, max(counting.widths)
        assert len(counting.widths) <= 2 * len(ids) + 2
