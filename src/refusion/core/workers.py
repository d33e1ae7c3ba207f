"""One-thread worker processes: run command lines at most ``workers`` at a time, one thread each.

Measured on the 2-core development machine: a torch process with more threads than free cores slows
down several-fold (its threads spin-wait), while two one-thread processes get ~1.1x the throughput of
one two-thread process. So every worker gets exactly one OpenMP/MKL thread. Used by
``refusion results --jobs`` (one ablation per worker), ``refusion bench --jobs`` (a share of the samples
per worker) and ``refusion train --recipe tiny --jobs`` (one fine-tune per worker).

A worker receives its settings as a written file, never as a command line rebuilt flag by flag:
:func:`call_job` writes ``CALL.json`` (``{"function": "module:name", "kwargs": {...}, "threads": 1}``;
pydantic models, paths and tuples keep their types through :func:`encode` / :func:`decode`) and the
worker, ``python -m refusion.core.workers CALL.json``, calls the function with those arguments in one
torch thread. Every option a caller passes reaches the worker, with no list of flags to keep in step.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


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


def encode(value: Any) -> Any:
    """``value`` as JSON data that :func:`decode` turns back into it: a pydantic model as its class and
    fields, a path, a tuple; mappings and lists element by element."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        cls = type(value)
        return {"__model__": f"{cls.__module__}:{cls.__qualname__}", "fields": value.model_dump(mode="json")}
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"cannot pass a {type(value).__name__} to a worker process: {value!r}")


def _find(ref: str) -> Any:
    module, _, name = ref.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def decode(data: Any) -> Any:
    """The value :func:`encode` wrote as ``data``."""
    if isinstance(data, dict):
        if "__model__" in data:
            return _find(data["__model__"]).model_validate(data["fields"])
        if "__path__" in data:
            return Path(data["__path__"])
        if "__tuple__" in data:
            return tuple(decode(v) for v in data["__tuple__"])
        return {k: decode(v) for k, v in data.items()}
    if isinstance(data, list):
        return [decode(v) for v in data]
    return data


def write_call(path: Path, function: Callable[..., Any], kwargs: dict[str, Any], threads: int | None = 1) -> Path:
    """Write the call ``function(**kwargs)`` to ``path`` (JSON) for a worker to run in ``threads`` torch threads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = {"function": f"{function.__module__}:{function.__qualname__}", "kwargs": encode(kwargs), "threads": threads}
    path.write_text(json.dumps(spec, indent=1))
    return path


def call_command(spec: Path, function: Callable[..., Any], kwargs: dict[str, Any]) -> list[str]:
    """The command line of a worker that runs ``function(**kwargs)`` in one torch thread, the call written to
    ``spec`` (:func:`write_call`)."""
    write_call(spec, function, kwargs)
    return [sys.executable, "-m", "refusion.core.workers", str(spec)]


def call_job(name: str, function: Callable[..., Any], kwargs: dict[str, Any], spec: Path, log: Path) -> Job:
    """A :class:`Job` of :func:`call_command`, logging to ``log``."""
    return Job(name, call_command(spec, function, kwargs), log)


def run_call(spec: Path) -> Any:
    """Run the call written to ``spec`` in this process; its return value."""
    data = json.loads(Path(spec).read_text())
    if data.get("threads"):
        import torch

        torch.set_num_threads(int(data["threads"]))
    return _find(data["function"])(**decode(data["kwargs"]))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refusion.core.workers CALL.json``: a worker's entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m refusion.core.workers CALL.json", file=sys.stderr)
        return 2
    run_call(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
