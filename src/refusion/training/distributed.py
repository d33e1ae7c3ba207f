"""Data-parallel training through accelerate: DDP, FSDP2 or DeepSpeed ZeRO-2/3, chosen by an accelerate config.

::

    # two CPU processes (what the tests run), or one process per GPU:
    torchrun --nproc_per_node 2 -m refusion.training.distributed --objective ar --init runs/m --data d.json --out runs/dp
    accelerate launch --config_file src/refusion/training/accelerate_configs/fsdp2_8gpu.yaml \\
        -m refusion.training.distributed --objective refusion --init /ckpt/Qwen3-8B-mask --data train.json \\
        --out runs/refusion-8b --epochs 4 --batch-size 512 --grad-accum 16 --lr 2e-5 --min-lr-ratio 0 \\
        --max-length 4096 --chat-template --gradient-checkpointing
    # the same paths on 2 CPU processes (gloo): fsdp2_cpu2.yaml, deepspeed_zero2_cpu2.yaml, deepspeed_zero3_cpu2.yaml

:class:`AccelerateRuntime` runs the one training loop, :class:`~refusion.training.trainer.Trainer` (AdamW
with decay / no-decay groups, warmup + cosine schedule, grad clipping, the objective's batches; ``batch_size``
the GLOBAL batch, each rank's share cut into ``grad_accum`` micro-batches of ``batch_size / (world x
grad_accum)`` examples), over the processes of an accelerator (:class:`DistributedTrainer` is that
pairing). ``Accelerator(gradient_accumulation_steps=grad_accum)``: inside ``accelerator.accumulate`` gradients
are synchronised and the optimizer steps on the last micro-batch only. The model, optimizer and gradient
clipping go through ``accelerate`` (``Accelerator.prepare``), so the accelerate config decides DDP / FSDP /
DeepSpeed and mixed precision (``--mixed-precision bf16``). The learning-rate schedule is built on the
optimizer ``prepare`` returns (under ZeRO its param groups are the sharded optimizer's) and stepped once per
optimizer step by the loop (not by accelerate, which would step it once per process). Under DeepSpeed no
dataloader goes through ``prepare``: the micro-batch (``train_micro_batch_size_per_gpu``), the global batch,
the accumulation steps and the clipping are written into the DeepSpeed config before it
(:func:`configure_deepspeed`); a config that says otherwise is refused.

Start-up at scale (:func:`main`): weights are loaded once, in their stored dtype (``config.json``), straight to
where they train (:func:`load_for_training`): under FSDP with ``fsdp_cpu_ram_efficient_loading`` only the
main process reads them (into host memory) and the others start from empty (meta) tensors that ``prepare``
fills with their shards; under ZeRO-3 with ``zero3_init_flag`` each rank keeps its partition as they load;
otherwise each rank loads them onto its own device (``device_map``). The data are tokenised once, by the main
process, into a memory-mapped store (:func:`refusion.training.data.tokenized_store`, in ``--data-cache``,
default ``OUT/tokenized``); the other ranks wait for it and map it. A rerun with the same data, tokenizer,
max length and prompt layout reuses the store. The process group is joined with a long timeout
(``--dist-timeout``, minutes) because the ranks wait at a barrier while the main process tokenises.

Objective noise (masking ratios, slot orders) comes from a per-rank generator seeded ``seed + 1 + rank *
1000003``; with one process the steps are those of the local runtime. With several, the gradient is the
mean of the ranks' gradients: equal to the single-process gradient of the same global batch for losses
normalised per example (the diffusion losses), and close to it for token-mean losses (AR) whose shards
hold different token counts.

Files in ``out_dir``: ``train_log.jsonl`` (rank 0; metrics averaged over ranks), ``accelerate_state/`` and
``dist_state_rank{r}.pt`` (resumable: ``--resume``), ``tokenized/`` (the token store), and the final Hugging
Face folder (bf16 safetensors, written by rank 0 from the gathered state dict). ``summary["param_spread"]`` is
the largest difference of a parameter checksum between ranks (0 when DDP kept them synchronised; None under
FSDP / DeepSpeed); ``summary["weights"]`` says per rank how the initial weights were loaded (dtype, device,
bytes held) and ``summary["data"]`` which store was used and which rank tokenised it.

Why one module of about 500 lines: the accelerate runtime, the start-up loaders and the entry point
share the accelerator object and the DeepSpeed configuration it is prepared with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch

from refusion.core.objective import Pair
from refusion.models.build import record_objective
from refusion.models.loading import save_tokenizer
from refusion.training.config import DistributedRun, TrainConfig
from refusion.training.trainer import Trainer, TrainingRuntime, build_optimizer, lr_lambda

ACCEL_STATE_DIR = "accelerate_state"
STORE_DIR = "tokenized"
#: minutes a rank waits at a collective before the job fails (torch's default is 10 min for NCCL; ranks
#: wait longer than that while the main process tokenises a large data set or writes the final model)
DIST_TIMEOUT_MIN = DistributedRun.model_fields["dist_timeout"].default


def rank_state_file(rank: int) -> str:
    return f"dist_state_rank{rank}.pt"


# ------------------------------------------------------------------------------ the accelerator
def launch_kind() -> str:
    """``deepspeed``, ``fsdp`` or ``ddp``: what the launch asked for (``accelerate launch`` with a DeepSpeed /
    FSDP config sets ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP``)."""
    def flag(name: str) -> bool:
        return os.environ.get(name, "false").lower() in ("1", "true", "yes")

    return "deepspeed" if flag("ACCELERATE_USE_DEEPSPEED") else "fsdp" if flag("ACCELERATE_USE_FSDP") else "ddp"


def make_accelerator(
    grad_accum: int | None = None, mixed_precision: str | None = None, timeout_minutes: float = DIST_TIMEOUT_MIN,
) -> Any:
    """The ``Accelerator`` of a training run: the launch's config (DDP / FSDP / DeepSpeed), the process group
    joined with a ``timeout_minutes`` timeout, ``grad_accum`` micro-batches per step (None: the config's, else
    1; a number the config contradicts is refused, since accelerate would silently take the config's).

    Without a GPU the same configs run on CPU processes over gloo: DeepSpeed picks its CPU accelerator
    (the process group is joined with ``backend="gloo"``); FSDP, which accelerate only enables on GPUs (its
    state promotes ``MULTI_GPU``, never ``MULTI_CPU``, to ``FSDP``), is enabled here on the CPU processes
    (:func:`_fsdp_on_cpu`, FSDP2 only). These are the CPU stand-ins the tests run."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    gpu, kind = torch.cuda.is_available(), launch_kind()
    pg: dict[str, Any] = {"timeout": timedelta(minutes=timeout_minutes)}
    if kind == "deepspeed" and not gpu:
        pg["backend"] = "gloo"
    kw: dict[str, Any] = {"kwargs_handlers": [InitProcessGroupKwargs(**pg)]}
    if mixed_precision:
        kw["mixed_precision"] = mixed_precision
    if grad_accum is not None:
        kw["gradient_accumulation_steps"] = int(grad_accum)
    acc = Accelerator(cpu=not gpu and kind != "deepspeed", **kw)
    if kind == "fsdp" and not gpu:
        _fsdp_on_cpu(acc)
    if grad_accum is not None and int(acc.gradient_accumulation_steps) != int(grad_accum):
        raise ValueError(f"--grad-accum {grad_accum} contradicts the accelerate config's gradient_accumulation_steps "
                         f"({acc.gradient_accumulation_steps}): give the same number (or leave --grad-accum out)")
    return acc


def _fsdp_on_cpu(acc: Any) -> None:
    """Turn ``acc``'s CPU processes (gloo) into an FSDP2 run, with the plugin accelerate builds from the
    launch's ``FSDP_*`` variables. FSDP1 is refused: on CPU it needs ``device_id`` "cpu" where accelerate passes
    "cpu:0", and even with that its FULL_STATE_DICT unshard crashes (SIGSEGV) over gloo in torch 2.13."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if acc.distributed_type != DistributedType.MULTI_CPU:
        return  # one process: nothing to shard
    plugin = FullyShardedDataParallelPlugin()
    if int(plugin.fsdp_version) != 2:
        raise ValueError("FSDP on CPU processes runs FSDP2 only: set fsdp_version: 2 in the accelerate config "
                         "(fsdp2_cpu2.yaml)")
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def distributed_kind(acc: Any) -> str:
    """``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``, ... of an accelerator."""
    return str(acc.distributed_type).split(".")[-1]


def configure_deepspeed(acc: Any, config: TrainConfig, grad_accum: int) -> dict[str, Any] | None:
    """Write the batch geometry and clipping into the DeepSpeed config before ``prepare``: no dataloader goes
    through ``prepare`` here, so accelerate cannot fill ``train_micro_batch_size_per_gpu`` ("auto") itself.
    Values the config already fixes must agree; returns the config (None when not under DeepSpeed)."""
    if distributed_kind(acc) != "DEEPSPEED":
        return None
    cfg = acc.state.deepspeed_plugin.deepspeed_config
    world = acc.num_processes
    want = {"train_micro_batch_size_per_gpu": config.batch_size // (world * grad_accum),
            "gradient_accumulation_steps": grad_accum, "train_batch_size": config.batch_size,
            "gradient_clipping": float(config.grad_clip or 0.0)}
    for key, value in want.items():
        have = cfg.get(key, "auto")
        if have not in (None, "auto") and float(have) != float(value):
            raise ValueError(f"the DeepSpeed config sets {key}={have}, but this run needs {value} (global batch "
                             f"{config.batch_size} = {world} processes x {grad_accum} micro-batches x "
                             f"{want['train_micro_batch_size_per_gpu']}; --grad-clip {config.grad_clip}): make them agree")
        cfg[key] = value
    return cfg


class AccelerateRuntime(TrainingRuntime):
    """:class:`~refusion.training.trainer.Trainer`'s steps over the processes of an ``accelerate``
    ``Accelerator``: the model and optimizer go through ``prepare`` (after :func:`configure_deepspeed`), the
    schedule is built on the optimizer ``prepare`` returns and registered for checkpointing; backward, clipping,
    accumulation and autocast are the accelerator's. State: ``accelerate_state/`` (model, optimizer, schedule,
    RNG) and ``dist_state_rank{r}.pt`` (the loop's, per rank); the final model is written by the main process
    from the gathered state dict."""

    def __init__(self, accelerator: Any = None) -> None:
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.accelerator = acc = accelerator
        self.rank, self.world, self.is_main = acc.process_index, acc.num_processes, acc.is_main_process
        self.grad_accum = int(acc.gradient_accumulation_steps)  # Accelerator(gradient_accumulation_steps=...)
        self.device = acc.device

    def setup(self, model, config):
        acc = self.accelerator
        configure_deepspeed(acc, config, self.grad_accum)
        model, optimizer = acc.prepare(model, build_optimizer(model, config))
        # The schedule is built on the optimizer prepare returned (FSDP replaces the parameters; under ZeRO
        # the inner object is DeepSpeed's, not a torch optimizer) and stepped by the loop, once per step
        # (not by accelerate, which would step it once per process).
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        acc.register_for_checkpointing(scheduler)
        return model, optimizer, scheduler

    def accumulate(self, model):
        return self.accelerator.accumulate(model)  # no gradient sync and no optimizer step until the last

    def autocast(self):
        return self.accelerator.autocast()

    @property
    def sync_gradients(self) -> bool:
        return bool(self.accelerator.sync_gradients)

    def backward(self, loss):
        self.accelerator.backward(loss)  # divided by grad_accum here (DeepSpeed: by its engine)

    def clip_grad_norm(self, model, max_norm):
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)  # DeepSpeed: None (its config clips)
        return None if norm is None else float(norm)

    def reduce_sum(self, values):
        return self.accelerator.reduce(values, "sum")

    def log_fields(self):
        return {"processes": self.world}

    def save_state(self, trainer, state):
        trainer.out_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator.save_state(str(trainer.out_dir / ACCEL_STATE_DIR))
        torch.save({**state, "world": self.world}, trainer.out_dir / rank_state_file(self.rank))
        self.accelerator.wait_for_everyone()

    def read_state(self, out_dir):
        path = out_dir / rank_state_file(self.rank)
        if not path.is_file() or not (out_dir / ACCEL_STATE_DIR).is_dir():
            return None
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["world"] != self.world:
            raise ValueError(f"{path} was written by {state['world']} processes, not {self.world}")
        return state

    def restore_state(self, trainer, state):
        self.accelerator.load_state(str(trainer.out_dir / ACCEL_STATE_DIR))

    def save_final(self, trainer):
        acc = self.accelerator
        acc.wait_for_everyone()
        state = acc.get_state_dict(trainer.model)  # FSDP / DeepSpeed: gathered on the main process
        if acc.is_main_process:
            model = acc.unwrap_model(trainer.model)
            record_objective(model.config, trainer.objective)
            state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
            model.save_pretrained(trainer.final_dir, state_dict=state, safe_serialization=True)
            save_tokenizer(trainer.tokenizer, trainer.final_dir)
        acc.wait_for_everyone()

    def param_spread(self, model: torch.nn.Module) -> float | None:
        """Largest difference between ranks of a float64 checksum of the parameters (0: synchronised);
        None when the parameters are sharded (FSDP, DeepSpeed), where ranks hold different pieces."""
        if distributed_kind(self.accelerator) not in ("NO", "MULTI_CPU", "MULTI_GPU"):
            return None
        total = sum(p.detach().double().sum() for p in model.parameters()).to(self.device)
        sums = self.accelerator.gather(total.reshape(1))
        return float(sums.max() - sums.min())

    def summary(self, trainer):
        return {"processes": self.world, "grad_accum": self.grad_accum, "param_spread": self.param_spread(trainer.model)}


class DistributedTrainer(Trainer):
    """:class:`~refusion.training.trainer.Trainer` over the processes of ``accelerator`` (None: a plain
    ``Accelerator``, on the CPU when there is no GPU)."""

    def __init__(self, *args: Any, accelerator: Any = None, **kwargs: Any) -> None:
        """:class:`~refusion.training.trainer.Trainer`'s arguments, its runtime the accelerator's."""
        super().__init__(*args, runtime=AccelerateRuntime(accelerator), **kwargs)
        self.accelerator = self.runtime.accelerator


# ------------------------------------------------------------------------------ start-up at scale
def storage_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype a model folder's weights are stored in (``config.json``'s ``dtype`` / ``torch_dtype``;
    float32 when it says nothing)."""
    from refusion.models.loading import DTYPES

    cfg = json.loads((Path(path) / "config.json").read_text())
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return DTYPES.get(name, torch.float32)


def weights_info(model: torch.nn.Module) -> dict[str, Any]:
    """dtype, device and bytes of the parameters this process holds (a ZeRO-3 partition counts its
    ``ds_tensor``; meta tensors count nothing)."""
    params = list(model.parameters())
    held = 0
    for p in params:
        t = getattr(p, "ds_tensor", p)
        if t.device.type != "meta":
            held += t.numel() * t.element_size()
    first = params[0] if params else torch.empty(0)
    return {"dtype": str(first.dtype).removeprefix("torch."), "device": str(first.device), "bytes": held}


def load_for_training(name_or_path: str | os.PathLike, accelerator: Any, dtype: torch.dtype | None = None) -> tuple[Any, Any, dict]:
    """``(model, tokenizer, info)``: the weights of a model folder loaded once, in their stored dtype (or
    ``dtype``), where this process trains them, with no float32 copy on the host:

    - FSDP with ``fsdp_cpu_ram_efficient_loading``: the main process reads them into host memory; the others
      read nothing and build the model's skeleton (parameters on the meta device, buffers real);
      ``prepare`` sends each rank its shards from the main process;
    - DeepSpeed ZeRO-3 with ``zero3_init_flag``: each rank keeps only its partition as the weights load;
    - otherwise (DDP, ZeRO-1/2, FSDP without it, one process): ``device_map`` puts them straight on this
      process's device.

    ``info`` records which way (``how``) and what this process then holds (:func:`weights_info`).

    Memory at load, for Qwen3-8B (8.2B parameters, bf16 on disk) on 8 GPUs: ``on_device`` 16.4 GB per GPU,
    which the trainer's float32 master copy turns into 32.8 GB on that GPU before ``prepare`` (ZeRO-2 then
    keeps bf16 weights plus 1/8 of the float32 master and AdamW state); ``rank0_host_then_shards`` 16.4 GB of
    host memory on rank 0 only (32.8 GB once upcast to float32 for the master shards), none on the other
    ranks, and 1/8 of the float32 weights per GPU after ``prepare``; ``zero3_partitioned`` about 2 GB (1/8 of
    the bf16 weights) per GPU. The former load (float32 on the CPU in every process) took 32.8 GB of host
    memory per rank: 262 GB for 8."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import is_deepspeed_zero3_enabled

    from refusion.models.loading import check_model_dir, resolve_model_path

    path = resolve_model_path(name_or_path)
    check_model_dir(path)
    dtype = dtype or storage_dtype(path)
    kind, kw = distributed_kind(accelerator), {}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if kind == "FSDP" and getattr(accelerator.state.fsdp_plugin, "cpu_ram_efficient_loading", False):
        how = "rank0_host_then_shards"
        if not accelerator.is_main_process:  # the skeleton only: parameters on meta, buffers real (small)
            from accelerate import init_empty_weights
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, local_files_only=True)
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
            model.tie_weights()  # init_empty_weights gives each module its own meta tensor: tie them again
            return model, tokenizer, {"rank": accelerator.process_index, "how": how, **weights_info(model)}
    elif kind == "DEEPSPEED" and is_deepspeed_zero3_enabled():
        how = "zero3_partitioned"
    else:
        how = "on_device"
        kw["device_map"] = {"": str(accelerator.device) if accelerator.device.type != "cpu" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, trust_remote_code=False,
                                                 attn_implementation="sdpa", **kw)
    return model, tokenizer, {"rank": accelerator.process_index, "how": how, **weights_info(model)}


def _broadcast(accelerator: Any, obj: Any) -> Any:
    """``obj`` of the main process, on every process (a barrier: the others wait here)."""
    if accelerator.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _gather(accelerator: Any, obj: Any) -> list[Any]:
    """Every process's ``obj``, in rank order."""
    if accelerator.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        out: list[Any] = [None] * accelerator.num_processes
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


def shared_pairs(
    accelerator: Any, root: str | os.PathLike, data: str | os.PathLike, tokenizer: Any, max_length: int | None,
    chat: bool = False, limit: int | None = None,
) -> tuple[Sequence[Pair], Sequence[Pair], dict[str, Any]]:
    """``(train, validation, info)`` from the token store under ``root``: the main process builds it (or finds
    it from an earlier run), the others wait and memory-map it. ``root`` must be on a filesystem every process
    sees; an error of the main process is raised on every rank (not a hang)."""
    from refusion.training.data import STORE_META, open_store, tokenized_store

    failure: BaseException | None = None
    result: dict[str, Any] | None = None
    if accelerator.is_main_process:
        try:
            folder, built = tokenized_store(root, data, tokenizer, max_length, chat, limit)
            result = {"store": str(folder), "built": built}
        except Exception as exc:  # noqa: BLE001  (re-raised below, on every rank)
            failure, result = exc, {"error": f"{type(exc).__name__}: {exc}"}
    result = _broadcast(accelerator, result)
    if "error" in result:
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank {accelerator.process_index}: the main process could not build the token store: "
                           f"{result['error']}")
    folder = Path(result["store"])
    if not (folder / STORE_META).is_file():
        raise FileNotFoundError(f"rank {accelerator.process_index}: the token store {folder} is not visible here; "
                                "put --data-cache on a filesystem every node sees")
    splits = open_store(folder)
    tokenized = bool(result["built"]) and accelerator.is_main_process
    return splits["train"], splits["validation"], {"store": str(folder), "tokenized": tokenized}


