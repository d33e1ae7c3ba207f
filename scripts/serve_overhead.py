"""Where a served decode's CPU time goes, against batch-bench's, on the thread that decodes.

A bench row's decoder on the task's first ``--limit`` test prompts, in one process, one torch thread. Each
mode decodes every prompt once; ``--rounds`` interleaved rounds (the order reversed every other round):

``offline``         batch-bench at batch 16 (chunks of 16 through ``Decoder.generate_batch``), main thread;
``offline-thread``  the same in a thread of its own (glibc's per-thread malloc arenas, a non-main stack);
``offline-loop``    the same in a thread while the main thread runs an asyncio event loop as a server's
                    does: 16 handlers each checking every 0.2 s, and one ``call_soon_threadsafe`` per commit
                    (every commit wakes the loop, which takes the interpreter from the decoding thread);
``engine``          the serving engine (``serve/engine.py``, max batch 16, ``--call-cost-tokens`` as
                    ``refusion serve`` takes it: the CPU's price by default) with 16 client threads, each
                    sending its next request when its answer ends: the served arrival pattern, no HTTP;
``engine-width``    the same with calls split by width alone (the call price's key and pair terms 0: the
                    policy before calls by cached length);
``server``          the same engine inside the HTTP server (in this process, uvicorn on its own thread),
                    driven by ``refusion loadtest --concurrency 16`` in a subprocess;
``offline-key-groups``, ``engine-key-groups``
                    ``offline`` and ``engine`` in key groups (``Backbone.use_key_groups()``: consecutive rows
                    whose keys end early attend over fewer keys, models/ragged_forward.py).

Per mode, on the decoding thread (the engine thread for the last two): its CPU seconds (``RUSAGE_THREAD``,
user and system; the engine's ``refusion_engine_cpu_seconds_total`` for ``server``), minor page faults,
model calls, tokens fed (padding included), and its CPU time split into the model's forward
(``Backbone.forward``), the batch cache's work around it (``RaggedCache.forward`` less the model: masks,
row gathers, KV copies) and the rest (the decoders' loops, the engine's bookkeeping). Per model call of
the batch cache, what its attention spans: (row, key) pairs (every row's keys padded to its key group's
width, the group's longest row's cached length plus the tokens fed) and query-key pairs (every fed position, padding
included, against that width), each beside what the rows' own lengths need (row r: ``fed_r`` queries
over its own ``length_r + fed_r`` keys), over every batch-cache call (a speculative decode's drafter's
too); and the seconds the padding costs by the cost model's CPU figures (the pooled cold fit of
docs/profile.md: 1.24 us per (row, key) pair, 65 ns per query-key pair: ``CALL_PRICE_CPU`` and
``TOKEN_S_CPU`` of :mod:`refusion.serve.engine`); and the model CPU time of the calls of 16 rows (the whole
batch) with their key width (the longest row's cached length plus the tokens fed), what padded keys cost
in calls of the same rows. Prints one line per mode and round and a table of the medians over the rounds,
with each mode's CPU over ``offline``'s.

    python scripts/serve_overhead.py --row ar --rounds 5
    python scripts/serve_overhead.py --row block --modes offline,engine,server --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from refusion.core.config import ConfigError, build_decoder
from refusion.core.loop import CallPrice
from refusion.core.threads import set_threads
from refusion.experiments import tables
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.tokenizer import encode_prompt
from refusion.serve.cli import parse_call_cost_tokens
from refusion.serve.engine import CALL_PRICE_CPU, TOKEN_S_CPU, Engine, Job, call_price
from refusion.serve.server import BackgroundServer, create_state
from refusion.tasks import get_task

MODES = ("offline", "offline-thread", "offline-loop", "engine", "engine-width", "server", "offline-key-groups",
         "engine-key-groups")
#: CPU seconds of the decoding thread inside each timed function (one decoding thread runs at a time)
spent = {"model": 0.0, "cache": 0.0}
#: per batch-cache model call: (row, key) pairs padded and the rows' own, query-key pairs padded and own
spans: list[tuple[int, int, int, int]] = []


def record_spans() -> None:
    """Wrap ``RaggedCache.forward`` so that each call's attention span goes to :data:`spans`."""
    inner = RaggedCache.forward

    def wrapper(cache, requests):
        fed = [(row, request.ids.shape[-1]) for request in requests for row in request.cache.rows]
        width = max(n for _, n in fed)  # every row is padded to it
        own = [cache.lengths[row] + n for row, n in fed]
        before = cache.pairs_attended
        out = inner(cache, requests)
        keys = cache.pairs_attended - before  # every row's keys padded to its key group's longest row's
        spans.append((keys, sum(own), width * keys, sum(n * k for (_, n), k in zip(fed, own))))
        return out

    RaggedCache.forward = wrapper


