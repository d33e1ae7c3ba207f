"""The forward cost model: what one model call costs from its shape, and what a decode's forwards cost.

A forward (:class:`~refusion.models.backend.ForwardShape`: ``rows`` sequences of ``fed`` new tokens after
``past`` cached columns, ``logits_rows`` rows through the output head, its ``kind``) costs

    t = fixed[kind] + ragged_row * rows [ragged kinds] + token * rows*fed + narrow * min(rows*fed, 4)
        + key * rows*(past+fed) + pair * rows*fed*(past+fed) + logit * logits_rows

seconds: a fixed per-call cost (Python, dispatch, kernel launches; one per kind, since a ragged batch's
call builds a mask and gathers rows that a dense causal call does not, and a block-causal mask is built
from segment ids), a per-row cost of a batch's shared cache (its Python per request: padding, the
per-row mask, the output-head index), per-token compute (the layers' matmuls, each of a call's first few
tokens costing more: a narrow matmul runs below its per-token speed), per key read (the KV each
row attends over, and the ragged cache's gather of it), per query-key pair (the attention scores) and
per logits row (the output head over the vocabulary). :func:`fit` finds the non-negative coefficients
from timed forwards (:func:`measure`, as ``scripts/forward_cost.py`` runs it) by least squares on the
relative error. A decode's time is then its forwards' costs plus its loop's own work outside them
(:class:`LoopCost`: seconds per model call, the batch's step, and per sequence-forward, a sequence taking
part in a forward: Python that steps the decoder, reads the host, builds requests), calibrated per
decoder on decodes at one or more batch sizes (:func:`calibrate_loop`), so the predicted throughput at
any batch size follows from the decode's counted forwards (:func:`predict_decode`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from refusion.models.backend import ForwardShape

if TYPE_CHECKING:
    from refusion.models.backend import Backbone

#: the kinds of call (:class:`~refusion.models.backend.ForwardShape`), each with a fixed cost of its own
KINDS = ("causal", "masked", "segments", "ragged", "ragged_masked")
RAGGED_KINDS = ("ragged", "ragged_masked")
#: coefficient names, in feature order: a fixed cost per kind, then the per-unit costs
FEATURES = tuple(f"fixed_{k}" for k in KINDS) + ("ragged_row", "token", "narrow", "key", "pair", "logit")
#: the tokens of a call up to which each costs ``narrow`` on top of ``token``: the layers' matmuls over one
#: to a few tokens run below their per-token speed (on the CPU: 1 token fed ~4.9 ms, 4 ~6.0, 16 ~7.4, 64
#: ~12.0, one call of tiny-ar), which one linear per-token cost would price as a higher fixed cost
NARROW_TOKENS = 4


def features(shape: ForwardShape) -> list[float]:
    """The feature vector of one forward (:data:`FEATURES` order)."""
    if shape.kind not in KINDS:
        raise ValueError(f"kind: {shape.kind!r} is not one of {KINDS}")
    keys = shape.past + shape.fed
    tokens = shape.rows * shape.fed
    return [float(shape.kind == k) for k in KINDS] + [
        float(shape.rows if shape.kind in RAGGED_KINDS else 0), float(tokens), float(min(tokens, NARROW_TOKENS)),
        float(shape.rows * keys), float(tokens * keys), float(shape.logits_rows)]


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward from its shape: ``coef[name]`` per :data:`FEATURES` name; ``device`` and
    ``note`` say where the coefficients come from."""

    coef: dict[str, float]
    device: str = ""
    note: str = ""
    fit_error: dict[str, float] = field(default_factory=dict)  # relative error of the fit: median, max

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coef]
        if missing:
            raise ValueError(f"coef: missing {missing}; a cost model has one coefficient per {FEATURES}")
        unknown = [f for f in self.coef if f not in FEATURES]
        if unknown:
            raise ValueError(f"coef: unknown {unknown}; a cost model has one coefficient per {FEATURES}")

    def predict(self, shape: ForwardShape) -> float:
        return float(np.dot(features(shape), [self.coef[f] for f in FEATURES]))

    def terms(self, totals: Sequence[float]) -> dict[str, float]:
        """Seconds per :data:`FEATURES` term of a decode whose feature totals (summed over its calls:
        :func:`feature_totals`, :func:`refusion_floor`) are ``totals``."""
        return {name: self.coef[name] * float(x) for name, x in zip(FEATURES, totals)}

    def terms_of(self, shapes: Iterable[ForwardShape]) -> dict[str, float]:
        """Seconds per :data:`FEATURES` term of the calls ``shapes``."""
        return self.terms(feature_totals(shapes))

    def fixed(self, shape: ForwardShape) -> float:
        """The fixed (per-call) part of :meth:`predict`."""
        return self.coef[f"fixed_{shape.kind}"]

    def total(self, shapes: Iterable[ForwardShape]) -> tuple[float, float]:
        """``(seconds, of which fixed)`` of a sequence of forwards."""
        shapes = list(shapes)
        return sum(map(self.predict, shapes)), sum(map(self.fixed, shapes))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        return cls(coef={k: float(v) for k, v in data["coef"].items()}, device=data.get("device", ""),
                   note=data.get("note", ""), fit_error=dict(data.get("fit_error", {})))

    def markdown(self) -> str:
        """The coefficients as a table, in readable units."""
        units = {"fixed_causal": ("ms per call, dense causal", 1e3),
                 "fixed_masked": ("ms per call, dense, full attention", 1e3),
                 "fixed_segments": ("ms per call, dense, block-causal", 1e3),
                 "fixed_ragged": ("ms per call, ragged batch, causal", 1e3),
                 "fixed_ragged_masked": ("ms per call, ragged batch, full / block-causal", 1e3),
                 "ragged_row": ("us per row of a ragged batch", 1e6), "token": ("us per token fed", 1e6),
                 "narrow": (f"us more per token of a call's first {NARROW_TOKENS}", 1e6),
                 "key": ("ns per key attended over (per row)", 1e9), "pair": ("ns per query-key pair", 1e9),
                 "logit": ("us per logits row", 1e6)}
        from refusion.experiments.tables import markdown

        return markdown(["term", "value", "unit"],
                        [[name, f"{self.coef[name] * units[name][1]:.4g}", units[name][0]] for name in FEATURES])


