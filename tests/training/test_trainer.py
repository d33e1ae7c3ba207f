"""Trainer: exact resume, logs, final Hugging Face folder, data loading, CLI wiring."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from refusion.models.build import build_model
from refusion.models.loading import load_pretrained
from refusion.plugins.objectives import OBJECTIVES
from refusion.training.data import encode_pair, load_pairs
from refusion.training.trainer import LOG_FILE, STATE_FILE, WEIGHTS_FILE, TrainConfig, Trainer, lr_lambda, read_log

QA = [
    ("ava has 3 pens. ben has 4 pens. total?", "3 + 4 = 7.\n#### 7"),
    ("cy has 10 eggs and gives 2 away.", "10 - 2 = 8.\n#### 8"),
    ("dan buys 2 bags of 5 cards.", "2 * 5 = 10.\n#### 10"),
    ("capital of france?", "paris."),
    ("eve has 6 coins and finds 7 more.", "6 + 7 = 13.\n#### 13"),
    ("def add", "return a + b"),
]


@pytest.fixture
def pairs(char_tokenizer):
    return [encode_pair(char_tokenizer, q, r) for q, r in QA]


def _trainer(tok, pairs, out, name="refusion", steps=6, **cfg):
    torch.manual_seed(0)
    obj = OBJECTIVES[name].from_tokenizer(tok)
    model = build_model(tok, "micro", seed=0)
    config = TrainConfig(steps=steps, batch_size=3, lr=3e-3, log_every=2, progress=False, seed=0, **cfg)
    return Trainer(model, tok, obj, pairs, config, out, val_pairs=pairs[:4])


@pytest.mark.parametrize("name,group", [("refusion", 0), ("block", 2)])
def test_resume_gives_identical_weights(char_tokenizer, pairs, tmp_path, name, group):
    straight = _trainer(char_tokenizer, pairs, tmp_path / "a", name, group_by_length=group)
    straight.train()
    first = _trainer(char_tokenizer, pairs, tmp_path / "b", name, group_by_length=group)
    first.train(stop_at=3)
    assert first.step == 3 and (tmp_path / "b" / STATE_FILE).is_file()
    assert not (tmp_path / "b" / "config.json").exists()  # not finished: no final model yet
    second = _trainer(char_tokenizer, pairs, tmp_path / "b", name, group_by_length=group)  # a fresh process
    summary = second.train(resume=True)
    assert summary["finished"] and second.step == 6
    a = load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    b = load_file(str(tmp_path / "b" / WEIGHTS_FILE))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
    # the log was continued, not restarted; train records every 2 steps
    log = read_log(tmp_path / "b")
    assert [r["step"] for r in log if r["kind"] == "train"] == [2, 3, 4, 6]
    # each start and resume names the machine it ran on; so does the summary
    starts = [r for r in log if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, 3] and all(r["threads"] >= 1 for r in starts)
    assert summary["machine"] == starts[-1]["machine"] and f"torch {torch.__version__}" in summary["machine"]


def test_outputs_log_and_final_model(char_tokenizer, pairs, tmp_path):
    t = _trainer(char_tokenizer, pairs, tmp_path, "mdm", steps=4, eval_every=2)
    summary = t.train()
    log = read_log(tmp_path)
    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4]
    assert {"loss", "masked_acc", "lr", "tokens", "tok_per_s", "elapsed"} <= set(train[0])
    assert [r["step"] for r in evals] == [2, 4] and "masked_acc" in evals[-1]
    assert summary["eval"]["masked_acc"] == evals[-1]["masked_acc"]
    assert (tmp_path / LOG_FILE).is_file() and (tmp_path / STATE_FILE).is_file()
    model, tok = load_pretrained(tmp_path)
    assert model.config.refusion_attention == "bidirectional" and model.config.refusion_objective == "mdm"
    assert model.config.mask_token_id == tok.mask_token_id == 3
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"


def test_block_model_records_block_size(char_tokenizer, pairs, tmp_path):
    obj = OBJECTIVES["block"].from_tokenizer(char_tokenizer, block_size=4)
    model = build_model(char_tokenizer, "micro")
    Trainer(model, char_tokenizer, obj, pairs, TrainConfig(steps=1, batch_size=2, progress=False), tmp_path).train()
    loaded, _ = load_pretrained(tmp_path)
    assert loaded.config.refusion_attention == "block_causal" and loaded.config.refusion_block_size == 4


def test_token_budget_batches(char_tokenizer, pairs, tmp_path):
    t = _trainer(char_tokenizer, pairs, tmp_path, "ar", max_tokens=120)
    longest = max(len(p) + len(r) for p, r in pairs)
    for _ in range(8):
        b = t.make_batch(t.next_indices())
        assert 1 <= b.n_examples <= 3
        assert b.n_examples == 1 or b.input_ids.numel() <= 120 or b.input_ids.shape[1] <= longest


def test_length_grouped_batches_cover_the_data(char_tokenizer, pairs, tmp_path):
    t = _trainer(char_tokenizer, pairs, tmp_path, "ar", group_by_length=2)
    lengths = [len(p) + len(r) for p, r in pairs]
    seen = []
    for _ in range(4):  # 2 pools of 2 batches of 3 = two epochs of 6 examples
        idx = t.sampler.next_batch(3, None, lengths.__getitem__)
        assert len(idx) == 3
        seen += idx
    assert sorted(seen) == sorted(list(range(6)) * 2)


def test_schedule_warmup_then_cosine():
    f = lr_lambda(TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55, abs=0.01) and f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


def test_json_data_loading(char_tokenizer, tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"query": q, "response": r} for q, r in QA * 4]))
    train = load_pairs(path, char_tokenizer, "train")
    val = load_pairs(path, char_tokenizer, "validation")
    assert len(train) + len(val) == 24 and len(val) == 1
    p, r = train[0]
    assert r[-1] == char_tokenizer.eos_token_id and p[-1] == char_tokenizer.convert_tokens_to_ids("\n")
    assert char_tokenizer.eos_token_id not in p
    short = load_pairs(path, char_tokenizer, "train", max_length=30)
    assert 0 < len(short) < len(train) and all(len(a) + len(b) <= 30 for a, b in short)
    path.write_text(json.dumps([{"query": 1}]))
    with pytest.raises(ValueError):
        load_pairs(path, char_tokenizer)


def test_tinybench_mix_repeats_the_named_tasks_train_examples_only():
    """'tinybench:facts=3' is tinybench with each facts train example three times; other splits unchanged."""
    from refusion.tasks import get_task
    from refusion.training.data import load_texts, tinybench_mix

    assert tinybench_mix("tinybench") == {"arith": 1, "code": 1, "facts": 1} and tinybench_mix("d.json") is None
    plain, mixed = load_texts("tinybench"), load_texts("tinybench:facts=3")
    facts = [(e.query, e.response) for e in get_task("facts").examples("train")]
    assert len(mixed) == len(plain) + 2 * len(facts)
    assert sorted(mixed) == sorted(plain + facts * 2)
    assert load_texts("tinybench:facts=3", "validation") == load_texts("tinybench", "validation")
    for bad in ("tinybench:fact=3", "tinybench:facts=0", "tinybench:facts"):
        with pytest.raises(ValueError, match="TASK=K with TASK one of arith, code, facts"):
            load_texts(bad)


def test_cli_train_from_folder(char_tokenizer, tmp_path, monkeypatch):
    from refusion.models.loading import save_pretrained
    from refusion.training.cli import add_train_command

    configs = []
    init_trainer = Trainer.__init__
    monkeypatch.setattr(Trainer, "__init__", lambda self, *a, **k: configs.append(a[4]) or init_trainer(self, *a, **k))

    init = tmp_path / "init"
    save_pretrained(build_model(char_tokenizer, "micro"), char_tokenizer, init)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"query": q, "response": r} for q, r in QA * 4]))
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["train", "--objective", "refusion", "--data", str(data), "--init", str(init),
                              "--out", str(out), "--steps", "3", "--batch-size", "4", "--set", "slot_sizes=[2,4]",
                              "--group-by-length", "2", "--no-progress"])
    assert args.func(args) == 0
    model, _ = load_pretrained(out)
    assert model.config.refusion_objective == "refusion"
    assert configs[0].group_by_length == 2
    args = parser.parse_args(["train", "--objective", "ar", "--out", str(out), "--group-by-length", "-1"])
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error, naming the flag
        args.func(args)
    with pytest.raises(SystemExit):
        args = parser.parse_args(["train", "--objective", "refusion", "--data", str(data), "--init", str(init),
                                  "--out", str(out), "--set", "slot_size=2", "--no-progress"])
        args.func(args)


def test_training_device_errors_name_the_setting(monkeypatch):
    from refusion.training.trainer import training_device

    assert training_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: 'gpu0' is not a torch device"):
        training_device("gpu0")
    with pytest.raises(ValueError, match="device: 'meta' is not supported"):
        training_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device: 'cuda' was asked for, but torch sees no CUDA device"):
        training_device("cuda")


def test_trainer_moves_model_and_batches_to_its_device(char_tokenizer, pairs, tmp_path, monkeypatch):
    """The model and every batch go to ``config.device`` (recorded here, as CI has no GPU)."""
    from refusion.core.objective import Batch

    moved = []
    to = Batch.to
    monkeypatch.setattr(Batch, "to", lambda self, device: moved.append(torch.device(device)) or to(self, device))
    trainer = _trainer(char_tokenizer, pairs, tmp_path, steps=2, device="cpu")
    assert trainer.device == torch.device("cpu") and next(trainer.model.parameters()).device == trainer.device
    trainer.train()
    assert len(moved) == 3 and set(moved) == {torch.device("cpu")}  # 2 training batches + the validation batch


def test_cli_rejects_an_absent_device(char_tokenizer, tmp_path, monkeypatch):
    from refusion.training.cli import add_train_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers(dest="command"))
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"query": q, "response": r} for q, r in QA]))
    args = parser.parse_args(["train", "--objective", "ar", "--data", str(data), "--out", str(tmp_path / "o"),
                              "--device", "cuda", "--no-progress"])
    with pytest.raises(SystemExit, match="2"):
        args.func(args)


def test_a_split_batch_is_cut_by_example_count(char_tokenizer, pairs, tmp_path):
    """A runtime that splits the global batch (processes x micro-batches) needs a multiple of its shards
    and refuses token budgets and length grouping; each process keeps its strided share."""
    from refusion.training.trainer import LocalRuntime

    class TwoMicroBatches(LocalRuntime):
        grad_accum = 2

    obj = OBJECTIVES["ar"].from_tokenizer(char_tokenizer)
    make = lambda **cfg: Trainer(build_model(char_tokenizer, "micro"), char_tokenizer, obj, pairs,  # noqa: E731
                                 TrainConfig(progress=False, **cfg), tmp_path, runtime=TwoMicroBatches())
    with pytest.raises(ValueError, match=r"multiple of processes x grad_accum \(1 x 2\)"):
        make(batch_size=3)
    with pytest.raises(ValueError, match="max_tokens / group_by_length are not supported"):
        make(batch_size=4, group_by_length=2)
    t = make(batch_size=4, steps=2, log_every=1)
    assert t.shard([5, 1, 4, 0]) == [[5, 4], [1, 0]]
    summary = t.train()
    assert summary["steps"] == 2 and [r["batch_size"] for r in read_log(tmp_path) if r["kind"] == "train"] == [4, 4]
