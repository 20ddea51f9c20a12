"""The lean runtime (specdec/lean/): its logits equal transformers' (fp32, max abs diff <= 1e-4) for
single sessions decoding incrementally with rollbacks, for ragged batches of sessions of different
lengths, on every matrix-product backend, for Llama (untied and tied), Qwen2 (QKV biases) and the
embedded SmolLM2 target; a failed pass leaves every session as it was."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from specdec.lean import LeanModel, unsupported_reason
from specdec.lean.matmul import available_backends

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4
BACKENDS = ["auto", *available_backends(torch.device("cpu"))]


def reference_logits(model, tokens: list[int], num_logits: int) -> torch.Tensor:
    """transformers' logits for the last ``num_logits`` positions of ``tokens``, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -num_logits:].float()


def fresh_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def built_hf(kind: str):
    """Tiny random models of the other supported shapes, built from a config (nothing saved)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(3)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    elif kind == "llama-gqa":  # untied, grouped-query heads, default RoPE (the EAGLE head's kind of target)
        config = LlamaConfig(**common, tie_word_embeddings=False)
    else:  # llama with tied embeddings, no GQA, llama3 RoPE scaling
        common.update(num_key_value_heads=4)
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if kind == "qwen2":
        with torch.no_grad():  # biases initialise to zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def tiny_hf(tiny_pair):
    return fresh_hf(tiny_pair[1])


def check_incremental(model, lean: LeanModel, rng: random.Random, steps: int = 12, vocab: int | None = None):
    """One session: prefill, then chunks of 1..5 tokens with rollbacks of 0..3, several logits per step."""
    vocab = vocab or model.config.vocab_size
    kv = lean.new_kv()
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    worst = 0.0
    for step in range(steps):
        if step:
            cut = rng.randint(0, min(3, len(tokens) - 1))
            del tokens[len(tokens) - cut :]
            kv.crop(len(tokens))  # O(1) rollback: set the length
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
        feed = tokens[kv.length :]
        num = rng.randint(1, len(feed))
        got = lean.forward([kv], [feed], [num])
        expected = reference_logits(model, tokens, num)
        worst = max(worst, float((got - expected).abs().max()))
        assert kv.length == len(tokens)
    assert worst <= TOLERANCE, worst


def check_ragged(model, lean: LeanModel, rng: random.Random, lengths=(5, 17, 1, 40, 9), steps: int = 8):
    """Sessions of different lengths in one pass: ragged pasts and feeds, rollbacks, a fresh session joining."""
    vocab = model.config.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    kvs = [lean.new_kv() for _ in sequences]
    worst = 0.0
    for step in range(steps):
        if step == steps // 2:
            kvs[2], sequences[2] = lean.new_kv(), [rng.randrange(vocab)]
        feeds, nums = [], []
        for kv, tokens in zip(kvs, sequences):
            if step and kv.length and rng.random() < 0.5:
                del tokens[len(tokens) - rng.randint(1, min(2, len(tokens))) :]
                kv.crop(len(tokens))
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1 if step else 0, 6)))
            feed = tokens[kv.length :]
            feeds.append(feed)
            nums.append(rng.randint(1, len(feed)))
        logits = lean.forward(kvs, feeds, nums)
        assert logits.shape[0] == sum(nums)
        first = 0
        for kv, tokens, num in zip(kvs, sequences, nums):
            expected = reference_logits(model, tokens, num)
            worst = max(worst, float((logits[first : first + num] - expected).abs().max()))
            first += num
            assert kv.length == len(tokens)
    assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_session_incremental_with_rollback_matches_transformers(backend, tiny_hf):
    check_incremental(tiny_hf, LeanModel.from_hf(tiny_hf, backend=backend), random.Random(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_matches_transformers(backend, tiny_hf):
    check_ragged(tiny_hf, LeanModel.from_hf(tiny_hf, backend=backend), random.Random(1))


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied_llama3_rope"])
def test_other_llama_family_shapes_match_transformers(kind):
    model = built_hf(kind)
    assert unsupported_reason(model) is None
    lean = LeanModel.from_hf(model)
    check_incremental(model, lean, random.Random(2))
    check_ragged(model, lean, random.Random(3))


@pytest.mark.parametrize("kind", ["tiny", "qwen2", "llama_tied_llama3_rope"])
def test_single_session_numpy_passes_share_the_cache_with_batched_torch_passes(kind, tiny_hf):
    """On CPU a single session's pass runs ``NumpyPass`` (activations in numpy) and a pass of several
    sessions the torch forward, on the same KV buffers: one session decodes token by token and in
    blocks, rolls back, and joins a two-session pass (which reads the keys the numpy passes wrote)
    and goes on alone (reading the keys the torch pass wrote)."""
    model = tiny_hf if kind == "tiny" else built_hf(kind)
    lean = LeanModel.from_hf(model)
    assert lean.numpy_pass is not None
    single = []
    original = lean.numpy_pass.run
    lean.numpy_pass.run = lambda kv, tokens, *rest: single.append(len(tokens)) or original(kv, tokens, *rest)
    rng = random.Random(5)
    vocab = model.config.vocab_size
    kv, tokens = lean.new_kv(), [rng.randrange(vocab) for _ in range(7)]
    other, other_tokens = lean.new_kv(), [rng.randrange(vocab) for _ in range(3)]
    worst = float((lean.forward([kv], [tokens], [2]) - reference_logits(model, tokens, 2)).abs().max())
    for step in range(12):
        if step == 5:
            del tokens[-3:]
            kv.crop(len(tokens))
        tokens.extend(rng.randrange(vocab) for _ in range(4 if step in (5, 9) else 1))
        feed = tokens[kv.length :]
        if step == 7:  # both sessions in one torch pass
            logits = lean.forward([kv, other], [feed, other_tokens], [1, 2])
            worst = max(worst, float((logits[:1] - reference_logits(model, tokens, 1)).abs().max()),
                        float((logits[1:] - reference_logits(model, other_tokens, 2)).abs().max()))
        else:
            got = lean.forward([kv], [feed], [len(feed)])
            worst = max(worst, float((got - reference_logits(model, tokens, len(feed))).abs().max()))
        assert kv.length == len(tokens)
    assert sorted(single) == [1] * 9 + [4, 4, 7]
    assert worst <= TOLERANCE, worst


def test_a_single_session_pass_that_fails_leaves_the_session(tiny_hf, monkeypatch):
    """A bad token id (numpy would wrap a negative one round) or a product failing mid-pass: the
    session keeps its length, and its next pass is right."""
    lean = LeanModel.from_hf(tiny_hf, backend="numpy")
    kv = lean.new_kv()
    lean.forward([kv], [[4, 8, 15]], [1])
    for bad in ([-1], [3, tiny_hf.config.vocab_size]):
        with pytest.raises(IndexError):
            lean.forward([kv], [bad], [1])
        assert kv.length == 3
    calls = []

    def failing(x, handle):  # the second layer's first product, after the first layer wrote its keys
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("out of memory")
        return np_matmul(x, handle)

    from numpy import matmul as np_matmul

    backend = lean.plan.backend(2)
    monkeypatch.setattr(backend, "mm_numpy", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        lean.forward([kv], [[1, 2]], [2])
    monkeypatch.undo()
    assert kv.length == 3
    got = lean.forward([kv], [[16]], [1])
    assert float((got - reference_logits(tiny_hf, [4, 8, 15, 16], 1)).abs().max()) <= TOLERANCE


def test_a_reduced_head_reaches_the_numpy_pass(tiny_hf):
    lean = LeanModel.from_hf(tiny_hf)
    ids = torch.arange(0, lean.logits_width, 3)
    lean.restrict_lm_head(ids)
    kv = lean.new_kv()
    lean.forward([kv], [[5, 9, 11]], [1])
    got = lean.forward([kv], [[3]], [1])
    assert torch.isinf(got[:, 1]).all()
    assert float((got[:, ids] - reference_logits(tiny_hf, [5, 9, 11, 3], 1)[:, ids]).abs().max()) <= TOLERANCE


def test_the_hf_model_shares_the_fused_weights(tiny_hf):
    """transformers' parameters become views of the fused tensors: one copy, same logits."""
    lean = LeanModel.from_hf(tiny_hf)
    attn = tiny_hf.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == lean.w.layers[0].qkv[lean.w.q_width :].data_ptr()
    assert tiny_hf.model.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == \
        lean.w.layers[0].gate_up.untyped_storage().data_ptr()


