"""The forward cost model against measured decodes: predicted vs measured tokens/s per decoder and batch size.

    .venv/bin/python scripts/cost_model.py [--decoders ar,refusion,llada,block,spec-diffusion]
        [--tasks arith,code,facts] [--limit 16] [--batch-sizes 1,4,16] [--calibrate 4] [--calibrate-batch 16]
        [--repeats 7] [--compile [MODE]] [--clock wall|cpu] [--grid warm|cold|both] [--out runs/cost_model]
    .venv/bin/python scripts/cost_model.py --refit runs/cost_model [--grid cold] [--out DIR]   # from profiles.json
    .venv/bin/python scripts/cost_model.py --refit runs/a runs/b --out runs/ab   # two runs pooled
    .venv/bin/python scripts/cost_model.py --bound [GRID] --fit runs/cost_model [--tasks facts] [--batch-size 16]

1. Fits :mod:`refusion.experiments.costmodel` on timed forwards of every shape of its grid through the
   decoders' caches (the first decoder's model; the shipped tiny models share one shape), timed before
   the decodes and again after each task's (the machine's load drifts; pooled), and prints the
   coefficients. ``--grid``: each shape timed right after an untimed call of itself (``warm``, the
   default: a decode's next step of that shape), after the grid's previous shape (``cold``), or both in
   the same run (the fit on warm; ``--refit OUT --grid cold --out DIR`` fits the cold timings).
2. Calibrates each decoder's loop cost (:class:`~refusion.experiments.costmodel.LoopCost`: seconds of work
   outside forwards per model call and per sequence-forward) on validation decodes: ``--calibrate``
   samples per task one by one, and the first ``--calibrate-batch`` samples per task in one batch (0: none;
   then the loop cost is per sequence-forward alone). Every forward of every decode is timed on the same
   clock (``Backbone.time_forwards``; no synchronisation on the CPU), so the time outside forwards is
   measured, not inferred (``--loop residual``: the decode's time less its forwards' predicted costs).
3. Decodes the first ``--limit`` test samples per task with each decoder at each batch size, in chunks
   interleaved by their first sample (the bench's order; the calibration decodes among them), each
   (decoder, batch size) after one untimed warm-up chunk; records every forward's shape
   (``Backbone.forward_log``, drafter models included) and prints, per decoder, task and batch size, the
   measured aggregate tokens/s, the predicted one (the recorded forwards priced by the fit, plus the loop
   cost), their relative difference and the fixed per-call cost's share of the predicted time. Every
   timed forward of the grid and every decode's profile go to ``OUT/profiles.json``, from which
   ``--refit OUT`` repeats steps 1, 2 and 4 without decoding; ``--refit A B`` pools two runs' measurements
   (the grid's timings, the calibration decodes and each cell's decodes: their tokens and times summed).
4. Predicts each decoder's tokens/s over AR's at batch 1, 4, 16, 32 and 64 and its crossover batch size
   against AR (the first size at which AR's tokens/s reaches it) per task: on this CPU (the fit above)
   and on an H100-class GPU by assumption (:func:`refusion.experiments.costmodel.roofline` for a 0.6B
   shape, eager: the fixed cost measured on an H200; with CUDA graphs: ``GRAPH_FIXED_S``), from the
   forwards recorded here (32 and 64: the batch-16 forwards in lock-step). Writes ``OUT/cost_model.json``.
5. ``--bound [GRID] --fit DIR`` (no timing): decodes every run of an ablation grid (default
   ``tune_batch_refusion``) on its split in chunks of ``--batch-size``, prices each run's recorded forwards
   with DIR's fit and loop costs (predicted tokens/s over the grid's baseline, and the shares of fixed
   cost, tokens, attention, logits and loop), each ReFusion run's calls again at the least widths, and
   ReFusion's floor (:func:`~refusion.experiments.floor.refusion_floor`: 2 calls per chunk at the least
   widths, for the baseline's answer lengths), an upper bound under the model on any schedule's tokens/s.
   Writes ``OUT/bound.json``.
   One torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from refusion.core.config import build_decoder
from refusion.experiments.ablate import build_runs, load_ablation
from refusion.experiments.bench import bench_runs, load_bench_config
from refusion.experiments.costmodel import (
    EAGER_FIXED_S, FEATURES, GRAPH_FIXED_S, H100, QWEN3_0_6B, WARM_CALLS, CostModel, DecodeProfile, LoopCost,
    SwitchCost, calibrate_loop, crossover, feature_totals, fit, measure, predict_decode, predicted_rates, roofline,
)
from refusion.experiments.floor import GROUPS, breakdown, refusion_floor
from refusion.experiments.tables import markdown
from refusion.models.backend import Backbone, ForwardShape
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


def decode(decoder, prompts: list[list[int]], clock=time.perf_counter,
           time_forwards: bool = False) -> tuple[DecodeProfile, list]:
    """Decode ``prompts`` in one ``generate_batch`` call (``generate`` for one), recording every forward
    (each timed on ``clock`` with ``time_forwards``: no synchronisation on the CPU); the profile's time is
    ``clock``'s over the call."""
    bbs = backbones_of(decoder)
    log: list[ForwardShape] = []  # one list: the calls of every model in call order
    for bb in bbs:
        bb.forward_log, bb.time_forwards, bb.forward_clock = log, time_forwards, clock
    try:
        t0 = clock()
        results = [decoder.generate(prompts[0])] if len(prompts) == 1 else decoder.generate_batch(prompts)
        wall = clock() - t0
    finally:
        shapes = list(log)
        for bb in bbs:
            bb.forward_log, bb.time_forwards, bb.forward_clock = None, False, time.perf_counter
    seq_forwards = sum(r.stats.nfe + int((r.stats.extra or {}).get("draft_forwards", 0)) for r in results)
    return DecodeProfile(shapes, seq_forwards, sum(r.stats.generated_tokens for r in results), wall), results


