"""Built-in slot scorers: ``first_token_prob`` (ReFusion's rule) and its alternatives (paper App. C.2).

A scorer maps a proposal of S slots to one confidence per slot (higher = more confident), in [0, 1]
for every built-in, so one threshold scale serves them all. With slot size 1 the same scorers give
per-token confidences for token-level decoders.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Scorer
from refusion.core.types import Proposal


class FirstTokenProb(Scorer):
    """Probability of the slot's first drafted token (the reference's rule)."""

    def score(self, proposal: Proposal) -> Tensor:
        return proposal.probs[:, 0]


def slot_mean(values: Tensor, proposal: Proposal) -> Tensor:
    """Mean of ``values [S, k]`` over each slot's real positions -> ``[S]``."""
    mask = proposal.mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1)


class MeanProb(Scorer):
    """Mean probability of the slot's drafted tokens."""

    def score(self, proposal: Proposal) -> Tensor:
        return slot_mean(proposal.probs, proposal)


class MeanNegEntropy(Scorer):
    """Mean negative entropy of the predictive distributions over the slot's positions, as
    ``exp(mean(-H))`` so that, like the probability scorers, scores lie in (0, 1] (1 = certain) and the
    same thresholds apply; the order of slots is that of the mean negative entropy."""

    def score(self, proposal: Proposal) -> Tensor:
        logp = torch.log_softmax(proposal.logits.float(), dim=-1)  # [S, k, V]
        return slot_mean((logp.exp() * logp).sum(-1), proposal).exp()


class Margin(Scorer):
    """Mean margin between the top-1 and top-2 probabilities over the slot's positions."""

    def score(self, proposal: Proposal) -> Tensor:
        top2 = torch.softmax(proposal.logits.float(), dim=-1).topk(2, dim=-1).values  # [S, k, 2]
        return slot_mean(top2[..., 0] - top2[..., 1], proposal)


@hookimpl
def register_scorers(register):
    register("first_token_prob", FirstTokenProb)
    register("mean_prob", MeanProb)
    register("mean_neg_entropy", MeanNegEntropy)
    register("margin", Margin)