def test_reduced_head_gives_minus_inf_elsewhere(tiny_hf):
    lean = LeanModel.from_hf(tiny_hf)
    ids = torch.arange(0, lean.logits_width, 3)
    lean.restrict_lm_head(ids)
    tokens = [5, 9, 11, 3]
    got = lean.forward([lean.new_kv()], [tokens], [2])
    expected = reference_logits(tiny_hf, tokens, 2)
    assert torch.isinf(got[:, 1]).all()
    assert float((got[:, ids] - expected[:, ids]).abs().max()) <= TOLERANCE


def test_a_failed_pass_leaves_every_session_unchanged(tiny_hf, monkeypatch):
    lean = LeanModel.from_hf(tiny_hf, backend="torch")
    rng = random.Random(4)
    sequences = [[rng.randrange(300) for _ in range(n)] for n in (4, 11, 7)]
    kvs = [lean.new_kv() for _ in sequences]
    lean.forward(kvs, sequences, [1, 1, 1])
    from specdec.lean import attention

    original = attention.attend_ragged

    def failing(q_and_k, v, kvs, index, *rest):
        if index == 1:  # the second layer, after the first wrote every session's new keys
            raise RuntimeError("out of memory")
        return original(q_and_k, v, kvs, index, *rest)

    monkeypatch.setattr(attention, "attend_ragged", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        lean.forward(kvs, [[1, 2]] * 3, [2, 2, 2])
    monkeypatch.undo()
    for kv, tokens in zip(kvs, sequences):
        assert kv.length == len(tokens)
        got = lean.forward([kv], [[5]], [1])
        assert float((got - reference_logits(tiny_hf, tokens + [5], 1)).abs().max()) <= TOLERANCE


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "model type" in unsupported_reason(model)


@pytest.mark.embedded
def test_embedded_target_matches_transformers_on_real_prompts(embedded_target):
    lm = embedded_target
    model = lm.model
    lean = getattr(lm, "lean", None) or LeanModel.from_hf(model)
    texts = ["List three facts about the moon, one per line.",
             "def is_palindrome(text: str) -> bool:\n    return text == text[::-1]\n",
             "Speculative decoding drafts tokens cheaply and verifies them in one pass of the target."]
    prompts = [lm.tokenizer(text)["input_ids"] for text in texts]
    # One session: prefill, then decode greedily token by token, with a rollback of two and a 4-token block.
    kv = lean.new_kv()
    tokens = list(prompts[0])
    worst = float((lean.forward([kv], [tokens], [3]) - reference_logits(model, tokens, 3)).abs().max())
    for step in range(6):
        if step == 3:
            del tokens[-2:]
            kv.crop(len(tokens))
            tokens.extend([28, 253, 30, 1037])
        else:
            tokens.append(int(reference_logits(model, tokens, 1).argmax()))
        feed = tokens[kv.length :]
        got = lean.forward([kv], [feed], [len(feed)])
        worst = max(worst, float((got - reference_logits(model, tokens, len(feed))).abs().max()))
    # A ragged batch: the three prompts' next blocks in one pass.
    kvs = [lean.new_kv() for _ in prompts]
    lean.forward(kvs, [p[:-3] for p in prompts], [1, 1, 1])
    logits = lean.forward(kvs, [p[-3:] for p in prompts], [3, 2, 1])
    first = 0
    for prompt, num in zip(prompts, (3, 2, 1)):
        worst = max(worst, float((logits[first : first + num] - reference_logits(model, prompt, num)).abs().max()))
        first += num
    assert worst <= TOLERANCE, worst


def test_load_model_wires_the_lean_runtime_into_sessions_and_batched_passes(tiny_pair):
    """``load_model(runtime="lean")``: KV sessions and ragged passes run the lean forward, with the
    logits of transformers' (the ``hf`` runtime, same weights), rollback included."""
    from specdec.kv import KVSession
    from specdec.models import load_model
    from specdec.ragged import ForwardRow, batched_forward

    lean, hf = (load_model(str(tiny_pair[1]), device="cpu", runtime=r) for r in ("lean", "hf"))
    assert lean.lean is not None and hf.lean is None
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 8], [30, 2, 2, 9, 17]]
    outputs = {}
    for name, lm in (("lean", lean), ("hf", hf)):
        sessions = [KVSession(lm) for _ in prompts]
        first = [s.forward(p, 1) for s, p in zip(sessions, prompts)]
        sessions[0].rollback(4)  # drop two tokens, then feed others in a batched pass
        fed = [prompts[0][:4] + [40, 41], prompts[1] + [6], prompts[2] + [12, 13]]
        rows = [ForwardRow(s, tokens, 2) for s, tokens in zip(sessions, fed)]
        outputs[name] = first + batched_forward(lm, rows)
        for s in sessions:
            s.close()
    for got, want in zip(outputs["lean"], outputs["hf"]):
        assert (got - want).abs().max().item() <= 1e-4