def merge(profiles: list[DecodeProfile]) -> DecodeProfile:
    return DecodeProfile([s for p in profiles for s in p.shapes], sum(p.sequence_forwards for p in profiles),
                         sum(p.tokens for p in profiles), sum(p.wall_s for p in profiles))


def shapes_to_json(shapes: list[ForwardShape]) -> list[list]:
    return [[s.rows, s.fed, s.past, s.logits_rows, s.kind, s.seconds] for s in shapes]


def profile_to_json(p: DecodeProfile) -> dict:
    return {"shapes": shapes_to_json(p.shapes), "sequence_forwards": p.sequence_forwards, "tokens": p.tokens,
            "wall_s": p.wall_s}


def profile_from_json(d: dict) -> DecodeProfile:
    return DecodeProfile([ForwardShape(*s) for s in d["shapes"]], d["sequence_forwards"], d["tokens"], d["wall_s"])


def collect(a, clock) -> dict:
    """Steps 1-3's measurements: the timed grid, the calibration and the test decodes' profiles."""
    tasks = [t for t in a.tasks.split(",") if t]
    sizes = sorted({int(x) for x in a.batch_sizes.split(",") if x.strip()})
    cfg = load_bench_config()
    runs = bench_runs(cfg, [d for d in a.decoders.split(",") if d], tasks)
    bbs = {m: Backbone.from_pretrained(m, compile=a.compile) for m in dict.fromkeys(r.model for r in runs)}
    decoders = {(r.label, t): build_decoder(bbs[r.model], r.configs[t]) for r in runs for t in tasks}
    grid_bb = bbs[runs[0].model]
    orders = ("warm", "cold") if a.grid == "both" else (a.grid,)
    timed: dict[str, list[ForwardShape]] = {o: [] for o in orders}

    def time_grid() -> None:  # before the decodes and again after each task's: pooled
        for order in orders:
            timed[order] += measure(grid_bb, repeats=a.repeats, clock=clock, warm=WARM_CALLS if order == "warm" else 0)

    time_grid()

    def prompts(task: str, split: str, n: int) -> dict[str, list[list[int]]]:
        exs = get_task(task).examples(split, n)
        return {m: [encode_prompt(bb.tokenizer, e.query) for e in exs] for m, bb in bbs.items()}

    test = {t: prompts(t, "test", a.limit) for t in tasks}
    val = {t: prompts(t, "validation", max(a.calibrate, a.calibrate_batch)) for t in tasks}
    for r in runs:  # warm-up per (decoder, batch size)
        for size in sorted({*sizes, a.calibrate_batch} - {0}):
            decode(decoders[r.label, tasks[0]], test[tasks[0]][r.model][:size])
    # (task, first sample, split, decoder, size): test chunks and calibration decodes interleaved
    chunks = [(ti, first, "test", ri, size) for ti in range(len(tasks)) for ri in range(len(runs)) for size in sizes
              for first in range(0, a.limit, size)]
    chunks += [(ti, first, "validation", ri, 1) for ti in range(len(tasks)) for ri in range(len(runs))
               for first in range(a.calibrate)]
    if a.calibrate_batch:
        chunks += [(ti, 0, "validation", ri, a.calibrate_batch) for ti in range(len(tasks)) for ri in range(len(runs))]
    chunks.sort()
    test_profiles: dict[str, list[dict]] = {}
    calibration: dict[str, list[dict]] = {}
    for i, (ti, first, split, ri, size) in enumerate(chunks):
        r, t = runs[ri], tasks[ti]
        ps = (test if split == "test" else val)[t][r.model][first:first + size]
        profile, _ = decode(decoders[r.label, t], ps, clock, time_forwards=True)
        if split == "test":
            test_profiles.setdefault(f"{r.label}|{t}|{size}", []).append(profile_to_json(profile))
        else:
            calibration.setdefault(r.label, []).append({"task": t, "batch_size": size, **profile_to_json(profile)})
        if i + 1 == len(chunks) or chunks[i + 1][0] != ti:  # a task's decodes are done
            time_grid()
    return {"decoders": [r.label for r in runs], "tasks": tasks, "batch_sizes": sizes, "limit": a.limit,
            "calibrate": a.calibrate, "calibrate_batch": a.calibrate_batch, "clock": a.clock, "compile": a.compile,
            "model": runs[0].model, "grid_order": orders[0], "warm_calls": WARM_CALLS, "grid": shapes_to_json(timed[orders[0]]),
            **({"grid_cold": shapes_to_json(timed["cold"])} if len(orders) == 2 else {}),
            "calibration": calibration, "test": test_profiles}


