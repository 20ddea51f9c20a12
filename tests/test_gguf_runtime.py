"""The gguf runtime (specdec.gguf, issue #43): its exactness contract and its bookkeeping.

A position's logits depend neither on how its passes were cut nor on which sessions shared them,
bit for bit; so speculative decoding on this runtime equals its own plain decoding token for token.
That holds for quantized and float files alike (q4_1 and f32 here).
Tiny random Llama GGUFs (tests/tiny_gguf.py) carry the embedded model's tokenizer; their greedy top-2
gaps can be tiny, so the runtime is only ever compared with itself, never with torch.
"""

from __future__ import annotations

import gc
import random
import shutil
from pathlib import Path

import pytest
import torch

from specdec.completion import CompletionBuilder
from specdec.drafters import ModelDrafter
from specdec.drafting import ScriptedDrafter
from specdec.engine import LocalDrafter, LocalVerifier, collect, generate, run_sync
from specdec.gguf.build import LIBRARY_ENV, built_dir
from specdec.gguf import SequencesExhausted
from specdec.gguf.runtime import POSITIONS_ENV, SEQUENCES_ENV, THREADS_ENV
from specdec.kv import KVSession
from specdec.local import LocalEngine
from specdec.models import CACHE_ENV, EMBEDDED_GGUF, ModelLoadError, load_model, load_tokenizer, tokenizer_fingerprint
from specdec.pass_options import RUNTIME_ENV
from specdec.policy import FixedDraftLength
from specdec.ragged import ForwardRow, batched_forward
from specdec.sampling import greedy_tokens
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.verification import TargetSession, verify_batch
from tests.test_distribution import _first_tokens, assert_first_three_follow_target
from tests.test_greedy_equality import RecordingPolicy, corrupting_script
from tests.tiny_gguf import build_tiny_gguf

