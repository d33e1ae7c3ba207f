import torch

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
