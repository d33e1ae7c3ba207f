"""``refusion train``: train one objective, or run the controlled recipe.

::

    refusion train --objective refusion --data tinybench --init runs/recipe/tiny-base --out runs/ft \\
        --steps 500 --batch-size 32 --lr 1e-3 --set slot_sizes=[4,8] --resume
    refusion train --objective ar --data my.json --init scratch --size tiny --out runs/mine
    refusion train --recipe tiny --out runs/recipe [--pretrain-steps P] [--finetune-steps F]
        [--refine-steps R] [--refine-rounds N] [--base-ar-steps B]

``--init`` takes a model folder or a shipped checkpoint name; ``scratch`` builds a fresh model of
``--size`` with the tinybench tokenizer (``--data tinybench``) or a tokenizer trained on the JSON file.
``--set key=value`` sets an option of the objective (values parsed as YAML: ``slot_sizes=[4,8]``,
``block_size=16``, ``eps=0.01``); unknown keys are an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

TRAIN_THREADS = 2  # torch threads of `refusion train` without --threads (the shipped recipe's)


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def add_train_command(subparsers: Any) -> None:
    """Add the ``train`` subcommand (``func=run_train``) to an argparse subparsers object."""
    from refusion.training.recipe import (
        DEFAULT_BASE_AR_STEPS, DEFAULT_REFINE_ROUNDS, DEFAULT_REFINE_STEPS, LATE_MIX, LONG_SLOT_SIZES,
        LONG_SLOTS_FROM_ROUND, MIX_FROM_ROUND,
    )

    p = subparsers.add_parser("train", help="train a model with one objective, or run the controlled recipe",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", help="ar | refusion | mdm | block (or a plugin's objective)")
    p.add_argument("--data", default="tinybench",
                   help="'tinybench', a tinybench mix such as 'tinybench:facts=3' (facts train examples 3 times), "
                        "or a JSON file of {query, response}")
    p.add_argument("--init", default="scratch", help="model folder, shipped checkpoint name, or 'scratch'")
    p.add_argument("--out", required=True, help="output folder (log, resumable state, final model)")
    p.add_argument("--recipe", choices=["tiny"], help="run the controlled pretrain + fine-tune recipe")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per batch (default 32)")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget per batch (padded tokens)")
    p.add_argument("--group-by-length", type=int, default=0, metavar="N",
                   help="draw N batches at a time and batch them by length, so less padding is computed "
                        "(the recipe uses 64; default 0: plain shuffled batches)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of steps)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--size", default="tiny", help="model size for --init scratch (micro, tiny, small)")
    p.add_argument("--max-length", type=int, default=512, help="drop examples longer than this (tokens)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N training examples")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="objective option")
    p.add_argument("--grow-layers", type=int, default=None, metavar="N",
                   help="grow the --init model to N decoder layers first: copies of its layers whose residual "
                        "writers are zero, so it starts computing exactly what --init computes")
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    from refusion.core.threads import add_threads_arg

    add_threads_arg(p, default=TRAIN_THREADS)
    p.add_argument("--device", default="cpu", help="train on this torch device: cpu (default), cuda, cuda:N")
    p.add_argument("--attn-implementation", default=None, choices=["sdpa", "eager"],
                   help="attention of the --init / scratch model: sdpa (default) or eager (training keeps float32 "
                        "weights, so flash attention, which needs 16-bit ones, is not offered; the recipe uses sdpa)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="recipe: AR pretraining steps (P)")
    p.add_argument("--finetune-steps", type=int, default=None, help="recipe: fine-tuning steps per objective (F)")
    p.add_argument("--refine-steps", type=int, default=None,
                   help="recipe: further steps per objective after F, under a fresh schedule (R; default: the "
                        f"shipped recipe's, {DEFAULT_REFINE_STEPS})")
    p.add_argument("--refine-rounds", type=int, default=None,
                   help="recipe: refine stages per objective, each R steps from the one before (N; default: "
                        f"the shipped recipe's, {DEFAULT_REFINE_ROUNDS})")
    p.add_argument("--base-ar-steps", type=int, default=None,
                   help="recipe: more ar steps on the base, at the fine-tune lr, before the objectives branch "
                        f"(B; default: the shipped recipe's, {DEFAULT_BASE_AR_STEPS})")
    p.add_argument("--long-slots-from", type=int, default=None, metavar="ROUND",
                   help=f"recipe: refine round from which the refusion arm draws slot sizes from {LONG_SLOT_SIZES} "
                        f"(default {LONG_SLOTS_FROM_ROUND}, once --refine-rounds reaches it; 0: never)")
    p.add_argument("--mix-from", type=int, default=None, metavar="ROUND",
                   help=f"recipe: refine round from which every arm trains on {LATE_MIX} (default {MIX_FROM_ROUND}, "
                        "once --refine-rounds reaches it; 0: never)")
    p.add_argument("--objectives", default=None, help="recipe: comma-separated objectives (default all four)")
    p.add_argument("--jobs", type=int, default=1, help="recipe: fine-tune in this many 1-thread worker processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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


def write_train_manifest(args: argparse.Namespace, threads: int) -> None:
    """``OUT/manifest.json`` for a training run: the command's settings (every flag), the ``--init`` model's
    weights hash, machine, packages, threads. A resumed run whose settings differ says which on stderr
    (``--steps`` may grow on a resume) and the manifest takes the new ones."""
    from pathlib import Path

    from refusion.experiments.manifest import build_manifest, read_manifest, weights_sha256, write_manifest

    settings = {k: v for k, v in vars(args).items() if k not in ("func", "_parser") and not k.startswith("_")}
    settings["threads"] = threads
    if args.init != "scratch":
        settings["init_weights_sha256"] = weights_sha256(args.init)
    out = Path(args.out)
    old = read_manifest(out)
    if args.resume and old is not None:
        before = old.get("inputs", {})
        changed = [f"{k}: {before.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(before) | set(settings))
                   if k not in ("resume", "no_progress") and before.get(k) != settings.get(k)]
        if changed:
            print(f"note: resuming {out} with other settings than it started with: {'; '.join(changed)}",
                  file=sys.stderr)
    write_manifest(out, build_manifest("train", inputs=json.loads(json.dumps(settings, default=str))))


def run_train(args: argparse.Namespace) -> int:
    from refusion.core.threads import resolve_threads

    args.threads = resolve_threads(args.threads, TRAIN_THREADS)
    if args.recipe and args.attn_implementation:
        _error(args, "--attn-implementation applies to --objective training; the recipe trains with sdpa")
    if args.recipe:
        from refusion.training.recipe import run_recipe

        objectives = tuple(o.strip() for o in args.objectives.split(",")) if args.objectives else None
        kw: dict[str, Any] = {}
        if objectives:
            kw["objectives"] = objectives
        if args.batch_size:
            kw["batch_size"] = args.batch_size
        for key in ("refine_rounds", "long_slots_from", "mix_from"):  # checked by run_recipe
            if getattr(args, key) is not None:
                kw[key] = getattr(args, key)
        run_recipe(args.out, pretrain_steps=args.pretrain_steps, finetune_steps=args.finetune_steps,
                   refine_steps=args.refine_steps, base_ar_steps=args.base_ar_steps, threads=args.threads,
                   progress=not args.no_progress, seed=args.seed, jobs=args.jobs, device=args.device,
                   on_start=lambda: write_train_manifest(args, args.threads), **kw)
        return 0
    if not args.objective:
        _error(args, "--objective is required (or use --recipe tiny)")
    if args.group_by_length < 0:
        _error(args, f"--group-by-length must be 0 (off) or a number of batches, got {args.group_by_length}")

    import torch

    from refusion.core.registry import PluginError, get_registry
    from refusion.models.build import build_model, deepen
    from refusion.models.loading import load_pretrained
    from refusion.training.data import load_pairs
    from refusion.training.trainer import TrainConfig, Trainer

    try:
        cls = get_registry().get("objective", args.objective)
    except PluginError as exc:
        _error(args, str(exc))
    if cls.wants_random_batches and args.group_by_length:
        print(f"note: --group-by-length {args.group_by_length} with objective {args.objective!r}, whose layout depends "
              "on which examples share a batch (EOS padding to the batch's longest response): length-grouped "
              "batches teach it little about where answers end; the recipe trains it with 0", file=sys.stderr)
    try:
        options = cls.Options(**parse_sets(args.set))
    except Exception as exc:  # pydantic ValidationError or a bad --set
        _error(args, f"bad objective options for {args.objective!r}: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from refusion.training.trainer import training_device

    try:
        training_device(args.device)
    except ValueError as exc:
        _error(args, f"--{exc}")

    if args.init == "scratch":
        tokenizer = scratch_tokenizer(args.data)
        objective = cls.from_tokenizer(tokenizer, options)
        model = build_model(tokenizer, args.size, seed=args.seed,
                            max_position_embeddings=max(512, args.max_length))
        if args.attn_implementation:
            model.set_attn_implementation(args.attn_implementation)
    else:
        model, tokenizer = load_pretrained(args.init, attn_implementation=args.attn_implementation)
        objective = cls.from_tokenizer(tokenizer, options)
    if args.grow_layers is not None:
        try:
            deepen(model, args.grow_layers)
        except ValueError as exc:
            _error(args, f"--grow-layers: {exc}")
    max_len = min(args.max_length, int(getattr(model.config, "max_position_embeddings", args.max_length)))
    train_pairs = load_pairs(args.data, tokenizer, "train", max_length=max_len, limit=args.limit)
    val_pairs = load_pairs(args.data, tokenizer, "validation", max_length=max_len)
    config = TrainConfig(
        steps=args.steps or 200, batch_size=args.batch_size or 32, max_tokens=args.max_tokens,
        lr=args.lr or 1e-3, warmup_steps=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        seed=args.seed, log_every=args.log_every, save_every=args.save_every, eval_every=args.eval_every,
        threads=args.threads, progress=not args.no_progress, group_by_length=args.group_by_length,
        device=args.device,
    )
    write_train_manifest(args, args.threads)
    trainer = Trainer(model, tokenizer, objective, train_pairs, config, args.out, val_pairs=val_pairs)
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
