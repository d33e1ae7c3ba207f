"""Two versions of the code side by side: aggregate tokens/s of the bench's decoders per batch size,
interleaved in one run, and whether their token ids agree.

Each version runs in its own worker process (``PYTHONPATH`` = its ``src``; one torch thread, float32,
CPU), which loads the models once. The parent sends the same decode jobs to both, one worker at a time,
alternating which goes first, so both see the same machine state; each job decodes the first ``--limit``
test prompts of a task in batches of the given size (``generate_batch``; ``generate`` at size 1) and
reports its wall time, generated tokens, token ids and the logits rows its forwards computed. Per decoder, task and batch size: tokens/s of
each version (the median over rounds), the ratio new / old (geometric mean over rounds) with a 95%
bootstrap interval over rounds, and the samples whose token ids differ::

    git worktree add /tmp/old <old commit>
    .venv/bin/python scripts/version_speed.py --old /tmp/old/src --decoders llada,block --batch-sizes 1,4,16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from refusion.core.config import build_decoder
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task
backbones, prompts = {}, {}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    bb = backbones.get(job["model"]) or backbones.setdefault(job["model"], Backbone.from_pretrained(job["model"]))
    key = (job["model"], job["task"], job["limit"])
    if key not in prompts:
        prompts[key] = [encode_prompt(bb.tokenizer, ex.query) for ex in get_task(job["task"]).examples("test", job["limit"])]
    decoder = build_decoder(bb, job["config"])
    todo, b, ids = prompts[key], job["batch"], []
    rows0 = bb.logits_rows
    t0 = time.perf_counter()
    for i in range(0, len(todo), b):
        chunk = todo[i : i + b]
        results = decoder.generate_batch(chunk) if b > 1 else [decoder.generate(chunk[0])]
        ids += [r.token_ids for r in results]
    wall = time.perf_counter() - t0
    print(json.dumps({"wall": wall, "tokens": sum(len(t) for t in ids), "ids": ids,
                      "logits_rows": bb.logits_rows - rows0}), flush=True)
"""


class Worker:
    def __init__(self, src: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died on {job}")
        return json.loads(line)


def bootstrap(logs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of exp(mean(logs)) by resampling rounds."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(logs) for _ in logs) / len(logs) for _ in range(n))
    return math.exp(means[int(0.025 * n)]), math.exp(means[int(0.975 * n) - 1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the old version's src folder")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    p.add_argument("--decoders", default="llada,block", help="bench decoders (bench.yaml's settings and models)")
    p.add_argument("--tasks", default="arith,code,facts")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--limit", type=int, default=16, help="test prompts per job")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    sys.path.insert(0, str(a.new))
    from refusion.experiments.bench import bench_runs, load_bench_config

    bench = load_bench_config()
    tasks = a.tasks.split(",")
    runs = [r for r in bench_runs(bench, list(bench.models), tasks) if r.label in a.decoders.split(",")]
    workers = {"old": Worker(a.old), "new": Worker(a.new)}
    rows = []
    print(f"{'decoder':10} {'task':6} {'batch':>5} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'95% interval':>16} differ  logits rows old/new")
    for task in tasks:  # every decoder and batch size on one task before the next task
        for run in runs:
            for b in [int(x) for x in a.batch_sizes.split(",")]:
                job = {"model": run.model, "task": task, "limit": a.limit, "config": run.configs[task], "batch": b}
                tps = {"old": [], "new": []}
                ids, head_rows = {}, {}
                for r in range(a.rounds + 1):  # round 0 warms up both workers
                    order = ["old", "new"] if r % 2 else ["new", "old"]
                    for name in order:
                        out = workers[name].run(job)
                        ids[name], head_rows[name] = out["ids"], out["logits_rows"]
                        if r:
                            tps[name].append(out["tokens"] / out["wall"])
                logs = [math.log(n / o) for n, o in zip(tps["new"], tps["old"])]
                lo, hi = bootstrap(logs)
                ratio = math.exp(sum(logs) / len(logs))
                differ = sum(x != y for x, y in zip(ids["old"], ids["new"]))
                med = {k: sorted(v)[len(v) // 2] for k, v in tps.items()}
                rows.append({"decoder": run.label, "task": task, "batch": b, "old_tps": med["old"], "new_tps": med["new"],
                             "ratio": ratio, "interval": [lo, hi], "differ": differ, "n": len(ids["new"]),
                             "logits_rows": head_rows})
                print(f"{run.label:10} {task:6} {b:>5} {med['old']:>10.1f} {med['new']:>10.1f} {ratio:>8.3f} "
                      f"{f'[{lo:.3f}, {hi:.3f}]':>16} {differ}/{len(ids['new'])}  {head_rows['old']}/{head_rows['new']}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
