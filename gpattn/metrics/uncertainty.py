r"""Total, aleatoric and epistemic uncertainty of a stochastic classifier from its Monte Carlo predictions.

For :math:`T` predictive samples :math:`p^{(t)}(\cdot \mid x)` of one input (the class probabilities of :math:`T`
forward passes of a GP-attention model, of MC dropout, or of the members of an ensemble), the entropy of the mean
prediction splits into an expected entropy and the mutual information between the prediction and the model sample
(Houlsby et al. 2011, "BALD"; Depeweg et al. 2018):

.. math::

    \underbrace{H\Big[\tfrac1T \sum_t p^{(t)}\Big]}_{\text{total}}
    = \underbrace{\tfrac1T \sum_t H\big[p^{(t)}\big]}_{\text{expected (aleatoric)}}
    + \underbrace{I(y; \theta \mid x)}_{\text{mutual information (epistemic)}},
    \qquad H[p] = -\sum_c p_c \log p_c,

with natural logarithms and :math:`0 \log 0 = 0`. The mutual information is non-negative (the entropy is concave)
and zero for a deterministic model or when all samples agree. :func:`ood_auroc_mutual_information` scores OOD
detection with it (a lower mutual information reads as more in-distribution); it needs :math:`T \geq 2` samples of
each data set, since the mutual information of a single sample is 0 for every input.

Sample probabilities are ``(T, n, C)`` tensors or arrays (rows summing to one); results are float64 NumPy arrays
of shape ``(n,)``.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from .calibration import _as_probabilities
from .selective import _binary_auroc

__all__ = [
    "expected_entropy",
    "mutual_information",
    "ood_auroc_mutual_information",
    "predictive_entropy",
]


def _entropies(probabilities: np.ndarray) -> np.ndarray:
    r""":math:`H[p]` of every row (the last axis) of a float array, summed in a fixed (sorted) order, so that rows that
    are permutations of each other get the same value, not values apart by rounding (which a ranking by the entropy,
    e.g. an AUROC, would read as an order instead of a tie); :math:`0 \log 0 = 0`."""
    ordered = np.sort(probabilities, axis=-1)
    safe = np.where(ordered > 0.0, ordered, 1.0)
    return -(ordered * np.log(safe)).sum(axis=-1)


def _as_samples(
    samples: Tensor | np.ndarray, name: str = "samples", *, at_least_two: bool = False, where: str = ""
) -> np.ndarray:
    r"""Validate ``(T, n, C)`` sample probabilities (each row as in the other metrics, with the tolerance of the
    input's dtype) and return them as float64. ``at_least_two`` requires :math:`T \geq 2` (a score that needs the
    samples to vary: the mutual information of one sample is 0 for every input); ``where`` names the caller."""
    if not isinstance(samples, (Tensor, np.ndarray)):
        samples = np.asarray(samples)  # its own dtype, checked as the other metrics': bools and strings refused
    if samples.ndim != 3 or min(samples.shape) < 1:
        raise ValueError(
            f"expected {name} of shape (T, n, C) (Monte Carlo samples of class probabilities), got shape "
            f"{tuple(samples.shape)}"
        )
    if at_least_two and samples.shape[0] < 2:
        prefix = f"{where}: " if where else ""
        raise ValueError(
            f"{prefix}expected {name} of shape (T, n, C) with T >= 2 Monte Carlo samples, got T = {samples.shape[0]} "
            f"(shape {tuple(samples.shape)}): the mutual information of a single sample is 0 for every input, so it "
            f"cannot separate the data sets; score a deterministic model with ood_auroc instead"
        )
    shape = tuple(samples.shape)
    return _as_probabilities(samples.reshape(-1, shape[-1]), name).reshape(shape)


def predictive_entropy(probs: Tensor | np.ndarray) -> np.ndarray:
    r"""The entropy :math:`H[p]` of each row of ``probs`` (``(n, C)``), e.g. of the mean prediction (total
    uncertainty).

    :return: Shape ``(n,)``, in :math:`[0, \log C]`.
    """
    return _entropies(_as_probabilities(probs))


def expected_entropy(samples: Tensor | np.ndarray) -> np.ndarray:
    r""":math:`\tfrac1T \sum_t H[p^{(t)}]` of each input (aleatoric uncertainty).

    :param samples: ``(T, n, C)``.
    :return: Shape ``(n,)``.
    """
    return _entropies(_as_samples(samples)).mean(axis=0)


def mutual_information(samples: Tensor | np.ndarray) -> np.ndarray:
    r"""The mutual information :math:`H[\bar p] - \tfrac1T \sum_t H[p^{(t)}]` of each input (epistemic uncertainty),
    :math:`\bar p = \tfrac1T \sum_t p^{(t)}`, floored at 0 (rounding can make it slightly negative), and exactly 0 for
    an input whose samples are all equal (where rounding would leave values of order 1e-16 that a ranking, e.g.
    :func:`ood_auroc_mutual_information`, would read as an order instead of a tie).

    :param samples: ``(T, n, C)`` Monte Carlo predictions.
    :return: Shape ``(n,)``, in :math:`[0, \log \min(T, C)]` (0 for every input when :math:`T = 1`).

    .. note:: Cost O(T n C).
    """
    array = _as_samples(samples)
    information = np.maximum(_entropies(array.mean(axis=0)) - _entropies(array).mean(axis=0), 0.0)
    information[(array == array[:1]).all(axis=(0, 2))] = 0.0
    return information


def ood_auroc_mutual_information(samples_in: Tensor | np.ndarray, samples_out: Tensor | np.ndarray) -> float:
    r"""AUROC of separating in-distribution (positive) from OOD inputs by the score :math:`-I(y; \theta \mid x)`
    (:func:`mutual_information`): the Mann-Whitney statistic, ties counted half, as
    :func:`~gpattn.metrics.ood_auroc`.

    :param samples_in: In-distribution samples, ``(T, n_in, C)``, :math:`T \geq 2`.
    :param samples_out: OOD samples, ``(T', n_out, C)`` (the same classes), :math:`T' \geq 2`.
    :return: A fraction in :math:`[0, 1]`; 0.5 when every input's samples agree (every score 0).
    :raises ValueError: For a single sample (:math:`T = 1` or :math:`T' = 1`), whose mutual information is 0 for every
        input: a deterministic model has no such score (use :func:`~gpattn.metrics.ood_auroc`).
    """
    where = "ood_auroc_mutual_information"
    inside = _as_samples(samples_in, "samples_in", at_least_two=True, where=where)
    outside = _as_samples(samples_out, "samples_out", at_least_two=True, where=where)
    if inside.shape[-1] != outside.shape[-1]:
        raise ValueError(
            f"expected samples_in and samples_out over the same number of classes, got C = {inside.shape[-1]} and "
            f"C = {outside.shape[-1]}; score both data sets with the same model"
        )
    inside, outside = mutual_information(inside), mutual_information(outside)
    scores = -np.concatenate([inside, outside])
    is_in = np.r_[np.ones(inside.shape[0], dtype=bool), np.zeros(outside.shape[0], dtype=bool)]
    return _binary_auroc(scores, is_in)
