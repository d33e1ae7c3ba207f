"""``refusion bench``: every decoder on every tinybench task with its shipped checkpoint.

Each decoder runs on its own model (``configs/bench/bench.yaml``: refusion on tiny-refusion, ar on tiny-ar,
llada on tiny-mdm, block on tiny-block) with per-task settings chosen on the validation split. The
engine (``runner.py``) interleaves decoders per sample, records each sample as it finishes and resumes
with ``--resume``. The config's optional ``runtime:`` mapping (device, dtype, attn_implementation,
device_map) says how models load; ``--device`` / ``--dtype`` / ``--attn-implementation`` / ``--device-map``
override it option by option. ``--batch-size N`` (or the config's ``batch_size:``) decodes the samples
of each task in chunks of N through ``Decoder.generate_batch``; tokens/s is then the aggregate
throughput and each row says its ``batch_size``. ``--jobs N`` decodes in N one-thread worker processes,
each a share of the samples (:mod:`refusion.experiments.sharding`). Writes ``results.json`` (one row per task x decoder,
schema in docs/bench.md), prints the table and plots accuracy against tokens/s per task (``bench.png`` /
``bench.svg``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from refusion.core.config import ConfigError, apply_overrides
from refusion.core.threads import set_threads
from refusion.experiments.config_files import CONFIGS_DIR, find_config
from refusion.experiments.runner import Run, check_batch_size, evaluate, print_table, summarize, write_json
from refusion.models.loading import RuntimeOptions, runtime_from_args

DEFAULT_CONFIG = CONFIGS_DIR / "bench" / "bench.yaml"
GOAL_SPEEDUP, GOAL_POINTS = 2.0, 2.0  # the paper's claim: >= 2x AR's tokens/s, accuracy within 2 points of AR's


class BenchRow(BaseModel):
    """A bench row not named after its decoder (e.g. ``refusion-paper``: the ``refusion`` decoder)."""
    model_config = ConfigDict(extra="forbid")
    decoder: str = Field(description="the registered decoder the row runs")
    limit: int | None = Field(None, ge=1, description="at most this many samples per task (a slow row)")


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: dict[str, str] = Field(description="row (a decoder name or a label under rows:) -> model folder or "
                                               "shipped checkpoint; the rows run in this order")
    rows: dict[str, BenchRow] = Field(default_factory=dict, description="row label -> its decoder and sample limit, "
                                                                      "for rows not named after their decoder")
    decoders: dict[str, dict[str, Any]] = Field(default_factory=dict, description="row -> shared settings")
    tasks: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict, description="task -> row -> overrides")
    runtime: RuntimeOptions = Field(default_factory=RuntimeOptions,
                                    description="device, dtype, attn_implementation, device_map, compile (flags override)")
    batch_size: int = Field(1, ge=1, description="samples per Decoder.generate_batch call (--batch-size overrides)")

    @model_validator(mode="after")
    def _rows_have_models(self) -> "BenchConfig":
        for field, keys in (("rows", self.rows), ("decoders", self.decoders),
                            *((f"tasks.{t}", rows) for t, rows in self.tasks.items())):
            stray = [k for k in keys if k not in self.models]
            if stray:
                raise ValueError(f"{field}: rows {stray} have no model under models: (rows: {', '.join(self.models)})")
        return self

    @property
    def decoder_rows(self) -> list[str]:
        """One row per decoder (what profile and batch-bench run by default): the row named after it, else
        (a decoder whose rows all have labels, such as speculative's spec-*) its first row."""
        named = {row for row in self.models if row not in self.rows}
        out, seen = [], set(named)
        for row in self.models:
            decoder = self.decoder_of(row)
            if row in named or decoder not in seen:
                out.append(row)
                seen.add(decoder)
        return out

    def decoder_of(self, row: str) -> str:
        return self.rows[row].decoder if row in self.rows else row

    def decoder_config(self, task: str, row: str, gen_length: int, overrides: list[str] = ()) -> dict[str, Any]:
        """The row's shared settings, then the task's overrides for the row (a harder level without its own:
        its base task's), then ``overrides``: ``key=value`` for every row, ``ROW:key=value`` for row ``ROW``
        only (:func:`row_overrides`)."""
        from refusion.tasks import get_task

        cfg = {"decoder": self.decoder_of(row), "gen_length": gen_length, **self.decoders.get(row, {})}
        per_task = self.tasks.get(task) or self.tasks.get(get_task(task).split_name, {})
        for key, value in per_task.get(row, {}).items():
            cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) and isinstance(value, dict) else value
        return apply_overrides(cfg, row_overrides(overrides, row))


