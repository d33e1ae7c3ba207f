"""What ``--compile`` changes: token ids, tokens/s and the fixed per-call cost, eager against compiled.

    .venv/bin/python scripts/compile_bench.py [--decoders ar,refusion,llada,block,spec-diffusion]
        [--tasks arith,code,facts] [--limit 16] [--batch-sizes 1,16] [--mode default] [--repeats 5]
        [--no-fit] [--out runs/compile_bench]
    .venv/bin/python scripts/compile_bench.py --calls-only [--mode MODE] [--cpp-wrapper] [--freezing]
    .venv/bin/python scripts/compile_bench.py --split
    .venv/bin/python scripts/compile_bench.py --mode aot [...]   # the ahead-of-time compiled forward (models/aot.py)

Loads every model of the bench's decoders twice, eagerly and under ``torch.compile`` (``--mode``), and
decodes the first ``--limit`` test samples per task with each decoder at each batch size on both, chunk by
chunk (the chunks interleaved by first sample; within a chunk eager and compiled alternate which goes
first), after warm-up decodes that compile the graphs. Prints per decoder and batch size: samples whose
token ids differ between the two, aggregate tokens/s of each and compiled over eager with a 95%
paired-bootstrap interval over chunks (and the same ratio in this thread's CPU time, which other busy
processes on the machine do not inflate), and the graphs compiled during the timed decodes (recompiles).
Then (unless ``--no-fit``) fits the forward cost model (:mod:`refusion.experiments.costmodel`) on both
and prints each fixed per-call cost, eager and compiled. Writes ``OUT/compile_bench.json``. One thread.

``--calls-only``: only the per-call cost, without decodes: one forward of 1 token after 150 cached through
a sequence's cache and through a ragged batch of 16 rows (nearly all fixed cost), eager and compiled on
``tiny-ar``, interleaved call by call for ``--call-repeats`` rounds; median wall and CPU milliseconds.
``--cpp-wrapper``: inductor's C++ wrapper (``torch._inductor.config.cpp_wrapper``) instead of its Python
one, which calls the compiled kernels from C++. ``--freezing``: inductor's freezing
(``torch._inductor.config.freezing``: the weights become constants of the graph, so each model gets graphs
of its own). ``--split``: where the compiled call's CPU time goes (:func:`split_call`), no eager arm.
``--mode aot``: the compiled arm is ``--compile aot`` (:mod:`refusion.models.aot`); its kinds compiled in the
warm-up and during the timed decodes, and any kind that ran through ``torch.compile`` instead, are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model import backbones_of  # noqa: E402

from refusion.core.config import build_decoder  # noqa: E402
from refusion.experiments.bench import bench_runs, load_bench_config  # noqa: E402
from refusion.experiments.costmodel import FEATURES, fit, forward_call, measure  # noqa: E402
from refusion.experiments.stats import throughput_ratio  # noqa: E402
from refusion.experiments.tables import markdown  # noqa: E402
from refusion.models.backend import Backbone  # noqa: E402
from refusion.models.loading import COMPILE_MODES  # noqa: E402
from refusion.models.tokenizer import encode_prompt  # noqa: E402
from refusion.tasks import get_task  # noqa: E402


def aot_kinds(backbones) -> tuple[int, dict[str, str]]:
    """Under ``--compile aot``: the compiled kinds loaded by ``backbones`` so far, and the kinds any of them ran
    through ``torch.compile`` instead (with why)."""
    aots = [bb.aot for bb in backbones if bb.aot is not None]
    return sum(len(a.runners) for a in aots), {k: v for a in aots for k, v in a.fallbacks.items()}


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_chunk(decoder, prompts: list[list[int]]) -> tuple[int, float, list[list[int]], float]:
    """(tokens, wall seconds, token ids per prompt, this thread's CPU seconds) of one decode call."""
    cpu0 = time.thread_time()
    if len(prompts) == 1:
        res = [decoder.generate(prompts[0])]
        wall = res[0].stats.wall_s
    else:
        res = decoder.generate_batch(prompts)
        wall = res[0].stats.batch_wall_s
    return sum(r.stats.generated_tokens for r in res), wall, [r.token_ids for r in res], time.thread_time() - cpu0


#: the per-call shapes of ``--calls-only``: (kind, rows, fed, past)
CALLS = (("causal", 1, 1, 150), ("ragged", 16, 1, 150))


def per_call(mode: str, repeats: int, skip_guards: bool = False) -> list[dict]:
    """Median wall and CPU milliseconds of each :data:`CALLS` forward, eager and compiled, interleaved;
    ``skip_guards``: after the first calls, dynamo's ``skip_guard_eval_unsafe`` stance (guards are checked only
    where they tell cached graphs apart; a measurement of what the guards cost, unsafe for decoding)."""
    eager = Backbone.from_pretrained("tiny-ar")
    compiled = Backbone(eager.model, eager.tokenizer, mask_id=eager.mask_id, eos_ids=eager.eos_ids, compile=mode)
    calls = [(arm, shape, forward_call(bb, *shape, False)) for shape in CALLS
             for arm, bb in (("eager", eager), ("compiled", compiled))]
    for arm, shape, call in calls:  # compiles
        t0 = time.perf_counter()
        call()
        call()
        print(f"{arm} {shape}: first calls {time.perf_counter() - t0:.1f} s", flush=True)
    if skip_guards:
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    wall: list[list[float]] = [[] for _ in calls]
    cpu: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, (_, _, call) in enumerate(calls):
            w0, c0 = time.perf_counter(), time.thread_time()
            call()
            wall[i].append(time.perf_counter() - w0)
            cpu[i].append(time.thread_time() - c0)
    import statistics

    return [{"arm": arm, "shape": list(shape), "wall_ms": 1e3 * statistics.median(w), "cpu_ms": 1e3 * statistics.median(c)}
            for (arm, shape, _), w, c in zip(calls, wall, cpu)]


def split_call(repeats: int) -> list[dict]:
    """Where a compiled call's CPU time goes (tiny-ar, mode ``default``, each :data:`CALLS` shape): the whole
    call, the model call (``Backbone.time_forwards`` on this thread's clock; the rest is the cache's and
    ``Backbone.forward``'s Python), and inside inductor's compiled graph (a backend that times it; the rest
    of the model call is dynamo's guards, its bytecode around the graph and AOT autograd's wrappers); and
    the model's linear layers alone on one row (the weights streamed, the floor of a one-token forward's
    matrix products). Medians of ``repeats`` rounds, milliseconds."""
    import statistics

    from torch._inductor.compile_fx import compile_fx

    from refusion.models.backend import compiled_call

    inside = [0.0]

    def timed_inductor(gm, example_inputs):
        graph = compile_fx(gm, example_inputs)

        def run(*args):
            c0 = time.thread_time()
            out = graph(*args)
            inside[0] += time.thread_time() - c0
            return out

        return run

    bb = Backbone.from_pretrained("tiny-ar", compile="default")
    compiled_call(bb.model, "default")  # its dynamo settings
    bb._call = torch.compile(bb.model, backend=timed_inductor, dynamic=True)
    bb.time_forwards, bb.forward_clock = True, time.thread_time
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    rows = []
    for shape in CALLS:
        call = forward_call(bb, *shape, False)
        call(), call()
        whole, model, graph = [], [], []
        for _ in range(repeats):
            inside[0], bb.forward_s = 0.0, 0.0
            c0 = time.thread_time()
            call()
            whole.append(time.thread_time() - c0)
            model.append(bb.forward_s)
            graph.append(inside[0])
        rows.append({"shape": list(shape), "whole_ms": med(whole), "model_call_ms": med(model), "graph_ms": med(graph)})
    linears = [m for m in bb.model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, m.in_features) for m in linears]
    times = []
    with torch.no_grad():
        for i in range(repeats + 5):
            c0 = time.thread_time()
            for m, x in zip(linears, xs):
                torch.nn.functional.linear(x, m.weight, m.bias)
            times.append(time.thread_time() - c0)
    rows.append({"linears": len(linears), "linears_one_row_ms": med(times[5:])})
    return rows


