"""Statistical tests: speculative sampling emits tokens distributed exactly as the target's p.

Acceptance-level simulations on a small vocabulary call ``accept_speculative`` itself (no
re-implementation); chi-square tests use fixed seeds, so they are deterministic, at a fixed
significance (p-value > 1e-4). One case also runs vLLM's convergence check (REFERENCES §2), and
one runs end to end through ``LocalEngine`` on the tiny models.
"""

from __future__ import annotations

import pytest
import torch

from specdec.acceptance import accept_speculative
from specdec.drafters import ModelDrafter
from specdec.engine import collect
from specdec.local import LocalEngine
from specdec.randomness import position_keys
from specdec.suffix import SuffixConfig, SuffixDrafter
from specdec.sampling import STREAM_VERIFY, process_logits, sparse_to_dense, truncate_top_k
from specdec.wire_types import SamplingParams, SparseDistribution

ALPHA = 1e-4  # significance of every chi-square test below

pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with small expected counts are pooled.

    A count in a cell of probability exactly 0 fails at once: such a token must never appear.
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    n = counts.sum()
    forbidden = probs == 0
    assert counts[forbidden].sum() == 0, f"emitted ids with p = 0: {forbidden.nonzero().flatten().tolist()}"
    expected = probs[~forbidden] * n
    observed = counts[~forbidden]
    small = expected < min_expected
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        observed = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = max(len(expected) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def dirichlet(generator: torch.Generator, size: int, sharpness: float = 1.0) -> torch.Tensor:
    """A random full-support distribution (Dirichlet(1) raised to ``sharpness``, normalised)."""
    sample = -torch.rand(size, generator=generator, dtype=torch.float64).clamp_min(1e-12).log()
    sample = sample**sharpness
    return (sample / sample.sum()).float()


def dense(probs: torch.Tensor) -> SparseDistribution:
    return SparseDistribution(torch.arange(probs.shape[-1]), probs.float())


def block_keys(seed: int, trial: int, width: int):
    """The verifier's draw keys for trial ``trial`` of a simulation: positions of its own, so every
    trial's draws are independent of every other's (as the positions of one long request)."""
    return position_keys(seed, trial * width, width, STREAM_VERIFY)


def first_token_counts(p: torch.Tensor, q: SparseDistribution, n: int, seed: int):
    """Draw x ~ q, verify a one-draft block with target row p; count the first emitted token."""
    vocab = p.shape[0]
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(torch.from_numpy(q.probs), n, replacement=True, generator=g)
    drafts = q.token_ids[draws.numpy()].tolist()
    rows = torch.stack([p, torch.full((vocab,), 1.0 / vocab)])
    counts = torch.zeros(vocab, dtype=torch.long)
    accepted = 0
    for trial, x in enumerate(drafts):
        result = accept_speculative(rows, [x], [q], block_keys(seed, trial, 2))
        counts[result.tokens[0]] += 1
        accepted += result.num_accepted
    return counts, accepted / n


V = 8


def _case(name: str):
    """(p, q) for one named case, from fixed seeds."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    target_logits = torch.randn(V, generator=g) * 1.5
    draft_logits = target_logits + torch.randn(V, generator=g)
    sampled = SamplingParams(temperature=1.0)
    if name == "random":
        return dirichlet(g, V), dense(dirichlet(g, V))
    if name == "temperature":
        p = process_logits(target_logits[None], SamplingParams(temperature=0.6), V)[0]
        q = process_logits(draft_logits[None], SamplingParams(temperature=1.7), V)[0]
        return p, dense(q)
    if name == "top_k":
        p = process_logits(target_logits[None], SamplingParams(temperature=1.0, top_k=3), V)[0]
        return p, dense(process_logits(draft_logits[None], sampled, V)[0])
    if name == "top_p":
        p = process_logits(target_logits[None], SamplingParams(temperature=0.8, top_p=0.7), V)[0]
        q = process_logits(draft_logits[None], SamplingParams(temperature=1.0, top_p=0.9), V)[0]
        return p, dense(q)
    if name == "draft_equals_target":
        p = process_logits(target_logits[None], sampled, V)[0]
        return p, dense(p.clone())
    if name == "disjoint_supports":
        p = torch.cat([dirichlet(g, 4), torch.zeros(4)])
        q = torch.cat([torch.zeros(4), dirichlet(g, 4)])
        return p, dense(q)
    if name == "q_zero_positions":
        p = dirichlet(g, V)
        q = dirichlet(g, V)
        q[p.argsort(descending=True)[:3]] = 0.0  # q is 0 where p is largest
        return p, dense(q / q.sum())
    if name == "sparse_top_k_q":
        p = process_logits(target_logits[None], sampled, V)[0]
        q_full = process_logits(draft_logits[None], sampled, V)[0]
        return p, truncate_top_k(q_full, 3)
    if name == "one_hot_q":  # a greedy or n-gram draft: deterministic, q one-hot
        p = process_logits(target_logits[None], sampled, V)[0]
        return p, SparseDistribution.one_hot(int(draft_logits.argmax()))
    if name == "padded_q":  # draft logits wider than the target's vocabulary
        p = process_logits(target_logits[None], SamplingParams(temperature=1.0, top_k=5), V)[0]
        ids = torch.tensor([0, 2, 3, 5, V, V + 1, V + 3])
        return p, SparseDistribution(ids, dirichlet(g, len(ids)))
    raise KeyError(name)


CASES = [
    "random",
    "temperature",
    "top_k",
    "top_p",
    "draft_equals_target",
    "disjoint_supports",
    "q_zero_positions",
    "sparse_top_k_q",
    "one_hot_q",
    "padded_q",
]


@pytest.mark.parametrize("name", CASES)
def test_first_emitted_token_follows_p(name):
    p, q = _case(name)
    assert abs(float(p.sum()) - 1) < 1e-5 and abs(float(q.probs.sum()) - 1) < 1e-5
    n = 12_000
    counts, acceptance_rate = first_token_counts(p, q, n, seed=len(name))
    pvalue = chi2_pvalue(counts, p)
    assert pvalue > ALPHA, (name, pvalue, (counts / n).tolist(), p.tolist())
    # The acceptance rate is alpha = sum_x min(p(x), q(x)).
    alpha = min(1.0, float(torch.minimum(p, sparse_to_dense(q, V)).sum()))
    sigma = (alpha * (1 - alpha) / n) ** 0.5
    assert abs(acceptance_rate - alpha) <= 5 * sigma + 1e-9, (acceptance_rate, alpha)
    if name == "draft_equals_target":
        assert acceptance_rate == 1.0
    if name == "disjoint_supports":
        assert acceptance_rate == 0.0


def test_convergence_vllm_style():
    """vLLM's test_rejection_sampling_approximates_target_distribution, on our acceptance step.

    Vocab 10, k 2, random p and q, the same distributions at every position. As the number of
    samples grows from 10 to 100 000 the distance of the empirical distribution of the emitted
    (non-bonus) tokens to p must shrink at least 20x more than its distance to 100 unrelated
    reference distributions.
    """
    vocab, k = 10, 2
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.2, dim=0)
    q_probs = torch.softmax(torch.randn(vocab, generator=g) * 1.2, dim=0)
    references = torch.softmax(torch.randn(100, vocab, generator=g) * 1.2, dim=-1)
    rows = p.expand(k + 1, vocab).contiguous()
    q = [dense(q_probs)] * k
    sizes = [10, 100, 1_000, 10_000, 100_000]
    emitted: list[int] = []
    draft_pool = torch.multinomial(q_probs, 2 * sizes[-1], replacement=True, generator=g).tolist()
    cursor = 0
    while len(emitted) < sizes[-1]:
        drafts = draft_pool[cursor : cursor + k]
        result = accept_speculative(rows, drafts, q, block_keys(1234, cursor // k, k + 1))
        cursor += k
        emitted.extend(result.tokens[: min(len(result.tokens), k)])  # drop the bonus token
    emitted_t = torch.tensor(emitted[: sizes[-1]])
    to_target, to_reference = [], []
    for n in sizes:
        estimate = torch.bincount(emitted_t[:n], minlength=vocab).float() / n
        to_target.append(float(torch.dist(p, estimate)))
        to_reference.append(float(torch.dist(references, estimate)) / references.shape[0])
    target_change = to_target[0] / to_target[-1]
    reference_change = to_reference[0] / to_reference[-1]
    assert target_change > 20 * reference_change, (to_target, to_reference)
    assert chi2_pvalue(torch.bincount(emitted_t, minlength=vocab), p) > ALPHA


def test_second_emitted_position_follows_conditional_p():
    """Two-token blocks: the joint (first, second) emitted tokens must be p1(a) * p2(b | a).

    The target's second row depends on the first token, as in a real model: the verifier
    scores x2 after x1, and when x1 is rejected the second token comes from the next block,
    conditioned on the recovered token. Target rows are top-k processed (zeros) and drafts come
    from sparse truncated q with zeros too.
    """
    vocab, n = 6, 16_000
    g = torch.Generator().manual_seed(99)
    target_params = SamplingParams(temperature=0.9, top_k=4)
    p1 = process_logits(torch.randn(1, vocab, generator=g) * 1.5, target_params, vocab)[0]
    p2 = process_logits(torch.randn(vocab, vocab, generator=g) * 1.5, target_params, vocab)  # p2[a]
    p3 = torch.full((vocab,), 1.0 / vocab)  # bonus row: not measured
    q1 = truncate_top_k(dirichlet(g, vocab), 4)
    q2 = [truncate_top_k(dirichlet(g, vocab, 1.5), 3) for _ in range(vocab)]

    def draw(dist: SparseDistribution, count: int) -> list[int]:
        return dist.token_ids[torch.multinomial(torch.from_numpy(dist.probs), count, replacement=True,
                                                generator=g).numpy()].tolist()

    first_drafts = draw(q1, n)
    second_drafts = {a: iter(draw(q2[a], 2 * n)) for a in range(vocab)}
    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    second_accepted = 0
    for trial, x1 in enumerate(first_drafts):
        x2 = next(second_drafts[x1])
        rows = torch.stack([p1, p2[x1], p3])
        keys = block_keys(99, trial, 3)  # this trial's positions j, j + 1, j + 2
        result = accept_speculative(rows, [x1, x2], [q1, q2[x1]], keys)
        if len(result.tokens) >= 2:
            a, b = result.tokens[0], result.tokens[1]
            second_accepted += result.num_accepted == 2
        else:
            a = result.tokens[0]  # recovered; the next block drafts the second token given it
            y = next(second_drafts[a])
            # The next block starts at position j + 1, whose draws the rejection left unused.
            b = accept_speculative(torch.stack([p2[a], p3]), [y], [q2[a]], keys[1:]).tokens[0]
        counts[a, b] += 1
    joint = p1[:, None] * p2
    pvalue = chi2_pvalue(counts, joint)
    assert pvalue > ALPHA, pvalue
    assert second_accepted > n // 20  # the second position really was accepted as a draft often
    # and the marginal of the first token alone
    assert chi2_pvalue(counts.sum(1), p1) > ALPHA


# ---------------------------------------------------------------------------------------------
# End to end through LocalEngine


def _target_probs(lm, ids: list[int], params: SamplingParams) -> torch.Tensor:
    logits = lm.forward(ids, lm.new_cache(), 1)
    return process_logits(logits, params, lm.vocab_size)[0]


async def _first_tokens(engine, prompt, params_for_seed, runs: int, k: int):
    outcomes, accepted_second_draft = [], 0
    for seed in range(runs):
        result = await collect(engine.stream(prompt, params_for_seed(seed), num_draft_tokens=k))
        outcomes.append(tuple(result.token_ids[:3]))
        accepted_second_draft += result.stats.accepted_tokens >= 2
    return outcomes, accepted_second_draft


async def test_local_engine_sampling_matches_target_distribution(tiny_target, tiny_noisy_draft):
    """The first three generated tokens over many seeds follow the target's own distribution.

    Token 1 comes from prefill; tokens 2 and 3 are the two drafts of the first block (accepted or
    recovered) or come from later blocks. Expected joint: p(t1) p(t2 | t1) p(t3 | t1 t2),
    computed directly from the target's logits with the request's processing (T 0.9, top-k 3).
    """
    tokenizer = tiny_target.tokenizer
    prompt = tokenizer("the quick brown fox jumps")["input_ids"]
    runs = 1000

    def params_for_seed(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=seed, ignore_eos=True)

    engine = LocalEngine(tiny_target, ModelDrafter(tiny_noisy_draft))
    outcomes, accepted_second_draft = await _first_tokens(engine, prompt, params_for_seed, runs, k=2)
    assert accepted_second_draft > runs // 10, accepted_second_draft
    assert len(set(outcomes)) <= 27  # top-k 3 at each of three positions
    assert_first_three_follow_target(tiny_target, prompt, params_for_seed(0), outcomes)


def assert_first_three_follow_target(lm, prompt: list[int], params: SamplingParams, outcomes) -> None:
    """Chi-square of the first three generated tokens against the target's own joint distribution
    p(t1) p(t2 | t1) p(t3 | t1 t2) under the request's processing (``params``)."""
    cells: dict[tuple[int, int, int], float] = {}
    p1 = _target_probs(lm, prompt, params)
    for a in p1.nonzero().flatten().tolist():
        p2 = _target_probs(lm, prompt + [a], params)
        for b in p2.nonzero().flatten().tolist():
            p3 = _target_probs(lm, prompt + [a, b], params)
            for c in p3.nonzero().flatten().tolist():
                cells[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    assert abs(sum(cells.values()) - 1) < 1e-4
    unexpected = [o for o in outcomes if o not in cells]
    assert not unexpected, f"outcomes the target cannot produce: {unexpected[:5]}"
    keys = list(cells)
    index = {key: i for i, key in enumerate(keys)}
    counts = torch.zeros(len(keys), dtype=torch.long)
    for outcome in outcomes:
        counts[index[outcome]] += 1
    probs = torch.tensor([cells[key] for key in keys], dtype=torch.float64)
    pvalue = chi2_pvalue(counts, probs / probs.sum())
    assert pvalue > ALPHA, pvalue


async def test_suffix_drafts_from_earlier_samples_keep_the_target_distribution(tiny_target):
    """Suffix drafts come from what earlier runs sampled (one drafter, one cache over every seed):
    drafts that depend on history, deterministic, one-hot q. The first three tokens must still
    follow the target's own joint distribution."""
    tokenizer = tiny_target.tokenizer
    prompt = tokenizer("the quick brown fox jumps")["input_ids"]
    runs = 1000

    def params_for_seed(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=seed, ignore_eos=True)

    engine = LocalEngine(tiny_target, SuffixDrafter(SuffixConfig(min_token_prob=0.0, anchor=1)))
    outcomes, accepted_second_draft = await _first_tokens(engine, prompt, params_for_seed, runs, k=2)
    assert accepted_second_draft > runs // 10, accepted_second_draft
    assert_first_three_follow_target(tiny_target, prompt, params_for_seed(0), outcomes)
