"""Static-shape passes (specdec/lean/static.py, issue #26), run on CPU without graphs: their logits
equal transformers' for single sessions with rollbacks and for ragged batches (padded up to the
buckets), passes past the buckets or a slot's end fall back to the eager forward on the same cache,
a session that outgrows its slot leaves the pool, slots come back when sessions are dropped, a full
pool hands out ordinary caches, features and a reduced head come out as the eager forward's, a
failed pass leaves every session as it was, and batch-invariant mode gives every session the logits
it gets alone. The exactness suites rerun on this path under ``SPECDEC_STATIC_KV=on`` (Makefile)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from specdec.lean import LeanModel
from specdec.lean.kv import LeanKV
from specdec.lean.matmul import smallest_bucket
from specdec.lean.static import SESSION_BUCKETS, TOKEN_BUCKETS, StaticKV
from tests.test_lean_runtime import TOLERANCE, built_hf, check_incremental, check_ragged, fresh_hf, reference_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_hf(tiny_pair):
    return fresh_hf(tiny_pair[1])


def static_lean(model, slots: int = 8, slot_tokens: int = 128) -> LeanModel:
    lean = LeanModel.from_hf(model, backend="torch")
    lean.use_static_kv(slots, slot_tokens, graphs=False)
    return lean


def count_static_passes(lean: LeanModel, monkeypatch) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    run = lean.static.run

    def counted(kvs, feeds, num_logits, shape, sink):
        shapes.append(shape)
        return run(kvs, feeds, num_logits, shape, sink)

    monkeypatch.setattr(lean.static, "run", counted)
    return shapes


def test_buckets_pick_the_smallest_that_holds():
    assert [smallest_bucket(n, TOKEN_BUCKETS) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]
    assert smallest_bucket(9, SESSION_BUCKETS) == 16


def test_single_session_with_rollbacks_matches_transformers(tiny_hf, monkeypatch):
    lean = static_lean(tiny_hf)
    shapes = count_static_passes(lean, monkeypatch)
    check_incremental(tiny_hf, lean, random.Random(0), steps=16)
    assert shapes and all(shape[0] == 1 for shape in shapes)  # the prefill may exceed 16 tokens: eager


@pytest.mark.parametrize("kind", ["tiny", "qwen2", "llama_tied_llama3_rope"])
def test_ragged_batches_padded_to_buckets_match_transformers(kind, tiny_hf, monkeypatch):
    model = tiny_hf if kind == "tiny" else built_hf(kind)
    lean = static_lean(model)
    shapes = count_static_passes(lean, monkeypatch)
    check_ragged(model, lean, random.Random(1), lengths=(5, 9, 1, 3, 7), steps=10)
    assert (8, 8) in shapes or (8, 4) in shapes  # five sessions padded to eight
    if kind != "tiny":
        check_incremental(model, lean, random.Random(2))


def test_long_feeds_and_full_slots_run_eagerly_on_the_same_cache(tiny_hf, monkeypatch):
    lean = static_lean(tiny_hf, slots=2, slot_tokens=32)
    shapes = count_static_passes(lean, monkeypatch)
    rng = random.Random(4)
    tokens = [rng.randrange(300) for _ in range(20)]  # past the largest token bucket: eager
    kv = lean.new_kv()
    assert isinstance(kv, StaticKV) and kv.pool is lean.static.pool
    lean.forward([kv], [tokens], [1])
    assert shapes == []
    for _ in range(3):  # 20 + 3 x 4 = 32: the last feed fits the slot only exactly
        feed = [rng.randrange(300) for _ in range(4)]
        tokens += feed
        got = lean.forward([kv], [feed], [2])
        assert float((got - reference_logits(tiny_hf, tokens, 2)).abs().max()) <= TOLERANCE
    assert len(shapes) == 3
    feed = [rng.randrange(300)]  # position 32: past the slot, so the session moves to its own buffers
    tokens += feed
    got = lean.forward([kv], [feed], [1])
    assert float((got - reference_logits(tiny_hf, tokens, 1)).abs().max()) <= TOLERANCE
    assert kv.pool is None and kv.capacity > 32 and kv.length == 33
    assert lean.static.pool.free_slots == 2  # its slot went back


def test_slots_come_back_when_sessions_go_and_a_full_pool_hands_out_plain_caches(tiny_hf):
    lean = static_lean(tiny_hf, slots=2, slot_tokens=32)
    first, second = lean.new_kv(), lean.new_kv()
    third = lean.new_kv()
    assert isinstance(first, StaticKV) and isinstance(second, StaticKV) and {first.slot, second.slot} == {1, 2}
    assert type(third) is LeanKV and lean.static.pool.free_slots == 0
    lean.forward([first, third], [[1, 2, 3], [4, 5]], [1, 1])  # a plain cache in the pass: eager
    del first
    gc.collect()
    assert lean.static.pool.free_slots == 1
    assert isinstance(lean.new_kv(), StaticKV)


def test_features_and_a_reduced_head_come_out_as_the_eager_forwards(tiny_hf):
    eager = LeanModel.from_hf(tiny_hf, backend="torch")
    static = static_lean(tiny_hf)
    ids = torch.tensor(sorted(random.Random(5).sample(range(300), 64)))
    for lean in (eager, static):
        lean.restrict_lm_head(ids)
    sequences = [[7, 8, 9, 10, 11], [3, 4], [12]]
    results = []
    for lean in (eager, static):
        kvs = [lean.new_kv() for _ in sequences]
        lean.forward(kvs, [s[:-1] or s for s in sequences[:2]] + [sequences[2]], [1, 1, 1])
        captured: list[torch.Tensor] = []
        lean.feature_sink = captured.append
        logits = lean.forward(kvs[:2], [s[-1:] for s in sequences[:2]], [1, 1])
        lean.feature_sink = None
        results.append((logits, torch.cat(captured)))
    (eager_logits, eager_features), (static_logits, static_features) = results
    assert static_features.shape == eager_features.shape == (2, tiny_hf.config.hidden_size)
    assert float((static_features - eager_features).abs().max()) <= TOLERANCE
    outside = torch.ones(static_logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(static_logits[:, outside]).all() and torch.isfinite(static_logits[:, ids]).all()
    assert float((static_logits[:, ids] - eager_logits[:, ids]).abs().max()) <= TOLERANCE


def test_a_failed_static_pass_leaves_every_session(tiny_hf, monkeypatch):
    lean = static_lean(tiny_hf)
    kvs = [lean.new_kv(), lean.new_kv()]
    lean.forward(kvs, [[1, 2, 3], [4, 5]], [1, 1])

    def broken(*args, **kwargs):
        raise RuntimeError("device fault")

    monkeypatch.setattr(lean.static, "_body", broken)
    with pytest.raises(RuntimeError, match="device fault"):
        lean.forward(kvs, [[6], [7, 8]], [1, 2])
    assert [kv.length for kv in kvs] == [3, 2]
    monkeypatch.undo()
    got = lean.forward(kvs, [[6], [7, 8]], [1, 2])
    assert float((got[:1] - reference_logits(tiny_hf, [1, 2, 3, 6], 1)).abs().max()) <= TOLERANCE
    assert float((got[1:] - reference_logits(tiny_hf, [4, 5, 7, 8], 2)).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("static", [False, True])
def test_batch_invariant_mode_gives_each_session_its_logits_alone(static, tiny_hf, monkeypatch):
    lean = static_lean(tiny_hf) if static else LeanModel.from_hf(tiny_hf, backend="torch")
    lean.batch_invariant = True
    alone = static_lean(tiny_hf) if static else LeanModel.from_hf(tiny_hf, backend="torch")
    alone.batch_invariant = True  # one session per pass either way: only the pass shape must match
    sequences = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    kvs = [lean.new_kv() for _ in sequences]
    together = lean.forward(kvs, sequences, [2, 1, 3])
    first = 0
    for tokens, num in zip(sequences, [2, 1, 3]):
        single = alone.forward([alone.new_kv()], [tokens], [num])
        assert torch.equal(together[first : first + num], single)  # bitwise: the same pass as alone
        first += num
    calls = []
    original = lean.forward
    monkeypatch.setattr(lean, "forward", lambda kvs, feeds, nums: calls.append(len(kvs)) or original(kvs, feeds, nums))
    kv_lengths = [kv.length for kv in kvs]

    def fail_second(*args, **kwargs):
        if len(calls) >= 3:
            raise RuntimeError("fault in the second session's pass")
        return real_full_width(*args, **kwargs)

    real_full_width = lean._full_width
    monkeypatch.setattr(lean, "_full_width", fail_second)
    with pytest.raises(RuntimeError):
        lean.forward(kvs, [[10], [11], [12]], [1, 1, 1])
    assert [kv.length for kv in kvs] == kv_lengths  # all or nothing, as one pass


def test_batch_invariant_static_passes_give_a_token_the_same_bits_alone_or_among_drafts(tiny_hf):
    """One pass shape for everything: row results cannot depend on the rows beside them (the bf16
    exactness a GPU needs, checked here in fp32 where the padding is the only difference)."""
    lean = static_lean(tiny_hf)
    lean.batch_invariant = True
    prompt, continuation = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]
    verified, decoded = lean.new_kv(), lean.new_kv()
    lean.forward([verified, decoded], [prompt, prompt], [1, 1])
    together = lean.forward([verified], [continuation], [len(continuation)])
    alone = torch.cat([lean.forward([decoded], [[token]], [1]) for token in continuation])
    assert torch.equal(together, alone)


def test_the_flags_reach_the_loader_and_its_sessions(tiny_pair, monkeypatch):
    """``--static-kv on --kv-slots 3 --kv-slot-tokens 64 --batch-invariant`` -> environment -> load_model:
    sessions hold slots and passes run static; --cuda-graphs on without a GPU is a clear load error."""
    import argparse

    from specdec import pass_options
    from specdec.kv import KVSession
    from specdec.lm import ModelLoadError
    from specdec.models import load_model

    for env in (pass_options.STATIC_KV_ENV, pass_options.CUDA_GRAPHS_ENV, pass_options.KV_SLOTS_ENV,
                pass_options.KV_SLOT_TOKENS_ENV, pass_options.BATCH_INVARIANT_ENV):
        monkeypatch.delenv(env, raising=False)
    parser = argparse.ArgumentParser()
    pass_options.add_model_flags(parser)
    args = parser.parse_args(["--static-kv", "on", "--kv-slots", "3", "--kv-slot-tokens", "64", "--batch-invariant"])
    with monkeypatch.context() as env:
        for name in ("SPECDEC_STATIC_KV", "SPECDEC_KV_SLOTS", "SPECDEC_KV_SLOT_TOKENS", "SPECDEC_BATCH_INVARIANT"):
            env.setenv(name, "")  # apply_model_flags writes os.environ: undone with this context
        pass_options.apply_model_flags(args)
        lm = load_model(str(tiny_pair[1]), device="cpu", runtime="lean")
    assert lm.lean.static is not None and lm.lean.batch_invariant
    assert lm.lean.static.pool.slot_tokens == 64 and lm.lean.static.pool.free_slots == 3
    session = KVSession(lm)
    assert isinstance(session.cache, StaticKV)
    shapes = count_static_passes(lm.lean, monkeypatch)
    session.forward([5, 9, 14, 3], 1)
    session.forward([5, 9, 14, 3, 22], 1, committed=4)
    assert shapes == [(1, 16), (1, 16)]
    monkeypatch.setenv(pass_options.CUDA_GRAPHS_ENV, "on")
    with pytest.raises(ModelLoadError, match="--cuda-graphs on needs the model on a CUDA device"):
        load_model(str(tiny_pair[1]), device="cpu", runtime="lean")
    monkeypatch.setenv(pass_options.CUDA_GRAPHS_ENV, "sometimes")
    with pytest.raises(ModelLoadError, match="SPECDEC_CUDA_GRAPHS"):
        load_model(str(tiny_pair[1]), device="cpu", runtime="lean")


def test_batch_invariant_speculation_equals_decoding_one_token_at_a_time(tiny_pair, tiny_noisy_draft, monkeypatch):
    """Greedy speculation (drafts verified k at a time) against the same runtime decoding alone,
    one token per pass: equal tokens, whatever the precision. On a GPU in bf16 (scripts/gpu_sweep.sh:
    SPECDEC_TEST_DEVICE=cuda SPECDEC_DTYPE=bfloat16) this is the exactness batch invariance buys;
    transformers' generate there is another computation and no reference."""
    from specdec.drafters import ModelDrafter
    from specdec.engine import collect, run_sync
    from specdec.kv import KVSession
    from specdec.local import LocalEngine
    from specdec.models import load_model
    from specdec.policy import FixedDraftLength
    from specdec.wire_types import SamplingParams
    from tests.tiny_models import TEST_DEVICE

    monkeypatch.setenv("SPECDEC_STATIC_KV", "on")
    monkeypatch.setenv("SPECDEC_BATCH_INVARIANT", "1")
    target = load_model(str(tiny_pair[1]), device=TEST_DEVICE, runtime="lean")
    assert target.lean.static is not None and target.lean.batch_invariant
    rng = random.Random(6)
    prompts = [[rng.randrange(1, target.vocab_size) for _ in range(rng.randint(2, 12))] for _ in range(6)]
    new_tokens = 40

    def decode_alone(prompt: list[int]) -> list[int]:
        session, tokens = KVSession(target), list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(session.forward(tokens, 1, committed=len(tokens) - 1)[0].argmax()))
        session.close()
        return tokens[len(prompt):]

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    drafter = ModelDrafter(tiny_noisy_draft)
    accepted = 0
    for prompt in prompts:
        result = run_sync(collect(LocalEngine(target, drafter).stream(prompt, params, policy=FixedDraftLength(5))))
        assert result.token_ids == decode_alone(prompt), prompt
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # drafts were verified several at a time, not only decoded


