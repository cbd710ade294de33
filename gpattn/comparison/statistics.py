r"""Statistics over training seeds: mean, standard deviation and count per metric, and paired differences between
two methods with a confidence interval.

A comparison trains every method once per seed, so two methods' runs pair up by seed (same data split, same
initialisation seed). The paired difference of a metric, :math:`d_s = m^\text{ref}_s - m^\text{other}_s` for the
:math:`n` seeds both have, removes the seed-to-seed variation that both share, which an unpaired comparison of two
means would count twice.

Intervals (confidence level :math:`1 - \alpha`, 95 % by default):

* ``method="t"`` (default): the paired :math:`t` interval
  :math:`\bar d \pm t_{1 - \alpha/2,\, n - 1}\, s_d / \sqrt n`, with :math:`s_d` the sample standard deviation
  (divisor :math:`n - 1`); the interval of ``scipy.stats.ttest_rel(...).confidence_interval()``. Exact when the
  differences are normal, and honest with the 5 to 10 seeds a comparison can afford: the :math:`t` quantile widens
  the interval for small :math:`n` (2.78 standard errors at :math:`n = 5`, against 1.96).
* ``method="bootstrap"``: the percentile bootstrap, the :math:`\alpha/2` and :math:`1 - \alpha/2` quantiles of the
  means of ``num_resamples`` resamples of the :math:`n` differences with replacement (seeded). It assumes no
  normality but is too narrow for small :math:`n`: its resampled means have the plug-in variance
  :math:`\frac{n-1}{n} s_d^2 / n` and a normal quantile, so with 5 seeds a nominal 95 % interval covers far less
  often. Hence it is not the default; use it for many seeds or skewed differences.

A difference is *significant* only when its interval excludes 0. No interval is formed from fewer than 2 paired
seeds (``min_pairs``, at least 2; a runner that demands 5 passes ``min_pairs=5``), and every result carries its
:math:`n`.

Two more tools serve the comparison's declared endpoints:

* :func:`hierarchical_difference`: the interval of a per-example metric (e.g. the NLL of every test example) over
  seeds *and* test examples, so that it also reflects the finite test set, which the seed intervals above hold
  fixed.
* :func:`paired_p_value` and :func:`holm_adjusted`: the paired :math:`t` test's p-value of each test of a family
  (the secondary endpoints) and Holm's adjustment of the family, which controls the probability of any false
  rejection among them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..validation import InputTypeError, check_choice, check_float, check_int

__all__ = [
    "INTERVAL_METHODS",
    "PairedDifference",
    "SeedSummary",
    "compare_to_reference",
    "hierarchical_difference",
    "holm_adjusted",
    "paired_difference",
    "paired_p_value",
    "scaled_mean",
    "summarize_seeds",
]

#: The interval methods of :func:`paired_difference`, the default first.
INTERVAL_METHODS = ("t", "bootstrap")

SeedValues = Sequence[float] | Mapping[Hashable, float]


@dataclass(frozen=True)
class SeedSummary:
    """Mean, sample standard deviation (divisor :math:`n - 1`; NaN for :math:`n = 1`) and number of seeds."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.4g} ± {self.std:.2g} (n={self.n})"


@dataclass(frozen=True)
class PairedDifference:
    """The paired difference ``reference - other`` over seeds and its confidence interval.

    :ivar mean: :math:`\\bar d`, the mean difference.
    :ivar low: Lower end of the interval.
    :ivar high: Upper end of the interval.
    :ivar n: Number of paired seeds.
    :ivar confidence: Confidence level, e.g. 0.95.
    :ivar method: ``"t"`` or ``"bootstrap"`` (:func:`paired_difference`), ``"hierarchical"``
        (:func:`hierarchical_difference`).
    :ivar seeds: The paired seeds (positions ``0 .. n-1`` for sequences), in order.
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float
    method: str
    seeds: tuple[Hashable, ...]

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 0."""
        return not self.low <= 0.0 <= self.high

    def __str__(self) -> str:
        mark = " *" if self.significant else ""
        level = f"{100 * self.confidence:g} %"
        return f"{self.mean:+.4g} [{self.low:+.4g}, {self.high:+.4g}]{mark} ({level} {self.method}, n={self.n})"


