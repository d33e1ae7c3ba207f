"""The ahead-of-time compiled forward (``--compile aot``): the model's forward exported as a function of
tensors (``torch.export``, every size that varies between calls symbolic) and compiled by AOTInductor, run
from its C++ wrapper with no guards and no Python around the graph.

A call is sorted into a :class:`CallKind` (which cache, which mask, the per-row output head or not); each
kind is exported and compiled once per model architecture, dtype and torch version, the first time a call
of that kind runs, into a package in :func:`cache_dir` (``$REFUSION_AOT_CACHE``, else
``$XDG_CACHE_HOME/refusion/aot`` or ``~/.cache/refusion/aot``; nothing is downloaded). Packages hold no
weights: the model's own parameters are handed to the compiled code at load (shared, not copied).

What the compiled function takes and gives (``R`` rows, ``T`` tokens fed, ``N`` logits rows):

* every kind: ``ids, pos [R, T]``, ``keep [N]`` (the fed positions whose logits are computed; a call that
  wants no logits computes one row, which is dropped), and the additive mask ``[R, 1, T, W]`` or a 2D mask
  ``[R, T]`` where the call has one; with the per-row head, ``row_of [N]`` (:func:`head_on_rows`);
* ``dense``: a sequence's cache, ``keys`` and ``values [R, H, L, D]`` per layer; returns the logits and
  each layer's keys and values with the new tokens appended (``[R, H, L + T, D]``, the concatenation the
  transformers cache makes eagerly), which the cache keeps or, for a call that keeps no KV, drops;
  ``dense_new``: the same on an empty cache (no KV inputs);
* ``ragged``: a batch's buffers ``[B, H, C, D]`` per layer, written in place at ``rows, cols [R, T]``
  (export's input mutation) and attended over their first ``W`` columns; ``ragged_take``: the same with
  ``take [R]``, the buffer row of each of the call's rows (:class:`~refusion.models.ragged_forward.OffsetLayer`);
* ``none``: no cache.

A call that fits no kind (another cache class, a sliding-window layer), or whose kind failed to export or
compile, runs through :func:`~refusion.models.backend.compiled_call` (``torch.compile``, mode ``default``)
instead; each such kind is logged once and listed in :attr:`AotForward.fallbacks`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch import Tensor
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from refusion.models.kvcache import kv_geometry
from refusion.models.ragged_forward import OffsetLayer

log = logging.getLogger(__name__)

#: bumped whenever what :class:`TensorForward` exports changes, so older packages are not loaded
FORMAT = 1
CACHE_KINDS = ("none", "dense", "dense_new", "ragged", "ragged_take")
MASK_KINDS = ("none", "2d", "4d")


@dataclass(frozen=True)
class CallKind:
    """What a call's compiled function takes: its ``cache`` (:data:`CACHE_KINDS`), its ``mask``
    (:data:`MASK_KINDS`) and whether the output head runs on each row's own positions (``head_rows``)."""

    cache: str
    mask: str
    head_rows: bool

    def __str__(self) -> str:
        return f"{self.cache}-mask_{self.mask}{'-head_rows' if self.head_rows else ''}"


