"""The replay drafter (controlled acceptance) and synthetic targets: exactness against plain decoding,
the acceptance it was set to, reruns that repeat, its file, the names of synthetic targets, and a
sweep through real services (``specdec bench --up --acceptance-sweep``)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch

from specdec.bench import sweep as bench_sweep
from specdec.cli import main as cli_main
from specdec.engine import collect
from specdec.lm import ModelLoadError
from specdec.local import LocalEngine
from specdec.replay import (
    REPLAY_WIRE_METHOD,
    ReplayDrafter,
    ReplayScript,
    ReplaySettings,
    prompt_key,
    read_replay_file,
    write_replay_file,
)
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.synthetic import PRESETS, parse_synthetic
from tests.tiny_models import TEST_DEVICE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_SYNTHETIC = "synthetic:llama:hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128,std=0.1"
PROMPTS = ["the quick brown fox", "def add(a, b):", "numbers 0 1 2 3"]
NEW_TOKENS = 24


def _generate(target, drafter, prompt_ids, k: int):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return asyncio.run(collect(LocalEngine(target, drafter).stream(prompt_ids, params, k)))


@pytest.fixture(scope="module")
def recorded(tiny_target):
    """Plain decoding of each prompt: (prompt ids, output ids) and the replay recordings of them."""
    runs = []
    for text in PROMPTS:
        prompt_ids = tiny_target.tokenizer.encode(text)
        runs.append((prompt_ids, list(_generate(tiny_target, None, prompt_ids, 0).token_ids)))
    return runs, {prompt_key(p): out for p, out in runs}


# -- exactness and acceptance, in process on the tiny target ----------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("k", [3, 0])
def test_replay_output_equals_plain_decoding(tiny_target, recorded, one_thread, alpha, k):
    runs, continuations = recorded
    drafter = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=alpha), continuations))
    drafted = accepted = 0
    for prompt_ids, plain in runs:
        result = _generate(tiny_target, drafter, prompt_ids, k)
        assert result.token_ids == plain
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    if k:  # a fixed k drafts every round, so the acceptance is the drafter's
        assert drafted > 0
        if alpha == 1.0:
            assert accepted == drafted
        elif alpha == 0.0:
            assert accepted == 0
        else:
            assert 0 < accepted < drafted


def test_replay_on_a_prompt_it_has_no_recording_of_proposes_nothing(tiny_target, recorded, one_thread):
    _, continuations = recorded
    drafter = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=1.0), continuations))
    prompt_ids = tiny_target.tokenizer.encode("a prompt nobody recorded")
    result = _generate(tiny_target, drafter, prompt_ids, 3)
    assert result.stats.draft_tokens == 0
    assert result.token_ids == list(_generate(tiny_target, None, prompt_ids, 0).token_ids)


def _greedy_verification(drafter, prompt, recorded, k):
    """Decode ``recorded`` (the target's greedy tokens) with ``drafter`` the way the verifier does under
    greedy: accept the longest prefix of drafts equal to the target's tokens, then commit the target's
    next token. Returns drafted and accepted counts per draft position."""
    session = drafter.start(prompt, SamplingParams())
    done = 0
    drafted, accepted = [0] * k, [0] * k
    while done < len(recorded):
        proposal = session.propose(k)
        n = 0
        while n < len(proposal) and proposal.draft_tokens[n] == recorded[done + n]:
            n += 1
        for i in range(len(proposal)):
            drafted[i] += 1
            accepted[i] += i < n
        step = recorded[done : done + n + 1]
        session.extend(step)
        done += len(step)
    return drafted, accepted


def test_replay_acceptance_is_the_alpha_set_at_every_position():
    """Seeded, so deterministic: each position's keep draw is a pure function of (seed, prompt, position)."""
    prompt, recorded = [5, 6, 7], [(11 * i) % 300 for i in range(6000)]
    drafter = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=0.7, seed=3), {prompt_key(prompt): recorded}))
    drafted, accepted = _greedy_verification(drafter, prompt, recorded, 4)
    # Per token: a draft is decided when every draft before it was accepted (later ones go unread).
    decided = [drafted[0]] + accepted[:-1]
    assert sum(accepted) / sum(decided) == pytest.approx(0.7, abs=0.02)
    for i in range(4):  # P(accept position i | positions before it accepted) = alpha at every position
        assert decided[i] > 500
        assert accepted[i] / decided[i] == pytest.approx(0.7, abs=0.05)
    assert sum(accepted) / sum(drafted) < 0.6  # accepted / drafted counts the unread drafts too


