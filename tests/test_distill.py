"""The draft-distillation recipe end to end on the tiny target: the target's answers with its top-K,
growing the data without repeating prompts, training that resumes, export, continuing from an export,
and an exported draft that keeps greedy output identical."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdec.distill import generate, queries, train
from specdec.distill.generate import read_shards
from specdec.drafters import ModelDrafter
from specdec.engine import collect, run_sync
from specdec.local import LocalEngine
from specdec.models import HEAD_TOKEN_IDS_FILE, check_compatible, load_model
from specdec.prompts import encode_chat
from specdec.wire_types import SamplingParams
from tests.test_greedy_equality import hf_greedy
from tests.tiny_models import TEST_DEVICE

TOP_K = 32


def _generate(target_dir, out, *extra: str) -> None:
    assert generate.main([
        "--out", str(out), "--target", str(target_dir), "--prompts", "60", "--batch-size", "8",
        "--max-new-tokens", "12", "--sampled-every", "3", "--top-k", str(TOP_K), "--threads", "1",
        "--dtype", "float32", *extra,
    ]) == 0


def test_target_answers_carry_its_top_k_and_growing_the_data_skips_answered_prompts(tiny_pair, tmp_path):
    _, target_dir, _ = tiny_pair
    data, more = tmp_path / "data", tmp_path / "more"
    _generate(target_dir, data, "--max-batches", "3")
    records = read_shards(data)
    assert len(records) == 24
    assert {r["temperature"] for r in records} == {0.0, 0.7}  # every third batch samples
    for record in records:
        n = len(record["output_ids"])
        assert record["topk_ids"].shape == (n, TOP_K) and record["topk_logprobs"].shape == (n, TOP_K)
        assert bool((record["topk_logprobs"][:, :-1] >= record["topk_logprobs"][:, 1:]).all())
        if record["temperature"] == 0.0 and n:  # greedy text is the recorded distribution's top token
            assert record["output_ids"] == record["topk_ids"][:, 0].tolist()

    _generate(target_dir, more, "--max-batches", "2", "--exclude", str(data))
    assert len(read_shards(more)) == 16
    assert not generate.answered_prompts([data]) & generate.answered_prompts([more])


def _train_args(target_dir, data, out, steps: int, *extra: str) -> list[str]:
    return ["--data", str(data), "--out", str(out), "--target", str(target_dir), "--hidden", "32", "--layers", "1",
            "--intermediate", "64", "--heads", "2", "--kv-heads", "1", "--head-tokens", "200", "--steps", str(steps),
            "--token-budget", "256", "--holdout", "4", "--eval-every", "4", "--warmup", "2", "--lr", "1e-2",
            "--threads", "1", *extra]


def test_training_resumes_exports_a_draft_that_keeps_greedy_output_and_continues_from_it(
        tiny_pair, tiny_target, tmp_path, capsys):
    _, target_dir, _ = tiny_pair
    data, work, export = tmp_path / "data", tmp_path / "work", tmp_path / "draft"
    _generate(target_dir, data, "--max-batches", "4")

    assert train.main(_train_args(target_dir, data, work, 6)) == 0
    assert train.main(_train_args(target_dir, data, work, 12, "--export", str(export))) == 0
    assert "resumed at step 6" in capsys.readouterr().out
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == list(range(1, 13))
    assert sum(e["kd"] for e in log[-3:]) < sum(e["kd"] for e in log[:3])  # it learns the target
    assert (work / "best" / "eval.json").exists()

    draft = load_model(str(export), device=TEST_DEVICE)
    check_compatible(tiny_target, draft)
    head = json.loads((export / HEAD_TOKEN_IDS_FILE).read_text())
    assert draft.head_token_ids is not None and draft.head_token_ids.tolist() == head
    assert json.loads((export / "config.json").read_text())["dtype"] == "float16"  # shipped in half precision
    prompt = tiny_target.tokenizer("the quick brown fox")["input_ids"]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    result = run_sync(collect(LocalEngine(tiny_target, ModelDrafter(draft)).stream(prompt, params, num_draft_tokens=4)))
    assert result.token_ids == hf_greedy(tiny_target, prompt, 24)

    # Continuing from an export keeps its head (its weights only fit those ids) and starts a new schedule.
    again = tmp_path / "again"
    assert train.main(_train_args(target_dir, data, again, 2, "--init-from", str(export), "--dtype", "float32")) == 0
    assert json.loads((again / HEAD_TOKEN_IDS_FILE).read_text()) == head
    assert [json.loads(line)["step"] for line in (again / "train_log.jsonl").read_text().splitlines()] == [1, 2]


def test_held_out_records_come_only_from_the_named_directories(tmp_path):
    def shard(directory, source, count):
        directory.mkdir()
        torch.save([{"source": source, "prompt_ids": [i], "output_ids": [i, i]} for i in range(count)],
                   directory / "shard-00000.pt")

    old, new = tmp_path / "old", tmp_path / "new"
    shard(old, "old", 30)
    shard(new, "new", 10)
    held, training = train.split_records([old, new], 4, [new], random.Random(0))
    assert [r["source"] for r in held] == ["new"] * 4
    assert len(training) == 36 and sum(r["source"] == "new" for r in training) == 6
    held, training = train.split_records([old, new], 4, [], random.Random(0))
    assert len(held) == 4 and len(training) == 36
    with pytest.raises(SystemExit, match="not among --data"):
        train.split_records([old], 4, [new], random.Random(0))
    # Another run's held-out set by key (an EAGLE head's --heldout-from file names answers this way).
    keys = {"new/shard-00000:3", "old/shard-00000:29"}
    held, training = train.split_records([old, new], 4, [], random.Random(0), keys)
    assert {r["key"] for r in held} == keys and len(training) == 38
    assert [r["output_ids"] for r in sorted(held, key=lambda r: r["key"])] == [[3, 3], [29, 29]]
    with pytest.raises(SystemExit, match="not answered records"):
        train.split_records([old, new], 4, [], random.Random(0), {"new/shard-00000:10"})


def test_positions_whose_top_k_lies_outside_the_draft_head_stay_out_of_the_loss(tiny_pair):
    """Seen in a real run: a new answer whose top-32 held no id of the (earlier) reduced head made the
    renormalised teacher 0/0, and one NaN loss broke the weights."""
    from transformers import AutoModelForCausalLM

    _, _, draft_dir = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    head_ids = torch.arange(0, vocab // 2)
    position_of = train.head_rows(head_ids, vocab)
    inside = torch.arange(0, 4, dtype=torch.int32)
    outside = torch.arange(vocab - 4, vocab, dtype=torch.int32)  # none of them in the head
    record = {"prompt_ids": [5, 6, 7], "output_ids": [1, vocab - 1, 2],
              "topk_ids": torch.stack([inside, outside, inside + 2]),
              "topk_logprobs": torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3), -1).half()}
    loss, info = train.batch_loss(model, [record], head_ids, position_of, 0.2, 1.0, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and info["kd"] > 0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_target_writes_user_requests_that_resume_and_feed_the_answers(tiny_pair, tiny_target, tmp_path):
    _, target_dir, _ = tiny_pair
    out = tmp_path / "queries"
    base = ["--out", str(out), "--target", str(target_dir), "--batch-size", "16", "--max-new-tokens", "48",
            "--threads", "1", "--dtype", "float32"]
    assert queries.main([*base, "--count", "6"]) == 0
    first = queries.read_queries(out / "queries.jsonl")
    assert len(first) == 6
    assert queries.main([*base, "--count", "10"]) == 0  # resumes: the first six stay, four more, no repeats
    kept = queries.read_queries(out / "queries.jsonl")
    assert kept[:6] == first and len(kept) == 10
    assert len({queries.repeat_key(text) for text in kept}) == 10

    # The requests are sampled where the chat template opens a user turn.
    prefix = tiny_target.tokenizer.decode(queries.user_turn_prefix(tiny_target.tokenizer))
    rendered = tiny_target.tokenizer.decode(encode_chat(tiny_target.tokenizer, [("user", "hello there")]))
    assert rendered.startswith(prefix) and rendered[len(prefix):].startswith("hello there")

    data = tmp_path / "answers"
    _generate(target_dir, data, "--queries", str(out / "queries.jsonl"))
    records = read_shards(data)
    assert len(records) == 10 and {r["source"] for r in records} == {"self-instruct"}
    assert all(r["chat"] for r in records)


def test_steering_picks_which_system_prompts_the_requests_are_sampled_under(tiny_pair, tiny_target, tmp_path, monkeypatch):
    """--steering 1 7 rotates through those two prompts only; the default is the general mix (0-6),
    so earlier recipes sample as before; an unknown index is a usage error."""
    _, target_dir, _ = tiny_pair
    seen = []

    def fake_requests(lm, prefix, batch_size, *args):
        seen.append(tuple(prefix))
        return [(f"request {len(seen)} {i}", 8, True) for i in range(2)]

    monkeypatch.setattr(queries, "sample_requests", fake_requests)
    base = ["--target", str(target_dir), "--batch-size", "2", "--threads", "1", "--dtype", "float32",
            "--decontaminate-words", "50"]
    tokenizer = tiny_target.tokenizer
    prefix_of = {i: tuple(queries.user_turn_prefix(tokenizer, queries.STEERING_SYSTEM_PROMPTS[i]))
                 for i in range(len(queries.STEERING_SYSTEM_PROMPTS))}
    assert queries.main([*base, "--out", str(tmp_path / "code"), "--count", "8", "--steering", "1", "7"]) == 0
    assert seen == [prefix_of[1], prefix_of[7]] * 2
    seen.clear()
    assert queries.main([*base, "--out", str(tmp_path / "mix"), "--count", "14"]) == 0
    assert seen == [prefix_of[i] for i in queries.DEFAULT_STEERING] == [prefix_of[i] for i in range(7)]
    with pytest.raises(SystemExit):
        queries.main([*base, "--out", str(tmp_path / "bad"), "--steering", str(len(queries.STEERING_SYSTEM_PROMPTS))])


def test_requests_overlapping_a_benchmark_prompt_are_dropped():
    from specdec.bench.prompts import load_prompts

    n = 8
    question = load_prompts("mt_bench")[0].turns[0]
    keep = queries.QueryFilter(queries.benchmark_ngrams(n), n)
    copied = "Please help: " + " ".join(question.split()[:n + 2]) + " thanks"
    assert not keep.keep(copied, 30, True)
    assert keep.rejected == {"benchmark overlap": 1}
    assert keep.keep("What is the best way to prepare for a marathon?", 12, True)
    assert not keep.keep("what is the best way to prepare for a MARATHON", 12, True)  # a repeat, up to case
    assert not keep.keep("Tell me about", 3, True)  # too short
    assert not keep.keep("An unfinished request about", 20, False)
    assert keep.rejected == {"benchmark overlap": 1, "repeat": 1, "length": 1, "unfinished": 1}
