"""`refusion bench` mechanics on a random tiny model: table rows, schema, resume without redoing work."""

import json

import pytest
import yaml

from refusion.core.config import ConfigError
from refusion.experiments.bench import run_bench
from refusion.experiments.records import load_records
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
    rows[2].update(speedup_interval=[1.7, 1.9],
                   accuracy_diff={"value": 0.01, "low": -0.01, "high": 0.03, "p_value": 0.5})
    assert goal_lines(rows)[2] == ("facts: refusion 1.80x [1.70, 1.90] ar's tokens/s, +1.0 points [-1.0, +3.0], "
                                   "McNemar p 0.5 (99.0% vs 98.0%, n 200): goal not met")
    # a row on the first 20 samples is compared with ar on those 20, not with ar's whole-split accuracy
    rows.append({**row("arith", "slow", 0.9, 0.2), "n": 20,
                 "accuracy_diff": {"value": -0.1, "low": -0.25, "high": 0.0, "p_value": 0.06}})
    assert goal_lines(rows)[2] == ("arith: slow 0.20x ar's tokens/s, -10.0 points [-25.0, +0.0], McNemar p 0.06 "
                                   "(90.0% vs 100.0%, n 20): goal not met")


def test_rows_carry_paired_intervals_against_the_baseline():
    from refusion.experiments.runner import Run, summarize

    def rec(run, idx, correct, seconds):
        return {"run": run, "task": "arith", "idx": idx, "correct": correct, "generated_tokens": 10,
                "nfe": 10, "wall_s": seconds}

    records = [rec("ar", i, True, 1.0) for i in range(20)] + [rec("fast", i, i != 3, 0.5) for i in range(20)]
    runs = [Run(label="ar", model="m", configs={"arith": {"decoder": "ar"}}),
            Run(label="fast", model="m", configs={"arith": {"decoder": "refusion"}})]
    ar, fast = summarize(records, runs, baseline="ar")
    assert "accuracy_diff" not in ar
    d = fast["accuracy_diff"]
    assert d["value"] == pytest.approx(-0.05) and (d["only_baseline"], d["only_this"], d["n"]) == (1, 0, 20)
    assert d["low"] <= -0.05 <= d["high"] and d["p_value"] == 1.0
    assert fast["speedup_interval"] == pytest.approx([2.0, 2.0])
    from refusion.experiments.runner import markdown_table

    table = markdown_table([ar, fast])
    assert "acc vs baseline, points [95%] | speed-up [95%] |" in table.splitlines()[0]
    assert "| -5.0 [" in table and "[2.00, 2.00] |" in table


def test_batched_bench_decodes_chunks_and_reports_aggregate_throughput(tmp_path, bench_config, monkeypatch):
    """--batch-size 2: the samples of a task go through generate_batch in chunks of 2 (the last one
    shorter); tokens/s is total tokens / total chunk wall time, latency the mean per-sample latency."""
    from refusion.core import interfaces

    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    chunks = []
    orig = interfaces.Decoder.generate_batch
    monkeypatch.setattr(interfaces.Decoder, "generate_batch",
                        lambda self, ps: chunks.append((self.name, len(ps))) or orig(self, ps))
    rows = run_bench(tasks=["facts"], decoders=["ar", "refusion"], limit=5, out=tmp_path / "out",
                     config=str(bench_config), batch_size=2)
    assert chunks == [("ar", 2), ("refusion", 2)] + [("ar", 2), ("refusion", 2), ("ar", 2), ("refusion", 2),
                                                      ("ar", 1), ("refusion", 1)]  # warm-ups, then interleaved
    recs = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["run"], r["idx"]) for r in recs) == sorted((d, i) for d in ("ar", "refusion") for i in range(5))
    for r in recs:
        assert r["batch_size"] == 2 and r["batch"] == r["idx"] - r["idx"] % 2
        assert r["batch_samples"] == (1 if r["idx"] == 4 else 2) and r["batch_wall_s"] > 0
    for row in rows:
        assert row["batch_size"] == 2 and row["n"] == 5
        rs = [r for r in recs if r["run"] == row["run"]]
        walls = {r["batch"]: r["batch_wall_s"] for r in rs}  # one wall time per chunk
        tokens = sum(r["generated_tokens"] for r in rs)
        assert row["tokens_per_second"] == pytest.approx(tokens / sum(walls.values()))
        assert row["latency_s_mean"] == pytest.approx(sum(r["wall_s"] for r in rs) / 5)
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == rows


