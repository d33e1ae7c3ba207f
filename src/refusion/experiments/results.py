"""``refusion results``: every shipped ablation in one run, and a results page written from it.

The page goes to ``OUT/results.md`` (``--doc PATH`` elsewhere); ``--write-docs`` rewrites the shipped
``docs/results.md``, so that a trial run never overwrites it by default.

Runs each ablation config of ``experiments/configs/ablations/`` with
the same engine as ``refusion ablate`` into ``OUT/<name>/`` (resumable: ``--resume`` skips finished
samples), times each, draws its plots next to the document and writes one markdown page: the command,
the machine, per ablation its table, figures, the paper's own finding beside it and a verdict. Each
section says when and on which machine it ran: ``--only`` reruns some analyses, and one with no results
in ``OUT`` keeps its section of the existing page, unless a checkpoint it decodes has changed since (then
it must be rerun too).

Verdicts are rules over the measured rows, never typed by hand, so a rerun rewrites them:

* ``holds``: the paper's claim is true of the numbers on every task measured;
* ``does not hold``: it is false on every task;
* ``mixed``: true on some tasks only (each task's outcome is listed);
* ``cannot be tested here``: a run the claim needs is missing (for example no model for the decoder),
  or every task is at chance or at the ceiling (below).

Accuracy is compared paired, on the samples both runs decoded (:mod:`refusion.experiments.stats`: the
95% paired-bootstrap interval of the difference). "A is at least as accurate as B" holds when the
interval's lower end is above -``MARGIN`` (5 points), and fails when its upper end is below 0 (A is
worse beyond doubt); "A and B agree" holds when the whole interval is within ``MARGIN`` of 0, and fails
when it lies wholly outside. Anything between is **inconclusive** on that task: the samples cannot
tell, and the task is listed as such and left out of the verdict. A claim about accuracy is not tested
on a task where every run of the ablation is at chance level (each run's accuracy at most the task's
``chance_accuracy`` plus two binomial standard errors of it, and at least 5 points): "0% and 0% agree"
says nothing about the decoder; nor does "100% and 100% agree" on a task where every run got every
sample right (the ceiling). Such tasks are listed as not testable and left out of the verdict.

Speed is compared the same way: "A is faster than B" holds when the 95% paired-bootstrap interval of A's
tokens/s over B's (from each sample's generated tokens and decode seconds) lies above 1, fails when it
lies below 1, and is inconclusive when it contains 1.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from refusion.core.machine import machine
from refusion.experiments.ablate import load_ablation, plot, run_ablation
from refusion.experiments.config_files import shipped_configs
from refusion.models.loading import RuntimeOptions, runtime_from_args

if TYPE_CHECKING:
    from refusion.experiments.stats import Interval

WALL_FILE = "wall.json"  # {"wall_s": the command's wall seconds, a resumed run's added}
ORDER = ("kv_cache", "scorers", "slot_threshold", "token_threshold", "slot_size", "serial_blocks", "frontier",
         "variants", "ladder")
STEPPED = ("ladder",)  # analyses whose runs are rungs: each run is compared with the one before it
Rows = list[dict[str, Any]]
Outcome = tuple[bool, str]  # (claim true on this task, the numbers that decided it)


MARGIN = 0.05  # accuracy points (as a fraction) within which two runs count as equally accurate


class NotTestable(Exception):
    """Raised by a claim's test when its runs are all there but cannot answer it on a task (message: why)."""


class AtChance(NotTestable):
    """Raised by a claim's test when the runs it compares are at chance on a task (message: the numbers)."""


class Inconclusive(NotTestable):
    """Raised by a claim's test when the paired interval it reads can neither confirm nor refute it."""


def paired_gap(a: dict[str, Any], b: dict[str, Any]) -> "Interval":
    """A's accuracy minus B's on the samples both decoded, with its 95% paired-bootstrap interval
    (:class:`~refusion.experiments.stats.Interval`). Rows carry their samples' correctness as
    ``per_sample`` (``idx -> bool``; :func:`attach_samples`)."""
    from refusion.experiments.stats import paired_accuracy

    if "per_sample" not in a or "per_sample" not in b:
        raise LookupError("per-sample results (samples.jsonl) of both runs")
    ids = sorted(set(a["per_sample"]) & set(b["per_sample"]))
    if not ids:
        raise LookupError(f"samples decoded by both {a['run']!r} and {b['run']!r}")
    return paired_accuracy([b["per_sample"][i] for i in ids], [a["per_sample"][i] for i in ids]).difference


def speed_ratio(a: dict[str, Any], b: dict[str, Any]) -> "Interval":
    """A's tokens/s over B's on the samples both decoded, with its 95% paired-bootstrap interval. Rows carry
    their samples' generated tokens and decode seconds as ``per_sample_speed`` (``idx -> (tokens, s)``;
    :func:`attach_samples`)."""
    from refusion.experiments.stats import throughput_ratio

    if "per_sample_speed" not in a or "per_sample_speed" not in b:
        raise LookupError("per-sample times (samples.jsonl) of both runs")
    ids = sorted(set(a["per_sample_speed"]) & set(b["per_sample_speed"]))
    (tok_a, s_a), (tok_b, s_b) = (zip(*(row["per_sample_speed"][i] for i in ids)) for row in (a, b))
    return throughput_ratio(tok_b, s_b, tok_a, s_a)