def split_table(rows: list[dict]) -> str:
    """:func:`split_call`'s rows (Markdown)."""
    body = [[", ".join(map(str, r["shape"])), f"{r['whole_ms']:.2f}", f"{r['whole_ms'] - r['model_call_ms']:.2f}",
             f"{r['model_call_ms'] - r['graph_ms']:.2f}", f"{r['graph_ms']:.2f}"] for r in rows if "shape" in r]
    lin = rows[-1]
    return (markdown(["shape (kind, rows, fed, past)", "whole call, CPU ms", "outside the model call",
                      "model call outside the graph", "inside the graph"], body)
            + f"the model's {lin['linears']} linear layers alone on one row: {lin['linears_one_row_ms']:.2f} ms\n")


def calls_table(rows: list[dict]) -> str:
    """One forward's wall and CPU time per shape and arm (Markdown)."""
    return markdown(["shape (kind, rows, fed, past)", "arm", "wall ms", "CPU ms"],
                    [[", ".join(map(str, r["shape"])), r["arm"], f"{r['wall_ms']:.2f}", f"{r['cpu_ms']:.2f}"] for r in rows])


def decode_table(rows: list[dict]) -> str:
    """Eager against compiled decodes per decoder and batch size, ratios with their 95% intervals (Markdown)."""
    return markdown(["decoder", "batch", "samples", "ids differ", "eager tok/s", "compiled tok/s", "compiled / eager [95%]",
                     "the same in CPU time [95%]"],
                    [[r["decoder"], str(r["batch_size"]), str(r["samples"]), str(r["ids_differ"]),
                      f"{r['eager_tokens_per_second']:.0f}", f"{r['compiled_tokens_per_second']:.0f}",
                      f"{r['ratio']:.2f}x [{r['ratio_low']:.2f}, {r['ratio_high']:.2f}]",
                      f"{r['cpu_ratio']:.2f}x [{r['cpu_ratio_low']:.2f}, {r['cpu_ratio_high']:.2f}]"] for r in rows])


