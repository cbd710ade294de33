"""Evaluation of the comparison's runs: the Monte Carlo logits of a model or an ensemble on every set of a task, the
metrics computed from them and the post-hoc temperature-scaled variant of every run (the KSVD fidelity of its KSVD
layers: :mod:`gpattn.comparison.fidelity`).

One set of metric functions (:mod:`gpattn.metrics`) serves everywhere: the validation NLL that the training loop
selects on (:func:`~gpattn.training.validation_metrics`) is the test NLL that the comparison reports
(:func:`classification_metrics`), :func:`~gpattn.metrics.negative_log_likelihood` with its floor
:math:`\\epsilon = 10^{-12}` on the probability of the true class.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import metrics
from ..models import fit_temperature, monte_carlo_logits
from ..training import dataset_inputs, dataset_labels, validation_metrics
from ..validation import check_int
from .records import (
    ClassificationMetrics,
    OODMetrics,
    ReliabilityBins,
    RunMetrics,
    ShiftMetrics,
    TemperatureScaled,
)
from .tasks import TaskData

__all__ = [
    "DEFAULT_ECE_BINS",
    "Evaluation",
    "classification_metrics",
    "ensemble_logits",
    "evaluate_models",
    "evaluate_run",
]

#: Bins of the reported ECE/MCE and reliability diagrams (15, as the KEP-SVGP paper).
DEFAULT_ECE_BINS = 15


# -- metrics ---------------------------------------------------------------------------------------------------------
def classification_metrics(
    probabilities: Tensor, labels: Tensor, num_bins: int = DEFAULT_ECE_BINS
) -> ClassificationMetrics:
    """Every test-set metric of predictive probabilities ``(n, C)`` against labels ``(n,)``; the calibration errors
    over ``num_bins`` equal-width bins (top-label ECE/MCE and the classwise ECE,
    :func:`~gpattn.metrics.expected_calibration_error`)."""
    accuracy, nll = validation_metrics(probabilities, labels)
    return ClassificationMetrics(
        accuracy=accuracy,
        confidence=float(probabilities.max(dim=-1).values.mean()),
        nll=nll,
        ece=metrics.expected_calibration_error(probabilities, labels, num_bins),
        mce=metrics.maximum_calibration_error(probabilities, labels, num_bins),
        brier=metrics.brier_score(probabilities, labels),
        aurc=metrics.aurc(probabilities, labels),
        eaurc=metrics.eaurc(probabilities, labels),
        auroc=metrics.misclassification_auroc(probabilities, labels),
        fpr95=metrics.fpr_at_95_tpr(probabilities, labels),
        classwise_ece=metrics.expected_calibration_error(probabilities, labels, num_bins, kind="classwise"),
    )


def _shift_metrics(probabilities: Tensor, labels: Tensor, num_bins: int) -> ShiftMetrics:
    accuracy, nll = validation_metrics(probabilities, labels)
    ece = metrics.expected_calibration_error(probabilities, labels, num_bins)
    return ShiftMetrics(accuracy=accuracy, nll=nll, ece=ece, brier=metrics.brier_score(probabilities, labels))


def _ood_metrics(test_probabilities: Tensor, ood_probabilities: Tensor) -> OODMetrics:
    return OODMetrics(
        auroc_max_prob=metrics.ood_auroc(test_probabilities, ood_probabilities, score="max_prob"),
        auroc_entropy=metrics.ood_auroc(test_probabilities, ood_probabilities, score="entropy"),
        aupr_max_prob=metrics.ood_aupr(test_probabilities, ood_probabilities, score="max_prob"),
        fpr95_max_prob=metrics.ood_fpr_at_95_tpr(test_probabilities, ood_probabilities, score="max_prob"),
        aupr_out_max_prob=metrics.ood_aupr(test_probabilities, ood_probabilities, score="max_prob", positive="out"),
    )


def _optional(value: float) -> float | None:
    return None if value != value else float(value)  # an empty bin's NaN is JSON's null


def ensemble_logits(
    models: Sequence[torch.nn.Module],
    dataset: Any,
    num_samples: int = 10,
    mc_dropout: bool = False,
    batch_size: int = 256,
) -> Tensor:
    r"""Monte Carlo logits of every member on a data set, :func:`~gpattn.models.monte_carlo_logits` by batches (members
    in order, each drawing from the global torch RNG; the same draws, in the same order, as
    :func:`~gpattn.training.ensemble_probabilities`).

    :param models: The members (one for a single model), all with the same number of samples per input.
    :param dataset: Has ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param num_samples: :math:`T` (a deterministic member is run once).
    :param mc_dropout: Keep dropout on (MC dropout; a member without dropout raises).
    :param batch_size: Inputs per forward pass.
    :return: Logits ``(K, T', n, C)`` on the CPU (``T' = 1`` for deterministic members), in float64.
    """
    models = list(models)
    if not models:
        raise ValueError("expected at least one model in the ensemble, got none")
    check_int("batch_size", batch_size)
    inputs, mask = dataset_inputs(dataset)
    outputs = []
    for model in models:
        parameter = next(model.parameters(), None)
        device = torch.device("cpu") if parameter is None else parameter.device
        mask_on_device = None if mask is None else mask.to(device)
        logits = monte_carlo_logits(model, inputs.to(device), mask_on_device, num_samples, mc_dropout, batch_size)
        outputs.append(logits.cpu().double())
    if len({tuple(logits.shape) for logits in outputs}) != 1:
        raise ValueError(
            f"expected every member to give as many samples, got shapes {[tuple(o.shape) for o in outputs]}"
        )
    return torch.stack(outputs)


def _probabilities(logits: Tensor, temperature: float = 1.0) -> Tensor:
    # mean over members and samples of softmax(logits / tau): shape (n, C)
    return (logits / temperature).softmax(dim=-1).mean(dim=(0, 1))


@dataclass(frozen=True)
class Evaluation:
    """The evaluation of one trained model or ensemble (:func:`evaluate_models`).

    :ivar metrics: Test, shift and OOD metrics.
    :ivar reliability: The test set's reliability bins.
    :ivar ood_scores: Max probabilities of the test (``"in"``) and every OOD input; ``{}`` without OOD sets.
    :ivar temperature_scaled: The same predictions temperature-scaled (temperature fitted on the validation split),
        or ``None``.
    """

    metrics: RunMetrics
    reliability: ReliabilityBins
    ood_scores: dict[str, list[float]]
    temperature_scaled: TemperatureScaled | None


def _bins(probabilities: Tensor, labels: Tensor, num_bins: int) -> ReliabilityBins:
    reliability = metrics.reliability_diagram_data(probabilities, labels, num_bins)
    return ReliabilityBins(
        confidence=[_optional(value) for value in reliability.confidence],
        accuracy=[_optional(value) for value in reliability.accuracy],
        count=[int(value) for value in reliability.count],
    )


def _metrics_from_logits(
    logits: dict[str, Tensor], data: TaskData, temperature: float, num_bins: int
) -> tuple[RunMetrics, ReliabilityBins, dict[str, list[float]]]:
    test_probabilities = _probabilities(logits["test"], temperature)
    shift: dict[str, dict[str, ShiftMetrics]] = {}
    for (kind, severity), dataset in data.shifted.items():
        probabilities = _probabilities(logits[f"shift/{kind}/{severity}"], temperature)
        shift.setdefault(kind, {})[str(severity)] = _shift_metrics(probabilities, dataset.labels, num_bins)
    ood, ood_scores = {}, {}
    if data.ood:
        ood_scores["in"] = test_probabilities.max(dim=-1).values.tolist()
    for name in data.ood:
        probabilities = _probabilities(logits[f"ood/{name}"], temperature)
        ood_scores[name] = probabilities.max(dim=-1).values.tolist()
        ood[name] = _ood_metrics(test_probabilities, probabilities)
    test = classification_metrics(test_probabilities, data.test.labels, num_bins)
    bins = _bins(test_probabilities, data.test.labels, num_bins)
    return RunMetrics(test=test, shift=shift, ood=ood), bins, ood_scores


def evaluate_models(
    models: torch.nn.Module | Sequence[torch.nn.Module],
    data: TaskData,
    num_samples: int,
    *,
    num_bins: int = DEFAULT_ECE_BINS,
    mc_dropout: bool = False,
    temperature_scaling: bool = True,
) -> Evaluation:
    r"""Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged), on a task's test, shifted and OOD sets, and of its temperature-scaled variant.

    Every set is predicted once, as Monte Carlo logits :math:`f^{(k,t)}(x)` of member :math:`k` and sample
    :math:`t` (:func:`ensemble_logits`); the reported prediction is
    :math:`\frac{1}{KT} \sum_{k,t} \operatorname{softmax}(f^{(k,t)}(x) / \tau)` with :math:`\tau = 1` for the
    model as trained and, for the ``+ts`` variant, :math:`\hat\tau` fitted by
    :func:`~gpattn.models.fit_temperature` on the *validation* split's logits of the same kind (the same :math:`T`,
    the same MC dropout). The test labels are never read before the metrics: the temperature depends on the
    validation split only. Post-hoc: no retraining, one extra pass over the validation split.

    :param models: The model or the members.
    :param data: The task.
    :param num_samples: Monte Carlo samples :math:`T` per prediction.
    :param num_bins: Bins of the ECE/MCE (top-label and classwise) and of the reliability diagram.
    :param mc_dropout: Dropout on at test time (MC dropout; the models must have dropout).
    :param temperature_scaling: Also fit and evaluate the temperature-scaled variant.
    :return: The :class:`Evaluation`.

    .. note:: Cost: :math:`K T` forward passes over every set (and the validation split for the temperature);
        the scaled variant's metrics reuse the same logits. A temperature on the boundary of
        :func:`~gpattn.models.fit_temperature`'s bounds (the validation NLL still falling, e.g. a validation split
        classified perfectly) is kept without its warning: the comparison's ``temperature`` column shows it.
    """
    members = [models] if isinstance(models, torch.nn.Module) else list(models)
    check_int("num_bins", num_bins, where="evaluate_models")
    sets = {"test": data.test}
    sets.update({f"shift/{kind}/{severity}": dataset for (kind, severity), dataset in data.shifted.items()})
    sets.update({f"ood/{name}": dataset for name, dataset in data.ood.items()})
    logits = {name: ensemble_logits(members, dataset, num_samples, mc_dropout) for name, dataset in sets.items()}
    run_metrics, reliability, ood_scores = _metrics_from_logits(logits, data, 1.0, num_bins)
    scaled = None
    if temperature_scaling:
        val_logits = ensemble_logits(members, data.val, num_samples, mc_dropout)
        with warnings.catch_warnings():  # a boundary temperature is kept and shown in the table's temperature column
            warnings.filterwarnings("ignore", message="fit_temperature: the optimum lies on the boundary")
            temperature = fit_temperature(val_logits.flatten(0, 1), dataset_labels(data.val))
        scaled_metrics, scaled_bins, _ = _metrics_from_logits(logits, data, temperature, num_bins)
        scaled = TemperatureScaled(temperature=temperature, metrics=scaled_metrics, reliability=scaled_bins)
    return Evaluation(run_metrics, reliability, ood_scores, scaled)


def evaluate_run(
    models: torch.nn.Module | Sequence[torch.nn.Module],
    data: TaskData,
    num_samples: int,
    num_bins: int = DEFAULT_ECE_BINS,
) -> tuple[RunMetrics, ReliabilityBins, dict[str, list[float]]]:
    """Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged, :func:`~gpattn.training.ensemble_probabilities`), on a task's test, shifted and OOD sets
    (:func:`evaluate_models` without the temperature-scaled variant).

    :param models: The model or the members.
    :param data: The task.
    :param num_samples: Monte Carlo samples :math:`T` per prediction.
    :param num_bins: Bins of the calibration errors and the reliability diagram.
    :return: The :class:`~gpattn.comparison.RunMetrics`, the test set's reliability bins and the OOD scores (the
        maximum probability of every test (``"in"``) and OOD input; ``{}`` for a task without OOD sets).
    """
    evaluation = evaluate_models(models, data, num_samples, num_bins=num_bins, temperature_scaling=False)
    return evaluation.metrics, evaluation.reliability, evaluation.ood_scores