def faster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether A decodes more tokens/s than B (the paired interval of the ratio above 1; below 1: no);
    raises :class:`Inconclusive` when the interval contains 1."""
    ratio = speed_ratio(a, b)
    if ratio.low > 1:
        return True
    if ratio.high < 1:
        return False
    raise Inconclusive(f"{a['run']} vs {b['run']}: {_ratio_text(ratio)} the tokens/s, an interval that contains 1")


def _ratio_text(ratio) -> str:
    return f"{ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}]"


def _gap_text(gap) -> str:
    return f"{100 * gap.value:+.1f} points [{100 * gap.low:+.1f}, {100 * gap.high:+.1f}]"


def as_accurate(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether A is at least as accurate as B (non-inferiority within ``MARGIN``, paired); raises
    :class:`Inconclusive` when the interval allows both."""
    gap = paired_gap(a, b)
    if gap.low >= -MARGIN:
        return True
    if gap.high < 0:
        return False
    raise Inconclusive(f"{a['run']} vs {b['run']}: {_gap_text(gap)}, neither within {100 * MARGIN:g} points "
                       "nor below 0")


def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether A and B are equally accurate (equivalence within ``MARGIN``, paired); raises
    :class:`Inconclusive` when the interval straddles the margin."""
    gap = paired_gap(a, b)
    if -MARGIN <= gap.low and gap.high <= MARGIN:
        return True
    if gap.low > MARGIN or gap.high < -MARGIN:
        return False
    raise Inconclusive(f"{a['run']} vs {b['run']}: {_gap_text(gap)}, straddles +/-{100 * MARGIN:g} points")


def attach_samples(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Give each summary row ``per_sample`` (``idx -> correct``) and ``per_sample_speed`` (``idx ->
    (generated tokens, decode seconds)``) of its run's records on its task."""
    from refusion.experiments.runner import decode_share_s

    by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for r in records:
        by.setdefault((r["run"], r["task"]), {})[r["idx"]] = r
    for row in rows:
        if (row["run"], row["task"]) in by:
            samples = by[row["run"], row["task"]]
            row["per_sample"] = {i: bool(r["correct"]) for i, r in samples.items()}
            row["per_sample_speed"] = {i: (r["generated_tokens"], decode_share_s(r)) for i, r in samples.items()}


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def chance(task: str) -> float:
    """The accuracy of guessing on ``task`` (0 for a task this package does not know)."""
    from refusion.tasks import chance_accuracy

    return chance_accuracy(task)


def at_chance(task: str, runs: dict[str, dict[str, Any]]) -> bool:
    """Whether every run on ``task`` is within noise of guessing (see the module docstring)."""
    c = chance(task)
    return all(r["accuracy"] <= c + max(0.05, 2 * math.sqrt(c * (1 - c) / r["n"])) for r in runs.values())


def at_ceiling(runs: dict[str, dict[str, Any]]) -> bool:
    """Whether every run on a task got every sample right: a comparison of accuracies that cannot fail."""
    return all(r["accuracy"] >= 1.0 for r in runs.values())


def _by_task(rows: Rows) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["task"], {})[r["run"]] = r
    return out


# --------------------------------------------------------------------------------------------------
# per-task tests of the paper's claims: each returns (holds on this task, the deciding numbers)
# --------------------------------------------------------------------------------------------------
# (reuse, recompute) run pairs of kv_cache.yaml: at the shipped per-task settings, and at the reference's own
# settings (the yaml says which)
KV_PAIRS = (("shipped settings", "kv_concat", "kv_recompute"),
            ("reference settings", "kv_concat_ref", "kv_recompute_ref"))


def kv_reuse_faster_and_as_accurate(runs: dict[str, dict]) -> Outcome:
    """Judged on each pair of ``KV_PAIRS`` whose two runs made different forwards (the caches differ only
    when a Stage II-b round completes two or more slots at once): reuse faster and as accurate in each.
    The shipped-settings pair is required; the reference-settings pair counts when it was run."""
    judged: list[tuple[bool, str]] = []
    same: list[str] = []
    for name, a, b in KV_PAIRS:
        if name != KV_PAIRS[0][0] and a not in runs and b not in runs:
            continue
        c, r = runs[a], runs[b]
        if r["nfe_mean"] == c["nfe_mean"] and r["tpf"] == c["tpf"]:
            same.append(f"{name}: both caches made the same forwards (NFE {c['nfe_mean']:.2f})")
            continue
        ratio = speed_ratio(c, r)
        ok = as_accurate(c, r) and faster(c, r)
        judged.append((ok, f"{name}: reuse {ratio.value:.2f}x the tokens/s of recompute, accuracy "
                           f"{_pct(c['accuracy'])} vs {_pct(r['accuracy'])} ({_gap_text(paired_gap(c, r))}), "
                           f"NFE {c['nfe_mean']:.2f} vs {r['nfe_mean']:.2f}, speed ratio {_ratio_text(ratio)}"))
    if not judged:
        raise NotTestable("; ".join(same) + ": no Stage II-b round completed two or more slots at once, where "
                          "reuse and recompute differ")
    return all(ok for ok, _ in judged), "; ".join([why for _, why in judged] + same)