def test_batched_run_killed_midway_resumes_with_the_samples_not_written(tmp_path, bench_config, monkeypatch):
    from refusion.core import interfaces
    from refusion.experiments import records

    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    args = dict(tasks=["facts"], decoders=["ar"], limit=5, out=tmp_path / "out", config=str(bench_config), batch_size=2)
    orig_write = records.RecordWriter.write
    written = []

    def dying_write(self, rec):  # killed after 3 records: inside the second chunk (samples 2, 3)
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(rec["idx"])
        orig_write(self, rec)

    monkeypatch.setattr(records.RecordWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_bench(**args)
    assert written == [0, 1, 2]
    monkeypatch.setattr(records.RecordWriter, "write", orig_write)
    chunks = []
    orig = interfaces.Decoder.generate_batch
    monkeypatch.setattr(interfaces.Decoder, "generate_batch", lambda self, ps: chunks.append(len(ps)) or orig(self, ps))
    rows = run_bench(**args, resume=True)
    assert chunks == [2, 2]  # the warm-up, then one chunk of the samples left: 3 and 4
    recs = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["idx"] for r in recs) == [0, 1, 2, 3, 4]  # every sample written once
    assert [r["batch"] for r in recs] == [0, 0, 2, 3, 3]
    assert rows[0]["n"] == 5 and rows[0]["batch_size"] == 2
    from refusion.core.config import ConfigError

    with pytest.raises(ConfigError, match="batch_size: .* decoded at batch size 2, not 1"):
        run_bench(**{**args, "batch_size": 1}, resume=True)


def test_batch_size_one_keeps_the_records_and_tables_unchanged(tmp_path, bench_config, monkeypatch):
    from refusion.core import interfaces
    from refusion.experiments.runner import markdown_table

    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 4)
    monkeypatch.setattr(interfaces.Decoder, "generate_batch", lambda self, ps: pytest.fail("batch size 1 batches"))
    rows = run_bench(tasks=["facts"], decoders=["ar"], limit=2, out=tmp_path / "o", config=str(bench_config))
    rec = json.loads((tmp_path / "o" / "samples.jsonl").read_text().splitlines()[0])
    assert list(rec) == ["run", "task", "idx", "decoder", "model", "config_key", "correct", "generated_tokens", "nfe", "wall_s",
                         "completion", "token_ids"]
    assert "batch_size" not in rows[0]
    assert markdown_table(rows).splitlines()[0] == "| task | run | n | acc % | tok/s | TPF | NFE | latency s | speed-up |"
    assert "speedup" not in rows[0] and markdown_table(rows).splitlines()[2].endswith("| 1.00 |")  # speedup_vs_ar
    assert "| batch_size |" in markdown_table([{**rows[0], "batch_size": 4}])


def test_summarize_batched_records_count_each_chunk_wall_once():
    def rec(idx, wall, chunk_wall, samples):
        return {"run": "ar", "task": "t", "idx": idx, "correct": True, "generated_tokens": 10, "nfe": 10,
                "wall_s": wall, "batch_size": 2, "batch": idx - idx % 2, "batch_samples": samples,
                "batch_wall_s": chunk_wall}

    recs = [rec(0, 0.5, 1.0, 2), rec(1, 1.0, 1.0, 2), rec(2, 0.5, 0.5, 1)]
    [row] = summarize(recs, [Run("ar", "m", {"t": {"decoder": "ar"}}, batch_size=2)])
    assert row["tokens_per_second"] == pytest.approx(30 / 1.5)  # not 30 / 2.0 (the sum of latencies)
    assert row["latency_s_mean"] == pytest.approx(2.0 / 3) and row["batch_size"] == 2


def test_bad_batch_size_names_the_field(tmp_path, bench_config, capsys):
    from refusion.cli import main
    from refusion.core.config import ConfigError
    from refusion.experiments.bench import load_bench_config

    assert main(["bench", "--batch-size", "0", "--config", str(bench_config), "--out", str(tmp_path / "o")]) == 2
    assert "--batch-size: must be an integer of at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**yaml.safe_load(bench_config.read_text()), "batch_size": 0}))
    with pytest.raises(ConfigError, match="batch_size"):
        load_bench_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({**yaml.safe_load(bench_config.read_text()), "batch_size": 3}))
    assert load_bench_config(good).batch_size == 3


