"""The settings of ``gpattn tune`` (:class:`TuneConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..methods import Hyperparameters, MethodSpec, get_method, method_names
from ..training.config import DEVICE_TYPES
from ..validation import InputTypeError, check_choice, check_device, check_int
from .config import CompareConfig, _names
from .tasks import DEFAULT_TASKS, TASKS
from .tuning_space import MAX_EPOCHS, PATIENCE, TUNED_ROWS, TUNING_SEED, hyperparameter_values

__all__ = ["DEFAULT_TRIALS", "EVALUATION_SEEDS", "TuneConfig"]

#: Trials per (task, row) study: the same for every row (``gpattn tune --trials``).
DEFAULT_TRIALS = 20
#: The evaluation seeds of the comparison, which the tuning seed must not be.
EVALUATION_SEEDS = range(10)
#: The member seeds of their ensembles of up to 5 members (:func:`~gpattn.training.member_seed`: seed * 5 + member),
#: which the tuning seed must not be either.
MEMBER_SEEDS = range(EVALUATION_SEEDS.stop * 5)


@dataclass
class TuneConfig:
    """Settings of :func:`~gpattn.comparison.tuning.tune`: one Optuna study per (task, row), the same number of
    trials for every row, each trial trained with the tuning seed on the task's training split and scored by its best
    validation NLL. The settings every row shares (batch size, GP blocks, inducing set size) are
    :class:`~gpattn.comparison.CompareConfig`'s (:meth:`compare_config`).

    :ivar tasks: Tasks (:data:`~gpattn.comparison.tasks.TASKS`); default MNIST-1D and digits.
    :ivar rows: Rows to tune (:func:`~gpattn.methods.method_names`, single models only: an ensemble row, or the
        Laplace row, uses its attention row's configuration); default :data:`~gpattn.comparison.TUNED_ROWS`.
    :ivar trials: Finished trials per study (:data:`DEFAULT_TRIALS`).
    :ivar seed: The tuning seed (model initialisation, batch order, noise of every trial; Optuna's sampler seeds
        derive from it): not an evaluation seed (0-9).
    :ivar pointer_epochs: Most epochs of a trial on the pointer task.
    :ivar digits_epochs: Most epochs of a trial on digits.
    :ivar mnist1d_epochs: Most epochs of a trial on MNIST-1D.
    :ivar patience: Early stopping: a trial stops after this many epochs without a lower validation NLL.
    :ivar eval_samples: Monte Carlo samples of the validation predictions.
    :ivar device: ``"cpu"`` or ``"cuda"``.
    :ivar threads: Torch threads per trial worker.
    :ivar jobs: Trial workers (processes) sharing the studies.
    :ivar progress: One line per finished trial on standard error, and a live bar on a terminal.
    :ivar label: A note stored with the tuned configurations (e.g. ``"smoke run, 2 trials"``).
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    rows: tuple[str, ...] = TUNED_ROWS
    trials: int = DEFAULT_TRIALS
    seed: int = TUNING_SEED
    pointer_epochs: int = MAX_EPOCHS["pointer"]
    digits_epochs: int = MAX_EPOCHS["digits"]
    mnist1d_epochs: int = MAX_EPOCHS["mnist1d"]
    patience: int = PATIENCE
    eval_samples: int = 10
    device: str = "cpu"
    threads: int = 1
    jobs: int = 1
    progress: bool = True
    label: str = ""

    def __post_init__(self) -> None:
        where = "TuneConfig"
        self.tasks, self.rows = _names("tasks", self.tasks, where), _names("rows", self.rows, where)
        for label, values, choices in (("tasks", self.tasks, TASKS), ("rows", self.rows, method_names())):
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{where}: expected distinct {label} among {list(choices)}, got {list(values)}")
            for value in values:
                check_choice(label, value, choices, where=where)
        for row in self.rows:
            method = get_method(row)
            if method.predictive.members > 1 or method.predictive.laplace:
                raise ValueError(
                    f"{where}: the row {row!r} wraps {method.attention!r} models (an ensemble, or a post-hoc "
                    f"predictive) and uses the tuned configuration of the row {method.attention!r}; tune that row "
                    "instead"
                )
        names = ("trials", "pointer_epochs", "digits_epochs", "mnist1d_epochs", "patience", "eval_samples", "threads")
        for name in (*names, "jobs"):  # stored as Python ints: a NumPy integer would reach the studies' JSON settings
            setattr(self, name, check_int(name, getattr(self, name), where=where))
        # the TPE sampler of trial slot k is seeded with seed * 1000 + k, which numpy takes below 2**32
        largest = (2**32 - 1 - self.trials) // 1000
        self.seed = check_int("seed", self.seed, minimum=0, maximum=largest, where=where)
        if self.seed in MEMBER_SEEDS:
            raise ValueError(
                f"{where}: the tuning seed must not be an evaluation seed ({EVALUATION_SEEDS.start}-"
                f"{EVALUATION_SEEDS.stop - 1}) nor a member seed of their ensembles ({MEMBER_SEEDS.start}-"
                f"{MEMBER_SEEDS.stop - 1}), got {self.seed}; the default is {TUNING_SEED}"
            )
        check_device("device", self.device, where=where, types=DEVICE_TYPES)
        if not isinstance(self.progress, bool) or not isinstance(self.label, str):
            raise InputTypeError(
                f"{where}: expected progress to be a bool and label a string, got {self.progress!r}, {self.label!r}"
            )

    def budget(self, task: str) -> dict[str, int]:
        """The tuning budget of every row on ``task``, as :func:`~gpattn.comparison.tuned_configuration.tuning_budget`
        reads it back from a tuned row: ``trials``, ``tuning_seed``, the most ``epochs``, ``patience`` and
        ``eval_samples``."""
        return {
            "trials": self.trials,
            "tuning_seed": self.seed,
            "epochs": self.max_epochs(task),
            "patience": self.patience,
            "eval_samples": self.eval_samples,
        }

    def max_epochs(self, task: str) -> int:
        """The most epochs of a trial on ``task``."""
        check_choice("task", task, TASKS, where="TuneConfig.max_epochs")
        return getattr(self, f"{task}_epochs")

    def compare_config(self) -> CompareConfig:
        """The untuned :class:`~gpattn.comparison.CompareConfig` whose shared settings every trial starts from (its
        tasks, rows, Monte Carlo samples, device and threads are these)."""
        return CompareConfig(
            attentions=self.rows,
            tasks=self.tasks,
            eval_samples=self.eval_samples,
            device=self.device,
            threads=self.threads,
            progress=False,
            fidelity_sequences=0,
            tuned=False,
        )

    def trial_hyperparameters(
        self, task: str, method: MethodSpec, parameters: dict[str, Any], defaults: Mapping[str, Any] | None = None
    ) -> Hyperparameters:
        """The :class:`~gpattn.methods.Hyperparameters` of a trial of ``method`` on ``task``: the shared settings
        (:meth:`compare_config`, with the task's ``defaults``, :attr:`~gpattn.comparison.TaskData.defaults`), this
        config's epochs and patience, and the trial's
        ``parameters`` (:func:`~gpattn.comparison.tuning_space.hyperparameter_values`)."""
        shared = self.compare_config().hyperparameters(task, method, defaults)
        return shared.updated({**self.fixed_hyperparameters(task), **hyperparameter_values(parameters)})

    def fixed_hyperparameters(self, task: str) -> dict[str, int]:
        """The hyperparameters every trial on ``task`` has and a tuned configuration records beside the searched
        ones: ``epochs`` and ``patience``."""
        return {"epochs": self.max_epochs(task), "patience": self.patience}
