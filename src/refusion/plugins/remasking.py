"""Built-in remaskers for ReFusion slots completed in Stage II-b.

* ``none``: keep every filled token (the reference behaviour).
* ``sub_slot``: the authors' proposed future work. Stage II-b verifies a slot round by round and accepts
  the first unverified token of each round whatever its probability, so a completed slot can hold
  tokens accepted with low confidence. ``sub_slot`` keeps the slot's prefix up to (not including) the
  first token whose acceptance probability is below ``threshold`` (at least ``min_keep`` tokens) and
  sends the suffix back to the pool as a shorter slot, to be redrafted later with more context.
  Cost: the remasked tokens are decoded again (more iterations and forwards); the KV of the kept prefix
  is exact (a prefix of its row), so no extra forward is needed.
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.host import to_host
from refusion.core.interfaces import Options, Remasker


class KeepAll(Remasker):
    def keep(self, confidence: Tensor, lengths: list[int]) -> list[int]:
        return list(lengths)


class SubSlotRemasker(Remasker):
    class Options(Options):
        threshold: float = Field(0.3, ge=0.0, le=1.0, description="remask from the first token accepted below this")
        min_keep: int = Field(1, ge=1, description="always keep at least this many tokens of a slot")

    def keep(self, confidence: Tensor, lengths: list[int]) -> list[int]:
        (low_rows,) = to_host(confidence < self.options.threshold)  # [S][k]: one host read
        out = []
        for low, n in zip(low_rows, lengths):
            cut = next((j for j in range(self.options.min_keep, n) if low[j]), n)
            out.append(min(n, max(cut, 1)))
        return out


@hookimpl
def register_remaskers(register):
    register("none", KeepAll)
    register("sub_slot", SubSlotRemasker)