def scorers_comparable(runs: dict[str, dict]) -> Outcome:
    names = [n for n in ("first_token_prob", "mean_prob", "mean_neg_entropy") if n in runs]
    accs = {n: runs[n]["accuracy"] for n in names}
    hi = max(accs, key=accs.get)
    lo = min((n for n in names if n != hi), key=accs.get)  # two different scorers, also when all tie
    ok = agree(runs[hi], runs[lo])
    return ok, (", ".join(f"{n} {_pct(a)}" for n, a in accs.items())
                + f"; {hi} - {lo}: {_gap_text(paired_gap(runs[hi], runs[lo]))}")


def _swept(runs: dict[str, dict], key: str) -> list[dict]:
    return sorted((r for r in runs.values() if r.get(key) is not None), key=lambda r: r[key])


def higher_slot_threshold_more_accurate(runs: dict[str, dict]) -> Outcome:
    pts = _swept(runs, "selector.slot_threshold")
    lo, hi = pts[0], pts[-1]
    ok = as_accurate(hi, lo)
    return ok, (f"slot_threshold {lo['selector.slot_threshold']:g}: {_pct(lo['accuracy'])} (TPF {lo['tpf']:.2f}); "
                f"{hi['selector.slot_threshold']:g}: {_pct(hi['accuracy'])} (TPF {hi['tpf']:.2f}); "
                f"difference {_gap_text(paired_gap(hi, lo))}")


def higher_token_threshold_slower(runs: dict[str, dict]) -> Outcome:
    pts = _swept(runs, "verifier.token_threshold")
    lo, hi = pts[0], pts[-1]
    return hi["tpf"] < lo["tpf"], (f"token_threshold {lo['verifier.token_threshold']:g}: TPF {lo['tpf']:.2f}, "
                                   f"{_pct(lo['accuracy'])}; {hi['verifier.token_threshold']:g}: TPF {hi['tpf']:.2f}, "
                                   f"{_pct(hi['accuracy'])}")


def larger_slots_not_worse(runs: dict[str, dict]) -> Outcome:
    pts = _swept(runs, "slot_size")
    best_small = max((r for r in pts if r["slot_size"] <= 4), key=lambda r: r["accuracy"])
    big = [r for r in pts if r["slot_size"] >= 8]
    top = max(big, key=lambda r: (r["accuracy"], r["tpf"]))
    ok = top["tpf"] >= best_small["tpf"] and as_accurate(top, best_small)
    return ok, (f"best of k<=4: k={best_small['slot_size']} {_pct(best_small['accuracy'])} TPF {best_small['tpf']:.2f}; "
                f"best of k>=8: k={top['slot_size']} {_pct(top['accuracy'])} TPF {top['tpf']:.2f}")


def block_size_robust(runs: dict[str, dict]) -> Outcome:
    pts = _swept(runs, "serial_blocks")
    hi, lo = max(pts, key=lambda r: r["accuracy"]), min(pts, key=lambda r: r["accuracy"])
    ok = agree(hi, lo)
    return ok, f"most - least accurate {_gap_text(paired_gap(hi, lo))}: " + ", ".join(
        f"{r['serial_blocks']} block{'s' * (r['serial_blocks'] != 1)} {_pct(r['accuracy'])} (TPF {r['tpf']:.2f})"
        for r in pts)


def _drop(runs: dict[str, dict], decoder: str) -> tuple[float, float, str] | None:
    """Accuracy lost per unit of TPF gained from the slowest to the fastest setting of ``decoder``; None
    without two settings; :class:`NotTestable` when its settings all decode at the same TPF."""
    pts = sorted((r for r in runs.values() if r["decoder"] == decoder), key=lambda r: r["tpf"])
    if len(pts) < 2:
        return None
    if pts[-1]["tpf"] <= pts[0]["tpf"]:
        raise NotTestable(f"every {decoder} setting decodes at TPF {pts[0]['tpf']:.2f}: no TPF range to lose "
                          "accuracy over")
    lo, hi = pts[0], pts[-1]
    slope = (lo["accuracy"] - hi["accuracy"]) / (hi["tpf"] - lo["tpf"])
    return slope, hi["accuracy"], f"{decoder} TPF {lo['tpf']:.2f}->{hi['tpf']:.2f}: {_pct(lo['accuracy'])}->{_pct(hi['accuracy'])}"


def refusion_flatter_than_llada(runs: dict[str, dict]) -> Outcome:
    ref, lla = _drop(runs, "refusion"), _drop(runs, "llada")
    if ref is None or lla is None:
        raise LookupError("needs at least two refusion and two llada settings")
    task = next(iter(runs.values()))["task"]
    for decoder in ("refusion", "llada"):  # a decoder at chance at every TPF has no accuracy to lose
        if at_chance(task, {k: r for k, r in runs.items() if r["decoder"] == decoder}):
            raise AtChance(f"every {decoder} setting at chance; {ref[2]}; {lla[2]}")
    return ref[0] < lla[0], f"{ref[2]}; {lla[2]}"


