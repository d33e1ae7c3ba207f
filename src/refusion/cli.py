"""The ``refusion`` command line: generate, plugins, check-plugin, bench, batch-bench, profile, trace, ablate, results, train, eval,
eval-table, serve, loadtest."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from refusion.core.config import ConfigError, add_decoder_config_args, decoder_config


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The runtime flags (``--device``, ``--dtype``, ``--attn-implementation``, ``--device-map``) and
    ``--trust-remote-code``."""
    from refusion.models.loading import add_runtime_args

    add_runtime_args(p)
    p.add_argument("--trust-remote-code", action="store_true", help="run the model folder's own modeling code (LLaDA, Dream: instead of the native path; off by default)")


def cmd_generate(args: argparse.Namespace) -> int:
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt
    from refusion.models.loading import runtime_from_args
    from refusion.core.threads import set_threads

    set_threads(args.threads)
    cfg = decoder_config(args.decoder, args.config, args.set)
    from refusion.core.config import validate_config

    validate_config(cfg)  # fail on a bad config or prompt before loading a model
    if not args.prompt:
        raise ConfigError("--prompt: empty prompt; give some text")
    backbone = Backbone.from_pretrained(
        args.model, **runtime_from_args(args).model_dump(), trust_remote_code=args.trust_remote_code
    )
    decoder = build_decoder(backbone, cfg)
    prompt_ids = encode_prompt(backbone.tokenizer, args.prompt, chat=not args.no_chat_template)
    streamed = StreamedText(backbone.tokenizer, json_lines=args.json) if args.stream else None
    result = decoder.generate(prompt_ids, on_commit=streamed)
    if args.json:
        print(json.dumps(result.as_dict(with_trace=args.trace)))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(markup=False)  # model text, labels and paths print as they are
    if streamed is not None:
        streamed.close()
    elif result.text:
        console.print(result.text, highlight=False)
    if not result.text:
        console.print("(empty completion: the model ended at once)", style="dim")
    table = Table(title=f"{cfg['decoder']} on {args.model}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    for key, value in result.stats.as_dict().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    return 0


class StreamedText:
    """Prints a decode's text as it becomes final (``generate --stream``): each commit extends the text,
    which is written as far as it decodes to whole characters. With ``json_lines``, one JSON object per
    commit (positions, token ids, the new text) instead."""

    def __init__(self, tokenizer, json_lines: bool = False) -> None:
        self.tokenizer, self.json_lines = tokenizer, json_lines
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, commit) -> None:
        self.ids += commit.token_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        new = text[len(self.shown):] if not text.endswith("\ufffd") else ""  # hold back a partial character
        if self.json_lines:
            print(json.dumps({"positions": commit.positions, "token_ids": commit.token_ids, "text": new}), flush=True)
        else:
            sys.stdout.write(new)
            sys.stdout.flush()
        self.shown += new

    def close(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        sys.stdout.write(text[len(self.shown):] + ("\n" if text else ""))
        sys.stdout.flush()


def cmd_plugins(args: argparse.Namespace) -> int:
    from refusion.core.registry import get_registry

    rows = get_registry().entries()
    if args.json:
        print(json.dumps([{"kind": e.kind, "name": e.name, "class": f"{e.cls.__module__}.{e.cls.__qualname__}",
                           "origin": e.origin} for e in rows]))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="registered parts")
    for col in ("kind", "name", "class", "origin"):
        table.add_column(col)
    for e in rows:
        table.add_row(e.kind, e.name, f"{e.cls.__module__}.{e.cls.__qualname__}", e.origin)
    from refusion.experiments.tables import print_fitted

    print_fitted(table, "`refusion plugins --json` prints every field", Console(markup=False))
    return 0


def _matches(origin: str, name: str) -> bool:
    """Whether a registry origin ("entry point N (DIST VERSION)", "builtin MODULE", "plugin N") is ``name``'s:
    its entry-point name, distribution (case, ``-`` and ``_`` alike), module or plugin name; ``builtin``
    names every built-in part."""
    def norm(text: str) -> str:
        return text.lower().replace("_", "-")

    if name == "builtin":
        return origin.startswith("builtin ")
    words = origin.replace("(", " ").replace(")", " ").split()
    if origin.startswith("entry point "):
        return norm(name) in (norm(words[2]), norm(words[3]))
    return norm(name) == norm(words[-1])


