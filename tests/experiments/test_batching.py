"""`refusion batch-bench`: the same samples at each batch size, rows against batch size 1 and ar, the
token-id comparison, the plot, and resume after a kill."""

import json

import pytest
import yaml

from refusion.core.config import ConfigError
from refusion.experiments.batching import (
    advantage_ended, batching_rows, crossover_rows, markdown_table, parse_sizes, run_batching,
)
from refusion.experiments.runner import Run
from refusion.models.loading import save_pretrained
from refusion.tasks import get_task


@pytest.fixture
def bench_config(tmp_path, backbone, monkeypatch):
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    model = save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "m")
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump({"models": {"ar": str(model), "refusion": str(model)},
                                    "decoders": {"refusion": {"slot_size": 2}}}))
    return path


def test_parse_sizes_adds_batch_size_one_and_names_the_flag():
    assert parse_sizes("16,4") == [1, 4, 16] and parse_sizes("1, 2,2") == [1, 2]
    for bad in ("0,4", "4,x", ",", "-2"):
        with pytest.raises(ConfigError, match="--batch-sizes"):
            parse_sizes(bad)


def test_rows_at_each_batch_size_against_batch_one_and_ar(tmp_path, bench_config, monkeypatch):
    from refusion.core import interfaces

    chunks = []
    orig = interfaces.Decoder.generate_batch
    monkeypatch.setattr(interfaces.Decoder, "generate_batch",
                        lambda self, ps: chunks.append((self.name, len(ps))) or orig(self, ps))
    out = tmp_path / "out"
    rows, crossovers = run_batching(["facts"], ["ar", "refusion"], [2], 3, out, config=str(bench_config),
                                    stop_when_crossed=False)
    assert [(c["decoder"], c["task"], c["batch_sizes"], c["n"]) for c in crossovers] == [("refusion", "facts", [1, 2], 3)]
    assert json.loads((out / "crossover.json").read_text()) == crossovers
    assert [(r["decoder"], r["batch_size"], r["n"]) for r in rows] == [
        ("ar", 1, 3), ("ar", 2, 3), ("refusion", 1, 3), ("refusion", 2, 3)]
    # batch size 2, per decoder: a warm-up of 2, then a chunk of 2 and a chunk of the last sample
    assert sorted(chunks) == sorted([(d, n) for d in ("ar", "refusion") for n in (2, 2, 1)])
    for r in rows:
        assert r["vs_batch_1"] == pytest.approx(r["tokens_per_second"] / next(
            x["tokens_per_second"] for x in rows if x["decoder"] == r["decoder"] and x["batch_size"] == 1))
        ar = next(x for x in rows if x["decoder"] == "ar" and x["batch_size"] == r["batch_size"])
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_second"] / ar["tokens_per_second"])
        assert 0 < r["forward_share"] <= 1  # forwards timed by default on the CPU
        if r["batch_size"] == 1:
            assert r["differ_from_batch_1"] is None and r["vs_batch_1"] == pytest.approx(1.0)
        else:
            assert 0 <= r["differ_from_batch_1"] <= 3 and r["compared_with_batch_1"] == 3
    assert json.loads((out / "results.json").read_text()) == rows
    assert (out / "results.md").read_text().splitlines()[0].startswith("| decoder | task | batch | n |")
    assert "| decoder | task | crossover batch size [95%] |" in (out / "results.md").read_text()
    for r in rows:
        assert r["latency_s_p50"] <= r["latency_s_p95"] and r["fed_per_token"] >= 1 / r["tpf"]
        assert r["aup"] == pytest.approx(r["tpf"] * 100 * r["accuracy"])
    assert (out / "throughput.png").stat().st_size > 0 and (out / "throughput.svg").stat().st_size > 0
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 12 and all("forward_s" in r or "batch_forward_s" in r for r in recs)
    with pytest.raises(ConfigError, match="--resume"):
        run_batching(["facts"], ["ar"], [2], 3, out, config=str(bench_config))


