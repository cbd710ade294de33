"""Tests of the seed statistics on values of extreme magnitude: the standard deviation, the paired t interval and the
paired p-value of differences far below 1e-154 or far above 1e154, whose squares underflow to 0 or overflow to
infinity, against the standard library's exactly rounded mean and standard deviation and scipy's t distribution."""

from __future__ import annotations

import math
import statistics as stdlib_statistics

import pytest
from scipy import stats

from gpattn.comparison import hierarchical_difference, paired_difference, paired_p_value, summarize_seeds


@pytest.mark.parametrize("scale", [1e-170, 1e-300, 1e200, 1e300])
def test_tiny_and_huge_differences_keep_their_spread(scale: float) -> None:
    # noise around 0: no interval may collapse to a point that excludes 0, nor widen to (-inf, inf)
    differences = [scale * value for value in (1.0, -1.0, 2.0, 0.5, -1.5)]
    n = len(differences)
    mean, std = stdlib_statistics.fmean(differences), stdlib_statistics.stdev(differences)  # exact sums, no squares
    half_width = stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)
    result = paired_difference(differences, [0.0] * n)
    assert result.mean == pytest.approx(mean, rel=1e-12)
    assert (result.low, result.high) == pytest.approx((mean - half_width, mean + half_width), rel=1e-12)
    assert not result.significant
    p_value = 2 * stats.t.sf(abs(mean / (std / math.sqrt(n))), n - 1)
    assert paired_p_value(differences, [0.0] * n) == pytest.approx(p_value, rel=1e-12)  # 0.77, not 0 or 1
    summary = summarize_seeds(differences)
    assert (summary.mean, summary.std) == pytest.approx((mean, std), rel=1e-12)


def test_a_huge_difference_with_a_small_spread_keeps_a_finite_interval() -> None:
    # d = 1e308 (1, 1 + 1e-7, 1 + 2e-7): the half-width 6e300 is finite, but the scale 2^1022 times the t quantile
    # 12.7... overflowed first, giving (-inf, inf) beside a p-value of 3e-15
    unit = [1.0, 1.0000001, 1.0000002]
    differences = [1e308 * value for value in unit]
    result = paired_difference(differences, [0.0] * 3)
    interval = stats.ttest_rel(unit, [0.0] * 3).confidence_interval(0.95)  # the same interval divided by 1e308
    assert (result.low, result.high) == pytest.approx((1e308 * interval.low, 1e308 * interval.high), rel=1e-12)
    assert result.significant


@pytest.mark.parametrize("method", ["t", "bootstrap", "p", "hierarchical"])
def test_differences_that_overflow_are_refused(method: str) -> None:
    # 1.5e308 - (-1.5e308) is infinite: the mean was inf with a NaN interval marked significant, the p-value NaN
    # (which Holm's adjustment reads as "no test")
    reference, other = [1.5e308, 1.6e308, 1.4e308], [-1.5e308, -1.6e308, -1.4e308]
    with pytest.raises(ValueError, match="overflow"):
        if method == "p":
            paired_p_value(reference, other)
        elif method == "hierarchical":
            hierarchical_difference(
                {seed: [value] for seed, value in enumerate(reference)},
                {seed: [value] for seed, value in enumerate(other)},
            )
        else:
            paired_difference(reference, other, method=method)


def test_the_hierarchical_mean_of_huge_differences_does_not_overflow() -> None:
    # per-example differences near 1.5e308: their sum overflows unless scaled first (the mean was inf, the interval
    # NaN); the reference is the exactly rounded mean of the values over 1e308
    reference = {0: [1.5e308, 1.4e308], 1: [1.6e308, 1.5e308]}
    other = {0: [0.0, 0.0], 1: [0.0, 0.0]}
    result = hierarchical_difference(reference, other, num_resamples=2000)
    assert result.mean == pytest.approx(1e308 * stdlib_statistics.fmean([1.5, 1.4, 1.6, 1.5]), rel=1e-15)
    assert math.isfinite(result.low) and math.isfinite(result.high)
    assert 1.4e308 <= result.low <= result.mean <= result.high <= 1.6e308
