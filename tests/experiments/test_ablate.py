"""`refusion ablate`: grid expansion, per-run configs on top of the bench's, resumable output, plots."""

import json
from pathlib import Path

import pytest
import yaml

from refusion.core.config import ConfigError, validate_config
from refusion.experiments.ablate import build_runs, load_ablation, run_ablation
from refusion.experiments.config_files import CONFIGS_DIR, KINDS, find_config, shipped_configs
from refusion.models.loading import save_pretrained
from refusion.tasks import get_task


@pytest.fixture
def setup(tmp_path, backbone, monkeypatch):
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    model = str(save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "m"))
    bench = tmp_path / "bench.yaml"
    bench.write_text(yaml.safe_dump({"models": {"refusion": model, "ar": model},
                                     "decoders": {"refusion": {"slot_size": 2}}}))
    abl = {"name": "t", "tasks": ["facts"], "limit": 2, "baseline": "ar", "bench_config": str(bench),
           "runs": [{"label": "ar", "decoder": "ar"}],
           "grid": {"decoder": "refusion", "set": {"cache": "kv_recompute"},
                    "axes": {"selector.slot_threshold": [0.0, 1.0], "verifier.token_threshold": [0.5]}},
           "plots": [{"x": "selector.slot_threshold"}, {"x": "tpf"}]}
    path = tmp_path / "abl.yaml"
    path.write_text(yaml.safe_dump(abl))
    return path


def test_grid_expands_on_top_of_bench_settings(setup):
    runs = build_runs(load_ablation(setup))
    assert [r.label for r in runs] == ["ar", "slot_threshold=0 token_threshold=0.5", "slot_threshold=1 token_threshold=0.5"]
    cfg = runs[2].configs["facts"]
    assert cfg["slot_size"] == 2 and cfg["cache"] == "kv_recompute"  # bench setting kept, grid `set` applied
    assert cfg["selector"] == {"slot_threshold": 1.0}  # the decoder's default part keeps its name
    assert runs[1].params == {"selector.slot_threshold": 0.0, "verifier.token_threshold": 0.5}


def test_run_writes_results_summary_plots_and_resumes(setup, tmp_path):
    out = tmp_path / "out"
    rows = run_ablation(setup, out)
    assert len(rows) == 3 and all(r["n"] == 2 for r in rows)
    assert {r["run"]: r["speedup"] for r in rows}["ar"] == pytest.approx(1.0)
    assert json.loads((out / "results.json").read_text()) == rows
    assert "| facts |" in (out / "summary.md").read_text()
    assert (out / "t_0.png").exists() and (out / "t_1.svg").exists()
    with pytest.raises(ConfigError, match="--resume"):
        run_ablation(setup, out)
    assert len(run_ablation(setup, out, resume=True)) == 3  # nothing left to do


def test_bad_ablation_config_names_the_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nruns: [{label: a, decoder: refusion, sett: {}}]\n")
    with pytest.raises(ConfigError, match=r"runs.0.sett"):
        load_ablation(p)
    with pytest.raises(ConfigError, match="not found"):
        load_ablation(tmp_path / "nope.yaml")


ABLATION_KINDS = ("ablations", "tuning", "research")


@pytest.mark.parametrize("name", sorted(n for k in ABLATION_KINDS for n in shipped_configs(k)))
def test_every_shipped_ablation_is_a_valid_config_on_each_of_its_tasks(name):
    """A grid value the decoder rejects on one task (e.g. a serial block count that does not divide
    that task's slots) must fail here, not an hour into ``refusion results``."""
    cfg = load_ablation(name)
    for run in build_runs(cfg):
        for task in cfg.tasks:
            validate_config(run.configs[task])


BENCH_ROWS = ("batch_aware",)  # configs/bench/ files of batch-aware rows (batch-bench --batch-aware), not bench configs


@pytest.mark.parametrize("name", sorted(n for n in shipped_configs("bench") if n not in BENCH_ROWS))
def test_every_shipped_bench_config_is_valid_on_each_of_its_tasks(name):
    """The bench configs (``refusion bench --config NAME``, an ablation's ``bench_config: NAME``) decode every
    configured row on every task."""
    from refusion.experiments.bench import bench_runs, load_bench_config

    cfg = load_bench_config(name)
    for run in bench_runs(cfg, list(cfg.models), list(cfg.tasks) or ["arith", "code", "facts"]):
        for task, config in run.configs.items():
            validate_config(config)


