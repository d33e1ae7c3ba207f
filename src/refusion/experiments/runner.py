"""The evaluation engine shared by ``refusion bench`` and ``refusion ablate``.

A run is a labelled decoder configuration on a model; the engine decodes every sample of every task
with every run, interleaved per sample (so machine noise hits all runs alike), appends each finished
sample to ``samples.jsonl`` at once (flushed), skips finished samples on ``resume``, and summarises one
row per (run, task): accuracy, tokens/s (total tokens / total decode time) and its per-sample median,
TPF (tokens / forwards), mean NFE, mean latency, and the speed-up over a baseline run measured in the
same run.

A run with ``batch_size`` N > 1 sends the samples of each task still to do in chunks of N through
:meth:`~refusion.core.interfaces.Decoder.generate_batch` (a decoder without a batched loop decodes a
chunk one sample after another); each result is still one record, written as it comes back, so a
resumed run forms its chunks from the samples not yet written. A batched record adds ``batch_size``,
``batch`` (the index of its chunk's first sample), ``batch_samples`` (samples in the chunk) and
``batch_wall_s`` (the chunk's decode wall time); its ``wall_s`` is its latency from the chunk's start
(for a decoder without a batched loop: its own decode time). Chunks of all runs are interleaved by
their first sample. A batched row's tokens/s is the aggregate throughput, total tokens / total chunk
wall time (each record counts ``batch_wall_s / batch_samples``), and its latency the mean per-sample
latency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from refusion.core.config import ConfigError, build_decoder, validate_config
from refusion.core.threads import set_threads  # noqa: F401  (its old home; commands import it from core.threads)
from refusion.experiments.records import (
    RecordWriter, SampleRecord, Speed, SummaryRow, SummaryStats, load_records, sample_records,
)
from refusion.models.loading import RuntimeOptions

KEY = ("run", "task", "idx")


@dataclass
class Run:
    """One labelled configuration: ``configs[task]`` is the full decoder config used on that task."""

    label: str
    model: str
    configs: dict[str, dict[str, Any]]
    params: dict[str, Any] = field(default_factory=dict)  # the swept values, for tables and plots
    batch_size: int = 1  # samples per generate_batch call (1: one generate call per sample)
    limit: int | None = None  # at most this many samples per task (the first ones), under the run's limit
    seeds: int = 1  # decode each sample with this many seeds (the config's seed, +1, ...); records carry "seed"

    def seed_values(self, task: str) -> list[int | None]:
        """The ``seed`` of each repetition on ``task``: None (the config's own, records without a seed) for
        one; else the config's seed and the next ``seeds - 1``."""
        if self.seeds == 1:
            return [None]
        base = int(self.configs[task].get("seed", 0) or 0)
        return [base + s for s in range(self.seeds)]

    @property
    def decoder(self) -> str:
        return next(iter(self.configs.values()))["decoder"]


def summarize(records: list[dict[str, Any]], runs: list[Run], baseline: str | None = None,
              speedup_key: str = "speedup") -> list[SummaryRow]:
    """One row per (run, task), in run order; ``speedup_key`` (the bench names it ``speedup_vs_ar``) =
    tokens/s over the baseline run's on that task,
    on the samples both decoded (a run with a ``limit`` is compared on its own samples only). A run
    repeated over seeds (``Run.seeds``) pools every seed's records (``n`` counts them, ``seeds`` says how
    many) and is paired with the baseline by sample and seed. The statistics are
    :class:`~refusion.experiments.records.SummaryStats`: tokens/s is total tokens / total decode time (for
    a batched run the chunks' wall time, so the aggregate throughput), latency the mean per-sample
    ``wall_s``; a batched run's rows add ``batch_size``."""
    groups: dict[tuple[str, str], list[SampleRecord]] = {}
    for r in sample_records(records):
        groups.setdefault((r.run, r.task), []).append(r)
    rows = []
    for run in runs:
        for task in sorted({t for (lbl, t) in groups if lbl == run.label}):
            rs = groups[run.label, task]
            row = {"run": run.label, "task": task, "decoder": run.decoder, "model": run.model, **run.params,
                   **SummaryStats.of(rs).row()}
            if run.seeds > 1:
                row["seeds"] = run.seeds
            sizes = {r.batch_size or 1 for r in rs}
            if sizes != {1}:
                row["batch_size"] = max(sizes)  # one size per (run, task): evaluate refuses to mix them
            rows.append(row)
    for r in rows:
        ref = groups.get((baseline, r["task"]), [])
        ids = {x.key for x in groups[r["run"], r["task"]]}
        ref = [x for x in ref if x.key in ids] if len(ids) < len(ref) else ref
        ref_tps = Speed.of(ref).tokens_per_second
        r[speedup_key] = r["tokens_per_second"] / ref_tps if ref_tps else None
    if baseline is not None:
        add_paired_intervals(rows, groups, baseline)
    return rows


def add_paired_intervals(rows: list[dict[str, Any]], groups: dict[tuple[str, str], list[SampleRecord]],
                         baseline: str) -> None:
    """For each row of another run than ``baseline``, on the samples both decoded (matched by ``idx`` and,
    for runs repeated over seeds, ``seed``: a baseline without seeds pairs with every seed of the row):
    ``accuracy_diff`` (this run's accuracy minus the baseline's, with its 95% paired-bootstrap interval,
    the exact McNemar p-value and the discordant counts) and ``speedup_interval`` (95% paired-bootstrap
    interval of the tokens/s ratio, from each sample's tokens and decode time)."""
    from refusion.experiments.stats import paired_accuracy, throughput_ratio

    for row in rows:
        ref = groups.get((baseline, row["task"]))
        if row["run"] == baseline or not ref or any(r.idx is None for r in ref):
            continue  # records without sample ids cannot be paired
        mine = [r for r in groups[row["run"], row["task"]] if r.idx is not None]
        by_key = {r.key: r for r in ref}
        pairs = [(by_key[m.key], m) for m in mine if m.key in by_key]
        if not pairs:  # a baseline decoded once (no seeds): each seed of this run pairs with its sample
            by_idx = {r.idx: r for r in ref if r.seed is None}
            pairs = [(by_idx[m.idx], m) for m in mine if m.idx in by_idx]
        if not pairs:
            continue
        acc = paired_accuracy([b.correct for b, _ in pairs], [m.correct for _, m in pairs])
        row["accuracy_diff"] = {"value": acc.difference.value, "low": acc.difference.low,
                                "high": acc.difference.high, "p_value": acc.p_value, "n": acc.n,
                                "only_baseline": acc.only_a, "only_this": acc.only_b}
        ratio = throughput_ratio([b.generated_tokens for b, _ in pairs], [b.decode_share_s() for b, _ in pairs],
                                 [m.generated_tokens for _, m in pairs], [m.decode_share_s() for _, m in pairs])
        row["speedup_interval"] = [ratio.low, ratio.high]


def check_batch_size(value: int | None, field: str = "--batch-size") -> int | None:
    """``value`` when it is a batch size (an integer of at least 1, or None: not given); else a
    :class:`ConfigError` naming ``field``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{field}: must be an integer of at least 1, got {value!r}")
    return value


def check_runs(runs: list[Run], tasks: list[str], runtime: RuntimeOptions) -> None:
    """Fail before any model loads: an unavailable runtime option, duplicate run labels, a bad batch size,
    or a decoder config that does not validate on one of ``tasks``."""
    runtime.resolve()
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"run labels must be unique: {labels}")
    for run in runs:
        check_batch_size(run.batch_size, f"batch_size of run {run.label!r}")
        for t in tasks:
            validate_config(run.configs[t])


def evaluate(
    runs: list[Run], tasks: list[str], split: str, limit: int | None, out: Path, resume: bool = False,
    runtime: RuntimeOptions | None = None, desc: str = "eval", on_record: Callable[[dict], None] | None = None,
    time_forwards: bool = False, shard: tuple[int, int] | None = None, rerun_changed: bool = False,
    command: str | None = None, inputs: dict[str, Any] | None = None, record_tokens_in: bool = False,
) -> list[dict[str, Any]]:
    """Decode every sample of every task with every run; return all records (old and new). Every model
    loads with ``runtime`` (default: the CPU in float32), checked before any model loads. Each run decodes
    in chunks of its ``batch_size``. With ``time_forwards`` every model forward is timed
    (:attr:`~refusion.models.backend.Backbone.time_forwards`: two synchronisations per forward on a GPU)
    and each record adds ``forward_s`` (a batched one: ``batch_forward_s``, its chunk's). ``shard=(k, n)``
    decodes only the samples whose index ``i`` has ``i % n == k`` (one worker of
    :mod:`refusion.experiments.sharding`). With ``record_tokens_in`` every record carries ``tokens_in``
    (the tokens fed in its rows of the forwards it took part in; a speculative decode's records always do).

    ``OUT/manifest.json`` records what produced the folder (:mod:`refusion.experiments.manifest`: every
    run's validated config per task, its model's weights hash, the machine, ``command`` and ``inputs``)
    and every record carries its (run, task)'s ``config_key``. ``resume`` continues only what the same
    configs started: a folder whose manifest differs is refused, naming each difference, unless
    ``rerun_changed`` (which implies ``resume``) drops the changed runs' records and decodes them anew. A
    worker (``shard``) leaves the manifest to the process that started it."""
    from refusion.experiments.manifest import prepare_output, run_entries
    from refusion.models.tokenizer import encode_prompt
    from refusion.models.backend import Backbone
    from refusion.tasks import get_task

    runtime = runtime or RuntimeOptions()
    check_runs(runs, tasks, runtime)
    entries = run_entries(runs, tasks, split, runtime)
    task_objs = [get_task(t) for t in tasks]
    out.mkdir(parents=True, exist_ok=True)
    samples_path = out / "samples.jsonl"
    resume = resume or rerun_changed
    if samples_path.exists() and not resume:
        raise ConfigError(f"{samples_path} exists: pass --resume to continue that run, or choose another --out")
    records = load_records(samples_path)
    size_of = {r.label: r.batch_size for r in runs}
    for r in records if not rerun_changed else ():  # a resumed run keeps its batch size: its rows would mix two
        if r["run"] in size_of and r["task"] in tasks and r.get("batch_size", 1) != size_of[r["run"]]:
            raise ConfigError(f"batch_size: {samples_path} holds run {r['run']!r} on {r['task']!r} decoded at batch "
                              f"size {r.get('batch_size', 1)}, not {size_of[r['run']]}; resume with that batch size, "
                              "choose another --out, or pass --rerun-changed to decode those runs anew")
    if shard is None:
        if prepare_output(out, command or desc, entries, resume, rerun_changed, inputs):
            records = load_records(samples_path)
    done = {(r["run"], r["task"], r["idx"], r.get("seed")) for r in records}

    backbones: dict[str, Backbone] = {}
    decoders = {}
    for run in runs:
        if run.model not in backbones:
            backbones[run.model] = Backbone.from_pretrained(run.model, **runtime.model_dump())
        for t in tasks:
            for seed in run.seed_values(t):
                config = run.configs[t] if seed is None else {**run.configs[t], "seed": seed}
                decoders[run.label, t, seed] = build_decoder(backbones[run.model], config)
    examples = {t.name: t.examples(split, limit) for t in task_objs}
    prompts: dict[tuple[str, str], list[list[int]]] = {}  # (model, task) -> encoded prompts

    def prompt(run: Run, task: str, i: int) -> list[int]:
        if (run.model, task) not in prompts:
            tok = backbones[run.model].tokenizer
            prompts[run.model, task] = [encode_prompt(tok, ex.query) for ex in examples[task]]
        return prompts[run.model, task][i]

    # chunks of the samples still to do, per (run, task); interleaved by their first sample, so that
    # machine noise hits all runs alike (at batch size 1: sample by sample, run after run)
    todo: list[tuple[int, int, int, int, Any, list[int]]] = []  # (task, first index, run, seed order, seed, indices)
    for ti, t in enumerate(task_objs):
        for ri, run in enumerate(runs):
            n = len(examples[t.name]) if run.limit is None else min(run.limit, len(examples[t.name]))
            for si, seed in enumerate(run.seed_values(t.name)):
                left = [i for i in range(n) if (run.label, t.name, i, seed) not in done
                        and (shard is None or i % shard[1] == shard[0])]
                for c in range(0, len(left), run.batch_size):
                    todo.append((ti, left[c], ri, si, seed, left[c:c + run.batch_size]))
    todo.sort(key=lambda c: c[:4])
    if todo:
        for run in runs:  # warm-up, untimed, so the first timed chunk pays no one-off costs
            t0 = task_objs[0].name
            dec = decoders[run.label, t0, run.seed_values(t0)[0]]
            if run.batch_size == 1:
                dec.generate(prompt(run, t0, 0))
            else:
                dec.generate_batch([prompt(run, t0, i) for i in range(min(run.batch_size, len(examples[t0])))])
    if time_forwards:
        for bb in backbones.values():
            bb.time_forwards = True
    try:
        with RecordWriter(samples_path) as writer, \
                tqdm(total=sum(len(c[-1]) for c in todo), desc=desc, unit="decode", dynamic_ncols=True) as bar:
            for ti, _, ri, _, seed, idx in todo:
                task, run = task_objs[ti], runs[ri]
                dec, bb = decoders[run.label, task.name, seed], backbones[run.model]
                fwd0 = bb.forward_s
                if run.batch_size == 1:
                    results = [dec.generate(prompt(run, task.name, idx[0]))]
                    chunk: dict[str, Any] = {}
                else:
                    results = dec.generate_batch([prompt(run, task.name, i) for i in idx])
                    chunk_wall = results[0].stats.batch_wall_s
                    if chunk_wall is None:  # decoded one after another (no batched loop, or a chunk of one)
                        chunk_wall = sum(res.stats.wall_s for res in results)
                    chunk = {"batch_size": run.batch_size, "batch": idx[0], "batch_samples": len(idx),
                             "batch_wall_s": chunk_wall}
                if time_forwards:
                    chunk["forward_s" if run.batch_size == 1 else "batch_forward_s"] = bb.forward_s - fwd0
                for i, res in zip(idx, results):
                    ex = examples[task.name][i]
                    counts = res.stats.extra or {}  # a decoder's own counts (speculative: drafted, accepted, ...)
                    rec = SampleRecord(  # tokens_in: tokens fed in the sample's rows of its forwards
                        run=run.label, task=task.name, idx=i, seed=seed, decoder=run.decoder, model=run.model,
                        config_key=entries[run.label][task.name]["config_key"], correct=bool(task.score(ex, res.text)),
                        generated_tokens=res.stats.generated_tokens, nfe=res.stats.nfe, wall_s=res.stats.wall_s,
                        **chunk, completion=res.text, token_ids=res.token_ids,
                        tokens_in=res.stats.tokens_in if record_tokens_in or counts else None,
                        extra=dict(counts)).to_dict()
                    writer.write(rec)
                    records.append(rec)
                    bar.update()
                    if on_record:
                        on_record(rec)
    finally:
        for bb in backbones.values():
            bb.time_forwards = False
    return wanted_records(records, runs, tasks)


def wanted_records(records: list[dict[str, Any]], runs: list[Run], tasks: list[str]) -> list[dict[str, Any]]:
    """The ``records`` of ``runs`` on ``tasks`` with the seeds those runs decode now (a folder may hold
    other runs' records, or those of another seed count)."""
    wanted = {(r.label, t, seed) for r in runs for t in tasks for seed in r.seed_values(t)}
    return [r for r in records if (r["run"], r["task"], r.get("seed")) in wanted]


SUMMARY_COLUMNS = (("n", "n"), ("accuracy", "acc %"), ("tokens_per_second", "tok/s"), ("tpf", "TPF"),
                   ("nfe_mean", "NFE"), ("latency_s_mean", "latency s"), ("speedup", "speed-up"))
#: the bench's rows carry their speed-up over AR as ``speedup_vs_ar`` (results.json's documented schema)
SPEEDUP_VS_AR_COLUMN = ("speedup_vs_ar", "speed-up")


def summary_cell(key: str, value: Any) -> str:
    """A summary row's cell: accuracy in percent, other numbers to two decimals, nothing as ``-``."""
    return ("-" if value is None else f"{100 * value:.1f}" if key == "accuracy" else
            f"{value:.2f}" if isinstance(value, float) else str(value))


def _summary_columns(rows: list[dict[str, Any]], extra: list[str]) -> list[tuple[str, str]]:
    """The table's columns; the speed-up column reads ``speedup_vs_ar`` when the rows carry it."""
    stats = list(SUMMARY_COLUMNS)
    if any("speedup_vs_ar" in r for r in rows):
        stats[-1] = SPEEDUP_VS_AR_COLUMN
    return [("task", "task"), ("run", "run"), *[(k, k) for k in _with_batch(rows, list(extra))], *stats]


def _batch_default(key: str) -> Any:
    return 1 if key == "batch_size" else None  # an unbatched row was decoded at batch size 1


def print_table(rows: list[dict[str, Any]], title: str, extra: list[str] = (),
                where: str = "results.json and summary.md in the output folder hold every column") -> None:
    """The summary rows in the terminal (:mod:`refusion.experiments.tables`), task by task."""
    from refusion.experiments.tables import cells, print_rich

    cols = _summary_columns(rows, list(extra))
    body = cells(sorted(rows, key=lambda r: r["task"]), cols, summary_cell, _batch_default)
    print_rich([h for _, h in cols], body, title, left=("task", "run"), where=where)


def _with_batch(rows: list[dict[str, Any]], extra: list[str]) -> list[str]:
    """``extra`` plus a ``batch_size`` column when some row was decoded in batches of more than one."""
    batched = any(r.get("batch_size", 1) != 1 for r in rows) and "batch_size" not in extra
    return [*extra, "batch_size"] if batched else list(extra)


def markdown_table(rows: list[dict[str, Any]], extra: list[str] = ()) -> str:
    """The rows as a markdown table; with paired intervals against a baseline
    (:func:`add_paired_intervals`), two more columns: the accuracy difference in points and the speed-up,
    each with its 95% interval."""
    from refusion.experiments.tables import cells, markdown

    cols = _summary_columns(rows, list(extra))
    heads = [h for _, h in cols]
    ordered = sorted(rows, key=lambda r: r["task"])
    body = cells(ordered, cols, summary_cell, _batch_default)
    if any(r.get("accuracy_diff") for r in rows):
        heads += ["acc vs baseline, points [95%]", "speed-up [95%]"]
        for r, row_cells in zip(ordered, body):
            d, ci = r.get("accuracy_diff"), r.get("speedup_interval")
            row_cells.append(f"{100 * d['value']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]" if d else "-")
            row_cells.append(f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "-")
    return markdown(heads, body)


def write_json(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(rows, indent=1))