def _finite(name: str, values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise ValueError(f"expected finite {name} values, got {values.tolist()} (drop the failed seeds first)")
    return values


def _scaled(values: np.ndarray) -> tuple[np.ndarray, float]:
    """``(values / scale, scale)`` with ``scale`` the power of 2 at most the largest magnitude (1 for no or only zero
    values): exact, and the squares of a standard deviation of the scaled values neither overflow (magnitudes above
    about 1e154) nor underflow (below about 1e-154); a mean or standard deviation times ``scale`` is the unscaled
    one."""
    largest = float(np.abs(values).max(initial=0.0))
    scale = math.ldexp(1.0, math.frexp(largest)[1] - 1) if largest > 0.0 else 1.0
    return values / scale, scale


def scaled_mean(values: Sequence[float]) -> float:
    """The mean of ``values``, ``math.fsum(values) / n`` (the exactly rounded sum), of the values scaled by a power of
    2 (:func:`_scaled`): finite for finite values up to the largest double, whose plain sum overflows (five values
    near 1e308), and otherwise the same double as ``math.fsum(values) / n`` (a power of 2 scales exactly, unless a
    value is below about 1e-308 times the largest). A NaN gives NaN, like :func:`statistics.fmean`. O(n).

    :raises ValueError: No values.

    Example:
        >>> scaled_mean([1e308, 1.5e308]), scaled_mean([0.1, 0.2, 0.4])
        (1.25e+308, 0.23333333333333336)
    """
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("expected at least one value to average, got none")
    scaled, scale = _scaled(array)
    return math.fsum(scaled.tolist()) / array.size * scale


def _differences(left: np.ndarray, right: np.ndarray, where: str) -> np.ndarray:
    """``left - right``, refused where a difference of two finite values overflows to infinity (magnitudes near
    1.8e308): its mean, interval and p-value would be infinite or NaN, not numbers."""
    with np.errstate(over="ignore"):
        differences = left - right
    if not np.isfinite(differences).all():
        raise ValueError(
            f"{where}: the differences reference - other overflow (beyond {np.finfo(np.float64).max:.3g}) on "
            f"{int(np.count_nonzero(~np.isfinite(differences)))} of {differences.size} values; rescale the metric"
        )
    return differences


def _as_values(name: str, values: SeedValues) -> np.ndarray:
    if isinstance(values, Mapping):
        values = list(values.values())
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence | np.ndarray):
        raise InputTypeError(f"expected {name} to be a sequence or a {{seed: value}} mapping, got {values!r}")
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise InputTypeError(f"expected {name} to hold numbers, got {values!r}") from error
    if array.ndim != 1:
        raise ValueError(f"expected {name} to be one value per seed, got shape {array.shape}")
    return _finite(name, array)


def summarize_seeds(values: SeedValues) -> SeedSummary:
    """Mean, standard deviation and count of one metric over seeds.

    :param values: One value per seed: a sequence, or a mapping ``{seed: value}``.
    :return: The :class:`SeedSummary` (``std`` is NaN for a single seed).
    :raises ValueError: No values, or a NaN or infinite one.
    """
    array, scale = _scaled(_as_values("values", values))
    if array.size == 0:
        raise ValueError("expected at least one value to summarize, got none")
    std = scale * float(array.std(ddof=1)) if array.size > 1 else math.nan
    return SeedSummary(scale * float(array.mean()), std, int(array.size))


def _pairs(reference: SeedValues, other: SeedValues) -> tuple[np.ndarray, np.ndarray, tuple[Hashable, ...]]:
    if isinstance(reference, Mapping) != isinstance(other, Mapping):
        raise InputTypeError("expected reference and other both as {seed: value} mappings or both as sequences")
    if isinstance(reference, Mapping):
        seeds = tuple(seed for seed in reference if seed in other)
        return (
            _as_values("reference", [reference[seed] for seed in seeds]),
            _as_values("other", [other[seed] for seed in seeds]),
            seeds,
        )
    left, right = _as_values("reference", reference), _as_values("other", other)
    if left.size != right.size:
        raise ValueError(
            f"expected as many reference as other values (one per seed, in the same seed order), got {left.size} and "
            f"{right.size}; pass {{seed: value}} mappings to pair by seed"
        )
    return left, right, tuple(range(left.size))