def any_order_faster_than_left_to_right(runs: dict[str, dict]) -> Outcome:
    p, l2r = runs["plain"], runs["left_to_right"]
    ratio = speed_ratio(p, l2r)
    ok = as_accurate(p, l2r) and faster(p, l2r)
    return ok, (f"any-order {_ratio_text(ratio)} the tokens/s of left-to-right, accuracy {_pct(p['accuracy'])} vs "
                f"{_pct(l2r['accuracy'])} ({_gap_text(paired_gap(p, l2r))})")


@dataclass(frozen=True)
class Claim:
    ablation: str
    paper: str  # what the paper reports, with its numbers
    claim: str  # the statement tested here
    test: Callable[[dict[str, dict]], Outcome]
    about_accuracy: bool = True  # False: the claim is about speed only, testable at any accuracy


CLAIMS = (
    Claim("kv_cache", "Table 8 (App. C.3): KV reuse is 1.16-1.33x faster than recomputing the KV for full "
          "context, with stable and on several benchmarks slightly better accuracy.",
          "kv_concat is faster than kv_recompute and as accurate", kv_reuse_faster_and_as_accurate),
    Claim("scorers", "Table 7 (App. C.2): first-token probability, mean slot probability and mean slot entropy "
          "give highly comparable performance; first-token is the default as the cheapest.",
          "the three scorers' accuracies agree within 5 points (paired)", scorers_comparable),
    Claim("slot_threshold", "Figure 4 (§5.4): a higher slot threshold improves performance; its effect on "
          "throughput is non-monotonic; sweet spot 0.5-1.0.",
          "the highest slot threshold is at least as accurate as the lowest", higher_slot_threshold_more_accurate),
    Claim("token_threshold", "Figure 4 (§5.4): a higher token threshold lowers throughput; sweet spot 0.1-0.9.",
          "the highest token threshold has a lower TPF than the lowest", higher_token_threshold_slower,
          about_accuracy=False),
    Claim("slot_size", "Figure 4 (§5.4): a larger slot size can improve both performance and speed; sweet spot "
          "k in {8, 32}.",
          "the best slot size >= 8 is as accurate and at least as parallel as the best <= 4", larger_slots_not_worse),
    Claim("serial_blocks", "App. C.7 / Figure 9: block sizes 32-128 are a sweet spot; from 32 to 512 pass@1 "
          "drops only ~0.2% relative to its peak.",
          "accuracy agrees within 5 points (paired) across serial block counts", block_size_robust),
    Claim("frontier", "Figure 7 (App. C.4): as tokens per forward grow, LLaDA's and Dream's accuracy falls "
          "sharply while ReFusion's curve is much flatter.",
          "ReFusion loses less accuracy per unit of TPF gained than the LLaDA-style decoder",
          refusion_flatter_than_llada),
    Claim("variants", "Figure 1: ReFusion with any-order slots is faster than the same model forced left to "
          "right. (Sub-slot remasking, adaptive split, fused scheduling and joined II-b rows are ours; the paper has no numbers.)",
          "any-order slots are faster than left-to-right and as accurate", any_order_faster_than_left_to_right),
)


def verdict(claim: Claim, rows: Rows) -> tuple[str, list[str]]:
    """``(verdict, per-task lines)`` of ``claim`` over an ablation's summary rows."""
    outcomes: list[tuple[str, bool, str]] = []
    lines: list[str] = []
    for task, runs in sorted(_by_task(rows).items()):
        try:
            ok, why = claim.test(runs)
        except Inconclusive as e:
            ok, why = None, str(e)
        except NotTestable as e:
            lines.append(f"{task}: not testable, {e}")
            continue
        except (KeyError, LookupError, ValueError, ZeroDivisionError) as e:
            return "cannot be tested here", [f"{task}: missing {e}"]
        if claim.about_accuracy and at_ceiling(runs):
            lines.append(f"{task}: not testable, every run at the ceiling (100%: no run could have been less "
                         f"accurate than another; {why})")
            continue
        if claim.about_accuracy and at_chance(task, runs):
            best = max(r["accuracy"] for r in runs.values())
            lines.append(f"{task}: not testable, every run at chance (best {_pct(best)}, chance "
                         f"{_pct(chance(task))}; {why})")
            continue
        if ok is None:
            lines.append(f"{task}: inconclusive, {why}")
            continue
        outcomes.append((task, ok, why))
        lines.append(f"{task}: {'yes' if ok else 'no'} ({why})")
    if not outcomes:
        return "cannot be tested here", lines or ["no results"]
    n_ok = sum(ok for _, ok, _ in outcomes)
    word = "holds" if n_ok == len(outcomes) else "does not hold" if n_ok == 0 else "mixed"
    return word, lines


