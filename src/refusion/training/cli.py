"""``refusion train``: train one objective, or run the controlled recipe.

::

    refusion train --objective refusion --data tinybench --init runs/recipe/tiny-base --out runs/ft \\
        --steps 500 --batch-size 32 --lr 1e-3 --set slot_sizes=[4,8] --resume
    refusion train --objective ar --data my.json --init scratch --size tiny --out runs/mine
    refusion train --recipe tiny --out runs/recipe [--pretrain-steps P] [--finetune-steps F]
        [--refine-steps R] [--refine-rounds N] [--base-ar-steps B]

``--init`` takes a model folder or a shipped checkpoint name; ``scratch`` builds a fresh model of
``--size`` with the tinybench tokenizer (``--data tinybench``) or a tokenizer trained on the JSON file.
Every flag is a field of :class:`~refusion.training.config.TrainRun` (with ``--recipe``:
:class:`~refusion.training.config.RecipeConfig`), its default defined there; ``--config FILE`` gives any of
them from a YAML or TOML file, the flags override it, and ``--set key=value`` overrides both (values parsed
as YAML). A ``--set`` key that is not a field is an option of the objective (``slot_sizes=[4,8]``,
``block_size=16``, ``eps=0.01``); unknown options are an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from refusion.training.config import RecipeConfig, TrainConfig, TrainRun

TRAIN_THREADS = TrainConfig.model_fields["threads"].default  # torch threads of `refusion train` without --threads
RUN_FLAGS = [n for n in TrainRun.model_fields if n not in ("threads", "options")]  # threads: --threads N|auto
RECIPE_FLAGS = [n for n in RecipeConfig.model_fields if n not in TrainRun.model_fields]


def objective_sets(extra: dict[str, Any]) -> dict[str, Any]:
    """``--set`` keys of ``refusion train``: a field of :class:`TrainRun` sets it, any other key an option of
    the objective (``slot_sizes=[4,8]`` is ``options.slot_sizes=[4,8]``)."""
    out: dict[str, Any] = {k: v for k, v in extra.items() if k in TrainRun.model_fields}
    options = {k: v for k, v in extra.items() if k not in TrainRun.model_fields}
    if options:
        out["options"] = {**out.get("options", {}), **options}
    return out


def add_train_command(subparsers: Any) -> None:
    """Add the ``train`` subcommand (``func=run_train``) to an argparse subparsers object; its flags and their
    defaults come from :class:`TrainRun` and :class:`RecipeConfig` (training/config.py)."""
    from refusion.core.flags import add_model_flags, default_text
    from refusion.core.threads import add_threads_arg

    p = subparsers.add_parser("train", help="train a model with one objective, or run the controlled recipe",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=["tiny"], help="run the controlled pretrain + fine-tune recipe")
    p.add_argument("--config", help="YAML or TOML file of settings (fields of TrainRun, or of RecipeConfig with "
                                     "--recipe); flags and --set override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting (values parsed as YAML); a key that is not one is an objective option "
                        "(--set slot_sizes=[4,8])")
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    add_model_flags(p, TrainRun, RUN_FLAGS)
    add_threads_arg(p, default=TRAIN_THREADS)
    add_model_flags(p.add_argument_group("recipe (--recipe tiny)"), RecipeConfig, RECIPE_FLAGS, help_prefix="recipe: ")
    for action in p._actions:  # a flag both modes take, with another default under --recipe: say both
        name = action.dest
        if name in RUN_FLAGS and name in RecipeConfig.model_fields and \
                default_text(RecipeConfig, name) != default_text(TrainRun, name):
            action.help = action.help[:-1] + f"; with --recipe {default_text(RecipeConfig, name)})"
    p.set_defaults(func=run_train, _parser=p)


def _error(args: argparse.Namespace, msg: str) -> None:
    parser = getattr(args, "_parser", None)
    if parser is not None:
        parser.error(msg)  # exits with status 2
    raise SystemExit(f"refusion train: error: {msg}")


def scratch_tokenizer(data: str) -> Any:
    """The tinybench tokenizer, or one trained on a JSON file's queries and responses."""
    from refusion.models import tokenizer as tk
    from refusion.tasks.tokenizer import build_tinybench_tokenizer
    from refusion.training.data import tinybench_mix, tokenizer_training_texts

    if tinybench_mix(data) is not None:
        return build_tinybench_tokenizer()

    return tk.train_tokenizer(tokenizer_training_texts(data))


