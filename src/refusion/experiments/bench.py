"""``refusion bench``: every decoder on every tinybench task with its shipped checkpoint.

For each sample of the split, every decoder decodes the same prompt in turn (interleaved, so machine
noise hits all decoders alike); each finished sample is appended to ``samples.jsonl`` at once and a
rerun with ``--resume`` skips what is done. The summary (``results.json``, schema in docs/bench.md) has
one row per task x decoder: accuracy, tokens/s (total generated tokens / total decode time), the
median per-sample tokens/s, TPF (tokens / forwards), mean NFE, mean latency and the speed-up over ``ar``
measured in the same run. A plot of accuracy against tokens/s per task is written as PNG and SVG.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from refusion.core.config import ConfigError, apply_overrides, build_decoder
from refusion.experiments.records import RecordWriter, done_keys, load_records

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "bench.yaml"
KEY = ("task", "decoder", "idx")


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    models: dict[str, str] = Field(description="decoder name -> model folder or shipped checkpoint")
    decoders: dict[str, dict[str, Any]] = Field(default_factory=dict, description="decoder -> shared settings")
    tasks: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict, description="task -> decoder -> overrides")

    def decoder_config(self, task: str, decoder: str, gen_length: int, overrides: list[str]) -> dict[str, Any]:
        cfg = {"decoder": decoder, "gen_length": gen_length, **self.decoders.get(decoder, {})}
        for key, value in self.tasks.get(task, {}).get(decoder, {}).items():
            cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) and isinstance(value, dict) else value
        return apply_overrides(cfg, overrides)


def load_bench_config(path: str | Path | None) -> BenchConfig:
    p = Path(path) if path else DEFAULT_CONFIG
    try:
        return BenchConfig.model_validate(yaml.safe_load(p.read_text()))
    except Exception as e:  # pydantic or YAML error: name the file
        raise ConfigError(f"bench config {p}: {e}") from None


@dataclass
class BenchArgs:
    tasks: list[str]
    decoders: list[str]
    limit: int | None
    out: Path
    split: str = "test"
    config: str | None = None
    overrides: tuple[str, ...] = ()
    resume: bool = False
    device: str = "cpu"


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (task, decoder) with accuracy and speed; speed-up over ``ar`` on the same task."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["decoder"]), []).append(r)
    rows = []
    for (task, dec), rs in sorted(groups.items()):
        tokens, wall = sum(r["generated_tokens"] for r in rs), sum(r["wall_s"] for r in rs)
        nfe = sum(r["nfe"] for r in rs)
        rows.append({
            "task": task, "decoder": dec, "model": rs[0]["model"], "n": len(rs),
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "tokens_per_second": tokens / wall if wall else 0.0,
            "tokens_per_second_median": statistics.median(r["generated_tokens"] / r["wall_s"] for r in rs),
            "tpf": tokens / nfe if nfe else 0.0,
            "nfe_mean": nfe / len(rs),
            "latency_s_mean": wall / len(rs),
            "generated_tokens_mean": tokens / len(rs),
        })
    ar = {r["task"]: r["tokens_per_second"] for r in rows if r["decoder"] == "ar"}
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar[r["task"]] if ar.get(r["task"]) else None
    return rows


def print_table(rows: list[dict[str, Any]], title: str = "refusion bench") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = [("task", "task"), ("decoder", "decoder"), ("n", "n"), ("accuracy", "acc %"),
            ("tokens_per_second", "tok/s"), ("tpf", "TPF"), ("nfe_mean", "NFE"),
            ("latency_s_mean", "latency s"), ("speedup_vs_ar", "x ar")]
    for _, head in cols:
        table.add_column(head, justify="left" if head in ("task", "decoder") else "right")
    for r in rows:
        cells = []
        for key, _ in cols:
            v = r[key]
            cells.append("-" if v is None else f"{100 * v:.1f}" if key == "accuracy" else
                         f"{v:.2f}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    Console().print(table)


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy against tokens/s, one panel per task; writes bench.png and bench.svg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    decoders = sorted({r["decoder"] for r in rows})
    colors = {d: plt.cm.tab10(i) for i, d in enumerate(decoders)}
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in rows if r["task"] == task):
            ax.scatter(r["tokens_per_second"], 100 * r["accuracy"], s=60, color=colors[r["decoder"]], label=r["decoder"])
            ax.annotate(f"{r['decoder']}\nTPF {r['tpf']:.1f}", (r["tokens_per_second"], 100 * r["accuracy"]),
                        textcoords="offset points", xytext=(6, -4), fontsize=8)
        ax.set_title(task)
        ax.set_xlabel("tokens / s")
        ax.set_ylabel("accuracy %")
        ax.set_ylim(-5, 105)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    fig.suptitle("tinybench: accuracy vs decoding speed")
    fig.tight_layout()
    paths = [out / "bench.png", out / "bench.svg"]
    for p in paths:
        fig.savefig(p, dpi=130)
    plt.close(fig)
    return paths


def run_bench(args: BenchArgs) -> list[dict[str, Any]]:
    from refusion.cli import encode_prompt
    from refusion.models.backend import Backbone
    from refusion.tasks import get_task

    cfg = load_bench_config(args.config)
    tasks = [get_task(t) for t in args.tasks]
    unknown = [d for d in args.decoders if d not in cfg.models]
    if unknown:
        raise ConfigError(f"--decoders: no model configured for {unknown}; configured: {', '.join(cfg.models)}")
    args.out.mkdir(parents=True, exist_ok=True)
    samples_path = args.out / "samples.jsonl"
    if samples_path.exists() and not args.resume:
        raise ConfigError(f"{samples_path} exists: pass --resume to continue that run, or choose another --out")
    records = load_records(samples_path)
    done = done_keys(records, KEY)

    backbones = {d: Backbone.from_pretrained(cfg.models[d], device=args.device) for d in args.decoders}
    decoders = {}
    for task in tasks:  # validate every config before decoding anything
        for d in args.decoders:
            decoders[task.name, d] = build_decoder(
                backbones[d], cfg.decoder_config(task.name, d, task.max_new_tokens, list(args.overrides)))
    examples = {t.name: t.examples(args.split, args.limit) for t in tasks}
    todo = [(t, i, d) for t in tasks for i in range(len(examples[t.name])) for d in args.decoders
            if (t.name, d, i) not in done]
    for d in args.decoders:  # warm-up, untimed, so the first timed sample pays no one-off costs
        ex = examples[tasks[0].name][0]
        decoders[tasks[0].name, d].generate(encode_prompt(backbones[d].tokenizer, ex.query))
    with RecordWriter(samples_path) as writer:
        for task, i, d in tqdm(todo, desc="bench", unit="decode", dynamic_ncols=True):
            ex = examples[task.name][i]
            res = decoders[task.name, d].generate(encode_prompt(backbones[d].tokenizer, ex.query))
            rec = {"task": task.name, "decoder": d, "idx": i, "model": cfg.models[d],
                   "correct": bool(task.score(ex, res.text)), "generated_tokens": res.stats.generated_tokens,
                   "nfe": res.stats.nfe, "wall_s": res.stats.wall_s, "completion": res.text}
            writer.write(rec)
            records.append(rec)
    wanted = {(t.name, d) for t in tasks for d in args.decoders}
    rows = summarize([r for r in records if (r["task"], r["decoder"]) in wanted])
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out)
    return rows


def add_bench_command(sub) -> None:
    p = sub.add_parser("bench", help="every decoder on every tinybench task: accuracy and speed table")
    p.add_argument("--tasks", default="arith,code,facts", help="comma-separated tinybench tasks")
    p.add_argument("--decoders", default="", help="comma-separated decoders (default: all configured)")
    p.add_argument("--limit", type=int, default=100, help="samples per task (default 100; 0 = whole split)")
    p.add_argument("--split", default="test", choices=["validation", "test"])
    p.add_argument("--out", default="runs/bench", help="output folder (samples.jsonl, results.json, plots)")
    p.add_argument("--config", help="bench YAML (default: the shipped experiments/configs/bench.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override every decoder config")
    p.add_argument("--resume", action="store_true", help="continue a run in --out, skipping finished samples")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_bench)


def cmd_bench(a) -> int:
    cfg = load_bench_config(a.config)
    args = BenchArgs(
        tasks=[t for t in a.tasks.split(",") if t], decoders=[d for d in a.decoders.split(",") if d] or list(cfg.models),
        limit=a.limit or None, out=Path(a.out), split=a.split, config=a.config, overrides=tuple(a.set),
        resume=a.resume, device=a.device,
    )
    rows = run_bench(args)
    print_table(rows, title=f"refusion bench ({args.split} split, {args.limit or 'all'} per task)")
    print(f"wrote {args.out / 'results.json'}, {args.out / 'bench.png'}, {args.out / 'samples.jsonl'}")
    return 0