def test_warm_up_runs_every_bucket_the_pool_can_fill_and_gives_the_slots_back(tiny_hf, monkeypatch):
    """``capture_all`` (a GPU service's warm-up): one pass per bucket with sessions <= free slots,
    positions restarting at 0 each time; every slot free afterwards. Nothing on a CPU (no graphs)."""
    lean = static_lean(tiny_hf, slots=5, slot_tokens=32)
    assert lean.static.capture_all() == 0
    seen = []
    monkeypatch.setattr(lean.static, "graphs", True)
    monkeypatch.setattr(lean.static, "run", lambda kvs, feeds, nums, shape, sink: seen.append(
        (shape, len(kvs), {len(f) for f in feeds}, {kv.length for kv in kvs})))
    assert lean.static.capture_all() == 15
    assert [s for s, *_ in seen] == [(s, t) for s in (1, 2, 4) for t in TOKEN_BUCKETS]
    assert all(n == s[0] and lengths == {0} and fed == {s[1]} for s, n, fed, lengths in seen)
    assert lean.static.pool.free_slots == 5


def test_half_precision_runs_the_same_passes(tiny_pair, monkeypatch):
    """bf16 (what a GPU runs; the CPU refuses it only for speed): eager and static passes agree to
    bf16 rounding, and batch-invariant static passes give a token the same bits alone or among drafts."""
    from transformers import AutoModelForCausalLM

    import specdec.lean.weights as weights

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.bfloat16).eval()
    assert "bfloat16 on CPU" in weights.unsupported_reason(model)
    monkeypatch.setattr(weights, "unsupported_reason", lambda model, dtype=None: None)
    eager, static = LeanModel.from_hf(model, backend="torch"), LeanModel.from_hf(model, backend="torch")
    static.use_static_kv(4, 64, graphs=False)
    static.batch_invariant = True
    assert static.static.pool.keys.dtype == torch.bfloat16
    prompt, continuation = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]
    verified, decoded = static.new_kv(), static.new_kv()
    static.forward([verified, decoded], [prompt, prompt], [1, 1])
    together = static.forward([verified], [continuation], [len(continuation)])
    alone = torch.cat([static.forward([decoded], [[token]], [1]) for token in continuation])
    assert together.dtype == torch.float32 and torch.equal(together, alone)
    reference = eager.forward([eager.new_kv()], [prompt + continuation], [len(continuation)])
    scale = float(reference.abs().max())
    assert float((together - reference).abs().max()) <= 0.02 * scale  # bf16: ~3 significant digits


def test_what_the_switches_pick_on_a_cuda_device():
    """On CUDA graphs and the pool are on by default; ``--cuda-graphs off`` leaves today's eager
    passes (no pool unless asked for); an explicit ``on`` that cannot hold is refused."""
    from specdec.lm import ModelLoadError
    from specdec.pass_options import PassOptions

    assert PassOptions().resolve("cuda") == (True, True)
    assert PassOptions().resolve("cpu") == (False, False)
    assert PassOptions(cuda_graphs="off").resolve("cuda") == (False, False)
    assert PassOptions(cuda_graphs="off", static_kv="on").resolve("cuda") == (True, False)
    assert PassOptions(static_kv="off").resolve("cuda") == (False, False)
    assert PassOptions(static_kv="on").resolve("cpu") == (True, False)
    with pytest.raises(ModelLoadError, match="needs the static KV pool"):
        PassOptions(cuda_graphs="on", static_kv="off").resolve("cuda")
