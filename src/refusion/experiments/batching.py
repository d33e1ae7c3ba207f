"""``refusion batch-bench``: decoding throughput against batch size, per decoder and task.

Decodes the same samples of each task with each decoder of the bench config (its model and per-task
settings, as ``refusion bench``) at every batch size of ``--batch-sizes`` (batch size 1 always runs: it
is the reference). A run at batch size N sends the samples of a task in chunks of N through
``Decoder.generate_batch`` (a decoder without a batched loop decodes a chunk one sample after another).
The engine is the bench's (``runner.py``): chunks of every (decoder, batch size) are interleaved by
their first sample, every result is appended to ``OUT/samples.jsonl`` at once and ``--resume`` redoes
only the samples not yet written.

The sizes are decoded in rounds, smallest first (within a round every decoder's chunks are interleaved,
so a ratio against ``ar`` at one batch size is paired); with ``stop_when_crossed`` (the default) the
sweep ends after the first size at which every decoder's tokens/s is below ``ar``'s on every task: its
advantage has ended, and larger sizes only confirm it.

One row per (decoder, task, batch size): samples, accuracy, aggregate tokens/s (total generated tokens /
total chunk wall time), that over the same decoder's at batch size 1, that over ``ar``'s at the same
batch size, per-sample latency (mean, p50, p95; from the chunk's start), tokens per forward, tokens fed
per generated token (every row of every forward the sample took part in, padding included: the compute
it spends), AUP (:func:`~refusion.experiments.crossover.aup` of its one (TPF, accuracy) point), the share
of decode wall time spent in model forwards (forwards timed:
:attr:`~refusion.models.backend.Backbone.time_forwards`, on by default on the CPU, where the timing adds
no synchronisation) and how many samples' token ids differ from the batch-1 decode of the same sample.
One crossover per (decoder, task): the batch size at which its tokens/s falls below ``ar``'s, with a
paired-bootstrap interval (:func:`~refusion.experiments.crossover.crossover_interval`). Writes
``results.json``, ``crossover.json``, ``results.md`` and ``throughput.png`` / ``throughput.svg``
(aggregate tokens/s and the ratio to ``ar`` against batch size, one column of panels per task, one line
per decoder, each crossover marked with its interval).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from refusion.core.config import ConfigError, load_config_file
from refusion.core.threads import set_threads
from refusion.experiments.bench import bench_config_path, bench_runs, load_bench_config, with_models
from refusion.experiments.config_files import CONFIGS_DIR, find_config
from refusion.experiments.crossover import aup, crossover_interval
from refusion.experiments.records import SampleRecord, load_records, sample_records
from refusion.experiments.stats import paired_accuracy, percentile, throughput_ratio
from refusion.experiments.runner import Run, check_batch_size, evaluate, summarize, write_json
from refusion.models.loading import RuntimeOptions, runtime_from_args
from refusion.tasks import get_task

DEFAULT_SIZES = "1,2,4,8,16,32,64"
BATCH_AWARE = CONFIGS_DIR / "bench" / "batch_aware.yaml"  # the shipped batch-aware rows
DEFAULT_LIMIT = 64  # samples per task: one chunk of the largest default size

#: (key, table heading) of every reported column, in table order
COLUMNS = (
    ("decoder", "decoder"), ("task", "task"), ("batch_size", "batch"), ("n", "n"), ("accuracy", "acc %"),
    ("tokens_per_second", "tok/s"), ("vs_batch_1", "x batch 1"), ("speedup_vs_ar", "x ar"),
    ("speedup_interval", "x ar [95%]"), ("accuracy_diff_vs_ar", "acc vs ar, points [95%]"),
    ("latency_s_p50", "p50 s"), ("latency_s_p95", "p95 s"), ("tpf", "TPF"), ("fed_per_token", "fed/token"),
    ("aup", "AUP"), ("forward_share", "fwd %"), ("differ_from_batch_1", "ids differ"),
)
#: (key, table heading) of the crossover table
CROSSOVER_COLUMNS = (("decoder", "decoder"), ("task", "task"), ("crossover_text", "crossover batch size [95%]"),
                     ("ratios_text", "x ar at each batch size"))


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


class Variant(BaseModel):
    """A row of batch-aware settings: the bench row ``row`` with options added, to all tasks (``set``) and
    per task (``tasks``); each key replaces the row's own value of it."""

    model_config = ConfigDict(extra="forbid")
    row: str
    set: dict[str, Any] = {}
    tasks: dict[str, dict[str, Any]] = {}


