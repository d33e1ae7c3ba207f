"""KV caches: one sequence's own cache and a batch's shared cache whose rows have their own lengths.

Both implement the :class:`~refusion.core.loop.KVCache` operations (length, rows, crop, select,
repeat_rows, drop_span, concat_rows, forward of a :class:`~refusion.core.loop.ForwardRequest`), so a
decoding loop runs unchanged on either.

* :class:`DenseCache`: a single sequence's transformers ``DynamicCache`` (``cache.layers[i].keys`` /
  ``.values``, ``[rows, n_kv_heads, T, head_dim]``).
* :class:`RaggedCache`: several sequences decode together; each owns one or more rows of one shared
  cache (ReFusion's Stage II-b gives a sequence one row per chosen slot) and sees them through a
  :class:`CacheView`. Layout per layer: ``keys, values [R, n_kv_heads, C, head_dim]`` with capacity
  ``C``; row ``r`` holds its ``lengths[r]`` tokens at columns ``0 .. lengths[r]-1``, in the order the
  sequence's single-row cache would hold them. A forward writes each row's new tokens right after that
  row's own length (a per-row offset, no gaps) and attends with a per-row mask, so no row pays for
  another row's length beyond the padding of the key dimension to the longest row (of its key group). Crop
  is a change of a host integer; forking, reordering and dropping rows change a host mapping, which the
  next forward applies in one gather over rows. The forwards of several sequences run as one model call
  (:meth:`RaggedCache.forward`); :mod:`refusion.models.ragged_forward` holds its transformers side (the
  offset cache layer, the per-row output head and the opt-in key groups).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache

from refusion.core.host import from_host
from refusion.core.loop import ForwardRequest
from refusion.core.masks import additive_mask, segment_allowed
from refusion.models.ragged_forward import (  # noqa: F401  (OffsetLayer: also importable from here)
    OffsetLayer, attend_in_groups, grow_columns, head_on_rows, install_row_head, key_groups, offset_cache)

if TYPE_CHECKING:
    from refusion.models.backend import Backbone

#: segment of a key no query may see (a padding or stale column), and of a padding query
_UNSEEN = 1 << 40


def kv_geometry(config) -> tuple[int, int, int]:
    """``(layers, kv heads, head dim)`` of a transformers config."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return int(config.num_hidden_layers), heads, head_dim


def _logits_rows(logits_at) -> slice | Tensor | None:
    """A request's ``logits_at`` as :meth:`Backbone.forward` takes it (a list becomes an index tensor)."""
    if isinstance(logits_at, (list, tuple)):
        return torch.tensor(logits_at, dtype=torch.long)
    return logits_at


class DenseCache:
    """One sequence's KV cache: a transformers ``DynamicCache`` of one or more rows (``kv``)."""

    def __init__(self, backbone: "Backbone", kv: DynamicCache | None = None) -> None:
        self.backbone = backbone
        self.kv = kv if kv is not None else DynamicCache(config=backbone.model.config)

    def length(self) -> int:
        return self.kv.get_seq_length()

    def live_sequences(self) -> int:
        return 1

    def n_rows(self) -> int:
        layer = self.kv.layers[0] if self.kv.layers else None
        return int(layer.keys.shape[0]) if layer is not None and getattr(layer, "keys", None) is not None else 1

    def crop(self, length: int) -> None:
        drop = self.length() - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length()} tokens to {length}")
        if drop:
            self.kv.crop(-drop)

    def select(self, rows: list[int]) -> None:
        self.kv.batch_select_indices(from_host(rows, self.kv.layers[0].keys.device))

    def repeat_rows(self, n: int) -> None:
        if n != 1:
            self.kv.batch_repeat_interleave(n)

    def fork(self, n: int = 1) -> "DenseCache":
        """A new cache with each row repeated ``n`` times (this one is untouched)."""
        out = DenseCache(self.backbone, copy.deepcopy(self.kv))
        out.repeat_rows(n)
        return out

    def drop_span(self, start: int, end: int) -> None:
        for layer in self.kv.layers:
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, end:]], dim=-2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, end:]], dim=-2)

    def concat_rows(self, base_len: int, lengths: list[int]) -> None:
        """One row: the shared prefix ``[:base_len]`` (from row 0) followed by, for each row s in order, its
        own tokens ``base_len .. base_len+lengths[s]``. One row is a crop (a view), not a copy."""
        if len(lengths) == 1:
            if self.n_rows() > 1:
                self.select([0])
            self.crop(base_len + lengths[0])
            return
        for layer in self.kv.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                parts = [t[:1, :, :base_len]] + [t[s : s + 1, :, base_len : base_len + n] for s, n in enumerate(lengths)]
                setattr(layer, name, torch.cat(parts, dim=-2))

    def forward(self, request: ForwardRequest) -> Tensor | None:
        """Run ``request`` on this cache: causal over the cache by default (no mask: none is needed with a
        cache), else the additive mask of its attention. A request that keeps no KV on an empty cache
        runs without one."""
        bb = self.backbone
        ids, pos = (request.ids[None], request.pos[None]) if request.ids.dim() == 1 else (request.ids, request.pos)
        T, past = ids.shape[1], self.length()
        mask = None
        if request.attention.kind == "full":
            mask = torch.zeros(1, 1, T, past + T, dtype=bb.model.dtype, device=bb.device)
        elif request.attention.kind != "causal":
            seg = from_host(request.attention.segment_ids(T), bb.device)  # [T]
            allowed = torch.cat([torch.ones(T, past, dtype=torch.bool, device=bb.device), segment_allowed(seg, seg)], 1)
            mask = additive_mask(allowed, bb.model.dtype)[None, None]  # [1, 1, T, past + T]
        kv = None if past == 0 and not request.keep_kv else self.kv
        kind = "segments" if request.attention.kind == "segments" else None
        return bb.forward(ids, pos, kv, keep_kv=request.keep_kv, attn_mask=mask, logits_at=_logits_rows(request.logits_at),
                          kind=kind)


