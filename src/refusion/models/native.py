"""LLaDA and Dream as transformers' own architectures: their published checkpoints' weights on
``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, attending bidirectionally, without running remote code.

LLaDA-8B (``GSAI-ML/LLaDA-8B-Instruct``) is a Llama block stack written in OLMo's format, and Dream-7B
(``Dream-org/Dream-v0-Instruct-7B``) is Qwen2.5-7B run without a causal mask. Both ship modeling code
written for transformers 4.x with no cache this project can drive; on the native architectures the
``llada`` decoder gets transformers' ``DynamicCache`` (Fast-dLLM prefix / dual caches), sdpa / eager
attention, any dtype and batched decoding with per-row 4D masks.

:func:`native_config` reads the published ``config.json`` (OLMo keys for LLaDA, Qwen2 keys for Dream) and
refuses every option the native architecture would compute differently (it names the key and points at
``--trust-remote-code``). :func:`rename_key` maps the published tensor names:

================================================  =====================================================
LLaDA (``model.transformer.`` ...)                Llama (``LlamaForCausalLM``; ``model.layers.N.`` = L)
================================================  =====================================================
``wte.weight``                                    ``model.embed_tokens.weight``
``blocks.N.attn_norm`` / ``ff_norm``              L ``input_layernorm`` / ``post_attention_layernorm``
``blocks.N.q_proj`` / ``k_proj`` / ``v_proj``     L ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``
``blocks.N.attn_out``                             L ``self_attn.o_proj``
``blocks.N.ff_proj`` (gate) / ``up_proj``         L ``mlp.gate_proj`` / ``mlp.up_proj``
``blocks.N.ff_out``                               L ``mlp.down_proj``
``ln_f.weight``                                   ``model.norm.weight``
``ff_out.weight`` (none with ``weight_tying``)    ``lm_head.weight`` (``weight_tying``: the embedding)
================================================  =====================================================

Dream's tensors already carry Qwen2's names (``model.layers.N.self_attn.q_proj.bias``, ``lm_head.weight``).
Config: LLaDA ``d_model`` / ``n_heads`` / ``n_kv_heads`` (or ``multi_query_attention``) / ``n_layers`` /
``mlp_hidden_size`` (else ``mlp_ratio * d_model``) / ``embedding_size`` (else ``vocab_size``) /
``max_sequence_length`` / ``rms_norm_eps`` / ``rope_theta`` / ``weight_tying`` / ``activation_type`` become
Llama's ``hidden_size`` / ``num_attention_heads`` / ``num_key_value_heads`` / ``num_hidden_layers`` /
``intermediate_size`` / ``vocab_size`` / ``max_position_embeddings`` / ``rms_norm_eps`` /
``rope_parameters`` / ``tie_word_embeddings`` / ``hidden_act``; Dream's keys are Qwen2's (its sliding window
is off: Dream's own sdpa attention never applies one). Keys absent from a LLaDA config take the published
code's defaults (``ModelConfig``), so a config that relies on a default the native model cannot follow is
refused too.

Numerics: in float32 the native forward equals the published code's to 1e-4 (``tests/models/test_native.py``,
tiny random checkpoints). In 16-bit dtypes transformers applies the rotary embedding in the model's dtype,
whereas LLaDA's code rotates in float32 (``rope_full_precision``), so 16-bit logits differ at rounding level.

Bidirectional attention: the decoders always pass a 4D additive mask, which transformers uses as it is
(no causal mask is added, and sdpa's ``is_causal`` stays off when a mask is given). The loaded model is
bidirectional without one as well: ``config.is_causal = False`` makes transformers build a bidirectional
mask from a 2D / absent mask, and every attention module's ``is_causal`` is False.

Weights are loaded by transformers' ``from_pretrained`` with a key mapping (sharded safetensors, dtype,
``device_map``, meta-device initialisation); the checkpoint's names are checked against the native model's
before any tensor is read, and the load is refused if transformers reports a missing or unexpected tensor.
Tokenizers: a tokenizer that names its own code (Dream's ``DreamTokenizer``, a copy of the 4.x slow
``Qwen2Tokenizer``) is loaded as transformers' ``Qwen2Tokenizer`` from the same ``vocab.json`` /
``merges.txt``; LLaDA's is a plain ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refusion.models.families import Family, FamilyError, read_config, resolve_family

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from refusion.models.loading import Runtime

#: family -> the transformers architecture its checkpoints load as
NATIVE_ARCHITECTURES = {"llada": "llama", "dream": "qwen2"}


class NativeFormatError(FamilyError):
    """A checkpoint whose config or tensors the native architecture cannot reproduce."""


def _refuse(family: str, path: Any, what: str) -> NativeFormatError:
    where = f" in {str(path)!r}" if path is not None else ""
    return NativeFormatError(
        f"{family} checkpoint{where}: {what}. The native loading (its weights on transformers' "
        f"{NATIVE_ARCHITECTURES.get(family, '?')} architecture) covers the published format only; to run the "
        "checkpoint's own modeling code instead, pass --trust-remote-code (trust_remote_code=True; no KV cache "
        "there: kv_cache none)"
    )


# ------------------------------------------------------------------------------------------ LLaDA
#: the published code's defaults (configuration_llada.ModelConfig) for the keys the mapping reads
LLADA_DEFAULTS: dict[str, Any] = {
    "d_model": 768, "n_heads": 12, "n_kv_heads": None, "n_layers": 12, "mlp_ratio": 4, "mlp_hidden_size": None,
    "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1, "alibi": False, "rope": False,
    "multi_query_attention": None, "attention_layer_norm": False, "input_emb_norm": False,
    "layer_norm_type": "default", "layer_norm_with_affine": True, "rms_norm_eps": 1e-5, "max_sequence_length": 1024,
    "rope_theta": 10000.0, "include_qkv_bias": False, "include_bias": False, "bias_for_layer_norm": None,
    "scale_logits": False, "vocab_size": 50257, "embedding_size": 50304, "weight_tying": True,
    "eos_token_id": 50256, "pad_token_id": 50256, "mask_token_id": 50256,
}
#: LLaDA's feed-forward activation (applied to ``ff_proj``) -> transformers' ``hidden_act``
LLADA_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "relu": "relu"}
#: (published config key, value the native Llama block computes): any other value is refused
LLADA_REQUIRED = (
    ("block_type", "llama"), ("layer_norm_type", "rms"), ("rope", True), ("alibi", False),
    ("attention_layer_norm", False), ("input_emb_norm", False), ("scale_logits", False), ("include_bias", False),
    ("include_qkv_bias", False), ("layer_norm_with_affine", True), ("block_group_size", 1),
)
LLADA_RENAMES = (  # published name (regex, anchored) -> Llama name
    (r"^model\.transformer\.wte\.", "model.embed_tokens."),
    (r"^model\.transformer\.ln_f\.", "model.norm."),
    (r"^model\.transformer\.ff_out\.", "lm_head."),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^model\.transformer\.blocks\.(\d+)\.q_proj\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.k_proj\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.v_proj\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_out\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.up_proj\.", r"model.layers.\1.mlp.up_proj."),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_out\.", r"model.layers.\1.mlp.down_proj."),
)


def _llada_config(raw: dict[str, Any], path: Any = None):
    from transformers import LlamaConfig

    missing = [k for k in ("d_model", "n_heads", "n_layers", "block_type") if k not in raw]
    if missing:
        raise _refuse("llada", path, f"config.json lacks {', '.join(missing)} (not LLaDA's published format)")
    c = {**LLADA_DEFAULTS, **{k: v for k, v in raw.items() if k in LLADA_DEFAULTS}}
    for key, value in LLADA_REQUIRED:
        if c[key] != value and not (key == "include_qkv_bias" and c[key] is None):
            raise _refuse("llada", path, f"{key} = {c[key]!r} (the native model computes {key} = {value!r})")
    bias_ln = c["bias_for_layer_norm"] if c["bias_for_layer_norm"] is not None else c["include_bias"]
    if bias_ln:
        raise _refuse("llada", path, "bias_for_layer_norm = true (RMSNorm with a bias)")
    if c["activation_type"] not in LLADA_ACTIVATIONS:
        raise _refuse("llada", path, f"activation_type = {c['activation_type']!r} with a llama block "
                                     f"(mapped: {', '.join(LLADA_ACTIVATIONS)})")
    d, heads = int(c["d_model"]), int(c["n_heads"])
    if d % heads:
        raise _refuse("llada", path, f"d_model {d} is not a multiple of n_heads {heads}")
    kv, mqa = c["n_kv_heads"], c["multi_query_attention"]
    kv_heads = (1 if mqa else heads) if kv is None else (int(kv) if mqa is None else (1 if mqa else heads))
    vocab = int(c["embedding_size"] or c["vocab_size"])
    if vocab < int(c["vocab_size"]):
        raise _refuse("llada", path, f"embedding_size {vocab} < vocab_size {c['vocab_size']}")
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_hidden_layers=int(c["n_layers"]), intermediate_size=int(c["mlp_hidden_size"] or c["mlp_ratio"] * d),
        hidden_act=LLADA_ACTIVATIONS[c["activation_type"]], max_position_embeddings=int(c["max_sequence_length"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_parameters={"rope_type": "default", "rope_theta": float(c["rope_theta"])},
        tie_word_embeddings=bool(c["weight_tying"]), attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        use_cache=True, eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"],
        bos_token_id=raw.get("bos_token_id"),
    )
    config.mask_token_id = c["mask_token_id"]
    return config


# ------------------------------------------------------------------------------------------ Dream
def _dream_config(raw: dict[str, Any], path: Any = None):
    from transformers import Qwen2Config

    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in raw]
    if missing:
        raise _refuse("dream", path, f"config.json lacks {', '.join(missing)} (not Dream's published Qwen2 format)")
    if raw.get("rope_scaling"):
        raise _refuse("dream", path, f"rope_scaling = {raw['rope_scaling']!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse("dream", path, f"hidden_act = {raw['hidden_act']!r}")
    heads = int(raw["num_attention_heads"])
    if raw.get("head_dim") not in (None, int(raw["hidden_size"]) // heads):
        raise _refuse("dream", path, f"head_dim = {raw['head_dim']} (Dream's attention uses hidden_size // heads)")
    kv = raw.get("num_key_value_heads")
    config = Qwen2Config(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=int(kv) if kv is not None else heads,
        hidden_act="silu", max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_parameters={"rope_type": "default", "rope_theta": float(raw.get("rope_theta", 10000.0))},
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), use_sliding_window=False,
        attention_dropout=0.0, use_cache=True, eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id", 151643), bos_token_id=raw.get("bos_token_id"),
    )
    config.mask_token_id = raw.get("mask_token_id", 151666)  # DreamConfig's default
    return config


# ----------------------------------------------------------------------------------------- shared
def _family_name(family: str | Family) -> str:
    name = family.name if isinstance(family, Family) else str(family)
    if name not in NATIVE_ARCHITECTURES:
        raise FamilyError(f"family {name!r} has no native mapping (native: {', '.join(NATIVE_ARCHITECTURES)})")
    return name


def native_config(raw: dict[str, Any], family: str | Family, path: Any = None):
    """The transformers config (``LlamaConfig`` for LLaDA, ``Qwen2Config`` for Dream) of a published
    ``config.json`` dict; bidirectional (``is_causal`` False) and tagged with ``refusion_family`` and
    ``mask_token_id``. Raises :class:`NativeFormatError` for options the native model cannot reproduce."""
    name = _family_name(family)
    config = _llada_config(raw, path) if name == "llada" else _dream_config(raw, path)
    config.is_causal = False
    config.refusion_family = name
    return config


def key_mapping(family: str | Family) -> dict[str, str]:
    """``from_pretrained``'s ``key_mapping`` (regex -> replacement) for a family's published tensor names."""
    return dict(LLADA_RENAMES) if _family_name(family) == "llada" else {}


def rename_key(name: str, family: str | Family) -> str:
    """The native model's name of one published tensor name (unchanged when no rule applies)."""
    for pattern, repl in key_mapping(family).items():
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def checkpoint_tensors(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a folder's safetensors tensors (headers only; sharded or single file)."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as st:
            for k in st.keys():
                out[k] = tuple(st.get_slice(k).get_shape())
    return out


def _native_class(family: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    return LlamaForCausalLM if family == "llada" else Qwen2ForCausalLM


def check_tensors(path: str | os.PathLike, config: Any, family: str | Family) -> None:
    """Refuse (before reading any tensor) a checkpoint whose renamed tensors are not exactly the native
    model's, or whose shapes differ from the config's."""
    name = _family_name(family)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in _native_class(name)(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    found = {rename_key(k, name): shape for k, shape in checkpoint_tensors(path).items()}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}"] if unexpected else [])
        raise _refuse(name, path, f"tensors not in the published format ({'; '.join(parts)}; names after renaming)")
    wrong = [f"{k} {found[k]} (config: {expected[k]})" for k in expected if found[k] != expected[k]]
    if wrong:
        raise _refuse(name, path, f"tensor shapes differ from config.json: {', '.join(wrong[:4])}")


def make_bidirectional(model: torch.nn.Module) -> torch.nn.Module:
    """Every attention module of ``model`` non-causal (sdpa without a mask then attends everywhere)."""
    model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    return model


def load_native_model(
    path: str | os.PathLike, family: str | Family | None = None, dtype: torch.dtype | str | None = None,
    attn_implementation: str = "sdpa", device_map: str | dict | None = None, runtime: "Runtime | None" = None,
) -> "PreTrainedModel":
    """A LLaDA / Dream checkpoint folder (published ``config.json`` + safetensors) as a bidirectional
    ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, in eval mode, on the CPU unless ``device_map`` places it.

    ``dtype`` None keeps the storage dtype (the safetensors' floating dtype). ``runtime`` (a
    :class:`~refusion.models.loading.Runtime`) supplies dtype, attention implementation and device map
    instead of the keywords (it does not move the model: :meth:`Runtime.place` does). No code from the
    folder runs; ``family`` defaults to the one detected from ``config.json``."""
    path = Path(path)
    raw = read_config(path)
    name = _family_name(resolve_family(path, family))
    config = native_config(raw, name, path)
    check_tensors(path, config, name)
    if runtime is not None:
        kwargs = runtime.from_pretrained_kwargs(remote_code=False)
    else:
        kwargs = {"dtype": dtype if dtype is not None else "auto", "attn_implementation": attn_implementation}
        if device_map is not None:
            kwargs["device_map"] = device_map
    if kwargs["dtype"] == "auto":  # the storage dtype, not a config's (the native config names none)
        kwargs["dtype"] = storage_dtype(path)
    model, info = _native_class(name).from_pretrained(
        path, config=config, key_mapping=key_mapping(name) or None, local_files_only=True, trust_remote_code=False,
        output_loading_info=True, **kwargs,
    )
    bad = {k: sorted(v) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if (v := info.get(k))}
    if bad or info.get("error_msgs"):
        raise _refuse(name, path, f"transformers reported {bad or info['error_msgs']} while loading")
    return make_bidirectional(model).eval()


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def storage_dtype(path: str | os.PathLike) -> torch.dtype:
    """The floating dtype of a folder's safetensors (its first floating tensor's)."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                dt = SAFETENSORS_DTYPES.get(st.get_slice(k).get_dtype())
                if dt is not None:
                    return dt
    return torch.float32


def load_native_tokenizer(path: str | os.PathLike, family: str | Family | None = None) -> "PreTrainedTokenizerBase":
    """The folder's tokenizer without remote code: one that names its own class (``auto_map``, Dream's
    ``DreamTokenizer``) or names none is loaded as the family's transformers class (Dream:
    ``Qwen2Tokenizer`` from ``vocab.json`` / ``merges.txt``; LLaDA: ``PreTrainedTokenizerFast`` from
    ``tokenizer.json``); one that names a transformers class is loaded by ``AutoTokenizer``."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

    path = Path(path)
    name = _family_name(resolve_family(path, family))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    own_code = "AutoTokenizer" in (cfg.get("auto_map") or {})
    if cfg.get("tokenizer_class") and not own_code:  # given the native config, AutoTokenizer reads no config.json
        config = native_config(read_config(path), name, path)
        return AutoTokenizer.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=False)
    if name == "dream" and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return Qwen2Tokenizer.from_pretrained(path, local_files_only=True)
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    raise _refuse(name, path, "the tokenizer names its own code and the folder has no tokenizer.json "
                              "(nor vocab.json + merges.txt for Dream) to load instead")
