"""Built-in drafters: the argmax / Gumbel-max draft at [MASK] positions.

``gumbel`` with ``temperature: 0`` is plain argmax, and nothing else reads the vocabulary but the
argmax and the logsumexp behind the drafted token's probability. With ``T > 0`` it samples as the
reference does, ``argmax(exp(logits) / (-log u)^T)`` in float64, computed in log space as
``argmax(logits - T * log(-log u))`` (the same argmax, without overflow of ``exp``), the uniform noise
drawn from the decoder's seeded generator on the logits' device. The returned probability is the
softmax probability of the drafted token under the un-noised logits.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Drafter, Options
from refusion.core.probs import row_argmax, token_probs
from refusion.core.types import Proposal


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor:
    """Token ids ``[...]`` from ``logits [..., V]``: argmax at T=0, Gumbel-max sampling (float64) above."""
    if temperature == 0:
        return row_argmax(logits)
    device = generator.device if generator is not None else logits.device
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=device).to(logits.device)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    return (logits.double() - temperature * torch.log(-torch.log(u))).argmax(dim=-1)


class GumbelDrafter(Drafter):
    class Options(Options):
        temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = argmax; >0 = Gumbel-max sampling")

    def draft(self, logits: Tensor, generator: torch.Generator | None = None) -> Proposal:
        ids = gumbel_argmax(logits, self.options.temperature, generator)  # [S, k]
        return Proposal(token_ids=ids, probs=token_probs(logits, ids), logits=logits)


@hookimpl
def register_drafters(register):
    register("gumbel", GumbelDrafter)
