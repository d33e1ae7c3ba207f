"""The flags the experiment commands share (``bench``, ``batch-bench``, ``profile``, ``ablate``, ``results``, ``trace``).

One function adds each group, so that a flag means and defaults the same in every command that has it:
:func:`add_rows_args` (which rows on which tasks: ``--tasks``, ``--decoders``, :func:`add_split_arg`'s
``--split`` and :func:`add_bench_config_args`' ``--config``, ``--set``, ``--model``; ``trace`` and
``loadtest`` take those two alone), :func:`add_output_args` (``--out``, ``--limit``), :func:`add_resume_args`
(``--resume``, ``--rerun-changed``), :func:`add_machine_args` (the runtime flags, ``--threads`` and, where a
command shards its work, ``--jobs``), :func:`add_batch_size_arg` and :func:`add_seeds_arg`.
"""

from __future__ import annotations

import argparse

from refusion.core.threads import add_threads_arg
from refusion.models.loading import add_runtime_args

TASKS = "arith,code,facts"
DEVICE_HELP = "cpu, cuda or cuda:N (default: the config's runtime.device, else cpu)"


def add_rows_args(p: argparse.ArgumentParser, row_sets: bool = False, models: bool = True) -> None:
    """``--tasks``, ``--decoders``, ``--split`` and the bench config's flags (:func:`add_bench_config_args`)."""
    p.add_argument("--tasks", default=TASKS, help=f"comma-separated tinybench tasks (default {TASKS})")
    p.add_argument("--decoders", default="", help="comma-separated decoders (default: all configured)")
    add_split_arg(p)
    add_bench_config_args(p, row_sets, models)


def add_split_arg(p: argparse.ArgumentParser) -> None:
    """``--split``: the tinybench split whose samples are decoded."""
    p.add_argument("--split", default="test", choices=["validation", "test"])


def add_bench_config_args(p: argparse.ArgumentParser, row_sets: bool = False, models: bool = True,
                          rows: str = "row") -> None:
    """``--config`` (the bench YAML), ``--set`` (``row_sets``: also ``ROW:key=value``, one row's; ``rows``
    names what a row is in the help) and, with ``models``, ``--model DECODER=FOLDER``."""
    p.add_argument("--config", help="bench YAML, or a shipped one's name (default: the shipped "
                                    "experiments/configs/bench/bench.yaml)")
    if row_sets:
        p.add_argument("--set", action="append", default=[], metavar="[ROW:]KEY=VALUE",
                       help=f"override every {rows}'s decoder config, or with ROW: one {rows}'s (e.g. "
                            "refusion:scorer=mean_prob)")
    else:
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override every decoder config")
    if models:
        p.add_argument("--model", action="append", default=[], metavar="DECODER=FOLDER",
                       help="run DECODER on this model folder or checkpoint name instead of the configured one")


def add_output_args(p: argparse.ArgumentParser, out: str | None, holds: str, limit: int | None, limit_help: str) -> None:
    """``--out`` (default ``out``; the folder ``holds`` these files) and ``--limit`` (samples per task)."""
    p.add_argument("--out", default=out, help=f"output folder ({holds})")
    p.add_argument("--limit", type=int, default=limit, help=f"samples per task ({limit_help})")


def add_resume_args(p: argparse.ArgumentParser) -> None:
    """``--resume`` and ``--rerun-changed``, as every command that decodes into a resumable folder has them."""
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out, skipping finished samples; refused when --out was started with "
                        "other settings (its manifest.json says which)")
    p.add_argument("--rerun-changed", action="store_true",
                   help="resume, keeping the samples of the runs whose settings are unchanged and decoding the "
                        "changed runs anew")


def add_machine_args(p: argparse.ArgumentParser, device_help: str = DEVICE_HELP, jobs_help: str | None = None) -> None:
    """The runtime flags (``--device``, ``--dtype``, ``--attn-implementation``, ``--device-map``), ``--threads``
    and, with ``jobs_help``, ``--jobs N`` (one-thread worker processes)."""
    add_runtime_args(p, device_help=device_help)
    add_threads_arg(p)
    if jobs_help:
        p.add_argument("--jobs", type=int, default=1, metavar="N", help=jobs_help)


def add_batch_size_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--batch-size N``: samples per ``generate_batch`` call (``default_help``: where the default comes from)."""
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="decode N samples per generate_batch call; tokens/s is then the aggregate throughput "
                        f"(default: {default_help})")


def add_seeds_arg(p: argparse.ArgumentParser, default: int | None = 1, default_help: str = "1") -> None:
    """``--seeds N``, as every command that compares runs over the same samples has it (the repetitions:
    :meth:`~refusion.experiments.runner.Run.seed_values`); ``default_help`` says what ``default`` means."""
    p.add_argument("--seeds", type=int, default=default, metavar="N",
                   help="decode every sample with N seeds (each run's seed and the next N-1; they differ under "
                        f"sampling); statistics pool them, runs paired by sample and seed (default {default_help})")
