"""What produced an output folder (``OUT/manifest.json``), and the check that a resumed run is the same.

A manifest holds what the command was and where it ran: ``command``, ``argv``, ``written`` (UTC),
``machine`` (:func:`refusion.core.machine.machine`), ``torch_threads``, ``packages`` (python, refusion,
torch, transformers) and ``inputs`` (the files the command read, e.g. the bench config). An evaluation's
manifest adds ``runs``: run label -> task -> one entry::

    {"model": "tiny-refusion", "model_folder": "/abs/path", "weights_sha256": "...", "split": "test",
     "batch_size": 1, "runtime": {"device": "cpu", "dtype": "float32", ...},
     "config": {the validated decoder config: every option and every part's options, defaults filled},
     "config_key": "3f9c0a1b2c4d5e6f"}

A run repeated over seeds (``--seeds N``, N > 1) adds ``"seeds": [s, s + 1, ...]``, the ``seed`` each
repetition decodes with (its records carry theirs); a run decoded once has no ``seeds`` field.
``config_key`` is a stable hash (sha256, 16 hex digits) of the entry less the model's name and folder:
the validated config, the weights' hash, split, batch size, runtime and seeds; every record a run writes
carries the key of the entry that produced it. :func:`prepare_output` compares a folder's manifest with
the command's before a resumed run continues: any difference in a (run, task) both hold refuses the
resume with a message naming run, task, field, old and new value, unless ``rerun_changed`` drops the
changed pairs' records (kept: every other record). A folder with records and no manifest (written before
manifests existed) cannot be checked: resume is refused, and ``rerun_changed`` redoes every run of the
command there.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.core.config import ConfigError, dump_config, validate_config
from refusion.experiments.records import load_records, rewrite_records

if TYPE_CHECKING:
    from refusion.experiments.runner import Run
    from refusion.models.loading import RuntimeOptions

MANIFEST = "manifest.json"
VERSION = 1
KEYED = ("config", "weights_sha256", "split", "batch_size", "runtime", "seeds")  # what a config_key covers, in order
OPTIONAL = ("seeds",)  # KEYED fields an entry holds only when set, so that the keys of entries without them stay put

_weights_cache: dict[tuple, str] = {}


def weights_sha256(model: str | Path) -> str:
    """sha256 over the ``*.safetensors`` files of a model folder or shipped checkpoint (names and bytes, in
    name order); computed once per process for unchanged files."""
    from refusion.models.loading import resolve_model_path

    folder = resolve_model_path(model).resolve()
    files = sorted(folder.glob("*.safetensors"))
    stamp = (str(folder), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if stamp not in _weights_cache:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(block)
        _weights_cache[stamp] = digest.hexdigest()
    return _weights_cache[stamp]


def validated_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as validation reads it: every decoder option, and every part as ``{name, **its options}``
    with the part's defaults filled (a config that validates the same gives the same mapping)."""
    dec_cls, options, parts = validate_config(config)
    out = dump_config(dec_cls.name, options)
    for kind, part in parts.items():
        out[kind] = {"name": getattr(options, kind).name, **part.options.model_dump(mode="json")}
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def key_of(entry: dict[str, Any]) -> str:
    """The config key of a manifest entry: sha256 of its :data:`KEYED` fields (an :data:`OPTIONAL` one only
    when the entry holds it), 16 hex digits."""
    keyed = {k: entry[k] for k in KEYED if k in entry or k not in OPTIONAL}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_entries(runs: list["Run"], tasks: list[str], split: str,
                runtime: "RuntimeOptions") -> dict[str, dict[str, dict[str, Any]]]:
    """Run label -> task -> manifest entry (with its ``config_key``) for every run on every task."""
    from refusion.models.loading import resolve_model_path

    resolved = runtime.resolve().model_dump(mode="json")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        weights = weights_sha256(run.model)
        for task in tasks:
            entry = {"model": run.model, "model_folder": str(resolve_model_path(run.model).resolve()),
                     "weights_sha256": weights, "split": split, "batch_size": run.batch_size, "runtime": resolved,
                     "config": validated_config(run.configs[task])}
            if run.seeds > 1:
                entry["seeds"] = run.seed_values(task)
            entry["config_key"] = key_of(entry)
            out.setdefault(run.label, {})[task] = entry
    return out


def packages() -> dict[str, str]:
    """Versions of python and of the packages whose code decides a run's numbers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("refusion", "torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def build_manifest(command: str, runs: dict[str, dict[str, dict[str, Any]]] | None = None,
                   inputs: dict[str, Any] | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """A manifest for ``command`` now, on this machine (see the module docstring); ``runs`` from
    :func:`run_entries`, ``inputs`` anything else that says what the command read (kept as given)."""
    import torch

    from refusion.core.machine import machine

    out = {"manifest": VERSION, "command": command, "argv": list(sys.argv if argv is None else argv),
           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
           "torch_threads": torch.get_num_threads(), "packages": packages(), "inputs": inputs or {}}
    if runs is not None:
        out["runs"] = runs
    return json.loads(json.dumps(out, default=str))


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """Write ``folder/manifest.json`` (a temporary file renamed over it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False))
    tmp.replace(folder / MANIFEST)
    return folder / MANIFEST


