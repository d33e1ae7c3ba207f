"""Built-in slot selectors.

``threshold`` (ReFusion Stage I): every slot whose score exceeds ``slot_threshold``; if none does, the
single best-scoring slot (top-1 fallback), so every iteration makes progress. Variant ``fallback:
leftmost``: if none does, the leftmost pool slot instead. With the top-1 fallback a short last slot
(the answer, then EOS and confident padding) can outscore the unfinished computation before it, so an
answer is committed before the lines it depends on (seen on tinybench arith: ``#### 6 68``); the
leftmost fallback decodes in order whenever no slot is confident.
``left_to_right`` (the paper's "ReFusion left-to-right" ablation): the ``n`` leftmost pool slots,
whatever their scores.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, Selector


class ThresholdSelector(Selector):
    class Options(Options):
        slot_threshold: float = Field(0.9, ge=0.0, le=1.0, description="choose slots scoring above this")
        fallback: Literal["best", "leftmost"] = Field(
            "best", description="if no slot passes: the best-scoring one (the reference) or the leftmost one")

    def select(self, scores: Tensor) -> Tensor:
        passed = scores > self.options.slot_threshold  # [S]
        index = torch.arange(len(scores), device=scores.device)
        fallback = index == (scores.argmax() if self.options.fallback == "best" else 0)  # one-hot, no host read
        return torch.where(passed.any(), passed, fallback)


class LeftToRightSelector(Selector):
    class Options(Options):
        n: int = Field(1, ge=1, description="number of leftmost slots to choose")

    def select(self, scores: Tensor) -> Tensor:
        return torch.arange(len(scores), device=scores.device) < self.options.n


@hookimpl
def register_selectors(register):
    register("threshold", ThresholdSelector)
    register("left_to_right", LeftToRightSelector)
