"""Every registered part keeps its kind's contract (refusion.testing's checks), whatever package registered
it: the parts are drawn from the registry, so an installed plugin's parts are checked by these same tests
(entry points load when REFUSION_TEST_AUTOLOAD=1). A deliberately broken part of each kind shows that each
check can fail, and with what message."""

from __future__ import annotations

import os
import types

import pytest
import torch

from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import (
    AcceptanceRule, CacheManager, Draft, Drafter, Extender, Proposer, Remasker, Scorer, Selector, Verifier,
)
from refusion.core.registry import build_registry, get_registry, make_plugin_manager, set_registry
from refusion.core.types import Acceptance, LoopOutput, Proposal, Verdict
from refusion.plugins.acceptance import RejectionSampling
from refusion.plugins.caches import KVConcat
from refusion.plugins.proposers import ModelProposer
from refusion.testing import (
    CHECKS, CONTRACTS, ContractError, check_acceptance, check_cache_manager, check_decoder, check_drafter,
    check_extender, check_part, check_proposer, check_remasker, check_scorer, check_selector, check_verifier,
)

pytestmark = pytest.mark.property

PART_ENTRIES = [e for e in get_registry().entries() if e.kind not in ("decoder", "objective")]
CHECKED = [e for e in PART_ENTRIES if e.kind in CHECKS]
set_registry(None)  # the suite's fixture builds a fresh registry per test


def test_every_part_kind_has_a_contract_check():
    """Every registered part kind (speculative decoding's proposer and acceptance kinds included) has a check in
    refusion.testing, so every part is held to its kind's contract below."""
    assert {e.kind for e in PART_ENTRIES if e.kind not in CHECKS} == set()
    assert {"proposer", "acceptance"} <= {e.kind for e in CHECKED}


@pytest.mark.parametrize("kind,name", [(e.kind, e.name) for e in CHECKED], ids=[f"{e.kind}-{e.name}" for e in CHECKED])
def test_every_registered_part_keeps_its_kinds_contract(kind, name):
    """check_<kind> on every registered part: scorers reorder-, subset- and padding-invariant; selectors
    choose at least one (token selectors only eligible positions); verifiers accept a prefix, monotone in
    probabilities and thresholds; extenders gain a token per open row, row-order invariant; cache managers
    exact for the prefix and first slot (every slot when declared exact, slots in any position order);
    remaskers keep 1..length, slot-order invariant; drafters give the drafted tokens' probabilities;
    proposers draft at most k vocabulary ids and after accept() draft what a fresh proposer drafts; acceptance
    rules accept 0..n drafts row by row, greedy AR's longest matching prefix, sampling within the residual."""
    report = check_part(kind, name)  # a check skips the properties that do not apply (exact caches, sampling rules)
    assert report.ok and report.passed  # at least one property applies to every part
    assert report.passed == [s for s in CONTRACTS[kind] if s in report.passed]


# -- each check can fail: a deliberately broken part per kind ----------------------------------------------------

class SlotOrderScorer(Scorer):
    """Broken: a slot's score grows with its index in the pool."""

    def score(self, proposal):
        return proposal.probs[:, 0] * torch.linspace(0.5, 1.0, proposal.probs.shape[0])


class PaddingScorer(Scorer):
    """Broken: averages the padding too."""

    def score(self, proposal):
        return proposal.probs.mean(-1)


class NothingSelector(Selector):
    """Broken: chooses nothing when every score is below 0.5."""

    def select(self, scores):
        return scores > 0.5


class CountingVerifier(Verifier):
    """Broken: counts every passing token, so the accepted set need not be a prefix."""

    def verify(self, draft_probs, ar_probs, valid=None):
        valid = torch.ones_like(ar_probs, dtype=torch.bool) if valid is None else valid
        passed = (ar_probs > 0.5) & valid
        passed[:, 0] = True
        n = passed.sum()
        ends = valid.sum(1).cumsum(0)
        return Verdict(passed=passed, prefix_len=n, accepted_slots=(ends <= n).sum())


class StuckExtender(Extender):
    """Broken: a round that verifies nothing new."""

    def extend(self, ar_probs, verified):
        return verified.clone()


class ClaimsExact(KVConcat):
    """Broken: declares exact but reuses each row's KV, blind to the slots before it."""

    exact = True


class ZeroRemasker(Remasker):
    """Broken: keeps nothing of a slot whose first token is unsure."""

    def keep(self, confidence, lengths):
        return [0 if float(c[0]) < 0.5 else n for c, n in zip(confidence, lengths)]


class MaxProbDrafter(Drafter):
    """Broken: drafts the argmax but reports 1.0 as its probability."""

    def draft(self, logits, generator=None):
        ids = logits.argmax(-1)
        return Proposal(token_ids=ids, probs=torch.ones(ids.shape), logits=logits)


class OneTooMany(Proposer):
    """Broken: proposes k + 1 tokens."""

    def propose(self, state, context, k, temperature, generator):
        return Draft(torch.full((k + 1,), 4), k + 1)


class UncroppedDraftModel(ModelProposer):
    """Broken: keeps the rejected drafts in its cache after verification."""

    def accept(self, state, context, accepted):
        pass


class AcceptAll(AcceptanceRule):
    """Broken: accepts every draft, then the target's argmax after them."""

    def accept(self, logits, draft_tokens, draft_probs, temperature, generator=None):
        accepted = torch.full((draft_tokens.shape[0],), draft_tokens.shape[1])
        return Acceptance(accepted, logits[:, -1].argmax(-1))


