"""Sums over the tokens of a sequence that the attention features share: causal prefix means of outer products and
the quadratic forms of the unit features (the induced kernels' diagonals), each O(N p s) or O(N p^2)."""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_eigen_scores import induced_kernel_diag

__all__ = ["prefix_mean_outer", "unit_quadratic_form"]


def prefix_mean_outer(features: Tensor, values: Tensor) -> Tensor:
    r""":math:`\frac1i \sum_{j \leq i} \phi_j a_j^\top` for every position :math:`i` (causal, linear-attention style).

    :param features: :math:`\phi`, shape ``(B, H, M, p)``.
    :param values: :math:`a`, shape ``(B, H, M, s)``.
    :return: ``(B, H, M, p, s)``.
    """
    outer = features.unsqueeze(-1) * values.unsqueeze(-2)  # shape: (B, H, M, p, s)
    counts = torch.arange(1, features.shape[-2] + 1, dtype=features.dtype, device=features.device)
    return outer.cumsum(dim=-3) / counts[:, None, None]


def unit_quadratic_form(
    columns: Tensor, inverse: Tensor, other_columns: Tensor, other_inverse: Tensor, mask: Tensor | None, causal: bool
) -> Tensor:
    r""":math:`\sum_{j \in V} \langle \bar p_i, \bar p'_j \rangle^2` of the unit features :math:`\bar p = \nu P`
    over the visible tokens :math:`V` of the other side (all real tokens, or :math:`j \leq i` when causal).

    :param columns: :math:`P`, ``(B, H, p, N)``.
    :param inverse: :math:`\nu`, ``(B, H, 1, N)``.
    :param other_columns: The other side's :math:`P'`, ``(B, H, p, M)``.
    :param other_inverse: The other side's :math:`\nu'`, ``(B, H, 1, M)``.
    :param mask: ``(B, M)`` bool or ``None``.
    :param causal: Sum over :math:`j \leq i` only.
    :return: ``(B, H, N)``.
    """
    unit, other = columns * inverse, other_columns * other_inverse
    if not causal:
        return induced_kernel_diag(unit.mT, other.mT, None if mask is None else mask[:, None, :])
    # one Gram matrix per prefix: (B, H, N, p, p); a causal call has no padding mask
    gram = (other.mT.unsqueeze(-1) * other.mT.unsqueeze(-2)).cumsum(dim=-3)
    # two products of two operands: torch.einsum searches a contraction path (opt_einsum) on every call with three
    return (torch.einsum("bhpn,bhnpq->bhqn", unit, gram) * unit).sum(-2)
