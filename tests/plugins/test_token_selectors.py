"""Token selectors: the LLaDA schedule count, Fast-dLLM's threshold and factor rules, registration.
Selectors return ``[n]`` bool masks; ``chosen`` turns one into its ascending indices."""

import pytest
import torch
from helpers import chosen

from refusion.core.config import ConfigError, validate_config
from refusion.core.registry import get_registry
from refusion.decoders.llada import choose
from refusion.plugins.selectors import ThresholdSelector
from refusion.plugins.token_selectors import ConfidenceThreshold, FactorSelector, TopkPerStep

SCORES = torch.tensor([0.2, 0.95, 0.5, 0.91, 0.05])


def test_registered_and_configurable():
    reg = get_registry()
    assert {"topk_per_step", "confidence_threshold", "factor"} <= set(reg.names("selector"))
    _, _, parts = validate_config({"decoder": "llada", "selector": {"name": "factor", "factor": 2.0}})
    assert isinstance(parts["selector"], FactorSelector) and parts["selector"].options.factor == 2.0
    with pytest.raises(ConfigError, match="selector.threshold"):
        validate_config({"decoder": "llada", "selector": {"name": "confidence_threshold", "threshold": 1.5}})


def test_topk_uses_option_then_budget_then_one():
    assert chosen(TopkPerStep().select(SCORES, budget=2)) == [1, 3]  # ascending indices of the 2 best
    assert chosen(TopkPerStep().select(SCORES)) == [1]
    assert chosen(TopkPerStep(TopkPerStep.Options(k=3)).select(SCORES, budget=1)) == [1, 2, 3]
    assert chosen(TopkPerStep().select(SCORES, budget=99)) == [0, 1, 2, 3, 4]


def test_confidence_threshold_is_fast_dllm_rule():
    sel = ConfidenceThreshold(ConfidenceThreshold.Options(threshold=0.9))
    assert chosen(sel.select(SCORES)) == [1, 3]
    assert chosen(sel.select(torch.tensor([0.3, 0.9]))) == [1]  # >= threshold passes
    assert chosen(sel.select(torch.tensor([0.3, 0.6, 0.1]))) == [1]  # none passes: top-1 always
    assert chosen(sel.select(torch.tensor([0.3, 0.6]), at_least_one=False)) == []
    assert chosen(ConfidenceThreshold(ConfidenceThreshold.Options(threshold=0.0)).select(SCORES)) == [0, 1, 2, 3, 4]


def factor_reference(conf: list[float], factor: float) -> int:
    """Fast-dLLM's factor rule as documented: the n-th best (1-based) must reach 1 - factor/(n+1); n >= 1."""
    ranked = sorted(conf, reverse=True)
    n = 1
    while n < len(ranked) and ranked[n] >= 1 - factor / (n + 2):
        n += 1
    return n


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0, 4.0])
def test_factor_matches_reference_rule(factor):
    g = torch.Generator().manual_seed(0)
    sel = FactorSelector(FactorSelector.Options(factor=factor))
    for _ in range(50):
        s = torch.rand(int(torch.randint(1, 12, (1,), generator=g)), generator=g) ** 0.3
        got = chosen(sel.select(s))
        assert len(got) == factor_reference(s.tolist(), factor)
        assert set(got) == set(s.topk(len(got)).indices.tolist()) and got == sorted(got)


def test_factor_examples():
    sel = FactorSelector()  # factor 1: 1st needs 0.5, 2nd 2/3, 3rd 3/4
    assert chosen(sel.select(torch.tensor([0.8, 0.76, 0.9]))) == [0, 1, 2]
    assert chosen(sel.select(torch.tensor([0.8, 0.6, 0.74]))) == [0, 2]
    assert chosen(sel.select(torch.tensor([0.1, 0.3]))) == [1]  # the best always
    assert chosen(sel.select(torch.tensor([0.1, 0.3]), at_least_one=False)) == []


def test_empty_pool_and_plain_selectors():
    assert chosen(ConfidenceThreshold().select(torch.tensor([]))) == []
    # a slot selector (no budget, always non-empty) works through the same entry point
    assert chosen(choose(ThresholdSelector(), SCORES, budget=3)) == [1, 3]
    assert chosen(choose(TopkPerStep(), SCORES, budget=3)) == [1, 2, 3]


def test_ties_go_leftmost_and_only_eligible_positions_are_chosen():
    scores = torch.tensor([0.5, 0.95, 0.5, 0.95, 0.5])
    eligible = torch.tensor([True, False, True, True, True])
    assert chosen(TopkPerStep().select(scores, budget=3)) == [0, 1, 3]  # the 0.5 tie: leftmost first
    assert chosen(TopkPerStep().select(scores, budget=2, eligible=eligible)) == [0, 3]
    assert chosen(TopkPerStep().select(scores, budget=9, eligible=eligible)) == [0, 2, 3, 4]
    assert chosen(ConfidenceThreshold().select(scores, eligible=eligible)) == [3]
    assert chosen(ConfidenceThreshold().select(scores, eligible=~eligible)) == [1]
    assert chosen(ConfidenceThreshold().select(torch.tensor([0.1, 0.95]), eligible=torch.tensor([True, False]))) == [0]
    assert chosen(FactorSelector().select(scores, eligible=eligible)) == [3]  # 0.95 passes 0.5, 0.5 fails 2/3
    assert chosen(ConfidenceThreshold().select(scores, at_least_one=True, eligible=torch.zeros(5, dtype=torch.bool))) == []