def paired_difference(
    reference: SeedValues,
    other: SeedValues,
    *,
    confidence: float = 0.95,
    method: str = "t",
    min_pairs: int = 2,
    num_resamples: int = 10000,
    seed: int = 0,
) -> PairedDifference:
    r"""The mean of ``reference - other`` over paired seeds, with a confidence interval (module docstring).

    Whether a positive difference is good depends on the metric (accuracy: the reference is better; NLL, ECE: worse).

    .. note:: Cost: O(n) for ``"t"``; O(``num_resamples`` n) time and memory for ``"bootstrap"``.

    :param reference: One value per seed of the reference method (e.g. KEP-SVGP): a sequence, or ``{seed: value}``.
    :param other: The other method's values: a sequence in the same seed order, or a mapping (paired on the seeds
        both hold, in the reference's order).
    :param confidence: Confidence level in ``(0, 1)``.
    :param method: ``"t"`` (default) or ``"bootstrap"`` (percentile).
    :param min_pairs: Fewest paired seeds to form an interval from (at least 2).
    :param num_resamples: Bootstrap resamples.
    :param seed: Seed of the bootstrap's ``numpy.random.Generator``.
    :return: The :class:`PairedDifference`.
    :raises ValueError: Fewer than ``min_pairs`` paired seeds, NaN or infinite values (or differences that overflow),
        or bad settings.
    """
    where = "paired_difference"
    check_float("confidence", confidence, 0.0, 1.0, strict_minimum=True, strict_maximum=True, where=where)
    check_choice("method", method, INTERVAL_METHODS, where=where)
    check_int("min_pairs", min_pairs, minimum=2, where=where)
    check_int("num_resamples", num_resamples, where=where)
    check_int("seed", seed, minimum=0, where=where)
    left, right, seeds = _pairs(reference, other)
    n = left.size
    if n < min_pairs:
        raise ValueError(f"{where}: {n} paired seed(s) {list(seeds)}, fewer than min_pairs={min_pairs}; no interval")
    differences, scale = _scaled(_differences(left, right, where))
    mean = scale * float(differences.mean())
    alpha = 1.0 - confidence
    if method == "t":
        from scipy import stats  # here: scipy.stats takes about a second to import, and every command imports this

        # the scale last: a half-width of huge differences can be finite where scale * t alone is not
        half_width = scale * (stats.t.ppf(1.0 - alpha / 2, n - 1) * differences.std(ddof=1) / math.sqrt(n))
        low, high = mean - half_width, mean + half_width
    else:
        rows = np.random.default_rng(seed).integers(0, n, size=(num_resamples, n))
        low, high = scale * np.quantile(differences[rows].mean(axis=1), [alpha / 2, 1.0 - alpha / 2])
    return PairedDifference(mean, float(low), float(high), n, float(confidence), method, seeds)


def compare_to_reference(
    results: Mapping[str, SeedValues], reference: str, **options: float | int | str
) -> dict[str, PairedDifference]:
    """:func:`paired_difference` of a reference method against every other method of a table.

    :param results: ``{method: values per seed}`` for one metric (mappings pair by seed).
    :param reference: The reference method, a key of ``results``.
    :param options: Keyword arguments of :func:`paired_difference` (``confidence``, ``method``, ``min_pairs``...).
    :return: ``{other method: PairedDifference of reference - other}``, in the order of ``results``.
    """
    check_choice("reference", reference, list(results), where="compare_to_reference")
    return {
        name: paired_difference(results[reference], values, **options)
        for name, values in results.items()
        if name != reference
    }


