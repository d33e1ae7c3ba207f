"""Token-level selectors: which [MASK] positions of a pool to commit in one diffusion step.

The pool is the still-masked positions a decoder may commit now (e.g. the current LLaDA block), its
``scores [n]`` one confidence per position (a scorer over k = 1 slots, or random numbers), in
position order. A :class:`TokenSelector` also receives

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

from pydantic import Field
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Options, Selector


class TokenSelector(Selector):
    """A selector over per-token scores that may use the step's budget and may choose nothing."""

    def select(self, scores: Tensor, budget: int | None = None, at_least_one: bool = True) -> list[int]:
        """``scores [n]`` -> chosen indices, ascending; non-empty when ``at_least_one`` (and n > 0)."""
        if scores.numel() == 0:
            return []
        chosen = self._choose(scores, budget)
        if not chosen and at_least_one:
            chosen = [int(scores.argmax())]
        return sorted(chosen)

    def _choose(self, scores: Tensor, budget: int | None) -> list[int]:
        raise NotImplementedError


class TopkPerStep(TokenSelector):
    class Options(Options):
        k: int | None = Field(None, ge=1, description="tokens per step; None = the decoder's schedule (else 1)")

    def _choose(self, scores, budget):
        n = self.options.k or budget or 1
        return scores.topk(min(n, scores.numel())).indices.tolist()


class ConfidenceThreshold(TokenSelector):
    class Options(Options):
        threshold: float = Field(0.9, ge=0.0, le=1.0, description="commit every token scoring >= this")

    def _choose(self, scores, budget):
        return (scores >= self.options.threshold).nonzero().flatten().tolist()


class FactorSelector(TokenSelector):
    class Options(Options):
        factor: float = Field(1.0, gt=0.0, description="n tokens pass when the n-th best score >= 1 - factor/(n+1)")

    def _choose(self, scores, budget):
        ranked = scores.sort(descending=True)
        n = 0  # ranked.values[n] is the (n+1)-th best: it passes at 1 - factor / (n + 2)
        while n < scores.numel() and float(ranked.values[n]) >= 1.0 - self.options.factor / (n + 2):
            n += 1
        return ranked.indices[:n].tolist()


@hookimpl
def register_selectors(register):
    register("topk_per_step", TopkPerStep)
    register("confidence_threshold", ConfidenceThreshold)
    register("factor", FactorSelector)
