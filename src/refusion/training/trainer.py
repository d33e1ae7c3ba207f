"""The training loop: AdamW + warmup/cosine schedule, grad clipping, fp32, exact resume, over a runtime.

One loop (:class:`Trainer`) serves one process and many. Every step draws a GLOBAL batch of example
indices from the seeded sampler; the process keeps its share (indices ``rank::world``) and cuts it into
``grad_accum`` micro-batches; each is built (objective noise), moved to the device and back-propagated
inside the runtime's accumulation context, the optimizer stepping once the gradient is complete; the
schedule steps once per optimizer step. Metrics are summed over micro-batches, steps and processes and
logged as means every ``log_every`` steps. A :class:`TrainingRuntime` decides where: :class:`LocalRuntime` (the
default) is one process on ``config.device`` (``world = grad_accum = 1``); the accelerate runtime
(:mod:`refusion.training.distributed`: DDP, FSDP2, DeepSpeed) spreads the steps over processes. With one
process and one micro-batch both compute the same steps.

Files written to ``out_dir`` (the local runtime's state files; the accelerate runtime writes its own):

- ``train_log.jsonl``: one JSON object per line; ``{"kind": "train", "step", "lr", "loss", ...}`` every
  ``log_every`` steps (metrics averaged over the interval, plus tokens/s and elapsed seconds) and
  ``{"kind": "eval", "step", "loss", "masked_acc" | "acc", ...}`` every ``eval_every`` steps and at the
  end, computed on a fixed validation batch (same examples and same noise every time), and
  ``{"kind": "start", "step", "machine", "threads"}`` each time training starts or resumes (a stage
  resumed on another host names both);
- ``trainer_state.pt`` + ``trainer_weights.safetensors`` (fp32): the resumable state (step, optimizer,
  scheduler, data order and position, generator and global RNG states, config), written every
  ``save_every`` steps and at the end; ``train(resume=True)`` continues exactly where it stopped
  (same batches, same noise, same weights up to float round-off);
- the final model as a Hugging Face folder (bf16 safetensors + tokenizer) in ``final_dir``
  (default: ``out_dir``), its config carrying ``refusion_attention`` / ``refusion_block_size`` /
  ``refusion_objective`` / ``mask_token_id``.

Randomness: batches are drawn from epoch permutations of a ``data`` generator, objective noise from a
separate ``noise`` generator, both seeded from ``seed`` (noise: ``seed + 1 + rank * NOISE_SEED_STRIDE``)
and saved in the state.

Why one module of about 550 lines: the sampler, the runtime interface and the loop save and restore one
resumable state together; split, each would need the others' private fields.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch
from safetensors.torch import load_model, save_model
from tqdm.auto import tqdm

from refusion.core.machine import machine
from refusion.core.objective import Batch, Objective, Pair
from refusion.models.build import record_objective
from refusion.models.loading import save_pretrained
from refusion.training.config import TrainConfig  # noqa: F401  (its old home; the settings live in training.config)

STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "trainer_weights.safetensors"
LOG_FILE = "train_log.jsonl"
NOISE_SEED_STRIDE = 1_000_003  # noise seeds of distributed ranks lie this far apart


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    warm, total, floor = config.warmup(), config.steps, config.min_lr_ratio

    def f(step: int) -> float:
        if warm > 0 and step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class _Sampler:
    """Epoch permutations of the training pairs; batches by count or token budget, optionally
    grouped by length (a pool of ``group`` batches is sorted by length, cut, and the batches shuffled)."""

    def __init__(self, n: int, generator: torch.Generator, group: int = 0) -> None:
        self.n = n
        self.gen = generator
        self.group = group
        self.perm: list[int] = []
        self.pos = 0
        self.epoch = 0
        self.queue: list[list[int]] = []

    def _next_index(self) -> int:
        if self.pos >= len(self.perm):
            self.perm = torch.randperm(self.n, generator=self.gen).tolist()
            self.pos = 0
            self.epoch += 1
        i = self.perm[self.pos]
        self.pos += 1
        return i

    def _peek(self) -> int:
        if self.pos >= len(self.perm):
            return -1
        return self.perm[self.pos]

    @staticmethod
    def _cut(idx: list[int], batch_size: int, max_tokens: int | None, length: Callable[[int], int]) -> list[list[int]]:
        out: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i in idx:
            li = length(i)
            if cur and (len(cur) >= batch_size or (max_tokens is not None and (len(cur) + 1) * max(longest, li) > max_tokens)):
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, li)
        if cur:
            out.append(cur)
        return out

    def next_batch(self, batch_size: int, max_tokens: int | None, length: Callable[[int], int]) -> list[int]:
        if self.group > 0:
            if not self.queue:
                pool = [self._next_index() for _ in range(batch_size * self.group)]
                pool.sort(key=length)
                batches = self._cut(pool, batch_size, max_tokens, length)
                order = torch.randperm(len(batches), generator=self.gen).tolist()
                self.queue = [batches[i] for i in order]
            return self.queue.pop(0)
        idx = [self._next_index()]
        longest = length(idx[0])
        while len(idx) < batch_size:
            if max_tokens is not None:
                nxt = self._peek()
                if nxt < 0:  # epoch boundary: stop the batch here
                    break
                if (len(idx) + 1) * max(longest, length(nxt)) > max_tokens:
                    break
            i = self._next_index()
            idx.append(i)
            longest = max(longest, length(i))
        return idx

    def state_dict(self) -> dict:
        return {"perm": list(self.perm), "pos": self.pos, "epoch": self.epoch, "queue": [list(b) for b in self.queue]}

    def load_state_dict(self, d: dict) -> None:
        self.perm, self.pos, self.epoch = list(d["perm"]), int(d["pos"]), int(d["epoch"])
        self.queue = [list(b) for b in d.get("queue", [])]


def input_length(objective: Objective, pair: Pair) -> int:
    """Approximate padded input length of one example under ``objective`` (for token budgets)."""
    p, r = len(pair[0]), len(pair[1])
    if objective.name == "block":
        bs = getattr(objective.options, "block_size", 8)
        r = math.ceil(r / bs) * bs
        return p + r + max(0, r - bs)
    return p + r


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (no decay for norms and biases)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=tuple(config.betas),
    )


def training_device(name: str) -> torch.device:
    """``name`` as a torch device, or a ValueError naming the setting when it is malformed or absent here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {name!r} is not a torch device (use cpu, cuda or cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} was asked for, but torch sees no CUDA device here (use cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {name!r} is not supported for training (use cpu, cuda or cuda:N)")
    return device


def validation_batch(objective: Objective, val_pairs: Sequence[Pair], config: TrainConfig) -> Batch:
    """The fixed validation batch: the first ``eval_batch_size`` pairs with a fixed noise seed."""
    gen = torch.Generator().manual_seed(config.seed + 12345)
    return objective.make_batch(list(val_pairs[: config.eval_batch_size]), gen)


class TrainingRuntime:
    """Where :class:`Trainer`'s steps run. The defaults are one process's: ``world = grad_accum = 1``, no
    accumulation or mixed-precision context, no collectives. A subclass places the model and optimizer
    (:meth:`setup`) and keeps the resumable state and the final model in its own files."""

    rank: int = 0
    world: int = 1
    grad_accum: int = 1
    is_main: bool = True
    device: torch.device

    def setup(self, model: torch.nn.Module, config: TrainConfig) -> tuple[torch.nn.Module, Any, Any]:
        """``(model, optimizer, scheduler)`` ready to train: the model placed, AdamW (:func:`build_optimizer`)
        and the :func:`lr_lambda` schedule on the optimizer the loop steps."""
        raise NotImplementedError

    def accumulate(self, model: torch.nn.Module) -> ContextManager:
        """The context of one micro-batch's forward, backward and optimizer step (which, accumulating, only
        acts on the last micro-batch of a step)."""
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        """The mixed-precision context of forwards."""
        return contextlib.nullcontext()

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch whose backward completes the step's gradient."""
        return True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float | None:
        """Clip the gradient to ``max_norm``; its norm before clipping (None when clipped elsewhere)."""
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over processes (every process calls it at the same step)."""
        return values

    def log_fields(self) -> dict[str, Any]:
        """Extra fields of the start and train log records."""
        return {}

    def save_state(self, trainer: "Trainer", state: dict[str, Any]) -> None:
        """Write the loop's ``state`` (step, data order, generators, config, objective) and the runtime's
        own (weights, optimizer, schedule, RNG) into ``trainer.out_dir``."""
        raise NotImplementedError

    def read_state(self, out_dir: Path) -> dict[str, Any] | None:
        """The loop's state saved in ``out_dir``; None when there is none."""
        raise NotImplementedError

    def restore_state(self, trainer: "Trainer", state: dict[str, Any]) -> None:
        """Load the runtime's share of a state that :meth:`read_state` returned."""
        raise NotImplementedError

    def save_final(self, trainer: "Trainer") -> None:
        """The final Hugging Face folder in ``trainer.final_dir``: bf16 safetensors, the tokenizer, a config
        recording the objective."""
        raise NotImplementedError

    def summary(self, trainer: "Trainer") -> dict[str, Any]:
        """Extra fields of :meth:`Trainer.train`'s summary."""
        return {}


class LocalRuntime(TrainingRuntime):
    """One process on ``device``; the state is ``trainer_state.pt`` + ``trainer_weights.safetensors`` (fp32)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = training_device(str(device))

    def setup(self, model, config):
        model = model.to(self.device)
        optimizer = build_optimizer(model, config)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))

    def save_state(self, trainer, state):
        out = trainer.out_dir
        out.mkdir(parents=True, exist_ok=True)
        tmp_w = out / (WEIGHTS_FILE + ".tmp")
        save_model(trainer.model, str(tmp_w))
        state = {**state, "optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        tmp_s = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp_s)
        os.replace(tmp_w, out / WEIGHTS_FILE)
        os.replace(tmp_s, out / STATE_FILE)

    def read_state(self, out_dir):
        if not (out_dir / STATE_FILE).is_file() or not (out_dir / WEIGHTS_FILE).is_file():
            return None
        return torch.load(out_dir / STATE_FILE, map_location="cpu", weights_only=False)

    def restore_state(self, trainer, state):
        load_model(trainer.model, str(trainer.out_dir / WEIGHTS_FILE), strict=True)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])

    def save_final(self, trainer):
        record_objective(trainer.model.config, trainer.objective)
        save_pretrained(trainer.model, trainer.tokenizer, trainer.final_dir)


class Trainer:
    """Train ``model`` with ``objective`` on ``train_pairs`` over ``runtime`` (default: one process on
    ``config.device``); the module docstring describes the loop and its files. ``config.batch_size`` is the
    global batch, a multiple of ``world x grad_accum``; a batch split over several is cut by example count
    (no ``max_tokens`` or ``group_by_length``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        objective: Objective,
        train_pairs: Sequence[Pair],
        config: TrainConfig,
        out_dir: str | os.PathLike,
        val_pairs: Sequence[Pair] | None = None,
        final_dir: str | os.PathLike | None = None,
        runtime: TrainingRuntime | None = None,
    ) -> None:
        if not train_pairs:
            raise ValueError("no training pairs")
        self.runtime = runtime if runtime is not None else LocalRuntime(config.device)
        self.rank, self.world, self.grad_accum = self.runtime.rank, self.runtime.world, self.runtime.grad_accum
        if self.grad_accum < 1 or config.batch_size % (self.world * self.grad_accum):
            raise ValueError(f"the global batch_size ({config.batch_size}) must be a multiple of processes x "
                             f"grad_accum ({self.world} x {self.grad_accum})")
        if self.world * self.grad_accum > 1 and (config.max_tokens is not None or config.group_by_length):
            raise ValueError("a batch split over processes or micro-batches is cut by example count: "
                             "max_tokens / group_by_length are not supported")
        self.tokenizer, self.objective, self.config = tokenizer, objective, config
        self.train_pairs, self.val_pairs = train_pairs, val_pairs or []
        self.out_dir = Path(out_dir)
        self.final_dir = Path(final_dir) if final_dir is not None else self.out_dir
        self.step = self.tokens_seen = 0
        self.elapsed = 0.0
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        model.float()
        record_objective(model.config, objective)
        self.data_gen = torch.Generator().manual_seed(config.seed)
        self.noise_gen = torch.Generator().manual_seed(config.seed + 1 + self.rank * NOISE_SEED_STRIDE)
        self.sampler = _Sampler(len(train_pairs), self.data_gen, config.group_by_length)
        self._length: Callable[[int], int] = lambda i: 0  # batches by count never read a length
        if config.max_tokens is not None or config.group_by_length:
            self._length = [input_length(objective, p) for p in train_pairs].__getitem__
        self.model, self.optimizer, self.scheduler = self.runtime.setup(model, config)
        self.device = self.runtime.device
        self._val_batch: Batch | None = None

    # -- state ------------------------------------------------------------------------------
    def save_state(self) -> None:
        self.runtime.save_state(self, {
            "step": self.step, "elapsed": self.elapsed, "tokens_seen": self.tokens_seen,
            "sampler": self.sampler.state_dict(), "data_gen": self.data_gen.get_state(),
            "noise_gen": self.noise_gen.get_state(), "config": self.config.model_dump(),
            "objective": {"name": self.objective.name, "options": self.objective.options.model_dump()},
        })

    def load_state(self) -> bool:
        """Restore from ``out_dir`` if a state is there; returns whether it did."""
        state = self.runtime.read_state(self.out_dir)
        if state is None:
            return False
        saved = state.get("objective", {}).get("name", self.objective.name)
        if saved != self.objective.name:
            raise ValueError(f"the state in {self.out_dir} was written by objective {saved!r}, not "
                             f"{self.objective.name!r}")
        self.runtime.restore_state(self, state)
        self.sampler.load_state_dict(state["sampler"])
        self.data_gen.set_state(state["data_gen"])
        self.noise_gen.set_state(state["noise_gen"])
        self.step = int(state["step"])
        self.elapsed = float(state.get("elapsed", 0.0))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self._truncate_log()
        return True

    def _truncate_log(self) -> None:
        """Drop log lines written after the saved step (they will be written again)."""
        path = self.out_dir / LOG_FILE
        if not self.runtime.is_main or not path.is_file():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(rec.get("step", 0)) <= self.step:
                keep.append(line)
        path.write_text("".join(l + "\n" for l in keep))

    def _log(self, record: dict) -> None:
        if self.runtime.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / LOG_FILE, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    # -- batches and evaluation -----------------------------------------------------------
    def next_indices(self) -> list[int]:
        """The example indices of the next global batch."""
        return self.sampler.next_batch(self.config.batch_size, self.config.max_tokens, self._length)

    def shard(self, indices: list[int]) -> list[list[int]]:
        """This process's share of a global batch, cut into ``grad_accum`` micro-batches."""
        mine = indices[self.rank :: self.world]
        return [mine[j :: self.grad_accum] for j in range(self.grad_accum)]

    def make_batch(self, indices: list[int]) -> Batch:
        """The objective's batch of ``indices`` (noise from the noise generator), on the device."""
        return self.objective.make_batch([self.train_pairs[i] for i in indices], self.noise_gen).to(self.device)

    def evaluate(self) -> dict[str, float]:
        """Loss and masked_acc (acc for ``ar``) on a fixed validation batch (empty without val pairs), the
        same on every process."""
        if not self.val_pairs:
            return {}
        if self._val_batch is None:
            self._val_batch = validation_batch(self.objective, self.val_pairs, self.config).to(self.device)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.runtime.autocast():
            _, metrics = self.objective.loss(self.model, self._val_batch)
        self.model.train(was_training)
        return metrics

    # -- training ---------------------------------------------------------------------------
    def _step(self, sums: dict[str, float], counts: dict[str, int]) -> tuple[float, int]:
        """One optimizer step on the next global batch, its metrics added to ``sums`` / ``counts`` (a NaN
        counts nothing). Returns the learning rate it stepped with and its tokens over all processes."""
        cfg, rt = self.config, self.runtime
        indices = self.next_indices()
        lr = self.scheduler.get_last_lr()[0]
        tokens = 0
        per_step = {"batch_size": float(len(indices))}
        for part in self.shard(indices):
            batch = self.make_batch(part)
            with rt.accumulate(self.model), rt.autocast():
                loss, metrics = self.objective.loss(self.model, batch)
                if not torch.isfinite(loss):
                    where = f"rank {self.rank}: " if self.world > 1 else ""
                    raise FloatingPointError(f"{where}non-finite loss {loss.item()} at step {self.step + 1}")
                rt.backward(loss)  # accumulating: divided by grad_accum there
                if rt.sync_gradients and cfg.grad_clip and cfg.grad_clip > 0:
                    norm = rt.clip_grad_norm(self.model, cfg.grad_clip)
                    if norm is not None:
                        per_step["grad_norm"] = norm
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            tokens += batch.num_tokens * self.world
            for k, v in metrics.items():
                counted = not (isinstance(v, float) and math.isnan(v))
                sums[k] = sums.get(k, 0.0) + (float(v) if counted else 0.0)
                counts[k] = counts.get(k, 0) + counted
        for k, v in per_step.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
        self.scheduler.step()
        self.step += 1
        return lr, tokens

    def _means(self, sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
        """The interval's metrics averaged over its steps, micro-batches and processes (one collective)."""
        keys = sorted(sums)
        local = torch.tensor([sums[k] for k in keys] + [counts[k] for k in keys], dtype=torch.float64,
                             device=self.device)
        total = self.runtime.reduce_sum(local).tolist()
        n = len(keys)
        return {k: total[i] / total[n + i] for i, k in enumerate(keys) if total[n + i] > 0}

    def train(self, resume: bool = False, stop_at: int | None = None) -> dict[str, Any]:
        """Train to ``config.steps`` (or stop after step ``stop_at``, saving the state there); returns a summary."""
        cfg, rt = self.config, self.runtime
        if not (resume and self.load_state()) and rt.is_main and (self.out_dir / LOG_FILE).exists():
            (self.out_dir / LOG_FILE).unlink()  # a fresh run starts a fresh log
        end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
        host = machine()
        if self.step < end:
            self._log({"kind": "start", "step": self.step, "machine": host, "threads": torch.get_num_threads(),
                       **rt.log_fields()})
        self.model.train()
        diffusion = self.objective.diffusion
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        interval_tokens = 0
        interval_start = time.perf_counter()
        last_metrics: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        bar = tqdm(
            total=cfg.steps, initial=self.step, desc=f"train {self.objective.name}",
            disable=not (cfg.progress and rt.is_main),
            mininterval=0.5 if sys.stderr.isatty() else 30.0, dynamic_ncols=True,
        )
        t_run = time.perf_counter()
        elapsed0 = self.elapsed
        while self.step < end:
            lr, tokens = self._step(sums, counts)
            self.tokens_seen += tokens
            interval_tokens += tokens
            self.elapsed = elapsed0 + time.perf_counter() - t_run
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == end:
                now = time.perf_counter()
                last_metrics = self._means(sums, counts)
                self._log({"kind": "train", "step": self.step, "lr": lr, **last_metrics, "tokens": self.tokens_seen,
                           "tok_per_s": interval_tokens / max(now - interval_start, 1e-9),
                           "elapsed": round(self.elapsed, 2), **rt.log_fields()})
                post = {"loss": f"{last_metrics.get('loss', math.nan):.3f}"}
                if diffusion and "masked_acc" in last_metrics:
                    post["macc"] = f"{last_metrics['masked_acc']:.3f}"
                bar.set_postfix(post, refresh=False)
                sums, counts, interval_tokens, interval_start = {}, {}, 0, now
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps and self.val_pairs:
                last_eval = self.evaluate()
                self._log({"kind": "eval", "step": self.step, **last_eval})
                if diffusion and "masked_acc" in last_eval:
                    bar.write(f"step {self.step}: val loss {last_eval['loss']:.4f} masked_acc {last_eval['masked_acc']:.3f}")
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < end:
                self.save_state()
        bar.close()
        self.save_state()
        finished = self.step >= cfg.steps
        if finished:
            if self.val_pairs:
                last_eval = self.evaluate()
                self._log({"kind": "eval", "step": self.step, **last_eval})
            rt.save_final(self)
        return {
            "objective": self.objective.name,
            "options": self.objective.options.model_dump(),
            "steps": self.step,
            "finished": finished,
            "train": last_metrics,
            "eval": last_eval,
            "tokens": self.tokens_seen,
            "wall_s": round(self.elapsed, 2),
            "batch_size": cfg.batch_size,
            "max_tokens": cfg.max_tokens,
            "lr": cfg.lr,
            "params": sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters()),
            "machine": host,
            **rt.summary(self),
        }


def read_log(out_dir: str | os.PathLike) -> list[dict]:
    """The records of ``out_dir/train_log.jsonl``."""
    path = Path(out_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