FILE_TYPES = ("q4_1", "f32")  # the same seed: the f32 file is a close draft of the q4_1 one
PROMPTS = [
    "the quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "1 2 1 2 1 2 1 2",
    "Hello! How can I help you today?",
    "ünïcödé bytes: 日本語のテキスト",
]
STEPS = 64  # greedy tokens each reference runs past its prompt
NEW_TOKENS = 48

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Fixtures (the services' tests share them)


def tiny_gguf_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny GGUFs, built once per test session under its base temp dir (both test modules use them)."""
    root = tmp_path_factory.getbasetemp() / "tiny-gguf"
    if not root.is_dir():
        staging = tmp_path_factory.mktemp("tiny-gguf-staging")
        for file_type in FILE_TYPES:
            build_tiny_gguf(staging / f"tiny-{file_type}.gguf", file_type=file_type)
        shutil.move(staging, root)
    return {file_type: root / f"tiny-{file_type}.gguf" for file_type in FILE_TYPES}


def gguf_env(tmp_path_factory) -> dict[str, str]:
    """The environment the gguf tests run under (in-process and in the services they start).

    One llama.cpp thread: on a busy 2-core machine, threads that spin-wait for each other make a tiny
    model's passes far slower. specdec's cache in the test's temp dir: the tokenizer a GGUF converts
    to is cached by the file's path, new each run (the llama.cpp build stays where it is)."""
    built = built_dir()
    assert built is not None, "llama.cpp is not built: run `make setup` (python -m specdec.gguf.build)"
    return {LIBRARY_ENV: str(built), CACHE_ENV: str(tmp_path_factory.getbasetemp() / "tiny-gguf-cache"),
            THREADS_ENV: "1"}


@pytest.fixture(scope="module", autouse=True)
def environment(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in gguf_env(tmp_path_factory).items():
            patch.setenv(name, value)
        for name in (SEQUENCES_ENV, POSITIONS_ENV):
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_gguf_files(tmp_path_factory)


@pytest.fixture(scope="module")
def models(files, environment):
    return {file_type: load_model(str(path), device="cpu", runtime="gguf") for file_type, path in files.items()}


def prompt_ids(lm, text: str) -> list[int]:
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def one_token_reference(lm, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding one token per pass from the very first prompt token: the tokens (prompt and
    ``steps`` more) and the logits row of every position but the last (row p predicts token p + 1)."""
    kv = KVSession(lm)
    tokens, rows = list(ids), []
    try:
        for position in range(len(ids) + steps - 1):
            row = kv.forward(tokens[: position + 1], 1, committed=position + 1)[0]
            rows.append(row)
            if position + 1 == len(tokens):
                tokens.append(int(greedy_tokens(row[None], lm.vocab_size)[0]))
    finally:
        kv.close()
    return tokens, torch.stack(rows)


@pytest.fixture(scope="module")
def references(models):
    return {file_type: [one_token_reference(lm, prompt_ids(lm, text), STEPS) for text in PROMPTS]
            for file_type, lm in models.items()}


# ---------------------------------------------------------------------------------------------
# 1. Exactness: pass- and batch-invariant, bit for bit


class Speculation:
    """Sessions replaying the references in verify-like passes: each pass feeds the pending token and
    0..7 drafts (some wrong, so the next pass rolls back), co-batched with the other sessions and
    with throwaway sessions that reuse sequences freed before."""

    def __init__(self, lm, references, rng: random.Random) -> None:
        self.lm, self.references, self.rng = lm, references, rng
        self.kvs: list[KVSession | None] = [None] * len(references)
        self.committed = [0] * len(references)  # tokens of the reference committed (0: not started)
        self.junk: list[KVSession] = []
        self.compared = self.differing = self.wrong_drafts = 0

    def junk_rows(self) -> list[ForwardRow]:
        """Open, feed and close throwaway sessions: their sequences' cells hold stale keys and values
        when a real session gets them, and their rows share the real sessions' passes."""
        rng = self.rng
        if self.junk and rng.random() < 0.3:
            self.junk.pop(rng.randrange(len(self.junk))).close()
        if len(self.junk) < 4 and rng.random() < 0.4:
            self.junk.append(KVSession(self.lm))
        rows = []
        for kv in self.junk:
            if rng.random() < 0.6:
                if len(kv) > 200:
                    kv.rollback(rng.randrange(len(kv)))
                tokens = kv.cached_tokens + [rng.randrange(self.lm.vocab_size) for _ in range(rng.randint(1, 8))]
                rows.append(ForwardRow(kv, tokens, rng.randint(1, len(tokens) - len(kv.cached_tokens))))
        return rows

    def session_row(self, i: int) -> tuple[ForwardRow, int, list[int]]:
        """Session i's row: (row, the position of its first logits row, its drafts)."""
        tokens, _ = self.references[i]
        rng = self.rng
        if self.kvs[i] is None:  # its prefill: logits at every prompt position
            self.kvs[i] = KVSession(self.lm)
            prompt = len(tokens) - STEPS
            return ForwardRow(self.kvs[i], tokens[:prompt], prompt, committed=prompt), 0, []
        done = self.committed[i]
        k = min(rng.randint(0, 7), len(tokens) - 1 - done)
        drafts = list(tokens[done:done + k])
        for j in range(k):
            if rng.random() < 0.25:
                drafts[j] = rng.randrange(self.lm.vocab_size)
        return ForwardRow(self.kvs[i], tokens[:done] + drafts, k + 1, committed=done), done - 1, drafts

    def run(self) -> None:
        for _ in range(self.lm.gguf.context.sequences):  # every sequence holds stale cells when a session gets it
            kv = KVSession(self.lm)
            kv.forward([self.rng.randrange(self.lm.vocab_size) for _ in range(self.rng.randint(1, 100))], 1)
            self.junk.append(kv)
        while self.junk:
            self.junk.pop().close()
        while any(done < len(tokens) for done, (tokens, _) in zip(self.committed, self.references)):
            live = [i for i, (done, (tokens, _)) in enumerate(zip(self.committed, self.references))
                    if done < len(tokens) and (self.kvs[i] is not None or self.rng.random() < 0.5)]
            live = [i for i in live if self.rng.random() < 0.75] or live[:1]
            if not live:
                continue
            planned = [self.session_row(i) for i in live]
            rows = [row for row, _, _ in planned] + self.junk_rows()
            self.rng.shuffle(rows)
            logits = dict(zip(map(id, rows), batched_forward(self.lm, rows)))
            for i, (row, first, drafts) in zip(live, planned):
                self.check(i, logits[id(row)], first, drafts)
        for kv in self.kvs + self.junk:
            kv.close()

    def check(self, i: int, logits: torch.Tensor, first: int, drafts: list[int]) -> None:
        """Compare the rows of committed positions with the reference and commit as greedy would."""
        tokens, reference = self.references[i]
        for j in range(len(logits)):
            self.compared += 1
            self.differing += not torch.equal(logits[j], reference[first + j])
            if j < len(drafts) and drafts[j] != tokens[first + j + 1]:
                self.wrong_drafts += 1
                break  # the rows after a wrong draft are not the reference's positions
        # j drafts accepted, and the token after them (row j's greedy token) committed
        self.committed[i] = first + j + 2


# Float weights too: specdec.gguf.build turns llamafile's GEMM off, whose multi-token float products
# round unlike the one-token path (quantized products round alike either way).
@pytest.mark.parametrize("file_type", ["q4_1", "f32"])
def test_rows_are_bitwise_equal_to_one_token_passes_whatever_the_pass(file_type, models, references):
    run = Speculation(models[file_type], references[file_type], random.Random(sum(map(ord, file_type))))
    run.run()
    assert run.differing == 0, f"{run.differing} of {run.compared} rows differ from the one-token passes"
    assert run.compared > 300 and run.wrong_drafts > 40, (run.compared, run.wrong_drafts)


@pytest.mark.parametrize("file_type", ["q4_1", "f32"])
def test_a_long_prompt_in_one_pass_or_in_chunks_beside_others_gives_the_one_token_rows(file_type, models):
    """llama.cpp computes a sequence's rows by another path once a ubatch holds 64 of its tokens:
    a 150-token prompt fed in one pass, or in chunks of 40 / 64 / 100 beside another session's
    passes (as the scheduler chunks a prefill under load), gives bitwise the rows of one-token
    passes (``MAX_TOKENS_PER_DECODE``)."""
    lm = models[file_type]
    rng = random.Random(7)
    ids = [rng.randrange(3, lm.vocab_size) for _ in range(150)]
    reference = torch.cat([lm.gguf.forward([kv], [[t]], [1]) for kv in [lm.gguf.new_kv()] for t in ids])
    for chunk in (150, 100, 64, 40):
        kv, other = lm.gguf.new_kv(), lm.gguf.new_kv()
        rows = []
        try:
            for start in range(0, len(ids), chunk):
                piece = ids[start:start + chunk]
                rows.append(lm.gguf.forward([other, kv], [[5, 6, 7], piece], [1, len(piece)])[1:])
        finally:
            kv.release()
            other.release()
        rows = torch.cat(rows)
        differing = int((rows != reference).any(dim=1).sum())
        assert differing == 0, f"chunks of {chunk}: {differing} of {len(ids)} rows differ from one-token passes"


# ---------------------------------------------------------------------------------------------
# 2. Speculative decoding on gguf equals its own plain decoding


async def decode(lm, ids: list[int], params: SamplingParams, drafter=None, policy=None):
    session = TargetSession(lm, ids, params)
    draft_session = drafter.start(ids, params) if drafter is not None else None
    try:
        return await collect(generate(
            prompt_tokens=len(ids), completion=CompletionBuilder(lm.tokenizer, params, lm.eos_token_ids),
            verifier=LocalVerifier(session), drafter=LocalDrafter(draft_session) if draft_session else None,
            policy=policy or FixedDraftLength(0), draft_method=drafter.name if drafter else "none"))
    finally:
        session.close()
        if draft_session is not None:
            draft_session.close()


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(models):
    lm = models["q4_1"]
    return [(ids, run_sync(decode(lm, ids, GREEDY)).token_ids) for ids in (prompt_ids(lm, p) for p in PROMPTS)]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_equals_plain_gguf_decoding(k, models, plain_greedy):
    lm = models["q4_1"]
    rounds = []
    for ids, expected in plain_greedy:
        policy = RecordingPolicy(k)
        drafter = ScriptedDrafter(corrupting_script(ids, expected, lm.vocab_size))
        result = run_sync(decode(lm, ids, GREEDY, drafter, policy))
        assert result.token_ids == expected, ids
        rounds += [r for r in policy.rounds if r.num_drafts]
    assert sum(r.num_accepted < r.num_drafts for r in rounds) >= 15, "drafts were rarely rejected"
    assert sum(r.num_accepted > 0 for r in rounds) >= 15, "drafts were rarely accepted"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=40,
                                                           seed=11, ignore_eos=True)], ids=["greedy", "sampled"])
