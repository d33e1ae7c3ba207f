"""Served against offline throughput, and the serving goals, per bench row on one tinybench task.

For each row (a decoder on its shipped model with the bench config's settings for the task) this starts
``refusion serve --bench-row ROW --task TASK --threads 1`` (its engine in a process of its own, the default)
in a subprocess and, from this process, runs the ``--parts`` asked for (default all three):

``ratio``  batch-bench's measurement at batch 16 (the task's first ``--limit`` prompts in chunks of 16
           through ``Decoder.generate_batch`` on one torch thread; tokens/s = generated tokens / summed
           chunk wall time, as ``refusion batch-bench`` computes it) and ``refusion loadtest`` at
           concurrency 16 on the same prompts (one request each, a stream that keeps 16 in flight;
           completed tokens / wall time), each side idle while the other runs, interleaved ``--rounds``
           times with the side that goes first alternating; served / offline tokens/s with a
           paired-bootstrap 95% interval over the rounds (:func:`~refusion.experiments.stats.throughput_ratio`),
           and the same per CPU second (the offline side's process time against the server process's);
           per side the model calls and tokens fed (padding included), and the server's CPU time split
           into its engine thread's and the rest (the HTTP side: event loop, tokenizer, JSON);
``table``  ``loadtest`` at each of ``--concurrency`` (``--table-requests`` each): docs/serving.md's table;
``goal``   ``--goal-requests`` requests at concurrency 16 with ``--disconnect-fraction`` of the clients
           hanging up mid-stream, every response checked against the offline decode; prints each goal's
           verdict (:func:`~refusion.serve.loadtest.verdicts`).

Writes ``OUT/serve_bench.json`` and ``OUT/serve_bench.md`` (tables through the project's renderer,
:mod:`refusion.experiments.tables`); prints the load average beside each row.
The exit code is 1 when a goal is not met.

    python scripts/serve_bench.py --rows ar,refusion,llada,block,spec-diffusion --task arith --out runs/serve_bench
    python scripts/serve_bench.py --rows refusion --parts ratio --rounds 3 --out runs/serve_ratio
    python scripts/serve_bench.py --rows ar --parts ratio --rounds 2 --compare-serve-args="--engine thread"

``--serve-args`` adds flags to every server (``--serve-args="--engine thread"``: the engine in a thread of the
HTTP process; ``=`` where the value is one flag alone); ``--compare-serve-args`` starts a second server of the
row with more flags, measured in the same rounds (batch-bench, the first server, the second, in reverse order
every other round), a table row each. Table rows are named by the row and its serve flags: ``block`` (the
defaults), ``block (--engine thread)``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from refusion.core.config import build_decoder
from refusion.core.threads import set_threads
from refusion.experiments import tables
from refusion.experiments.bench import load_bench_config
from refusion.experiments.stats import throughput_ratio
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.serve.loadtest import format_report, run_loadtest, task_prompts, verdicts
from refusion.tasks import get_task


def start_server(row: str, task: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "refusion.cli", "serve", "--bench-row", row, "--task", task, "--port", "0",
           "--threads", "1", "--max-batch", "16", "--max-queue", "1024", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("serving "):
            threading.Thread(target=lambda: [print(f"[{row} server] {x}", end="", flush=True) for x in proc.stdout],
                             daemon=True).start()  # its later output: printed, so the pipe never fills
            return proc, line.rsplit(" ", 1)[-1].strip()
    raise RuntimeError(f"the server of row {row} did not start (exit {proc.wait()})")


def offline_chunk(decoder, prompts: list[list[int]]) -> tuple[int, float, float, int, int]:
    """One batch-bench chunk: (generated tokens, wall seconds, CPU seconds, model calls, tokens fed) of
    ``generate_batch`` over ``prompts``."""
    bb = decoder.backbone
    t0, c0, nfe, fed = time.perf_counter(), time.process_time(), bb.nfe, bb.tokens_in
    results = decoder.generate_batch(prompts)
    return (sum(len(r.token_ids) for r in results), time.perf_counter() - t0, time.process_time() - c0,
            bb.nfe - nfe, bb.tokens_in - fed)


def measure_ratio(decoder, urls: list[str], queries: list[str], prompts: list[list[int]], rounds: int) -> list[dict]:
    """Per round: batch-bench's chunks of 16 over every prompt, and the same prompts served as a stream of
    requests at concurrency 16 by each server of ``urls``, the sides in turn, in reverse order every other
    round (see the module docstring) -> per server: per-round figures (its served side's beside the round's
    offline side) and the served / offline ratios with paired-bootstrap intervals over the rounds: of tokens
    per wall second, and of tokens per CPU second (the offline process's against the server's processes',
    which other work on the machine inflates less)."""
    per_url: list[list[dict]] = [[] for _ in urls]
    for r in range(rounds):
        off: dict = {}
        served_rows: list[dict] = [{} for _ in urls]

        def offline() -> None:
            chunks = [offline_chunk(decoder, prompts[i: i + 16]) for i in range(0, len(prompts), 16)]
            off.update(offline_tokens=sum(c[0] for c in chunks), offline_s=sum(c[1] for c in chunks),
                       offline_cpu_s=sum(c[2] for c in chunks), offline_calls=sum(c[3] for c in chunks),
                       offline_fed=sum(c[4] for c in chunks))

        def served(k: int) -> None:
            c0 = time.process_time()
            rep = run_loadtest(urls[k], queries, 16, len(queries), 1800)
            if rep["errors"] or rep["not_sent"]:
                raise RuntimeError(f"served round failed: {rep['errors']}, {rep['not_sent']} not sent")
            srv = rep["server"]
            served_rows[k].update(served_tokens=rep["completion_tokens"], served_s=rep["wall_s"],
                                  served_cpu_s=srv["cpu_s"], served_engine_cpu_s=srv["engine_cpu_s"],
                                  client_cpu_s=time.process_time() - c0, served_calls=srv["forward_calls"],
                                  served_fed=srv["tokens_fed"], served_chunks=rep["chunks"])

        sides = [offline] + [lambda k=k: served(k) for k in range(len(urls))]
        for side in (sides if r % 2 == 0 else sides[::-1]):
            side()
        for k, row in enumerate(served_rows):
            per_url[k].append({**off, **row})
            print(f"  round {r}, server {k}: {json.dumps(per_url[k][-1])}, load average {os.getloadavg()[0]:.1f}",
                  flush=True)

    def summary(rows: list[dict]) -> dict:
        def col(key: str) -> list[float]:
            return [row[key] for row in rows]

        wall = throughput_ratio(col("offline_tokens"), col("offline_s"), col("served_tokens"), col("served_s"))
        cpu = throughput_ratio(col("offline_tokens"), col("offline_cpu_s"), col("served_tokens"),
                               col("served_cpu_s"))
        return {"rounds": rows, "offline_tokens_per_s": sum(col("offline_tokens")) / sum(col("offline_s")),
                "served_tokens_per_s": sum(col("served_tokens")) / sum(col("served_s")),
                "ratio": wall.value, "ratio_low": wall.low, "ratio_high": wall.high,
                "cpu_ratio": cpu.value, "cpu_ratio_low": cpu.low, "cpu_ratio_high": cpu.high,
                "same_tokens": col("offline_tokens") == col("served_tokens")}

    return [summary(rows) for rows in per_url]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="ar,refusion,llada,block,spec-diffusion")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--parts", default="ratio,table,goal", help="of ratio, table, goal (default all)")
    ap.add_argument("--limit", type=int, default=32, help="prompts of the task (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved offline / served rounds (default 3)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--table-requests", type=int, default=16, help="requests per concurrency level (default 16)")
    ap.add_argument("--goal-requests", type=int, default=500)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--serve-args", default="", help="more flags for refusion serve (e.g. '--admit-min 1', "
                    "'--engine thread')")
    ap.add_argument("--compare-serve-args", default=None,
                    help="ratio part: also serve with these flags added (e.g. '--engine thread'), a second server "
                         "measured in the same rounds, the sides in turn")
    ap.add_argument("--out", type=Path, default=Path("runs/serve_bench"))
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"ratio", "table", "goal"}:
        ap.error(f"--parts: of ratio, table, goal; got {args.parts!r}")
    set_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = load_bench_config(None)
    task = get_task(args.task)
    queries = task_prompts(args.task, "test", args.limit)
    results, all_met = [], True
    for row in [r for r in args.rows.split(",") if r]:
        result = {"row": row, "model": bench.models[row], "task": args.task, "serve_args": args.serve_args,
                  "load_average_before": os.getloadavg()}
        proc, url = start_server(row, args.task, args.serve_args.split())
        other = None
        try:
            run_loadtest(url, queries[:16], 16, 16, 1800)  # warm-up of the server
            if "ratio" in parts:
                urls = [url]
                if args.compare_serve_args is not None:
                    other, other_url = start_server(row, args.task, (args.serve_args + " " +
                                                                     args.compare_serve_args).split())
                    run_loadtest(other_url, queries[:16], 16, 16, 1800)
                    urls.append(other_url)
                backbone = Backbone.from_pretrained(bench.models[row])
                decoder = build_decoder(backbone, bench.decoder_config(args.task, row, task.max_new_tokens))
                prompts = [encode_prompt(backbone.tokenizer, q) for q in queries]
                offline_chunk(decoder, prompts[:16])  # warm-up of the offline side
                ratios = measure_ratio(decoder, urls, queries, prompts, args.rounds)
                result["ratio"] = ratios[0]
                if other is not None:
                    result["ratio_compare"] = {**ratios[1], "serve_args": args.compare_serve_args}
                for x in ratios:
                    print(row, "served / offline", json.dumps({k: v for k, v in x.items() if k != "rounds"}),
                          f"load average {os.getloadavg()}", flush=True)
            if "table" in parts:
                table = {}
                for c in [int(x) for x in args.concurrency.split(",")]:
                    r = run_loadtest(url, queries, c, args.table_requests, 1800)
                    table[c] = {k: r[k] for k in ("tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms", "errors",
                                                  "completed")}
                result["concurrency"] = table
            if "goal" in parts:
                goal = run_loadtest(url, queries, 16, args.goal_requests, 3 * 3600,
                                    disconnect_fraction=args.disconnect_fraction, check_offline=True)
                result["goal"] = goal
                result["verdicts"] = verdicts(goal)
                print(f"{row}: goal run of {args.goal_requests} requests at concurrency 16\n" + format_report(goal),
                      flush=True)
                all_met &= all(met for _, met, _ in result["verdicts"])
        finally:
            for p in (proc, other):
                if p is not None:
                    p.send_signal(signal.SIGINT)
            result["server_exit"] = proc.wait(timeout=120)
            if other is not None:
                result["compare_server_exit"] = other.wait(timeout=120)
        result["load_average"] = os.getloadavg()
        print(row, f"done, load average {result['load_average']}", flush=True)
        results.append(result)
        (args.out / "serve_bench.json").write_text(json.dumps(results, indent=1))
        (args.out / "serve_bench.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all_met else 1


def markdown(results: list[dict]) -> str:
    """docs/serving.md's tables of ``results`` (the parts each row has), through the project's table renderer;
    a row is named by its bench row and the serve flags it ran with, e.g. ``block (--engine thread)``."""
    def label(r: dict, part: dict | None = None) -> str:  # part: a ratio with serve args of its own
        serve_args = (part or {}).get("serve_args", r.get("serve_args", ""))
        return f"{r['row']} ({serve_args})" if serve_args else r["row"]

    def f(v) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"

    def load(r: dict) -> str:
        return f"{r['load_average_before'][0]:.1f} / {r['load_average'][0]:.1f}"

    def mean(rounds: list[dict], key: str) -> float:
        return sum(x[key] for x in rounds) / len(rounds)

    out = []
    table = [[label(r), str(c), f"{t['tokens_per_s']:.0f}", f"{t['requests_per_s']:.2f}",
              " / ".join(f(t["ttft_ms"][k]) for k in ("p50", "p95", "p99")),
              " / ".join(f(t["itl_ms"][k]) for k in ("p50", "p95", "p99")), str(sum(t["errors"].values()))]
             for r in results for c, t in r.get("concurrency", {}).items()]
    if table:
        out.append(tables.markdown(["row", "concurrency", "tokens/s", "requests/s", "TTFT p50 / p95 / p99 ms",
                                    "ITL p50 / p95 / p99 ms", "errors"], table))
    ratio = []
    for r, x in [(r, r[key]) for r in results for key in ("ratio", "ratio_compare") if key in r]:
        rounds = x["rounds"]
        counted = "served_engine_cpu_s" in rounds[0]  # runs before the engine's own counters have none
        ratio.append([
            label(r, x), f"{x['offline_tokens_per_s']:.0f}", f"{x['served_tokens_per_s']:.0f}",
            f"{x['ratio']:.2f} ({x['ratio_low']:.2f} - {x['ratio_high']:.2f})",
            f"{x['cpu_ratio']:.2f} ({x['cpu_ratio_low']:.2f} - {x['cpu_ratio_high']:.2f})",
            f"{mean(rounds, 'offline_calls'):.0f} / {mean(rounds, 'served_calls'):.0f}" if counted else "-",
            f"{mean(rounds, 'offline_fed'):.0f} / {mean(rounds, 'served_fed'):.0f}" if counted else "-",
            f"{mean(rounds, 'offline_cpu_s'):.2f} / {mean(rounds, 'served_engine_cpu_s'):.2f} / "
            f"{mean(rounds, 'served_cpu_s') - mean(rounds, 'served_engine_cpu_s'):.2f}" if counted else "-",
            str(len(rounds)), load(r)])
    if ratio:
        out.append(tables.markdown(
            ["row", "batch-bench tok/s, batch 16", "served tok/s, concurrency 16",
             "served / batch-bench, wall (95% interval)", "the same per CPU second",
             "model calls: batch-bench / served", "tokens fed: batch-bench / served",
             "CPU s: batch-bench / engine thread / HTTP side", "rounds", "load average before / after"], ratio))
    goal = []
    for r in results:
        if "goal" not in r:
            continue
        g, srv = r["goal"], r["goal"]["server"]
        met = [name for name, ok, _ in r["verdicts"] if ok]
        unmet = [name for name, ok, _ in r["verdicts"] if not ok]
        goal.append([
            label(r), f"{g['completed']} / {g['disconnected']} / {sum(g['errors'].values())} / {g['not_sent']} / "
            f"{g['delivery']['lost']}", f"{g['offline']['differ']} of {g['offline']['compared']}",
            f"{f(srv['batch_size_after'])}, {f(srv['queue_after'])}", f"{srv['cancelled_disconnect']:.0f}",
            f"{f(srv['rss_mb_first_half_max'])} / {f(srv['rss_mb_second_half_max'])}", f"{g['wall_s']:.0f}",
            f"all {len(met)} met" if not unmet else "NOT MET: " + ", ".join(unmet), load(r)])
    if goal:
        out.append(tables.markdown(
            ["row", "requests: completed / hung up / errors / not sent / lost", "differ from offline",
             "batch, queue after", "cancelled by hang-up", "RSS MB 1st / 2nd half max", "wall s", "verdicts",
             "load average before / after"], goal))
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
