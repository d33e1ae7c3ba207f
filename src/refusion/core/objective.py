"""The training-objective interface: :class:`Objective` and the padded :class:`Batch` it builds.

An objective turns ``(prompt_ids, response_ids)`` pairs (response already ending in EOS) into a
:class:`Batch` and computes a scalar loss from a model and that batch. Convention shared by every
objective of this project: ``labels[b, j]`` is the target of the logits AT position ``j`` (labels are
already shifted where the objective wants next-token prediction), so the loss is computed from the
logits directly and ``labels=`` is never passed to the Hugging Face model (which would shift again).

Objectives are registered through the plugin hook ``register_objectives`` (see
:mod:`refusion.plugins.objectives`) and looked up with ``get_registry().get("objective", name)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE = -100

Pair = tuple[list[int], list[int]]


@dataclass
class Batch:
    """A padded training batch.

    - ``input_ids``, ``position_ids``, ``labels``: ``[B, L]`` long; ``labels == -100`` is ignored.
    - ``attention_mask``: ``[B, L]`` (1 = real token; causal attention) or ``[B, 1, L, L]`` float additive
      (0 = attend, ``finfo.min`` = blocked) for bidirectional / block-causal attention.
    - ``masked``: ``[B, L]`` bool, True where the input is ``[MASK]`` and the label is the original token
      at that same position (diffusion targets; an objective with shifted targets marks the position
      before each ``[MASK]``, whose logits predict it).
    - ``weights``: ``[B, L]`` float, per-token loss weight of the diffusion targets
      (``1 / (p_mask * answer_length)``), 0 elsewhere.
    - ``n_examples``: number of examples (the divisor of the diffusion loss).
    - ``label_positions``: ``[K]`` long, the positions ``j`` where some row has a label, ascending: the only
      positions whose logits a loss reads. Filled from ``labels`` when the batch is built (on the host,
      so no device synchronisation) and carried along by :meth:`to`.
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    masked: Tensor
    weights: Tensor
    n_examples: int
    meta: dict[str, Any] = field(default_factory=dict)
    label_positions: Tensor | None = None

    def __post_init__(self) -> None:
        if self.label_positions is None:
            self.label_positions = (self.labels != IGNORE).any(0).nonzero().flatten()

    def targets(self) -> "Targets":
        """``labels``, ``masked`` and ``weights`` at :attr:`label_positions`, ``[B, K]`` each."""
        at = self.label_positions.to(self.labels.device)
        return Targets(labels=self.labels[:, at], masked=self.masked[:, at], weights=self.weights[:, at])

    def to(self, device: torch.device | str) -> "Batch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, Tensor) else v
        return Batch(**kw)

    @property
    def num_tokens(self) -> int:
        """Number of non-padding input tokens."""
        if self.attention_mask.dim() == 2:
            return int(self.attention_mask.sum())
        return int(self.meta.get("n_tokens", self.input_ids.numel()))


@dataclass
class Targets:
    """A batch's targets at its :attr:`Batch.label_positions`: ``labels`` ``[B, K]`` long (``-100`` =
    ignored), ``masked`` ``[B, K]`` bool, ``weights`` ``[B, K]`` float, as in :class:`Batch`."""

    labels: Tensor
    masked: Tensor
    weights: Tensor


