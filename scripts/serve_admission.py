"""The serving engine's admission policy against batch-bench's static batches, without HTTP.

A bench row's decoder on the task's first 32 test prompts: batch-bench's measurement at batch 16 (chunks of
16 through ``Decoder.generate_batch``) and the engine (``serve/engine.py``, max batch 16) with all 32
requests queued at once, admitting at once (``admit_min`` 1), in groups of 8 and of 16 (``admit_wait_s``
30: no deadline), and at once with the prompt's call inside the running batch's (``separate_prefill``
off). Per mode: tokens/s, model calls and tokens fed (padding included); ``--rounds`` interleaved rounds,
one torch thread.

    python scripts/serve_admission.py --row refusion --rounds 2
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
from refusion.models.tokenizer import encode_prompt
from refusion.serve.engine import Engine, Job
from refusion.tasks import get_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="refusion")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    set_threads(1)
    bench, task = load_bench_config(None), get_task(args.task)
    bb = Backbone.from_pretrained(bench.models[args.row])
    decoder = build_decoder(bb, bench.decoder_config(args.task, args.row, task.max_new_tokens))
    prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in task.examples("test", 32)]

    def offline() -> float:
        tokens, wall = 0, 0.0
        for i in range(0, len(prompts), 16):
            t0 = time.perf_counter()
            results = decoder.generate_batch(prompts[i: i + 16])
            wall += time.perf_counter() - t0
            tokens += sum(len(r.token_ids) for r in results)
        return tokens / wall

    def engine(admit_min: int, separate_prefill: bool = True) -> float:
        e = Engine(decoder, max_batch=16, max_queue=64, admit_min=admit_min, admit_wait_s=30.0,
                   separate_prefill=separate_prefill)
        ended, tokens = threading.Semaphore(0), [0]

        def sink(event: tuple) -> None:
            if event[0] == "commit":
                tokens[0] += len(event[1])
            elif event[0] in ("end", "error"):
                ended.release()

        e.start()
        t0 = time.perf_counter()
        for p in prompts:
            e.submit(Job(p, decoder, None, time.perf_counter() + 3600, sink))
        for _ in prompts:
            ended.acquire()
        wall = time.perf_counter() - t0
        e.stop()
        return tokens[0] / wall

    def counted(label: str, run) -> str:
        nfe, fed = bb.nfe, bb.tokens_in
        rate = run()
        return f"{label} {rate:.0f} tok/s, {bb.nfe - nfe} calls, {bb.tokens_in - fed} tokens fed"

    offline()  # warm-up
    for _ in range(args.rounds):
        print(" | ".join([counted("batch-bench@16", offline), counted("at once", lambda: engine(1)),
                          counted("groups of 8", lambda: engine(8)), counted("groups of 16", lambda: engine(16)),
                          counted("at once, prompt in the batch's call", lambda: engine(1, False))]),
              f"| load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
