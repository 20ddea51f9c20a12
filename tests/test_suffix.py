"""Suffix drafting (specdec.suffix): the index against brute force, the frequency scoring, the
cache's token budget over 4 000 requests, tenant scopes, and the method chooser of ``auto``."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from specdec.policy.method_choice import MethodChooser
from specdec.suffix import (SuffixCache, SuffixConfig, SuffixDraft, SuffixDrafter, SuffixIndex, cache_scope_key,
                            continue_match)
from specdec.wire_types import SamplingParams

PARAMS = SamplingParams(max_new_tokens=64)


def brute_longest(documents: dict[int, list[int]], context: list[int], anchor: int, max_depth: int):
    """The longest suffix of ``context`` (anchor..max_depth tokens) followed by something in a document."""
    best = 0
    for doc in documents.values():
        for end in range(anchor, len(doc)):  # end < len(doc): a continuation exists
            length = 0
            while (length < min(max_depth, end, len(context))
                   and doc[end - length - 1] == context[len(context) - length - 1]):
                length += 1
            if length >= anchor:
                best = max(best, length)
    return best


@pytest.mark.parametrize("anchor", [1, 2, 3])
def test_longest_match_equals_brute_force(anchor):
    rng = random.Random(anchor)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 50])
        index = SuffixIndex(anchor)
        documents = {}
        for serial in range(1, rng.randint(1, 4) + 1):
            documents[serial] = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
            index.add(serial, documents[serial][:7])  # in two appends, as a running request's output comes
            index.add(serial, documents[serial][7:])
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        if documents and rng.random() < 0.5:  # a context that surely occurs
            doc = rng.choice(list(documents.values()))
            cut = rng.randint(0, len(doc))
            context += doc[:cut]
        match = index.longest_match(context, max_depth=16, max_candidates=10**6)
        assert match.length == brute_longest(documents, context, anchor, 16), (trial, documents, context)
        for doc, end, serial in match.occurrences:
            assert end < len(doc) and list(doc[end - match.length:end]) == context[len(context) - match.length:]


def test_index_forgets_a_document_entirely():
    index = SuffixIndex(2)
    index.add(1, [1, 2, 3, 1, 2, 4])
    index.add(2, [5, 1, 2, 3])
    assert index.remove(1) == 6 and index.num_tokens == 4
    assert sum(len(found) for found in index.occurrences.values()) == 3  # positions 2..4 of document 2
    match = index.longest_match([9, 1, 2], 8, 8)
    assert match.length == 2 and [serial for *_, serial in match.occurrences] == [2]


def test_draft_follows_the_most_frequent_continuation_and_stops_at_min_prob():
    index = SuffixIndex(2)
    for serial, doc in enumerate([[7, 8, 1, 2, 3], [7, 8, 1, 2, 3], [7, 8, 1, 9, 9], [7, 8, 4]], start=1):
        index.add(serial, doc)
    match = index.longest_match([0, 7, 8], 8, 32)
    assert match.length == 2 and len(match.occurrences) == 4
    draft = continue_match(match, 8, 0.1)
    assert draft.tokens == [1, 2, 3]
    assert draft.cumulative_probs == pytest.approx([0.75, 0.5, 0.5])
    assert continue_match(match, 8, 0.6).tokens == [1]  # 0.5 < 0.6 ends it after one token
    assert draft.serial == 2  # ties go to the most recent document


def test_draft_length_grows_with_the_match():
    drafter = SuffixDrafter(SuffixConfig(max_cached_tokens=0))
    text = list(range(100, 140))
    session = drafter.start(text + [1, 2] + text[:3], PARAMS)  # context ends with text[:3]: a 3-token match
    assert session.propose(16).draft_tokens == text[3:6]  # spec_factor 1: as long as the match
    session.extend(text[3:10])  # now a 10-token match
    assert session.propose(16).draft_tokens == text[10:20]
    assert session.propose(4).draft_tokens == text[10:14]


def test_a_later_request_drafts_what_an_earlier_one_wrote():
    drafter = SuffixDrafter(SuffixConfig(max_cached_tokens=10_000))
    prompt, answer = [1, 2, 3, 4], list(range(200, 260))
    first = drafter.start_in_scope(prompt, PARAMS, "t/")
    first.extend(answer)
    first.close()
    second = drafter.start_in_scope([9] + prompt, PARAMS, "t/")
    second.extend(answer[:1])  # the verifier's first token (prefill)
    proposal = second.propose(16)
    # The lead-in (the prompt's tail) matches, so the draft starts at once, as long as the match.
    assert proposal.draft_tokens == answer[1:1 + len(proposal)] and len(proposal) >= 5
    second.extend(answer[1:20])
    assert second.propose(16).draft_tokens == answer[20:36]


def test_tenant_b_never_receives_a_draft_made_of_tenant_a_tokens():
    """Random traffic of two tenants (and two scopes of one): every draft of a scope is made only
    of tokens that scope's own requests contain; the same prompts give A drafts and B none."""
    rng = random.Random(7)
    drafter = SuffixDrafter(SuffixConfig(max_cached_tokens=50_000, anchor=1))
    secret = [rng.randrange(1000, 2000) for _ in range(80)]  # only tenant A's outputs hold these
    seen: dict[str, set[int]] = {}
    drafted = {}
    for i in range(300):
        tenant = rng.choice(["a", "b"])
        scope = cache_scope_key(tenant, rng.choice(["", "x"]))
        prompt = [rng.randrange(50) for _ in range(rng.randint(2, 8))]
        output = secret if tenant == "a" else [rng.randrange(50) for _ in range(40)]
        own = set(prompt) | set(output)
        session = drafter.start_in_scope(prompt, PARAMS, scope)
        allowed = seen.setdefault(scope, set())
        position = 0
        while position < len(output):
            proposal = session.propose(8)
            assert set(proposal.draft_tokens) <= allowed | own, (i, scope)
            drafted[scope] = drafted.get(scope, 0) + len(proposal)
            step = rng.randint(1, 5)
            session.extend(output[position:position + step])
            position += step
        session.close()
        allowed |= own
    assert drafted[cache_scope_key("a", "")] > 1000 and drafted[cache_scope_key("a", "x")] > 1000
    assert not (seen[cache_scope_key("b", "")] | seen[cache_scope_key("b", "x")]) & set(secret)


