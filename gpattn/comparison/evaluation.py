"""Evaluation of the comparison's runs: the Monte Carlo logits of a model or an ensemble on every set of a task, the
metrics computed from them and the post-hoc temperature-scaled variant of every run (the KSVD fidelity of its KSVD
layers: :mod:`gpattn.comparison.fidelity`).

One set of metric functions (:mod:`gpattn.metrics`) serves everywhere: the validation NLL that the training loop
selects on (:func:`~gpattn.training.validation_metrics`) is the test NLL that the comparison reports
(:func:`classification_metrics`), :func:`~gpattn.metrics.negative_log_likelihood` with its floor
:math:`\\epsilon = 10^{-12}` on the probability of the true class.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import metrics
from ..metrics.calibration import _check_inputs
from ..models import LastLayerLaplace, fit_temperature, monte_carlo_logits
from ..training import dataset_inputs, dataset_labels, validation_metrics
from ..validation import InputTypeError, check_int
from .records import (
    ClassificationMetrics,
    OODMetrics,
    ReliabilityBins,
    RunMetrics,
    ShiftMetrics,
    TemperatureScaled,
)
from .streams import random_stream
from .tasks import TaskData

__all__ = [
    "DEFAULT_ECE_BINS",
    "POOLED_OOD",
    "Evaluation",
    "classification_metrics",
    "ensemble_logits",
    "evaluate_models",
    "evaluate_run",
    "per_example_predictions",
]

#: Bins of the reported ECE/MCE and reliability diagrams (15, as the KEP-SVGP paper), and equal-mass bins of the
#: debiased calibration error.
DEFAULT_ECE_BINS = 15
#: The name of the OOD set that pools every OOD set of a task.
POOLED_OOD = "pooled"
#: The floor of :func:`~gpattn.metrics.negative_log_likelihood` on the probability of the true class.
NLL_FLOOR = 1e-12


# -- metrics ---------------------------------------------------------------------------------------------------------
def classification_metrics(
    probabilities: Tensor, labels: Tensor, num_bins: int = DEFAULT_ECE_BINS
) -> ClassificationMetrics:
    """Every test-set metric of predictive probabilities ``(n, C)`` against labels ``(n,)``: the calibration errors
    over ``num_bins`` equal-width bins (top-label ECE/MCE and the classwise ECE,
    :func:`~gpattn.metrics.expected_calibration_error`), the debiased top-label calibration error on ``num_bins``
    equal-mass bins (:func:`~gpattn.metrics.debiased_calibration_error`) and the top-label sweep ECE
    (:func:`~gpattn.metrics.sweep_calibration_error`). ``probabilities`` and ``labels`` are tensors or NumPy arrays,
    checked as every metric checks them; the mean confidence is computed in float64, as the metrics."""
    accuracy, nll = validation_metrics(probabilities, labels)
    # NumPy or torch (or lists), checked as the metrics check them, as float64
    array, _ = _check_inputs(probabilities, labels)
    # the top probabilities averaged in float64 by torch (as before: the float64 values of the input's top
    # probabilities, so the records of earlier runs stay bit-equal, which gpattn report's merge of run folders
    # compares), from the checked array (torch.as_tensor refused a reversed NumPy view, warned on a read-only array,
    # and read a list in float32)
    top = torch.from_numpy(array.max(axis=1))
    return ClassificationMetrics(
        accuracy=accuracy,
        confidence=float(top.mean()),
        nll=nll,
        ece=metrics.expected_calibration_error(probabilities, labels, num_bins),
        mce=metrics.maximum_calibration_error(probabilities, labels, num_bins),
        brier=metrics.brier_score(probabilities, labels),
        aurc=metrics.aurc(probabilities, labels),
        eaurc=metrics.eaurc(probabilities, labels),
        auroc=metrics.misclassification_auroc(probabilities, labels),
        fpr95=metrics.fpr_at_95_tpr(probabilities, labels),
        classwise_ece=metrics.expected_calibration_error(probabilities, labels, num_bins, kind="classwise"),
        debiased_ce=metrics.debiased_calibration_error(probabilities, labels, num_bins),
        sweep_ece=metrics.sweep_calibration_error(probabilities, labels),
    )


def per_example_predictions(probabilities: Tensor, labels: Tensor) -> dict[str, list[float]]:
    """The prediction on every example (:attr:`~gpattn.comparison.RunRecord.per_example`): ``"test_nll"``
    (:math:`-\\log \\max(P_{i y_i}, \\epsilon)`, whose mean is :func:`~gpattn.metrics.negative_log_likelihood`),
    ``"test_correct"`` (1.0 where the first top class is the label) and ``"test_confidence"`` (the top probability),
    one float each per row of ``probabilities`` ``(n, C)``, in order.

    ``probabilities`` and ``labels`` (tensors or NumPy arrays) are checked as every metric checks them (rows summing
    to one, integer labels in ``[0, C)``), so that the values are those whose means are the metrics.
    """
    array, targets = _check_inputs(probabilities, labels)
    true_class = array[np.arange(targets.shape[0]), targets]
    return {
        "test_nll": (-np.log(np.maximum(true_class, NLL_FLOOR))).tolist(),
        "test_correct": (array.argmax(axis=1) == targets).astype(np.float64).tolist(),
        "test_confidence": array.max(axis=1).tolist(),
    }


def _shift_metrics(probabilities: Tensor, labels: Tensor, num_bins: int) -> ShiftMetrics:
    accuracy, nll = validation_metrics(probabilities, labels)
    return ShiftMetrics(
        accuracy=accuracy,
        nll=nll,
        ece=metrics.expected_calibration_error(probabilities, labels, num_bins),
        brier=metrics.brier_score(probabilities, labels),
        debiased_ce=metrics.debiased_calibration_error(probabilities, labels, num_bins),
    )


def _ood_metrics(test_samples: Tensor, ood_samples: Tensor) -> OODMetrics:
    # samples: (S, n, C) probabilities, S = members x Monte Carlo samples; one sample: a deterministic row
    test_probabilities, ood_probabilities = test_samples.mean(dim=0), ood_samples.mean(dim=0)
    stochastic = test_samples.shape[0] > 1
    return OODMetrics(
        auroc_max_prob=metrics.ood_auroc(test_probabilities, ood_probabilities, score="max_prob"),
        auroc_entropy=metrics.ood_auroc(test_probabilities, ood_probabilities, score="entropy"),
        aupr_max_prob=metrics.ood_aupr(test_probabilities, ood_probabilities, score="max_prob"),
        fpr95_max_prob=metrics.ood_fpr_at_95_tpr(test_probabilities, ood_probabilities, score="max_prob"),
        aupr_out_max_prob=metrics.ood_aupr(test_probabilities, ood_probabilities, score="max_prob", positive="out"),
        auroc_mutual_information=(
            metrics.ood_auroc_mutual_information(test_samples, ood_samples) if stochastic else math.nan
        ),
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
    r"""Monte Carlo logits of every member on a data set, by batches: :func:`~gpattn.models.monte_carlo_logits`, or
    for a :class:`~gpattn.models.LastLayerLaplace` member its GLM predictive's samples
    (:meth:`~gpattn.models.LastLayerLaplace.sample_logits`); members in order, each drawing from the global torch RNG
    (the same draws, in the same order, as :func:`~gpattn.training.ensemble_probabilities` for models).

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
    for index, model in enumerate(models):
        if not isinstance(model, torch.nn.Module):
            raise InputTypeError(
                f"ensemble_logits: expected every member to be a torch.nn.Module, got {type(model).__name__} "
                f"{model!r} as member {index}"
            )
    check_int("batch_size", batch_size)
    inputs, mask = dataset_inputs(dataset)
    outputs = []
    for model in models:
        parameter = next(model.parameters(), None)
        device = torch.device("cpu") if parameter is None else parameter.device
        mask_on_device = None if mask is None else mask.to(device)
        if isinstance(model, LastLayerLaplace):
            logits = model.sample_logits(inputs.to(device), mask_on_device, num_samples, batch_size)
        else:
            logits = monte_carlo_logits(model, inputs.to(device), mask_on_device, num_samples, mc_dropout, batch_size)
        outputs.append(logits.cpu().double())
    if len({tuple(logits.shape) for logits in outputs}) != 1:
        raise ValueError(
            f"expected every member to give as many samples, got shapes {[tuple(o.shape) for o in outputs]}"
        )
    return torch.stack(outputs)