def same_call(a: ForwardShape, b: ForwardShape) -> bool:
    """Whether call ``b`` repeats call ``a``'s shape (kind, rows, tokens fed): the next step of a run of
    like calls (the cache length may grow)."""
    return (a.kind, a.rows, a.fed) == (b.kind, b.rows, b.fed)


@dataclass(frozen=True)
class SwitchCost:
    """Prices a sequence of calls: a call that repeats its predecessor's shape (:func:`same_call`) at the
    ``warm`` fit (a grid timed after :data:`WARM_CALLS` calls of each shape), any other at the ``cold``
    one (each shape timed right after a different one). Duck-types :meth:`CostModel.total`."""

    warm: CostModel
    cold: CostModel

    def models(self, shapes: Iterable[ForwardShape]) -> list[tuple[CostModel, ForwardShape]]:
        """Each call with the fit that prices it."""
        out, previous = [], None
        for s in shapes:
            out.append((self.warm if previous is not None and same_call(previous, s) else self.cold, s))
            previous = s
        return out

    def total(self, shapes: Iterable[ForwardShape]) -> tuple[float, float]:
        priced = self.models(shapes)
        return sum(m.predict(s) for m, s in priced), sum(m.fixed(s) for m, s in priced)

    def terms_of(self, shapes: Iterable[ForwardShape]) -> dict[str, float]:
        """Seconds per :data:`FEATURES` term of ``shapes``, each call at its fit."""
        out = dict.fromkeys(FEATURES, 0.0)
        for m, s in self.models(shapes):
            for name, v in m.terms(features(s)).items():
                out[name] += v
        return out