def test_differing_token_ids_are_counted_per_sample():
    def rec(run, idx, ids, size):
        extra = {"batch_size": size, "batch": idx, "batch_samples": 1, "batch_wall_s": 1.0} if size > 1 else {}
        return {"run": run, "task": "t", "idx": idx, "correct": True, "generated_tokens": len(ids), "nfe": 1,
                "wall_s": 1.0, "token_ids": ids, **extra}

    runs = [Run("ar@1", "m", {"t": {"decoder": "ar"}}, {"batch_size": 1}),
            Run("ar@4", "m", {"t": {"decoder": "ar"}}, {"batch_size": 4}, batch_size=4)]
    recs = [rec("ar@1", 0, [1, 2], 1), rec("ar@1", 1, [3], 1), rec("ar@4", 0, [1, 2], 4), rec("ar@4", 1, [3, 4], 4)]
    one, four = batching_rows(recs, runs)
    assert four["differ_from_batch_1"] == 1 and one["differ_from_batch_1"] is None
    assert four["forward_share"] is None  # forwards not timed
    assert four["vs_batch_1"] == pytest.approx(4 / 3) and four["speedup_vs_ar"] == pytest.approx(1.0)
    assert "| ar | t | 4 | 2 | 100.0 | 2.0 | 1.33x | 1.00x | - | - | 1.000 | 1.000 | 2.00 | - | 200.0 | - | 1 |" in \
        markdown_table([one, four])
    assert four["fed_per_token"] is None  # records without tokens_in


def test_latency_percentiles_fed_tokens_and_the_crossover_from_records():
    def rec(run, idx, size, wall, tokens=10, fed=30):
        return {"run": run, "task": "t", "idx": idx, "correct": True, "generated_tokens": tokens, "nfe": 5,
                "tokens_in": fed, "wall_s": wall, "token_ids": [1] * tokens, "batch_size": size, "batch": 0,
                "batch_samples": 4, "batch_wall_s": 4 * wall}

    runs = [Run(f"{d}@{n}", "m", {"t": {"decoder": d}}, {"batch_size": n}, batch_size=n)
            for d in ("ar", "x") for n in (1, 2, 4)]
    # x: 4x ar's tokens/s at 1, 1x at 2, 0.25x at 4 -> crosses at 2; latencies 0.1 .. 0.4 per sample
    speed = {("ar", 1): 1.0, ("ar", 2): 2.0, ("ar", 4): 4.0, ("x", 1): 4.0, ("x", 2): 2.0, ("x", 4): 1.0}
    recs = [rec(f"{d}@{n}", i, n, (i + 1) / 10 / speed[d, n]) for (d, n) in speed for i in range(4)]
    rows = batching_rows(recs, runs)
    ar1 = next(r for r in rows if r["run"] == "ar@1")
    assert ar1["latency_s_p50"] == pytest.approx(0.25) and ar1["latency_s_p95"] == pytest.approx(0.385)
    assert ar1["fed_per_token"] == pytest.approx(3.0) and ar1["tpf"] == pytest.approx(2.0)
    (cross,) = crossover_rows(recs, runs)
    assert cross["decoder"] == "x" and cross["crossover"] == pytest.approx(2.0, rel=1e-6)
    assert cross["ratios"] == pytest.approx({"1": 4.0, "2": 1.0, "4": 0.25})
    x4 = next(r for r in rows if r["run"] == "x@4")
    assert x4["speedup_interval"] == pytest.approx([0.25, 0.25]) and x4["accuracy_diff_vs_ar"]["value"] == 0
    assert ar1["speedup_interval"] is None and ar1["accuracy_diff_vs_ar"] is None
    assert advantage_ended(rows, 4) and not advantage_ended(rows, 1)


def test_the_sweep_stops_once_every_decoder_is_behind_ar(tmp_path, bench_config, monkeypatch):
    from refusion.experiments import batching

    monkeypatch.setattr(batching, "advantage_ended", lambda rows, size: size >= 2)
    rows, _ = run_batching(["facts"], ["ar", "refusion"], [2, 4, 8], 2, tmp_path / "o", config=str(bench_config))
    assert sorted({r["batch_size"] for r in rows}) == [1, 2]
    rows, _ = run_batching(["facts"], ["ar", "refusion"], [2, 4], 2, tmp_path / "p", config=str(bench_config),
                           stop_when_crossed=False)
    assert sorted({r["batch_size"] for r in rows}) == [1, 2, 4]