class Objective(ABC):
    """A training objective: batch layout + loss. Subclasses set ``name``, ``attention``, ``Options``."""

    name: ClassVar[str] = ""
    #: attention the model is trained with: "causal" | "bidirectional" | "block_causal"
    attention: ClassVar[str] = "causal"
    #: whether the objective trains [MASK] predictions (reports ``masked_acc``)
    diffusion: ClassVar[bool] = False
    #: whether the layout depends on which examples share a batch (``mdm`` pads each response with EOS to
    #: the batch's longest), so that batching by length (``TrainConfig.group_by_length``) changes what is
    #: learned; the recipe trains such objectives on random batches
    wants_random_batches: ClassVar[bool] = False

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, mask_id: int, pad_id: int, eos_id: int, options: "Objective.Options | dict | None" = None,
                 **kwargs: Any) -> None:
        self.mask_id = int(mask_id)
        self.pad_id = int(pad_id)
        self.eos_id = int(eos_id)
        if options is None:
            options = {}
        if isinstance(options, dict):
            options = self.Options(**{**options, **kwargs})
        elif kwargs:
            options = self.Options(**{**options.model_dump(), **kwargs})
        self.options = options

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, options: "Objective.Options | dict | None" = None, **kw: Any) -> "Objective":
        """Build with the tokenizer's mask / pad / eos ids."""
        mask_id = tokenizer.mask_token_id
        if mask_id is None:
            mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(mask_id=mask_id, pad_id=pad_id, eos_id=tokenizer.eos_token_id, options=options, **kw)

    @abstractmethod
    def make_batch(self, pairs: list[Pair], generator: torch.Generator) -> Batch:
        """Build a padded batch from ``(prompt_ids, response_ids)`` pairs using only ``generator``."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss and float metrics (diffusion objectives include ``masked_acc``)."""

    # -- helpers shared by the objectives ---------------------------------------------------
    @staticmethod
    def forward_logits(model: torch.nn.Module, batch: Batch, positions: Tensor | None = None) -> Tensor:
        """Logits ``[B, L, V]`` in the model's dtype, or ``[B, K, V]`` at ``positions [K]`` only: just those
        rows go through the output head (``logits_to_keep``). :meth:`token_ce` casts them to float32 (chunk
        by chunk when they are 16-bit and need gradients). Always passes position ids and a mask, never
        a cache."""
        keep = 0 if positions is None else positions.to(batch.input_ids.device)
        out = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
            logits_to_keep=keep,
        )
        logits = out.logits
        if positions is not None and logits.shape[1] != keep.numel():  # a model that ignores logits_to_keep
            logits = logits[:, keep]
        return logits

    @classmethod
    def label_logits(cls, model: torch.nn.Module, batch: Batch) -> tuple[Tensor, Targets]:
        """Logits ``[B, K, V]`` at the batch's :attr:`~Batch.label_positions` and the :class:`Targets`
        there. Positions no row has a label at (the prompt, padding) cost no full-vocabulary row: at a
        151,936-token vocabulary each row is 0.6 MB of float32 logits, and as much again for its
        gradient."""
        return cls.forward_logits(model, batch, batch.label_positions), batch.targets()

    @staticmethod
    def token_ce(logits: Tensor, labels: Tensor) -> Tensor:
        """Per-token cross entropy ``[B, L]`` in float32 (0 where the label is ignored) from ``logits
        [B, L, V]`` of any float dtype.

        Logits of more than :data:`CE_CHUNK_ELEMENTS` values go in chunks of rows, so that one chunk's
        float32 copy and log-softmax are alive at a time, not a float32 copy of all the logits and their
        log-softmax (2.5 GB each at 4,096 labelled positions of a 151,936-token vocabulary): without
        gradients (evaluation) always; with gradients when the logits are 16-bit, each chunk then being
        recomputed in the backward pass (activation checkpointing), since the backward pass would keep
        every chunk's log-softmax. Float32 logits with gradients need no copy, and their log-softmax in
        one pass costs no more memory at its peak than the recomputation, so they take one pass. Each
        row is its own computation, so the values equal the unchunked ones."""
        b, l, v = logits.shape
        rows, row_labels = logits.reshape(b * l, v), labels.reshape(b * l)
        per_chunk = max(1, CE_CHUNK_ELEMENTS // v)
        with_grad = torch.is_grad_enabled() and logits.requires_grad
        if b * l <= per_chunk or (with_grad and logits.dtype not in (torch.bfloat16, torch.float16)):
            return _rows_ce(rows, row_labels).reshape(b, l)
        chunks = zip(rows.split(per_chunk), row_labels.split(per_chunk))  # one SplitBackward for all chunks
        if not with_grad:
            return torch.cat([_rows_ce(r, y) for r, y in chunks]).reshape(b, l)
        return torch.cat([checkpoint(_rows_ce, r, y, use_reentrant=False) for r, y in chunks]).reshape(b, l)


#: logits per cross-entropy chunk in :meth:`Objective.token_ce` (256 MB of float32)
CE_CHUNK_ELEMENTS = 1 << 26


def _rows_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """``logits [N, V]``, ``labels [N]`` -> float32 cross entropy ``[N]`` (0 where ignored)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="none")