def test_verify_batch_over_sessions_equals_each_alone(params, models, plain_greedy):
    lm = models["q4_1"]
    rng = random.Random(3)
    scripts = [corrupting_script(ids, expected, lm.vocab_size) for ids, expected in plain_greedy]
    together = [TargetSession(lm, ids, params) for ids, _ in plain_greedy]
    alone = [TargetSession(lm, ids, params) for ids, _ in plain_greedy]
    proposals = [DraftProposal()] * len(together)
    try:
        while True:
            live = [i for i, s in enumerate(together) if len(s.tokens) < s.prompt_length + NEW_TOKENS - 8]
            if not live:
                break
            live = [i for i in live if rng.random() < 0.7] or live[:1]
            verdicts = verify_batch(lm, [(together[i], proposals[i]) for i in live])
            for i, verdict in zip(live, verdicts):
                assert not isinstance(verdict, Exception), verdict
                own = alone[i].verify(proposals[i])
                assert (verdict.tokens, verdict.num_accepted) == (own.tokens, own.num_accepted), i
                proposals[i] = scripts[i](together[i].tokens, rng.randint(1, 6), params)
        if params.greedy:  # and both are plain greedy decoding's tokens
            for session, (ids, expected) in zip(together, plain_greedy):
                generated = session.tokens[len(ids):]
                assert generated == expected[:len(generated)]
    finally:
        for session in together + alone:
            session.close()