def cache_dir() -> Path:
    """Where compiled packages are kept (see the module docstring)."""
    if os.environ.get("REFUSION_AOT_CACHE"):
        return Path(os.environ["REFUSION_AOT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "refusion" / "aot"


def package_key(model: torch.nn.Module, kind: CallKind) -> str:
    """The file name of ``kind``'s package for ``model``: its class, config (the shapes; not the folder it
    was loaded from), dtype, device type, the kind, and the torch and transformers versions, hashed."""
    import transformers

    param = next(model.parameters())
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    spec = {"format": FORMAT, "class": type(model).__qualname__, "config": config, "dtype": str(param.dtype),
            "device": param.device.type, "kind": str(kind), "torch": torch.__version__, "transformers": transformers.__version__}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return f"{type(model).__name__}-{kind}-{digest}.pt2"


class _ConcatLayer(DynamicLayer):
    """A dense cache's layer inside the exported function: its past ``keys, values`` given, the new tokens'
    concatenated as transformers' own layer does."""

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None) -> None:
        super().__init__()
        if keys is not None:
            self.keys, self.values, self.is_initialized = keys, values, True
            self.device = keys.device


class TensorForward(torch.nn.Module):
    """``model``'s forward for one :class:`CallKind` as a function of tensors only (the module docstring
    lists them, in this order: ids, pos, keep, [mask], [row_of], [rows, cols], [take], keys..., values...)."""

    def __init__(self, model: torch.nn.Module, kind: CallKind, n_layers: int) -> None:
        super().__init__()
        self.model, self.kind, self.n_layers = model, kind, n_layers

    def forward(self, ids: Tensor, pos: Tensor, keep: Tensor, *rest: Tensor):
        kind, rest = self.kind, list(rest)
        mask = rest.pop(0) if kind.mask != "none" else None
        row_of = rest.pop(0) if kind.head_rows else None
        cache: Cache | None = None
        if kind.cache in ("ragged", "ragged_take"):
            rows, cols = rest.pop(0), rest.pop(0)
            take = rest.pop(0) if kind.cache == "ragged_take" else None
            keys, values = rest[: self.n_layers], rest[self.n_layers:]
            T, W = ids.shape[1], mask.shape[-1]
            cache = Cache(layers=[OffsetLayer(k, v, rows, cols, W - T, W, take) for k, v in zip(keys, values)])
        elif kind.cache == "dense":
            keys, values = rest[: self.n_layers], rest[self.n_layers:]
            cache = Cache(layers=[_ConcatLayer(k, v) for k, v in zip(keys, values)])
        elif kind.cache == "dense_new":
            cache = Cache(layers=[_ConcatLayer() for _ in range(self.n_layers)])
        head = self.model.get_output_embeddings() if kind.head_rows else None
        saved = head.refusion_rows if head is not None else None
        if head is not None:
            head.refusion_rows = row_of
        try:
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                             use_cache=cache is not None, logits_to_keep=keep)
        finally:
            if head is not None:
                head.refusion_rows = saved
        if kind.cache in ("dense", "dense_new"):
            return (out.logits, *[layer.keys for layer in cache.layers], *[layer.values for layer in cache.layers])
        return out.logits


def example_inputs(model: torch.nn.Module, kind: CallKind) -> tuple[tuple, tuple]:
    """Example tensors of ``kind`` for export (every varying size at least 2 and the sizes distinct, so none
    is specialised) and the matching ``dynamic_shapes``."""
    n_layers, heads, head_dim = kv_geometry(model.config)
    param = next(model.parameters())
    dev, dtype = param.device, param.dtype
    R, T, L, C, N, B = 3, 5, 7, 17, 2, 4  # rows, fed, dense past, ragged buffer columns, logits rows, buffer rows
    auto = torch.export.Dim.AUTO
    W = {"none": T, "dense": L + T, "dense_new": T}.get(kind.cache, 11)  # ragged: 11 columns attended, < C
    args: list = [torch.randint(0, 10, (R, T), device=dev), torch.arange(T, device=dev).repeat(R, 1) + W - T,
                  torch.tensor([1, T - 1], device=dev)]
    shapes: list = [{0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto}]
    if kind.mask == "4d":
        args.append(torch.zeros(R, 1, T, W, dtype=dtype, device=dev))
        shapes.append({0: auto, 2: auto, 3: auto})
    elif kind.mask == "2d":
        args.append(torch.ones(R, T, dtype=torch.long, device=dev))
        shapes.append({0: auto, 1: auto})
    if kind.head_rows:
        args.append(torch.tensor([0, R - 1], device=dev))
        shapes.append({0: auto})
    if kind.cache in ("ragged", "ragged_take"):
        take = kind.cache == "ragged_take"
        rows = torch.tensor([3, 0, 2] if take else [0, 1, 2], device=dev)
        args += [rows[:, None].expand(R, T).contiguous(), (W - T + torch.arange(T, device=dev)).repeat(R, 1)]
        shapes += [{0: auto, 1: auto}, {0: auto, 1: auto}]
        if take:
            args.append(rows)
            shapes.append({0: auto})
        buffers = [torch.zeros(B if take else R, heads, C, head_dim, dtype=dtype, device=dev) for _ in range(2 * n_layers)]
        args += buffers
        shapes += [{0: auto, 2: auto}] * len(buffers)
    elif kind.cache == "dense":
        args += [torch.randn(R, heads, L, head_dim, dtype=dtype, device=dev) for _ in range(2 * n_layers)]
        shapes += [{0: auto, 2: auto}] * (2 * n_layers)
    return tuple(args), tuple(shapes)