@dataclass(frozen=True)
class Difference:
    """One field of one (run, task) that differs between a folder's manifest and this command's."""

    run: str
    task: str
    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"run {self.run!r} on {self.task}: {self.field}: {_short(self.old)} -> {_short(self.new)}"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def entry_differences(run: str, task: str, old: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """The fields of :data:`KEYED` that differ between two entries of (``run``, ``task``), a mapping field by
    dotted key (``config.selector.slot_threshold``); a changed weights hash names both models."""
    diffs = []
    for field in KEYED:
        if field == "weights_sha256":
            if old.get(field) != new.get(field):
                diffs.append(Difference(run, task, "model weights",
                                        f"{old.get('model')} (sha256 {str(old.get(field))[:10]})",
                                        f"{new.get('model')} (sha256 {str(new.get(field))[:10]})"))
            continue
        if field in OPTIONAL and field not in old and field not in new:
            continue
        a, b = (_flat(e[field], field) if field in e else {field: "(absent)"} for e in (old, new))
        for key in sorted(set(a) | set(b), key=lambda k: (k not in a, k)):
            if a.get(key, "(absent)") != b.get(key, "(absent)"):
                diffs.append(Difference(run, task, key, a.get(key, "(absent)"), b.get(key, "(absent)")))
    return diffs


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """Every :func:`entry_differences` of the (run, task) pairs both manifests hold, in ``new``'s order."""
    out = []
    for run, tasks in new.get("runs", {}).items():
        for task, entry in tasks.items():
            before = old.get("runs", {}).get(run, {}).get(task)
            if before is not None and before.get("config_key") != entry["config_key"]:
                out += entry_differences(run, task, before, entry) or [
                    Difference(run, task, "config_key", before.get("config_key"), entry["config_key"])]
    return out


def record_files(out: Path) -> list[Path]:
    """The record files of an output folder: ``samples.jsonl`` and a killed ``--jobs`` run's shard files."""
    return [p for p in [out / "samples.jsonl", *sorted(out.glob("shards/*/samples.jsonl"))] if p.is_file()]


class ManifestMismatch(ConfigError):
    """A resumed run whose configs differ from those that started its output folder."""


def prepare_output(out: Path, command: str, runs: dict[str, dict[str, dict[str, Any]]], resume: bool,
                   rerun_changed: bool = False, inputs: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Check ``out`` against this command's ``runs`` (:func:`run_entries`) and write its manifest; return the
    (run, task) pairs whose old records were dropped.

    Without ``resume`` (and ``rerun_changed``) a folder with records is the caller's to refuse. With it, a
    (run, task) counts as changed when the folder's manifest holds another config key for it, or a record
    of it carries another ``config_key``; a folder with records and no manifest has every pair changed.
    Changed pairs raise :class:`ManifestMismatch` naming each difference and the two ways out, unless
    ``rerun_changed``: then their records are removed from every record file and they are decoded anew.
    The manifest written keeps the old entries of pairs this command does not run."""
    old = read_manifest(out)
    files = record_files(out)
    dropped: list[tuple[str, str]] = []
    if (resume or rerun_changed) and files:
        records = {f: load_records(f) for f in files}
        keys = {(run, task): e["config_key"] for run, tasks in runs.items() for task, e in tasks.items()}
        held = {(r.get("run"), r.get("task")) for rs in records.values() for r in rs}
        if old is None:
            changed = {pair for pair in keys if pair in held}
            reasons = [f"{out / MANIFEST} is missing: {out} was written before runs recorded their configs (or by "
                       "another tool), so nothing says which configs produced its samples"]
        else:
            diffs = differences(old, {"runs": runs})
            stray = sorted({(r["run"], r["task"]) for rs in records.values() for r in rs
                            if (r.get("run"), r.get("task")) in keys and "config_key" in r
                            and r["config_key"] != keys[r["run"], r["task"]]})
            changed = {(d.run, d.task) for d in diffs} | set(stray)
            reasons = [str(d) for d in diffs] + [
                f"run {run!r} on {task}: samples carry another config_key than {keys[run, task]}" for run, task in stray
                if not any((d.run, d.task) == (run, task) for d in diffs)]
        if changed and not rerun_changed:
            raise ManifestMismatch(
                f"--resume: {out} was started with other settings than this command's; its samples would be "
                "reported as this command's results:\n  " + "\n  ".join(reasons) + "\nEither write to another "
                "--out, or pass --rerun-changed to keep the unchanged runs' samples there and decode the changed "
                f"ones anew ({', '.join(sorted({run for run, _ in changed}))})")
        if changed:
            for f, rs in records.items():
                kept = [r for r in rs if (r.get("run"), r.get("task")) not in changed]
                if len(kept) != len(rs):
                    rewrite_records(f, kept)
            dropped = sorted(changed)
            print(f"--rerun-changed: decoding anew in {out}: " + ", ".join(f"{run} on {task}" for run, task in dropped),
                  file=sys.stderr)
    merged = {run: dict(tasks) for run, tasks in ((old or {}).get("runs", {}) if files else {}).items()}
    for run, tasks in runs.items():
        merged.setdefault(run, {}).update(tasks)
    write_manifest(out, build_manifest(command, merged, inputs))
    return dropped

