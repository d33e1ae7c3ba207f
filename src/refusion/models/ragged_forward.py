"""The transformers side of a ragged batch's forward (:class:`~refusion.models.kvcache.RaggedCache`): a cache
layer that writes each row's new keys and values at that row's own column offset, the buffers it writes into,
the output-head hook that computes logits only at each row's own requested positions, and attention in key
groups (opt-in: :meth:`~refusion.models.backend.Backbone.use_key_groups`, ``$REFUSION_KEY_GROUPS``): consecutive rows
whose own keys end early attend over their own shorter key width, in an sdpa call of their own inside the same
forward, instead of over the call's longest row's keys."""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import Cache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from refusion.core.loop import CallPrice, cheapest_runs

#: the attention implementation :func:`install_key_groups` gives a model: sdpa, in key groups while a ragged
#: forward sets them (:func:`attend_in_groups`), plain sdpa otherwise
GROUPED_SDPA = "refusion_grouped_sdpa"
#: the default price of one more attention group in a forward, in (row, key) pairs attended: the cost
#: model's 1.24 us per pair against an sdpa call per layer with its slices (tiny-ar: about 40 us per group
#: and forward). Served AR calls (one token a row) pay more per group than that: docs/serving.md#key-groups
GROUP_KEYS_CPU = 100.0
#: the environment variable that sets a Backbone's key groups at load (:func:`key_groups_setting`)
KEY_GROUPS_ENV = "REFUSION_KEY_GROUPS"
#: a query-key pair's cost over a (row, key) pair's (the cost model's 65 ns over 1.24 us): a row fed T tokens
#: over W keys costs W * (1 + T * PAIR_PER_KEY) (row, key) pairs
PAIR_PER_KEY = 65e-9 / 1.24e-6


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


class KeyGroups:
    """What a model's attention modules read (:func:`install_key_groups`): ``groups``, while a ragged forward
    runs in key groups, is ``[(first row, end row, key width), ...]`` covering the forward's rows in order;
    None: one sdpa call over every row's keys."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, int, int]] | None = None


def _grouped_sdpa(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """transformers' sdpa attention (``query [B, H, T, D]``, ``key / value [B, Hkv, W, D]``, mask
    ``[B, 1, T, W]``) run per key group: rows ``a .. b-1`` attend over their first ``w`` keys only. Outside
    a grouped forward it is sdpa unchanged. Returns ``([B, T, H, D], None)`` as sdpa does."""
    holder = getattr(module, "refusion_key_groups", None)
    groups = None if holder is None else holder.groups
    if groups is None or attention_mask is None or attention_mask.dim() != 4:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = [sdpa_attention_forward(module, query[a:b], key[a:b, :, :w], value[a:b, :, :w],
                                   attention_mask[a:b, :, :, :w], **kwargs)[0] for a, b, w in groups]
    return torch.cat(outs), None


def install_key_groups(model) -> bool:
    """Give ``model``, once, attention that :func:`attend_in_groups` can split by key width: its attention
    implementation becomes :data:`GROUPED_SDPA` (registered with transformers' attention and mask interfaces,
    sdpa's mask) and its attention modules share one :class:`KeyGroups`. Only for a transformers model
    attending through sdpa (eager and flash attention, remote-code adapters stay as they are); returns whether
    the model has it."""
    if getattr(model, "refusion_key_groups", None) is not None:
        return True
    if not isinstance(model, PreTrainedModel) or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    ALL_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, _grouped_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    if model.config._attn_implementation != GROUPED_SDPA:  # the model does not take a custom implementation
        return False
    holder = KeyGroups()
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):  # transformers' attention modules
            module.refusion_key_groups = holder
    model.refusion_key_groups = holder
    return True


def key_groups(needs: list[int], fed: int, group_keys: float | None) -> list[tuple[int, int, int]] | None:
    """The cheapest split of a forward's rows, in order, into consecutive groups, each attending over its
    longest row's own keys (``needs [R]``: each row's cached length plus the forward's width ``fed``); a row
    over ``w`` keys costs ``w * (1 + fed * PAIR_PER_KEY)`` (row, key) pairs and each group after the first
    ``group_keys`` (None: no groups). Returns ``[(first row, end row, width), ...]``, or None where one group
    is cheapest, and for forwards of one token a row (served AR calls lose time in groups:
    docs/serving.md#key-groups). Over 64 rows, group boundaries fall on every ``ceil(R / 64)``-th row only."""
    n = len(needs)
    if group_keys is None or n < 2 or fed < 2:  # one token a row: a group's sdpa call costs more than its keys
        return None
    step = -(-n // 64)
    blocks = [(0, max(needs[a: a + step]), min(step, n - a)) for a in range(0, n, step)]  # (0, need, rows)
    # a group of n rows over w keys: group_keys + n * w * (1 + fed * PAIR_PER_KEY), as a call's price
    _, runs = cheapest_runs(CallPrice(group_keys, 1.0 + fed * PAIR_PER_KEY), blocks)
    if len(runs) < 2:
        return None
    return [(run[0] * step, min(n, (run[-1] + 1) * step), max(blocks[b][1] for b in run)) for run in runs]


@contextmanager
def attend_in_groups(model, groups: list[tuple[int, int, int]] | None):
    """Within it, ``model``'s attention (:func:`install_key_groups`, which must have run when ``groups`` is
    not None) runs in ``groups`` (:func:`key_groups`); None: as it is."""
    if groups is None:
        yield
        return
    holder = model.refusion_key_groups
    holder.groups = groups
    try:
        yield
    finally:
        holder.groups = None


def key_groups_setting() -> float | None | str:
    """``$REFUSION_KEY_GROUPS``: ``off`` (unset; None), ``auto`` (key groups for an uncompiled sdpa model on the
    CPU, at :data:`GROUP_KEYS_CPU`) or a group's price in (row, key) pairs (a number >= 0, on any device);
    anything else raises a ``ValueError`` naming the variable."""
    text = os.environ.get(KEY_GROUPS_ENV, "off").strip()
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    try:
        price = float(text)
    except ValueError:
        price = float("nan")
    if not price >= 0:
        raise ValueError(f"${KEY_GROUPS_ENV}: expected auto, off or a group's price in (row, key) pairs (a number "
                         f">= 0), got {text!r}")
    return price
