"""Two runs of one ``refusion ablate`` (or ``refusion bench``) output folder, paired on the same samples.

Per task: run B's accuracy minus run A's, in points, with the 95% paired-bootstrap interval and
McNemar's p. Then, for each run's misses on the reference run's correct samples: in which line its
output first leaves the reference run's (``Total:`` or another), and whether the first number that
differs there differs only in its tens digit (``19`` for ``29``).

    python scripts/paired_runs.py RUN_DIR A B [--reference ar] [--tasks arith,code,facts]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from refusion.experiments.records import load_records
from refusion.experiments.stats import paired_accuracy


def first_difference(reference: str, output: str) -> tuple[str, str]:
    """(``"Total:"`` or ``"other line"``, ``"tens digit"`` / ``"other digits"`` / ``"no number"``): where
    ``output`` first leaves ``reference``, line by line, and how the first differing number differs."""
    for want, got in zip(reference.split("\n") + [""], output.split("\n") + [""]):
        if want == got:
            continue
        line = "Total:" if want.startswith("Total:") else "other line"
        for a, b in zip(re.findall(r"\d+", want), re.findall(r"\d+", got)):
            if a != b:
                only_tens = len(a) == len(b) >= 2 and [i for i in range(len(a)) if a[i] != b[i]] == [len(a) - 2]
                return line, "tens digit" if only_tens else "other digits"
        return line, "no number"
    return "other line", "no number"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--reference", default="ar", help="the run whose outputs the misses are compared with")
    ap.add_argument("--tasks", default=None, help="comma-separated tasks (default: every task in the folder)")
    args = ap.parse_args(argv)
    rows = load_records(args.run_dir / "samples.jsonl")
    by_key = {(r["run"], r["task"], r["idx"]): r for r in rows}
    tasks = args.tasks.split(",") if args.tasks else sorted({r["task"] for r in rows})
    for task in tasks:
        both = sorted(i for (run, t, i) in by_key if run == args.a and t == task and (args.b, t, i) in by_key)
        if not both:
            print(f"error: no sample of task {task!r} holds both runs {args.a!r} and {args.b!r} in {args.run_dir}",
                  file=sys.stderr)
            return 2
        paired = paired_accuracy([by_key[(args.a, task, i)]["correct"] for i in both],
                                 [by_key[(args.b, task, i)]["correct"] for i in both])
        d = paired.difference
        print(f"{task}: {args.b} - {args.a} = {100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] points, "
              f"McNemar p {paired.p_value:.3f}, n {paired.n}")
        for run in (args.a, args.b):
            kinds: collections.Counter[tuple[str, str]] = collections.Counter()
            for i in both:
                mine, ref = by_key[(run, task, i)], by_key.get((args.reference, task, i))
                if not mine["correct"] and ref is not None and ref["correct"]:
                    kinds[first_difference(ref["completion"], mine["completion"])] += 1
            total = sum(kinds.values())
            in_total = sum(n for (line, _), n in kinds.items() if line == "Total:")
            tens = sum(n for (_, how), n in kinds.items() if how == "tens digit")
            print(f"  {run}: {total} misses where {args.reference} is right; first difference in the Total: line "
                  f"{in_total}, only in a tens digit {tens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
