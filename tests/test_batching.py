"""Batching across sessions: one forward pass serves several sessions of different lengths, and
every session's output stays exactly what it is alone (greedy: token-identical to the target;
sampling: distributed as the target), in the core loop, in the scheduler and through the services."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.client import GatewayClient
from specdec.drafters import ModelDrafter
from specdec.drafting import ScriptedDrafter
from specdec.kv import KVSession
from specdec.ragged import ForwardRow, batched_forward
from specdec.rpc.scheduler import BatchingOptions, BatchScheduler
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.verification import PrefillChunk, TargetSession, verify_batch
from tests.harness import scrape_metric, start_stack
from tests.test_distribution import assert_first_three_follow_target
from tests.test_greedy_equality import PROMPTS, corrupting_script, hf_greedy
from tests.tiny_models import TEST_DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_reduced_head(tiny_pair):
    """The tiny target with an FR-Spec reduced head (as the shipped draft has): logits for a third of
    the ids, -inf elsewhere."""
    from specdec.models import load_model

    lm = load_model(str(tiny_pair[1]), device=TEST_DEVICE)
    lm.restrict_lm_head(list(range(0, lm.logits_width, 3)))
    return lm


@pytest.mark.parametrize("head", ["full", "reduced"])
def test_batched_forward_matches_each_session_alone(head, tiny_target, tiny_reduced_head):
    """Ragged pasts, ragged new tokens (packed into one sequence), rollbacks, fresh sessions and
    several logits per row: each row's logits and resulting cache are what the session's own
    forward gives, with the full LM head and with a reduced one."""
    if head == "reduced":
        tiny_target = tiny_reduced_head
    rng = random.Random(0)
    vocab = tiny_target.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 1, 40, 9)]
    batched = [KVSession(tiny_target) for _ in sequences]
    alone = [KVSession(tiny_target) for _ in sequences]
    for step in range(10):
        if step == 5:  # a new session (empty cache) joins sessions with long caches
            batched[2], alone[2] = KVSession(tiny_target), KVSession(tiny_target)
        rows = []
        for i, tokens in enumerate(sequences):
            if step and rng.random() < 0.5:
                del tokens[-rng.randint(1, 2):]  # rejected drafts roll back
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 6)))
            rows.append(ForwardRow(batched[i], list(tokens), rng.randint(1, 3)))
        logits = batched_forward(tiny_target, rows)
        for i, row in enumerate(rows):
            expected = alone[i].forward(row.tokens, row.num_logits)
            assert logits[i].shape == expected.shape
            torch.testing.assert_close(logits[i], expected, rtol=1e-4, atol=1e-4)
            assert batched[i].cached_tokens == row.tokens
            assert batched[i].cache.get_seq_length() == len(row.tokens)
    # The adopted caches keep working for single-session forwards.
    for kv, ref, tokens in zip(batched, alone, sequences):
        torch.testing.assert_close(kv.forward(tokens + [3], 1), ref.forward(tokens + [3], 1), rtol=1e-4, atol=1e-4)


def test_a_failed_pass_leaves_every_session_consistent(tiny_target, monkeypatch):
    """A pass that fails in its second layer (after the first grew every row's cache) rolls every
    session back to what it held; the sessions then continue exactly."""
    rng = random.Random(1)
    vocab = tiny_target.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (4, 11, 7)]
    sessions = [KVSession(tiny_target) for _ in sequences]
    batched_forward(tiny_target, [ForwardRow(kv, list(tokens), 1) for kv, tokens in zip(sessions, sequences)])
    static = tiny_target.lean.static if tiny_target.lean is not None else None
    if static is not None:  # static passes: the whole pass writes every layer's keys, then fails
        body = static._body

        def failing_body(bucket, *args):
            body(bucket, *args)
            raise RuntimeError("out of memory")

        monkeypatch.setattr(static, "_body", failing_body)
    elif tiny_target.lean is not None:  # the lean runtime: its second layer's attention fails
        from specdec.lean import attention

        ragged = attention.attend_ragged

        def failing(q_and_k, v, kvs, index, *rest):
            if index == 1:
                raise RuntimeError("out of memory")
            return ragged(q_and_k, v, kvs, index, *rest)

        monkeypatch.setattr(attention, "attend_ragged", failing)
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(tiny_target.model.model.layers[1].mlp, "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        batched_forward(tiny_target, [ForwardRow(kv, tokens + [1, 2], 2) for kv, tokens in zip(sessions, sequences)])
    monkeypatch.undo()
    for kv, tokens in zip(sessions, sequences):
        assert all(layer.get_seq_length() == len(kv.cached_tokens) for layer in kv.cache.layers)
        expected = KVSession(tiny_target).forward(tokens + [5], 1)
        torch.testing.assert_close(kv.forward(tokens + [5], 1), expected, rtol=1e-4, atol=1e-4)


def run_lockstep(target, drafter, prompts: list[list[int]], params: list[SamplingParams], k: int):
    """Every session advances together: one batched drafting pass and one batched verification per
    round (as the services do under concurrency), sessions dropping out as they finish."""
    targets = [TargetSession(target, ids, p) for ids, p in zip(prompts, params)]
    drafts = [drafter.start(ids, p) for ids, p in zip(prompts, params)]
    outputs: list[list[int]] = [[] for _ in prompts]
    accepted = [0] * len(prompts)
    batch_sizes = []
    verdicts = verify_batch(target, [(t, DraftProposal()) for t in targets])  # prefills, batched too
    for i, verdict in enumerate(verdicts):
        outputs[i].extend(verdict.tokens)
        drafts[i].extend(verdict.tokens)
    active = [i for i in range(len(prompts)) if len(outputs[i]) < params[i].max_new_tokens]
    while active:
        ks = [min(k, params[i].max_new_tokens - len(outputs[i]) - 1) for i in active]
        proposals = drafter.propose_batch([(drafts[i], ki) for i, ki in zip(active, ks)])
        verdicts = verify_batch(target, [(targets[i], proposal) for i, proposal in zip(active, proposals)])
        batch_sizes.append(len(active))
        for i, verdict in zip(active, verdicts):
            assert not isinstance(verdict, Exception), verdict
            outputs[i].extend(verdict.tokens)
            drafts[i].extend(verdict.tokens)
            accepted[i] += verdict.num_accepted
        active = [i for i in active if len(outputs[i]) < params[i].max_new_tokens]
    return outputs, accepted, batch_sizes


@pytest.mark.parametrize("kind", ["noisy_copy", "scripted_corrupted"])
def test_batched_greedy_equals_target_generate(kind, tiny_target, tiny_noisy_draft):
    """All prompts (1 to 20 tokens) decode in one batch; each equals transformers' greedy output."""
    prompts = [tiny_target.tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    references = [hf_greedy(tiny_target, ids, NEW_TOKENS) for ids in prompts]
    # Different budgets make sessions leave the batch at different times.
    params = [SamplingParams(max_new_tokens=NEW_TOKENS - 3 * (i % 4), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    if kind == "noisy_copy":
        drafter = ModelDrafter(tiny_noisy_draft)
    else:
        scripts = {tuple(ids): corrupting_script(ids, ref, tiny_target.vocab_size) for ids, ref in zip(prompts, references)}
        lengths = {tuple(ids): len(ids) for ids in prompts}

        def script(tokens, k, p):  # each session follows its own reference
            for key, n in lengths.items():
                if tuple(tokens[:n]) == key:
                    return scripts[key](tokens, k, p)
            raise AssertionError("unknown session")

        drafter = ScriptedDrafter(script)
    outputs, accepted, batch_sizes = run_lockstep(tiny_target, drafter, prompts, params, k=3)
    assert len({len(ids) for ids in prompts}) >= 8 and max(batch_sizes) == len(prompts)
    for out, ref, p in zip(outputs, references, params):
        assert out == ref[: p.max_new_tokens]
    assert sum(accepted) > 100, accepted  # drafts were accepted (and, with this noise, often rejected)


def test_batched_sampling_matches_target_distribution(tiny_target, tiny_noisy_draft):
    """The first three tokens of 960 seeded sessions, decoded 8 to a batch beside sessions of other
    prompts and lengths, follow the target's own joint distribution (chi-square, as unbatched)."""
    tokenizer = tiny_target.tokenizer
    prompt = tokenizer("the quick brown fox jumps")["input_ids"]
    fillers = [tokenizer(text)["input_ids"] for text in ("a", "def add(a, b):\n    return a + b\n", "Hello!")]
    drafter = ModelDrafter(tiny_noisy_draft)

    def params_for_seed(seed: int, n: int = 4) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=0.9, top_k=3, seed=seed, ignore_eos=True)

    outcomes = []
    seed = 0
    while len(outcomes) < 960:
        prompts = [prompt] * 5 + fillers
        params = [params_for_seed(seed + j) for j in range(5)] + [params_for_seed(10_000 + seed + j, 9) for j in range(3)]
        outputs, _, batch_sizes = run_lockstep(tiny_target, drafter, prompts, params, k=2)
        assert batch_sizes[0] == 8
        outcomes.extend(tuple(out[:3]) for out in outputs[:5])
        seed += 5
    assert_first_three_follow_target(tiny_target, prompt, params_for_seed(0), outcomes)


def test_batched_sampling_equals_unbatched_per_seed(tiny_target, tiny_noisy_draft):
    """Draws are keyed by (seed, position), never by batch slot: a seeded session samples the same
    tokens alone and in a batch with others."""
    tokenizer = tiny_target.tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[:6]]
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(6)]
    drafter = ModelDrafter(tiny_noisy_draft)
    together, _, _ = run_lockstep(tiny_target, drafter, prompts, params, k=3)
    alone = [run_lockstep(tiny_target, drafter, [ids], [p], k=3)[0][0] for ids, p in zip(prompts, params)]
    assert together == alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_fed_in_chunks_beside_decoding_sessions_decodes_the_same(temperature, tiny_target, tiny_noisy_draft):
    """Chunked prefill: a session arriving while others decode has its prompt fed in
    ``PrefillChunk`` jobs, each in a pass with their verifications, then joins them. Every session
    decodes what it decodes alone (greedy: the target's own output; sampling: the same draws for
    the same seed), the arriving one included."""
    tokenizer = tiny_target.tokenizer
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS[:3]]
    arriving = tokenizer(" ".join(PROMPTS), add_special_tokens=False)["input_ids"]
    chunk = 5
    assert len(arriving) > 6 * chunk
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    drafter = ModelDrafter(tiny_noisy_draft)
    targets = [TargetSession(tiny_target, ids, p) for ids, p in zip(prompts, params)]
    drafts = [drafter.start(ids, p) for ids, p in zip(prompts, params)]
    outputs: list[list[int]] = [[] for _ in range(4)]

    def commit(i: int, verdict) -> None:
        assert not isinstance(verdict, Exception), verdict
        outputs[i].extend(verdict.tokens)
        drafts[i].extend(verdict.tokens)

    for i, verdict in enumerate(verify_batch(tiny_target, [(t, DraftProposal()) for t in targets])):
        commit(i, verdict)
    new_session = TargetSession(tiny_target, arriving, params[3])
    chunk_passes = 0
    fed = 0
    while True:  # each pass: one round for every decoding session, plus the next piece of the prompt
        active = [i for i in range(len(targets)) if len(outputs[i]) < params[i].max_new_tokens]
        if len(targets) == 4 and not active:
            break
        ks = [min(2, params[i].max_new_tokens - len(outputs[i]) - 1) for i in active]
        proposals = drafter.propose_batch([(drafts[i], k) for i, k in zip(active, ks)])
        jobs = [(targets[i], proposal) for i, proposal in zip(active, proposals)]
        if len(targets) == 3:
            if len(arriving) - fed > chunk:
                fed += chunk
                jobs.append(PrefillChunk(new_session, fed))
                chunk_passes += 1
            else:  # the last piece: the session's prefill verdict (its first token)
                jobs.append((new_session, DraftProposal()))
        results = verify_batch(tiny_target, jobs)
        for i, verdict in zip(active, results):
            commit(i, verdict)
        if len(targets) == 3 and isinstance(jobs[-1], PrefillChunk):
            assert results[-1] is None and len(new_session.kv.cached_tokens) == fed
        elif len(targets) == 3:
            targets.append(new_session)
            drafts.append(drafter.start(arriving, params[3]))
            commit(3, results[-1])
    assert chunk_passes == (len(arriving) - 1) // chunk
    alone = [run_lockstep(tiny_target, drafter, [ids], [p], k=2)[0][0] for ids, p in zip(prompts + [arriving], params)]
    assert outputs == alone
    if temperature == 0.0:
        assert outputs == [hf_greedy(tiny_target, ids, NEW_TOKENS) for ids in prompts + [arriving]]