class RaggedCache:
    """The shared KV of a batch (see the module docstring). ``lengths`` and the views' rows live on the
    host; the buffers are allocated at the first forward and grow by doubling.

    Rows are logical: forking, dropping or reordering a sequence's rows only changes ``phys`` (logical
    row -> row of the buffers, repeats allowed). The buffers are gathered into the new order by the next
    forward, in the same copy that forward needs anyway, so a step in which several sequences fork,
    merge or finish copies the cache once, not once per change; a sequence joining takes a spare row."""

    def __init__(self, backbone: "Backbone") -> None:
        self.backbone = backbone
        self.n_layers, self.n_kv_heads, self.head_dim = kv_geometry(backbone.model.config)
        self._head_per_row = install_row_head(backbone.model)  # installed by the Backbone already
        self.pairs_attended = 0  # (row, key) pairs the forwards attended, each row padded to its group's keys
        self.keys: list[Tensor] = []  # per layer [rows of the buffers, n_kv_heads, C, head_dim]
        self.values: list[Tensor] = []
        self.lengths: list[int] = []  # per logical row
        self.phys: list[int] = []  # per logical row: its row in the buffers
        self.views: list[CacheView] = []

    # ------------------------------------------------------------------ rows
    def new_view(self) -> "CacheView":
        """A new sequence with one empty row (the last row of the batch)."""
        view = CacheView(self, [len(self.lengths)])
        self.lengths.append(0)
        self.views.append(view)
        self.phys.append(self._free_row() if self.keys else len(self.phys))
        return view

    def _free_row(self) -> int:
        """A zeroed buffer row no logical row uses (a spare one: no copy; else the buffers grow by half)."""
        held, used = self.keys[0].shape[0], set(self.phys)
        row = next((p for p in range(held) if p not in used), None)
        if row is None:
            row, grow = held, max(1, held // 2)
            self.keys = [torch.cat([k, k.new_zeros((grow, *k.shape[1:]))]) for k in self.keys]
            self.values = [torch.cat([v, v.new_zeros((grow, *v.shape[1:]))]) for v in self.values]
        else:
            for t in (*self.keys, *self.values):
                t[row].zero_()
        return row

    def _gather(self, physical: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        """New buffers holding the buffer rows ``physical`` at rows ``0 .. n-1`` (one copy), keeping the
        current row count when it is ``n`` to ``2n`` (spare rows, uninitialised, for sequences joining)."""
        n, held = len(physical), self.keys[0].shape[0]
        rows = held if n <= held <= 2 * n else n
        index = from_host(physical, self.keys[0].device, torch.long)

        def take(t: Tensor) -> Tensor:
            out = t.new_empty((rows, *t.shape[1:]))
            torch.index_select(t, 0, index, out=out[:n])
            return out

        return [take(k) for k in self.keys], [take(v) for v in self.values]

    def _set_rows(self, view: "CacheView", new_rows: list[int]) -> None:
        """Replace ``view``'s rows by ``new_rows`` (indices of current rows, repeats allowed), keeping every
        other view's rows and the row order of the batch otherwise. No tensor is copied here."""
        order: list[int] = []
        placed = False
        mine = set(view.rows)
        for r in range(len(self.lengths)):
            if r in mine:
                if not placed:
                    order.extend(new_rows)
                    placed = True
            else:
                order.append(r)
        others = [v for v in self.views if v is not view]
        owner = {r: id(v) for v in others for r in v.rows}
        self.lengths = [self.lengths[r] for r in order]
        self.phys = [self.phys[r] for r in order]
        new_view_rows: list[int] = []
        other_rows: dict[int, list[int]] = {}
        for i, r in enumerate(order):
            if r in mine:
                new_view_rows.append(i)
            else:
                other_rows.setdefault(owner[r], []).append(i)
        view.rows = new_view_rows
        for v in others:
            v.rows = other_rows.get(id(v), [])
        if not view.rows:
            self.views.remove(view)
        if not self.lengths:  # the batch is empty: its buffers go
            self.keys, self.values, self.phys = [], [], []

    def release(self, view: "CacheView") -> None:
        """The sequence of ``view`` has finished: its rows leave the batch."""
        if view.rows:
            self._set_rows(view, [])

    def row_order(self, view: "CacheView") -> int:
        return min(view.rows) if view.rows else len(self.lengths)

    def _materialize(self) -> None:
        """Gather the buffers into logical row order (one copy; none when they are in it already)."""
        if self.keys and self.phys != list(range(len(self.phys))):
            self.keys, self.values = self._gather(self.phys)
        self.phys = list(range(len(self.lengths)))

    # ------------------------------------------------------------------ forward
    def _ensure(self, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        """Buffers of MORE than ``capacity`` columns (doubling), made at the first call: a forward's ``[:width]``
        is never the whole buffer (a compiled forward would compile a graph for each case)."""
        if not self.keys:
            shape = (len(self.lengths), self.n_kv_heads, max(capacity + 1, 64), self.head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
            self.phys = list(range(len(self.lengths)))
        elif self.keys[0].shape[2] <= capacity:
            capacity = max(capacity + 1, 2 * self.keys[0].shape[2])
            self.keys, self.values = grow_columns(self.keys, capacity), grow_columns(self.values, capacity)

    def forward(self, requests: list[ForwardRequest]) -> list[Tensor | None]:
        """Run every request in ONE model call; returns each request's logits ``[r, n, V]`` (its rows, its
        ``logits_at`` positions), or None where it asked for none.

        Rows are padded on the right to the longest request's length; a padding token is written after
        the row's real ones and never counted (the row's length advances by its real tokens only, and
        only with ``keep_kv``). Each row attends to its cached tokens and to its new tokens as its
        request's :class:`~refusion.core.loop.Attention` says; no real token sees padding. The output
        head runs on each row's own requested positions only (:func:`~refusion.models.ragged_forward.head_on_rows`) when the rows ask
        for different ones and the model allows it (:func:`~refusion.models.ragged_forward.install_row_head`), else on the union of
        the requested positions in every row. When the requests cover every row, the buffers end in the
        requests' row order."""
        bb = self.backbone
        dev, dtype = bb.device, bb.model.dtype
        rows = [r for req in requests for r in req.cache.rows]
        if len(set(rows)) != len(rows):
            raise ValueError("two requests of one batched forward share a cache row")
        T = max(req.ids.shape[-1] for req in requests)
        lengths = [self.lengths[r] for r in rows]
        past = max(lengths)
        self._ensure(past + T, dev, dtype)
        every = len(rows) == len(self.lengths)
        if not every and len(set(self.phys)) < len(self.phys):  # forked rows share a buffer row: each row
            self._materialize()  # gets its own before a forward of some sequences writes in place
        physical, n, gathered = [self.phys[r] for r in rows], len(rows), None  # gathered: new buffers
        take = None  # the buffer row of each row of the forward, where the buffers are not sliced to them
        start = 0 if every else physical[0]  # every row: in order from buffer row 0 (then a row joining
        if physical == list(range(start, start + n)):  # takes the spare row after them); else consecutive rows
            keys, values = [k[start: start + n] for k in self.keys], [v[start: start + n] for v in self.values]
        elif every:  # every row, reordered: one gather, which later forwards then read in order
            gathered = self._gather(physical)
            keys, values = [k[:n] for k in gathered[0]], [v[:n] for v in gathered[1]]
        else:  # a forward of some sequences alone (a prompt beside a running batch, rows split by width):
            # written in place in the buffers, its rows' first ``width`` columns gathered per layer
            keys, values, take = self.keys, self.values, from_host(physical, dev, torch.long)
        ids = torch.cat([_pad_right(req.ids.to(dev), T, bb.eos_id) for req in requests])  # [R', T]
        pos = torch.cat([_pad_right(req.pos.to(dev), T, 0) for req in requests])  # [R', T]
        offsets = from_host(lengths, dev, torch.long)  # [R']
        width = past + T
        mask = additive_mask(self._allowed(requests, offsets, T, width), dtype)[:, None]  # [R', 1, T, width]
        kind = "ragged" if all(req.attention.kind == "causal" for req in requests) else "ragged_masked"
        cache = offset_cache(keys, values, offsets, T, width, take)
        wanted = [req.columns() if req.logits_at is not None else None for req in requests]
        union = sorted(set(c for cols in wanted if cols for c in cols))
        any_logits = any(cols is not None for cols in wanted)
        groups = key_groups([n + T for n in lengths], T, bb.group_keys)  # None: all over the longest row's keys
        self.pairs_attended += sum((b - a) * w for a, b, w in groups or [(0, n, width)])
        row_of: list[int] = []  # per kept (row, column) pair, request after request, row after row
        col_of: list[int] = []
        for start, req, cols in zip(_starts(requests), requests, wanted):
            for j in range(len(req.cache.rows) if cols else 0):
                row_of += [start + j] * len(cols)
                col_of += cols
        flat = logits = None
        if self._head_per_row and 0 < len(row_of) < len(rows) * len(union):
            # rows ask for different columns: the head runs on each row's own positions only
            with head_on_rows(bb.model, from_host(row_of, dev, torch.long)), attend_in_groups(bb.model, groups):
                flat = bb.forward(ids, pos, cache, keep_kv=True, attn_mask=mask,
                                  logits_at=from_host(col_of, dev, torch.long), kind=kind)[0]  # [N, V]
        else:
            with attend_in_groups(bb.model, groups):
                logits = bb.forward(ids, pos, cache, keep_kv=True, attn_mask=mask, kind=kind,
                                    logits_at=from_host(union, dev, torch.long) if any_logits else None)  # [R', n_union, V]
        if gathered is not None:  # the buffers hold logical row rows[i] at row i now
            self.keys, self.values = gathered
            for i, r in enumerate(rows):
                self.phys[r] = i
        out: list[Tensor | None] = []
        at = flat_at = 0
        place = {c: i for i, c in enumerate(union)}
        for req, cols in zip(requests, wanted):
            r = len(req.cache.rows)
            if req.keep_kv:
                for row in req.cache.rows:
                    self.lengths[row] += req.ids.shape[-1]
            if cols is None:
                out.append(None)
            elif flat is not None:
                out.append(flat[flat_at : flat_at + r * len(cols)].view(r, len(cols), flat.shape[-1]))  # [r, n, V]
                flat_at += r * len(cols)
            else:
                mine = logits[at : at + r]
                if cols != union:
                    mine = mine[:, from_host([place[c] for c in cols], dev, torch.long)]
                out.append(mine)
            at += r
        return out

    def _allowed(self, requests: list[ForwardRequest], offsets: Tensor, T: int, width: int) -> Tensor:
        """``[R', T, width]`` bool: new token t of row r sees the row's cached columns (``< offsets[r]``) and
        its new tokens whose segment is <= its own; padding tokens get segments no real token reaches."""
        dev = offsets.device
        cols = torch.arange(width, device=dev)
        if all(req.attention.kind == "causal" for req in requests):  # key j visible to t iff j <= offset + t
            return cols[None, None, :] <= offsets[:, None, None] + torch.arange(T, device=dev)[None, :, None]
        t = torch.arange(T, device=dev)
        per_row = [(req.ids.shape[-1], req.attention.kind == "full") for req in requests for _ in req.cache.rows]
        fed, full = from_host([[n, f] for n, f in per_row], dev, torch.long).unbind(1)  # [R'] each
        seg_q = torch.where(t < fed[:, None], torch.where(full[:, None].bool(), 0, t), _UNSEEN + t)  # [R', T]
        explicit_rows, explicit = [], []  # rows with explicit segments (block-causal): one host copy for all
        row = 0
        for req in requests:
            for _ in req.cache.rows:
                if req.attention.kind == "segments":
                    n = req.ids.shape[-1]
                    explicit_rows.append(row)
                    explicit.append(req.attention.segment_ids(n) + [_UNSEEN + j for j in range(n, T)])
                row += 1
        if explicit:
            seg_q[from_host(explicit_rows, dev, torch.long)] = from_host(explicit, dev, torch.long)
        rel = cols[None, :] - offsets[:, None]  # [R', width]: the new token at each column, < 0 = cached
        seg_k = seg_q.gather(1, rel.clamp(0, T - 1))
        seg_k = torch.where(rel < 0, -1, torch.where(rel < T, seg_k, 2 * _UNSEEN))  # [R', width]
        return segment_allowed(seg_q, seg_k)


def _starts(requests: list[ForwardRequest]) -> list[int]:
    """Each request's first row in the batched forward (its rows follow one another)."""
    out, at = [], 0
    for req in requests:
        out.append(at)
        at += len(req.cache.rows)
    return out


def _pad_right(t: Tensor, width: int, value: int) -> Tensor:
    if t.dim() == 1:
        t = t[None]
    if t.shape[1] == width:
        return t
    return torch.cat([t, torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)], dim=1)


class CacheView:
    """One sequence's rows of a :class:`RaggedCache`, with the :class:`~refusion.core.loop.KVCache`
    operations."""

    def __init__(self, owner: RaggedCache, rows: list[int]) -> None:
        self.owner, self.rows = owner, rows

    def n_rows(self) -> int:
        return len(self.rows)

    def live_sequences(self) -> int:
        """Sequences of the batch not yet finished (a finished one's view leaves it)."""
        return len(self.owner.views)

    def length(self) -> int:
        return max(self.owner.lengths[r] for r in self.rows)

    def crop(self, length: int) -> None:
        for r in self.rows:
            if self.owner.lengths[r] < length:
                raise ValueError(f"cannot crop a cache row of {self.owner.lengths[r]} tokens to {length}")
            self.owner.lengths[r] = length

    def repeat_rows(self, n: int) -> None:
        self.owner._set_rows(self, [r for r in self.rows for _ in range(n)])

    def select(self, rows: list[int]) -> None:
        self.owner._set_rows(self, [self.rows[i] for i in rows])

    def forward(self, request: ForwardRequest) -> Tensor | None:
        """Run ``request`` (on this view) alone: a model call for this sequence's rows only."""
        return self.owner.forward([request])[0]

    def _own_rows(self) -> None:
        """Every row of this view has a buffer row of its own (it is about to be written in place)."""
        o = self.owner
        if any(o.phys.count(o.phys[r]) > 1 for r in self.rows):
            o._materialize()

    def drop_span(self, start: int, end: int) -> None:
        o, n = self.owner, end - start
        self._own_rows()
        for r in self.rows:
            length, p = o.lengths[r], o.phys[r]
            for store in (o.keys, o.values):
                for t in store:
                    t[p, :, start : length - n] = t[p, :, end:length].clone()
            o.lengths[r] = length - n

    def concat_rows(self, base_len: int, lengths: list[int]) -> None:
        """Row 0 keeps ``[:base_len]`` and gets row s's ``base_len .. base_len+lengths[s]`` appended for every
        s in order; the other rows are dropped."""
        first = self.rows[0]
        total = base_len + sum(lengths)
        if len(lengths) > 1:
            o = self.owner
            if o.phys.count(o.phys[first]) > 1:  # row ``first`` is written in place: it must own its buffer row
                o._materialize()
            dev = o.keys[0].device
            src_rows = [o.phys[self.rows[s]] for s, n in enumerate(lengths) for _ in range(n)]
            src_cols = [base_len + j for n in lengths for j in range(n)]
            rows_t, cols_t = from_host(src_rows, dev, torch.long), from_host(src_cols, dev, torch.long)
            o._ensure(total, dev, o.keys[0].dtype)
            for store in (o.keys, o.values):
                for i, t in enumerate(store):
                    gathered = t[rows_t, :, cols_t]  # [n, H, D]
                    t[o.phys[first], :, base_len:total] = gathered.transpose(0, 1)
        self.owner.lengths[first] = total
        self.owner._set_rows(self, [first])