def paired_p_value(reference: SeedValues, other: SeedValues) -> float:
    r"""The two-sided p-value of the paired :math:`t` test of ``reference - other`` over the seeds both hold
    (``scipy.stats.ttest_rel``): with :math:`t = \bar d / (s_d / \sqrt n)`, the probability of a :math:`|t|` at
    least as large under no true difference (normal differences, :math:`n - 1` degrees of freedom). It is below
    :math:`1 - c` exactly when the :math:`t` interval of :func:`paired_difference` at confidence :math:`c` excludes 0.

    .. note:: Cost O(n).

    :param reference: One value per seed of the reference method: a sequence, or ``{seed: value}``.
    :param other: The other method's values, paired as in :func:`paired_difference`.
    :return: A float in :math:`[0, 1]`: 1 when every difference is 0 (no evidence of one; scipy's NaN there), 0 for
        the same non-zero difference on every seed (equal up to rounding, a relative spread of at most
        :math:`10^{-12}`: a zero-width interval that excludes 0; scipy warns of catastrophic cancellation), NaN for
        fewer than 2
        paired seeds (no test).
    :raises ValueError: NaN or infinite values (or differences that overflow), or sequences of different lengths.
    """
    left, right, _ = _pairs(reference, other)
    # the same t, without overflow or underflow in its squares
    differences, _ = _scaled(_differences(left, right, "paired_p_value"))
    if differences.size < 2:
        return math.nan
    if np.all(differences == 0.0):
        return 1.0
    if np.ptp(differences) <= 1e-12 * np.abs(differences).max():  # no spread beyond rounding: t is infinite
        return 0.0
    from scipy import stats

    return float(stats.ttest_1samp(differences, 0.0).pvalue)  # ttest_rel(left, right) is this test


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    r"""Holm's step-down adjustment of a family of :math:`m` p-values (Holm 1979), which controls the family-wise
    error rate (the probability of rejecting any true hypothesis of the family) under any dependence between the
    tests. With the p-values sorted, :math:`p_{(1)} \le \dots \le p_{(m)}`,

    .. math:: \tilde p_{(k)} = \min\Big(1,\ \max_{j \le k}\, (m - j + 1)\, p_{(j)}\Big),

    returned in the input order: the smallest level :math:`\alpha` at which Holm's procedure (reject
    :math:`H_{(1)}, H_{(2)}, \dots` while :math:`p_{(k)} \le \alpha / (m - k + 1)`) rejects that hypothesis. A
    hypothesis is rejected at level :math:`\alpha` iff :math:`\tilde p \le \alpha`. A NaN p-value (no test) stays NaN
    and does not count in :math:`m`.

    .. note:: Cost O(m log m).

    :param p_values: The family's p-values.
    :return: The adjusted p-values, in the order given.
    :raises ValueError: A p-value outside :math:`[0, 1]`, or not a flat sequence.
    """
    try:
        values = np.asarray(p_values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise InputTypeError(f"holm_adjusted: expected a sequence of p-values, got {p_values!r}") from error
    if values.ndim != 1:
        raise ValueError(f"holm_adjusted: expected a flat sequence of p-values, got shape {values.shape}")
    tested = np.flatnonzero(~np.isnan(values))
    if np.any((values[tested] < 0.0) | (values[tested] > 1.0)):
        raise ValueError(f"holm_adjusted: expected p-values in [0, 1] (or NaN for no test), got {values.tolist()}")
    adjusted = np.full_like(values, np.nan)
    order = tested[np.argsort(values[tested], kind="stable")]
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (order.size - rank) * values[index]))
        adjusted[index] = running
    return adjusted.tolist()


