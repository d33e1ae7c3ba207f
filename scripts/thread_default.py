"""Measure candidates for the default torch thread count: ReFusion's speed-up over AR, quiet and beside
a one-thread busy process.

For each candidate, ``refusion bench --decoders ar,refusion --limit N`` runs once on a quiet machine and
once beside a one-thread busy process (a loop of float32 matrix products in one torch thread, as a
training job is); the script prints, per task, ReFusion's tokens/s over AR's in both and their ratio
(busy / quiet). A candidate keeps its speed-up beside a busy process when that ratio is within 10% of 1.

Candidates (``--candidates``, comma-separated):

- ``one``: ``--threads 1`` (the decoding commands' default);
- ``auto``: ``--threads auto`` (physical cores less the one-minute load average);
- ``passive``: ``--threads <cores>`` with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP threads sleep instead of
  spin-waiting);
- ``cores``: ``--threads <cores>`` (torch's own default, one thread per core: the reference).

Every quiet run goes first, then the busy ones, each busy run after ``--settle`` seconds beside the busy
process (the load average, which ``auto`` reads, takes about a minute to rise). Needs a machine with
nothing else running for the quiet runs. Writes each bench into ``OUT/<candidate>-<quiet|busy>/`` and
the summary into ``OUT/thread_default.json``::

    python scripts/thread_default.py --out runs/thread_default            # the measurement (--limit 50)
    python scripts/thread_default.py --out runs/td --limit 2 --tasks arith --settle 0   # a smoke run
    python scripts/thread_default.py --out runs/thread_default --summarize cores   # a stopped candidate's medians
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BUSY = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\n"
        "while True:\n    a = torch.tanh(a @ a)\n")


def candidate_flags(name: str, cores: int) -> tuple[list[str], dict[str, str]]:
    """(bench flags, extra environment) of a candidate."""
    if name == "one":
        return ["--threads", "1"], {}
    if name == "auto":
        return ["--threads", "auto"], {}
    if name == "passive":
        return ["--threads", str(cores)], {"OMP_WAIT_POLICY": "PASSIVE"}
    if name == "cores":
        return ["--threads", str(cores)], {}
    raise SystemExit(f"--candidates: unknown candidate {name!r}; allowed: one, auto, passive, cores")


def speedups(folder: Path) -> dict[str, float]:
    """Task -> refusion's tokens/s over ar's, from a bench folder's results.json."""
    rows = json.loads((folder / "results.json").read_text())
    return {r["task"]: r["speedup_vs_ar"] for r in rows if r["run"] == "refusion" and r["speedup_vs_ar"]}


def median_decode_s(folder: Path) -> dict[tuple[str, str], tuple[float, int]]:
    """(run, task) -> (median seconds per decode, samples) in a bench folder (a stopped run's too)."""
    import statistics

    walls: dict[tuple[str, str], list[float]] = {}
    path = folder / "samples.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip():
            r = json.loads(line)
            walls.setdefault((r["run"], r["task"]), []).append(r["wall_s"])
    return {key: (statistics.median(w), len(w)) for key, w in walls.items()}


def summarize_stopped(out: Path, name: str) -> None:
    """Print what a candidate's folders hold when its bench did not finish (``--summarize``)."""
    for state in ("quiet", "busy"):
        med = median_decode_s(out / f"{name}-{state}")
        cells = [f"{run} {task} {s:.3f} s (n={n})" for (run, task), (s, n) in sorted(med.items())]
        print(f"  {name:8s} {state:5s} median s/decode: " + "; ".join(cells))


def run_bench(folder: Path, flags: list[str], env: dict[str, str], limit: int, tasks: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "refusion.cli", "bench", "--decoders", "ar,refusion", "--limit", str(limit),
           "--tasks", tasks, "--out", str(folder), "--rerun-changed", *flags]
    print(f"[thread_default] load {os.getloadavg()[0]:.2f}: {' '.join(cmd[2:])}"
          + (f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else ""), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    return speedups(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/thread_default")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--tasks", default="arith,code,facts")
    p.add_argument("--candidates", default="one,auto,passive,cores")
    p.add_argument("--summarize", metavar="CANDIDATES",
                   help="only print the median seconds per decode in these candidates' folders (stopped runs too)")
    p.add_argument("--settle", type=float, default=60.0, help="seconds beside the busy process before each busy run")
    a = p.parse_args(argv)
    if a.summarize:
        for name in a.summarize.split(","):
            summarize_stopped(Path(a.out), name)
        return 0
    from refusion.core.threads import physical_cores

    cores = physical_cores()
    names = [c for c in a.candidates.split(",") if c]
    plans = {n: candidate_flags(n, cores) for n in names}
    out = Path(a.out)
    found: dict[str, dict[str, dict[str, float]]] = {n: {} for n in names}
    for n in names:
        found[n]["quiet"] = run_bench(out / f"{n}-quiet", *plans[n], a.limit, a.tasks)
    for n in names:
        busy = subprocess.Popen([sys.executable, "-c", BUSY], env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            time.sleep(a.settle)
            found[n]["busy"] = run_bench(out / f"{n}-busy", *plans[n], a.limit, a.tasks)
        finally:
            busy.kill()
            busy.wait()
    tasks = [t for t in a.tasks.split(",") if t]
    print(f"\nrefusion's tokens/s over ar's, quiet -> beside a one-thread busy process (busy / quiet); "
          f"{cores} physical cores, --limit {a.limit}")
    summary = []
    for n in names:
        cells = []
        for t in tasks:
            q, b = found[n]["quiet"].get(t), found[n]["busy"].get(t)
            ratio = b / q if q and b else None
            summary.append({"candidate": n, "task": t, "quiet": q, "busy": b, "busy_over_quiet": ratio})
            cells.append(f"{t} {q:.2f}x -> {b:.2f}x ({ratio:.2f})" if ratio else f"{t} -")
        within = all(s["busy_over_quiet"] and abs(s["busy_over_quiet"] - 1) <= 0.10 for s in summary
                     if s["candidate"] == n)
        print(f"  {n:8s} {'; '.join(cells)}: {'within' if within else 'NOT within'} 10%")
    (out / "thread_default.json").write_text(json.dumps({"cores": cores, "limit": a.limit, "rows": summary}, indent=1))
    print(f"wrote {out / 'thread_default.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
