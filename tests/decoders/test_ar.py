import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.config import build_decoder


def test_ar_equals_transformers_greedy_generate(backbone):
    prompt = [10, 11, 12, 13]
    res = build_decoder(backbone, {"decoder": "ar", "gen_length": 24}).generate(prompt)
    hf = backbone.model.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, suppress_tokens=[backbone.mask_id],
        eos_token_id=backbone.eos_id, pad_token_id=1,
    )[0, len(prompt):].tolist()
    assert res.token_ids == hf
    assert res.stats.nfe == len(res.token_ids)  # prefill gives token 1, then one forward per token


def test_ar_stops_at_eos(backbone):
    from helpers import force_token

    h = force_token(backbone.model, 9, backbone.eos_id)
    try:
        res = build_decoder(backbone, {"decoder": "ar", "gen_length": 24}).generate([10, 11, 12, 13])
    finally:
        h.remove()
    assert len(res.token_ids) == 6 and res.token_ids[-1] == backbone.eos_id


@pytest.mark.property
@given(lengths=st.lists(st.integers(1, 16), min_size=2, max_size=6), seed=st.integers(0, 1000),
       gen_length=st.integers(1, 24))
def test_each_sequence_of_a_batch_decodes_as_alone(backbone, lengths, seed, gen_length):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lengths]
    dec = build_decoder(backbone, {"decoder": "ar", "gen_length": gen_length})
    alone = [dec.generate(p) for p in prompts]
    batch = dec.generate_batch(prompts)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [r.stats.nfe for r in batch] == [r.stats.nfe for r in alone]
    assert batch[0].stats.batch_nfe == max(r.stats.nfe for r in alone)  # one forward per step for all


def test_a_batch_refuses_flash_attention(backbone, monkeypatch):
    monkeypatch.setattr(backbone.model.config, "_attn_implementation", "flash_attention_2")
    dec = build_decoder(backbone, {"decoder": "ar", "gen_length": 4})
    with pytest.raises(ValueError, match="flash_attention_2.*sdpa or eager"):
        dec.generate_batch([[10, 11], [12]])