def split_row(item: str) -> tuple[str | None, str]:
    """``"ROW:key=value"`` -> ``("ROW", "key=value")``; ``"key=value"`` -> ``(None, "key=value")`` (a ``:``
    after the ``=`` belongs to the value)."""
    key, sep, _ = item.partition("=")
    row, colon, rest = key.partition(":")
    if sep and colon and row.strip():
        return row.strip(), item[len(row) + 1:].lstrip()
    return None, item


def row_overrides(overrides: list[str], row: str) -> list[str]:
    """The ``--set`` items that apply to ``row``: the plain ones and its own ``ROW:key=value`` ones, in order."""
    out = []
    for item in overrides:
        target, setting = split_row(item)
        if target is None or target == row:
            out.append(setting)
    return out


def check_row_overrides(overrides: list[str], rows: list[str]) -> None:
    """Refuse a ``ROW:key=value`` naming a row that is not run."""
    for item in overrides:
        target, _ = split_row(item)
        if target is not None and target not in rows:
            raise ConfigError(f"--set {item!r}: no row {target!r} is run; rows: {', '.join(rows)}")


def bench_config_path(path: str | Path | None = None) -> Path:
    """The absolute path of the bench config ``path`` names (:func:`load_bench_config`)."""
    return (find_config(path, "bench", what="bench config") if path else DEFAULT_CONFIG).resolve()


def load_bench_config(path: str | Path | None = None) -> BenchConfig:
    """The bench config at ``path`` or the shipped one of that name (``llada_b8_picks``); default the shipped
    ``bench.yaml``."""
    p = bench_config_path(path)
    try:
        return BenchConfig.model_validate(yaml.safe_load(p.read_text()))
    except Exception as e:  # pydantic or YAML error: name the file
        raise ConfigError(f"bench config {p}: {e}") from None


def with_models(cfg: BenchConfig, items: list[str]) -> BenchConfig:
    """``cfg`` with ``DECODER=FOLDER`` items (``--model``) replacing those decoders' models."""
    models = dict(cfg.models)
    for item in items:
        name, sep, folder = item.partition("=")
        if not (sep and name.strip() and folder.strip()):
            raise ConfigError(f"--model expects DECODER=FOLDER (e.g. ar=tiny-refusion or ar=path/to/model), got {item!r}")
        if name.strip() not in models:
            raise ConfigError(f"--model {item!r}: no decoder {name.strip()!r} in the bench config; "
                              f"configured: {', '.join(cfg.models)}")
        models[name.strip()] = folder.strip()
    return cfg.model_copy(update={"models": models})


def bench_runs(cfg: BenchConfig, decoders: list[str], tasks: list[str], overrides: list[str] = (),
               batch_size: int = 1, seeds: int = 1) -> list[Run]:
    from refusion.tasks import get_task

    unknown = [d for d in decoders if d not in cfg.models]
    if unknown:
        raise ConfigError(f"--decoders: no model configured for {unknown}; configured: {', '.join(cfg.models)}")
    check_row_overrides(list(overrides), list(decoders))
    runs = [Run(label=d, model=cfg.models[d],
                configs={t: cfg.decoder_config(t, d, get_task(t).max_new_tokens, overrides) for t in tasks},
                batch_size=batch_size, limit=cfg.rows[d].limit if d in cfg.rows else None, seeds=seeds)
            for d in decoders]
    plain = [o for o in overrides if split_row(o)[0] is None]
    if plain:  # a --set for every row that one row's decoder refuses: say how to aim it at one row
        from refusion.core.config import validate_config

        for run in runs:
            for config in run.configs.values():
                try:
                    validate_config(config)
                except ConfigError as e:
                    raise ConfigError(f"row {run.label}: {e} (--set {' --set '.join(plain)} applies to every row; "
                                      f"ROW:key=value sets one row, e.g. --set refusion:{plain[0]})") from None
    return runs


LABEL_OFFSETS = ((6, -4), (6, 8), (6, -16), (-52, -4), (-52, 8))  # points: right, above, below, left


