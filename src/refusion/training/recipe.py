"""The controlled recipe behind the shipped ``tiny-*`` checkpoints.

Stages (each writes its result and is skipped when the recipe is run again; an interrupted training
stage resumes from its ``trainer_state.pt``):

1. ``tokenizer``: the tinybench BPE (:func:`refusion.tasks.tokenizer.build_tinybench_tokenizer`),
   saved to ``OUT/tokenizer``;
2. ``pretrain``: a fresh ``tiny`` Qwen3 (3.4M parameters with the 1024-token vocabulary) trained from
   scratch with ``ar`` on tinybench train for P steps -> ``OUT/tiny-base``;
   With ``--base-ar-steps B`` (default 3000), ``base-ar`` then trains the base B more steps with ``ar`` under
   the fine-tune schedule -> ``OUT/tiny-base`` (the P-step base kept in ``OUT/work/pretrain/model``);
3. ``finetune-<obj>`` for ``refusion``, ``ar``, ``mdm``, ``block``: each starts from the SAME
   ``tiny-base`` checkpoint and trains F steps on the same data, batch size and learning-rate schedule
   -> ``OUT/tiny-<obj>``;
   With ``--refine-steps R`` (default 2400), ``refine-<obj>`` then trains each R more steps under a fresh
   schedule (peak lr 5e-4, 100 warmup steps, data order seeded ``seed + 1``) -> ``OUT/tiny-<obj>``, the
   F-step model kept in ``OUT/work/finetune-<obj>/model``; with ``--refine-rounds N`` (default 8) that
   stage runs N times, round r >= 2 as ``refine<r>-<obj>`` from round r - 1's model (kept in that round's
   ``OUT/work/<stage>/model``), data order seeded ``seed + r``;
4. ``OUT/recipe_summary.json``: per stage wall time, steps, batch size, lr, params, final train
   metrics and validation metrics (``masked_acc`` for diffusion objectives), rewritten after every stage.

From refine round ``--long-slots-from`` (default 6; 0: never) the ``refusion`` arm draws its slot sizes
from ``LONG_SLOT_SIZES`` instead of the reference's {4, 8, 16, 32} (:func:`objective_options`); from
round ``--mix-from`` (default 7; 0: never) every arm trains on ``LATE_MIX`` (:func:`stage_data`).
``--adopt STAGE=RUN`` makes a finished ``refusion train`` run a refine stage, after checking that its
saved settings are the stage's (:func:`adopt_stage`).

Training logs and resumable states live in ``OUT/work/<stage>/``; the ``tiny-*`` folders are plain
Hugging Face folders (bf16 safetensors + tokenizer) ready to copy into ``src/refusion/checkpoints/``.
To redo a stage, delete ``OUT/work/<stage>`` and its output folder.

Batches are grouped by length (``GROUP_BY_LENGTH``) except for objectives that set
``wants_random_batches`` (``mdm``, whose EOS padding to the batch's longest response is what teaches a
LLaDA-style model where an answer ends); each stage records its ``group_by_length``.

Defaults (below) and why (docs/training.md; the runs behind each choice: docs/history/training.md):
P = 3600 pretraining steps, so that the base itself does arithmetic (the hybrid objective keeps an AR
skill the base has far better than it teaches one); B = 3000 more ``ar`` steps before the objectives
branch, for the same reason (ReFusion, too, starts from a tuned AR model); F = 3000 fine-tuning steps and
N = 8 refine rounds of R = 2400 steps, since the hybrid arm keeps improving with more steps; longer slots
for the ``refusion`` arm from round 6 and the facts-heavier mix for every arm from round 7, since facts is
the task the hybrid arm learns slowest. Every arm gets the same base, steps, rounds, schedules and data,
so the comparison stays controlled. With ``--jobs N`` the fine-tunes and refine rounds run in N one-thread
worker processes; on 2 CPU cores (``--jobs 2``) the whole recipe takes ~28 h, a one-thread step ~1.2-1.4 s
for ``ar`` and ``refusion`` and ~2.3-2.5 s for ``block`` and ``mdm``.

Why one module of about 490 lines: its stages share one summary file and one folder layout, which
:func:`run_recipe`, :func:`adopt_stage`, the fine-tune workers and :func:`report` all read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from refusion.training.config import RecipeConfig

_DEFAULTS = {name: info.default for name, info in RecipeConfig.model_fields.items() if not info.is_required()}
GROUP_BY_LENGTH = _DEFAULTS["group_by_length"]  # RecipeConfig's defaults (training/config.py)
LONG_SLOTS_FROM_ROUND, MIX_FROM_ROUND = _DEFAULTS["long_slots_from"], _DEFAULTS["mix_from"]
REFINE_LR = 5e-4
REFINE_WARMUP = 100
LONG_SLOT_SIZES = [16, 32]
LATE_MIX = "tinybench:facts=3"
SUMMARY_FILE = "recipe_summary.json"
STAGE_FILE = "stage.json"


def refine_stage(objective: str, round_: int) -> str:
    """The name of refine round ``round_`` (1-based) of ``objective``: ``refine-ar``, ``refine2-ar``, ..."""
    return f"refine-{objective}" if round_ == 1 else f"refine{round_}-{objective}"


def objective_options(name: str, round_: int, long_slots_from: int = LONG_SLOTS_FROM_ROUND) -> dict | None:
    """Options of ``name``'s objective in refine round ``round_`` (0: the fine-tune); None: its defaults.

    From round ``long_slots_from`` on (0: never) the ``refusion`` arm draws its slot sizes from
    ``LONG_SLOT_SIZES`` instead of the reference's {4, 8, 16, 32}: with short slots a facts answer's
    judgement of an option is mostly trained with the stated value out of view (docs/training.md)."""
    if name == "refusion" and long_slots_from and round_ >= long_slots_from:
        return {"slot_sizes": list(LONG_SLOT_SIZES)}
    return None


def stage_data(round_: int, mix_from: int = MIX_FROM_ROUND) -> str:
    """The training data of refine round ``round_`` (0: the fine-tune) for every arm: tinybench, and from
    round ``mix_from`` on (0: never) ``LATE_MIX``, tinybench with each facts example three times: facts,
    whose short examples cost a third of a mixed step, is the task the hybrid arm learns slowest
    (docs/training.md)."""
    return LATE_MIX if mix_from and round_ >= mix_from else "tinybench"


def refine_warmup(refine_steps: int) -> int:
    """Warmup steps of a refine round of ``refine_steps`` steps."""
    return min(REFINE_WARMUP, max(1, refine_steps // 20))


def stage_grouping(name: str, group_by_length: int) -> int:
    """Length grouping of ``name``'s stages: none for objectives that want random batches (``mdm``, whose
    EOS padding to the batch's longest response needs mixed lengths)."""
    from refusion.plugins.objectives import OBJECTIVES as OBJ_CLASSES

    return 0 if OBJ_CLASSES[name].wants_random_batches else group_by_length


