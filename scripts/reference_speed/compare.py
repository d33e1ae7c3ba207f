"""Compare the reference's and our results (``run_reference.py`` / ``run_ours.py``) prompt by prompt.

    python scripts/reference_speed/compare.py OUT/reference.json OUT/ours.json [--show 5] [--json OUT/summary.json]

Prints a markdown table, per task and over all tasks: prompts compared, how many outputs are
token-identical, the median over prompts of (reference seconds / our seconds) with a 95% percentile
bootstrap interval (10,000 resamples of the prompts, seed 0), and the total-time ratio (sum of reference
seconds / sum of ours). A ratio above 1 means ours is faster. Then the differing outputs, each with its
first differing position. Needs only the standard library (runs under either environment).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

N_BOOT = 10_000


def bootstrap_median_ci(values: list[float], level: float = 0.95, n_boot: int = N_BOOT,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values``."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(n_boot))
    alpha = (1.0 - level) / 2.0
    lo = meds[int(alpha * n_boot)]
    hi = meds[min(n_boot - 1, int((1.0 - alpha) * n_boot))]
    return (lo, hi)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def pair_results(ref: dict, ours: dict) -> dict[str, list[tuple[dict, dict]]]:
    """(reference record, our record) per task, matched on (task, index), in our order."""
    by_key = {(r["task"], r["index"]): r for r in ref["results"]}
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for o in ours["results"]:
        r = by_key.get((o["task"], o["index"]))
        if r is not None:
            pairs.setdefault(o["task"], []).append((r, o))
    return pairs


def summarize_pairs(pairs: list[tuple[dict, dict]], time_field: str = "wall_s") -> dict:
    ratios = [r["wall_s"] / o[time_field] for r, o in pairs if o[time_field] > 0]
    ref_total = sum(r["wall_s"] for r, _ in pairs)
    ours_total = sum(o[time_field] for _, o in pairs)
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "prompts": len(pairs),
        "identical": sum(r["token_ids"] == o["token_ids"] for r, o in pairs),
        "median_ratio": statistics.median(ratios) if ratios else float("nan"),
        "ci_low": lo,
        "ci_high": hi,
        "total_ratio": ref_total / ours_total if ours_total > 0 else float("nan"),
        "reference_total_s": ref_total,
        "ours_total_s": ours_total,
    }


def summarize(ref: dict, ours: dict, time_field: str = "wall_s") -> dict[str, dict]:
    """Per task (in our order), ``all``, and ``all, identical outputs`` (only the prompts whose outputs are
    the same token ids, so both decoders did the same decoding work): the summary of :func:`summarize_pairs`."""
    pairs = pair_results(ref, ours)
    rows = {task: summarize_pairs(p, time_field) for task, p in pairs.items()}
    every = [x for p in pairs.values() for x in p]
    if len(pairs) > 1:
        rows["all"] = summarize_pairs(every, time_field)
    same = [(r, o) for r, o in every if r["token_ids"] == o["token_ids"]]
    if same and len(same) < len(every):
        rows["all, identical outputs"] = summarize_pairs(same, time_field)
    return rows


def causes(r: dict) -> list[str]:
    """What in a reference record points to one of the deliberate differences (docs/refusion.md)."""
    out = []
    if r.get("empty_positions"):
        out.append(f"reference left positions {r['empty_positions'][:12]} empty (difference 1: EOS in Stage II-b)")
    extra = r.get("raw_len", len(r["token_ids"])) - len(r["token_ids"])
    if extra > 0:
        out.append(f"reference returned {extra} token(s) past the cut (difference 2: output cut at the first EOS "
                   "and at gen_length)")
    if r.get("contains_mask"):
        out.append("reference output holds [MASK] (difference 3)")
    return out


def differing(ref: dict, ours: dict) -> list[dict]:
    out = []
    for task, pairs in pair_results(ref, ours).items():
        for r, o in pairs:
            pos = first_difference(r["token_ids"], o["token_ids"])
            if pos is not None:
                out.append({"task": task, "index": o["index"], "first_difference": pos,
                            "reference_len": len(r["token_ids"]), "ours_len": len(o["token_ids"]),
                            "causes": causes(r), "positions_recorded": "empty_positions" in r,
                            "reference": r["token_ids"][max(0, pos - 3): pos + 8],
                            "ours": o["token_ids"][max(0, pos - 3): pos + 8]})
    return out


def table(rows: dict[str, dict]) -> str:
    lines = ["| task | prompts | identical | median ratio ref/ours | 95% CI | total ratio | ref total s | ours total s |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for task, s in rows.items():
        lines.append(f"| {task} | {s['prompts']} | {s['identical']} | {s['median_ratio']:.2f}x | "
                     f"{s['ci_low']:.2f}-{s['ci_high']:.2f}x | {s['total_ratio']:.2f}x | "
                     f"{s['reference_total_s']:.2f} | {s['ours_total_s']:.2f} |")
    return "\n".join(lines)


def header(ref: dict, ours: dict) -> str:
    def side(d: dict) -> str:
        v = d.get("versions", {})
        extra = f", commit {d['reference_commit'][:7]}" if d.get("reference_commit") else ""
        return (f"{d.get('decoder')}: torch {v.get('torch')}, transformers {v.get('transformers')}, "
                f"{d.get('threads')} thread(s){extra}")
    settings = ours.get("settings", {})
    lines = [f"model {ours.get('model')} (vocabulary {ours.get('vocab_size')})", side(ref), side(ours)]
    for task, s in settings.items():
        lines.append(f"{task}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    if ref.get("settings") and ref["settings"] != settings:
        lines.append("WARNING: the two result files were made with different settings")
    if ref.get("model") != ours.get("model"):
        lines.append(f"WARNING: different models ({ref.get('model')} vs {ours.get('model')})")
    return "\n".join(f"- {line}" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="run_reference.py's results")
    parser.add_argument("ours", help="run_ours.py's results")
    parser.add_argument("--time-field", default="wall_s", choices=["wall_s", "call_s"],
                        help="our timing: the decoder's own wall_s (default) or perf_counter around generate()")
    parser.add_argument("--show", type=int, default=10, help="differing outputs to list")
    parser.add_argument("--json", help="also write the summary and the differing cases here")
    args = parser.parse_args(argv)

    ref = json.loads(Path(args.reference).read_text())
    ours = json.loads(Path(args.ours).read_text())
    rows = summarize(ref, ours, args.time_field)
    diffs = differing(ref, ours)
    print(header(ref, ours))
    print()
    print(table(rows))
    print()
    print(f"Ratios: reference seconds / our seconds (above 1: ours is faster); our time is {args.time_field}.")
    if diffs:
        print()
        explained = sum(bool(d["causes"]) for d in diffs)
        print(f"{len(diffs)} differing output(s), {explained} with a deliberate difference found in the reference's "
              f"record; first {min(len(diffs), args.show)}:")
        print()
        for d in diffs[: args.show]:
            why = "; ".join(d["causes"]) or ("no deliberate difference found" if d["positions_recorded"] else
                                            "cause unknown (run run_reference.py with --positions)")
            print(f"- {d['task']}[{d['index']}]: first difference at token {d['first_difference']}, lengths "
                  f"ref {d['reference_len']} / ours {d['ours_len']}; ref ...{d['reference']} / "
                  f"ours ...{d['ours']}; {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": rows, "differing": diffs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
