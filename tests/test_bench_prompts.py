"""specdec bench's prompt sets and how groups of items run (unit tier: no model, no service): the
``repetitive`` set (issue #45), --limit and --rounds keeping groups whole, a group's items one after
another in one stream, and the suffix systems' requests (method, auto_methods, cache scope)."""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest

from specdec.bench import cli as bench_cli
from specdec.bench import load, prompts, repetitive, runners

GROUP_SIZES = {"revise": 1, "samples": repetitive.DEFAULT_SAMPLES_PER_PROBLEM, "docqa": len(repetitive.DOCQA_QUESTIONS)}


def groups_of(items: list[prompts.Conversation]) -> list[list[prompts.Conversation]]:
    return [items[span.start:span.stop] for span in prompts.group_spans(items)]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the prompt set tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# -- the repetitive set ---------------------------------------------------------------------------
def test_repetitive_is_deterministic_and_built_from_shipped_files_only(no_network):
    first = prompts.load_prompts("repetitive")
    second = prompts.load_prompts("repetitive")
    assert first == second  # every field of every item, in the same order
    assert [c.id for c in first[:4]] == ["revise/mt-81#fix", "revise/mt-91#title", "revise/mt-101#summary",
                                         "revise/mt-111#numbered"]  # MT-bench's categories in turn
    counts = {category: sum(c.category == category for c in first) for category in repetitive.CATEGORIES}
    assert counts == {"revise": 80, "samples": 82 * 3, "docqa": 82 * 3}
    assert "repetitive" in prompts.BUILTIN_NAMES


def test_repetitive_items_are_well_formed_and_their_ids_name_their_groups():
    items = prompts.load_prompts("repetitive")
    assert len({c.id for c in items}) == len(items)
    groups = groups_of(items)
    assert len({g[0].group for g in groups}) == len(groups)  # a group's items are consecutive: one span each
    for group in groups:
        category = group[0].category
        assert category in repetitive.CATEGORIES and group[0].group.startswith(f"{category}/")
        assert len(group) == GROUP_SIZES[category]
        for item in group:
            assert item.category == category and item.source == "repetitive"
            name, member = item.id.split(repetitive.GROUP_SEPARATOR)
            assert name == item.group and member
            assert item.turns and all(isinstance(t, str) and t.strip() for t in item.turns)
            assert len(item.turns) == (2 if category == "revise" else 1)
            assert item.chat or category == "samples"  # only samples asks plain-text prompts too
    samples = next(g for g in groups if g[0].category == "samples")
    assert len({c.turns[0] for c in samples}) == len(samples)  # other wrappers: greedy answers differ
    assert {c.chat for c in samples} == {True, False}
    docqa = next(g for g in groups if g[0].category == "docqa")
    document = docqa[0].turns[0].split("```python\n")[1].split("```")[0]
    assert all(document in c.turns[0] for c in docqa)  # every question quotes the same document


def test_repetitive_revise_asks_a_second_turn_about_the_first_answer():
    questions = {str(q["question_id"]): q for q in prompts.read_jsonl(prompts.builtin_prompt_path("mt_bench"))}
    templates = dict(repetitive.REVISE_TEMPLATES)
    revise = [c for c in prompts.load_prompts("repetitive") if c.category == "revise"]
    assert len(revise) == len(questions)
    for item in revise:
        question = questions[item.group.removeprefix("revise/mt-")]
        assert item.turns[0] == question["turns"][0]
        assert item.turns[1] == templates[item.id.split("#")[1]]
    assert {c.turns[1] for c in revise} == set(templates.values())


def test_repetitive_samples_and_docqa_take_disjoint_problems():
    items = prompts.load_prompts("repetitive")
    sampled = {c.group.removeprefix("samples/") for c in items if c.category == "samples"}
    documents = {c.group.removeprefix("docqa/") for c in items if c.category == "docqa"}
    assert len(sampled) == len(documents) == 82 and not sampled & documents
    assert len(repetitive.build_repetitive(samples_per_problem=1)) == 80 + 82 + 82 * 3
    with pytest.raises(ValueError, match="samples per problem"):
        repetitive.build_repetitive(samples_per_problem=len(repetitive.SAMPLE_WRAPPERS) + 1)


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 7, 10])
def test_limit_takes_whole_groups_categories_in_turn(limit):
    full = {g[0].group: g for g in groups_of(prompts.load_prompts("repetitive"))}
    chosen = groups_of(prompts.load_prompts("repetitive", limit=limit))
    assert len(chosen) == limit
    assert [g[0].category for g in chosen] == [repetitive.CATEGORIES[i % 3] for i in range(limit)]
    for group in chosen:
        assert group == full[group[0].group]  # whole: every item, in order


