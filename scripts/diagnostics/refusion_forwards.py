"""Where ReFusion's decoding time goes, forward by forward (CPU, 2 threads; run on a quiet machine).

    python scripts/diagnostics/refusion_forwards.py width MODEL
        median time of one forward of W [MASK]s after an 80-token cached prefix, for several W
    python scripts/diagnostics/refusion_forwards.py stages MODEL TASK N [KEY=VALUE ...]
        decode the first N validation samples of TASK with bench.yaml's settings for it (plus the
        overrides) and sum the forwards by the decoder step that made them: calls, mean width, time
"""

from __future__ import annotations

import collections
import inspect
import statistics
import sys
import time

import torch

from refusion.models.backend import Backbone


def width(model: str) -> None:
    bb = Backbone.from_pretrained(model)
    prefix = 80
    cache = bb.new_cache()
    bb.forward(torch.arange(prefix) % 400 + 10, torch.arange(prefix), cache)
    for w in (1, 2, 4, 8, 16, 32, 64, 96, 128, 160):
        times = []
        for _ in range(30):
            t = time.perf_counter()
            bb.forward(torch.full((w,), bb.mask_id), torch.arange(prefix, prefix + w), cache, keep_kv=False)
            times.append(time.perf_counter() - t)
        print(f"{w:4d} masks: {statistics.median(times) * 1000:.2f} ms")


def stages(model: str, task_name: str, n: str, *overrides: str) -> None:
    from refusion.models.tokenizer import encode_prompt
    from refusion.core.config import build_decoder
    from refusion.experiments.bench import load_bench_config
    from refusion.tasks import get_task

    bb = Backbone.from_pretrained(model)
    task = get_task(task_name)
    examples = task.examples("validation", int(n))
    decoder = build_decoder(bb, load_bench_config().decoder_config(task.name, "refusion", task.max_new_tokens,
                                                                   list(overrides)))
    forward, log = bb.forward, collections.defaultdict(lambda: [0, 0, 0.0])

    def timed(ids, pos, cache, *args, **kwargs):
        t = time.perf_counter()
        out = forward(ids, pos, cache, *args, **kwargs)
        entry = log[inspect.stack()[1].function, "KV kept" if kwargs.get("keep_kv", True) else "KV dropped"]
        entry[0] += 1
        entry[1] += ids.numel()
        entry[2] += time.perf_counter() - t
        return out

    bb.forward = timed
    decoder.generate(encode_prompt(bb.tokenizer, examples[0].query))  # warm-up
    log.clear()
    start, right = time.perf_counter(), 0
    for e in examples:
        right += task.score(e, decoder.generate(encode_prompt(bb.tokenizer, e.query)).text)
    print(f"{right}/{len(examples)} right, {time.perf_counter() - start:.2f} s, "
          f"forwards {sum(v[2] for v in log.values()):.2f} s")
    for (step, kv), (calls, tokens, seconds) in sorted(log.items()):
        print(f"{step} ({kv}): {calls} calls, mean width {tokens / calls:.1f}, {seconds:.2f} s")


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"width": width, "stages": stages}[sys.argv[1]](*sys.argv[2:])
