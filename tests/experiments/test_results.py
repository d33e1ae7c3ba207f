"""`refusion results`: verdict rules over summary rows, and the document written from results folders."""

import json

import pytest

from refusion.experiments import claims, results, results_page
from refusion.experiments.claims import CLAIMS, Inconclusive, agree, as_accurate, faster, speed_ratio, verdict
from refusion.experiments.results_page import write_document

CLAIM = {c.ablation: c for c in CLAIMS}


def row(task, run, acc, tps=10.0, tpf=1.0, n=200, decoder="refusion", **params):
    """A summary row whose first ``round(acc * n)`` samples are right (so two rows differ only on the samples
    between their counts: paired differences all in one direction)."""
    nfe = 1.2 if run == "kv_recompute" else 1.0  # recompute's extra forward when slots complete together
    return {"task": task, "run": run, "decoder": decoder, "n": n, "accuracy": acc, "tokens_per_second": tps,
            "tpf": tpf, "nfe_mean": nfe, "latency_s_mean": 1.0, "speedup": None,
            "per_sample": {i: i < round(acc * n) for i in range(n)},
            "per_sample_speed": {i: (10, 10 / tps) for i in range(n)}, **params}  # every sample at ``tps``


def test_paired_comparisons_hold_fail_or_are_inconclusive():
    assert as_accurate(row("t", "a", 0.90), row("t", "b", 0.92))  # 4 of 200 apart: within 5 points
    assert not as_accurate(row("t", "a", 0.80), row("t", "b", 0.92))  # worse beyond doubt
    with pytest.raises(Inconclusive, match="a vs b: -10.0 points"):  # 2 of 20 apart: the interval reaches both
        as_accurate(row("t", "a", 0.80, n=20), row("t", "b", 0.90, n=20))
    assert agree(row("t", "a", 0.90), row("t", "b", 0.92)) and not agree(row("t", "a", 0.70), row("t", "b", 0.92))
    with pytest.raises(Inconclusive, match="straddles"):
        agree(row("t", "a", 0.85), row("t", "b", 0.90))
    shifted = row("t", "b", 0.9)
    shifted["per_sample"] = {i: i >= 20 for i in range(200)}  # same accuracy, other samples: 40 discordant
    with pytest.raises(Inconclusive):
        agree(row("t", "a", 0.9), shifted)


def test_faster_reads_the_paired_interval_of_the_tokens_per_second_ratio():
    """1.01x on average with per-sample times on both sides of 1 is not 'faster'; 1.2x on every sample is."""
    assert faster(row("t", "a", 0.9, tps=12), row("t", "b", 0.9, tps=10))
    assert not faster(row("t", "a", 0.9, tps=9), row("t", "b", 0.9, tps=10))
    noisy = row("t", "a", 0.9)
    noisy["per_sample_speed"] = {i: (10, 0.79 if i % 2 else 1.19) for i in range(200)}  # b: 1.0 s per sample
    with pytest.raises(Inconclusive, match=r"a vs b: 1.01x \[0.98, 1.04\] the tokens/s, an interval that contains 1"):
        faster(noisy, row("t", "b", 0.9))
    assert speed_ratio(noisy, row("t", "b", 0.9)).value == pytest.approx(1.01, abs=0.001)


def test_scorers_compare_two_different_scorers_when_all_tie():
    rows = [row("code", n, 0.995) for n in ("first_token_prob", "mean_prob", "mean_neg_entropy")]
    word, why = verdict(CLAIM["scorers"], rows)
    assert word == "holds" and why[0].endswith("first_token_prob - mean_prob: +0.0 points [+0.0, +0.0])")


def test_kv_cache_verdicts_per_task():
    rows = [row("arith", "kv_concat", 0.90, tps=12), row("arith", "kv_recompute", 0.92, tps=10),
            row("code", "kv_concat", 0.50, tps=12), row("code", "kv_recompute", 0.90, tps=10)]
    word, why = verdict(CLAIM["kv_cache"], rows)
    assert word == "mixed"
    assert why[0].startswith("arith: yes (shipped settings: reuse 1.20x") and why[1].startswith("code: no")
    assert verdict(CLAIM["kv_cache"], rows[:2])[0] == "holds"
    slower = [row("arith", "kv_concat", 0.9, tps=9), row("arith", "kv_recompute", 0.9, tps=10)]
    assert verdict(CLAIM["kv_cache"], slower)[0] == "does not hold"


