"""The CGP regulariser of correlated-GP attention as a GPyTorch added loss term."""

from __future__ import annotations

from gpytorch.mlls import AddedLossTerm
from torch import Tensor

from ..validation import check_float, check_tensor


class CGPAddedLossTerm(AddedLossTerm):
    r"""The weighted CGP regulariser :math:`\alpha\, \mathcal L_{\mathrm{CGP}}` of
    :class:`~gpattn.attention.CGPTAttention` (Bui et al. 2024): the negative expected log-likelihood of the attention
    outputs under the correlated-GP prior, a per-sequence quantity added to the mean cross-entropy as it is.

    It is not a KL divergence (there is no variational distribution to compare with a prior), so it does not go
    through ``kl_divergence()``, which :class:`~gpattn.mlls.AttentionELBO` divides by the training-set size: like
    every added loss term, GPyTorch's marginal log likelihoods and :class:`~gpattn.mlls.AttentionELBO` add
    :meth:`loss` unscaled.

    :param objective: :math:`\mathcal L_{\mathrm{CGP}}` per sequence (summed over heads), shape ``(B,)``.
    :param weight: :math:`\alpha \geq 0`.
    """

    def __init__(self, objective: Tensor, weight: float = 1.0):
        # O(1): built on every training forward pass of a CGPT layer
        check_float("the CGP weight alpha", weight, 0.0, where="CGPAddedLossTerm")
        check_tensor("objective", objective, ("B",), floating=True, meaning="(sequences,)", where="CGPAddedLossTerm")
        self.objective = objective
        self.weight = float(weight)

    def loss(self) -> Tensor:
        """The regulariser, averaged over the sequences of the batch.

        :return: :math:`\\alpha\\, \\mathrm{mean}_b\\, \\mathcal L_{\\mathrm{CGP}, b}`, a scalar.
        """
        return self.weight * self.objective.mean()
