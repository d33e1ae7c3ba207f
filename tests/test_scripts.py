"""The scripts under scripts/ that CI can run: the GPU bench's CPU smoke run, the decode comparison and the loss-memory probe."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(name: str, *args: str) -> int:
    saved = sys.argv
    sys.argv = [name, *args]
    try:
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0


def test_gpu_bench_runs_on_cpu_with_a_tiny_shape(tmp_path):
    assert run_script("gpu_bench.py", "--device", "cpu", "--dtype", "float32", "--shape", "tiny",
                      "--prompts", "2", "--gen-length", "16", "--batch-sizes", "1,2", "--out", str(tmp_path)) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = report["rows"]
    assert [r["decoder"] for r in rows] == ["ar", "refusion"] and report["skipped"] == []
    for r in rows:
        assert r["forwards"] > 0 and 0.0 <= r["share_outside_forwards"] < 1.0 and r["host_reads_per_iteration"] >= 1
    batches = [(r["decoder"], r["batch_size"]) for r in report["batch_rows"]]
    assert batches == [("ar", 1), ("ar", 2), ("refusion", 1), ("refusion", 2)]
    ar_tokens = {r["batch_size"]: r["tokens"] for r in report["batch_rows"] if r["decoder"] == "ar"}
    assert ar_tokens == {1: 16, 2: 32}  # random weights never emit EOS: every sequence runs to gen_length
    coef = report["forward_cost"]["model"]["coef"]
    assert coef["fixed_causal"] > 0 and coef["fixed_ragged"] > 0 and min(coef.values()) >= 0
    assert set(report["forward_cost"]["loop_s"]) == {"ar", "refusion"}
    predicted = {(r["decoder"], r["batch_size"]) for r in report["predictions"]["rows"]}
    assert predicted == {("ar", 1), ("ar", 2), ("refusion", 1), ("refusion", 2)}
    assert set(report["predictions"]["lock_step"]["ar"]) == {"1", "2", "4", "8", "16", "32", "64"}


@pytest.mark.slow
def test_gpu_bench_times_the_compiled_forward(tmp_path, capsys):
    from refusion.models.loading import cpp_compiler

    if cpp_compiler() is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    assert run_script("gpu_bench.py", "--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--prompts", "1",
                      "--gen-length", "8", "--batch-sizes", "1", "--compile", "default", "--out", str(tmp_path)) == 0
    compiled = json.loads((tmp_path / "gpu_bench.json").read_text())["compiled"]
    assert "error" not in compiled and compiled["graphs"] >= 1
    assert len(compiled["compiled_s"]) == len(compiled["eager_s"]) == len(compiled["shapes"]) == 4
    check = json.loads((tmp_path / "gpu_bench.json").read_text())["token_check"]
    assert [(r["decoder"], r["batch_size"]) for r in check] == [("ar", 1), ("ar", 4), ("refusion", 1), ("refusion", 4)]
    assert all("error" not in r and r["ids_differ"] == 0 and r["samples"] == r["batch_size"] for r in check)
    out = capsys.readouterr().out
    assert "compiled forward (default)" in out and "compiled token check" in out


def test_gpu_bench_skips_what_would_start_after_its_time_limit(tmp_path, capsys):
    assert run_script("gpu_bench.py", "--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--prompts", "1",
                      "--gen-length", "8", "--batch-sizes", "1,2", "--time-limit-s", "0", "--out", str(tmp_path)) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["rows"] == [] and report["batch_rows"] == []
    assert report["skipped"] == ["ar batch 1", "refusion batch 1", "forward cost", "ar batch 2", "refusion batch 2"]
    assert "forward_cost" not in report and "predictions" not in report
    assert "skipped after 0 s" in capsys.readouterr().out


def write_samples(folder: Path, token_ids: list[list[int]], nfe: list[int]) -> None:
    (folder / "bench").mkdir(parents=True)
    rows = [{"run": "refusion", "task": "arith", "idx": i, "token_ids": t, "nfe": n, "correct": True,
             "completion": "x"} for i, (t, n) in enumerate(zip(token_ids, nfe))]
    (folder / "bench" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("after, differs", [(([[1, 2, 3], [4, 5]], [3, 2]), False), (([[1, 2, 3], [4, 6]], [3, 2]), True),
                                            (([[1, 2, 3], [4, 5]], [3, 3]), True)])
def test_compare_decodes_reports_any_difference(tmp_path, capsys, after, differs):
    write_samples(tmp_path / "a", [[1, 2, 3], [4, 5]], [3, 2])
    write_samples(tmp_path / "b", *after)
    assert run_script("compare_decodes.py", str(tmp_path / "a"), str(tmp_path / "b")) == int(differs)
    assert ("1 differ" if differs else "0 differ") in capsys.readouterr().out


def test_forward_cost_prints_a_row_per_fed_width(capsys):
    assert run_script("forward_cost.py", "--repeats", "1", "--cached", "8", "--no-fit") == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "16", "64"]
    assert all(float(c) > 0 for r in rows for c in r.strip("|").split("|")[1:])


def test_forward_cost_fits_and_writes_the_cost_model(tmp_path, capsys):
    from refusion.experiments.costmodel import FEATURES, CostModel

    assert run_script("forward_cost.py", "--repeats", "1", "--cached", "8", "--fit-repeats", "1", "--warm-calls", "1",
                      "--json", str(tmp_path / "cost.json")) == 0
    out = capsys.readouterr().out
    model = CostModel.from_dict(json.loads((tmp_path / "cost.json").read_text()))
    assert model.coef["fixed_causal"] > 0 and model.coef["fixed_ragged"] > 0 and min(model.coef.values()) >= 0
    assert all(f"| {name} |" in out for name in FEATURES)


@pytest.mark.slow  # minutes on a busy 2-core machine: the whole grid, twice
def test_forward_cost_fits_eager_and_aot_in_one_run(monkeypatch, capsys):
    # the exported programs stand in for AOTInductor's packages (seconds, no C++ build); every grid shape
    # must run through a compiled kind, none through torch.compile
    from refusion.experiments.costmodel import FEATURES
    from refusion.models import aot

    monkeypatch.setattr(aot, "aoti_runner", lambda model, kind: aot.export(model, kind)[1].module())
    assert run_script("forward_cost.py", "--compile", "aot", "--with-eager", "--fit-repeats", "1", "--warm-calls", "1",
                      "--no-table") == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in FEATURES) and "| term | eager | compiled | compiled / eager |" in out
    assert "kinds run through torch.compile: none" in out
    assert run_script("forward_cost.py", "--with-eager") == 2  # nothing to fit against eager


def test_mdm_gap_prints_every_layout(capsys):
    assert run_script("mdm_gap.py", "--n", "2", "--tasks", "facts") == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| facts")]
    layouts = [(r[1].strip(), r[2].strip()) for r in rows]
    assert layouts == [("tiny-mdm", "iid 0.25"), ("tiny-mdm", "iid 0.5"), ("tiny-mdm", "iid 0.75"),
                       ("tiny-mdm", "left-to-right"), ("tiny-ar", "causal next token")]
    accuracy = {layout: float(r[3].strip().rstrip("%")) for layout, r in zip(layouts, rows)}
    assert all(0.0 <= a <= 100.0 for a in accuracy.values())
    assert accuracy[("tiny-ar", "causal next token")] > 90.0  # tiny-ar answers facts; a broken layout would not


def test_head_vs_normalisation_prints_a_row_per_width(capsys):
    assert run_script("head_vs_normalisation.py", "--vocab", "4096", "--hidden", "16,32", "--rows", "2",
                      "--repeats", "1") == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")
            and line[2].isdigit()]
    assert [r[0].strip() for r in rows] == ["16", "32"]
    assert all(0.0 < float(r[4].strip().rstrip("%")) < 100.0 for r in rows)


def test_paired_runs_pairs_two_runs_and_classifies_where_misses_start(tmp_path, capsys):
    ref = "Ann has 9 + 10 = 19 eggs.\nTotal: 19 + 4 = 23.\n#### 23"
    outputs = {  # idx: (ar, A, B) completions; A misses 0 (tens digit, Total line) and 1, B misses 1
        0: (ref, ref.replace("= 23", "= 33"), ref),
        1: (ref, ref.replace("= 19 eggs", "= 18 eggs"), ref.replace("= 19 eggs", "= 18 eggs")),
        2: (ref, ref, ref),
    }
    with (tmp_path / "samples.jsonl").open("w") as f:
        for idx, completions in outputs.items():
            for run, text in zip(("ar", "A", "B"), completions):
                f.write(json.dumps({"run": run, "task": "arith", "idx": idx, "completion": text,
                                    "correct": text == ref}) + "\n")
    assert run_script("paired_runs.py", str(tmp_path), "A", "B") == 0
    out = capsys.readouterr().out
    assert "arith: B - A = +33.3 [" in out and "n 3" in out
    assert "A: 2 misses where ar is right; first difference in the Total: line 1, only in a tens digit 1" in out
    assert "B: 1 misses where ar is right; first difference in the Total: line 0, only in a tens digit 0" in out
    assert run_script("paired_runs.py", str(tmp_path), "A", "C") == 2
    assert "no sample of task 'arith' holds both runs 'A' and 'C'" in capsys.readouterr().err


def test_loss_memory_runs_both_modes_on_a_widened_model(capsys):
    assert run_script("loss_memory.py", "--vocab", "2048", "--dtype", "float32", "--batch", "2", "--json") == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["mode"] for r in rows] == ["one-pass", "chunked"]
    assert rows[0]["loss"] == rows[1]["loss"] and rows[0]["logits_rows"] == rows[1]["logits_rows"] > 0
    assert all(r["peak_gb_above_load"] >= 0 and r["seconds"] > 0 for r in rows)


def test_thread_default_candidates_and_its_reading_of_a_bench_folder(tmp_path):
    """scripts/thread_default.py (the measurement behind the default --threads): each candidate's flags and
    environment, and refusion's speed-up read from a bench's results.json."""
    script = runpy.run_path(str(SCRIPTS / "thread_default.py"))
    assert script["candidate_flags"]("one", 4) == (["--threads", "1"], {})
    assert script["candidate_flags"]("passive", 4) == (["--threads", "4"], {"OMP_WAIT_POLICY": "PASSIVE"})
    (tmp_path / "results.json").write_text(json.dumps([
        {"run": "ar", "task": "arith", "speedup_vs_ar": 1.0}, {"run": "refusion", "task": "arith", "speedup_vs_ar": 4.5}]))
    assert script["speedups"](tmp_path) == {"arith": 4.5}
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"run": "ar", "task": "arith", "wall_s": w}) + "\n"
                                                    for w in (0.5, 0.1, 5.0)))
    assert script["median_decode_s"](tmp_path) == {("ar", "arith"): (0.5, 3)}  # a stopped run's samples count


def test_spec_vs_transformers_finds_the_same_tokens_and_target_forwards(tmp_path):
    """The external check of the speculative decoder on one facts prompt: prompt lookup and assisted
    generation (tiny-ar with tiny-ar-draft) give our tokens in as many target forwards."""
    out = tmp_path / "spec.json"
    assert run_script("spec_vs_transformers.py", "--limit", "1", "--tasks", "facts", "--out", str(out)) == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["ngram", "model"]
    for r in rows:
        assert r["identical"] == r["equal_target_forwards"] == r["n"] == 1 and r["differences"] == []


def test_stage_tokens_sorts_every_fed_token_by_stage(capsys):
    assert run_script("stage_tokens.py", "--tasks", "facts", "--batch-size", "2", "--limit", "2") == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("facts ")]
    stages = [line for line in out if line.endswith("%")]
    assert any("prefill + Stage I" in line for line in stages) and any("Stage II-a" in line for line in stages)
    assert sum(float(line.split()[-1].rstrip("%")) for line in stages) == pytest.approx(100, abs=0.5)
    assert float(out[-1].split()[3]) == pytest.approx(sum(float(line.split()[-2]) for line in stages), abs=0.05)
    assert run_script("stage_tokens.py", "--batch-size", "3", "--limit", "4") == 2


@pytest.mark.slow
def test_serve_bench_runs_the_goal_and_the_ratio_on_a_small_load(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    code = run_script("serve_bench.py", "--rows", "block", "--parts", "ratio,goal", "--limit", "16", "--rounds", "2",
                      "--goal-requests", "20", "--compare-serve-args=--engine thread", "--out", str(tmp_path))
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "serve_bench.json").read_text())[0]
    # every verdict met; the memory one needs a run of 2 s or more (an RSS sample in each half)
    assert code == 0 and "NOT MET" not in out and out.count("MET: ") == len(result["verdicts"]) >= 5
    assert result["goal"]["disconnected"] == 2 and result["goal"]["offline"]["differ"] == 0
    assert result["ratio"]["same_tokens"] and result["ratio"]["ratio_low"] <= result["ratio"]["ratio"]
    other = result["ratio_compare"]  # the second server, --engine thread, in the same rounds as the default
    assert other["same_tokens"] and other["serve_args"] == "--engine thread"
    assert [r["offline_s"] for r in other["rounds"]] == [r["offline_s"] for r in result["ratio"]["rounds"]]
    assert all(r["served_engine_cpu_s"] > 0 for r in other["rounds"])
    md = (tmp_path / "serve_bench.md").read_text()
    assert "| block |" in md and "| block (--engine thread) |" in md and result["compare_server_exit"] == 0


def test_cost_model_refit_predicts_decodes_of_a_known_cost(tmp_path, capsys):
    """--refit analyses a saved profiles.json: decodes timed by a known forward cost and loop cost (per call and
    per sequence-forward) are predicted exactly, at batch 1 and in a ragged batch."""
    from refusion.experiments.costmodel import GRID, CostModel, DecodeProfile, LoopCost
    from refusion.models.backend import ForwardShape

    coef = {"fixed_causal": 3e-3, "fixed_masked": 3.5e-3, "fixed_segments": 3.8e-3, "fixed_ragged": 4.2e-3,
            "fixed_ragged_masked": 4.6e-3, "ragged_row": 5e-5, "token": 1.1e-4, "narrow": 3e-4, "key": 2e-7,
            "pair": 3e-9, "logit": 6e-6}
    truth, loop = CostModel(coef), {"ar": LoopCost(0.0, 2e-4), "block": LoopCost(1e-3, 3e-4)}
    grid = []
    for kind, rows, fed, past, logits in GRID:
        s = ForwardShape(rows, fed, past, rows * (fed if logits == "all" else 1), kind)
        grid.append([s.rows, s.fed, s.past, s.logits_rows, s.kind, truth.predict(s)])

    def profile(label: str, size: int, steps: int) -> dict:
        if label == "ar":
            kind, fed, per_step = ("causal" if size == 1 else "ragged"), 1, 1
        else:
            kind, fed, per_step = ("segments" if size == 1 else "ragged_masked"), 8, 4
        shapes = [ForwardShape(size, fed, 20 + 3 * i, size * fed, kind) for i in range(steps)]
        p = DecodeProfile(shapes, steps * size, steps * size * per_step, 0.0)
        wall = truth.total(shapes)[0] + loop[label].seconds(p)
        return {"shapes": [[s.rows, s.fed, s.past, s.logits_rows, s.kind, None] for s in shapes],
                "sequence_forwards": p.sequence_forwards, "tokens": p.tokens, "wall_s": wall}

    data = {"decoders": ["ar", "block"], "tasks": ["facts"], "batch_sizes": [1, 4], "limit": 4, "calibrate": 1,
            "calibrate_batch": 4, "clock": "cpu", "compile": None, "model": "tiny-ar", "grid": grid,
            "calibration": {label: [{"task": "facts", "batch_size": b, **profile(label, b, 9 + b)} for b in (1, 4)]
                            for label in loop},
            "test": {f"{label}|facts|{b}": [profile(label, b, 12)] for label in loop for b in (1, 4)}}
    (tmp_path / "profiles.json").write_text(json.dumps(data))
    assert run_script("cost_model.py", "--refit", str(tmp_path)) == 0
    assert "4 of 4 rows within 15%" in capsys.readouterr().out
    result = json.loads((tmp_path / "cost_model.json").read_text())
    assert all(abs(r["error"]) < 1e-6 for r in result["rows"])
    assert result["loop"]["block"]["per_call"] == pytest.approx(1e-3)
    assert run_script("cost_model.py", "--refit", str(tmp_path), str(tmp_path), "--out", str(tmp_path / "both")) == 0
    assert "4 of 4 rows within 15%" in capsys.readouterr().out  # two runs pooled
    assert (tmp_path / "both" / "cost_model.json").is_file()
    assert run_script("cost_model.py", "--refit", str(tmp_path / "none")) == 2
    assert "--refit: no" in capsys.readouterr().err
    # a run that timed the grid both ways: --grid cold fits the cold timings (here twice the warm ones)
    data["grid_order"], data["grid_cold"] = "warm", [[*g[:5], 2 * g[5]] for g in grid]
    both = tmp_path / "both_grids"
    both.mkdir()
    (both / "profiles.json").write_text(json.dumps(data))
    assert run_script("cost_model.py", "--refit", str(both), "--grid", "cold", "--out", str(tmp_path / "cold")) == 0
    cold = json.loads((tmp_path / "cold" / "cost_model.json").read_text())["model"]["coef"]
    assert cold["fixed_causal"] == pytest.approx(2 * coef["fixed_causal"])
    assert not (both / "cost_model.json").exists()  # --out took the analysis
    del data["grid_cold"]
    (both / "profiles.json").write_text(json.dumps(data))
    assert run_script("cost_model.py", "--refit", str(both), "--grid", "cold") == 2
    assert "holds no grid timed cold" in capsys.readouterr().err


def test_suite_cost_times_the_same_tests_at_a_base_commit_and_now():
    """Both sides run the named tests (a path the base lacks is left out of its side) and report pytest's line."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", "scripts/suite_cost.sh", "HEAD", "1", "--", "tests/test_docs_pages.py"],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "REFUSION_PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    base, now = (re.search(rf"round 1 {side}: (\d+) passed", out.stdout) for side in ("base", "now"))
    assert base and now and int(base.group(1)) > 0, out.stdout
    assert "load average:" in out.stdout


