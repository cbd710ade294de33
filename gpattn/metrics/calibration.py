r"""Accuracy, proper scoring rules and calibration errors (top-label and classwise) of probabilistic classifiers.

All metrics take predicted class probabilities :math:`P \in [0, 1]^{n \times C}` (rows summing to one) and integer
labels :math:`y \in \{0, \dots, C - 1\}^n`, as ``torch.Tensor`` or ``numpy.ndarray``, and return plain Python floats
(fractions, never percent). Computations run in float64 NumPy on the CPU, so tensor and array inputs give identical
results. The prediction is :math:`\hat y_i = \arg\max_c P_{ic}` (the first maximal class on ties) and the confidence is
:math:`\hat p_i = \max_c P_{ic}`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..validation import InputTypeError, check_choice, check_float, check_int

#: The least tolerance on a row sum :math:`|\sum_c P_{ic} - 1|` (float32 and float64 inputs, integers).
ROW_SUM_TOLERANCE = 1e-4
#: The row-sum tolerance of low-precision inputs in units of their machine epsilon (see :func:`row_sum_tolerance`).
ROW_SUM_EPS_FACTOR = 4.0


def row_sum_tolerance(dtype: Any) -> float:
    r"""The tolerance on :math:`|\sum_c P_{ic} - 1|` for probabilities stored in ``dtype`` (a torch or NumPy dtype):
    :math:`\max(10^{-4}, 4 \epsilon)` with :math:`\epsilon` the dtype's machine epsilon (0 for integers).

    Rounding each :math:`P_{ic}` to the dtype changes it by at most :math:`\epsilon P_{ic} / 2`, so a row sum by at
    most :math:`\epsilon / 2` whatever the number of classes; a softmax computed in that dtype adds a few
    :math:`\epsilon` (measured: at most :math:`0.75\,\epsilon` for 2 to 10^4 classes in bfloat16 and float16). So
    bfloat16 (:math:`\epsilon = 2^{-7}`) gets 0.031, float16 0.0039, float32 and float64 :math:`10^{-4}`.
    """
    if isinstance(dtype, torch.dtype):
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    else:
        dtype = np.dtype(dtype)
        eps = float(np.finfo(dtype).eps) if dtype.kind == "f" else 0.0
    return max(ROW_SUM_TOLERANCE, ROW_SUM_EPS_FACTOR * eps)


def _to_numpy(array: Any) -> np.ndarray:
    if isinstance(array, Tensor):
        array = array.detach().cpu()
        if array.is_floating_point():
            array = array.to(torch.float64)
        return array.numpy()
    return np.asarray(array)


def _as_probabilities(probs: Any, name: str = "probs") -> np.ndarray:
    """Validate predicted probabilities of shape ``(n, C)`` and return them as a float64 array (row sums checked
    within :func:`row_sum_tolerance` of the input's dtype)."""
    dtype = probs.dtype if isinstance(probs, (Tensor, np.ndarray)) else np.dtype(np.float64)
    tolerance = row_sum_tolerance(dtype)
    array = _to_numpy(probs)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(f"expected {name} of shape (n, C) with n >= 1 and C >= 1, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "fiu" or array.dtype == np.bool_:
        raise InputTypeError(f"expected {name} to hold real probabilities, got dtype {array.dtype}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or Inf; pass probabilities (e.g. softmax outputs), not logits")
    if array.min() < 0.0 or array.max() > 1.0:
        raise ValueError(
            # in full: 1.0000001 (a float32 rounding) read "[0, 1]" at 6 digits
            f"expected {name} in [0, 1], got values in [{float(array.min())!r}, {float(array.max())!r}]; "
            "pass probabilities (e.g. softmax outputs), not logits"
        )
    worst = np.abs(array.sum(axis=1) - 1.0).max()
    if worst > tolerance:
        raise ValueError(
            f"expected each row of {name} to sum to 1 within {tolerance:g} (for {dtype} inputs), got a row off by "
            f"{worst:.6g}; normalise along the class dimension (dim=-1)"
        )
    return array


def _as_labels(labels: Any, num_samples: int, num_classes: int) -> np.ndarray:
    """Validate integer labels of shape ``(n,)`` in ``[0, C)`` and return them as an int64 array."""
    array = _to_numpy(labels)
    if array.ndim != 1 or array.shape[0] != num_samples:
        raise ValueError(f"expected labels of shape (n,) = ({num_samples},), got shape {tuple(array.shape)}")
    if array.dtype == np.bool_ or array.dtype.kind not in "iu":
        raise InputTypeError(f"expected integer labels, got dtype {array.dtype}; cast class indices with .long()")
    low, high = array.min(), array.max()  # before the cast: uint64 labels of 2**63 and more would wrap to negative
    if low < 0 or high >= num_classes:
        raise ValueError(f"expected labels in [0, C - 1] = [0, {num_classes - 1}], got values in [{low}, {high}]")
    return array.astype(np.int64)


def _check_inputs(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    probabilities = _as_probabilities(probs)
    return probabilities, _as_labels(labels, *probabilities.shape)


def _confidence_and_correctness(probabilities: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # np.argmax returns the first maximal class on ties.
    return probabilities.max(axis=1), probabilities.argmax(axis=1) == targets


#: The calibration errors of :func:`expected_calibration_error` and :func:`maximum_calibration_error`.
CALIBRATION_KINDS = ("top_label", "classwise")


def _binned_means(
    scores: np.ndarray, hits: np.ndarray, groups: np.ndarray, num_groups: int, num_bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Count, mean score and mean hit of every (group, bin), bins of equal width on (0, 1] (a score 0 goes to the
    first bin), flattened as ``group * num_bins + bin``; empty cells have NaN means."""
    interior_edges = np.linspace(0.0, 1.0, num_bins + 1)[1:-1]
    # searchsorted(side="left") on the interior edges gives b with e_b < p <= e_{b+1}.
    cells = groups * num_bins + np.searchsorted(interior_edges, scores, side="left")
    size = num_groups * num_bins
    count = np.bincount(cells, minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_score = np.bincount(cells, weights=scores, minlength=size) / count
        mean_hit = np.bincount(cells, weights=hits.astype(np.float64), minlength=size) / count
    return count, mean_score, mean_hit


def _calibration_gaps(probs: Any, labels: Any, num_bins: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Counts and ``|accuracy - confidence|`` of the non-empty cells: B top-label bins, or C x B classwise cells."""
    check_choice("kind", kind, CALIBRATION_KINDS)
    if kind == "top_label":
        diagram = reliability_diagram_data(probs, labels, num_bins)
        count, mean_score, mean_hit = diagram.count, diagram.confidence, diagram.accuracy
    else:
        num_bins = check_int("num_bins", num_bins)  # Python and NumPy integers, not bools
        probabilities, targets = _check_inputs(probs, labels)
        num_samples, num_classes = probabilities.shape
        is_class = targets[:, None] == np.arange(num_classes)  # shape: (n, C)
        classes = np.broadcast_to(np.arange(num_classes), (num_samples, num_classes))
        count, mean_score, mean_hit = _binned_means(
            probabilities.ravel(), is_class.ravel(), classes.ravel(), num_classes, num_bins
        )
    filled = count > 0
    return count[filled], np.abs(mean_hit[filled] - mean_score[filled])


def accuracy(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""Top-1 accuracy :math:`\frac1n \sum_i [\hat y_i = y_i]`.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A fraction in :math:`[0, 1]`.
    """
    probabilities, targets = _check_inputs(probs, labels)
    return float(_confidence_and_correctness(probabilities, targets)[1].mean())


def negative_log_likelihood(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, eps: float = 1e-12) -> float:
    r"""Mean negative log-likelihood :math:`-\frac1n \sum_i \log \max(P_{i y_i}, \epsilon)` (natural log).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param eps: Floor on the probability of the true class, :math:`0 < \epsilon < 1`, so that a zero probability
        gives a finite :math:`-\log \epsilon` instead of :math:`+\infty` (a floor of 1 or more would replace every
        probability and make the result :math:`-\log \epsilon \leq 0`).
    :return: A float :math:`\geq 0`.
    """
    check_float("eps", eps, 0.0, 1.0, strict_minimum=True, strict_maximum=True, where="negative_log_likelihood")
    probabilities, targets = _check_inputs(probs, labels)
    true_class = probabilities[np.arange(targets.shape[0]), targets]
    return float(-np.log(np.maximum(true_class, eps)).mean()) + 0.0  # + 0.0: -0.0 (one class) reads as 0.0


def brier_score(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""Multi-class Brier score :math:`\frac1n \sum_i \sum_{c=1}^C (P_{ic} - [y_i = c])^2`.

    This is the *sum over classes* form (Brier, 1950), with range :math:`[0, 2]`; it equals
    ``sklearn.metrics.brier_score_loss`` for multi-class inputs, and twice its default (``scale_by_half="auto"``)
    binary value. Some papers instead divide by :math:`C` (mean over classes); which form the KEP-SVGP paper
    (Chen et al., 2024) reports is not stated there, so convert with ``brier_score(...) / C`` where needed.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A float in :math:`[0, 2]`.
    """
    probabilities, targets = _check_inputs(probs, labels)
    one_hot = np.zeros_like(probabilities)
    one_hot[np.arange(targets.shape[0]), targets] = 1.0
    return float(((probabilities - one_hot) ** 2).sum(axis=1).mean())


class ReliabilityDiagram(NamedTuple):
    r"""Per-bin statistics of top-label confidence, for reliability diagrams.

    Bin :math:`b` covers confidences in :math:`(e_b, e_{b+1}]`. Empty bins have ``count == 0`` and NaN
    ``confidence`` and ``accuracy``.

    :ivar bin_edges: Equal-width edges :math:`0 = e_0 < \dots < e_B = 1`, shape ``(B + 1,)``.
    :ivar confidence: Mean confidence :math:`\hat p_i` of each bin, shape ``(B,)``.
    :ivar accuracy: Fraction of correct predictions of each bin, shape ``(B,)``.
    :ivar count: Number of samples of each bin, shape ``(B,)``, integer.
    """

    bin_edges: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    count: np.ndarray


def reliability_diagram_data(
    probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, num_bins: int = 15
) -> ReliabilityDiagram:
    r"""Bin samples by top-label confidence into ``num_bins`` equal-width bins on :math:`(0, 1]`.

    Sample :math:`i` falls in bin :math:`b` iff :math:`e_b < \hat p_i \leq e_{b+1}` with
    ``e = numpy.linspace(0, 1, num_bins + 1)`` (right-closed bins, as in Guo et al., 2017).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param num_bins: Number of bins :math:`B \geq 1` (a Python or NumPy integer).
    :return: A :class:`ReliabilityDiagram` of NumPy arrays.
    """
    num_bins = check_int("num_bins", num_bins)  # Python and NumPy integers, not bools
    probabilities, targets = _check_inputs(probs, labels)
    confidence, correct = _confidence_and_correctness(probabilities, targets)
    groups = np.zeros(confidence.shape[0], dtype=np.int64)
    count, mean_confidence, mean_accuracy = _binned_means(confidence, correct, groups, 1, num_bins)
    bin_edges = np.linspace(0.0, 1.0, num_bins + 1)
    return ReliabilityDiagram(bin_edges, mean_confidence, mean_accuracy, count.astype(np.int64))


def expected_calibration_error(
    probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, num_bins: int = 15, kind: str = "top_label"
) -> float:
    r"""Expected calibration error, top-label (default) or classwise.

    ``kind="top_label"`` (Guo et al., 2017; the KEP-SVGP and SGPA papers' ECE):
    :math:`\sum_b \frac{n_b}{n} |\mathrm{acc}_b - \mathrm{conf}_b|` over the bins of the confidence
    :math:`\hat p_i` (those of :func:`reliability_diagram_data`, equal width on :math:`(0, 1]`; empty bins
    contribute 0). It equals ``torchmetrics``' ``MulticlassCalibrationError(norm="l1")`` up to samples exactly on a
    bin edge (torchmetrics' bins are closed on the left).

    ``kind="classwise"`` (Kull et al., 2019): every class :math:`c` is binned on its own probability
    :math:`P_{ic}` of all samples,

    .. math:: \mathrm{cwECE} = \frac1C \sum_{c=1}^C \sum_b \frac{n_{cb}}{n}
        \big|\overline{[y_i = c]}_{cb} - \overline{P_{ic}}_{cb}\big|,

    with the same bins (a probability 0 goes to the first bin, :math:`[0, 1/B]`).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param num_bins: Number of bins :math:`B \geq 1` (a Python or NumPy integer; 15 by default, as the KEP-SVGP
        paper).
    :param kind: ``"top_label"`` or ``"classwise"``.
    :return: A fraction in :math:`[0, 1]` (multiply by 100 for the percent that papers often report).
    """
    count, gaps = _calibration_gaps(probs, labels, num_bins, kind)
    return float((count * gaps).sum() / count.sum())


def maximum_calibration_error(
    probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, num_bins: int = 15, kind: str = "top_label"
) -> float:
    r"""Maximum calibration error :math:`\max |\mathrm{acc}_b - \mathrm{conf}_b|` over the non-empty bins.

    The bins are those of :func:`expected_calibration_error`: of the top-label confidence (default), or of every
    class's probability (``kind="classwise"``, the maximum over classes and bins).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :param num_bins: Number of bins :math:`B \geq 1` (a Python or NumPy integer).
    :param kind: ``"top_label"`` or ``"classwise"``.
    :return: A fraction in :math:`[0, 1]`.
    """
    return float(_calibration_gaps(probs, labels, num_bins, kind)[1].max())
