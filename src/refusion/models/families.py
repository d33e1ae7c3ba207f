"""Model families: what a checkpoint's architecture means for decoding, in one small registry.

A :class:`Family` says how a model attends (``causal`` / ``bidirectional`` / ``block_causal``), which
token is its [MASK], whether its logits are *shifted* (the logits at position i predict token i+1 even
at a [MASK] input: Dream), its EOS ids, which decoders can drive it, and which transformers class its
weights load as (LLaDA and Dream: natively, or their own code with ``trust_remote_code``).
:func:`detect_family` reads it from ``config.json``; a family name given by the caller
(``--family NAME``, ``family=``) overrides the detection.

=============  ==============  ===========  =======  ======================  ===========================  ==================
family         attention       mask id      shifted  EOS ids                 decoders                     loads as
=============  ==============  ===========  =======  ======================  ===========================  ==================
refusion       causal          151670       no       config + 151643/151645  refusion, ar, speculative    Qwen3
qwen3          causal          (optional)   no       config + 151643/151645  ar, speculative              Qwen3
llada          bidirectional   126336       no       126081, 126348          llada                        Llama (native)
dream          bidirectional   151666       yes      151643, 151645          llada                        Qwen2 (native)
tiny-causal    causal          tokenizer    no       config                  refusion, ar, speculative    Qwen3
tiny-mdm       bidirectional   tokenizer    no       config                  llada                        Qwen3
tiny-block     block_causal    tokenizer    no       config                  block                        Qwen3
=============  ==============  ===========  =======  ======================  ===========================  ==================

Detection (first match wins): ``refusion_family`` in the config (a native LLaDA / Dream model in
memory); ``refusion_attention`` (the tiny models of this project, by attention kind); ``model_type`` /
``architectures`` naming LLaDA or Dream; a Qwen3 with a mask token (``config.mask_token_id``, or the
tokenizer files declare a mask token / add ``<|mask|>``: ReFusion is Qwen3-8B plus ``<|beginoftext|>``
151669 and ``<|mask|>`` 151670); any other Qwen3 (plain autoregressive: a Qwen3 tokenizer has no mask
token). Anything else is an error naming the families, and ``--family`` chooses one by hand.

Mask id resolution: ``config.mask_token_id``, else the tokenizer's mask token, else the family's id
(a mask id outside the vocabulary is an error). EOS ids: ``config.eos_token_id`` and the tokenizer's
EOS, plus the family's own ids that lie inside the vocabulary.

LLaDA and Dream load natively by default (:mod:`refusion.models.native`): their published weights on
transformers' own ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` with bidirectional attention, no remote
code, so the ``llada`` decoder's prefix / dual KV caches, sdpa, any dtype and batches work on them. They
also ship their own modeling code (``auto_map`` in ``config.json``, written for transformers 4.x); with
``trust_remote_code=True`` (``--trust-remote-code``) or ``native=False`` that code is loaded instead and
driven through a small adapter (:func:`adapt_model`) that calls it with its own keyword conventions
(LLaDA: no ``position_ids``, positions 0..T-1, an additive ``attention_bias``; Dream: no 2D mask for full
attention). Neither adapter uses a KV cache: run the ``llada`` decoder with ``kv_cache: none`` on them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refusion.core.errors import MaskTokenError

QWEN_EOS = (151643, 151645)  # <|endoftext|>, <|im_end|>
REFUSION_MASK_ID = 151670  # <|mask|>
LLADA_MASK_ID = 126336
LLADA_EOS = (126081, 126348)  # <|endoftext|> (EOS), <|eot_id|> (EoT)
DREAM_MASK_ID = 151666


class FamilyError(ValueError):
    """Unknown family, undetectable checkpoint, or a family/decoder/remote-code mismatch."""


@dataclass(frozen=True)
class Family:
    """How a family of checkpoints is decoded (see the module docstring's table)."""

    name: str
    attention: str  # "causal" | "bidirectional" | "block_causal"
    decoders: tuple[str, ...]  # decoders that can drive it
    mask_id: int | None = None  # default [MASK] id (None: from config/tokenizer only)
    mask_required: bool = True  # False: an AR-only family may have no mask token
    logits_shifted: bool = False  # logits at i predict token i+1, also at [MASK] inputs (Dream)
    eos_ids: tuple[int, ...] = ()  # extra EOS ids (added to the config's/tokenizer's when in vocab)
    remote_code: bool = False  # ships its own modeling code (loaded only with trust_remote_code=True)
    adapter: str | None = None  # forward adapter for remote-code models ("llada" | "dream")
    native: str | None = None  # transformers architecture its checkpoints load as without remote code
    description: str = ""

    def check_decoder(self, decoder: str) -> None:
        """Refuse a decoder this family does not serve (before any forward)."""
        if decoder not in self.decoders:
            raise FamilyError(
                f"decoder {decoder!r} cannot drive a {self.name!r} model ({self.description}); "
                f"this family serves: {', '.join(self.decoders)}. If the family was detected wrongly, "
                f"choose one with --family ({', '.join(FAMILIES)})"
            )

    def resolve_mask_id(self, config: Any, tokenizer: Any, vocab_size: int | None = None) -> int | None:
        """``config.mask_token_id``, else the tokenizer's mask token, else the family's id."""
        mask_id = getattr(config, "mask_token_id", None)
        if mask_id is None and tokenizer is not None:
            mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            mask_id = self.mask_id
        if mask_id is None:
            return None
        mask_id = int(mask_id)
        if vocab_size is not None and not 0 <= mask_id < vocab_size:
            raise FamilyError(
                f"family {self.name!r}: mask id {mask_id} is outside the vocabulary ({vocab_size} tokens); "
                "set config.mask_token_id or add a mask token to the tokenizer"
            )
        return mask_id

    def resolve_eos_ids(self, config: Any, tokenizer: Any, vocab_size: int | None = None) -> set[int]:
        """The config's and tokenizer's EOS ids plus the family's own (those inside the vocabulary)."""
        out: set[int] = set()
        eos = getattr(config, "eos_token_id", None)
        for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if e is not None:
                out.add(int(e))
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            out.add(int(tokenizer.eos_token_id))
        for e in self.eos_ids:
            if vocab_size is None or e < vocab_size:
                out.add(int(e))
        return out


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("refusion", "causal", ("refusion", "ar", "speculative"), mask_id=REFUSION_MASK_ID, eos_ids=QWEN_EOS,
           description="ReFusion: Qwen3 weights fine-tuned with [MASK] 151670"),
    Family("qwen3", "causal", ("ar", "speculative"), mask_required=False, eos_ids=QWEN_EOS,
           description="plain Qwen3 causal LM (autoregressive only)"),
    Family("llada", "bidirectional", ("llada",), mask_id=LLADA_MASK_ID, eos_ids=LLADA_EOS, remote_code=True,
           adapter="llada", native="llama", description="LLaDA-8B masked diffusion model (Llama weights, bidirectional)"),
    Family("dream", "bidirectional", ("llada",), mask_id=DREAM_MASK_ID, logits_shifted=True, eos_ids=QWEN_EOS,
           remote_code=True, adapter="dream", native="qwen2",
           description="Dream-7B masked diffusion model with shifted logits (Qwen2 weights, bidirectional)"),
    Family("tiny-causal", "causal", ("refusion", "ar", "speculative"), description="this project's causal tiny models"),
    Family("tiny-mdm", "bidirectional", ("llada",), description="this project's bidirectional tiny models"),
    Family("tiny-block", "block_causal", ("block",), description="this project's block-causal tiny models"),
)}

