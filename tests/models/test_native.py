"""Native LLaDA / Dream backbones (``refusion.models.native``) on tiny random checkpoints written in the
published formats (config.json keys and tensor names as GSAI-ML/LLaDA-8B-Instruct and
Dream-org/Dream-v0-Instruct-7B publish them, plus their modeling / tokenizer files, which the native
path never runs):

(a) logits equal the published modeling code's (tests/models/fixtures/remote_code, run under
    transformers 5 with the shims its README lists) and an independent float64 forward written here from
    the published equations (RMSNorm, rotary, GQA, gated MLP), to 1e-4 in float32 with a bidirectional
    all-zero 4D mask; Dream's shifted logits reach the llada decoder shifted;
(b) the llada decoder's prefix / dual caches run on them and decode as without a cache where Fast-dLLM
    is exact (a refresh every step; each block's first step), feeding fewer tokens otherwise;
(c) bfloat16 loads (the storage dtype by default) and decodes;
(d) ``generate_batch`` on three ragged prompts decodes each as alone.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import ban_token, make_char_tokenizer, make_tiny_qwen3
from safetensors.torch import save_file

from refusion.core.config import build_decoder
from refusion.models import native
from refusion.models.backend import Backbone
from refusion.models.checkpoint import load_model
from refusion.models.families import FamilyError, family_of_model, get_family, uses_native
from refusion.models.loading import save_pretrained, save_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "remote_code"
ATOL = 1e-4

pytestmark = [  # what the published 4.x configuration code triggers in transformers 5 (the fixture, not the package)
    pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`rope_config_validation` is deprecated:FutureWarning"),
]


# --------------------------------------------------------------------------- published formats
def llada_config(**over) -> dict:
    """LLaDA-8B-Instruct's config.json keys (OLMo format), tiny sizes."""
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64,
        "embedding_dropout": 0.0, "embedding_size": 64, "eos_token_id": 0, "flash_attention": False,
        "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": 3, "max_sequence_length": 256, "mlp_hidden_size": 96,
        "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4,
        "n_layers": 2, "pad_token_id": 1, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
        "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 64, "weight_tying": False,
    }
    cfg.update(over)
    return cfg


def dream_config(**over) -> dict:
    """Dream-v0-Instruct-7B's config.json keys (Qwen2 format), tiny sizes."""
    cfg = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 260, "eos_token_id": 260, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "mask_token_id": 264, "max_position_embeddings": 256, "max_window_layers": 2,
        "model_type": "Dream", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pad_token_id": 260, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2", "use_cache": True, "use_sliding_window": False, "vocab_size": 272,
    }
    cfg.update(over)
    return cfg


def _kv_heads_llada(c: dict) -> int:
    return c["n_kv_heads"] if c.get("multi_query_attention") is None else (1 if c["multi_query_attention"] else c["n_heads"])


