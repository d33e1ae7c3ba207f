"""scripts/reference_speed/compare.py on small synthetic result files (no reference code needed)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[2] / "scripts" / "reference_speed" / "compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("reference_speed_compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def results(decoder: str, rows: list[tuple[str, int, list[int], float]]) -> dict:
    return {"decoder": decoder, "model": "/m", "vocab_size": 1024, "threads": 1,
            "settings": {"arith": {"gen_length": 8}, "code": {"gen_length": 8}},
            "results": [{"task": t, "index": i, "token_ids": ids, "wall_s": s} for t, i, ids, s in rows]}


# arith: 3 prompts, 2 identical, ratios 2, 4, 3; code: 2 prompts, both identical, ratios 1 and 1
REF = results("reference", [("arith", 0, [5, 6, 0], 2.0), ("arith", 1, [7, 0], 4.0), ("arith", 2, [9, 9, 9], 3.0),
                            ("code", 0, [1], 1.0), ("code", 1, [2, 0], 2.0)])
OURS = results("ours", [("arith", 0, [5, 6, 0], 1.0), ("arith", 1, [7, 0], 1.0), ("arith", 2, [9, 8, 9, 0], 1.0),
                        ("code", 0, [1], 1.0), ("code", 1, [2, 0], 2.0)])


def test_counts_ratios_and_interval(compare):
    rows = compare.summarize(REF, OURS)
    assert list(rows) == ["arith", "code", "all", "all, identical outputs"]
    a, c, total, same = rows["arith"], rows["code"], rows["all"], rows["all, identical outputs"]
    assert (same["prompts"], same["identical"]) == (4, 4)
    assert same["median_ratio"] == pytest.approx(statistics.median([2, 4, 1, 1]))
    assert (a["prompts"], a["identical"]) == (3, 2)
    assert (c["prompts"], c["identical"]) == (2, 2)
    assert (total["prompts"], total["identical"]) == (5, 4)
    assert a["median_ratio"] == pytest.approx(3.0)
    assert a["total_ratio"] == pytest.approx(9.0 / 3.0)
    assert c["median_ratio"] == pytest.approx(1.0) and c["total_ratio"] == pytest.approx(1.0)
    assert c["ci_low"] == c["ci_high"] == pytest.approx(1.0)  # every resample has median 1
    assert 2.0 <= a["ci_low"] <= a["median_ratio"] <= a["ci_high"] <= 4.0
    assert total["median_ratio"] == pytest.approx(statistics.median([2, 4, 3, 1, 1]))
    assert total["total_ratio"] == pytest.approx(12.0 / 6.0)


def test_bootstrap_interval_is_reproducible_and_covers_the_median(compare):
    values = [0.5, 0.9, 1.1, 1.2, 1.3, 1.5, 2.0, 2.5]
    lo, hi = compare.bootstrap_median_ci(values)
    assert (lo, hi) == compare.bootstrap_median_ci(values)
    assert min(values) <= lo <= statistics.median(values) <= hi <= max(values)
    assert compare.bootstrap_median_ci([2.0]) == (2.0, 2.0)


def test_first_difference(compare):
    assert compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert compare.first_difference([1, 2], [1, 2, 0]) == 2


def test_main_prints_table_and_differing_cases(compare, tmp_path, capsys):
    (tmp_path / "ref.json").write_text(json.dumps(REF))
    (tmp_path / "ours.json").write_text(json.dumps(OURS))
    assert compare.main([str(tmp_path / "ref.json"), str(tmp_path / "ours.json"),
                         "--json", str(tmp_path / "summary.json")]) == 0
    out = capsys.readouterr().out
    assert "| arith | 3 | 2 | 3.00x |" in out
    assert "| code | 2 | 2 | 1.00x |" in out
    assert "1 differing output(s)" in out and "arith[2]: first difference at token 1" in out
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["summary"]["all"]["identical"] == 4 and len(saved["differing"]) == 1