def _per_example_differences(
    reference: Mapping[Hashable, Sequence[float] | np.ndarray],
    other: Mapping[Hashable, Sequence[float] | np.ndarray],
    min_pairs: int,
    where: str,
) -> tuple[np.ndarray, tuple[Hashable, ...]]:
    if not isinstance(reference, Mapping) or not isinstance(other, Mapping):
        raise InputTypeError(f"{where}: expected reference and other as {{seed: per-example values}} mappings")
    seeds = tuple(key for key in reference if key in other)
    if len(seeds) < min_pairs:
        raise ValueError(f"{where}: {len(seeds)} paired seed(s) {list(seeds)}, fewer than min_pairs={min_pairs}")
    rows = []
    for key in seeds:
        try:
            left = np.asarray(reference[key], dtype=np.float64)
            right = np.asarray(other[key], dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise InputTypeError(f"{where}: seed {key!r}: expected per-example numbers") from error
        if left.ndim != 1 or left.shape != right.shape or left.size == 0:
            raise ValueError(
                f"{where}: seed {key!r} has per-example values of shapes {left.shape} and {right.shape}; expected one "
                "value per test example, the same examples for both methods"
            )
        rows.append(_differences(_finite(f"seed {key!r}", left), _finite(f"seed {key!r}", right), where))
    if len({row.size for row in rows}) != 1:
        sizes = {key: row.size for key, row in zip(seeds, rows, strict=True)}
        raise ValueError(f"{where}: expected the same test examples for every seed, got sizes {sizes}")
    return np.stack(rows), seeds


def _draw_counts(generator: np.random.Generator, size: int, count: int) -> np.ndarray:
    """How often each of ``count`` items is drawn in each of ``size`` resamples of ``count`` draws with replacement:
    shape ``(size, count)``, every row summing to ``count``."""
    drawn = generator.integers(0, count, size=(size, count)) + count * np.arange(size)[:, None]
    return np.bincount(drawn.ravel(), minlength=size * count).reshape(size, count).astype(np.float64)


def hierarchical_difference(
    reference: Mapping[Hashable, Sequence[float] | np.ndarray],
    other: Mapping[Hashable, Sequence[float] | np.ndarray],
    *,
    confidence: float = 0.95,
    num_resamples: int = 10000,
    min_pairs: int = 2,
    seed: int = 0,
) -> PairedDifference:
    r"""The mean difference ``reference - other`` of a per-example metric (e.g. the NLL of every test example) over
    seeds and test examples, with a percentile bootstrap interval that resamples both.

    With :math:`D_{si}` the difference on test example :math:`i` in the runs of seed :math:`s` (every seed is
    evaluated on the same :math:`n` test examples), the estimate is the difference of the metric's means,
    :math:`\bar D = \frac{1}{Sn} \sum_{s,i} D_{si}`. Seeds and examples are *crossed*, not nested: a new test set
    would be the same for every seed, and an example that is hard for one model is hard on every seed. So each
    resample draws :math:`S` seeds and, independently, :math:`n` examples, both with replacement, and takes the mean
    of the :math:`S \times n` block they index (Owen's pigeonhole bootstrap, Ann. Appl. Stat. 2007):
    :math:`\bar D^* = w^\top D v` with :math:`w, v` the multinomial resampling weights of seeds and examples. Its
    variance is exactly

    .. math:: \operatorname{Var}^*(\bar D^*) = \frac{\hat\sigma^2_{\text{seed}}}{S}
        + \frac{\hat\sigma^2_{\text{example}}}{n} + \frac{\|D_c\|_F^2}{S^2 n^2},

    with :math:`\hat\sigma^2` the plug-in variances (divisor :math:`S`, :math:`n`) of the seed means and of the
    example means and :math:`D_c` the doubly centred :math:`D`: the seed and test-set components of the variance of
    :math:`\bar D`, and the interaction counted about three times (mildly conservative). Resampling the examples of
    each seed independently instead (a nested bootstrap) would divide the test-set component by :math:`S`, too
    narrow whenever the per-example differences correlate across seeds. Like every percentile bootstrap, the seed
    component is somewhat narrow for few seeds (the plug-in variance and a normal quantile, where the :math:`t`
    interval of :func:`paired_difference` widens); report both.

    With the same difference on every example of a seed, the interval is the percentile bootstrap over seeds
    (:func:`paired_difference` with ``method="bootstrap"``); with the same difference everywhere, a point.

    .. note:: Cost O(``num_resamples`` (S + n) + ``num_resamples`` S n) time (one matrix product per block of
        resamples), O(S n + 1000 n) memory.

    :param reference: ``{seed: per-example values}`` of the reference method, the same test examples in the same
        order for every seed.
    :param other: The same for the other method (paired on the seeds both hold, in the reference's order).
    :param confidence: Confidence level in ``(0, 1)``.
    :param num_resamples: Bootstrap resamples.
    :param min_pairs: Fewest paired seeds (at least 2).
    :param seed: Seed of the bootstrap's ``numpy.random.Generator``.
    :return: A :class:`PairedDifference` with ``method="hierarchical"`` (``n``: the paired seeds).
    :raises ValueError: Fewer than ``min_pairs`` paired seeds, per-example values of different lengths or not finite
        (or differences that overflow), or bad settings.
    """
    where = "hierarchical_difference"
    check_float("confidence", confidence, 0.0, 1.0, strict_minimum=True, strict_maximum=True, where=where)
    check_int("num_resamples", num_resamples, where=where)
    check_int("min_pairs", min_pairs, minimum=2, where=where)
    check_int("seed", seed, minimum=0, where=where)
    differences, seeds = _per_example_differences(reference, other, min_pairs, where)  # shape: (S, n)
    num_seeds, num_examples = differences.shape
    differences, scale = _scaled(differences)  # exact; sums of differences near 1e308 do not overflow
    mean = float(differences.mean())
    centred = differences - mean  # resampled around the estimate: a constant difference gives exactly a point
    generator = np.random.default_rng(seed)
    means = np.empty(num_resamples)
    block = 1000
    for start in range(0, num_resamples, block):
        size = min(block, num_resamples - start)
        seed_weights = _draw_counts(generator, size, num_seeds) / num_seeds
        example_weights = _draw_counts(generator, size, num_examples)
        # w^T D v for every resample of the block: (size, S) @ (S, n) -> (size, n), times (size, n), summed over n
        means[start : start + size] = ((seed_weights @ centred) * example_weights).sum(axis=1) / num_examples
    alpha = 1.0 - confidence
    low, high = scale * (mean + np.quantile(means, [alpha / 2, 1.0 - alpha / 2]))
    return PairedDifference(scale * mean, float(low), float(high), num_seeds, float(confidence), "hierarchical", seeds)