def _check_from_rounds(long_slots_from: int, mix_from: int) -> None:
    for field, value in (("long_slots_from", long_slots_from), ("mix_from", mix_from)):
        if value < 0:
            raise ValueError(f"{field} must be a refine round >= 1, or 0 for never; got {value}")


def _stage_done(work: Path) -> dict | None:
    f = work / STAGE_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically; fine-tune workers write the same summary at once, so each
    write goes through its own temporary file (with a shared ``.tmp`` name one worker's replace can fail)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2, default=str))
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would carry over to the summary
    os.replace(tmp, path)


def run_recipe(config: RecipeConfig | str | os.PathLike, on_start: Callable[[], None] | None = None,
               **settings: Any) -> dict[str, Any]:
    """Run (or continue) the recipe ``config`` (a :class:`RecipeConfig`, or the output folder with
    ``settings`` as its other fields); returns the summary written to ``recipe_summary.json``. ``on_start`` is
    called once the settings are checked, before anything is written.

    ``jobs > 1`` runs the fine-tunes still to do in that many worker processes of one torch thread each
    (:func:`run_finetune_jobs`), after the pretraining stage; every other setting is the same.
    ``device`` is the torch device every stage trains on (batches and their noise are drawn on the CPU
    either way). ``refine_steps`` R > 0 adds a stage ``refine-<obj>`` after each fine-tune: R more steps
    of the same objective from the fine-tuned model, under a fresh schedule (peak ``REFINE_LR``,
    ``REFINE_WARMUP`` warmup steps, data order seeded ``seed + 1``); the F-step model is kept in
    ``OUT/work/finetune-<obj>/model`` and ``OUT/<size>-<obj>`` becomes the refined one. ``refine_rounds``
    N > 1 repeats that stage N times (round r: stage :func:`refine_stage`, from round r - 1's model, kept in
    its ``OUT/work/<stage>/model``, data order seeded ``seed + r``). ``base_ar_steps``
    B > 0 adds a stage ``base-ar`` before the fine-tunes: B more ``ar`` steps on the pretrained base under
    the fine-tune schedule (the phase-1 base kept in ``OUT/work/pretrain/model``); ``OUT/<size>-base``
    becomes that model and every objective starts from it, as ReFusion starts from a tuned AR model.
    ``long_slots_from``: the refine round from which the ``refusion`` arm trains with longer slots
    (:func:`objective_options`; 0: never); ``mix_from``: the refine round from which every arm trains on
    ``LATE_MIX`` (:func:`stage_data`; 0: never)."""
    from transformers import AutoTokenizer

    from refusion.models.build import build_model
    from refusion.models.loading import load_pretrained
    from refusion.tasks.tokenizer import build_tinybench_tokenizer
    from refusion.plugins.objectives import OBJECTIVES as OBJ_CLASSES
    from refusion.training.data import load_pairs
    from refusion.training.trainer import TrainConfig, Trainer, training_device

    cfg = config if isinstance(config, RecipeConfig) else RecipeConfig(out=str(config), **settings)
    P, F, R, B = cfg.pretrain_steps, cfg.finetune_steps, cfg.refine_steps, cfg.base_ar_steps
    batch_size, size, objectives, seed, threads = cfg.batch_size, cfg.size, cfg.objectives, cfg.seed, cfg.threads
    pretrain_lr, finetune_lr, group_by_length, device = cfg.pretrain_lr, cfg.finetune_lr, cfg.group_by_length, cfg.device
    refine_rounds, long_slots_from, mix_from = cfg.refine_rounds, cfg.long_slots_from, cfg.mix_from
    progress, train_limit, jobs = cfg.progress, cfg.train_limit, cfg.jobs
    training_device(device)  # a bad or absent device fails before any work
    if refine_rounds < 1:
        raise ValueError(f"refine_rounds must be >= 1, got {refine_rounds} (use refine_steps=0 for no refining)")
    _check_from_rounds(long_slots_from, mix_from)
    if on_start is not None:
        on_start()
    out = Path(cfg.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    summary: dict[str, Any] = {
        "recipe": "tiny", "size": size, "pretrain_steps": P, "finetune_steps": F, "refine_steps": R,
        "refine_rounds": refine_rounds if R else 0,
        "base_ar_steps": B,
        "batch_size": batch_size, "pretrain_lr": pretrain_lr, "finetune_lr": finetune_lr, "refine_lr": REFINE_LR,
        "group_by_length": group_by_length, "long_slots_from": long_slots_from, "mix_from": mix_from,
        "late_mix": LATE_MIX,
        "seed": seed, "threads": threads, "torch_threads": torch.get_num_threads(), "device": device,
        "stages": {},
    }
    t_all = time.perf_counter()

    def save_summary() -> None:
        stages = summary["stages"]
        summary["total_wall_s"] = round(sum(s.get("wall_s", 0.0) for s in stages.values()), 1)
        _write_json(out / SUMMARY_FILE, summary)

    def log(msg: str) -> None:
        print(f"[recipe {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # 1. tokenizer ---------------------------------------------------------------------------
    tok_dir = out / "tokenizer"
    done = _stage_done(work / "tokenizer")
    if done and (tok_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        log("tokenizer: done before, loaded")
    else:
        t = time.perf_counter()
        tokenizer = build_tinybench_tokenizer()
        tokenizer.save_pretrained(tok_dir)
        done = {"stage": "tokenizer", "wall_s": round(time.perf_counter() - t, 2), "vocab_size": len(tokenizer)}
        (work / "tokenizer").mkdir(exist_ok=True)
        _write_json(work / "tokenizer" / STAGE_FILE, done)
        log(f"tokenizer: built ({len(tokenizer)} tokens, {done['wall_s']} s)")
    summary["stages"]["tokenizer"] = done
    save_summary()

    t = time.perf_counter()
    train_sets = {"tinybench": load_pairs("tinybench", tokenizer, "train", limit=train_limit)}
    train_pairs = train_sets["tinybench"]
    val_pairs = load_pairs("tinybench", tokenizer, "validation")
    summary["data"] = {"train_pairs": len(train_pairs), "validation_pairs": len(val_pairs),
                       "tokenize_s": round(time.perf_counter() - t, 2)}
    log(f"data: {len(train_pairs)} train / {len(val_pairs)} validation pairs")

    def config(steps: int, lr: float, **kw: Any) -> TrainConfig:
        return TrainConfig(**{
            "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "log_every": max(1, min(20, steps // 10)),
            "save_every": max(1, min(100, steps // 4)), "eval_every": max(1, steps // 5), "eval_batch_size": 128,
            "threads": threads, "progress": progress, "group_by_length": group_by_length, "device": device, **kw,
        })

    def train_stage(stage: str, model: Any, tok: Any, objective: Any, steps: int, lr: float, final: Path,
                    data: str = "tinybench", **kw: Any) -> dict:
        if data not in train_sets:
            train_sets[data] = load_pairs(data, tokenizer, "train", limit=train_limit)
        trainer = Trainer(model, tok, objective, train_sets[data], config(steps, lr, **kw), work / stage,
                          val_pairs=val_pairs, final_dir=final)
        result = trainer.train(resume=True)
        result.update(stage=stage, output=str(final), group_by_length=trainer.config.group_by_length,
                      seed=trainer.config.seed, data=data, train_examples=len(train_sets[data]))
        _write_json(work / stage / STAGE_FILE, result)
        return result

    def run_stage(stage: str, name: str, init: Path, steps: int, lr: float, final: Path | None = None,
                  options: dict | None = None, data: str = "tinybench", **kw: Any) -> dict:
        """Train ``name`` (objective ``options``, None: its defaults) on ``data`` from the model in ``init``
        into ``final`` (default ``OUT/<size>-<name>``), unless done before."""
        done = _stage_done(work / stage)
        if done is not None:
            log(f"{stage}: done before, skipped")
            return done
        random_batches = OBJ_CLASSES[name].wants_random_batches
        kw = {"group_by_length": stage_grouping(name, group_by_length), **kw}
        log(f"{stage}: from {init}, {steps} steps" + (", random batches" if random_batches else "")
            + (f", options {options}" if options else "") + (f", data {data}" if data != "tinybench" else ""))
        model, tok = load_pretrained(init)
        done = train_stage(stage, model, tok, OBJ_CLASSES[name].from_tokenizer(tok, options), steps, lr,
                           final or out / f"{size}-{name}", data=data, **kw)
        log(f"{stage}: finished in {done['wall_s']} s, eval {done['eval']}")
        return done

    def kept_copy(model_dir: Path, keep: Path, stage: str) -> Path:
        """``keep``, a copy of ``model_dir`` made while ``stage`` (which overwrites ``model_dir``) is to run."""
        if not keep.is_dir() and _stage_done(work / stage) is None:
            shutil.copytree(model_dir, keep)
        return keep

    # 2. pretraining --------------------------------------------------------------------------
    base = out / f"{size}-base"
    done = _stage_done(work / "pretrain")
    if done is None:
        log(f"pretrain: ar from scratch, {P} steps")
        model = build_model(tokenizer, size, seed=seed)
        done = train_stage("pretrain", model, tokenizer, OBJ_CLASSES["ar"].from_tokenizer(tokenizer), P,
                           pretrain_lr, base)
        log(f"pretrain: finished in {done['wall_s']} s, eval {done['eval']}")
    else:
        log("pretrain: done before, skipped")
    summary["stages"]["pretrain"] = done
    save_summary()

    if B:  # phase 2 of the base: more AR steps under the fine-tune schedule, then every objective branches
        start = kept_copy(base, work / "pretrain" / "model", "base-ar")
        summary["stages"]["base-ar"] = run_stage("base-ar", "ar", start, B, finetune_lr, final=base)
        save_summary()

    # 3. fine-tuning (and refining) -------------------------------------------------------------
    N = refine_rounds if R else 0
    todo = [name for name in objectives if any(
        _stage_done(work / s) is None for s in [f"finetune-{name}", *(refine_stage(name, r) for r in range(1, N + 1))])]
    if jobs > 1 and len(todo) > 1:
        log(f"fine-tunes {', '.join(todo)} in {jobs} worker processes (1 thread each; logs in {work}/finetune-*.log)")
        run_finetune_jobs(cfg, todo, jobs)
    for name in objectives:
        summary["stages"][f"finetune-{name}"] = run_stage(f"finetune-{name}", name, base, F, finetune_lr)
        save_summary()
        before = f"finetune-{name}"
        for r in range(1, N + 1):
            stage = refine_stage(name, r)
            # the previous stage's model, kept: OUT/<size>-<name> is overwritten
            start = kept_copy(out / f"{size}-{name}", work / before / "model", stage)
            summary["stages"][stage] = run_stage(stage, name, start, R, REFINE_LR, seed=seed + r,
                                                 options=objective_options(name, r, long_slots_from),
                                                 data=stage_data(r, mix_from),
                                                 warmup_steps=refine_warmup(R))
            save_summary()
            before = stage
    summary["this_run_wall_s"] = round(time.perf_counter() - t_all, 1)
    save_summary()
    log(f"all stages done; summary in {out / SUMMARY_FILE}")
    return summary


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")


def adopt_stage(out: str | os.PathLike, stage: str, run: str | os.PathLike, **settings: Any) -> dict:
    """Make a finished ``refusion train`` run the recipe's refine ``stage`` (``refine<r>-<obj>``), as if the
    recipe had trained it: the run's saved config and objective options must be the stage's (steps, lr,
    warmup, batch size, data-order seed, batch grouping, options, and the number of training examples of
    the stage's data, :func:`stage_data`, cut to ``train_limit``), else ValueError naming each field that
    differs. The caller vouches that the run started from round r - 1's model, which must be done in
    ``out`` and is ``OUT/<size>-<obj>`` now: it is kept in ``OUT/work/<round r - 1>/model`` and the run's
    model becomes ``OUT/<size>-<obj>``. Writes and returns the stage's ``stage.json`` (``adopted_from``:
    the run). ``settings``: the recipe's other fields (:class:`RecipeConfig`: size, batch_size, refine_steps,
    seed, group_by_length, long_slots_from, mix_from, train_limit)."""
    from transformers import AutoTokenizer

    from refusion.plugins.objectives import OBJECTIVES as OBJ_CLASSES
    from refusion.training.data import load_pairs

    cfg = RecipeConfig(out=str(out), **settings)
    size, batch_size, seed, group_by_length = cfg.size, cfg.batch_size, cfg.seed, cfg.group_by_length
    long_slots_from, mix_from, train_limit = cfg.long_slots_from, cfg.mix_from, cfg.train_limit
    _check_from_rounds(long_slots_from, mix_from)
    out, run = Path(out), Path(run)
    m = re.fullmatch(r"refine(\d*)-(\w+)", stage)
    if not m or m.group(2) not in OBJ_CLASSES:
        raise ValueError(f"stage must be a refine stage such as refine4-refusion, got {stage!r}")
    name, r = m.group(2), int(m.group(1) or 1)
    work = out / "work"
    if _stage_done(work / stage) is not None:
        raise ValueError(f"{stage} is done in {out} already")
    before = refine_stage(name, r - 1) if r > 1 else f"finetune-{name}"
    if _stage_done(work / before) is None:
        raise ValueError(f"{stage} follows {before}, which is not done in {out}")
    missing = [f for f in ("trainer_state.pt", "train_log.jsonl", "model.safetensors", "config.json")
               if not (run / f).is_file()]
    if missing:
        raise ValueError(f"{run} is not a finished training run: no {', '.join(missing)}")
    state = torch.load(run / "trainer_state.pt", map_location="cpu", weights_only=False)
    R = cfg.refine_steps
    options = OBJ_CLASSES[name].Options(**(objective_options(name, r, long_slots_from) or {})).model_dump()
    want = {"steps": R, "lr": REFINE_LR, "warmup_steps": refine_warmup(R), "batch_size": batch_size,
            "seed": seed + r, "group_by_length": stage_grouping(name, group_by_length)}
    have = {**{k: state["config"].get(k) for k in want}, "step": state["step"],
            "train_examples": len(state["sampler"]["perm"])}
    tokenizer = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    data = stage_data(r, mix_from)
    want.update(step=R, train_examples=len(load_pairs(data, tokenizer, "train", limit=train_limit)))
    diff = [f"{k}: run {have[k]!r}, stage {v!r}" for k, v in want.items() if have[k] != v]
    if state["objective"]["name"] != name:
        diff.append(f"objective: run {state['objective']['name']!r}, stage {name!r}")
    if state["objective"]["options"] != options:
        diff.append(f"options: run {state['objective']['options']}, stage {options}")
    if diff:
        raise ValueError(f"{run} is not {stage} of this recipe: " + "; ".join(diff))
    logs = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line.strip()]
    last = lambda kind: next((row for row in reversed(logs) if row.get("kind") == kind), {})  # noqa: E731
    final = out / f"{size}-{name}"
    if not (work / before / "model").is_dir():
        shutil.copytree(final, work / before / "model")
    (work / stage).mkdir(parents=True)
    for f in ("trainer_state.pt", "train_log.jsonl"):
        shutil.copy2(run / f, work / stage / f)
    for f in MODEL_FILES:
        if (run / f).is_file():
            shutil.copy2(run / f, final / f)
    skip = {"kind", "step", "lr", "tokens", "tok_per_s", "elapsed"}
    done = {"objective": name, "options": options, "steps": state["step"], "finished": True,
            "train": {k: v for k, v in last("train").items() if k not in skip},
            "eval": {k: v for k, v in last("eval").items() if k not in skip},
            "tokens": state["tokens_seen"], "wall_s": round(state["elapsed"], 2), "batch_size": batch_size,
            "lr": REFINE_LR, "stage": stage, "output": str(final), "group_by_length": want["group_by_length"],
            "seed": seed + r, "data": data, "train_examples": want["train_examples"],
            "eval_batch_size": state["config"].get("eval_batch_size"),
            "adopted_from": str(run)}
    _write_json(work / stage / STAGE_FILE, done)
    return done


def run_finetune_jobs(config: RecipeConfig, objectives: Sequence[str], jobs: int) -> None:
    """Fine-tune each of ``objectives`` in its own child recipe, ``jobs`` at a time in one-thread workers
    (:mod:`refusion.core.workers`), on the finished pretraining; each child receives ``config`` for its one
    objective as a written file (``OUT/work/finetune-<obj>.call.json``), logs to ``OUT/work/finetune-<obj>.log``
    and writes its stage's ``stage.json`` as the sequential recipe does, and the parent then collects them.
    Raises if a worker fails (see its log)."""
    from refusion.core import workers

    work = Path(config.out) / "work"
    todo = [workers.call_job(o, run_recipe, {"config": config.model_copy(update={
        "objectives": (o,), "threads": 1, "jobs": 1, "progress": False})}, work / f"finetune-{o}.call.json",
        work / f"finetune-{o}.log") for o in objectives]
    failed = [f"{f.name} (exit {f.returncode}, log {f.log})" for f in workers.run_jobs(todo, jobs) if f.returncode]
    if failed:
        raise RuntimeError("fine-tune worker(s) failed: " + "; ".join(failed))


def report(out: str | os.PathLike) -> str:
    """A markdown table of a recipe's ``recipe_summary.json``: wall time, final losses, masked accuracy."""
    summary = json.loads((Path(out) / SUMMARY_FILE).read_text())
    from refusion.experiments.tables import markdown

    body = []
    for name, st in summary["stages"].items():
        if "objective" not in st:
            continue
        tr, ev = st.get("train", {}), st.get("eval", {})
        cell = lambda d, k: f"{d[k]:.3f}" if k in d else "-"  # noqa: E731
        acc = ev.get("acc", ev.get("ar_acc"))
        body.append([name, st["objective"], str(st["steps"]), f"{st['wall_s'] / 60:.1f}", cell(tr, "loss"),
                     cell(ev, "loss"), "-" if acc is None else f"{acc:.3f}", cell(ev, "masked_acc")])
    return markdown(["stage", "objective", "steps", "wall (min)", "train loss", "val loss", "val token acc",
                     "val masked acc"], body)


RECIPE_FLAGS = list(RecipeConfig.model_fields)


def build_parser() -> argparse.ArgumentParser:
    """The flags of :class:`RecipeConfig`, each default defined there, and the recipe's actions."""
    from refusion.core.flags import add_model_flags

    p = argparse.ArgumentParser(prog="python -m refusion.training.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or TOML file of settings (fields of RecipeConfig); flags and --set "
                                    "override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (values parsed as YAML)")
    add_model_flags(p, RecipeConfig, RECIPE_FLAGS)
    p.add_argument("--report", action="store_true", help="print OUT's summary as a markdown table and exit")
    p.add_argument("--adopt", metavar="STAGE=RUN", action="append", default=[],
                   help="make the finished `refusion train` run RUN the refine stage STAGE (its settings are "
                        "checked against the stage's), then exit; repeatable, in round order")
    return p


def main(argv: list[str] | None = None) -> int:
    from refusion.core.config import ConfigError
    from refusion.core.flags import settings_from_args

    a = build_parser().parse_args(argv)
    try:
        if a.report:
            if not getattr(a, "out", None):
                raise ConfigError("--report: give --out, the recipe's output folder")
            print(report(a.out), end="")
            return 0
        cfg = settings_from_args(RecipeConfig, a, config_file=a.config, sets=a.set)
        return _run_main(cfg, a.adopt)
    except (ValueError, ConfigError) as exc:  # a bad setting, named by run_recipe / adopt_stage
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run_main(cfg: RecipeConfig, adopt: list[str]) -> int:
    for item in adopt:
        stage, _, run = item.partition("=")
        adopt_stage(cfg.out, stage, run, **cfg.model_dump(exclude={"out"}))
        print(f"{stage}: adopted {run}")
    if adopt:
        return 0
    run_recipe(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
