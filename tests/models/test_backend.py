import json

import pytest
import torch
from helpers import make_char_tokenizer, make_tiny_qwen3

from refusion.core.config import build_decoder
from refusion.models.backend import Backbone, MaskTokenError, NonFiniteLogitsError
from refusion.models.loading import CheckpointError, load_pretrained, save_pretrained


def count_forwards(model):
    calls = {"n": 0, "tokens": 0}

    def pre(module, args, kwargs):
        calls["n"] += 1
        calls["tokens"] += kwargs["input_ids"].numel()

    return calls, model.register_forward_pre_hook(pre, with_kwargs=True)


@pytest.mark.parametrize(
    "cfg",
    [
        {"decoder": "ar"},
        {"decoder": "refusion", "selector": {"slot_threshold": 0.0}, "verifier": {"token_threshold": 0.0}},
        {"decoder": "refusion", "selector": {"slot_threshold": 1.0}, "verifier": {"token_threshold": 1.0}},
        {"decoder": "refusion", "selector": {"slot_threshold": 0.0}, "verifier": {"token_threshold": 0.9}, "cache": "kv_recompute"},
        {"decoder": "refusion", "serial_blocks": 4, "selector": {"slot_threshold": 0.02}, "verifier": {"token_threshold": 0.03}},
    ],
)
def test_nfe_equals_instrumented_forward_count(backbone, cfg):
    calls, h = count_forwards(backbone.model)
    res = build_decoder(backbone, {"gen_length": 32, "slot_size": 4, **cfg} if cfg["decoder"] == "refusion"
                        else {"gen_length": 32, **cfg}).generate([5, 6, 7, 8])
    h.remove()
    assert res.stats.nfe == calls["n"] == backbone.nfe
    assert res.stats.tokens_in == calls["tokens"] == backbone.tokens_in


def test_cache_ops(backbone):
    bb = backbone
    ids, pos = torch.tensor([5, 6, 7, 8, 9]), torch.arange(5)
    cache = bb.new_cache()
    bb.forward(ids, pos, cache.kv)
    keys0 = cache.kv.layers[1].keys.clone()
    bb.forward(torch.tensor([10, 11, 12]), torch.tensor([9, 7, 8]), cache.kv, keep_kv=False)
    assert torch.equal(cache.kv.layers[1].keys, keys0)  # KV of a dropped forward leaves no trace
    bb.forward(torch.tensor([10, 11]), torch.tensor([5, 6]), cache.kv)
    cache.crop(5)
    assert torch.equal(cache.kv.layers[1].keys, keys0)
    # fork into 2 rows, continue each differently, merge: equals row-wise continuations
    fork = cache.fork(2)
    assert fork.n_rows() == 2 and cache.n_rows() == 1
    cont = torch.tensor([[20, 21, 22], [30, 31, 32]])
    cpos = torch.tensor([[5, 6, 7], [8, 9, 10]])
    bb.forward(cont, cpos, fork.kv)
    single = cache.fork(1)
    bb.forward(cont[1:], cpos[1:], single.kv)
    assert torch.allclose(fork.kv.layers[1].keys[1], single.kv.layers[1].keys[0], atol=1e-6)  # forked row == own run
    merged = fork.fork(1)
    merged.concat_rows(5, [3, 2])
    k = merged.kv.layers[1].keys
    assert k.shape[0] == 1 and k.shape[-2] == 5 + 3 + 2
    assert torch.equal(k[0, :, 5:8], fork.kv.layers[1].keys[0, :, 5:8])
    assert torch.equal(k[0, :, 8:10], fork.kv.layers[1].keys[1, :, 5:7])


def test_select_keeps_the_chosen_row(backbone):
    bb = backbone
    cache = bb.new_cache()
    bb.forward(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0, 1], [0, 1]]), cache.kv)
    row1 = cache.kv.layers[0].keys[1].clone()
    cache.select([1])
    assert torch.equal(cache.kv.layers[0].keys[0], row1)


def test_permuted_positions_get_an_explicit_mask(backbone):
    """Without a cache, a permuted buffer must equal the cached continuation (no packed-sequence mask)."""
    ids, pos = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([0, 1, 4, 5, 2, 3])
    full = backbone.forward(ids, pos, None)
    cache = backbone.new_cache().kv
    a = backbone.forward(ids[:2], pos[:2], cache)
    b = backbone.forward(ids[2:], pos[2:], cache)
    assert torch.allclose(full, torch.cat([a, b], dim=1), atol=1e-5)


