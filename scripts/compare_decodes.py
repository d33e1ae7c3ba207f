"""Compare two folders written by scripts/record_decodes.sh, sample by sample.

    python scripts/compare_decodes.py runs/before runs/after [--show 10]

For every ``samples.jsonl`` under both folders (the bench and each ablation), matches samples by
(folder, run, task, idx) and compares generated token ids, NFE and correctness. Prints one line per
folder and run (samples compared, identical token ids, identical NFE, accuracy before and after) and
each differing sample (up to ``--show`` per run) with the first position where the tokens differ.
Exits 1 if any sample differs, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict[tuple[str, str, str, int], dict]:
    out = {}
    for path in sorted(folder.glob("*/samples.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[path.parent.name, r["run"], r["task"], r["idx"]] = r
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--show", type=int, default=10, help="differing samples to print per run")
    args = ap.parse_args(argv)
    before, after = load(args.before), load(args.after)
    if not before or not after:
        ap.error("no */samples.jsonl under one of the folders")
    groups: dict[tuple[str, str, str], list[tuple[dict, dict]]] = defaultdict(list)
    for key in sorted(before.keys() & after.keys()):
        groups[key[:3]].append((before[key], after[key]))
    missing = len(before.keys() ^ after.keys())
    total = differing = 0
    print(f"{'folder':<16} {'run':<28} {'task':<6} {'n':>4} {'same ids':>8} {'same nfe':>8} {'acc before':>10} {'acc after':>9}")
    for (folder, run, task), pairs in groups.items():
        same_ids = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
        same_nfe = sum(a["nfe"] == b["nfe"] for a, b in pairs)
        acc = [100 * sum(r["correct"] for r in side) / len(pairs) for side in zip(*pairs)]
        print(f"{folder:<16} {run[:28]:<28} {task:<6} {len(pairs):>4} {same_ids:>8} {same_nfe:>8} {acc[0]:>9.1f}% {acc[1]:>8.1f}%")
        total += len(pairs)
        shown = 0
        for a, b in pairs:
            if a["token_ids"] != b["token_ids"] or a["nfe"] != b["nfe"]:
                differing += 1
                if shown < args.show:
                    shown += 1
                    at = first_difference(a["token_ids"], b["token_ids"])
                    print(f"    idx {a['idx']}: nfe {a['nfe']} -> {b['nfe']}, correct {a['correct']} -> {b['correct']}, "
                          f"tokens differ from position {at}: {a['completion'][:60]!r} -> {b['completion'][:60]!r}")
    print(f"\n{total} samples compared, {differing} differ, {missing} present in only one folder")
    return 1 if differing or missing else 0


if __name__ == "__main__":
    sys.exit(main())
