"""Output folders that cannot mislead: a manifest in each, records keyed by the config that produced
them, and `--resume` refused (or `--rerun-changed` redoing only what changed) when the settings differ.

Before manifests, a folder rerun with `--resume` and another setting kept the old samples and reported
them as the new setting's: each `..._is_refused_...` test below returned the old rows without a word."""

import json

import pytest
import yaml

from refusion.core.config import ConfigError
from refusion.experiments.ablate import run_ablation
from refusion.experiments.batching import run_batching
from refusion.experiments.bench import run_bench
from refusion.experiments.records import load_records
from refusion.models.loading import save_pretrained
from refusion.tasks import get_task

MANIFEST = "manifest.json"


@pytest.fixture
def model(tmp_path, backbone, monkeypatch):
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 4)
    return str(save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "m"))


@pytest.fixture
def bench_config(tmp_path, model):
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump({"models": {"ar": model, "refusion": model},
                                    "decoders": {"refusion": {"slot_size": 2, "selector": {"slot_threshold": 0.5}}}}))
    return path


def edit(path, change):
    cfg = yaml.safe_load(path.read_text())
    change(cfg)
    path.write_text(yaml.safe_dump(cfg))


def count_decodes(monkeypatch):
    from refusion.core import interfaces

    calls = []
    orig = interfaces.Decoder.generate
    monkeypatch.setattr(interfaces.Decoder, "generate", lambda self, p: calls.append(self.name) or orig(self, p))
    return calls


def test_the_manifest_says_what_produced_the_folder(tmp_path, bench_config):
    from refusion.experiments.manifest import key_of

    out = tmp_path / "out"
    run_bench(tasks=["facts"], decoders=["ar", "refusion"], limit=2, out=out, config=str(bench_config),
              overrides=["gen_length=4"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["command"] == "bench" and manifest["argv"] and manifest["written"].endswith("Z")
    assert {"python", "refusion", "torch", "transformers"} <= set(manifest["packages"])
    assert manifest["machine"] and manifest["torch_threads"] >= 1
    assert manifest["inputs"]["bench_config"] == str(bench_config) and manifest["inputs"]["set"] == ["gen_length=4"]
    entry = manifest["runs"]["refusion"]["facts"]
    assert entry["config"]["selector"] == {"name": "threshold", "slot_threshold": 0.5, "fallback": "best"}  # defaults filled
    assert entry["config"]["gen_length"] == 4 and entry["config"]["slot_size"] == 2
    assert len(entry["weights_sha256"]) == 64 and entry["split"] == "test" and entry["batch_size"] == 1
    assert entry["runtime"]["device"] == "cpu" and entry["config_key"] == key_of(entry)
    for rec in load_records(out / "samples.jsonl"):
        assert rec["config_key"] == manifest["runs"][rec["run"]][rec["task"]]["config_key"]
    assert manifest["runs"]["ar"]["facts"]["config_key"] != entry["config_key"]


def test_the_config_key_is_that_of_the_validated_config():
    """Two spellings of one config (a part's name as a string or a mapping, a default given or not) have
    one validated form."""
    from refusion.experiments.manifest import validated_config

    a = validated_config({"decoder": "refusion", "selector": "threshold"})
    b = validated_config({"decoder": "refusion", "selector": {"name": "threshold", "slot_threshold": 0.9},
                          "gen_length": 128})
    assert a == b and a != validated_config({"decoder": "refusion", "selector": {"slot_threshold": 0.8}})


def test_resume_with_an_edited_bench_config_is_refused_naming_the_field(tmp_path, bench_config, monkeypatch):
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=2, out=tmp_path / "out", config=str(bench_config))
    run_bench(**args)
    edit(bench_config, lambda c: c["decoders"]["refusion"].update(slot_size=4))
    with pytest.raises(ConfigError) as err:
        run_bench(**args, resume=True)
    msg = str(err.value)
    assert "run 'refusion' on facts: config.slot_size: 2 -> 4" in msg
    assert "'ar'" not in msg.split("\nEither")[0]  # ar's settings did not change
    assert "another --out" in msg and "--rerun-changed" in msg


def test_rerun_changed_keeps_the_unchanged_runs_and_redoes_the_changed(tmp_path, bench_config, monkeypatch):
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=2, out=tmp_path / "out", config=str(bench_config))
    run_bench(**args)
    before = {(r["run"], r["idx"]): r for r in load_records(tmp_path / "out" / "samples.jsonl")}
    edit(bench_config, lambda c: c["decoders"]["refusion"].update(slot_size=4))
    calls = count_decodes(monkeypatch)
    rows = run_bench(**args, rerun_changed=True)
    assert calls == ["ar", "refusion", "refusion", "refusion"]  # two warm-ups, then refusion's two samples anew
    assert [r["n"] for r in rows] == [2, 2]
    after = {(r["run"], r["idx"]): r for r in load_records(tmp_path / "out" / "samples.jsonl")}
    assert sorted(after) == sorted(before)
    assert all(after["ar", i] == before["ar", i] for i in range(2))
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["runs"]["refusion"]["facts"]["config"]["slot_size"] == 4
    assert {after["refusion", i]["config_key"] for i in range(2)} == {manifest["runs"]["refusion"]["facts"]["config_key"]}
    assert len(run_bench(**args, resume=True)) == 2  # now the same settings: resumes, nothing left to decode