def test_rows_not_named_after_their_decoder_run_it_with_their_own_settings_and_limit(tmp_path, bench_config,
                                                                                       monkeypatch):
    from refusion.experiments.bench import bench_runs, load_bench_config

    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    cfg = yaml.safe_load(bench_config.read_text())
    cfg["models"]["refusion-paper"] = cfg["models"]["refusion"]
    cfg["rows"] = {"refusion-paper": {"decoder": "refusion", "limit": 2}}
    cfg["decoders"]["refusion-paper"] = {"slot_size": 2}
    bench_config.write_text(yaml.safe_dump(cfg))
    loaded = load_bench_config(bench_config)
    assert loaded.decoder_rows == ["ar", "refusion"]
    (run,) = bench_runs(loaded, ["refusion-paper"], ["facts"])
    assert (run.decoder, run.limit, run.configs["facts"]["slot_size"]) == ("refusion", 2, 2)
    rows = run_bench(tasks=["facts"], decoders=["ar", "refusion-paper"], limit=3, out=tmp_path / "out",
                     config=str(bench_config))
    assert [(r["run"], r["decoder"], r["n"]) for r in rows] == [("ar", "ar", 3), ("refusion-paper", "refusion", 2)]
    assert rows[1]["accuracy_diff"]["n"] == 2  # paired with ar on the samples both decoded


def test_bench_rows_without_a_model_are_refused(tmp_path, bench_config):
    from refusion.core.config import ConfigError
    from refusion.experiments.bench import load_bench_config

    cfg = yaml.safe_load(bench_config.read_text())
    cfg["rows"] = {"refusion-paper": {"decoder": "refusion"}}
    bench_config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"rows: rows \['refusion-paper'\] have no model under models:"):
        load_bench_config(bench_config)


def test_speedup_of_a_limited_run_is_measured_on_its_own_samples():
    recs = [{"run": "ar", "task": "t", "idx": i, "correct": True, "generated_tokens": 10, "nfe": 10, "wall_s": w}
            for i, w in enumerate([1.0, 1.0, 4.0])]
    recs += [{"run": "slow", "task": "t", "idx": i, "correct": True, "generated_tokens": 10, "nfe": 10, "wall_s": 2.0}
             for i in range(2)]
    runs = [Run("ar", "m", {"t": {"decoder": "ar"}}), Run("slow", "m", {"t": {"decoder": "llada"}}, limit=2)]
    rows = {r["run"]: r for r in summarize(recs, runs, baseline="ar")}
    assert rows["slow"]["speedup"] == pytest.approx(0.5)  # against ar's first two samples, not all three


def test_the_shipped_paper_rows_run_the_papers_algorithms():
    """refusion-paper carries none of our additions on any task, llada-paper none of Fast-dLLM's, and both
    share their model with the row they are compared to."""
    from refusion.core.config import validate_config
    from refusion.experiments.bench import load_bench_config

    cfg = load_bench_config()
    assert cfg.models["refusion-paper"] == cfg.models["refusion"] and cfg.models["llada-paper"] == cfg.models["llada"]
    for task in ("arith", "code", "facts", "arith_hard"):
        _, paper, _ = validate_config(cfg.decoder_config(task, "refusion-paper", get_task(task).max_new_tokens))
        assert paper.scorer.name == "first_token_prob" and paper.selector.fallback == "best"
        assert paper.draft_window is None and not paper.correct and not paper.join_adjacent and not paper.fused
        assert paper.split_threshold is None and paper.remasker.name == "none" and paper.serial_blocks == 1
        _, llada, _ = validate_config(cfg.decoder_config(task, "llada-paper", get_task(task).max_new_tokens))
        assert llada.kv_cache == "none" and llada.selector.name == "topk_per_step" and llada.steps is None