def label_offset(px: float, py: float, placed: list[tuple[float, float]],
                 markers: list[tuple[float, float]] = ()) -> tuple[int, int]:
    """The first of ``LABEL_OFFSETS`` whose label (about 45 x 10 points, its anchor at its lower left)
    anchored at ``(px, py)`` plus the offset clears every label anchor in ``placed`` and covers none of
    the other points' ``markers`` (page positions, about 8 points wide); the first offset if none does."""
    def clear(ax: float, ay: float) -> bool:
        return (all(abs(ax - qx) > 45 or abs(ay - qy) > 11 for qx, qy in placed)
                and not any(ax - 4 <= mx <= ax + 49 and ay - 4 <= my <= ay + 14 for mx, my in markers))

    return next(((dx, dy) for dx, dy in LABEL_OFFSETS if clear(px + dx, py + dy)), LABEL_OFFSETS[0])


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy against tokens/s, one panel per task, one colour per decoder (legend below the panels),
    each point labelled with its TPF in the point's colour, the goal region (>= 2x ar's tokens/s, within
    2 points of ar's accuracy) shaded; writes bench.png and bench.svg."""
    from refusion.experiments.figures import legend_below, pyplot, save, task_panels

    plt = pyplot()
    tasks = sorted({r["task"] for r in rows})
    runs = sorted({r["run"] for r in rows})
    fig, axes = task_panels(len(tasks))
    colors = {d: plt.cm.tab10(i) for i, d in enumerate(runs)}
    for ax, task in zip(axes, tasks):
        pts = sorted((r for r in rows if r["task"] == task), key=lambda r: -r["accuracy"])
        ar = next((r for r in pts if r["run"] == "ar"), None)
        xhi = max(1.3 * max(r["tokens_per_second"] for r in pts), 2.6 * ar["tokens_per_second"] if ar else 0)
        sizes = sorted({r.get("batch_size", 1) for r in pts})
        xlabel = "tokens / s" if sizes == [1] else f"tokens / s (aggregate, batch size {', '.join(map(str, sizes))})"
        ax.set(title=task, xlabel=xlabel, ylabel="accuracy %", ylim=(-5, 105), xlim=(0, xhi))
        ax.grid(alpha=0.3)
        if ar is not None:  # the goal region (GOAL_SPEEDUP, GOAL_POINTS)
            ax.axvspan(GOAL_SPEEDUP * ar["tokens_per_second"], xhi, ymin=(100 * ar["accuracy"] - GOAL_POINTS + 5) / 110,
                       color="tab:green", alpha=0.1, lw=0)
        placed: list[tuple[float, float]] = []  # label anchors already used, in points on the page
        page = [tuple(ax.transData.transform((r["tokens_per_second"], 100 * r["accuracy"])) * 72 / fig.dpi)
                for r in pts]  # every point's marker, in points on the page
        for i, r in enumerate(pts):
            x, y = r["tokens_per_second"], 100 * r["accuracy"]
            ax.scatter(x, y, s=60, color=colors[r["run"]])
            px, py = page[i]
            dx, dy = label_offset(px, py, placed, page[:i] + page[i + 1:])
            placed.append((px + dx, py + dy))
            ax.annotate(f"TPF {r['tpf']:.1f}", (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=8,
                        color=colors[r["run"]])  # the point's colour: a label pushed aside stays its point's
    handles = [plt.Line2D([], [], marker="o", linestyle="", markersize=7, color=colors[d]) for d in runs]
    labels = list(runs)
    if any(r["run"] == "ar" for r in rows):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:green", alpha=0.1))
        labels.append(f">= {GOAL_SPEEDUP:g}x ar's tokens/s, accuracy within {GOAL_POINTS:g} points of ar")
    ncol = min(len(labels), 5)  # wider than five entries, the legend runs past the figure's edges
    legend_rows = -(-len(labels) // ncol)
    legend_below(fig, handles, labels, ncol=ncol, title="tinybench: accuracy vs decoding speed",
                 bottom=0.02 + 0.065 * legend_rows)
    return save(fig, out, "bench")


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (task, decoder other than ``ar``): its ``speedup_vs_ar``, its accuracy against ``ar``'s
    in the same run (with their paired 95% intervals and McNemar's p when the row has them), and whether
    the point estimates meet the goal (``GOAL_SPEEDUP``, ``GOAL_POINTS``); task by task in name order.
    A row with a paired ``accuracy_diff`` is compared with ``ar`` on the samples both decoded (a row with
    a ``limit`` decodes fewer). Tasks without an ``ar`` row give no line."""
    ar = {r["task"]: r for r in rows if r["run"] == "ar"}
    lines = []
    for r in sorted(rows, key=lambda r: r["task"]):
        b = ar.get(r["task"])
        if b is None or r is b or r["speedup_vs_ar"] is None:
            continue
        paired = r.get("accuracy_diff")
        ar_accuracy = r["accuracy"] - paired["value"] if paired else b["accuracy"]  # on this row's samples
        points = 100 * (r["accuracy"] - ar_accuracy)
        met = r["speedup_vs_ar"] >= GOAL_SPEEDUP and points >= -GOAL_POINTS - 1e-9  # accuracies are ratios: float slack
        speed, diff = f"{r['speedup_vs_ar']:.2f}x", f"{points:+.1f} points"
        if r.get("speedup_interval"):  # paired 95% intervals (runner.add_paired_intervals)
            speed += " [{:.2f}, {:.2f}]".format(*r["speedup_interval"])
        if paired:
            diff += f" [{100 * paired['low']:+.1f}, {100 * paired['high']:+.1f}], McNemar p {paired['p_value']:.2g}"
        lines.append(f"{r['task']}: {r['run']} {speed} ar's tokens/s, {diff} "
                     f"({100 * r['accuracy']:.1f}% vs {100 * ar_accuracy:.1f}%, n {r['n']}): "
                     f"goal {'met' if met else 'not met'}")
    return lines


def run_bench(tasks: list[str], decoders: list[str] | None, limit: int | None, out: Path, split: str = "test",
              config: str | None = None, overrides: list[str] = (), resume: bool = False,
              runtime: RuntimeOptions | None = None, models: list[str] = (),
              batch_size: int | None = None, jobs: int = 1,
              shard: tuple[int, int] | None = None, rerun_changed: bool = False, seeds: int = 1) -> list[dict[str, Any]]:
    """Run the bench; models load with the config's ``runtime:`` overridden by ``runtime`` (the flags);
    ``batch_size`` (the flag) overrides the config's ``batch_size:``. ``jobs > 1`` decodes in that many
    one-thread worker processes (:mod:`refusion.experiments.sharding`); ``shard=(k, n)`` is one such
    worker: it decodes its share into ``out`` and returns no rows. ``resume`` continues only a folder the
    same configs started; ``rerun_changed`` decodes the changed runs anew (:func:`runner.evaluate`).
    ``seeds > 1`` decodes every sample with that many seeds (each row's config seed and the next ones: what
    differs under sampling, ``drafter.temperature > 0``); the statistics pool them and pair rows by sample
    and seed."""
    check_batch_size(batch_size)
    check_batch_size(seeds, "--seeds")
    if jobs < 1:
        raise ConfigError(f"--jobs: must be at least 1, got {jobs}")
    cfg = with_models(load_bench_config(config), list(models))
    runs = bench_runs(cfg, decoders or list(cfg.models), tasks, overrides,
                      batch_size if batch_size is not None else cfg.batch_size, seeds=seeds)
    inputs = {"bench_config": str(bench_config_path(config)), "set": list(overrides),
              "model": list(models), "limit": limit, **({"seeds": seeds} if seeds > 1 else {})}
    if jobs > 1:
        worker = {"tasks": tasks, "decoders": decoders, "limit": limit, "split": split, "config": config,
                  "overrides": list(overrides), "runtime": runtime, "models": list(models), "batch_size": batch_size,
                  "seeds": seeds, "resume": True}  # each worker: run_bench on its share (shard, out set per worker)
        records = _run_workers(runs, tasks, split, limit, out, resume, cfg.runtime.override(runtime), jobs,
                               worker, rerun_changed, inputs)
    else:
        records = evaluate(runs, tasks, split, limit, out, resume=resume, runtime=cfg.runtime.override(runtime),
                           desc="bench", shard=shard, rerun_changed=rerun_changed, inputs=inputs)
    if shard is not None:
        return []
    rows = summarize(records, runs, baseline="ar", speedup_key="speedup_vs_ar")
    write_json(out / "results.json", rows)
    plot(rows, out)
    return rows


def _run_workers(runs: list[Run], tasks: list[str], split: str, limit: int | None, out: Path, resume: bool,
                 runtime: RuntimeOptions, jobs: int, worker: dict[str, Any], rerun_changed: bool = False,
                 inputs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The bench in ``jobs`` worker processes (sample ``i`` to worker ``i % jobs``), each calling
    :func:`run_bench` with ``worker``'s arguments on its shard (written to its folder's ``call.json``,
    :func:`refusion.core.workers.call_command`); the joined records. This process checks the folder's manifest
    and writes it (:func:`~refusion.experiments.manifest.prepare_output`)."""
    from refusion.core.workers import call_command
    from refusion.experiments.manifest import prepare_output, run_entries
    from refusion.experiments.runner import check_runs, wanted_records
    from refusion.experiments.sharding import join_records, run_shards, split_records
    from refusion.tasks import get_task

    resume = resume or rerun_changed
    if ((out / "samples.jsonl").exists() or (out / "shards").exists()) and not resume:
        raise ConfigError(f"{out} holds a run's samples: pass --resume to continue that run, or choose another --out")
    check_runs(runs, tasks, runtime)  # a bad config fails here, not in every worker
    prepare_output(out, "bench", run_entries(runs, tasks, split, runtime), resume, rerun_changed, inputs)
    sizes = {t: len(get_task(t).examples(split, limit)) for t in tasks}
    total = sum(sizes[t] if run.limit is None else min(run.limit, sizes[t]) for run in runs for t in tasks)
    split_records(out, jobs)
    run_shards(out, jobs, lambda k, folder: call_command(folder / "call.json", run_bench, {
        **worker, "out": folder, "shard": (k, jobs)}), total)
    task_order, run_order = {t: i for i, t in enumerate(tasks)}, {r.label: i for i, r in enumerate(runs)}
    records = join_records(out, lambda r: (task_order.get(r["task"], len(tasks)), r["idx"],
                                           run_order.get(r["run"], len(runs))))
    return wanted_records(records, runs, tasks)


def add_bench_command(sub) -> None:
    from refusion.experiments.args import (
        add_batch_size_arg, add_machine_args, add_output_args, add_resume_args, add_rows_args, add_seeds_arg,
    )

    p = sub.add_parser("bench", help="every decoder on every tinybench task: accuracy and speed table")
    add_rows_args(p, row_sets=True)
    add_output_args(p, "runs/bench", "samples.jsonl, results.json, plots", 0,
                    "default 0: the whole split, 200 per task")
    add_resume_args(p)
    add_seeds_arg(p)
    add_batch_size_arg(p, "the config's batch_size, else 1")
    add_machine_args(p, jobs_help="decode in N one-thread worker processes, sample i in worker i mod N, the rows "
                                  "interleaved per sample in each (2 on a 2-core CPU; default 1: this process)")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # K/N: one worker of --jobs N
    p.set_defaults(func=cmd_bench)


def seeds_note(seeds: int) -> str:
    """What a table's title adds for runs repeated over ``seeds``."""
    return f", {seeds} seeds pooled" if seeds > 1 else ""


def cmd_bench(a) -> int:
    from refusion.experiments.sharding import parse_shard

    threads = set_threads(a.threads)
    out = Path(a.out)
    shard = parse_shard(a.shard) if a.shard else None
    try:
        rows = run_bench([t for t in a.tasks.split(",") if t], [d for d in a.decoders.split(",") if d] or None,
                         a.limit or None, out, a.split, a.config, a.set, a.resume, runtime_from_args(a), a.model,
                         a.batch_size, a.jobs, shard, a.rerun_changed, seeds=a.seeds)
    except RuntimeError as e:  # a failed worker: named with its log
        print(f"error: {e}", file=sys.stderr)
        return 1
    if shard is not None:
        print(f"wrote {out / 'samples.jsonl'} (worker {a.shard})")
        return 0
    sizes = sorted({r.get("batch_size", 1) for r in rows})
    batch = f", batch size {', '.join(map(str, sizes))}" if sizes and sizes != [1] else ""
    batch += seeds_note(a.seeds)
    workers = f"{a.jobs} one-thread workers" if a.jobs > 1 else f"{threads} torch thread{'s' * (threads != 1)}"
    print_table(rows, title=f"refusion bench ({a.split} split, {a.limit or 'all'} per task{batch}, {workers})")
    lines = goal_lines(rows)
    if lines:
        print(f"against ar in this run (goal: >= {GOAL_SPEEDUP:g}x its tokens/s, within {GOAL_POINTS:g} points):")
        print("\n".join("  " + line for line in lines))
    print(f"wrote {out / 'results.json'}, {out / 'bench.png'}, {out / 'samples.jsonl'}, {out / 'manifest.json'}")
    return 0
