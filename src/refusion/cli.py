"""The ``refusion`` command line: generate, plugins, bench, batch-bench, profile, trace, ablate, results, train, eval,
eval-table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from refusion.core.config import ConfigError, decoder_config


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
    Console(markup=False).print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt and print the completion with stats")
    g.add_argument("--model", required=True, help="model folder or shipped checkpoint name")
    g.add_argument("--decoder", default="", help="registered decoder name (refusion, ar, ...)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--config", help="YAML or TOML decoder config ('-': YAML from standard input)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
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
