"""ReFusion variants chosen by config: left-to-right slots, fused scheduling, sub-slot remasking,
adaptive (split) slots, alternative scorers."""

import pytest
import torch
from helpers import ban_token, chosen, force_token

from refusion.core.config import build_decoder

PROMPT = [10, 11, 12, 13, 14]


def run(backbone, **cfg):
    return build_decoder(backbone, {"decoder": "refusion", "gen_length": 32, "slot_size": 4, **cfg}).generate(PROMPT)


def assert_sound(res, backbone, gen_length=32):
    ids = res.token_ids
    assert backbone.mask_id not in ids and len(ids) <= gen_length
    eos = [i for i, t in enumerate(ids) if t in backbone.eos_ids]
    assert not eos or eos[0] == len(ids) - 1
    gen_pos = res.buffer_pos[len(PROMPT):]
    assert sorted(gen_pos) == list(range(len(PROMPT), len(PROMPT) + len(gen_pos)))
    restored = [t for _, t in sorted(zip(res.buffer_pos, res.buffer_ids))][len(PROMPT):]
    assert restored[: len(ids)] == ids


def test_left_to_right_chooses_the_leftmost_slot(backbone):
    ban_token(backbone.model, backbone.eos_id)
    res = run(backbone, selector={"name": "left_to_right"}, verifier={"token_threshold": 0.5})
    starts = [t.chosen[0] for t in res.trace]
    assert all(len(t.chosen) == 1 for t in res.trace)
    assert starts == sorted(starts) and starts[0] == len(PROMPT)
    assert_sound(res, backbone)


@pytest.mark.parametrize("fallback", ["best", "leftmost"])
def test_threshold_fallback_when_no_slot_passes(fallback):
    from refusion.plugins.selectors import ThresholdSelector

    sel = ThresholdSelector(ThresholdSelector.Options(slot_threshold=0.9, fallback=fallback))
    assert chosen(sel.select(torch.tensor([0.2, 0.95, 0.3, 0.99]))) == [1, 3]  # slots that pass: the fallback is unused
    assert chosen(sel.select(torch.tensor([0.2, 0.5, 0.3, 0.8]))) == ([3] if fallback == "best" else [0])


def test_leftmost_fallback_decodes_in_order_when_nothing_is_confident(backbone):
    ban_token(backbone.model, backbone.eos_id)
    res = run(backbone, selector={"slot_threshold": 1.0, "fallback": "leftmost"}, verifier={"token_threshold": 0.5})
    starts = [t.chosen[0] for t in res.trace]
    assert all(len(t.chosen) == 1 for t in res.trace) and starts == sorted(starts)
    assert starts[0] == len(PROMPT)
    assert_sound(res, backbone)


@pytest.mark.parametrize("window", [1, 2])
def test_draft_window_drafts_the_same_tokens_with_narrower_forwards(backbone, window):
    # causal attention: a mask's logits do not depend on the masks to its right, so with the leftmost
    # slot chosen every time, drafting a window of the pool gives the output of drafting all of it
    widths = []
    hook = backbone.model.register_forward_hook(lambda m, args, kw, out: widths.append(kw["input_ids"].shape[-1]),
                                                with_kwargs=True)
    try:
        cfg = dict(selector={"slot_threshold": 1.0, "fallback": "leftmost"}, verifier={"token_threshold": 0.5})
        full = run(backbone, **cfg)
        n_full = len(widths)
        windowed = run(backbone, draft_window=window, **cfg)
    finally:
        hook.remove()
    assert windowed.token_ids == full.token_ids and windowed.stats.nfe == full.stats.nfe
    assert sum(widths[n_full:]) < sum(widths[:n_full])
    assert all(len(t.scored) <= window for t in windowed.trace)
    assert_sound(windowed, backbone)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_draft_window_keeps_fused_scheduling_exact(backbone, window):
    cfg = dict(selector={"slot_threshold": 0.02}, verifier={"token_threshold": 0.0}, draft_window=window)
    assert run(backbone, fused=True, **cfg).token_ids == run(backbone, **cfg).token_ids


@pytest.mark.parametrize("cfg", [
    {"selector": {"slot_threshold": 0.02}, "verifier": {"token_threshold": 0.0}},
    {"selector": {"name": "left_to_right", "n": 2}, "verifier": {"token_threshold": 0.0}},
    {"selector": {"slot_threshold": 0.03}, "verifier": {"token_threshold": 0.03}, "serial_blocks": 2},
])
def test_fused_equals_plain_and_saves_forwards(backbone, cfg):
    plain = run(backbone, **cfg)
    fused = run(backbone, fused=True, **cfg)
    assert fused.token_ids == plain.token_ids
    saved = sum(t.fused for t in fused.trace)
    assert fused.stats.nfe == plain.stats.nfe - saved
    if cfg["verifier"]["token_threshold"] == 0.0 and len(plain.trace) > 1:
        assert saved > 0


@pytest.mark.parametrize("cache", ["kv_concat", "kv_recompute"])
def test_sub_slot_remask_sends_suffixes_back(backbone, cache):
    ban_token(backbone.model, backbone.eos_id)
    res = run(backbone, selector={"slot_threshold": 0.0}, verifier={"token_threshold": 1.0},
              remasker={"name": "sub_slot", "threshold": 1.0, "min_keep": 2}, cache=cache)
    assert any(t.remasked for t in res.trace)
    first = res.trace[0]
    assert all(n == 2 for _, n in first.accepted)  # every II-b slot kept exactly min_keep tokens
    assert len(res.token_ids) == 32
    assert_sound(res, backbone)


