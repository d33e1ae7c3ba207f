"""Training settings, each default defined once: the models every training command takes its flags from.

- :class:`TrainConfig`: the training loop's settings (:class:`~refusion.training.trainer.Trainer`);
- :class:`TrainRun`: one objective's run, ``refusion train --objective`` (a :class:`TrainConfig` plus the
  model, data and objective);
- :class:`DistributedRun`: ``python -m refusion.training.distributed`` (a :class:`TrainRun` plus the
  accelerate settings);
- :class:`RecipeConfig`: the controlled recipe, ``refusion train --recipe tiny`` and
  ``python -m refusion.training.recipe``; its fine-tune workers receive it as a written file.

Each command's flags are generated from its model (:func:`refusion.core.flags.add_model_flags`), and
``--config FILE --set key=value`` fill any field, as a decoder's config does. ``refusion train``'s ``--set``
keeps its meaning for objective options: a key that is not a field of :class:`TrainRun` is an option of the
objective (``--set slot_sizes=[4,8]`` is ``--set options.slot_sizes=[4,8]``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _split(value: Any) -> Any:
    """``"a,b"`` -> ``["a", "b"]`` (a list flag given on the command line); anything else as it is."""
    return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value


class TrainConfig(BaseModel):
    """Optimisation and bookkeeping settings of one training run."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(200, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="examples per optimizer step (under accelerate: the global batch)")
    max_tokens: int | None = Field(None, ge=1, description="token budget per batch (padded input tokens); batches "
                                                           "then hold as many examples as fit, at least one")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of --lr (0: to zero)")
    group_by_length: int = Field(0, ge=0, description="draw N batches at a time and batch them by length, so less "
                                                      "padding is computed (0: plain shuffled batches)")
    warmup_steps: int | None = Field(None, ge=0, json_schema_extra={"flag": "--warmup"},
                                     description="linear warmup steps (none: 5% of the steps, at least 1)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases and norms)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas (Hugging Face Trainer's: 0.9,0.999)")
    grad_clip: float = Field(1.0, ge=0, description="gradient norm clip")
    seed: int = Field(0, description="seed of data order, objective noise and a scratch model's weights")
    log_every: int = Field(10, ge=1, description="log train metrics every N steps")
    save_every: int = Field(100, ge=0, description="save the resumable state every N steps (0: only at the end)")
    eval_every: int = Field(100, ge=0, description="evaluate on the validation batch every N steps (0: only at "
                                                   "the end)")
    eval_batch_size: int = Field(64, ge=1, description="examples in the fixed validation batch")
    threads: int | None = Field(2, ge=1, description="torch CPU threads (none: torch's own default)")
    device: str = Field("cpu", description="torch device to train on: cpu, cuda, cuda:N (batches are built on the "
                                           "CPU and moved there, so data order and noise do not depend on it)")
    progress: bool = Field(True, json_schema_extra={"flag": "--no-progress"}, description="progress bar")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, value: Any) -> Any:
        return tuple(float(b) for b in _split(value)) if isinstance(value, str) else value

    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    def loop_config(self) -> "TrainConfig":
        """The :class:`TrainConfig` part of a subclass's settings."""
        return TrainConfig(**{k: getattr(self, k) for k in TrainConfig.model_fields})


class TrainRun(TrainConfig):
    """``refusion train --objective``: one objective on one model and data set."""

    objective: str | None = Field(None, description="ar | refusion | mdm | block (or a plugin's objective)")
    options: dict[str, Any] = Field(default_factory=dict, description="the objective's options (--set KEY=VALUE)")
    data: str = Field("tinybench", description="'tinybench', a tinybench mix such as 'tinybench:facts=3' (facts "
                                               "train examples 3 times), or a JSON file of {query, response}")
    init: str = Field("scratch", description="model folder, shipped checkpoint name, or 'scratch'")
    size: str = Field("tiny", description="model size for --init scratch (micro, tiny, small)")
    out: str = Field(description="output folder (log, resumable state, final model)")
    max_length: int = Field(512, ge=1, description="drop examples longer than this (tokens)")
    limit: int | None = Field(None, ge=1, description="use only the first N training examples")
    grow_layers: int | None = Field(None, ge=1, description="grow the --init model to N decoder layers first: "
                                                            "copies of its layers whose residual writers are zero, "
                                                            "so it starts computing exactly what --init computes")
    attn_implementation: Literal["sdpa", "eager"] | None = Field(
        None, description="attention of the --init / scratch model: sdpa (none: the model's) or eager (training "
                          "keeps float32 weights, so flash attention, which needs 16-bit ones, is not offered)")


