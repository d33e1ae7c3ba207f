"""ReFusion against speculative decoding, from bench folders: per task and speculative row, whether every
sample's tokens equal AR greedy's (lossless), the paired tokens/s ratio against ``ar`` and against
``refusion`` with 95% paired-bootstrap intervals (units: samples at batch size 1, batch chunks above), and
the paired accuracy difference against ``refusion``.

    refusion bench --decoders ar,refusion,spec-diffusion,spec-draft,spec-ngram --limit 50 --out runs/bench_spec
    python scripts/spec_report.py runs/bench_spec [runs/bench_spec_b16 ...]

A verdict per task: "ReFusion faster" / "speculative faster" when the interval of refusion's tokens/s over
the row's lies wholly above / below 1, else "inconclusive"; accuracy as the bench judges it (a 2-point goal).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from refusion.experiments.records import SampleRecord, load_records, sample_records
from refusion.experiments.stats import paired_accuracy, throughput_ratio
from refusion.experiments.tables import markdown


def load(folder: Path) -> dict[tuple[str, str], dict[int, SampleRecord]]:
    """(run, task) -> sample index -> its record."""
    by: dict[tuple[str, str], dict[int, SampleRecord]] = defaultdict(dict)
    for r in sample_records(load_records(folder / "samples.jsonl")):
        by[(r.run, r.task)][r.idx] = r
    return by


def units(records: dict[int, SampleRecord], keys: list[int]) -> tuple[list[float], list[float]]:
    """(tokens, seconds) per unit of ``keys``' samples: each sample at batch size 1; each batch chunk above
    (its samples' tokens over the chunk's wall time: aggregate throughput, as the bench reports it)."""
    if (records[keys[0]].batch_size or 1) == 1:
        return [records[i].generated_tokens for i in keys], [records[i].wall_s for i in keys]
    chunks: dict[int, list[SampleRecord]] = defaultdict(list)
    for i in keys:
        chunks[records[i].batch].append(records[i])
    order = sorted(chunks)
    return [sum(r.generated_tokens for r in chunks[c]) for c in order], [chunks[c][0].batch_wall_s for c in order]


def report(folder: Path) -> list[str]:
    by = load(folder)
    manifest = json.loads((folder / "manifest.json").read_text()) if (folder / "manifest.json").exists() else {}
    first = next(iter(next(iter(by.values())).values()))
    batch = manifest.get("inputs", {}).get("batch_size") or first.batch_size or 1
    tasks = sorted({t for _, t in by}, key=lambda t: ("arith", "code", "facts").index(t.split("_")[0]) * 2 + ("_" in t))
    spec_runs = sorted({r for r, _ in by if r.startswith("spec-")})
    body = []
    for task in tasks:
        ar, rf = by.get(("ar", task), {}), by.get(("refusion", task), {})
        for run in spec_runs:
            sp = by.get((run, task), {})
            shared = sorted(set(sp) & set(ar))
            same = sum(sp[i].token_ids == ar[i].token_ids for i in shared)
            vs_ar = throughput_ratio(*units(ar, shared), *units(sp, shared))
            both = sorted(set(sp) & set(rf))
            if both:
                rf_over = throughput_ratio(*units(sp, both), *units(rf, both))
                acc = paired_accuracy([sp[i].correct for i in both], [rf[i].correct for i in both])
                faster = ("ReFusion faster" if rf_over.low > 1 else "speculative faster" if rf_over.high < 1
                          else "inconclusive")
                within = "within 2 points" if acc.difference.low > -0.02 else \
                    "ReFusion less accurate" if acc.difference.high < 0 else "accuracy inconclusive"
                rf_cell = f"{rf_over.value:.2f}x [{rf_over.low:.2f}, {rf_over.high:.2f}]"
                d = acc.difference
                acc_cell = f"{100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"
                verdict = f"{faster}; {within}"
            else:
                rf_cell = acc_cell = verdict = "-"
            body.append([task, run, f"{same}/{len(shared)}", f"{vs_ar.value:.2f}x [{vs_ar.low:.2f}, {vs_ar.high:.2f}]",
                         rf_cell, acc_cell, verdict])
    table = markdown(["task", "run", "identical to ar", "tokens/s vs ar [95%]", "refusion's tokens/s over it [95%]",
                      "acc vs refusion, points [95%]", "verdict"], body)
    return [f"{folder} (batch size {batch})", "", *table.splitlines()]


def main() -> None:
    for folder in sys.argv[1:]:
        print("\n".join(report(Path(folder))))
        print()


if __name__ == "__main__":
    main()