TINY_BY_ATTENTION = {"causal": "tiny-causal", "bidirectional": "tiny-mdm", "block_causal": "tiny-block"}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise FamilyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


# ------------------------------------------------------------------------------------- detection
def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FamilyError(f"{str(path)!r} has no config.json")
    return json.loads(p.read_text(encoding="utf-8"))


def has_mask_token(path: str | os.PathLike) -> bool:
    """Whether a folder's tokenizer files declare a mask token or add ``<|mask|>`` (no tokenizer load)."""
    path = Path(path)
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text(encoding="utf-8"))
        if data.get("mask_token"):
            return True
        if any(isinstance(t, dict) and t.get("content") == "<|mask|>" for t in (data.get("added_tokens_decoder") or {}).values()):
            return True
    tj = path / "tokenizer.json"
    if tj.is_file() and tj.stat().st_size < 64 << 20:
        data = json.loads(tj.read_text(encoding="utf-8"))
        return any(t.get("content") == "<|mask|>" for t in data.get("added_tokens") or [])
    return False


def detect_family(config: dict[str, Any], path: str | os.PathLike | None = None) -> Family:
    """The family of a checkpoint from its ``config.json`` dict (``path``: its folder, for tokenizer files)."""
    if config.get("refusion_family") in FAMILIES:  # a native LLaDA / Dream model (refusion.models.native)
        return FAMILIES[config["refusion_family"]]
    attention = config.get("refusion_attention")
    if attention is not None:
        if attention not in TINY_BY_ATTENTION:
            raise FamilyError(f"config.json: refusion_attention {attention!r} is not one of {', '.join(TINY_BY_ATTENTION)}")
        return FAMILIES[TINY_BY_ATTENTION[attention]]
    model_type = str(config.get("model_type", "")).lower()
    archs = " ".join(config.get("architectures") or []).lower()
    if model_type == "llada" or "llada" in archs:
        return FAMILIES["llada"]
    if model_type == "dream" or "dream" in archs:
        return FAMILIES["dream"]
    if model_type == "qwen3" or "qwen3" in archs:
        if config.get("mask_token_id") is not None or (path is not None and has_mask_token(path)):
            return FAMILIES["refusion"]
        return FAMILIES["qwen3"]
    raise FamilyError(
        f"cannot tell the model family of model_type {config.get('model_type')!r} "
        f"(architectures {config.get('architectures')}); choose one with --family ({', '.join(FAMILIES)})"
    )