def test_the_backend_table_is_measured_once_and_kept(tiny_hf, tmp_path, monkeypatch):
    """A load measures the backend table and keeps it (unless its sweeps disagreed, as on a busy
    machine); a later load with the same key reads it (measuring nothing); a damaged file is
    measured again; another thread count is another key."""
    if len(available_backends(torch.device("cpu"))) < 2:
        pytest.skip("one matmul backend here: there is no table to measure")
    from specdec.lean import matmul

    sweeps = []
    original = matmul.MatmulPlan.measure
    quiet = {"machine": False}

    def measure(self, reps=3):
        sweeps.append(1)
        table = original(self, reps)
        self.table_stable = quiet["machine"]  # what the sweeps' agreement says, made deterministic here
        return table

    monkeypatch.setattr(matmul.MatmulPlan, "measure", measure)
    busy = LeanModel.from_hf(tiny_hf, table_dir=tmp_path, timed_bytes=None)
    assert not list(tmp_path.glob("*.json")) and "not kept" in busy.plan.describe()  # a busy machine's table
    sweeps.clear()
    quiet["machine"] = True
    first = LeanModel.from_hf(tiny_hf, table_dir=tmp_path, timed_bytes=None)
    files = list(tmp_path.glob("*.json"))
    assert len(sweeps) == 1 and len(files) == 1 and "measured at load" in first.plan.describe()
    second = LeanModel.from_hf(tiny_hf, table_dir=tmp_path, timed_bytes=None)
    assert len(sweeps) == 1 and second.plan.choice == first.plan.choice
    assert f"read from {files[0]}" in second.plan.describe()
    files[0].write_text("{not json")
    LeanModel.from_hf(tiny_hf, table_dir=tmp_path, timed_bytes=None)
    assert len(sweeps) == 2 and json.loads(files[0].read_text())["ms"]  # measured again, and rewritten
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        LeanModel.from_hf(tiny_hf, table_dir=tmp_path, timed_bytes=None)
    finally:
        torch.set_num_threads(threads)
    assert len(sweeps) == 3 and len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.parametrize("noisy", [False, True])
