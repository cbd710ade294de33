"""The KSVD penalty as a GPyTorch added loss term."""

from __future__ import annotations

from gpytorch.mlls import AddedLossTerm
from torch import Tensor


class KSVDAddedLossTerm(AddedLossTerm):
    r"""The penalty :math:`\eta J^2` that drives learned KSVD scores to a stationary point (MATH.md section 2).

    GPyTorch's marginal log likelihoods subtract every registered added loss term, so a model whose
    :class:`~gpattn.features.KernelEigenFeatures` are in ``primal`` mode is penalised by :math:`\eta J^2`
    without further code. Batched objectives are summed.

    :param objective: :math:`J`, shape ``(*batch)``.
    :param weight: :math:`\eta \geq 0`.
    """

    def __init__(self, objective: Tensor, weight: float = 1.0):
        if weight < 0:
            raise ValueError(f"expected a non-negative KSVD weight eta, got {weight}")
        self.objective = objective
        self.weight = float(weight)

    def loss(self) -> Tensor:
        """:return: :math:`\\eta \\sum_{batch} J^2`, a scalar."""
        return self.weight * self.objective.pow(2).sum()