def test_resume_with_another_set_or_model_is_refused(tmp_path, bench_config, backbone):
    from helpers import make_tiny_qwen3

    args = dict(tasks=["facts"], decoders=["refusion"], limit=1, out=tmp_path / "out", config=str(bench_config))
    run_bench(**args)
    with pytest.raises(ConfigError, match=r"config.selector.slot_threshold: 0.5 -> 0.9"):
        run_bench(**args, overrides=["selector.slot_threshold=0.9"], resume=True)
    other = save_pretrained(make_tiny_qwen3(len(backbone.tokenizer), seed=1), backbone.tokenizer, tmp_path / "other")
    with pytest.raises(ConfigError, match=r"run 'refusion' on facts: model weights: .*m \(sha256 .*other \(sha256"):
        run_bench(**args, models=[f"refusion={other}"], resume=True)
    with pytest.raises(ConfigError, match=r"split: 'test' -> 'validation'"):
        run_bench(**{**args, "split": "validation"}, resume=True)
    assert len(run_bench(**args, resume=True)) == 1  # unchanged: resumes


def test_a_folder_without_a_manifest_is_not_resumed_blindly(tmp_path, bench_config, monkeypatch):
    args = dict(tasks=["facts"], decoders=["ar"], limit=2, out=tmp_path / "out", config=str(bench_config))
    run_bench(**args)
    (tmp_path / "out" / MANIFEST).unlink()  # a folder from before manifests
    with pytest.raises(ConfigError, match="manifest.json is missing"):
        run_bench(**args, resume=True)
    calls = count_decodes(monkeypatch)
    run_bench(**args, rerun_changed=True)
    assert calls == ["ar"] * 3  # the warm-up and both samples anew
    assert (tmp_path / "out" / MANIFEST).is_file()


def test_the_command_line_refuses_and_names_both_ways_out(tmp_path, bench_config, capsys):
    from refusion.cli import main

    base = ["bench", "--config", str(bench_config), "--tasks", "facts", "--decoders", "refusion", "--limit", "1",
            "--out", str(tmp_path / "out"), "--resume"]
    assert main(base) == 0
    assert main(base + ["--set", "selector.slot_threshold=0.7"]) == 2
    err = capsys.readouterr().err
    assert "config.selector.slot_threshold: 0.5 -> 0.7" in err and "--rerun-changed" in err
    assert main(base + ["--set", "selector.slot_threshold=0.7", "--rerun-changed"]) == 0
    assert "--rerun-changed: decoding anew" in capsys.readouterr().err


