"""Monte Carlo predictive probabilities of a model or an ensemble on a data set, and the validation metrics the training
loop records and selects on.

One set of metric functions (:mod:`gpattn.metrics`) serves everywhere: the validation NLL that the loop selects on
(:func:`validation_metrics`) is the test NLL that the comparison reports
(:func:`~gpattn.comparison.evaluation.classification_metrics`), :func:`~gpattn.metrics.negative_log_likelihood` with
its floor :math:`\\epsilon = 10^{-12}` on the probability of the true class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import metrics
from ..models import predict_probabilities
from ..validation import check_int
from .batches import batch_to_device, dataset_inputs

__all__ = ["ensemble_probabilities", "evaluate", "validation_metrics"]


def evaluate(
    model: torch.nn.Module, dataset: Any, num_samples: int = 10, batch_size: int = 256, mc_dropout: bool = False
) -> Tensor:
    r"""Monte Carlo predictive probabilities of ``model`` on a data set, by batches of
    :func:`~gpattn.models.predict_probabilities` (eval mode, ``num_samples`` samples, no gradients; the global torch RNG
    drives the samples); with ``mc_dropout`` the MC-dropout predictive :math:`\frac1T \sum_t
    \operatorname{softmax}(f^{(t)}(x))` (dropout masks drawn in every pass, as the MC-dropout row predicts at test
    time).

    :param model: Maps ``(inputs, mask=mask)`` to logits.
    :param dataset: Has ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param num_samples: :math:`T`.
    :param batch_size: Sequences per forward pass.
    :param mc_dropout: Keep dropout on (raises ``ValueError`` for a model without dropout).
    :return: Probabilities, shape ``(n, C)``, on the CPU.
    :raises TypeError: ``model`` is not a ``torch.nn.Module``, or ``dataset`` has no tensor of inputs.
    :raises ValueError: An empty data set.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"evaluate: expected model to be a torch.nn.Module, got {type(model).__name__}")
    check_int("batch_size", batch_size)
    inputs, mask = dataset_inputs(dataset)
    if inputs.shape[0] == 0:  # no batch to predict: torch.cat would fail on the empty list of parts
        raise ValueError(f"evaluate: expected a non-empty data set, got 0 inputs (shape {tuple(inputs.shape)})")
    parameter = next(model.parameters(), None)
    device = torch.device("cpu") if parameter is None else parameter.device
    parts = []
    for start in range(0, inputs.shape[0], batch_size):
        index = torch.arange(start, min(start + batch_size, inputs.shape[0]))
        batch_inputs, batch_mask = batch_to_device(inputs, mask, index, device)
        probabilities = predict_probabilities(model, batch_inputs, batch_mask, num_samples, mc_dropout=mc_dropout)
        parts.append(probabilities.cpu())
    return torch.cat(parts)


def ensemble_probabilities(
    models: Sequence[torch.nn.Module], dataset: Any, num_samples: int = 10, batch_size: int = 256
) -> Tensor:
    """The ensemble's predictive probabilities: the mean over members of :func:`evaluate` (members in order, each
    drawing its Monte Carlo samples from the global torch RNG), shape ``(n, C)``.

    :raises TypeError: ``models`` is a single model, or a member is not a ``torch.nn.Module`` (e.g. the ``(model,
        result)`` pairs that :func:`~gpattn.training.train_ensemble` returns: pass ``[model for model, _ in pairs]``).
    :raises ValueError: No model.
    """
    if isinstance(models, torch.nn.Module) and not isinstance(models, torch.nn.ModuleList):
        raise TypeError(
            f"ensemble_probabilities: expected a list of models, got a single {type(models).__name__}; pass "
            "[model] (or use evaluate)"
        )
    models = list(models)
    if not models:
        raise ValueError("expected at least one model in the ensemble, got none")
    for index, model in enumerate(models):
        if not isinstance(model, torch.nn.Module):
            pairs = " (train_ensemble returns (model, result) pairs: pass [model for model, _ in pairs])"
            raise TypeError(
                f"ensemble_probabilities: expected models[{index}] to be a torch.nn.Module, got "
                f"{type(model).__name__}{pairs if isinstance(model, tuple) else ''}"
            )
    return torch.stack([evaluate(model, dataset, num_samples, batch_size) for model in models]).mean(dim=0)


def validation_metrics(probabilities: Tensor, labels: Tensor) -> tuple[float, float]:
    """Accuracy and NLL of predictive probabilities ``(n, C)`` against labels ``(n,)``: what the training loop records
    every epoch and selects on, the reported :func:`~gpattn.metrics.accuracy` and
    :func:`~gpattn.metrics.negative_log_likelihood`."""
    return metrics.accuracy(probabilities, labels), metrics.negative_log_likelihood(probabilities, labels)
