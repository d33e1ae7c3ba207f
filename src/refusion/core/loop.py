"""The loop protocol: a decoder is one generator of forward requests, host reads and commits.

A decoding loop is written once, for one sequence, as a generator (:data:`LoopSteps`). It yields

* a :class:`ForwardRequest` when it needs a model call, and receives the logits (``[r, n, V]`` for its
  ``r`` cache rows and the ``n`` fed positions it asked for, or None);
* a :class:`Read` when it needs device values on the host, and receives them
  (:func:`~refusion.core.host.to_host`);
* a :class:`Commit` when part of its output has become final (it never changes after), and receives None;

and returns its :class:`~refusion.core.types.LoopOutput`. The same body then runs

* alone: :func:`drive` (a generator of the commits) / :func:`run_loop`, each forward on the sequence's
  own cache;
* as a ragged batch: :func:`run_loops`, every waiting read of the batch served by one host read and every
  waiting forward by one model call per request ``group`` over a shared cache whose rows have their own
  lengths; sequences at different stages share the forwards, finished ones leave, and new ones may be
  admitted between forwards (continuous batching).

A loop learns the load it decodes under from its cache: ``cache.live_sequences()`` is the number of
sequences decoding in the batch that cache belongs to at that moment (1 on a sequence's own cache; in a
ragged batch every sequence not yet finished, those admitted later included), so a loop can size its
next request by the load (ReFusion's ``draft_budget``). It is read when the loop builds a request; it
changes only between model calls.

A request says how its fed tokens attend (:class:`Attention`): each fed token attends to every token its
cache rows hold and to the fed tokens whose *segment* is not after its own. Causal attention is one
segment per token, full (bidirectional) attention one segment for all, block-causal attention one
segment per block. A cache is any object with the :class:`KVCache` operations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from torch import Tensor

from refusion.core.host import to_host
from refusion.core.types import LoopOutput

T = TypeVar("T")

# ------------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class Attention:
    """How a request's fed tokens attend: to all of the cache's tokens and to the fed tokens whose segment
    is <= their own. ``segments``: one int per fed token (host values), or None for causal attention
    (the segment of fed token t is t). Use :data:`CAUSAL`, :data:`FULL` or :meth:`block_causal`."""

    kind: str  # "causal", "full" or "segments"
    segments: tuple[int, ...] | None = None

    @staticmethod
    def block_causal(segments: Sequence[int]) -> "Attention":
        """A block-causal request: ``segments[t]`` is fed token t's block index (non-decreasing)."""
        return Attention("segments", tuple(int(s) for s in segments))

    def segment_ids(self, fed: int) -> list[int]:
        """One segment id per fed token."""
        if self.kind == "causal":
            return list(range(fed))
        if self.kind == "full":
            return [0] * fed
        if len(self.segments) != fed:
            raise ValueError(f"attention has {len(self.segments)} segments for {fed} fed tokens")
        return list(self.segments)


CAUSAL = Attention("causal")
FULL = Attention("full")


# -------------------------------------------------------------------------------------------- requests
@dataclass
class ForwardRequest:
    """One sequence's forward: ``ids, pos [r, T]`` (or ``[T]``) fed after the tokens its ``cache`` rows
    hold (``r`` = its rows), attending as ``attention`` says; KV kept or not; logits at ``logits_at``
    (a slice, a list / 1-D CPU index tensor of fed positions, or None for no logits). Requests of
    different ``group`` run in different model calls of a batch (for example a full-width refresh
    apart from narrow cached steps), requests of one group in one call."""

    cache: "KVCache"
    ids: Tensor
    pos: Tensor
    keep_kv: bool = True
    logits_at: slice | list[int] | Tensor | None = field(default_factory=lambda: slice(None))
    attention: Attention = CAUSAL
    group: str | None = None

    def cached(self) -> int:
        """The keys its rows hold before it (its cache's longest row): its key length is this plus its width,
        and a batched call pads every row's keys to its longest row's plus the call's width."""
        return self.cache.length()

    def columns(self) -> list[int]:
        """The fed positions whose logits the request reads, as host integers."""
        T = self.ids.shape[-1]
        if self.logits_at is None:
            return []
        if isinstance(self.logits_at, slice):
            return list(range(*self.logits_at.indices(T)))
        if isinstance(self.logits_at, Tensor):
            if self.logits_at.device.type != "cpu":
                raise ValueError("a batched forward takes logits positions built on the host (a list or CPU tensor)")
            return [int(i) for i in self.logits_at.numpy()]
        return [int(i) for i in self.logits_at]


