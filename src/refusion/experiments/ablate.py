"""``refusion ablate CONFIG.yaml``: a grid of decoders, parts and knobs x tasks x models.

An ablation file names runs explicitly and/or as a grid (the cartesian product of its axes); each run
starts from the bench's per-task settings for its decoder (``configs/bench/bench.yaml``) and applies its own
``set`` overrides (dotted keys, as ``--set``)::

    name: kv_cache
    title: KV reuse vs recompute (paper Table 8)
    tasks: [arith, code, facts]
    split: test                            # or validation (choose settings there, never on test)
    limit: 50
    baseline: kv_concat                    # speed-ups are over this run, per task
    runs:
      - {label: kv_concat, decoder: refusion, set: {cache: kv_concat}}
      - {label: kv_recompute, decoder: refusion, set: {cache: kv_recompute}}
    grid:                                  # optional
      decoder: refusion
      axes: {selector.slot_threshold: [0.5, 0.7, 0.9]}
    plots:
      - {x: tpf, y: accuracy}              # one point per run, per task (connect: true joins each decoder's)
      - {x: selector.slot_threshold, y: accuracy}   # a line per task along a swept knob
    runtime: {device: cuda, dtype: bfloat16}   # optional: device, dtype, attn_implementation, device_map
    batch_size: 4                          # optional: samples per generate_batch call (default 1)
    seeds: 3                               # optional: every sample decoded with 3 seeds (default 1)

``bench_config`` (default ``configs/bench/bench.yaml``) gives the models and per-task settings runs start from.
A run's ``model`` (a folder or shipped name) overrides the bench's model for its decoder. ``runtime``
(how every model loads: :class:`~refusion.models.loading.Runtime`) overrides the bench config's
``runtime`` option by option, and the command-line flags override both. ``batch_size`` (default: the
bench config's, else 1; ``--batch-size`` overrides it) decodes each run's samples in chunks through
``Decoder.generate_batch``; tokens/s is then the aggregate throughput (``runner.py``). ``seeds`` N > 1
(``--seeds`` overrides it) decodes every sample with each run's ``seed`` and the next N-1: each record
carries its seed, a row pools them and pairs with the baseline by sample and seed (as ``bench --seeds``).

The evaluation engine is the bench's (``runner.py``): every finished sample is appended to
``OUT/samples.jsonl`` at once and ``--resume`` skips finished work. Writes ``results.json``,
``summary.md`` and each plot as PNG and SVG.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from refusion.core.config import ConfigError
from refusion.core.threads import set_threads
from refusion.experiments.bench import load_bench_config, seeds_note
from refusion.experiments.config_files import CONFIGS_DIR, find_config
from refusion.experiments.runner import (
    Run, check_batch_size, evaluate, markdown_table, print_table, summarize, write_json,
)
from refusion.experiments.tables import markdown
from refusion.models.loading import RuntimeOptions, runtime_from_args



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSpec(Strict):
    label: str = Field(description="the run's name in tables and plots (unique)")
    decoder: str = Field(description="a registered decoder (refusion, ar, llada, block, or a plugin's)")
    model: str | None = Field(None, description="model folder or shipped name (default: the bench's for the decoder)")
    set: dict[str, Any] = Field(default_factory=dict, description="dotted overrides of the decoder config")


class GridSpec(Strict):
    decoder: str = Field(description="the decoder of every grid point")
    model: str | None = Field(None, description="model folder or shipped name (default: the bench's for the decoder)")
    set: dict[str, Any] = Field(default_factory=dict, description="overrides shared by every grid point")
    axes: dict[str, list[Any]] = Field(description="dotted key -> values; the runs are their cartesian product")


class PlotSpec(Strict):
    x: str = Field(description="a metric of the summary (tpf, tokens_per_second, nfe_mean, latency_s_mean, accuracy) or a swept dotted key")
    y: str = Field("accuracy", description="a metric of the summary")
    title: str | None = Field(None, description="the plot's title (default: 'y vs x')")
    connect: bool = Field(False, description="join each decoder's runs in x order (a trade-off frontier)")


class AblationConfig(Strict):
    name: str = Field(description="the ablation's name (results.json, the results page's section)")
    title: str = Field("", description="a one-line title for tables and the results page")
    tasks: list[str] = Field(["arith", "code", "facts"], description="tinybench tasks to run on")
    split: str = Field("test", description="test or validation (choose settings on validation, never on test)")
    limit: int | None = Field(50, description="samples per task (None: the whole split)")
    baseline: str | None = Field(None, description="the label of the run speed-ups are over, per task")
    runs: list[RunSpec] = Field([], description="runs named one by one (RunSpec)")
    grid: GridSpec | None = Field(None, description="runs as the cartesian product of axes (GridSpec)")
    plots: list[PlotSpec] = Field([], description="plots written as PNG and SVG (PlotSpec)")
    bench_config: str | None = Field(None, description="the bench config runs start from: a file or a shipped one's "
                                                       "name (default configs/bench/bench.yaml)")
    runtime: RuntimeOptions = Field(default_factory=RuntimeOptions,
                                    description="device, dtype, attn_implementation, device_map, compile: over the bench "
                                                "config's runtime, under the flags")
    batch_size: int | None = Field(None, ge=1, description="samples per Decoder.generate_batch call (default: the "
                                                           "bench config's batch_size; --batch-size overrides)")
    seeds: int = Field(1, ge=1, description="decode every sample with this many seeds (each run's seed and the next "
                                            "ones); rows pool them, paired by sample and seed (--seeds overrides)")

    @model_validator(mode="after")
    def _has_runs(self) -> "AblationConfig":
        if not self.runs and self.grid is None:
            raise ValueError("give `runs` or a `grid` (or both)")
        return self


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    for noise in ("typing.", "refusion.experiments.ablate.", "refusion.models.loading."):
        text = text.replace(noise, "")
    return text


def schema_markdown() -> str:
    """The ablation file's schema as markdown tables, generated from :class:`AblationConfig` and the models of
    its fields (docs/bench.md holds this text; a test keeps them equal)."""
    out = []
    for model in (AblationConfig, RunSpec, GridSpec, PlotSpec, RuntimeOptions):
        out += [f"`{model.__name__}`" + (" (the file's top level)" if model is AblationConfig else "") + ":", ""]
        body = []
        for fname, info in model.model_fields.items():
            if info.is_required():
                default = "required"
            elif info.default_factory is not None:
                made = info.default_factory()
                empty = isinstance(made, RuntimeOptions) and not made.model_dump(exclude_none=True)
                default = "`" + ("{}" if empty else repr(made)) + "`"
            else:
                default = f"`{info.default!r}`"
            meaning = (info.description or ("as the flag --" + fname.replace("_", "-") + " (docs/gpu.md, runtime options)"
                                            if model is RuntimeOptions else "")).replace("|", "\\|")
            kind = _type_name(info.annotation).replace("|", "\\|")
            body.append([f"`{fname}`", f"`{kind}`", default, meaning])
        out += [*markdown(["field", "type", "default", "meaning"], body).splitlines(), ""]
    return "\n".join(out).rstrip() + "\n"


def load_ablation(path: str | Path) -> AblationConfig:
    """The ablation file at ``path``, or the shipped one of that name (:func:`~refusion.experiments.config_files.find_config`:
    ``kv_cache``, ``kv_cache.yaml``, ``tune_bench.yaml``)."""
    p = find_config(path, what="ablation config")
    if p.parent.name == "bench" and p.parent.parent == CONFIGS_DIR:
        raise ConfigError(f"ablation config {str(path)!r}: {p.name} is a bench config (refusion bench --config)")
    try:
        return AblationConfig.model_validate(yaml.safe_load(p.read_text()))
    except ValidationError as e:
        raise ConfigError(f"ablation config {p}: " + "; ".join(
            f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def build_runs(cfg: AblationConfig, batch_size: int | None = None, seeds: int | None = None) -> list[Run]:
    """The runs of ``cfg``, each decoding in chunks of ``batch_size`` (default: the file's ``batch_size``,
    else the bench config's), every sample with ``seeds`` seeds (default: the file's ``seeds``)."""
    from refusion.tasks import get_task

    bench = load_bench_config(cfg.bench_config)
    batch_size = check_batch_size(batch_size) or cfg.batch_size or bench.batch_size
    seeds = check_batch_size(seeds, "--seeds") or cfg.seeds
    specs: list[tuple[str, str, str | None, dict[str, Any], dict[str, Any]]] = [
        (r.label, r.decoder, r.model, r.set, {}) for r in cfg.runs]
    if cfg.grid:
        keys = list(cfg.grid.axes)
        for values in itertools.product(*cfg.grid.axes.values()):
            params = dict(zip(keys, values))
            label = " ".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in params.items())
            specs.append((label, cfg.grid.decoder, cfg.grid.model, {**cfg.grid.set, **params}, params))
    runs = []
    for label, decoder, model, sets, params in specs:
        model = model or bench.models.get(decoder)
        if model is None:
            raise ConfigError(f"run {label!r}: no model given and none configured for decoder {decoder!r} in the bench")
        overrides = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                     for k, v in sets.items()]
        configs = {t: bench.decoder_config(t, decoder, get_task(t).max_new_tokens, overrides) for t in cfg.tasks}
        runs.append(Run(label=label, model=model, configs=configs, params=params, batch_size=batch_size, seeds=seeds))
    return runs


def plot(rows: list[dict[str, Any]], spec: PlotSpec, out: Path, stem: str) -> list[Path]:
    from refusion.experiments.figures import legend_below, save, task_panels
    from refusion.tasks import chance_accuracy

    tasks = sorted({r["task"] for r in rows})
    swept = spec.x in rows[0] and spec.x not in ("tpf", "tokens_per_second", "nfe_mean", "accuracy", "latency_s_mean")
    scale = (lambda v: 100 * v) if spec.y == "accuracy" else (lambda v: v)
    labels = list(dict.fromkeys(r["run"] for r in rows))
    legend_h = 0.0 if swept else 0.25 * ((len(labels) + 3) // 4) + 0.1  # inches below the axes
    fig, axes = task_panels(len(tasks), height=3.6 + legend_h)
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    colors = {d: f"C{i}" for i, d in enumerate(decoders)}  # one colour per decoder, or per run if only one

    def color(r: dict[str, Any]) -> str:
        return colors[r["decoder"]] if len(decoders) > 1 else f"C{labels.index(r['run']) % 10}"

    markers = "osD^v<>pPX*h"
    for ax, task in zip(axes, tasks):
        pts = [r for r in rows if r["task"] == task and r.get(spec.x) is not None]
        if swept:
            pts.sort(key=lambda r: r[spec.x])
            ax.plot([r[spec.x] for r in pts], [scale(r[spec.y]) for r in pts], marker="o")
        else:  # one marker per run, one colour per decoder; the legend names the runs
            if spec.connect:
                for d in decoders:
                    line = sorted((r for r in pts if r["decoder"] == d), key=lambda r: r[spec.x])
                    ax.plot([r[spec.x] for r in line], [scale(r[spec.y]) for r in line], color=colors[d], alpha=0.4)
            for r in pts:
                i = labels.index(r["run"])
                ax.scatter(r[spec.x], scale(r[spec.y]), s=45, color=color(r),
                           marker=markers[i % len(markers)], label=r["run"], zorder=3)
        ax.set(title=task, xlabel=spec.x, ylabel=spec.y + (" %" if spec.y == "accuracy" else ""))
        if spec.y == "accuracy":  # the full scale, so that 0% vs 5% does not look like a trend
            ax.set_ylim(-3, 103)
            guess = chance_accuracy(task)
            if guess:
                ax.axhline(100 * guess, ls=":", color="gray")
                ax.annotate("chance", (0.01, 100 * guess), xycoords=("axes fraction", "data"), fontsize=7,
                            color="gray", va="bottom")
        ax.grid(alpha=0.3)
    handles = {} if swept else {h.get_label(): h for ax in axes for h in ax.collections}
    legend_below(fig, [handles[lbl] for lbl in labels if lbl in handles], [lbl for lbl in labels if lbl in handles],
                 ncol=min(4, len(handles)), title=spec.title or f"{spec.y} vs {spec.x}",
                 bottom=legend_h / (3.6 + legend_h), fontsize=8)
    return save(fig, out, stem)


def run_ablation(config: str | Path, out: Path, resume: bool = False, limit: int | None = None,
                 runtime: RuntimeOptions | None = None, batch_size: int | None = None,
                 rerun_changed: bool = False, seeds: int | None = None) -> list[dict[str, Any]]:
    """Run one ablation; models load with the bench config's ``runtime:``, overridden by the ablation's,
    overridden by ``runtime`` (the flags); ``batch_size`` and ``seeds`` (the flags) override the file's. ``resume``
    continues only a folder the same configs started; ``rerun_changed`` decodes the changed runs anew
    (:func:`runner.evaluate`)."""
    import torch

    cfg = load_ablation(config)
    runs = build_runs(cfg, batch_size, seeds)
    seeds = runs[0].seeds if runs else 1
    limit = limit or cfg.limit
    options = load_bench_config(cfg.bench_config).runtime.override(cfg.runtime).override(runtime)
    inputs = {"ablation": cfg.model_dump(mode="json"), "limit": limit, **({"seeds": seeds} if seeds > 1 else {})}
    records = evaluate(runs, cfg.tasks, cfg.split, limit, out, resume=resume, runtime=options, desc=cfg.name,
                       rerun_changed=rerun_changed, command="ablate", inputs=inputs)
    rows = summarize(records, runs, baseline=cfg.baseline)
    write_json(out / "results.json", rows)
    extra = list(cfg.grid.axes) if cfg.grid else []
    figures = [plot(rows, spec, out, f"{cfg.name}_{i}")[0].name for i, spec in enumerate(cfg.plots)]
    batch = f", batch size {runs[0].batch_size} (tokens/s: aggregate)" if runs and runs[0].batch_size > 1 else ""
    threads = torch.get_num_threads()
    batch += f", {threads} torch thread{'s' * (threads != 1)}" + seeds_note(seeds)
    summary = [f"# {cfg.title or cfg.name}\n", f"{cfg.split} split, {limit or 'all'} samples per task{batch}; "
               f"speed-up over `{cfg.baseline}`.\n" if cfg.baseline else
               f"{cfg.split} split, {limit or 'all'} samples per task{batch}.\n",
               markdown_table(rows, extra)] + [f"\n![{f}]({f})\n" for f in figures]
    (out / "summary.md").write_text("\n".join(summary))
    return rows


def add_ablate_command(sub) -> None:
    from refusion.experiments.args import (
        add_batch_size_arg, add_machine_args, add_output_args, add_resume_args, add_seeds_arg,
    )

    p = sub.add_parser("ablate", help="run an ablation grid (decoders, parts, knobs x tasks x models)")
    p.add_argument("config", help="ablation YAML, or the name of a shipped one (experiments/configs/{ablations,tuning,research}/)")
    add_output_args(p, None, "default runs/ablate/NAME", None, "overrides the file's limit")
    add_resume_args(p)
    add_batch_size_arg(p, "the file's batch_size, else the bench config's, else 1")
    add_seeds_arg(p, default=None, default_help="the file's seeds, else 1")
    add_machine_args(p, device_help="cpu, cuda or cuda:N (default: the file's runtime.device, else cpu)")
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(a) -> int:
    set_threads(a.threads)
    cfg = load_ablation(a.config)
    out = Path(a.out or f"runs/ablate/{cfg.name}")
    rows = run_ablation(a.config, out, a.resume, a.limit, runtime_from_args(a), a.batch_size, a.rerun_changed,
                        seeds=a.seeds)
    seeds = max((r.get("seeds", 1) for r in rows), default=1)
    title = (cfg.title or cfg.name) + (f" ({seeds} seeds pooled)" if seeds > 1 else "")
    print_table(rows, title=title, extra=list(cfg.grid.axes) if cfg.grid else [])
    print(f"wrote {out / 'results.json'}, {out / 'summary.md'}, {out / 'manifest.json'} and plots in {out}")
    return 0
