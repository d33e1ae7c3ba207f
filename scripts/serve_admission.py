"""The serving engine's admission policy against batch-bench's static batches, without HTTP.

A bench row's decoder on the task's first ``--limit`` test prompts (default 32): batch-bench's measurement at
batch 16 (chunks of 16 through ``Decoder.generate_batch``) and the engine (``serve/engine.py``, max batch 16)
with all the requests queued at once, admitting at once (``admit_min`` 1), in groups of 8 and of 16 (``admit_wait_s``
30: no deadline), and at once with the prompt's call inside the running batch's (``separate_prefill``
off). Per mode: tokens/s, model calls and tokens fed (padding included); ``--rounds`` interleaved rounds,
one torch thread, with the process's CPU time (which other work on a busy machine inflates less than
wall time), and the (row, key) and query-key pairs a model call attends on average (every row's keys
padded to the longest row's and its queries to the widest row's: sequences at different stages make a
call attend more). The admission modes make one model call per request group (``call_cost_tokens`` None,
as ``refusion serve --call-cost-tokens off``): the admission policy alone; then groups of 8 with calls by
width (the call price's key and pair terms 0) and by width and cached length (the CPU default,
:data:`~refusion.serve.engine.CALL_PRICE_CPU`), and 16 clients each sending its next request when its
answer ends (as ``refusion loadtest --concurrency 16``; default admission), one call per group, by
width, and by width and cached length.

    python scripts/serve_admission.py --row refusion --rounds 2
    python scripts/serve_admission.py --row ar --rounds 1 --limit 128
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from refusion.core.config import build_decoder
from refusion.core.threads import set_threads
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.tokenizer import encode_prompt
from refusion.core.loop import CallPrice
from refusion.serve.engine import CALL_PRICE_CPU, Engine, Job
from refusion.tasks import get_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="refusion")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=32, help="prompts of the task (default 32)")
    args = ap.parse_args()
    set_threads(1)
    bench, task = load_bench_config(None), get_task(args.task)
    bb = Backbone.from_pretrained(bench.models[args.row])
    decoder = build_decoder(bb, bench.decoder_config(args.task, args.row, task.max_new_tokens))
    prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in task.examples("test", args.limit)]

    def offline() -> float:
        tokens, wall = 0, 0.0
        for i in range(0, len(prompts), 16):
            t0 = time.perf_counter()
            results = decoder.generate_batch(prompts[i: i + 16])
            wall += time.perf_counter() - t0
            tokens += sum(len(r.token_ids) for r in results)
        return tokens / wall

    def engine(admit_min: int, separate_prefill: bool = True, call_cost_tokens: CallPrice | None = None,
               clients: int = 0) -> float:
        """All requests queued at once; or ``clients`` > 0 clients each sending its next request when its
        previous answer ends (as ``refusion loadtest`` at that concurrency)."""
        e = Engine(decoder, max_batch=16, max_queue=len(prompts), admit_min=admit_min, admit_wait_s=30.0 if not clients
                   else 0.5, separate_prefill=separate_prefill, call_cost_tokens=call_cost_tokens)
        tokens, lock, pending = [0], threading.Lock(), iter(prompts)

        def send(prompt: list[int]) -> threading.Event:
            ended = threading.Event()

            def sink(event: tuple) -> None:
                if event[0] == "commit":
                    with lock:
                        tokens[0] += len(event[1])
                elif event[0] in ("end", "error"):
                    ended.set()

            e.submit(Job(prompt, decoder, None, time.perf_counter() + 3600, sink))
            return ended

        def client() -> None:
            while True:
                with lock:
                    prompt = next(pending, None)
                if prompt is None:
                    return
                send(prompt).wait()

        e.start()
        t0 = time.perf_counter()
        if clients:
            threads = [threading.Thread(target=client) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for ended in [send(p) for p in prompts]:
                ended.wait()
        wall = time.perf_counter() - t0
        e.stop()
        return tokens[0] / wall

    calls: list[tuple[int, int, int]] = []  # (rows, width, key width) of each batched model call
    forward = RaggedCache.forward

    def recorded(cache, requests):  # the keys a call attends: every row's padded to the longest row's
        rows = [r for request in requests for r in request.cache.rows]
        width = max(q.ids.shape[-1] for q in requests)
        calls.append((len(rows), width, max(cache.lengths[r] for r in rows) + width))
        return forward(cache, requests)

    RaggedCache.forward = recorded

    def counted(label: str, run) -> str:
        nfe, fed, cpu = bb.nfe, bb.tokens_in, time.process_time()
        calls.clear()
        rate = run()
        pairs = sum(rows * keys for rows, _, keys in calls) / max(1, len(calls))
        queries = sum(rows * width * keys for rows, width, keys in calls) / max(1, len(calls))
        return (f"{label} {rate:.0f} tok/s, {bb.nfe - nfe} calls, {bb.tokens_in - fed} tokens fed, "
                f"{pairs:.0f} (row, key) pairs per call, {queries:.0f} query-key pairs per call, "
                f"{time.process_time() - cpu:.2f} CPU s")

    by_width = CallPrice(CALL_PRICE_CPU.call)  # the key and pair terms 0: calls by width alone
    offline()  # warm-up
    for _ in range(args.rounds):
        modes = [("batch-bench@16", offline), ("at once", lambda: engine(1)), ("groups of 8", lambda: engine(8)),
                 ("groups of 16", lambda: engine(16)),
                 ("at once, prompt in the batch's call", lambda: engine(1, False)),
                 ("groups of 8, calls by width", lambda: engine(8, call_cost_tokens=by_width)),
                 ("groups of 8, calls by width and cached length", lambda: engine(8, call_cost_tokens=CALL_PRICE_CPU)),
                 ("16 clients", lambda: engine(8, clients=16)),
                 ("16 clients, calls by width", lambda: engine(8, call_cost_tokens=by_width, clients=16)),
                 ("16 clients, calls by width and cached length",
                  lambda: engine(8, call_cost_tokens=CALL_PRICE_CPU, clients=16))]
        print(" | ".join(counted(label, run) for label, run in modes), f"| load average {os.getloadavg()}",
              flush=True)


if __name__ == "__main__":
    main()
