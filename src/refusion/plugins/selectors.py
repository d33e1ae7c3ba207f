"""Built-in slot selectors.

``threshold`` (ReFusion Stage I): every slot whose score exceeds ``slot_threshold``; if none does, the
single best-scoring slot (top-1 fallback), so every iteration makes progress.
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


@hookimpl
def register_selectors(register):
    register("threshold", ThresholdSelector)
