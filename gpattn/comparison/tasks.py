"""The tasks of ``gpattn compare``: their data splits (the validation split drawn with the run's seed; the test,
shifted and OOD sets fixed), and the Transformer input and hyperparameters they need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple

from torch import Tensor

from ..data import load_digits_splits, make_noise_ood, make_pointer_task, make_shifted_test_sets
from ..data.mnist1d import (
    load_mnist1d,
    make_mnist1d_noise_ood,
    make_mnist1d_shifted_test_sets,
    make_mnist1d_shuffled_test_set,
    mnist1d_noise_families,
)
from ..validation import check_choice, check_int, check_seed

__all__ = ["DEFAULT_TASKS", "PUBLISHED_ACCURACIES", "TASKS", "TASK_DEFAULTS", "TaskData", "load_task"]

#: The task names, in the order of the comparison's tables.
TASKS = ("pointer", "digits", "mnist1d")
#: The tasks of the main job (``gpattn compare`` without ``--tasks``): the pointer task, which every attention solves,
#: only runs in ``--quick`` and the tests.
DEFAULT_TASKS = ("mnist1d", "digits")
#: Task -> the hyperparameters it fixes beyond the settings every task shares (:attr:`TaskData.defaults`). MNIST-1D:
#: the base model's dropout 0.1 for every row, and an inducing set of 5 (the KSVD rank :math:`s` well below the 20
#: tokens of the convolutional stem); the rest of its base model (width 32, depth 2, 2 heads, learning rate 3e-3,
#: weight decay 0.01, batch 64, 60 epochs) are the defaults of :class:`~gpattn.comparison.CompareConfig`.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {"pointer": {}, "digits": {}, "mnist1d": {"dropout": 0.1, "num_inducing": 5}}
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
    :ivar val: Validation set (model selection, the temperature of the ``+ts`` rows).
    :ivar test: Test set.
    :ivar model_kwargs: Input arguments of :class:`~gpattn.models.Transformer` for this data.
    :ivar shifted: ``(kind, severity)`` -> shifted test set; ``{}`` for none.
    :ivar ood: OOD set name -> data set, one per family of OOD inputs (the evaluation adds them pooled); ``{}`` for
        none.
    :ivar defaults: The task's own values of some :class:`~gpattn.methods.Hyperparameters` (name -> value,
        :data:`TASK_DEFAULTS`), which
        :meth:`~gpattn.comparison.CompareConfig.hyperparameters` uses where its settings leave them open
        (``num_inducing``: the inducing set size where ``CompareConfig.num_inducing`` is ``None``; ``dropout``: the
        model's dropout for the rows that do not predict with dropout); ``{}``: the shared settings, no dropout, each
        layer's own inducing set size.
    :ivar seed: The seed of the validation split (the training split is the rest of the training data).
    """

    name: str
    train: Any
    val: Any
    test: Any
    model_kwargs: dict[str, Any]
    shifted: dict[tuple[str, int], Any] = field(default_factory=dict)
    ood: dict[str, Any] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def num_classes(self) -> int:
        """Number of classes of the training set."""
        return self.train.num_classes

    @property
    def num_inducing(self) -> int | None:
        """The task's inducing set size (``defaults["num_inducing"]``), or ``None`` for each layer's own."""
        return self.defaults.get("num_inducing")


