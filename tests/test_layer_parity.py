"""Every forward built on the one layer body (specdec/lean/layer.py) gives the same logits and the
same keys/values on the same inputs: the eager torch pass of one session and of several (ragged),
the numpy pass, the static slot-pool pass, long prefills attended in query blocks, and the EAGLE
head's layer against the lean layer on the same weights. Tiny random Llama (grouped-query heads)
and Qwen2 (QKV biases); products on one backend (torch) so that only the
code around them differs; the house tolerance against transformers (1e-4) holds throughout."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.lean import LeanModel, attention
from specdec.lean.layer import TORCH, LayerShape, decoder_layer, rope_tables
from tests.test_lean_runtime import built_hf

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4
PREFIXES = (13, 21)  # two sessions' contexts
FED = 5  # then each feeds this many tokens in one pass


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2"])
def hf(request):
    return built_hf(request.param)


def inputs(vocab: int):
    rng = random.Random(8)
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in PREFIXES]
    feeds = [[rng.randrange(vocab) for _ in range(FED)] for _ in PREFIXES]
    return prefixes, feeds


def run_path(hf, path: str):
    """Logits [sessions x FED, V] of the fed tokens and each session's keys/values after them."""
    lean = LeanModel.from_hf(hf, backend="torch")
    if path != "numpy":
        lean.numpy_pass = None  # the torch forward, as on a GPU
    if path == "static":
        lean.use_static_kv(slots=4, slot_tokens=64, graphs=False)
    prefixes, feeds = inputs(hf.config.vocab_size)
    kvs = [lean.new_kv() for _ in prefixes]
    for kv, prefix in zip(kvs, prefixes):
        lean.forward([kv], [prefix], [1])
    if path in ("ragged", "static"):
        logits = lean.forward(kvs, feeds, [FED] * len(kvs))
    else:
        logits = torch.cat([lean.forward([kv], [feed], [FED]) for kv, feed in zip(kvs, feeds)])
    caches = [(kv.keys[:, :, : kv.length].clone(), kv.values[:, :, : kv.length].clone()) for kv in kvs]
    return logits, caches


def reference(hf):
    prefixes, feeds = inputs(hf.config.vocab_size)
    with torch.inference_mode():
        return torch.cat([hf(input_ids=torch.tensor([p + f])).logits[0, -FED:] for p, f in zip(prefixes, feeds)])


def assert_same_caches(got, want):
    for (keys, values), (want_keys, want_values) in zip(got, want):
        assert keys.shape == want_keys.shape
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(values, want_values, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("path", ["numpy", "ragged", "static"])
def test_every_path_gives_the_eager_sessions_logits_and_keys(hf, path):
    want_logits, want_caches = run_path(hf, "eager")
    assert float((want_logits - reference(hf)).abs().max()) <= TOLERANCE
    logits, caches = run_path(hf, path)
    assert float((logits - want_logits).abs().max()) <= TOLERANCE
    assert_same_caches(caches, want_caches)


@pytest.mark.parametrize("path", ["numpy", "eager"])
def test_a_long_prefill_in_query_blocks_equals_one_block(hf, path, monkeypatch):
    """Three query rows per attention block at the longest context (the budget forced down, so every
    pass runs in several blocks): the logits and keys/values of each pass in one block."""
    whole_logits, whole_caches = run_path(hf, path)
    heads = hf.config.num_attention_heads
    # numpy: 4-byte scores over every head; torch: a bool mask plus SDPA's fp32 bias over the groups.
    entry = heads * 4 if path == "numpy" else heads // hf.config.num_key_value_heads * 5
    monkeypatch.setattr(attention, "SCORE_BYTES", 3 * (max(PREFIXES) + FED) * entry)
    calls = []
    original = attention.attend_session

    def counting(q_and_k, v, keys, values, past, heads, kernel, xp, block, mask):
        calls.append((block, len(v)))
        return original(q_and_k, v, keys, values, past, heads, kernel, xp, block, mask)

    monkeypatch.setattr(attention, "attend_session", counting)
    logits, caches = run_path(hf, path)
    assert len(calls) == 2 * len(PREFIXES) * hf.config.num_hidden_layers
    assert all(block < rows for block, rows in calls)
    assert float((logits - whole_logits).abs().max()) <= TOLERANCE
    assert_same_caches(caches, whole_caches)


def test_the_eagle_heads_layer_is_the_lean_layer():
    """The head warm-started from the target's last layer (separate q/k/v and gate/up modules,
    its own attention function) and the lean runtime's last layer (fused products, one session's
    attention) give the same output on the same rows."""
    from specdec.eagle.head import EagleHead
    from specdec.eagle.head import attention as head_attention

    hf = built_hf("llama-gqa")  # the head supports Llama-family targets without QKV biases
    head = EagleHead.from_target(hf, list(range(hf.config.vocab_size)))
    lean = LeanModel.from_hf(hf, backend="torch")
    n = 9
    x = torch.randn(1, n, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(3, 3 + n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.inference_mode():
        cos, sin = head.rope(positions)
        from_head = head.layer(x, cos, sin, lambda q, k, v: head_attention(q, k, v, causal))[0]
        kv = lean.new_kv(capacity=n)
        cos, sin = rope_tables(positions.float(), lean._inv_freq, lean.w.rope_scale)
        params = lean.bound_layers("torch")[-1]
        index = len(lean.layers) - 1

        def attend(q_and_k, v):
            return attention.attend_session(q_and_k, v, kv.keys[index], kv.values[index], 0, lean.w.heads,
                                            lean.kernel, TORCH, n, lean.kernel.causal(0, 0, n))

        from_lean = decoder_layer(x[0], params, LayerShape.of(lean.w), lean.plan.backend(n).mm, attend,
                                  cos[:, None], sin[:, None])
    assert float((from_head - from_lean).abs().max()) <= TOLERANCE
