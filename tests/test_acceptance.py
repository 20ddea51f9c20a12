"""Unit tests of the acceptance step (specdec.acceptance) and logits processing (specdec.sampling)."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch

from specdec.acceptance import accept_greedy, accept_speculative, residual_distribution
from specdec.randomness import DrawKey, position_keys, uniform
from specdec.sampling import (
    DRAW_ACCEPT,
    DRAW_TOKEN,
    STREAM_DRAFT,
    STREAM_VERIFY,
    greedy_tokens,
    mask_beyond_vocab,
    process_logits,
    sample_sparse,
    sparse_to_dense,
    truncate_top_k,
)
from specdec.wire_types import DraftProposal, SamplingParams, SparseDistribution

V = 10


def gens(seed: int, n: int) -> list[DrawKey]:
    """The verifier's draw keys for a block of n positions (request seed ``seed``)."""
    return position_keys(seed, 0, n, STREAM_VERIFY)


def one_hot_rows(ids: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def dense_q(probs: torch.Tensor) -> SparseDistribution:
    return SparseDistribution(torch.arange(probs.shape[-1]), probs.float())


def random_dist(generator: torch.Generator, vocab: int = V, zeros: int = 0) -> torch.Tensor:
    probs = torch.rand(vocab, generator=generator) + 0.05
    if zeros:
        probs[torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return probs / probs.sum()


# ---------------------------------------------------------------------------------------------
# accept_speculative: block outcomes


def test_all_accepted_gives_drafts_plus_bonus():
    drafts = [3, 7, 1]
    # The target puts all its mass on each draft, so every ratio p/q is >= 1.
    target = one_hot_rows(drafts + [5])
    q = [dense_q(random_dist(torch.Generator().manual_seed(i))) for i in range(3)]
    for seed in range(20):
        result = accept_speculative(target, drafts, q, gens(seed, 4))
        assert result.num_accepted == 3 and result.num_drafts == 3 and result.all_accepted
        assert result.tokens == [3, 7, 1, 5]  # k + 1 tokens, the bonus drawn from p_{k+1}
        assert len(result.tokens) == len(drafts) + 1
        assert result.next_token == 5


def test_none_accepted_gives_exactly_one_recovered_token():
    drafts = [3, 7, 1]
    # p_1 forbids the first draft; the residual is then p_1 itself (q is one-hot on 3).
    target = torch.stack([one_hot_rows([6])[0], one_hot_rows([7])[0], one_hot_rows([1])[0], one_hot_rows([2])[0]])
    q = [SparseDistribution.one_hot(t) for t in drafts]
    for seed in range(20):
        result = accept_speculative(target, drafts, q, gens(seed, 4))
        assert result.num_accepted == 0 and not result.all_accepted
        assert result.tokens == [6]
        assert result.next_token == 6


def test_some_accepted_discards_the_rest():
    drafts = [4, 4, 9, 2]
    rows = torch.zeros(5, V)
    rows[0, 4] = 1.0
    rows[1, 4] = 1.0
    rows[2, 0] = 0.5  # forbids draft 9: rejected here
    rows[2, 8] = 0.5
    rows[3, 2] = 1.0  # would accept draft 2, but it comes after the rejection
    rows[4, 1] = 1.0
    q = [SparseDistribution.one_hot(t) for t in drafts]
    seen = set()
    for seed in range(50):
        result = accept_speculative(rows, drafts, q, gens(seed, 5))
        assert result.num_accepted == 2
        assert result.tokens[:2] == [4, 4] and len(result.tokens) == 3
        assert result.tokens[2] in (0, 8)
        seen.add(result.tokens[2])
    assert seen == {0, 8}  # the recovered token is really sampled from the residual


def test_partial_probability_acceptance_rate():
    # One-hot q on x with p(x) = 0.3: accepted with probability 0.3, else residual = p without x.
    p = torch.tensor([[0.3, 0.5, 0.2, 0, 0, 0, 0, 0, 0, 0], [0.1] * 10])
    n, accepted, recovered = 4000, 0, []
    for seed in range(n):
        result = accept_speculative(p, [0], [SparseDistribution.one_hot(0)], gens(seed, 2))
        if result.num_accepted:
            accepted += 1
        else:
            recovered.append(result.tokens[0])
    assert abs(accepted / n - 0.3) < 0.03
    assert set(recovered) == {1, 2}  # never the rejected draft, never a p = 0 token
    assert abs(recovered.count(1) / len(recovered) - 0.5 / 0.7) < 0.04


def test_empty_block_samples_from_p():
    p = one_hot_rows([8])
    result = accept_speculative(p, [], [], gens(0, 1))
    assert result.tokens == [8] and result.num_accepted == 0 and result.num_drafts == 0


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        accept_speculative(torch.full((2, V), 0.1), [1, 2], [SparseDistribution.one_hot(1)] * 2, gens(0, 3))
    with pytest.raises(ValueError):
        accept_speculative(torch.full((3, V), 0.1), [1, 2], [SparseDistribution.one_hot(1)] * 2, gens(0, 2))


# ---------------------------------------------------------------------------------------------
# accept_greedy


@pytest.mark.parametrize(
    "argmax, drafts, accepted, tokens",
    [
        ([5, 6, 7, 8], [5, 6, 7], 3, [5, 6, 7, 8]),  # all accepted: drafts + bonus
        ([5, 6, 7, 8], [4, 6, 7], 0, [5]),  # first mismatch: the target's argmax only
        ([5, 6, 7, 8], [5, 6, 1], 2, [5, 6, 7]),  # partial
        ([5, 6, 7, 8], [5, 1, 7], 1, [5, 6]),  # a later match after a mismatch does not count
        ([9], [], 0, [9]),  # no drafts
    ],
)
def test_accept_greedy(argmax, drafts, accepted, tokens):
    result = accept_greedy(argmax, drafts)
    assert result.num_accepted == accepted
    assert result.num_drafts == len(drafts)
    assert result.tokens == tokens
    assert len(result.tokens) == accepted + 1


def test_accept_greedy_length_check():
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def test_greedy_one_hot_p_accepts_exactly_the_argmax():
    # Sampling acceptance with one-hot p (greedy) agrees with accept_greedy.
    argmax = [2, 3, 4, 5]
    p = one_hot_rows(argmax)
    for drafts in ([2, 3, 4], [2, 9, 4], [0, 3, 4]):
        q = [SparseDistribution.one_hot(t) for t in drafts]
        assert accept_speculative(p, drafts, q, gens(1, 4)).tokens == accept_greedy(argmax, drafts).tokens


# ---------------------------------------------------------------------------------------------
# Guards: p == q, q(x) = 0, p(x) = 0 with u = 0


def test_p_equals_q_accepts_everything_without_nan():
    g = torch.Generator().manual_seed(7)
    for trial in range(300):
        k = 3
        p = torch.stack([random_dist(g, zeros=trial % 4) for _ in range(k + 1)])
        drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(k)]
        q = [dense_q(p[i]) for i in range(k)]
        result = accept_speculative(p, drafts, q, gens(trial, k + 1))
        assert result.num_accepted == k
        assert result.tokens[:k] == drafts


def test_residual_guard_p_equals_q():
    g = torch.Generator().manual_seed(3)
    p = random_dist(g)
    residual = residual_distribution(p, p.clone())
    assert torch.isfinite(residual).all()
    assert math.isclose(float(residual.sum()), 1.0, rel_tol=1e-6)
    assert torch.allclose(residual, p)
    # p <= q everywhere by rounding: still a finite distribution
    residual = residual_distribution(p, p * (1 + 1e-7))
    assert torch.isfinite(residual).all() and math.isclose(float(residual.sum()), 1.0, rel_tol=1e-6)
    # fp16 inputs are computed in fp32
    assert residual_distribution(p.half(), p.half()).dtype == torch.float32


def test_residual_values():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))


