"""Built-in slot selectors.

``threshold`` (ReFusion Stage I): every slot whose score exceeds ``slot_threshold``; if none does, the
single best-scoring slot (top-1 fallback), so every iteration makes progress.
``left_to_right`` (the paper's "ReFusion left-to-right" ablation): the ``n`` leftmost pool slots,
whatever their scores.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, Selector


class ThresholdSelector(Selector):
    class Options(Options):
        slot_threshold: float = Field(0.9, ge=0.0, le=1.0, description="choose slots scoring above this")

    def select(self, scores: Tensor) -> list[int]:
        chosen = (scores > self.options.slot_threshold).nonzero().flatten().tolist()
        return chosen if chosen else [int(scores.argmax())]


class LeftToRightSelector(Selector):
    class Options(Options):
        n: int = Field(1, ge=1, description="number of leftmost slots to choose")

    def select(self, scores: Tensor) -> list[int]:
        return list(range(min(self.options.n, len(scores))))


@hookimpl
def register_selectors(register):
    register("threshold", ThresholdSelector)
    register("left_to_right", LeftToRightSelector)
