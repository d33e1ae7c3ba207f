"""The evaluation engine shared by ``refusion bench`` and ``refusion ablate``.

A run is a labelled decoder configuration on a model; the engine decodes every sample of every task
with every run, interleaved per sample (so machine noise hits all runs alike), appends each finished
sample to ``samples.jsonl`` at once (flushed), skips finished samples on ``resume``, and summarises one
row per (run, task): accuracy, tokens/s (total tokens / total decode time) and its per-sample median,
TPF (tokens / forwards), mean NFE, mean latency, and the speed-up over a baseline run measured in the
same run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from refusion.core.config import ConfigError, build_decoder, validate_config
from refusion.experiments.records import RecordWriter, done_keys, load_records
from refusion.models.loading import RuntimeOptions

KEY = ("run", "task", "idx")


@dataclass
class Run:
    """One labelled configuration: ``configs[task]`` is the full decoder config used on that task."""

    label: str
    model: str
    configs: dict[str, dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)  # the swept values, for tables and plots

    @property
    def decoder(self) -> str:
        return next(iter(self.configs.values()))["decoder"]


def summarize(records: list[dict[str, Any]], runs: list[Run], baseline: str | None = None) -> list[dict[str, Any]]:
    """One row per (run, task), in run order; ``speedup`` = tokens/s over the baseline run's on that task."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["run"], r["task"]), []).append(r)
    rows = []
    for run in runs:
        for task in sorted({t for (lbl, t) in groups if lbl == run.label}):
            rs = groups[run.label, task]
            tokens, wall = sum(r["generated_tokens"] for r in rs), sum(r["wall_s"] for r in rs)
            nfe = sum(r["nfe"] for r in rs)
            rows.append({
                "run": run.label, "task": task, "decoder": run.decoder, "model": run.model, **run.params, "n": len(rs),
                "accuracy": sum(r["correct"] for r in rs) / len(rs),
                "tokens_per_second": tokens / wall if wall else 0.0,
                "tokens_per_second_median": statistics.median(r["generated_tokens"] / r["wall_s"] for r in rs),
                "tpf": tokens / nfe if nfe else 0.0,
                "nfe_mean": nfe / len(rs),
                "latency_s_mean": wall / len(rs),
                "generated_tokens_mean": tokens / len(rs),
            })
    base = {r["task"]: r["tokens_per_second"] for r in rows if r["run"] == baseline}
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / base[r["task"]] if base.get(r["task"]) else None
    return rows


def set_threads(threads: int | None) -> None:
    """Decode with ``threads`` torch CPU threads (None: torch's default, one per core). Beside another busy
    process use 1: a 2-thread decode sharing a core with a 1-thread training job spin-waits (arith AR
    decodes: median 4.19 s against 0.15 s with one thread, 2-core CPU, docs/bench.md)."""
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"--threads: must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def evaluate(
    runs: list[Run], tasks: list[str], split: str, limit: int | None, out: Path, resume: bool = False,
    runtime: RuntimeOptions | None = None, desc: str = "eval", on_record: Callable[[dict], None] | None = None,
) -> list[dict[str, Any]]:
    """Decode every sample of every task with every run; return all records (old and new). Every model
    loads with ``runtime`` (default: the CPU in float32), checked before any model loads."""
    from refusion.models.tokenizer import encode_prompt
    from refusion.models.backend import Backbone
    from refusion.tasks import get_task

    runtime = runtime or RuntimeOptions()
    runtime.resolve()  # an unavailable option fails before any work

    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"run labels must be unique: {labels}")
    task_objs = [get_task(t) for t in tasks]
    out.mkdir(parents=True, exist_ok=True)
    samples_path = out / "samples.jsonl"
    if samples_path.exists() and not resume:
        raise ConfigError(f"{samples_path} exists: pass --resume to continue that run, or choose another --out")
    for run in runs:  # validate every config before loading or decoding anything
        for t in tasks:
            validate_config(run.configs[t])
    records = load_records(samples_path)
    done = done_keys(records, KEY)

    backbones: dict[str, Backbone] = {}
    decoders = {}
    for run in runs:
        if run.model not in backbones:
            backbones[run.model] = Backbone.from_pretrained(run.model, **runtime.model_dump())
        for t in tasks:
            decoders[run.label, t] = build_decoder(backbones[run.model], run.configs[t])
    examples = {t.name: t.examples(split, limit) for t in task_objs}
    todo = [(t, i, run) for t in task_objs for i in range(len(examples[t.name])) for run in runs
            if (run.label, t.name, i) not in done]
    if todo:
        for run in runs:  # warm-up, untimed, so the first timed sample pays no one-off costs
            t0 = task_objs[0]
            decoders[run.label, t0.name].generate(encode_prompt(backbones[run.model].tokenizer, examples[t0.name][0].query))
    with RecordWriter(samples_path) as writer:
        for task, i, run in tqdm(todo, desc=desc, unit="decode", dynamic_ncols=True):
            ex = examples[task.name][i]
            res = decoders[run.label, task.name].generate(encode_prompt(backbones[run.model].tokenizer, ex.query))
            rec = {"run": run.label, "task": task.name, "idx": i, "decoder": run.decoder, "model": run.model,
                   "correct": bool(task.score(ex, res.text)), "generated_tokens": res.stats.generated_tokens,
                   "nfe": res.stats.nfe, "wall_s": res.stats.wall_s, "completion": res.text,
                   "token_ids": res.token_ids}
            writer.write(rec)
            records.append(rec)
            if on_record:
                on_record(rec)
    wanted = {(r.label, t) for r in runs for t in tasks}
    return [r for r in records if (r["run"], r["task"]) in wanted]


def print_table(rows: list[dict[str, Any]], title: str, extra: list[str] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [("task", "task"), ("run", "run"), *[(k, k) for k in extra], ("n", "n"), ("accuracy", "acc %"),
            ("tokens_per_second", "tok/s"), ("tpf", "TPF"), ("nfe_mean", "NFE"), ("latency_s_mean", "latency s"),
            ("speedup", "speed-up")]
    for _, head in cols:
        table.add_column(head, justify="left" if head in ("task", "run") else "right")
    for r in sorted(rows, key=lambda r: r["task"]):
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append("-" if v is None else f"{100 * v:.1f}" if key == "accuracy" else
                         f"{v:.2f}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    Console().print(table)


def markdown_table(rows: list[dict[str, Any]], extra: list[str] = ()) -> str:
    cols = ["task", "run", *extra, "n", "accuracy", "tokens_per_second", "tpf", "nfe_mean", "latency_s_mean", "speedup"]
    heads = ["task", "run", *extra, "n", "acc %", "tok/s", "TPF", "NFE", "latency s", "speed-up"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in sorted(rows, key=lambda r: r["task"]):
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{100 * v:.1f}" if c == "accuracy" else
                         f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(rows, indent=1))