def test_a_table_whose_sweeps_disagree_is_not_stable(tiny_hf, monkeypatch, noisy):
    """The rule behind keeping a table: its last sweep alone must pick the same backends, at times
    within STABLE_SPREAD of the best. Times are scripted: one backend always faster (quiet), or the
    winner flipping between sweeps (a busy machine)."""
    from specdec.lean import matmul

    if len(available_backends(torch.device("cpu"))) < 2:
        pytest.skip("one matmul backend here: there is no table to measure")
    calls = Counter()

    def scripted(self, backend, rows):
        calls[backend.name, rows] += 1  # a cell's n-th timing (warm-ups included)
        fast = "torch" if not noisy or calls[backend.name, rows] % 2 == 0 else "numpy"
        return 1.0 if backend.name == fast else 3.0

    monkeypatch.setattr(matmul.MatmulPlan, "time_weighted", scripted)
    monkeypatch.setattr(matmul, "MEASURE_BUDGET_S", 1e9)
    model = LeanModel.from_hf(tiny_hf, timed_bytes=None, reps=2)
    assert model.plan.table_stable is (not noisy)


def test_the_table_counts_each_timed_product_for_every_weight_of_its_shape(tiny_hf):
    """Timing a subset of layers stands for the whole forward: a layer's product counts once per
    layer, the LM head once (regression: the subset's total, head included, was scaled by the
    weights' sizes, which counted the head as many times as the layers were scaled)."""
    model = LeanModel.from_hf(tiny_hf, timed_bytes=1)  # the first layer only, plus the head
    layers = len(model.layers)
    assert layers >= 2 and len(model.plan.timed) == 4 + 1
    weights = model.plan._weights
    assert weights[tuple(model.lm_head.weight.shape)] == 1
    assert all(weights[tuple(lin.weight.shape)] == layers for lin in model.layers[0][1:])


