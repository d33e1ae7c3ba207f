"""One evaluation split over one-thread worker processes by sample index, its records joined after.

``refusion bench --jobs N`` runs N copies of itself, worker ``k`` decoding the samples whose index ``i``
has ``i % N == k`` of every task with every row, rows interleaved per sample as in one process, so
machine noise still hits the rows of a sample alike and speed ratios stay paired. Each worker has one
torch thread: on a CPU, a forward of a few tokens gains little from a second thread, so two one-thread
processes decode more than one two-thread process (``refusion.core.workers``).

Layout: worker ``k`` appends its records to ``OUT/shards/k/samples.jsonl`` (its log: ``run.log`` beside
it). Before the workers start, every record already in ``OUT`` (``samples.jsonl`` and any shard files
a killed run left) is split again over the N shards, so a resumed run may change N; after all workers
succeed the records are joined into ``OUT/samples.jsonl`` (written whole, then renamed) and the shard
folders removed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from refusion.core.workers import Job, run_jobs
from refusion.experiments.records import load_records
from refusion.experiments.runner import KEY


def shard_folder(out: Path, k: int) -> Path:
    return out / "shards" / str(k)


def parse_shard(value: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``0 <= K < N``."""
    from refusion.core.config import ConfigError

    k, sep, n = value.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise ConfigError(f"--shard: expected K/N with 0 <= K < N (e.g. 0/2), got {value!r}")
    return int(k), int(n)


def _all_records(out: Path) -> list[dict[str, Any]]:
    """Every record in ``OUT``, joined and shard files, each key once (first seen wins)."""
    seen, records = set(), []
    files = [out / "samples.jsonl", *sorted((out / "shards").glob("*/samples.jsonl"))]
    for path in files:
        for rec in load_records(path):
            key = (*(rec[f] for f in KEY), rec.get("seed"))  # a run repeated over seeds: one record per seed
            if key not in seen:
                seen.add(key)
                records.append(rec)
    return records


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    """``records`` as JSONL at ``path``, written to a temporary file first and renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def split_records(out: Path, workers: int) -> int:
    """Deal the records already in ``OUT`` to ``workers`` shard files by sample index; return their count."""
    records = _all_records(out)
    shutil.rmtree(out / "shards", ignore_errors=True)
    for k in range(workers):
        _write_lines(shard_folder(out, k) / "samples.jsonl", [r for r in records if r["idx"] % workers == k])
    (out / "samples.jsonl").unlink(missing_ok=True)
    return len(records)


def join_records(out: Path, order: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Join the shard files into ``OUT/samples.jsonl`` (sorted by ``order``), remove them, return the records."""
    records = sorted(_all_records(out), key=order)
    _write_lines(out / "samples.jsonl", records)
    shutil.rmtree(out / "shards", ignore_errors=True)
    return records


def run_shards(out: Path, workers: int, command: Callable[[int, Path], list[str]], total: int,
               desc: str = "bench") -> None:
    """Run ``command(k, shard_folder)`` for every worker ``k`` at once, one thread each, with one progress
    bar over all of them (``total`` decodes in all, counted from the shard files). Raises ``RuntimeError``
    naming the failed workers' logs."""
    folders = [shard_folder(out, k) for k in range(workers)]
    jobs = [Job(str(k), command(k, folders[k]), folders[k] / "run.log") for k in range(workers)]

    def decoded() -> int:  # complete lines only; never parse a file a worker is appending to
        return sum((f / "samples.jsonl").read_bytes().count(b"\n") for f in folders
                   if (f / "samples.jsonl").is_file())

    finished: list = []
    thread = threading.Thread(target=lambda: finished.extend(run_jobs(jobs, workers)), daemon=True)
    with tqdm(total=total, initial=decoded(), desc=f"{desc} ({workers} workers)", unit="decode",
              dynamic_ncols=True) as bar:
        thread.start()
        while thread.is_alive():
            thread.join(timeout=1.0)
            bar.update(decoded() - bar.n)
    failed = [f for f in finished if f.returncode]
    if failed:
        logs = ", ".join(str(f.log) for f in failed)
        raise RuntimeError(f"{len(failed)} of {workers} workers failed (logs: {logs}); their finished samples "
                           "are kept: rerun with --resume")