def check_symbolic(ep, shapes: tuple) -> None:
    """Raise unless every size ``shapes`` marks dynamic is symbolic in the exported program ``ep`` (export
    specialises a size it finds constant; the package would then be wrong for any other size)."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders[-len(ep.graph_signature.user_inputs):], ep.graph_signature.user_inputs)]
    for i, (node, dims) in enumerate(zip(user, shapes)):
        val = node.meta.get("val")
        for d in dims:
            if not isinstance(val.shape[d], torch.SymInt):
                raise RuntimeError(f"export made input {i} ({node.name}) dimension {d} a constant ({val.shape[d]})")


def export(model: torch.nn.Module, kind: CallKind):
    """``kind``'s :class:`TensorForward` of ``model``, exported with its varying sizes symbolic."""
    fn = TensorForward(model, kind, kv_geometry(model.config)[0]).eval()
    args, shapes = example_inputs(model, kind)
    with torch.no_grad():
        dynamic = (*shapes[:3], shapes[3:]) if len(shapes) > 3 else shapes  # *rest: one entry, when given
        ep = torch.export.export(fn, args, dynamic_shapes=dynamic, strict=False)
    check_symbolic(ep, shapes)
    return fn, ep


def aoti_runner(model: torch.nn.Module, kind: CallKind) -> Callable:
    """``kind``'s compiled function for ``model``: its package from :func:`cache_dir`, compiled there first
    if absent, with ``model``'s parameters and buffers loaded into it (shared with the model, not copied)."""
    path = cache_dir() / package_key(model, kind)
    fn = TensorForward(model, kind, 0)
    if not path.is_file():
        fn, ep = export(model, kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(tmp), inductor_configs={"aot_inductor.package_constants_in_so": False})
        os.replace(tmp, path)  # another process compiling the same package writes the same file
    runner = torch._inductor.aoti_load_package(str(path))
    tensors = {**dict(fn.named_parameters(remove_duplicate=False)), **dict(fn.named_buffers(remove_duplicate=False))}
    wanted = runner.get_constant_fqns()
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise RuntimeError(f"the package wants constants the model does not have: {missing[:3]}")
    runner.load_constants({name: tensors[name] for name in wanted}, check_full_update=True, user_managed=True)
    return runner


