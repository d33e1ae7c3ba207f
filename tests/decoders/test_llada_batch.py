"""LLaDA / Fast-dLLM in a batch: each sequence decodes to the tokens of its decode alone (ragged prompts,
rows at different blocks and steps), one host read per step for the whole batch, a finished sequence
leaves the batch, and each result counts the forwards it took part in."""

import pytest
import torch
from helpers import assert_batch_decodes_as_alone, ban_token, decode_reading_host, force_token, make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder
from refusion.models.backend import Backbone

THRESHOLD = {"name": "confidence_threshold", "threshold": 0.5}
SETTINGS = [
    {"steps": 8},  # LLaDA: no cache, the top-k schedule
    {"kv_cache": "dual", "selector": THRESHOLD},  # Fast-dLLM: dual cache, threshold
    {"kv_cache": "prefix", "selector": THRESHOLD, "block_length": 4},
    {"kv_cache": "dual", "refresh_every": 2, "steps": 8},
    {"kv_cache": "prefix", "refresh_every": 3, "selector": {"name": "factor", "factor": 1.0}},
    {"kv_cache": "dual", "steps": 16, "early_stop": False},
    {"kv_cache": "none", "selector": {"name": "threshold", "slot_threshold": 0.5}},  # a slot selector
]


@pytest.fixture(scope="module")
def bidi(char_tokenizer) -> Backbone:
    model = make_tiny_qwen3(len(char_tokenizer))
    model.config.refusion_attention = "bidirectional"
    return Backbone(model, char_tokenizer)


def decoder(bb, **cfg):
    return build_decoder(bb, {"decoder": "llada", "gen_length": 16, "block_length": 8, **cfg})


class Forwards:
    """Records the rows and tokens of every model call (a pre-hook on the model)."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []  # (rows, tokens fed)
        self.handle = model.register_forward_pre_hook(
            lambda m, args, kw: self.calls.append((kw["input_ids"].shape[0], kw["input_ids"].numel())), with_kwargs=True)


@pytest.mark.property
@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), setting=st.sampled_from(SETTINGS),
       shifted=st.booleans(), forced=st.lists(st.integers(1, 26), min_size=2, max_size=10, unique=True),
       eos_at=st.one_of(st.none(), st.integers(2, 26)), seed=st.integers(0, 1000))
def test_each_sequence_of_a_batch_decodes_as_alone(bidi, lengths, setting, shifted, forced, eos_at, seed):
    """Forced confident tokens at fixed positions fall at different generation offsets in prompts of
    different lengths, so rows commit different numbers of tokens per step and drift into different
    blocks and refresh steps; each still decodes as alone, and its stats count its own forwards."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]
    hooks = [ban_token(bidi.model, bidi.eos_id)] + [force_token(bidi.model, p, 20 + p % 9) for p in forced]
    if eos_at is not None:
        hooks.append(force_token(bidi.model, eos_at, bidi.eos_id, boost=3e4))
    bidi.logits_shifted = shifted
    try:
        dec = decoder(bidi, **setting)
        alone = [dec.generate(p) for p in prompts]
        nfe0, tok0 = bidi.nfe, bidi.tokens_in
        forwards = Forwards(bidi.model)
        hooks.append(forwards.handle)
        batch = dec.generate_batch(prompts)
    finally:
        bidi.logits_shifted = False
        for h in hooks:
            h.remove()
    assert_batch_decodes_as_alone(batch, alone)
    # stats: one forward per step of a sequence; the batch's forwards and tokens are its sequences'
    assert [r.stats.nfe for r in batch] == [r.stats.nfe for r in alone] == [len(r.trace) for r in alone]
    assert batch[0].stats.batch_nfe == len(forwards.calls) == bidi.nfe - nfe0
    assert sum(r.stats.nfe for r in batch) == sum(rows for rows, _ in forwards.calls)
    assert sum(r.stats.tokens_in for r in batch) == sum(t for _, t in forwards.calls) == bidi.tokens_in - tok0
    assert all(r.stats.batch_size == len(prompts) and r.stats.wall_s <= r.stats.batch_wall_s for r in batch)
    assert [r.buffer_pos for r in batch] == [r.buffer_pos for r in alone]


READ_VARIANTS = {
    "dual threshold, rows diverge": {"kv_cache": "dual", "selector": THRESHOLD},
    "no cache, top-k": {"steps": 8},
    "prefix refresh": {"kv_cache": "prefix", "refresh_every": 2, "steps": 8},
    "shifted logits dual": {"kv_cache": "dual", "steps": 8, "shifted": True},
    "random remasking, sampled": {"remasking": "random", "steps": 8, "drafter": {"temperature": 1.0}},
}


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_one_host_read_per_step_of_the_batch_and_nowhere_else(bidi, variant):
    cfg = dict(READ_VARIANTS[variant])
    bidi.logits_shifted = cfg.pop("shifted", False)
    hooks = [ban_token(bidi.model, bidi.eos_id)] + [force_token(bidi.model, p, 25) for p in (8, 9, 12, 13, 14)]
    prompts = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37], [15]]
    try:
        batch, reads, tolist_calls, stray = decode_reading_host(
            bidi, {"decoder": "llada", "gen_length": 16, "block_length": 8, **cfg}, prompts)
    finally:
        bidi.logits_shifted = False
        for h in hooks:
            h.remove()
    assert stray == []  # no .item() / .tolist() / int() / bool() / .nonzero() / mask indexing outside to_host
    steps = max(len(r.trace) for r in batch)  # every sequence still decoding takes one step per step of the batch
    assert reads == steps + 1 == tolist_calls  # one per step + the finiteness check
    if variant == "dual threshold, rows diverge":
        assert len({len(r.trace) for r in batch}) > 1  # the rows did drift apart
        assert batch[0].stats.batch_nfe > steps  # full (refresh) and cached rows in one step: two forwards


@pytest.mark.parametrize("kv_cache", ["none", "dual"])
def test_a_finished_sequence_leaves_the_batch(bidi, kv_cache):
    short, long = [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    hooks = [ban_token(bidi.model, bidi.eos_id),
             force_token(bidi.model, len(short), bidi.eos_id, boost=3e4)]  # the short prompt's first token is EOS;
    # that position lies inside the long prompt, whose logits are never read there
    rows = []  # per forward: (rows fed, rows of the cache's KV buffers; None without one yet)

    def record(module, args, kwargs):
        cache = kwargs["cache"]
        keys = cache.layers[0].keys if cache is not None and cache.layers else None
        rows.append((kwargs["input_ids"].shape[0], None if keys is None or keys.dim() < 4 else keys.shape[0]))

    hooks.append(bidi.model.register_forward_pre_hook(record, with_kwargs=True))
    try:
        res = decoder(bidi, kv_cache=kv_cache, steps=16).generate_batch([short, long])
    finally:
        for h in hooks:
            h.remove()
    assert res[0].token_ids == [bidi.eos_id] and res[0].stats.nfe == 1  # decided after its first step
    assert len(res[1].token_ids) == 16 and res[1].stats.nfe == res[1].stats.batch_nfe == 16
    assert rows[0][0] == 2 and all(fed == 1 for fed, _ in rows[1:])  # later forwards: the long row alone
    if kv_cache == "dual":
        assert {cached for _, cached in rows[1:]} <= {None, 1}  # the short row's cache left too
        assert any(cached == 1 for _, cached in rows[1:])