@dataclass
class Read:
    """A loop's request for the host values of ``tensors`` (:func:`~refusion.core.host.to_host`)."""

    tensors: tuple[Tensor, ...]


@dataclass(frozen=True)
class Commit:
    """Output that has become final: ``token_ids`` at sequence ``positions`` (the next tokens of the
    output, left to right; concatenated, a loop's commits are its output)."""

    positions: list[int]
    token_ids: list[int]


#: A decoding loop: yields requests, reads and commits; returns its LoopOutput.
LoopSteps = Generator[ForwardRequest | Read | Commit, object, LoopOutput]


class KVCache(Protocol):
    """One sequence's KV cache: one or more rows, each holding the KV of the tokens fed so far (in feed
    order; position ids are the caller's). Implemented by a single sequence's own cache and by a
    sequence's view of a batch's shared cache."""

    def length(self) -> int: ...  # tokens held (the longest row)
    def n_rows(self) -> int: ...
    def live_sequences(self) -> int: ...  # sequences decoding in this cache's batch now (1: decoding alone)
    def crop(self, length: int) -> None: ...  # keep every row's first ``length`` tokens
    def select(self, rows: list[int]) -> None: ...  # keep these rows, in this order (repeats allowed)
    def repeat_rows(self, n: int) -> None: ...  # each row n times: [r0]*n + [r1]*n + ...
    def drop_span(self, start: int, end: int) -> None: ...  # remove entries start .. end-1 of every row
    def concat_rows(self, base_len: int, lengths: list[int]) -> None: ...  # one row: prefix + each row's own part
    def forward(self, request: ForwardRequest) -> Tensor | None: ...  # run a request on this cache alone


class BatchCache(Protocol):
    """The shared cache of a batch: makes one view per sequence and runs requests of several views in
    one model call."""

    def new_view(self) -> KVCache: ...
    def forward(self, requests: list[ForwardRequest]) -> list[Tensor | None]: ...
    def release(self, view: KVCache) -> None: ...  # a finished sequence's rows leave the batch
    def row_order(self, view: KVCache) -> int: ...  # where the view's rows sit in the batch (a sort key)


# ---------------------------------------------------------------------------------------------- drivers
def drive(loop: LoopSteps) -> Generator[Commit, None, LoopOutput]:
    """Run one sequence's loop, each forward on its own cache, each read one :func:`to_host`; yields the
    loop's commits and returns its output."""
    reply: object = None
    while True:
        try:
            step = loop.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(step, Commit):
            yield step
            reply = None
        elif isinstance(step, Read):
            reply = to_host(*step.tensors)
        else:
            reply = step.cache.forward(step)


def exhaust(steps: Generator[Commit, None, T], on_commit: Callable[[Commit], None] | None = None) -> T:
    """Run a generator of commits to its end, handing each commit to ``on_commit``; -> its return value."""
    while True:
        try:
            commit = next(steps)
        except StopIteration as stop:
            return stop.value
        if on_commit is not None:
            on_commit(commit)


def run_loop(loop: LoopSteps, on_commit: Callable[[Commit], None] | None = None) -> LoopOutput:
    """Run one sequence's loop to its end (:func:`drive`), handing each commit to ``on_commit``."""
    return exhaust(drive(loop), on_commit)


def rows(request: ForwardRequest) -> int:
    """The cache rows a request feeds (its ``ids`` are ``[r, T]`` or ``[T]``)."""
    return request.ids.shape[0] if request.ids.dim() == 2 else 1


#: a policy that splits one group's forward requests (in the batch's row order) into several model calls:
#: -> the calls, each a list of indices into the requests (every index once; each call in row order)
SplitPolicy = Callable[[list["ForwardRequest"]], list[list[int]]]


