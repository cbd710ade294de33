"""Tests of the seed statistics: summaries against NumPy and the stdlib, paired t intervals against scipy.stats and a
hand computation, the percentile bootstrap against scipy.stats.bootstrap and its exact small-n limit, significance,
pairing by seed, and the refusal of too few seeds; the paired p-value against scipy, Holm's adjustment against a
brute-force run of Holm's procedure, and the seeds-and-examples bootstrap against its exact variance, its limits
(one difference per seed, a constant difference) and a simulated coverage."""

from __future__ import annotations

import math
import statistics as stdlib_statistics
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from gpattn.comparison import (
    compare_to_reference,
    hierarchical_difference,
    holm_adjusted,
    paired_difference,
    paired_p_value,
    summarize_seeds,
)


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


# -- the paired p-value ------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 12), shift=st.floats(-1.0, 1.0))
def test_p_value_against_scipy(seed: int, n: int, shift: float) -> None:
    rng = np.random.default_rng(seed)
    other = rng.normal(size=n)
    reference = other + shift + 0.5 * rng.normal(size=n)
    assert paired_p_value(list(reference), list(other)) == pytest.approx(
        stats.ttest_rel(reference, other).pvalue, rel=1e-12, abs=1e-300
    )
    # the same decision as the interval at every level (away from the boundary)
    p_value = paired_p_value(list(reference), list(other))
    for confidence in (0.8, 0.95):
        if abs(p_value - (1 - confidence)) > 1e-9:
            assert paired_difference(list(reference), list(other), confidence=confidence).significant == (
                p_value < 1 - confidence
            )


def test_p_value_limits_and_pairing() -> None:
    assert paired_p_value([0.3, 0.4, 0.5], [0.3, 0.4, 0.5]) == 1.0  # no difference at all (scipy: NaN)
    assert paired_p_value([1.5, 2.5, 3.5], [1.0, 2.0, 3.0]) == 0.0  # the same non-zero difference on every seed
    # equal up to rounding (0.19999999999999998, 0.19999999999999996, 0.20000000000000007): no scipy warning either
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paired_p_value([0.3, 0.7, 1.1], [0.1, 0.5, 0.9]) == 0.0
    assert math.isnan(paired_p_value([0.5], [0.4]))  # one pair: no test
    assert math.isnan(paired_p_value({0: 0.5, 1: 0.6}, {1: 0.4, 2: 0.3}))
    by_seed = paired_p_value({0: 0.9, 1: 0.8, 2: 0.85, 4: 0.7}, {4: 0.6, 2: 0.8, 1: 0.75, 3: 0.1})
    assert by_seed == paired_p_value([0.8, 0.85, 0.7], [0.75, 0.8, 0.6])
    with pytest.raises(ValueError, match="finite"):
        paired_p_value([0.5, math.nan], [0.4, 0.3])