def test_scheduler_gathers_concurrent_jobs_and_runs_prefills_alone():
    passes: list[list[str]] = []
    gate = threading.Event()

    def run_batch(jobs):
        gate.wait(5)  # the first pass blocks until every other job has queued
        passes.append(list(jobs))
        if "bad" in jobs:
            return [ValueError("bad job") if job == "bad" else job.upper() for job in jobs]
        return [job.upper() for job in jobs]

    async def main():
        scheduler = BatchScheduler(run_batch, ThreadPoolExecutor(1),
                                   BatchingOptions(max_batch_size=3, max_row_tokens=8, max_wait_s=0.0))
        first = asyncio.ensure_future(scheduler.submit("a", 1))
        await asyncio.sleep(0.05)
        jobs = {name: asyncio.ensure_future(scheduler.submit(name, tokens))
                for name, tokens in [("b", 2), ("prefill", 50), ("c", 2), ("d", 2), ("bad", 1), ("e", 1)]}
        cancelled = asyncio.ensure_future(scheduler.submit("gone", 1))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        gate.set()
        result, info = await first
        assert (result, info.size) == ("A", 1)
        done = dict(zip(jobs, await asyncio.gather(*jobs.values(), return_exceptions=True)))
        scheduler.close()
        return done

    done = asyncio.run(main())
    assert passes[0] == ["a"]
    # Order kept; the long job alone; at most 3 per pass; the cancelled job never ran.
    assert passes[1:] == [["b", "c", "d"], ["prefill"], ["bad", "e"]]
    assert done["b"][0] == "B" and done["b"][1].size == 3 and done["b"][1].num_tokens == 6
    assert done["prefill"][1].size == 1
    assert isinstance(done["bad"], ValueError) and done["e"][0] == "E"