def test_killed_run_resumes_each_batch_size_with_its_samples_left(tmp_path, bench_config, monkeypatch):
    from refusion.experiments import records

    orig_write = records.RecordWriter.write
    written = []

    def dying_write(self, rec):
        if len(written) == 5:
            raise KeyboardInterrupt
        written.append((rec["run"], rec["idx"]))
        orig_write(self, rec)

    monkeypatch.setattr(records.RecordWriter, "write", dying_write)
    args = dict(tasks=["facts"], decoders=["ar"], sizes=[1, 2], limit=4, out=tmp_path / "out", config=str(bench_config))
    with pytest.raises(KeyboardInterrupt):
        run_batching(**args)
    monkeypatch.setattr(records.RecordWriter, "write", orig_write)
    rows, _ = run_batching(**args, resume=True)
    recs = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    keys = [(r["run"], r["idx"]) for r in recs]
    assert keys[:5] == written and sorted(keys) == sorted((f"ar@{n}", i) for n in (1, 2) for i in range(4))
    assert [(r["batch_size"], r["n"]) for r in rows] == [(1, 4), (2, 4)]


def test_command_line(tmp_path, bench_config, capsys):
    from refusion.cli import main

    assert main(["batch-bench", "--batch-sizes", "1,0", "--config", str(bench_config), "--out", str(tmp_path / "o")]) == 2
    assert "--batch-sizes" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["batch-bench", "--batch-sizes", "2", "--tasks", "facts", "--decoders", "ar", "--limit", "2",
                 "--config", str(bench_config), "--out", str(tmp_path / "o"), "--no-time-forwards"]) == 0
    printed = capsys.readouterr().out
    assert "batch sizes 1, 2" in printed and "throughput.png" in printed
    rows = json.loads((tmp_path / "o" / "results.json").read_text())
    assert [r["batch_size"] for r in rows] == [1, 2] and all(r["forward_share"] is None for r in rows)


def test_batch_aware_rows_run_beside_their_bench_row(tmp_path, bench_config):
    variants = tmp_path / "aware.yaml"
    variants.write_text(yaml.safe_dump({
        "refusion-sched": {"row": "refusion", "tasks": {"facts": {"batch_schedule": {2: {"slot_size": 3}}}}},
        "refusion-budget": {"row": "refusion", "set": {"draft_budget": 4}},
        "block-sched": {"row": "block", "set": {"batch_schedule": {2: {}}}},  # its row does not run: skipped
    }))
    out = tmp_path / "out"
    rows, crossovers = run_batching(["facts"], ["ar", "refusion"], [2], 2, out, config=str(bench_config),
                                    batch_aware=str(variants), stop_when_crossed=False)
    assert sorted({r["decoder"] for r in rows}) == ["ar", "refusion", "refusion-budget", "refusion-sched"]
    assert {c["decoder"] for c in crossovers} == {"refusion", "refusion-budget", "refusion-sched"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runs"]["refusion-sched@2"]["facts"]["config"]["batch_schedule"] == {"2": {"slot_size": 3}}
    assert manifest["runs"]["refusion-budget@1"]["facts"]["config"]["draft_budget"] == 4
    for bad, match in [({"x": {"row": "refusion", "sett": {}}}, "row 'x': sett"),
                       ({"x": {"row": "refusion", "tasks": {"nope": {}}}}, "tasks.nope"),
                       ({"refusion": {"row": "refusion"}}, "name of a bench row")]:
        variants.write_text(yaml.safe_dump(bad))
        with pytest.raises(ConfigError, match=match):
            run_batching(["facts"], ["ar", "refusion"], [2], 2, tmp_path / "bad", config=str(bench_config),
                         batch_aware=str(variants))
