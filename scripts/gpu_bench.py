"""ReFusion against AR greedy on a randomly initialised Qwen3 of 0.6B shape, on one device.

    python scripts/gpu_bench.py [--device cuda] [--dtype bfloat16] [--shape 0.6b] [--prompts 4] [--gen-length 256]

Builds the model from a config (no download; random weights, the shipped tiny tokenizer, whose ids all
lie inside the 151,936-row vocabulary), decodes the same prompts with ``ar`` and ``refusion`` (reference
settings: slot 8, slot threshold 0.9, token threshold 0.4), one untimed warm-up each, and prints per
decoder: tokens/s (tokens / decode wall time, medians over prompts), forwards, the share of decode time
outside model forwards (a second pass with synchronised forward timing) and host reads per iteration.
Random weights decode text of no meaning: the figures measure the data path and the forwards, not
quality. Then throughput against batch size (``--batch-sizes``, default 1,4,16): the first
``--batch-prompts`` prompts (default 16) decoded with ``generate_batch`` in chunks of each size, per
decoder, as aggregate tokens/s (all tokens / all chunks' wall time) and ReFusion's over AR's at each
size. ``--shape tiny`` builds a small model for a CPU smoke run. Writes ``--out/gpu_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def measure(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]]) -> dict:
    decoder = build_decoder(backbone, {**CONFIGS[name], "gen_length": gen_length})
    decoder.generate(ids[0])  # warm-up
    rates, forwards, tokens, iterations, reads = [], 0, 0, 0, 0
    for prompt in ids:
        host.reset()
        result = decoder.generate(prompt)
        reads += host.count
        rates.append(result.stats.tokens_per_second)
        forwards += result.stats.nfe
        tokens += result.stats.generated_tokens
        iterations += result.stats.iterations
    backbone.time_forwards, backbone.forward_s, wall = True, 0.0, 0.0
    for prompt in ids:  # second pass: forwards timed with a synchronisation each
        wall += decoder.generate(prompt).stats.wall_s
    backbone.time_forwards = False
    return {"decoder": name, "tokens_per_second_median": statistics.median(rates), "tokens": tokens,
            "forwards": forwards, "iterations": iterations, "host_reads_per_iteration": reads / iterations,
            "share_outside_forwards": 1 - backbone.forward_s / wall}


def measure_batches(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]], sizes: list[int]) -> list[dict]:
    """Aggregate tokens/s of ``ids`` decoded in chunks of each batch size (one untimed warm-up chunk each)."""
    decoder = build_decoder(backbone, {**CONFIGS[name], "gen_length": gen_length})
    rows = []
    for size in sizes:
        decoder.generate_batch(ids[:size])  # warm-up
        tokens, wall = 0, 0.0
        for i in range(0, len(ids), size):
            results = decoder.generate_batch(ids[i : i + size])
            tokens += sum(r.stats.generated_tokens for r in results)
            wall += results[0].stats.batch_wall_s if size > 1 else results[0].stats.wall_s
        rows.append({"decoder": name, "batch_size": size, "tokens": tokens, "wall_s": wall,
                     "tokens_per_second": tokens / wall})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--shape", default="0.6b", choices=list(SHAPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--batch-sizes", default="1,4,16", help="batch sizes of the throughput table ('' for none)")
    ap.add_argument("--batch-prompts", type=int, default=16, help="prompts decoded at each batch size")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_bench"))
    a = ap.parse_args(argv)
    backbone = random_backbone(a.shape, a.device, getattr(torch, a.dtype))
    ids = prompts(backbone, a.prompts)
    rows = [measure(backbone, name, a.gen_length, ids) for name in CONFIGS]
    ar_rate = rows[0]["tokens_per_second_median"]
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    print(f"random Qwen3 ({a.shape} shape), {a.dtype}, {device}, {a.prompts} prompts, gen_length {a.gen_length}")
    print("| decoder | tok/s (median) | x AR | forwards | iterations | host reads / iteration | time outside forwards |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['decoder']} | {r['tokens_per_second_median']:.1f} | {r['tokens_per_second_median'] / ar_rate:.2f} | "
              f"{r['forwards']} | {r['iterations']} | {r['host_reads_per_iteration']:.2f} | {100 * r['share_outside_forwards']:.1f}% |")
    sizes = [int(x) for x in a.batch_sizes.split(",") if x.strip()]
    batch_rows = []
    if sizes:
        many = prompts(backbone, a.batch_prompts)
        batch_rows = [r for name in CONFIGS for r in measure_batches(backbone, name, a.gen_length, many, sizes)]
        rate = {(r["decoder"], r["batch_size"]): r["tokens_per_second"] for r in batch_rows}
        print(f"\nthroughput against batch size ({a.batch_prompts} prompts, aggregate tokens/s)")
        print("| batch size | " + " | ".join(f"{n} tok/s | {n} x batch 1" for n in CONFIGS) + " | refusion / ar |")
        print("|---|" + "---|---|" * len(CONFIGS) + "---|")
        for size in sizes:
            cells = [f"{rate[n, size]:.1f} | {rate[n, size] / rate[n, sizes[0]]:.2f}" for n in CONFIGS]
            print(f"| {size} | " + " | ".join(cells) + f" | {rate['refusion', size] / rate['ar', size]:.2f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_bench.json").write_text(json.dumps(
        {"device": device, "shape": a.shape, "dtype": a.dtype, "rows": rows, "batch_rows": batch_rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
