"""Decoder configuration: pydantic v2 models, YAML/TOML files and ``--set key=value`` overrides.

A config is a flat mapping: ``decoder`` names a registered decoder, the other top-level keys are that
decoder's options. Options whose field name is a part kind (``scorer``, ``drafter``, ``selector``,
``verifier``, ``extender``, ``cache``, ``remasker``, ``proposer``, ``acceptance``) name a registered part,
either as a bare string or as a mapping with ``name`` plus that part's own options::

    decoder: refusion
    gen_length: 256
    slot_size: 8
    scorer: mean_prob                       # swapping the scorer is this one line
    selector: {name: threshold, slot_threshold: 0.9}
    verifier: {name: prefix, token_threshold: 0.4}

Every level rejects unknown fields, and errors name the field (``selector.slot_threshold``). An extender
is bound to the verifier beside it (:meth:`~refusion.core.interfaces.Extender.bind`): the default ``prefix``
extender takes the verifier's ``token_threshold`` unless given its own. A decoder refuses combinations of
options and parts it cannot run (:meth:`~refusion.core.interfaces.Decoder.check_parts`), naming the fields.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from refusion.core.interfaces import Decoder, DecoderOptions, Part
from refusion.core.registry import KINDS, Registry, get_registry

if TYPE_CHECKING:
    from refusion.models.backend import Backbone

PART_KINDS = tuple(k for k in KINDS if k not in ("decoder", "objective"))


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


class PartSpec(BaseModel):
    """A part chosen by registered ``name``; the remaining fields are that part's options."""

    model_config = ConfigDict(extra="allow")
    name: str

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def part_options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def dump(self) -> str | dict[str, Any]:
        return {"name": self.name, **self.part_options} if self.model_extra else self.name


def part_fields(options_cls: type[BaseModel]) -> dict[str, str]:
    """Field name -> default part name, for the fields of a decoder's Options that are parts."""
    out = {}
    for fname, info in options_cls.model_fields.items():
        if fname in PART_KINDS and info.annotation is PartSpec:
            out[fname] = info.default.name
    return out


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error as ``field.path: message (got value)``, one per error, joined by ``; ``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        got = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{loc}: {msg}{got}" if loc else msg)
    return "; ".join(lines)


def validate_config(config: dict[str, Any], registry: Registry | None = None) -> tuple[type[Decoder], DecoderOptions, dict[str, Part]]:
    """Validate a config mapping -> (decoder class, its options, its instantiated parts)."""
    registry = registry or get_registry()
    cfg = dict(config)
    if "decoder" not in cfg:
        raise ConfigError(f"decoder: missing; allowed: {', '.join(registry.names('decoder'))}")
    try:
        dec_cls = registry.get("decoder", str(cfg.pop("decoder")))
    except ValueError as e:
        raise ConfigError(f"decoder: {e}") from None
    defaults = part_fields(dec_cls.Options)
    for fname, default_name in defaults.items():  # `selector.slot_threshold=...` without a name keeps the default part
        if isinstance(cfg.get(fname), dict) and "name" not in cfg[fname]:
            cfg[fname] = {"name": default_name, **cfg[fname]}
    try:
        options = dec_cls.Options.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(f"invalid {dec_cls.name} config: {format_validation_error(e)}") from None
    parts: dict[str, Part] = {}
    for kind in defaults:
        spec: PartSpec = getattr(options, kind)
        try:
            part_cls = registry.get(kind, spec.name)
        except ValueError as e:
            raise ConfigError(f"{kind}: {e}") from None
        try:
            part_opts = part_cls.Options.model_validate(spec.part_options)
        except ValidationError as e:
            raise ConfigError(f"invalid {dec_cls.name} config: {format_validation_error(e, kind)}") from None
        parts[kind] = part_cls(part_opts)
    if "extender" in parts and "verifier" in parts:  # Stage II-b runs beside Stage II-a's verifier
        try:
            parts["extender"] = parts["extender"].bind(parts["verifier"])
        except ValueError as e:
            raise ConfigError(f"extender: {e}") from None
    try:
        dec_cls.check_parts(options, parts)
    except ValueError as e:
        raise ConfigError(f"invalid {dec_cls.name} config: {e}") from None
    for n, entry in scheduled_configs(config, options).items():
        try:
            validate_config(entry, registry)
        except ConfigError as e:
            raise ConfigError(f"batch_schedule.{n}: {e}") from None
    return dec_cls, options, parts


def scheduled_configs(config: dict[str, Any], options: DecoderOptions) -> dict[int, dict[str, Any]]:
    """Batch size -> the full config of each ``batch_schedule`` entry: ``config`` without the schedule,
    with the entry's options over it. A part given as a mapping without a new ``name`` keeps the part and
    its other options; a part named anew (a string, or a mapping with another name) starts from its
    defaults."""
    base = {k: v for k, v in config.items() if k != "batch_schedule"}
    out = {}
    for n, entry in sorted((options.batch_schedule or {}).items()):
        merged = dict(base)
        for key, value in entry.items():
            old = merged.get(key)
            if key in PART_KINDS and isinstance(value, dict) and not isinstance(old, (int, float, bool)):
                old = {"name": old} if isinstance(old, str) else dict(old or {})
                same = "name" not in value or value["name"] == old.get("name")
                merged[key] = {**old, **value} if same else dict(value)
            else:
                merged[key] = value
        out[n] = merged
    return out