def pool(runs: list[dict]) -> dict:
    """Several runs' measurements as one: every timed grid forward, every calibration decode and, per
    (decoder, task, batch size), every test decode (their tokens and times summed when merged)."""
    first = runs[0]
    keys = ("decoders", "tasks", "batch_sizes", "clock", "compile", "model", "grid_order", "warm_calls")
    for r in runs:
        r.setdefault("warm_calls", 1 if r["grid_order"] == "warm" else 0)  # runs before WARM_CALLS
    for other in runs[1:]:
        for k in keys:
            if other[k] != first[k]:
                raise SystemExit(f"--refit: the runs differ in {k}: {first[k]!r} and {other[k]!r}")
    out = {**first, "grid": [s for r in runs for s in r["grid"]],
           **({"grid_cold": [s for r in runs for s in r["grid_cold"]]} if all("grid_cold" in r for r in runs) else {}),
           "calibration": {label: [d for r in runs for d in r["calibration"][label]] for label in first["calibration"]},
           "test": {k: [d for r in runs for d in r["test"][k]] for k in first["test"]}}
    if len(runs) > 1:
        out["pooled_runs"] = len(runs)
    return out


def analyse(data: dict, out: Path, residual: bool = False) -> None:
    """Steps 1, 2 and 4 from :func:`collect`'s measurements: the fit, the loop costs (each decode's time
    outside its forwards: measured where they were timed, unless ``residual``: its time less the forwards'
    predicted costs), the predictions."""
    labels, tasks, sizes = data["decoders"], data["tasks"], data["batch_sizes"]
    order = data["grid_order"] + (f" ({data.get('warm_calls', 1)} calls before each)" if data["grid_order"] == "warm" else "")
    model = fit([ForwardShape(*s) for s in data["grid"]], device="cpu, 1 thread",
                note=f"{data['model']}, compile {data['compile']}, {data['clock']} clock, grid timed {order} "
                     "before the decodes and after each task's")
    print(f"forward cost model ({model.note}; fit error median {100 * model.fit_error['median']:.1f}%, "
          f"max {100 * model.fit_error['max']:.1f}%)\n{model.markdown()}")
    cold = None
    if data.get("grid_cold"):
        cold = fit([ForwardShape(*s) for s in data["grid_cold"]], device="cpu, 1 thread",
                   note=f"{data['model']}, the same run's grid timed cold")
        print(f"cold: each call after another shape ({cold.note}; fit error median "
              f"{100 * cold.fit_error['median']:.1f}%, max {100 * cold.fit_error['max']:.1f}%)\n{cold.markdown()}\n"
              "a decode's call that repeats its predecessor's shape is priced warm, any other cold")
    cpu = SwitchCost(model, cold) if cold else model
    # one profile per (task, batch size) of the calibration decodes
    loop = {}
    for label in labels:
        groups: dict[tuple[str, int], list[DecodeProfile]] = {}
        for d in data["calibration"][label]:
            p = profile_from_json(d)
            if residual:
                p.shapes = [ForwardShape(*dataclasses.astuple(x)[:5]) for x in p.shapes]  # untimed
            groups.setdefault((d["task"], d["batch_size"]), []).append(p)
        loop[label] = calibrate_loop(cpu, [merge(ps) for ps in groups.values()])
    got = {tuple(k.split("|")[:2]) + (int(k.split("|")[2]),): merge([profile_from_json(d) for d in v])
           for k, v in data["test"].items()}
    rows = []
    for label in labels:
        for t in tasks:
            for size in sizes:
                pred = predict_decode(cpu, got[label, t, size], loop[label])
                rows.append({"decoder": label, "task": t, "batch_size": size, **pred})
    print("loop cost (ms per call + per sequence-forward): " + ", ".join(
        f"{k} {1e3 * v.per_call:.3f} + {1e3 * v.per_sequence:.3f}" for k, v in loop.items()))
    print("\n" + markdown(
        ["decoder", "task", "batch", "measured tok/s", "predicted tok/s", "error", "fixed share of predicted time",
         "calls"],
        [[r["decoder"], r["task"], str(r["batch_size"]), f"{r['measured_tokens_per_second']:.0f}",
          f"{r['predicted_tokens_per_second']:.0f}", f"{100 * r['error']:+.1f}%",
          f"{100 * r['fixed_s'] / r['predicted_s']:.0f}%", str(r["calls"])] for r in rows]), end="")
    worst = max(rows, key=lambda x: abs(x["error"]))
    print(f"\nlargest error: {100 * worst['error']:+.1f}% ({worst['decoder']}, {worst['task']}, batch {worst['batch_size']}); "
          f"{sum(abs(x['error']) <= 0.15 for x in rows)} of {len(rows)} rows within 15%")
    predictions = {}
    for where, cost in (("this CPU", cpu), ("H100, eager (assumed)", roofline(QWEN3_0_6B, H100, EAGER_FIXED_S)),
                        ("H100, CUDA graphs (assumed)", roofline(QWEN3_0_6B, H100, GRAPH_FIXED_S))):
        rates = {(label, t): predicted_rates(cost, {s: got[label, t, s] for s in sizes}, loop[label])
                 for label in labels for t in tasks}
        table = []
        for label in labels:
            for t in tasks:
                ar = rates.get(("ar", t))
                if ar is None or label == "ar":
                    continue
                mine = rates[label, t]
                table.append({"decoder": label, "task": t, "vs_ar": {s: mine[s] / ar[s] for s in mine},
                              "crossover": crossover(mine, ar)})
        predictions[where] = table
        if table:
            sizes_shown = list(table[0]["vs_ar"])
            print(f"\npredicted tokens/s over AR's, {where}\n" + markdown(
                ["decoder", "task", *(f"batch {s}" for s in sizes_shown), "crossover"],
                [[r["decoder"], r["task"], *(f"{v:.2f}" for v in r["vs_ar"].values()),
                  str(r["crossover"] or f"> {sizes_shown[-1]}")] for r in table]), end="")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_model.json").write_text(json.dumps({
        "model": model.as_dict(), "cold_model": cold.as_dict() if cold else None, "loop": {k: asdict(v) for k, v in loop.items()}, "rows": rows,
        "limit": data["limit"], "calibrate": data["calibrate"], "calibrate_batch": data["calibrate_batch"],
        "predictions": predictions}, indent=1))