def write_train_manifest(settings: TrainRun | RecipeConfig, resume: bool) -> None:
    """``OUT/manifest.json`` for a training run: its settings (every field), the ``--init`` model's weights
    hash, machine, packages, threads. A resumed run whose settings differ says which on stderr (``--steps``
    may grow on a resume) and the manifest takes the new ones."""
    from pathlib import Path

    from refusion.experiments.manifest import build_manifest, read_manifest, weights_sha256, write_manifest

    record = settings.model_dump(mode="json")
    if isinstance(settings, TrainRun) and settings.init != "scratch":
        record["init_weights_sha256"] = weights_sha256(settings.init)
    out = Path(settings.out)
    old = read_manifest(out)
    if resume and old is not None:
        before = old.get("inputs", {})
        changed = [f"{k}: {before.get(k)!r} -> {record.get(k)!r}" for k in sorted(set(before) | set(record))
                   if k != "progress" and before.get(k) != record.get(k)]
        if changed:
            print(f"note: resuming {out} with other settings than it started with: {'; '.join(changed)}",
                  file=sys.stderr)
    write_manifest(out, build_manifest("train", inputs=record))


def train_settings(args: argparse.Namespace) -> TrainRun | RecipeConfig:
    """The settings of a ``refusion train`` command line: a :class:`RecipeConfig` with ``--recipe``, else a
    :class:`TrainRun` (defaults < ``--config`` < flags < ``--set``); a flag of the other mode is refused."""
    from refusion.core.config import ConfigError
    from refusion.core.flags import flag_of, settings_from_args
    from refusion.core.threads import resolve_threads

    threads = {"threads": resolve_threads(args.threads, TRAIN_THREADS)} if args.threads is not None else {}
    model, other = (RecipeConfig, TrainRun) if args.recipe else (TrainRun, RecipeConfig)
    stray = [n for n in vars(args) if n in other.model_fields and n not in model.model_fields]
    if stray:
        flags = ", ".join(flag_of(other, n) for n in stray)
        raise ConfigError(f"{flags}: {'--objective training' if args.recipe else '--recipe tiny'} only; "
                          f"{'the recipe sets it per stage' if args.recipe else 'give --recipe tiny'}")
    return settings_from_args(model, args, config_file=args.config, sets=args.set, fixed=threads,
                              route_set=None if args.recipe else objective_sets)


def run_train(args: argparse.Namespace) -> int:
    from refusion.core.config import ConfigError

    try:
        settings = train_settings(args)
    except ConfigError as exc:
        _error(args, str(exc))
    if isinstance(settings, RecipeConfig):
        from refusion.training.recipe import run_recipe

        run_recipe(settings, on_start=lambda: write_train_manifest(settings, args.resume))
        return 0
    return train_one(settings, args)


def train_one(run: TrainRun, args: argparse.Namespace) -> int:
    """Train ``run``'s objective (``refusion train --objective``)."""
    if not run.objective:
        _error(args, "--objective is required (or use --recipe tiny)")

    import torch

    from refusion.core.registry import PluginError, get_registry
    from refusion.models.build import build_model, deepen
    from refusion.models.loading import load_pretrained
    from refusion.training.data import load_pairs
    from refusion.training.trainer import Trainer, training_device

    try:
        cls = get_registry().get("objective", run.objective)
    except PluginError as exc:
        _error(args, str(exc))
    if cls.wants_random_batches and run.group_by_length:
        print(f"note: --group-by-length {run.group_by_length} with objective {run.objective!r}, whose layout depends "
              "on which examples share a batch (EOS padding to the batch's longest response): length-grouped "
              "batches teach it little about where answers end; the recipe trains it with 0", file=sys.stderr)
    try:
        options = cls.Options(**run.options)
    except Exception as exc:  # pydantic ValidationError
        _error(args, f"bad objective options for {run.objective!r}: {exc}")
    if run.threads:
        torch.set_num_threads(run.threads)
    try:
        training_device(run.device)
    except ValueError as exc:
        _error(args, f"--{exc}")

    if run.init == "scratch":
        tokenizer = scratch_tokenizer(run.data)
        objective = cls.from_tokenizer(tokenizer, options)
        model = build_model(tokenizer, run.size, seed=run.seed, max_position_embeddings=max(512, run.max_length))
        if run.attn_implementation:
            model.set_attn_implementation(run.attn_implementation)
    else:
        model, tokenizer = load_pretrained(run.init, attn_implementation=run.attn_implementation)
        objective = cls.from_tokenizer(tokenizer, options)
    if run.grow_layers is not None:
        try:
            deepen(model, run.grow_layers)
        except ValueError as exc:
            _error(args, f"--grow-layers: {exc}")
    max_len = min(run.max_length, int(getattr(model.config, "max_position_embeddings", run.max_length)))
    train_pairs = load_pairs(run.data, tokenizer, "train", max_length=max_len, limit=run.limit)
    val_pairs = load_pairs(run.data, tokenizer, "validation", max_length=max_len)
    write_train_manifest(run, args.resume)
    trainer = Trainer(model, tokenizer, objective, train_pairs, run.loop_config(), run.out, val_pairs=val_pairs)
    summary = trainer.train(resume=args.resume)
    print(json.dumps({k: summary[k] for k in ("objective", "steps", "train", "eval", "wall_s")}, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m refusion.training.cli train ...``)."""
    parser = argparse.ArgumentParser(prog="refusion")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_command(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
