"""Model families: detection from config.json, the family deciding attention / mask / shift / EOS, and
local stand-ins of the remote-code families (LLaDA, Dream) whose own code loads only with trust_remote_code
(their native loading, the default, is tested in test_native.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import kept_rows, make_char_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from refusion.core.config import build_decoder
from refusion.models.backend import Backbone, MaskTokenError
from refusion.models.build import build_model
from refusion.models.checkpoint import load_model
from refusion.models.families import (
    FAMILIES, DreamAdapter, FamilyError, LladaAdapter, detect_family, get_family,
)
from refusion.models.loading import save_pretrained

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)

# ------------------------------------------------------------------------------ local stand-ins
# Tiny local copies of the two remote-code families, subclassing Qwen3 but with the *real* models'
# calling conventions: LLaDA's forward has no position_ids (positions 0..T-1) and takes an additive
# attention_bias; Dream registers only AutoModel and passes a tensor mask straight to attention.
STANDINS = {
    "llada": {
        "configuration_llada.py": '''
            from transformers import Qwen3Config

            class LLaDAConfig(Qwen3Config):
                model_type = "llada"
        ''',
        "modeling_llada.py": '''
            import torch
            from transformers import Qwen3ForCausalLM
            from .configuration_llada import LLaDAConfig

            class LLaDAModelLM(Qwen3ForCausalLM):
                config_class = LLaDAConfig

                def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, attention_bias=None,
                            past_key_values=None, labels=None, use_cache=None, output_attentions=None,
                            output_hidden_states=None, return_dict=None):
                    T = input_ids.shape[1]
                    bias = torch.zeros(1, 1, T, T, dtype=self.dtype, device=input_ids.device)
                    if attention_bias is not None:
                        bias = attention_bias.to(self.dtype)
                    pos = torch.arange(T, device=input_ids.device)[None]
                    return super().forward(input_ids=input_ids, position_ids=pos, attention_mask=bias, use_cache=False)
        ''',
        "config": {"model_type": "llada", "architectures": ["LLaDAModelLM"], "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}},
    },
    "dream": {
        "configuration_dream.py": '''
            from transformers import Qwen3Config

            class DreamConfig(Qwen3Config):
                model_type = "Dream"
        ''',
        "modeling_dream.py": '''
            import torch
            from transformers import Qwen3ForCausalLM
            from .configuration_dream import DreamConfig

            class DreamModel(Qwen3ForCausalLM):
                config_class = DreamConfig

                def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                            inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                            output_hidden_states=None, return_dict=None, **loss_kwargs):
                    assert attention_mask is None or attention_mask.dim() == 4, "Dream passes masks to SDPA as is"
                    T = input_ids.shape[1]
                    if attention_mask is None:
                        attention_mask = torch.zeros(1, 1, T, T, dtype=self.dtype, device=input_ids.device)
                    return super().forward(input_ids=input_ids, position_ids=position_ids,
                                           attention_mask=attention_mask, use_cache=False)
        ''',
        "config": {"model_type": "Dream", "architectures": ["DreamModel"], "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}},
    },
}


def write_standin(kind: str, folder: Path) -> Path:
    """A tiny randomly initialised stand-in of a remote-code family in ``folder`` (weights, tokenizer,
    config.json with auto_map, modeling code)."""
    tok = make_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), eos_token_id=0, pad_token_id=1, bos_token_id=2, **SMALL))
    save_pretrained(model, tok, folder, dtype=torch.float32)
    spec = STANDINS[kind]
    for name, code in spec.items():
        if name.endswith(".py"):
            (folder / name).write_text(textwrap.dedent(code))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(spec["config"], mask_token_id=tok.mask_token_id)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def force_shifted(model, position: int, token: int, boost: float = 1e4):
    """Dream semantics on any model: the logits at position p predict p+1, also at [MASK] inputs."""

    def hook(module, args, kwargs, output):
        target = kept_rows(kwargs["position_ids"] + 1, kwargs.get("logits_to_keep", 0), output.logits.shape[1])
        output.logits[..., token] += boost * (target == position).to(output.logits.dtype)
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


# ------------------------------------------------------------------------------------- registry
def test_registry_holds_the_reference_facts():
    assert FAMILIES["refusion"].mask_id == 151670 and FAMILIES["refusion"].attention == "causal"
    assert FAMILIES["llada"].mask_id == 126336 and FAMILIES["llada"].attention == "bidirectional"
    assert {126081, 126348} <= set(FAMILIES["llada"].eos_ids)
    assert FAMILIES["dream"].logits_shifted and not FAMILIES["llada"].logits_shifted
    assert FAMILIES["llada"].remote_code and FAMILIES["dream"].remote_code and not FAMILIES["refusion"].remote_code
    assert (FAMILIES["llada"].native, FAMILIES["dream"].native) == ("llama", "qwen2")
    assert not any(f.native for n, f in FAMILIES.items() if n not in ("llada", "dream"))
    assert FAMILIES["qwen3"].decoders == ("ar", "speculative") and not FAMILIES["qwen3"].mask_required
    assert {n: f.attention for n, f in FAMILIES.items() if n.startswith("tiny")} == {
        "tiny-causal": "causal", "tiny-mdm": "bidirectional", "tiny-block": "block_causal"}
    with pytest.raises(FamilyError, match="known: refusion, qwen3"):
        get_family("gpt2")


@pytest.mark.parametrize("config, name", [
    ({"model_type": "qwen3", "refusion_attention": "bidirectional"}, "tiny-mdm"),
    ({"model_type": "qwen3", "refusion_attention": "block_causal"}, "tiny-block"),
    ({"model_type": "qwen3", "refusion_attention": "causal", "mask_token_id": 3}, "tiny-causal"),
    ({"model_type": "llada", "architectures": ["LLaDAModelLM"]}, "llada"),
    ({"model_type": "Dream", "architectures": ["DreamModel"]}, "dream"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "refusion_family": "llada"}, "llada"),  # native
    ({"model_type": "qwen2", "refusion_family": "dream"}, "dream"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "mask_token_id": 151670}, "refusion"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "qwen3"),
])
def test_detection_from_config(config, name):
    assert detect_family(config).name == name


def test_undetectable_config_names_the_override():
    with pytest.raises(FamilyError, match="--family"):
        detect_family({"model_type": "gpt2"})


# --------------------------------------------------------------------------------- tiny families
@pytest.mark.parametrize("attention, served, refused", [
    ("causal", "refusion", "llada"), ("bidirectional", "llada", "ar"), ("block_causal", "block", "refusion"),
])
def test_tiny_families_decide_the_backbone(tmp_path, attention, served, refused):
    tok = make_char_tokenizer()
    model = build_model(tok, size="micro", attention=attention, block_size=4 if attention == "block_causal" else None)
    save_pretrained(model, tok, tmp_path / "m")
    bb = Backbone.from_pretrained(tmp_path / "m")
    family = get_family(bb.family)
    assert family.attention == bb.attention == attention and bb.mask_id == tok.mask_token_id
    assert served in family.decoders and refused not in family.decoders
    cfg = {"decoder": served, "gen_length": 8}
    assert len(build_decoder(bb, cfg).generate([5, 6, 7]).token_ids) <= 8
    with pytest.raises(ValueError, match="needs a model with"):
        build_decoder(bb, {"decoder": refused})
    with pytest.raises(FamilyError, match="this family serves"):
        family.check_decoder(refused)


@pytest.mark.parametrize("shift", [False, True])
def test_a_shifted_mdm_objective_gives_a_shifted_backbone(tmp_path, shift):
    from refusion.models.build import record_objective
    from refusion.plugins.objectives import MdmObjective

    tok = make_char_tokenizer()
    model = build_model(tok, size="micro", attention="causal")  # adapted from an autoregressive model
    record_objective(model.config, MdmObjective.from_tokenizer(tok, {"shift": shift}))
    save_pretrained(model, tok, tmp_path / "m")
    bb = Backbone.from_pretrained(tmp_path / "m")
    assert bb.family == "tiny-mdm" and bb.attention == "bidirectional" and bb.logits_shifted is shift


def test_plain_qwen3_is_autoregressive_only_and_family_override_gives_refusion_ids(tmp_path):
    tok = make_char_tokenizer(with_mask=False)
    torch.manual_seed(0)
    vocab = 151680  # room for the real <|beginoftext|> 151669 and <|mask|> 151670
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, eos_token_id=0, pad_token_id=1, bos_token_id=2,
                                         **{**SMALL, "hidden_size": 16, "head_dim": 8, "intermediate_size": 32}))
    save_pretrained(model, tok, tmp_path / "q")
    bb = Backbone.from_pretrained(tmp_path / "q")
    assert bb.family == "qwen3" and bb.attention == "causal" and {0, 151643, 151645} <= bb.eos_ids
    assert len(build_decoder(bb, {"decoder": "ar", "gen_length": 3}).generate([5, 6]).token_ids) <= 3
    dec = build_decoder(bb, {"decoder": "refusion", "gen_length": 8, "slot_size": 4})
    nfe = bb.nfe
    with pytest.raises(MaskTokenError, match="only autoregressive"):
        dec.generate([5, 6])
    assert bb.nfe == nfe  # refused before any forward
    with pytest.raises(FamilyError, match="this family serves: ar"):
        get_family(bb.family).check_decoder("refusion")
    ref = Backbone.from_pretrained(tmp_path / "q", family="refusion")
    assert ref.family == "refusion" and ref.mask_id == 151670 and ref.attention == "causal"
    out = build_decoder(ref, {"decoder": "refusion", "gen_length": 8, "slot_size": 4}).generate([5, 6])
    assert 151670 not in out.token_ids and 0 < len(out.token_ids) <= 8


# ------------------------------------------------------------------------- remote-code stand-ins
@pytest.mark.parametrize("kind, adapter", [("llada", LladaAdapter), ("dream", DreamAdapter)])
def test_remote_code_family_loads_only_when_trusted(tmp_path, kind, adapter):
    folder = write_standin(kind, tmp_path / kind)
    with pytest.raises(FamilyError, match=r"published format only; .*pass --trust-remote-code"):
        Backbone.from_pretrained(folder)  # native by default: a stand-in is not in the published format
    with pytest.raises(FamilyError, match=r"modeling_.*only loaded with --trust-remote-code"):
        load_model(folder, get_family(kind), native=False)
    bb = Backbone.from_pretrained(folder, trust_remote_code=True)
    assert isinstance(bb.model, adapter) and bb.family == kind and bb.attention == "bidirectional"
    assert bb.mask_id == 3 and bb.logits_shifted == (kind == "dream")
    out = build_decoder(bb, {"decoder": "llada", "gen_length": 8, "block_length": 4}).generate([5, 6, 7])
    assert 0 < len(out.token_ids) <= 8 and out.stats.nfe >= 1
    with pytest.raises(ValueError, match="needs a model with causal attention"):
        build_decoder(bb, {"decoder": "ar"})
    with pytest.raises(FamilyError, match="kv_cache: none"):
        build_decoder(bb, {"decoder": "llada", "gen_length": 8, "kv_cache": "prefix"}).generate([5, 6])


def test_dream_standin_logits_are_shifted_by_the_llada_decoder(tmp_path):
    bb = Backbone.from_pretrained(write_standin("dream", tmp_path / "d"), trust_remote_code=True)
    P, target, token = 3, 5, 20  # generation positions 3..10; force token 20 at position 5
    h = force_shifted(bb.model, target, token)
    out = build_decoder(bb, {"decoder": "llada", "gen_length": 8, "steps": 8, "early_stop": False}).generate([5, 6, 7])
    assert out.token_ids[target - P] == token
    bb.logits_shifted = False  # a decoder ignoring the shift puts it one position early
    out = build_decoder(bb, {"decoder": "llada", "gen_length": 8, "steps": 8, "early_stop": False}).generate([5, 6, 7])
    assert out.token_ids[target - P - 1] == token and out.token_ids[target - P] != token
    h.remove()


@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_shifted_logits_with_a_cache_use_the_refresh_prediction_at_the_window_start(char_tokenizer, kv_cache):
    model = build_model(char_tokenizer, size="micro", attention="bidirectional")
    bb = Backbone(model, char_tokenizer, attention="bidirectional", logits_shifted=True)
    P = 3
    for target in (P + 4, P + 6):  # the first position of block 2 (window start) and one inside it
        h = force_shifted(model, target, 20)
        cfg = {"decoder": "llada", "gen_length": 8, "block_length": 4, "steps": 8, "kv_cache": kv_cache, "early_stop": False}
        out = build_decoder(bb, cfg).generate([5, 6, 7])
        h.remove()
        assert out.token_ids[target - P] == 20, (target, out.token_ids)


def test_add_refusion_tokens_turns_a_plain_qwen3_into_the_refusion_family(tmp_path):
    from refusion.models.families import add_refusion_tokens

    tok = make_char_tokenizer(with_mask=False)
    n = len(tok)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=n, eos_token_id=0, pad_token_id=1, bos_token_id=2, **SMALL))
    # this tokenizer already has <|beginoftext|> (id 2); on Qwen3's the two new ids are 151669, 151670
    assert add_refusion_tokens(model, tok) == (2, n)
    save_pretrained(model, tok, tmp_path / "r")
    bb = Backbone.from_pretrained(tmp_path / "r")
    assert bb.family == "refusion" and bb.mask_id == n and bb.model.config.vocab_size >= n + 1
