"""Served against offline throughput, and the serving goals, per bench row on one tinybench task.

For each row (a decoder on its shipped model with the bench config's settings for the task) this starts
``refusion serve --bench-row ROW --task TASK --threads 1`` in a subprocess and, from this process:

1. interleaves, ``--rounds`` times, batch-bench's measurement at batch 16 (the task's first ``--limit``
   prompts in chunks of 16 through ``Decoder.generate_batch`` on one torch thread; tokens/s = generated
   tokens / summed chunk wall time, as ``refusion batch-bench`` computes it) with ``refusion loadtest`` at
   concurrency 16 on the same prompts (one request each; tokens/s = completed tokens / wall time), while
   the other side is idle; the ratio served / offline per round;
2. runs ``loadtest`` at each of ``--concurrency`` (``--table-requests`` each): the table of docs/serving.md;
3. runs the goal: ``--goal-requests`` requests at concurrency 16 with ``--disconnect-fraction`` of the
   clients hanging up mid-stream, every response checked against the offline decode.

Writes ``OUT/serve_bench.json`` and ``OUT/serve_bench.md``; prints the load average beside each row.

    python scripts/serve_bench.py --rows ar,refusion,llada,block --task arith --rounds 2 --out runs/serve_bench
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from refusion.core.config import build_decoder
from refusion.core.threads import set_threads
from refusion.experiments.bench import load_bench_config
from refusion.experiments.tables import markdown
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.serve.loadtest import run_loadtest, task_prompts
from refusion.tasks import get_task


def start_server(row: str, task: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "refusion.cli", "serve", "--bench-row", row, "--task", task, "--port", "0",
           "--threads", "1", "--max-batch", "16", "--max-queue", "1024", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("serving "):
            return proc, line.rsplit(" ", 1)[-1].strip()
    raise RuntimeError(f"the server of row {row} did not start (exit {proc.wait()})")


def offline_tokens_per_s(decoder, prompts: list[list[int]], batch: int) -> float:
    tokens, wall = 0, 0.0
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        results = decoder.generate_batch(prompts[i: i + batch])
        wall += time.perf_counter() - t0
        tokens += sum(len(r.token_ids) for r in results)
    return tokens / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="ar,refusion,llada,block")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--limit", type=int, default=32, help="prompts of the task (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved offline / served rounds (default 3)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--table-requests", type=int, default=16, help="requests per concurrency level (default 16)")
    ap.add_argument("--goal-requests", type=int, default=500)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--serve-args", default="", help="more flags for refusion serve (e.g. '--admit-min 1')")
    ap.add_argument("--out", type=Path, default=Path("runs/serve_bench"))
    args = ap.parse_args(argv)
    set_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = load_bench_config(None)
    task = get_task(args.task)
    queries = task_prompts(args.task, "test", args.limit)
    results = []
    for row in [r for r in args.rows.split(",") if r]:
        backbone = Backbone.from_pretrained(bench.models[row])
        decoder = build_decoder(backbone, bench.decoder_config(args.task, row, task.max_new_tokens))
        prompts = [encode_prompt(backbone.tokenizer, q) for q in queries]
        proc, url = start_server(row, args.task, args.serve_args.split())
        try:
            run_loadtest(url, queries, 16, 16, 600)  # warm-up of both sides
            offline_tokens_per_s(decoder, prompts[:16], 16)
            rounds = []
            for _ in range(args.rounds):
                off = offline_tokens_per_s(decoder, prompts, 16)
                served = run_loadtest(url, queries, 16, len(queries), 600)
                rounds.append({"offline_tokens_per_s": off, "served_tokens_per_s": served["tokens_per_s"],
                               "ratio": served["tokens_per_s"] / off, "served_errors": served["errors"]})
            table = {}
            for c in [int(x) for x in args.concurrency.split(",")]:
                r = run_loadtest(url, queries, c, args.table_requests, 1800)
                table[c] = {k: r[k] for k in ("tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms", "errors",
                                              "completed")}
            goal = run_loadtest(url, queries, 16, args.goal_requests, 1800,
                                disconnect_fraction=args.disconnect_fraction, check_offline=True)
        finally:
            proc.send_signal(signal.SIGINT)
            exit_code = proc.wait(timeout=120)
        results.append({"row": row, "model": bench.models[row], "task": args.task, "serve_args": args.serve_args,
                        "rounds": rounds,
                        "ratio_median": statistics.median(r["ratio"] for r in rounds), "concurrency": table,
                        "goal": goal, "server_exit": exit_code, "load_average": os.getloadavg()})
        print(row, json.dumps(results[-1]["rounds"]), f"load average {os.getloadavg()}", flush=True)
        (args.out / "serve_bench.json").write_text(json.dumps(results, indent=1))
    (args.out / "serve_bench.md").write_text(report(results))
    print(report(results))
    return 0


def report(results: list[dict]) -> str:
    """The served rows per concurrency level, then each row's offline against served throughput and the goal
    run (Markdown, :func:`refusion.experiments.tables.markdown`)."""
    def f(v) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"

    levels = [[r["row"], str(c), f"{t['tokens_per_s']:.0f}", f"{t['requests_per_s']:.2f}",
               " / ".join(f(t["ttft_ms"][k]) for k in ("p50", "p95", "p99")),
               " / ".join(f(t["itl_ms"][k]) for k in ("p50", "p95", "p99")), str(sum(t["errors"].values()))]
              for r in results for c, t in r["concurrency"].items()]
    goals = []
    for r in results:
        g = r["goal"]
        goals.append([r["row"], ", ".join(f"{x['offline_tokens_per_s']:.0f}" for x in r["rounds"]),
                      ", ".join(f"{x['served_tokens_per_s']:.0f}" for x in r["rounds"]), f"{r['ratio_median']:.2f}",
                      f"{g['completed']} / {g['disconnected']} / {sum(g['errors'].values())} / {g['delivery']['lost']}",
                      f"{g['offline']['differ']} of {g['offline']['compared']}", str(g["server"]["batch_size_after"]),
                      f"{f(g['server']['rss_mb_first_half_max'])} / {f(g['server']['rss_mb_second_half_max'])}"])
    return (markdown(["row", "concurrency", "tokens/s", "requests/s", "TTFT p50 / p95 / p99 ms", "ITL p50 / p95 / p99 ms",
                      "errors"], levels) + "\n" +
            markdown(["row", "offline tok/s at batch 16 (rounds)", "served tok/s at concurrency 16 (rounds)",
                      "served / offline (median)", "goal: completed / hung up / errors / lost", "differ from offline",
                      "batch after", "RSS MB 1st / 2nd half max"], goals))


if __name__ == "__main__":
    sys.exit(main())
