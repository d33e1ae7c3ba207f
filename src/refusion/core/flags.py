"""Command-line flags read from a pydantic settings model, so that each default is defined once: in the model.

:func:`add_model_flags` adds one ``--flag`` per field of a model (``--batch-size`` for ``batch_size``; a
field's ``json_schema_extra={"flag": "--warmup"}`` renames it, ``{"flag": "--no-progress"}`` on a bool
that defaults to True makes an off switch), its help the field's description and its default as the model
says. The flags default to :data:`argparse.SUPPRESS`, so only what the command line gives reaches
:func:`settings_from_args`, which layers, later ones winning: the model's defaults, a ``--config`` YAML or
TOML file, the flags, then ``--set key=value`` items (values parsed as YAML; a dotted key reaches into a
mapping field). An invalid or unknown setting is a :class:`~refusion.core.config.ConfigError` naming the
field.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from refusion.core.config import ConfigError, load_config_file

M = TypeVar("M", bound=BaseModel)


def flag_of(model: type[BaseModel], name: str) -> str:
    """The command-line flag of ``model``'s field ``name``."""
    extra = model.model_fields[name].json_schema_extra
    return extra["flag"] if isinstance(extra, dict) and "flag" in extra else "--" + name.replace("_", "-")


def default_text(model: type[BaseModel], name: str) -> str:
    """The default of ``model``'s field ``name`` as help texts print it ("required" for none)."""
    info = model.model_fields[name]
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def _scalar(annotation: Any) -> Any:
    """The argparse ``type`` of a field: int, float or str (a list, tuple or mapping is passed as text and
    parsed by the model's validators)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return annotation if annotation in (int, float, str) else str


def add_model_flags(parser: argparse.ArgumentParser | Any, model: type[BaseModel], names: Iterable[str] | None = None,
                    help_prefix: str = "") -> list[str]:
    """Add the flags of ``model``'s fields ``names`` (default all) to ``parser``; returns the names added."""
    added = []
    for name in names or model.model_fields:
        info = model.model_fields[name]
        flag, default = flag_of(model, name), default_text(model, name)
        text = help_prefix + (info.description or name.replace("_", " ")).replace("%", "%%")
        if info.annotation is bool:
            if flag.startswith("--no-"):
                parser.add_argument(flag, dest=name, action="store_false", default=argparse.SUPPRESS,
                                    help=f"{text} (off; default on)")
            else:
                parser.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS,
                                    help=f"{text} (default {'on' if default == 'True' else 'off'})")
        else:
            kind = _scalar(info.annotation)
            parser.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                                metavar={int: "N", float: "X"}.get(kind, name.split("_")[-1].upper()),
                                help=f"{text} ({'required' if default == 'required' else f'default {default}'})")
        added.append(name)
    return added


def parse_sets(items: Iterable[str], where: str = "--set") -> dict[str, Any]:
    """``["a=1", "b.c=[4, 8]"]`` -> ``{"a": 1, "b": {"c": [4, 8]}}`` (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{where} expects key=value, got {item!r}")
        *path, last = key.strip().split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where} {item!r}: {part} is set to a value, not a mapping")
        node[last] = yaml.safe_load(value)
    return out


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys over it, mappings merged key by key."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def validate(model: type[M], data: dict[str, Any], where: str = "settings") -> M:
    """``model`` from ``data``; a :class:`ConfigError` naming each bad field (as its flag) otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        def name(loc: tuple) -> str:
            first = str(loc[0]) if loc else ""
            head = flag_of(model, first) if first in model.model_fields else first
            return ".".join([head, *map(str, loc[1:])])

        raise ConfigError(f"{where}: " + "; ".join(f"{name(x['loc'])}: {x['msg']}" for x in e.errors())) from None


def settings_from_args(model: type[M], args: argparse.Namespace, names: Iterable[str] | None = None,
                       config_file: str | Path | None = None, sets: Iterable[str] = (),
                       route_set: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                       fixed: dict[str, Any] | None = None) -> M:
    """``model`` from its defaults < ``config_file`` < the flags of ``names`` given in ``args`` (a flag left
    at None counts as not given) < ``sets`` (``key=value``; ``route_set`` may move keys, e.g. unknown ones
    into an options mapping) < ``fixed``."""
    data: dict[str, Any] = load_config_file(config_file) if config_file else {}
    given = {n: getattr(args, n) for n in (names or model.model_fields) if getattr(args, n, None) is not None}
    data = merge(data, given)
    extra = parse_sets(sets)
    data = merge(data, route_set(extra) if route_set else extra)
    data = merge(data, fixed or {})
    return validate(model, data, f"{config_file}" if config_file else "settings")
