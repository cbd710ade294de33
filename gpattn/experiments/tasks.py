"""The tasks of ``gpattn compare``: their data splits (fixed seeds), shifted and OOD sets, and the Transformer input
they need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..data import load_digits_splits, make_noise_ood, make_pointer_task, make_shifted_test_sets
from ..validation import check_choice

__all__ = ["TASKS", "TaskData", "load_task"]

#: The task names, in the order of the comparison's tables.
TASKS = ("pointer", "digits")


@dataclass(frozen=True)
class TaskData:
    """Everything one task gives a run.

    :ivar name: The task name (one of :data:`TASKS`).
    :ivar train: Training set (``.labels`` and ``.tokens``/``.mask`` or ``.images``).
    :ivar val: Validation set (model selection).
    :ivar test: Test set.
    :ivar model_kwargs: Input arguments of :class:`~gpattn.models.Transformer` for this data.
    :ivar shifted: ``(kind, severity)`` -> shifted test set; ``{}`` for none.
    :ivar ood: OOD set name -> data set; ``{}`` for none.
    """

    name: str
    train: Any
    val: Any
    test: Any
    model_kwargs: dict[str, Any]
    shifted: dict[tuple[str, int], Any] = field(default_factory=dict)
    ood: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        """Number of classes of the training set."""
        return self.train.num_classes


def load_task(task: str) -> TaskData:
    """The data of a comparison task (deterministic: the splits, shifts and noise images have fixed seeds).

    * ``"pointer"``: 2048/256/512 directed pointer sequences of length 8 (4 to 8 real tokens, vocabulary 8).
    * ``"digits"``: scikit-learn's 8x8 digits as 2x2 patches (digits 8 and 9 held out), with the noise, rotation
      and blur shifts at severities 1-5 and two OOD sets: the held-out digits and structured noise images.

    :param task: One of :data:`TASKS`.
    :return: The :class:`TaskData`.
    """
    check_choice("task", task, TASKS)
    if task == "pointer":
        splits = make_pointer_task(2048, 256, 512, length=8, seed=0, vocab_size=8, min_length=4)
        model_kwargs = {"input": "tokens", "vocab_size": splits.train.vocab_size, "max_len": 8}
        return TaskData(task, splits.train, splits.val, splits.test, model_kwargs)
    splits = load_digits_splits(seed=0)
    model_kwargs = {"input": "patches", "image_size": 8, "patch_size": 2, "in_channels": 1}
    return TaskData(
        task,
        splits.train,
        splits.val,
        splits.test,
        model_kwargs,
        shifted=make_shifted_test_sets(splits.test, seed=0),
        ood={"held_out": splits.ood_classes, "noise": make_noise_ood(len(splits.test), seed=0)},
    )
