"""Data-parallel training through accelerate: DDP here; FSDP / DeepSpeed from an accelerate config file.

::

    # two CPU processes (what the tests run), or one process per GPU:
    torchrun --nproc_per_node 2 -m refusion.training.distributed --objective ar --init runs/m --data d.json --out runs/dp
    accelerate launch --config_file src/refusion/training/accelerate_configs/fsdp_8gpu.yaml \\
        -m refusion.training.distributed --objective refusion --init /ckpt/Qwen3-8B-mask --data train.json \\
        --out runs/refusion-8b --epochs 4 --batch-size 512 --grad-accum 16 --lr 2e-5 --min-lr-ratio 0 \\
        --max-length 4096 --chat-template --gradient-checkpointing

:class:`DistributedTrainer` runs the same optimisation as :class:`~refusion.training.trainer.Trainer`
(AdamW with decay / no-decay groups, warmup + cosine schedule, grad clipping, the objective's batches),
with ``batch_size`` the GLOBAL batch: every rank draws the same global batch of example indices from the
shared seeded sampler, keeps its share (indices ``rank::world``), and splits it into ``grad_accum``
micro-batches (``Accelerator(gradient_accumulation_steps=grad_accum)``; inside ``accelerator.accumulate``
gradients are synchronised and the optimizer steps on the last one only). The model, optimizer and
gradient clipping go through ``accelerate`` (``Accelerator.prepare``), so the accelerate config decides
DDP / FSDP / DeepSpeed and mixed precision (``--mixed-precision bf16``); the learning-rate schedule is
stepped once per optimizer step by this loop (not by accelerate, which would step it once per process).

Objective noise (masking ratios, slot orders) comes from a per-rank generator seeded ``seed + 1 + rank *
1000003``; with one process this loop reproduces ``Trainer`` exactly. With several, the gradient is the
mean of the ranks' gradients: equal to the single-process gradient of the same global batch for losses
normalised per example (the diffusion losses), and close to it for token-mean losses (AR) whose shards
hold different token counts.

Files in ``out_dir``: ``train_log.jsonl`` (rank 0; loss averaged over ranks), ``accelerate_state/`` and
``dist_state_rank{r}.pt`` (resumable: ``--resume``), and the final Hugging Face folder (bf16 safetensors,
written by rank 0 from the gathered state dict). ``summary["param_spread"]`` is the largest difference of
a parameter checksum between ranks (0 when DDP kept them synchronised; None under FSDP / DeepSpeed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from refusion.core.machine import machine
from refusion.models.loading import save_tokenizer
from refusion.training.objective import Batch, Objective, Pair
from refusion.training.trainer import (
    LOG_FILE, TrainConfig, _Sampler, build_optimizer, init_run, lr_lambda, validation_batch,
)

ACCEL_STATE_DIR = "accelerate_state"


def rank_state_file(rank: int) -> str:
    return f"dist_state_rank{rank}.pt"


class DistributedTrainer:
    """Train ``model`` with ``objective`` on ``train_pairs`` over the processes of ``accelerator``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        objective: Objective,
        train_pairs: list[Pair],
        config: TrainConfig,
        out_dir: str | Path,
        accelerator: Any = None,
        val_pairs: list[Pair] | None = None,
        final_dir: str | Path | None = None,
    ) -> None:
        from accelerate import Accelerator

        if config.max_tokens is not None or config.group_by_length:
            raise ValueError("distributed training batches by example count: max_tokens / group_by_length are not supported")
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        acc = self.accelerator
        self.rank, self.world = acc.process_index, acc.num_processes
        grad_accum = int(acc.gradient_accumulation_steps)  # Accelerator(gradient_accumulation_steps=...)
        if grad_accum < 1 or config.batch_size % (self.world * grad_accum):
            raise ValueError(
                f"the global batch_size ({config.batch_size}) must be a multiple of processes x grad_accum "
                f"({self.world} x {grad_accum})"
            )
        self.grad_accum = grad_accum
        init_run(self, model, tokenizer, objective, train_pairs, config, out_dir, val_pairs, final_dir, self.rank)
        self.sampler = _Sampler(len(train_pairs), self.data_gen)
        self.model, self.optimizer = acc.prepare(model, build_optimizer(model, config))
        # FSDP may replace the parameters: the schedule is built on the prepared optimizer, stepped by us
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.optimizer if hasattr(self.optimizer, "optimizer")
                                                           else self.optimizer, lr_lambda(config))
        acc.register_for_checkpointing(self.scheduler)
        self._val_batch: Batch | None = None

    # -- state ------------------------------------------------------------------------------
    def save_state(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator.save_state(str(self.out_dir / ACCEL_STATE_DIR))
        torch.save({"step": self.step, "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(),
                    "data_gen": self.data_gen.get_state(), "noise_gen": self.noise_gen.get_state(),
                    "world": self.world, "config": self.config.model_dump()},
                   self.out_dir / rank_state_file(self.rank))
        self.accelerator.wait_for_everyone()

    def load_state(self) -> bool:
        path = self.out_dir / rank_state_file(self.rank)
        if not path.is_file() or not (self.out_dir / ACCEL_STATE_DIR).is_dir():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["world"] != self.world:
            raise ValueError(f"{path} was written by {state['world']} processes, not {self.world}")
        self.accelerator.load_state(str(self.out_dir / ACCEL_STATE_DIR))
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.sampler.load_state_dict(state["sampler"])
        self.data_gen.set_state(state["data_gen"])
        self.noise_gen.set_state(state["noise_gen"])
        return True

    def _log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / LOG_FILE, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    # -- steps ------------------------------------------------------------------------------
    def shard(self, indices: list[int]) -> list[list[int]]:
        """This rank's share of a global batch, cut into ``grad_accum`` micro-batches."""
        mine = indices[self.rank :: self.world]
        return [mine[j :: self.grad_accum] for j in range(self.grad_accum)]

    def evaluate(self) -> dict[str, float]:
        """Loss (and masked_acc / acc) on a fixed validation batch, the same on every rank."""
        if not self.val_pairs:
            return {}
        if self._val_batch is None:
            self._val_batch = validation_batch(self.objective, self.val_pairs, self.config)
        self.model.eval()
        with torch.no_grad(), self.accelerator.autocast():
            _, metrics = self.objective.loss(self.model, self._val_batch.to(self.accelerator.device))
        self.model.train()
        return metrics

    def param_spread(self) -> float | None:
        """Largest difference between ranks of a float64 checksum of the parameters (0: synchronised);
        None when the parameters are sharded (FSDP, DeepSpeed), where ranks hold different pieces."""
        if str(self.accelerator.distributed_type).split(".")[-1] not in ("NO", "MULTI_CPU", "MULTI_GPU"):
            return None
        total = sum(p.detach().double().sum() for p in self.model.parameters()).to(self.accelerator.device)
        sums = self.accelerator.gather(total.reshape(1))
        return float(sums.max() - sums.min())

    def train(self, resume: bool = False, stop_at: int | None = None) -> dict[str, Any]:
        cfg, acc = self.config, self.accelerator
        if not (resume and self.load_state()) and acc.is_main_process and (self.out_dir / LOG_FILE).exists():
            (self.out_dir / LOG_FILE).unlink()
        end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
        if self.step < end:
            self._log({"kind": "start", "step": self.step, "machine": machine(), "processes": self.world})
        self.model.train()
        lengths = [len(p) + len(r) for p, r in self.train_pairs]
        t0, last, last_eval = time.perf_counter(), {}, {}
        while self.step < end:
            idx = self.sampler.next_batch(cfg.batch_size, None, lengths.__getitem__)
            micro = self.shard(idx)
            sums: dict[str, float] = {}
            lr = self.scheduler.get_last_lr()[0]
            for part in micro:  # accelerate's accumulate(): no gradient sync and no optimizer step until the last
                batch = self.objective.make_batch([self.train_pairs[i] for i in part], self.noise_gen).to(acc.device)
                with acc.accumulate(self.model), acc.autocast():
                    loss, metrics = self.objective.loss(self.model, batch)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"rank {self.rank}: non-finite loss {loss.item()} at step {self.step + 1}")
                    acc.backward(loss)  # divided by grad_accum here (DeepSpeed: by its engine)
                    if acc.sync_gradients and cfg.grad_clip and cfg.grad_clip > 0:
                        norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)  # DeepSpeed: None (its config clips)
                        if norm is not None:
                            sums["grad_norm"] = float(norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.tokens_seen += batch.num_tokens * self.world
                for k, v in metrics.items():
                    if isinstance(v, float) and not math.isnan(v):
                        sums[k] = sums.get(k, 0.0) + v / len(micro)
            self.scheduler.step()
            self.step += 1
            keys = sorted(sums)
            mean = acc.reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=acc.device), "mean")
            last = {k: float(v) for k, v in zip(keys, mean.tolist())}
            if self.step % cfg.log_every == 0 or self.step == end:
                self._log({"kind": "train", "step": self.step, "lr": lr, **last, "tokens": self.tokens_seen,
                           "processes": self.world, "elapsed": round(time.perf_counter() - t0, 2)})
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps and self.val_pairs:
                last_eval = self.evaluate()
                self._log({"kind": "eval", "step": self.step, **last_eval})
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < end:
                self.save_state()
        self.save_state()
        finished = self.step >= cfg.steps
        if finished:
            if self.val_pairs:
                last_eval = self.evaluate()
                self._log({"kind": "eval", "step": self.step, **last_eval})
            self.save_final()
        return {"objective": self.objective.name, "steps": self.step, "finished": finished, "train": last,
                "eval": last_eval, "tokens": self.tokens_seen, "processes": self.world, "grad_accum": self.grad_accum,
                "param_spread": self.param_spread(), "wall_s": round(time.perf_counter() - t0, 2)}

    def save_final(self) -> None:
        """The final Hugging Face folder (bf16 safetensors + tokenizer), from the gathered state dict."""
        acc = self.accelerator
        acc.wait_for_everyone()
        state = acc.get_state_dict(self.model)  # FSDP / DeepSpeed: gathered on the main process
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            self.objective.configure_model(model.config)
            state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
            model.save_pretrained(self.final_dir, state_dict=state, safe_serialization=True)
            save_tokenizer(self.tokenizer, self.final_dir)
        acc.wait_for_everyone()