def step_table(records: list[dict[str, Any]], labels: list[str]) -> list[str]:
    """What each run buys over the run before it (the rungs of a ladder, in ``labels`` order), per task, on
    the samples both decoded: accuracy difference in points and tokens/s ratio, each with its 95%
    paired-bootstrap interval, McNemar's p, and the TPF of both. Markdown lines."""
    from refusion.experiments.runner import decode_share_s
    from refusion.experiments.stats import paired_accuracy, throughput_ratio

    by = {(r["run"], r["task"], r["idx"]): r for r in records}
    lines = ["| task | change | acc before -> after % | points [95%] | McNemar p | tokens/s ratio [95%] | TPF before -> after |",
             "|---|---|---|---|---|---|---|"]
    for task in sorted({r["task"] for r in records}):
        for before, after in zip(labels, labels[1:]):
            ids = sorted(i for (run, t, i) in by if run == before and t == task and (after, task, i) in by)
            if not ids:
                continue
            a, b = [by[before, task, i] for i in ids], [by[after, task, i] for i in ids]
            acc = paired_accuracy([r["correct"] for r in a], [r["correct"] for r in b])
            ratio = throughput_ratio([r["generated_tokens"] for r in a], [decode_share_s(r) for r in a],
                                     [r["generated_tokens"] for r in b], [decode_share_s(r) for r in b])
            tpf = [sum(r["generated_tokens"] for r in rs) / max(1, sum(r["nfe"] for r in rs)) for rs in (a, b)]
            d = acc.difference
            lines.append(f"| {task} | {after} | {100 * acc.accuracy_a:.1f} -> {100 * acc.accuracy_b:.1f} | "
                         f"{100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {acc.p_value:.2g} | "
                         f"{ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}] | {tpf[0]:.2f} -> {tpf[1]:.2f} |")
    return lines


def shipped_models() -> str:
    """``name (sha256 prefix of its weights), ...`` for the shipped checkpoints: which models a page describes."""
    import hashlib

    from refusion.models.loading import resolve_model_path, shipped_checkpoints

    out = []
    for name in shipped_checkpoints():
        weights = resolve_model_path(name) / "model.safetensors"
        out.append(f"`{name}` {hashlib.sha256(weights.read_bytes()).hexdigest()[:10]}")
    return ", ".join(out)


MODEL_HASH = re.compile(r"`([\w.-]+)` ([0-9a-f]{10})")


@dataclass
class KeptSection:
    """An analysis's section of an existing page, kept when a run writes the page without its results."""

    summary_row: str  # its row of the page's summary table
    text: str  # from its anchor to the next section's
    minutes: float  # its decode time


def kept_sections(doc: Path, wanted: list[str], models_used: Callable[[str], list[str]]) -> dict[str, KeptSection]:
    """The sections of the analyses ``wanted`` on the page at ``doc`` (those it has), by analysis name, each
    with its "Ran <date> on <machine>" line (a section from before sections carried one gets the page
    header's date and machine). ``models_used(name)`` names the checkpoints an analysis decodes with: a
    section whose checkpoints' weights changed since the page was written is stale and raises
    ``RuntimeError`` (rerun it with ``--only``)."""
    if not doc.is_file():
        return {}
    text = doc.read_text()
    head, _, body = text.partition('<a id="')
    written = re.search(r"^- Written (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", head, re.M)
    machine_line = re.search(r"^- Machine: (.+)$", head, re.M)
    page_machine = machine_line.group(1) if machine_line else "an unrecorded machine."
    models_line = re.search(r"^- Written .*$", head, re.M)
    page_hashes = dict(MODEL_HASH.findall(models_line.group(0))) if models_line else {}
    now_hashes = dict(MODEL_HASH.findall(shipped_models()))
    kept = {}
    for chunk in ('<a id="' + body).split('<a id="')[1:]:
        name = chunk.split('"', 1)[0]
        if name not in wanted:
            continue
        section = '<a id="' + chunk.rstrip("\n") + "\n"  # as write_document joins it: one newline at its end
        row = next((line for line in head.splitlines() if f"](#{name})" in line), None)
        if row is None:
            continue
        changed = [m for m in models_used(name) if m in page_hashes and page_hashes[m] != now_hashes.get(m)]
        if changed:
            raise RuntimeError(f"{doc}: section {name!r} decoded {', '.join(changed)} with weights that have changed "
                               f"since; rerun it (--only {name})")
        if not re.search(r"^Ran \d{4}-", section, re.M):
            command_line = re.search(r"^`refusion ablate .*$", section, re.M)
            ran = f"Ran {written.group(1) if written else 'at an unrecorded time'} on {page_machine}"
            section = section[:command_line.end()] + "\n\n" + ran + section[command_line.end():]
        minutes = float(re.search(r"\| ([\d.]+) min \|$", row).group(1))
        kept[name] = KeptSection(summary_row=row, text=section, minutes=minutes)
    return kept


def models_used(name: str) -> list[str]:
    """The checkpoints the shipped ablation ``name`` decodes with."""
    from refusion.experiments.ablate import build_runs

    return sorted({run.model for run in build_runs(load_ablation(name + ".yaml"))})


