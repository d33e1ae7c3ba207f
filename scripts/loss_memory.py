"""Peak memory and time of one training loss + backward, cross entropy in checkpointed chunks vs one pass.

Each mode runs in its own process (the peak is the process's maximum resident set, above what it held
once the model was loaded), on one batch of tinybench examples in the layout of ``--objective``:

    python scripts/loss_memory.py --vocab 151936 --dtype bfloat16 --threads 1

``--vocab N`` first widens ``--model`` to N rows (``refusion.models.build.widen_vocabulary``, in a
temporary folder) so the output head costs what a real vocabulary's does; ``--vocab 0`` keeps the model's.
Chunking applies to 16-bit logits only (``refusion.core.objective.Objective.token_ce``); with float32 the
two modes run the same code. On the CPU a bfloat16 step is slow (minutes at 151,936 rows).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def one_mode(args: argparse.Namespace) -> dict:
    import torch

    import refusion.core.objective as objective_module
    from refusion.models.loading import load_pretrained
    from refusion.plugins.objectives import OBJECTIVES
    from refusion.tasks import get_task
    from refusion.training.data import encode_pair

    torch.set_num_threads(args.threads)
    if args.mode == "one-pass":
        objective_module.CE_CHUNK_ELEMENTS = 1 << 62
    model, tokenizer = load_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    objective = OBJECTIVES[args.objective].from_tokenizer(tokenizer)
    examples = get_task(args.task).examples("validation")[: args.batch]
    batch = objective.make_batch([encode_pair(tokenizer, e.query, e.response) for e in examples],
                                 torch.Generator().manual_seed(0))
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loss, _ = objective.loss(model, batch)
    loss.backward()
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - loaded
    return {"mode": args.mode, "loss": loss.item(), "logits_rows": batch.label_positions.numel() * len(examples),
            "peak_gb_above_load": peak_kb / 1e6, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-ar", help="model folder or shipped checkpoint name")
    p.add_argument("--vocab", type=int, default=151936, help="widen the vocabulary to N rows first (0: as is)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--objective", default="refusion", choices=["ar", "refusion", "mdm", "block"])
    p.add_argument("--task", default="arith")
    p.add_argument("--batch", type=int, default=8, help="examples in the batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--mode", choices=["chunked", "one-pass"], help=argparse.SUPPRESS)  # a child process
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if args.vocab:
            from refusion.models.build import widen_vocabulary

            model_dir = str(widen_vocabulary(args.model, tmp, args.vocab))
        rows = []
        for mode in ("one-pass", "chunked"):
            cmd = [sys.executable, __file__, "--mode", mode, "--model-dir", model_dir, "--dtype", args.dtype,
                   "--objective", args.objective, "--task", args.task, "--batch", str(args.batch),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{args.objective} loss + backward, {args.batch} {args.task} examples, {args.dtype}, "
          f"vocabulary {args.vocab or 'as shipped'}")
    print("| mode | logits rows | peak GB above load | seconds | loss |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['logits_rows']} | {r['peak_gb_above_load']:.2f} | {r['seconds']:.1f} | {r['loss']:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
