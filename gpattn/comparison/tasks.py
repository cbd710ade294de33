"""The tasks of ``gpattn compare``: their data splits (fixed seeds), shifted and OOD sets, and the Transformer input
they need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..data import load_digits_splits, make_noise_ood, make_pointer_task, make_shifted_test_sets
from ..data.mnist1d import (
    load_mnist1d,
    make_mnist1d_noise_ood,
    make_mnist1d_shifted_test_sets,
    make_mnist1d_shuffled_test_set,
)
from ..validation import check_choice, check_int

__all__ = ["DEFAULT_TASKS", "MNIST1D_PATCH_SIZE", "PUBLISHED_ACCURACIES", "TASKS", "TaskData", "load_task"]

#: The task names, in the order of the comparison's tables.
TASKS = ("pointer", "digits", "mnist1d")
#: The tasks of the main job (``gpattn compare`` without ``--tasks``): the pointer task, which every attention solves,
#: only runs in ``--quick`` and the tests.
DEFAULT_TASKS = ("mnist1d", "digits")
#: Values per MNIST-1D token: 40 / 4 = 10 tokens of width 4.
MNIST1D_PATCH_SIZE = 4
#: Published test accuracies of other models on a task, printed beside the comparison's own (never measured here):
#: MNIST-1D's README (github.com/greydanus/mnist1d, Greydanus 2020, arXiv 2011.14439), the standard 4000 / 1000
#: split of all ten classes.
PUBLISHED_ACCURACIES: dict[str, dict[str, float]] = {
    "mnist1d": {
        "logistic regression": 0.32,
        "MLP": 0.68,
        "CNN": 0.94,
        "GRU": 0.91,
        "human": 0.96,
    }
}


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
    :ivar num_inducing: The task's inducing set size (KSVD rank :math:`s`, SGPA/SVGP inducing points) where
        ``CompareConfig.num_inducing`` is ``None``; ``None``: each layer's own default.
    """

    name: str
    train: Any
    val: Any
    test: Any
    model_kwargs: dict[str, Any]
    shifted: dict[tuple[str, int], Any] = field(default_factory=dict)
    ood: dict[str, Any] = field(default_factory=dict)
    num_inducing: int | None = None

    @property
    def num_classes(self) -> int:
        """Number of classes of the training set."""
        return self.train.num_classes


def load_task(task: str, test_size: int | None = None) -> TaskData:
    r"""The data of a comparison task (deterministic: the splits, shifts and noise images have fixed seeds).

    * ``"pointer"``: 2048/256/512 directed pointer sequences of length 8 (4 to 8 real tokens, vocabulary 8).
    * ``"digits"``: scikit-learn's 8x8 digits as 2x2 patches (digits 8 and 9 held out), with the noise, rotation
      and blur shifts at severities 1-5 and two OOD sets: the held-out digits and structured noise images.
    * ``"mnist1d"``: MNIST-1D (:func:`~gpattn.data.load_mnist1d`), the standard split of all ten digits (3600
      training sequences, 400 validation sequences carved from the standard 4000 with seed 0, the standard 1000
      test sequences), as 10 tokens of 4 consecutive values. Shifts: the test split regenerated with
      ``iid_noise``, ``correlated_noise``, ``shear``, ``translation`` and ``scale`` raised, severities 1-5
      (:func:`~gpattn.data.make_mnist1d_shifted_test_sets`, seed 0), and the spatially shuffled test split as kind
      ``"shuffled"`` at severity 1. OOD: 1000 sequences without a digit (:func:`~gpattn.data.make_mnist1d_noise_ood`,
      seed 1: flat templates, random templates and smooth noise). No class is held out, so that the test accuracy
      is the one the published numbers (:data:`PUBLISHED_ACCURACIES`) report; the random templates are the unseen
      shapes of this task. Inducing set size 5 (``num_inducing``): with the layers' default
      :math:`s = \min(10, p) = 10` the KSVD rank would equal the 10 tokens, a full-rank decomposition whose
      subspaces are trivially exact.

    :param task: One of :data:`TASKS`.
    :param test_size: Keep only the first ``test_size`` test sequences, and as many of every shifted and OOD set
        (MNIST-1D: the shifts are then generated for those only, which makes loading that much faster); ``None``
        (default): all. For quick looks and smoke tests; the comparison uses all.
    :return: The :class:`TaskData`.
    """
    check_choice("task", task, TASKS)
    if test_size is not None:
        check_int("test_size", test_size, where="load_task")
        if task == "mnist1d":
            return _load_mnist1d(test_size)
        full = load_task(task)
        return dataclasses.replace(
            full,
            test=_head(full.test, test_size),
            shifted={key: _head(dataset, test_size) for key, dataset in full.shifted.items()},
            ood={name: _head(dataset, test_size) for name, dataset in full.ood.items()},
        )
    if task == "pointer":
        splits = make_pointer_task(2048, 256, 512, length=8, seed=0, vocab_size=8, min_length=4)
        model_kwargs = {"input": "tokens", "vocab_size": splits.train.vocab_size, "max_len": 8}
        return TaskData(task, splits.train, splits.val, splits.test, model_kwargs)
    if task == "mnist1d":
        return _load_mnist1d()
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


def _head(dataset: Any, size: int) -> Any:
    """The first ``size`` items of a data set dataclass (every tensor field with one row per item is cut)."""
    count = len(dataset)
    changes = {
        entry.name: value[:size]
        for entry in dataclasses.fields(dataset)
        if isinstance(value := getattr(dataset, entry.name), Tensor) and value.dim() > 0 and value.shape[0] == count
    }
    return dataclasses.replace(dataset, **changes)


def _load_mnist1d(test_size: int | None = None) -> TaskData:
    splits = load_mnist1d(seed=0, val_fraction=0.1, patch_size=MNIST1D_PATCH_SIZE)
    shuffled = make_mnist1d_shuffled_test_set(splits)
    if test_size is not None:
        splits = dataclasses.replace(splits, test=_head(splits.test, test_size))
        shuffled = _head(shuffled, test_size)
    tokens = splits.train.tokens
    model_kwargs = {"input": "vectors", "input_dim": tokens.shape[-1], "max_len": tokens.shape[-2]}
    shifted = dict(make_mnist1d_shifted_test_sets(splits, seed=0))
    shifted[("shuffled", 1)] = shuffled
    noise = make_mnist1d_noise_ood(len(splits.test), seed=1, patch_size=MNIST1D_PATCH_SIZE, dtype=tokens.dtype)
    ood = {"noise": noise}
    return TaskData(
        "mnist1d", splits.train, splits.val, splits.test, model_kwargs, shifted=shifted, ood=ood, num_inducing=5
    )
