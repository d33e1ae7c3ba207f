"""Fresh tiny Qwen3 models built from a tokenizer (size presets), with the project's config keys.

Presets (parameter counts with a vocabulary of ~1k tokens, embeddings tied):

=========  ======  ======  =====  ========  ========  =====  ===========
name       hidden  layers  heads  kv heads  head dim  ffn    ~params
=========  ======  ======  =====  ========  ========  =====  ===========
micro      64      2       2      1         32        128    0.2M (tests)
draft      128     2       4      2         32        384    0.5M (tiny-ar-draft)
tiny       256     4       4      2         64        768    3.3M
small      384     6       6      2         64        1536   13M
=========  ======  ======  =====  ========  ========  =====  ===========

Config keys the rest of the project reads (all stored in ``config.json``):

- ``mask_token_id``: the tokenizer's ``<|mask|>`` id (also ``pad_token_id``, ``bos_token_id``,
  ``eos_token_id`` from the tokenizer);
- ``refusion_attention``: ``"causal"`` | ``"bidirectional"`` | ``"block_causal"``: the attention the
  model was trained with (the trainer overwrites it with the objective's kind);
- ``refusion_block_size``: block length of ``block_causal`` models (absent/None otherwise);
- ``refusion_objective``: name of the last training objective (set by the trainer);
- ``refusion_logits_shifted``: True when that objective trained shifted targets (the ``mdm`` objective's
  ``shift``: logits at position i predict token i + 1, as Dream's do);
- ``refusion_base_vocab_size``: on a stand-in made by :func:`widen_vocabulary`, the vocabulary it was
  widened from (ids at or above it are the new, never-produced ones).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")

#: Architecture presets (vocabulary and special-token ids come from the tokenizer).
SIZES: dict[str, dict[str, int]] = {
    "micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, intermediate_size=128),
    "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=384),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=768),
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                  head_dim=64, intermediate_size=1536),
}

DEFAULT_MAX_POSITIONS = 512


def _token_id(tokenizer: PreTrainedTokenizerBase, attr: str, literal: str) -> int | None:
    value = getattr(tokenizer, f"{attr}_id", None)
    if value is None:
        tid = tokenizer.convert_tokens_to_ids(literal)
        unk = getattr(tokenizer, "unk_token_id", None)
        value = tid if isinstance(tid, int) and tid != unk else None
    return None if value is None else int(value)


def set_attention(config: Any, attention: str, block_size: int | None = None) -> None:
    """Record the attention kind (and block size for block-causal models) in a model config."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {attention!r}; allowed: {', '.join(ATTENTION_KINDS)}")
    if attention == "block_causal":
        if not block_size or block_size < 1:
            raise ValueError("block_causal attention needs a positive block_size")
        config.refusion_block_size = int(block_size)
    else:
        config.refusion_block_size = None
    config.refusion_attention = attention


def record_objective(config: Any, objective: Any) -> None:
    """Record in a model config which attention (and block size) a training ``objective`` trains, and
    the objective's name (``refusion_objective``)."""
    set_attention(config, objective.attention, getattr(objective.options, "block_size", None))
    config.refusion_objective = objective.name
    config.refusion_logits_shifted = bool(getattr(objective.options, "shift", False))


def make_config(
    tokenizer: PreTrainedTokenizerBase,
    size: str = "tiny",
    attention: str = "causal",
    block_size: int | None = None,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    **overrides: Any,
) -> Qwen3Config:
    """A Qwen3 config for ``size`` whose vocabulary and special ids match ``tokenizer``."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; allowed: {', '.join(SIZES)}")
    arch = dict(SIZES[size])
    arch.update(overrides)
    mask_id = _token_id(tokenizer, "mask_token", "<|mask|>")
    if mask_id is None:
        raise ValueError("the tokenizer has no mask token (<|mask|>); diffusion objectives need one")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        use_cache=True,
        pad_token_id=_token_id(tokenizer, "pad_token", "<|pad|>"),
        bos_token_id=_token_id(tokenizer, "bos_token", "<|beginoftext|>"),
        eos_token_id=_token_id(tokenizer, "eos_token", "<|endoftext|>"),
        **arch,
    )
    config.mask_token_id = mask_id
    config.refusion_size = size
    set_attention(config, attention, block_size)
    return config


def build_model(tokenizer: PreTrainedTokenizerBase, size: str = "tiny", seed: int | None = 0,
                **config_options: Any) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 Qwen3ForCausalLM of preset ``size`` (seeded when ``seed`` is given);
    ``config_options`` are :func:`make_config`'s (attention, block_size, max_position_embeddings, overrides)."""
    config = make_config(tokenizer, size, **config_options)
    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    return model.float()


