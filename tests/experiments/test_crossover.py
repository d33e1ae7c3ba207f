"""The crossover batch size against AR (interpolation, censoring, bootstrap interval), latency
percentiles and d3LLM's AUP."""

import math

import numpy as np
import pytest

from refusion.experiments.crossover import aup, crossing, crossover_interval
from refusion.experiments.stats import percentile


def test_crossing_interpolates_in_log_batch_and_log_ratio():
    # 2x at 4, 0.5x at 16: log r falls linearly from log 2 to -log 2 over log2 4 .. log2 16 -> crosses at 8
    assert crossing([1, 4, 16], [3.0, 2.0, 0.5]) == pytest.approx(8.0)
    assert crossing([1, 2], [1.0, 0.25]) == pytest.approx(1.0)  # exactly 1 at 1: the crossing starts there
    assert crossing([1, 2, 4], [0.9, 1.2, 0.5]) == 1.0  # behind at the smallest size: censored there
    assert math.isinf(crossing([1, 2, 4], [3.0, 2.0, 1.1]))  # never behind: beyond the largest size
    assert crossing([1, 2, 4, 8], [3.0, 0.5, 2.0, 0.5]) == pytest.approx(2 ** (math.log(3) / (math.log(3) - math.log(0.5))))


def test_crossover_interval_brackets_the_point_and_pairs_the_samples():
    rng = np.random.default_rng(1)
    sizes = [1, 2, 4, 8, 16]
    n = 40
    tokens = rng.integers(20, 60, size=(len(sizes), n)).astype(float)
    ar_seconds = tokens / np.array([100, 190, 360, 650, 1100])[:, None]  # AR gains ~11x
    dec_seconds = tokens / np.array([400, 520, 600, 660, 700])[:, None] * rng.uniform(0.8, 1.2, (len(sizes), n))
    c = crossover_interval(sizes, tokens, ar_seconds, tokens, dec_seconds, resamples=500)
    assert 4 < c.low <= c.value <= c.high < 16
    assert "[" in c.describe() and c.as_dict()["crossover"] == c.value
    # the same samples with the decoder always ahead: censored above the largest size, said as such
    ahead = crossover_interval(sizes, tokens, ar_seconds * 100, tokens, dec_seconds, resamples=200)
    assert math.isinf(ahead.value) and ahead.describe() == "> 16 [> 16, > 16]"
    assert ahead.as_dict()["crossover"] is None
    with pytest.raises(ValueError, match=r"\[5, n\]"):
        crossover_interval(sizes, tokens[:, :3], ar_seconds, tokens, dec_seconds)


def test_percentile_and_aup():
    assert percentile([1, 2, 3, 4, 5], 50) == 3 and percentile([0, 10], 95) == pytest.approx(9.5)
    with pytest.raises(ValueError):
        percentile([], 50)
    assert aup([(4.0, 90.0)], 95.0) == pytest.approx(360.0)  # one point: TPF x accuracy
    # d3LLM's curve: first point's area, then trapezoids of accuracy x W(accuracy); W = 1 at y_max
    w = math.exp(-3 * (1 - 88 / 90))
    want = 1 * 90 + 0.5 * (3 - 1) * (88 * w + 90 * 1.0)
    assert aup([(3.0, 88.0), (1.0, 90.0)], 90.0) == pytest.approx(want)
    # a point more than 5 points below the lowest-TPF point's accuracy is dropped
    assert aup([(1.0, 90.0), (3.0, 88.0), (9.0, 80.0)], 90.0) == pytest.approx(want)
    with pytest.raises(ValueError, match="TPF"):
        aup([(0.0, 90.0)], 90.0)
