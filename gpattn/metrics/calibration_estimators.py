r"""Calibration-error estimators that are less biased than the 15-bin ECE on finite test sets.

The equal-width ECE of :func:`~gpattn.metrics.expected_calibration_error` is biased upwards: even a perfectly
calibrated classifier shows an ECE of order :math:`\sqrt{B / n}` (about 2.6 % with 15 bins on 1,000 test examples),
the size of the differences between the rows of a comparison. Two estimators from the literature correct for this:

* :func:`debiased_calibration_error`: the debiased :math:`\ell_2` calibration error of Kumar, Liang & Ma (2019,
  "Verified uncertainty calibration", NeurIPS), on equal-mass bins. With :math:`n_b` examples in bin :math:`b`, mean
  score :math:`\bar s_b` and mean outcome :math:`\bar y_b` (outcome: the prediction is correct, for the top label;
  the example is of class :math:`c`, classwise),

  .. math::

      \widehat{\mathrm{CE}}^2 = \sum_b \frac{n_b}{n} \Big[ (\bar s_b - \bar y_b)^2
          - \frac{\bar y_b (1 - \bar y_b)}{n_b - 1} \Big],

  the plug-in squared error minus an estimate of the variance of :math:`\bar y_b`. The squared estimate can be
  negative (``squared=True`` returns it as it is, for averaging over runs); the error itself is
  :math:`\sqrt{\max(\widehat{\mathrm{CE}}^2, 0)}` (classwise: the root of the mean over classes of the floored
  squared estimates). Bins with fewer than two examples contribute 0, as in the
  reference implementation (the ``uncertainty-calibration`` package, ``get_calibration_error(..., p=2,
  debias=True)``), against which the tests check this function.
* :func:`sweep_calibration_error`: the equal-mass "sweep" ECE of Roelofs, Cain, Shlens & Mozer (2022, "Mitigating
  bias in calibration error estimation", AISTATS): the :math:`\ell_1` error on the largest number of equal-mass bins
  for which the bins' mean outcomes are monotone (non-decreasing) in the bins' scores.

Both take the predicted probabilities :math:`P` (``(n, C)``) and integer labels of the other metrics and return
plain floats (fractions).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from ..validation import InputTypeError, check_choice, check_int
from .calibration import CALIBRATION_KINDS, _check_inputs, _confidence_and_correctness

__all__ = ["debiased_calibration_error", "equal_mass_bin_indices", "sweep_calibration_error"]


def equal_mass_bin_indices(scores: np.ndarray, num_bins: int) -> np.ndarray:
    r"""The equal-mass bin of every score: the sorted scores split into ``num_bins`` contiguous groups of sizes
    differing by at most one (``numpy.array_split``), ties kept together (a boundary between two equal scores moves
    to the next distinct value, so bins can merge), as the reference implementation of Kumar et al. bins them.

    :param scores: Shape ``(n,)``, :math:`n \geq 1`.
    :param num_bins: :math:`B \geq 1` (a Python or NumPy integer; at most ``n`` bins are used).
    :return: Bin indices in ``[0, B)``, shape ``(n,)``, non-decreasing in the score.
    """
    num_bins = check_int("num_bins", num_bins, where="equal_mass_bin_indices")
    scores = np.asarray(scores)
    if scores.ndim != 1 or scores.shape[0] < 1:
        raise ValueError(f"equal_mass_bin_indices: expected scores of shape (n,) with n >= 1, got shape {scores.shape}")
    order = np.sort(scores)
    groups = np.array_split(order, min(num_bins, order.shape[0]))
    # the midpoints between consecutive groups are the edges; a score goes to the first edge >= it
    edges = np.unique([(left[-1] + right[0]) / 2.0 for left, right in zip(groups[:-1], groups[1:], strict=True)])
    return np.searchsorted(edges, scores, side="left")


def _outcomes(
    probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, kind: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(scores, outcomes)`` of every binary problem: the top label, or each class (classwise)."""
    check_choice("kind", kind, CALIBRATION_KINDS)
    probabilities, targets = _check_inputs(probs, labels)
    if kind == "top_label":
        confidence, correct = _confidence_and_correctness(probabilities, targets)
        return [(confidence, correct.astype(np.float64))]
    return [(probabilities[:, label], (targets == label).astype(np.float64)) for label in range(probabilities.shape[1])]


def _binned(scores: np.ndarray, outcomes: np.ndarray, bins: np.ndarray) -> tuple[np.ndarray, ...]:
    count = np.bincount(bins)
    filled = count > 0
    count = count[filled]
    mean_score = np.bincount(bins, weights=scores)[filled] / count
    mean_outcome = np.bincount(bins, weights=outcomes)[filled] / count
    return count, mean_score, mean_outcome


