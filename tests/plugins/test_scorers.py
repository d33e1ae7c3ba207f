"""Scorers are functions of a Proposal's tensors: no model needed."""

import pytest
import torch

from refusion.core.types import Proposal
from refusion.plugins.scorers import FirstTokenProb, Margin, MeanNegEntropy, MeanProb


def proposal(logits, valid=None):
    ids = logits.argmax(-1)
    probs = torch.softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    return Proposal(ids, probs, logits, valid)


def test_values_and_padding():
    sharp = torch.tensor([[10.0, 0, 0], [10.0, 0, 0]])  # two confident positions
    flat = torch.zeros(2, 3)  # two uniform positions
    p = proposal(torch.stack([sharp, flat, torch.stack([sharp[0], flat[0]])]))  # [3 slots, k=2, V=3]
    top = p.probs[0, 0].item()
    assert FirstTokenProb().score(p).tolist() == pytest.approx([top, 1 / 3, top])
    assert MeanProb().score(p)[2] == pytest.approx((top + 1 / 3) / 2)
    # padding: slot 2 with only its first (sharp) position real scores like slot 0
    padded = Proposal(p.token_ids, p.probs, p.logits, torch.tensor([[True, True], [True, True], [True, False]]))
    for scorer in (MeanProb(), MeanNegEntropy(), Margin()):
        s = scorer.score(padded)
        assert s[2] == pytest.approx(s[0].item(), abs=1e-6)
        assert s[0] > s[1] and ((0 <= s) & (s <= 1)).all()
    assert MeanNegEntropy().score(p)[1] == pytest.approx(1 / 3, abs=1e-5)  # exp(-log 3)
    assert Margin().score(p)[1] == pytest.approx(0.0, abs=1e-6)