# ---------------------------------------------------------------------------------------- CLI
DISTRIBUTED_FLAGS = [n for n in DistributedRun.model_fields if n not in ("options", "progress")]


def build_parser() -> argparse.ArgumentParser:
    """The flags of :class:`~refusion.training.config.DistributedRun`, each default defined there."""
    from refusion.core.flags import add_model_flags

    p = argparse.ArgumentParser(prog="python -m refusion.training.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or TOML file of settings (fields of DistributedRun); flags and --set "
                                    "override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting (values parsed as YAML); a key that is not one is an objective option")
    p.add_argument("--resume", action="store_true", help="continue from OUT's saved state")
    add_model_flags(p, DistributedRun, DISTRIBUTED_FLAGS)
    return p


def distributed_settings(args: argparse.Namespace) -> DistributedRun:
    """The run's settings: defaults < ``--config`` < flags < ``--set`` (a key that is not a field: an
    objective option); progress bars off (one per process would interleave)."""
    from refusion.core.flags import settings_from_args

    def route(extra: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in extra.items() if k in DistributedRun.model_fields}
        options = {k: v for k, v in extra.items() if k not in DistributedRun.model_fields}
        return {**out, "options": {**out.get("options", {}), **options}} if options else out

    return settings_from_args(DistributedRun, args, config_file=args.config, sets=args.set, route_set=route,
                              fixed={"progress": False})