def test_repetitive_beside_the_other_sets():
    mixed = prompts.load_prompts("mt_bench,humaneval,repetitive", limit=3)
    assert [c.source for c in mixed[:6]] == ["mt_bench"] * 3 + ["humaneval"] * 3
    rest = mixed[6:]
    assert len(groups_of(rest)) == 3 and len(rest) == 1 + 3 + 3
    with pytest.raises(ValueError, match="repetitive"):  # the error names every built-in set
        prompts.load_prompts("no_such_set")


def test_ungrouped_sets_keep_their_selection():
    """An item outside a group is its own group: --limit N still takes N items of MT-bench."""
    mt = prompts.load_prompts("mt_bench", limit=8)
    assert len(mt) == 8 and len({c.category for c in mt}) == 8
    assert [len(span) for span in prompts.group_spans(mt)] == [1] * 8
    same_id = [prompts.Conversation("x", "c", ["a"], True), prompts.Conversation("x", "c", ["b"], True)]
    assert len(prompts.group_spans(same_id)) == 2  # only a non-empty group joins items


# -- rounds and streams keep groups whole ---------------------------------------------------------
def test_rounds_take_whole_groups():
    items = prompts.load_prompts("repetitive", limit=6)  # revise, samples, docqa, twice: 14 items
    assert load.effective_rounds(10, len(prompts.group_spans(items)), None) == 6
    assert load.effective_rounds(10, len(prompts.group_spans(items)), 2) == 3
    blocks = load.round_blocks(items, 4)
    assert sorted(i for block in blocks for i in block) == list(range(len(items)))
    for block in blocks:
        for span in prompts.group_spans([items[i] for i in block]):
            group = [items[block[i]] for i in span]
            assert len(group) == GROUP_SIZES[group[0].category]  # no group split across rounds
    plain = [prompts.Conversation(str(i), "c", ["q"], True) for i in range(7)]
    assert load.round_blocks(plain, 3) == [[0, 3, 6], [1, 4], [2, 5]]  # as before groups: i % R


class LoggingRunner(runners.Runner):
    """Answers after a short sleep, logging each request's first user text (its item's) and time span."""

    def __init__(self, meet_in_flight: bool = False) -> None:
        self.log: list[tuple[str, float, float]] = []
        self.lock = threading.Lock()
        # The first two requests wait for each other: with several streams they meet, with one they
        # time out (and the requests fail).
        self.meeting = threading.Barrier(2, timeout=10) if meet_in_flight else None
        self.calls = 0

    def generate(self, *, messages, prompt, max_new_tokens, temperature, seed):
        with self.lock:
            self.calls += 1
            meet = self.meeting is not None and self.calls <= 2
        if meet:
            self.meeting.wait()
        begin = time.perf_counter()
        time.sleep(0.01)
        clock = runners.ChunkClock()
        clock.chunk(1)
        with self.lock:
            self.log.append((messages[0][1] if messages else prompt, begin, time.perf_counter()))
        return clock.outcome("answer")


@pytest.mark.parametrize("concurrency", [None, 4])
def test_a_group_runs_one_item_after_another(concurrency):
    items = prompts.load_prompts("repetitive", limit=6)
    cfg = argparse.Namespace(max_new_tokens=4, temperature=0.0, seed=0, request_rate=None, concurrency=concurrency)
    runner = LoggingRunner(meet_in_flight=concurrency is not None)  # groups themselves run side by side
    records, _ = load.run_system(runner, "logging", items, cfg, progress=False)
    assert not any(r.error for r in records)
    assert [(r.conversation_id, r.turn) for r in records] == [(c.id, t) for c in items
                                                              for t in range(1, len(c.turns) + 1)]
    item_of = {c.turns[0]: c.id for c in items}
    spans: dict[str, list[tuple[float, float]]] = {}
    for text, begin, end in runner.log:
        spans.setdefault(item_of[text], []).append((begin, end))
    for group in groups_of(items):
        times = [span for item in group for span in sorted(spans[item.id])]
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(times, times[1:]))  # one after another


# -- the suffix systems ---------------------------------------------------------------------------
def test_parse_suffix_systems():
    suffix, nosuffix = runners.parse_systems("spec-suffix,spec-nosuffix", local=False)
    assert (suffix.kind, suffix.method, suffix.num_draft_tokens, suffix.auto_methods) == ("gateway", "suffix", 0, ())
    assert (nosuffix.method, nosuffix.num_draft_tokens, nosuffix.auto_methods) == ("auto", 0, ("model", "eagle", "ngram"))
    for name in ("spec-suffix", "spec-nosuffix"):
        with pytest.raises(ValueError, match="needs a gateway"):
            runners.parse_systems(name, local=True)