def llada_tensors(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under LLaDA's published tensor names (``model.transformer...``)."""
    g = torch.Generator().manual_seed(seed)
    d, hd = c["d_model"], c["d_model"] // c["n_heads"]
    kv, ffn, vocab = _kv_heads_llada(c) * hd, c["mlp_hidden_size"] or c["mlp_ratio"] * c["d_model"], c["embedding_size"]

    def w(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    def norm(n):
        return 0.5 + torch.rand(n, generator=g)

    t = {"model.transformer.wte.weight": w(vocab, d, std=1.0), "model.transformer.ln_f.weight": norm(d)}
    if not c["weight_tying"]:
        t["model.transformer.ff_out.weight"] = w(vocab, d)
    for i in range(c["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        t.update({p + "attn_norm.weight": norm(d), p + "ff_norm.weight": norm(d), p + "q_proj.weight": w(d, d),
                  p + "k_proj.weight": w(kv, d), p + "v_proj.weight": w(kv, d), p + "attn_out.weight": w(d, d),
                  p + "ff_proj.weight": w(ffn, d), p + "up_proj.weight": w(ffn, d), p + "ff_out.weight": w(d, ffn)})
    return t


def dream_tensors(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Dream's published tensor names (Qwen2's, with q/k/v biases)."""
    g = torch.Generator().manual_seed(seed)
    d, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv, ffn, vocab = c["num_key_value_heads"] * hd, c["intermediate_size"], c["vocab_size"]

    def w(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    def norm(n):
        return 0.5 + torch.rand(n, generator=g)

    t = {"model.embed_tokens.weight": w(vocab, d, std=1.0), "model.norm.weight": norm(d)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = w(vocab, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "self_attn.q_proj.weight": w(d, d), p + "self_attn.q_proj.bias": w(d, std=0.1),
                  p + "self_attn.k_proj.weight": w(kv, d), p + "self_attn.k_proj.bias": w(kv, std=0.1),
                  p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.v_proj.bias": w(kv, std=0.1),
                  p + "self_attn.o_proj.weight": w(d, d), p + "mlp.gate_proj.weight": w(ffn, d),
                  p + "mlp.up_proj.weight": w(ffn, d), p + "mlp.down_proj.weight": w(d, ffn)})
    return t


DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]  # ids 260..264


def byte_alphabet() -> list[str]:
    """The 256 characters byte-level BPE (GPT-2, Qwen2, Dream) maps bytes to."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    extra = [256 + i for i in range(256 - len(keep))]
    return [chr(c) for c in keep + extra]


def write_dream_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer in Dream's published files: vocab.json + merges.txt and a
    tokenizer_config.json naming its own ``DreamTokenizer`` (auto_map) with ``<|mask|>``."""
    vocab = {c: i for i, c in enumerate(sorted(byte_alphabet()))}
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("Ġ", "a")]
    vocab.update({a + b: len(vocab) + j for j, (a, b) in enumerate(merges)})  # 256..259; then the added tokens
    n = len(vocab)
    added = {str(n + i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for i, tok in enumerate(DREAM_SPECIALS)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
        "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "DreamTokenizer", "unk_token": None,
    }))


def write_checkpoint(folder: Path, family: str, cfg: dict, tensors: dict, dtype=torch.float32,
                     shards: int = 1) -> Path:
    """A checkpoint folder as published: config.json, safetensors (``shards`` > 1: with an index), the
    tokenizer files and the family's own modeling code (which the native path must never run)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        names, weight_map = sorted(tensors), {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[s::shards]}
            save_file(part, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    gen = {"_from_model_config": True, "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg["eos_token_id"],
           "pad_token_id": cfg["pad_token_id"], "transformers_version": cfg["transformers_version"]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    code = FIXTURES / f"{family}_remote"
    for f in code.glob("*.py"):
        shutil.copy(f, folder / f.name)
    if family == "llada":
        save_tokenizer(make_char_tokenizer(), folder)
    else:
        write_dream_tokenizer(folder)
    return folder


def checkpoint(tmp_path: Path, family: str, dtype=torch.float32, seed: int = 0, **over) -> Path:
    cfg = llada_config(**over) if family == "llada" else dream_config(**over)
    tensors = llada_tensors(cfg, seed) if family == "llada" else dream_tensors(cfg, seed)
    return write_checkpoint(tmp_path / family, family, cfg, tensors, dtype)


# ------------------------------------------------------------------- independent reference forward
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotary(x, theta):  # x [B, H, T, D]: positions 0..T-1, halves rotated (LLaDA's / Qwen2's convention)
    D, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    return x * cos + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin


def reference_logits(family: str, c: dict, t: dict, ids: torch.Tensor) -> torch.Tensor:
    """Float64 logits from the published equations: pre-norm blocks, RMSNorm, rotary, grouped-query
    attention over every position (no mask), ``down(act(gate x) * up x)`` (LLaDA's ``activation_type``,
    Dream's SiLU)."""
    t = {k: v.double() for k, v in t.items()}
    if family == "llada":
        d, H, KV, L = c["d_model"], c["n_heads"], _kv_heads_llada(c), c["n_layers"]
        eps, theta, pre = c["rms_norm_eps"], c["rope_theta"], "model.transformer."
        names = dict(emb=pre + "wte.weight", norm=pre + "ln_f.weight",
                     head=pre + ("wte.weight" if c["weight_tying"] else "ff_out.weight"))
        blk = {"an": "attn_norm", "fn": "ff_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
               "g": "ff_proj", "u": "up_proj", "dn": "ff_out"}
        layer = lambda i, r: f"{pre}blocks.{i}.{blk[r]}"  # noqa: E731
    else:
        d, H, KV, L = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
        eps, theta = c["rms_norm_eps"], c["rope_theta"]
        names = dict(emb="model.embed_tokens.weight", norm="model.norm.weight",
                     head="model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight")
        blk = {"an": "input_layernorm", "fn": "post_attention_layernorm", "q": "self_attn.q_proj",
               "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "g": "mlp.gate_proj",
               "u": "mlp.up_proj", "dn": "mlp.down_proj"}
        layer = lambda i, r: f"model.layers.{i}.{blk[r]}"  # noqa: E731

    def lin(x, name):
        return x @ t[name + ".weight"].T + t.get(name + ".bias", 0)

    act = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[c.get("activation_type", "silu")]
    B, T = ids.shape
    hd = d // H
    x = t[names["emb"]][ids]
    for i in range(L):
        h = _rms(x, t[layer(i, "an") + ".weight"], eps)
        q = lin(h, layer(i, "q")).view(B, T, H, hd).transpose(1, 2)
        k = lin(h, layer(i, "k")).view(B, T, KV, hd).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        v = lin(h, layer(i, "v")).view(B, T, KV, hd).transpose(1, 2).repeat_interleave(H // KV, dim=1)
        q, k = _rotary(q, theta), _rotary(k, theta)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, -1) @ v
        x = x + lin(att.transpose(1, 2).reshape(B, T, d), layer(i, "o"))
        h = _rms(x, t[layer(i, "fn") + ".weight"], eps)
        x = x + lin(act(lin(h, layer(i, "g"))) * lin(h, layer(i, "u")), layer(i, "dn"))
    return _rms(x, t[names["norm"]], eps) @ t[names["head"]].T


# ------------------------------------------------------------------------- the published code
@pytest.fixture
def published(monkeypatch):
    """``published(family, cfg, tensors)`` -> the published modeling code's model (float32, eval) with
    ``tensors`` loaded strictly, and a forward ``f(ids) -> logits`` without a mask (full attention). The
    transformers-5 shims the fixture README lists are applied for the test only (Dream's rope init only
    while its model is built)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def default_rope(config, device=None, seq_len=None, **kwargs):  # transformers 4.x "default" rope init
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        base = config.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim)), 1.0

    monkeypatch.setattr(TOKENIZER_MAPPING, "_extra_content", dict(TOKENIZER_MAPPING._extra_content))
    monkeypatch.syspath_prepend(str(FIXTURES))

    def build(family: str, cfg: dict, tensors: dict):
        try:
            if family == "llada":
                conf_mod = importlib.import_module("llada_remote.configuration_llada")
                mod = importlib.import_module("llada_remote.modeling_llada")
                config = conf_mod.LLaDAConfig(**cfg)
                inner_cfg = mod.create_model_config_from_pretrained_config(config)
                inner_cfg.init_device = "cpu"  # this copy builds its inner model on "cuda"
                model = mod.LLaDAModelLM(config, model=mod.LLaDAModel(inner_cfg, init_params=False))
            else:
                conf_mod = importlib.import_module("dream_remote.configuration_dream")
                mod = importlib.import_module("dream_remote.modeling_dream")
                ROPE_INIT_FUNCTIONS["default"] = default_rope  # only while the model is built (its rotary init)
                if isinstance(mod.DreamModel._tied_weights_keys, list):  # 4.x list; 5.x maps target -> source
                    monkeypatch.setattr(mod.DreamModel, "_tied_weights_keys", {"lm_head.weight": "model.embed_tokens.weight"})
                try:
                    model = mod.DreamModel(conf_mod.DreamConfig(**cfg))
                finally:
                    del ROPE_INIT_FUNCTIONS["default"]
        except Exception as e:  # pragma: no cover - a future transformers breaking the 4.x code
            pytest.skip(f"the published {family} modeling code does not run under this transformers: {e!r}")
        tied = cfg.get("tie_word_embeddings", False) if family == "dream" else False
        missing, unexpected = model.load_state_dict(tensors, strict=not tied)  # the published names and shapes
        if tied:  # a tied head is not stored: the published model ties it to the embedding
            assert unexpected == [] and set(missing) <= {"lm_head.weight"}
            model.lm_head.weight = model.model.embed_tokens.weight
        model = model.float().eval()

        def forward(ids):
            with torch.no_grad():
                return model(input_ids=ids, use_cache=False, return_dict=True).logits

        return model, forward

    yield build


def native_logits(model, ids):
    B, T = ids.shape
    with torch.no_grad():
        return model(input_ids=ids, position_ids=torch.arange(T).expand(B, T),
                     attention_mask=torch.zeros(B, 1, T, T, dtype=model.dtype)).logits


# ---------------------------------------------------------------------------------- (a) logits
LLADA_VARIANTS = {
    "mha": {},
    "gqa": {"n_kv_heads": 2},
    "tied, mlp_ratio": {"weight_tying": True, "mlp_hidden_size": None, "mlp_ratio": 2},
    "multi-query": {"multi_query_attention": True, "n_kv_heads": None},
    "gelu": {"activation_type": "gelu"},
    "relu": {"activation_type": "relu"},
}
DREAM_VARIANTS = {"gqa": {}, "tied": {"tie_word_embeddings": True}, "mha": {"num_key_value_heads": 4}}


@pytest.mark.parametrize("family, over", [("llada", v) for v in LLADA_VARIANTS.values()]
                         + [("dream", v) for v in DREAM_VARIANTS.values()],
                         ids=[f"llada-{k}" for k in LLADA_VARIANTS] + [f"dream-{k}" for k in DREAM_VARIANTS])
def test_logits_equal_the_published_code_and_the_equations(tmp_path, published, family, over):
    folder = checkpoint(tmp_path, family, **over)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = llada_tensors(cfg) if family == "llada" else dream_tensors(cfg)
    before = {m for m in sys.modules if m.startswith("transformers_modules")}
    model = native.load_native_model(folder)
    assert {m for m in sys.modules if m.startswith("transformers_modules")} == before  # no remote code ran
    assert type(model).__name__ == ("LlamaForCausalLM" if family == "llada" else "Qwen2ForCausalLM")
    assert model.dtype == torch.float32 and not model.training
    ids = torch.randint(0, cfg["vocab_size"] if family == "dream" else 52, (2, 13), generator=torch.Generator().manual_seed(1))
    out = native_logits(model, ids)
    _, ref_forward = published(family, cfg, tensors)
    ref = ref_forward(ids)
    assert out.shape == ref.shape and ref.abs().max() > 1.0  # logits far from zero: the comparison means something
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.double(), reference_logits(family, cfg, tensors, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_attention_is_bidirectional_with_or_without_a_mask(tmp_path, family):
    """The 4D mask is used as given (no causal mask added, sdpa's is_causal off); without one, or with a
    2D all-ones mask, the model still attends everywhere; eager attention agrees with sdpa."""
    folder = checkpoint(tmp_path, family)
    model = native.load_native_model(folder)
    eager = native.load_native_model(folder, attn_implementation="eager")
    assert model.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    assert all(not m.is_causal for m in model.modules() if hasattr(m, "is_causal"))
    ids = torch.randint(4, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    full = native_logits(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, full, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, full, atol=ATOL, rtol=0)
        causal = torch.full((9, 9), torch.finfo(torch.float32).min).triu(1)[None, None].expand(2, 1, 9, 9)
        assert (model(input_ids=ids, attention_mask=causal).logits[:, :-1] - full[:, :-1]).abs().max() > 1e-2
    torch.testing.assert_close(native_logits(eager, ids), full, atol=ATOL, rtol=0)
    # transformers itself uses a 4D mask as given: causal-configured modules change nothing with one
    for m in [model, *model.modules()]:
        if hasattr(m, "is_causal"):
            m.is_causal = True
    model.config.is_causal = True
    torch.testing.assert_close(native_logits(model, ids), full, atol=0, rtol=0)


def test_dream_logits_reach_the_llada_decoder_shifted(tmp_path, published):
    """Dream's logits at position i predict token i+1 (also at a [MASK] input): the decoder scores a masked
    position p with the published model's row p-1."""
    folder = checkpoint(tmp_path, "dream")
    cfg = json.loads((folder / "config.json").read_text())
    _, ref_forward = published("dream", cfg, dream_tensors(cfg))
    bb = Backbone.from_pretrained(folder)
    assert bb.logits_shifted and bb.family == "dream" and bb.mask_id == 264
    prompt = [40, 41, 42, 43]
    res = build_decoder(bb, {"decoder": "llada", "gen_length": 8, "steps": 8, "early_stop": False}).generate(prompt)
    P = len(prompt)
    logits = ref_forward(torch.tensor([prompt + [bb.mask_id] * 8]))[0]
    logits[:, bb.mask_id] = torch.finfo(logits.dtype).min  # as the backbone does: [MASK] is never a token
    probs = torch.softmax(logits.double(), -1)
    first = res.trace[0]
    assert [p for p, _ in first.scored] == list(range(P, P + 8))
    expected = [probs[p - 1].max().item() for p in range(P, P + 8)]  # row p-1 predicts position p
    assert [s for _, s in first.scored] == pytest.approx(expected, abs=1e-4)
    (pos,) = first.chosen
    assert res.token_ids[pos - P] == int(probs[pos - 1].argmax())
    unshifted = [probs[p].max().item() for p in range(P, P + 8)]
    assert [s for _, s in first.scored] != pytest.approx(unshifted, abs=1e-4)


def test_dream_tokenizer_loads_without_its_code_and_matches_it(tmp_path, published):
    folder = checkpoint(tmp_path, "dream")
    tok = native.load_native_tokenizer(folder)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    remote = importlib.import_module("dream_remote.tokenization_dream").DreamTokenizer.from_pretrained(folder)
    text = "the then <|mask|><|mask|> théâtre 12, a b <|im_start|>x<|im_end|><|endoftext|>"
    assert tok(text)["input_ids"] == remote(text)["input_ids"]
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (remote.mask_token_id, remote.eos_token_id,
                                                                     remote.pad_token_id) == (264, 260, 260)
    ids = tok("the theatre")["input_ids"]
    assert tok.decode(ids) == remote.decode(ids) == "the theatre"


# ------------------------------------------------------------------------------ loading / family
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_backbone_loads_natively_by_default(tmp_path, family):
    folder = checkpoint(tmp_path, family)
    bb = Backbone.from_pretrained(folder)
    fam = get_family(family)
    assert bb.family == family and bb.attention == "bidirectional" and bb.logits_shifted == fam.logits_shifted
    assert type(bb.model).__name__ == ("LlamaForCausalLM" if family == "llada" else "Qwen2ForCausalLM")
    assert bb.mask_id == (3 if family == "llada" else 264) and bb.eos_id == (0 if family == "llada" else 260)
    assert family_of_model(bb.model).name == family
    assert uses_native(fam) and not uses_native(fam, trust_remote_code=True) and uses_native(fam, True, native=True)
    with pytest.raises(FamilyError, match="no native mapping"):
        uses_native(get_family("tiny-mdm"), native=True)
    with pytest.raises(ValueError, match="needs a model with causal attention"):
        build_decoder(bb, {"decoder": "ar"})


@pytest.mark.parametrize("family, over, match", [
    ("llada", {"block_type": "sequential"}, "block_type = 'sequential'"),
    ("llada", {"include_bias": True}, "include_bias = True"),
    ("llada", {"input_emb_norm": True}, "input_emb_norm"),
    ("llada", {"activation_type": "swiglu"}, "activation_type = 'swiglu'"),
    ("dream", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_options_the_native_model_cannot_reproduce_are_refused(tmp_path, family, over, match):
    folder = checkpoint(tmp_path, family, **over)
    with pytest.raises(native.NativeFormatError, match=match) as e:
        Backbone.from_pretrained(folder)
    assert "--trust-remote-code" in str(e.value)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tensors_not_in_the_published_format_are_refused_before_loading(tmp_path, family):
    cfg = llada_config() if family == "llada" else dream_config()
    tensors = llada_tensors(cfg) if family == "llada" else dream_tensors(cfg)
    name = next(k for k in tensors if ".1." in k and "proj" in k)
    tensors[name.replace("proj", "projection")] = tensors.pop(name)
    folder = write_checkpoint(tmp_path / "renamed", family, cfg, tensors)
    with pytest.raises(native.NativeFormatError, match=r"missing .*; unexpected"):
        native.load_native_model(folder)
    cfg = {**cfg, ("n_kv_heads" if family == "llada" else "num_key_value_heads"): 1}
    folder = write_checkpoint(tmp_path / "shapes", family, cfg, llada_tensors(cfg | {"n_kv_heads": 4})
                              if family == "llada" else dream_tensors(cfg | {"num_key_value_heads": 2}))
    with pytest.raises(native.NativeFormatError, match="shapes differ from config.json"):
        native.load_native_model(folder)


def test_a_checkpoint_of_another_architecture_names_the_remote_code_option(tmp_path):
    """A folder claiming model_type llada but holding Qwen3 weights and config keys (this project's old
    stand-ins) is not LLaDA's published format."""
    tok = make_char_tokenizer()
    save_pretrained(make_tiny_qwen3(len(tok)), tok, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**cfg, "model_type": "llada", "architectures": ["LLaDAModelLM"]}))
    with pytest.raises(FamilyError, match=r"lacks d_model.*--trust-remote-code"):
        Backbone.from_pretrained(tmp_path / "q")


def test_flash_attention_is_refused_for_the_native_families(tmp_path):
    from refusion.models.loading import Runtime, RuntimeOptionError

    rt = Runtime(device="cuda", dtype="bfloat16", attn_implementation="flash_attention_2")  # as resolved on a GPU
    with pytest.raises(RuntimeOptionError, match="'llada' models attend bidirectional through 4D masks"):
        load_model(checkpoint(tmp_path, "llada"), get_family("llada"), runtime=rt)


# ------------------------------------------------------------------------------- (b) KV caches
def run(bb, prompt, **cfg):
    cfg = {"decoder": "llada", "gen_length": 16, "block_length": 8, **cfg}
    return build_decoder(bb, cfg).generate(prompt)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefix_and_dual_caches_decode_as_without_where_fast_dllm_is_exact(tmp_path, family):
    bb = Backbone.from_pretrained(checkpoint(tmp_path, family))
    h = ban_token(bb.model, bb.eos_id)  # decode all 16 positions
    prompt = [20, 21, 22, 23, 24]
    try:
        none = run(bb, prompt, steps=8)
        for kv in ("prefix", "dual"):
            # a refresh at every step: the cache holds exactly what a full forward would compute
            every = run(bb, prompt, steps=8, kv_cache=kv, refresh_every=1)
            assert every.token_ids == none.token_ids
            assert [t.chosen for t in every.trace] == [t.chosen for t in none.trace]
            for a, b in zip(every.trace, none.trace):
                assert [p for p, _ in a.scored] == [p for p, _ in b.scored]
                assert [s for _, s in a.scored] == pytest.approx([s for _, s in b.scored], abs=1e-5)
            # Fast-dLLM's cache (a refresh at each block start): the block start is exact, the other steps
            # feed only the window over the cached KV
            cached = run(bb, prompt, steps=8, kv_cache=kv)
            assert len(cached.token_ids) == 16 and bb.mask_id not in cached.token_ids
            starts = [i for i, t in enumerate(none.trace) if i == 0 or t.block != none.trace[i - 1].block]
            assert starts == [0, 4]
            assert [p for p, _ in cached.trace[0].scored] == [p for p, _ in none.trace[0].scored]
            assert [s for _, s in cached.trace[0].scored] == pytest.approx([s for _, s in none.trace[0].scored], abs=1e-5)
            N = len(prompt) + 16
            window = 16 if kv == "prefix" else 8  # block 0's window; prefix: block + every later [MASK]
            assert cached.stats.tokens_in == 2 * N + 3 * window + 3 * 8 < none.stats.tokens_in == 8 * N
    finally:
        h.remove()


# ------------------------------------------------------------------------------- (c) bfloat16
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bfloat16_loads_and_decodes(tmp_path, family):
    folder = write_checkpoint(tmp_path / "bf16", family, cfg := (llada_config() if family == "llada" else dream_config()),
                              (llada_tensors if family == "llada" else dream_tensors)(cfg), dtype=torch.bfloat16, shards=2)
    assert (folder / "model.safetensors.index.json").is_file()
    stored = native.load_native_model(folder)
    assert stored.dtype == torch.bfloat16  # the storage dtype by default
    as_f32 = native.load_native_model(folder, dtype=torch.float32)
    ids = torch.randint(4, 50, (2, 11), generator=torch.Generator().manual_seed(3))
    lo, hi = native_logits(stored, ids).float(), native_logits(as_f32, ids)
    assert torch.isfinite(lo).all() and (lo - hi).abs().max() < 0.05 * hi.abs().max()
    bb2 = Backbone.from_pretrained(folder, dtype="bfloat16")
    assert bb2.model.dtype == torch.bfloat16 and bb2.family == family
    for kv in ("none", "dual"):
        res = run(bb2, [20, 21, 22], kv_cache=kv, selector={"name": "confidence_threshold", "threshold": 0.3})
        assert 0 < len(res.token_ids) <= 16 and bb2.mask_id not in res.token_ids and res.stats.nfe >= 1


# ------------------------------------------------------------------------------ (d) batches
BATCH_SETTINGS = [
    {"steps": 8},
    {"kv_cache": "dual", "selector": {"name": "confidence_threshold", "threshold": 0.3}},
    {"kv_cache": "prefix", "block_length": 4, "steps": 8},
]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("setting", BATCH_SETTINGS, ids=["none", "dual-threshold", "prefix-block4"])
def test_generate_batch_of_ragged_prompts_decodes_each_as_alone(tmp_path, family, setting):
    bb = Backbone.from_pretrained(checkpoint(tmp_path, family))
    prompts = [[20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42, 43, 44]]
    h = ban_token(bb.model, bb.eos_id)
    try:
        dec = build_decoder(bb, {"decoder": "llada", "gen_length": 16, "block_length": 8, **setting})
        alone = [dec.generate(p) for p in prompts]
        batch = dec.generate_batch(prompts)
    finally:
        h.remove()
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert [[t.chosen for t in r.trace] for r in batch] == [[t.chosen for t in r.trace] for r in alone]
    assert all(len(r.token_ids) == 16 for r in batch)