def test_missing_mask_token_says_how_to_add_one():
    tok = make_char_tokenizer(with_mask=False)
    with pytest.raises(MaskTokenError, match="add_special_tokens"):
        Backbone(make_tiny_qwen3(len(tok)), tok)


def test_mask_token_from_config_when_tokenizer_has_none():
    tok = make_char_tokenizer(with_mask=False)
    model = make_tiny_qwen3(len(tok) + 1)
    model.config.mask_token_id = len(tok)
    assert Backbone(model, tok).mask_id == len(tok)


def test_non_finite_logits_are_refused(backbone):
    def poison(module, args, out):
        out.logits.fill_(float("nan"))

    h = backbone.model.register_forward_hook(poison)
    with pytest.raises(NonFiniteLogitsError, match="NaN"):
        build_decoder(backbone, {"decoder": "ar", "gen_length": 4}).generate([5, 6])
    h.remove()


def test_bidirectional_model_refused_by_causal_decoder(char_tokenizer):
    bb = Backbone(make_tiny_qwen3(len(char_tokenizer)), char_tokenizer, attention="bidirectional")
    for name in ("refusion", "ar"):
        with pytest.raises(ValueError, match="needs a model with causal attention"):
            build_decoder(bb, {"decoder": name})


def test_prompt_checks(backbone):
    dec = build_decoder(backbone, {"decoder": "refusion", "gen_length": 16, "slot_size": 4})
    with pytest.raises(ValueError, match="prompt is empty"):
        dec.generate([])
    with pytest.raises(ValueError, match="maximum positions"):
        dec.generate([5] * 500)


def test_save_load_round_trip_and_incomplete_folder(tmp_path, backbone):
    save_pretrained(backbone.model, backbone.tokenizer, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    model, tok = load_pretrained(tmp_path / "m")
    assert model.dtype == torch.float32 and tok.mask_token_id == backbone.mask_id
    loaded = Backbone(model, tok)
    ids, pos = torch.tensor([5, 6, 7]), torch.arange(3)
    assert torch.allclose(loaded.forward(ids, pos, None), backbone.forward(ids, pos, None), atol=0.05)  # bf16 storage
    save_pretrained(model, tok, tmp_path / "again")  # a tokenizer loaded from a folder keeps no load-time keys
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (tmp_path / "m" / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text()) == json.loads(
        (tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "model.safetensors").unlink()
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing model.safetensors.*tokenizer files"):
        load_pretrained(tmp_path / "m")
    with pytest.raises(CheckpointError, match="neither a local folder nor a shipped checkpoint"):
        load_pretrained(tmp_path / "nope")


def test_logits_only_at_the_rows_read(backbone):
    """``logits_at`` computes exactly those rows (equal to the full forward's), a prefill computes none,
    and ``logits_rows`` counts the rows that went through the output head."""
    ids, pos = torch.tensor([5, 6, 7, 8, 9]), torch.arange(5)
    full = backbone.forward(ids, pos, None)[0]  # [5, V]
    backbone.logits_rows = 0
    assert torch.allclose(backbone.forward(ids, pos, None, logits_at=slice(2, None))[0], full[2:], atol=1e-6)
    assert torch.allclose(backbone.forward(ids, pos, None, logits_at=slice(0, 4))[0], full[:4], atol=1e-6)
    index = torch.tensor([4, 0, 2])
    assert torch.allclose(backbone.forward(ids, pos, None, logits_at=index)[0], full[index], atol=1e-6)
    assert backbone.logits_rows == 3 + 4 + 3
    assert backbone.forward(ids, pos, None, logits_at=slice(5, None)).shape[1] == 0  # an empty slice is no rows
    assert backbone.logits_rows == 3 + 4 + 3
    cache = backbone.new_cache().kv
    assert backbone.forward(ids, pos, cache, logits_at=None) is None  # a prefill: KV, no logits
    assert backbone.logits_rows == 10 and cache.get_seq_length() == 5
    step = backbone.forward(torch.tensor([10]), torch.tensor([5]), cache, logits_at=slice(-1, None))
    assert step.shape == (1, 1, full.shape[-1]) and step.dtype == torch.float32
    assert step[0, 0, backbone.mask_id] == torch.finfo(torch.float32).min  # [MASK] never generated


def test_non_finite_rows_not_read_are_not_flagged(backbone):
    """The finiteness flag looks at the rows read only; it is raised once, by ``check_finite``."""
