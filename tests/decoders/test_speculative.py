"""Speculative decoding: greedy output is AR greedy's, token for token, for every proposer, k, schedule,
prompt and batch composition; sampled output follows the target's distribution (a goodness-of-fit test);
prompt lookup proposes what transformers' does and takes its number of target forwards."""

import math

import pytest
import torch
from helpers import force_token, make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import ConfigError, build_decoder, validate_config
from refusion.core.interfaces import AcceptanceRule
from refusion.core.types import Acceptance
from refusion.decoders.speculative import SpeculativeDecoder
from refusion.models.backend import Backbone
from refusion.plugins.acceptance import Greedy, RejectionSampling
from refusion.plugins.proposers import DiffusionProposer, ModelProposer, NgramProposer, lookup


@pytest.fixture(scope="module")
def models(char_tokenizer) -> dict[str, Backbone]:
    """The target, a draft that equals it (every draft accepted), an unrelated draft (few accepted), and a
    bidirectional model as the diffusion drafter."""
    target = Backbone(make_tiny_qwen3(len(char_tokenizer), seed=0), char_tokenizer)
    same = Backbone(make_tiny_qwen3(len(char_tokenizer), seed=0), char_tokenizer)
    other = Backbone(make_tiny_qwen3(len(char_tokenizer), seed=5, layers=1, hidden=32), char_tokenizer)
    mdm_model = make_tiny_qwen3(len(char_tokenizer), seed=3)
    mdm_model.config.refusion_attention = "bidirectional"
    return {"target": target, "same": same, "other": other, "mdm": Backbone(mdm_model, char_tokenizer)}


def speculative(models, proposer: str, gen_length: int = 16, acceptance=None, **options) -> SpeculativeDecoder:
    """A speculative decoder on the target; ``proposer``: ngram, ngram1 (1-grams), same, other, diffusion;
    ``acceptance``: an acceptance rule instance in place of the config's."""
    cfg = {"decoder": "speculative", "gen_length": gen_length, **options}
    if proposer.startswith("ngram"):
        cfg["proposer"] = {"name": "ngram", "max_matching_ngram_size": 1 if proposer == "ngram1" else 3}
    _, opts, parts = validate_config(cfg)
    if not proposer.startswith("ngram"):
        cls, draft = {"same": (ModelProposer, "same"), "other": (ModelProposer, "other"),
                      "diffusion": (DiffusionProposer, "mdm")}[proposer]
        parts["proposer"] = cls().with_backbone(models[draft])
    if acceptance is not None:
        parts["acceptance"] = acceptance
    return SpeculativeDecoder(models["target"], opts, parts)