def deepen(model: Qwen3ForCausalLM, num_layers: int) -> Qwen3ForCausalLM:
    """Grow ``model`` in place to ``num_layers`` decoder layers without changing what it computes.

    Each new layer is a copy of the layer before it with its two residual writers (the attention's
    ``o_proj`` and the MLP's ``down_proj``) zeroed, so it adds nothing to the residual stream until
    training moves those weights; the copies are spread evenly (layer i gets ``extra // L`` copies, one
    more for the first ``extra % L`` layers). Returns ``model`` with ``num_hidden_layers`` (and
    ``layer_types``) updated and every layer's cache index renumbered."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "o_proj")
                                 and hasattr(getattr(layer, "mlp", None), "down_proj") for layer in layers):
        raise ValueError(f"{type(model).__name__} is not a Qwen3-style decoder (model.layers with self_attn.o_proj "
                         "and mlp.down_proj); only those can be grown")
    old = len(layers)
    if num_layers <= old:
        raise ValueError(f"num_layers must exceed the model's {old} layers; got {num_layers}")
    extra = num_layers - old
    copies_after = [extra // old + (1 if i < extra % old else 0) for i in range(old)]
    grown: list[torch.nn.Module] = []
    for layer, copies in zip(layers, copies_after):
        grown.append(layer)
        for _ in range(copies):
            twin = copy.deepcopy(layer)
            with torch.no_grad():
                for writer in (twin.self_attn.o_proj, twin.mlp.down_proj):
                    writer.weight.zero_()
                    if writer.bias is not None:
                        writer.bias.zero_()
            grown.append(twin)
    for index, layer in enumerate(grown):
        layer.self_attn.layer_idx = index
    model.model.layers = torch.nn.ModuleList(grown)
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types:
        origin = [i for i, copies in enumerate(copies_after) for _ in range(1 + copies)]
        model.config.layer_types = [layer_types[i] for i in origin]
    model.config.num_hidden_layers = num_layers
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def widen_vocabulary(model_dir_or_name: str | os.PathLike, out_dir: str | os.PathLike,
                     vocab_size: int = 151936) -> Path:
    """Save to ``out_dir`` a copy of a checkpoint (folder or shipped name) whose vocabulary has
    ``vocab_size`` rows: a stand-in with a real model's output-head and embedding size (151936: Qwen's).

    The new rows of the input embedding and of the output head are zero (with tied embeddings they are one
    tensor) and the tokenizer is unchanged, so it never produces the new ids; every other weight and
    config key is kept, ``vocab_size`` is updated and ``refusion_base_vocab_size`` records the old size.
    A new id's logit is 0, which takes probability mass from the real ids wherever their logits are
    not far above 0 (``refusion profile`` puts them 40 under each row's top logit instead). Weights are
    stored in bfloat16 (:func:`~refusion.models.loading.save_pretrained`)."""
    from refusion.models.loading import load_pretrained, resolve_model_path, save_pretrained

    model, tokenizer = load_pretrained(resolve_model_path(model_dir_or_name))
    old = model.get_input_embeddings().weight.shape[0]
    if vocab_size < old:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the model's vocabulary ({old} rows)")
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:] = 0
        head = model.get_output_embeddings()
        if head is not None:
            head.weight[old:] = 0
            if getattr(head, "bias", None) is not None:
                head.bias[old:] = 0
    model.config.vocab_size = vocab_size
    model.config.refusion_base_vocab_size = getattr(model.config, "refusion_base_vocab_size", None) or old
    return save_pretrained(model, tokenizer, out_dir)
