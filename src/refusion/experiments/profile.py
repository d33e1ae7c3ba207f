"""``refusion profile``: where each decoder's decode time goes, with the bench's settings.

For each decoder and task, decodes the first ``--limit`` samples (after one untimed warm-up) on the
bench's model with forward timing on (:attr:`Backbone.time_forwards`) and reports, per (decoder, task):
decode wall time, time inside model forwards and the share outside them, forwards, iterations, tokens
fed, output-head rows computed (total and per forward), host synchronisations per iteration
(:mod:`refusion.core.host`), tokens generated and tokens/s. ``--vocab N`` profiles a stand-in of each
model widened to ``N`` vocabulary rows (:func:`refusion.models.build.widen_vocabulary`), so that a real
model's output-head cost shows without a download; its new ids' logits are put 40 under each row's
top logit (:func:`mask_new_ids`) unless ``--raw-vocab`` leaves them at the zero rows' 0, and each row
counts the decodes whose token ids equal the original model's. Writes ``profile.json`` (list of rows)
and ``profile.md`` to ``--out``; docs/profile.md says how to read them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from tqdm import tqdm

from refusion.core import host
from refusion.core.config import ConfigError, build_decoder, validate_config
from refusion.core.threads import add_threads_arg, set_threads
from refusion.experiments.bench import bench_config_path, bench_runs, load_bench_config

#: how far under each row's top logit a stand-in's new ids are put (``mask_new_ids``)
NEW_ID_GAP = 40.0

#: (key, table heading) of every reported column, in table order
COLUMNS = (
    ("decoder", "decoder"), ("task", "task"), ("n", "n"), ("wall_s", "wall s"), ("forward_s", "fwd s"),
    ("outside_forward_share", "out %"), ("forwards", "fwds"), ("iterations", "iters"),
    ("tokens_in", "tok in"), ("logits_rows", "rows"), ("logits_rows_per_forward", "rows/fwd"),
    ("host_syncs_per_iteration", "syncs/it"), ("generated_tokens", "tokens"),
    ("tokens_per_second", "tok/s"), ("identical_to_original", "same ids"),
)


def mask_new_ids(model: torch.nn.Module, base_vocab: int, below: float = NEW_ID_GAP) -> RemovableHandle:
    """Make ``model``'s output head give every id from ``base_vocab`` on the logit ``below`` under its
    row's top one, so a widened stand-in decodes as the original model: 151936 ids at 40 under the top
    hold about 6e-13 of the probability, under float32's resolution, while their exponentials stay
    normal floats, as a real model's tail does (an exponential that underflows takes a slower path on
    the CPU, about 5x for ``exp`` and ``logsumexp``)."""
    def hook(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        out[..., base_vocab:] = out[..., :base_vocab].amax(-1, keepdim=True) - below
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "outside_forward_share":
        return f"{100 * value:.1f}"
    if key == "wall_s" or key == "forward_s":
        return f"{value:.3f}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _columns(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """:data:`COLUMNS` less ``identical_to_original`` when no row has it (no ``--vocab``)."""
    return [(k, h) for k, h in COLUMNS
            if k != "identical_to_original" or any(r.get(k) is not None for r in rows)]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    from refusion.experiments.tables import cells, markdown

    cols = _columns(rows)
    return markdown([h for _, h in cols], cells(rows, cols, _cell))


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from refusion.experiments.tables import cells, print_rich

    cols = _columns(rows)
    print_rich([h for _, h in cols], cells(rows, cols, _cell), title, left=("decoder", "task"),
               where="profile.md in the output folder holds every column")


def _row(decoder: str, task: str, model: str, vocab: int, samples: list[dict[str, Any]],
         same: int | None) -> dict[str, Any]:
    tot = {k: sum(s[k] for s in samples) for k in samples[0]}
    return {
        "decoder": decoder, "task": task, "model": model, "vocab_size": vocab, "n": len(samples),
        "wall_s": tot["wall_s"], "forward_s": tot["forward_s"],
        "outside_forward_share": 1 - tot["forward_s"] / tot["wall_s"] if tot["wall_s"] else None,
        "forwards": tot["forwards"], "iterations": tot["iterations"], "tokens_in": tot["tokens_in"],
        "logits_rows": tot["logits_rows"],
        "logits_rows_per_forward": tot["logits_rows"] / tot["forwards"] if tot["forwards"] else 0.0,
        "host_syncs": tot["host_syncs"],
        "host_syncs_per_iteration": tot["host_syncs"] / tot["iterations"] if tot["iterations"] else None,
        "generated_tokens": tot["generated_tokens"],
        "tokens_per_second": tot["generated_tokens"] / tot["wall_s"] if tot["wall_s"] else 0.0,
        "identical_to_original": same,
    }


def profile(tasks: list[str], decoders: list[str] | None = None, limit: int | None = 5, split: str = "test",
            vocab: int | None = None, overrides: list[str] = (), device: str = "cpu", config: str | None = None,
            raw_vocab: bool = False) -> list[dict[str, Any]]:
    """One row per (decoder, task), in decoder order (keys: :data:`COLUMNS`, ``model``, ``vocab_size``,
    ``host_syncs``); ``identical_to_original`` is None without ``vocab``."""
    from refusion.models.tokenizer import encode_prompt
    from refusion.models.backend import Backbone
    from refusion.models.build import widen_vocabulary
    from refusion.models.loading import resolve_model_path
    from refusion.tasks import get_task

    if not tasks:
        raise ConfigError("--tasks: give at least one task")
    for t in tasks:
        try:
            get_task(t)
        except ValueError as e:
            raise ConfigError(f"--tasks: {e}") from None
    cfg = load_bench_config(config)
    runs = bench_runs(cfg, decoders or cfg.decoder_rows, tasks, overrides)
    for run in runs:  # every config checked before anything loads
        for t in tasks:
            validate_config(run.configs[t])
    for model in dict.fromkeys(r.model for r in runs) if vocab is not None else ():
        base = json.loads((resolve_model_path(model) / "config.json").read_text()).get("vocab_size", 0)
        if vocab < base:
            raise ConfigError(f"--vocab {vocab} is smaller than the vocabulary of {model!r} ({base} rows); "
                              f"give at least {base}")
    examples = {t: get_task(t).examples(split, limit) for t in tasks}
    n_decodes = len(runs) * sum(len(e) for e in examples.values()) * (2 if vocab else 1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="refusion-profile-") as tmp, \
            tqdm(total=n_decodes, desc="profile", unit="decode", dynamic_ncols=True) as bar:
        widened: dict[str, Path] = {}
        for run in runs:
            reference: dict[str, list[list[int]]] = {}
            model = run.model
            if vocab:
                original = Backbone.from_pretrained(run.model, device=device)
                for t in tasks:
                    dec = build_decoder(original, run.configs[t])
                    reference[t] = []
                    for ex in examples[t]:
                        reference[t].append(dec.generate(encode_prompt(original.tokenizer, ex.query)).token_ids)
                        bar.update()
                del original, dec
                if run.model not in widened:
                    widened[run.model] = widen_vocabulary(run.model, Path(tmp) / f"model-{len(widened)}", vocab)
                model = str(widened[run.model])
            backbone = Backbone.from_pretrained(model, device=device)
            if vocab and not raw_vocab:
                mask_new_ids(backbone.model, backbone.model.config.refusion_base_vocab_size)
            size = backbone.model.get_input_embeddings().weight.shape[0]
            for t in tasks:
                dec = build_decoder(backbone, run.configs[t])
                prompts = [encode_prompt(backbone.tokenizer, ex.query) for ex in examples[t]]
                backbone.time_forwards = False
                dec.generate(prompts[0])  # warm-up, untimed
                backbone.time_forwards = True
                samples, same = [], 0
                for i, prompt in enumerate(prompts):
                    before = (backbone.forward_s, backbone.logits_rows, host.count)
                    res = dec.generate(prompt)
                    samples.append({
                        "wall_s": res.stats.wall_s, "forward_s": backbone.forward_s - before[0],
                        "forwards": res.stats.nfe, "iterations": res.stats.iterations,
                        "tokens_in": res.stats.tokens_in, "logits_rows": backbone.logits_rows - before[1],
                        "host_syncs": host.count - before[2], "generated_tokens": res.stats.generated_tokens,
                    })
                    if vocab:
                        same += res.token_ids == reference[t][i]
                    bar.update()
                backbone.time_forwards = False
                rows.append(_row(run.label, t, run.model, size, samples, same if vocab else None))
            del backbone
    return rows


def add_profile_command(sub) -> None:
    from refusion.experiments.args import add_output_args, add_rows_args

    p = sub.add_parser("profile", help="where each decoder's time goes: forwards, output-head rows, host syncs")
    add_rows_args(p, models=False)
    add_output_args(p, "runs/profile", "profile.json, profile.md", 5, "default 5")
    p.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="profile stand-ins widened to N vocabulary rows (e.g. 151936, Qwen's) instead of the models")
    p.add_argument("--raw-vocab", action="store_true",
                   help="with --vocab: keep the new ids' logits at 0 (the zero rows' own), not 40 under each row's top")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--device", default="cpu")
    add_threads_arg(p)
    p.set_defaults(func=cmd_profile)


def cmd_profile(a) -> int:
    if a.limit < 1:
        raise ConfigError(f"--limit: must be at least 1, got {a.limit}")
    if a.raw_vocab and not a.vocab:
        raise ConfigError("--raw-vocab needs --vocab")
    from refusion.experiments.manifest import build_manifest, run_entries, write_manifest
    from refusion.models.loading import RuntimeOptions

    threads = set_threads(a.threads)
    tasks, decoders = [t for t in a.tasks.split(",") if t], [d for d in a.decoders.split(",") if d] or None
    rows = profile(tasks, decoders, a.limit, a.split, a.vocab, a.set, a.device, a.config, a.raw_vocab)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(rows, indent=1))
    (out / "profile.md").write_text(markdown_table(rows))
    cfg = load_bench_config(a.config)
    runs = bench_runs(cfg, decoders or cfg.decoder_rows, tasks, a.set)
    write_manifest(out, build_manifest("profile", run_entries(runs, tasks, a.split, RuntimeOptions(device=a.device)),
                                       {"bench_config": str(bench_config_path(a.config)),
                                        "set": a.set, "limit": a.limit, "vocab": a.vocab, "raw_vocab": a.raw_vocab}))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        vocab = f", vocabulary {a.vocab}{' (raw)' if a.raw_vocab else ''}" if a.vocab else ""
        print_table(rows, title=f"refusion profile ({a.split} split, {a.limit} per task{vocab}, {a.device}, "
                                f"{threads} torch thread{'s' * (threads != 1)})")
        print(f"wrote {out / 'profile.json'}, {out / 'profile.md'}, {out / 'manifest.json'}")
    return 0
