"""The data sets the training loop reads: their inputs, masks and labels, and minibatches moved to a device.

A data set is any object with integer class labels ``.labels`` and one tensor of inputs: ``.tokens`` (and ``.mask``,
:class:`~gpattn.data.SequenceDataset`), ``.images`` (:class:`~gpattn.data.ImageDataset`) or a generic ``.inputs``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["batch_to_device", "dataset_inputs", "dataset_labels"]


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


def check_label_range(model: torch.nn.Module, labels: dict[str, Tensor]) -> None:
    """Refuse labels outside ``[0, num_classes - 1]`` of a model that declares its classes (an integer
    ``num_classes`` attribute, as :class:`~gpattn.models.Transformer`), before anything trains: the loss would refuse
    training labels at the first step, the validation metrics validation labels only after the first epoch, and
    neither would name the data set. Models without the attribute are not checked. O(n), on the labels' device.

    :param model: The model to train.
    :param labels: Data set name (as the message names it) -> its labels, shape ``(n,)``.
    :raises ValueError: A label outside the model's classes.
    """
    num_classes = getattr(model, "num_classes", None)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        return
    for name, values in labels.items():
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"train_model: the {name} labels must be class indices in [0, {num_classes - 1}] (the model has "
                f"num_classes = {num_classes}), got values in [{low}, {high}]"
            )
