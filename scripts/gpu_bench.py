"""ReFusion against AR greedy on a randomly initialised Qwen3 of 0.6B shape, on one device.

    python scripts/gpu_bench.py [--device cuda] [--dtype bfloat16] [--shape 0.6b] [--prompts 2] [--gen-length 256]

Builds the model from a config (no download; random weights, the shipped tiny tokenizer, whose ids all
lie inside the 151,936-row vocabulary), decodes the same prompts with ``ar`` and ``refusion`` (reference
settings: slot 8, slot threshold 0.9, token threshold 0.4) after a short warm-up each, and prints per
decoder: tokens/s (tokens / decode wall time, medians over prompts), forwards, the share of decode time
outside model forwards (a second pass with synchronised forward timing) and host reads per iteration.
Random weights decode text of no meaning: the figures measure the data path and the forwards, not
quality. Then throughput against batch size (``--batch-sizes``, default 1,4,16): at size s the first s
prompts decoded in one ``generate_batch`` call, per decoder, as aggregate tokens/s (all tokens / the
batch's wall time; size 1 is the first pass's first prompt) and ReFusion's over AR's at each size.

Time is scarce on a lent GPU, so the work runs in order of importance (batch 1, then time outside
forwards, then the batch sizes) and a part that would start after ``--time-limit-s`` seconds is skipped
and named as skipped; ``--out/gpu_bench.json`` is rewritten after every part, so a run cut short keeps
what it measured. ``--shape tiny`` builds a small model for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion.core import host
from refusion.core.config import build_decoder
from refusion.models.backend import Backbone
from refusion.models.loading import load_pretrained
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=4096),
}
CONFIGS = {
    "ar": {"decoder": "ar"},
    "refusion": {"decoder": "refusion", "slot_size": 8, "selector": {"name": "threshold", "slot_threshold": 0.9},
                 "verifier": {"name": "prefix", "token_threshold": 0.4}},
}


def random_backbone(shape: str, device: str, dtype: torch.dtype) -> Backbone:
    _, tokenizer = load_pretrained("tiny-refusion")
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    return Backbone(model, tokenizer, mask_id=tokenizer.mask_token_id)


def prompts(backbone: Backbone, n: int) -> list[list[int]]:
    examples = get_task("arith").examples("test", n)
    return [encode_prompt(backbone.tokenizer, e.query) for e in examples]


WARM_UP_TOKENS = 16  # a warm-up decode compiles kernels and fills allocator pools; its length does not matter


class Clock:
    """Seconds since the run began, against the ``--time-limit-s`` budget."""

    def __init__(self, limit_s: float) -> None:
        self.start, self.limit_s = time.perf_counter(), limit_s

    def allows(self) -> bool:
        return time.perf_counter() - self.start < self.limit_s


def decoder_for(backbone: Backbone, name: str, gen_length: int):
    return build_decoder(backbone, {**CONFIGS[name], "gen_length": gen_length})


def measure(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]]) -> dict:
    """Batch 1: tokens/s per prompt (median), forwards, iterations and host reads per iteration."""
    decoder_for(backbone, name, WARM_UP_TOKENS).generate(ids[0])
    decoder = decoder_for(backbone, name, gen_length)
    rates, walls, forwards, tokens, iterations, reads = [], [], 0, [], 0, 0
    for prompt in ids:
        host.reset()
        result = decoder.generate(prompt)
        reads += host.count
        rates.append(result.stats.tokens_per_second)
        walls.append(result.stats.wall_s)
        forwards += result.stats.nfe
        tokens.append(result.stats.generated_tokens)
        iterations += result.stats.iterations
    return {"decoder": name, "tokens_per_second_median": statistics.median(rates), "tokens": sum(tokens),
            "forwards": forwards, "iterations": iterations, "host_reads_per_iteration": reads / iterations,
            "first_prompt": {"tokens": tokens[0], "wall_s": walls[0]}}


def share_outside_forwards(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]]) -> float:
    """A second pass over ``ids`` with every forward timed (a synchronisation each): 1 - forward time / wall."""
    decoder = decoder_for(backbone, name, gen_length)
    backbone.time_forwards, backbone.forward_s, wall = True, 0.0, 0.0
    try:
        for prompt in ids:
            wall += decoder.generate(prompt).stats.wall_s
    finally:
        backbone.time_forwards = False
    return 1 - backbone.forward_s / wall


def measure_batch(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]]) -> dict:
    """Aggregate tokens/s of ``ids`` decoded in one ``generate_batch`` call (after a short warm-up batch)."""
    decoder_for(backbone, name, WARM_UP_TOKENS).generate_batch(ids)
    results = decoder_for(backbone, name, gen_length).generate_batch(ids)
    tokens = sum(r.stats.generated_tokens for r in results)
    wall = results[0].stats.batch_wall_s if len(ids) > 1 else results[0].stats.wall_s
    return {"decoder": name, "batch_size": len(ids), "tokens": tokens, "wall_s": wall, "tokens_per_second": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--shape", default="0.6b", choices=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,4,16", help="batch sizes of the throughput table ('' for none)")
    ap.add_argument("--time-limit-s", type=float, default=240.0,
                    help="skip the parts that would start after this many seconds (default 240)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_bench"))
    a = ap.parse_args(argv)
    clock = Clock(a.time_limit_s)
    backbone = random_backbone(a.shape, a.device, getattr(torch, a.dtype))
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    sizes = [int(x) for x in a.batch_sizes.split(",") if x.strip()]
    ids = prompts(backbone, max([a.prompts, *sizes]))
    report: dict = {"device": device, "shape": a.shape, "dtype": a.dtype, "prompts": a.prompts,
                    "gen_length": a.gen_length, "rows": [], "batch_rows": [], "skipped": []}
    a.out.mkdir(parents=True, exist_ok=True)

    rows: dict[str, dict] = {}  # decoder -> its batch-1 figures
    batch: dict[tuple[str, int], dict] = {}  # (decoder, batch size) -> its throughput

    def save() -> None:
        report["rows"], report["batch_rows"] = list(rows.values()), list(batch.values())
        (a.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))

    def run(part: str, work) -> bool:
        if not clock.allows():
            if part not in report["skipped"]:
                report["skipped"].append(part)
            save()
            return False
        work()
        save()
        return True

    for name in CONFIGS:
        run(f"{name} batch 1", lambda name=name: rows.setdefault(name, measure(backbone, name, a.gen_length, ids[:a.prompts])))
    for name in rows:
        run(f"{name} time outside forwards", lambda name=name: rows[name].update(
            share_outside_forwards=share_outside_forwards(backbone, name, a.gen_length, ids[:a.prompts])))
    print(f"random Qwen3 ({a.shape} shape), {a.dtype}, {device}, {a.prompts} prompts, gen_length {a.gen_length}")
    print("| decoder | tok/s (median) | x AR | forwards | iterations | host reads / iteration | time outside forwards |")
    print("|---|---|---|---|---|---|---|")
    ar_rate = rows["ar"]["tokens_per_second_median"] if "ar" in rows else float("nan")
    for r in rows.values():
        outside = f"{100 * r['share_outside_forwards']:.1f}%" if "share_outside_forwards" in r else "skipped"
        print(f"| {r['decoder']} | {r['tokens_per_second_median']:.1f} | {r['tokens_per_second_median'] / ar_rate:.2f} | "
              f"{r['forwards']} | {r['iterations']} | {r['host_reads_per_iteration']:.2f} | {outside} |")
    for name in CONFIGS:
        for size in sizes:
            if size == 1 and name in rows:  # the first pass decoded the first prompt alone
                first = rows[name]["first_prompt"]
                batch[name, 1] = {"decoder": name, "batch_size": 1, **first, "tokens_per_second": first["tokens"] / first["wall_s"]}
            else:
                run(f"{name} batch {size}", lambda name=name, size=size: batch.__setitem__(
                    (name, size), measure_batch(backbone, name, a.gen_length, ids[:size])))
    save()
    if sizes:
        print("\nthroughput against batch size (the first s prompts in one batch, aggregate tokens/s)")
        print("| batch size | " + " | ".join(f"{n} tok/s" for n in CONFIGS) + " | refusion / ar |")
        print("|---|" + "---|" * len(CONFIGS) + "---|")
        for size in sizes:
            cells = [f"{batch[n, size]['tokens_per_second']:.1f}" if (n, size) in batch else "skipped" for n in CONFIGS]
            ratio = (f"{batch['refusion', size]['tokens_per_second'] / batch['ar', size]['tokens_per_second']:.2f}"
                     if ("refusion", size) in batch and ("ar", size) in batch else "-")
            print(f"| {size} | " + " | ".join(cells) + f" | {ratio} |")
    if report["skipped"]:
        print(f"\nskipped after {a.time_limit_s:.0f} s (--time-limit-s): " + ", ".join(report["skipped"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
