"""ReFusion in a batch: each sequence decodes to the tokens of its decode alone, the batch's host reads
and forwards are shared, and a finished sequence's rows leave the cache."""

import pytest
import torch
from helpers import force_token
from hypothesis import given
from hypothesis import strategies as st

from refusion.core import host
from refusion.core.config import build_decoder

SETTINGS = [
    {},
    {"slot_size": 4, "verifier": {"token_threshold": 0.0}},
    {"slot_size": 4, "serial_blocks": 2, "selector": {"slot_threshold": 0.0}},
    {"fused": True},
    {"draft_window": 2, "correct": True, "join_adjacent": True},
    {"split_threshold": 0.5, "min_split": 2},
    {"remasker": {"name": "sub_slot", "threshold": 0.3}},
    {"cache": "kv_recompute", "slot_size": 4},
    {"selector": {"name": "left_to_right", "n": 2}, "slot_size": 4},
]


def decoder(backbone, **cfg):
    return build_decoder(backbone, {"decoder": "refusion", "gen_length": 16, "slot_size": 8, **cfg})


@pytest.mark.property
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=5), setting=st.sampled_from(SETTINGS),
       seed=st.integers(0, 1000))
def test_each_sequence_of_a_batch_decodes_as_alone(backbone, lengths, setting, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]
    dec = decoder(backbone, **setting)
    alone = [dec.generate(p) for p in prompts]
    batch = dec.generate_batch(prompts)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.buffer_pos for r in batch] == [r.buffer_pos for r in alone]
    assert [len(r.trace) for r in batch] == [len(r.trace) for r in alone]
    assert [r.stats.nfe for r in batch] == [r.stats.nfe for r in alone]  # forwards it took part in
    assert all(r.stats.batch_size == len(prompts) for r in batch)
    assert max(r.stats.nfe for r in batch) <= batch[0].stats.batch_nfe <= sum(r.stats.nfe for r in alone)


@pytest.mark.parametrize("setting", [{}, {"fused": True}, {"slot_size": 4, "verifier": {"token_threshold": 0.0}}])
def test_identical_prompts_share_every_forward_and_read(backbone, setting):
    dec = decoder(backbone, **setting)
    prompt = [10, 11, 12, 13]
    host.reset()
    alone = dec.generate(prompt)
    reads_alone = host.reset()
    batch = dec.generate_batch([prompt] * 4)
    assert host.reset() == reads_alone  # one to_host per read point, for the whole batch
    assert batch[0].stats.batch_nfe == alone.stats.nfe  # one model call per forward, for the whole batch
    assert all(r.token_ids == alone.token_ids for r in batch)


def test_a_finished_sequence_leaves_the_batch(backbone):
    short, long = [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    force_token(backbone.model, len(short), backbone.eos_id)  # the short prompt's first token is EOS;
    # that position lies inside the long prompt, whose logits are never read there
    rows = []
    hook = backbone.model.register_forward_hook(
        lambda m, args, kw, out: rows.append((kw["input_ids"].shape[0], kw["cache"].layers[0].keys.shape[0])),
        with_kwargs=True)
    try:
        res = decoder(backbone, gen_length=32).generate_batch([short, long])
    finally:
        hook.remove()
    assert res[0].token_ids == [backbone.eos_id]
    assert res[0].stats.nfe < res[1].stats.nfe == res[1].stats.batch_nfe
    assert all(fed == cached for fed, cached in rows)  # every row of the cache is fed: none left behind
    assert rows[-1][0] < rows[0][0]
