"""Tests of the seed statistics on values of extreme magnitude: the standard deviation, the paired t interval and the
paired p-value of differences far below 1e-154 or far above 1e154, whose squares underflow to 0 or overflow to
infinity, against the standard library's exactly rounded mean and standard deviation and scipy's t distribution."""

from __future__ import annotations

import math
import statistics as stdlib_statistics

import pytest
from scipy import stats

from gpattn.comparison import paired_difference, paired_p_value, summarize_seeds


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