def resolve_family(path: str | os.PathLike, family: str | Family | None = None) -> Family:
    """``family`` when given (a name or a :class:`Family`), else the one detected from the folder."""
    if isinstance(family, Family):
        return family
    if family:
        return get_family(family)
    return detect_family(read_config(path), path)


def family_of_model(model: Any) -> Family:
    """The family of an in-memory model (from its config; no tokenizer files)."""
    return detect_family(model.config.to_dict())


# --------------------------------------------------------------------------------------- loading
def auto_class(config: dict[str, Any]):
    """``AutoModelForCausalLM`` unless the folder's own code only registers ``AutoModel`` (Dream)."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto_map = config.get("auto_map") or {}
    if auto_map and "AutoModelForCausalLM" not in auto_map and "AutoModel" in auto_map:
        return AutoModel
    return AutoModelForCausalLM


def needs_remote_code(config: dict[str, Any], family: Family) -> bool:
    """Whether loading needs the folder's own code: the family says so, or its model type is unknown to
    transformers and the config maps it to code in the folder (``auto_map``)."""
    if family.remote_code:
        return True
    from transformers import CONFIG_MAPPING

    return bool(config.get("auto_map")) and config.get("model_type") not in CONFIG_MAPPING


def uses_native(family: Family, trust_remote_code: bool = False, native: bool | None = None) -> bool:
    """Whether ``family`` loads through :mod:`refusion.models.native`: ``native`` when given (True for a
    family without a native mapping is an error), else for a family with one unless remote code is trusted."""
    if native is None:
        return family.native is not None and not trust_remote_code
    if native and family.native is None:
        raise FamilyError(f"family {family.name!r} has no native mapping; native loading serves: "
                          f"{', '.join(f.name for f in FAMILIES.values() if f.native)}")
    return bool(native)


# -------------------------------------------------------------------------------------- adapters
class RemoteCodeAdapter(torch.nn.Module):
    """Calls a remote-code model with the backbone's keywords (``input_ids, position_ids, attention_mask,
    cache, use_cache``) and returns its output (``.logits``). Subclasses translate the keywords."""

    family = ""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    @property
    def config(self) -> Any:
        return self.inner.config

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def _no_cache(self, cache: Any) -> None:
        if cache is not None:
            raise FamilyError(
                f"the {self.family} adapter runs without a KV cache (its modeling code has its own cache "
                "format); use the llada decoder with kv_cache: none, or load the checkpoint natively "
                "(without --trust-remote-code), which has one"
            )

    @staticmethod
    def _is_full(mask: torch.Tensor | None) -> bool:
        """Whether a 2D 1/0 mask or 4D additive mask lets every query see every key."""
        if mask is None:
            return True
        return bool((mask == 1).all()) if mask.dim() == 2 else bool((mask == 0).all())


class LladaAdapter(RemoteCodeAdapter):
    """LLaDA's ``forward(input_ids, attention_mask, attention_bias, ...)``: no ``position_ids`` (positions
    are 0..T-1), a float ``attention_bias`` is added to the scores, no mask means full attention."""

    family = "llada"

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=False, **kw):
        self._no_cache(cache)
        T = input_ids.shape[1]
        if position_ids is not None and not torch.equal(
            position_ids, torch.arange(T, device=position_ids.device).expand_as(position_ids)
        ):
            raise FamilyError("LLaDA's modeling code numbers positions 0..T-1 itself; other position ids are not supported")
        # use_cache given: under transformers 5 LLaDA's config has no use_cache default for its forward to read
        if self._is_full(attention_mask):
            return self.inner(input_ids=input_ids, use_cache=False)
        if attention_mask.dim() == 2:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.inner(input_ids=input_ids, attention_bias=attention_mask.float(), use_cache=False)


class DreamAdapter(RemoteCodeAdapter):
    """Dream's ``forward(input_ids, attention_mask, position_ids, ...)`` passes a tensor mask straight to
    SDPA (so a 2D mask must not be given); no mask means full attention."""

    family = "dream"

    def forward(self, input_ids, position_ids=None, attention_mask=None, cache=None, use_cache=False, **kw):
        self._no_cache(cache)
        if self._is_full(attention_mask):
            attention_mask = None
        elif attention_mask.dim() == 2:
            keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T] key padding -> additive
            attention_mask = torch.zeros(keep.shape, dtype=self.dtype, device=keep.device).masked_fill(
                ~keep, torch.finfo(self.dtype).min)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)


ADAPTERS = {"llada": LladaAdapter, "dream": DreamAdapter}


def adapt_model(model: torch.nn.Module, family: Family) -> torch.nn.Module:
    """Wrap a remote-code model in its family's forward adapter (other models are returned as they are)."""
    if family.adapter is None or isinstance(model, RemoteCodeAdapter):
        return model
    return ADAPTERS[family.adapter](model).eval()


