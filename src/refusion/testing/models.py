"""Tiny models for tests, built in seconds: a character tokenizer with a mask token, random Qwen3 models of
each attention kind, and forward hooks that ban or force a token.

Nothing here needs hypothesis; :mod:`refusion.testing.checks` builds its models from these.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,+-*=#?\n")
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|beginoftext|>", "<|mask|>"]
#: id of ``<|mask|>`` in :func:`make_char_tokenizer`'s vocabulary
MASK_ID = 3
#: the attention kinds a decoder may need (``Decoder.attention``)
ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")


def make_char_tokenizer(with_mask: bool = True) -> PreTrainedTokenizerFast:
    """One token per character of :data:`CHARS` after the special tokens (EOS 0, pad 1, BOS 2, mask 3)."""
    specials = SPECIALS if with_mask else SPECIALS[:3]
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    kw = dict(eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token="<|beginoftext|>")
    if with_mask:
        kw["mask_token"] = "<|mask|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


def make_tiny_qwen3(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64,
                    attention: str | None = None, block_size: int = 4) -> Qwen3ForCausalLM:
    """A random Qwen3 (float32, eval mode); ``attention`` (one of :data:`ATTENTION_KINDS`) sets
    ``config.refusion_attention`` (and ``refusion_block_size``) as the shipped tiny models do."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=0, pad_token_id=1, bos_token_id=2,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    if attention is not None:
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {attention!r} not one of {ATTENTION_KINDS}")
        model.config.refusion_attention = attention
        model.config.refusion_block_size = block_size
    return model


def tiny_backbone(attention: str = "causal", seed: int = 0, layers: int = 2, tokenizer=None):
    """A :class:`~refusion.models.backend.Backbone` over :func:`make_tiny_qwen3` and the char tokenizer."""
    from refusion.models.backend import Backbone

    tokenizer = tokenizer or make_char_tokenizer()
    return Backbone(make_tiny_qwen3(len(tokenizer), seed=seed, layers=layers, attention=attention), tokenizer)


def kept_rows(per_position: torch.Tensor, logits_to_keep, n_rows: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The entries of ``per_position [B, T]`` at the positions whose logits a forward computed (``n_rows``
    of them: a model that ignores ``logits_to_keep`` computes all). ``rows``: in a batched forward whose
    head ran on each row's own positions (``model.refusion_logits_rows``), the row of each kept entry ->
    ``[1, N]``."""
    if rows is not None:
        return per_position[rows, logits_to_keep][None]
    if n_rows == per_position.shape[1]:
        return per_position
    if isinstance(logits_to_keep, torch.Tensor):
        return per_position[:, logits_to_keep]
    return per_position[:, -logits_to_keep:] if logits_to_keep else per_position


def force_token(model, position: int, token: int, boost: float = 1e4, mask_id: int = MASK_ID):
    """Make ``model`` predict ``token`` wherever the logits predict ``position``.

    At a [MASK] input the logits predict the same position; at a real token, the next one. Returns the
    hook handle (``.remove()`` to undo).
    """

    def hook(module, args, kwargs, output):
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        target = torch.where(ids == mask_id, pos, pos + 1)
        target = kept_rows(target, kwargs.get("logits_to_keep", 0), output.logits.shape[1],
                           getattr(module, "refusion_logits_rows", None))
        output.logits[..., token] += boost * (target == position).to(output.logits.dtype)
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def ban_token(model, token: int):
    """Make ``model`` never predict ``token`` (a hook; ``.remove()`` to undo)."""

    def hook(module, args, output):
        output.logits[..., token] -= 1e4
        return output

    return model.register_forward_hook(hook)
