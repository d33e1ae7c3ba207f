"""Three parts, registered through refusion's hooks as any third-party package does.

* scorer ``min_prob``: a slot is as confident as its least confident drafted token;
* verifier ``running_product`` (Stage II-a): a drafted token passes while the product of the causal
  probabilities from the start of its slot stays above ``min_product`` (a whole-prefix criterion instead
  of ReFusion's per-token threshold);
* extender ``running_product`` (Stage II-b): a round verifies the tokens that keep the running product from
  the start of the unverified window above ``min_product``, and always the first unverified one; its
  ``min_product`` is the verifier's unless set.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Extender, Options, Scorer, Verifier
from refusion.core.types import Proposal, Verdict


class MinProb(Scorer):
    """The smallest drafted-token probability over each slot's real positions."""

    def score(self, proposal: Proposal) -> Tensor:
        probs = proposal.probs.masked_fill(~proposal.mask, 1.0)  # [S, k]; padding never lowers the score
        return probs.min(dim=-1).values  # [S]


def running_product_passes(ar_probs: Tensor, valid: Tensor, min_product: float) -> Tensor:
    """``[S, k]`` bool: the running product of ``ar_probs`` along each row (column 0 and padding count as 1)
    is at least ``min_product``."""
    probs = torch.where(valid, ar_probs, 1.0)  # [S, k]
    probs[:, 0] = 1.0
    return torch.cumprod(probs, dim=-1) >= min_product


class RunningProduct(Verifier):
    """Accept the longest prefix whose tokens keep the running product of causal probabilities (per slot,
    the slot's first token excluded: it keeps its Stage-I probability) above ``min_product``."""

    class Options(Options):
        min_product: float = Field(0.5, gt=0.0, le=1.0, description="lowest running product a passing token keeps")

    def verify(self, draft_probs: Tensor, ar_probs: Tensor, valid: Tensor | None = None) -> Verdict:
        valid = torch.ones_like(ar_probs, dtype=torch.bool) if valid is None else valid
        passed = running_product_passes(ar_probs, valid, self.options.min_product) | ~valid
        run = torch.cumprod(passed.flatten().int(), 0).view_as(passed).bool()  # [S, k] inside the prefix
        accepted = torch.cumprod(run.all(dim=1).int(), 0).sum()
        return Verdict(passed=passed & valid, prefix_len=(run & valid).sum(), accepted_slots=accepted)


class RunningProductExtender(Extender):
    """A Stage II-b round by the running product: the tokens that pass, and always the first unverified one
    (progress per round)."""

    class Options(Options):
        min_product: float | None = Field(None, gt=0.0, le=1.0,
                                          description="lowest running product (None: the verifier's min_product)")

    def bind(self, verifier: Verifier) -> "RunningProductExtender":
        if self.options.min_product is not None:
            return self
        if not isinstance(verifier, RunningProduct):
            raise ValueError("running_product takes min_product from a running_product verifier: set "
                             "extender.min_product")
        return type(self)(self.Options(min_product=verifier.options.min_product))

    def extend(self, ar_probs: Tensor, verified: Tensor) -> Tensor:
        predecessor = torch.nn.functional.pad(verified, (1, 0), value=True)[:, :-1]  # [S, m]
        passes = running_product_passes(ar_probs, torch.ones_like(verified), self.options.min_product) | predecessor
        return torch.cumprod(passes.int(), dim=-1).bool()


@hookimpl
def register_scorers(register):
    register("min_prob", MinProb)


@hookimpl
def register_verifiers(register):
    register("running_product", RunningProduct)


@hookimpl
def register_extenders(register):
    register("running_product", RunningProductExtender)