def fit(shapes: Sequence[ForwardShape], device: str = "", note: str = "") -> CostModel:
    """The :class:`CostModel` whose non-negative coefficients minimise the squared relative error over
    ``shapes`` (each with ``seconds``). Exact non-negative least squares: every subset of the features
    the data exercise is solved unconstrained and the best feasible one kept (11 features: 2,047 solves).
    A feature no shape exercises (a kind never measured) gets coefficient 0."""
    timed = [s for s in shapes if s.seconds is not None and s.seconds > 0]
    if len(timed) < 2:
        raise ValueError(f"shapes: need at least 2 timed forwards to fit, got {len(timed)}")
    a = np.array([features(s) for s in timed])  # [n, F]
    t = np.array([s.seconds for s in timed])
    a_rel = a / t[:, None]  # relative error: (a c - t) / t = a_rel c - 1
    used = [j for j in range(a.shape[1]) if a[:, j].any()]
    best, best_res = None, np.inf
    for k in range(1, len(used) + 1):
        for subset in itertools.combinations(used, k):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(a_rel[:, cols], np.ones(len(t)), rcond=None)
            if (sol < 0).any():
                continue
            res = float(np.sum((a_rel[:, cols] @ sol - 1) ** 2))
            if res < best_res - 1e-15:
                best, best_res = (cols, sol), res
    coef = np.zeros(len(FEATURES))
    if best is not None:
        coef[best[0]] = best[1]
    rel = np.abs(a @ coef - t) / t
    return CostModel(coef=dict(zip(FEATURES, map(float, coef))), device=device, note=note,
                     fit_error={"median": float(np.median(rel)), "max": float(rel.max())})


# ------------------------------------------------------------------------------------ measurement
#: the default grid of :func:`measure`: (kind, rows, fed, past, logits), logits ``last`` (the last fed
#: position per row: what AR-like steps read) or ``all`` (every fed position: what a diffusion step reads),
#: so the per-logits-row cost is told apart from the per-token one
GRID = tuple(
    [("causal", 1, fed, past, "last") for fed in (1, 4, 16, 64) for past in (32, 160, 320)]
    + [("causal", 1, fed, past, "all") for fed in (16, 64) for past in (32, 320)]
    + [("causal", rows, fed, 160, logits) for rows in (4, 16) for fed in (1, 16) for logits in ("last", "all")
       if fed > 1 or logits == "last"]
    + [("masked", 1, fed, past, "last") for fed in (1, 16, 64) for past in (32, 160, 320)]
    + [("masked", 1, fed, past, "all") for fed in (16, 64) for past in (32, 320)]
    + [("segments", 1, fed, past, "all") for fed in (8, 16, 64) for past in (32, 160, 320)]
    + [("ragged", rows, fed, past, "last") for rows in (1, 4, 16) for fed in (1, 4, 16, 64) for past in (32, 160)]
    + [("ragged", rows, fed, 160, "all") for rows in (1, 4, 16) for fed in (16, 64)]
    + [("ragged", 64, 1, 160, "last"), ("ragged", 64, 16, 160, "last"), ("ragged", 64, 16, 160, "all")]
    + [("ragged_masked", rows, fed, past, "all") for rows in (1, 4, 16) for fed in (8, 16, 64) for past in (32, 160)]
    + [("ragged_masked", rows, 1, 160, "last") for rows in (4, 16)]
)

#: the block-causal segments of a ``segments`` / ``ragged_masked`` grid call: blocks of 8 fed tokens
GRID_BLOCK = 8


