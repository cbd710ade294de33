"""A KL divergence that belongs to each sequence (an amortised posterior) as a GPyTorch added loss term."""

from __future__ import annotations

from gpytorch.mlls import AddedLossTerm
from torch import Tensor

from ..validation import check_float, check_tensor


class SequenceKLAddedLossTerm(AddedLossTerm):
    r"""The KL divergence of a per-sequence (amortised) posterior, e.g. SGPA's term on the values of each sequence
    (:class:`~gpattn.attention.SGPAAttention`).

    The evidence lower bound of :math:`n` sequences with a global :math:`q(u)` and a local :math:`q_b` per sequence is
    :math:`\sum_b \mathbb E[\log p(y_b)] - \mathrm{KL}_{\text{global}} - \sum_b \mathrm{KL}_b`; per sequence (divided by
    :math:`n`) the global KL gets the weight :math:`1/n` and each local KL the weight 1. So this term is
    :math:`w\, \operatorname{mean}_b \mathrm{KL}_b` over the minibatch, **not** divided by ``num_data``: the weight
    SGPA's paper and official code give it. :class:`~gpattn.mlls.AttentionELBO` multiplies it by its KL weight
    :math:`\beta` and reports it with the KL; GPyTorch's MLLs add :meth:`loss` as it is. (SGPA's official loss also
    adds the global KL to every sequence: ``SGPAAttention(kl_weighting="official")`` puts it in this term, which then
    carries :math:`\mathrm{KL}_{\text{global}} + \mathrm{KL}_b`.)

    :param objective: :math:`\mathrm{KL}_b` per sequence (summed over heads and value dimensions), shape ``(B,)``.
    :param weight: :math:`w \geq 0`.
    """

    def __init__(self, objective: Tensor, weight: float = 1.0):
        # O(1): built on every forward pass of the layer
        check_float("weight", weight, 0.0, where="SequenceKLAddedLossTerm")
        check_tensor(
            "objective", objective, ("B",), floating=True, meaning="(sequences,)", where="SequenceKLAddedLossTerm"
        )
        self.objective = objective
        self.weight = float(weight)

    def loss(self) -> Tensor:
        """The per-sequence KL averaged over the sequences of the batch.

        :return: :math:`w\\, \\mathrm{mean}_b\\, \\mathrm{KL}_b`, a scalar.
        """
        return self.weight * self.objective.mean()
