"""Choosing the bench's per-task ReFusion settings from a validation grid."""

import pytest

from refusion.experiments.tune import pick


def r(task, run, acc, tps, **params):
    return {"task": task, "run": run, "accuracy": acc, "tokens_per_second": tps, "tpf": 1.0, **params}


def test_fastest_within_tolerance_else_most_accurate():
    rows = [r("arith", "ar", 0.90, 100), r("arith", "a", 0.90, 150), r("arith", "b", 0.885, 300),
            r("arith", "c", 0.80, 900),
            r("code", "ar", 0.95, 100), r("code", "x", 0.70, 500), r("code", "y", 0.75, 200), r("code", "z", 0.75, 250)]
    chosen = pick(rows)
    assert chosen["arith"]["run"] == "b"  # 0.885 is within 2 points of 0.90; "c" is faster but not
    assert chosen["code"]["run"] == "z"  # none within 2 points: most accurate, then faster
    assert pick(rows, tolerance=0.0)["arith"]["run"] == "a"


def test_missing_baseline_is_an_error():
    with pytest.raises(ValueError, match="no 'ar' row for task 'facts'"):
        pick([r("facts", "a", 1.0, 1.0)])