def repetitive_prompts(lengths, seed, alphabet=6):
    """Prompts over a few letters, so that n-grams recur (prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    return [(4 + torch.randint(0, alphabet, (n,), generator=g)).tolist() for n in lengths]


PROPOSERS = ["ngram", "ngram1", "same", "other", "diffusion"]


@pytest.mark.property
@given(proposer=st.sampled_from(PROPOSERS), k=st.integers(1, 6), schedule=st.sampled_from(["constant", "heuristic"]),
       lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4), seed=st.integers(0, 1000),
       gen_length=st.integers(1, 24))
def test_greedy_speculative_decoding_is_ar_greedy_alone_and_batched(models, proposer, k, schedule, lengths, seed,
                                                                     gen_length):
    prompts = repetitive_prompts(lengths, seed)
    ar = build_decoder(models["target"], {"decoder": "ar", "gen_length": gen_length})
    expected = [ar.generate(p).token_ids for p in prompts]
    dec = speculative(models, proposer, gen_length, k=k, schedule=schedule)
    alone = [dec.generate(p) for p in prompts]
    assert [r.token_ids for r in alone] == expected
    assert [r.token_ids for r in dec.generate_batch(prompts)] == expected
    for r in alone:  # one target forward per verification; the stats add up
        extra = r.stats.extra
        assert r.stats.nfe == extra["verifications"] == len(r.trace)
        assert 0 <= extra["accepted"] <= extra["drafted"]
        assert extra["verifications"] + extra["accepted"] >= len(r.token_ids)
        assert extra["draft_forwards"] == (0 if proposer.startswith("ngram") else
                                           extra["drafted"] if proposer in ("same", "other") else
                                           sum(1 for t in r.trace if t.chosen))


def test_a_draft_equal_to_the_target_is_always_accepted(models):
    prompt = [10, 11, 12, 13]
    res = speculative(models, "same", gen_length=25, k=4).generate(prompt)
    assert res.stats.extra["acceptance_rate"] == 1.0
    assert res.stats.nfe == 5  # 4 drafts + the bonus token per forward: 25 tokens in 5 verifications
    assert res.stats.extra["mean_accepted_length"] == 5.0


def test_the_heuristic_schedule_grows_k_while_every_draft_passes(models):
    res = speculative(models, "same", gen_length=40, k=2, schedule="heuristic").generate([10, 11, 12])
    assert [len(t.chosen) for t in res.trace][:4] == [2, 4, 6, 8]


def test_speculative_decoding_stops_at_eos_like_ar(models):
    bb = models["target"]
    h = force_token(bb.model, 9, bb.eos_id)
    try:
        ar = build_decoder(bb, {"decoder": "ar", "gen_length": 24}).generate([10, 11, 12, 13]).token_ids
        for proposer in ("ngram", "same"):
            out = speculative(models, proposer, gen_length=24, k=5).generate([10, 11, 12, 13]).token_ids
            assert out == ar and len(out) == 6 and out[-1] == bb.eos_id
    finally:
        h.remove()


def test_prompt_lookup_proposes_what_transformers_proposes():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        L = int(torch.randint(1, 30, (1,), generator=g))
        context = torch.randint(0, 5, (L,), generator=g).tolist()
        k, n = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([0]), num_output_tokens=k,
                                            max_matching_ngram_size=n, max_length=1000)
        ids, _ = hf.get_candidates(torch.tensor([context]))
        assert lookup(context, k, n, {0}) == ids[0, L:].tolist(), (context, k, n)


@pytest.mark.parametrize("k,ngram", [(3, 2), (10, 2), (5, 1)])
def test_ngram_matches_transformers_prompt_lookup_tokens_and_target_forwards(models, k, ngram):
    """transformers' generate(prompt_lookup_num_tokens=k): the same tokens, the same number of target
    forwards (counted by a hook on the model)."""
    bb = models["target"]
    calls = {"n": 0}
    h = bb.model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    try:
        for prompt in repetitive_prompts([12, 20, 7, 30], seed=3, alphabet=4):
            dec = build_decoder(bb, {"decoder": "speculative", "gen_length": 30, "k": k,
                                     "proposer": {"name": "ngram", "max_matching_ngram_size": ngram}})
            calls["n"] = 0
            ours = dec.generate(prompt)
            assert calls["n"] == ours.stats.nfe
            calls["n"] = 0
            hf = bb.model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                   prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram,
                                   suppress_tokens=[bb.mask_id], eos_token_id=bb.eos_id, pad_token_id=1)
            assert ours.token_ids == hf[0, len(prompt):].tolist()
            assert ours.stats.nfe == calls["n"]
    finally:
        h.remove()


def test_model_proposer_matches_transformers_assisted_generation(models):
    """transformers' generate(assistant_model=...) with a constant schedule of k drafts (set on the assistant's
    generation config, where transformers reads them) and no confidence cut: the same tokens, the same number
    of target forwards."""
    bb, draft = models["target"], models["other"]
    config = draft.model.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = 4, "constant", 0.0
    calls = {"n": 0}
    h = bb.model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    try:
        for prompt in repetitive_prompts([5, 9, 14], seed=8):
            ours = speculative(models, "other", gen_length=20, k=4).generate(prompt)
            calls["n"] = 0
            hf = bb.model.generate(torch.tensor([prompt]), assistant_model=draft.model, max_new_tokens=20,
                                   do_sample=False, suppress_tokens=[bb.mask_id], eos_token_id=bb.eos_id, pad_token_id=1)
            assert ours.token_ids == hf[0, len(prompt):].tolist()
            assert ours.stats.nfe == calls["n"]
    finally:
        h.remove()
        config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = saved


# ------------------------------------------------------------------------------------- sampling
def target_distribution(bb, prefix: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = bb.model(torch.tensor([prefix])).logits[0, -1].float()
    logits[bb.mask_id] = torch.finfo(logits.dtype).min
    return torch.softmax(logits / temperature, -1)


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson's test of ``counts`` against probabilities ``expected`` (cells under 5 expected are pooled)."""
    from scipy.stats import chi2

    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for cell, p in expected.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return float(chi2.sf(stat, df))


