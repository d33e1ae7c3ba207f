"""``refusion results``: every shipped ablation in one run, and a results page written from it.

The page goes to ``OUT/results.md`` (``--doc PATH`` elsewhere); ``--write-docs`` rewrites the shipped
``docs/results.md``, so that a trial run never overwrites it by default.

Runs each ablation config of ``experiments/configs/ablations/`` with
the same engine as ``refusion ablate`` into ``OUT/<name>/`` (resumable: ``--resume`` skips finished
samples), times each, draws its plots next to the document and writes one markdown page: the command,
the machine, per ablation its table, figures, the paper's own finding beside it and a verdict. Each
section says when and on which machine it ran: ``--only`` reruns some analyses, and one with no results
in ``OUT`` keeps its section of the existing page, unless a checkpoint it decodes has changed since (then
it must be rerun too).

The verdicts are :mod:`refusion.experiments.claims`' rules over the measured rows; the page is
:mod:`refusion.experiments.results_page`'s.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from refusion.experiments.ablate import load_ablation, run_ablation
from refusion.experiments.config_files import shipped_configs
from refusion.experiments.results_page import (
    WALL_FILE, indexed_sections, kept_sections, models_used, write_document,
)
from refusion.models.loading import RuntimeOptions, runtime_from_args

ORDER = ("kv_cache", "scorers", "slot_threshold", "token_threshold", "slot_size", "serial_blocks", "frontier",
         "variants", "ladder", "speculative")


def ablation_command(name: str, out: Path, limit: int | None, resume: bool,
                     runtime: RuntimeOptions | None = None, rerun_changed: bool = False) -> list[str]:
    """The worker command that runs one ablation into ``out`` (:func:`run_ablation` with these settings, written
    to ``OUT/call.json``: :func:`refusion.core.workers.call_command`), in one torch thread."""
    from refusion.core.workers import call_command

    return call_command(Path(out) / "call.json", run_ablation, {
        "config": name + ".yaml", "out": Path(out), "resume": resume, "limit": limit, "runtime": runtime,
        "rerun_changed": rerun_changed})


def decode_count(name: str, limit: int | None = None) -> int:
    """Decodes the shipped ablation ``name`` runs: (runs + grid points) x samples over its tasks (``limit``,
    else the file's, else each task's whole split). The workers start the ablations in descending order of
    it (longest first), so the last to start are short and the workers finish close together."""
    from refusion.tasks import get_task

    cfg = load_ablation(f"{name}.yaml")
    grid_points = math.prod(len(values) for values in cfg.grid.axes.values()) if cfg.grid else 0
    per_task = limit or cfg.limit
    samples = sum(min(per_task or math.inf, get_task(t).sizes[cfg.split]) for t in cfg.tasks)
    return int((len(cfg.runs) + grid_points) * samples)


def _run_workers(names: list[str], out: Path, limit: int | None, resume: bool, runtime: RuntimeOptions | None,
                 jobs: int, timings: dict[str, float], timing_file: Path, rerun_changed: bool = False) -> None:
    """Run the ablations in ``jobs`` one-thread ``refusion ablate`` processes, longest first (``decode_count``),
    each logging to ``OUT/<name>/run.log``; record each one's wall time as it finishes."""
    from refusion.core.workers import Finished, Job, run_jobs

    def record(f: Finished) -> None:
        timings[f.name] = timings.get(f.name, 0.0) + f.wall_s
        timing_file.write_text(json.dumps(timings, indent=1))
        print(f"[results] {f.name}: {'done' if f.returncode == 0 else f'FAILED (exit {f.returncode})'} in "
              f"{f.wall_s / 60:.1f} min (log: {f.log})", flush=True)

    work = [Job(n, ablation_command(n, out / n, limit, resume, runtime, rerun_changed=rerun_changed),
                out / n / "run.log")
            for n in sorted(names, key=lambda n: -decode_count(n, limit))]
    failed = [f.name for f in run_jobs(work, jobs, record) if f.returncode]
    if failed:
        raise RuntimeError(f"ablations failed: {failed}; see their run.log; rerun with --resume to continue")


