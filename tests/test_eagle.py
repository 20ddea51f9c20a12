"""The EAGLE head (specdec/eagle/) on a tiny random Llama target: shapes, the warm-started layer,
incremental drafting against the full forward and the training-time-test unroll, save/load, the
target's features by teacher forcing, the loss going down, resuming, and the acceptance arithmetic."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specdec.distill.train import head_rows
from specdec.eagle import train as eagle_train
from specdec.eagle.drafting import HeadSession
from specdec.eagle.evaluate import (acceptance_stats, anchor_acceptance, evaluate_records, greedy_drafts,
                                    simulated_rounds)
from specdec.eagle.features import read_feature_shards, teacher_force, write_feature_shards
from specdec.eagle.head import EagleHead, attention

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tiny_pair):
    from specdec.models import load_model

    return load_model(str(tiny_pair[1]), device="cpu", runtime="hf")


def perturbed_head(target, ids=None, seed=0, scale=0.3, train_lm_head=False) -> EagleHead:
    """A head warm-started from ``target`` with noise on the fusion and the layer (so that it is
    neither the identity fusion nor the target's layer, and drafts vary)."""
    head = EagleHead.from_target(target, list(range(target.vocab_size)) if ids is None else ids,
                                 train_lm_head=train_lm_head)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc.", "layer.")) and p.ndim == 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * max(float(p.std()), 0.05))
    return head.eval()


def random_sequences(count, seed, vocab, low=6, high=30):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def feature_records(target, count=6, seed=0):
    seqs = random_sequences(count, seed, target.vocab_size, 12, 40)
    forced = teacher_force(target, seqs, token_budget=128)
    return [{"key": f"r{i}", "source": "test", "answer_start": len(s) // 2, **f} for i, (s, f) in enumerate(zip(seqs, forced))]


def test_head_shapes(target):
    ids = list(range(0, target.vocab_size, 2))
    head = EagleHead.from_target(target, ids)
    hidden = head.config.hidden_size
    tokens = torch.randint(0, target.vocab_size, (2, 10))
    g = head(tokens, torch.randn(2, 10, hidden), torch.arange(1, 11))
    assert g.shape == (2, 10, hidden)
    assert head.token_logits(g).shape == (2, 10, len(ids))
    full = head.full_logits(g)
    assert full.shape == (2, 10, head.config.vocab_size) and full.dtype == torch.float32
    assert torch.isinf(full[..., 1::2]).all() and torch.isfinite(full[..., 0::2]).all()
    assert set(head.greedy_tokens(g).flatten().tolist()) <= set(ids)
    # The head's layer has the target's shapes; nothing of the target's embedding is a parameter.
    layer = target.model.base_model.layers[-1]
    assert {k: v.shape for k, v in head.layer.state_dict().items()} == {k: v.shape for k, v in layer.state_dict().items()}
    assert "embed_weight" not in head.state_dict() and "embed_weight" not in dict(head.named_parameters())


def test_warm_started_layer_is_the_targets_last_layer(target):
    """Fed the target's input to its last layer, the head's layer gives that layer's output."""
    layer = target.model.base_model.layers[-1]
    seen = {}
    handle = layer.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0] if args else kwargs["hidden_states"], y=out),
                                         with_kwargs=True)
    ids = torch.tensor([random_sequences(1, 1, target.vocab_size, 20, 20)[0]])
    with torch.no_grad():
        target.model(input_ids=ids)
    handle.remove()
    head = EagleHead.from_target(target, list(range(target.vocab_size)))
    n = ids.shape[1]
    cos, sin = head.rope(torch.arange(n))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.no_grad():
        out = head.layer(seen["x"], cos, sin, lambda q, k, v: attention(q, k, v, causal))
    assert (out - seen["y"]).abs().max() <= TOL


def test_incremental_steps_equal_the_full_forward(target):
    head = perturbed_head(target)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, target.vocab_size, (1, 24), generator=gen)
    features = torch.randn(1, 24, head.config.hidden_size, generator=gen)
    with torch.no_grad():
        full = head(tokens, features, torch.arange(1, 25))[0]
        session = HeadSession(head)
        parts = [session.step(tokens[0, :9].tolist(), features[0, :9])]
        parts += [session.step([int(tokens[0, i])], features[0, i:i + 1]) for i in range(9, 24)]
    assert (torch.cat(parts) - full).abs().max() <= TOL
    assert session.cache.length == 24


