"""One-thread worker processes: run command lines at most ``workers`` at a time, one thread each.

Measured on the 2-core development machine: a torch process with more threads than free cores slows
down several-fold (its threads spin-wait), while two one-thread processes get ~1.1x the throughput of
one two-thread process. So every worker gets exactly one OpenMP/MKL thread. Used by
``refusion results --jobs`` (one ablation per worker), ``refusion bench --jobs`` (a share of the samples
per worker) and ``refusion train --recipe tiny --jobs`` (one fine-tune per worker).
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class Job:
    name: str
    cmd: list[str]
    log: Path  # stdout and stderr are appended here


@dataclass(frozen=True)
class Finished:
    name: str
    wall_s: float
    returncode: int
    log: Path


def run_jobs(jobs: Sequence[Job], workers: int, on_finish: Callable[[Finished], None] | None = None) -> list[Finished]:
    """Run ``jobs`` in the given order, at most ``workers`` at once, each with one thread; call
    ``on_finish`` as each one ends (in the calling thread's order of completion). Returns them all,
    in order of completion; a failed job is a non-zero ``returncode``, never an exception."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def one(job: Job) -> Finished:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(job.log, "a") as fh:
            rc = subprocess.run(job.cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
        return Finished(job.name, time.perf_counter() - t0, rc, job.log)

    done: list[Finished] = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for fut in as_completed([pool.submit(one, job) for job in jobs]):
            done.append(fut.result())
            if on_finish is not None:
                on_finish(done[-1])
    return done
