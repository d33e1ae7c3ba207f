"""Per-request decoders: the served config plus a request's ``refusion`` options, ``temperature`` and
``max_tokens``, validated by the decoder's own options model.

Requests that differ in decoder options still share one running batch: every request gets a decoder of
the served class on the served backbone (built from its own options), and the loops of such decoders run
side by side over one shared cache (:meth:`~refusion.decoders.common.LoopDecoder.batch_loop`); a loop
reads only its own decoder's options. What a request may not change is what the batch shares: the
decoder (``refusion.decoder``) and the model. Validated options are cached per distinct set of options
(parts built once per set), decoders per (options, ``max_tokens``), both bounded.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError

from refusion.core.config import (
    ConfigError, apply_overrides, dump_config, format_validation_error, part_fields, validate_config,
)
from refusion.core.interfaces import Decoder
from refusion.decoders.common import LoopDecoder
from refusion.serve.protocol import RequestError

#: the extension field that carries a request's decoder options
EXTENSION = "refusion"
#: how many distinct option sets (and decoders) the pool keeps
CACHE_SIZE = 64
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def flatten(options: dict[str, Any], prefix: str = "") -> list[str]:
    """``{"selector": {"slot_threshold": 0.8}}`` -> ``["selector.slot_threshold=0.8"]`` (values as JSON,
    which the config's ``key=value`` overrides read as YAML); refuses keys that are not option names."""
    out: list[str] = []
    for key, value in options.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str) or not _KEY.match(key):
            raise RequestError(400, f"{EXTENSION}.{path}", f"{EXTENSION}.{path}: not an option name")
        if isinstance(value, dict) and value:
            out += flatten(value, path + ".")
        else:
            out.append(f"{path}={json.dumps(value)}")
    return out


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What requests are checked against when the backbone lives in another process (``refusion serve
    --engine process``, the default): its tokenizer, EOS ids and maximum positions."""

    tokenizer: Any
    eos_ids: set[int]
    max_positions: int


class DecoderPool:
    """The served decoder config and the decoders of its requests (see the module docstring). ``backbone``:
    the served backbone, or a :class:`ModelInfo` of one in another process, for which the pool checks
    requests (:meth:`validate`) and builds no decoder."""

    def __init__(self, backbone, config: dict[str, Any]) -> None:
        dec_cls, options, parts = validate_config(config)
        if not issubclass(dec_cls, LoopDecoder) or not dec_cls.serves_batch_loop():
            raise ConfigError(f"decoder: {dec_cls.name!r} cannot be served: the server runs decoders whose loops "
                              "share one batch cache (ar, refusion, llada, block, speculative and other "
                              "LoopDecoders whose batch runs batch_loop over new_batch_cache)")
        self.backbone = backbone
        self.config = dump_config(dec_cls.name, options)
        self.name = dec_cls.name
        self.base: Decoder | None = None if isinstance(backbone, ModelInfo) else dec_cls(backbone, options, parts)
        self._options: OrderedDict[str, tuple] = OrderedDict()  # options key -> (options, parts)
        self._sized: OrderedDict[tuple[str, int], Any] = OrderedDict()  # (key, gen_length) -> options
        self._decoders: OrderedDict[tuple[str, int], Decoder] = OrderedDict()
        fields = dec_cls.Options.model_fields
        #: where a request's temperature goes: the decoder's own option, its drafter's, or nowhere (greedy)
        self.temperature_path = ("temperature" if "temperature" in fields else
                                 "drafter.temperature" if "drafter" in part_fields(dec_cls.Options) else None)

    def decoder(self, options: dict[str, Any] | None, temperature: float | None, max_tokens: int | None,
                prompt_len: int) -> Decoder:
        """The decoder of one request (cached); raises a :class:`RequestError` naming the field."""
        key, gen_length, opts, parts = self.validate(options, temperature, max_tokens, prompt_len)
        if self.base is None:
            raise RuntimeError("this pool checks requests for a backbone in another process; it builds no decoder")
        if (key, gen_length) not in self._decoders:
            self._decoders[key, gen_length] = type(self.base)(self.backbone, opts, parts)
            while len(self._decoders) > CACHE_SIZE:
                self._decoders.popitem(last=False)
        self._decoders.move_to_end((key, gen_length))
        return self._decoders[key, gen_length]

    def validate(self, options: dict[str, Any] | None, temperature: float | None, max_tokens: int | None,
                 prompt_len: int) -> tuple[str, int, Any, dict]:
        """A request's decoder settings checked (cached) -> (options key, gen_length, options, parts); raises a
        :class:`RequestError` naming the field."""
        overrides = self._overrides(options or {}, temperature)
        key = json.dumps(overrides)
        if key not in self._options:
            cfg = apply_overrides(dict(self.config), overrides) if overrides else dict(self.config)
            try:
                _, opts, parts = validate_config(cfg)
            except ConfigError as e:
                field = "temperature" if temperature is not None and "temperature" in str(e) else EXTENSION
                raise RequestError(400, field, f"{field}: {e}") from None
            self._options[key] = (opts, parts)
            while len(self._options) > CACHE_SIZE:
                self._options.popitem(last=False)
        self._options.move_to_end(key)
        opts, parts = self._options[key]
        gen_length = opts.gen_length if max_tokens is None else max_tokens
        self._check_length(prompt_len, gen_length, max_tokens is not None)
        if (key, gen_length) not in self._sized:
            if gen_length != opts.gen_length:
                cfg = dump_config(self.name, opts)
                cfg.pop("decoder")
                try:
                    opts = type(opts).model_validate({**cfg, "gen_length": gen_length})
                except ValidationError as e:
                    raise RequestError(400, "max_tokens", f"max_tokens: {gen_length} does not fit the decoder's "
                                       f"options: {format_validation_error(e)}") from None
            self._sized[key, gen_length] = opts
            while len(self._sized) > CACHE_SIZE:
                self._sized.popitem(last=False)
        self._sized.move_to_end((key, gen_length))
        return key, gen_length, self._sized[key, gen_length], parts

    def _overrides(self, options: dict[str, Any], temperature: float | None) -> list[str]:
        for name, instead in (("decoder", None), ("gen_length", "max_tokens"), ("seed", "seed")):
            if name in options and not (name == "decoder" and options[name] == self.name):
                hint = f"use the request's {instead}" if instead else f"this server serves {self.name!r}"
                raise RequestError(400, f"{EXTENSION}.{name}", f"{EXTENSION}.{name}: not a per-request option "
                                   f"({hint})")
        overrides = flatten({k: v for k, v in options.items() if k != "decoder"})
        if temperature is not None:
            if self.temperature_path is None:
                if temperature != 0:
                    raise RequestError(400, "temperature", f"temperature: decoder {self.name!r} decodes greedily; "
                                       f"give 0 or leave it out (got {temperature})")
            elif any(o.split("=", 1)[0] == self.temperature_path for o in overrides):
                raise RequestError(400, "temperature", f"temperature: contradicts {EXTENSION}."
                                   f"{self.temperature_path}; give one of them")
            else:
                overrides.append(f"{self.temperature_path}={json.dumps(float(temperature))}")
        return overrides

    def _check_length(self, prompt_len: int, gen_length: int, asked: bool) -> None:
        limit = self.backbone.max_positions
        if prompt_len >= limit:
            raise RequestError(400, "prompt", f"prompt: {prompt_len} tokens; the model's maximum is {limit} "
                               "positions, prompt and completion together")
        if prompt_len + gen_length > limit:
            field = "max_tokens" if asked else "prompt"
            raise RequestError(400, field, f"{field}: prompt ({prompt_len} tokens) + max_tokens ({gen_length}) "
                               f"exceeds the model's maximum of {limit} positions; lower max_tokens to at most "
                               f"{limit - prompt_len}")