def fit_table(fits: dict) -> str:
    """The eager and compiled forward cost models' coefficients side by side (Markdown)."""
    body = []
    for name in FEATURES:
        e, c = fits["eager"].coef[name], fits["compiled"].coef[name]
        scale, unit = (1e3, "ms") if name.startswith("fixed") else (1e6, "us")
        body.append([name, f"{e * scale:.4g} {unit}", f"{c * scale:.4g} {unit}", f"{(c / e if e else float('nan')):.2f}"])
    return markdown(["term", "eager", "compiled", "compiled / eager"], body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", default="ar,refusion,llada,block,spec-diffusion")
    ap.add_argument("--tasks", default="arith,code,facts")
    ap.add_argument("--limit", type=int, default=16, help="test samples per task")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--mode", default="default", choices=COMPILE_MODES, help="--compile's mode for the compiled arm")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds of the forward-cost grid")
    ap.add_argument("--no-fit", action="store_true", help="skip the forward-cost fit")
    ap.add_argument("--fit-clock", choices=["wall", "cpu"], default="wall",
                    help="time the fit's forwards in wall time or in this thread's CPU time")
    ap.add_argument("--calls-only", action="store_true", help="only the per-call cost of two shapes (see above)")
    ap.add_argument("--call-repeats", type=int, default=40)
    ap.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper instead of its Python one")
    ap.add_argument("--split", action="store_true", help="where a compiled call's CPU time goes (see split_call)")
    ap.add_argument("--freezing", action="store_true", help="inductor's freezing (weights as constants)")
    ap.add_argument("--skip-guards", action="store_true",
                    help="with --calls-only: time the compiled calls under dynamo's skip_guard_eval_unsafe stance")
    ap.add_argument("--out", type=Path, default=Path("runs/compile_bench"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    if a.cpp_wrapper:
        inductor_config.cpp_wrapper = True
    if a.freezing:
        inductor_config.freezing = True
    if a.split:
        rows = split_call(a.call_repeats)
        print(f"\nthe compiled call's CPU time, median of {a.call_repeats} rounds (tiny-ar, compile default)\n"
              + split_table(rows), end="")
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "split.json").write_text(json.dumps(rows, indent=1))
        return 0
    if a.calls_only:
        rows = per_call(a.mode, a.call_repeats, a.skip_guards)
        print(f"\none forward, median of {a.call_repeats} interleaved rounds (tiny-ar, compile {a.mode}, "
              f"{'C++' if a.cpp_wrapper or a.mode == 'aot' else 'Python'} wrapper{', guards skipped' if a.skip_guards else ''})\n" + calls_table(rows), end="")
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "calls.json").write_text(json.dumps({"mode": a.mode, "cpp_wrapper": a.cpp_wrapper, "skip_guards": a.skip_guards, "rows": rows}, indent=1))
        return 0
    tasks = [t for t in a.tasks.split(",") if t]
    sizes = sorted({int(x) for x in a.batch_sizes.split(",") if x.strip()})
    runs = bench_runs(load_bench_config(), [d for d in a.decoders.split(",") if d], tasks)
    models = list(dict.fromkeys(r.model for r in runs))
    arms = {"eager": None, "compiled": a.mode}
    bbs = {(arm, m): Backbone.from_pretrained(m, compile=mode) for arm, mode in arms.items() for m in models}
    decoders = {(arm, r.label, t): build_decoder(bbs[arm, r.model], r.configs[t])
                for arm in arms for r in runs for t in tasks}
    for arm, mode in arms.items():  # a drafter model loads through the proposer: it must follow its target
        for r in runs:
            for bb in backbones_of(decoders[arm, r.label, tasks[0]]):
                assert bb.compile == mode, f"{r.label} ({arm}): a backbone runs with compile {bb.compile}"
    prompts = {(m, t): [encode_prompt(bbs["eager", m].tokenizer, e.query) for e in get_task(t).examples("test", a.limit)]
               for m in models for t in tasks}

    t0 = time.perf_counter()
    for arm in arms:  # warm-up: every (decoder, task, size) once, which compiles what the decodes need
        for r in runs:
            for t in tasks:
                for size in sizes:
                    run_chunk(decoders[arm, r.label, t], prompts[r.model, t][:size])
    warm_s, graphs0 = time.perf_counter() - t0, graphs_compiled()
    compiled_bbs = list(dict.fromkeys(bb for r in runs for t in tasks for bb in backbones_of(decoders["compiled", r.label, t])))
    kinds0 = aot_kinds(compiled_bbs)[0]
    print(f"warm-up {warm_s:.0f} s, {graphs0} graphs compiled" + (f", {kinds0} aot kinds loaded" if a.mode == "aot" else ""),
          flush=True)

    chunks = sorted((ti, first, ri, size) for ti in range(len(tasks)) for ri in range(len(runs)) for size in sizes
                    for first in range(0, a.limit, size))
    got: dict[tuple[str, int], dict[str, list]] = {}
    for n, (ti, first, ri, size) in enumerate(chunks):
        r, t = runs[ri], tasks[ti]
        ps = prompts[r.model, t][first:first + size]
        order = list(arms) if n % 2 == 0 else list(arms)[::-1]
        out = {arm: run_chunk(decoders[arm, r.label, t], ps) for arm in order}
        cell = got.setdefault((r.label, size), {"tokens": {k: [] for k in arms}, "wall": {k: [] for k in arms},
                                                "cpu": {k: [] for k in arms}, "differ": 0, "samples": 0})
        for arm in arms:
            cell["tokens"][arm].append(out[arm][0])
            cell["wall"][arm].append(out[arm][1])
            cell["cpu"][arm].append(out[arm][3])
        cell["differ"] += sum(x != y for x, y in zip(out["eager"][2], out["compiled"][2]))
        cell["samples"] += len(ps)
    recompiles = graphs_compiled() - graphs0
    kinds1, fallbacks = aot_kinds(compiled_bbs)

    rows = []
    for r in runs:
        for size in sizes:
            c = got[r.label, size]
            rate = {arm: sum(c["tokens"][arm]) / sum(c["wall"][arm]) for arm in arms}
            tok = c["tokens"]
            ratio = throughput_ratio(tok["eager"], c["wall"]["eager"], tok["compiled"], c["wall"]["compiled"])
            cpu = throughput_ratio(tok["eager"], c["cpu"]["eager"], tok["compiled"], c["cpu"]["compiled"])
            rows.append({"decoder": r.label, "batch_size": size, "samples": c["samples"], "ids_differ": c["differ"],
                         "eager_tokens_per_second": rate["eager"], "compiled_tokens_per_second": rate["compiled"],
                         "ratio": ratio.value, "ratio_low": ratio.low, "ratio_high": ratio.high,
                         "cpu_ratio": cpu.value, "cpu_ratio_low": cpu.low, "cpu_ratio_high": cpu.high})
    print("\n" + decode_table(rows), end="")
    print(f"\ngraphs compiled during the timed decodes (recompiles): {recompiles}")
    report = {"mode": a.mode, "limit": a.limit, "warm_up_s": warm_s, "graphs_at_warm_up": graphs0,
              "recompiles_timed": recompiles, "rows": rows}
    if a.mode == "aot":
        print(f"aot kinds loaded: {kinds0} in the warm-up, {kinds1 - kinds0} during the timed decodes; kinds run through "
              f"torch.compile instead: {fallbacks or 'none'}")
        report.update(aot_kinds_warm_up=kinds0, aot_kinds_timed=kinds1 - kinds0, aot_fallbacks=fallbacks)
    if not a.no_fit:
        clock = time.thread_time if a.fit_clock == "cpu" else time.perf_counter
        fits = {arm: fit(measure(bbs[arm, models[0]], repeats=a.repeats, clock=clock), device="cpu, 1 thread",
                         note=f"{models[0]}, {arm}, {a.fit_clock} clock") for arm in arms}
        print(f"\nforward cost model on {models[0]}, eager and compiled ({a.mode}):")
        print(fit_table(fits), end="")
        print("fit error (median, max): " + ", ".join(
            f"{arm} {100 * f.fit_error['median']:.1f}% / {100 * f.fit_error['max']:.1f}%" for arm, f in fits.items()))
        report["fits"] = {arm: f.as_dict() for arm, f in fits.items()}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "compile_bench.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