# ---------------------------------------------------------------------------------------------
# 3. Sampling with drafts follows the target's own distribution


def test_sampling_with_model_drafts_follows_the_gguf_target(models):
    """The first three tokens over many seeds follow p(t1) p(t2 | t1) p(t3 | t1 t2), the target's own
    logits under the request's processing; the f32 file drafts for the q4_1 one (close, not equal)."""
    target, draft = models["q4_1"], models["f32"]
    prompt = prompt_ids(target, "the quick brown fox jumps")
    runs = 600

    def params_for_seed(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=seed, ignore_eos=True)

    engine = LocalEngine(target, ModelDrafter(draft))
    outcomes, accepted_second_draft = run_sync(_first_tokens(engine, prompt, params_for_seed, runs, k=2))
    assert accepted_second_draft > runs // 10, accepted_second_draft
    assert_first_three_follow_target(target, prompt, params_for_seed(0), outcomes)


# ---------------------------------------------------------------------------------------------
# 4. KV caches as sequences: rollback, release, failed passes


@pytest.fixture
def two_sequences(files, monkeypatch):
    """The q4_1 file in a context of 2 sequences of few positions, and its one-token references."""
    monkeypatch.setenv(POSITIONS_ENV, "64")
    lm = load_model(str(files["q4_1"]), device="cpu", runtime="gguf", sessions=2)
    assert lm.gguf.context.sequences == 2
    yield lm, [one_token_reference(lm, prompt_ids(lm, text), 12) for text in PROMPTS[:3]]
    lm.gguf.close()


