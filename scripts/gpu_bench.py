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

The forward-cost table: the cost model of :mod:`refusion.experiments.costmodel` fitted on this device
(one forward of each shape of a small grid through the decoders' caches: a fixed per-call cost per kind
of forward, then per token fed, per key, per query-key pair and per logits row), the decoders' loop cost
per sequence-forward calibrated on the batch-1 decode of the first prompt, and from them each measured
batch row predicted from its recorded forwards, and ReFusion over AR predicted at batch 1 to 64 (the
batch-1 decode's forwards with every call carrying s sequences: lock-step batches), with the predicted
crossover (the first size where AR's tokens/s reaches ReFusion's). ``--compile MODE`` adds two parts:
the model forward under ``torch.compile(mode=MODE)`` (on CUDA ``reduce-overhead`` records CUDA graphs)
timed on a few fixed shapes against eager, i.e. the fixed per-call cost a static-shape forward keeps; and
the token check: the shipped models (the bench's, float32 on ``--device``) decode the first
:data:`CHECK_BATCH` arith test samples with the bench's settings, alone (the first) and as one batch, eager
and compiled, and the samples whose token ids differ are counted (0 expected) per decoder and batch size.

Time is scarce on a lent GPU, so the work runs in order of importance (batch 1, then the forward-cost
table, then the compiled forward, then time outside forwards, then the batch sizes) and a part that
would start after ``--time-limit-s`` seconds is skipped and named as skipped; ``--out/gpu_bench.json`` is
rewritten after every part, so a run cut short keeps what it measured. ``--shape tiny`` builds a small
model for a CPU smoke run.
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
from refusion.experiments.costmodel import (
    DecodeProfile, calibrate_loop, crossover, fit, predict_decode, scale_rows,
)
from refusion.experiments.costmodel import measure as time_forwards
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


#: the forward-cost grid on the device: (kind, rows, fed, past); the decoders' forwards at batch 1 (dense
#: causal) and in batches (ragged), an AR step to a wide Stage I, a short and a long cache
GPU_GRID = tuple([("causal", 1, fed, past) for fed in (1, 16, 64) for past in (128, 512)]
                 + [("ragged", rows, fed, past) for rows in (1, 4, 16) for fed in (1, 16, 64) for past in (128, 512)])
#: the shapes the compiled forward is timed on (each a graph of its own under CUDA graphs)
COMPILE_GRID = (("causal", 1, 1, 256), ("causal", 1, 64, 256), ("ragged", 16, 1, 256), ("ragged", 16, 64, 256))
PREDICT_SIZES = (1, 2, 4, 8, 16, 32, 64)

#: the token check of ``--compile``: the decoders, their bench settings on this task, and its batch size
CHECK_DECODERS, CHECK_TASK, CHECK_BATCH = ("ar", "refusion"), "arith", 4

WARM_UP_TOKENS = 16  # a warm-up decode compiles kernels and fills allocator pools; its length does not matter


class Clock:
    """Seconds since the run began, against the ``--time-limit-s`` budget."""

    def __init__(self, limit_s: float) -> None:
        self.start, self.limit_s = time.perf_counter(), limit_s

    def allows(self) -> bool:
        return time.perf_counter() - self.start < self.limit_s


def decoder_for(backbone: Backbone, name: str, gen_length: int):
    return build_decoder(backbone, {**CONFIGS[name], "gen_length": gen_length})


#: (decoder, batch size) -> the recorded forwards of its first timed decode (batch 1: the first prompt)
PROFILES: dict[tuple[str, int], DecodeProfile] = {}


def measure(backbone: Backbone, name: str, gen_length: int, ids: list[list[int]]) -> dict:
    """Batch 1: tokens/s per prompt (median), forwards, iterations and host reads per iteration."""
    decoder_for(backbone, name, WARM_UP_TOKENS).generate(ids[0])
    decoder = decoder_for(backbone, name, gen_length)
    rates, walls, forwards, tokens, iterations, reads = [], [], 0, [], 0, 0
    for i, prompt in enumerate(ids):
        host.reset()
        backbone.forward_log = [] if i == 0 else None
        result = decoder.generate(prompt)
        if i == 0:
            PROFILES[name, 1] = DecodeProfile(backbone.forward_log, result.stats.nfe, result.stats.generated_tokens,
                                              result.stats.wall_s)
            backbone.forward_log = None
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
    backbone.forward_log = []
    try:
        results = decoder_for(backbone, name, gen_length).generate_batch(ids)
    finally:
        log, backbone.forward_log = backbone.forward_log, None
    tokens = sum(r.stats.generated_tokens for r in results)
    wall = results[0].stats.batch_wall_s if len(ids) > 1 else results[0].stats.wall_s
    PROFILES[name, len(ids)] = DecodeProfile(log, sum(r.stats.nfe for r in results), tokens, wall)
    return {"decoder": name, "batch_size": len(ids), "tokens": tokens, "wall_s": wall, "tokens_per_second": tokens / wall}


def forward_cost(backbone: Backbone, device: str) -> dict:
    """The cost model fitted on :data:`GPU_GRID` here, and the loop cost per sequence-forward of each decoder
    whose batch-1 decode was recorded."""
    model = fit(time_forwards(backbone, GPU_GRID, repeats=3), device=device, note="gpu_bench grid")
    loop = {name: calibrate_loop(model, p).per_sequence for (name, size), p in PROFILES.items() if size == 1}
    return {"model": model.as_dict(), "loop_s": loop}


def predictions(cost: dict) -> dict:
    """Each recorded batch row predicted; each decoder's tokens/s predicted at :data:`PREDICT_SIZES` from its
    batch-1 forwards in lock-step batches; ReFusion's crossover against AR."""
    from refusion.experiments.costmodel import CostModel

    model, loop = CostModel.from_dict(cost["model"]), cost["loop_s"]
    rows = [{"decoder": name, "batch_size": size, **predict_decode(model, p, loop[name])}
            for (name, size), p in PROFILES.items() if name in loop]
    rates: dict[str, dict[int, float]] = {}
    for name in loop:
        one = PROFILES[name, 1]
        for size in PREDICT_SIZES:
            scaled = DecodeProfile(scale_rows(one.shapes, size), one.sequence_forwards * size, one.tokens * size, 0.0)
            rates.setdefault(name, {})[size] = predict_decode(model, scaled, loop[name])["predicted_tokens_per_second"]
    cross = crossover(rates["refusion"], rates["ar"]) if {"ar", "refusion"} <= set(rates) else None
    return {"rows": rows, "lock_step": rates, "refusion_crossover": cross}


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
    ap.add_argument("--compile", default=None, metavar="MODE",
                    help="also time the forward under torch.compile(mode=MODE) on a few shapes (on CUDA: "
                         "reduce-overhead for CUDA graphs)")
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
    run("forward cost", lambda: report.update(forward_cost=forward_cost(backbone, device)))
    if a.compile:
        run(f"compiled forward ({a.compile})", lambda: report.update(compiled=compiled_forward(backbone, a.compile)))
        run(f"compiled token check ({a.compile})", lambda: report.update(
            token_check=compiled_token_check(a.device, a.compile)))
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
    if "forward_cost" in report:
        report["predictions"] = predictions(report["forward_cost"])
    save()
    print_forward_cost(report)
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


def compiled_forward(backbone: Backbone, mode: str) -> dict:
    """Median seconds of one forward of each :data:`COMPILE_GRID` shape, eager and under ``torch.compile(mode)``
    (the same weights), with the graphs compiled; an error is reported, not raised."""
    from torch._dynamo.utils import counters

    compiled = Backbone(backbone.model, backbone.tokenizer, mask_id=backbone.mask_id, compile=mode)
    out: dict = {"mode": mode, "shapes": [list(g) for g in COMPILE_GRID]}
    try:
        t0 = time.perf_counter()
        out["compiled_s"] = [s.seconds for s in time_forwards(compiled, COMPILE_GRID, repeats=5)]
        out["compile_and_time_s"] = time.perf_counter() - t0
        out["graphs"] = int(counters["stats"]["unique_graphs"])
    except Exception as e:  # a lent GPU's minutes should still return the eager figures
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    out["eager_s"] = [s.seconds for s in time_forwards(backbone, COMPILE_GRID, repeats=5)]
    return out


def decode_ids(backbone: Backbone, config: dict, ids: list[list[int]]) -> list[list[int]]:
    """The token ids ``config``'s decoder generates for each prompt: one prompt alone, several as one batch."""
    decoder = build_decoder(backbone, config)
    if len(ids) == 1:
        return [decoder.generate(ids[0]).token_ids]
    return [r.token_ids for r in decoder.generate_batch(ids)]


def compiled_token_check(device: str, mode: str) -> list[dict]:
    """Per :data:`CHECK_DECODERS` decoder and batch size (1 and :data:`CHECK_BATCH`): the samples whose token ids
    differ between eager and ``torch.compile(mode)`` decodes on the decoder's shipped model in float32 with its
    bench settings (:data:`CHECK_TASK`); a failure is reported in its row, not raised."""
    from refusion.experiments.bench import bench_runs, load_bench_config

    rows = []
    for run in bench_runs(load_bench_config(), list(CHECK_DECODERS), [CHECK_TASK]):
        task = get_task(CHECK_TASK)
        try:
            eager = Backbone.from_pretrained(run.model, device=device, dtype="float32")
            compiled = Backbone(eager.model, eager.tokenizer, mask_id=eager.mask_id, eos_ids=eager.eos_ids, compile=mode)
            ids = [encode_prompt(eager.tokenizer, e.query) for e in task.examples("test", CHECK_BATCH)]
        except Exception as e:
            rows.append({"decoder": run.label, "model": run.model, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        for size in (1, CHECK_BATCH):
            row: dict = {"decoder": run.label, "model": run.model, "batch_size": size}
            try:
                want, got = (decode_ids(bb, run.configs[CHECK_TASK], ids[:size]) for bb in (eager, compiled))
                row.update(samples=len(want), ids_differ=sum(w != g for w, g in zip(want, got)))
            except Exception as e:  # a lent GPU's minutes should still return the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
            rows.append(row)
    return rows


def print_forward_cost(report: dict) -> None:
    from refusion.experiments.costmodel import CostModel

    if "forward_cost" in report:
        cost = report["forward_cost"]
        model = CostModel.from_dict(cost["model"])
        print(f"\nforward cost model on this device (fit error median {100 * model.fit_error['median']:.1f}%, "
              f"max {100 * model.fit_error['max']:.1f}%)")
        print(model.markdown(), end="")
        print("loop cost per sequence-forward: " + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in cost["loop_s"].items()))
        pred = report["predictions"]
        print("\n| decoder | batch | measured tok/s | predicted tok/s | error |\n|---|---|---|---|---|")
        for r in pred["rows"]:
            print(f"| {r['decoder']} | {r['batch_size']} | {r['measured_tokens_per_second']:.1f} | "
                  f"{r['predicted_tokens_per_second']:.1f} | {100 * r['error']:+.1f}% |")
        if {"ar", "refusion"} <= set(pred["lock_step"]):
            ar, rf = pred["lock_step"]["ar"], pred["lock_step"]["refusion"]
            print("\npredicted refusion / ar, lock-step batches: " + ", ".join(
                f"{s}: {rf[s] / ar[s]:.2f}" for s in PREDICT_SIZES) + f"; crossover: {pred['refusion_crossover'] or '> 64'}")
    if "compiled" in report:
        c = report["compiled"]
        print(f"\ncompiled forward ({c['mode']}): " + (c.get("error") or f"{c.get('graphs')} graphs"))
        print("| shape (kind, rows, fed, past) | eager ms | compiled ms |\n|---|---|---|")
        for i, shape in enumerate(c["shapes"]):
            comp = f"{1e3 * c['compiled_s'][i]:.2f}" if "compiled_s" in c else "-"
            print(f"| {', '.join(map(str, shape))} | {1e3 * c['eager_s'][i]:.2f} | {comp} |")
    if "token_check" in report:
        print(f"\ncompiled token check (shipped models, float32, {CHECK_TASK}): samples whose token ids differ, eager "
              "against compiled\n| decoder | model | batch | ids differ |\n|---|---|---|---|")
        for r in report["token_check"]:
            cell = r.get("error") or f"{r['ids_differ']} of {r['samples']}"
            print(f"| {r['decoder']} | {r['model']} | {r.get('batch_size', '-')} | {cell} |")


if __name__ == "__main__":
    raise SystemExit(main())