def test_draft_with_zero_q_always_rejects():
    # The draft token is outside q's support (q(x) = 0): reject even though p(x) = 1.
    p = torch.stack([one_hot_rows([4])[0], torch.full((V,), 0.1)])
    q_outside = SparseDistribution(torch.tensor([1, 2]), torch.tensor([0.5, 0.5]))
    q_zero = SparseDistribution(torch.tensor([4, 2]), torch.tensor([0.0, 1.0]))
    for q in (q_outside, q_zero):
        for seed in range(50):
            result = accept_speculative(p, [4], [q], gens(seed, 2))
            assert result.num_accepted == 0
            assert result.tokens == [4]  # the residual is p (q has no mass on 4)


class ZeroDraws:
    """A position whose every draw is exactly 0.0 (the smallest uniform there is)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def uniform(self, draw: int = 0) -> float:
        self.calls.append(draw)
        return 0.0


def test_forbidden_token_never_accepted_even_with_u_zero():
    """SGLang #35771: u = 0 with an inclusive compare accepts a token the target forbids."""
    zeros = [ZeroDraws(), ZeroDraws()]
    p = torch.zeros(3, V)
    p[0, 1] = 1.0  # forbids 5
    p[1, 5] = 1e-30  # allows 5, barely
    p[1, 2] = 1.0 - 1e-30
    p[2, 0] = 1.0
    q = SparseDistribution.one_hot(5)
    result = accept_speculative(p[:2], [5], [q], zeros)
    # The stub is in use: r (DRAW_ACCEPT) then, on rejection, the recovered token's draw (DRAW_TOKEN).
    assert zeros[0].calls == [DRAW_ACCEPT, DRAW_TOKEN]
    assert result.num_accepted == 0 and result.tokens == [1]
    # With u = 0 a token of tiny but positive p is accepted: the strict compare only excludes p = 0.
    result = accept_speculative(p[1:], [5], [q], zeros)
    assert result.num_accepted == 1 and result.tokens == [5, 0]
    # Also a sparse q whose support holds the forbidden id with large mass.
    q = SparseDistribution(torch.tensor([5, 1]), torch.tensor([0.99, 0.01]))
    result = accept_speculative(p[:2], [5], [q], zeros)
    assert result.num_accepted == 0 and result.tokens == [1]
    # u = 0 for the recovered and the bonus token: the first id with p > 0, never a leading p = 0 id.
    rows = torch.zeros(2, V)
    rows[0, 6] = rows[0, 8] = 0.5
    rows[1, 3] = 1.0
    result = accept_speculative(rows, [2], [SparseDistribution.one_hot(2)], zeros)
    assert result.tokens == [6]
    result = accept_speculative(rows[1:], [], [], zeros[:1])
    assert result.tokens == [3]