def test_replay_reruns_repeat_and_seeds_differ():
    prompt, recorded = [1, 2], list(range(10, 60))
    continuations = {prompt_key(prompt): recorded}

    def drafts(seed):
        session = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=0.5, seed=seed), continuations)).start(
            prompt, SamplingParams())
        return session.propose(40).draft_tokens

    first = drafts(0)
    assert first == drafts(0)
    assert first != drafts(1)
    kept = [d == t for d, t in zip(first, recorded)]
    assert 0 < sum(kept) < len(kept)
    assert all(d == t or d == t - 1 for d, t in zip(first, recorded))  # a changed token is never the target's


def test_replay_proposes_nothing_once_the_text_left_the_recording():
    prompt, recorded = [1, 2], [30, 31, 32, 33]
    session = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=1.0), {prompt_key(prompt): recorded})).start(
        prompt, SamplingParams())
    assert session.propose(2).draft_tokens == [30, 31]
    session.extend([30, 99])
    assert len(session.propose(2)) == 0
    fresh = ReplayDrafter(ReplayScript(ReplaySettings(acceptance=1.0), {prompt_key(prompt): recorded})).start(
        prompt, SamplingParams())
    fresh.extend(recorded)
    assert len(fresh.propose(2)) == 0  # past the recording's end


def test_emulated_cost_is_one_sleep_per_draft_step_for_a_whole_batch():
    slept = []
    a, b = [1, 2], [3, 4]
    script = ReplayScript(ReplaySettings(acceptance=1.0, cost_s=0.01), {prompt_key(a): [5] * 8, prompt_key(b): [6] * 8})
    drafter = ReplayDrafter(script, sleep=slept.append)
    proposals = drafter.propose_batch([(drafter.start(a, SamplingParams()), 3), (drafter.start(b, SamplingParams()), 2)])
    assert [p.draft_tokens for p in proposals] == [[5, 5, 5], [6, 6]]
    assert slept == [pytest.approx(0.03)]
    drafter.start(a, SamplingParams()).propose(4)
    assert slept[-1] == pytest.approx(0.04)


def test_replay_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "replay.json"
    prompt = [1, 2, 3]
    drafter = ReplayDrafter(path)
    assert drafter.start(prompt, SamplingParams()).propose(3) == DraftProposal()  # no file yet
    write_replay_file(path, ReplayScript(ReplaySettings(acceptance=1.0), {prompt_key(prompt): [7, 8, 9]}))
    assert drafter.start(prompt, SamplingParams()).propose(3).draft_tokens == [7, 8, 9]
    assert "alpha=1" in drafter.label
    write_replay_file(path, ReplayScript(ReplaySettings(acceptance=0.0, cost_s=0.0), {prompt_key(prompt): [7, 8, 9]}))
    assert drafter.start(prompt, SamplingParams()).propose(3).draft_tokens == [6, 7, 8]
    assert read_replay_file(path).settings.acceptance == 0.0


@pytest.mark.parametrize("data, field", [
    ({"format": "other"}, "format"),
    ({"format": "specdec-replay/1"}, "settings"),
    ({"format": "specdec-replay/1", "settings": {"acceptance": 1.5}}, "acceptance"),
    ({"format": "specdec-replay/1", "settings": {"acceptance": 0.5, "cost_s": -1}}, "cost_s"),
    ({"format": "specdec-replay/1", "settings": {"acceptance": 0.5, "speed": 1}}, "settings"),
    ({"format": "specdec-replay/1", "settings": {"acceptance": 0.5}, "continuations": {"k": [1, "x"]}}, "continuations"),
])
def test_a_bad_replay_file_names_its_field(tmp_path, data, field):
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        ReplayDrafter(path)