def forward_call(bb: "Backbone", kind: str, rows: int, fed: int, past: int, logits_all: bool):
    """A zero-argument callable running one forward of that shape through the decoders' own caches (the
    cost of the cache's bookkeeping included), keeping no KV, so it can repeat."""
    import torch

    from refusion.core.loop import CAUSAL, FULL, Attention, ForwardRequest
    from refusion.models.kvcache import RaggedCache

    gen = torch.Generator().manual_seed(rows * 1000 + fed * 10 + past)
    vocab = min(int(bb.model.config.vocab_size), 500)

    def ids(n: int, r: int = 1):
        return torch.randint(10, vocab, (r, n), generator=gen)

    def pos(start: int, n: int, r: int = 1):
        return torch.arange(start, start + n).expand(r, n)

    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
    logits_at = slice(None) if logits_all else [fed - 1]
    attention = {"causal": CAUSAL, "ragged": CAUSAL, "masked": FULL}.get(
        kind, Attention.block_causal([t // GRID_BLOCK for t in range(fed)]))
    if kind not in RAGGED_KINDS:
        cache = bb.new_cache()
        cache.forward(ForwardRequest(cache, ids(past), pos(0, past), logits_at=None))
        cache.repeat_rows(rows)
        request = ForwardRequest(cache, ids(fed, rows), pos(past, fed, rows), keep_kv=False, attention=attention,
                                 logits_at=logits_at)
        return lambda: cache.forward(request)
    shared = RaggedCache(bb)
    views = [shared.new_view() for _ in range(rows)]
    shared.forward([ForwardRequest(v, ids(past), pos(0, past), logits_at=None) for v in views])
    requests = [ForwardRequest(v, ids(fed), pos(past, fed), keep_kv=False, attention=attention, logits_at=logits_at)
                for v in views]
    return lambda: shared.forward(requests)


#: untimed calls of a shape before each timed one in a warm grid: on the CPU a one-token call right after a
#: wide call costs more than after several like it (what the wide call streamed through the caches is read
#: again over the next few calls; docs/profile.md, "The cost model")
WARM_CALLS = 6


def measure(bb: "Backbone", grid: Iterable[tuple] = GRID, repeats: int = 7,
            clock: Callable[[], float] = time.perf_counter, warm: int = WARM_CALLS) -> list[ForwardShape]:
    """Time one forward of every ``(kind, rows, fed, past[, logits])`` of ``grid`` (logits ``last`` when not
    given) through the decoders' caches: ``repeats`` rounds, each timing every shape once in grid order
    (interleaved, so machine noise hits all alike), after one untimed round; the median per shape.
    ``warm`` (default :data:`WARM_CALLS`): each timed call after that many untimed calls of the same shape,
    as a decode's run of calls of one shape (AR's steps) runs; 0: each right after the grid's previous
    shape, as a call whose shape differs from its predecessor's runs (:class:`SwitchCost` prices each
    call of a decode from one or the other).
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU time (one torch
    thread on a CPU shared with other processes: the work, not the waiting)."""
    grid = [(*g, "last") if len(g) == 4 else tuple(g) for g in grid]
    bad = [g for g in grid if g[4] not in ("last", "all")]
    if bad:
        raise ValueError(f"grid: logits must be 'last' or 'all', got {bad[0]}")
    calls = [forward_call(bb, kind, rows, fed, past, logits == "all") for kind, rows, fed, past, logits in grid]
    for call in calls:  # warm-up: allocator pools, one-off paths
        call()
    times: list[list[float]] = [[] for _ in grid]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            for _ in range(warm):
                call()
            bb.synchronize()
            t0 = clock()
            call()
            bb.synchronize()
            times[i].append(clock() - t0)
    return [ForwardShape(rows, fed, past, rows * (fed if logits == "all" else 1), kind, statistics.median(ts))
            for (kind, rows, fed, past, logits), ts in zip(grid, times)]


# ------------------------------------------------------------------------------------ decodes
@dataclass
class DecodeProfile:
    """What a set of decodes did: the model calls (``shapes``, from :attr:`Backbone.forward_log` of every
    backbone the decoder used), ``sequence_forwards`` (the sum over decoded samples of the forwards each
    took part in: its ``nfe``), the generated ``tokens`` and the measured ``wall_s``."""

    shapes: list[ForwardShape]
    sequence_forwards: int
    tokens: int
    wall_s: float


@dataclass(frozen=True)
class LoopCost:
    """A decoder's own work outside its forwards: ``per_call`` seconds per model call (a batch's step:
    gathering its requests, running the call, handing out the results) plus ``per_sequence`` seconds per
    sequence-forward (stepping one sequence's loop: drafting, scoring, host reads, building its request)."""

    per_call: float = 0.0
    per_sequence: float = 0.0

    def seconds(self, profile: DecodeProfile) -> float:
        return self.per_call * len(profile.shapes) + self.per_sequence * profile.sequence_forwards


def outside_forwards(model: "CostModel | SwitchCost", profile: DecodeProfile) -> float:
    """Seconds of ``profile``'s wall time outside its forwards: measured, when every forward was timed
    (:attr:`~refusion.models.backend.Backbone.time_forwards`, on the profile's clock), else what the forwards'
    predicted costs leave (a forward priced too high or too low then moves the loop's share); at least 0."""
    if profile.shapes and all(s.seconds is not None for s in profile.shapes):
        inside = sum(s.seconds for s in profile.shapes)
    else:
        inside = model.total(profile.shapes)[0]
    return max(0.0, profile.wall_s - inside)


def calibrate_loop(model: "CostModel | SwitchCost", profiles: DecodeProfile | Sequence[DecodeProfile]) -> LoopCost:
    """The :class:`LoopCost` that fits each profile's time outside its forwards (:func:`outside_forwards`)
    best: non-negative least squares on the relative error of that part, over ``profiles``. Profiles of
    batch size 1 alone (as many calls as sequence-forwards) cannot tell the two terms apart: then the
    whole cost is per sequence-forward."""
    profiles = [profiles] if isinstance(profiles, DecodeProfile) else list(profiles)
    if not profiles:
        raise ValueError("profiles: need at least one decode profile to calibrate the loop cost")
    left = np.array([outside_forwards(model, p) for p in profiles])  # [n] seconds
    a = np.array([[len(p.shapes), p.sequence_forwards] for p in profiles], dtype=float)  # [n, 2]
    if all(len(p.shapes) == p.sequence_forwards for p in profiles) or not left.any():
        return LoopCost(0.0, float(left.sum() / max(1, a[:, 1].sum())))
    weight = 1 / np.maximum(left, left[left > 0].min())[:, None]  # relative error of the loop's part
    best, best_res = LoopCost(0.0, float(left.sum() / max(1, a[:, 1].sum()))), np.inf
    for cols in ([1], [0], [0, 1]):  # per sequence first: a term joins only where it fits strictly better
        sol, *_ = np.linalg.lstsq(a[:, cols] * weight, left * weight[:, 0], rcond=None)
        if (sol < 0).any():
            continue
        res = float(np.sum((a[:, cols] @ sol - left) ** 2 * weight[:, 0] ** 2))
        if res < best_res * (1 - 1e-6) - 1e-18:
            coef = dict(zip(cols, map(float, sol)))
            best, best_res = LoopCost(coef.get(0, 0.0), coef.get(1, 0.0)), res
    return best


def predict_decode(model: "CostModel | SwitchCost", profile: DecodeProfile, loop: LoopCost | float) -> dict[str, float]:
    """Predicted seconds and tokens/s of ``profile``'s decodes: its forwards' costs plus its loop cost
    (a :class:`LoopCost`, or seconds per sequence-forward); with the measured figures and the relative
    error of the predicted tokens/s."""
    loop = loop if isinstance(loop, LoopCost) else LoopCost(0.0, float(loop))
    forwards, fixed = model.total(profile.shapes)
    loop_s = loop.seconds(profile)
    seconds = forwards + loop_s
    predicted = profile.tokens / seconds
    measured = profile.tokens / profile.wall_s if profile.wall_s else float("nan")
    return {"predicted_s": seconds, "forward_s": forwards, "fixed_s": fixed, "loop_s": loop_s,
            "predicted_tokens_per_second": predicted, "measured_tokens_per_second": measured,
            "error": predicted / measured - 1 if measured else float("nan"), "calls": len(profile.shapes)}


def feature_totals(shapes: Iterable[ForwardShape]) -> list[float]:
    """Every feature (:data:`FEATURES` order) summed over ``shapes``: what :meth:`CostModel.terms` prices."""
    rows = [features(s) for s in shapes]
    return [float(x) for x in np.sum(rows, axis=0)] if rows else [0.0] * len(FEATURES)


def scale_rows(shapes: Iterable[ForwardShape], factor: float) -> list[ForwardShape]:
    """``shapes`` with every call's rows (and logits rows) multiplied by ``factor`` (at least 1 row): a
    batch ``factor`` times larger decoding in lock-step, the same calls each carrying more sequences."""
    return [ForwardShape(max(1, round(s.rows * factor)), s.fed, s.past, max(0, round(s.logits_rows * factor)),
                         s.kind) for s in shapes]


def crossover(rates: dict[int, float], ar_rates: dict[int, float]) -> int | None:
    """The smallest batch size at which AR's tokens/s reaches the decoder's (None: not at any size given)."""
    for size in sorted(set(rates) & set(ar_rates)):
        if ar_rates[size] >= rates[size]:
            return size
    return None


# ------------------------------------------------------------------------------------ a GPU by assumption
#: an H100 SXM: dense bfloat16 tensor throughput (FLOP/s) and HBM bandwidth (bytes/s), from its data sheet
H100 = {"flops": 989e12, "bandwidth": 3.35e12}
#: Qwen3-0.6B's shape (scripts/gpu_bench.py's ``0.6b``)
QWEN3_0_6B = {"hidden": 1024, "intermediate": 3072, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
              "vocab": 151936}
#: the fixed per-call cost of an eager forward of that shape measured on an H200 (docs/gpu.md: AR at 25.7
#: tokens/s, 1.6% of its time outside forwards: 38.3 ms per forward); host-bound, so taken for an H100 too
EAGER_FIXED_S = 38.3e-3
#: the fixed per-call cost assumed for a forward replayed as a CUDA graph (``--compile reduce-overhead`` with
#: static shapes): one graph launch and the host's own work per call, an assumption for the GPU check to test
GRAPH_FIXED_S = 1.0e-3


def roofline(shape: dict[str, int], gpu: dict[str, float], fixed_s: float, efficiency: float = 0.5,
             bytes_per_value: int = 2, device: str = "H100 (assumed)") -> CostModel:
    """A :class:`CostModel` for a transformer of ``shape`` on ``gpu`` by arithmetic, not measurement: per token
    fed 2 FLOP per layer weight, per logits row 2 FLOP per head weight, per query-key pair 4 FLOP per head
    dimension per head per layer (scores and the weighted sum), all at ``efficiency`` of the peak; per key
    attended over, its K and V read from memory per row; the fixed cost ``fixed_s`` per call of every kind
    (plus reading the weights once: the memory floor)."""
    h, layers = shape["hidden"], shape["layers"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    layer_weights = h * q + 2 * h * kv + q * h + 3 * h * shape["intermediate"]
    flops = gpu["flops"] * efficiency
    weights_bytes = (layers * layer_weights + shape["vocab"] * h) * bytes_per_value
    fixed = fixed_s + weights_bytes / gpu["bandwidth"]
    coef = {**{f"fixed_{k}": fixed for k in KINDS}, "ragged_row": 0.0, "narrow": 0.0,
            "token": 2 * layers * layer_weights / flops, "logit": 2 * shape["vocab"] * h / flops,
            "pair": 4 * shape["head_dim"] * shape["heads"] * layers / flops,
            "key": 2 * kv * layers * bytes_per_value / gpu["bandwidth"]}
    return CostModel(coef=coef, device=device,
                     note=f"roofline at {efficiency:.0%} of peak, fixed {1e3 * fixed_s:.2f} ms + weights read")


def predicted_rates(model: "CostModel | SwitchCost", profiles: dict[int, DecodeProfile], loop: LoopCost | float,
                    sizes: Sequence[int] = (1, 4, 16, 32, 64)) -> dict[int, float]:
    """Predicted tokens/s at each of ``sizes``: from the profile recorded at that batch size, else from the
    largest recorded one below it with every call carrying proportionally more sequences (lock-step)."""
    out = {}
    for size in sizes:
        base = size if size in profiles else max((b for b in profiles if b <= size), default=None)
        if base is None:
            continue
        p, factor = profiles[base], size / base
        scaled = p if factor == 1 else DecodeProfile(scale_rows(p.shapes, factor), round(p.sequence_forwards * factor),
                                                     round(p.tokens * factor), 0.0)
        out[size] = predict_decode(model, scaled, loop)["predicted_tokens_per_second"]
    return out