class CorrectsFromTheTarget(RejectionSampling):
    """Broken: after a rejection draws the next token from the target's p instead of the residual max(0, p - q)
    (the rejected draft can come back)."""

    def accept(self, logits, draft_tokens, draft_probs, temperature, generator=None):
        out = super().accept(logits, draft_tokens, draft_probs, temperature, generator)
        p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, n+1, V]
        at = p.gather(1, out.accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]  # [B, V]
        return Acceptance(out.accepted, torch.multinomial(at, 1, generator=generator)[:, 0])


BROKEN = [
    (check_scorer, SlotOrderScorer, "reorder invariance: permuting the slots permutes the scores"),
    (check_scorer, PaddingScorer, "padding never changes a score"),
    (check_selector, NothingSelector, "chose nothing"),
    (check_verifier, CountingVerifier, "the accepted tokens are not that prefix"),
    (check_extender, StuckExtender, "a row with unverified tokens gained none"),
    (check_cache_manager, ClaimsExact, "logits after the merged cache differ from a fresh forward"),
    (check_remasker, ZeroRemasker, "outside 1..length"),
    (check_drafter, MaxProbDrafter, "are not the drafted tokens' probabilities"),
    (check_proposer, OneTooMany, "expected n <= k tokens"),
    (check_proposer, UncroppedDraftModel, "its cache is cropped right"),
    (check_acceptance, AcceptAll, "AR greedy accepts"),
    (check_acceptance, CorrectsFromTheTarget, "under the residual max(0, p - q)"),
]


@pytest.mark.parametrize("check,cls,expected", BROKEN, ids=[c.__name__ for _, c, _ in BROKEN])
def test_each_check_catches_a_broken_part_with_its_failing_example(check, cls, expected):
    """Each kind's check fails on a part that breaks one of its properties; the message names the part, the
    property, what was expected and the (shrunk) example hypothesis found."""
    with pytest.raises(ContractError) as err:
        check(cls)
    message = str(err.value)
    assert cls.__qualname__ in message and expected in message and "Failing test case" in message, message


class LongDecoderOptions(__import__("refusion.core.interfaces", fromlist=["DecoderOptions"]).DecoderOptions):
    pass


def test_check_decoder_catches_a_decoder_that_writes_past_gen_length():
    from refusion.core.interfaces import Decoder

    class Overlong(Decoder):
        """Broken: one token more than gen_length."""

        name, Options, attention = "overlong", LongDecoderOptions, ("causal",)

        def _decode(self, prompt_ids, generator):
            out = [5] * (self.options.gen_length + 1)
            return LoopOutput(out, [], list(prompt_ids) + out, list(range(len(prompt_ids) + len(out))))

    plugin = types.SimpleNamespace(register_decoders=hookimpl(lambda register: register("overlong", Overlong)))
    registry = build_registry(make_plugin_manager([plugin], autoload=False))
    with pytest.raises(ContractError) as err:
        check_decoder("overlong", registry=registry)
    assert "decoder overlong" in str(err.value) and "> gen_length" in str(err.value), str(err.value)


# -- a third-party part, written here, is checked by the same tests ------------------------------------------------

class GeoMeanProb(Scorer):
    """The geometric mean of the drafted tokens' probabilities over the slot's real positions."""

    def score(self, proposal):
        mask = proposal.mask
        logp = torch.log(proposal.probs.clamp_min(1e-30)).masked_fill(~mask, 0.0)
        return (logp.sum(-1) / mask.sum(-1)).exp()


def test_a_fresh_third_party_scorer_is_checked_alone_and_inside_every_decoder_that_takes_a_scorer():
    """A scorer registered through the plugin hooks (as an installed package's would be) passes check_scorer
    by name, and the decoder invariants draw it like any built-in."""
    module = types.ModuleType("geo_mean_plugin")
    module.register_scorers = hookimpl(lambda register: register("geo_mean_prob", GeoMeanProb))
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    assert check_scorer("geo_mean_prob").ok
    for decoder in ("refusion", "llada", "block"):
        assert check_decoder(decoder, max_examples=5, parts={"scorer": ["geo_mean_prob"]}).ok


@pytest.mark.skipif(not os.environ.get("REFUSION_TEST_AUTOLOAD"), reason="only with installed plugins loaded")
def test_installed_plugins_are_in_the_registry_these_tests_draw_from():
    """Run with REFUSION_TEST_AUTOLOAD=1: the entry points' parts are parametrized above like the built-ins."""
    assert any(not e.origin.startswith("builtin") for e in CHECKED)


def test_check_plugin_exits_1_with_the_failing_example(capsys):
    """`refusion check-plugin NAME` on a plugin with a broken selector: exit 1, the part, the property and its
    example on stdout; the plugin's sound parts still pass."""
    from refusion.cli import main

    module = types.ModuleType("broken_plugin")
    module.register_selectors = hookimpl(lambda register: register("nothing", NothingSelector))
    module.register_scorers = hookimpl(lambda register: register("geo_mean_prob", GeoMeanProb))
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    assert main(["check-plugin", "broken_plugin", "--no-decoders", "--max-examples", "10"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  selector nothing" in out and "chose nothing" in out and "Failing test case" in out, out
    assert "ok    scorer geo_mean_prob" in out and "1 of 2 checks passed for broken_plugin" in out, out


def test_without_hypothesis_the_checks_say_how_to_install_it_and_the_models_still_import(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "refusion.testing._hypothesis", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'refusion\[testing\]'"):
        importlib.import_module("refusion.testing._hypothesis")
    monkeypatch.delitem(sys.modules, "refusion.testing.models", raising=False)
    assert importlib.import_module("refusion.testing.models").make_char_tokenizer