def cmd_check_plugin(args: argparse.Namespace) -> int:
    """Run refusion.testing's check of its kind on every part ``NAME`` registered, and the decoder
    invariants of every decoder that takes such a part with that part drawn (or of a registered decoder)."""
    try:
        from refusion.testing import checks
    except ImportError as e:
        raise ConfigError(str(e)) from None
    from refusion.core.config import part_fields
    from refusion.core.registry import get_registry
    from refusion.core.threads import set_threads

    set_threads(args.threads)
    registry = get_registry()
    entries = [e for e in registry.entries() if _matches(e.origin, args.name)]
    if not entries:
        origins = sorted({e.origin for e in registry.entries() if not e.origin.startswith("builtin ")})
        raise ConfigError(f"no registered part comes from {args.name!r}; plugins: {', '.join(origins) or 'none'} "
                          "(or 'builtin')")
    runs = []  # (label, callable)
    for e in entries:
        if e.kind == "decoder":
            runs.append((f"decoder {e.name}", lambda e=e: checks.check_decoder(
                e.name, args.max_examples, registry=registry, raise_on_failure=False)))
        elif e.kind in checks.CHECKS:
            runs.append((f"{e.kind} {e.name}", lambda e=e: checks.CHECKS[e.kind](
                e.cls, None, args.max_examples, registry=registry, raise_on_failure=False)))
            if not args.no_decoders:
                for dec in registry.names("decoder"):
                    if e.kind in part_fields(registry.get("decoder", dec).Options):
                        runs.append((f"decoder {dec} with {e.kind} {e.name}", lambda e=e, dec=dec: checks.check_decoder(
                            dec, args.max_examples, registry=registry, parts={e.kind: [e.name]},
                            raise_on_failure=False)))
        else:
            print(f"skip  {e.kind} {e.name}: no check for this kind")
    failed = 0
    for label, run in runs:
        report = run()
        status = "ok  " if report.ok else "FAIL"
        print(f"{status}  {label}: {len(report.passed)} of {len(report.passed) + len(report.failed)} properties hold",
              flush=True)
        if not report.ok:
            failed += 1
            print(report.message().replace(f"{report.kind} {report.name}", label, 1), flush=True)
    print(f"{len(runs) - failed} of {len(runs)} checks passed for {args.name}")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the completion with stats")
    add_decoder_config_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--trace", action="store_true", help="with --json: include the per-iteration trace")
    g.add_argument("--stream", action="store_true",
                   help="print the text as it becomes final (with --json: one JSON line per commit, then the result)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as is")
    _add_model_args(g)
    from refusion.core.threads import add_threads_arg

    add_threads_arg(g)
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("plugins", help="list every registered part with its kind and origin")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    c = sub.add_parser("check-plugin", help="check every part an installed plugin registered against its kind's contract",
                       description="Run refusion.testing's check of its kind on every part NAME registered (its "
                       "reorder, position and padding properties with hypothesis), and the decoder invariants of "
                       "each decoder that takes such a part, with that part drawn. Exit 1 with the failing examples.")
    c.add_argument("name", metavar="NAME", help="a distribution (refusion-plugin-example), an entry-point or plugin "
                   "module name, or 'builtin'")
    c.add_argument("--max-examples", type=int, default=50, help="examples per property (default 50)")
    c.add_argument("--no-decoders", action="store_true", help="check the parts alone, not inside the decoders")
    from refusion.core.threads import add_threads_arg as _threads

    _threads(c)
    c.set_defaults(func=cmd_check_plugin)

    from refusion.experiments.ablate import add_ablate_command
    from refusion.experiments.batching import add_batching_command
    from refusion.experiments.bench import add_bench_command
    from refusion.experiments.profile import add_profile_command
    from refusion.experiments.results import add_results_command
    from refusion.experiments.trace_view import add_trace_command
    from refusion.eval.cli import add_eval_command
    from refusion.eval.table import add_eval_table_command
    from refusion.training.cli import add_train_command

    add_bench_command(sub)
    add_batching_command(sub)
    add_profile_command(sub)
    add_ablate_command(sub)
    add_results_command(sub)
    add_trace_command(sub)
    add_train_command(sub)
    add_eval_command(sub)
    add_eval_table_command(sub)
    from refusion.serve.cli import add_serve_commands

    add_serve_commands(sub, _add_model_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