class ForgetsTheUniformDraw(AcceptanceRule):
    """A wrong rejection rule: accepts a draft exactly when p >= q (the uniform draw of min(1, p / q)
    forgotten), then corrects from the residual as it should. It keeps the acceptance kind's contract
    (refusion.testing.check_acceptance); only the distribution of its output is wrong."""

    sampling = True

    def accept(self, logits, draft_tokens, draft_probs, temperature, generator=None):
        B, n, V = draft_tokens.shape[0], draft_tokens.shape[1], logits.shape[-1]
        p = torch.softmax(logits.float() / temperature, dim=-1)  # [B, n+1, V]
        q = torch.zeros_like(p)
        if n:
            q[:, :n] = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(draft_tokens, V).float()
        p_d, q_d = (t[:, :n].gather(-1, draft_tokens[..., None])[..., 0] for t in (p, q))  # [B, n]
        residual = (p - q).clamp_min(0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        drawn = torch.multinomial(residual.view(-1, V), 1, generator=generator).view(B, n + 1)
        accepted = (q_d <= p_d).long().cumprod(-1).sum(-1)
        return Acceptance(accepted, drawn.gather(-1, accepted[:, None])[:, 0])


def first_two_tokens_fit(models, proposer: str, acceptance=None, n: int = 1500) -> tuple[float, int]:
    """The first two tokens of ``n`` sampled decodes (seeds 0..n-1) against the target's exact joint distribution
    at temperature 1.5: (Pearson's chi-square p-value, drafts rejected)."""
    bb, T = models["target"], 1.5
    prompt = [4, 5, 4, 5, 4]
    p1 = target_distribution(bb, prompt, T)
    top = p1.argsort(descending=True)[:6].tolist()
    expected = {}
    for a in top:
        if a in bb.eos_ids:  # the decode ends at an EOS
            expected[(a,)] = float(p1[a])
            continue
        p2 = target_distribution(bb, prompt + [a], T)
        for b, pb in enumerate(p2.tolist()):
            expected[(a, b)] = float(p1[a]) * pb
    expected["rest"] = 1.0 - sum(expected.values())
    counts: dict = {}
    rejected = 0
    for seed in range(n):
        res = speculative(models, proposer, gen_length=2, k=3, temperature=T, seed=seed,
                          acceptance=acceptance).generate(prompt)
        cell = tuple(res.token_ids) if tuple(res.token_ids) in expected else "rest"
        counts[cell] = counts.get(cell, 0) + 1
        rejected += res.stats.extra["drafted"] - res.stats.extra["accepted"]
    return chi_square_p(counts, expected, n), rejected


@pytest.mark.parametrize("proposer", ["other", "ngram1", pytest.param("diffusion", marks=pytest.mark.slow)])
def test_speculative_sampling_follows_the_targets_distribution(models, proposer):
    """The first two tokens of 1,500 sampled decodes (fixed seeds; a drafter that disagrees with the target
    often, so rejections and residual draws happen: an unrelated AR draft model, 1-gram prompt lookup, and the
    diffusion drafter, whose k drafts come from one forward) against the target's exact joint distribution
    at temperature 1.5: Pearson's chi-square over the cells; fails by chance with probability 1e-3."""
    p, rejected = first_two_tokens_fit(models, proposer)
    assert rejected > 50  # the rejection rule acted
    assert p > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["other", "diffusion"])
def test_the_goodness_of_fit_test_fails_a_rule_that_forgets_the_uniform_draw(models, proposer):
    """The same test on a wrong rule (a draft accepted exactly when p >= q) rejects it: the fit test can fail,
    though the wrong rule keeps the acceptance kind's contract."""
    from refusion.testing import check_acceptance

    assert check_acceptance(ForgetsTheUniformDraw, max_examples=10).ok
    p, _ = first_two_tokens_fit(models, proposer, acceptance=ForgetsTheUniformDraw())
    assert p < 1e-3