def test_kv_cache_is_not_tested_where_both_caches_made_the_same_forwards():
    """One slot per Stage II-b merge: reuse and recompute do the same work, so a speed ratio is noise."""
    rows = [row("arith", "kv_concat", 1.0, tps=12, tpf=7.84, nfe_mean=15.6),
            row("arith", "kv_recompute", 1.0, tps=10, tpf=7.84, nfe_mean=15.6),
            row("code", "kv_concat", 0.95, tps=12), row("code", "kv_recompute", 0.95, tps=10)]
    word, why = verdict(CLAIM["kv_cache"], rows)
    assert word == "holds" and why[0].startswith(
        "arith: not testable, shipped settings: both caches made the same forwards (NFE 15.60)")
    assert verdict(CLAIM["kv_cache"], rows[:2])[0] == "cannot be tested here"


def test_kv_cache_judged_at_the_reference_settings_where_the_shipped_ones_make_the_same_forwards():
    same = [row("arith", "kv_concat", 1.0, tps=12, tpf=7.84, nfe_mean=15.6),
            row("arith", "kv_recompute", 1.0, tps=10, tpf=7.84, nfe_mean=15.6)]
    ref = [row("arith", "kv_concat_ref", 0.55, tps=9, tpf=9.3, nfe_mean=13.4),
           row("arith", "kv_recompute_ref", 0.55, tps=10, tpf=9.5, nfe_mean=13.2)]
    word, why = verdict(CLAIM["kv_cache"], same + ref)
    assert word == "does not hold"
    assert why[0].startswith("arith: no (reference settings: reuse 0.90x the tokens/s of recompute, accuracy 55% vs 55%")
    assert "shipped settings: both caches made the same forwards" in why[0]
    faster = [row("arith", "kv_concat_ref", 0.55, tps=11, tpf=9.3, nfe_mean=13.4), ref[1]]
    assert verdict(CLAIM["kv_cache"], same + faster)[0] == "holds"
    with pytest.raises(KeyError):  # half a pair is a missing run, not a pair to skip
        claims.kv_reuse_faster_and_as_accurate({r["run"]: r for r in same + ref[:1]})


def test_missing_run_cannot_be_tested():
    word, why = verdict(CLAIM["kv_cache"], [row("arith", "kv_concat", 0.9)])
    assert word == "cannot be tested here" and "kv_recompute" in why[0]
    assert verdict(CLAIM["frontier"], [row("arith", "ar", 0.9, decoder="ar")])[0] == "cannot be tested here"


def test_sweep_claims_read_the_swept_key():
    key = "verifier.token_threshold"
    rows = [row("arith", f"t{v}", 0.9, tpf=t, **{key: v}) for v, t in ((0.1, 3.0), (0.5, 2.0), (0.9, 1.2))]
    assert verdict(CLAIM["token_threshold"], rows)[0] == "holds"
    rows[-1]["tpf"] = 3.5
    assert verdict(CLAIM["token_threshold"], rows)[0] == "does not hold"
    blocks = [row("code", f"b{b}", a, serial_blocks=b) for b, a in ((1, 0.80), (2, 0.82), (4, 0.40))]
    word, why = verdict(CLAIM["serial_blocks"], blocks)
    assert word == "does not hold" and "4 blocks 40%" in why[0]


def test_frontier_compares_accuracy_lost_per_tpf():
    rows = [row("arith", "r1", 0.90, tpf=1.5), row("arith", "r2", 0.88, tpf=3.0),
            row("arith", "l1", 0.80, tpf=1.0, decoder="llada"), row("arith", "l2", 0.40, tpf=2.0, decoder="llada")]
    assert verdict(CLAIM["frontier"], rows)[0] == "holds"


