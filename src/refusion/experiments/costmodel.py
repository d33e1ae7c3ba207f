"""The forward cost model: what one model call costs from its shape, and what a decode's forwards cost.

A forward (:class:`~refusion.models.backend.ForwardShape`: ``rows`` sequences of ``fed`` new tokens after
``past`` cached columns, ``logits_rows`` rows through the output head, its ``kind``) costs

    t = fixed[kind] + token * rows*fed + key * rows*(past+fed) + pair * rows*fed*(past+fed) + logit * logits_rows

seconds: a fixed per-call cost (Python, dispatch, kernel launches; one per kind, since a ragged batch's
call builds a mask and gathers rows that a dense causal call does not), per-token compute (the layers'
matmuls), per key read (the KV each row attends over, and the ragged cache's gather of it), per
query-key pair (the attention scores) and per logits row (the output head over the vocabulary).
:func:`fit` finds the non-negative coefficients from timed forwards (:func:`measure`, as
``scripts/forward_cost.py`` runs it) by least squares on the relative error. A decode's time is then its
forwards' costs plus its loop's own work outside them, ``loop`` seconds per sequence-forward (a
sequence taking part in a forward: Python that steps the decoder, reads the host, builds requests),
one constant per decoder calibrated on batch-1 decodes (:func:`calibrate_loop`), so the predicted
throughput at any batch size follows from the decode's counted forwards (:func:`predict_decode`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from refusion.models.backend import ForwardShape

if TYPE_CHECKING:
    from refusion.models.backend import Backbone

KINDS = ("causal", "masked", "ragged")
#: coefficient names, in feature order: a fixed cost per kind, then the per-unit costs
FEATURES = ("fixed_causal", "fixed_masked", "fixed_ragged", "token", "key", "pair", "logit")


def features(shape: ForwardShape) -> list[float]:
    """The feature vector of one forward (:data:`FEATURES` order)."""
    if shape.kind not in KINDS:
        raise ValueError(f"kind: {shape.kind!r} is not one of {KINDS}")
    keys = shape.past + shape.fed
    return [float(shape.kind == k) for k in KINDS] + [
        float(shape.rows * shape.fed), float(shape.rows * keys), float(shape.rows * shape.fed * keys),
        float(shape.logits_rows)]


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

    def predict(self, shape: ForwardShape) -> float:
        return float(np.dot(features(shape), [self.coef[f] for f in FEATURES]))

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
        units = {"fixed_causal": ("ms per call, dense causal", 1e3), "fixed_masked": ("ms per call, dense masked", 1e3),
                 "fixed_ragged": ("ms per call, ragged batch", 1e3), "token": ("us per token fed", 1e6),
                 "key": ("ns per key attended over (per row)", 1e9), "pair": ("ns per query-key pair", 1e9),
                 "logit": ("us per logits row", 1e6)}
        lines = ["| term | value | unit |", "|---|---|---|"]
        lines += [f"| {name} | {self.coef[name] * units[name][1]:.4g} | {units[name][0]} |" for name in FEATURES]
        return "\n".join(lines) + "\n"


def fit(shapes: Sequence[ForwardShape], device: str = "", note: str = "") -> CostModel:
    """The :class:`CostModel` whose non-negative coefficients minimise the squared relative error over
    ``shapes`` (each with ``seconds``). Exact non-negative least squares: every subset of the features
    the data exercise is solved unconstrained and the best feasible one kept (7 features: 127 solves).
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
#: the default grid of :func:`measure`: (kind, rows, fed, past); logits at the last fed position per row
GRID = tuple(
    [("causal", 1, fed, past) for fed in (1, 4, 16, 64) for past in (32, 160, 320)]
    + [("causal", rows, fed, 160) for rows in (4, 16) for fed in (1, 16)]
    + [("masked", 1, fed, past) for fed in (1, 16, 64) for past in (32, 160, 320)]
    + [("ragged", rows, fed, past) for rows in (1, 4, 16) for fed in (1, 4, 16, 64) for past in (32, 160)]
)