@dataclass(frozen=True)
class CallPrice:
    """What a batched model call costs, in tokens fed: ``call`` per call, 1 per token fed, ``key`` per
    (row, key) pair and ``pair`` per query-key pair. A call pads every row to its widest request (``width``
    tokens fed) and every row's keys to its longest: ``keys`` = the longest cached row + ``width``; so a
    call of ``rows`` rows costs ``call + rows * (width + key * keys + pair * width * keys)``
    (:meth:`cost`): the forward cost model's fixed, token, key and pair terms over its per-token one."""

    call: float
    key: float = 0.0
    pair: float = 0.0

    def __post_init__(self) -> None:
        for name in ("call", "key", "pair"):
            value = getattr(self, name)
            if not value >= 0:  # NaN included
                raise ValueError(f"call price: {name} must be 0 or more, got {value}")

    def cost(self, rows: int, width: int, cached: int) -> float:
        """A call of ``rows`` rows fed ``width`` tokens each after ``cached`` keys (each padded to these)."""
        keys = cached + width
        return self.call + rows * (width + self.key * keys + self.pair * width * keys)


def shape_split(price: CallPrice) -> SplitPolicy:
    """A :data:`SplitPolicy` that puts requests of similar widths AND similar cached lengths in one call,
    where that saves more than a call costs (priced by ``price``: a call pads every row to its widest
    request and its longest cached row, so sequences at different stages may cost less in two calls than
    in one). Over the distinct widths, sorted, it picks contiguous ranges; within each range, over its
    requests sorted by cached length, contiguous runs; the cheapest such split by :meth:`CallPrice.cost`
    (each call at its own widest and longest). One call when its padding costs less than a call."""

    def split(requests: list[ForwardRequest]) -> list[list[int]]:
        shapes = [(r.ids.shape[-1], r.cached(), rows(r)) for r in requests]  # (width, cached, rows)
        one = price.cost(sum(n for *_, n in shapes), max(w for w, *_ in shapes), max(c for _, c, _ in shapes))
        alone = price.call + sum(price.cost(n, w, c) - price.call for w, c, n in shapes)  # no padding at all
        if one <= alone + price.call:  # no split of two or more calls can cost less
            return [list(range(len(requests)))]
        levels = sorted(set(w for w, *_ in shapes))
        # best[j]: the least cost of the requests of widths levels[:j], start[j]: where its last range begins
        best, start, runs = [0.0] + [float("inf")] * len(levels), [0] * (len(levels) + 1), {}
        for j in range(1, len(levels) + 1):
            for i in range(j):
                members = sorted((k for k, s in enumerate(shapes) if levels[i] <= s[0] <= levels[j - 1]),
                                 key=lambda k: shapes[k][1])
                cost, parts = cheapest_runs(price, [shapes[k] for k in members])
                runs[i, j] = [[members[k] for k in part] for part in parts]
                if best[i] + cost < best[j]:
                    best[j], start[j] = best[i] + cost, i
        calls, j = [], len(levels)
        while j:
            calls = runs[start[j], j] + calls
            j = start[j]
        return [sorted(call) for call in calls]

    return split


def cheapest_runs(price: CallPrice, shapes: list[tuple[int, int, int]]) -> tuple[float, list[list[int]]]:
    """The cheapest split of ``shapes`` ((width, cached, rows), in their order) into contiguous runs, each
    priced by :meth:`CallPrice.cost` at its widest and longest: (its cost, the runs as index lists). Calls
    by cached length (:func:`shape_split`) and a forward's key groups
    (:func:`~refusion.models.ragged_forward.key_groups`) are such splits."""
    best, start = [0.0] + [float("inf")] * len(shapes), [0] * (len(shapes) + 1)
    for j in range(1, len(shapes) + 1):
        cached, n, width = 0, 0, 0
        for i in range(j - 1, -1, -1):  # the run shapes[i:j], grown to the left
            n, width, cached = n + shapes[i][2], max(width, shapes[i][0]), max(cached, shapes[i][1])
            cost = best[i] + price.cost(n, width, cached)
            if cost < best[j]:
                best[j], start[j] = cost, i
    parts, j = [], len(shapes)
    while j:
        parts.append(list(range(start[j], j)))
        j = start[j]
    return best[-1], parts[::-1]


