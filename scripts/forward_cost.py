"""What batching can save: the cost of one forward per sequence against the batch size.

    .venv/bin/python scripts/forward_cost.py [--model tiny-refusion] [--cached 150] [--repeats 30]

For each number of tokens fed per sequence (1: an AR step; 16; 64: a wide ReFusion Stage I) and each
batch size (1, 4, 16), times one forward of ``[batch, fed]`` new tokens after ``--cached`` cached
tokens per sequence (a KV cache built once and cropped back after each call), and prints the median
milliseconds per sequence. One torch thread, float32, on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

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
    a = p.parse_args()
    torch.set_num_threads(1)
    bb = Backbone.from_pretrained(a.model)
    sizes = (1, 4, 16)
    print(f"ms per sequence for one forward ({a.model}, {a.cached} cached tokens, 1 thread, median of {a.repeats})")
    print("| tokens fed per sequence | " + " | ".join(f"batch {b}" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for fed in (1, 16, 64):
        cells = [f"{per_sequence_ms(bb, b, fed, a.cached, a.repeats):.2f}" for b in sizes]
        print(f"| {fed} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