def write_document(out: Path, doc: Path, names: list[str], command: str, jobs: int = 1,
                   kept: dict[str, KeptSection] | None = None) -> str:
    """Write ``doc`` from ``OUT/<name>/results.json``, ``samples.jsonl`` and plots; return its text. An
    analysis's time is its decode time: the wall seconds of its samples' decodes, summed (a resumed or
    interrupted run counts every sample once; model loading and plots are not counted). An analysis in
    ``kept`` (from :func:`kept_sections`) keeps its section and summary row as they were."""
    import torch

    from refusion.experiments.records import load_records
    from refusion.experiments.runner import markdown_table

    fig_dir = doc.parent / doc.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    claims = {c.ablation: c for c in CLAIMS}
    sections, summary = [], []
    total_seconds = 0.0
    kept = kept or {}
    now = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    run_note = f"{machine()}." + (f" The ablations ran in {jobs} one-thread worker processes at once, sharing the "
                                  "machine." if jobs > 1 else
                                  " The ablations ran one after another in one process "
                                  f"({torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() > 1 else ''}).")
    for name in names:
        if name in kept:
            summary.append(kept[name].summary_row)
            sections.append(kept[name].text)
            continue
        rows = json.loads((out / name / "results.json").read_text())
        finished = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime((out / name / "results.json").stat().st_mtime))
        records = load_records(out / name / "samples.jsonl")
        attach_samples(rows, records)
        minutes = sum(float(r.get("wall_s", 0.0)) for r in records) / 60
        total_seconds += 60 * minutes
        cfg = load_ablation(name + ".yaml")
        claim = claims.get(name)
        word, why = verdict(claim, rows) if claim else ("(no claim)", [])
        untestable = [line for line in why if ": not testable" in line or ": inconclusive" in line]
        untested = [line.split(":")[0] for line in untestable]
        tested = [line.split(":")[0] for line in why if line not in untestable]
        reason = ("at chance" if all("at chance" in line for line in untestable) else
                  "at the ceiling" if all("ceiling" in line for line in untestable) else
                  "inconclusive" if all(": inconclusive" in line for line in untestable) else
                  "not testable or inconclusive")
        scope = f" (tested on {', '.join(tested)}; {reason} on {', '.join(untested)})" if tested and untested else ""
        summary.append(f"| [{cfg.title or name}](#{name}) | {claim.paper.split(':')[0] if claim else ''} | "
                       f"**{word}**{scope} | {minutes:.1f} min |")
        extra = list(cfg.grid.axes) if cfg.grid else []
        sec = [f'<a id="{name}"></a>', f"## {cfg.title or name}", "",
               f"`refusion ablate {name}.yaml` ({cfg.split} split, {rows[0]['n'] if rows else 0} samples per task"
               f"{f', speed-up over `{cfg.baseline}`' if cfg.baseline else ''}; {minutes:.1f} min of decoding).", "",
               f"Ran {finished} on {run_note}", ""]
        if claim:
            sec += [f"**Paper.** {claim.paper}", "", f"**Tested here.** {claim.claim}: **{word}**.", ""]
            sec += [f"- {w}" for w in why] + [""]
        sec += [markdown_table(rows, extra), ""]
        if name in STEPPED:
            labels = [r.label for r in cfg.runs if r.label != cfg.baseline]
            sec += ["What each change buys: each row against the row before it, on the same samples.", "",
                    *step_table(load_records(out / name / "samples.jsonl"), labels), ""]
        for i, spec in enumerate(cfg.plots if rows else []):  # drawn again from the rows, as `ablate` draws them
            png = plot(rows, spec, fig_dir, f"{name}_{i}")[0]
            sec += [f"![{png.stem}]({fig_dir.name}/{png.name})", ""]
        sections.append("\n".join(sec))
    wall_file = out / WALL_FILE
    wall = (f"; the command took {json.loads(wall_file.read_text())['wall_s'] / 60:.0f} min of wall time"
            + (f" with {jobs} workers at once" if jobs > 1 else "") + ", model loading included"
            if wall_file.is_file() else "")
    kept_names = [n for n in names if n in kept]
    kept_minutes = sum(kept[n].minutes for n in kept_names)
    decode_time = (
        f"- Decode time: the wall seconds of an analysis's decodes, summed (model loading and plots not counted; "
        f"a resumed run counts each sample once). " + (
            f"This page's decodes took {total_seconds / 60:.0f} min{wall}." if not kept_names else
            f"This page's decodes took {(total_seconds / 60 + kept_minutes):.0f} min: {total_seconds / 60:.0f} min "
            f"in this run{wall}, {kept_minutes:.0f} min in the earlier runs that wrote the kept sections."))
    kept_note = (f" The sections kept from an earlier run of this page ({', '.join(kept_names)}) name their own "
                 "date and machine." if kept_names else "")
    lines = ["# Results: the paper's analyses on the tiny models", "",
             f"Generated by `{command}` (`src/refusion/experiments/results.py`); do not edit by hand.", "",
             f"- Machine: {run_note}{kept_note}",
             decode_time,
             f"- Written {now}{' (each section gives the date its analysis ran)' if kept_names else ''}; "
             "models: the shipped checkpoints "
             f"({shipped_models()}); split: test; decoder settings: `configs/bench.yaml` plus each run's overrides.",
             "- Accuracies are compared paired, on the samples both runs decoded, by the 95% paired-bootstrap "
             "interval of their difference: \"at least as accurate\" holds when its lower end is above -5 points "
             "and fails when its upper end is below 0; \"agree\" holds when it lies within 5 points of 0 and "
             "fails when it lies wholly outside; a task where the interval allows both is inconclusive and left "
             "out of the verdict. Speeds are tokens/s measured side by side in one run (samples interleaved); "
             "\"faster\" holds when the 95% paired-bootstrap interval of the tokens/s ratio lies above 1 and "
             "fails when it lies below 1, and a task where it contains 1 is inconclusive. "
             "TPF = generated tokens / forward calls.",
             "- A claim about accuracy is not tested on a task where every run is at chance (arith and code: "
             "at most 5%; facts: within two standard errors of 25%) or every run is at the ceiling (100%): "
             "there the data could not have said otherwise, so such tasks are listed as not testable and "
             "the verdict is over the others.",
             "- Where an ablation has a baseline run, each row also gives its accuracy difference from the "
             "baseline on the same samples and its speed-up, each with a 95% paired-bootstrap interval "
             "(`refusion.experiments.stats`).", "",
             "| analysis | paper | verdict | decode time |", "|---|---|---|---|"]
    text = "\n".join(lines + summary + [""] + sections)
    doc.write_text(text)
    return text