def test_the_cache_stays_under_its_budget_over_4000_requests():
    budget = 20_000
    drafter = SuffixDrafter(SuffixConfig(max_cached_tokens=budget))
    cache = drafter.cache
    rng = random.Random(3)
    phrases = [[rng.randrange(30_000) for _ in range(12)] for _ in range(400)]  # text repeats across requests
    memory = {}
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(4_000):
            scope = cache_scope_key(f"tenant{i % 13}", "")
            session = drafter.start_in_scope([rng.randrange(30_000) for _ in range(20)], PARAMS, scope)
            for _ in range(rng.randint(1, 12)):
                session.propose(8)
                session.extend(rng.choice(phrases)[:rng.randint(1, 12)])
            session.close()
            assert cache.num_tokens <= budget
            if i + 1 in (1_000, 4_000):  # full from about the 400th request on
                gc.collect()
                memory[i + 1] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    stats = cache.stats()
    assert stats["evicted_documents"] > 3_000
    held = sum(len(doc) for index in cache.scopes.values() for doc in index.documents.values())
    assert held == cache.num_tokens == stats["tokens"] > budget * 0.9
    entries = sum(len(found) for index in cache.scopes.values() for found in index.occurrences.values())
    assert entries == sum(max(0, len(doc) - 1) for index in cache.scopes.values() for doc in index.documents.values())
    assert len(cache.recency) == stats["documents"]
    # Memory: flat once the cache is full, and a bounded cost per cached token.
    assert memory[4_000] < 1.15 * memory[1_000], memory
    assert memory[4_000] < 400 * budget, memory


def test_an_evicted_running_document_stays_out():
    cache = SuffixCache(SuffixConfig(max_cached_tokens=10))
    cache.add("s", 1, list(range(8)), new=True)
    cache.add("s", 2, list(range(20, 28)), new=True)  # 16 > 10: document 1 goes
    assert 1 not in cache.recency and cache.num_tokens == 8
    cache.add("s", 1, [1, 2, 3], new=False)  # its request goes on: nothing comes back
    assert cache.num_tokens == 8 and 1 not in cache.scopes["s"].documents


def test_method_chooser_tries_each_then_takes_the_fastest_and_explores():
    chooser = MethodChooser(explore_every=4)
    candidates = [("model", "m"), ("suffix", "s")]
    assert chooser.choose(candidates) == "model"
    assert chooser.choose(candidates) == "suffix"  # model is being measured by a running request
    chooser.report("m", emitted=100, round_s=2.0)  # 50 tok/s
    chooser.report("s", emitted=100, round_s=1.0)  # 100 tok/s
    choices = [chooser.choose(candidates) for _ in range(20)]
    assert choices.count("suffix") >= 16 and 2 <= choices.count("model") <= 4  # one in every ~5
    chooser.report("s", emitted=10, round_s=1.0)  # suffix's requests slow down: the blend follows
    chooser.report("s", emitted=10, round_s=1.0)
    chooser.report("s", emitted=10, round_s=1.0)
    assert chooser.rates()["s"] < 50
    assert [chooser.choose(candidates) for _ in range(3)].count("model") >= 2
    assert chooser.choose([]) is None
    # A request that ends without a report (cancelled) frees its unmeasured method for the next one.
    fresh = MethodChooser()
    assert fresh.choose([("eagle", "e"), ("suffix", "s")]) == "eagle"
    fresh.release("e")
    assert fresh.choose([("eagle", "e"), ("suffix", "s")]) == "eagle"