class FakeGateway:
    """Stands in for ``GatewayClient``: answers every request with two tokens, keeping its arguments."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def stream(self, **kwargs):
        from specdec.client import ChunkEvent, FinalEvent, build_request

        build_request(**kwargs)  # the real client takes every argument the runner passes
        with self.lock:
            self.requests.append(kwargs)
        yield ChunkEvent([1, 2], "ok")
        yield FinalEvent("length", 3, 2, {}, [7, 8, 9])

    def close(self) -> None:
        pass


def test_gateway_requests_carry_method_auto_methods_and_cache_scope():
    from specdec.client import build_request

    request = build_request(prompt="x", method="auto", cache_scope="run/spec/1", auto_methods=("model", "ngram"))
    assert request.speculation.cache_scope == "run/spec/1" and list(request.speculation.auto_methods) == ["model", "ngram"]
    gateway = FakeGateway()
    runner = runners.GatewayRunner(gateway, "auto", 0, auto_methods=runners.NON_SUFFIX_METHODS, cache_scope="r/s/1")
    outcome = runner.generate(messages=None, prompt="def f():", max_new_tokens=4, temperature=0.0, seed=1)
    assert outcome.text == "ok" and outcome.token_ids == [1, 2]
    sent = gateway.requests[0]
    assert (sent["method"], sent["cache_scope"], tuple(sent["auto_methods"])) == ("auto", "r/s/1", ("model", "eagle", "ngram"))


def test_bench_gives_every_system_and_round_a_cold_cache_scope(monkeypatch, tmp_path):
    """Through run_bench with a stand-in gateway: each request names RUN_ID/SYSTEM/ROUND (the warm-up
    a scope of its own), and a group's items share their round's scope."""
    gateway = FakeGateway()
    monkeypatch.setattr(bench_cli, "_gateway_client", lambda spec, address, args: gateway)
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--gateway", "localhost:1", "--prompts", "repetitive", "--limit", "4",
                              "--systems", "spec-suffix,spec-nosuffix,baseline", "--rounds", "2",
                              "--max-new-tokens", "4", "--out", str(tmp_path), "--no-progress"])
    summary = bench_cli.run_bench(args)
    run_id = summary["config"]["run_id"]
    assert run_id and summary["systems"]["spec-nosuffix"]["auto_methods"] == ["model", "eagle", "ngram"]
    assert summary["systems"]["spec-suffix"]["method"] == "suffix"
    assert "suffix_vs_nosuffix" in summary["speedup"] and summary["suffix_vs_nosuffix_by_round"]["pair"] == [
        "spec-suffix", "spec-nosuffix"]
    assert "spec-suffix / spec-nosuffix within each interleaved round" in (tmp_path / "report.md").read_text()
    items = prompts.load_prompts("repetitive", limit=4)
    per_system = len(items) + sum(len(c.turns) - 1 for c in items)  # requests, one per turn
    assert len(gateway.requests) == 3 * (per_system + 1)  # and one warm-up each
    scopes = {r["cache_scope"] for r in gateway.requests}
    assert scopes == {f"{run_id}/{system}/{name}" for system in ("spec-suffix", "spec-nosuffix", "baseline")
                      for name in ("warmup", "1", "2")}
    for request in gateway.requests:
        system = request["cache_scope"].split("/")[1]
        assert request["method"] == {"spec-suffix": "suffix", "spec-nosuffix": "auto", "baseline": "none"}[system]
    # every item of a group ran in one round: all its requests named that round's scope
    group_of = {c.turns[0]: c.group for c in items}
    scopes_of_group: dict[str, set[str]] = {}
    for request in gateway.requests:
        if not request["cache_scope"].endswith("/warmup"):
            first = request["messages"][0][1] if "messages" in request else request["prompt"]
            scopes_of_group.setdefault(group_of[first], set()).add(request["cache_scope"])
    assert set(scopes_of_group) == {c.group for c in items}
    assert all(len(scopes) == 3 for scopes in scopes_of_group.values())  # one per system, one round each
    rounds_of_group = {g: {scope.rsplit("/", 1)[1] for scope in scopes} for g, scopes in scopes_of_group.items()}
    assert all(len(r) == 1 for r in rounds_of_group.values())
    assert sorted(r for rs in rounds_of_group.values() for r in rs) == ["1", "1", "2", "2"]  # groups 0, 2 | 1, 3
