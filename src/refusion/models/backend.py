"""The backbone adapter: a Hugging Face causal LM driven with explicit position ids over a KV cache.

Every forward goes through :meth:`Backbone.forward`, which counts forward calls (NFE), tokens fed and
logits rows computed, passes an attention mask wherever there is no cache (transformers builds a
packed-sequence mask for non-monotone position ids without one), computes logits only at the positions
the caller reads, keeps them on the model's device, flags non-finite logits, and sets the [MASK] logit
to the lowest float, so no decoder ever emits [MASK] as a token. The KV caches the decoders run on, and
their operations, live in :mod:`refusion.models.kvcache`; :meth:`Backbone.forward` takes any transformers
``Cache`` of 5.x.

Two opt-in instruments: ``forward_log`` (a list) receives the :class:`ForwardShape` of every forward
(what :mod:`refusion.experiments.costmodel` prices), and ``compile`` (a ``torch.compile`` mode) runs the
model call compiled (:func:`compiled_call`), or with ``aot`` exported and compiled ahead of time
(:class:`~refusion.models.aot.AotForward`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from refusion.core import host
from refusion.core.errors import MaskTokenError
from refusion.models.aot import AotForward
from refusion.models.loading import AOT_MODE, resolve_model_path
from refusion.models.kvcache import DenseCache
from refusion.models.ragged_forward import (GROUP_KEYS_CPU, OffsetLayer, install_key_groups, install_row_head,
                                            key_groups_setting)

ATTENTION_KINDS = ("causal", "bidirectional", "block_causal")

#: which fed positions' logits a forward computes: a slice, a 1-D index tensor, or None (no logits)
LogitsAt = slice | Tensor | None
ALL_ROWS = slice(None)


@dataclass(frozen=True)
class ForwardShape:
    """What one forward computed: ``rows`` sequences (cache rows) of ``fed`` new tokens each after ``past``
    cached columns, ``logits_rows`` rows through the output head (summed over rows), and its ``kind``:
    ``causal`` (no mask: a dense cache's causal forward), ``masked`` (a dense cache with a 4D mask of
    full attention), ``segments`` (the same with a block-causal mask built from segment ids), ``ragged`` (a
    batch's shared cache, every request causal) or ``ragged_masked`` (the same with a request of full or
    block-causal attention, whose mask is built per row). ``seconds``: the model call's wall time when
    :attr:`Backbone.time_forwards` is on, else None."""

    rows: int
    fed: int
    past: int
    logits_rows: int
    kind: str
    seconds: float | None = None


#: ``torch.compile``'s ``dynamic`` argument for :func:`compiled_call`: symbolic sizes from the first call, so
#: the growing cache length and the changing widths of the decoders' forwards share one graph
COMPILE_DYNAMIC = True


def compiled_call(model: PreTrainedModel, mode: str):
    """``model`` (its ``__call__``) through ``torch.compile(mode=mode, dynamic=COMPILE_DYNAMIC)``; the module
    itself is left as it is (its weights are shared, its config and dtype read as before)."""
    import torch._dynamo

    # every distinct cache object type / layer count is one more graph; the default limit (8) would make
    # a long-running process fall back to eager without a word
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    setattr(config, limit, max(getattr(config, limit), 64))
    # the per-row output head's rows (``lm_head.refusion_rows``, a tensor attribute of a torch.nn module:
    # :func:`~refusion.models.ragged_forward.install_row_head`) change length every batched call; dynamo
    # would take such an attribute's shape as static and compile a graph per length (parameters and
    # buffers stay static: ``force_parameter_static_shapes``)
    config.force_nn_module_property_static_shapes = False
    # no "duck sizing": a ragged batch's cache buffers have as many rows as the call has rows only while every
    # sequence takes part; equal sizes sharing one symbol would compile a second graph for when they differ
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    return torch.compile(model, mode=mode, dynamic=COMPILE_DYNAMIC)


def plain(t: Tensor) -> Tensor:
    """``t`` itself when it is contiguous and not a view, else a contiguous copy. A compiled graph is
    specialised to its inputs' strides and to whether each is a view (dynamo guards a view's base), so an
    input given as a slice, a transposed or an expanded view would compile a graph of its own."""
    return t if t._base is None and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def contiguous_layers(cache: Cache) -> None:
    """Make each layer's ``keys`` / ``values`` of a dense transformers cache :func:`plain`, in place. A
    prefill leaves them as a transposed view of the projection and a crop as a narrower view of the old
    tensor: one copy of the cache, only where it is such a view, instead of a graph per layout."""
    for layer in cache.layers:
        if isinstance(layer, OffsetLayer) or getattr(layer, "keys", None) is None:
            continue
        layer.keys, layer.values = plain(layer.keys), plain(layer.values)


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
        compile: str | None = None,
    ) -> None:
        self.model = model.eval()
        #: whether a batched forward can run the output head on each row's own positions; its hook goes in
        #: now, before any compiled call (:func:`~refusion.models.ragged_forward.install_row_head` says why)
        self.head_per_row = install_row_head(self.model)
        #: one more attention group's price in (row, key) pairs in a batched forward, where consecutive rows
        #: whose keys end early attend over fewer keys (:meth:`use_key_groups`); None: every row attends over
        #: the longest row's keys (the default; ``$REFUSION_KEY_GROUPS``:
        #: :func:`~refusion.models.ragged_forward.key_groups_setting`)
        self.group_keys: float | None = None
        #: the ``--compile`` mode the forwards run under (None: eager); see :func:`compiled_call`, and
        #: :class:`~refusion.models.aot.AotForward` for ``aot`` (whose other calls run ``default``)
        self.compile = compile
        setting = key_groups_setting()  # $REFUSION_KEY_GROUPS: off (unset), auto (on the CPU) or a price
        if setting == "auto" and next(self.model.parameters()).device.type == "cpu":
            self.use_key_groups()
        elif setting not in ("auto", None):
            self.use_key_groups(setting)
        self._call = self.model if compile is None else compiled_call(self.model, "default" if compile == AOT_MODE else compile)
        #: under ``aot``: the compiled forward (its ``fallbacks`` and per-kind ``calls``); else None
        self.aot = AotForward(self.model, fallback=self._call) if compile == AOT_MODE else None
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
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        #: where inputs and the decoders' tensors live (the embedding's device: the first shard with device_map)
        self.device = embed.weight.device if embed is not None else next(model.parameters()).device
        self.nfe = 0  # forward calls
        self.tokens_in = 0  # tokens fed (batch x length, summed over forwards)
        self.logits_rows = 0  # rows that went through the output head (batch x rows read, summed)
        #: with ``time_forwards``, every forward synchronises before and after the model call and adds its
        #: wall time to ``forward_s`` (``refusion profile``); off for decoding, where it would cost two syncs
        self.time_forwards = False
        self.forward_s = 0.0
        #: the clock ``time_forwards`` reads (``time.thread_time``: this thread's CPU time, as the cost model's
        #: ``--clock cpu`` times decodes)
        self.forward_clock: Callable[[], float] = time.perf_counter
        #: when a list, every forward appends its :class:`ForwardShape` (the cost model's input); None: off
        self.forward_log: list[ForwardShape] | None = None
        self._finite = torch.ones((), dtype=torch.bool, device=self.device)

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
        cls, name_or_path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype | str | None = None,
        trust_remote_code: bool = False, family: str | None = None, attn_implementation: str | None = None,
        device_map: str | dict | None = None, compile: str | None = None,
    ) -> "Backbone":
        """Load a local folder / shipped checkpoint; its family (detected from ``config.json``, or ``family``)
        decides attention, mask id, logits shift and EOS ids (:mod:`refusion.models.families`). ``dtype``,
        ``attn_implementation``, ``device_map`` and ``compile`` default as
        :class:`~refusion.models.loading.Runtime` says (bfloat16 on CUDA, float32 on CPU; sdpa; eager) and
        are checked there with errors naming the option."""
        from refusion.models import checkpoint, families
        from refusion.models.loading import Runtime

        runtime = Runtime.resolve(device=device, dtype=dtype, attn_implementation=attn_implementation,
                                  device_map=device_map, compile=compile)
        path = resolve_model_path(name_or_path)
        fam = families.resolve_family(path, family)
        model, tokenizer = checkpoint.load_model(path, fam, runtime=runtime, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, **families.backbone_kwargs(fam, model, tokenizer), compile=runtime.compile)

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

    def use_key_groups(self, price: float | None = GROUP_KEYS_CPU) -> bool:
        """Batched forwards attend in key groups (:func:`~refusion.models.ragged_forward.key_groups`, one
        more group priced at ``price`` (row, key) pairs), or not (None). Only an uncompiled model attending
        through sdpa takes them (its attention implementation becomes
        :data:`~refusion.models.ragged_forward.GROUPED_SDPA`, sdpa outside a grouped forward); returns
        whether the forwards now attend in groups. Opt-in (or ``REFUSION_KEY_GROUPS=auto``): a server's
        block-diffusion calls attend a quarter fewer (row, key) pairs and take 3 - 6% less engine CPU time
        in each run measured, within each run's spread; forwards of one token a row never split
        (docs/serving.md#key-groups)."""
        if price is None:
            self.group_keys = None
            return False
        if not price >= 0:  # NaN included
            raise ValueError(f"key groups: the price of a group must be 0 or more, got {price}")
        if self.compile is not None or not install_key_groups(self.model):
            return False
        self.group_keys = float(price)
        return True

    # ----------------------------------------------------------------- forward
    def new_cache(self) -> DenseCache:
        """An empty KV cache for one sequence (:class:`~refusion.models.kvcache.DenseCache`)."""
        return DenseCache(self)

    @torch.no_grad()
    def forward(
        self, ids: Tensor, pos: Tensor, cache: Cache | None, keep_kv: bool = True,
        attn_mask: Tensor | None = None, logits_at: LogitsAt = ALL_ROWS, kind: str | None = None,
    ) -> Tensor | None:
        """Logits ``[B, n, V]`` (float32, on ``self.device``) of ``ids [B, T]`` at positions ``pos [B, T]``
        after ``cache``, for the ``n`` fed positions ``logits_at`` names: a slice (``ALL_ROWS`` = every
        one), a 1-D index tensor, or ``None`` for no logits at all (a prefill), which returns None.

        Only those rows go through the output head (``logits_to_keep``), so a decoder that reads a few
        rows never pays for a full-vocabulary head over every fed token; only they are cast to float32,
        scanned for non-finite values (a device-side flag, raised by :meth:`check_finite` at the end of a
        decode, so the scan costs no synchronisation) and have the [MASK] logit set to the lowest float.

        With ``keep_kv`` the new tokens' KV stays in ``cache`` (appended after its current length);
        without, the cache is cropped back to its length before the call. ``attn_mask``: a 4D float
        additive mask ``[B, 1, T, cached + T]`` (0 = attend, finfo(model dtype).min = blocked) used
        instead of the causal default, for bidirectional / block-causal models. ``kind``: what
        :attr:`forward_log` records as the call's :attr:`ForwardShape.kind` (the caches say which mask they
        built); by default ``ragged`` over an :class:`OffsetLayer` cache, else ``masked`` with a mask, else
        ``causal``.
        """
        if ids.dim() == 1:
            ids, pos = ids[None], pos[None]
        ids = ids.to(self.device, non_blocking=True)
        pos = pos.to(self.device, non_blocking=True)
        past = cache.get_seq_length() if cache is not None else 0
        T = ids.shape[1]
        if attn_mask is not None:
            if attn_mask.dim() != 4 or tuple(attn_mask.shape[-2:]) != (T, past + T):
                raise ValueError(f"attn_mask must be [B, 1, {T}, {past + T}], got {tuple(attn_mask.shape)}")
            mask = attn_mask.to(self.device, non_blocking=True)
        elif cache is None:  # without a cache, non-monotone position ids need a mask (else: packed sequences)
            mask = torch.ones(ids.shape[0], T, dtype=torch.long, device=self.device)
        else:  # causal over the cache; no 2D all-ones mask, whose check inside the model would synchronise
            mask = None
        rows = self._rows(logits_at, T)
        if self.compile is not None:  # one graph per kind of call, not per layout of its inputs
            ids, pos = plain(ids), plain(pos)
            if cache is not None:
                contiguous_layers(cache)
        if self.time_forwards:
            self.synchronize()
            t0 = self.forward_clock()
        call = self._call if self.aot is None else partial(self.aot, keep_kv=keep_kv)
        out = call(
            input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=cache is not None,
            logits_to_keep=rows,
        )
        seconds = None
        if self.time_forwards:
            self.synchronize()
            seconds = self.forward_clock() - t0
            self.forward_s += seconds
        if self.forward_log is not None:
            kind = kind or ("ragged" if cache is not None and cache.layers and isinstance(cache.layers[0], OffsetLayer)
                            else "causal" if attn_mask is None else "masked")
            n_rows = rows.numel() if isinstance(rows, Tensor) else (T if rows == 0 else rows)
            head_rows = getattr(self.model, "refusion_logits_rows", None)  # the head on each row's own positions
            n_logits = int(head_rows.numel()) if head_rows is not None else int(ids.shape[0]) * n_rows
            self.forward_log.append(ForwardShape(int(ids.shape[0]), T, past, n_logits, kind, seconds))
        self.nfe += 1
        self.tokens_in += ids.numel()
        if cache is not None and not keep_kv and cache.get_seq_length() > past:
            cache.crop(past - cache.get_seq_length())  # transformers 5 crops by a negative count
        logits = None
        if logits_at is not None:
            logits = out.logits
            n = rows.numel() if isinstance(rows, Tensor) else (T if rows == 0 else rows)
            if logits.shape[1] != n:  # a model that ignores logits_to_keep (remote-code adapters)
                logits = logits[:, rows] if isinstance(rows, Tensor) else logits[:, T - n :]
            logits = logits.float()
            self.logits_rows += logits.shape[0] * logits.shape[1]
            # one reduction: any NaN or inf makes the sum non-finite (bounded logits cannot overflow it)
            self._finite = self._finite & torch.isfinite(logits.sum())
            if self._mask_id is not None:
                logits[..., self._mask_id] = torch.finfo(logits.dtype).min  # [MASK] is never a token to generate
        return logits

    def _rows(self, logits_at: LogitsAt, T: int) -> int | Tensor:
        """``logits_to_keep`` for ``logits_at`` over ``T`` fed positions: an int n (the last n; 0 = all) or
        a 1-D index tensor on the device (empty for no logits)."""
        if logits_at is None:
            return torch.empty(0, dtype=torch.long, device=self.device)
        if isinstance(logits_at, Tensor):
            return logits_at.to(self.device, non_blocking=True)
        start, stop, step = logits_at.indices(T)
        if step == 1 and stop == T and start < T:
            return 0 if start == 0 else T - start
        return torch.arange(start, stop, step, device=self.device)  # empty when the slice is

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteLogitsError` if any logits row read since the last call held NaN or inf.
        One synchronisation; :meth:`Decoder.generate` calls it once per decode."""
        if not host.to_host(self._finite)[0]:
            self._finite = torch.ones((), dtype=torch.bool, device=self.device)
            raise NonFiniteLogitsError(
                f"a forward produced NaN/inf logits (dtype {self.model.dtype}); check the checkpoint "
                "and try --dtype float32"
            )
