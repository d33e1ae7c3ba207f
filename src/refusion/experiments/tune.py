"""Pick a bench row's per-task settings from a validation-split grid (``tune_refusion.yaml``, ``tune_llada.yaml``; shipped grids by name).

Rule (docs/bench.md): per task, the fastest run (tokens/s) whose validation accuracy is within
``tolerance`` of the baseline's (AR greedy, same run); if none is, the most accurate run (ties: the
faster). ``python -m refusion.experiments.tune runs/ablate/tune_refusion`` prints the picks and the
``tasks:`` block to paste into ``configs/bench/bench.yaml``: the grid's shared ``set`` values and the chosen
run's axis values, or, for a run the config names one by one, that run's ``set``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from refusion.experiments.ablate import load_ablation


def pick(rows: list[dict[str, Any]], baseline: str = "ar", tolerance: float = 0.02) -> dict[str, dict[str, Any]]:
    """``task -> chosen row`` among the non-baseline rows of an ablation's ``results.json``."""
    chosen = {}
    for task in sorted({r["task"] for r in rows}):
        base = next((r for r in rows if r["task"] == task and r["run"] == baseline), None)
        if base is None:
            raise ValueError(f"no {baseline!r} row for task {task!r}")
        cands = [r for r in rows if r["task"] == task and r["run"] != baseline]
        if not cands:
            raise ValueError(f"no candidate runs for task {task!r}")
        good = [r for r in cands if r["accuracy"] >= base["accuracy"] - tolerance - 1e-9]
        chosen[task] = (max(good, key=lambda r: r["tokens_per_second"]) if good else
                        max(cands, key=lambda r: (r["accuracy"], r["tokens_per_second"])))
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refusion.experiments.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="the tuning ablation's output folder (with results.json)")
    p.add_argument("--config", default="tune_refusion.yaml",
                   help="the grid's ablation config (its shared settings and axes are the knobs)")
    p.add_argument("--baseline", default="ar")
    p.add_argument("--tolerance", type=float, default=0.02, help="accuracy below the baseline allowed (0-1)")
    a = p.parse_args(argv)
    rows = json.loads((Path(a.folder) / "results.json").read_text())
    chosen = pick(rows, a.baseline, a.tolerance)
    base = {r["task"]: r for r in rows if r["run"] == a.baseline}
    ablation = load_ablation(a.config)
    grid, named = ablation.grid, {spec.label: spec for spec in ablation.runs}
    unknown = sorted({r["run"] for r in chosen.values() if r["run"] not in named and grid is None})
    missing = [key for key in (grid.axes if grid else ()) if any(key not in r for r in chosen.values()
                                                                  if r["run"] not in named)]
    if missing or unknown:
        print(f"error: {a.folder}/results.json has no column for axes {missing} or no run {unknown} of --config "
              f"{a.config}; pass the ablation config that made it", file=sys.stderr)
        return 2
    print("tasks:")
    for task, r in chosen.items():
        knobs: dict[str, Any] = {}
        if r["run"] in named:  # a run named in the config: its own settings
            decoder, settings = named[r["run"]].decoder, list(named[r["run"]].set.items())
        else:  # a grid point: the grid's shared settings and its axis values
            decoder, settings = grid.decoder, [*grid.set.items(), *((key, r[key]) for key in grid.axes)]
        for key, value in settings:  # dotted keys nest, as bench.yaml's task overrides expect
            *parents, leaf = key.split(".")
            node = knobs
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        print(f"  {task}:  # {r['run']}: acc {100 * r['accuracy']:.1f}% vs {a.baseline} "
              f"{100 * base[task]['accuracy']:.1f}%, {r['tokens_per_second']:.1f} tok/s, TPF {r['tpf']:.2f}")
        print(f"    {decoder}: {json.dumps(knobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
