"""`refusion bench` mechanics on a random tiny model: table rows, schema, resume without redoing work."""

import json

import pytest
import yaml

from refusion.experiments.bench import run_bench
from refusion.experiments.runner import Run, summarize
from refusion.models.loading import save_pretrained
from refusion.tasks import get_task


@pytest.fixture
def bench_config(tmp_path, backbone):
    model = save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "m")
    cfg = {"models": {"ar": str(model), "refusion": str(model)},
           "decoders": {"refusion": {"slot_size": 4, "selector": {"slot_threshold": 0.5}}},
           "tasks": {"facts": {"refusion": {"slot_size": 2}}}}
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_bench_rows_and_resume(tmp_path, bench_config, monkeypatch):
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=3, out=tmp_path / "out", config=str(bench_config))
    rows = run_bench(**args)
    assert [(r["task"], r["decoder"], r["n"]) for r in rows] == [("facts", "ar", 3), ("facts", "refusion", 3)]
    for key in ("task", "decoder", "model", "n", "accuracy", "tokens_per_second", "tpf", "nfe_mean", "latency_s_mean"):
        assert key in rows[0]
    assert rows[0]["speedup_vs_ar"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == rows
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0
    lines = (tmp_path / "out" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 6
    # kill simulation: drop the last record and tear the one before; resume redoes exactly those
    (tmp_path / "out" / "samples.jsonl").write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])
    calls = []
    from refusion.core import interfaces

    orig = interfaces.Decoder.generate
    monkeypatch.setattr(interfaces.Decoder, "generate", lambda self, p: calls.append(1) or orig(self, p))
    with pytest.warns(UserWarning, match="torn"):
        rows2 = run_bench(**args, resume=True)
    assert len(calls) == 2 + 2  # two warm-ups + the two lost samples
    assert [r["n"] for r in rows2] == [3, 3]


def test_existing_run_needs_resume(tmp_path, bench_config, monkeypatch):
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 4)
    args = dict(tasks=["facts"], decoders=["ar"], limit=1, out=tmp_path / "o", config=str(bench_config))
    run_bench(**args)
    with pytest.raises(ValueError, match="--resume"):
        run_bench(**args)


def test_summarize_speedup():
    recs = [{"run": d, "task": "t", "correct": c, "generated_tokens": 10, "nfe": n, "wall_s": w}
            for d, c, n, w in [("ar", True, 10, 1.0), ("ar", False, 10, 1.0), ("refusion", True, 4, 0.5), ("refusion", True, 4, 0.5)]]
    runs = [Run("ar", "m", {"t": {"decoder": "ar"}}), Run("refusion", "m", {"t": {"decoder": "refusion"}})]
    rows = {r["run"]: r for r in summarize(recs, runs, baseline="ar")}
    assert rows["ar"]["accuracy"] == 0.5 and rows["refusion"]["accuracy"] == 1.0
    assert rows["refusion"]["speedup"] == pytest.approx(2.0)
    assert rows["refusion"]["tpf"] == pytest.approx(2.5)


def test_model_override_replaces_one_decoders_model(tmp_path, bench_config):
    from refusion.core.config import ConfigError
    from refusion.experiments.bench import load_bench_config, with_models

    cfg = load_bench_config(bench_config)
    other = with_models(cfg, ["ar=runs/recipe/tiny-base"])
    assert other.models == {**cfg.models, "ar": "runs/recipe/tiny-base"} and cfg.models["ar"] != "runs/recipe/tiny-base"
    with pytest.raises(ConfigError, match="--model expects DECODER=FOLDER"):
        with_models(cfg, ["runs/recipe/tiny-base"])
    with pytest.raises(ConfigError, match="no decoder 'block' in the bench config; configured: ar, refusion"):
        with_models(cfg, ["block=tiny-block"])


def test_label_offset_moves_a_label_off_a_neighbours():
    from refusion.experiments.bench import LABEL_OFFSETS, label_offset

    assert label_offset(100, 100, []) == LABEL_OFFSETS[0]
    first = (100 + LABEL_OFFSETS[0][0], 100 + LABEL_OFFSETS[0][1])
    dx, dy = label_offset(102, 96, [first])  # a point 4 points below the first: its label must go elsewhere
    assert abs(102 + dx - first[0]) > 45 or abs(96 + dy - first[1]) > 11
    assert label_offset(300, 100, [first]) == LABEL_OFFSETS[0]  # far away: the default place
    dx, dy = label_offset(100, 100, [], [(130, 98)])  # another point's marker where the label would go
    assert (dx, dy) != LABEL_OFFSETS[0] and not (100 + dx - 4 <= 130 <= 100 + dx + 49 and 100 + dy - 4 <= 98 <= 100 + dy + 14)


def test_threads_option_sets_torch_threads_and_rejects_zero(tmp_path, bench_config, capsys):
    """`--threads 1` for a bench beside a training job (2 threads on a shared core spin-wait); 0 is an error."""
    import torch

    from refusion.cli import main

    before = torch.get_num_threads()
    try:
        assert main(["bench", "--threads", "0", "--config", str(bench_config), "--out", str(tmp_path / "o")]) == 2
        assert "--threads: must be at least 1, got 0" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()  # nothing ran
        assert main(["ablate", "nothing.yaml", "--threads", "-1"]) == 2
        assert "--threads" in capsys.readouterr().err
        from refusion.experiments.runner import set_threads

        set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_goal_lines_compare_each_decoder_with_ar_of_its_task():
    from refusion.experiments.bench import goal_lines

    def row(task, run, acc, speedup):
        return {"task": task, "run": run, "accuracy": acc, "speedup_vs_ar": speedup, "n": 200}

    rows = [row("facts", "ar", 0.98, 1.0), row("arith", "ar", 0.995, 1.0),
            row("facts", "refusion", 0.99, 1.8), row("arith", "refusion", 0.975, 2.0),
            row("arith", "block", 0.97, 4.0), row("code", "refusion", 1.0, None)]
    assert goal_lines(rows) == [
        "arith: refusion 2.00x ar's tokens/s, -2.0 points (97.5% vs 99.5%, n 200): goal met",
        "arith: block 4.00x ar's tokens/s, -2.5 points (97.0% vs 99.5%, n 200): goal not met",
        "facts: refusion 1.80x ar's tokens/s, +1.0 points (99.0% vs 98.0%, n 200): goal not met",
    ]