def test_drafting_equals_the_training_time_test_unroll(target):
    """k-step drafting (own features past the target's) == the unroll's depth-d rows on the same tokens,
    and the unroll's step d fuses step d-1's outputs one position back."""
    head = perturbed_head(target, seed=3)
    gen = torch.Generator().manual_seed(2)
    n, k = 14, 4
    committed = torch.randint(3, target.vocab_size, (n + 1,), generator=gen).tolist()
    features = torch.randn(n, head.config.hidden_size, generator=gen)
    session = HeadSession(head)
    drafted = session.draft(committed, features, k)
    assert len(drafted.token_ids) == k and session.cache.length == n and session.tokens == committed
    text = committed + drafted.token_ids[: k - 1]
    extra = torch.randn(k - 1, head.config.hidden_size, generator=gen)  # never seen by the anchor's chain
    tokens = torch.tensor([text[1:]])
    with torch.no_grad():
        unrolled = head.unroll(tokens, torch.cat([features, extra])[None], torch.arange(1, len(text)), k)
    for d in range(1, k + 1):
        row = n + d - 2
        assert (unrolled.outputs[d - 1][0, row] - drafted.features[d - 1]).abs().max() <= TOL
        assert int(head.greedy_tokens(unrolled.outputs[d - 1][0, row])) == drafted.token_ids[d - 1]
    for d in range(1, k):
        assert torch.equal(unrolled.inputs[d][:, 1:], unrolled.outputs[d - 1][:, :-1])
        assert not unrolled.inputs[d][:, 1:].equal(unrolled.inputs[0][:, 1:])
    # After more commits (with their features), the session rolls back and drafts as a fresh one does,
    # whether it is given every feature or only the new ones.
    longer = committed + [drafted.token_ids[0], 7]
    more = torch.cat([features, torch.randn(2, head.config.hidden_size, generator=gen)])
    fresh = HeadSession(head).draft(longer, more, k)
    again = session.draft(longer, more[n - 1:], k, features_start=n - 1)
    assert again.token_ids == fresh.token_ids
    torch.testing.assert_close(again.features, fresh.features, atol=TOL, rtol=1e-5)  # features reach |g| ~ 40
    # Committed tokens past the target's features: fed with the head's own features first.
    lagging = HeadSession(head).draft(longer, more[:n], k)
    assert len(lagging.token_ids) == k


def test_save_load_roundtrip(target, tmp_path):
    from safetensors.torch import load_file

    for train_lm_head in (False, True):
        head = perturbed_head(target, ids=list(range(0, target.vocab_size, 3)), seed=4, train_lm_head=train_lm_head)
        with torch.no_grad():  # fp16 on disk: make the weights fp16-exact so the roundtrip is lossless
            for name, p in head.named_parameters():
                if train_lm_head or name != "lm_head.weight":
                    p.copy_(p.half().float())
        directory = head.save(tmp_path / f"head-{train_lm_head}")
        saved = load_file(str(directory / "model.safetensors"))
        assert all(t.dtype == torch.float16 for t in saved.values())
        assert "embed_weight" not in saved and all(t.shape[0] != target.vocab_size for t in saved.values())
        assert ("lm_head.weight" in saved) == train_lm_head
        loaded = EagleHead.load(directory, target).eval()
        for name, tensor in head.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), name
        assert torch.equal(loaded.head_token_ids, head.head_token_ids)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(3, target.vocab_size, (16,), generator=gen).tolist()
        features = torch.randn(15, head.config.hidden_size, generator=gen)
        assert HeadSession(loaded).draft(tokens, features, 5).token_ids == HeadSession(head).draft(tokens, features, 5).token_ids


