"""Which of ReFusion's forwards a batch pays for: tokens fed per generated token by stage, per task.

Decodes the first ``--limit`` test prompts of each task with the bench's ``refusion`` row (its model and
per-task settings; ``--set`` and ``--batch-aware ROW`` change them) in batches of ``--batch-size``, and
sorts every forward request of every sequence by the stage that made it: the prefill with the first
Stage I, Stage I (the drafted [MASK]s, KV dropped), Stage II-a (the chosen drafts, KV kept), Stage II-b
predict and verify rounds (one row per chosen slot). Per stage: the requests, the tokens they feed
(rows x tokens, before padding to the batch's widest request) per generated token, and that share of
all tokens fed; AR greedy feeds one token per generated token after its prefill. One torch thread, CPU::

    .venv/bin/python scripts/stage_tokens.py --batch-size 16 --limit 32
    .venv/bin/python scripts/stage_tokens.py --batch-size 16 --limit 32 --batch-aware refusion-sched
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from refusion.core.config import build_decoder
from refusion.experiments.batching import BATCH_AWARE, load_variants, variant_runs
from refusion.experiments.bench import bench_runs, load_bench_config
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task

STAGES = ("prefill + Stage I", "Stage I", "Stage II-a", "Stage II-b predict", "Stage II-b verify")


def stage_of(request, first: bool) -> str:
    if request.ids.dim() == 2:
        return STAGES[4] if request.keep_kv else STAGES[3]
    if first:
        return STAGES[0]
    return STAGES[2] if request.keep_kv else STAGES[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="arith,code,facts")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override the row's config")
    p.add_argument("--batch-aware", default=None, metavar="ROW",
                   help="decode with this row of configs/bench/batch_aware.yaml instead of bench.yaml's refusion")
    a = p.parse_args(argv)
    if a.batch_size < 2 or a.limit % a.batch_size:
        p.error("--batch-size must be at least 2 and divide --limit (a batch of one decodes outside the batch cache)")
    torch.set_num_threads(1)
    tasks = a.tasks.split(",")
    bench = load_bench_config()
    runs = bench_runs(bench, ["refusion"], tasks, a.set)
    if a.batch_aware:
        runs = [r for r in variant_runs(runs, load_variants(BATCH_AWARE), tasks) if r.label == a.batch_aware]
    run = runs[-1]
    bb = Backbone.from_pretrained(run.model)
    seen: set[int] = set()
    tally: Counter = Counter()
    calls: Counter = Counter()
    orig = RaggedCache.forward

    def counting(self, requests):
        for req in requests:
            first = id(req.cache) not in seen
            seen.add(id(req.cache))
            stage = stage_of(req, first)
            rows = req.ids.shape[0] if req.ids.dim() == 2 else 1
            tally[stage] += rows * req.ids.shape[-1]
            calls[stage] += 1
        return orig(self, requests)

    RaggedCache.forward = counting
    print(f"{run.label} in batches of {a.batch_size}, first {a.limit} test prompts per task")
    print(f"{'task':6} {'stage':20} {'requests':>8} {'fed/token':>9} {'share':>6}")
    for task in tasks:
        tally.clear()
        calls.clear()
        seen.clear()
        prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in get_task(task).examples("test", a.limit)]
        decoder = build_decoder(bb, run.configs[task])
        generated = 0
        for i in range(0, len(prompts), a.batch_size):
            generated += sum(len(r.token_ids) for r in decoder.generate_batch(prompts[i : i + a.batch_size]))
        total = sum(tally.values())
        for stage in STAGES:
            if calls[stage]:
                print(f"{task:6} {stage:20} {calls[stage]:>8} {tally[stage] / generated:>9.2f} "
                      f"{100 * tally[stage] / total:>5.1f}%")
        print(f"{task:6} {'all':20} {sum(calls.values()):>8} {total / generated:>9.2f}  ({generated} tokens)")
    RaggedCache.forward = orig
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