def test_scheduler_waits_briefly_for_open_sessions():
    """Two open sessions whose messages arrive 30 ms apart share a pass (instead of alternating
    passes forever); with one open session, or the wait off, the first runs at once."""
    passes: list[list[str]] = []

    def run_batch(jobs):
        passes.append(list(jobs))
        return list(jobs)

    async def main(expected: int, wait_s: float) -> None:
        scheduler = BatchScheduler(run_batch, ThreadPoolExecutor(1),
                                   BatchingOptions(max_wait_s=wait_s, max_wait_fraction=0.0),
                                   expected=lambda: expected)
        first = asyncio.ensure_future(scheduler.submit("a", 1))
        await asyncio.sleep(0.03)
        second = asyncio.ensure_future(scheduler.submit("b", 1))
        await asyncio.gather(first, second)
        scheduler.close()

    asyncio.run(main(expected=2, wait_s=0.5))
    assert passes == [["a", "b"]]
    passes.clear()
    asyncio.run(main(expected=1, wait_s=0.5))
    asyncio.run(main(expected=2, wait_s=0.0))
    assert passes == [["a"], ["b"], ["a"], ["b"]]


def test_scheduler_waits_longer_after_long_passes():
    """After 200 ms passes a pass waits up to a tenth of that for an open session: one whose message
    comes 12 ms after the other's (a gateway turning a burst of verdicts around) shares the pass,
    which a wait of 5 ms alone would have run without it."""
    passes: list[list[str]] = []

    def run_batch(jobs):
        time.sleep(0.2 if jobs[0].startswith("warm") else 0.0)
        passes.append(list(jobs))
        return list(jobs)

    async def main(fraction: float) -> None:
        options = BatchingOptions(max_wait_s=0.005, max_wait_fraction=fraction)
        scheduler = BatchScheduler(run_batch, ThreadPoolExecutor(1), options, expected=lambda: 2)
        await asyncio.gather(scheduler.submit("warm-a", 1), scheduler.submit("warm-b", 1))
        assert scheduler.wait_bound_s == pytest.approx(max(0.005, fraction * 0.2), rel=0.3)
        first = asyncio.ensure_future(scheduler.submit("a", 1))
        await asyncio.sleep(0.012)
        await asyncio.gather(first, scheduler.submit("b", 1))
        scheduler.close()

    asyncio.run(main(0.1))
    assert passes[1:] == [["a", "b"]]
    passes.clear()
    asyncio.run(main(0.0))
    assert passes[1:] == [["a"], ["b"]]