@pytest.mark.parametrize("proposer,temperature", [("ngram1", 1e-30), ("other", 1e-30), ("diffusion", 1e-30),
                                                  ("other", 1e-200)])
def test_sampling_at_a_temperature_near_zero_is_greedy(models, proposer, temperature):
    """softmax(logits / T) for T = 1e-30 (and 1e-200, 0 in float32) is the point mass on the argmax (not NaN):
    rejection sampling and the drafters' draws give AR greedy's tokens."""
    prompts = repetitive_prompts([5, 9], seed=3)
    ar = build_decoder(models["target"], {"decoder": "ar", "gen_length": 12})
    dec = speculative(models, proposer, gen_length=12, k=3, temperature=temperature)
    assert [dec.generate(p).token_ids for p in prompts] == [ar.generate(p).token_ids for p in prompts]


def test_a_sampled_batch_draws_what_each_sequence_draws_alone(models):
    prompts = repetitive_prompts([3, 8, 5], seed=2)
    dec = speculative(models, "other", gen_length=12, k=3, temperature=1.0, seed=4)
    alone = [dec.generate(p).token_ids for p in prompts]
    assert [r.token_ids for r in dec.generate_batch(prompts)] == alone
    greedy = speculative(models, "other", gen_length=12, k=3)
    assert alone != [greedy.generate(p).token_ids for p in prompts]


# ------------------------------------------------------------------------------------- config
def test_the_proposer_is_a_part_chosen_in_config(models):
    dec = build_decoder(models["target"], {"decoder": "speculative", "proposer": {"name": "ngram",
                                                                                 "max_matching_ngram_size": 4}})
    assert isinstance(dec.proposer, NgramProposer) and dec.proposer.options.max_matching_ngram_size == 4
    with pytest.raises(ConfigError, match="proposer.*unknown proposer 'ngarm'.*did you mean 'ngram'"):
        build_decoder(models["target"], {"decoder": "speculative", "proposer": "ngarm"})
    with pytest.raises(ConfigError, match="proposer.max_matching_ngram_size"):
        build_decoder(models["target"], {"decoder": "speculative", "proposer": {"name": "ngram",
                                                                                 "max_matching_ngram_size": 0}})


def test_the_acceptance_rule_is_a_part_chosen_in_config_and_follows_the_temperature(models):
    bb = models["target"]
    assert isinstance(build_decoder(bb, {"decoder": "speculative"}).acceptance, Greedy)
    assert isinstance(build_decoder(bb, {"decoder": "speculative", "temperature": 0.8}).acceptance, RejectionSampling)
    with pytest.raises(ConfigError, match=r"acceptance 'greedy' decodes at temperature 0, but temperature is 0\.8"):
        build_decoder(bb, {"decoder": "speculative", "temperature": 0.8, "acceptance": "greedy"})
    with pytest.raises(ConfigError, match=r"acceptance 'rejection_sampling' decodes at temperature > 0, but "
                                          r"temperature is 0"):
        build_decoder(bb, {"decoder": "speculative", "acceptance": "rejection_sampling"})
    with pytest.raises(ConfigError, match="acceptance.*unknown acceptance 'gredy'.*did you mean 'greedy'"):
        build_decoder(bb, {"decoder": "speculative", "acceptance": "gredy"})


def test_a_third_party_acceptance_rule_is_registered_and_used(models):
    import types

    from refusion.core.hookspecs import hookimpl
    from refusion.core.registry import build_registry, make_plugin_manager, set_registry

    module = types.ModuleType("forgets_the_draw_plugin")
    module.register_acceptance_rules = hookimpl(lambda register: register("forgets_the_draw", ForgetsTheUniformDraw))
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    dec = build_decoder(models["target"], {"decoder": "speculative", "gen_length": 16, "temperature": 1.0, "k": 3,
                                           "acceptance": "forgets_the_draw",
                                           "proposer": {"name": "ngram", "max_matching_ngram_size": 1}})
    assert isinstance(dec.acceptance, ForgetsTheUniformDraw)
    prompt = repetitive_prompts([9], seed=1)[0]
    by_hand = speculative(models, "ngram1", temperature=1.0, k=3, acceptance=ForgetsTheUniformDraw())
    assert dec.generate(prompt).token_ids == by_hand.generate(prompt).token_ids


