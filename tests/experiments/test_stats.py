"""Paired statistics: intervals that cover, a McNemar test that matches the binomial, verdicts that can fail."""

import math

import numpy as np
import pytest

from refusion.experiments.stats import mcnemar_p, paired_accuracy, same_accuracy, throughput_ratio


def test_mcnemar_matches_the_exact_binomial():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(3, 3) == 1.0
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)  # all six discordant samples on one side
    assert mcnemar_p(1, 9) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_p(9, 1) == mcnemar_p(1, 9)


def test_paired_accuracy_counts_and_interval():
    a = [True] * 80 + [False] * 20
    b = [True] * 70 + [False] * 10 + [True] * 5 + [False] * 15  # loses 10, gains 5
    r = paired_accuracy(a, b)
    assert (r.n, r.only_a, r.only_b) == (100, 10, 5)
    assert r.difference.value == pytest.approx(-0.05)
    assert r.difference.low < -0.05 < r.difference.high
    assert 0.0 < r.p_value < 1.0 and not r.at_ceiling
    with pytest.raises(ValueError, match="equally long"):
        paired_accuracy([True], [True, False])


def test_the_interval_covers_the_true_difference_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(200):
        a = rng.random(200) < 0.7
        b = np.where(rng.random(200) < 0.9, a, rng.random(200) < 0.7)  # same accuracy, correlated
        d = paired_accuracy(a, b, resamples=500, seed=trial).difference
        covered += d.low <= 0.0 <= d.high
    assert 0.88 <= covered / 200 <= 0.99


def test_throughput_ratio_and_its_interval():
    tokens = [100.0] * 50
    r = throughput_ratio(tokens, [1.0] * 50, tokens, [0.5] * 50)
    assert r.value == pytest.approx(2.0) and r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)
    rng = np.random.default_rng(0)
    noisy = throughput_ratio(tokens, list(1 + 0.3 * rng.random(50)), tokens, list(0.5 + 0.3 * rng.random(50)))
    assert noisy.low < noisy.value < noisy.high
    with pytest.raises(ValueError, match="positive"):
        throughput_ratio([1.0], [0.0], [1.0], [1.0])


def test_same_accuracy_can_fail_and_says_when_it_cannot_be_tested():
    ceiling = paired_accuracy([True] * 50, [True] * 50)
    assert ceiling.at_ceiling and same_accuracy(ceiling) == "not testable"
    close = paired_accuracy([True] * 180 + [False] * 20, [True] * 179 + [False, True] + [False] * 19)
    assert same_accuracy(close) == "holds"
    worse = paired_accuracy([True] * 200, [True] * 100 + [False] * 100)
    assert same_accuracy(worse) == "does not hold"
    small = paired_accuracy([True, False, True, True], [True, True, False, True])
    assert same_accuracy(small) == "inconclusive"
    assert not math.isnan(small.p_value)