def test_auto_never_chooses_replay_and_replay_needs_its_file():
    from specdec import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "embedded")
    for target in ("embedded", TINY_SYNTHETIC):
        drafter_cmd = up.children(parser.parse_args(["--target", target]))[1].command
        method = drafter_cmd[drafter_cmd.index("--method") + 1]
        assert method == ("model" if target == "embedded" else "ngram")
    with pytest.raises(SystemExit, match="--replay-file"):
        up.children(parser.parse_args(["--draft-method", "replay"]))
    cmd = up.children(parser.parse_args(["--draft-method", "replay", "--replay-file", "r.json"]))[1].command
    assert cmd[cmd.index("--method") + 1] == "replay" and cmd[cmd.index("--replay-file") + 1].endswith("/r.json")


def test_bench_replay_flags_are_checked():
    from specdec.bench.cli import add_arguments, validate_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, message in [
        (["--up", "--acceptance-sweep", "0.5,x"], "--acceptance-sweep"),
        (["--up", "--acceptance-sweep", "0.5,1.2"], "--acceptance-sweep"),
        (["--up", "--acceptance-sweep", "0.5", "--replay-acceptance", "0.5"], "exclude"),
        (["--up", "--acceptance-sweep", "0.5", "--systems", "spec"], "--systems"),
        (["--local", "--replay-acceptance", "0.5"], "--local"),
        (["--gateway", "h:1", "--replay-acceptance", "0.5"], "--replay-file"),
        (["--up", "--replay-acceptance", "0.5", "--replay-cost", "-1"], "--replay-cost"),
        (["--up", "--target", "synthetic:llama-2b"], "llama-2b"),
    ]:
        with pytest.raises((ValueError, ModelLoadError), match=message):
            validate_args(parser.parse_args(flags))
    systems = bench_sweep.sweep_systems([0.5, 0.9], 4)
    assert [s.name for s in systems] == ["baseline", "spec@a=0.5", "spec-k=4@a=0.5", "spec@a=0.9", "spec-k=4@a=0.9"]
    assert all(s.method == REPLAY_WIRE_METHOD and s.replay_acceptance for s in systems[1:])


# -- synthetic targets ------------------------------------------------------------------------------
def test_synthetic_names_parse_to_llama_shapes():
    one = parse_synthetic("synthetic:llama-1b")
    assert (one.hidden, one.layers, one.heads, one.kv_heads, one.intermediate) == (2048, 16, 32, 8, 8192)
    assert one.parameter_count(49152) == 1_174_472_704
    eight = parse_synthetic("synthetic:llama-8b")
    assert eight.parameter_count(49152) == pytest.approx(7.4e9, rel=0.01)
    assert parse_synthetic("synthetic:llama-1b:layers=4,seed=3").layers == 4
    custom = parse_synthetic("synthetic:llama:hidden=256,layers=3,heads=8,intermediate=512")
    assert custom.kv_heads == 8 and custom.vocab is None and custom.seed == 0
    assert set(PRESETS) == {"llama-1b", "llama-8b"}


@pytest.mark.parametrize("name, field", [
    ("synthetic:gpt-1b", "unknown shape"),
    ("synthetic:llama:hidden=64,layers=2", "heads=, intermediate="),
    ("synthetic:llama-1b:layers=zero", "layers"),
    ("synthetic:llama-1b:layers=0", "layers"),
    ("synthetic:llama-1b:depth=3", "depth"),
    ("synthetic:llama-1b:std=-1", "std"),
    ("synthetic:llama-1b:seed=x", "seed"),
    ("synthetic:llama-1b:heads=30", "hidden=2048 must be a multiple of heads=30"),
    ("synthetic:llama-1b:kv_heads=5", "kv_heads=5"),
])
def test_a_bad_synthetic_name_says_which_field(name, field):
    from specdec.models import resolve_model_path

    with pytest.raises(ModelLoadError, match=field):
        resolve_model_path(name)  # where up and the services fail first


