"""Paired statistics for comparing two decoders on the same samples.

Two runs of an ablation decode the same samples, so their differences are paired: the test that can
tell them apart looks at the samples where they disagree, not at two independent accuracies.

* :func:`paired_accuracy`: the accuracy difference B - A with a 95% paired-bootstrap interval and the
  exact McNemar p-value (a two-sided binomial test on the discordant samples);
* :func:`throughput_ratio`: B's tokens/s over A's (total tokens / total time each) with a 95%
  paired-bootstrap interval over the samples;
* :func:`percentile` (defined in :mod:`refusion.core.stats`): the project's one percentile, linear
  interpolation between order statistics;
* :func:`same_accuracy`: a verdict that can fail: "holds" when the whole interval of the difference lies
  within ``margin`` of zero, "does not hold" when it lies wholly outside, "inconclusive" otherwise, and
  "not testable" when both runs are at the ceiling (every sample right, or every sample wrong, in both):
  there the data could not have said anything else.

Bootstrap resamples are drawn from a fixed seed, so a rerun on the same records gives the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from refusion.core.stats import percentile  # noqa: F401  (the project's one percentile, re-exported)

LEVEL = 0.95
RESAMPLES = 4000
SEED = 0


@dataclass(frozen=True)
class Interval:
    """An estimate with its ``level`` interval."""

    value: float
    low: float
    high: float
    level: float = LEVEL

    def __str__(self) -> str:
        return f"{self.value:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


@dataclass(frozen=True)
class PairedAccuracy:
    """Accuracy of B minus accuracy of A on the same ``n`` samples."""

    difference: Interval
    p_value: float  # exact McNemar: two-sided binomial test on the discordant samples
    n: int
    only_a: int  # samples A got right and B wrong
    only_b: int  # samples B got right and A wrong
    accuracy_a: float
    accuracy_b: float

    @property
    def at_ceiling(self) -> bool:
        """Both runs got every sample right, or both got every sample wrong."""
        return self.accuracy_a == self.accuracy_b and self.accuracy_a in (0.0, 1.0)


def _resamples(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]`` sample indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _interval(point: float, draws: np.ndarray, level: float) -> Interval:
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return Interval(float(point), float(low), float(high), level)


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: the binomial(only_a + only_b, 1/2) probability of a split at least
    as uneven as the one seen (1.0 when no sample is discordant)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_accuracy(correct_a: Sequence[bool], correct_b: Sequence[bool], level: float = LEVEL,
                    resamples: int = RESAMPLES, seed: int = SEED) -> PairedAccuracy:
    """Compare two runs' per-sample correctness on the same samples, in the same order."""
    a = np.asarray(correct_a, dtype=bool)
    b = np.asarray(correct_b, dtype=bool)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_accuracy needs two equally long, non-empty lists; got {a.shape} and {b.shape}")
    delta = b.astype(float) - a.astype(float)  # [n] in {-1, 0, 1}
    draws = delta[_resamples(a.size, resamples, seed)].mean(axis=1)
    only_a, only_b = int((a & ~b).sum()), int((b & ~a).sum())
    return PairedAccuracy(_interval(delta.mean(), draws, level), mcnemar_p(only_a, only_b), int(a.size),
                          only_a, only_b, float(a.mean()), float(b.mean()))


def throughput_ratio(tokens_a: Sequence[float], seconds_a: Sequence[float], tokens_b: Sequence[float],
                     seconds_b: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
                     seed: int = SEED) -> Interval:
    """B's tokens/s over A's on the same samples: ``(sum tok_b / sum s_b) / (sum tok_a / sum s_a)``, with a
    paired-bootstrap interval (the same resampled samples for both runs)."""
    ta, sa, tb, sb = (np.asarray(v, dtype=float) for v in (tokens_a, seconds_a, tokens_b, seconds_b))
    if not (ta.shape == sa.shape == tb.shape == sb.shape) or ta.ndim != 1 or ta.size == 0:
        raise ValueError("throughput_ratio needs four equally long, non-empty lists (one entry per sample)")
    if (sa <= 0).any() or (sb <= 0).any():
        raise ValueError("throughput_ratio: every sample's time must be positive")
    index = _resamples(ta.size, resamples, seed)
    draws = (tb[index].sum(1) / sb[index].sum(1)) / (ta[index].sum(1) / sa[index].sum(1))
    return _interval((tb.sum() / sb.sum()) / (ta.sum() / sa.sum()), draws, level)


Verdict = Literal["holds", "does not hold", "inconclusive", "not testable"]


def same_accuracy(paired: PairedAccuracy, margin: float = 0.05) -> Verdict:
    """Whether B is as accurate as A within ``margin`` (an equivalence test on the paired interval)."""
    if paired.at_ceiling:
        return "not testable"
    d = paired.difference
    if -margin <= d.low and d.high <= margin:
        return "holds"
    if d.high < -margin or d.low > margin:
        return "does not hold"
    return "inconclusive"
