"""Built-in extender ``prefix``: ReFusion's Stage II-b verification round at ``token_threshold``.

In each round a token passes when its causal probability exceeds the threshold or its predecessor was
already verified before the round; verified = cumulative product of passes. So every row with unverified
tokens gains at least one token per round. The threshold is the verifier's ``token_threshold`` unless the
extender sets its own (ReFusion uses one threshold for Stage II-a and II-b).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Extender, Options, Verifier


class PrefixExtender(Extender):
    class Options(Options):
        token_threshold: float | None = Field(
            None, ge=0.0, le=1.0,
            description="verify tokens whose AR prob exceeds this (None: the verifier's token_threshold)")

    def bind(self, verifier: Verifier) -> "PrefixExtender":
        if self.options.token_threshold is not None:
            return self
        threshold = getattr(verifier.options, "token_threshold", None)
        if threshold is None:
            raise ValueError(f"prefix takes token_threshold from the verifier, but {type(verifier).__name__} has "
                             "none: set extender.token_threshold, or choose the extender that goes with the verifier")
        return type(self)(self.options.model_copy(update={"token_threshold": threshold}))

    def extend(self, ar_probs: Tensor, verified: Tensor) -> Tensor:
        threshold = self.options.token_threshold
        if threshold is None:
            raise ValueError("extender prefix has no token_threshold: set one, or bind it to a verifier")
        predecessor = torch.nn.functional.pad(verified, (1, 0), value=True)[:, :-1]  # [S, m]
        passes = (ar_probs > threshold) | predecessor
        return torch.cumprod(passes.int(), dim=-1).bool()


@hookimpl
def register_extenders(register):
    register("prefix", PrefixExtender)