def test_confidence_policy_verifies_the_prefix_of_the_best_expected_rate():
    from specdec.policy.base import RoundObservation
    from specdec.policy.confidence import ConfidenceDraftLength
    from specdec.policy.memory import AcceptanceMemory

    # A compute-bound verifier: 10 ms for one token, +4 ms per further token.
    curve = [0.010 + 0.004 * k for k in range(17)]
    policy = ConfidenceDraftLength(max_k=16, forward_curve=curve, margin=0.0)
    assert policy.choose(5) == 5 and policy.choose(40) == 16  # the drafter is asked for all it may draft
    assert policy.prefix_length([0.3, 0.1]) == 0  # 1.3 tokens in 14 ms is worse than 1 in 10
    assert policy.prefix_length([0.99] * 16) == 16  # a sure copy: as long as it goes
    # Sure for four tokens, then unlikely: stop after the fourth.
    assert policy.prefix_length([0.98, 0.97, 0.96, 0.95, 0.1, 0.01, 0.001]) == 4
    # Rounds that cost more than the curve says (a verify-ahead pass before the drafts) are learned.
    memory, key = AcceptanceMemory(), ("suffix", "", "t")
    costly = ConfidenceDraftLength(max_k=16, forward_curve=curve, margin=0.0, memory=memory, key=key)
    for _ in range(30):
        costly.observe(RoundObservation(num_drafts=0, num_accepted=0, draft_s=0.0, verify_s=0.010))
        costly.observe(RoundObservation(num_drafts=2, num_accepted=2, draft_s=0.0, verify_s=0.030))
    assert policy.prefix_length([0.9, 0.8]) == 2 and costly.prefix_length([0.9, 0.8]) == 0
    costly.close()
    warm = ConfidenceDraftLength(max_k=16, forward_curve=curve, margin=0.0, memory=memory, key=key)
    assert warm.prefix_length([0.9, 0.8]) == 0  # a new session knows it from its first round
    # Beside seven other sessions in a shared pass, my drafts lengthen their rounds too.
    shared = ConfidenceDraftLength(max_k=16, forward_curve=curve, margin=0.0, co_batched=7)
    assert shared.prefix_length([0.9, 0.8, 0.7]) < policy.prefix_length([0.9, 0.8, 0.7])


def test_calibration_learns_how_far_the_cache_is_right():
    from specdec.suffix import AcceptanceCalibration, SuffixDraft

    calibration = AcceptanceCalibration()
    prior = calibration.rate(40, copying=True)
    draft = SuffixDraft([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0], match_length=40, serial=None)
    for _ in range(200):  # long matches that are right: trusted more
        calibration.record(draft, 4, copying=True)
    assert calibration.rate(40, copying=True) > 0.95 > prior
    for _ in range(200):  # short matches right after a miss that are wrong at once: trusted less
        calibration.record(SuffixDraft([7, 8], [1.0, 1.0], 3, None), 0, copying=False)
    assert calibration.rate(3, copying=False) < 0.1
    assert calibration.rate(40, copying=True) > 0.9  # the other bucket kept its own
    estimates = calibration.estimates([1.0, 0.5, 0.5], 40, copying=True)
    assert estimates[0] > 0.9 and estimates[1] == pytest.approx(estimates[0] * 0.5 * calibration.rate(40, True))


def test_candidates_trimmed_to_nothing_still_teach_the_calibration():
    """A session whose calibration distrusts the cache drafts nothing, yet its candidates are scored
    against what the target commits: once they prove right, the estimates rise and it drafts."""
    drafter = SuffixDrafter(SuffixConfig(max_cached_tokens=10_000))
    calibration = drafter.calibration
    for _ in range(300):  # a history of misses
        calibration.record(SuffixDraft([1] * 8, [1.0] * 8, 40, None), 0, copying=False)
    low = calibration.rate(40, copying=False)
    text = list(range(300, 400))
    earlier = drafter.start_in_scope([1, 2], PARAMS, "s")
    earlier.extend(text)
    earlier.close()
    session = drafter.start_in_scope([1, 2], PARAMS, "s")
    for position in range(len(text)):
        session.propose(16)  # the loop would verify none of it; one token is committed per round
        session.extend(text[position:position + 1])
    assert session.tracker.copying
    assert calibration.rate(40, copying=True) > 0.9 and calibration.rate(40, copying=False) > low


def test_a_session_whose_drafts_fail_trusts_the_estimates_less():
    from specdec.policy.base import RoundObservation
    from specdec.policy.confidence import ConfidenceDraftLength

    curve = [0.010 + 0.004 * k for k in range(17)]
    policy = ConfidenceDraftLength(max_k=16, forward_curve=curve, margin=0.0)
    sure = [0.95] * 8
    assert policy.prefix_length(sure) == 8
    for _ in range(10):  # the estimates said 7.6 of 8; the target took 1
        n = policy.prefix_length(sure)
        policy.observe(RoundObservation(num_drafts=n, num_accepted=min(n, 1), draft_s=0.0, verify_s=curve[n]))
    assert policy.trust < 0.3 and policy.prefix_length(sure) < 8