def _timed_call(bb: "Backbone", kind: str, rows: int, fed: int, past: int, logits_all: bool):
    """A zero-argument callable running one forward of that shape through the decoders' own caches (the
    cost of the cache's bookkeeping included), keeping no KV, so it can repeat."""
    import torch

    from refusion.core.loop import CAUSAL, FULL, ForwardRequest
    from refusion.models.kvcache import RaggedCache

    gen = torch.Generator().manual_seed(rows * 1000 + fed * 10 + past)
    vocab = min(int(bb.model.config.vocab_size), 500)

    def ids(n: int, r: int = 1):
        return torch.randint(10, vocab, (r, n), generator=gen)

    def pos(start: int, n: int, r: int = 1):
        return torch.arange(start, start + n).expand(r, n)

    logits_at = slice(None) if logits_all else [fed - 1]
    if kind in ("causal", "masked"):
        cache = bb.new_cache()
        cache.forward(ForwardRequest(cache, ids(past), pos(0, past), logits_at=None))
        cache.repeat_rows(rows)
        attention = FULL if kind == "masked" else CAUSAL
        request = ForwardRequest(cache, ids(fed, rows), pos(past, fed, rows), keep_kv=False, attention=attention,
                                 logits_at=logits_at)
        return lambda: cache.forward(request)
    shared = RaggedCache(bb)
    views = [shared.new_view() for _ in range(rows)]
    shared.forward([ForwardRequest(v, ids(past), pos(0, past), logits_at=None) for v in views])
    requests = [ForwardRequest(v, ids(fed), pos(past, fed), keep_kv=False, logits_at=logits_at) for v in views]
    return lambda: shared.forward(requests)


def measure(bb: "Backbone", grid: Iterable[tuple[str, int, int, int]] = GRID, repeats: int = 7,
            logits_all: bool = False) -> list[ForwardShape]:
    """Time one forward of every ``(kind, rows, fed, past)`` of ``grid`` through the decoders' caches:
    ``repeats`` rounds, each timing every shape once in grid order (interleaved, so machine noise hits all
    alike), after one untimed round; the median per shape. Logits at every fed position with
    ``logits_all``, else at the last one per row (what the AR-like steps read)."""
    grid = list(grid)
    calls = [_timed_call(bb, *g, logits_all) for g in grid]
    for call in calls:  # warm-up: allocator pools, one-off paths
        call()
    times: list[list[float]] = [[] for _ in grid]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            bb.synchronize()
            t0 = time.perf_counter()
            call()
            bb.synchronize()
            times[i].append(time.perf_counter() - t0)
    out = []
    for (kind, rows, fed, past), ts in zip(grid, times):
        out.append(ForwardShape(rows, fed, past, rows * (fed if logits_all else 1), kind, statistics.median(ts)))
    return out


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


def calibrate_loop(model: CostModel, profile: DecodeProfile) -> float:
    """Seconds of loop work per sequence-forward: the part of ``profile``'s wall time its forwards'
    predicted costs leave, over its sequence-forwards (at least 0)."""
    forwards, _ = model.total(profile.shapes)
    return max(0.0, (profile.wall_s - forwards) / max(1, profile.sequence_forwards))


def predict_decode(model: CostModel, profile: DecodeProfile, loop_s: float) -> dict[str, float]:
    """Predicted seconds and tokens/s of ``profile``'s decodes: its forwards' costs plus ``loop_s`` per
    sequence-forward; with the measured figures and the relative error of the predicted tokens/s."""
    forwards, fixed = model.total(profile.shapes)
    seconds = forwards + loop_s * profile.sequence_forwards
    predicted = profile.tokens / seconds
    measured = profile.tokens / profile.wall_s if profile.wall_s else float("nan")
    return {"predicted_s": seconds, "forward_s": forwards, "fixed_s": fixed, "loop_s": loop_s * profile.sequence_forwards,
            "predicted_tokens_per_second": predicted, "measured_tokens_per_second": measured,
            "error": predicted / measured - 1 if measured else float("nan"), "calls": len(profile.shapes)}


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