# ---------------------------------------------------------------------------------------- CLI
def encode_chat_pairs(tokenizer: Any, texts: list[tuple[str, str]], max_length: int | None) -> list[Pair]:
    """Prompts through the tokenizer's chat template (as the 8B is evaluated), responses + EOS."""
    from refusion.models.tokenizer import encode_prompt
    from refusion.training.data import encode_response

    pairs = []
    for query, response in texts:
        p, r = encode_prompt(tokenizer, query, chat=True), encode_response(tokenizer, response)
        if max_length is None or len(p) + len(r) <= max_length:
            pairs.append((p, r))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m refusion.training.distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", required=True, help="ar | refusion | mdm | block (or a plugin's objective)")
    p.add_argument("--data", default="tinybench", help="'tinybench' or a JSON file of {query, response}")
    p.add_argument("--init", required=True, help="model folder, shipped checkpoint name, or 'scratch'")
    p.add_argument("--size", default="tiny", help="model size for --init scratch")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs, else 200)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the training data (sets --steps)")
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL examples per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per process per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr (0: to zero)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--betas", default="0.9,0.95", help="AdamW betas (Hugging Face Trainer default: 0.9,0.999)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=512, help="drop examples longer than this (tokens)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="objective option")
    p.add_argument("--chat-template", action="store_true", help="encode prompts with the tokenizer's chat template")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="(default: the accelerate config's)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    p.add_argument("--resume", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from accelerate import Accelerator

    from refusion.core.registry import get_registry
    from refusion.models.build import build_model
    from refusion.models.loading import load_pretrained
    from refusion.training.cli import parse_sets, scratch_tokenizer
    from refusion.training.data import load_pairs, load_texts

    args = build_parser().parse_args(argv)
    kw = {"mixed_precision": args.mixed_precision} if args.mixed_precision else {}
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum, **kw)
    cls = get_registry().get("objective", args.objective)
    options = cls.Options(**parse_sets(args.set))
    if args.init == "scratch":
        tokenizer = scratch_tokenizer(args.data)
        model = build_model(tokenizer, args.size, seed=args.seed, max_position_embeddings=max(512, args.max_length))
    else:
        model, tokenizer = load_pretrained(args.init)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    objective = cls.from_tokenizer(tokenizer, options)
    max_len = min(args.max_length, int(getattr(model.config, "max_position_embeddings", args.max_length)))
    if args.chat_template:
        texts = load_texts(args.data, "train", args.limit)
        train_pairs, val_pairs = encode_chat_pairs(tokenizer, texts, max_len), encode_chat_pairs(
            tokenizer, load_texts(args.data, "validation"), max_len)
    else:
        train_pairs = load_pairs(args.data, tokenizer, "train", max_length=max_len, limit=args.limit)
        val_pairs = load_pairs(args.data, tokenizer, "validation", max_length=max_len)
    steps = args.steps or (math.ceil(args.epochs * len(train_pairs) / args.batch_size) if args.epochs else 200)
    config = TrainConfig(
        steps=steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup,
        weight_decay=args.weight_decay, betas=tuple(float(b) for b in args.betas.split(",")), grad_clip=args.grad_clip,
        seed=args.seed, log_every=args.log_every,
        save_every=args.save_every, eval_every=args.eval_every, threads=args.threads, progress=False,
    )
    trainer = DistributedTrainer(model, tokenizer, objective, train_pairs, config, args.out, accelerator=accelerator,
                                 val_pairs=val_pairs)
    summary = trainer.train(resume=args.resume)
    if accelerator.is_main_process:
        print(json.dumps(summary, default=str))
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    # A barrier drains gloo's work queue before exit: otherwise the DDP reducer, freed at interpreter
    # teardown with the GIL held, joins gloo's worker thread while that thread waits for the GIL to free
    # the last all-gather's tensors (a deadlock seen in about half of the 2-process CPU runs here).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    _LIVE.append(trainer)  # not freed on return: see __main__
    return 0


# The barrier above made that deadlock rare, not impossible: under CPU contention ~1 run in 6 still hung
# (faulthandler: the main thread in C code at the `main()` call, as main's locals were freed, and gloo's
# thread without a Python frame). So the trainer outlives main() and the command-line process leaves
# with os._exit, without freeing it: everything is written and flushed by then.
_LIVE: list[Any] = []

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