def test_onednn_sums_long_products_from_blocks():
    """Products over more than K_BLOCK inputs run as blocks (oneDNN rounds long sums worse): the
    blocked product is still x @ W.T, on one row and several."""
    from specdec.lean.matmul import MkldnnBackend

    backend = available_backends(torch.device("cpu"))["mkldnn"]
    torch.manual_seed(0)
    weight = torch.randn(40, 2 * MkldnnBackend.K_BLOCK + 5)
    handle = backend.prepare(weight)
    sizes = [stop - start for start, stop, _ in handle]
    assert len(sizes) == 3 and sum(sizes) == weight.shape[1] and max(sizes) - min(sizes) <= 1
    assert [start for start, _, _ in handle] == [0, sizes[0], sizes[0] + sizes[1]]
    for rows in (1, 3, 16):
        x = torch.randn(rows, weight.shape[1])
        exact = x.double() @ weight.double().T
        assert float((backend.mm(x, handle).double() - exact).abs().max()) <= 1e-3
    short = backend.prepare(weight[:, : MkldnnBackend.K_BLOCK].contiguous())
    assert not isinstance(short, list)


def test_a_plan_never_mixes_threading_runtimes():
    """OpenBLAS's spinning workers starve the next OpenMP pass (and the reverse): the plan takes one
    runtime's best backend per bucket, the runtime whose buckets sum least; MKL and oneDNN share one."""
    from specdec.lean.matmul import choose_backends

    backends = available_backends(torch.device("cpu"))
    table = {1: {"torch": 30.0, "mkldnn": 15.0, "numpy": 14.0}, 2: {"torch": 70.0, "mkldnn": 16.0, "numpy": 38.0},
             8: {"torch": 45.0, "mkldnn": 18.0, "numpy": 37.0}, 64: {"torch": 90.0, "mkldnn": 95.0, "numpy": 120.0}}
    assert choose_backends(table, backends) == {1: "mkldnn", 2: "mkldnn", 8: "mkldnn", 64: "torch"}
    for row in table.values():
        row["numpy"] = 10.0
    assert choose_backends(table, backends) == {1: "numpy", 2: "numpy", 8: "numpy", 64: "numpy"}


