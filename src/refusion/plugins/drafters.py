"""Built-in drafters: the argmax / Gumbel-max draft at [MASK] positions.

``gumbel`` with ``temperature: 0`` is plain argmax. With ``T > 0`` it samples as the reference does,
``argmax(exp(logits) / (-log u)^T)`` in float64, computed in log space as
``argmax(logits - T * log(-log u))`` (the same argmax, without overflow of ``exp``). The returned
probability is the softmax probability of the drafted token under the un-noised logits.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Drafter, Options
from refusion.core.types import Proposal


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Token ids ``[...]`` from ``logits [..., V]``: argmax at T=0, Gumbel-max sampling (float64) above."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator).to(logits.device)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    return (logits.double() - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


class GumbelDrafter(Drafter):
    class Options(Options):
        temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = argmax; >0 = Gumbel-max sampling")

    def draft(self, logits: Tensor, generator: torch.Generator | None = None) -> Proposal:
        ids = gumbel_argmax(logits, self.options.temperature, generator)  # [S, k]
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids[..., None]).squeeze(-1)  # [S, k]
        return Proposal(token_ids=ids, probs=probs, logits=logits)


@hookimpl
def register_drafters(register):
    register("gumbel", GumbelDrafter)
