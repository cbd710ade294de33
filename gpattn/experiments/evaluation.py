"""Evaluation: Monte Carlo predictive probabilities of a model or an ensemble, and the metrics computed from them.

One set of metric functions (:mod:`gpattn.metrics`) serves everywhere: the validation NLL that the training loop
selects on (:func:`validation_metrics`) is the test NLL that the comparison reports (:func:`classification_metrics`),
:func:`~gpattn.metrics.negative_log_likelihood` with its floor :math:`\\epsilon = 10^{-12}` on the probability of the
true class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import metrics
from ..models import predict_probabilities
from ..validation import check_int
from .records import ClassificationMetrics, OODMetrics, ReliabilityBins, RunMetrics, ShiftMetrics
from .tasks import TaskData

__all__ = [
    "batch_to_device",
    "classification_metrics",
    "dataset_inputs",
    "dataset_labels",
    "ensemble_probabilities",
    "evaluate",
    "evaluate_run",
    "validation_metrics",
]


# -- data sets -------------------------------------------------------------------------------------------------------
def dataset_inputs(dataset: Any) -> tuple[Tensor, Tensor | None]:
    """``(inputs, mask or None)`` of a data set: ``.tokens`` and ``.mask`` (:class:`~gpattn.data.SequenceDataset`),
    ``.images`` (:class:`~gpattn.data.ImageDataset`, no mask) or a generic ``.inputs`` (and ``.mask`` if present).

    :param dataset: The data set.
    :return: The inputs, shape ``(n, ...)``, and the boolean mask ``(n, N)`` or ``None``.
    :raises TypeError: For an object without such a tensor attribute.
    """
    for name in ("tokens", "images", "inputs"):
        inputs = getattr(dataset, name, None)
        if isinstance(inputs, Tensor):
            return inputs, None if name == "images" else getattr(dataset, "mask", None)
    raise TypeError(
        f"expected a data set with a tensor attribute .tokens, .images or .inputs (and .labels), "
        f"got {type(dataset).__name__}"
    )


def dataset_labels(dataset: Any) -> Tensor:
    """The integer class labels ``.labels`` of a data set, shape ``(n,)``, checked against its inputs.

    :raises TypeError: Labels missing or not an integer vector.
    :raises ValueError: An empty data set, or as many labels as inputs.
    """
    labels = getattr(dataset, "labels", None)
    inputs, _ = dataset_inputs(dataset)
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.is_floating_point():
        raise TypeError(f"expected integer class labels .labels of shape (n,), got {type(labels).__name__}")
    if labels.shape[0] != inputs.shape[0] or labels.shape[0] == 0:
        raise ValueError(
            f"expected a non-empty data set with as many labels as inputs, got {labels.shape[0]} labels for "
            f"{inputs.shape[0]} inputs"
        )
    return labels


def batch_to_device(
    inputs: Tensor, mask: Tensor | None, index: Tensor, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """Rows ``index`` of ``inputs`` ``(n, ...)`` and of ``mask`` ``(n, N)`` (or ``None``), moved to ``device``."""
    return inputs[index].to(device), None if mask is None else mask[index].to(device)


# -- predictions -----------------------------------------------------------------------------------------------------
def evaluate(model: torch.nn.Module, dataset: Any, num_samples: int = 10, batch_size: int = 256) -> Tensor:
    """Monte Carlo predictive probabilities of ``model`` on a data set, by batches of
    :func:`~gpattn.models.predict_probabilities` (eval mode, ``num_samples`` samples, no gradients; the global torch RNG
    drives the samples).

    :param model: Maps ``(inputs, mask=mask)`` to logits.
    :param dataset: Has ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param num_samples: :math:`T`.
    :param batch_size: Sequences per forward pass.
    :return: Probabilities, shape ``(n, C)``, on the CPU.
    """
    check_int("batch_size", batch_size)
    inputs, mask = dataset_inputs(dataset)
    parameter = next(model.parameters(), None)
    device = torch.device("cpu") if parameter is None else parameter.device
    parts = []
    for start in range(0, inputs.shape[0], batch_size):
        index = torch.arange(start, min(start + batch_size, inputs.shape[0]))
        batch_inputs, batch_mask = batch_to_device(inputs, mask, index, device)
        parts.append(predict_probabilities(model, batch_inputs, mask=batch_mask, num_samples=num_samples).cpu())
    return torch.cat(parts)


def ensemble_probabilities(
    models: Sequence[torch.nn.Module], dataset: Any, num_samples: int = 10, batch_size: int = 256
) -> Tensor:
    """The ensemble's predictive probabilities: the mean over members of :func:`evaluate` (members in order, each
    drawing its Monte Carlo samples from the global torch RNG), shape ``(n, C)``."""
    models = list(models)
    if not models:
        raise ValueError("expected at least one model in the ensemble, got none")
    return torch.stack([evaluate(model, dataset, num_samples, batch_size) for model in models]).mean(dim=0)


# -- metrics ---------------------------------------------------------------------------------------------------------
def validation_metrics(probabilities: Tensor, labels: Tensor) -> tuple[float, float]:
    """Accuracy and NLL of predictive probabilities ``(n, C)`` against labels ``(n,)``: what the training loop records
    every epoch and selects on, the reported :func:`~gpattn.metrics.accuracy` and
    :func:`~gpattn.metrics.negative_log_likelihood`."""
    return metrics.accuracy(probabilities, labels), metrics.negative_log_likelihood(probabilities, labels)


def classification_metrics(probabilities: Tensor, labels: Tensor) -> ClassificationMetrics:
    """Every test-set metric of predictive probabilities ``(n, C)`` against labels ``(n,)``."""
    accuracy, nll = validation_metrics(probabilities, labels)
    return ClassificationMetrics(
        accuracy=accuracy,
        confidence=float(probabilities.max(dim=-1).values.mean()),
        nll=nll,
        ece=metrics.expected_calibration_error(probabilities, labels),
        mce=metrics.maximum_calibration_error(probabilities, labels),
        brier=metrics.brier_score(probabilities, labels),
        aurc=metrics.aurc(probabilities, labels),
        eaurc=metrics.eaurc(probabilities, labels),
        auroc=metrics.misclassification_auroc(probabilities, labels),
        fpr95=metrics.fpr_at_95_tpr(probabilities, labels),
    )


def _shift_metrics(probabilities: Tensor, labels: Tensor) -> ShiftMetrics:
    accuracy, nll = validation_metrics(probabilities, labels)
    ece = metrics.expected_calibration_error(probabilities, labels)
    return ShiftMetrics(accuracy=accuracy, nll=nll, ece=ece, brier=metrics.brier_score(probabilities, labels))


def _ood_metrics(test_probabilities: Tensor, ood_probabilities: Tensor) -> OODMetrics:
    return OODMetrics(
        auroc_max_prob=metrics.ood_auroc(test_probabilities, ood_probabilities, score="max_prob"),
        auroc_entropy=metrics.ood_auroc(test_probabilities, ood_probabilities, score="entropy"),
        aupr_max_prob=metrics.ood_aupr(test_probabilities, ood_probabilities, score="max_prob"),
        fpr95_max_prob=metrics.ood_fpr_at_95_tpr(test_probabilities, ood_probabilities, score="max_prob"),
    )


def _optional(value: float) -> float | None:
    return None if value != value else float(value)  # an empty bin's NaN is JSON's null


def evaluate_run(
    models: torch.nn.Module | Sequence[torch.nn.Module], data: TaskData, num_samples: int
) -> tuple[RunMetrics, ReliabilityBins, dict[str, list[float]]]:
    """Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged, :func:`ensemble_probabilities`), on a task's test, shifted and OOD sets.

    :param models: The model or the members.
    :param data: The task.
    :param num_samples: Monte Carlo samples :math:`T` per prediction.
    :return: The :class:`~gpattn.experiments.RunMetrics`, the test set's reliability bins and the OOD scores (the
        maximum probability of every test (``"in"``) and OOD input; ``{}`` for a task without OOD sets).
    """
    members = [models] if isinstance(models, torch.nn.Module) else list(models)

    def predict(dataset: Any) -> Tensor:
        return ensemble_probabilities(members, dataset, num_samples=num_samples)

    test_probabilities = predict(data.test)
    reliability = metrics.reliability_diagram_data(test_probabilities, data.test.labels)
    bins = ReliabilityBins(
        confidence=[_optional(value) for value in reliability.confidence],
        accuracy=[_optional(value) for value in reliability.accuracy],
        count=[int(value) for value in reliability.count],
    )
    shift: dict[str, dict[str, ShiftMetrics]] = {}
    for (kind, severity), dataset in data.shifted.items():
        shift.setdefault(kind, {})[str(severity)] = _shift_metrics(predict(dataset), dataset.labels)
    ood, ood_scores = {}, {}
    if data.ood:
        ood_scores["in"] = test_probabilities.max(dim=-1).values.tolist()
    for name, dataset in data.ood.items():
        probabilities = predict(dataset)
        ood_scores[name] = probabilities.max(dim=-1).values.tolist()
        ood[name] = _ood_metrics(test_probabilities, probabilities)
    test = classification_metrics(test_probabilities, data.test.labels)
    return RunMetrics(test=test, shift=shift, ood=ood), bins, ood_scores
