"""Two parts, registered through refusion's hooks as any third-party package does.

* scorer ``min_prob``: a slot is as confident as its least confident drafted token;
* verifier ``running_product``: a drafted token passes while the product of the causal probabilities
  from the start of its slot stays above ``min_product`` (a whole-prefix criterion instead of
  ReFusion's per-token threshold).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, Scorer, Verifier
from refusion.core.types import Proposal, Verdict


class MinProb(Scorer):
    """The smallest drafted-token probability over each slot's real positions."""

    def score(self, proposal: Proposal) -> Tensor:
        probs = proposal.probs.masked_fill(~proposal.mask, 1.0)  # [S, k]; padding never lowers the score
        return probs.min(dim=-1).values  # [S]


class RunningProduct(Verifier):
    """Accept the longest prefix whose tokens keep the running product of causal probabilities (per slot,
    the slot's first token excluded: it keeps its Stage-I probability) above ``min_product``."""

    class Options(Options):
        min_product: float = Field(0.5, gt=0.0, le=1.0, description="lowest running product a passing token keeps")

    def _passes(self, ar_probs: Tensor, valid: Tensor) -> Tensor:
        probs = torch.where(valid, ar_probs, 1.0)  # [S, k]
        probs[:, 0] = 1.0
        return torch.cumprod(probs, dim=-1) >= self.options.min_product  # [S, k]

    def verify(self, draft_probs: Tensor, ar_probs: Tensor, valid: Tensor | None = None) -> Verdict:
        valid = torch.ones_like(ar_probs, dtype=torch.bool) if valid is None else valid
        passed = self._passes(ar_probs, valid) | ~valid
        run = torch.cumprod(passed.flatten().int(), 0).view_as(passed).bool()  # [S, k] inside the prefix
        accepted = torch.cumprod(run.all(dim=1).int(), 0).sum()
        return Verdict(passed=passed & valid, prefix_len=(run & valid).sum(), accepted_slots=accepted)

    def extend(self, ar_probs: Tensor, verified: Tensor) -> Tensor:
        # a round verifies the tokens that pass, and always the first unverified one (progress per round)
        predecessor = torch.nn.functional.pad(verified, (1, 0), value=True)[:, :-1]  # [S, m]
        passes = self._passes(ar_probs, torch.ones_like(verified)) | predecessor
        return torch.cumprod(passes.int(), dim=-1).bool()


@hookimpl
def register_scorers(register):
    register("min_prob", MinProb)


@hookimpl
def register_verifiers(register):
    register("running_product", RunningProduct)
