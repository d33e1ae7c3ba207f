"""What batching can save: the cost of one forward per sequence against the batch size, and the cost model.

    .venv/bin/python scripts/forward_cost.py [--model tiny-refusion] [--cached 150] [--repeats 30]
        [--compile [MODE]] [--fit-repeats 7] [--warm-calls 6] [--clock wall|cpu] [--no-fit] [--json PATH]
    .venv/bin/python scripts/forward_cost.py --compile MODE --with-eager [--clock cpu] [--no-table]

For each number of tokens fed per sequence (1: an AR step; 16; 64: a wide ReFusion Stage I) and each
batch size (1, 4, 16), times one forward of ``[batch, fed]`` new tokens after ``--cached`` cached
tokens per sequence (a KV cache built once and cropped back after each call), and prints the median
milliseconds per sequence. Then fits the forward cost model (:mod:`refusion.experiments.costmodel`: a
fixed per-call cost per kind of forward, per token fed, per key attended over, per query-key pair, per
logits row) on its grid of shapes timed through the decoders' own caches, and prints the coefficients
and the fit's relative error (``--json``: the fitted model as JSON, for ``scripts/cost_model.py``'s
predictions). ``--compile``: the forwards run through ``torch.compile`` (``Backbone(compile=MODE)``).
``--clock cpu``: the fit's forwards are timed in this thread's CPU time (``time.thread_time``), which
other processes on a shared machine inflate less than wall time. ``--with-eager`` (with ``--compile``): the
same model also eager, in the same process, the two arms' rounds of the grid alternating (each round of
each arm after one untimed round of it), and both fits printed side by side with compiled / eager per term.
One torch thread, float32, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from refusion.experiments.costmodel import WARM_CALLS, FEATURES, fit, measure
from refusion.experiments.tables import markdown
from refusion.models.backend import Backbone
from refusion.models.loading import COMPILE_MODES


def per_sequence_ms(bb: Backbone, batch: int, fed: int, cached: int, repeats: int) -> float:
    cache = bb.new_cache().kv  # the transformers cache itself: a bare model call
    prefix = torch.randint(10, 500, (batch, cached))
    bb.forward(prefix, torch.arange(cached).expand(batch, cached), cache, logits_at=None)
    ids = torch.randint(10, 500, (batch, fed))
    pos = torch.arange(cached, cached + fed).expand(batch, fed)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        bb.forward(ids, pos, cache, keep_kv=False)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:]) / batch


def measure_pair(arms: dict[str, Backbone], repeats: int, clock, warm: int) -> dict[str, list]:
    """Each arm's grid (:func:`~refusion.experiments.costmodel.measure`), rounds alternating between the
    arms (which goes first alternating too); per arm the median seconds per shape over the rounds."""
    rounds: dict[str, list[list]] = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            rounds[arm].append(measure(arms[arm], repeats=1, clock=clock, warm=warm))
    out = {}
    for arm, rs in rounds.items():
        out[arm] = [replace(s0, seconds=statistics.median(r[i].seconds for r in rs)) for i, s0 in enumerate(rs[0])]
    return out


def pair_table(eager, compiled) -> str:
    """The two fits' coefficients side by side with compiled / eager (Markdown)."""
    body = []
    for name in FEATURES:
        e, c = eager.coef[name], compiled.coef[name]
        scale, unit = (1e3, "ms") if name.startswith("fixed") else (1e6, "us")
        body.append([name, f"{e * scale:.4g} {unit}", f"{c * scale:.4g} {unit}", f"{c / e:.2f}" if e else "-"])
    return markdown(["term", "eager", "compiled", "compiled / eager"], body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-refusion")
    p.add_argument("--cached", type=int, default=150)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE", choices=COMPILE_MODES)
    p.add_argument("--with-eager", action="store_true", help="with --compile: fit eager too, rounds interleaved")
    p.add_argument("--no-table", action="store_true", help="skip the per-sequence table")
    p.add_argument("--fit-repeats", type=int, default=7, help="timed rounds of the cost model's grid")
    p.add_argument("--warm-calls", type=int, default=WARM_CALLS,
                   help="untimed calls of each grid shape before its timed one (0: right after the previous shape)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="the fit's clock: wall or this thread's CPU time")
    p.add_argument("--no-fit", action="store_true", help="the per-sequence table only")
    p.add_argument("--json", type=Path, default=None, help="write the fitted cost model here")
    a = p.parse_args()
    if a.with_eager and a.compile is None:
        p.error("--with-eager: give --compile MODE, the arm fitted against eager")
    torch.set_num_threads(1)
    bb = Backbone.from_pretrained(a.model, compile=a.compile)
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.with_eager:
        eager = Backbone(bb.model, bb.tokenizer, mask_id=bb.mask_id, eos_ids=bb.eos_ids)
        timed = measure_pair({"eager": eager, "compiled": bb}, a.fit_repeats, clock, a.warm_calls)
        fits = {arm: fit(shapes, device="cpu, 1 thread", note=f"{a.model}, {arm}, {a.warm_calls} warm calls, {a.clock} clock")
                for arm, shapes in timed.items()}
        print(f"forward cost model, eager and compile {a.compile} interleaved ({a.model}, {a.fit_repeats} rounds, "
              f"{a.warm_calls} warm calls, {a.clock} clock; relative error of the fit, median / max: "
              + ", ".join(f"{arm} {100 * f.fit_error['median']:.1f}% / {100 * f.fit_error['max']:.1f}%" for arm, f in fits.items())
              + ")")
        print(pair_table(fits["eager"], fits["compiled"]), end="")
        if bb.aot is not None:
            print(f"aot calls per kind: {bb.aot.calls}; kinds run through torch.compile: {bb.aot.fallbacks or 'none'}")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({arm: f.as_dict() for arm, f in fits.items()}, indent=1))
        return 0
    sizes = (1, 4, 16)
    print(f"ms per sequence for one forward ({a.model}, {a.cached} cached tokens, 1 thread, median of {a.repeats})")
    print("| tokens fed per sequence | " + " | ".join(f"batch {b}" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for fed in (1, 16, 64) if not a.no_table else ():
        cells = [f"{per_sequence_ms(bb, b, fed, a.cached, a.repeats):.2f}" for b in sizes]
        print(f"| {fed} | " + " | ".join(cells) + " |")
    if a.no_fit:
        return 0
    model = fit(measure(bb, repeats=a.fit_repeats, clock=clock, warm=a.warm_calls), device="cpu, 1 thread",
                note=f"{a.model}, compile {a.compile}, {a.warm_calls} warm calls, {a.clock} clock")
    print(f"\nforward cost model ({model.note}; relative error of the fit: median "
          f"{100 * model.fit_error['median']:.1f}%, max {100 * model.fit_error['max']:.1f}%)")
    print(model.markdown(), end="")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(model.as_dict(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