def test_the_thread_regime_hands_torchs_threads_to_openblas_and_back():
    """While numpy multiplies, OpenBLAS gets torch's threads and torch one; after, torch has them
    back; a torch pass keeps OpenBLAS on one thread. The counts are read from the libraries
    themselves (threadpoolctl's scan), not from the regime's cached handle."""
    from threadpoolctl import threadpool_info

    from specdec.lean.matmul import ThreadRegime

    def blas_threads() -> set[int]:
        return {lib["num_threads"] for lib in threadpool_info() if lib["internal_api"] == "openblas"}

    if not blas_threads():
        pytest.skip("this numpy has no OpenBLAS")
    numpy_backend, torch_backend = (available_backends(torch.device("cpu"))[name] for name in ("numpy", "torch"))
    regime, before = ThreadRegime(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):  # twice: the second round's counts come from the cached handle
            with regime(numpy_backend):
                assert (torch.get_num_threads(), blas_threads()) == (1, {2})
            assert torch.get_num_threads() == 2
            with regime(torch_backend):
                assert (torch.get_num_threads(), blas_threads()) == (2, {1})
    finally:
        torch.set_num_threads(before)


class _LargestScores:
    """numpy as ``specdec.lean.attention`` sees it, noting the largest 4-d product (the attention
    scores [kv_heads, groups, rows, keys]; the other 4-d product, scores times values, is smaller)."""

    def __init__(self, numpy) -> None:
        self.numpy, self.largest = numpy, 0

    def __getattr__(self, name):
        return getattr(self.numpy, name)

    def matmul(self, *args, **kwargs):
        out = self.numpy.matmul(*args, **kwargs)
        if out.ndim == 4:
            self.largest = max(self.largest, out.nbytes)
        return out


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_a_long_prefill_attends_in_blocks_of_bounded_scores(path, tiny_hf, monkeypatch):
    """A long prefill (after a short one) with the score budget forced down to a few query rows: the
    same logits and keys/values as in one block (and transformers'), and the largest scores array
    (numpy pass) or SDPA mask (torch forward) stays within the one budget at two lengths, where one
    block's grows with the square of the length."""
    from specdec.lean import attention

    heads = tiny_hf.config.num_attention_heads
    groups = heads // tiny_hf.config.num_key_value_heads
    rng = random.Random(6)
    vocab = tiny_hf.config.vocab_size

    def prefill(tokens: list[int]):
        lean = LeanModel.from_hf(tiny_hf, backend="numpy")
        if path == "torch":
            lean.numpy_pass = None  # the torch forward, as for a GPU or a half-precision model
        kv = lean.new_kv()
        lean.forward([kv], [tokens[:20]], [1])
        logits = lean.forward([kv], [tokens[20:]], [len(tokens) - 20])
        return logits, kv.keys[:, :, : kv.length].clone(), kv.values[:, :, : kv.length].clone()

    largest = []
    if path == "numpy":
        recorder = _LargestScores(attention.np)
        monkeypatch.setattr(attention, "np", recorder)
    else:
        original_sdpa = torch.nn.functional.scaled_dot_product_attention

        def sdpa(query, key, value, attn_mask=None, **kwargs):
            if attn_mask is not None:  # bool [G x rows, keys] plus SDPA's float bias of that size
                largest.append(attn_mask.numel() * (1 + query.element_size()))
            return original_sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)

    def measured() -> int:
        return recorder.largest if path == "numpy" else max(largest)

    def reset(budget: int) -> None:
        monkeypatch.setattr(attention, "SCORE_BYTES", budget)
        if path == "numpy":
            recorder.largest = 0
        largest.clear()

    default = attention.SCORE_BYTES
    lengths = (150, 300)
    # One budget for both lengths: 7 query rows per block at the longer, 14 at the other (last blocks shorter).
    budget = 7 * max(lengths) * (heads * 4 if path == "numpy" else groups * 5)
    for length in lengths:
        tokens = [rng.randrange(vocab) for _ in range(length)]
        reset(default)
        whole = prefill(tokens)
        one_block = measured()
        reset(budget)
        blocked = prefill(tokens)
        assert 0 < measured() <= budget < one_block
        for got, expected in zip(blocked, whole):  # logits, keys, values: equal to fp32 rounding
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert float((blocked[0] - reference_logits(tiny_hf, tokens, length - 20)).abs().max()) <= TOLERANCE