def test_every_shipped_config_is_found_by_its_name_its_file_name_and_an_old_path():
    """One tree, names unique across its kinds; ``kv_cache``, ``kv_cache.yaml`` and ``docs/tune_bench.yaml``
    (where a grid lived before) all name the shipped file; a stray name lists the shipped ones."""
    from refusion.experiments.bench import load_bench_config

    stems = [f.stem for k in KINDS for f in (CONFIGS_DIR / k).glob("*.yaml")]
    assert len(stems) == len(set(stems)) == len(shipped_configs()) > 30
    for name, path in shipped_configs().items():
        assert find_config(name) == find_config(name + ".yaml") == find_config(f"docs/{name}.yaml") == path
        if name in BENCH_ROWS:
            from refusion.experiments.batching import load_variants

            assert load_variants(name)
        else:
            (load_bench_config if path.parent.name == "bench" else load_ablation)(name)
    with pytest.raises(ConfigError, match="is a bench config"):
        load_ablation("bench")
    with pytest.raises(ConfigError, match="shipped bench: .*llada_b8_picks"):
        load_bench_config("no_such_bench")
    docs = Path(__file__).resolve().parents[2] / "docs"
    stray = [str(p.relative_to(docs)) for p in docs.rglob("*") if p.is_file() and p.suffix not in (".md", ".png", ".svg")]
    assert stray == []  # docs/ holds only pages and figures


def test_plots_are_byte_identical_when_redrawn(tmp_path):
    """Regenerating docs from the same results must not churn the committed figures (no ids, no dates)."""
    from refusion.experiments.ablate import PlotSpec, plot

    rows = [{"task": "facts", "run": r, "decoder": d, "accuracy": a, "tpf": t}
            for r, d, a, t in (("ar", "ar", 0.9, 1.0), ("x", "refusion", 0.5, 2.0), ("y", "refusion", 0.4, 3.0))]
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    for out in (first, second):
        plot(rows, PlotSpec(x="tpf", connect=True), out, "f")
    for name in ("f.png", "f.svg"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_batch_size_from_the_file_or_the_flag(setup, tmp_path):
    spec = yaml.safe_load(setup.read_text())
    assert {r.batch_size for r in build_runs(load_ablation(setup))} == {1}
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump({**spec, "batch_size": 2}))
    assert {r.batch_size for r in build_runs(load_ablation(path))} == {2}
    assert {r.batch_size for r in build_runs(load_ablation(path), batch_size=3)} == {3}  # --batch-size wins
    rows = run_ablation(path, tmp_path / "out")
    assert all(r["batch_size"] == 2 and r["n"] == 2 for r in rows)
    assert "batch size 2" in (tmp_path / "out" / "summary.md").read_text()
    path.write_text(yaml.safe_dump({**spec, "batch_size": 0}))
    with pytest.raises(ConfigError, match="batch_size: Input should be greater than or equal to 1"):
        load_ablation(path)
    with pytest.raises(ConfigError, match="--batch-size: must be an integer of at least 1, got -1"):
        build_runs(load_ablation(setup), batch_size=-1)


def test_seeds_from_the_file_or_the_flag_pool_and_pair_by_seed(setup, tmp_path, capsys):
    """`seeds: 2` (or `--seeds 2`): every sample decoded with seeds 0 and 1 (records carry the seed), each
    row pools them and is paired with the baseline by (sample, seed), the manifest keys the seeds, and a
    resume with another seed count is refused naming them."""
    from refusion.cli import main
    from refusion.experiments.records import load_records

    spec = {**yaml.safe_load(setup.read_text()), "grid": None, "plots": [],
            "runs": [{"label": "ar", "decoder": "ar"},
                     {"label": "sampled", "decoder": "refusion", "set": {"drafter.temperature": 1.0}}]}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**spec, "seeds": 2}))
    assert {r.seeds for r in build_runs(load_ablation(path))} == {2}
    assert {r.seeds for r in build_runs(load_ablation(path), seeds=3)} == {3}  # --seeds wins
    out = tmp_path / "out"
    rows = run_ablation(path, out)
    records = load_records(out / "samples.jsonl")
    assert sorted((r["run"], r["idx"], r["seed"]) for r in records) == sorted(
        (run, i, s) for run in ("ar", "sampled") for i in range(2) for s in range(2))
    assert [(r["run"], r["n"], r["seeds"]) for r in rows] == [("ar", 4, 2), ("sampled", 4, 2)]
    assert rows[1]["accuracy_diff"]["n"] == 4
    assert "2 seeds pooled" in (out / "summary.md").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"]["sampled"]["facts"]["seeds"] == [0, 1] and manifest["inputs"]["seeds"] == 2
    assert run_ablation(path, out, resume=True) == rows  # nothing left to do
    with pytest.raises(ConfigError, match=r"run 'sampled' on facts: seeds: \[0, 1\] -> \[0, 1, 2\]"):
        run_ablation(path, out, resume=True, seeds=3)
    with pytest.raises(ConfigError, match="--seeds: must be an integer of at least 1, got 0"):
        run_ablation(path, tmp_path / "zero", seeds=0)
    path.write_text(yaml.safe_dump({**spec, "seeds": 0}))
    with pytest.raises(ConfigError, match="seeds: Input should be greater than or equal to 1"):
        load_ablation(path)
    path.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    assert main(["ablate", str(path), "--out", str(tmp_path / "cli"), "--seeds", "2"]) == 0
    assert "2 seeds pooled" in capsys.readouterr().out
    assert {r["seed"] for r in load_records(tmp_path / "cli" / "samples.jsonl")} == {0, 1}