def main(argv: list[str] | None = None) -> int:
    from refusion.core.registry import get_registry
    from refusion.models.build import build_model
    from refusion.training.cli import scratch_tokenizer

    args = build_parser().parse_args(argv)
    run = distributed_settings(args)
    if run.objective is None:
        raise SystemExit("python -m refusion.training.distributed: error: --objective is required")
    accelerator = make_accelerator(run.grad_accum, run.mixed_precision, run.dist_timeout)
    cls = get_registry().get("objective", run.objective)
    options = cls.Options(**run.options)
    if run.init == "scratch":
        tokenizer = scratch_tokenizer(run.data)
        model = build_model(tokenizer, run.size, seed=run.seed, max_position_embeddings=max(512, run.max_length))
        weights = {"rank": accelerator.process_index, "how": "scratch", **weights_info(model)}
    else:
        model, tokenizer, weights = load_for_training(run.init, accelerator)
    if run.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    objective = cls.from_tokenizer(tokenizer, options)
    max_len = min(run.max_length, int(getattr(model.config, "max_position_embeddings", run.max_length)))
    train_pairs, val_pairs, data_info = shared_pairs(
        accelerator, run.data_cache or Path(run.out) / STORE_DIR, run.data, tokenizer, max_len,
        chat=run.chat_template, limit=run.limit)
    if run.epochs and "steps" not in run.model_fields_set:  # --steps, when given, wins over --epochs
        run = run.model_copy(update={"steps": math.ceil(run.epochs * len(train_pairs) / run.batch_size)})
    config = run.loop_config()
    trainer = DistributedTrainer(model, tokenizer, objective, train_pairs, config, run.out, accelerator=accelerator,
                                 val_pairs=val_pairs)
    summary = trainer.train(resume=args.resume, stop_at=run.stop_at)
    ranks = _gather(accelerator, {"weights": weights, "tokenized": data_info["tokenized"]})
    if distributed_kind(accelerator) == "DEEPSPEED":
        ds = accelerator.deepspeed_plugin.deepspeed_config
        summary["deepspeed"] = {k: ds.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                         "train_batch_size", "gradient_clipping")}
        summary["deepspeed"].update(zero_stage=ds["zero_optimization"]["stage"], bf16=ds.get("bf16", {}).get("enabled"))
    summary.update(distributed=distributed_kind(accelerator), weights=[r["weights"] for r in ranks],
                   data={"store": data_info["store"], "train_pairs": len(train_pairs), "validation_pairs": len(val_pairs),
                         "tokenized_by_ranks": [i for i, r in enumerate(ranks) if r["tokenized"]]})
    if accelerator.is_main_process:
        print(json.dumps(summary, default=str))
        (Path(run.out) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    # A barrier drains gloo's work queue before exit: otherwise the DDP reducer, freed at interpreter
    # teardown with the GIL held, joins gloo's worker thread while that thread waits for the GIL to free
    # the last all-gather's tensors (without it, about half of 2-process CPU runs deadlock).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    _LIVE.append(trainer)  # not freed on return: see __main__
    return 0


# The barrier above makes that deadlock rare, not impossible: under CPU contention about 1 run in 6 can
# still hang (faulthandler: the main thread in C code at the `main()` call, as main's locals are freed, and
# gloo's thread without a Python frame). So the trainer outlives main() and the command-line process
# leaves with os._exit, without freeing it: everything is written and flushed by then.
_LIVE: list[Any] = []

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
