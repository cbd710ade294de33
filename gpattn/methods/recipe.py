"""How a comparison row is trained beyond the settings every row shares (:class:`TrainingRecipe`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_float, check_int

__all__ = ["TrainingRecipe"]


@dataclass(frozen=True)
class TrainingRecipe:
    r"""The training recipe of a row: what its paper's training does differently from the shared loop.

    :ivar kl_anneal_fraction: The fraction :math:`a \in [0, 1]` of a run over which the KL weight rises linearly to
        :math:`\beta` (:attr:`~gpattn.training.TrainConfig.kl_anneal_epochs` = :math:`a` times the run's epochs); 0
        (default) for a constant weight. SGPA's official recipe anneals over the first half (0.5).

    Example:
        >>> TrainingRecipe(kl_anneal_fraction=0.5).kl_anneal_epochs(20)
        10.0
    """

    kl_anneal_fraction: float = 0.0

    def __post_init__(self) -> None:
        # stored as a Python float (a NumPy number or a tensor would hash and serialise otherwise)
        fraction = check_float("kl_anneal_fraction", self.kl_anneal_fraction, 0.0, 1.0, where="TrainingRecipe")
        object.__setattr__(self, "kl_anneal_fraction", fraction)

    def kl_anneal_epochs(self, epochs: int) -> float:
        """The KL annealing length in epochs of a run of ``epochs`` epochs.

        :raises InputTypeError: ``epochs`` is not an integer.
        :raises ValueError: ``epochs`` is negative.
        """
        return self.kl_anneal_fraction * check_int("epochs", epochs, minimum=0, where="TrainingRecipe.kl_anneal_epochs")