def test_jobs_check_the_manifest_before_any_worker_starts(tmp_path, bench_config, monkeypatch):
    from refusion.experiments import sharding

    args = dict(tasks=["facts"], decoders=["refusion"], limit=1, out=tmp_path / "out", config=str(bench_config))
    run_bench(**args)
    monkeypatch.setattr(sharding, "run_shards", lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(ConfigError, match="config.slot_size: 2 -> 4"):
        run_bench(**args, overrides=["slot_size=4"], resume=True, jobs=2)


def test_ablate_resume_with_a_changed_run_is_refused_and_rerun_changed_redoes_it(tmp_path, model, monkeypatch):
    bench = tmp_path / "bench.yaml"
    bench.write_text(yaml.safe_dump({"models": {"refusion": model, "ar": model}, "decoders": {"refusion": {"slot_size": 2}}}))
    abl = tmp_path / "abl.yaml"
    abl.write_text(yaml.safe_dump({"name": "t", "tasks": ["facts"], "limit": 2, "baseline": "ar", "bench_config": str(bench),
                                   "runs": [{"label": "ar", "decoder": "ar"},
                                            {"label": "r", "decoder": "refusion", "set": {"cache": "kv_concat"}}]}))
    out = tmp_path / "out"
    run_ablation(abl, out)
    edit(abl, lambda c: c["runs"][1]["set"].update(cache="kv_recompute"))
    with pytest.raises(ConfigError, match=r"run 'r' on facts: config.cache.name: 'kv_concat' -> 'kv_recompute'"):
        run_ablation(abl, out, resume=True)
    calls = count_decodes(monkeypatch)
    rows = run_ablation(abl, out, rerun_changed=True)
    assert calls == ["ar", "refusion", "refusion", "refusion"]
    assert [r["n"] for r in rows] == [2, 2]
    assert json.loads((out / MANIFEST).read_text())["command"] == "ablate"


def test_batch_bench_resume_with_another_set_is_refused(tmp_path, bench_config, monkeypatch):
    args = dict(tasks=["facts"], decoders=["refusion"], sizes=[2], limit=2, out=tmp_path / "out",
                config=str(bench_config))
    run_batching(**args)
    with pytest.raises(ConfigError, match=r"run 'refusion@1' on facts: config.selector.slot_threshold: 0.5 -> 0.6"):
        run_batching(**args, overrides=["selector.slot_threshold=0.6"], resume=True)
    rows, _ = run_batching(**args, overrides=["selector.slot_threshold=0.6"], rerun_changed=True)
    assert [(r["batch_size"], r["n"]) for r in rows] == [(1, 2), (2, 2)]
    keys = json.loads((tmp_path / "out" / MANIFEST).read_text())["runs"]
    assert all(r["config_key"] == keys[r["run"]]["facts"]["config_key"]
               for r in load_records(tmp_path / "out" / "samples.jsonl"))


def test_differences_name_run_task_field_old_and_new():
    from refusion.experiments.manifest import differences, key_of

    entry = {"model": "a", "weights_sha256": "1" * 64, "split": "test", "batch_size": 1, "runtime": {"device": "cpu"},
             "config": {"decoder": "refusion", "slot_size": 8, "selector": {"name": "threshold", "slot_threshold": 0.9}}}
    new = json.loads(json.dumps(entry))
    new["config"]["selector"]["slot_threshold"] = 0.8
    new["batch_size"] = 4
    entry["config_key"], new["config_key"] = key_of(entry), key_of(new)
    diffs = differences({"runs": {"x": {"arith": entry}}}, {"runs": {"x": {"arith": new}, "y": {"arith": new}}})
    assert [str(d) for d in diffs] == ["run 'x' on arith: config.selector.slot_threshold: 0.9 -> 0.8",
                                       "run 'x' on arith: batch_size: 1 -> 4"]


def test_the_manifest_keys_the_seeds_and_a_resume_with_another_count_is_refused(tmp_path, bench_config, monkeypatch):
    """`--seeds 3` records the seeds in each entry (and so in its config_key); resuming with another count
    is refused naming them (before, the folder's seeded records were joined with the new run's under
    --jobs, and the manifest did not say which seeds its records had); a run decoded once keeps the
    config_key it had before seeds existed, so older folders still resume."""
    import hashlib

    from refusion.experiments.manifest import key_of

    out = tmp_path / "out"
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=2, out=out, config=str(bench_config))
    run_bench(**args, seeds=3)
    entry = json.loads((out / MANIFEST).read_text())["runs"]["refusion"]["facts"]
    assert entry["seeds"] == [0, 1, 2] and entry["config_key"] == key_of(entry)
    assert {rec["config_key"] for rec in load_records(out / "samples.jsonl") if rec["run"] == "refusion"} == {
        entry["config_key"]}
    for jobs in (1, 2):
        with pytest.raises(ConfigError, match=r"run 'refusion' on facts: seeds: \[0, 1, 2\] -> '\(absent\)'"):
            run_bench(**args, resume=True, jobs=jobs)
    calls = count_decodes(monkeypatch)
    rows = run_bench(**args, rerun_changed=True)
    assert len(calls) == 2 + 4 and [(r["n"], r.get("seeds")) for r in rows] == [(2, None), (2, None)]  # warm-ups + 4
    once = json.loads((out / MANIFEST).read_text())["runs"]["refusion"]["facts"]
    assert "seeds" not in once
    old_key = {k: once[k] for k in ("config", "weights_sha256", "split", "batch_size", "runtime")}
    assert once["config_key"] == hashlib.sha256(json.dumps(old_key, sort_keys=True, default=str).encode()).hexdigest()[:16]
