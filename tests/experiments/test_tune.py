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


def test_printed_block_is_valid_bench_yaml(tmp_path, capsys):
    """The printed ``tasks:`` block nests dotted knobs and, pasted into bench.yaml, configures the decoder."""
    import json

    import yaml

    from refusion.experiments.bench import load_bench_config
    from refusion.experiments.tune import main

    knobs = {"scorer": "mean_prob", "serial_blocks": 2, "verifier.token_threshold": 0.3,
             "selector.slot_threshold": 0.99}
    grid = {"name": "g", "title": "t", "tasks": ["arith"], "runs": [{"label": "ar", "decoder": "ar"}],
            "grid": {"decoder": "refusion", "set": {"correct": True, "slot_size": 4},
                     "axes": {k: [v] for k, v in knobs.items()}}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    rows = [r("arith", "ar", 0.9, 100), r("arith", "g", 0.9, 200, **knobs)]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert main([str(tmp_path), "--config", str(tmp_path / "grid.yaml")]) == 0
    block = yaml.safe_load(capsys.readouterr().out)
    assert block["tasks"]["arith"]["refusion"] == {  # the grid's shared settings and the axes
        "correct": True, "slot_size": 4, "scorer": "mean_prob", "serial_blocks": 2,
        "verifier": {"token_threshold": 0.3}, "selector": {"slot_threshold": 0.99}}
    bench = load_bench_config().model_copy(update=block)
    cfg = bench.decoder_config("arith", "refusion", 224)
    assert cfg["verifier"]["token_threshold"] == 0.3 and cfg["verifier"]["name"] == "prefix" and cfg["correct"] is True
    assert cfg["slot_size"] == 4 and cfg["serial_blocks"] == 2 and cfg["scorer"] == "mean_prob"
    assert cfg["selector"] == {"name": "threshold", "slot_threshold": 0.99}  # merged into the shared selector


def test_the_printed_row_is_the_grid_decoder(tmp_path, capsys):
    """A grid over another decoder (here llada) prints its picks under that row, not under ``refusion``."""
    import json

    import yaml

    from refusion.experiments.tune import main

    grid = {"name": "g", "title": "t", "tasks": ["arith"], "runs": [{"label": "ar", "decoder": "ar"}],
            "grid": {"decoder": "llada", "axes": {"block_length": [8], "selector.threshold": [0.99]}}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    rows = [r("arith", "ar", 0.9, 100), r("arith", "g", 0.8, 200, block_length=8, **{"selector.threshold": 0.99})]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert main([str(tmp_path), "--config", str(tmp_path / "grid.yaml")]) == 0
    block = yaml.safe_load(capsys.readouterr().out)
    assert block["tasks"]["arith"] == {"llada": {"block_length": 8, "selector": {"threshold": 0.99}}}


def test_results_from_another_grid_are_refused(tmp_path, capsys):
    """Picks from a results.json whose rows lack one of --config's axes: exit 2 naming the axis, no block."""
    import json

    import yaml

    from refusion.experiments.tune import main

    grid = {"name": "g", "title": "t", "tasks": ["arith"], "runs": [{"label": "ar", "decoder": "ar"}],
            "grid": {"decoder": "refusion", "axes": {"scorer": ["mean_prob"], "selector.fallback": ["leftmost"]}}}
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    rows = [r("arith", "ar", 0.9, 100), r("arith", "g", 0.9, 200, scorer="mean_prob")]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert main([str(tmp_path), "--config", str(tmp_path / "grid.yaml")]) == 2
    out = capsys.readouterr()
    assert "tasks:" not in out.out and "selector.fallback" in out.err and "--config" in out.err


def test_a_run_named_in_the_config_prints_its_own_settings(tmp_path, capsys):
    """A grid of runs named one by one (no axes): the chosen run's ``set`` is printed under its decoder."""
    import json

    import yaml

    from refusion.experiments.tune import main

    config = {"name": "g", "title": "t", "tasks": ["arith"], "runs": [
        {"label": "ar", "decoder": "ar"}, {"label": "wide", "decoder": "refusion", "set": {"draft_window": 4}},
        {"label": "narrow", "decoder": "refusion", "set": {"draft_window": 1, "selector.slot_threshold": 0.99}}]}
    (tmp_path / "runs.yaml").write_text(yaml.safe_dump(config))
    rows = [r("arith", "ar", 0.9, 100), r("arith", "wide", 0.9, 200), r("arith", "narrow", 0.9, 300)]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert main([str(tmp_path), "--config", str(tmp_path / "runs.yaml")]) == 0
    block = yaml.safe_load(capsys.readouterr().out)
    assert block["tasks"]["arith"] == {"refusion": {"draft_window": 1, "selector": {"slot_threshold": 0.99}}}
