"""Where a decoder stops paying against AR as the batch grows, and AUP.

* :func:`crossing`: the batch size at which a ratio curve (a decoder's aggregate tokens/s over AR's,
  one value per measured batch size) first falls below 1, interpolated between the two measured sizes
  around the crossing, linearly in ``log2(batch size)`` and ``log(ratio)``;
* :func:`crossover_interval`: that crossing with a paired-bootstrap interval: every resample draws the
  samples (with replacement) once and uses the same draw at every batch size, for the decoder and for AR;
  each drawn sample contributes its generated tokens and its share of its chunk's wall time
  (``batch_wall_s / batch_samples``), the ratio curve is recomputed from the drawn samples' totals and its
  crossing found again. The interval is therefore over the prompt set (which samples were measured); the
  timing noise of a chunk enters only through the measured chunk times themselves;
* :func:`aup`: d3LLM's accuracy under parallelism (AUP) of (TPF, accuracy) points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from refusion.experiments.stats import LEVEL, RESAMPLES, SEED


def crossing(sizes: Sequence[int], ratios: Sequence[float]) -> float:
    """The batch size at which ``ratios`` (one per size of ``sizes``, increasing) first falls below 1.

    ``sizes[0]`` when the ratio is below 1 already there (the decoder is never ahead: the crossing is at or
    below the smallest size measured); ``inf`` when it never falls below 1 (the crossing lies beyond the
    largest size measured). Otherwise, with ``a`` the last size at or above 1 and ``b`` the first below,
    the point where the straight line through ``(log2 a, log r_a)`` and ``(log2 b, log r_b)`` reaches 0."""
    if len(sizes) != len(ratios) or not len(sizes):
        raise ValueError("crossing needs one ratio per batch size")
    if ratios[0] < 1:
        return float(sizes[0])
    for i in range(1, len(sizes)):
        if ratios[i] < 1:
            la, lb = math.log2(sizes[i - 1]), math.log2(sizes[i])
            ra, rb = math.log(ratios[i - 1]), math.log(ratios[i])
            return 2 ** (la + (lb - la) * ra / (ra - rb))
    return math.inf


@dataclass(frozen=True)
class Crossover:
    """A crossing batch size with its interval. ``inf`` (beyond the largest size measured) and the
    smallest size (at or below it) are censored values: :meth:`describe` writes them as ``> N`` / ``<= N``."""

    value: float
    low: float
    high: float
    smallest: int
    largest: int
    level: float = LEVEL

    def _fmt(self, x: float) -> str:
        if math.isinf(x):
            return f"> {self.largest}"
        if x <= self.smallest:
            return f"<= {self.smallest}"
        return f"{x:.1f}"

    def describe(self) -> str:
        return f"{self._fmt(self.value)} [{self._fmt(self.low)}, {self._fmt(self.high)}]"

    def as_dict(self) -> dict[str, object]:
        def num(x: float) -> float | None:
            return None if math.isinf(x) else x
        return {"crossover": num(self.value), "crossover_low": num(self.low), "crossover_high": num(self.high),
                "crossover_text": self.describe()}


def crossover_interval(sizes: Sequence[int], tokens_a: np.ndarray, seconds_a: np.ndarray, tokens_b: np.ndarray,
                       seconds_b: np.ndarray, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = SEED) -> Crossover:
    """B's crossing of A (the ratio of B's tokens/s over A's falls below 1) with a paired-bootstrap interval.

    Each argument array is ``[len(sizes), n]``: per batch size, per sample (the same n samples, in the same
    order, at every size), its generated tokens and its decode time share. See the module docstring."""
    arrays = [np.asarray(x, dtype=float) for x in (tokens_a, seconds_a, tokens_b, seconds_b)]
    shape = arrays[0].shape
    if any(x.shape != shape for x in arrays) or len(shape) != 2 or shape[0] != len(sizes) or shape[1] == 0:
        raise ValueError(f"crossover_interval needs four [{len(sizes)}, n] arrays with n > 0; got "
                         f"{[x.shape for x in arrays]}")
    ta, sa, tb, sb = arrays

    def ratios(index: np.ndarray) -> np.ndarray:  # index [R, n] -> [R, sizes]
        return ((tb[:, index].sum(-1) / sb[:, index].sum(-1)) / (ta[:, index].sum(-1) / sa[:, index].sum(-1))).T

    point = crossing(sizes, ratios(np.arange(shape[1])[None])[0])
    draws = np.random.default_rng(seed).integers(0, shape[1], size=(resamples, shape[1]))
    found = sorted(crossing(sizes, r) for r in ratios(draws))
    tail = (1 - level) / 2
    low = found[int(math.floor(tail * resamples))]
    high = found[min(resamples - 1, int(math.ceil((1 - tail) * resamples)) - 1)]
    return Crossover(point, low, high, int(sizes[0]), int(sizes[-1]), level)


def _weight(y: float, y_max: float, alpha: float) -> float:
    return min(math.exp(-alpha * (1 - y / y_max)), 1.0)


def aup(points: Sequence[tuple[float, float]], y_max: float, alpha: float = 3.0, y_min_offset: float = 5.0) -> float:
    """d3LLM's accuracy under parallelism of ``points`` = (TPF, accuracy in percent) of one decoder's settings.

    The points are sorted by TPF; those more than ``y_min_offset`` points below the lowest-TPF point's
    accuracy are dropped; then AUP = rho_1 * y_1 + sum_i (rho_i - rho_{i-1}) * (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2
    with W(y) = min(exp(-alpha (1 - y / y_max)), 1) and ``y_max`` the highest accuracy of every method
    compared. One point gives TPF x accuracy."""
    if not points:
        raise ValueError("aup of no points")
    if any(rho <= 0 for rho, _ in points):
        raise ValueError(f"aup: every TPF must be positive, got {[rho for rho, _ in points]}")
    if y_max <= 0:
        raise ValueError(f"aup: y_max must be positive, got {y_max}")
    pts = sorted(points)
    floor = pts[0][1] - y_min_offset
    pts = [(rho, y) for rho, y in pts if y >= floor]
    total = pts[0][0] * pts[0][1]
    for (r0, y0), (r1, y1) in zip(pts, pts[1:]):
        total += 0.5 * (r1 - r0) * (y1 * _weight(y1, y_max, alpha) + y0 * _weight(y0, y_max, alpha))
    return total
