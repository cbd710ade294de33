"""The data sets the training loop reads: their inputs, masks and labels, and minibatches moved to a device.

A data set is any object with integer class labels ``.labels`` and one tensor of inputs: ``.tokens`` (and ``.mask``,
:class:`~gpattn.data.SequenceDataset`), ``.images`` (:class:`~gpattn.data.ImageDataset`) or a generic ``.inputs``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..validation import all_finite

__all__ = ["batch_to_device", "dataset_inputs", "dataset_labels"]


def _set(name: str | None) -> str:
    # how the messages name the data set: "training set", or "data set" without a name
    return f"{'data' if name is None else name} set"


def dataset_inputs(dataset: Any, name: str | None = None) -> tuple[Tensor, Tensor | None]:
    """``(inputs, mask or None)`` of a data set: ``.tokens`` and ``.mask`` (:class:`~gpattn.data.SequenceDataset`),
    ``.images`` (:class:`~gpattn.data.ImageDataset`, no mask) or a generic ``.inputs`` (and ``.mask`` if present).
    A mask is checked to be a tensor with one row per input (O(1)).

    :param dataset: The data set.
    :param name: What the messages call it (``"training"``: "the training set"), or ``None`` ("the data set").
    :return: The inputs, shape ``(n, ...)``, and the boolean mask ``(n, N)`` or ``None``.
    :raises TypeError: For an object without such a tensor attribute, or a mask that is not a tensor.
    :raises ValueError: A mask with another number of rows than the inputs.
    """
    for attribute in ("tokens", "images", "inputs"):
        inputs = getattr(dataset, attribute, None)
        if isinstance(inputs, Tensor):
            mask = None if attribute == "images" else getattr(dataset, "mask", None)
            if mask is not None and not isinstance(mask, Tensor):
                raise TypeError(
                    f"expected the .mask of the {_set(name)} to be a boolean tensor of shape (n, N) or None, got "
                    f"{type(mask).__name__}"
                )
            if mask is not None and (mask.dim() == 0 or mask.shape[0] != inputs.shape[0]):
                rows = mask.shape[0] if mask.dim() else 0
                raise ValueError(
                    f"expected the .mask of the {_set(name)} to have one row per input, got {rows} rows (shape "
                    f"{tuple(mask.shape)}) for {inputs.shape[0]} inputs (shape {tuple(inputs.shape)}); give the "
                    "mask of these inputs"
                )
            return inputs, mask
    raise TypeError(
        f"expected a {_set(name)} with a tensor attribute .tokens, .images or .inputs (and .labels), "
        f"got {type(dataset).__name__}"
    )


def dataset_labels(dataset: Any, name: str | None = None) -> Tensor:
    """The integer class labels ``.labels`` of a data set, shape ``(n,)``, checked against its inputs
    (:func:`dataset_inputs`) and returned as ``int64``, the dtype the losses index with: the labels themselves when
    they are ``int64``, else a converted copy (exact for every integer dtype; O(n)).

    :param dataset: The data set.
    :param name: What the messages call it (``"validation"``: "the validation set"), or ``None`` ("the data set").
    :raises TypeError: Labels missing, not a vector, or not of an integer dtype (floating point, complex, bool).
    :raises ValueError: An empty data set, or not as many labels as inputs.
    """
    labels = getattr(dataset, "labels", None)
    inputs, _ = dataset_inputs(dataset, name)
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"expected integer class labels .labels of shape (n,) in the {_set(name)}, got {type(labels).__name__}"
        )
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"expected integer class labels .labels of shape (n,) in the {_set(name)}, got a {labels.dtype} tensor of "
            f"shape {tuple(labels.shape)}; give one class index per input"
        )
    if labels.shape[0] == 0:
        raise ValueError(f"expected a non-empty {_set(name)}, got 0 labels for {inputs.shape[0]} inputs")
    if labels.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"expected as many labels as inputs in the {_set(name)}, got {labels.shape[0]} labels for "
            f"{inputs.shape[0]} inputs"
        )
    return labels.to(torch.int64)


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


def check_finite_inputs(inputs: dict[str, Tensor]) -> None:
    """Refuse floating-point inputs holding NaN or Inf before anything trains: the model would refuse a training batch
    only when it comes (a whole epoch in, for the last one) and the validation inputs only after the first epoch had
    trained, and neither would name the data set. Integer inputs (token ids) are not read. One pass over each
    (:func:`~gpattn.validation.all_finite`).

    :param inputs: Data set name (as the message names it) -> its inputs, shape ``(n, ...)``.
    :raises ValueError: Inputs with a NaN or an infinity.
    """
    for name, values in inputs.items():
        if not all_finite(values):
            rows = int((~torch.isfinite(values.reshape(values.shape[0], -1))).any(dim=1).sum())
            raise ValueError(
                f"train_model: the {name} inputs hold NaN or Inf values ({rows} of {values.shape[0]} inputs); clean "
                "or drop them before training"
            )
