"""The built-in Stage II-b extender: a round's verified prefix, and the threshold it takes from the verifier."""

import pytest
import torch

from refusion.core.interfaces import Options, Verifier
from refusion.plugins.extenders import PrefixExtender
from refusion.plugins.verifiers import PrefixVerifier


def test_a_round_passes_tokens_after_a_verified_predecessor_then_by_the_threshold():
    ext = PrefixExtender(PrefixExtender.Options(token_threshold=0.5))
    after = ext.extend(torch.tensor([[1.0, 0.1, 0.9, 0.1], [1.0, 0.9, 0.9, 0.9]]),
                       torch.tensor([[True, False, False, False], [True, True, False, False]]))
    assert after.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_bind_takes_the_verifiers_threshold_only_when_unset():
    verifier = PrefixVerifier(PrefixVerifier.Options(token_threshold=0.4))
    bound = PrefixExtender().bind(verifier)
    assert bound.options.token_threshold == 0.4
    own = PrefixExtender(PrefixExtender.Options(token_threshold=0.7))
    assert own.bind(verifier) is own

    class NoThreshold(Verifier):
        class Options(Options):
            min_product: float = 0.5

        def verify(self, draft_probs, ar_probs, valid=None):
            raise NotImplementedError

    with pytest.raises(ValueError, match="extender.token_threshold"):
        PrefixExtender().bind(NoThreshold())
    with pytest.raises(ValueError, match="no token_threshold"):
        PrefixExtender().extend(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
