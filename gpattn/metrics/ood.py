r"""Out-of-distribution (OOD) detection from predicted class probabilities.

A score :math:`s(p)` of a probability vector :math:`p \in \Delta^{C-1}` is *higher for more in-distribution*
samples:

* ``"max_prob"``: :math:`s(p) = \max_c p_c` (maximum softmax probability, Hendrycks & Gimpel, 2017);
* ``"entropy"``: :math:`s(p) = -H(p) = \sum_c p_c \log p_c` (natural log, :math:`0 \log 0 = 0`).

Inputs are in-distribution probabilities ``(n_in, C)`` and OOD probabilities ``(n_out, C)`` with the same
:math:`C`, as ``torch.Tensor`` or ``numpy.ndarray``; outputs are plain Python floats.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from .calibration import _as_probabilities
from .selective import _average_precision, _binary_auroc, _fpr_at_tpr
from .uncertainty import _entropies

SCORES = ("max_prob", "entropy")
POSITIVES = ("in", "out")


def _scores(probabilities: np.ndarray, score: str) -> np.ndarray:
    if score == "max_prob":
        return probabilities.max(axis=1)
    return -_entropies(probabilities)  # summed in a fixed order: permuted rows tie


def _in_out_scores(
    probs_in: Tensor | np.ndarray, probs_out: Tensor | np.ndarray, score: str
) -> tuple[np.ndarray, np.ndarray]:
    # Concatenated scores of shape (n_in + n_out,) and a mask that is True on in-distribution samples.
    if score not in SCORES:
        raise ValueError(f"expected score in {SCORES}, got {score!r}")
    inside = _as_probabilities(probs_in, "probs_in")
    outside = _as_probabilities(probs_out, "probs_out")
    if inside.shape[1] != outside.shape[1]:
        raise ValueError(
            f"expected probs_in and probs_out over the same number of classes, got C = {inside.shape[1]} and "
            f"C = {outside.shape[1]}; score both data sets with the same model"
        )
    scores = np.concatenate([_scores(inside, score), _scores(outside, score)])
    is_in = np.r_[np.ones(inside.shape[0], dtype=bool), np.zeros(outside.shape[0], dtype=bool)]
    return scores, is_in


def ood_auroc(probs_in: Tensor | np.ndarray, probs_out: Tensor | np.ndarray, score: str = "max_prob") -> float:
    r"""AUROC of the score for separating in-distribution (positive) from OOD samples.

    Computed as the Mann-Whitney statistic :math:`P(s_\mathrm{in} > s_\mathrm{out}) + \frac12 P(s_\mathrm{in} =
    s_\mathrm{out})`, which is symmetric: taking OOD as positive with score :math:`-s` gives the same value.

    :param probs_in: In-distribution probabilities, shape ``(n_in, C)``, :math:`n_\mathrm{in} \geq 1`.
    :param probs_out: OOD probabilities, shape ``(n_out, C)``, :math:`n_\mathrm{out} \geq 1`.
    :param score: ``"max_prob"`` or ``"entropy"`` (negative entropy), see the module docstring.
    :return: A fraction in :math:`[0, 1]`.
    """
    scores, is_in = _in_out_scores(probs_in, probs_out, score)
    return _binary_auroc(scores, is_in)


def ood_aupr(
    probs_in: Tensor | np.ndarray,
    probs_out: Tensor | np.ndarray,
    score: str = "max_prob",
    positive: str = "in",
) -> float:
    r"""Area under the precision-recall curve, as average precision :math:`\sum_k (R_k - R_{k-1}) P_k`.

    This is scikit-learn's ``average_precision_score`` (no interpolation) over decreasing distinct thresholds.
    Unlike AUROC it depends on which class is positive: ``positive="in"`` (default, "AUPR-In") ranks by :math:`s`
    with in-distribution samples positive; ``positive="out"`` ("AUPR-Out") ranks by :math:`-s` with OOD samples
    positive.

    :param probs_in: In-distribution probabilities, shape ``(n_in, C)``.
    :param probs_out: OOD probabilities, shape ``(n_out, C)``.
    :param score: ``"max_prob"`` or ``"entropy"`` (negative entropy).
    :param positive: ``"in"`` or ``"out"``.
    :return: A fraction in :math:`[0, 1]`.
    """
    if positive not in POSITIVES:
        raise ValueError(f"expected positive in {POSITIVES}, got {positive!r}")
    scores, is_in = _in_out_scores(probs_in, probs_out, score)
    if positive == "in":
        return _average_precision(scores, is_in)
    return _average_precision(-scores, ~is_in)


def ood_fpr_at_95_tpr(probs_in: Tensor | np.ndarray, probs_out: Tensor | np.ndarray, score: str = "max_prob") -> float:
    r"""Fraction of OOD samples accepted when 95% of in-distribution samples are accepted.

    In-distribution is positive. Accepting every sample with :math:`s \geq t`, :math:`t` is the largest score at
    which the in-distribution TPR reaches 0.95 (tied scores are accepted together), i.e.
    ``fpr[argmax(tpr >= 0.95)]`` of ``sklearn.metrics.roc_curve(is_in, s, drop_intermediate=False)``.

    :param probs_in: In-distribution probabilities, shape ``(n_in, C)``.
    :param probs_out: OOD probabilities, shape ``(n_out, C)``.
    :param score: ``"max_prob"`` or ``"entropy"`` (negative entropy).
    :return: A fraction in :math:`[0, 1]` (lower is better).
    """
    scores, is_in = _in_out_scores(probs_in, probs_out, score)
    return _fpr_at_tpr(scores, is_in, 0.95)