def test_draft_id_beyond_target_vocab_rejects():
    p = torch.full((2, V), 1.0 / V)
    q = SparseDistribution(torch.tensor([V + 3]), torch.tensor([1.0]))
    for seed in range(30):
        result = accept_speculative(p, [V + 3], [q], gens(seed, 2))
        assert result.num_accepted == 0 and 0 <= result.tokens[0] < V


# ---------------------------------------------------------------------------------------------
# Emitted ids stay in the vocabulary and in the allowed set


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.8),
    ],
    ids=["top_k", "top_p", "top_k+top_p"],
)
def test_emitted_tokens_inside_allowed_set(params):
    g = torch.Generator().manual_seed(11)
    k, pad = 3, 4
    seen_recovered = 0
    for trial in range(300):
        logits = torch.randn(k + 1, V + pad, generator=g) * 2
        logits[:, V:] += 5.0  # padded ids have the largest logits but must never be emitted
        p = process_logits(logits, params, V)
        assert p.shape == (k + 1, V + pad) and (p[:, V:] == 0).all()
        p = p[:, :V]
        # A full-support draft distribution including padded ids: drafts often fall outside.
        q_probs = [random_dist(g, V + pad) for _ in range(k)]
        q = [dense_q(qp) for qp in q_probs]
        drafts = [int(torch.multinomial(qp, 1, generator=g)) for qp in q_probs]
        result = accept_speculative(p, drafts, q, gens(trial, k + 1))
        for i, token in enumerate(result.tokens):
            assert 0 <= token < V
            assert p[i, token] > 0, (trial, i, token)
        seen_recovered += not result.all_accepted
    assert seen_recovered > 100


