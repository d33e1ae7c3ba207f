import sys
import textwrap

import pytest

from refusion.core.config import build_decoder, validate_config
from refusion.core.hookspecs import hookimpl
from refusion.core.registry import PluginError, build_registry, make_plugin_manager
from refusion.plugins.scorers import FirstTokenProb


class AlwaysHalf(FirstTokenProb):
    def score(self, proposal):
        return proposal.probs[:, 0] * 0 + 0.5


class FakeScorerPlugin:
    @hookimpl
    def register_scorers(self, register):
        register("always_half", AlwaysHalf)


def test_builtins_registered_with_origin():
    reg = build_registry(make_plugin_manager(autoload=False))
    assert {"refusion", "ar"} <= set(reg.names("decoder"))
    assert {"first_token_prob", "mean_prob", "mean_neg_entropy", "margin"} <= set(reg.names("scorer"))
    assert {"kv_concat", "kv_recompute"} <= set(reg.names("cache"))
    assert reg.names("verifier") == ["prefix"] and reg.names("extender") == ["prefix"]
    origins = {e.origin for e in reg.entries("scorer")}
    assert origins == {"builtin refusion.plugins.scorers"}


def test_third_party_scorer_used_by_name_from_config(backbone):
    reg = build_registry(make_plugin_manager([FakeScorerPlugin()], autoload=False))
    _, _, parts = validate_config({"decoder": "refusion", "scorer": "always_half"}, reg)
    assert isinstance(parts["scorer"], AlwaysHalf)
    dec = build_decoder(backbone, {"decoder": "refusion", "gen_length": 8, "slot_size": 4, "scorer": "always_half",
                                   "selector": {"slot_threshold": 0.4}, "verifier": {"token_threshold": 0.0}}, reg)
    res = dec.generate([5, 6, 7])
    assert res.trace[0].scored == [(3, 0.5), (7, 0.5)]  # both slots scored 0.5 > 0.4: chosen together
    assert res.trace[0].chosen == [3, 7]


def test_duplicate_name_names_both_sources():
    class Dup:
        @hookimpl
        def register_scorers(self, register):
            register("mean_prob", AlwaysHalf)

    with pytest.raises(PluginError, match=r"duplicate scorer name 'mean_prob'.*builtin refusion.plugins.scorers.*plugin"):
        build_registry(make_plugin_manager([Dup()], autoload=False))


def test_misspelled_hook_is_caught():
    class Typo:
        @hookimpl
        def register_scorer(self, register):  # missing the final s
            pass

    with pytest.raises(Exception, match="register_scorer"):
        make_plugin_manager([Typo()], autoload=False)


def test_unknown_name_suggests_close_matches():
    reg = build_registry(make_plugin_manager(autoload=False))
    with pytest.raises(PluginError, match=r"unknown scorer 'mean_prb'; did you mean 'mean_prob'"):
        reg.get("scorer", "mean_prb")


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """An installed-looking distribution with an entry point in the ``refusion`` group."""
    (tmp_path / "fake_refusion_scorer.py").write_text(textwrap.dedent('''
        from refusion.core.hookspecs import hookimpl
        from refusion.plugins.scorers import MeanProb
        class EntryPointScorer(MeanProb):
            pass
        @hookimpl
        def register_scorers(register):
            register("entry_point_scorer", EntryPointScorer)
    '''))
    info = tmp_path / "fake_refusion_scorer-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-refusion-scorer\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[refusion]\nfake = fake_refusion_scorer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_refusion_scorer", None)


def test_entry_point_autoload_and_env_switch(fake_distribution, monkeypatch):
    monkeypatch.delenv("REFUSION_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    reg = build_registry(make_plugin_manager())
    assert "entry_point_scorer" in reg.names("scorer")
    (entry,) = [e for e in reg.entries("scorer") if e.name == "entry_point_scorer"]
    assert entry.origin == "entry point fake (fake-refusion-scorer 0.1)"
    monkeypatch.setenv("REFUSION_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "entry_point_scorer" not in build_registry(make_plugin_manager()).names("scorer")


def test_a_class_registered_under_the_wrong_kind_is_refused_naming_the_interface():
    from refusion.core.registry import Registry

    reg = Registry()
    with pytest.raises(PluginError, match=r"registered .* as verifier 'oops', but a verifier must be a subclass of "
                                          r"refusion\.core\.interfaces\.Verifier"):
        reg.add("verifier", "oops", FirstTokenProb, "entry point x")
    with pytest.raises(PluginError, match="must be a subclass"):
        reg.add("scorer", "fn", lambda proposal: proposal, "entry point x")
    reg.add("scorer", "first", FirstTokenProb, "builtin")
    assert reg.get("scorer", "first") is FirstTokenProb


def test_a_part_that_leaves_an_abstract_method_unimplemented_cannot_be_built():
    from refusion.core.interfaces import Extender, Verifier

    class NoVerify(Verifier):
        pass

    class BindOnly(Extender):
        def bind(self, verifier):
            return self

    with pytest.raises(TypeError, match="verify"):
        NoVerify()
    with pytest.raises(TypeError, match="extend"):
        BindOnly()
