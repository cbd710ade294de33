"""Tests of the seed statistics: summaries against NumPy and the stdlib, paired t intervals against scipy.stats and a
hand computation, the percentile bootstrap against scipy.stats.bootstrap and its exact small-n limit, significance,
pairing by seed, and the refusal of too few seeds."""

from __future__ import annotations

import math
import statistics as stdlib_statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from gpattn.comparison import compare_to_reference, paired_difference, summarize_seeds


def test_summary_against_stdlib() -> None:
    values = [0.81, 0.79, 0.84, 0.80, 0.83]
    summary = summarize_seeds(values)
    assert summary.n == 5
    assert summary.mean == pytest.approx(stdlib_statistics.mean(values), abs=1e-15)
    assert summary.std == pytest.approx(stdlib_statistics.stdev(values), abs=1e-15)  # divisor n - 1
    assert summarize_seeds({3: 0.5, 7: 0.7}) == summarize_seeds([0.5, 0.7])
    single = summarize_seeds([0.25])
    assert single.mean == 0.25 and single.n == 1 and math.isnan(single.std)
    assert str(summarize_seeds([1.0, 3.0])) == "2 ± 1.4 (n=2)"


def test_t_interval_hand_computed() -> None:
    # d = 1..5: mean 3, s = sqrt(2.5) = 1.5811388, s / sqrt(5) = 0.7071068, t_{0.975, 4} = 2.7764451
    # -> 3 -/+ 1.9632432 = [1.0367568, 4.9632432]
    result = paired_difference([2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert result.mean == pytest.approx(3.0, abs=1e-12)
    assert result.low == pytest.approx(1.0367568, abs=1e-7)
    assert result.high == pytest.approx(4.9632432, abs=1e-7)
    assert (result.n, result.method, result.confidence, result.seeds) == (5, "t", 0.95, (0, 1, 2, 3, 4))
    assert result.significant
    assert str(result) == "+3 [+1.037, +4.963] * (95 % t, n=5)"


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 12),
    shift=st.floats(-1.0, 1.0),
    confidence=st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)
def test_t_interval_against_scipy(seed: int, n: int, shift: float, confidence: float) -> None:
    rng = np.random.default_rng(seed)
    other = rng.normal(size=n)
    reference = other + shift + 0.5 * rng.normal(size=n)
    result = paired_difference(list(reference), list(other), confidence=confidence)
    test = stats.ttest_rel(reference, other)
    interval = test.confidence_interval(confidence_level=confidence)
    assert result.low == pytest.approx(interval.low, abs=1e-10)
    assert result.high == pytest.approx(interval.high, abs=1e-10)
    # the interval excludes 0 exactly when the two-sided paired t test rejects at level 1 - confidence
    if abs(test.pvalue - (1 - confidence)) > 1e-9:
        assert result.significant == (test.pvalue < 1 - confidence)


def test_bootstrap_against_scipy() -> None:
    rng = np.random.default_rng(0)
    differences = rng.normal(0.3, 1.0, size=8)
    result = paired_difference(list(differences), [0.0] * 8, method="bootstrap", num_resamples=40000, seed=1)
    reference = stats.bootstrap(
        (differences,), np.mean, method="percentile", n_resamples=40000, random_state=2
    ).confidence_interval
    # two independent Monte Carlo estimates of the same quantiles (their spread is about 0.01 here)
    assert result.low == pytest.approx(reference.low, abs=0.03)
    assert result.high == pytest.approx(reference.high, abs=0.03)
    again = paired_difference(list(differences), [0.0] * 8, method="bootstrap", num_resamples=40000, seed=1)
    assert (again.low, again.high) == (result.low, result.high)


def test_bootstrap_exact_for_two_pairs() -> None:
    # with d = (a, b) the resampled mean is a, (a + b) / 2, b with probabilities 1/4, 1/2, 1/4, so its 2.5 % and
    # 97.5 % quantiles are a and b
    result = paired_difference([1.0, 4.0], [0.5, 1.0], method="bootstrap")
    assert (result.low, result.high) == (0.5, 3.0)
    assert result.mean == pytest.approx(1.75)


def test_significance_needs_the_interval_to_exclude_zero() -> None:
    noisy = paired_difference([1.0, -1.0, 2.0, -2.0], [0.0, 0.0, 0.0, 0.0])
    assert noisy.low < 0 < noisy.high and not noisy.significant
    constant = paired_difference([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])  # zero spread: the interval is the point 0.5
    assert (constant.low, constant.high) == (0.5, 0.5) and constant.significant
    same = paired_difference([0.3, 0.4], [0.3, 0.4])
    assert (same.low, same.high) == (0.0, 0.0) and not same.significant


def test_pairs_by_seed() -> None:
    reference = {0: 0.9, 1: 0.8, 2: 0.85, 4: 0.7}
    other = {4: 0.6, 2: 0.8, 1: 0.75, 3: 0.1}
    result = paired_difference(reference, other)
    assert result.seeds == (1, 2, 4) and result.n == 3
    expected = paired_difference([0.8, 0.85, 0.7], [0.75, 0.8, 0.6])
    assert (result.mean, result.low, result.high) == (expected.mean, expected.low, expected.high)


def test_compare_to_reference() -> None:
    results = {"kep_svgp": [0.8, 0.82, 0.85], "softmax": [0.78, 0.8, 0.8], "sgpa": [0.81, 0.8, 0.86]}
    table = compare_to_reference(results, "kep_svgp", method="t")
    assert list(table) == ["softmax", "sgpa"]
    assert table["softmax"] == paired_difference(results["kep_svgp"], results["softmax"])
    with pytest.raises(ValueError, match="reference"):
        compare_to_reference(results, "primal")
    with pytest.raises(ValueError, match="min_pairs=5"):
        compare_to_reference(results, "kep_svgp", min_pairs=5)


@pytest.mark.parametrize(
    ("reference", "other", "options", "match"),
    [
        ([0.5], [0.4], {}, "fewer than min_pairs=2"),
        ([0.5, 0.6, 0.7, 0.8], [0.4] * 4, {"min_pairs": 5}, "fewer than min_pairs=5"),
        ({0: 0.5, 1: 0.6}, {1: 0.4, 2: 0.3}, {}, r"1 paired seed\(s\) \[1\]"),
        ([0.5, 0.6], [0.4], {}, "as many"),
        ([0.5, math.nan], [0.4, 0.3], {}, "finite"),
        ([0.5, 0.6], [0.4, 0.3], {"min_pairs": 1}, "min_pairs"),
        ([0.5, 0.6], [0.4, 0.3], {"confidence": 1.0}, "confidence"),
        ([0.5, 0.6], [0.4, 0.3], {"method": "wilcoxon"}, "method"),
        ([0.5, 0.6], [0.4, 0.3], {"num_resamples": 0}, "num_resamples"),
        ({0: 0.5, 1: 0.6}, [0.4, 0.3], {}, "both"),
        ("0.5", [0.4], {}, "sequence"),
        ([[0.5, 0.6]], [[0.4, 0.3]], {}, "one value per seed"),
    ],
)
def test_bad_inputs_raise(reference, other, options, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paired_difference(reference, other, **options)


def test_summary_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="at least one"):
        summarize_seeds([])
    with pytest.raises(ValueError, match="finite"):
        summarize_seeds([0.1, math.inf])
    with pytest.raises(ValueError, match="numbers"):
        summarize_seeds(["a", "b"])