def test_sparse_q_with_padded_support_never_emits_padding():
    g = torch.Generator().manual_seed(5)
    pad_ids = torch.tensor([V, V + 1, V + 2])
    for trial in range(300):
        p = torch.stack([random_dist(g, zeros=2) for _ in range(3)])
        ids = torch.cat([torch.tensor([1, 4, 6]), pad_ids])
        probs = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.2, 0.2])
        q = [SparseDistribution(ids, probs) for _ in range(2)]
        drafts = [int(ids[torch.multinomial(probs, 1, generator=g)]) for _ in range(2)]
        result = accept_speculative(p, drafts, q, gens(trial, 3))
        assert all(0 <= t < V for t in result.tokens)
        for i, token in enumerate(result.tokens):
            assert p[i, token] > 0


def test_sparse_distribution_helpers():
    sparse = SparseDistribution(torch.tensor([2, 7, V + 1]), torch.tensor([0.5, 0.25, 0.25]))
    assert sparse.prob_of(7) == 0.25 and sparse.prob_of(3) == 0.0
    dense = sparse_to_dense(sparse, V)
    assert dense.shape == (V,) and dense.dtype == torch.float32
    assert dense[2] == 0.5 and dense[7] == 0.25 and float(dense.sum()) == 0.75  # padded id dropped
    assert SparseDistribution.one_hot(4).prob_of(4) == 1.0
    proposal = DraftProposal([3, 4])
    assert proposal.q(1).prob_of(4) == 1.0 and len(proposal) == 2


# ---------------------------------------------------------------------------------------------
# Reproducibility


def test_fixed_keys_repeat_and_differ_across_seeds():
    g = torch.Generator().manual_seed(2)
    k = 4
    p = torch.stack([random_dist(g) for _ in range(k + 1)])
    q_probs = [random_dist(g) for _ in range(k)]
    drafts = [int(torch.multinomial(qp, 1, generator=g)) for qp in q_probs]
    q = [dense_q(qp) for qp in q_probs]
    outcomes = []
    for seed in range(40):
        first = accept_speculative(p, drafts, q, position_keys(seed, 100, k + 1, STREAM_VERIFY))
        again = accept_speculative(p, drafts, q, [DrawKey(seed, 100 + i, STREAM_VERIFY) for i in range(k + 1)])
        assert first == again
        outcomes.append(tuple(first.tokens))
    assert len(set(outcomes)) > 5


def test_keyed_draws_are_independent_per_key():
    draws = {
        (s, pos, stream, d): DrawKey(s, pos, stream).uniform(d)
        for s in (0, 1)
        for pos in (0, 1, 2)
        for stream in (STREAM_DRAFT, STREAM_VERIFY)
        for d in (DRAW_ACCEPT, DRAW_TOKEN)
    }
    assert len(set(draws.values())) == len(draws)
    assert DrawKey(1, 2, 1).uniform(DRAW_TOKEN) == draws[(1, 2, 1, DRAW_TOKEN)]


# ---------------------------------------------------------------------------------------------
# process_logits / truncate_top_k


def test_process_logits_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    for t in (0.5, 1.0, 2.0):
        probs = process_logits(logits, SamplingParams(temperature=t), 4)
        assert probs.dtype == torch.float32
        assert torch.allclose(probs, torch.softmax(logits / t, dim=-1))
        assert torch.allclose(probs.sum(-1), torch.ones(2))
    # Low temperature sharpens, high temperature flattens.
    cold = process_logits(logits, SamplingParams(temperature=0.25), 4)
    hot = process_logits(logits, SamplingParams(temperature=4.0), 4)
    assert cold[0, 0] > process_logits(logits, SamplingParams(temperature=1.0), 4)[0, 0] > hot[0, 0]
    # fp16 logits are processed in fp32
    assert process_logits(logits.half(), SamplingParams(temperature=1.0), 4).dtype == torch.float32