def test_jobs_decode_each_sample_once_with_the_ids_of_one_process_and_resume(tmp_path, bench_config):
    """--jobs 2: two worker processes, the joined samples.jsonl in task / sample / row order with the token
    ids of a one-process run; a run that lost samples resumes with another worker count."""
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=3, config=str(bench_config))
    one = run_bench(**args, out=tmp_path / "one")
    two = run_bench(**args, out=tmp_path / "two", jobs=2)
    assert [(r["run"], r["n"], r["accuracy"], r["tpf"]) for r in two] == \
        [(r["run"], r["n"], r["accuracy"], r["tpf"]) for r in one]
    ids = {(r["run"], r["idx"]): r["token_ids"] for r in load_records(tmp_path / "one" / "samples.jsonl")}
    joined = load_records(tmp_path / "two" / "samples.jsonl")
    assert [(r["idx"], r["run"]) for r in joined] == [(i, run) for i in range(3) for run in ("ar", "refusion")]
    assert {(r["run"], r["idx"]): r["token_ids"] for r in joined} == ids
    assert not (tmp_path / "two" / "shards").exists()
    with pytest.raises(ConfigError, match="--resume"):
        run_bench(**args, out=tmp_path / "two", jobs=2)
    lines = (tmp_path / "two" / "samples.jsonl").read_text().splitlines()
    (tmp_path / "two" / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")  # lost samples 1 and 2
    resumed = run_bench(**args, out=tmp_path / "two", jobs=3, resume=True)
    assert [r["n"] for r in resumed] == [3, 3]
    assert {(r["run"], r["idx"]): r["token_ids"] for r in load_records(tmp_path / "two" / "samples.jsonl")} == ids


def test_a_worker_decodes_only_its_share(tmp_path, bench_config):
    """--shard 1/2 (one worker of --jobs 2): samples 1 and 3 of 4, every row, no rows returned."""
    out = tmp_path / "w"
    assert run_bench(tasks=["facts"], decoders=["ar", "refusion"], limit=4, out=out, config=str(bench_config),
                     shard=(1, 2)) == []
    assert [(r["idx"], r["run"]) for r in load_records(out / "samples.jsonl")] == \
        [(1, "ar"), (1, "refusion"), (3, "ar"), (3, "refusion")]


def test_a_set_aimed_at_one_row_changes_only_that_row(bench_config):
    """`--set ROW:key=value` overrides one row; a plain `--set` every row; one that a row's decoder refuses
    says how to aim it; a row that is not run is refused by name."""
    from refusion.experiments.bench import bench_runs, load_bench_config, split_row

    cfg = load_bench_config(bench_config)
    runs = {r.label: r for r in bench_runs(cfg, ["ar", "refusion"], ["arith"],
                                           ["refusion:scorer=mean_prob", "gen_length=8"])}
    assert runs["refusion"].configs["arith"]["scorer"] == "mean_prob" and runs["refusion"].configs["arith"]["gen_length"] == 8
    assert "scorer" not in runs["ar"].configs["arith"] and runs["ar"].configs["arith"]["gen_length"] == 8
    assert split_row("verifier.token_threshold=0.5") == (None, "verifier.token_threshold=0.5")
    assert split_row("refusion-paper:slot_size=4") == ("refusion-paper", "slot_size=4")
    with pytest.raises(ConfigError, match="ROW:key=value sets one row, e.g. --set refusion:scorer=mean_prob"):
        bench_runs(cfg, ["ar", "refusion"], ["arith"], ["scorer=mean_prob"])
    with pytest.raises(ConfigError, match="no row 'llada' is run"):
        bench_runs(cfg, ["ar", "refusion"], ["arith"], ["llada:steps=4"])


def test_seeds_repeat_each_sample_pool_the_statistics_and_pair_by_seed(tmp_path, bench_config, monkeypatch):
    """`--seeds 3`: every sample decoded with seeds 0, 1, 2 (records carry the seed), n pools them, the
    rows are paired with ar by (sample, seed), and a resume redoes nothing."""
    monkeypatch.setattr(type(get_task("facts")), "max_new_tokens", 6)
    args = dict(tasks=["facts"], decoders=["ar", "refusion"], limit=2, out=tmp_path / "s", config=str(bench_config),
                overrides=["refusion:drafter.temperature=1.0"], seeds=3)
    rows = run_bench(**args)
    records = load_records(tmp_path / "s" / "samples.jsonl")
    assert sorted((r["run"], r["idx"], r["seed"]) for r in records) == sorted(
        (run, i, s) for run in ("ar", "refusion") for i in range(2) for s in range(3))
    assert [(r["run"], r["n"], r["seeds"]) for r in rows] == [("ar", 6, 3), ("refusion", 6, 3)]
    assert rows[1]["accuracy_diff"]["n"] == 6
    sampled = {(r["idx"], r["seed"]): r["token_ids"] for r in records if r["run"] == "refusion"}
    assert len({tuple(sampled[0, s]) for s in range(3)} | {tuple(sampled[1, s]) for s in range(3)}) > 2  # seeds differ
    assert run_bench(**args, resume=True) == rows
    with pytest.raises(ConfigError, match="--seeds"):
        run_bench(**{**args, "seeds": 0, "out": tmp_path / "z"})
