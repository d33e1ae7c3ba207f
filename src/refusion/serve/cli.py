"""The ``serve`` and ``loadtest`` commands (added to the ``refusion`` command line by ``refusion.cli``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from refusion.core.config import ConfigError


def _api_key(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--api-key-file: {path!r} is not a file")
    key = p.read_text().strip()
    if not key:
        raise ConfigError(f"--api-key-file: {path!r} is empty")
    return key


def serve_config(args: argparse.Namespace) -> tuple[str, dict]:
    """(model, decoder config) of the serve flags: ``--bench-row ROW --task TASK`` takes the bench config's
    row (its model unless ``--model``, its settings for the task), else ``--decoder``/``--config``/``--set``."""
    from refusion.core.config import decoder_config

    if args.bench_row or args.task:
        if not (args.bench_row and args.task):
            raise ConfigError("--bench-row and --task go together (the bench row's settings for that task)")
        if args.decoder or args.config:
            raise ConfigError("--bench-row: gives the decoder config; leave out --decoder and --config")
        from refusion.experiments.bench import load_bench_config
        from refusion.tasks import get_task

        bench = load_bench_config(None)
        if args.bench_row not in bench.models:
            raise ConfigError(f"--bench-row: {args.bench_row!r} is not a bench row; rows: {', '.join(bench.models)}")
        try:
            task = get_task(args.task)
        except ValueError as e:
            raise ConfigError(f"--task: {e}") from None
        config = bench.decoder_config(args.task, args.bench_row, task.max_new_tokens, args.set)
        return args.model or bench.models[args.bench_row], config
    if not args.model:
        raise ConfigError("--model: give a model folder or shipped checkpoint name (or --bench-row ROW --task TASK)")
    config = decoder_config(args.decoder, args.config, args.set)
    if "decoder" not in config:
        raise ConfigError("--decoder: give a decoder (ar, refusion, llada, block, speculative) or a --config that "
                          "names one")
    return args.model, config


def cmd_serve(args: argparse.Namespace) -> int:
    from refusion.core.config import validate_config
    from refusion.core.threads import set_threads
    from refusion.models.backend import Backbone
    from refusion.models.loading import resolve_model_path, runtime_from_args
    from refusion.serve.net import is_loopback

    try:
        from refusion.serve.server import create_state, serve_forever
    except ImportError as e:
        raise ConfigError(f"refusion serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'") \
            from None

    model, config = serve_config(args)
    validate_config(config)  # a bad config fails before the model loads
    key = _api_key(args.api_key_file)
    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--admit-min", args.admit_min, 1), ("--stream-interval", args.stream_interval, 1),
                             ("--max-body-bytes", args.max_body_bytes, 1024), ("--port", args.port, 0)):
        if value < low:
            raise ConfigError(f"{flag}: must be at least {low}, got {value}")
    if args.request_timeout <= 0 or args.shutdown_grace < 0 or args.admit_wait < 0:
        raise ConfigError("--request-timeout must be above 0, --shutdown-grace and --admit-wait 0 or more")
    call_cost = parse_call_cost_tokens(args.call_cost_tokens)
    if not is_loopback(args.host) and key is None:
        print(f"warning: serving on {args.host} without --api-key-file: anyone who reaches it can use it")
    if args.replicas and args.engine == "process":
        raise ConfigError("--engine process: not with --replicas (each Ray Serve replica runs its engine in a thread; "
                          "leave out --engine or give --engine thread)")
    if args.replicas:
        return _serve_replicas(args, model, config, key, call_cost)
    set_threads(args.threads)
    path = resolve_model_path(model)
    runtime = runtime_from_args(args).model_dump()
    settings = dict(api_key=key, max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
                    shutdown_grace_s=args.shutdown_grace, stream_interval=args.stream_interval)
    engine = dict(max_batch=args.max_batch, max_queue=args.max_queue, admit_min=args.admit_min,
                  admit_wait_s=args.admit_wait, call_cost_tokens=call_cost, align_groups=args.align_groups)
    if args.engine in (None, "process"):
        from refusion.serve.engine_process import EngineSpec, create_process_state

        spec = EngineSpec(str(path), config, engine, threads=args.threads,
                          runtime={**runtime, "trust_remote_code": args.trust_remote_code})
        try:
            state = create_process_state(spec, args.served_model_name or str(model), str(path), **settings)
        except RuntimeError as e:
            raise ConfigError(f"--engine process: {e}") from None
    else:
        backbone = Backbone.from_pretrained(path, **runtime, trust_remote_code=args.trust_remote_code)
        state = create_state(backbone, config, args.served_model_name or str(model), str(path), **engine,
                             **settings)
    serve_forever(state, args.host, args.port, args.log_level)
    return 0


def parse_call_cost_tokens(text: str) -> float | tuple[float, float, float] | None | str:
    """``--call-cost-tokens``: auto, off, N (a call's cost in tokens fed, >= 0) or N,KEY,PAIR (also per
    (row, key) pair and per query-key pair, each >= 0)."""
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 3) or not all(v >= 0 for v in values):
        raise ConfigError(f"--call-cost-tokens: expected auto, off, a number of tokens >= 0 or three "
                          f"(per call, per key, per query-key pair: N,KEY,PAIR), got {text!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _serve_replicas(args: argparse.Namespace, model: str, config: dict, key: str | None,
                    call_cost: float | None | str) -> int:
    """``--replicas N``: N whole servers on Ray Serve behind its proxy (docs/serving.md#replicas)."""
    from refusion.models.loading import runtime_from_args

    try:
        import ray.serve  # noqa: F401  (the extra is installed)

        from refusion.serve.replicas import run_replicas
    except ImportError as e:
        raise ConfigError(f"--replicas needs Ray Serve ({e.name} is missing): pip install -e '.[ray]'") from None
    runtime = runtime_from_args(args).model_dump()
    runtime["trust_remote_code"] = args.trust_remote_code
    print(f"serving {args.replicas} replicas of {model!r} on http://{args.host}:{args.port} (Ray Serve)", flush=True)
    run_replicas(model, config, args.replicas, args.host, args.port, args.served_model_name or str(model), runtime,
                 gpus_per_replica=args.gpus_per_replica, blocking=True, max_batch=args.max_batch,
                 max_queue=args.max_queue, api_key=key, max_body_bytes=args.max_body_bytes,
                 request_timeout_s=args.request_timeout, shutdown_grace_s=args.shutdown_grace, threads=args.threads,
                 admit_min=args.admit_min, admit_wait_s=args.admit_wait, call_cost_tokens=call_cost,
                 align_groups=args.align_groups, stream_interval=args.stream_interval)
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from refusion.serve.loadtest import format_report, run_loadtest, task_prompts, verdicts

    prompts = [args.prompt] if args.prompt else task_prompts(args.task, args.split, args.limit)
    result = run_loadtest(args.url, prompts, args.concurrency, args.requests, args.duration_limit, args.max_tokens,
                          args.disconnect_fraction, _api_key(args.api_key_file), check_offline=args.check_offline)
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(met for _, met, _ in verdicts(result)) else 1


def add_serve_commands(sub, add_model_args) -> None:
    """``refusion serve`` and ``refusion loadtest`` on the command line's subparsers; ``add_model_args`` adds
    the runtime flags and ``--trust-remote-code``."""
    from refusion.core.config import add_decoder_config_args
    from refusion.core.threads import add_threads_arg
    from refusion.experiments.args import add_split_arg
    from refusion.serve.engine import ADMIT_MIN, ADMIT_WAIT_S, CALL_PRICE_CPU, STREAM_INTERVAL
    from refusion.serve.protocol import MAX_BODY_BYTES, REQUEST_TIMEOUT_S

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (needs .[serve])",
                       description="Serve a model and decoder config over an OpenAI-compatible API: "
                       "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (docs/serving.md).")
    add_decoder_config_args(s, model_required=False)  # --bench-row gives the model instead
    s.add_argument("--bench-row", help="serve a row of the bench config (its model and settings for --task)")
    s.add_argument("--task", help="with --bench-row: the tinybench task whose settings to serve")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one)")
    s.add_argument("--max-batch", type=int, default=16, help="sequences decoding together at most (default 16)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a place in the batch at most; more get 429 (default 64)")
    s.add_argument("--admit-min", type=int, default=ADMIT_MIN,
                   help=f"when more requests wait than places are free: admit once this many places are free "
                        f"(default {ADMIT_MIN}; 1: at once)")
    s.add_argument("--admit-wait", type=float, default=ADMIT_WAIT_S,
                   help=f"... or once the oldest waiting request has waited this many seconds "
                        f"(default {ADMIT_WAIT_S:g})")
    s.add_argument("--call-cost-tokens", default="auto", metavar="N[,KEY,PAIR]|auto|off",
                   help=f"a model call's price in tokens fed: N per call, KEY per (row, key) pair, PAIR per "
                        f"query-key pair; rows of different widths or cached lengths go in separate calls when "
                        f"that saves more padding than a call costs (default auto: {CALL_PRICE_CPU.call:g},"
                        f"{CALL_PRICE_CPU.key:g},{CALL_PRICE_CPU.pair:g} on the CPU, off elsewhere; N alone: KEY "
                        f"and PAIR the CPU's there, 0 elsewhere)")
    s.add_argument("--no-align-groups", dest="align_groups", action="store_false",
                   help="run every request group's call in each round (default: where sequences wait in several "
                        "groups, e.g. a speculative drafter's and target's calls, the largest runs and the others "
                        "wait one round, so sequences admitted at different times fall into step)")
    s.add_argument("--stream-interval", type=int, default=STREAM_INTERVAL, metavar="N",
                   help=f"a request's commits are sent once N tokens are pending (its first at once, the rest at "
                        f"its end): fewer, larger chunks (default {STREAM_INTERVAL}; 1: every commit)")
    s.add_argument("--engine", choices=["process", "thread"], default=None,
                   help="where the engine (model, batch, decoding) runs: process (the default), a process of its "
                        "own whose events cross by a pipe, so the HTTP side (event loop, JSON, tokenizer) never "
                        "waits for the engine's interpreter; thread, a thread of the HTTP process. With --replicas "
                        "each replica's engine runs in a thread (thread only)")
    s.add_argument("--api-key-file", help="file holding the API key clients must send as 'Authorization: Bearer KEY'")
    s.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                   help=f"seconds a request may take from arrival to its last token (default {REQUEST_TIMEOUT_S:g})")
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="largest request body (default 1 MiB)")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGINT/SIGTERM: seconds to finish queued and running requests before rejecting them")
    s.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    s.add_argument("--replicas", type=int, default=0,
                   help="run N replicas on Ray Serve (needs .[ray]), one per device with --gpus-per-replica 1")
    s.add_argument("--gpus-per-replica", type=float, default=0, help="with --replicas: GPUs each replica takes")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_model_args(s)
    add_threads_arg(s)
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("loadtest", help="concurrent streamed requests against a server on this machine",
                       description="Send --requests streamed chat completions, --concurrency at a time, to a server "
                       "on a loopback address; report throughput, TTFT and ITL percentiles, errors and delivery.")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback addresses only)")
    t.add_argument("--concurrency", type=int, default=4, help="clients sending at once (default 4)")
    t.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    t.add_argument("--duration-limit", type=float, default=600.0,
                   help="seconds after which no new request is sent and open ones are cut (default 600)")
    t.add_argument("--task", default="arith", help="tinybench task whose prompts to send (default arith)")
    add_split_arg(t)
    t.add_argument("--limit", type=int, default=32, help="distinct prompts of the task, cycled (default 32)")
    t.add_argument("--prompt", help="send this one prompt instead of a task's")
    t.add_argument("--max-tokens", type=int, help="max_tokens of every request (default: the server's gen_length)")
    t.add_argument("--disconnect-fraction", type=float, default=0.0,
                   help="share of requests that hang up after their first text (e.g. 0.1)")
    t.add_argument("--check-offline", action="store_true",
                   help="decode each distinct prompt offline (the server's model and config) and compare")
    t.add_argument("--api-key-file", help="file holding the server's API key")
    t.add_argument("--json", help="also write the report to this JSON file")
    t.set_defaults(func=cmd_loadtest)
