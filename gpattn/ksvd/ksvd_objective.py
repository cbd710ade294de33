"""The KSVD objective J of Suykens (2016) and Primal-Attention, in the token-sum form."""

from __future__ import annotations

from torch import Tensor


def ksvd_objective(
    left_scores: Tensor,
    right_scores: Tensor,
    left_weights: Tensor,
    right_weights: Tensor,
    singular_values: Tensor,
) -> Tensor:
    r"""The KSVD objective (token sums, not means):

    .. math::

        J = \tfrac12 \sum_i e(x_i)^\top \Lambda^{-1} e(x_i) + \tfrac12 \sum_j r(z_j)^\top \Lambda^{-1} r(z_j)
            - \operatorname{Tr}(W_e^\top W_r).

    :math:`J = 0` at every stationary point (e.g. :math:`W_e = \Phi_k^\top H_r`, :math:`W_r = \Phi_q^\top H_e`);
    training adds :math:`\eta J^2`. :math:`J = 0` is necessary, not sufficient.

    :param left_scores: :math:`e(X)`, shape ``(*batch, N, s)``.
    :param right_scores: :math:`r(Z)`, shape ``(*batch, M, s)``.
    :param left_weights: :math:`W_e`, shape ``(*batch, p, s)``.
    :param right_weights: :math:`W_r`, shape ``(*batch, p, s)``.
    :param singular_values: :math:`\Lambda`, shape ``(*batch, s)``, positive.
    :return: :math:`J`, shape ``(*batch)``.

    .. note:: Cost O((N + M + p) s).
    """
    inverse = singular_values.reciprocal().unsqueeze(-2)  # shape: (*batch, 1, s)
    left_term = (left_scores.pow(2) * inverse).sum(dim=(-2, -1))
    right_term = (right_scores.pow(2) * inverse).sum(dim=(-2, -1))
    coupling = (left_weights * right_weights).sum(dim=(-2, -1))  # Tr(W_e^T W_r)
    return 0.5 * (left_term + right_term) - coupling