def timed(cls, name: str, key: str) -> None:
    """Wrap ``cls.name`` so that the calling thread's CPU time inside it adds to ``spent[key]``."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.thread_time() - t0

    setattr(cls, name, wrapper)


def thread_usage() -> tuple[float, float, int]:
    """(user s, system s, minor faults) of the calling thread."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def in_thread(fn) -> dict:
    """Run ``fn`` (-> dict) in a new thread; its result."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(fn()))
    t.start()
    t.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="ar")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--limit", type=int, default=32, help="prompts of the task (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)} (default all)")
    ap.add_argument("--call-cost-tokens", default="auto", metavar="N[,KEY,PAIR]|auto",
                    help="mode engine's call price, as refusion serve takes it (default auto: the CPU's)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "offline" not in modes or set(modes) - set(MODES):
        ap.error(f"--modes: of {', '.join(MODES)}, offline included; got {args.modes!r}")
    try:
        price = call_price(parse_call_cost_tokens(args.call_cost_tokens), "cpu")
    except ConfigError as e:
        ap.error(str(e))
    set_threads(1)
    bench, task = load_bench_config(None), get_task(args.task)
    bb = Backbone.from_pretrained(bench.models[args.row])
    config = bench.decoder_config(args.task, args.row, task.max_new_tokens)
    decoder = build_decoder(bb, config)
    prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in task.examples("test", args.limit)]
    timed(Backbone, "forward", "model")
    timed(RaggedCache, "forward", "cache")
    record_spans()

    def batches(on_commit=None) -> dict:
        u0, s0, f0 = thread_usage()
        for i in range(0, len(prompts), 16):
            decoder.generate_batch(prompts[i: i + 16], on_commit)
        u1, s1, f1 = thread_usage()
        return {"user": u1 - u0, "sys": s1 - s0, "faults": f1 - f0}

    def with_loop() -> dict:
        async def serve() -> dict:
            loop, done = asyncio.get_running_loop(), asyncio.Event()
            commits = [0]

            def on_commit(i: int, commit) -> None:
                loop.call_soon_threadsafe(commits.__setitem__, 0, commits[0] + 1)

            async def handler() -> None:
                while not done.is_set():
                    try:
                        await asyncio.wait_for(done.wait(), 0.2)
                    except asyncio.TimeoutError:
                        pass

            handlers = [asyncio.create_task(handler()) for _ in range(16)]
            out = await loop.run_in_executor(None, batches, on_commit)
            done.set()
            await asyncio.gather(*handlers)
            return out

        return asyncio.run(serve())

    def engine(price=price) -> dict:
        usage: dict = {}

        class Measured(Engine):
            def _run(self) -> None:
                u0, s0, f0 = thread_usage()
                super()._run()
                u1, s1, f1 = thread_usage()
                usage.update(user=u1 - u0, sys=s1 - s0, faults=f1 - f0)

        e = Measured(decoder, max_batch=16, max_queue=len(prompts), call_cost_tokens=price)
        pending, lock = iter(prompts), threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    prompt = next(pending, None)
                if prompt is None:
                    return
                ended = threading.Event()
                e.submit(Job(prompt, decoder, None, time.perf_counter() + 3600,
                             lambda event: ended.set() if event[0] in ("end", "error") else None, 4))
                ended.wait()

        e.start()
        clients = [threading.Thread(target=client) for _ in range(16)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        e.stop()
        return usage

    server = None
    if "server" in modes:
        state = create_state(bb, config, args.row, max_batch=16, max_queue=1024)
        server = BackgroundServer(state).start()

    def served() -> dict:
        metric = "refusion_engine_cpu_seconds_total"
        cpu = server.state.engine.metrics.value(metric)
        subprocess.run([sys.executable, "-m", "refusion.cli", "loadtest", "--url", server.url, "--concurrency", "16",
                        "--requests", str(len(prompts)), "--task", args.task, "--limit", str(len(prompts))],
                       check=True, capture_output=True)
        end = time.monotonic() + 5
        while server.state.engine.counts() != (0, 0) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.1)  # the engine counts its CPU time as it goes idle
        return {"user": server.state.engine.metrics.value(metric) - cpu, "sys": 0.0, "faults": None}

    def key_groups(fn) -> dict:
        keep = bb.group_keys
        bb.use_key_groups()
        try:
            return fn()
        finally:
            bb.use_key_groups(keep)

    run = {"offline": batches, "offline-thread": lambda: in_thread(batches), "offline-loop": with_loop,
           "engine": engine, "engine-width": lambda: engine(CallPrice(CALL_PRICE_CPU.call)), "server": served,
           "offline-key-groups": lambda: key_groups(batches), "engine-key-groups": lambda: key_groups(engine)}
    bb.time_forwards, bb.forward_clock = True, time.thread_time  # each call's model CPU time (no sync on the CPU)
    batches()  # warm-up
    for m in modes[1:]:
        run[m]()
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            nfe, fed = bb.nfe, bb.tokens_in
            spent.update(model=0.0, cache=0.0)
            spans.clear()
            bb.forward_log = []
            x = run[m]()
            cpu = x["user"] + x["sys"]
            x.update(cpu=cpu, calls=bb.nfe - nfe, fed=bb.tokens_in - fed, model=spent["model"],
                     cache=spent["cache"] - spent["model"], rest=cpu - spent["cache"])
            keys, own_keys, pairs, own_pairs = (sum(s[k] for s in spans) for k in range(4))
            full = [(f.seconds, f.past + f.fed) for f in bb.forward_log if f.rows == 16]  # the batch's 16-row calls
            x.update(full_ms=1e3 * statistics.median(t for t, _ in full) if full else float("nan"),
                     full_keys=statistics.mean(k for _, k in full) if full else float("nan"))
            x.update(cache_calls=len(spans), keys=keys / max(1, len(spans)), own_keys=own_keys / max(1, len(spans)),
                     pairs=pairs / max(1, len(spans)), own_pairs=own_pairs / max(1, len(spans)),
                     padding_s=TOKEN_S_CPU * (CALL_PRICE_CPU.key * (keys - own_keys)
                                              + CALL_PRICE_CPU.pair * (pairs - own_pairs)))
            rows[m].append(x)
            print(f"round {r} {m}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in x.items()), f"| load {os.getloadavg()[0]:.2f}", flush=True)
    if server is not None:
        server.stop()

    def med(m: str, key: str) -> float:
        return statistics.median(x[key] for x in rows[m])

    base = [x["cpu"] for x in rows["offline"]]
    table = []
    for m in modes:
        ratios = [x["cpu"] / b for x, b in zip(rows[m], base)]
        faults = [x["faults"] for x in rows[m] if x["faults"] is not None]
        table.append([m, f"{med(m, 'cpu'):.2f}", f"{med(m, 'sys'):.3f}",
                      f"{statistics.median(faults):.0f}" if faults else "-", f"{med(m, 'calls'):.0f}",
                      f"{med(m, 'fed'):.0f}", f"{1e3 * med(m, 'model') / med(m, 'calls'):.2f}",
                      f"{med(m, 'cache'):.3f}", f"{med(m, 'rest'):.3f}",
                      f"{med(m, 'keys'):.0f} / {med(m, 'own_keys'):.0f}",
                      f"{med(m, 'pairs'):.0f} / {med(m, 'own_pairs'):.0f}", f"{med(m, 'padding_s'):.2f}",
                      f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f})",
                      f"{med(m, 'full_ms'):.2f} / {med(m, 'full_keys'):.0f}"])
    print(f"{args.row} on {args.task}, {len(prompts)} prompts, {args.rounds} rounds (medians); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(tables.markdown(["mode", "thread CPU s", "of it system s", "minor faults", "model calls", "tokens fed",
                           "model ms per call", "cache s (less the model)", "rest s",
                           "(row, key) pairs per call: padded / own", "query-key pairs per call: padded / own",
                           "padding's model s (cost model)", "CPU over offline's (min - max)",
                           "16-row calls: model ms (median) / keys (mean)"], table))


if __name__ == "__main__":
    main()
