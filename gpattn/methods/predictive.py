"""How a trained row predicts (:class:`Predictive`): the post-hoc part of a comparison row."""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_choice, check_int

__all__ = ["PREDICTIVE_KINDS", "Predictive"]

#: How one trained member predicts: ``"samples"``, the model's own Monte Carlo samples (one pass for a deterministic
#: model); ``"mc_dropout"``, the model trained with dropout and evaluated with dropout on (Gal & Ghahramani 2016);
#: ``"laplace"``, a last-layer Laplace approximation fitted on the training split after training, predicting with
#: Monte Carlo samples of its GLM predictive's logits (:class:`~gpattn.models.LastLayerLaplace`). A further post-hoc
#: kind is one more entry here and one more branch where a run evaluates its trained models
#: (:func:`~gpattn.comparison.train_and_evaluate`).
PREDICTIVE_KINDS = ("samples", "mc_dropout", "laplace")


@dataclass(frozen=True)
class Predictive:
    """How a row predicts: the kind of each member's predictive, and how many independently trained members are
    averaged.

    :ivar kind: One of :data:`PREDICTIVE_KINDS`.
    :ivar members: Members :math:`K` whose predictive probabilities are averaged (Deep Ensembles: 5); member
        :math:`k` of seed :math:`s` is trained with the seed :func:`~gpattn.training.member_seed` ``(s, k, K)``.

    Example:
        >>> Predictive("mc_dropout").mc_dropout, Predictive(members=5).members, Predictive("laplace").laplace
        (True, 5, True)
    """

    kind: str = "samples"
    members: int = 1

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, PREDICTIVE_KINDS, where="Predictive")
        # stored as a Python int (a NumPy integer would reach the records' JSON, which refuses it)
        object.__setattr__(self, "members", check_int("members", self.members, where="Predictive"))

    @property
    def mc_dropout(self) -> bool:
        """Whether each member is trained with dropout and predicts with dropout on."""
        return self.kind == "mc_dropout"

    @property
    def laplace(self) -> bool:
        """Whether each trained member predicts through a last-layer Laplace approximation fitted after training."""
        return self.kind == "laplace"
