"""Token-level selectors: which [MASK] positions of a pool to commit in one diffusion step.

The pool is the still-masked positions a decoder may commit now (e.g. the current LLaDA block), its
``scores [n]`` one confidence per position (a scorer over k = 1 slots, or random numbers), in
position order. A :class:`~refusion.core.interfaces.TokenSelector` also receives

* ``budget``: the decoder's scheduled count for this step (LLaDA's ``get_num_transfer_tokens``), or
  None when the decoder has no schedule;
* ``at_least_one``: whether this step must commit something (False for the younger blocks of a
  pipelined block decoder, which only commit what is confident enough).

Rules (``c_1 >= c_2 >= ...`` are the sorted scores):

``topk_per_step``         the ``k`` (option) or ``budget`` (LLaDA schedule) or 1 best positions
``confidence_threshold``  every position with score >= ``threshold``; none -> the best one
                          (Fast-dLLM ``threshold``: top-1 always, others >= threshold)
``factor``                the largest n with ``c_i >= 1 - factor / (i + 1)`` for every i <= n (i 1-based);
                          none -> the best one (Fast-dLLM ``factor``, which forces i = 1: the same
                          choice, since c_1 failing implies every later c_i fails)
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, TokenSelector


def top_n(scores: Tensor, n: int) -> Tensor:
    """``[n]`` bool mask of the ``n`` best scores (ties: the leftmost first)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return torch.zeros_like(scores, dtype=torch.bool).index_fill_(0, order[: min(n, scores.numel())], True)


class TopkPerStep(TokenSelector):
    class Options(Options):
        k: int | None = Field(None, ge=1, description="tokens per step; None = the decoder's schedule (else 1)")

    def _choose(self, scores, budget):
        return top_n(scores, self.options.k or budget or 1)


class ConfidenceThreshold(TokenSelector):
    class Options(Options):
        threshold: float = Field(0.9, ge=0.0, le=1.0, description="commit every token scoring >= this")

    def _choose(self, scores, budget):
        return scores >= self.options.threshold


class FactorSelector(TokenSelector):
    class Options(Options):
        factor: float = Field(1.0, gt=0.0, description="n tokens pass when the n-th best score >= 1 - factor/(n+1)")

    def _choose(self, scores, budget):
        ranked = torch.sort(scores, descending=True, stable=True)
        rank = torch.arange(scores.numel(), device=scores.device)  # ranked.values[i] is the (i+1)-th best
        passes = ranked.values.double() >= 1.0 - self.options.factor / (rank + 2).double()
        n = torch.cumprod(passes.int(), 0).sum()  # [] leading run of passing ranks
        return torch.zeros_like(scores, dtype=torch.bool).index_put_((ranked.indices,), rank < n)


@hookimpl
def register_selectors(register):
    register("topk_per_step", TopkPerStep)
    register("confidence_threshold", ConfidenceThreshold)
    register("factor", FactorSelector)
