"""``refusion batch-bench``: decoding throughput against batch size, per decoder and task.

Decodes the same samples of each task with each decoder of the bench config (its model and per-task
settings, as ``refusion bench``) at every batch size of ``--batch-sizes`` (batch size 1 always runs: it
is the reference). A run at batch size N sends the samples of a task in chunks of N through
``Decoder.generate_batch`` (a decoder without a batched loop decodes a chunk one sample after another).
The engine is the bench's (``runner.py``): chunks of every (decoder, batch size) are interleaved by
their first sample, every result is appended to ``OUT/samples.jsonl`` at once and ``--resume`` redoes
only the samples not yet written.

One row per (decoder, task, batch size): samples, accuracy, aggregate tokens/s (total generated tokens /
total chunk wall time), that over the same decoder's at batch size 1, that over ``ar``'s at the same
batch size, mean per-sample latency, the share of decode wall time spent in model forwards (forwards
timed: :attr:`~refusion.models.backend.Backbone.time_forwards`, on by default on the CPU, where the
timing adds no synchronisation) and how many samples' token ids differ from the batch-1 decode of the
same sample. Writes ``results.json``, ``results.md`` and ``throughput.png`` / ``throughput.svg``
(aggregate tokens/s against batch size, one panel per task, one line per decoder).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from refusion.core.config import ConfigError
from refusion.core.threads import set_threads
from refusion.experiments.bench import bench_config_path, bench_runs, load_bench_config, with_models
from refusion.experiments.records import SampleRecord, sample_records
from refusion.experiments.runner import Run, check_batch_size, evaluate, summarize, write_json
from refusion.models.loading import RuntimeOptions, runtime_from_args

DEFAULT_SIZES = "1,4,16"

#: (key, table heading) of every reported column, in table order
COLUMNS = (
    ("decoder", "decoder"), ("task", "task"), ("batch_size", "batch"), ("n", "n"), ("accuracy", "acc %"),
    ("tokens_per_second", "tok/s"), ("vs_batch_1", "x batch 1"), ("speedup_vs_ar", "x ar"),
    ("latency_s_mean", "latency s"), ("forward_share", "fwd %"), ("differ_from_batch_1", "ids differ"),
)


def parse_sizes(text: str) -> list[int]:
    """``"4,16"`` -> ``[1, 4, 16]``: the batch sizes in increasing order, with 1 (the reference) added."""
    sizes = set()
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        try:
            sizes.add(check_batch_size(int(item), "--batch-sizes"))
        except ValueError:
            raise ConfigError(f"--batch-sizes: {item!r} is not a batch size; give integers of at least 1, "
                              f"e.g. {DEFAULT_SIZES}") from None
    if not sizes:
        raise ConfigError(f"--batch-sizes: give at least one batch size, e.g. {DEFAULT_SIZES}")
    return sorted(sizes | {1})


def label(decoder: str, size: int) -> str:
    return f"{decoder}@{size}"


def batching_runs(runs: list[Run], sizes: list[int]) -> list[Run]:
    """Every run of ``runs`` (one per decoder) at every batch size: decoder by decoder, sizes in order."""
    return [Run(label=label(r.label, n), model=r.model, configs=r.configs, params={"batch_size": n}, batch_size=n)
            for r in runs for n in sizes]


def _ratio(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    return row["tokens_per_second"] / base["tokens_per_second"] if base and base["tokens_per_second"] else None


def batching_rows(records: list[dict[str, Any]], runs: list[Run]) -> list[dict[str, Any]]:
    """One row per (run, task) of :func:`batching_runs`'s runs: the bench's summary (aggregate tokens/s,
    latency, ...) plus ``vs_batch_1``, ``speedup_vs_ar`` (over ``ar`` at the same batch size; None without
    it), ``forward_share`` (None when forwards were not timed) and ``differ_from_batch_1`` (samples whose
    token ids differ from the same decoder's batch-1 decode of that sample; None at batch size 1)."""
    rows = summarize(records, runs)
    base = {r.label: r.label.rsplit("@", 1)[0] for r in runs}  # run label -> decoder label
    for r in rows:
        r["decoder"] = base[r["run"]]  # the bench's decoder label (its row name in the bench's tables)
        r.pop("speedup", None)
    by_key = {(r["decoder"], r["task"], r["batch_size"]): r for r in rows}
    samples = [x for x in sample_records(records) if x.run in base]
    ids_1 = {(base[x.run], x.task, x.idx): x.token_ids for x in samples if (x.batch_size or 1) == 1}
    groups: dict[tuple[str, str], list[SampleRecord]] = {}
    for x in samples:
        groups.setdefault((x.run, x.task), []).append(x)
    for r in rows:
        rs = groups[r["run"], r["task"]]
        one = by_key.get((r["decoder"], r["task"], 1))
        ar = by_key.get(("ar", r["task"], r["batch_size"]))
        r["vs_batch_1"] = _ratio(r, one)
        r["speedup_vs_ar"] = _ratio(r, ar)
        fwd = [x.forward_share_s() for x in rs]
        wall = sum(x.decode_share_s() for x in rs)
        r["forward_share"] = sum(fwd) / wall if wall and None not in fwd else None
        if r["batch_size"] == 1:
            r["differ_from_batch_1"] = r["compared_with_batch_1"] = None
        else:
            pairs = [(x.token_ids, ids_1.get((r["decoder"], x.task, x.idx))) for x in rs]
            r["differ_from_batch_1"] = sum(a != b for a, b in pairs if b is not None)
            r["compared_with_batch_1"] = sum(b is not None for _, b in pairs)
    order = {r.label: i for i, r in enumerate(runs)}
    return sorted(rows, key=lambda r: (r["task"], order[r["run"]]))


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("accuracy", "forward_share"):
        return f"{100 * value:.1f}"
    if key in ("vs_batch_1", "speedup_vs_ar"):
        return f"{value:.2f}x"
    if key == "latency_s_mean":
        return f"{value:.3f}"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    from refusion.experiments.tables import cells, markdown

    return markdown([h for _, h in COLUMNS], cells(rows, COLUMNS, _cell))


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from refusion.experiments.tables import cells, print_rich

    print_rich([h for _, h in COLUMNS], cells(rows, COLUMNS, _cell), title, left=("decoder", "task"),
               where="results.md in the output folder holds every column")


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Aggregate tokens/s against batch size (log scale), one panel per task, one line per decoder (one
    colour per decoder, legend below the panels); writes throughput.png and throughput.svg."""
    from refusion.experiments.figures import legend_below, pyplot, save, task_panels

    plt = pyplot()
    tasks = sorted({r["task"] for r in rows})
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    sizes = sorted({r["batch_size"] for r in rows})
    fig, axes = task_panels(len(tasks))
    colors = {d: plt.cm.tab10(i) for i, d in enumerate(decoders)}
    for ax, task in zip(axes, tasks):
        for d in decoders:
            line = sorted((r for r in rows if r["task"] == task and r["decoder"] == d), key=lambda r: r["batch_size"])
            ax.plot([r["batch_size"] for r in line], [r["tokens_per_second"] for r in line], marker="o",
                    color=colors[d], label=d)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set(title=task, xlabel="batch size", ylabel="tokens / s (aggregate)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", color=colors[d]) for d in decoders]
    legend_below(fig, handles, decoders, ncol=len(decoders), title="tinybench: decoding throughput vs batch size")
    return save(fig, out, "throughput")


def run_batching(tasks: list[str], decoders: list[str] | None, sizes: list[int], limit: int | None, out: Path,
                 split: str = "test", config: str | None = None, overrides: list[str] = (), resume: bool = False,
                 runtime: RuntimeOptions | None = None, models: list[str] = (),
                 time_forwards: bool | None = None, rerun_changed: bool = False) -> list[dict[str, Any]]:
    """Decode, summarise, write ``results.json``, ``results.md`` and the plot; return the rows.
    ``time_forwards`` None: time the forwards when the models run on the CPU (no synchronisation added).
    ``resume`` continues only a folder the same configs started; ``rerun_changed`` decodes the changed
    runs anew (:func:`runner.evaluate`)."""
    if not tasks:
        raise ConfigError("--tasks: give at least one task")
    sizes = parse_sizes(",".join(map(str, sizes)))
    cfg = with_models(load_bench_config(config), list(models))
    options = cfg.runtime.override(runtime)
    if time_forwards is None:
        time_forwards = options.device_map is None and (options.device or "cpu") == "cpu"
    runs = batching_runs(bench_runs(cfg, decoders or cfg.decoder_rows, tasks, overrides), sizes)
    inputs = {"bench_config": str(bench_config_path(config)), "set": list(overrides),
              "model": list(models), "limit": limit, "batch_sizes": sizes}
    records = evaluate(runs, tasks, split, limit, out, resume=resume, runtime=options, desc="batch-bench",
                       time_forwards=time_forwards, rerun_changed=rerun_changed, inputs=inputs)
    rows = batching_rows(records, runs)
    write_json(out / "results.json", rows)
    (out / "results.md").write_text(markdown_table(rows))
    plot(rows, out)
    return rows


def add_batching_command(sub) -> None:
    from refusion.experiments.args import add_machine_args, add_output_args, add_resume_args, add_rows_args

    p = sub.add_parser("batch-bench", help="throughput against batch size: each decoder on the same samples at "
                                           "each batch size")
    p.add_argument("--batch-sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated batch sizes (default {DEFAULT_SIZES}; 1, the reference, always runs)")
    add_rows_args(p)
    add_output_args(p, "runs/batch-bench", "samples.jsonl, results.json, results.md, throughput.png/.svg", 32,
                    "default 32; 0: the whole split")
    add_resume_args(p)
    p.add_argument("--time-forwards", action=argparse.BooleanOptionalAction, default=None,
                   help="time every model forward for the fwd %% column (default: on the CPU only; on a GPU it "
                        "adds two synchronisations per forward)")
    add_machine_args(p)
    p.set_defaults(func=cmd_batching)


def cmd_batching(a) -> int:
    if a.limit < 0:
        raise ConfigError(f"--limit: must be 0 (the whole split) or more, got {a.limit}")
    threads = set_threads(a.threads)
    sizes = parse_sizes(a.batch_sizes)
    out = Path(a.out)
    rows = run_batching([t for t in a.tasks.split(",") if t], [d for d in a.decoders.split(",") if d] or None,
                        sizes, a.limit or None, out, a.split, a.config, a.set, a.resume, runtime_from_args(a),
                        a.model, a.time_forwards, a.rerun_changed)
    print_table(rows, title=f"refusion batch-bench ({a.split} split, {a.limit or 'all'} per task, "
                            f"batch sizes {', '.join(map(str, sizes))}, {threads} torch thread{'s' * (threads != 1)})")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'throughput.png'}, {out / 'samples.jsonl'}, "
          f"{out / 'manifest.json'}")
    return 0