def build_decoder(backbone: "Backbone", config: dict[str, Any], registry: Registry | None = None) -> Decoder:
    """Validate ``config`` and instantiate the decoder on ``backbone`` (refuses a mismatched model), with
    one decoder per ``batch_schedule`` entry (:meth:`~refusion.core.interfaces.Decoder.for_batch`)."""
    dec_cls, options, parts = validate_config(config, registry)
    decoder = dec_cls(backbone, options, parts)
    decoder.schedule = {n: build_decoder(backbone, entry, registry)
                        for n, entry in scheduled_configs(config, options).items()}
    return decoder


def dump_config(decoder: str, options: DecoderOptions) -> dict[str, Any]:
    """A config mapping that :func:`validate_config` turns back into ``options``."""
    out: dict[str, Any] = {"decoder": decoder}
    for fname in type(options).model_fields:
        value = getattr(options, fname)
        out[fname] = value.dump() if isinstance(value, PartSpec) else value
    return out


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file into a mapping; ``-`` reads YAML
    from standard input."""
    if str(path) == "-":
        data = yaml.safe_load(sys.stdin.read()) or {}
        if not isinstance(data, dict):
            raise ConfigError("config from standard input must hold a mapping at the top level")
        return data
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    if p.suffix == ".toml":
        data = tomllib.loads(text)
    elif p.suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    else:
        raise ConfigError(f"config file {str(p)!r}: unknown format {p.suffix!r}; allowed: .yaml, .yml, .toml")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides (dotted keys reach part options; values parsed as YAML scalars).

    Every value given reaches validation, whatever the order: the last value given for a key wins, and
    a value set on a key keeps what earlier overrides set below it. ``selector=threshold`` after
    ``selector.slot_threshold=0.8`` (or before it) gives ``{name: threshold, slot_threshold: 0.8}``; a
    mapping value keeps the earlier options it does not give itself. Options of the *config's* part are
    dropped when an override names a part (that part starts from its defaults). A scalar that is not a
    part name set on a key that earlier overrides gave options is refused, naming both keys.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    given: list[tuple[list[str], Any, str]] = []  # (path, value, the override as written), in order
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value")
        value = yaml.safe_load(raw) if raw.strip() else ""
        path = key.strip().split(".")
        below = [(p, v, it) for p, v, it in given if len(p) > len(path) and p[:len(path)] == path]
        if below and not isinstance(value, (str, dict)):
            raise ConfigError(f"--set {item!r} conflicts with --set {below[0][2]!r}: {key.strip()} is set to a "
                              f"{type(value).__name__}, which has no options; give only one of them")
        given.append((path, value, item))
        _apply(out, given, len(given) - 1)
    return out


def _apply(out: dict[str, Any], given: list[tuple[list[str], Any, str]], i: int) -> None:
    """Set override ``given[i]``, then again the earlier ones below its key that its value does not give
    itself (each with the same rule), in their order."""
    path, value, _ = given[i]
    _set_path(out, path, value)
    for j, (p, _, _) in enumerate(given[:i]):
        if len(p) > len(path) and p[:len(path)] == path and not _has_path(value, p[len(path):]):
            _apply(out, given, j)


def _set_path(root: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``root[path[0]]...[path[-1]] = value``; a string on the way becomes ``{"name": string}`` (a part
    named by a bare string), anything else that is not a mapping an empty mapping."""
    node = root
    for part in path[:-1]:
        child = node.get(part)
        if isinstance(child, str):
            child = {"name": child}
        elif isinstance(child, dict):
            child = dict(child)
        else:
            child = {}
        node[part] = child
        node = child
    node[path[-1]] = dict(value) if isinstance(value, dict) else value


def _has_path(value: Any, path: list[str]) -> bool:
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def add_decoder_config_args(p: Any, model_required: bool = True) -> None:
    """``--model`` and the flags :func:`decoder_config` reads (``--decoder``, ``--config``, ``--set``), as
    ``refusion generate`` and ``refusion serve`` take them (``p``: an argparse parser)."""
    p.add_argument("--model", required=model_required, help="model folder or shipped checkpoint name")
    p.add_argument("--decoder", default="", help="registered decoder name (ar, refusion, llada, block, speculative, "
                                                 "or a plugin's)")
    p.add_argument("--config", help="YAML or TOML decoder config ('-': YAML from standard input)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")


def decoder_config(decoder: str, config_file: str | None, overrides: list[str]) -> dict[str, Any]:
    """The config mapping from ``--decoder``, ``--config`` and ``--set`` (later ones win)."""
    cfg = load_config_file(config_file) if config_file else {}
    if decoder:
        if cfg.get("decoder", decoder) != decoder:
            raise ConfigError(f"--decoder {decoder!r} contradicts decoder {cfg['decoder']!r} in {config_file}")
        cfg["decoder"] = decoder
    return apply_overrides(cfg, overrides)
