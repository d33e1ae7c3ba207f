"""Training: objectives (``ar``, ``refusion``, ``mdm``, ``block``), data, the trainer, the recipe, the CLI.

- :class:`~refusion.core.objective.Objective` / :class:`~refusion.core.objective.Batch`: the
  objective interface; built-ins live in :mod:`refusion.plugins.objectives` (registered via the hook);
- :mod:`refusion.training.data`: ``load_pairs(data, tokenizer, split)`` -> ``[(prompt_ids, response_ids)]``;
- :class:`~refusion.training.trainer.Trainer` / :class:`~refusion.training.trainer.TrainConfig`: the one
  training loop, in one process (:class:`~refusion.training.trainer.LocalRuntime`) or over accelerate's
  (:mod:`refusion.training.distributed`: DDP, FSDP2, DeepSpeed);
- :mod:`refusion.training.recipe`: the controlled pretrain + fine-tune recipe behind ``tiny-*``;
- :mod:`refusion.training.cli`: ``refusion train``.
"""

from __future__ import annotations

from typing import Any

from refusion.core.objective import IGNORE, Batch, Objective, Pair

__all__ = ["IGNORE", "Batch", "Objective", "Pair", "get_objective"]


def get_objective(name: str, tokenizer: Any, options: dict | None = None) -> Objective:
    """Instantiate the objective registered as ``name`` with ``tokenizer``'s special ids."""
    from refusion.core.registry import get_registry

    return get_registry().get("objective", name).from_tokenizer(tokenizer, options or {})
