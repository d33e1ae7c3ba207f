"""Decoder invariants over a generated space of configurations, prompts and EOS placements."""

import pytest
from helpers import ban_token, force_token, make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder
from refusion.core.types import DecodeState, Slot
from refusion.models.backend import Backbone

pytestmark = pytest.mark.property

V = 50
thresholds = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def refusion_config(draw):
    k = draw(st.integers(1, 6))
    n_slots = draw(st.integers(1, 8))
    blocks = draw(st.sampled_from([d for d in range(1, n_slots + 1) if n_slots % d == 0]))
    gen_length = draw(st.integers(max(1, (n_slots - 1) * k + 1), n_slots * k))
    cfg = {"decoder": "refusion", "gen_length": gen_length, "slot_size": k, "serial_blocks": blocks,
           "scorer": draw(st.sampled_from(["first_token_prob", "mean_prob", "mean_neg_entropy", "margin"])),
           "selector": draw(st.one_of(st.builds(lambda t, f: {"name": "threshold", "slot_threshold": t, "fallback": f},
                                                            thresholds, st.sampled_from(["best", "leftmost"])),
                                      st.builds(lambda n: {"name": "left_to_right", "n": n}, st.integers(1, 3)))),
           "verifier": {"token_threshold": draw(thresholds)},
           "cache": draw(st.sampled_from(["kv_concat", "kv_recompute"])),
           "fused": draw(st.booleans()), "correct": draw(st.booleans()), "join_adjacent": draw(st.booleans()),
           "draft_window": draw(st.one_of(st.none(), st.integers(1, 4)))}
    if draw(st.booleans()):
        cfg["remasker"] = {"name": "sub_slot", "threshold": draw(thresholds)}
    if draw(st.booleans()):
        cfg["split_threshold"] = draw(thresholds)
    return cfg


@st.composite
def llada_config(draw):
    block = draw(st.integers(1, 8))
    n_blocks = draw(st.integers(1, 4))
    steps_per_block = draw(st.integers(1, block))
    cfg = {"decoder": "llada", "gen_length": block * n_blocks, "block_length": block, "steps": steps_per_block * n_blocks,
           "kv_cache": draw(st.sampled_from(["none", "prefix", "dual"])),
           "remasking": draw(st.sampled_from(["low_confidence", "random"]))}
    if draw(st.booleans()):
        cfg["selector"] = {"name": "confidence_threshold", "threshold": draw(thresholds)}
    return cfg


@st.composite
def block_config(draw):
    return {"decoder": "block", "gen_length": draw(st.integers(1, 24)), "block_size": draw(st.integers(1, 8)),
            "selector": {"name": "confidence_threshold", "threshold": draw(thresholds)},
            "kv_cache": draw(st.booleans()), "pipeline": draw(st.booleans())}


ATTENTION = {"refusion": "causal", "ar": "causal", "llada": "bidirectional", "block": "block_causal"}


@pytest.fixture(scope="module")
def models(char_tokenizer):
    out = {}
    for kind in ("causal", "bidirectional", "block_causal"):
        m = make_tiny_qwen3(len(char_tokenizer), seed=3)
        m.config.refusion_attention = kind
        m.config.refusion_block_size = 4
        out[kind] = Backbone(m, char_tokenizer)
    return out


configs = st.one_of(refusion_config(), llada_config(), block_config(),
                    st.builds(lambda n: {"decoder": "ar", "gen_length": n}, st.integers(1, 24)))


@given(cfg=configs, prompt=st.lists(st.integers(4, V - 1), min_size=1, max_size=8),
       eos_at=st.one_of(st.none(), st.integers(0, 30)), temperature=st.sampled_from([0.0, 0.7]))
def test_decoder_invariants(models, cfg, prompt, eos_at, temperature):
    """For every decoder and configuration: no [MASK] in the output; at most gen_length tokens; nothing after
    the first EOS (EOS forced at a generated position, or never); the committed positions form exactly a
    prefix range of the generation positions and restoring the buffer by position gives the output; NFE
    equals the forward calls counted by a hook on the model; temperature 0 is deterministic and a fixed
    seed reproduces sampling."""
    bb = models[ATTENTION[cfg["decoder"]]]
    if cfg["decoder"] != "ar":
        cfg = {**cfg, "drafter": {"temperature": temperature}}
    hooks = [ban_token(bb.model, bb.eos_id)]
    if eos_at is not None:
        hooks.append(force_token(bb.model, len(prompt) + eos_at, bb.eos_id, boost=2e4))
    calls = []
    hooks.append(bb.model.register_forward_pre_hook(lambda m, a: calls.append(1)))
    try:
        dec = build_decoder(bb, cfg)
        res = dec.generate(prompt)
        again = dec.generate(prompt)
    finally:
        for h in hooks:
            h.remove()
    ids = res.token_ids
    assert bb.mask_id not in ids
    assert len(ids) <= cfg["gen_length"]
    assert all(t not in bb.eos_ids for t in ids[:-1])
    if eos_at is not None and eos_at < cfg["gen_length"]:
        assert len(ids) == eos_at + 1 and ids[-1] == bb.eos_id
    if res.buffer_pos:
        gen = sorted(res.buffer_pos[len(prompt):])
        assert gen == list(range(len(prompt), len(prompt) + len(gen)))
        restored = [t for _, t in sorted(zip(res.buffer_pos, res.buffer_ids))][len(prompt):]
        assert restored[: len(ids)] == ids
    assert res.stats.nfe + again.stats.nfe == len(calls)
    assert again.token_ids == ids  # greedy, or the same seed


@given(k=st.integers(1, 6), n=st.integers(1, 10), prompt_len=st.integers(1, 5), data=st.data())
def test_restore_by_position_inverts_any_reordering(k, n, prompt_len, data):
    """Committing slots in any order (each with its original position ids) and sorting by position gives
    back the tokens in their original order, for any slot size, length and permutation."""
    tokens = data.draw(st.lists(st.integers(0, 999), min_size=n * k, max_size=n * k))
    order = data.draw(st.permutations(range(n)))
    state = DecodeState(ids=list(range(prompt_len)), pos=list(range(prompt_len)), prompt_len=prompt_len)
    for s in order:
        slot = Slot(prompt_len + s * k, k)
        state.commit(tokens[s * k:(s + 1) * k], list(slot.positions))
    assert state.generated_in_position_order() == tokens


@given(cfg=refusion_config(), prompt=st.lists(st.integers(4, V - 1), min_size=1, max_size=6))
def test_kv_concat_equals_kv_recompute_with_one_slot_per_iteration(models, cfg, prompt):
    """When exactly one slot is committed per iteration (top-1 fallback with slot_threshold 1), each
    completed slot's KV already has full context, so kv_concat and kv_recompute decode identically."""
    bb = models["causal"]
    cfg = {**cfg, "selector": {"name": "threshold", "slot_threshold": 1.0}, "fused": False}
    cfg.pop("split_threshold", None)
    a = build_decoder(bb, {**cfg, "cache": "kv_concat"}).generate(prompt)
    b = build_decoder(bb, {**cfg, "cache": "kv_recompute"}).generate(prompt)
    assert a.token_ids == b.token_ids and a.stats.nfe == b.stats.nfe