def test_cost_model_bound_prices_a_grid_against_refusions_floor(tmp_path, capsys):
    """--bound decodes a grid's runs (shipped models, batch 2) and prices them with a saved fit: no ReFusion
    run is predicted faster than its own forwards at the least widths, nor those faster than the floor."""
    coef = {"fixed_causal": 3e-3, "fixed_masked": 3.5e-3, "fixed_segments": 3.8e-3, "fixed_ragged": 4.2e-3,
            "fixed_ragged_masked": 4.6e-3, "ragged_row": 5e-5, "token": 1.1e-4, "narrow": 3e-4, "key": 2e-7,
            "pair": 3e-9, "logit": 6e-6}
    fit_dir = tmp_path / "fit"
    fit_dir.mkdir()
    loop = {"per_call": 1e-4, "per_sequence": 2e-4}
    (fit_dir / "cost_model.json").write_text(json.dumps({"model": {"coef": coef}, "loop": {"ar": loop,
                                                                                           "refusion": loop}}))
    grid = tmp_path / "grid.yaml"
    grid.write_text("name: g\ntasks: [facts]\nsplit: validation\nlimit: 4\nbaseline: ar\nruns:\n"
                    "  - {label: ar, decoder: ar}\n  - {label: shipped, decoder: refusion}\n"
                    "  - {label: w1, decoder: refusion, set: {draft_window: 1}}\n")
    assert run_script("cost_model.py", "--bound", str(grid), "--fit", str(fit_dir), "--tasks", "facts",
                      "--batch-size", "2", "--out", str(tmp_path / "out")) == 0
    assert "| facts | floor (ar's answers) |" in capsys.readouterr().out
    rows = {r["run"]: r for r in json.loads((tmp_path / "out" / "bound.json").read_text())["rows"]}
    assert rows["ar"]["vs_baseline"] == 1.0 and rows["ar"]["calls"] > 4
    floor = rows["floor (ar's answers)"]
    assert floor["calls"] == 4 and floor["fed_per_token"] >= 2  # 2 calls per chunk; P + 2G tokens per sequence
    for run in ("shipped", "w1"):
        assert rows[run]["vs_baseline"] <= rows[run]["least_widths_vs_baseline"] <= floor["vs_baseline"]
        assert rows[run]["tokens"] == floor["tokens"]  # the same answers as ar: the floor is for those lengths
        assert sum(v for k, v in rows[run]["seconds"].items() if k != "total") == pytest.approx(
            rows[run]["seconds"]["total"])
    assert run_script("cost_model.py", "--bound", str(grid), "--fit", str(tmp_path / "none")) == 2
    assert "--bound needs --fit DIR" in capsys.readouterr().err