class AotForward:
    """The model call of a :class:`~refusion.models.backend.Backbone` under ``--compile aot``: takes the
    model's keyword arguments (``input_ids``, ``position_ids``, ``attention_mask``, ``cache``,
    ``use_cache``, ``logits_to_keep``) and returns an object with ``.logits``, updating a dense cache's
    layers as the model would, unless ``keep_kv`` is False (the caller would crop the new tokens again).
    ``fallback`` runs the calls no compiled kind takes (see the module docstring); ``compile_kind`` (default
    :func:`aoti_runner`) makes a kind's compiled function. The compiled code checks no dtype: index inputs
    are made int64 here, and a mask not of the model's dtype falls back."""

    def __init__(self, model: torch.nn.Module, fallback: Callable, compile_kind: Callable | None = None) -> None:
        self.model, self.fallback = model, fallback
        self.n_layers = kv_geometry(model.config)[0]
        self.compile_kind = compile_kind or aoti_runner
        self.runners: dict[CallKind, Callable] = {}
        #: kind (or a description of a call no kind takes) -> why its calls run through ``fallback``
        self.fallbacks: dict[str, str] = {}
        #: calls run compiled, per kind
        self.calls: dict[str, int] = {}

    def _fall_back(self, what: str, reason: str, kwargs: dict):
        if what not in self.fallbacks:
            self.fallbacks[what] = reason
            log.warning("--compile aot: calls of kind %s run through torch.compile instead (%s)", what, reason)
        return self.fallback(**kwargs)

    def __call__(self, keep_kv: bool = True, **kwargs):
        ids, pos, mask, cache = kwargs["input_ids"], kwargs["position_ids"], kwargs.get("attention_mask"), kwargs.get("cache")
        R, T = ids.shape
        head = self.model.get_output_embeddings()
        row_of = getattr(head, "refusion_rows", None)
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, int):  # the last ``keep`` positions (0: all) as an index
            keep = torch.arange(T - keep if keep else 0, T, device=ids.device)
        wants_logits = keep.numel() > 0
        if not wants_logits:  # no logits wanted: one row computed, then dropped
            keep = torch.full((1,), T - 1, dtype=torch.long, device=ids.device)
        layers = cache.layers if cache is not None else []
        take = None
        if cache is None:
            cache_kind, kv = "none", []
        elif layers and all(isinstance(layer, OffsetLayer) for layer in layers):
            take = layers[0].take
            cache_kind = "ragged" if take is None else "ragged_take"
            kv = [layer.keys for layer in layers] + [layer.values for layer in layers]
            if not all(t.is_contiguous() for t in kv):  # written in place: a copy would lose the writes
                return self._fall_back(f"{cache_kind} over strided buffers", "its buffers are not contiguous", kwargs)
        elif len(layers) == self.n_layers and all(type(layer) is DynamicLayer for layer in layers):
            past = cache.get_seq_length()
            cache_kind = "dense" if past else "dense_new"
            kv = [layer.keys.contiguous() for layer in layers] + [layer.values.contiguous() for layer in layers] if past else []
        else:
            return self._fall_back(f"cache {type(cache).__name__} of layers {sorted({type(x).__name__ for x in layers})}",
                                   "no compiled kind takes this cache", kwargs)
        if mask is None:
            mask_kind = "none"
        elif mask.dim() == 4:
            if mask.dtype != self.model.dtype:
                return self._fall_back(f"a {mask.dtype} mask", f"the compiled kinds take {self.model.dtype} masks", kwargs)
            mask_kind = "4d"
            mask = mask.expand(R, *mask.shape[1:]).contiguous()  # a mask shared by the rows, made per row
        elif mask.dim() == 2:
            mask_kind = "2d"
        else:
            return self._fall_back(f"mask of {mask.dim()} dimensions", "no compiled kind takes this mask", kwargs)
        if cache_kind.startswith("ragged") and mask_kind != "4d":
            return self._fall_back(f"{cache_kind} without a 4D mask", "a ragged call's width comes from its mask", kwargs)
        kind = CallKind(cache_kind, mask_kind, row_of is not None)
        runner = self.runners.get(kind)
        if runner is None:
            if str(kind) in self.fallbacks:
                return self.fallback(**kwargs)
            try:
                runner = self.runners[kind] = self.compile_kind(self.model, kind)
            except Exception as err:  # noqa: BLE001  (export or the C++ build failed: this kind runs compiled by dynamo)
                return self._fall_back(str(kind), f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", kwargs)
        index = lambda t: t.long().contiguous()  # noqa: E731  (no copy when int64 and contiguous)
        args: list[Tensor] = [index(ids), index(pos), index(keep)]
        if mask is not None:
            args.append(mask.long().contiguous() if mask_kind == "2d" else mask.contiguous())
        if row_of is not None:
            args.append(index(row_of))
        if cache_kind.startswith("ragged"):
            args += [index(layers[0].rows), index(layers[0].cols)]
            if take is not None:
                args.append(index(take))
        out = runner(*args, *kv)
        self.calls[str(kind)] = self.calls.get(str(kind), 0) + 1
        if cache_kind.startswith("dense"):
            logits, new = out[0], out[1:]
            if not keep_kv:
                new = []
            for layer, k, v in zip(layers, new[: self.n_layers], new[self.n_layers:]):
                layer.keys, layer.values = k, v
                if not layer.is_initialized:
                    layer.is_initialized, layer.device = True, k.device
        else:
            logits = out[0] if isinstance(out, (list, tuple)) else out
        return SimpleNamespace(logits=logits if wants_logits else logits[:, :0])
