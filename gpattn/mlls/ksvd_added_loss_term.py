"""The KSVD penalty as a GPyTorch added loss term."""

from __future__ import annotations

import math

from gpytorch.mlls import AddedLossTerm
from torch import Tensor

from ..validation import check_float, check_int, check_tensor


class KSVDAddedLossTerm(AddedLossTerm):
    r"""The penalty :math:`\eta J^2` that drives learned KSVD scores to a stationary point (docs/math.md section 2).

    GPyTorch's marginal log likelihoods subtract every registered added loss term, so a model whose
    :class:`~gpattn.features.KernelEigenFeatures` are in ``primal`` mode is penalised by :math:`\eta J^2`
    without further code. Batched objectives are summed.

    :param objective: :math:`J`, shape ``(*batch)``.
    :param weight: :math:`\eta \geq 0`.
    :param num_averaged_dims: The first dimensions of ``objective`` index data (e.g. the sequences of a minibatch):
        :math:`J^2` is averaged over them and summed over the rest (e.g. heads), matching a mean data term.
    """

    def __init__(self, objective: Tensor, weight: float = 1.0, num_averaged_dims: int = 0):
        # O(1): built on every training forward pass of the KSVD layers
        check_float("the KSVD weight eta", weight, 0.0, where="KSVDAddedLossTerm")
        check_tensor("objective", objective, where="KSVDAddedLossTerm")
        check_int("num_averaged_dims", num_averaged_dims, 0, objective.dim(), where="KSVDAddedLossTerm")
        self.objective = objective
        self.weight = float(weight)
        self.num_averaged_dims = num_averaged_dims

    def loss(self) -> Tensor:
        """The penalty, averaged over the data dimensions and summed over the others.

        :return: :math:`\\eta\\, \\mathrm{mean}_{data} \\sum_{rest} J^2`, a scalar.
        """
        # the mean over the data dimensions as one division of the sum: three operators forward, five backward
        averaged = math.prod(self.objective.shape[: self.num_averaged_dims])
        scale = self.weight / averaged if averaged else math.nan  # no data: NaN, as a mean over nothing
        return self.objective.pow(2).sum() * scale
