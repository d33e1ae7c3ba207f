"""The forward cost model against measured decodes: predicted vs measured tokens/s per decoder and batch size.

    .venv/bin/python scripts/cost_model.py [--decoders ar,refusion,llada,block,spec-diffusion]
        [--tasks arith,code,facts] [--limit 16] [--batch-sizes 1,4,16] [--calibrate 4] [--repeats 7]
        [--compile [MODE]] [--out runs/cost_model]

1. Fits :mod:`refusion.experiments.costmodel` on timed forwards of every shape of its grid through the
   decoders' caches (the first decoder's model; the shipped tiny models share one shape), timed before
   and again after the decodes (the machine's load drifts), and prints the coefficients.
2. Calibrates each decoder's loop cost (seconds of work outside forwards per sequence-forward) on
   ``--calibrate`` validation samples per task at batch size 1.
3. Decodes the first ``--limit`` test samples per task with each decoder at each batch size, in chunks
   interleaved by their first sample (the bench's order), each (decoder, batch size) after one untimed
   warm-up chunk; records every forward's shape (``Backbone.forward_log``, drafter models included) and
   prints, per decoder, task and batch size, the measured aggregate tokens/s, the predicted one (the
   recorded forwards priced by the fit, plus the loop cost), their relative difference and the fixed
   per-call cost's share of the predicted time.
4. Predicts each decoder's tokens/s over AR's at batch 1, 4, 16, 32 and 64 and its crossover batch size
   against AR (the first size at which AR's tokens/s reaches it) per task: on this CPU (the fit above)
   and on an H100-class GPU by assumption (:func:`refusion.experiments.costmodel.roofline` for a 0.6B
   shape, eager: the fixed cost measured on an H200; with CUDA graphs: ``GRAPH_FIXED_S``), from the
   forwards recorded here (32 and 64: the batch-16 forwards in lock-step). Writes ``OUT/cost_model.json``.
   One torch thread.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refusion.core.config import build_decoder
from refusion.experiments.bench import bench_runs, load_bench_config
from refusion.experiments.costmodel import (
    EAGER_FIXED_S, GRAPH_FIXED_S, H100, QWEN3_0_6B, DecodeProfile, calibrate_loop, crossover, fit, measure,
    predict_decode, predicted_rates, roofline,
)
from refusion.experiments.tables import markdown
from refusion.models.backend import Backbone
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task


def backbones_of(decoder) -> list[Backbone]:
    """The decoder's backbone and its drafter's, when it runs a model of its own."""
    out = [decoder.backbone]
    draft = getattr(getattr(decoder, "proposer", None), "draft", None)
    if draft is not None and draft is not decoder.backbone:
        out.append(draft)
    return out


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def decode(decoder, prompts: list[list[int]], clock=time.perf_counter) -> tuple[DecodeProfile, list]:
    """Decode ``prompts`` in one ``generate_batch`` call (``generate`` for one), recording every forward;
    the profile's time is ``clock``'s over the call."""
    bbs = backbones_of(decoder)
    for bb in bbs:
        bb.forward_log = []
    try:
        t0 = clock()
        results = [decoder.generate(prompts[0])] if len(prompts) == 1 else decoder.generate_batch(prompts)
        wall = clock() - t0
    finally:
        shapes = [s for bb in bbs for s in bb.forward_log]
        for bb in bbs:
            bb.forward_log = None
    seq_forwards = sum(r.stats.nfe + int((r.stats.extra or {}).get("draft_forwards", 0)) for r in results)
    return DecodeProfile(shapes, seq_forwards, sum(r.stats.generated_tokens for r in results), wall), results


def merge(profiles: list[DecodeProfile]) -> DecodeProfile:
    return DecodeProfile([s for p in profiles for s in p.shapes], sum(p.sequence_forwards for p in profiles),
                         sum(p.tokens for p in profiles), sum(p.wall_s for p in profiles))


def measured_table(rows: list[dict]) -> str:
    """Measured against predicted tokens/s per decoder, task and batch size (Markdown)."""
    return markdown(["decoder", "task", "batch", "measured tok/s", "predicted tok/s", "error",
                     "fixed share of predicted time", "calls"],
                    [[r["decoder"], r["task"], str(r["batch_size"]), f"{r['measured_tokens_per_second']:.0f}",
                      f"{r['predicted_tokens_per_second']:.0f}", f"{100 * r['error']:+.1f}%",
                      f"{100 * r['fixed_s'] / r['predicted_s']:.0f}%", str(r["calls"])] for r in rows])


def predictions_table(table: list[dict], sizes: list[int]) -> str:
    """Predicted tokens/s over AR's at each batch size and the crossover, per decoder and task (Markdown)."""
    return markdown(["decoder", "task", *[f"batch {s}" for s in sizes], "crossover"],
                    [[r["decoder"], r["task"], *[f"{v:.2f}" for v in r["vs_ar"].values()],
                      str(r["crossover"] or "> " + str(sizes[-1]))] for r in table])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", default="ar,refusion,llada,block,spec-diffusion")
    ap.add_argument("--tasks", default="arith,code,facts")
    ap.add_argument("--limit", type=int, default=16, help="test samples per task")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--calibrate", type=int, default=4, help="validation samples per task for the loop cost")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds of the forward grid")
    ap.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall time (default), or this thread's CPU time: the work alone, on a CPU shared with "
                         "other processes (one torch thread)")
    ap.add_argument("--out", type=Path, default=Path("runs/cost_model"))
    a = ap.parse_args(argv)
    clock = CLOCKS[a.clock]
    torch.set_num_threads(1)
    tasks = [t for t in a.tasks.split(",") if t]
    sizes = sorted({int(x) for x in a.batch_sizes.split(",") if x.strip()})
    cfg = load_bench_config()
    runs = bench_runs(cfg, [d for d in a.decoders.split(",") if d], tasks)
    bbs = {m: Backbone.from_pretrained(m, compile=a.compile) for m in dict.fromkeys(r.model for r in runs)}
    decoders = {(r.label, t): build_decoder(bbs[r.model], r.configs[t]) for r in runs for t in tasks}

    timed = measure(bbs[runs[0].model], repeats=a.repeats, clock=clock)  # again after the decodes: pooled

    def prompts(task: str, split: str, n: int) -> dict[str, list[list[int]]]:
        exs = get_task(task).examples(split, n)
        return {m: [encode_prompt(bb.tokenizer, e.query) for e in exs] for m, bb in bbs.items()}

    calibration: dict[str, DecodeProfile] = {}
    for r in runs:  # loop cost per sequence-forward, from batch-1 decodes of validation samples
        parts = []
        for t in tasks:
            ps = prompts(t, "validation", a.calibrate)[r.model]
            decode(decoders[r.label, t], ps[:1])  # warm-up
            parts += [decode(decoders[r.label, t], [p], clock)[0] for p in ps]
        calibration[r.label] = merge(parts)

    test = {t: prompts(t, "test", a.limit) for t in tasks}
    for r in runs:  # warm-up per (decoder, batch size)
        for size in sizes:
            decode(decoders[r.label, tasks[0]], test[tasks[0]][r.model][:size])
    chunks = sorted((ti, first, ri, size) for ti in range(len(tasks)) for ri in range(len(runs)) for size in sizes
                    for first in range(0, a.limit, size))
    got: dict[tuple[str, str, int], list[DecodeProfile]] = {}
    for ti, first, ri, size in chunks:
        r, t = runs[ri], tasks[ti]
        profile, _ = decode(decoders[r.label, t], test[t][r.model][first:first + size], clock)
        got.setdefault((r.label, t, size), []).append(profile)

    timed += measure(bbs[runs[0].model], repeats=a.repeats, clock=clock)
    model = fit(timed, device="cpu, 1 thread", note=f"{runs[0].model}, compile {a.compile}, {a.clock} clock, "
                                                     "grid timed before and after the decodes")
    print(f"forward cost model ({model.note}; fit error median {100 * model.fit_error['median']:.1f}%, "
          f"max {100 * model.fit_error['max']:.1f}%)\n{model.markdown()}")
    loop = {label: calibrate_loop(model, p) for label, p in calibration.items()}
    rows = []
    for r in runs:
        for t in tasks:
            for size in sizes:
                pred = predict_decode(model, merge(got[r.label, t, size]), loop[r.label])
                rows.append({"decoder": r.label, "task": t, "batch_size": size, **pred})
    print(f"loop cost per sequence-forward (ms): " + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in loop.items()))
    print("\n" + measured_table(rows), end="")
    worst = max(rows, key=lambda x: abs(x["error"]))
    print(f"\nlargest error: {100 * worst['error']:+.1f}% ({worst['decoder']}, {worst['task']}, batch {worst['batch_size']}); "
          f"{sum(abs(x['error']) <= 0.15 for x in rows)} of {len(rows)} rows within 15%")
    predictions = {}
    for where, cost in (("this CPU", model), ("H100, eager (assumed)", roofline(QWEN3_0_6B, H100, EAGER_FIXED_S)),
                        ("H100, CUDA graphs (assumed)", roofline(QWEN3_0_6B, H100, GRAPH_FIXED_S))):
        rates = {(r.label, t): predicted_rates(cost, {s: merge(got[r.label, t, s]) for s in sizes}, loop[r.label])
                 for r in runs for t in tasks}
        table = []
        for r in runs:
            for t in tasks:
                ar = rates.get(("ar", t))
                if ar is None or r.label == "ar":
                    continue
                mine = rates[r.label, t]
                table.append({"decoder": r.label, "task": t, "vs_ar": {s: mine[s] / ar[s] for s in mine},
                              "crossover": crossover(mine, ar)})
        predictions[where] = table
        if table:
            sizes_shown = list(table[0]["vs_ar"])
            print(f"\npredicted tokens/s over AR's, {where}\n" + predictions_table(table, sizes_shown), end="")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cost_model.json").write_text(json.dumps({"model": model.as_dict(), "loop_s": loop, "rows": rows,
                                                       "limit": a.limit, "calibrate": a.calibrate,
                                                       "predictions": predictions}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
