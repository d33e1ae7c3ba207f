"""The results page (``refusion results``): Markdown written from the ablations' outputs, and the sections it keeps.

:func:`write_document` renders the page from ``OUT/<name>/results.json``, ``samples.jsonl`` and the plots:
its prose lives in Markdown fragments (``templates/results_*.md``, filled with :meth:`str.format`), its
verdicts come from :mod:`refusion.experiments.claims`. Each section says when and on which machine it ran;
an analysis with no results in ``OUT`` keeps its section of the existing page (:func:`kept_sections`),
unless a checkpoint it decodes has changed since.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from refusion.core.machine import machine
from refusion.experiments.ablate import load_ablation, plot
from refusion.experiments.claims import CLAIMS, attach_samples, step_table, verdict, versus_table

WALL_FILE = "wall.json"  # {"wall_s": the command's wall seconds, a resumed run's added}
STEPPED = ("ladder",)  # analyses whose runs are rungs: each run is compared with the one before it
#: analyses whose section adds a table of paired verdicts: the reference run against each run whose label
#: starts with the prefix, and each of those runs' token identity with the lossless-against run
VERSUS = {"speculative": ("refusion", "spec-", "ar")}
TEMPLATES = Path(__file__).parent / "templates"


def fragment(name: str) -> str:
    """The Markdown fragment ``templates/NAME`` (its prose), less its final newline."""
    return (TEMPLATES / name).read_text(encoding="utf-8").removesuffix("\n")


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
    entry: dict | None = None  # its entry of the index (None: read from a page written without one)


INDEX = "index.json"  # OUT/index.json: per section of the page, what wrote it (:func:`section_entry`)


def section_entry(date: str, machine_note: str, weights: dict[str, str | None], minutes: float, summary_row: str,
                  text: str) -> dict:
    """An analysis's entry of ``OUT/index.json``: when (``date``, UTC) and where (``machine``) it ran, the
    weights hash of each checkpoint it decoded (sha256 prefix, as the page names them; None for a model that
    is not shipped), its decode ``minutes``, and its ``summary_row`` and section ``text`` as the page shows them."""
    return {"date": date, "machine": machine_note, "weights": weights, "minutes": minutes, "summary_row": summary_row,
            "text": text}


def read_index(out: Path) -> dict[str, dict]:
    """Analysis name -> its entry in ``OUT/index.json`` ({} without one)."""
    path = Path(out) / INDEX
    return json.loads(path.read_text())["sections"] if path.is_file() else {}


def indexed_sections(out: Path, wanted: list[str], models_used: Callable[[str], list[str]]) -> dict[str, KeptSection]:
    """The sections of the analyses ``wanted`` that ``OUT/index.json`` holds; one whose checkpoints' weights
    changed since raises ``RuntimeError`` (rerun it with ``--only``)."""
    now = dict(MODEL_HASH.findall(shipped_models()))
    kept = {}
    for name, entry in read_index(out).items():
        if name not in wanted:
            continue
        changed = [m for m in models_used(name) if entry["weights"].get(m) not in (None, now.get(m))]
        if changed:
            raise RuntimeError(f"{Path(out) / INDEX}: section {name!r} decoded {', '.join(changed)} with weights that "
                               f"have changed since; rerun it (--only {name})")
        kept[name] = KeptSection(entry["summary_row"], entry["text"], entry["minutes"], entry)
    return kept


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
    """The checkpoints the shipped ablation ``name`` decodes with (a speculative run's drafter included)."""
    from refusion.experiments.ablate import build_runs

    used = set()
    for run in build_runs(load_ablation(name + ".yaml")):
        used.add(run.model)
        used.update(c["proposer"]["model"] for c in run.configs.values()
                    if isinstance(c.get("proposer"), dict) and c["proposer"].get("model"))
    return sorted(used)


def write_document(out: Path, doc: Path, names: list[str], command: str, jobs: int = 1,
                   kept: dict[str, KeptSection] | None = None) -> str:
    """Write ``doc`` from ``OUT/<name>/results.json``, ``samples.jsonl`` and plots; return its text. An
    analysis's time is its decode time: the wall seconds of its samples' decodes, summed (a resumed or
    interrupted run counts every sample once; model loading and plots are not counted). An analysis in
    ``kept`` (from :func:`kept_sections`) keeps its section and summary row as they were."""
    import torch

    from refusion.experiments.records import load_records, sample_records
    from refusion.experiments.runner import markdown_table

    fig_dir = doc.parent / doc.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    claims = {c.ablation: c for c in CLAIMS}
    sections, summary = [], []
    total_seconds = 0.0
    kept = kept or {}
    now = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    models = shipped_models()
    hashes = dict(MODEL_HASH.findall(models))
    index: dict[str, dict] = {}
    run_note = f"{machine()}." + (f" The ablations ran in {jobs} one-thread worker processes at once, sharing the "
                                  "machine." if jobs > 1 else
                                  " The ablations ran one after another in one process "
                                  f"({torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() > 1 else ''}).")
    for name in names:
        if name in kept:
            summary.append(kept[name].summary_row)
            sections.append(kept[name].text)
            if kept[name].entry is not None:
                index[name] = kept[name].entry
            continue
        rows = json.loads((out / name / "results.json").read_text())
        finished = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime((out / name / "results.json").stat().st_mtime))
        records = sample_records(load_records(out / name / "samples.jsonl"))
        attach_samples(rows, records)
        minutes = sum(r.wall_s for r in records) / 60
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
               f"`refusion ablate {name}.yaml` ({cfg.split} split, {rows[0]['n'] // rows[0].get('seeds', 1) if rows else 0} "
               f"samples per task{f' x {cfg.seeds} seeds' if cfg.seeds > 1 else ''}"
               f"{f', speed-up over `{cfg.baseline}`' if cfg.baseline else ''}; {minutes:.1f} min of decoding).", "",
               f"Ran {finished} on {run_note}", ""]
        if claim:
            sec += [f"**Paper.** {claim.paper}", "", f"**Tested here.** {claim.claim}: **{word}**.", ""]
            sec += [f"- {w}" for w in why] + [""]
        sec += [markdown_table(rows, extra), ""]
        if name in STEPPED:
            labels = [r.label for r in cfg.runs if r.label != cfg.baseline]
            sec += [fragment("results_steps.md"), "",
                    *step_table(records, labels), ""]
        if name in VERSUS:
            reference, prefix, lossless = VERSUS[name]
            sec += [f"Paired verdicts, `{reference}` against each `{prefix}*` run on the same samples (the "
                    f"page's rules), and each run's samples token-identical to `{lossless}`'s:", "",
                    *versus_table(rows, records, reference, prefix, lossless), ""]
        for i, spec in enumerate(cfg.plots if rows else []):  # drawn again from the rows, as `ablate` draws them
            png = plot(rows, spec, fig_dir, f"{name}_{i}")[0]
            sec += [f"![{png.stem}]({fig_dir.name}/{png.name})", ""]
        sections.append("\n".join(sec))
        index[name] = section_entry(finished, run_note, {m: hashes.get(m) for m in models_used(name)}, minutes,
                                    summary[-1], sections[-1])
    wall_file = out / WALL_FILE
    wall = (f"; the command took {json.loads(wall_file.read_text())['wall_s'] / 60:.0f} min of wall time"
            + (f" with {jobs} workers at once" if jobs > 1 else "") + ", model loading included"
            if wall_file.is_file() else "")
    kept_names = [n for n in names if n in kept]
    kept_minutes = sum(kept[n].minutes for n in kept_names)
    decode_time = (
        f"This page's decodes took {total_seconds / 60:.0f} min{wall}." if not kept_names else
        f"This page's decodes took {(total_seconds / 60 + kept_minutes):.0f} min: {total_seconds / 60:.0f} min "
        f"in this run{wall}, {kept_minutes:.0f} min in the earlier runs that wrote the kept sections.")
    kept_note = (f" The sections kept from an earlier run of this page ({', '.join(kept_names)}) name their own "
                 "date and machine." if kept_names else "")
    header = fragment("results_header.md").format(
        command=command, run_note=run_note, kept_note=kept_note, decode_time=decode_time, now=now,
        written_note=" (each section gives the date its analysis ran)" if kept_names else "", models=models)
    lines = header.split("\n")
    text = "\n".join(lines + summary + [""] + sections)
    doc.write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).write_text(json.dumps({"page": str(doc), "written": now, "sections": index}, indent=1))
    return text