def backbone_kwargs(family: Family, model: Any, tokenizer: Any) -> dict[str, Any]:
    """The :class:`~refusion.models.backend.Backbone` keyword arguments a family decides."""
    vocab = getattr(model.config, "vocab_size", None)
    mask_id = family.resolve_mask_id(model.config, tokenizer, vocab)
    if mask_id is None and family.mask_required:
        raise MaskTokenError(
            f"family {family.name!r} needs a [MASK] token, but neither config.mask_token_id nor the tokenizer "
            "has one; add one (tokenizer.add_special_tokens({'mask_token': '<|mask|>'}), resize the embeddings, "
            "set config.mask_token_id) or choose another family with --family"
        )
    return dict(
        mask_id=mask_id, mask_required=family.mask_required, eos_ids=family.resolve_eos_ids(model.config, tokenizer, vocab),
        attention=family.attention, family=family.name,
        logits_shifted=family.logits_shifted or bool(getattr(model.config, "refusion_logits_shifted", False)),
    )


def add_refusion_tokens(model: Any, tokenizer: Any) -> tuple[int, int]:
    """Prepare a Qwen3 checkpoint for ReFusion fine-tuning: add ``<|beginoftext|>`` then ``<|mask|>`` (the
    mask token), resize the embeddings only if the vocabulary outgrows them, and record
    ``config.mask_token_id``. On the Qwen3 tokenizer (151669 tokens) the ids are ReFusion's 151669 /
    151670 (Qwen3-8B's embedding matrix already has 151936 rows). Returns ``(beginoftext_id, mask_id)``."""
    tokenizer.add_tokens(["<|beginoftext|>"], special_tokens=True)
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})
    bos, mask = (int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|beginoftext|>", "<|mask|>"))
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.mask_token_id = mask
    return bos, mask
