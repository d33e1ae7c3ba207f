"""Hypothesis strategies for checking parts and decoders: part options drawn from their pydantic
``Options``, proposals with valid padding masks, slot layouts, probability grids, verified prefixes,
prompts and configs of any registered decoder with any registered parts.

Every strategy here draws only valid inputs of the interfaces in :mod:`refusion.core.interfaces`:
padding sits at the end of a row and position 0 of every slot is real; probabilities lie in [0, 1];
logits are finite.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

import annotated_types
import torch
from pydantic import BaseModel

from refusion.testing._hypothesis import st
from refusion.testing.models import MASK_ID

#: token ids a drawn prompt uses: past the char tokenizer's special tokens, inside its vocabulary
PROMPT_TOKENS = (4, 49)


def _bounds(info) -> tuple[float | None, float | None, bool, bool]:
    """(low, high, low exclusive, high exclusive) of a pydantic field's numeric constraints."""
    lo = hi = None
    lo_open = hi_open = False
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            hi = m.le
        elif isinstance(m, annotated_types.Lt):
            hi, hi_open = m.lt, True
    return lo, hi, lo_open, hi_open


def _value(annotation, info, none: bool, int_span: int, float_span: float):
    """A strategy for one field's values, or None when its type is not one drawn here."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner = [_value(a, info, none, int_span, float_span) for a in args]
        if any(s is None for s in inner):
            return None
        drawn = st.one_of(*inner)
        return st.one_of(st.none(), drawn) if none and type(None) in typing.get_args(annotation) else drawn
    if origin is Literal:
        return st.sampled_from(typing.get_args(annotation))
    if annotation is bool:
        return st.booleans()
    lo, hi, lo_open, hi_open = _bounds(info)
    if annotation is int:
        low = (int(lo) + (1 if lo_open else 0)) if lo is not None else 0
        high = (int(hi) - (1 if hi_open else 0)) if hi is not None else low + int_span
        return st.integers(low, min(high, low + int_span))
    if annotation is float:
        low = float(lo) if lo is not None else 0.0
        high = float(hi) if hi is not None else low + float_span
        high = min(high, low + float_span)
        return st.floats(low, high, exclude_min=lo_open, exclude_max=hi_open and high == hi,
                         allow_nan=False, allow_infinity=False)
    return None


def options_values(options_cls: type[BaseModel], none: bool = True, int_span: int = 3, float_span: float = 4.0,
                   skip: typing.Iterable[str] = ()) -> st.SearchStrategy[dict[str, Any]]:
    """A mapping of field -> value for ``options_cls`` (a part's or decoder's ``Options``): every bool,
    Literal, int and float field drawn within its constraints (unbounded ints within ``int_span`` of their
    lower bound, unbounded floats within ``float_span``), an optional one sometimes None when ``none``.
    Fields of other types, and those in ``skip``, keep their defaults (left out of the mapping)."""
    fields, required = {}, {}
    for name, info in options_cls.model_fields.items():
        if name in skip:
            continue
        strategy = _value(info.annotation, info, none, int_span, float_span)
        if strategy is None:
            continue
        if not none and info.default is None:  # an option left unset would stay None: draw it
            required[name] = strategy
        else:
            fields[name] = strategy
    return st.fixed_dictionaries(required, optional=fields)


def part_options(cls: type, none: bool = True) -> st.SearchStrategy[BaseModel]:
    """Validated ``cls.Options`` instances with drawn values (values the model refuses are filtered out)."""

    def options(values):
        try:
            return cls.Options.model_validate(values)
        except ValueError:
            return None

    return options_values(cls.Options, none=none).map(options).filter(lambda o: o is not None)


@st.composite
def slot_layouts(draw, max_slots: int = 6, max_size: int = 5, min_slots: int = 1) -> tuple[int, list[int]]:
    """``(k, sizes)``: a slot width ``k`` and each slot's real size in ``1 .. k`` (padding after), as a
    decoder pads slots of different sizes (a remasked or split slot is shorter)."""
    k = draw(st.integers(1, max_size))
    n = draw(st.integers(min_slots, max_slots))
    if draw(st.booleans()):
        return k, [k] * n
    return k, draw(st.lists(st.integers(1, k), min_size=n, max_size=n))


def valid_mask(k: int, sizes: list[int]) -> torch.Tensor:
    """``[S, k]`` bool: True at each slot's first ``sizes[s]`` positions."""
    return torch.arange(k)[None, :] < torch.tensor(sizes)[:, None]