def bound(a, fitted: dict) -> list[dict]:
    """Step 5 (``--bound GRID``): every run of the ablation GRID decoded on its split in chunks of
    ``--batch-size``, its recorded forwards priced by the fit (``fitted``: a ``cost_model.json``) with its
    decoder's loop cost; each ReFusion run's forwards again at the least widths
    (:func:`~refusion.experiments.floor.refusion_floor` with its own calls and sequence-forwards); and
    ReFusion's floor, the fewest calls (2 per chunk) at the least widths, for the baseline's answer lengths."""
    cfg = load_ablation(a.bound)
    tasks = [t for t in a.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in cfg.tasks]:
        raise SystemExit(f"--tasks: {unknown} not among the grid's tasks {cfg.tasks}")
    runs = build_runs(cfg, batch_size=a.batch_size)
    baseline = cfg.baseline or "ar"
    if baseline not in [r.label for r in runs]:
        raise SystemExit(f"--bound: the grid has no baseline run {baseline!r} to compare with")
    model = CostModel.from_dict(fitted["model"])
    cold = CostModel.from_dict(fitted["cold_model"]) if fitted.get("cold_model") else None
    pricer = SwitchCost(model, cold) if cold else model
    floor_models = [model, cold] if cold else [model]

    def floor_terms(vector: list[float]) -> dict[str, float]:  # the cheaper fit's price: still a lower bound
        return min((m.terms(vector) for m in floor_models), key=lambda t: sum(t.values()))

    loops = {k: LoopCost(**v) for k, v in fitted["loop"].items()}
    if missing := sorted({r.decoder for r in runs} - set(loops)):
        raise SystemExit(f"--fit: no loop cost for {missing} (run this script with --decoders including them)")
    limit, size = a.limit or cfg.limit, runs[0].batch_size
    bbs = {m: Backbone.from_pretrained(m) for m in dict.fromkeys(r.model for r in runs)}
    rows = []
    for t in tasks:
        task = get_task(t)
        examples = task.examples(cfg.split, limit)
        chunks = [examples[i:i + size] for i in range(0, len(examples), size)]
        answers = {}  # run -> per chunk (prompt lengths, generated tokens)
        for r in runs:
            decoder = build_decoder(bbs[r.model], r.configs[t])
            seconds: dict[str, float] = {}
            least = fed = 0.0
            calls = correct = 0
            for chunk in chunks:
                prompts = [encode_prompt(bbs[r.model].tokenizer, e.query) for e in chunk]
                profile, results = decode(decoder, prompts)
                nfe, generated = [res.stats.nfe for res in results], [res.stats.generated_tokens for res in results]
                answers.setdefault(r.label, []).append(([len(p) for p in prompts], generated))
                totals = feature_totals(profile.shapes)
                for k, v in breakdown(pricer.terms_of(profile.shapes), loops[r.decoder], len(profile.shapes),
                                      sum(nfe)).items():
                    seconds[k] = seconds.get(k, 0.0) + v
                if r.decoder == "refusion":
                    floor = refusion_floor([len(p) for p in prompts], generated, len(profile.shapes), nfe)
                    least += breakdown(floor_terms(floor), loops[r.decoder], len(profile.shapes), sum(nfe))["total"]
                fed += totals[FEATURES.index("token")]
                calls += len(profile.shapes)
                correct += sum(task.score(e, res.text) for e, res in zip(chunk, results))
            tokens = sum(sum(g) for _, g in answers[r.label])
            rows.append({"task": t, "run": r.label, "decoder": r.decoder, "accuracy": 100 * correct / len(examples),
                         "tokens": tokens, "calls": calls, "fed_per_token": fed / tokens, "seconds": seconds,
                         "least_widths_s": least if r.decoder == "refusion" else None})
        floor: dict[str, float] = {}
        fed = 0.0
        for p, g in answers[baseline]:  # per chunk: 2 calls, each sequence in both
            least = refusion_floor(p, g)
            fed += least[FEATURES.index("token")]
            for k, v in breakdown(floor_terms(least), loops["refusion"], 2, 2 * len(p)).items():
                floor[k] = floor.get(k, 0.0) + v
        tokens = sum(sum(g) for _, g in answers[baseline])
        rows.append({"task": t, "run": f"floor ({baseline}'s answers)", "decoder": "refusion", "accuracy": None,
                     "tokens": tokens, "calls": 2 * len(chunks), "fed_per_token": fed / tokens, "seconds": floor,
                     "least_widths_s": None})
        base = next(x for x in rows if x["task"] == t and x["run"] == baseline)
        for x in rows:
            if x["task"] == t:
                x["tokens_per_second"] = x["tokens"] / x["seconds"]["total"]
                x["vs_baseline"] = x["tokens_per_second"] / base["tokens_per_second"]
                x["least_widths_vs_baseline"] = (x["tokens"] / x["least_widths_s"] / base["tokens_per_second"]
                                                 if x["least_widths_s"] else None)
    return rows


