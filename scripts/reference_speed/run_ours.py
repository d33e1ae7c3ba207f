"""Decode tinybench test prompts with our ReFusion decoder at the reference's settings; write the job file
that ``run_reference.py`` replays with the authors' ``generate_refusion``, and our own results.

Runs under this project's environment (``.venv/bin/python``). See docs/reference_speed.md.

    .venv/bin/python scripts/reference_speed/run_ours.py --model tiny-refusion --tasks arith,code,facts \
        --limit 20 --threads 1 --job OUT/job.json --out OUT/ours.json

Settings are the reference's GSM8K settings with gen_length = the task's ``max_new_tokens`` (slot 8, one
serial block, slot threshold 0.9, token threshold 0.4, temperature 0); each can be changed by a flag. Every
one of our own variants that the reference lacks is switched off explicitly.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def reference_settings(gen_length: int, args: argparse.Namespace) -> dict:
    """The keyword arguments of the reference's ``generate_refusion`` (besides model/tokenizer/prompt/mask_id)."""
    return {
        "gen_length": gen_length,
        "slot_size": args.slot_size,
        "serial_num_blocks": args.serial_blocks,
        "slot_threshold": args.slot_threshold,
        "token_threshold": args.token_threshold,
        "temperature": 0.0,
    }


def our_config(settings: dict) -> dict:
    """Our decoder config equal to the reference's settings (each of our extras off)."""
    return {
        "decoder": "refusion",
        "gen_length": settings["gen_length"],
        "slot_size": settings["slot_size"],
        "serial_blocks": settings["serial_num_blocks"],
        "selector": {"name": "threshold", "slot_threshold": settings["slot_threshold"], "fallback": "best"},
        "verifier": {"name": "prefix", "token_threshold": settings["token_threshold"]},
        "drafter": {"name": "gumbel", "temperature": settings["temperature"]},
        "scorer": "first_token_prob",
        "cache": "kv_concat",
        "remasker": "none",
        "draft_window": None,
        "split_threshold": None,
        "fused": False,
        "correct": False,
        "join_adjacent": False,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-refusion", help="shipped checkpoint name or model folder")
    parser.add_argument("--tasks", default="arith,code,facts")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=20, help="prompts per task")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the reference gets the same)")
    parser.add_argument("--slot-size", type=int, default=8)
    parser.add_argument("--serial-blocks", type=int, default=1)
    parser.add_argument("--slot-threshold", type=float, default=0.9)
    parser.add_argument("--token-threshold", type=float, default=0.4)
    parser.add_argument("--gen-length", type=int, default=0, help="0: each task's max_new_tokens")
    parser.add_argument("--job", required=True, help="job file to write for run_reference.py")
    parser.add_argument("--out", required=True, help="our results (JSON)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from refusion.models.tokenizer import encode_prompt
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.loading import resolve_model_path
    from refusion.tasks import get_task

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model).resolve()
    backbone = Backbone.from_pretrained(model_path, device="cpu", dtype=torch.float32)
    tok = backbone.tokenizer

    tasks = []
    for name in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        task = get_task(name)
        settings = reference_settings(args.gen_length or task.max_new_tokens, args)
        prompts = [encode_prompt(tok, e.query) for e in task.examples(args.split, args.limit)]
        tasks.append({"name": name, "settings": settings, "config": our_config(settings), "prompts": prompts})

    job = {
        "model": str(model_path),
        "vocab_size": int(backbone.model.config.vocab_size),
        "mask_id": int(backbone.mask_id),
        "eos_token_id": int(backbone.eos_id),
        "eos_ids": sorted(backbone.eos_ids),
        "threads": args.threads,
        "split": args.split,
        "tasks": tasks,
    }
    if len(backbone.eos_ids) > 1:
        print(f"note: the model has several EOS ids {sorted(backbone.eos_ids)}; the reference stops only at "
              f"{backbone.eos_id}", file=sys.stderr)
    Path(args.job).parent.mkdir(parents=True, exist_ok=True)
    Path(args.job).write_text(json.dumps(job) + "\n")

    records = []
    warmed = False
    for t in tasks:
        decoder = build_decoder(backbone, t["config"])
        if not warmed and t["prompts"]:  # one untimed call, as the reference gets
            decoder.generate(t["prompts"][0])
            warmed = True
        for i, ids in enumerate(t["prompts"]):
            t0 = time.perf_counter()
            res = decoder.generate(ids)
            call_s = time.perf_counter() - t0
            records.append({
                "task": t["name"], "index": i, "prompt_len": len(ids), "token_ids": list(res.token_ids),
                "wall_s": res.stats.wall_s, "call_s": call_s, "nfe": res.stats.nfe,
                "tpf": res.stats.tpf, "tpf_reference_mean": res.stats.tpf_reference_mean,
            })
            print(f"ours {t['name']}[{i}]: {len(res.token_ids)} tokens, {res.stats.nfe} forwards, "
                  f"{res.stats.wall_s:.3f} s", file=sys.stderr)

    out = {
        "decoder": "ours",
        "model": str(model_path),
        "vocab_size": job["vocab_size"],
        "threads": args.threads,
        "timing": "DecodeResult.stats.wall_s (perf_counter around the decoding loop); call_s: around generate()",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "settings": {t["name"]: t["settings"] for t in tasks},
        "results": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.job} and {args.out} ({len(records)} prompts)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
