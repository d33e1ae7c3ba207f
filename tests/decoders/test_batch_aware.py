"""Batch-aware settings: a ``batch_schedule`` picks a decoder's settings from the batch size of a decode
(the entry of the largest size <= it), validated like the rest of the config; ReFusion's ``draft_budget``
sizes the draft window by the live sequences of the batch, which a loop reads from its cache."""

import pytest
import torch

from refusion.core.config import ConfigError, build_decoder, validate_config

BASE = {"decoder": "refusion", "gen_length": 16, "slot_size": 4, "scorer": "mean_prob",
        "selector": {"name": "threshold", "slot_threshold": 0.9, "fallback": "leftmost"}}


def prompts(n):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(4, 40, (3 + i % 4,), generator=g).tolist() for i in range(n)]


def test_the_entry_of_the_largest_batch_size_not_above_the_batch_applies(backbone):
    cfg = {**BASE, "batch_schedule": {2: {"slot_size": 8, "selector": {"slot_threshold": 0.5}},
                                      4: {"draft_window": 1, "scorer": "first_token_prob"}}}
    dec = build_decoder(backbone, cfg)
    assert dec.for_batch(1) is dec and dec.for_batch(3) is dec.for_batch(2) and dec.for_batch(64) is dec.for_batch(4)
    two, four = dec.for_batch(2).options, dec.for_batch(4).options
    # a part's options merge into the part's; a part named anew starts from its defaults; the rest stays
    assert two.slot_size == 8 and two.selector.dump() == {"name": "threshold", "slot_threshold": 0.5,
                                                          "fallback": "leftmost"}
    assert four.slot_size == 4 and four.draft_window == 1 and four.scorer.dump() == "first_token_prob"
    assert four.selector.dump() == BASE["selector"] and two.batch_schedule is None
    for n in (1, 2, 3, 4, 5):  # a batch decodes with its entry's settings: as that decoder alone would
        want = build_decoder(backbone, {**BASE, **({} if n < 2 else cfg["batch_schedule"][2] | {
            "selector": {**BASE["selector"], "slot_threshold": 0.5}} if n < 4 else cfg["batch_schedule"][4])})
        got = dec.generate_batch(prompts(n)) if n > 1 else [dec.generate(prompts(1)[0])]
        ref = want.generate_batch(prompts(n)) if n > 1 else [want.generate(prompts(1)[0])]
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]


@pytest.mark.parametrize("schedule, field", [
    ({0: {"slot_size": 8}}, "batch_schedule: entry 0: batch sizes are at least 1"),
    ({16: {"slot_size": 0}}, "batch_schedule.16: invalid refusion config: slot_size"),
    ({16: {"no_such_option": 1}}, "batch_schedule.16: invalid refusion config: no_such_option"),
    ({16: {"selector": {"slot_threshold": 2}}}, "batch_schedule.16: invalid refusion config: selector.slot_threshold"),
    ({16: {"batch_schedule": {32: {}}}}, "batch_schedule: entry 16: 'batch_schedule' cannot be scheduled"),
    ({16: {"decoder": "ar"}}, "batch_schedule: entry 16: 'decoder' cannot be scheduled"),
    ({16: 3}, "batch_schedule.16"),
])
def test_a_bad_schedule_is_refused_naming_the_field(schedule, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config({**BASE, "batch_schedule": schedule})


def test_draft_budget_narrows_the_window_by_the_live_sequences(backbone, monkeypatch):
    """draft_budget 16 with slots of 4: alone 4 slots, in a batch of 4 one slot per sequence, widening as
    sequences finish; Stage I feeds exactly the window's masks."""
    from refusion.decoders.refusion import RefusionDecoder

    cfg = {**BASE, "gen_length": 32, "draft_budget": 16}
    dec = build_decoder(backbone, cfg)
    seen = []
    orig = RefusionDecoder._window
    monkeypatch.setattr(RefusionDecoder, "_window",
                        lambda self, cache: seen.append((cache.live_sequences(), orig(self, cache))) or seen[-1][1])
    dec.generate(prompts(1)[0])
    assert seen and all(s == (1, 4) for s in seen)
    seen.clear()
    dec.generate_batch(prompts(4))
    assert (4, 1) in seen and all(w == max(1, 16 // (live * 4)) for live, w in seen)
    # alone, a budget of at least a whole pool is the decoder without it
    wide = build_decoder(backbone, {**cfg, "draft_budget": 1000})
    plain = build_decoder(backbone, {**BASE, "gen_length": 32})
    assert [wide.generate(p).token_ids for p in prompts(3)] == [plain.generate(p).token_ids for p in prompts(3)]
    capped = build_decoder(backbone, {**cfg, "draft_budget": 1000, "draft_window": 2})
    seen.clear()
    capped.generate(prompts(1)[0])
    assert all(w == 2 for _, w in seen)