def run_loops(
    loops: list[LoopSteps], cache: BatchCache, admit: Callable[[], list[LoopSteps]] | None = None,
    on_commit: Callable[[int, Commit], None] | None = None, split: SplitPolicy | None = None,
    align_groups: bool = False,
) -> list[LoopOutput]:
    """Run several sequences' loops as a batch over one shared ``cache`` (each loop's requests name its
    view of it). Every loop runs until it waits on the device; then all waiting reads are served by ONE
    :func:`to_host`, or, when every loop waits on a forward, the forwards by ONE model call per request
    group (:meth:`BatchCache.forward`). A finished loop's rows leave the cache. Before each model call
    ``admit()`` (if given) may return new loops (made on views of ``cache``), which join the batch; it
    may block (a server waiting for requests), and the run ends when it returns none while no loop is
    left.

    Returns the outputs in the order the loops joined (``loops`` first, then each admitted one); each gets
    the forwards its sequence took part in (``nfe``), the tokens fed in its rows (``tokens_in``, padding
    included: summed over the sequences, the tokens of the model calls) and when it ended.
    ``on_commit(i, commit)`` receives loop i's commits as they happen. ``split`` (a :data:`SplitPolicy`,
    e.g. :func:`shape_split`): a group's forwards in several model calls (default: one call per group).

    ``align_groups``: when the waiting forwards belong to several groups, run only the group with the most
    rows and those holding a forward that waited the round before; the others wait one round. Loops that
    alternate between groups (a speculative drafter's forward, then the target's) and joined at different
    times then fall into step, so each round is one call rather than one per group; no forward waits more
    than one round."""
    all_loops: list[LoopSteps] = []
    outputs: list[LoopOutput | None] = []
    nfe: list[int] = []
    fed: list[int] = []
    views: list[set] = []
    waiting: dict[int, ForwardRequest | Read] = {}
    held: set[int] = set()  # loops whose forward waited the last round (align_groups)

    def advance(i: int, reply: object) -> None:
        while True:
            try:
                step = all_loops[i].send(reply)
            except StopIteration as stop:
                out = stop.value
                out.nfe, out.tokens_in, out.finished_at = nfe[i], fed[i], time.perf_counter()
                outputs[i] = out
                waiting.pop(i, None)
                for view in views[i]:
                    cache.release(view)
                return
            if not isinstance(step, Commit):
                waiting[i] = step
                return
            if on_commit is not None:
                on_commit(i, step)
            reply = None

    def join(new: list[LoopSteps]) -> None:
        for loop in new:
            all_loops.append(loop)
            outputs.append(None)
            nfe.append(0)
            fed.append(0)
            views.append(set())
            advance(len(all_loops) - 1, None)

    join(loops)
    while waiting or admit is not None:
        reads = [i for i, step in waiting.items() if isinstance(step, Read)]
        if reads:
            values = to_host(*[t for i in reads for t in waiting[i].tensors])
            at = 0
            for i in reads:
                n = len(waiting[i].tensors)
                advance(i, values[at : at + n])
                at += n
            continue
        if admit is not None:
            new = admit()
            if new:
                join(new)
                continue
            if not waiting:
                break
        groups: dict[str | None, list[int]] = {}
        for i in sorted(waiting, key=lambda i: cache.row_order(waiting[i].cache)):  # the batch's row order
            groups.setdefault(waiting[i].group, []).append(i)
        if align_groups and len(groups) > 1:
            largest = max(groups, key=lambda g: sum(rows(waiting[i]) for i in groups[g]))
            now = {g: order for g, order in groups.items() if g == largest or held.intersection(order)}
            held = {i for g, order in groups.items() if g not in now for i in order}
            groups = now
        else:
            held = set()
        replies: dict[int, object] = {}
        calls: list[list[int]] = []
        for order in groups.values():
            if split is None or len(order) == 1:
                calls.append(order)
            else:
                calls += [[order[k] for k in part] for part in split([waiting[i] for i in order])]
        for order in calls:
            requests = [waiting[i] for i in order]
            width = max(request.ids.shape[-1] for request in requests)  # every row is padded to it
            for i, request, reply in zip(order, requests, cache.forward(requests)):
                views[i].add(request.cache)
                nfe[i] += 1
                fed[i] += rows(request) * width
                replies[i] = reply
        for i, reply in replies.items():
            advance(i, reply)
    return outputs