def test_sub_slot_remask_with_eos(backbone):
    ban_token(backbone.model, backbone.eos_id)  # EOS only where forced
    force_token(backbone.model, len(PROMPT) + 9, backbone.eos_id, boost=2e4)
    res = run(backbone, selector={"slot_threshold": 0.0}, verifier={"token_threshold": 1.0},
              remasker={"name": "sub_slot", "threshold": 1.0})
    assert res.token_ids[-1] == backbone.eos_id and len(res.token_ids) == 10
    assert_sound(res, backbone)


def test_adaptive_split_cuts_chosen_slots(backbone):
    ban_token(backbone.model, backbone.eos_id)
    res = run(backbone, split_threshold=1.0, min_split=2, selector={"slot_threshold": 0.0},
              verifier={"token_threshold": 0.0})
    assert res.trace[0].split and all(size == 2 for _, size in res.trace[0].split)
    assert all(n == 2 for _, n in res.trace[0].accepted)
    assert len(res.token_ids) == 32
    assert_sound(res, backbone)


@pytest.mark.parametrize("scorer", ["first_token_prob", "mean_prob", "mean_neg_entropy", "margin"])
def test_scorers_with_mixed_slot_sizes(backbone, scorer):
    ban_token(backbone.model, backbone.eos_id)
    res = run(backbone, scorer=scorer, split_threshold=0.5, selector={"slot_threshold": 0.5},
              verifier={"token_threshold": 0.5}, remasker={"name": "sub_slot", "threshold": 0.5})
    assert len(res.token_ids) == 32
    assert_sound(res, backbone)


def test_correct_makes_stage_IIb_autoregressive(backbone):
    """With one slot at a time (left to right) and every draft failing verification, ``correct`` turns
    Stage II-b into greedy AR decoding: every token but a slot's first (its Stage-I draft, always
    accepted) is the argmax of a causal forward over everything before it."""
    ban_token(backbone.model, backbone.eos_id)
    cfg = {"selector": {"name": "left_to_right"}, "verifier": {"token_threshold": 1.0}}
    res = run(backbone, correct=True, **cfg)
    assert_sound(res, backbone)
    assert set(t.stage for t in res.trace) == {"II-b"} and len(res.token_ids) == 32
    P, not_first = len(PROMPT), torch.arange(32) % 4 != 0

    def is_greedy(token_ids):
        full = torch.tensor(PROMPT + token_ids)
        greedy = backbone.forward(full, torch.arange(len(full)), None)[0].argmax(-1)  # [T] next-token argmax
        return torch.equal(torch.tensor(token_ids)[not_first], greedy[P - 1 : -1][not_first])

    assert is_greedy(res.token_ids)
    assert not is_greedy(run(backbone, **cfg).token_ids)  # the reference rule keeps masked predictions


def _greedy_after_first(backbone, token_ids):
    """Whether every token after the first is the causal argmax given everything before it."""
    full = torch.tensor(PROMPT + token_ids)
    greedy = backbone.forward(full, torch.arange(len(full)), None)[0].argmax(-1)  # [T] next-token argmax
    return torch.equal(torch.tensor(token_ids[1:]), greedy[len(PROMPT) : -1])


def test_join_adjacent_completes_touching_slots_in_one_row(backbone):
    """All eight slots chosen at once and every draft failing verification: with ``join_adjacent`` they are
    one row of 32 tokens, and with ``correct`` Stage II-b then decodes it greedily, each slot seeing the
    ones before it; without, each slot's first token is its blind Stage-I draft."""
    ban_token(backbone.model, backbone.eos_id)
    cfg = {"selector": {"slot_threshold": 0.0}, "verifier": {"token_threshold": 1.0}, "correct": True}
    joined = run(backbone, join_adjacent=True, **cfg)
    assert_sound(joined, backbone)
    (it,) = joined.trace
    assert it.stage == "II-b" and len(it.chosen) == 8 and it.accepted == [(len(PROMPT), 32)]
    assert _greedy_after_first(backbone, joined.token_ids)
    apart = run(backbone, **cfg)
    assert len(apart.trace[0].accepted) == 8 and not _greedy_after_first(backbone, apart.token_ids)


@pytest.mark.parametrize("remask", [False, True])
def test_join_adjacent_only_joins_touching_slots(backbone, remask):
    """Slots 0, 1 and 3 made confident: all three chosen, 0 and 1 completed in one row, 3 in its own;
    a remasked suffix of the joined row returns to the pool cut on the slot grid."""
    ban_token(backbone.model, backbone.eos_id)
    P = len(PROMPT)
    for pos, tok in ((P, 20), (P + 4, 21), (P + 12, 22)):
        force_token(backbone.model, pos, tok)
    remasker = {"name": "sub_slot", "threshold": 1.0, "min_keep": 2} if remask else {"name": "none"}
    res = run(backbone, join_adjacent=True, selector={"slot_threshold": 0.5}, verifier={"token_threshold": 1.0},
              remasker=remasker)
    assert_sound(res, backbone)
    assert len(res.token_ids) == 32
    first = res.trace[0]
    assert first.stage == "II-b" and first.chosen == [P, P + 4, P + 12]
    if remask:  # each row keeps min_keep tokens; the joined row's rest comes back cut on the slot grid
        assert first.accepted == [(P, 2), (P + 12, 2)]
        assert first.remasked == [(P + 2, 2), (P + 4, 4), (P + 14, 2)]
    else:
        assert first.accepted == [(P, 8), (P + 12, 4)]
    assert res.token_ids[0] == 20 and res.token_ids[12] == 22
