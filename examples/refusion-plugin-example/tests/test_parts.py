"""The example's own tests: its parts are functions of tensors, testable without a model. refusion.testing
checks each against its kind's contract (hypothesis properties: reorder, padding, prefix, monotonicity) and
inside the decoders; the example-based tests below pin a few values."""

import torch

from refusion.core.types import Proposal
from refusion.testing import check_decoder, check_extender, check_scorer, check_verifier
from refusion_plugin_example.parts import MinProb, RunningProduct, RunningProductExtender


def test_each_part_keeps_its_kinds_contract():
    check_scorer(MinProb)
    check_verifier(RunningProduct)
    check_extender(RunningProductExtender)


def test_the_decoders_keep_their_invariants_with_these_parts():
    check_decoder("refusion", parts={"scorer": ["min_prob"], "verifier": ["running_product"],
                                     "extender": ["running_product"]})


def test_min_prob_ignores_padding():
    probs = torch.tensor([[0.9, 0.5, 0.8], [0.7, 0.2, 0.0]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    proposal = Proposal(token_ids=torch.zeros(2, 3, dtype=torch.long), probs=probs, logits=torch.zeros(2, 3, 4),
                        valid=valid)
    assert MinProb().score(proposal).tolist() == [0.5, 0.699999988079071]


def test_running_product_accepts_while_the_product_holds():
    verifier = RunningProduct(RunningProduct.Options(min_product=0.5))
    ar = torch.tensor([[1.0, 0.9, 0.8, 0.5], [1.0, 0.9, 0.9, 0.9]])  # products 0.72, 0.36 | 0.81, 0.73, 0.66
    verdict = verifier.verify(torch.ones(2, 4), ar)
    assert verdict.passed.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert int(verdict.prefix_len) == 3 and int(verdict.accepted_slots) == 0


def test_running_product_extender_gains_a_token_per_round_and_takes_the_verifiers_bound():
    extender = RunningProductExtender().bind(RunningProduct(RunningProduct.Options(min_product=0.5)))
    assert extender.options.min_product == 0.5
    ar = torch.tensor([[1.0, 0.9, 0.8, 0.5], [1.0, 0.1, 0.9, 0.9]])  # row 0: products 0.9, 0.72, 0.36
    verified = torch.tensor([[True, False, False, False], [True, False, False, False]])
    assert extender.extend(ar, verified).tolist() == [[True, True, True, False], [True, True, False, False]]