def _samples(logits: Tensor, temperature: float = 1.0) -> Tensor:
    # softmax(logits / tau) of every member and sample: (K, T', n, C) -> (K T', n, C)
    return (logits / temperature).softmax(dim=-1).flatten(0, 1)


@dataclass(frozen=True)
class Evaluation:
    """The evaluation of one trained model or ensemble (:func:`evaluate_models`).

    :ivar metrics: Test, shift and OOD metrics.
    :ivar reliability: The test set's reliability bins.
    :ivar ood_scores: Max probabilities of the test (``"in"``) and every OOD input; ``{}`` without OOD sets.
    :ivar per_example: The prediction on every test example (:func:`per_example_predictions`).
    :ivar temperature_scaled: The same predictions temperature-scaled (temperature fitted on the validation split),
        or ``None``.
    """

    metrics: RunMetrics
    reliability: ReliabilityBins
    ood_scores: dict[str, list[float]]
    per_example: dict[str, list[float]]
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
) -> tuple[RunMetrics, ReliabilityBins, dict[str, list[float]], dict[str, list[float]]]:
    test_samples = _samples(logits["test"], temperature)
    test_probabilities = test_samples.mean(dim=0)
    shift: dict[str, dict[str, ShiftMetrics]] = {}
    for (kind, severity), dataset in data.shifted.items():
        probabilities = _samples(logits[f"shift/{kind}/{severity}"], temperature).mean(dim=0)
        shift.setdefault(kind, {})[str(severity)] = _shift_metrics(probabilities, dataset.labels, num_bins)
    ood, ood_scores = {}, {}
    ood_samples = {name: _samples(logits[f"ood/{name}"], temperature) for name in data.ood}
    if ood_samples:
        ood_samples[POOLED_OOD] = torch.cat(list(ood_samples.values()), dim=1)
        ood_scores["in"] = test_probabilities.max(dim=-1).values.tolist()
    for name, samples in ood_samples.items():
        if name != POOLED_OOD:
            ood_scores[name] = samples.mean(dim=0).max(dim=-1).values.tolist()
        ood[name] = _ood_metrics(test_samples, samples)
    test = classification_metrics(test_probabilities, data.test.labels, num_bins)
    bins = _bins(test_probabilities, data.test.labels, num_bins)
    per_example = per_example_predictions(test_probabilities, data.test.labels)
    return RunMetrics(test=test, shift=shift, ood=ood), bins, ood_scores, per_example