def test_serve_overhead_splits_each_modes_cpu_time(capsys):
    """The figures of docs/serving.md's "Where the engine thread's time goes": every mode decodes the same
    prompts (offline and in a thread: the same calls and tokens), its CPU time split into model, cache, rest;
    each call's attention span padded and the rows' own."""
    assert run_script("serve_overhead.py", "--row", "block", "--limit", "4", "--rounds", "1",
                      "--modes", "offline,offline-thread,engine,engine-width,server,offline-key-groups") == 0
    rows = {r[0]: r for r in (line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
                               if line.startswith("| ") and not line.startswith("| mode"))}
    rows = {k.strip(): [c.strip() for c in v] for k, v in rows.items()}
    assert list(rows) == ["offline", "offline-thread", "engine", "engine-width", "server", "offline-key-groups"]
    assert rows["offline"][4:6] == rows["offline-thread"][4:6] == rows["offline-key-groups"][4:6]  # calls, tokens
    # in key groups rows attend over their group's longest row's keys: as many pairs as in one group or fewer
    assert float(rows["offline-key-groups"][9].split(" / ")[0]) <= float(rows["offline"][9].split(" / ")[0])
    assert rows["offline"][9:12] == rows["offline-thread"][9:12]  # the same calls' spans and padding
    assert all(int(r[4]) > 0 and float(r[1]) > 0 and float(r[6]) > 0 for r in rows.values())
    for r in rows.values():
        for padded, own in (map(float, r[k].split(" / ")) for k in (9, 10)):
            assert padded >= own > 0
        assert float(r[11]) >= 0
    assert rows["offline"][12].startswith("1.000")
    ms, keys = map(float, rows["offline"][13].split(" / "))  # block's 4 prompts: no call of 16 rows
    assert ms != ms and keys != keys


def test_serve_admission_measures_every_mode_against_batch_bench(capsys):
    assert run_script("serve_admission.py", "--row", "block", "--limit", "4", "--rounds", "1") == 0
    out = capsys.readouterr().out
    modes = [part.split(" tok/s")[0].rsplit(" ", 1)[0].strip() for part in out.splitlines()[-1].split(" | ")[:-1]]
    assert modes[0] == "batch-bench@16" and "16 clients, calls by width and cached length" in modes
    assert len(modes) == 10
    assert all(" calls, " in part and "(row, key) pairs per call" in part and "query-key pairs per call" in part
               for part in out.splitlines()[-1].split(" | ")[:-1])
