"""The transformers side of a ragged batch's forward (:class:`~refusion.models.kvcache.RaggedCache`): a cache
layer that writes each row's new keys and values at that row's own column offset, the buffers it writes into,
and the output-head hook that computes logits only at each row's own requested positions."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import Cache
from transformers.cache_utils import DynamicLayer


class OffsetLayer(DynamicLayer):
    """One layer of one batched forward over per-row KV buffers ``[B, n_kv_heads, C, head_dim]``: the
    forward's new KV of its row r is written (in place) at buffer row ``rows[r]``, columns ``offsets[r] ..``,
    and every row attends over columns ``0 .. width-1``, its additive mask saying which of them are its keys.
    Without ``take`` the buffers hold the forward's rows in order (``B`` = its rows); with ``take [R]`` (the
    buffer row of each of the forward's rows) the attended keys are those rows' first ``width`` columns,
    gathered after the write (the rest of the buffers is neither copied nor written back). Nothing is
    appended or cropped: which columns hold a row's valid KV is the caller's bookkeeping."""

    def __init__(self, keys: Tensor, values: Tensor, rows: Tensor, cols: Tensor, past: int, width: int,
                 take: Tensor | None = None) -> None:
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.rows, self.cols = rows, cols  # [R, T] each: where row r's t-th new token goes (shared by the layers)
        self.past, self.width, self.take = past, width, take

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # an index_put_, not a scatter_: under torch.compile inductor writes an index_put_ into the buffer in
        # place, while a scatter_ becomes a copy of the whole buffer per layer and call
        self.keys[self.rows, :, self.cols] = key_states.transpose(1, 2).to(self.keys.dtype)  # [R, T, H, D]
        self.values[self.rows, :, self.cols] = value_states.transpose(1, 2).to(self.values.dtype)
        keys, values = self.keys[:, :, : self.width], self.values[:, :, : self.width]
        if self.take is None:
            return keys, values
        return keys.index_select(0, self.take), values.index_select(0, self.take)  # [R, H, width, D]

    def get_seq_length(self) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0


def offset_cache(keys: list[Tensor], values: list[Tensor], offsets: Tensor, fed: int, width: int,
                 take: Tensor | None = None) -> Cache:
    """A transformers cache over per-layer buffers (:class:`OffsetLayer`) for a forward of ``fed`` tokens
    per row written at columns ``offsets [R] ..`` and attending over columns ``0 .. width-1``; the mask of
    that forward is ``[R, 1, fed, width]``. ``take [R]``: the buffer row of each of the forward's rows
    (None: the buffers hold exactly the forward's rows, in order)."""
    dev = offsets.device
    cols = offsets[:, None] + torch.arange(fed, device=dev)  # [R, fed]: computed once for every layer
    at = torch.arange(offsets.shape[0], device=dev) if take is None else take
    rows = at[:, None].expand_as(cols)  # [R, fed]
    return Cache(layers=[OffsetLayer(k, v, rows, cols, width - fed, width, take) for k, v in zip(keys, values)])


def grow_columns(buffers: list[Tensor], capacity: int) -> list[Tensor]:
    """``buffers [R, H, C, D]`` with at least ``capacity`` columns (dim 2), zero-filled beyond the old ones."""
    if buffers[0].shape[2] >= capacity:
        return buffers
    out = []
    for t in buffers:
        new = t.new_zeros((*t.shape[:2], capacity, t.shape[3]))
        new[:, :, : t.shape[2]] = t
        out.append(new)
    return out


def head_per_row_supported(model) -> bool:
    """Whether a batched forward can run the output head on each row's own positions: the model takes
    ``logits_to_keep`` (an index tensor of fed positions, applied to the hidden states before the head,
    as transformers' causal LMs do) and has an output-embedding module (its head) to hook."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    return isinstance(head, torch.nn.Module) and "logits_to_keep" in inspect.signature(type(model).forward).parameters


def _head_on_rows_hook(head, args):
    """The output head's forward pre-hook (:func:`install_row_head`): while ``head.refusion_rows`` holds
    ``row_of [N]``, the hidden states ``[R, N, H]`` become entry k of row ``row_of[k]`` -> ``[1, N, H]``."""
    row_of = head.refusion_rows
    if row_of is None:
        return None
    hidden = args[0]  # [R, N, H]
    return (hidden[row_of, torch.arange(hidden.shape[1], device=hidden.device)][None], *args[1:])


def install_row_head(model) -> bool:
    """Give ``model``'s output head, once, the pre-hook :func:`head_on_rows` switches on; returns whether the
    model supports it (:func:`head_per_row_supported`).

    The hook stays installed (doing nothing while ``head.refusion_rows`` is None), so a model's forward
    is the same code with and without a per-row head: ``torch.compile`` does not guard on a module's
    hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), and a hook added and removed around
    each batched call would run through whichever graph was compiled first, with the hook or without.
    What the hook reads, ``head.refusion_rows`` (None or a tensor), it does guard on. Call it before the
    model's first compiled call (:class:`~refusion.models.backend.Backbone` does)."""
    if not head_per_row_supported(model):
        return False
    head = model.get_output_embeddings()
    if not hasattr(head, "refusion_rows"):
        head.refusion_rows = None
        head.register_forward_pre_hook(_head_on_rows_hook)
    return True


@contextmanager
def head_on_rows(model, row_of: Tensor):
    """Within it, the model's head gets each kept position's hidden state from its own row only.

    The forward is called with ``logits_to_keep`` = the column of each kept (row, column) pair, ``[N]``, so
    the hidden states reaching the head are ``[R, N, H]`` (every row at every kept column: a gather, no
    head compute); the head's pre-hook (:func:`install_row_head`, which must have run) keeps entry k of
    row ``row_of[k]`` -> ``[1, N, H]``, so the head computes N rows, not R x N (or R x the union of the
    columns). The logits come back ``[1, N, V]``. Meanwhile ``model.refusion_logits_rows`` holds
    ``row_of`` (a hook on the model's output reads which row each logits entry belongs to there:
    :func:`refusion.testing.models.kept_rows`)."""
    head = model.get_output_embeddings()
    if not hasattr(head, "refusion_rows"):
        raise RuntimeError("head_on_rows needs the head's hook: call install_row_head(model) first")
    head.refusion_rows = row_of
    model.refusion_logits_rows = row_of
    try:
        yield
    finally:
        head.refusion_rows = None
        del model.refusion_logits_rows