def test_a_tiny_synthetic_target_builds_the_same_in_both_runtimes(one_thread):
    from specdec.kv import KVSession
    from specdec.models import load_model

    hf = load_model(TINY_SYNTHETIC, device="cpu", runtime="hf")
    lean = load_model(TINY_SYNTHETIC, device="cpu", runtime="lean")
    assert hf.runtime == "hf" and lean.runtime == "lean"
    config = hf.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (64, 2, 4, 2, 128)
    assert config.vocab_size == len(hf.tokenizer) == hf.vocab_size
    spec = parse_synthetic(TINY_SYNTHETIC)
    assert sum(p.numel() for p in hf.model.parameters()) == spec.parameter_count(len(hf.tokenizer))
    assert all(torch.equal(a, b) for a, b in zip(hf.model.parameters(), lean.model.parameters()))  # seeded
    other = load_model(TINY_SYNTHETIC.replace("std=0.1", "std=0.1,seed=1"), device="cpu", runtime="hf")
    assert not torch.equal(hf.model.lm_head.weight, other.model.lm_head.weight)
    ids = hf.tokenizer.encode("Hello, how are you?")
    logits = []
    for lm in (hf, lean):
        session = KVSession(lm)
        logits.append(session.forward(ids, 4))
        session.close()
    assert logits[0].shape == (4, hf.logits_width)
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    top = logits[0][-1].topk(2).values
    assert float(top[0] - top[1]) > 0 and float(logits[0][-1].std()) > 0.1  # not degenerate
    bf16 = load_model(TINY_SYNTHETIC, device="cpu", dtype=torch.bfloat16, runtime="hf")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert float(bf16.model.lm_head.weight.detach().float().std()) == pytest.approx(0.1, rel=0.05)


# -- through real services --------------------------------------------------------------------------
def test_acceptance_sweep_through_real_services(tmp_path, monkeypatch):
    """``specdec bench --up --acceptance-sweep 0,1`` on a tiny synthetic target: the stack's drafter is
    the replay drafter; every output equals plain decoding; alpha = 1 accepts all it drafts and
    alpha = 0 nothing; the report and the plot show the sweep."""
    monkeypatch.setattr(bench_sweep, "SETTINGS_SETTLE_S", 0.5)  # the wait only steers warm starts
    out = tmp_path / "out"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": turns}) + "\n"
                               for i, turns in enumerate([["Hello there", "Again, shorter."], ["def add(a, b):"]])))
    rc = cli_main(["--log-level", "WARNING", "bench", "--up", "--target", TINY_SYNTHETIC, "--prompts", str(prompts),
                   "--max-new-tokens", "12", "--acceptance-sweep", "0,1", "--sweep-fixed-k", "3",
                   "--rounds", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    points = {p["system"]: p for p in summary["acceptance_sweep"]["points"]}
    assert set(points) == {"spec@a=0", "spec-k=3@a=0", "spec@a=1", "spec-k=3@a=1"}
    for name, point in points.items():
        assert point["outputs"] == {"identical": 3, "compared": 3}, name
        assert summary["systems"][name]["errors"] == 0
    for alpha in (0, 1):
        fixed = summary["systems"][f"spec-k=3@a={alpha}"]
        assert fixed["draft_tokens"] > 0 and fixed["accepted_tokens"] == (fixed["draft_tokens"] if alpha else 0)
    replay = summary["config"]["replay"]
    assert replay["recorded_prompts"] == 3 and replay["target_step_s"] > 0
    assert replay["cost_s"] == pytest.approx(0.05 * replay["target_step_s"])
    assert read_replay_file(replay["file"]).continuations  # what the drafter service read
    report = (out / "report.md").read_text()
    assert "## Controlled acceptance (replay drafter)" in report and "| spec-k=3@a=1 | 1 | 3 |" in report
    assert (out / "acceptance_sweep.png").read_bytes()[:8] == PNG_MAGIC