def print_bound(rows: list[dict], batch_size: int) -> None:
    """The bound's table: per run, its predicted tokens/s over the baseline's and where its time goes."""
    groups = [*GROUPS, "loop"]
    print(f"\npredicted at batch {batch_size}, each run's recorded forwards (shares of its predicted time); "
          "least widths: the same calls and sequence-forwards at the floor's widths\n" + markdown(
              ["task", "run", "acc %", "calls", "fed/token", "predicted tok/s", "x baseline",
               *(f"{g} %" for g in groups), "least widths: x baseline"],
              [[x["task"], x["run"], "" if x["accuracy"] is None else f"{x['accuracy']:.1f}", str(x["calls"]),
                "" if x["fed_per_token"] is None else f"{x['fed_per_token']:.2f}", f"{x['tokens_per_second']:.0f}",
                f"{x['vs_baseline']:.2f}",
                *(f"{100 * x['seconds'][g] / x['seconds']['total']:.0f}" if g in x["seconds"] else "" for g in groups),
                "" if x["least_widths_vs_baseline"] is None else f"{x['least_widths_vs_baseline']:.2f}"]
               for x in rows]), end="")

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", default="ar,refusion,llada,block,spec-diffusion")
    ap.add_argument("--tasks", default="arith,code,facts")
    ap.add_argument("--limit", type=int, default=None, help="test samples per task (default 16; with --bound: "
                                                             "the grid's)")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--calibrate", type=int, default=4, help="validation samples per task decoded one by one "
                                                             "for the loop cost")
    ap.add_argument("--calibrate-batch", type=int, default=16, help="validation samples per task decoded in one "
                                                                    "batch for the loop cost (0: none)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds of the forward grid")
    ap.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall time (default), or this thread's CPU time: the work alone, on a CPU shared with "
                         "other processes (one torch thread)")
    ap.add_argument("--grid", choices=("warm", "cold", "both"), default=None,
                    help="time each grid shape after calls of itself (warm: a run of like calls, AR's steps), "
                         "right after the grid's previous shape (cold: a call unlike its predecessor), or both "
                         "(the default: each decode's call priced by the one that fits it); with --refit: the "
                         "run's grids to fit (default: what it holds)")
    ap.add_argument("--loop", choices=("measured", "residual"), default="measured",
                    help="each calibration decode's loop time: measured outside its timed forwards (default; "
                         "the residual for runs whose forwards were not timed), or its time less the forwards' "
                         "predicted costs (residual)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/cost_model; with one --refit "
                                                           "DIR: DIR)")
    ap.add_argument("--refit", type=Path, nargs="+", metavar="DIR",
                    help="analyse DIR/profiles.json again, decoding nothing; several DIRs (runs of the same "
                         "decoders, tasks and batch sizes) are pooled and the analysis goes to --out")
    ap.add_argument("--bound", nargs="?", const="tune_batch_refusion", default=None, metavar="GRID",
                    help="price every run of an ablation grid (default: tune_batch_refusion) at --batch-size from "
                         "its recorded forwards with the fit of --fit, against ReFusion's floor; decodes, times nothing")
    ap.add_argument("--fit", type=Path, metavar="DIR", help="with --bound: a run of this script (DIR/cost_model.json)")
    ap.add_argument("--batch-size", type=int, default=16, help="with --bound: samples per decode call")
    a = ap.parse_args(argv)
    if a.bound:
        if a.fit is None or not (a.fit / "cost_model.json").is_file():
            ap.error(f"--bound needs --fit DIR holding a cost_model.json (written by a run of this script); "
                     f"got {a.fit}")
        torch.set_num_threads(1)
        a.out = a.out or Path("runs/cost_model")
        rows = bound(a, json.loads((a.fit / "cost_model.json").read_text()))
        print_bound(rows, a.batch_size)
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bound.json").write_text(json.dumps({"grid": a.bound, "fit": str(a.fit), "batch_size": a.batch_size,
                                                       "rows": rows}, indent=1))
        return 0
    a.limit = a.limit or 16
    if a.calibrate < 1:
        ap.error("--calibrate: need at least 1 validation sample per task")
    if a.refit:
        runs = []
        for folder in a.refit:
            path = folder / "profiles.json"
            if not path.is_file():
                ap.error(f"--refit: no {path} (written by a run of this script with --out {folder})")
            run = json.loads(path.read_text())
            run.setdefault("grid_order", "cold")  # runs before the warm grid timed each shape after the previous one
            if a.grid == "cold" and run["grid_order"] != "cold" and run.get("grid_cold"):
                run["grid"], run["grid_order"] = run["grid_cold"], "cold"
            if a.grid not in (None, "both", run["grid_order"]) or (a.grid == "both" and not run.get("grid_cold")):
                ap.error(f"--refit --grid {a.grid}: {path} holds no grid timed {a.grid}")
            if a.grid in ("warm", "cold"):
                run.pop("grid_cold", None)
            runs.append(run)
        if len(a.refit) > 1 and a.out is None:
            ap.error("--refit with several runs: give --out for the pooled analysis")
        analyse(pool(runs), a.out or a.refit[0], residual=a.loop == "residual")
        return 0
    torch.set_num_threads(1)
    a.grid, a.out = a.grid or "both", a.out or Path("runs/cost_model")
    data = collect(a, CLOCKS[a.clock])
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profiles.json").write_text(json.dumps(data))
    analyse(data, a.out, residual=a.loop == "residual")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
