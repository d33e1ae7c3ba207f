"""``refusion eval-table``: the main table from the JSON files ``refusion eval --output`` wrote.

::

    refusion eval-table out/refusion out/qwen3 out/llada out/llada-dual [--markdown table.md]

Each argument is a folder of ``refusion eval --output`` files (or one such file); its name labels a
column. A row per task: for each column, the task's score (the metric the paper reports, else the
task's first metric) and the decoder's tokens/s and tokens per forward from the decode statistics.
Tasks a column did not run are left empty.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: the metric the paper reports per task (name prefix, filter); other tasks: their first metric
PAPER_METRICS = {
    "gsm8k_cot": ("exact_match", "strict-match"),
    "minerva_math": ("exact_match", None),
    "mbpp": ("pass_at_1", None),
    "humaneval_instruct": ("pass@1", None),
    "gpqa": ("exact_match", "flexible-extract"),
    "arc_challenge_chat": ("exact_match", None),
    "mmlu_pro": ("exact_match", "custom-extract"),
}


def score(task: str, metrics: dict[str, Any]) -> tuple[str, float] | None:
    """``(metric key, value)`` of ``task``'s reported score in one results entry (``metric,filter`` keys)."""
    values = {k: v for k, v in metrics.items() if "," in k and "_stderr" not in k and isinstance(v, (int, float))}
    if not values:
        return None
    base = task.removeprefix("refusion_")
    for prefix, (metric, flt) in PAPER_METRICS.items():
        if base.startswith(prefix):
            for key, v in values.items():
                name, _, used = key.partition(",")
                if name == metric and (flt is None or used == flt):
                    return key, float(v)
    key = next(iter(values))
    return key, float(values[key])


def load_column(path: Path) -> dict[str, dict[str, Any]]:
    """task -> {score, metric, tokens_per_second, tpf} from the ``--output`` files under ``path``."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        raise FileNotFoundError(f"{path}: no refusion eval --output JSON files here")
    out: dict[str, dict[str, Any]] = {}
    for f in files:
        data = json.loads(f.read_text())
        if "results" not in data:
            raise ValueError(f"{f}: not a refusion eval --output file (no 'results')")
        stats = data.get("refusion", {}).get("stats", {})
        for task, metrics in data["results"].items():
            found = score(task, metrics)
            if found is None:
                continue
            out[task] = {"metric": found[0], "score": found[1], "tokens_per_second": stats.get("tokens_per_second"),
                         "tpf": stats.get("tpf")}
    return out


def table(columns: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Markdown: one row per task (a group's subtasks are left out when the group has a row), per column
    ``score (tok/s, TPF)``."""
    names = {t for col in columns.values() for t in col}
    tasks = sorted(t for t in names if not any(t.startswith(g + "_") for g in names if g != t))
    head = "| task | " + " | ".join(columns) + " |"
    lines = [head, "|---|" + "---|" * len(columns)]
    for task in tasks:
        cells = []
        for col in columns.values():
            c = col.get(task)
            if c is None:
                cells.append("")
                continue
            extra = [f"{c['tokens_per_second']:.1f} tok/s" if c.get("tokens_per_second") else "",
                     f"TPF {c['tpf']:.2f}" if c.get("tpf") else ""]
            extra = ", ".join(e for e in extra if e)
            cells.append(f"{100 * c['score']:.1f}" + (f" ({extra})" if extra else ""))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_eval_table_command(sub: Any) -> None:
    p = sub.add_parser("eval-table", help="the main table from refusion eval --output files",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("columns", nargs="+", help="folders (or files) of refusion eval --output JSON, one per column")
    p.add_argument("--markdown", help="also write the table to this file")
    p.set_defaults(func=cmd_eval_table)


def cmd_eval_table(a: argparse.Namespace) -> int:
    columns = {}
    for item in a.columns:
        path = Path(item)
        columns[path.stem if path.is_file() else path.name] = load_column(path)
    text = table(columns)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    return 0
