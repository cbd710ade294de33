r"""Selective classification and misclassification detection from top-label confidence.

The confidence of sample :math:`i` is :math:`\hat p_i = \max_c P_{ic}`, the prediction is
:math:`\hat y_i = \arg\max_c P_{ic}`, and a sample is *correct* iff :math:`\hat y_i = y_i`. Inputs follow
:mod:`gpattn.metrics.calibration`: probabilities ``(n, C)`` and integer labels ``(n,)``, as ``torch.Tensor`` or
``numpy.ndarray``; outputs are plain Python floats.

The binary ranking metrics (AUROC, average precision, FPR at a TPR) are implemented here without scikit-learn and
are shared with :mod:`gpattn.metrics.ood`.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from .calibration import _check_inputs, _confidence_and_correctness


def _binary_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    # Mann-Whitney U / (P N) with average ranks on ties: equals the trapezoidal area under the ROC curve.
    num_positive = int(positive.sum())
    num_negative = positive.shape[0] - num_positive
    if num_positive == 0 or num_negative == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Tie groups [starts[g], ends[g]) of the ascending scores share the average of their 1-based ranks.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], sorted_scores.shape[0]]
    average_ranks = (starts + 1 + ends) / 2.0
    ranks = np.empty_like(scores, dtype=np.float64)
    ranks[order] = np.repeat(average_ranks, ends - starts)
    rank_sum = ranks[positive].sum()
    return float((rank_sum - num_positive * (num_positive + 1) / 2.0) / (num_positive * num_negative))


def _roc_counts(scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # True/false positive counts when accepting every sample with score >= t, for each distinct t, decreasing.
    order = np.argsort(-scores, kind="stable")
    sorted_scores = scores[order]
    sorted_positive = positive[order]
    last_of_group = np.r_[np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]), sorted_scores.shape[0] - 1]
    true_positives = np.cumsum(sorted_positive)[last_of_group]
    false_positives = (last_of_group + 1) - true_positives
    return true_positives.astype(np.float64), false_positives.astype(np.float64)


def _average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    # AP = sum_k (R_k - R_{k-1}) P_k over decreasing distinct thresholds (scikit-learn's definition, no interpolation).
    if not positive.any():
        return float("nan")
    true_positives, false_positives = _roc_counts(scores, positive)
    precision = true_positives / (true_positives + false_positives)
    recall = true_positives / true_positives[-1]
    return float((np.diff(recall, prepend=0.0) * precision).sum())


def _fpr_at_tpr(scores: np.ndarray, positive: np.ndarray, tpr_level: float = 0.95) -> float:
    # FPR at the largest threshold t whose TPR(t) = #{pos >= t} / P reaches tpr_level: the smallest attainable FPR.
    if positive.all() or not positive.any():
        return float("nan")
    true_positives, false_positives = _roc_counts(scores, positive)
    true_positive_rate = true_positives / true_positives[-1]
    index = int(np.argmax(true_positive_rate >= tpr_level))
    return float(false_positives[index] / false_positives[-1])


def _risk_coverage(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> np.ndarray:
    # risk[k - 1] = fraction of errors among the k most confident samples (stable sort on decreasing confidence).
    probabilities, targets = _check_inputs(probs, labels)
    confidence, correct = _confidence_and_correctness(probabilities, targets)
    order = np.argsort(-confidence, kind="stable")
    errors = np.cumsum(~correct[order])
    return errors / np.arange(1, errors.shape[0] + 1)


def aurc(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""Area under the risk-coverage curve (Geifman et al., 2019) with the 0/1 loss.

    Samples are sorted by decreasing confidence :math:`\hat p` and

    .. math:: \mathrm{AURC} = \frac1n \sum_{k=1}^n \frac{\#\{\text{errors among the first } k\}}{k},

    i.e. the mean selective risk over the coverages :math:`k / n`. Ties in confidence are broken by a *stable*
    sort: tied samples keep their input order (the same as Python's ``sorted(..., reverse=True)`` in common reference
    implementations), so with ties the value depends on the input order.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A fraction in :math:`[0, 1]` (papers often report :math:`10^3 \times` AURC).
    """
    return float(_risk_coverage(probs, labels).mean())


def eaurc(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""Excess AURC: :func:`aurc` minus the AURC of a perfect ranking with the same errors.

    With :math:`e` errors among :math:`n` samples, the perfect ranking accepts all correct samples first, so

    .. math:: \mathrm{AURC}^\star = \frac1n \sum_{k=n-e+1}^{n} \frac{k - (n - e)}{k}.

    This exact discrete optimum makes E-AURC :math:`\geq 0` with equality for a perfect ranking. Geifman et al.
    (2019) use its continuous limit :math:`r + (1 - r) \log(1 - r)`, :math:`r = e / n`, which is smaller by
    :math:`O(1/n)`; add back the difference to reproduce numbers computed that way.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A float in :math:`[0, 1]`.
    """
    risk = _risk_coverage(probs, labels)
    num_samples = risk.shape[0]
    num_errors = int(round(risk[-1] * num_samples))
    coverage_counts = np.arange(1, num_samples + 1)
    optimal_risk = np.maximum(coverage_counts - (num_samples - num_errors), 0) / coverage_counts
    return float(risk.mean() - optimal_risk.mean())


def misclassification_auroc(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""AUROC of the confidence :math:`\hat p` for separating correct (positive) from wrong predictions.

    Computed as the Mann-Whitney statistic with average ranks on ties (equal to the trapezoidal ROC area and to
    ``sklearn.metrics.roc_auc_score(correct, confidence)``).

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A fraction in :math:`[0, 1]`, or ``float("nan")`` when all predictions are correct or all are wrong
        (AUROC is undefined with a single class; no warning is emitted).
    """
    probabilities, targets = _check_inputs(probs, labels)
    confidence, correct = _confidence_and_correctness(probabilities, targets)
    return _binary_auroc(confidence, correct)


def fpr_at_95_tpr(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray) -> float:
    r"""Misclassification detection: FPR (wrong predictions accepted) when 95% of correct predictions are accepted.

    Accepting every sample with :math:`\hat p \geq t`, the threshold :math:`t` is the largest confidence at which
    the true positive rate (correct = positive) reaches 0.95; tied confidences are accepted together. This is the
    smallest FPR with TPR :math:`\geq 0.95`, i.e. ``fpr[argmax(tpr >= 0.95)]`` of
    ``sklearn.metrics.roc_curve(correct, confidence, drop_intermediate=False)``.

    :param probs: Predicted probabilities, shape ``(n, C)``.
    :param labels: Integer labels, shape ``(n,)``.
    :return: A fraction in :math:`[0, 1]`, or ``float("nan")`` when all predictions are correct or all are wrong.
    """
    probabilities, targets = _check_inputs(probs, labels)
    confidence, correct = _confidence_and_correctness(probabilities, targets)
    return _fpr_at_tpr(confidence, correct, 0.95)
