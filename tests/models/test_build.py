"""Fresh model presets: sizes, config keys, save/load round trip."""

from __future__ import annotations

import pytest
import torch

from refusion.models.build import SIZES, build_model, count_parameters, make_config, set_attention
from refusion.models.loading import load_pretrained, save_pretrained


def _vocab_1k_tokenizer(char_tokenizer):
    """The char tokenizer padded with filler tokens to a vocabulary of 1000 (like the tinybench BPE)."""
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.add_tokens([f"<f{i}>" for i in range(1000 - len(tok))])
    return tok


def test_presets_parameter_counts(char_tokenizer):
    tok = _vocab_1k_tokenizer(char_tokenizer)
    assert len(tok) == 1000
    micro = count_parameters(build_model(tok, "micro"))
    tiny = count_parameters(build_model(tok, "tiny"))
    assert 0.1e6 < micro < 0.3e6
    assert 3.0e6 < tiny < 3.6e6  # hidden 256 x 4 layers, ffn 768, tied 1k embeddings
    with pytest.raises(ValueError):
        make_config(tok, "huge")
    assert set(SIZES) >= {"micro", "tiny"}


def test_config_keys(char_tokenizer):
    cfg = make_config(char_tokenizer, "micro", max_position_embeddings=640)
    assert cfg.vocab_size == len(char_tokenizer)
    assert cfg.mask_token_id == char_tokenizer.mask_token_id == 3
    assert cfg.eos_token_id == 0 and cfg.pad_token_id == 1 and cfg.bos_token_id == 2
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 640
    assert cfg.refusion_attention == "causal" and cfg.refusion_block_size is None
    cfg = make_config(char_tokenizer, "micro", attention="block_causal", block_size=8)
    assert cfg.refusion_attention == "block_causal" and cfg.refusion_block_size == 8
    with pytest.raises(ValueError):
        set_attention(cfg, "block_causal")  # needs a block size
    with pytest.raises(ValueError):
        set_attention(cfg, "sideways")


def test_needs_mask_token():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "a": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>")),
                                  eos_token="<|endoftext|>", pad_token="<|pad|>")
    with pytest.raises(ValueError, match="mask"):
        make_config(tok, "micro")


def test_save_load_round_trip(char_tokenizer, tmp_path):
    model = build_model(char_tokenizer, "micro", attention="bidirectional")
    model.config.refusion_objective = "mdm"
    save_pretrained(model, char_tokenizer, tmp_path / "m")
    loaded, tok = load_pretrained(tmp_path / "m")
    assert loaded.config.refusion_attention == "bidirectional"
    assert loaded.config.mask_token_id == 3 and loaded.config.refusion_objective == "mdm"
    assert tok.mask_token_id == 3 and len(tok) == len(char_tokenizer)
    want = {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:  # weights are stored in bf16 and come back as exactly those values
        assert torch.equal(want[k], got[k]), k
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.isfinite(loaded(input_ids=ids).logits).all()
    assert loaded.get_input_embeddings().weight.data_ptr() == loaded.get_output_embeddings().weight.data_ptr()


def test_deepen_computes_what_the_model_computed_and_its_new_layers_train(char_tokenizer, tmp_path):
    """Two micro layers grown to five (copies spread 2 + 1): identical logits with and without a KV cache,
    the cache indices renumbered, gradients reach the zeroed writers, and the depth survives a save."""
    from transformers import DynamicCache

    from refusion.models.build import deepen

    model = build_model(char_tokenizer, "micro", seed=3)
    ids = torch.randint(4, len(char_tokenizer), (2, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    deepen(model, 5)
    assert model.config.num_hidden_layers == 5 and len(model.model.layers) == 5
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3, 4]
    assert len(model.config.layer_types) == 5
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :8], cache=cache)
        step = model(input_ids=ids[:, 8:], cache=cache).logits
    assert len(cache.layers) == 5
    torch.testing.assert_close(step, before[:, 8:], rtol=1e-4, atol=1e-5)
    model(input_ids=ids, labels=ids).loss.backward()
    for new in (1, 2, 4):  # the copies: the originals sit at 0 and 3
        assert model.model.layers[new].mlp.down_proj.weight.grad.abs().sum() > 0
    save_pretrained(model, char_tokenizer, tmp_path / "deep")
    assert load_pretrained(tmp_path / "deep")[0].config.num_hidden_layers == 5
    with pytest.raises(ValueError, match="must exceed the model's 5 layers"):
        deepen(model, 5)
    with pytest.raises(ValueError, match="Linear is not a Qwen3-style decoder"):
        deepen(torch.nn.Linear(2, 2), 3)