def test_concurrent_requests_through_the_services_are_batched_and_exact(tiny_pair, tiny_target, tmp_path):
    """Eight concurrent greedy requests through real services: each equals the target alone, and the
    verifier and drafter did serve several sessions per pass (stats and Prometheus metrics); the
    prompts of sessions that arrived beside others were fed in chunks (chunked prefill)."""
    from tests.test_services import PROMPTS as SERVICE_PROMPTS, reference_greedy

    # A small batch wait makes the test independent of how fast the machine runs the tiny model;
    # two-token chunks split even these short prompts.
    stack = start_stack(tiny_pair[1], tiny_pair[1], tmp_path, metrics=True,
                        verifier_args=["--batch-wait-ms", "20", "--prefill-chunk-tokens", "2"],
                        drafter_args=["--batch-wait-ms", "20"])
    try:
        def one(prompt: str):
            with GatewayClient(stack.gateway.address, timeout=120) as client:
                return client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, method="model", num_draft_tokens=3)

        with ThreadPoolExecutor(len(SERVICE_PROMPTS)) as pool:
            results = list(pool.map(one, SERVICE_PROMPTS))
        for result in results:
            assert result.token_ids == reference_greedy(tiny_target, result.prompt_token_ids, NEW_TOKENS)
        assert max(r.stats["mean_batch_size"] for r in results) > 1.5
        assert all(r.stats["verify_queue_wait_s"] >= 0 for r in results)
        for service, role in ((stack.verifiers[0], "verifier"), (stack.drafters[0], "drafter")):
            passes = scrape_metric(service, f'specdec_batch_size_count{{role="{role}"}}')
            served = scrape_metric(service, f'specdec_batch_size_sum{{role="{role}"}}')
            assert served / passes > 1.2, (role, served, passes)
            if role == "verifier":
                assert scrape_metric(service, 'specdec_prefill_chunks_total{role="verifier"}') > 0
    finally:
        stack.stop()
