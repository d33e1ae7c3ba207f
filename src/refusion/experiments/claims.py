"""The paper's claims as rules over an ablation's summary rows: pure functions, no files, no clock.

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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from refusion.experiments.records import sample_records
from refusion.experiments.tables import markdown

if TYPE_CHECKING:
    from refusion.experiments.stats import Interval

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
    by: dict[tuple[str, str], dict[int, Any]] = {}
    for r in sample_records(records):
        by.setdefault((r.run, r.task), {})[r.idx] = r
    for row in rows:
        if (row["run"], row["task"]) in by:
            samples = by[row["run"], row["task"]]
            row["per_sample"] = {i: bool(r.correct) for i, r in samples.items()}
            row["per_sample_speed"] = {i: (r.generated_tokens, r.decode_share_s()) for i, r in samples.items()}


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


def _versus(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool | None, bool | None, str]:
    """A against B, paired: (A faster, A at least as accurate; None where inconclusive, see :func:`faster`,
    :func:`as_accurate`) and the numbers."""
    verdicts = []
    for test in (faster, as_accurate):
        try:
            verdicts.append(test(a, b))
        except Inconclusive:
            verdicts.append(None)
    ratio, gap = speed_ratio(a, b), paired_gap(a, b)
    return verdicts[0], verdicts[1], f"{_ratio_text(ratio)} the tokens/s of {b['run']}, accuracy {_gap_text(gap)}"


def refusion_beats_speculative(runs: dict[str, dict]) -> Outcome:
    """ReFusion against every speculative row (``spec-*``): faster and at least as accurate than each, paired."""
    spec = sorted(label for label in runs if label.startswith("spec-"))
    if not spec:
        raise LookupError("speculative runs (spec-*)")
    judged = [(label, *_versus(runs["refusion"], runs[label])) for label in spec]
    why = "; ".join(f"{why} ({'faster' if fast else 'slower' if fast is False else 'speed inconclusive'}, "
                    f"{'as accurate' if acc else 'less accurate' if acc is False else 'accuracy inconclusive'})"
                    for _, fast, acc, why in judged)
    if any(fast is False or acc is False for _, fast, acc, _ in judged):
        return False, why
    if any(fast is None or acc is None for _, fast, acc, _ in judged):
        raise Inconclusive(why)
    return True, why


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
    Claim("speculative", "Not in the paper (its rivals are AR and diffusion decoders): speculative decoding is the "
          "lossless AR baseline a user would pick instead (n-gram, draft-model and diffusion drafters).",
          "ReFusion is faster than every speculative configuration and at least as accurate (paired)",
          refusion_beats_speculative, about_accuracy=False),
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
    from refusion.experiments.stats import paired_accuracy, throughput_ratio

    by = {(r.run, r.task, r.idx): r for r in sample_records(records)}
    body = []
    for task in sorted({t for (_, t, _) in by}):
        for before, after in zip(labels, labels[1:]):
            ids = sorted(i for (run, t, i) in by if run == before and t == task and (after, task, i) in by)
            if not ids:
                continue
            a, b = [by[before, task, i] for i in ids], [by[after, task, i] for i in ids]
            acc = paired_accuracy([r.correct for r in a], [r.correct for r in b])
            ratio = throughput_ratio([r.generated_tokens for r in a], [r.decode_share_s() for r in a],
                                     [r.generated_tokens for r in b], [r.decode_share_s() for r in b])
            tpf = [sum(r.generated_tokens for r in rs) / max(1, sum(r.nfe for r in rs)) for rs in (a, b)]
            d = acc.difference
            body.append([task, after, f"{100 * acc.accuracy_a:.1f} -> {100 * acc.accuracy_b:.1f}",
                         f"{100 * d.value:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]", f"{acc.p_value:.2g}",
                         f"{ratio.value:.2f}x [{ratio.low:.2f}, {ratio.high:.2f}]", f"{tpf[0]:.2f} -> {tpf[1]:.2f}"])
    return markdown(["task", "change", "acc before -> after %", "points [95%]", "McNemar p", "tokens/s ratio [95%]",
                     "TPF before -> after"], body).splitlines()


def versus_table(rows: Rows, records: list[Any], reference: str, prefix: str, lossless: str) -> list[str]:
    """Per task and run labelled ``prefix*``: its samples token-identical to run ``lossless``'s, and
    ``reference`` against it, paired (tokens/s ratio and accuracy difference with 95% intervals, each with
    its verdict by the page's rules). Markdown lines."""
    tokens = {(r.run, r.task, r.idx): r.token_ids for r in sample_records(records)}
    body = []
    for task, runs in sorted(_by_task(rows).items()):
        for label in sorted(r for r in runs if r.startswith(prefix)):
            ids = [i for (run, t, i) in tokens if run == label and t == task and (lossless, t, i) in tokens]
            same = sum(tokens[label, task, i] == tokens[lossless, task, i] for i in ids)
            if reference not in runs:
                continue
            fast, acc, _ = _versus(runs[reference], runs[label])
            ratio, gap = speed_ratio(runs[reference], runs[label]), paired_gap(runs[reference], runs[label])
            body.append([task, label, f"{same}/{len(ids)}", _ratio_text(ratio),
                         "faster" if fast else "slower" if fast is False else "inconclusive",
                         _gap_text(gap).removesuffix("]").replace(" points [", " [") + "]",
                         "as accurate" if acc else "less accurate" if acc is False else "inconclusive"])
    return markdown(["task", "run", f"token-identical to {lossless}", f"{reference}'s tokens/s over it [95%]", "speed",
                     f"{reference}'s accuracy minus it, points [95%]", "accuracy"], body).splitlines()
