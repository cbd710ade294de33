"""The numbers one run of a comparison row reads (:class:`Hyperparameters`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..validation import InputTypeError, check_float, check_int
from .recipe import TrainingRecipe

__all__ = ["Hyperparameters"]


@dataclass(frozen=True)
class Hyperparameters:
    r"""The hyperparameters of one run of a row on a task: every number the run's model and training read.

    ``gpattn compare`` takes them from its settings, the same for every row, and replaces some by the configuration
    tuned for the (task, row) (:meth:`~gpattn.comparison.CompareConfig.hyperparameters`): a tuned configuration
    (``gpattn tune``, :mod:`gpattn.comparison.tuning`) is a mapping of some of these names to values, applied with
    :meth:`updated`, so that the run reads it as data.

    :ivar epochs: Training epochs.
    :ivar lr: Peak AdamW learning rate.
    :ivar weight_decay: AdamW's decoupled weight decay.
    :ivar batch_size: Minibatch size.
    :ivar embed_dim: Transformer width.
    :ivar depth: Encoder blocks.
    :ivar num_heads: Heads per block.
    :ivar gp_layers: Blocks (the last ones) using the row's attention.
    :ivar num_inducing: Inducing set size of the layers that have one (KSVD rank :math:`s`, SGPA's global keys, the
        SVGP's inducing points); ``None``: each layer's own default.
    :ivar beta: KL weight :math:`\beta`.
    :ivar ksvd_weight: :math:`\eta` of the KSVD penalty :math:`\eta J^2` of the KSVD layers.
    :ivar dropout: Dropout rate of the model (on the embeddings, every attention output and the MLPs); the MC-dropout
        rows train and predict with it.
    :ivar patience: Early stopping on the validation NLL after ``patience`` epochs without improvement
        (:attr:`~gpattn.training.TrainConfig.patience`); ``None`` (default): all ``epochs``.
    :ivar kl_anneal_fraction: The fraction of the run's epochs over which the KL weight rises to :math:`\beta`,
        replacing the row's recipe (:attr:`~gpattn.methods.TrainingRecipe.kl_anneal_fraction`); ``None`` (default):
        the recipe's (:meth:`kl_anneal_epochs`).

    Example:
        >>> base = Hyperparameters(epochs=20, lr=3e-3, weight_decay=0.01, batch_size=64, embed_dim=32, depth=2,
        ...                        num_heads=2, gp_layers=1, num_inducing=None, beta=1.0, ksvd_weight=1.0, dropout=0.0)
        >>> base.updated({"lr": 1e-3, "beta": 0.1}).lr
        0.001
    """

    epochs: int
    lr: float
    weight_decay: float
    batch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    gp_layers: int
    num_inducing: int | None
    beta: float
    ksvd_weight: float
    dropout: float
    patience: int | None = None
    kl_anneal_fraction: float | None = None

    def __post_init__(self) -> None:
        # each value is stored as its check returns it (a Python int or float: a NumPy number or a one-element tensor
        # would reach the records' JSON, which refuses them, and a tensor hashes by identity)
        where = "Hyperparameters"

        def store(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("epochs", "batch_size", "embed_dim", "depth", "num_heads"):
            store(name, check_int(name, getattr(self, name), where=where))
        store("gp_layers", check_int("gp_layers", self.gp_layers, 0, self.depth, where=where))
        if self.num_inducing is not None:
            store("num_inducing", check_int("num_inducing", self.num_inducing, where=where))
        if self.embed_dim % self.num_heads:
            raise ValueError(f"{where}: embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})")
        store("lr", check_float("lr", self.lr, 0.0, strict_minimum=True, where=where))
        for name in ("weight_decay", "beta", "ksvd_weight"):
            store(name, check_float(name, getattr(self, name), 0.0, where=where))
        store("dropout", check_float("dropout", self.dropout, 0.0, 1.0, strict_maximum=True, where=where))
        if self.patience is not None:
            store("patience", check_int("patience", self.patience, where=where))
        if self.kl_anneal_fraction is not None:
            store(
                "kl_anneal_fraction",
                check_float("kl_anneal_fraction", self.kl_anneal_fraction, 0.0, 1.0, where=where),
            )

    def updated(self, values: Mapping[str, Any]) -> Hyperparameters:
        """These hyperparameters with ``values`` (name -> value, e.g. a tuned configuration) replacing some.

        :raises InputTypeError: ``values`` is not a mapping with string keys.
        :raises ValueError: A name that is not a hyperparameter, or a value out of its range.
        """
        if not isinstance(values, Mapping) or not all(isinstance(name, str) for name in values):
            raise InputTypeError(
                f"Hyperparameters: expected values to map hyperparameter names (strings) to values, got {values!r}"
            )
        names = [entry.name for entry in dataclasses.fields(self)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"Hyperparameters: unknown names {unknown}; expected some of {names}")
        return dataclasses.replace(self, **values)

    def kl_anneal_epochs(self, recipe: TrainingRecipe) -> float:
        """The KL annealing length in epochs of a run with these hyperparameters and the row's ``recipe``: the
        fraction :attr:`kl_anneal_fraction` (or the recipe's, when ``None``) times :attr:`epochs`.

        Example:
            >>> base = Hyperparameters(epochs=60, lr=3e-3, weight_decay=0.01, batch_size=64, embed_dim=32, depth=2,
            ...                        num_heads=2, gp_layers=1, num_inducing=None, beta=1.0, ksvd_weight=1.0,
            ...                        dropout=0.0)
            >>> base.kl_anneal_epochs(TrainingRecipe(0.5)), base.updated({"kl_anneal_fraction": 0.25}).kl_anneal_epochs(
            ...     TrainingRecipe(0.5))
            (30.0, 15.0)

        :raises InputTypeError: ``recipe`` is not a :class:`~gpattn.methods.TrainingRecipe`.
        """
        if not isinstance(recipe, TrainingRecipe):
            raise InputTypeError(f"Hyperparameters: expected recipe to be a TrainingRecipe, got {recipe!r}")
        if self.kl_anneal_fraction is None:
            return recipe.kl_anneal_epochs(self.epochs)
        return TrainingRecipe(self.kl_anneal_fraction).kl_anneal_epochs(self.epochs)

    def to_dict(self) -> dict[str, Any]:
        """The values by name (plain numbers, as a tuned configuration file holds them)."""
        return dataclasses.asdict(self)
