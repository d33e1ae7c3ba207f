"""Block diffusion in a batch: each sequence decodes to the tokens of its decode alone (ragged prompts,
rows at different blocks, cache lengths and pipeline windows), one host read per step for the whole
batch, a finished sequence leaves the batch, and each result counts the forwards it took part in."""

import pytest
import torch
from helpers import assert_batch_decodes_as_alone, ban_token, decode_reading_host, force_token, make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder
from refusion.models.backend import Backbone

B = 4  # the model's block size
THRESHOLD = {"name": "confidence_threshold", "threshold": 0.5}
SETTINGS = [
    {},  # the model's block, threshold 0.9, KV cache
    {"kv_cache": False},
    {"selector": THRESHOLD},
    {"sub_block_size": 2, "selector": THRESHOLD},
    {"pipeline": True, "pipeline_threshold": 0.25},
    {"pipeline": True, "pipeline_threshold": 0.5, "kv_cache": False, "selector": THRESHOLD},
    {"gen_length": 14, "block_size": 6, "sub_block_size": 3, "pipeline": True, "pipeline_threshold": 0.3},
    {"selector": {"name": "factor", "factor": 1.0}, "gen_length": 12},
]


@pytest.fixture(scope="module")
def blockc(char_tokenizer) -> Backbone:
    model = make_tiny_qwen3(len(char_tokenizer))
    model.config.refusion_attention = "block_causal"
    model.config.refusion_block_size = B
    return Backbone(model, char_tokenizer)


def decoder(bb, **cfg):
    return build_decoder(bb, {"decoder": "block", "gen_length": 16, **cfg})


@pytest.mark.property
@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), setting=st.sampled_from(SETTINGS),
       forced=st.lists(st.integers(1, 26), min_size=2, max_size=10, unique=True),
       eos_at=st.one_of(st.none(), st.integers(2, 26)), seed=st.integers(0, 1000))
def test_each_sequence_of_a_batch_decodes_as_alone(blockc, lengths, setting, forced, eos_at, seed):
    """Forced confident tokens at fixed positions fall at different generation offsets in prompts of
    different lengths, so rows finish blocks at different steps (different cache lengths, windows and
    pipeline starts); each still decodes as alone, and its stats count its own forwards."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]
    hooks = [ban_token(blockc.model, blockc.eos_id)] + [force_token(blockc.model, p, 20 + p % 9) for p in forced]
    if eos_at is not None:
        hooks.append(force_token(blockc.model, eos_at, blockc.eos_id, boost=3e4))
    calls = []  # per model call: (rows, tokens fed)
    try:
        dec = decoder(blockc, **setting)
        alone = [dec.generate(p) for p in prompts]
        nfe0, tok0 = blockc.nfe, blockc.tokens_in
        hooks.append(blockc.model.register_forward_pre_hook(
            lambda m, args, kw: calls.append((kw["input_ids"].shape[0], kw["input_ids"].numel())), with_kwargs=True))
        batch = dec.generate_batch(prompts)
    finally:
        for h in hooks:
            h.remove()
    assert_batch_decodes_as_alone(batch, alone)
    # stats: one forward per step of a sequence, ONE forward per step of the batch
    assert [r.stats.nfe for r in batch] == [r.stats.nfe for r in alone] == [len(r.trace) for r in alone]
    assert batch[0].stats.batch_nfe == len(calls) == blockc.nfe - nfe0 == max(r.stats.nfe for r in batch)
    assert sum(r.stats.nfe for r in batch) == sum(rows for rows, _ in calls)
    assert sum(r.stats.tokens_in for r in batch) == sum(t for _, t in calls) == blockc.tokens_in - tok0
    assert all(r.stats.batch_size == len(prompts) and r.stats.wall_s <= r.stats.batch_wall_s for r in batch)
    assert [r.buffer_pos for r in batch] == [r.buffer_pos for r in alone]


READ_VARIANTS = {
    "threshold, rows diverge": {"selector": THRESHOLD},
    "no cache": {"kv_cache": False},
    "pipeline, sub-blocks": {"pipeline": True, "pipeline_threshold": 0.25, "sub_block_size": 2},
    "sampled": {"drafter": {"temperature": 1.0}},
}


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_one_host_read_per_step_of_the_batch_and_nowhere_else(blockc, variant):
    hooks = [ban_token(blockc.model, blockc.eos_id)] + [force_token(blockc.model, p, 25) for p in (8, 9, 12, 13, 14)]
    prompts = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37], [15]]
    config = {"decoder": "block", "gen_length": 16, **READ_VARIANTS[variant]}
    try:
        batch, reads, tolist_calls, stray = decode_reading_host(blockc, config, prompts)
    finally:
        for h in hooks:
            h.remove()
    assert stray == []  # no .item() / .tolist() / int() / bool() / .nonzero() / mask indexing outside to_host
    steps = max(len(r.trace) for r in batch)
    assert reads == steps + 1 == tolist_calls  # one per step + the finiteness check
    assert batch[0].stats.batch_nfe == steps  # one forward per step
    if variant == "threshold, rows diverge":
        assert len({len(r.trace) for r in batch}) > 1  # the rows did drift apart


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_finished_sequence_leaves_the_batch(blockc, kv_cache):
    short, long = [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    hooks = [ban_token(blockc.model, blockc.eos_id),
             force_token(blockc.model, len(short), blockc.eos_id, boost=3e4)]  # the short prompt's first token is EOS;
    # that position lies inside the long prompt, whose logits are never read there
    rows = []  # per forward: (rows fed, rows of the KV buffers; None without a cache)

    def record(module, args, kwargs):
        cache = kwargs["cache"]
        rows.append((kwargs["input_ids"].shape[0], None if cache is None else cache.layers[0].keys.shape[0]))

    hooks.append(blockc.model.register_forward_pre_hook(record, with_kwargs=True))
    try:
        res = decoder(blockc, kv_cache=kv_cache).generate_batch([short, long])
    finally:
        for h in hooks:
            h.remove()
    assert res[0].token_ids == [blockc.eos_id] and res[0].stats.nfe == 1  # decided after its first step
    assert len(res[1].token_ids) == 16 and res[1].stats.nfe == res[1].stats.batch_nfe == 16
    assert rows[0][0] == 2 and all(fed == 1 for fed, _ in rows[1:])  # later forwards: the long row alone
    assert all(cached == 1 for _, cached in rows[1:])  # its cache row left too (without kv_cache: scratch KV)