def test_document_is_written_from_results_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(results_page, "machine", lambda: "test box")
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 0123456789")
    out = tmp_path / "runs"
    (out / "kv_cache").mkdir(parents=True)
    rows = [row("arith", "kv_concat", 0.9, tps=12), row("arith", "kv_recompute", 0.9, tps=10)]
    (out / "kv_cache" / "results.json").write_text(json.dumps(rows))
    samples = [{"run": run, "task": "arith", "idx": i, "correct": True, "wall_s": 45.0, "nfe": 1,
                "generated_tokens": 12 if run == "kv_concat" else 10}
               for run in ("kv_concat", "kv_recompute") for i in range(2)]  # 4 decodes of 45 s: 3.0 min
    (out / "kv_cache" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    text = write_document(out, doc, ["kv_cache"], "refusion results --only kv_cache", jobs=2)
    assert doc.read_text() == text
    assert "`refusion results --only kv_cache`" in text and "test box" in text
    assert "**holds**" in text and "| 3.0 min |" in text and "Table 8" in text
    assert "decodes took 3 min." in text  # no wall time on record: none stated
    (out / "wall.json").write_text(json.dumps({"wall_s": 150.0}))
    text = write_document(out, doc, ["kv_cache"], "refusion results --only kv_cache", jobs=2)
    assert "decodes took 3 min; the command took 2 min of wall time with 2 workers at once, model loading included." in text
    assert "![kv_cache_0](results/kv_cache_0.png)" in text
    figure = tmp_path / "docs" / "results" / "kv_cache_0.png"  # drawn from results.json, with the page
    assert figure.read_bytes()[:4] == b"\x89PNG" and figure.with_suffix(".svg").exists()


def test_jobs_run_each_ablation_in_a_worker_and_report_failures(tmp_path, monkeypatch):
    """--jobs: every ablation runs once in a subprocess; its wall time is recorded; a failing worker is named."""
    import sys

    monkeypatch.setattr(results_page, "machine", lambda: "test box")
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 0123456789")
    rows = [row("arith", "kv_concat", 0.9, tps=12), row("arith", "kv_recompute", 0.9, tps=10)]

    def fake(name, out, limit, resume, device, **_):
        code = (f"import json, pathlib, os; pathlib.Path({str(out)!r}, 'results.json').write_text({json.dumps(rows)!r}); "
                f"print(os.environ['OMP_NUM_THREADS'], {limit!r}, {resume!r})")
        return [sys.executable, "-c", code if name != "scorers" else "raise SystemExit(3)"]

    monkeypatch.setattr(results, "ablation_command", fake)
    out, doc = tmp_path / "runs", tmp_path / "results.md"
    text = results.run_all(out, doc, ["kv_cache", "slot_size"], limit=5, jobs=2)
    assert text.count("**holds**") >= 1 and "slot_size" in text and "2 one-thread worker processes" in text
    wall_s = json.loads((out / "wall.json").read_text())["wall_s"]
    assert wall_s > 0 and f"the command took {wall_s / 60:.0f} min of wall time with 2 workers at once" in text
    timings = json.loads((out / "timings.json").read_text())
    assert set(timings) == {"kv_cache", "slot_size"} and all(t > 0 for t in timings.values())
    assert (out / "kv_cache" / "run.log").read_text().split() == ["1", "5", "False"]
    with pytest.raises(RuntimeError, match=r"\['scorers'\]"):
        results.run_all(out, doc, ["kv_cache", "scorers"], jobs=2)


def test_workers_start_the_ablations_with_the_most_decodes_first(tmp_path, monkeypatch):
    """With 2 workers the run ends soonest when the long ablations start first."""
    from refusion.core import workers

    started: list[str] = []
    monkeypatch.setattr(workers, "run_jobs", lambda jobs, n, on_finish: started.extend(j.name for j in jobs) or [])
    names = ["kv_cache", "serial_blocks", "frontier", "ladder"]
    counts = {n: results.decode_count(n) for n in names}
    assert counts["frontier"] == 14 * 6 * 200 and counts["serial_blocks"] < counts["kv_cache"]
    results._run_workers(names, tmp_path, None, False, None, 2, {}, tmp_path / "timings.json")
    assert started == ["frontier", "ladder", "kv_cache", "serial_blocks"]
    assert results.decode_count("frontier", limit=5) == 14 * 6 * 5
    assert results.decode_count("frontier", limit=10**6) == counts["frontier"]  # no more than the split holds


def fake_ablations(monkeypatch, box: str) -> None:
    """Every ablation a worker that writes two equally accurate kv_cache rows; the machine named ``box``."""
    import sys

    monkeypatch.setattr(results_page, "machine", lambda: box)
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 0123456789")
    rows = [row("arith", "kv_concat", 0.9, tps=12), row("arith", "kv_recompute", 0.9, tps=10)]
    code = "import pathlib, sys; pathlib.Path(sys.argv[1], 'results.json').write_text(sys.argv[2])"
    monkeypatch.setattr(results, "ablation_command",
                        lambda name, out, limit, resume, device, **_: [sys.executable, "-c", code, str(out), json.dumps(rows)])


def test_only_reruns_some_ablations_and_keeps_the_others_on_the_page(tmp_path, monkeypatch):
    """--only kv_cache after a full run: slot_size keeps its section and its decode time; kv_cache's time is new."""
    fake_ablations(monkeypatch, "test box")
    out, doc = tmp_path / "runs", tmp_path / "results.md"
    results.run_all(out, doc, ["kv_cache", "slot_size"], jobs=2)
    (out / "timings.json").write_text(json.dumps({"kv_cache": 600.0, "slot_size": 120.0}))
    (out / "slot_size" / "samples.jsonl").write_text(json.dumps(  # slot_size's decode time: 2.0 min
        {"run": "kv_concat", "task": "arith", "idx": 0, "correct": True, "wall_s": 120.0, "generated_tokens": 10,
         "nfe": 1}) + "\n")
    text = results.run_all(out, doc, ["kv_cache"], jobs=2)
    assert 'id="slot_size"' in text and 'id="kv_cache"' in text
    timings = json.loads((out / "timings.json").read_text())
    assert timings["slot_size"] == 120.0 and timings["kv_cache"] < 600.0  # replaced, not added to
    assert "| 2.0 min |" in text


def test_only_keeps_the_sections_of_the_existing_page_whose_results_are_gone(tmp_path, monkeypatch):
    """A page written by an earlier run (its OUT folder lost): --only kv_cache rewrites kv_cache and keeps
    slot_size's section, summary row and decode time, dated by the earlier page; a kept section whose
    models' weights changed since is refused."""
    fake_ablations(monkeypatch, "new box")
    doc = tmp_path / "results.md"
    results.run_all(tmp_path / "first", doc, ["kv_cache", "slot_size"], jobs=2)
    first = doc.read_text()
    slot_size = first[first.index('<a id="slot_size"></a>'):]
    monkeypatch.setattr(results_page, "machine", lambda: "newer box")
    monkeypatch.setattr(results, "models_used", lambda name: ["tiny-x"])
    text = results.run_all(tmp_path / "second", doc, ["kv_cache"], jobs=2)
    assert text.endswith(slot_size) and "Ran " in slot_size and "on new box." in slot_size
    assert text.count("on newer box.") == 1 and 'id="kv_cache"' in text
    assert "(slot_size) name their own date and machine" in text and "(each section gives the date its analysis ran)" in text
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 9876543210")  # retrained since
    with pytest.raises(RuntimeError, match="section 'slot_size' decoded tiny-x with weights that have changed"):
        results.run_all(tmp_path / "third", doc, ["kv_cache"], jobs=2)


def test_a_rerun_keeps_the_sections_it_does_not_redo_from_the_index_beside_the_outputs(tmp_path, monkeypatch):
    """OUT/index.json records each section (date, machine, weights, minutes, row, text): a rerun into the same
    OUT whose results for slot_size are gone keeps slot_size's section from the index, with no page to read;
    one whose checkpoints' weights changed since is refused."""
    fake_ablations(monkeypatch, "new box")
    monkeypatch.setattr(results_page, "models_used", lambda name: ["tiny-x"])
    monkeypatch.setattr(results, "models_used", lambda name: ["tiny-x"])
    out = tmp_path / "runs"
    first = results.run_all(out, tmp_path / "a.md", ["kv_cache", "slot_size"], jobs=2)
    entry = json.loads((out / "index.json").read_text())["sections"]["slot_size"]
    assert entry["machine"].startswith("new box.") and entry["weights"] == {"tiny-x": "0123456789"}
    assert first.endswith(entry["text"]) and entry["summary_row"] in first
    import shutil

    shutil.rmtree(out / "slot_size")
    monkeypatch.setattr(results_page, "machine", lambda: "newer box")
    text = results.run_all(out, tmp_path / "b.md", ["kv_cache"], jobs=2)  # b.md: no page to read sections from
    assert text.endswith(entry["text"]) and entry["summary_row"] in text and "(slot_size) name their own" in text
    assert json.loads((out / "index.json").read_text())["sections"]["slot_size"] == entry  # kept as it was
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 9876543210")  # retrained since
    with pytest.raises(RuntimeError, match="index.json: section 'slot_size' decoded tiny-x with weights that"):
        results.run_all(out, tmp_path / "c.md", ["kv_cache"], jobs=2)


def test_tasks_at_chance_are_not_tested_for_accuracy_claims():
    """0% vs 0% on arith, or 30% vs 25% on four-option facts, cannot confirm an accuracy claim."""
    rows = [row("arith", "kv_concat", 0.0, tps=12), row("arith", "kv_recompute", 0.0, tps=10),
            row("facts", "kv_concat", 0.30, tps=12, n=20), row("facts", "kv_recompute", 0.25, tps=10, n=20),
            row("code", "kv_concat", 0.60, tps=12), row("code", "kv_recompute", 0.62, tps=10)]
    word, why = verdict(CLAIM["kv_cache"], rows)
    assert word == "holds"
    assert why[0].startswith("arith: not testable, every run at chance (best 0%, chance 0%")
    assert why[1].startswith("code: yes") and why[2].startswith("facts: not testable")
    assert verdict(CLAIM["kv_cache"], rows[:4])[0] == "cannot be tested here"
    rows[1] = row("arith", "kv_recompute", 0.5, tps=10)  # recompute above chance: arith is tested, reuse (0%) fails it
    assert verdict(CLAIM["kv_cache"], rows)[0] == "mixed"
    speed = [row("arith", f"t{v}", 0.0, tpf=t, **{"verifier.token_threshold": v}) for v, t in ((0.1, 2.0), (0.9, 1.0))]
    assert verdict(CLAIM["token_threshold"], speed)[0] == "holds"  # a speed claim is tested at any accuracy


def test_frontier_skips_a_task_where_every_setting_of_a_decoder_has_one_tpf():
    """On code all four ReFusion settings decode at TPF 19.87; arith and facts still decide the claim."""
    arith = [row("arith", "r1", 0.90, tpf=1.5), row("arith", "r2", 0.88, tpf=3.0),
             row("arith", "l1", 0.80, tpf=1.0, decoder="llada"), row("arith", "l2", 0.40, tpf=2.0, decoder="llada")]
    code = [row("code", "r1", 1.0, tpf=19.87), row("code", "r2", 1.0, tpf=19.87),
            row("code", "l1", 0.25, tpf=8.0, decoder="llada"), row("code", "l2", 0.10, tpf=16.0, decoder="llada")]
    word, why = verdict(CLAIM["frontier"], arith + code)
    assert word == "holds" and why[0].startswith("arith: yes")
    assert why[1] == "code: not testable, every refusion setting decodes at TPF 19.87: no TPF range to lose accuracy over"
    assert verdict(CLAIM["frontier"], code)[0] == "cannot be tested here"


def test_frontier_is_not_tested_where_one_decoder_is_at_chance_at_every_tpf():
    """LLaDA at 0% everywhere has no accuracy to lose: 'ReFusion loses more' would be a floor effect."""
    rows = [row("code", "ar", 0.9, decoder="ar"), row("code", "r1", 0.40, tpf=1.2), row("code", "r2", 0.05, tpf=1.6),
            row("code", "l1", 0.0, tpf=2.0, decoder="llada"), row("code", "l2", 0.0, tpf=5.0, decoder="llada")]
    word, why = verdict(CLAIM["frontier"], rows)
    assert word == "cannot be tested here" and why[0].startswith("code: not testable, every llada setting at chance")


def test_doc_only_rewrites_the_document_with_the_tested_scope(tmp_path, monkeypatch):
    monkeypatch.setattr(results_page, "machine", lambda: "test box")
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-x` 0123456789")
    out = tmp_path / "runs"
    (out / "kv_cache").mkdir(parents=True)
    rows = [row("arith", "kv_concat", 0.0, tps=12), row("arith", "kv_recompute", 0.0, tps=10),
            row("code", "kv_concat", 0.6, tps=12), row("code", "kv_recompute", 0.6, tps=10)]
    (out / "kv_cache" / "results.json").write_text(json.dumps(rows))
    (out / "kv_cache" / "samples.jsonl").write_text("".join(json.dumps(
        {"run": r["run"], "task": r["task"], "idx": i, "correct": ok, "wall_s": 0.15, "nfe": 1,
         "generated_tokens": 12 if r["run"] == "kv_concat" else 10}) + "\n"  # reuse 1.2x recompute's tokens/s
        for r in rows for i, ok in r["per_sample"].items()))  # 800 decodes of 0.15 s: 2.0 min
    text = results.run_all(out, tmp_path / "r.md", ["kv_cache"], run=False, command="refusion results --limit 20")
    assert "**holds** (tested on code; at chance on arith) | 2.0 min |" in text
    with pytest.raises(RuntimeError, match="no results.json for \\['scorers'\\]"):
        results.run_all(out, tmp_path / "r.md", ["kv_cache", "scorers"], run=False)


def test_the_page_names_each_shipped_model_by_a_hash_of_its_weights():
    import re

    from refusion.models.loading import shipped_checkpoints

    text = results_page.shipped_models()
    assert [m.group(1) for m in re.finditer(r"`([\w-]+)` [0-9a-f]{10}\b", text)] == shipped_checkpoints()


def test_a_claim_about_accuracy_is_not_tested_where_every_run_is_at_the_ceiling():
    rows = [row("arith", "first_token_prob", 1.0), row("arith", "mean_prob", 1.0), row("arith", "mean_neg_entropy", 1.0),
            row("facts", "first_token_prob", 0.9), row("facts", "mean_prob", 0.91), row("facts", "mean_neg_entropy", 0.9)]
    word, why = verdict(CLAIM["scorers"], rows)
    assert word == "holds" and why[0].startswith("arith: not testable, every run at the ceiling (100%")
    assert verdict(CLAIM["scorers"], rows[:3])[0] == "cannot be tested here"


def test_step_table_compares_each_rung_with_the_one_before_on_shared_samples():
    from refusion.experiments.claims import step_table

    def rec(run, idx, correct, wall):
        return {"run": run, "task": "arith", "idx": idx, "correct": correct, "generated_tokens": 10, "nfe": 5,
                "wall_s": wall}

    records = [rec("0 ref", i, i < 2, 1.0) for i in range(4)] + [rec("1 +a", i, True, 0.5) for i in range(4)]
    records += [rec("2 +b", i, i == 0, 0.5) for i in range(3)]  # one sample short: compared on three
    lines = step_table(records, ["0 ref", "1 +a", "2 +b"])
    assert len(lines) == 4
    assert "| arith | 1 +a | 50.0 -> 100.0 | +50.0 [" in lines[2] and "| 2.00x [2.00, 2.00] |" in lines[2]
    assert "| arith | 2 +b | 100.0 -> 33.3 | -66.7 [" in lines[3] and "| 1.00x [1.00, 1.00] |" in lines[3]


def test_the_page_goes_to_the_output_folder_unless_the_docs_are_asked_for(tmp_path, monkeypatch, capsys):
    """A trial `refusion results` used to overwrite the shipped docs/results.md; now it writes OUT/results.md,
    and only --write-docs rewrites docs/results.md."""
    from refusion.cli import main

    fake_ablations(monkeypatch, "test box")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    run = ["results", "--only", "kv_cache", "--jobs", "2", "--out", "runs/r"]
    assert main(run) == 0
    assert (tmp_path / "runs" / "r" / "results.md").is_file() and not (tmp_path / "docs" / "results.md").exists()
    manifest = json.loads((tmp_path / "runs" / "r" / "manifest.json").read_text())
    assert manifest["command"] == "results" and manifest["inputs"]["ablations"] == ["kv_cache"]
    assert main(run + ["--resume", "--write-docs"]) == 0
    assert "Generated by `refusion results --write-docs --only kv_cache --jobs 2`" in \
        (tmp_path / "docs" / "results.md").read_text()
    assert main(run + ["--write-docs", "--doc", "x.md"]) == 2
    assert "--write-docs" in capsys.readouterr().err


def test_refusion_against_speculative_decoding_is_judged_per_task_against_every_row():
    """Faster than every spec-* row and at least as accurate: yes; slower than one: no; an accuracy gap the
    samples cannot settle: inconclusive. Speed is judged at the accuracy ceiling too."""
    spec = dict(decoder="speculative")
    rows = [row("arith", "refusion", 1.0, tps=30), row("arith", "spec-diffusion", 1.0, tps=20, **spec),
            row("arith", "spec-ngram", 1.0, tps=10, **spec),
            row("code", "refusion", 0.9, tps=15), row("code", "spec-diffusion", 0.9, tps=20, **spec),
            row("facts", "refusion", 0.8, tps=30, n=20), row("facts", "spec-diffusion", 0.9, tps=10, n=20, **spec)]
    word, why = verdict(CLAIM["speculative"], rows)
    assert word == "mixed"
    assert why[0] == ("arith: yes (1.50x [1.50, 1.50] the tokens/s of spec-diffusion, accuracy +0.0 points "
                      "[+0.0, +0.0] (faster, as accurate); 3.00x [3.00, 3.00] the tokens/s of spec-ngram, accuracy "
                      "+0.0 points [+0.0, +0.0] (faster, as accurate))")
    assert why[1].startswith("code: no (0.75x") and why[1].endswith("(slower, as accurate))")
    assert why[2].startswith("facts: inconclusive, 3.00x") and why[2].endswith("(faster, accuracy inconclusive)")


def test_versus_table_counts_token_identical_samples_and_gives_paired_verdicts():
    rows = [row("arith", "refusion", 0.9, tps=30), row("arith", "spec-diffusion", 0.9, tps=20)]
    records = [{"run": run, "task": "arith", "idx": i, "generated_tokens": 2, "nfe": 2, "wall_s": 0.1,
                "token_ids": [1, 3] if (run, i) == ("spec-diffusion", 1) else [1, 2]}
               for run in ("ar", "spec-diffusion") for i in range(3)]
    lines = claims.versus_table(rows, records, "refusion", "spec-", "ar")
    assert lines[2] == "| arith | spec-diffusion | 2/3 | 1.50x [1.50, 1.50] | faster | +0.0 [+0.0, +0.0] | as accurate |"


def test_doc_only_rewrites_a_page_byte_for_byte_from_the_same_outputs(tmp_path, monkeypatch):
    """fixtures/results_page.md is the page the code before the split (claims / page renderer / index) wrote
    from fixtures/results_page/ (kv_cache and the stepped ladder, --limit 2), clock and machine fixed; the
    renderer writes the same bytes, and an index beside the outputs records each section."""
    import shutil
    import time
    from pathlib import Path

    import torch

    fixtures = Path(__file__).parent / "fixtures"
    out = tmp_path / "runs"
    shutil.copytree(fixtures / "results_page", out)
    fixed = time.struct_time((2026, 12, 7, 6, 0, 0, 0, 341, 0))
    monkeypatch.setattr(time, "gmtime", lambda *a: fixed)
    monkeypatch.setattr(results_page, "machine", lambda: "fixture box")
    monkeypatch.setattr(results_page, "shipped_models", lambda: "`tiny-ar` 26f23c19f8, `tiny-refusion` 78ea9a4686")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    doc = tmp_path / "page" / "results.md"
    text = results.run_all(out, doc, ["kv_cache", "ladder"], run=False, command="refusion results --limit 2")
    assert text == doc.read_text() == (fixtures / "results_page.md").read_text()
    index = json.loads((out / "index.json").read_text())["sections"]
    assert list(index) == ["kv_cache", "ladder"] and index["kv_cache"]["date"] == "2026-12-07 06:00 UTC"
    assert index["kv_cache"]["weights"] == {"tiny-refusion": "78ea9a4686"} and index["ladder"]["minutes"] > 0
    assert f"| {index['ladder']['minutes']:.1f} min |" in index["ladder"]["summary_row"]
    assert text.endswith(index["ladder"]["text"])
