"""Does decoding in a batch change any sequence's tokens? Every shipped setting, batched vs one at a time.

For each run of the bench config (every decoder) and of every shipped ablation config, and each task,
decodes the first ``--limit`` test prompts one at a time (``generate``) and in batches of
``--batch-size`` (``generate_batch``; the prompts of a batch differ in length), and counts the samples
whose token ids differ. Prints one line per (config, run, task) and the totals; ``--out FILE`` also
writes them as JSON. One torch thread, float32, on the CPU::

    .venv/bin/python scripts/batch_identity.py --limit 8 --batch-size 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from refusion.core.config import build_decoder
from refusion.experiments.ablate import build_runs, load_ablation
from refusion.experiments.config_files import shipped_configs
from refusion.experiments.bench import bench_runs, load_bench_config
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task

SHIPPED_GRIDS = ("tune_refusion", "tune_refusion_paper")  # the tuning grids on the shipped models


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=8, help="test prompts per task (default 8)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--configs", default=None, help="comma-separated config names (default: bench and every ablation)")
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    names = a.configs.split(",") if a.configs else ["bench", *shipped_configs("ablations"), *SHIPPED_GRIDS]
    backbones: dict[str, Backbone] = {}
    rows, total, differ = [], 0, 0
    for name in names:
        if name == "bench":
            bench = load_bench_config()
            runs = bench_runs(bench, list(bench.models), ["arith", "code", "facts"])
        else:
            runs = build_runs(load_ablation(f"{name}.yaml"))
        for run in runs:
            bb = backbones.setdefault(run.model, Backbone.from_pretrained(run.model))
            for task_name, config in run.configs.items():
                task = get_task(task_name)
                prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in task.examples("test", a.limit)]
                decoder = build_decoder(bb, config)
                single = [decoder.generate(q).token_ids for q in prompts]
                batched = []
                for i in range(0, len(prompts), a.batch_size):
                    batched += [r.token_ids for r in decoder.generate_batch(prompts[i : i + a.batch_size])]
                diff = [i for i, (x, y) in enumerate(zip(single, batched)) if x != y]
                rows.append({"config": name, "run": run.label, "decoder": run.decoder, "task": task_name,
                             "n": len(prompts), "batch_size": a.batch_size, "differ": len(diff), "samples": diff})
                total += len(prompts)
                differ += len(diff)
                print(f"{name:>14} {run.label[:40]:<40} {task_name:<6} differ {len(diff)}/{len(prompts)}"
                      + (f" (samples {diff})" if diff else ""), flush=True)
    print(f"total: {differ} of {total} samples differ between batch {a.batch_size} and one at a time")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