def _grid(draw, shape, elements) -> torch.Tensor:
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(elements, min_size=n, max_size=n)), dtype=torch.float32).view(*shape)


LOGITS = st.one_of(st.floats(-12.0, 12.0, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, -1.0, 5.0]))
PROBS = st.one_of(st.floats(0.0, 1.0, allow_nan=False, width=32), st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))


@st.composite
def proposals(draw, max_slots: int = 6, max_size: int = 5, max_vocab: int = 6, min_slots: int = 1):
    """A :class:`~refusion.core.types.Proposal` as a drafter makes one: finite logits ``[S, k, V]``, a drafted
    token per position (the argmax or any other), its softmax probability, and ``valid`` (None when every
    slot is full, else the padding mask). Padded positions hold arbitrary values."""
    from refusion.core.types import Proposal

    k, sizes = draw(slot_layouts(max_slots, max_size, min_slots))
    S, V = len(sizes), draw(st.integers(2, max_vocab))
    logits = _grid(draw, (S, k, V), LOGITS)
    if draw(st.booleans()):
        ids = logits.argmax(-1)
    else:
        ids = torch.tensor(draw(st.lists(st.integers(0, V - 1), min_size=S * k, max_size=S * k))).view(S, k)
    probs = torch.softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    valid = None if all(s == k for s in sizes) else valid_mask(k, sizes)
    return Proposal(token_ids=ids, probs=probs, logits=logits, valid=valid)


@st.composite
def verifier_inputs(draw, max_slots: int = 5, max_size: int = 5):
    """``(draft_probs, ar_probs, valid)`` of Stage II-a: probabilities ``[S, k]`` in [0, 1] and the padding
    mask (None when every slot is full)."""
    k, sizes = draw(slot_layouts(max_slots, max_size))
    S = len(sizes)
    valid = None if all(s == k for s in sizes) else valid_mask(k, sizes)
    return _grid(draw, (S, k), PROBS), _grid(draw, (S, k), PROBS), valid


@st.composite
def extender_inputs(draw, max_rows: int = 5, max_width: int = 6):
    """``(ar_probs, verified)`` of a Stage II-b round: probabilities ``[S, m]`` and a verified prefix per
    row (column 0 always verified)."""
    m = draw(st.integers(1, max_width))
    S = draw(st.integers(1, max_rows))
    done = draw(st.lists(st.integers(1, m), min_size=S, max_size=S))
    return _grid(draw, (S, m), PROBS), valid_mask(m, done)


@st.composite
def remasker_inputs(draw, max_slots: int = 5, max_size: int = 5):
    """``(confidence [S, k], lengths)``: acceptance probabilities and each slot's real length in 1..k."""
    k, sizes = draw(slot_layouts(max_slots, max_size))
    return _grid(draw, (len(sizes), k), PROBS), sizes


@st.composite
def acceptance_inputs(draw, sampling: bool = False, max_rows: int = 3, max_drafts: int = 5, max_vocab: int = 6):
    """``(logits [B, n+1, V], drafts [B, n], draft_probs, temperature)`` of a speculative verification: finite
    target logits; drafts that are the target's argmax, any tokens, or a mix (so prefixes of every length
    match); with ``sampling`` a temperature > 0 and draft distributions ``[B, n, V]`` (softmax of other logits,
    each draft drawn from its row's support) or None (a deterministic proposer), else temperature 0 and None."""
    B, n, V = draw(st.integers(1, max_rows)), draw(st.integers(0, max_drafts)), draw(st.integers(2, max_vocab))
    logits = _grid(draw, (B, n + 1, V), LOGITS)
    argmax = logits.argmax(-1)[:, :n]
    anything = torch.tensor(draw(st.lists(st.integers(0, V - 1), min_size=B * n, max_size=B * n)),
                            dtype=torch.long).view(B, n)
    keep = torch.tensor(draw(st.lists(st.booleans(), min_size=B * n, max_size=B * n)), dtype=torch.bool).view(B, n)
    drafts = draw(st.sampled_from([argmax, anything, torch.where(keep, argmax, anything)]))
    if not sampling:
        return logits, drafts, None, 0.0
    temperature = draw(st.one_of(st.sampled_from([0.5, 1.0, 1.5]), st.floats(0.05, 4.0)))
    probs = torch.softmax(_grid(draw, (B, n, V), LOGITS), dim=-1) if draw(st.booleans()) else None
    return logits, drafts, probs, temperature