def test_teacher_forced_features_are_the_targets_hidden_states(target):
    sequences = random_sequences(4, 7, target.vocab_size, 5, 25)
    forced = teacher_force(target, sequences, token_budget=40)  # several right-padded batches
    layer = target.model.base_model.layers[-1]
    for sequence, record in zip(sequences, forced):
        seen = {}
        handle = layer.register_forward_hook(lambda m, args, out: seen.update(y=out))
        with torch.no_grad():
            out = target.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        handle.remove()
        plain = seen["y"][0]
        assert record["features"].dtype == torch.float16 and record["features"].shape == plain.shape
        torch.testing.assert_close(record["features"].float(), plain, atol=2e-3, rtol=2e-3)
        # Before the final norm: normed, they are the model's last hidden state.
        norm = target.model.base_model.norm
        torch.testing.assert_close(norm(record["features"].float()), out.hidden_states[-1][0], atol=5e-3, rtol=5e-3)
        assert record["labels"].tolist() == out.logits[0, :, : target.vocab_size].argmax(-1).tolist()
        assert record["input_ids"].tolist() == sequence


def test_feature_shards_resume(target, tmp_path):
    records = [{"key": f"k{i}", "source": "s", "prompt_ids": seq[:4], "output_ids": seq[4:]}
               for i, seq in enumerate(random_sequences(5, 8, target.vocab_size, 8, 16))]
    assert write_feature_shards(target, records[:3], tmp_path, 2, 256) == 3
    assert write_feature_shards(target, records, tmp_path, 2, 256) == 3  # shard 0 kept; shard 1 grew; shard 2 new
    read = read_feature_shards([tmp_path])
    assert [r["key"] for r in read] == [r["key"] for r in records]
    assert [r["answer_start"] for r in read] == [4] * 5


