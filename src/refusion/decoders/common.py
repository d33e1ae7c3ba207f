"""Helpers shared by decoding loops: cutting at EOS, the rows of a left-padded batch, and the drivers that
run a loop written as a generator of forwards and host reads, alone or as a batch."""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from refusion.core.host import from_host, to_host
from refusion.core.types import LoopOutput
from refusion.models.ragged import ForwardRequest, RaggedCache, grow_columns

if TYPE_CHECKING:
    from transformers import DynamicCache

    from refusion.models.backend import Backbone


def cut_after_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts of different lengths as one batch, each right-aligned so that every row's prompt ends in
    the same column: ``ids [B, P]`` (``pad_id`` before a shorter prompt), ``pos [B, P]`` (each prompt's
    own positions from 0; 0 at the padding) and ``real [B, P]`` bool (False at the padding), on
    ``device``. ``P`` is the longest prompt's length."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    pos = [[0] * (width - len(p)) + list(range(len(p))) for p in prompts]
    real = [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
    return from_host(ids, device), from_host(pos, device), from_host(real, device)


def fed_window(x: Tensor, pad: Tensor, lo: Tensor, hi: Tensor, fed: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's fed tokens: columns ``lo[r] .. hi[r]-1`` of ``x [b, N]``, right-padded with ``pad_id`` to
    ``fed`` tokens. -> ``cols [b, fed]`` (the column of each fed token; padding continues past ``hi``),
    ``ids [b, fed]`` and ``pos [b, fed]`` (each sequence's own positions: column minus its left padding
    ``pad [b]``; 0 at padding)."""
    cols = lo[:, None] + torch.arange(fed, device=x.device)
    real = cols < hi[:, None]
    ids = torch.where(real, x.gather(1, cols.clamp(max=x.shape[1] - 1)), pad_id)
    pos = torch.where(real, (cols - pad[:, None]).clamp_min(0), 0)
    return cols, ids, pos


class BatchRows:
    """The device tensors of the sequences of a batch still decoding, one row each: ``x [b, N]`` (token
    ids in column order, prompts left-padded), ``pad [b]`` (each row's left padding), per layer KV
    buffers ``keys`` / ``values [b, n_kv_heads, C, head_dim]`` in column order (:class:`~refusion.models.ragged.OffsetLayer`; None
    until a cache is made) and, for shifted-logits models, ``head [b, V]``. :meth:`select` keeps some rows
    (finished sequences leave the batch)."""

    def __init__(self, x: Tensor, pad: Tensor) -> None:
        self.x, self.pad = x, pad
        self.keys: list[Tensor] | None = None
        self.values: list[Tensor] | None = None
        self.head: Tensor | None = None

    def select(self, index: Tensor) -> None:
        """Keep the rows ``index [b']`` (a long tensor, in that order)."""
        self.x, self.pad = self.x[index], self.pad[index]
        if self.keys is not None:
            self.keys = [k.index_select(0, index) for k in self.keys]
            self.values = [v.index_select(0, index) for v in self.values]
        if self.head is not None:
            self.head = self.head[index]

    def new_buffers(self, heads: int, head_dim: int, layers: int, capacity: int, dtype: torch.dtype) -> None:
        """Zeroed KV buffers of ``capacity`` columns for every row."""
        shape = (self.x.shape[0], heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.x.device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.x.device) for _ in range(layers)]

    def grow(self, capacity: int) -> None:
        """At least ``capacity`` columns in the KV buffers."""
        self.keys, self.values = grow_columns(self.keys, capacity), grow_columns(self.values, capacity)

    def store(self, cache: "DynamicCache", index: Tensor | None, capacity: int) -> None:
        """The KV of a forward from column 0 (``cache``: a DynamicCache of rows ``index``, None = every row)
        becomes those rows' columns ``0 ..``; buffers of ``capacity`` columns are made on first use."""
        if self.keys is None:
            k = cache.layers[0].keys
            self.new_buffers(k.shape[1], k.shape[3], len(cache.layers), capacity, k.dtype)
        for i, layer in enumerate(cache.layers):
            n = layer.keys.shape[2]
            if index is None:
                self.keys[i][:, :, :n] = layer.keys
                self.values[i][:, :, :n] = layer.values
            else:
                self.keys[i][index, :, :n] = layer.keys
                self.values[i][index, :, :n] = layer.values

    def rows_kv(self, index: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
        """The KV buffers of rows ``index`` (a copy), or the buffers themselves (None = every row)."""
        if index is None:
            return self.keys, self.values
        return [k.index_select(0, index) for k in self.keys], [v.index_select(0, index) for v in self.values]

    def set_head(self, head: Tensor, index: Tensor | None) -> None:
        """``head [g, V]`` becomes the head of rows ``index`` (None = every row)."""
        if index is None:
            self.head = head
            return
        if self.head is None:
            self.head = head.new_zeros((self.x.shape[0], head.shape[-1]))
        self.head[index] = head


# ---------------------------------------------------------------------------- loops as step generators
@dataclass
class Read:
    """A loop's request for the host values of ``tensors`` (:func:`~refusion.core.host.to_host`)."""

    tensors: tuple[Tensor, ...]


#: A decoding loop written as a generator: it yields a :class:`ForwardRequest` when it needs a model call
#: (and receives the logits) or a :class:`Read` when it needs host values (and receives them), and
#: returns its :class:`LoopOutput`. :func:`run_loop` runs one; :func:`run_loops` runs several as a batch.
LoopSteps = Generator[ForwardRequest | Read, object, LoopOutput]


def run_loop(loop: LoopSteps, backbone: "Backbone") -> LoopOutput:
    """Run one sequence's loop: each forward a plain :meth:`Backbone.forward` on its own cache, each read
    one :func:`to_host`."""
    reply: object = None
    while True:
        try:
            request = loop.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Read):
            reply = to_host(*request.tensors)
        else:
            reply = backbone.forward(request.ids, request.pos, request.cache, keep_kv=request.keep_kv,
                                     logits_at=request.logits_at)


def run_loops(loops: list[LoopSteps], backbone: "Backbone", cache: "RaggedCache") -> list[LoopOutput]:
    """Run several sequences' loops as a batch over one shared :class:`RaggedCache` (each loop's forwards
    use a view of it). Every loop runs until it waits on the device; then all waiting reads are served by
    ONE :func:`to_host`, or, when every loop waits on a forward, all forwards by ONE model call
    (:meth:`RaggedCache.forward`). A finished loop's rows leave the cache. Each output gets the forwards
    its sequence took part in (``nfe``), the tokens it fed (``tokens_in``) and when it ended."""
    outputs: list[LoopOutput | None] = [None] * len(loops)
    nfe, fed = [0] * len(loops), [0] * len(loops)
    views: dict[int, set] = {i: set() for i in range(len(loops))}
    waiting: dict[int, object] = {}

    def advance(i: int, reply: object) -> None:
        try:
            waiting[i] = loops[i].send(reply)
        except StopIteration as stop:
            out = stop.value
            out.nfe, out.tokens_in, out.finished_at = nfe[i], fed[i], time.perf_counter()
            outputs[i] = out
            waiting.pop(i, None)
            for view in views[i]:
                view.release()

    for i in range(len(loops)):
        advance(i, None)
    while waiting:
        reads = [i for i, r in waiting.items() if isinstance(r, Read)]
        if reads:
            tensors = [t for i in reads for t in waiting[i].tensors]
            values = to_host(*tensors)
            at = 0
            for i in reads:
                n = len(waiting[i].tensors)
                advance(i, values[at : at + n])
                at += n
            continue
        order = sorted(waiting, key=lambda i: min(waiting[i].cache.rows))  # the batch's row order
        requests = [waiting[i] for i in order]
        replies = cache.forward(requests, backbone.eos_id)
        for i, request, reply in zip(order, requests, replies):
            views[i].add(request.cache)
            nfe[i] += 1
            fed[i] += request.ids.numel()
        for i, reply in zip(order, replies):
            advance(i, reply)
    return outputs
