"""Structured predictive covariances shared by the kernel-eigen strategies."""

from __future__ import annotations

from linear_operator.operators import DiagLinearOperator, LinearOperator, LowRankRootLinearOperator
from torch import Tensor


def covariance_root(variational_covar: LinearOperator) -> Tensor:
    r"""A root :math:`L` with :math:`S = L L^\top`, shape ``(*batch, s, r)``: free for Cholesky
    (``CholLinearOperator``) and mean-field (``DiagLinearOperator``) variational distributions; no
    factorisation of :math:`K_{uu}` is ever involved."""
    return variational_covar.root_decomposition().root.to_dense()


def low_rank_plus_diag(root: Tensor, diag: Tensor | None) -> LinearOperator:
    r""":math:`R R^\top + \operatorname{diag}(d)` as a ``LowRankRootAddedDiagLinearOperator`` (Woodbury solves in
    O(N r^2)), or :math:`R R^\top` alone when there is no diagonal. Never densified."""
    covar = LowRankRootLinearOperator(root)
    return covar if diag is None else covar + DiagLinearOperator(diag)