def _check_classes(classes: int, data: TaskData) -> None:
    # a model built for another task: say so in its terms, before the metrics' own label check (the sets evaluated)
    high = max(int(dataset_labels(dataset).max()) for dataset in [data.test, data.val, *data.shifted.values()])
    if high >= classes:
        task = max(high + 1, getattr(data.train, "num_classes", 0))
        raise ValueError(
            f"evaluate_models: the model's logits have {classes} classes, but the {data.name} task's labels are in "
            f"[0, {task}) ({task} classes): build the model with num_classes={task}"
        )


def evaluate_models(
    models: torch.nn.Module | Sequence[torch.nn.Module],
    data: TaskData,
    num_samples: int,
    *,
    num_bins: int = DEFAULT_ECE_BINS,
    mc_dropout: bool = False,
    temperature_scaling: bool = True,
    seed: int = 0,
) -> Evaluation:
    r"""Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged), on a task's test, shifted and OOD sets (each OOD set, and all of them pooled as
    :data:`POOLED_OOD`), and of its temperature-scaled variant.

    Every set is predicted once, as Monte Carlo logits :math:`f^{(k,t)}(x)` of member :math:`k` and sample
    :math:`t` (:func:`ensemble_logits`), drawn from a random stream of its own seeded from ``seed`` and the set's name
    (:func:`~gpattn.comparison.random_stream`); the reported prediction is
    :math:`\frac{1}{KT} \sum_{k,t} \operatorname{softmax}(f^{(k,t)}(x) / \tau)` with :math:`\tau = 1` for the
    model as trained and, for the ``+ts`` variant, :math:`\hat\tau` fitted by
    :func:`~gpattn.models.fit_temperature` on the *validation* split's logits of the same kind (the same :math:`T`,
    the same MC dropout, the validation split's own stream). The test labels are never read before the metrics, and
    no other set's draws come before the validation split's: the temperature depends on the validation split and
    ``seed`` only. OOD inputs are scored by the maximum probability and, where a run has more than one sample per
    input (:math:`KT > 1`), by the mutual information of its samples
    (:func:`~gpattn.metrics.ood_auroc_mutual_information`; NaN for one sample). Post-hoc: no retraining, one extra
    pass over the validation split.

    :param models: The model or the members.
    :param data: The task.
    :param num_samples: Monte Carlo samples :math:`T` per prediction.
    :param num_bins: Bins of the ECE/MCE (top-label and classwise), of the reliability diagram, and equal-mass bins of
        the debiased calibration error.
    :param mc_dropout: Dropout on at test time (MC dropout; the models must have dropout).
    :param temperature_scaling: Also fit and evaluate the temperature-scaled variant.
    :param seed: The run's seed, which seeds every set's stream.
    :return: The :class:`Evaluation`.

    .. note:: Cost: :math:`K T` forward passes over every set (and the validation split for the temperature);
        the scaled variant's metrics reuse the same logits. A temperature on the boundary of
        :func:`~gpattn.models.fit_temperature`'s bounds (the validation NLL still falling, e.g. a validation split
        classified perfectly) is kept without its warning: the comparison's ``temperature`` column shows it.
    """
    if isinstance(models, (str, bytes)):  # a sequence of its characters
        raise InputTypeError(f"evaluate_models: expected a model or a list of models, got the string {models!r}")
    members = [models] if isinstance(models, torch.nn.Module) else list(models)
    check_int("num_bins", num_bins, where="evaluate_models")
    sets = {"test": data.test}
    sets.update({f"shift/{kind}/{severity}": dataset for (kind, severity), dataset in data.shifted.items()})
    sets.update({f"ood/{name}": dataset for name, dataset in data.ood.items()})
    logits = {}
    for name, dataset in sets.items():
        with random_stream(seed, name):
            logits[name] = ensemble_logits(members, dataset, num_samples, mc_dropout)
        if name == "test":
            _check_classes(logits[name].shape[-1], data)
    run_metrics, reliability, ood_scores, per_example = _metrics_from_logits(logits, data, 1.0, num_bins)
    scaled = None
    if temperature_scaling:
        with random_stream(seed, "val"):
            val_logits = ensemble_logits(members, data.val, num_samples, mc_dropout)
        with warnings.catch_warnings():  # a boundary temperature is kept and shown in the table's temperature column
            warnings.filterwarnings("ignore", message="fit_temperature: the optimum lies on the boundary")
            temperature = fit_temperature(val_logits.flatten(0, 1), dataset_labels(data.val))
        scaled_metrics, scaled_bins, _, scaled_examples = _metrics_from_logits(logits, data, temperature, num_bins)
        scaled = TemperatureScaled(
            temperature=temperature, metrics=scaled_metrics, reliability=scaled_bins, per_example=scaled_examples
        )
    return Evaluation(run_metrics, reliability, ood_scores, per_example, scaled)


def evaluate_run(
    models: torch.nn.Module | Sequence[torch.nn.Module],
    data: TaskData,
    num_samples: int,
    num_bins: int = DEFAULT_ECE_BINS,
    seed: int = 0,
) -> tuple[RunMetrics, ReliabilityBins, dict[str, list[float]]]:
    """Metrics and figure data of one trained model, or of an ensemble (a list of members: their predictive
    probabilities are averaged), on a task's test, shifted and OOD sets (:func:`evaluate_models` without the
    temperature-scaled variant).

    :param models: The model or the members.
    :param data: The task.
    :param num_samples: Monte Carlo samples :math:`T` per prediction.
    :param num_bins: Bins of the calibration errors and the reliability diagram.
    :param seed: The seed of the sets' random streams.
    :return: The :class:`~gpattn.comparison.RunMetrics`, the test set's reliability bins and the OOD scores (the
        maximum probability of every test (``"in"``) and OOD input; ``{}`` for a task without OOD sets).
    """
    evaluation = evaluate_models(models, data, num_samples, num_bins=num_bins, temperature_scaling=False, seed=seed)
    return evaluation.metrics, evaluation.reliability, evaluation.ood_scores
