r"""Structured algebra of the kernel-eigen strategies: covariance roots, low-rank-plus-diagonal covariances and the
closed-form KL against a diagonal prior. Nothing here ever forms or factorises a dense :math:`N \times N` or
:math:`K_{uu}` matrix."""

from __future__ import annotations

import math

from linear_operator.operators import (
    CholLinearOperator,
    DiagLinearOperator,
    LinearOperator,
    LowRankRootLinearOperator,
)
from torch import Tensor

__all__ = ["diagonal_prior_kl", "low_rank_plus_diag", "reparameterised_draw", "times_covariance_root"]


def times_covariance_root(interp: Tensor, variational_covar: LinearOperator) -> Tensor:
    r""":math:`A L` for a root :math:`S = L L^\top` of the variational covariance, shape ``(*batch, N, s)``.

    The root is free for Cholesky (``CholLinearOperator``) and mean-field (``DiagLinearOperator``, a column
    scaling in O(N s)) distributions; no factorisation of :math:`K_{uu}` is ever involved.

    :param interp: :math:`A`, shape ``(*batch, N, s)``.
    :param variational_covar: :math:`S`, shape ``(*batch, s, s)``.
    """
    if isinstance(variational_covar, DiagLinearOperator):
        return interp * variational_covar.diagonal().sqrt().unsqueeze(-2)
    return interp @ variational_covar.root_decomposition().root.to_dense()


def reparameterised_draw(mean: Tensor, variational_covar: LinearOperator, noise: Tensor) -> Tensor:
    r""":math:`u = m + L \varepsilon` for a root :math:`S = L L^\top` of the variational covariance: a
    reparameterised draw of :math:`q(u) = \mathcal N(m, S)` from standard normal noise.

    :param mean: :math:`m`, shape ``(*batch, s)``.
    :param variational_covar: :math:`S`, shape ``(*batch, s, s)`` (mean-field: a column scaling, O(s)).
    :param noise: :math:`\varepsilon`, shape ``(*sample, *batch, s)`` (broadcast against the batch).
    :return: shape ``(*sample, *batch, s)``.
    """
    if isinstance(variational_covar, DiagLinearOperator):
        return mean + variational_covar.diagonal().sqrt() * noise
    root = variational_covar.root_decomposition().root.to_dense()  # shape: (*batch, s, s)
    sample_dims = noise.dim() - 1 - (root.dim() - 2)
    if sample_dims > 0 and noise.shape[sample_dims:-1] == root.shape[:-2]:
        # the draws as the columns of one (s, s) x (s, S) product per batch element, not S products of (s, s) x (s, 1)
        # (batched GEMMs of a single column are several times slower, forward and backward)
        columns = noise.reshape(-1, *noise.shape[sample_dims:]).movedim(0, -1)  # (*batch, s, S)
        return mean + (root @ columns).movedim(-1, 0).reshape(noise.shape)
    return mean + (root @ noise.unsqueeze(-1)).squeeze(-1)


def low_rank_plus_diag(root: Tensor, diag: Tensor | None) -> LinearOperator:
    r""":math:`R R^\top + \operatorname{diag}(d)` as a ``LowRankRootAddedDiagLinearOperator`` (Woodbury solves in
    O(N r^2)), or :math:`R R^\top` alone when there is no diagonal. Never densified."""
    covar = LowRankRootLinearOperator(root)
    return covar if diag is None else covar + DiagLinearOperator(diag)


def diagonal_prior_kl(mean: Tensor, variational_covar: LinearOperator | None, prior_variances: Tensor) -> Tensor:
    r"""Closed-form :math:`\mathrm{KL}(\mathcal N(m, S) \,\|\, \mathcal N(0, \operatorname{diag}(p)))`:

    .. math::

        \tfrac12 \Big[\sum_i \frac{S_{ii}}{p_i} + \sum_i \frac{m_i^2}{p_i} - s + \sum_i \log p_i - \log |S|\Big].

    O(s) for a mean-field :math:`S`, O(s^2) for a Cholesky one (the row norms of its factor); GPyTorch's generic
    KL would solve :math:`K_{uu}` against :math:`s + 1` dense columns. For a delta :math:`q(u) = \delta_m`
    (``variational_covar=None``, GPyTorch's ``DeltaVariationalDistribution``) the term is GPyTorch's
    :math:`-\log p(m) = \tfrac12 \big[\sum_i m_i^2 / p_i + \sum_i \log p_i + s \log 2\pi\big]`, in O(s).

    :param mean: :math:`m`, shape ``(*batch, s)``.
    :param variational_covar: :math:`S`, shape ``(*batch, s, s)``, or ``None`` for a delta :math:`q(u)`.
    :param prior_variances: :math:`p = \lambda^2` (or ones when whitened), shape ``(*batch, s)``.
    :return: shape ``(*batch)``.
    """
    mahalanobis = (mean.pow(2) / prior_variances).sum(-1)
    if variational_covar is None:  # -log N(m; 0, diag(p)), the KL GPyTorch registers for Delta against a Gaussian
        return 0.5 * (mahalanobis + prior_variances.log().sum(-1) + mean.shape[-1] * math.log(2.0 * math.pi))
    if isinstance(variational_covar, DiagLinearOperator):
        variances = variational_covar.diagonal()
        logdet = variances.log().sum(-1)
    else:
        root = variational_covar.root_decomposition().root
        variances = root.to_dense().pow(2).sum(-1)
        if isinstance(variational_covar, CholLinearOperator):  # triangular root: log|S| = 2 sum log |L_ii|
            logdet = 2.0 * root.diagonal().abs().log().sum(-1)
        else:
            logdet = variational_covar.logdet()
    trace = (variances / prior_variances).sum(-1)
    return 0.5 * (trace + mahalanobis - mean.shape[-1] + prior_variances.log().sum(-1) - logdet)