def test_rollback_then_forward_equals_a_fresh_session(models, references):
    lm = models["q4_1"]
    tokens, reference = references["q4_1"][0]
    kv = KVSession(lm)
    other = [t + 1 for t in tokens]
    kv.forward(tokens[:20] + other[20:40], 1)
    kv.rollback(20)
    assert len(kv) == kv.cache.length == 20 and lm.gguf.context.last_position(kv.cache.seq_id) == 19
    assert torch.equal(kv.forward(tokens[:30], 10), reference[20:30])
    # prepare() rolls back to the shared prefix by itself
    fresh = KVSession(lm)
    assert torch.equal(kv.forward(tokens[:25] + other[25:27], 1), fresh.forward(tokens[:25] + other[25:27], 1))
    fresh.close()
    assert torch.equal(kv.forward(tokens[:35], 5), reference[30:35])
    kv.cache.crop(-5)
    assert kv.cache.length == 30 and lm.gguf.context.last_position(kv.cache.seq_id) == 29
    kv.close()


def test_closed_and_collected_sessions_return_their_sequences(two_sequences):
    lm, refs = two_sequences
    for turn in range(8):  # many sessions, two at a time, each on a sequence others used before
        tokens, reference = refs[turn % len(refs)]
        kvs = [KVSession(lm), KVSession(lm)]
        for kv in kvs:
            assert torch.equal(kv.forward(tokens[:-1], len(tokens) - 1), reference)
        with pytest.raises(SequencesExhausted):
            KVSession(lm)
        for kv in kvs:
            kv.close()
    held, dropped = KVSession(lm), KVSession(lm)
    dropped.forward(refs[1][0], 1)
    del dropped  # never closed: collected, its sequence comes back
    gc.collect()
    tokens, reference = refs[0]
    again = KVSession(lm)
    assert torch.equal(again.forward(tokens[:-1], len(tokens) - 1), reference)
    held.close()
    again.close()


def test_sequences_other_sessions_dirtied_give_the_same_logits(two_sequences):
    """A sequence a closed session filled (then cut back) serves the next session exactly."""
    lm, refs = two_sequences
    rng = random.Random(5)
    for tokens, reference in refs:
        dirty = [KVSession(lm), KVSession(lm)]
        for kv in dirty:
            kv.forward([rng.randrange(lm.vocab_size) for _ in range(rng.randint(20, 120))], 1)
            kv.rollback(rng.randint(0, 10))
            kv.close()
        fresh = KVSession(lm)
        assert torch.equal(fresh.forward(tokens[:-1], len(tokens) - 1), reference)
        fresh.close()


def _state(lm, kvs: list[KVSession]) -> list[tuple[int, int, int]]:
    return [(len(kv), kv.cache.length, lm.gguf.context.last_position(kv.cache.seq_id)) for kv in kvs]


def _two_started(lm, a_tokens: list[int], b_tokens: list[int]):
    """Two sessions a few tokens in, and their state (``_state``)."""
    a, b = KVSession(lm), KVSession(lm)
    a.forward(a_tokens[:5], 1)
    b.forward(b_tokens[:4], 1)
    return a, b, _state(lm, [a, b])


def test_a_pass_past_the_sequence_positions_changes_no_cache(two_sequences):
    lm, refs = two_sequences
    (a_tokens, a_reference), (b_tokens, b_reference) = refs[0], refs[1]
    positions = lm.gguf.context.positions
    a, b, before = _two_started(lm, a_tokens, b_tokens)
    too_long = b_tokens[:4] + [7] * positions
    with pytest.raises(ValueError, match="per sequence"):
        batched_forward(lm, [ForwardRow(a, a_tokens[:8], 3), ForwardRow(b, too_long, 1)])
    with pytest.raises(ValueError, match="per sequence"):
        b.forward(too_long, 1)
    assert _state(lm, [a, b]) == before
    assert torch.equal(batched_forward(lm, [ForwardRow(a, a_tokens[:-1], len(a_tokens) - 5)])[0], a_reference[4:])
    assert torch.equal(b.forward(b_tokens[:-1], len(b_tokens) - 4), b_reference[3:])
    a.close()
    b.close()


