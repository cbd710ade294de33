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
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from ..validation import InputTypeError, check_choice, check_float, check_int

__all__ = [
    "INTERVAL_METHODS",
    "PairedDifference",
    "SeedSummary",
    "compare_to_reference",
    "paired_difference",
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
    :ivar method: ``"t"`` or ``"bootstrap"``.
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
    array = _as_values("values", values)
    if array.size == 0:
        raise ValueError("expected at least one value to summarize, got none")
    std = float(array.std(ddof=1)) if array.size > 1 else math.nan
    return SeedSummary(float(array.mean()), std, int(array.size))


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
    :raises ValueError: Fewer than ``min_pairs`` paired seeds, NaN or infinite values, or bad settings.
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
    differences = left - right
    mean = float(differences.mean())
    alpha = 1.0 - confidence
    if method == "t":
        half_width = stats.t.ppf(1.0 - alpha / 2, n - 1) * differences.std(ddof=1) / math.sqrt(n)
        low, high = mean - half_width, mean + half_width
    else:
        rows = np.random.default_rng(seed).integers(0, n, size=(num_resamples, n))
        low, high = np.quantile(differences[rows].mean(axis=1), [alpha / 2, 1.0 - alpha / 2])
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