def ablation_command(name: str, out: Path, limit: int | None, resume: bool,
                     runtime: RuntimeOptions | None = None, rerun_changed: bool = False) -> list[str]:
    """The worker command that runs one ablation into ``out`` (:func:`run_ablation` with these settings, written
    to ``OUT/call.json``: :func:`refusion.core.workers.call_command`), in one torch thread."""
    from refusion.core.workers import call_command

    return call_command(Path(out) / "call.json", run_ablation, {
        "config": name + ".yaml", "out": Path(out), "resume": resume, "limit": limit, "runtime": runtime,
        "rerun_changed": rerun_changed})


def decode_count(name: str, limit: int | None = None) -> int:
    """Decodes the shipped ablation ``name`` runs: (runs + grid points) x samples over its tasks (``limit``,
    else the file's, else each task's whole split). The workers start the ablations in descending order of
    it (longest first), so the last to start are short and the workers finish close together."""
    from refusion.tasks import get_task

    cfg = load_ablation(f"{name}.yaml")
    grid_points = math.prod(len(values) for values in cfg.grid.axes.values()) if cfg.grid else 0
    per_task = limit or cfg.limit
    samples = sum(min(per_task or math.inf, get_task(t).sizes[cfg.split]) for t in cfg.tasks)
    return int((len(cfg.runs) + grid_points) * samples)


def _run_workers(names: list[str], out: Path, limit: int | None, resume: bool, runtime: RuntimeOptions | None,
                 jobs: int, timings: dict[str, float], timing_file: Path, rerun_changed: bool = False) -> None:
    """Run the ablations in ``jobs`` one-thread ``refusion ablate`` processes, longest first (``decode_count``),
    each logging to ``OUT/<name>/run.log``; record each one's wall time as it finishes."""
    from refusion.core.workers import Finished, Job, run_jobs

    def record(f: Finished) -> None:
        timings[f.name] = timings.get(f.name, 0.0) + f.wall_s
        timing_file.write_text(json.dumps(timings, indent=1))
        print(f"[results] {f.name}: {'done' if f.returncode == 0 else f'FAILED (exit {f.returncode})'} in "
              f"{f.wall_s / 60:.1f} min (log: {f.log})", flush=True)

    work = [Job(n, ablation_command(n, out / n, limit, resume, runtime, rerun_changed=rerun_changed),
                out / n / "run.log")
            for n in sorted(names, key=lambda n: -decode_count(n, limit))]
    failed = [f.name for f in run_jobs(work, jobs, record) if f.returncode]
    if failed:
        raise RuntimeError(f"ablations failed: {failed}; see their run.log; rerun with --resume to continue")