def debiased_calibration_error(
    probs: Tensor | np.ndarray,
    labels: Tensor | np.ndarray,
    num_bins: int = 15,
    kind: str = "top_label",
    squared: bool = False,
) -> float:
    r"""The debiased :math:`\ell_2` calibration error of Kumar, Liang & Ma (2019) on ``num_bins`` equal-mass bins
    (see the module docstring for the estimator).

    ``kind="classwise"`` averages the squared estimates of the :math:`C` one-vs-rest problems (each floored at 0)
    before the square root (the reference implementation's ``mode="marginal"``).

    Conditional on the scores, a perfectly calibrated predictor (outcome :math:`\sim` Bernoulli(score)) gives
    :math:`\mathbb E[\widehat{\mathrm{CE}}^2] = -\sum_b \frac{n_b}{n} \frac{v_b}{n_b - 1}` with :math:`v_b` the
    variance of the scores within bin :math:`b`: zero up to the spread of the scores inside a bin (the plug-in squared
    error has expectation :math:`\sum_b \frac{1}{n n_b} \sum_{i \in b} s_i (1 - s_i)` instead, of order :math:`B/n`).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param num_bins: :math:`B \geq 1` equal-mass bins (15 by default).
    :param kind: ``"top_label"`` or ``"classwise"``.
    :param squared: Return the (possibly negative) squared estimate :math:`\widehat{\mathrm{CE}}^2` instead of
        :math:`\sqrt{\max(\widehat{\mathrm{CE}}^2, 0)}` (a Python or NumPy bool).
    :return: A float (a fraction; the squared estimate lies in :math:`[-1, 1]`).

    .. note:: Cost O(n log n) per binary problem (a sort).
    """
    num_bins = check_int("num_bins", num_bins)  # Python and NumPy integers, not bools
    if not isinstance(squared, (bool, np.bool_)):  # a string such as "False" would read as true
        raise InputTypeError(f"debiased_calibration_error: expected squared to be a bool, got {squared!r}")
    estimates = []
    for scores, outcomes in _outcomes(probs, labels, kind):
        count, mean_score, mean_outcome = _binned(scores, outcomes, equal_mass_bin_indices(scores, num_bins))
        usable = count >= 2  # the variance estimate needs two examples; smaller bins contribute 0
        variance = np.zeros_like(mean_outcome)
        variance[usable] = mean_outcome[usable] * (1.0 - mean_outcome[usable]) / (count[usable] - 1.0)
        errors = np.where(usable, (mean_score - mean_outcome) ** 2 - variance, 0.0)
        estimates.append(float((count * errors).sum() / count.sum()))
    if squared:
        return float(np.mean(estimates))
    # each problem's error floored at 0 before averaging, as the reference implementation's marginal mode
    return float(np.mean(np.maximum(estimates, 0.0))) ** 0.5


def sweep_calibration_error(
    probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, kind: str = "top_label", power: int = 1
) -> float:
    r"""The equal-mass sweep calibration error of Roelofs et al. (2022).

    For :math:`B = 1, 2, \dots` equal-mass bins (:func:`equal_mass_bin_indices`), the largest :math:`B^\star` such
    that the bins' mean outcomes are non-decreasing in :math:`b` for every :math:`B \leq B^\star` is chosen, and

    .. math:: \mathrm{ECE}_{\mathrm{sweep}} = \Big( \sum_b \frac{n_b}{n} |\bar s_b - \bar y_b|^p \Big)^{1/p}

    on :math:`B^\star` bins. ``kind="classwise"`` averages the :math:`p`-th powers over the classes.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param kind: ``"top_label"`` or ``"classwise"``.
    :param power: :math:`p \in \{1, 2\}` (1: the ECE; a Python or NumPy integer, not a bool).
    :return: A fraction in :math:`[0, 1]`.

    .. note:: Cost O(n log n) per binary problem for one sort, then O(B log n) per number of bins tried (from
        cumulative sums), so :math:`O(B^{\star 2} \log n)` for the search up to :math:`B^\star`: quadratic in
        :math:`n` in the worst case, where the mean outcomes stay monotone up to :math:`B^\star` near :math:`n` while
        the finest binning is not (a contrived input); O(n log n) in all when the outcomes are monotone in the
        scores (then every binning is, and :math:`B^\star` is the largest: no search).
    """
    # a Python int (a NumPy integer would make the result a NumPy float); True, equal to 1, is no power
    power = check_int("power", power, minimum=1, maximum=2, where="sweep_calibration_error")
    errors = []
    for scores, outcomes in _outcomes(probs, labels, kind):
        count, mean_score, mean_outcome = _sweep_bins(scores, outcomes)
        errors.append(float((count * np.abs(mean_score - mean_outcome) ** power).sum() / count.sum()))
    return float(np.mean(errors)) ** (1.0 / power)


def _sweep_bins(scores: np.ndarray, outcomes: np.ndarray) -> tuple[np.ndarray, ...]:
    # counts, mean scores and mean outcomes of the filled bins of the sweep's B*, the bins of equal_mass_bin_indices
    # found on the sorted scores: a bin is a run of the sorted scores, so its sums are differences of cumulative sums
    order = np.argsort(scores, kind="stable")
    sorted_scores, sorted_outcomes = scores[order], outcomes[order]
    size = sorted_scores.shape[0]
    score_sums = np.concatenate([[0.0], np.cumsum(sorted_scores)])
    outcome_sums = np.concatenate([[0.0], np.cumsum(sorted_outcomes)])

    def binned(num_bins: int) -> tuple[np.ndarray, ...]:
        # numpy.array_split's groups: the first size % B of size // B + 1, then size // B; an edge between two
        # groups is the midpoint of their neighbouring scores, and a score equal to an edge goes below it
        quotient, remainder = divmod(size, num_bins)
        groups = np.arange(1, num_bins)
        starts = groups * quotient + np.minimum(groups, remainder)
        edges = np.unique((sorted_scores[starts - 1] + sorted_scores[starts]) / 2.0)
        bounds = np.unique(np.concatenate([[0], np.searchsorted(sorted_scores, edges, side="right"), [size]]))
        count = np.diff(bounds).astype(np.float64)  # no empty bin: the bounds are distinct
        return count, np.diff(score_sums[bounds]) / count, np.diff(outcome_sums[bounds]) / count

    finest = binned(size)  # one bin per distinct score
    if not np.any(np.diff(finest[2]) < 0):  # monotone outcomes: every coarser binning is monotone too
        return finest
    chosen = binned(1)
    for num_bins in range(2, size + 1):
        candidate = binned(num_bins)
        if np.any(np.diff(candidate[2]) < 0):
            break
        chosen = candidate
    return chosen