def selector_scores(max_slots: int = 8, min_slots: int = 1) -> st.SearchStrategy[torch.Tensor]:
    """Scores ``[S]`` in [0, 1] (every built-in scorer's range), ties included."""
    return st.lists(PROBS, min_size=min_slots, max_size=max_slots).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


def prompts(min_size: int = 1, max_size: int = 8, tokens: tuple[int, int] = PROMPT_TOKENS):
    """Prompt token ids for the char tokenizer's models (no special token, no [MASK])."""
    return st.lists(st.integers(*tokens), min_size=min_size, max_size=max_size)


def reorderings(n: int):
    """A permutation of ``range(n)`` as a list (the order slots enter the buffer, or a reordering of rows)."""
    return st.permutations(range(n)).map(list)


# -- decoder configs --------------------------------------------------------------------------------------------

def _refusion_shape(draw) -> dict[str, Any]:
    k = draw(st.integers(1, 5))
    n_slots = draw(st.integers(1, 4))
    blocks = draw(st.sampled_from([d for d in range(1, n_slots + 1) if n_slots % d == 0]))
    return {"slot_size": k, "serial_blocks": blocks,
            "gen_length": draw(st.integers(max(1, (n_slots - 1) * k + 1), n_slots * k))}


def _llada_shape(draw) -> dict[str, Any]:
    block = draw(st.integers(1, 5))
    n_blocks = draw(st.integers(1, 3))
    return {"gen_length": block * n_blocks, "block_length": block,
            "steps": draw(st.integers(1, block)) * n_blocks}


def _block_shape(draw) -> dict[str, Any]:
    size = draw(st.integers(1, 5))
    out = {"gen_length": draw(st.integers(1, MAX_GEN_LENGTH)), "block_size": size}
    if draw(st.booleans()):
        out["sub_block_size"] = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    return out


#: decoder -> the fields that must agree with each other (lengths, blocks, steps), drawn together; every
#: other option of every decoder (a third-party one included) is drawn from its Options' constraints
SHAPES = {"refusion": _refusion_shape, "llada": _llada_shape, "block": _block_shape}
#: options drawn for every decoder: generation lengths the tiny models decode in milliseconds
MAX_GEN_LENGTH = 16


@st.composite
def decoder_configs(draw, name: str, registry=None, parts: dict[str, list[str]] | None = None):
    """A config mapping of decoder ``name`` (as given to :func:`~refusion.core.config.build_decoder`) that
    validates: its options drawn from its ``Options`` (lengths up to :data:`MAX_GEN_LENGTH`), and each part
    field of it a registered part of that kind (``parts``: kind -> the names to draw from; default: every
    name the registry holds) with options drawn from that part's ``Options``. Drawn combinations that the
    config refuses (an extender that cannot bind to the verifier, a schedule that does not divide) are
    rejected, so the config always builds."""
    from hypothesis import assume

    from refusion.core.config import ConfigError, part_fields, validate_config
    from refusion.core.registry import get_registry

    registry = registry or get_registry()
    dec_cls = registry.get("decoder", name)
    kinds = part_fields(dec_cls.Options)
    shape = SHAPES[name](draw) if name in SHAPES else {}
    cfg: dict[str, Any] = {"decoder": name}
    cfg.update(draw(options_values(dec_cls.Options, skip=set(kinds) | set(shape) | {"seed", "gen_length"})))
    cfg.update(shape)
    cfg.setdefault("gen_length", draw(st.integers(1, MAX_GEN_LENGTH)))
    cfg["seed"] = draw(st.integers(0, 3))
    for kind in kinds:
        names = (parts or {}).get(kind) or registry.names(kind)
        part = draw(st.sampled_from(names))
        cls = registry.get(kind, part)
        cfg[kind] = {"name": part, **draw(options_values(cls.Options))}
    try:
        validate_config(cfg, registry)
    except ConfigError:
        assume(False)
    return cfg


__all__ = ["options_values", "part_options", "slot_layouts", "valid_mask", "proposals", "verifier_inputs",
           "extender_inputs", "remasker_inputs", "acceptance_inputs", "selector_scores", "prompts", "reorderings",
           "decoder_configs",
           "SHAPES", "MAX_GEN_LENGTH", "MASK_ID"]