def run_all(out: Path, doc: Path, names: list[str] | None = None, limit: int | None = None, resume: bool = False,
            runtime: RuntimeOptions | None = None, command: str = "refusion results", jobs: int = 1,
            run: bool = True, rerun_changed: bool = False) -> str:
    """Run the ablations ``names`` (default all; in this process, or in ``jobs`` worker processes) and write
    ``doc`` from every ablation with results in ``OUT`` and, for the others, the existing page's sections
    (so ``--only`` reruns some and keeps the rest); with ``run=False`` only rewrite ``doc`` from ``OUT`` (after
    a change to the verdict rules).
    Run times live in ``OUT/timings.json`` (per ablation) and ``OUT/wall.json`` (the whole command): a resumed
    run adds to them, a fresh one replaces them. A run writes ``OUT/manifest.json`` (the command, machine,
    packages, threads; each ablation's folder has its own with its runs' configs); ``resume`` and
    ``rerun_changed`` act in each ablation's folder as in ``refusion ablate``."""
    from refusion.experiments.manifest import build_manifest, write_manifest

    everything = [n for n in ORDER if n in shipped_configs("ablations")]
    names = names or everything
    timing_file = out / "timings.json"
    timings: dict[str, float] = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    if run and not resume:
        for name in names:
            timings.pop(name, None)
    if not run:
        missing = [n for n in names if not (out / n / "results.json").is_file()]
        if missing:
            raise RuntimeError(f"--doc-only: no results.json for {missing} in {out}; run them first")
    documented, kept = _documented(out, doc, names, everything)  # a stale kept section fails before the run
    if not run:
        return write_document(out, doc, documented, command, jobs, kept)
    resume = resume or rerun_changed
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, build_manifest("results", inputs={"ablations": names, "limit": limit, "jobs": jobs,
                                                          "doc": str(doc), "runtime": (runtime.model_dump() if runtime
                                                                                       else None)}))
    started = time.perf_counter()
    if jobs > 1:
        _run_workers(names, out, limit, resume, runtime, jobs, timings, timing_file, rerun_changed)
    else:
        for name in names:
            t0 = time.perf_counter()
            run_ablation(name + ".yaml", out / name, resume=resume, limit=limit, runtime=runtime,
                         rerun_changed=rerun_changed)
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0  # a resumed run adds its share
            timing_file.write_text(json.dumps(timings, indent=1))
    wall_file = out / WALL_FILE
    earlier_s = json.loads(wall_file.read_text())["wall_s"] if resume and wall_file.is_file() else 0.0
    wall_file.write_text(json.dumps({"wall_s": earlier_s + time.perf_counter() - started}))
    return write_document(out, doc, documented, command, jobs, kept)


def _documented(out: Path, doc: Path, names: list[str], everything: list[str]) -> tuple[list[str], dict]:
    """The analyses the page shows: those run now or with results in ``OUT``, and the sections of the
    existing page for the rest (kept as they were)."""
    with_results = [n for n in everything if n in names or (out / n / "results.json").is_file()]
    kept = kept_sections(doc, [n for n in everything if n not in with_results], models_used)
    return [n for n in everything if n in with_results or n in kept], kept


DOCS_PAGE = Path("docs/results.md")  # the shipped page, rewritten only with --write-docs


def add_results_command(sub) -> None:
    from refusion.experiments.args import add_machine_args, add_output_args, add_resume_args

    p = sub.add_parser("results", help="run every shipped ablation and write the results page from it "
                                       "(OUT/results.md; --write-docs: docs/results.md)")
    add_output_args(p, "runs/results", "one subfolder per ablation, manifest.json, and results.md unless --doc or "
                                       "--write-docs", None, "for every ablation; default: each file's limit")
    p.add_argument("--doc", default=None, help="the markdown page to write, figures beside it (default OUT/results.md)")
    p.add_argument("--write-docs", action="store_true",
                   help=f"write the shipped page, {DOCS_PAGE}, instead of OUT/results.md (run from the repository root)")
    p.add_argument("--only", help="comma-separated ablation names (default: all of " + ", ".join(ORDER) + ")")
    add_resume_args(p)
    p.add_argument("--doc-only", action="store_true",
                   help="run nothing: rewrite the page from the results already in --out (give the run's --limit/--jobs)")
    add_machine_args(p, device_help="cpu, cuda or cuda:N (default cpu)",
                     jobs_help="run the ablations in this many one-thread worker processes (2 on a 2-core machine)")
    p.set_defaults(func=cmd_results)


def cmd_results(a) -> int:
    from refusion.core.config import ConfigError
    from refusion.core.threads import set_threads

    names = a.only.split(",") if a.only else None
    unknown = [n for n in names or [] if n not in ORDER]
    if unknown:
        raise ConfigError(f"--only: unknown ablation(s) {unknown}; allowed: {', '.join(ORDER)}")
    if a.jobs < 1:
        raise ConfigError(f"--jobs: must be at least 1, got {a.jobs}")
    if a.doc and a.write_docs:
        raise ConfigError(f"--doc {a.doc} and --write-docs name two pages; give one of them")
    set_threads(a.threads)
    doc = DOCS_PAGE if a.write_docs else Path(a.doc) if a.doc else Path(a.out) / "results.md"
    command = ("refusion results" + (" --write-docs" if a.write_docs else "") + (f" --limit {a.limit}" if a.limit else "")
               + (f" --only {a.only}" if a.only else "") + (f" --jobs {a.jobs}" if a.jobs > 1 else ""))
    runtime = runtime_from_args(a)
    if not a.doc_only:
        runtime.resolve()  # an unavailable flag fails here, not in every worker
    try:
        run_all(Path(a.out), doc, names, a.limit, a.resume, runtime, command, a.jobs, run=not a.doc_only,
                rerun_changed=a.rerun_changed)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {doc} (figures in {doc.parent / doc.stem}/) from {a.out}")
    return 0