def test_a_draft_model_with_another_vocabulary_is_refused(models, char_tokenizer):
    odd = Backbone(make_tiny_qwen3(len(char_tokenizer) + 7), char_tokenizer)
    _, opts, parts = validate_config({"decoder": "speculative"})
    parts["proposer"] = ModelProposer().with_backbone(odd)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        SpeculativeDecoder(models["target"], opts, parts)


def test_stats_report_the_speculative_counts(models):
    res = speculative(models, "other", gen_length=12, k=3).generate([4, 5, 6])
    d = res.stats.as_dict()
    for key in ("verifications", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "draft_forwards",
                "target_tokens_fed_per_token"):
        assert key in d
    assert math.isclose(d["mean_accepted_length"], len(res.token_ids) / d["verifications"])
    assert math.isclose(d["target_tokens_fed_per_token"] * len(res.token_ids), res.stats.tokens_in)  # alone: no padding


def test_the_proposer_written_in_plugins_md_is_lossless_alone_and_batched(models):
    """docs/plugins.md's "Writing a proposer" example, registered as a plugin, in at most 40 lines."""
    import re
    import types
    from pathlib import Path

    from refusion.core.registry import build_registry, make_plugin_manager, set_registry

    page = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    source = re.search(r"```python\n(.*?)```", page.split("## Writing a proposer", 1)[1], re.S).group(1)
    assert len(source.strip().splitlines()) <= 40
    module = types.ModuleType("recent_lookup_example")
    exec(compile(source, "plugins.md", "exec"), module.__dict__)
    set_registry(build_registry(make_plugin_manager([module], autoload=False)))
    prompts = repetitive_prompts([9, 14, 5], seed=11, alphabet=3)
    ar = build_decoder(models["target"], {"decoder": "ar", "gen_length": 20})
    dec = build_decoder(models["target"], {"decoder": "speculative", "gen_length": 20, "k": 5,
                                           "proposer": {"name": "recent", "n": 1}})
    expected = [ar.generate(p).token_ids for p in prompts]
    alone = [dec.generate(p) for p in prompts]
    assert [r.token_ids for r in alone] == expected
    assert [r.token_ids for r in dec.generate_batch(prompts)] == expected
    assert sum(r.stats.extra["accepted"] for r in alone) > 0  # its drafts were used


@pytest.mark.parametrize("proposer,draft", [("other", "other"), ("diffusion", "mdm")])
def test_a_batch_shares_the_drafters_forwards_too(models, proposer, draft):
    """In a batch the drafter's forwards of every sequence run in shared model calls over the drafter's own
    ragged cache (fewer drafter calls than alone), each sequence's nfe counts the target's forwards only,
    and the outputs are AR's."""
    prompts = repetitive_prompts([4, 11, 7, 2], seed=6)
    dec = speculative(models, proposer, gen_length=14, k=3)
    drafter = models[draft]
    n0 = drafter.nfe
    alone = [dec.generate(p) for p in prompts]
    alone_calls = drafter.nfe - n0
    n0 = drafter.nfe
    batch = dec.generate_batch(prompts)
    assert drafter.nfe - n0 < alone_calls == sum(r.stats.extra["draft_forwards"] for r in alone)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.stats.nfe for r in batch] == [r.stats.nfe for r in alone]
    assert [r.stats.extra["draft_forwards"] for r in batch] == [r.stats.extra["draft_forwards"] for r in alone]


def test_the_proposer_and_acceptance_kinds_are_registered_like_every_part_kind():
    from refusion.core.config import PART_KINDS
    from refusion.core.interfaces import Proposer
    from refusion.core.registry import PluginError, get_registry, interface

    reg = get_registry()
    assert "proposer" in PART_KINDS and interface("proposer") is Proposer
    assert reg.names("proposer") == ["diffusion", "model", "ngram"]
    assert "acceptance" in PART_KINDS and interface("acceptance") is AcceptanceRule
    assert reg.names("acceptance") == ["greedy", "rejection_sampling"]
    assert "speculative" in reg.names("decoder")
    with pytest.raises(PluginError, match="must be a subclass of refusion.core.interfaces.Proposer"):
        reg.add("proposer", "bad", dict, "test")