def load_task(task: str, seed: int = 0, test_size: int | None = None) -> TaskData:
    r"""The data of a comparison task for a run with ``seed``: the validation split is drawn with ``seed``, the test,
    shifted and OOD sets are the same for every seed (built once per process and cached, so that loading the task for
    another seed costs only its training and validation splits).

    * ``"pointer"``: 2048/256/512 directed pointer sequences of length 8 (4 to 8 real tokens, vocabulary 8), all
      splits fixed (a toy task: ``seed`` is not used).
    * ``"digits"``: scikit-learn's 8x8 digits as 2x2 patches (digits 8 and 9 held out): the test split of
      :func:`~gpattn.data.load_digits_splits` with seed 0, the validation split drawn from the other images with
      ``val_seed=seed``; the noise, rotation and blur shifts at severities 1-5 and two OOD sets, the held-out
      digits and structured noise images.
    * ``"mnist1d"``: MNIST-1D (:func:`~gpattn.data.load_mnist1d`), the standard split of all ten digits (3601
      training and 399 validation sequences carved from the standard 4000 with ``seed``, stratified by class; the
      standard 1000 test sequences), as signals of 40 values for the convolutional stem of
      :class:`~gpattn.models.Transformer` (``input="signal"``, ``input_dim=1``, ``max_len=40``: 20 tokens).
      Shifts: the test split regenerated with ``iid_noise``, ``correlated_noise``, ``shear``, ``translation`` and
      ``scale`` raised, severities 1-5 (:func:`~gpattn.data.make_mnist1d_shifted_test_sets`, seed 0), and the
      spatially shuffled test split as kind ``"shuffled"`` at severity 1. OOD: 1000 sequences without a digit
      (:func:`~gpattn.data.make_mnist1d_noise_ood`, seed 1), one set per family
      (:func:`~gpattn.data.mnist1d.mnist1d_noise_families`: ``background``, ``random_template``,
      ``smooth_noise``). No class is held out, so that the test accuracy is the one the published numbers
      (:data:`PUBLISHED_ACCURACIES`) report; the random templates are the unseen shapes of this task. Defaults
      (:data:`TASK_DEFAULTS`): dropout 0.1, inducing set size 5.

    :param task: One of :data:`TASKS`.
    :param seed: The run's seed, which draws the validation split (digits, MNIST-1D).
    :param test_size: Keep only the first ``test_size`` test sequences, and as many of every shifted set and of the
        noise OOD inputs (MNIST-1D: the shifts are then generated for those only, which makes loading that much
        faster); ``None`` (default): all. For quick looks and smoke tests; the comparison uses all.
    :return: The :class:`TaskData`.
    """
    check_choice("task", task, TASKS)
    seed = check_seed("seed", seed, where="load_task")  # a Python int (TaskData.seed reaches the records)
    if test_size is not None:
        test_size = check_int("test_size", test_size, where="load_task")
    fixed = _fixed_sets(task, test_size)
    shared = {
        "shifted": dict(fixed.shifted),
        "ood": dict(fixed.ood),
        "defaults": dict(TASK_DEFAULTS[task]),
        "seed": seed,
    }
    if task == "pointer":
        splits = make_pointer_task(2048, 256, 512, length=8, seed=0, vocab_size=8, min_length=4)
        model_kwargs = {"input": "tokens", "vocab_size": splits.train.vocab_size, "max_len": 8}
        return TaskData(task, splits.train, splits.val, fixed.test, model_kwargs, **shared)
    if task == "mnist1d":
        splits = load_mnist1d(seed=seed, val_fraction=0.1, patch_size=1)
        model_kwargs = {"input": "signal", "input_dim": 1, "max_len": splits.train.tokens.shape[1]}
        return TaskData(task, splits.train, splits.val, fixed.test, model_kwargs, **shared)
    splits = load_digits_splits(seed=0, val_seed=seed)
    model_kwargs = {"input": "patches", "image_size": 8, "patch_size": 2, "in_channels": 1}
    return TaskData(task, splits.train, splits.val, fixed.test, model_kwargs, **shared)


class _FixedSets(NamedTuple):
    test: Any
    shifted: dict[tuple[str, int], Any]
    ood: dict[str, Any]


@cache
def _fixed_sets(task: str, test_size: int | None) -> _FixedSets:
    """The test, shifted and OOD sets of a task, which no seed changes (cached per process: MNIST-1D's 25 shifted test
    sets take seconds to generate)."""
    if task == "pointer":
        test = make_pointer_task(2048, 256, 512, length=8, seed=0, vocab_size=8, min_length=4).test
        return _FixedSets(test if test_size is None else _head(test, test_size), {}, {})
    if task == "mnist1d":
        return _mnist1d_sets(test_size)
    splits = load_digits_splits(seed=0)
    fixed = _FixedSets(
        splits.test,
        make_shifted_test_sets(splits.test, seed=0),
        {"held_out": splits.ood_classes, "noise": make_noise_ood(len(splits.test), seed=0)},
    )
    if test_size is None:
        return fixed
    return _FixedSets(
        _head(fixed.test, test_size),
        {key: _head(dataset, test_size) for key, dataset in fixed.shifted.items()},
        {name: _head(dataset, test_size) for name, dataset in fixed.ood.items()},
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


def _mnist1d_sets(test_size: int | None) -> _FixedSets:
    splits = load_mnist1d(seed=0, val_fraction=0.1, patch_size=1)  # the test split does not depend on the seed
    shuffled = make_mnist1d_shuffled_test_set(splits)
    if test_size is not None:
        splits = dataclasses.replace(splits, test=_head(splits.test, test_size))
        shuffled = _head(shuffled, test_size)
    shifted = dict(make_mnist1d_shifted_test_sets(splits, seed=0))
    shifted[("shuffled", 1)] = shuffled
    noise = make_mnist1d_noise_ood(len(splits.test), seed=1, patch_size=1, dtype=splits.test.tokens.dtype)
    return _FixedSets(splits.test, shifted, mnist1d_noise_families(noise))