class DistributedRun(TrainRun):
    """``python -m refusion.training.distributed``: :class:`TrainRun` over the processes of an accelerator."""

    init: str = Field(description="model folder, shipped checkpoint name, or 'scratch'")
    epochs: float | None = Field(None, gt=0, description="passes over the training data (sets --steps unless it "
                                                         "is given)")
    grad_accum: int | None = Field(None, ge=1, description="micro-batches per process per step (none: the "
                                                           "accelerate config's, else 1)")
    chat_template: bool = Field(False, description="encode prompts with the tokenizer's chat template")
    data_cache: str | None = Field(None, description="folder of token stores, on a filesystem every process sees "
                                                     "(none: OUT/tokenized)")
    mixed_precision: Literal["no", "bf16", "fp16"] | None = Field(None, description="none: the accelerate "
                                                                                    "config's")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    dist_timeout: float = Field(180, gt=0, description="minutes a process waits at a collective before failing "
                                                       "(ranks wait while the main process tokenises)")
    stop_at: int | None = Field(None, ge=1, description="stop after this step, saving the state (continue with "
                                                        "--resume; the schedule is --steps')")


_LOOP = TrainConfig.model_fields


class RecipeConfig(BaseModel):
    """The controlled recipe (:func:`refusion.training.recipe.run_recipe`; its module docstring says why each
    default is what it is)."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field(description="output folder (the tiny-* models, work/, recipe_summary.json)")
    pretrain_steps: int = Field(3600, ge=1, description="AR pretraining steps (P)")
    finetune_steps: int = Field(3000, ge=1, description="fine-tuning steps per objective (F)")
    refine_steps: int = Field(2400, ge=0, description="further steps per objective after F, under a fresh "
                                                      "schedule (R; 0: no refining)")
    refine_rounds: int = Field(8, description="refine stages per objective, each R steps from the one before (N)")
    base_ar_steps: int = Field(3000, ge=0, description="more ar steps on the base, at the fine-tune lr, before the "
                                                       "objectives branch (B)")
    long_slots_from: int = Field(6, description="refine round from which the refusion arm draws slot sizes from "
                                                "LONG_SLOT_SIZES (0: never)")
    mix_from: int = Field(7, description="refine round from which every arm trains on LATE_MIX (0: never)")
    objectives: tuple[str, ...] = Field(("refusion", "ar", "mdm", "block"), description="objectives to fine-tune")
    batch_size: int = Field(_LOOP["batch_size"].default, ge=1, description=_LOOP["batch_size"].description)
    size: str = Field("tiny", description="model size preset (micro, tiny, small)")
    pretrain_lr: float = Field(2e-3, gt=0, description="peak learning rate of pretraining")
    finetune_lr: float = Field(1e-3, gt=0, description="peak learning rate of the fine-tunes and base-ar")
    group_by_length: int = Field(64, ge=0, description=_LOOP["group_by_length"].description)
    threads: int | None = Field(_LOOP["threads"].default, ge=1, description=_LOOP["threads"].description)
    jobs: int = Field(1, ge=1, description="fine-tune in this many 1-thread worker processes")
    seed: int = Field(_LOOP["seed"].default, description=_LOOP["seed"].description)
    device: str = Field(_LOOP["device"].default, description=_LOOP["device"].description)
    train_limit: int | None = Field(None, ge=1, description="use only the first N train pairs (smoke runs)")
    progress: bool = Field(True, json_schema_extra={"flag": "--no-progress"}, description="progress bar")

    @field_validator("objectives", mode="before")
    @classmethod
    def _objectives(cls, value: Any) -> Any:
        return tuple(_split(value)) if isinstance(value, str) else value