def test_process_logits_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    probs = process_logits(logits, SamplingParams(temperature=0.0), 3)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_process_logits_top_k_keeps_the_k_largest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g)
    for k in (1, 3, 7):
        probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=k), 20)
        for row, lrow in zip(probs, logits):
            kept = set((row > 0).nonzero().flatten().tolist())
            assert kept == set(torch.topk(lrow, k).indices.tolist())
            expected = torch.softmax(lrow[sorted(kept)], dim=0)
            assert torch.allclose(row[sorted(kept)], expected, atol=1e-6)
    # top_k >= V disables it
    assert torch.allclose(
        process_logits(logits, SamplingParams(temperature=1.0, top_k=20), 20), torch.softmax(logits, -1)
    )


def test_process_logits_top_p_keeps_the_smallest_covering_set():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().unsqueeze(0)
    cases = {0.3: {1}, 0.75: {1, 3}, 0.85: {1, 3, 2}, 0.99: {0, 1, 2, 3}, 1e-9: {1}}
    for top_p, keep in cases.items():
        out = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p), 4)[0]
        assert set((out > 0).nonzero().flatten().tolist()) == keep, top_p
        kept = sorted(keep)
        assert torch.allclose(out[kept], probs[kept] / probs[kept].sum(), atol=1e-6)


def test_process_logits_top_p_one_token_always_kept():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 16, generator=g) * 5
    for params in (
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=0.05, top_p=0.01),
        SamplingParams(temperature=1.0, top_k=1, top_p=0.5),
    ):
        probs = process_logits(logits, params, 16)
        assert ((probs > 0).sum(-1) == 1).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.isfinite(probs).all()


def test_process_logits_order_temperature_then_top_k_then_top_p():
    # softmax([0.4, 0.3, 0.2, 0.1]) with top_k = 2 renormalises to [4/7, 3/7]; top_p = 0.5 is then
    # covered by the first token alone. Applied to the unrenormalised probabilities it would keep 2.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().unsqueeze(0)
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 4)[0]
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0]
    out = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5), 4)[0]
    assert set((out > 0).nonzero().flatten().tolist()) == {0, 1}
    # temperature before top-p: at T = 0.1 the first token alone covers 0.9
    out = process_logits(logits, SamplingParams(temperature=0.1, top_p=0.9), 4)[0]
    assert set((out > 0).nonzero().flatten().tolist()) == {0}


def test_padded_ids_are_masked():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]])  # ids 3, 4 are padding for vocab 3
    assert greedy_tokens(logits, 3).tolist() == [2]
    probs = process_logits(logits, SamplingParams(temperature=1.0), 3)
    assert (probs[0, 3:] == 0).all() and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    assert process_logits(logits, SamplingParams(), 3)[0].argmax() == 2
    assert torch.equal(mask_beyond_vocab(logits, 5), logits)


def test_truncate_top_k():
    probs = torch.tensor([0.1, 0.4, 0.0, 0.3, 0.2])
    sparse = truncate_top_k(probs, 2)
    assert sparse.token_ids.tolist() == [1, 3]
    assert torch.allclose(torch.from_numpy(sparse.probs), torch.tensor([4 / 7, 3 / 7]))
    assert sparse.probs.dtype == np.float32 and sparse.token_ids.dtype == np.int64  # as on the wire
    # k beyond the support drops zero-probability ids
    sparse = truncate_top_k(probs, 10)
    assert sorted(sparse.token_ids.tolist()) == [0, 1, 3, 4]
    assert math.isclose(float(sparse.probs.sum()), 1.0, rel_tol=1e-6)
    # samples come from the support only
    draws = {sample_sparse(truncate_top_k(probs, 2), uniform(0, i, STREAM_DRAFT, DRAW_TOKEN)) for i in range(200)}
    assert draws == {1, 3}


def test_sampling_params_validate():
    SamplingParams().validate()
    for bad in (
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(draft_top_k=0),
        dict(stop=("",)),
        dict(stop_token_ids=(-1,)),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()
