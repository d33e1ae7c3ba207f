"""What batching can save: the cost of one forward per sequence against the batch size, and the cost model.

    .venv/bin/python scripts/forward_cost.py [--model tiny-refusion] [--cached 150] [--repeats 30]
        [--compile [MODE]] [--fit-repeats 7] [--warm-calls 6] [--clock wall|cpu] [--no-fit] [--json PATH]

For each number of tokens fed per sequence (1: an AR step; 16; 64: a wide ReFusion Stage I) and each
batch size (1, 4, 16), times one forward of ``[batch, fed]`` new tokens after ``--cached`` cached
tokens per sequence (a KV cache built once and cropped back after each call), and prints the median
milliseconds per sequence. Then fits the forward cost model (:mod:`refusion.experiments.costmodel`: a
fixed per-call cost per kind of forward, per token fed, per key attended over, per query-key pair, per
logits row) on its grid of shapes timed through the decoders' own caches, and prints the coefficients
and the fit's relative error (``--json``: the fitted model as JSON, for ``scripts/cost_model.py``'s
predictions). ``--compile``: the forwards run through ``torch.compile`` (``Backbone(compile=MODE)``).
``--clock cpu``: the fit's forwards are timed in this thread's CPU time (``time.thread_time``), which
other processes on a shared machine inflate less than wall time.
One torch thread, float32, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from refusion.experiments.costmodel import WARM_CALLS, fit, measure
from refusion.models.backend import Backbone


def per_sequence_ms(bb: Backbone, batch: int, fed: int, cached: int, repeats: int) -> float:
    cache = bb.new_cache().kv  # the transformers cache itself: a bare model call
    prefix = torch.randint(10, 500, (batch, cached))
    bb.forward(prefix, torch.arange(cached).expand(batch, cached), cache, logits_at=None)
    ids = torch.randint(10, 500, (batch, fed))
    pos = torch.arange(cached, cached + fed).expand(batch, fed)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        bb.forward(ids, pos, cache, keep_kv=False)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:]) / batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-refusion")
    p.add_argument("--cached", type=int, default=150)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE")
    p.add_argument("--fit-repeats", type=int, default=7, help="timed rounds of the cost model's grid")
    p.add_argument("--warm-calls", type=int, default=WARM_CALLS,
                   help="untimed calls of each grid shape before its timed one (0: right after the previous shape)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="the fit's clock: wall or this thread's CPU time")
    p.add_argument("--no-fit", action="store_true", help="the per-sequence table only")
    p.add_argument("--json", type=Path, default=None, help="write the fitted cost model here")
    a = p.parse_args()
    torch.set_num_threads(1)
    bb = Backbone.from_pretrained(a.model, compile=a.compile)
    sizes = (1, 4, 16)
    print(f"ms per sequence for one forward ({a.model}, {a.cached} cached tokens, 1 thread, median of {a.repeats})")
    print("| tokens fed per sequence | " + " | ".join(f"batch {b}" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for fed in (1, 16, 64):
        cells = [f"{per_sequence_ms(bb, b, fed, a.cached, a.repeats):.2f}" for b in sizes]
        print(f"| {fed} | " + " | ".join(cells) + " |")
    if a.no_fit:
        return 0
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    model = fit(measure(bb, repeats=a.fit_repeats, clock=clock, warm=a.warm_calls), device="cpu, 1 thread",
                note=f"{a.model}, compile {a.compile}, {a.warm_calls} warm calls, {a.clock} clock")
    print(f"\nforward cost model ({model.note}; relative error of the fit: median "
          f"{100 * model.fit_error['median']:.1f}%, max {100 * model.fit_error['max']:.1f}%)")
    print(model.markdown(), end="")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(model.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
