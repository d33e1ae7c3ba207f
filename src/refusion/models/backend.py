"""The backbone adapter: a Hugging Face causal LM driven with explicit position ids over a KV cache.

Every forward goes through :meth:`Backbone.forward`, which counts forward calls (NFE) and tokens fed,
always passes an attention mask (transformers builds a packed-sequence mask for non-monotone position
ids without one), refuses non-finite logits, and sets the [MASK] logit to the lowest float, so no
decoder ever emits [MASK] as a token. The cache operations the decoders need (crop, fork
into N rows, select rows, append per-row KV) are methods here, written against transformers 5.x
``DynamicCache`` (``cache.layers[i].keys`` / ``.values``, shape ``[B, n_kv_heads, T, head_dim]``).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from refusion.models.loading import resolve_model_path

ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")


class MaskTokenError(ValueError):
    """The model/tokenizer has no mask token."""


class NonFiniteLogitsError(RuntimeError):
    """A forward produced NaN or inf logits; decoding them would produce garbage."""


def find_mask_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """The [MASK] id from the tokenizer, else from ``config.mask_token_id``; else a helpful error."""
    mask_id = tokenizer.mask_token_id
    if mask_id is None:
        mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        raise MaskTokenError(
            "this model has no mask token (neither tokenizer.mask_token nor config.mask_token_id). Add one: "
            "tokenizer.add_special_tokens({'mask_token': '<|mask|>'}); model.resize_token_embeddings(len(tokenizer)); "
            "model.config.mask_token_id = tokenizer.mask_token_id; then save both to the model folder "
            "(a model never trained with a mask token will not decode well with diffusion decoders)"
        )
    return int(mask_id)


class Backbone:
    """A causal LM plus its tokenizer, mask id, EOS ids and attention kind; counts NFE and tokens in."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        mask_id: int | None = None,
        eos_ids: set[int] | None = None,
        attention: str | None = None,
        logits_shifted: bool = False,
        family: str | None = None,
        mask_required: bool = True,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: name of the model family (see :mod:`refusion.models.families`), when loaded through one
        self.family = family
        #: True for models whose logits at position i predict token i+1 even at a [MASK] input (Dream);
        #: decoders that read [MASK] predictions consult it and shift the logits right by one
        self.logits_shifted = bool(logits_shifted)
        if mask_id is None and not mask_required:  # an AR-only family: the mask token is optional
            mask_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else getattr(model.config, "mask_token_id", None)
            self._mask_id = None if mask_id is None else int(mask_id)
        else:
            self._mask_id = find_mask_id(model, tokenizer) if mask_id is None else int(mask_id)
        if eos_ids is None:
            eos = model.config.eos_token_id if model.config.eos_token_id is not None else tokenizer.eos_token_id
            eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        self.eos_ids = {int(e) for e in eos_ids if e is not None}
        if not self.eos_ids:
            raise ValueError("model has no EOS token id (config.eos_token_id / tokenizer.eos_token)")
        self.eos_id = min(self.eos_ids)
        self.attention = attention or getattr(model.config, "refusion_attention", "causal")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} not one of {ATTENTION_KINDS}")
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device
        self.nfe = 0
        self.tokens_in = 0

    @property
    def mask_id(self) -> int:
        """The [MASK] id; a model without one (an AR-only family) raises :class:`MaskTokenError` here."""
        if self._mask_id is None:
            raise MaskTokenError(
                f"this model{f' (family {self.family!r})' if self.family else ''} has no mask token, so only "
                "autoregressive decoding (decoder 'ar') can drive it; diffusion decoders need a model trained with one"
            )
        return self._mask_id

    @mask_id.setter
    def mask_id(self, value: int | None) -> None:
        self._mask_id = None if value is None else int(value)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False, family: str | None = None,
    ) -> "Backbone":
        """Load a local folder / shipped checkpoint; its family (detected from ``config.json``, or ``family``)
        decides attention, mask id, logits shift and EOS ids (:mod:`refusion.models.families`)."""
        from refusion.models import families

        path = resolve_model_path(name_or_path)
        fam = families.resolve_family(path, family)
        model, tokenizer = families.load_model(path, fam, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, **families.backbone_kwargs(fam, model, tokenizer))

    # ------------------------------------------------------------------ checks
    def check_length(self, prompt_len: int, gen_length: int) -> None:
        if prompt_len + gen_length > self.max_positions:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + gen_length ({gen_length}) exceeds the model's maximum "
                f"positions ({self.max_positions}); shorten the prompt or lower gen_length"
            )

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ----------------------------------------------------------------- forward
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self, ids: Tensor, pos: Tensor, cache: DynamicCache | None, keep_kv: bool = True, attn_mask: Tensor | None = None
    ) -> Tensor:
        """Logits ``[B, T, V]`` (float32, on the CPU) of ``ids [B, T]`` at positions ``pos [B, T]`` after ``cache``.

        The inputs may live anywhere; the model and the cache stay on ``self.device``. Logits come back on
        the CPU, where every decoder keeps its bookkeeping and its seeded ``torch.Generator``: one
        device-to-host copy per forward (the finiteness check below synchronises anyway).

        With ``keep_kv`` the new tokens' KV stays in ``cache`` (appended after its current length);
        without, the cache is cropped back to its length before the call. ``attn_mask``: a 4D float additive
        mask ``[B, 1, T, cached + T]`` (0 = attend, finfo(model dtype).min = blocked) used instead of the
        causal default, for bidirectional / block-causal models.
        """
        if ids.dim() == 1:
            ids, pos = ids[None], pos[None]
        ids = ids.to(self.device)
        pos = pos.to(self.device)
        past = self.cache_len(cache) if cache is not None else 0
        if attn_mask is not None:
            if attn_mask.dim() != 4 or tuple(attn_mask.shape[-2:]) != (ids.shape[1], past + ids.shape[1]):
                raise ValueError(f"attn_mask must be [B, 1, {ids.shape[1]}, {past + ids.shape[1]}], got {tuple(attn_mask.shape)}")
            mask = attn_mask.to(self.device)
        else:
            mask = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=cache is not None
        )
        self.nfe += 1
        self.tokens_in += ids.numel()
        if cache is not None and not keep_kv:
            self.crop(cache, past)
        logits = out.logits.float().cpu()  # a no-op on the CPU
        if not torch.isfinite(logits).all():
            raise NonFiniteLogitsError(
                f"forward {self.nfe} produced NaN/inf logits (dtype {self.model.dtype}); check the checkpoint "
                "and try --dtype float32"
            )
        if self._mask_id is not None:
            logits[..., self._mask_id] = torch.finfo(logits.dtype).min  # [MASK] is never a token to generate
        return logits

    # ------------------------------------------------------------ cache ops
    @staticmethod
    def cache_len(cache: DynamicCache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def cache_rows(cache: DynamicCache) -> int:
        return int(cache.layers[0].keys.shape[0]) if cache.layers and cache.layers[0].keys is not None else 1

    @classmethod
    def crop(cls, cache: DynamicCache, length: int) -> None:
        """Keep the first ``length`` tokens of every row."""
        drop = cls.cache_len(cache) - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {cls.cache_len(cache)} tokens to {length}")
        if drop:
            cache.crop(-drop)

    @staticmethod
    def fork(cache: DynamicCache, n: int) -> DynamicCache:
        """A new cache with each row repeated ``n`` times (the original is untouched)."""
        out = copy.deepcopy(cache)
        if n != 1:
            out.batch_repeat_interleave(n)
        return out

    @staticmethod
    def repeat_rows(cache: DynamicCache, n: int) -> None:
        """In place: each row repeated ``n`` times (rows ``[r0]*n + [r1]*n + ...``)."""
        if n != 1:
            cache.batch_repeat_interleave(n)

    @staticmethod
    def select(cache: DynamicCache, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), in place."""
        cache.batch_select_indices(torch.tensor(rows, device=cache.layers[0].keys.device))

    @staticmethod
    def drop_span(cache: DynamicCache, start: int, end: int) -> None:
        """In place: remove the KV of buffer entries ``start .. end-1`` (keys keep their RoPE positions)."""
        for layer in cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, end:]], dim=-2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, end:]], dim=-2)

    @classmethod
    def concat_rows(cls, cache: DynamicCache, base_len: int, lengths: list[int]) -> None:
        """In place, turn an S-row cache into one row: the shared prefix ``[:base_len]`` (from row 0)
        followed by, for each row s in order, its own tokens ``base_len .. base_len+lengths[s]``. One row
        is a crop (a view), not a copy of the whole cache."""
        if len(lengths) == 1:
            if cls.cache_rows(cache) > 1:
                cls.select(cache, [0])
            cls.crop(cache, base_len + lengths[0])
            return
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                parts = [t[:1, :, :base_len]] + [t[s : s + 1, :, base_len : base_len + n] for s, n in enumerate(lengths)]
                setattr(layer, name, torch.cat(parts, dim=-2))
