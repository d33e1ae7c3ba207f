"""``refusion eval``: run lm-evaluation-harness tasks on a model with one decoder config.

::

    refusion eval --model runs/m --tasks tinybench_arith,tinybench_facts --limit 20 [--batch-size 8]
    refusion eval --model /ckpt/ReFusion --tasks refusion_gsm8k_cot --config src/refusion/eval/configs/gsm8k_cot.yaml \\
        --apply-chat-template --gen-length-from config --device cuda --dtype bfloat16 --output out/gsm8k.json
    accelerate launch -m refusion.eval --model ... --tasks ...       # data parallel: one process per GPU

The model is the harness model ``refusion`` (:mod:`refusion.eval.lm_eval_adapter`), passed to
``lm_eval.simple_evaluate`` as an instance. Task names starting with ``tinybench_`` (or the tag
``tinybench``) are written as local tasks first (:func:`refusion.eval.tasks.write_lm_eval_tasks`); the
paper's tasks (``refusion_gsm8k_cot``, ``refusion_mbpp``, ...: docs/paper_tasks.md) are always included;
``--include-path`` adds folders of your own task YAMLs. When every task is found in those folders the
harness's ~15k built-in task configs are not indexed (saves ~10 s). Prints the results table and the
decode statistics (tokens/s, tokens per forward, NFE); ``--output`` writes both as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence


def add_eval_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand (``func=run_eval``) to an argparse subparsers object."""
    p = subparsers.add_parser("eval", help="run lm-evaluation-harness tasks with a decoder config",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(p)
    p.set_defaults(func=run_eval)
    return p


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder or shipped checkpoint name")
    p.add_argument("--tasks", required=True, help="comma-separated harness task names (tinybench_arith, refusion_gsm8k_cot, gsm8k_cot, ...)")
    p.add_argument("--config", help="decoder config file (YAML/TOML); default: the family's first decoder")
    p.add_argument("--decoder", default="", help="decoder name (instead of / consistent with the config's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a decoder option")
    p.add_argument("--family", help="model family (default: detected from config.json)")
    from refusion.models.loading import add_runtime_args

    add_runtime_args(p, device_help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--trust-remote-code", action="store_true", help="run the model folder's own modeling code (LLaDA, Dream: instead of the native path; off by default)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--include-path", action="append", default=[], help="folder of extra task YAMLs (repeatable)")
    p.add_argument("--tinybench-n", type=int, default=None, help="test examples exported per tinybench task (default all)")
    p.add_argument("--apply-chat-template", action="store_true", help="render prompts with the tokenizer's chat template")
    p.add_argument("--fewshot-as-multiturn", action="store_true")
    p.add_argument("--gen-length-from", choices=["task", "config"], default="task",
                   help="task: a request's max_gen_toks is gen_length; config: always the config's (the reference's way)")
    p.add_argument("--warmup", type=int, default=None, help="untimed decodes before timing (default 1 on cuda, 0 on cpu)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="requests per Decoder.generate_batch call (default 1); tokens/s is then the aggregate throughput")
    p.add_argument("--confirm-run-unsafe-code", action="store_true", help="allow code-execution metrics (mbpp, humaneval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bootstrap-iters", type=int, default=1000)
    p.add_argument("--output", help="write results + decode statistics as JSON here")
    p.add_argument("--log-samples", action="store_true", help="with --output: include every sample")
    from refusion.core.threads import add_threads_arg

    add_threads_arg(p)


def _decoder_config(args: argparse.Namespace) -> dict[str, Any]:
    from refusion.core.config import decoder_config

    return decoder_config(args.decoder, args.config, args.set)


def _task_manager(tasks: list[str], include: list[str]):
    from lm_eval.tasks import TaskManager

    if include:
        tm = TaskManager(include_path=include, include_defaults=False)
        if all(t in tm.all_tasks for t in tasks):
            return tm
    return TaskManager(include_path=include or None)


def run_eval(args: argparse.Namespace) -> int:
    from refusion.core.threads import set_threads
    from refusion.eval.tasks import TAG, task_names, write_lm_eval_tasks

    set_threads(getattr(args, "threads", None))
    from refusion.eval.tasks.paper import TASKS_DIR

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks: give at least one task")
    include = [str(TASKS_DIR)] + [str(Path(p).expanduser().resolve()) for p in args.include_path]  # yours win
    wanted_tiny = [t for t in tasks if t in task_names()] or (task_names() if TAG in tasks else [])
    if wanted_tiny:
        tiny_dir = write_lm_eval_tasks(tempfile.mkdtemp(prefix="refusion-tinybench-"), n=args.tinybench_n,
                                       tasks=wanted_tiny)
        include.append(str(tiny_dir))
    if args.confirm_run_unsafe_code:
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")  # the harness's code_eval metric asks for it

    try:
        import lm_eval
    except ImportError as e:
        raise ValueError(f"refusion eval needs lm-evaluation-harness ({e}); install the eval extra: "
                         "pip install -e '.[eval]' (or '.[test]')") from None

    from refusion.eval.lm_eval_adapter import RefusionLM
    from refusion.models.loading import runtime_from_args

    lm = RefusionLM(
        pretrained=args.model, config=_decoder_config(args), **runtime_from_args(args).model_dump(),
        trust_remote_code=args.trust_remote_code, family=args.family, gen_length_from=args.gen_length_from,
        warmup=args.warmup, batch_size=args.batch_size,
    )
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, task_manager=_task_manager(tasks, include),
        apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=args.fewshot_as_multiturn,
        log_samples=bool(args.output and args.log_samples), confirm_run_unsafe_code=args.confirm_run_unsafe_code,
        bootstrap_iters=args.bootstrap_iters, random_seed=args.seed, numpy_random_seed=args.seed,
        torch_random_seed=args.seed, fewshot_random_seed=args.seed,
    )
    gathered = lm.gather_object(lm.records, dst=0)
    try:
        if lm.rank == 0:
            _report(args, lm, results, [r for part in gathered for r in part])
    finally:
        lm.close()
    return 0


def _report(args: argparse.Namespace, lm: Any, results: dict, records: list[dict]) -> None:
    """Rank 0: the harness's table, the decode statistics and, with ``--output``, the JSON file."""
    from lm_eval.utils import handle_non_serializable, make_table

    stats = lm.summary(records)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print("decode statistics: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {**results, "refusion": {"model": args.model, "decoder_config": lm.config, "world_size": lm.world_size,
                                           "gen_length_from": args.gen_length_from, "stats": stats, "records": records,
                                           "manifest": _manifest(args, lm)}}
        out.write_text(json.dumps(payload, indent=1, default=handle_non_serializable, ensure_ascii=False))
        print(f"wrote {out}")


def _manifest(args: argparse.Namespace, lm: Any) -> dict[str, Any]:
    """What produced an ``--output`` file (:mod:`refusion.experiments.manifest`): the validated decoder config,
    the model folder and its weights hash, the harness settings, machine, packages, threads, command line."""
    from refusion.experiments.manifest import build_manifest, validated_config, weights_sha256

    try:
        model = {"model": args.model, "weights_sha256": weights_sha256(args.model)}
    except (OSError, ValueError) as e:  # a folder the adapter loaded some other way
        model = {"model": args.model, "weights_sha256": f"unknown ({e})"}
    try:
        config = validated_config(lm.config)
    except ValueError:
        config = lm.config
    settings = {k: v for k, v in vars(args).items() if k != "func" and not k.startswith("_")}
    return build_manifest("eval", {"eval": {t: {**model, "config": config} for t in args.tasks.split(",") if t}},
                          json.loads(json.dumps(settings, default=str)))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refusion.eval ...`` (same arguments as ``refusion eval``)."""
    from refusion.core.config import ConfigError

    parser = argparse.ArgumentParser(prog="refusion eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_eval_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_eval(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