def test_a_pass_llama_cpp_fails_part_way_changes_no_cache(two_sequences):
    """A pass longer than llama.cpp's batch runs in chunks; when a later chunk fails (an id outside the
    vocabulary), the positions the earlier chunks stored are removed again."""
    lm, refs = two_sequences
    (a_tokens, a_reference), (b_tokens, b_reference) = refs[0], refs[1]
    batch = lm.gguf.context.batch
    a, b, before = _two_started(lm, a_tokens, b_tokens)
    rng = random.Random(1)
    a_feed = a_tokens[:5] + [rng.randrange(lm.vocab_size) for _ in range(batch - 10)]
    b_feed = b_tokens[:4] + [rng.randrange(lm.vocab_size) for _ in range(30)] + [lm.gguf.vocab_size + 5]
    assert len(a_feed) - 5 < batch < len(a_feed) - 5 + len(b_feed) - 4  # the bad id is in the second chunk
    with pytest.raises(RuntimeError, match="llama"):
        batched_forward(lm, [ForwardRow(a, a_feed, 1), ForwardRow(b, b_feed, 1)])
    assert _state(lm, [a, b]) == before
    assert torch.equal(a.forward(a_tokens[:-1], len(a_tokens) - 5), a_reference[4:])
    assert torch.equal(b.forward(b_tokens[:-1], len(b_tokens) - 4), b_reference[3:])
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------
# 5. Loading


def test_a_gguf_file_loads_on_the_gguf_runtime_with_its_vocabulary_facts(files, models):
    lm = load_model(str(files["q4_1"]), device="cpu", runtime="auto")
    assert lm.runtime == "gguf" and lm.model is None and lm.packed_runtime is lm.gguf
    assert lm.vocab_size == lm.logits_width == 49152
    assert lm.eos_token_ids == (2,)
    assert lm.max_positions == 2048
    assert lm.fingerprint == models["f32"].fingerprint
    lm.gguf.close()


def test_gguf_loading_errors_name_the_problem(files, tiny_pair, tmp_path, monkeypatch):
    path = str(files["q4_1"])
    with pytest.raises(ModelLoadError, match="not 'lean'") as error:
        load_model(path, device="cpu", runtime="lean")
    assert path in str(error.value)
    monkeypatch.setenv(RUNTIME_ENV, "torch")  # what the suite pins: a .gguf asks for the runtime by name
    with pytest.raises(ModelLoadError, match="gguf runtime"):
        load_model(path, device="cpu")
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="no file"):
        load_model(missing, device="cpu", runtime="auto")
    with pytest.raises(ModelLoadError, match="no file"):
        load_tokenizer(missing)
    with pytest.raises(ModelLoadError, match="gguf runtime runs .gguf files"):
        load_model(str(tiny_pair[1]), device="cpu", runtime="gguf")


def test_a_gguf_tokenizer_is_the_embedded_tokenizer(files, monkeypatch):
    tokenizer = load_tokenizer(str(files["q4_1"]))
    monkeypatch.delenv(CACHE_ENV)  # the embedded one from the machine's cache, converted once there
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(load_tokenizer("embedded"))


@pytest.mark.embedded
def test_the_embedded_default_runs_on_gguf_on_a_cpu(monkeypatch):
    monkeypatch.delenv(CACHE_ENV)
    lm = load_model("embedded", device="cpu", runtime="auto")
    assert lm.runtime == "gguf" and lm.gguf.path.name == EMBEDDED_GGUF
    ids = prompt_ids(lm, "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")
    plain = run_sync(decode(lm, ids, SamplingParams(max_new_tokens=16, ignore_eos=True)))
    drafted = run_sync(decode(lm, ids, SamplingParams(max_new_tokens=16, ignore_eos=True),
                              ScriptedDrafter(corrupting_script(ids, plain.token_ids, lm.vocab_size)),
                              FixedDraftLength(4)))
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted_tokens > 0
    lm.gguf.close()