# -- Holm's adjustment -------------------------------------------------------------------------------------------------
def _holm_rejects(p_values: list[float], alpha: float) -> set[int]:
    """Holm's procedure at level alpha as Holm (1979) states it: walk the p-values in increasing order and reject
    while p_(k) <= alpha / (m - k + 1) (tested as (m - k + 1) p_(k) <= alpha: the same, without a rounded quotient)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected: set[int] = set()
    for k, index in enumerate(order, start=1):
        if (len(p_values) - k + 1) * p_values[index] > alpha:
            break
        rejected.add(index)
    return rejected


def _brute_force_holm(p_values: list[float]) -> list[float]:
    """The adjusted p-value by definition: the smallest level at which the procedure rejects the hypothesis, 1 when
    no level up to 1 does. The set of rejections changes only at the levels (m - k + 1) p_(k), so the smallest level
    is one of them."""
    m = len(p_values)
    levels = sorted({min(1.0, (m - k) * p) for k, p in enumerate(sorted(p_values))})
    return [next((a for a in levels if index in _holm_rejects(p_values, a)), 1.0) for index in range(m)]


def test_holm_textbook_example() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running maximum 0.02, 0.03, 0.06, 0.06
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm_adjusted([0.2]) == [0.2]  # one test: no adjustment
    assert holm_adjusted([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert holm_adjusted([]) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.02, 0.04, 0.05, 0.3, 1.0]) | st.floats(0.0, 1.0), max_size=9))
def test_holm_against_the_procedure(p_values: list[float]) -> None:
    # ties and exact zeros and ones included (the sampled values)
    assert holm_adjusted(p_values) == pytest.approx(_brute_force_holm(p_values), abs=1e-15)


def test_holm_leaves_missing_tests_out() -> None:
    adjusted = holm_adjusted([0.01, math.nan, 0.04])
    assert adjusted[0] == pytest.approx(0.02) and adjusted[2] == pytest.approx(0.04) and math.isnan(adjusted[1])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        holm_adjusted([0.1, 1.5])
    with pytest.raises(ValueError, match="flat"):
        holm_adjusted([[0.1, 0.2]])


# -- the seeds-and-examples bootstrap ----------------------------------------------------------------------------------
def _per_seed(matrix: np.ndarray) -> dict[int, list[float]]:
    return {seed: list(row) for seed, row in enumerate(matrix)}


def test_hierarchical_variance_is_the_pigeonhole_closed_form() -> None:
    # Var*(w^T D v) = var(seed means)/S + var(example means)/n + ||D_c||_F^2 / (S n)^2 (plug-in variances), computed
    # here from D directly and compared with the spread of the resampled means (the interval of a normal with that
    # variance, within Monte Carlo error)
    rng = np.random.default_rng(3)
    num_seeds, num_examples = 6, 40
    difference = (
        0.3 + rng.normal(0, 0.2, (num_seeds, 1)) + rng.normal(0, 0.5, (1, num_examples))
        + rng.normal(0, 0.4, (num_seeds, num_examples))
    )  # fmt: skip
    centred = difference - difference.mean(1, keepdims=True) - difference.mean(0, keepdims=True) + difference.mean()
    variance = (
        difference.mean(1).var() / num_seeds
        + difference.mean(0).var() / num_examples
        + (centred**2).sum() / (num_seeds * num_examples) ** 2
    )
    result = hierarchical_difference(_per_seed(difference), _per_seed(np.zeros_like(difference)), confidence=0.6827,
                                     num_resamples=40000, seed=5)  # fmt: skip
    assert result.mean == pytest.approx(difference.mean(), abs=1e-14)
    assert (result.high - result.low) / 2 == pytest.approx(math.sqrt(variance), rel=0.04)
    assert result.method == "hierarchical" and result.n == num_seeds and result.seeds == tuple(range(num_seeds))


def test_hierarchical_with_one_difference_per_seed_is_the_seed_bootstrap() -> None:
    # no variation within a seed: resampling the examples changes nothing, and with two seeds the resampled mean is
    # a, (a + b) / 2, b with probabilities 1/4, 1/2, 1/4, so the 2.5 % and 97.5 % quantiles are a and b exactly
    reference = {0: [1.0] * 30, 1: [4.0] * 30}
    other = {0: [0.5] * 30, 1: [1.0] * 30}
    result = hierarchical_difference(reference, other)
    assert (result.low, result.high) == pytest.approx((0.5, 3.0), abs=1e-12)
    assert result.mean == pytest.approx(1.75, abs=1e-15)
    assert result.low == pytest.approx(paired_difference([1.0, 4.0], [0.5, 1.0], method="bootstrap").low, abs=1e-12)
    # more seeds: the same distribution as the seed bootstrap (two independent Monte Carlo estimates)
    rng = np.random.default_rng(1)
    per_seed = rng.normal(0.2, 1.0, 8)
    constant = {seed: [value] * 25 for seed, value in enumerate(per_seed)}
    zeros = {seed: [0.0] * 25 for seed in range(8)}
    hierarchical = hierarchical_difference(constant, zeros, num_resamples=40000, seed=2)
    seeds_only = paired_difference(list(per_seed), [0.0] * 8, method="bootstrap", num_resamples=40000, seed=3)
    assert hierarchical.low == pytest.approx(seeds_only.low, abs=0.03)
    assert hierarchical.high == pytest.approx(seeds_only.high, abs=0.03)


def test_hierarchical_constant_difference_is_a_point() -> None:
    rng = np.random.default_rng(0)
    other = {seed: list(rng.uniform(0, 2, 50)) for seed in range(5)}
    reference = {seed: [value + 0.125 for value in values] for seed, values in other.items()}
    result = hierarchical_difference(reference, other)
    assert result.low == pytest.approx(0.125, abs=1e-15) and result.high == pytest.approx(0.125, abs=1e-15)
    assert result.significant


def test_hierarchical_interval_covers_at_its_level() -> None:
    # D_si = mu + a_i + b_s + e_si (example, seed and interaction effects; a new test set and new seeds each time):
    # the 90 % interval covers mu in about 90 % of 300 simulations (standard error 1.7 points; the interval is mildly
    # conservative in the interaction term). A nested bootstrap (examples resampled per seed) covers about 75 % here.
    rng = np.random.default_rng(11)
    num_seeds, num_examples, mu = 10, 50, 0.1
    covered = 0
    simulations = 300
    for index in range(simulations):
        difference = (
            mu + rng.normal(0, 1.0, (1, num_examples)) + rng.normal(0, 0.3, (num_seeds, 1))
            + rng.normal(0, 1.0, (num_seeds, num_examples))
        )  # fmt: skip
        result = hierarchical_difference(_per_seed(difference), _per_seed(np.zeros_like(difference)),
                                         confidence=0.9, num_resamples=1000, seed=index)  # fmt: skip
        covered += result.low <= mu <= result.high
    assert 0.84 <= covered / simulations <= 0.97


def test_hierarchical_pairs_by_seed_and_checks_its_input() -> None:
    reference = {0: [1.0, 2.0], 1: [3.0, 4.0], 5: [0.0, 0.0]}
    other = {1: [1.0, 1.0], 0: [0.0, 0.0], 7: [9.0, 9.0]}
    result = hierarchical_difference(reference, other, num_resamples=200)
    assert result.seeds == (0, 1) and result.mean == pytest.approx(2.0)
    with pytest.raises(ValueError, match="fewer than min_pairs=3"):
        hierarchical_difference(reference, other, min_pairs=3)
    with pytest.raises(ValueError, match="the same examples for both methods"):
        hierarchical_difference({0: [1.0], 1: [2.0]}, {0: [1.0, 2.0], 1: [2.0]})
    with pytest.raises(ValueError, match="same test examples for every seed"):
        hierarchical_difference({0: [1.0], 1: [2.0, 3.0]}, {0: [1.0], 1: [2.0, 3.0]})
    with pytest.raises(ValueError, match="finite"):
        hierarchical_difference({0: [1.0], 1: [math.inf]}, {0: [1.0], 1: [2.0]})
    with pytest.raises(ValueError, match="mappings"):
        hierarchical_difference([[1.0], [2.0]], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="confidence"):
        hierarchical_difference(reference, other, confidence=1.0)