def load_variants(path: str | Path) -> dict[str, Variant]:
    """Row label -> :class:`Variant` from a YAML file or a shipped one's name (``configs/bench/batch_aware.yaml``'s
    format); errors name the row and field."""
    path = find_config(path, "bench", what="batch-aware rows")
    data = load_config_file(path)
    out = {}
    for name, spec in data.items():
        try:
            out[str(name)] = Variant.model_validate(spec)
        except ValidationError as e:
            where = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ConfigError(f"{path}: row {name!r}: {where}") from None
    return out


def variant_runs(runs: list[Run], variants: dict[str, Variant], tasks: list[str]) -> list[Run]:
    """``runs`` followed by one run per variant whose ``row`` is among them (the others are skipped: their
    row is not run), on the same model with the variant's options over the row's per-task config."""
    by_label = {r.label: r for r in runs}
    out = list(runs)
    for name, v in variants.items():
        if name in by_label:
            raise ConfigError(f"batch-aware row {name!r} has the name of a bench row; rename it")
        for t in v.tasks:
            try:
                get_task(t)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"batch-aware row {name!r}: tasks.{t}: {e}") from None
        if v.row in by_label:
            base = by_label[v.row]
            configs = {t: {**base.configs[t], **v.set, **v.tasks.get(t, {})} for t in tasks}
            out.append(Run(label=name, model=base.model, configs=configs, params=dict(base.params)))
    return out


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
    mean latency, TPF, ...) plus ``vs_batch_1``, ``speedup_vs_ar`` (over ``ar`` at the same batch size; None
    without it), ``latency_s_p50`` / ``latency_s_p95`` (per-sample latency percentiles), ``fed_per_token``
    (tokens fed in the sample's rows of its forwards, padding included, per generated token; None for
    records without ``tokens_in``), ``aup`` (AUP of the row's one (TPF, accuracy %) point, which is TPF x
    accuracy %), ``forward_share`` (None when forwards were not timed) and ``differ_from_batch_1`` (samples
    whose token ids differ from the same decoder's batch-1 decode of that sample; None at batch size 1),
    and, paired sample by sample with ``ar`` at the same batch size (None for ``ar`` and without it),
    ``accuracy_diff_vs_ar`` (the accuracy difference with its 95% paired-bootstrap interval and McNemar's
    p) and ``speedup_interval`` (95% paired-bootstrap interval of ``speedup_vs_ar``)."""
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
        latencies = [x.wall_s for x in rs]
        r["latency_s_p50"], r["latency_s_p95"] = percentile(latencies, 50), percentile(latencies, 95)
        fed = [x.tokens_in for x in rs]
        tokens = sum(x.generated_tokens for x in rs)
        r["fed_per_token"] = sum(fed) / tokens if tokens and None not in fed else None
        r["aup"] = aup([(r["tpf"], 100 * r["accuracy"])], 100.0) if r["tpf"] > 0 else None
        r["accuracy_diff_vs_ar"] = r["speedup_interval"] = None
        mates = {x.idx: x for x in groups.get((ar["run"], r["task"]), [])} if ar and ar is not r else {}
        pairs = [(mates[x.idx], x) for x in rs if x.idx in mates]
        if pairs:  # paired with ar at the same batch size, sample by sample
            acc = paired_accuracy([a.correct for a, _ in pairs], [b.correct for _, b in pairs])
            r["accuracy_diff_vs_ar"] = {"value": acc.difference.value, "low": acc.difference.low,
                                        "high": acc.difference.high, "p_value": acc.p_value, "n": acc.n}
            ratio = throughput_ratio([a.generated_tokens for a, _ in pairs], [a.decode_share_s() for a, _ in pairs],
                                     [b.generated_tokens for _, b in pairs], [b.decode_share_s() for _, b in pairs])
            r["speedup_interval"] = [ratio.low, ratio.high]
        if r["batch_size"] == 1:
            r["differ_from_batch_1"] = r["compared_with_batch_1"] = None
        else:
            pairs = [(x.token_ids, ids_1.get((r["decoder"], x.task, x.idx))) for x in rs]
            r["differ_from_batch_1"] = sum(a != b for a, b in pairs if b is not None)
            r["compared_with_batch_1"] = sum(b is not None for _, b in pairs)
    order = {r.label: i for i, r in enumerate(runs)}
    return sorted(rows, key=lambda r: (r["task"], order[r["run"]]))


def crossover_rows(records: list[dict[str, Any]], runs: list[Run], baseline: str = "ar") -> list[dict[str, Any]]:
    """One row per (decoder, task) of every decoder but ``baseline``: its tokens/s over the baseline's at
    each batch size both ran (``ratios``: size -> ratio) and the batch size at which that ratio first falls
    below 1, with its 95% paired-bootstrap interval (:func:`~refusion.experiments.crossover.crossover_interval`),
    on the samples every one of those runs decoded. [] without the baseline."""
    base = {r.label: (r.label.rsplit("@", 1)[0], r.batch_size) for r in runs}
    by: dict[tuple[str, str, int], dict[int, SampleRecord]] = {}  # (decoder, task, size) -> idx -> record
    for x in sample_records(records):
        if x.run in base:
            decoder, size = base[x.run]
            by.setdefault((decoder, x.task, size), {})[x.idx] = x
    out = []
    decoders = list(dict.fromkeys(d for d, _ in base.values()))
    for task in sorted({t for _, t, _ in by}):
        for decoder in decoders:
            if decoder == baseline:
                continue
            sizes = sorted(n for d, t, n in by if d == decoder and t == task and (baseline, task, n) in by)
            if not sizes:
                continue
            sets = [set(by[who, task, n]) for n in sizes for who in (decoder, baseline)]
            common = sorted(set.intersection(*sets))
            if not common:
                continue

            def grid(who: str, key) -> np.ndarray:  # [sizes, n]
                return np.array([[key(by[who, task, n][i]) for i in common] for n in sizes], dtype=float)

            tokens, seconds = (lambda x: x.generated_tokens), SampleRecord.decode_share_s
            tok_a, sec_a = grid(baseline, tokens), grid(baseline, seconds)
            tok_b, sec_b = grid(decoder, tokens), grid(decoder, seconds)
            ratios = (tok_b.sum(1) / sec_b.sum(1)) / (tok_a.sum(1) / sec_a.sum(1))
            cross = crossover_interval(sizes, tok_a, sec_a, tok_b, sec_b)
            out.append({"decoder": decoder, "task": task, "n": len(common), "batch_sizes": sizes,
                        "ratios": {str(n): float(r) for n, r in zip(sizes, ratios)}, **cross.as_dict(),
                        "ratios_text": ", ".join(f"{n}: {r:.2f}x" for n, r in zip(sizes, ratios))})
    return out


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("accuracy", "forward_share"):
        return f"{100 * value:.1f}"
    if key in ("vs_batch_1", "speedup_vs_ar"):
        return f"{value:.2f}x"
    if key in ("latency_s_mean", "latency_s_p50", "latency_s_p95"):
        return f"{value:.3f}"
    if key == "speedup_interval":
        return f"[{value[0]:.2f}, {value[1]:.2f}]"
    if key == "accuracy_diff_vs_ar":
        return f"{100 * value['value']:+.1f} [{100 * value['low']:+.1f}, {100 * value['high']:+.1f}]"
    if key in ("tpf", "fed_per_token"):
        return f"{value:.2f}"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict[str, Any]], crossovers: list[dict[str, Any]] = ()) -> str:
    """The rows' table; with ``crossovers``, the crossover table after it (:mod:`refusion.experiments.tables`)."""
    from refusion.experiments.tables import cells, markdown

    text = markdown([h for _, h in COLUMNS], cells(rows, COLUMNS, _cell))
    if crossovers:
        text += "\n" + markdown([h for _, h in CROSSOVER_COLUMNS], cells(list(crossovers), CROSSOVER_COLUMNS, _cell))
    return text


def print_table(rows: list[dict[str, Any]], title: str, crossovers: list[dict[str, Any]] = ()) -> None:
    from refusion.experiments.tables import cells, print_rich

    for rs, columns, head in ((rows, COLUMNS, title), (crossovers, CROSSOVER_COLUMNS, "crossover against ar")):
        if rs:
            print_rich([h for _, h in columns], cells(list(rs), columns, _cell), head,
                       left=[h for k, h in columns if k in ("decoder", "task", "ratios_text")],
                       where="results.md in the output folder holds every column")


def plot(rows: list[dict[str, Any]], out: Path, crossovers: list[dict[str, Any]] = ()) -> list[Path]:
    """Per task (a column of panels): aggregate tokens/s against batch size (top) and tokens/s over ``ar``'s
    (bottom, with the line at 1 and each decoder's crossover marked there with its interval, or an arrow at
    its last point when it is still ahead at the largest size), log-2 batch axis,
    one colour per decoder (legend below); writes throughput.png and throughput.svg."""
    from refusion.experiments.figures import pyplot, save

    plt = pyplot()

    tasks = sorted({r["task"] for r in rows})
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    sizes = sorted({r["batch_size"] for r in rows})
    with_ratio = any(r.get("speedup_vs_ar") is not None for r in rows)
    n_rows = 2 if with_ratio else 1
    fig, axes = plt.subplots(n_rows, len(tasks), figsize=(4.2 * len(tasks), 3.6 * n_rows + 0.4), squeeze=False)
    colors = {d: plt.cm.tab10(i) for i, d in enumerate(decoders)}
    cross = {(c["decoder"], c["task"]): c for c in crossovers}
    for col, task in enumerate(tasks):
        ax = axes[0][col]
        for d in decoders:
            line = sorted((r for r in rows if r["task"] == task and r["decoder"] == d), key=lambda r: r["batch_size"])
            ax.plot([r["batch_size"] for r in line], [r["tokens_per_second"] for r in line], marker="o",
                    color=colors[d], label=d)
        ax.set(title=task, ylabel="tokens / s (aggregate)")
        ax.set_ylim(bottom=0)
        if with_ratio:
            rx = axes[1][col]
            rx.axhline(1.0, color="black", lw=0.8)
            for d in decoders:
                line = sorted((r for r in rows if r["task"] == task and r["decoder"] == d and r["decoder"] != "ar"
                               and r.get("speedup_vs_ar") is not None), key=lambda r: r["batch_size"])
                if not line:
                    continue
                rx.plot([r["batch_size"] for r in line], [r["speedup_vs_ar"] for r in line], marker="o",
                        color=colors[d])
                c = cross.get((d, task))
                if c and c["crossover"] is None:  # still ahead at the largest size: an arrow at its last point
                    rx.plot([line[-1]["batch_size"]], [line[-1]["speedup_vs_ar"]], marker=">", ms=11,
                            color=colors[d], ls="none")
                elif c:
                    lo = c["crossover_low"] if c["crossover_low"] is not None else sizes[0]
                    hi = c["crossover_high"] if c["crossover_high"] is not None else sizes[-1]
                    rx.errorbar([c["crossover"]], [1.0], xerr=[[c["crossover"] - lo], [hi - c["crossover"]]],
                                marker="D", ms=7, color=colors[d], capsize=4, lw=2,
                                mfc="white" if c["crossover"] <= sizes[0] else colors[d])
            rx.set(ylabel="tokens / s over ar's")
            rx.set_yscale("log", base=2)
        for ax in (axes[i][col] for i in range(n_rows)):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
        axes[-1][col].set(xlabel="batch size")
    handles = [plt.Line2D([], [], marker="o", color=colors[d]) for d in decoders]
    labels = list(decoders)
    if with_ratio:
        handles.append(plt.Line2D([], [], marker="D", color="gray", ls="none"))
        labels.append("crossover with ar [95%] (hollow: at or below batch 1; arrow: beyond the largest size)")
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle("tinybench: decoding throughput vs batch size")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save(fig, out, "throughput")


def advantage_ended(rows: list[dict[str, Any]], size: int, baseline: str = "ar") -> bool:
    """Every decoder's tokens/s is below ``baseline``'s at batch ``size`` on every task (point estimates);
    False without a baseline or another decoder at that size."""
    at = [r for r in rows if r["batch_size"] == size and r["decoder"] != baseline]
    return bool(at) and all(r.get("speedup_vs_ar") is not None and r["speedup_vs_ar"] < 1 for r in at)


def run_batching(tasks: list[str], decoders: list[str] | None, sizes: list[int], limit: int | None, out: Path,
                 split: str = "test", config: str | None = None, overrides: list[str] = (), resume: bool = False,
                 runtime: RuntimeOptions | None = None, models: list[str] = (),
                 time_forwards: bool | None = None, rerun_changed: bool = False,
                 stop_when_crossed: bool = True, batch_aware: str | Path | None = None,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Decode in rounds of one batch size each (smallest first), summarise, write ``results.json``,
    ``crossover.json``, ``results.md`` and the plot; return (rows, crossovers). ``stop_when_crossed``: stop
    after the first size (above 1) at which every decoder is slower than ``ar`` on every task.
    ``time_forwards`` None: time the forwards when the models run on the CPU (no synchronisation added).
    ``resume`` continues only a folder the same configs started; ``rerun_changed`` decodes the changed
    runs anew (:func:`runner.evaluate`). ``batch_aware``: a file of batch-aware rows (:func:`load_variants`)
    run beside the bench's."""
    if not tasks:
        raise ConfigError("--tasks: give at least one task")
    sizes = parse_sizes(",".join(map(str, sizes)))
    cfg = with_models(load_bench_config(config), list(models))
    options = cfg.runtime.override(runtime)
    if time_forwards is None:
        time_forwards = options.device_map is None and (options.device or "cpu") == "cpu"
    base_runs = bench_runs(cfg, decoders or cfg.decoder_rows, tasks, overrides)
    if batch_aware is not None:
        base_runs = variant_runs(base_runs, load_variants(batch_aware), tasks)
    inputs = {"bench_config": str(bench_config_path(config)), "set": list(overrides),
              "model": list(models), "limit": limit, "batch_sizes": sizes,
              "batch_aware": str(Path(batch_aware).resolve()) if batch_aware is not None else None}
    done: list[int] = []
    for size in sizes:
        done.append(size)
        runs = batching_runs(base_runs, done)
        evaluate(batching_runs(base_runs, [size]), tasks, split, limit, out, resume=resume or len(done) > 1,
                 runtime=options, desc=f"batch-bench @{size}", time_forwards=time_forwards,
                 rerun_changed=rerun_changed, inputs=inputs, record_tokens_in=True)
        if size > 1 and stop_when_crossed and advantage_ended(batching_rows(load_records_of(out, runs), runs), size):
            break
    records = load_records_of(out, runs)
    rows = batching_rows(records, runs)
    crossovers = crossover_rows(records, runs)
    write_json(out / "results.json", rows)
    write_json(out / "crossover.json", crossovers)
    (out / "results.md").write_text(markdown_table(rows, crossovers))
    plot(rows, out, crossovers)
    return rows, crossovers


def load_records_of(out: Path, runs: list[Run]) -> list[dict[str, Any]]:
    """The records of ``out/samples.jsonl`` that belong to ``runs``."""
    labels = {r.label for r in runs}
    return [x for x in load_records(out / "samples.jsonl") if x["run"] in labels]


def add_batching_command(sub) -> None:
    from refusion.experiments.args import add_machine_args, add_output_args, add_resume_args, add_rows_args

    p = sub.add_parser("batch-bench", help="throughput against batch size: each decoder on the same samples at "
                                           "each batch size, and where each falls below ar")
    p.add_argument("--batch-sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated batch sizes (default {DEFAULT_SIZES}; 1, the reference, always runs)")
    p.add_argument("--stop-when-crossed", action=argparse.BooleanOptionalAction, default=True,
                   help="stop after the first batch size at which every decoder is slower than ar on every task "
                        "(default: on)")
    p.add_argument("--batch-aware", nargs="?", const=str(BATCH_AWARE), default=None, metavar="FILE",
                   help="also run the batch-aware rows of FILE (default: the shipped configs/bench/batch_aware.yaml): a "
                        "bench row with settings by batch size (batch_schedule) or by live load (draft_budget)")
    add_rows_args(p)
    add_output_args(p, "runs/batch-bench", "samples.jsonl, results.json, crossover.json, results.md, "
                    "throughput.png/.svg", DEFAULT_LIMIT, f"default {DEFAULT_LIMIT}; 0: the whole split")
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
    rows, crossovers = run_batching(
        [t for t in a.tasks.split(",") if t], [d for d in a.decoders.split(",") if d] or None, sizes,
        a.limit or None, out, a.split, a.config, a.set, a.resume, runtime_from_args(a), a.model, a.time_forwards,
        a.rerun_changed, a.stop_when_crossed, a.batch_aware)
    ran = sorted({r["batch_size"] for r in rows})
    print_table(rows, title=f"refusion batch-bench ({a.split} split, {a.limit or 'all'} per task, batch sizes "
                            f"{', '.join(map(str, ran))}, {threads} torch thread{'s' * (threads != 1)})",
                crossovers=crossovers)
    if ran != sizes:
        print(f"stopped after batch size {ran[-1]}: every decoder is slower than ar there on every task "
              f"(--no-stop-when-crossed runs {', '.join(map(str, sizes))})")
    print(f"wrote {out / 'results.json'}, {out / 'crossover.json'}, {out / 'results.md'}, {out / 'throughput.png'}, "
          f"{out / 'samples.jsonl'}, {out / 'manifest.json'}")
    return 0