def run_all(out: Path, doc: Path, names: list[str] | None = None, limit: int | None = None, resume: bool = False,
            runtime: RuntimeOptions | None = None, command: str = "refusion results", jobs: int = 1,
            run: bool = True, rerun_changed: bool = False) -> str:
    """Run the ablations ``names`` (default all; in this process, or in ``jobs`` worker processes) and write
    ``doc`` from every ablation with results in ``OUT`` and, for the others, the existing page's sections
    (so ``--only`` reruns some and keeps the rest); with ``run=False`` only rewrite ``doc`` from ``OUT`` (after
    a change to the verdict rules).
    Run times live in ``OUT/timings.json`` (per ablation) and ``OUT/wall.json`` (the whole command): a resumed
    run adds to them, a fresh one replaces them. A run writes ``OUT/manifest.json`` (the command, machine,
    packages, threads; each ablation's folder has its own with its runs' configs); ``resume`` and
    ``rerun_changed`` act in each ablation's folder as in ``refusion ablate``."""
    from refusion.experiments.manifest import build_manifest, write_manifest

    everything = [n for n in ORDER if n in shipped_configs("ablations")]
    names = names or everything
    timing_file = out / "timings.json"
    timings: dict[str, float] = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    if run and not resume:
        for name in names:
            timings.pop(name, None)
    if not run:
        missing = [n for n in names if not (out / n / "results.json").is_file()]
        if missing:
            raise RuntimeError(f"--doc-only: no results.json for {missing} in {out}; run them first")
    documented, kept = _documented(out, doc, names, everything)  # a stale kept section fails before the run
    if not run:
        return write_document(out, doc, documented, command, jobs, kept)
    resume = resume or rerun_changed
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, build_manifest("results", inputs={"ablations": names, "limit": limit, "jobs": jobs,
                                                          "doc": str(doc), "runtime": (runtime.model_dump() if runtime
                                                                                       else None)}))
    started = time.perf_counter()
    if jobs > 1:
        _run_workers(names, out, limit, resume, runtime, jobs, timings, timing_file, rerun_changed)
    else:
        for name in names:
            t0 = time.perf_counter()
            run_ablation(name + ".yaml", out / name, resume=resume, limit=limit, runtime=runtime,
                         rerun_changed=rerun_changed)
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0  # a resumed run adds its share
            timing_file.write_text(json.dumps(timings, indent=1))
    wall_file = out / WALL_FILE
    earlier_s = json.loads(wall_file.read_text())["wall_s"] if resume and wall_file.is_file() else 0.0
    wall_file.write_text(json.dumps({"wall_s": earlier_s + time.perf_counter() - started}))
    return write_document(out, doc, documented, command, jobs, kept)


def _documented(out: Path, doc: Path, names: list[str], everything: list[str]) -> tuple[list[str], dict]:
    """The analyses the page shows: those run now or with results in ``OUT``, and for the rest their sections
    in ``OUT/index.json`` or, for those it lacks (a page written before the index, or from another ``OUT``),
    on the existing page (kept as they were)."""
    with_results = [n for n in everything if n in names or (out / n / "results.json").is_file()]
    missing = [n for n in everything if n not in with_results]
    kept = indexed_sections(out, missing, models_used)
    kept.update(kept_sections(doc, [n for n in missing if n not in kept], models_used))
    return [n for n in everything if n in with_results or n in kept], kept


DOCS_PAGE = Path("docs/results.md")  # the shipped page, rewritten only with --write-docs


def add_results_command(sub) -> None:
    from refusion.experiments.args import add_machine_args, add_output_args, add_resume_args

    p = sub.add_parser("results", help="run every shipped ablation and write the results page from it "
                                       "(OUT/results.md; --write-docs: docs/results.md)")
    add_output_args(p, "runs/results", "one subfolder per ablation, manifest.json, and results.md unless --doc or "
                                       "--write-docs", None, "for every ablation; default: each file's limit")
    p.add_argument("--doc", default=None, help="the markdown page to write, figures beside it (default OUT/results.md)")
    p.add_argument("--write-docs", action="store_true",
                   help=f"write the shipped page, {DOCS_PAGE}, instead of OUT/results.md (run from the repository root)")
    p.add_argument("--only", help="comma-separated ablation names (default: all of " + ", ".join(ORDER) + ")")
    add_resume_args(p)
    p.add_argument("--doc-only", action="store_true",
                   help="run nothing: rewrite the page from the results already in --out (give the run's --limit/--jobs)")
    add_machine_args(p, device_help="cpu, cuda or cuda:N (default cpu)",
                     jobs_help="run the ablations in this many one-thread worker processes (2 on a 2-core machine)")
    p.set_defaults(func=cmd_results)


def cmd_results(a) -> int:
    from refusion.core.config import ConfigError
    from refusion.core.threads import set_threads

    names = a.only.split(",") if a.only else None
    unknown = [n for n in names or [] if n not in ORDER]
    if unknown:
        raise ConfigError(f"--only: unknown ablation(s) {unknown}; allowed: {', '.join(ORDER)}")
    if a.jobs < 1:
        raise ConfigError(f"--jobs: must be at least 1, got {a.jobs}")
    if a.doc and a.write_docs:
        raise ConfigError(f"--doc {a.doc} and --write-docs name two pages; give one of them")
    set_threads(a.threads)
    doc = DOCS_PAGE if a.write_docs else Path(a.doc) if a.doc else Path(a.out) / "results.md"
    command = ("refusion results" + (" --write-docs" if a.write_docs else "") + (f" --limit {a.limit}" if a.limit else "")
               + (f" --only {a.only}" if a.only else "") + (f" --jobs {a.jobs}" if a.jobs > 1 else ""))
    runtime = runtime_from_args(a)
    if not a.doc_only:
        runtime.resolve()  # an unavailable flag fails here, not in every worker
    try:
        run_all(Path(a.out), doc, names, a.limit, a.resume, runtime, command, a.jobs, run=not a.doc_only,
                rerun_changed=a.rerun_changed)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {doc} (figures in {doc.parent / doc.stem}/) from {a.out}")
    return 0
