"""Built-in verifier ``prefix``: ReFusion's autoregressive verification at ``token_threshold``.

Stage II-a: the chosen drafts are concatenated in position order and verified by one causal forward. A
token passes when its causal probability exceeds ``token_threshold``; the first token of every slot
keeps its Stage-I probability and always passes. The accepted prefix is the longest all-pass run from
the start of the concatenation; only whole slots of it are accepted (``prefix_len // k``). Stage II-b's
rounds are the extender's (:mod:`refusion.plugins.extenders`), which takes this ``token_threshold`` by default.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, Verifier
from refusion.core.types import Verdict


class PrefixVerifier(Verifier):
    class Options(Options):
        token_threshold: float = Field(0.9, ge=0.0, le=1.0, description="accept tokens whose AR prob exceeds this")

    def verify(self, draft_probs: Tensor, ar_probs: Tensor, valid: Tensor | None = None) -> Verdict:
        valid = torch.ones_like(ar_probs, dtype=torch.bool) if valid is None else valid
        passed = (ar_probs > self.options.token_threshold) | ~valid  # [S, k]; padding never blocks the run
        passed[:, 0] = True  # first token of each slot keeps its Stage-I prob and is accepted
        run = torch.cumprod(passed.flatten().int(), 0).view_as(passed).bool()  # [S, k] inside the prefix
        accepted = torch.cumprod(run.all(dim=1).int(), 0).sum()  # []
        return Verdict(passed=passed & valid, prefix_len=(run & valid).sum(), accepted_slots=accepted)


@hookimpl
def register_verifiers(register):
    register("prefix", PrefixVerifier)