@pytest.mark.parametrize("soft_labels", [False, True])
def test_training_steps_reduce_the_loss(target, soft_labels):
    torch.manual_seed(0)
    records = feature_records(target)
    head = EagleHead.from_target(target, list(range(target.vocab_size)))
    position_of = torch.arange(target.vocab_size)
    batch = eagle_train.collate(records)
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    first, first_info = eagle_train.batch_loss(head, batch, position_of, depth=3, soft_labels=soft_labels)
    for _ in range(25):
        loss, info = eagle_train.batch_loss(head, batch, position_of, depth=3, soft_labels=soft_labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, info = eagle_train.batch_loss(head, batch, position_of, depth=3, soft_labels=soft_labels)
    first, last = float(first.detach()), float(last.detach())
    # Soft labels: the cross-entropy's floor is p's own entropy, so the loss falls less far.
    assert last < (0.8 if soft_labels else 0.6) * first, (first, last)
    # The tiny random target's p is nearly flat: matching it moves the argmax more slowly than its labels.
    assert info["acc1"] > (max(0.15, 2 * first_info["acc1"]) if soft_labels else 0.5), (first_info["acc1"], info["acc1"])
    assert not any(p.grad is not None for p in (head.lm_head.weight, head.norm.weight))  # frozen by default


def test_the_served_head_tokens_loss_is_the_loss_of_the_head_a_drafter_serves(target, tmp_path):
    """``served_head_tokens=N`` trains what a drafter keeping the first N ids serves: the loss and
    agreement equal those of the head loaded with only those ids (a label past them is no token loss,
    and counts as a miss), and with a trained LM head only those rows get gradients."""
    records = feature_records(target, seed=3)
    batch = eagle_train.collate(records)
    ids = list(range(target.vocab_size))
    random.Random(1).shuffle(ids)
    served = target.vocab_size // 3
    perturbed_head(target, ids, seed=2).save(tmp_path / "head")
    whole = EagleHead.load(tmp_path / "head", target)
    cut = EagleHead.load(tmp_path / "head", target, max_head_tokens=served)
    assert cut.head_token_ids.tolist() == ids[:served]
    position_of = head_rows(whole.head_token_ids, target.vocab_size)
    position_of_cut = head_rows(cut.head_token_ids, target.vocab_size)
    assert int((position_of_cut[batch.labels[batch.mask]] < 0).sum()) > 0  # some labels lie past the served ids
    for soft in (False, True):
        loss, info = eagle_train.batch_loss(whole, batch, position_of, 3, soft_labels=soft, served_head_tokens=served)
        expected, expected_info = eagle_train.batch_loss(cut, batch, position_of_cut, 3, soft_labels=soft)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        assert [info[f"acc{d}"] for d in (1, 2, 3)] == [expected_info[f"acc{d}"] for d in (1, 2, 3)]
    full_loss, _ = eagle_train.batch_loss(whole, batch, position_of, 3)
    assert abs(float(full_loss.detach()) - float(loss.detach())) > 1e-3  # the restriction changes what is trained
    trained = perturbed_head(target, ids, seed=2, train_lm_head=True)
    eagle_train.batch_loss(trained, batch, position_of, 3, served_head_tokens=served)[0].backward()
    grad = trained.lm_head.weight.grad
    assert grad[:served].abs().sum() > 0 and grad[served:].abs().sum() == 0


def test_training_resumes_at_the_saved_step(target, tiny_pair, tmp_path):
    records = [{"key": f"k{i:02d}", "source": "s", "prompt_ids": seq[:5], "output_ids": seq[5:]}
               for i, seq in enumerate(random_sequences(10, 9, target.vocab_size, 10, 20))]
    features = tmp_path / "features"
    write_feature_shards(target, records, features, 4, 256)
    common = ["--features", str(features), "--target", str(tiny_pair[1]), "--steps", "6", "--token-budget", "48",
              "--holdout", "2", "--eval-every", "3", "--checkpoint-every", "2", "--dtype", "float32", "--head-tokens", "300",
              "--warmup", "2", "--lr", "2e-3"]
    assert eagle_train.main(common + ["--out", str(tmp_path / "straight")]) == 0
    assert eagle_train.main(common + ["--out", str(tmp_path / "split"), "--stop-after", "3"]) == 0
    state = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert state["step"] == 3 and not (tmp_path / "split" / "head").exists()
    assert eagle_train.main(common + ["--out", str(tmp_path / "split")]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # step 0: the warm start's held-out numbers
    straight = EagleHead.load(tmp_path / "straight" / "head", target).state_dict()
    resumed = EagleHead.load(tmp_path / "split" / "head", target).state_dict()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=1e-6, rtol=0)
    held = json.loads((tmp_path / "split" / "heldout.json").read_text())
    assert len(held["keys"]) == 2 and (tmp_path / "split" / "best" / "config.json").exists()


def test_a_later_stage_starts_from_the_earlier_head_and_keeps_its_held_out_sequences(target, tiny_pair, tmp_path):
    """A curriculum (text first, then the target's answers): stage 2 starts from stage 1's head (its
    step-0 held-out numbers are stage 1's last) and holds out exactly stage 1's sequences."""
    records = [{"key": f"k{i:02d}", "source": "s", "prompt_ids": seq[:5], "output_ids": seq[5:]}
               for i, seq in enumerate(random_sequences(10, 4, target.vocab_size, 10, 20))]
    features = tmp_path / "features"
    write_feature_shards(target, records, features, 4, 256)
    common = ["--features", str(features), "--target", str(tiny_pair[1]), "--steps", "4", "--token-budget", "48",
              "--eval-every", "4", "--dtype", "float32", "--head-tokens", "300", "--warmup", "1", "--lr", "2e-3"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert eagle_train.main(common + ["--out", str(one), "--holdout", "3"]) == 0
    assert eagle_train.main(common + ["--out", str(two), "--init", str(one / "head"),
                                      "--heldout-from", str(one / "heldout.json"), "--seed", "5"]) == 0
    assert sorted(json.loads((two / "heldout.json").read_text())["keys"]) == sorted(json.loads((one / "heldout.json").read_text())["keys"])
    last_of_one = [json.loads(line) for line in (one / "train_log.jsonl").read_text().splitlines()][-1]["eval"]
    first_of_two = json.loads((two / "train_log.jsonl").read_text().splitlines()[0])["eval"]
    assert first_of_two["acc1"] == pytest.approx(last_of_one["acc1"], abs=1e-6)
    assert first_of_two["loss"] == pytest.approx(last_of_one["loss"], rel=1e-3)  # fp16 save of the weights


def greedy_record(length=20, answer_start=6, vocab=50):
    """A record whose text is its own greedy path: x[m + 1] == labels[m]."""
    rng = random.Random(0)
    x = [rng.randrange(vocab) for _ in range(length)]
    labels = x[1:] + [0]
    return {"key": "g", "source": "hand", "answer_start": answer_start,
            "input_ids": torch.tensor(x, dtype=torch.int32), "labels": torch.tensor(labels, dtype=torch.int32)}


def oracle_drafts(record, k, wrong_from=None):
    """[k, T-1] drafts: depth d at row i is the label at position i + 1 (correct), or a wrong id
    for depths >= ``wrong_from``."""
    labels = record["labels"].long()
    t = len(labels)
    drafts = torch.zeros((k, t - 1), dtype=torch.long)
    for d in range(1, k + 1):
        drafts[d - 1] = labels[1:]
        if wrong_from is not None and d >= wrong_from:
            drafts[d - 1] = labels[1:] + 1
    return drafts


def test_acceptance_on_hand_made_drafts():
    k = 5
    record = greedy_record()
    for wrong_from, expected in ((None, [1.0] * k), (1, [0.0] * k), (2, [1.0, 0, 0, 0, 0]), (4, [1.0, 1.0, 1.0, 0, 0])):
        windows, on_path = anchor_acceptance(oracle_drafts(record, k, wrong_from), record, k)
        assert all(on_path) and len(windows) == 20 - 1 - 6
        stats = acceptance_stats(windows, k)
        assert stats["prefix_acceptance"] == expected
        assert stats["expected_tokens_per_round"] == pytest.approx(1 + sum(expected))
        rounds = simulated_rounds(windows, k)
        assert sum(rounds) == 20 - 1 - 6  # every answer token after the first is produced once
        accepted = sum(1 for x in expected if x)
        assert rounds[0] == accepted + 1
    stats = acceptance_stats(anchor_acceptance(oracle_drafts(record, k, 3), record, k)[0], k)
    assert stats["conditional_acceptance"] == [1.0, 1.0, 0.0, None, None]
    # Text off the target's greedy path inside a window: left out of P(1..j), counted.
    off = dict(record, labels=record["labels"].clone())
    off["labels"][10] = (int(off["labels"][10]) + 1) % 50
    windows, on_path = anchor_acceptance(oracle_drafts(off, k), off, k)
    assert not all(on_path) and sum(on_path) < len(on_path)


def test_evaluation_report_for_an_oracle_and_a_real_head(target, monkeypatch):
    from specdec.eagle import evaluate as ev

    k = 4
    record = greedy_record(length=30, answer_start=5)
    monkeypatch.setattr(ev, "greedy_drafts", lambda head, records, k, budget=4096: [oracle_drafts(r, k) for r in records])
    report = ev.evaluate_records(None, [record], k)["all"]
    assert report["prefix_acceptance"] == [1.0] * k and report["first_draft_agreement"] == 1.0
    assert report["mean_accepted_length_rounds"] == pytest.approx(24 / 5)  # 24 tokens: four rounds of 5, one of 4
    monkeypatch.undo()
    # A real head: the evaluation's depth-1 drafts are HeadSession's first drafts at every anchor.
    head = perturbed_head(target, seed=6, scale=0.1)
    records = feature_records(target, count=2, seed=11)
    drafts = greedy_drafts(head, records, k)
    for record, matrix in zip(records, drafts):
        tokens, features = record["input_ids"].tolist(), record["features"]
        for n in range(record["answer_start"], len(tokens) - 1, 5):
            first = HeadSession(head).draft(tokens[: n + 1], features[:n], 1).token_ids[0]
            assert first == int(matrix[0, n - 1])
    assert evaluate_records(head, records, k)["all"]["answer_positions"] > 0


@pytest.mark.parametrize("step", ["eagle-features", "eagle-train", "eagle-eval", "eagle-ids", "eagle-curve"])
def test_cli_steps_have_help(step, capsys):
    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train-draft", step, "--help"])
    assert exit_info.value.code == 0
    assert "usage: specdec train-draft " + step in capsys.readouterr().out


def test_the_learning_curve_counts_tokens_across_stages_and_plots_other_learners(tmp_path, capsys):
    """eagle-curve: a later stage's tokens count on from the earlier's; --series adds another
    learner's points; the PNG is written and the points printed."""
    import json as _json

    from specdec.eagle.curve import curve_points, draft_points, main, parse_series

    runs = []
    for stage, (seen, acc) in enumerate([((100, 200), (0.1, 0.2)), ((50, 150), (0.3, 0.4))]):
        run = tmp_path / f"stage{stage}"
        run.mkdir()
        lines = [{"step": i + 1, "tokens_seen": t, "eval": {"acc1": a, "acc2": a / 2}} for i, (t, a) in enumerate(zip(seen, acc))]
        (run / "train_log.jsonl").write_text("\n".join(_json.dumps(x) for x in lines) + "\n")
        runs.append(run)
    points = curve_points(runs)
    assert [p["tokens"] for p in points] == [100, 200, 250, 350] and [p["stage"] for p in points] == [1, 1, 2, 2]
    assert parse_series("draft (own held-out)=1000:0.3,2000:0.4") == ("draft (own held-out)", [(1000.0, 0.3), (2000.0, 0.4)])
    with pytest.raises(ValueError):
        parse_series("no pairs")
    out = tmp_path / "curve.png"
    main(["--run", str(runs[0]), "--run", str(runs[1]), "--out", str(out), "--series", "draft=100:0.2,300:0.3",
          "--reference", "floor=0.5"])
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert _json.loads(capsys.readouterr().out)[-1]["acc1"] == 0.4
    # An independent draft's own run (train-draft train's log: tokens_seen, eval.greedy_agree).
    draft_run = tmp_path / "draft"
    draft_run.mkdir()
    log = [{"step": 1, "tokens_seen": 90}, {"step": 2, "tokens_seen": 180, "eval": {"top1_agree": 0.2, "greedy_agree": 0.25}}]
    (draft_run / "train_log.jsonl").write_text("\n".join(_json.dumps(x) for x in log) + "\n")
    assert draft_points(draft_run) == [(180.0, 0.25)]
    main(["--run", str(runs[0]), "--out", str(out), "--draft-run", f"independent draft={draft_run}"])
    with pytest.raises(ValueError, match="no evaluation"):
        draft_points(runs[0])


def test_eagle_ids_reranks_a_heads_ids_by_the_data_and_keeps_what_it_drafts_from(target, tiny_pair, tmp_path):
    """eagle-ids: the copy's ids are the data's most frequent greedy tokens (EOS first), the head's
    scores for an id do not change (its LM head rows are the target's), and a head that trained its
    own LM head is refused."""
    from specdec.eagle.ids import coverage, main as eagle_ids
    from specdec.eagle.train import id_counts

    records = feature_records(target, count=8, seed=9)
    write_feature_shards(target, [{"key": r["key"], "source": "s", "prompt_ids": r["input_ids"][:4].tolist(),
                                   "output_ids": r["input_ids"][4:].tolist()} for r in records], tmp_path / "feat", 4, 256)
    few = list(range(target.vocab_size - 40, target.vocab_size))  # ids the data hardly uses
    head = perturbed_head(target, ids=few, seed=2)
    head.save(tmp_path / "head")
    eagle_ids(["--head", str(tmp_path / "head"), "--features", str(tmp_path / "feat"), "--out", str(tmp_path / "out"),
               "--target", str(tiny_pair[1]), "--head-tokens", "32"])
    counts = id_counts(read_feature_shards([tmp_path / "feat"]), target.vocab_size)
    new = json.loads((tmp_path / "out" / "head_token_ids.json").read_text())
    eos = list(target.eos_token_ids)
    assert new[: len(eos)] == eos and 32 <= len(new) <= 32 + len(eos)
    ranked = [int(counts[i]) for i in new[len(eos):]]
    assert ranked == sorted(ranked, reverse=True)
    assert coverage(new, counts, (32,))[32] >= coverage(few, counts, (32,))[32]
    before, after = (EagleHead.load(tmp_path / name, target).eval() for name in ("head", "out"))
    g = torch.randn(3, head.config.hidden_size)
    shared = sorted(set(new) & set(few))
    assert shared  # random data reaches some of the rare ids too
    torch.testing.assert_close(after.full_logits(g)[:, shared], before.full_logits(g)[:, shared])
    trained = perturbed_head(target, ids=few, seed=3, train_lm_head=True)
    trained.save(tmp_path / "trained")
    with pytest.raises(SystemExit, match="trained for its own ids"):
        eagle_ids(["--head", str(tmp_path / "trained"), "--features", str(tmp_path / "feat"), "--out", str(tmp_path / "x"),
                   "--target", str(tiny_pair[1])])
