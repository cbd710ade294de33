r"""The kernel-eigen inducing features of one call: the one object every feature class returns.

:class:`~gpattn.features.KernelEigenFeatures` (landmarks, for GP models) and the
:class:`~gpattn.features.AttentionKernelEigenFeatures` (per sequence, for attention) are evaluated by calling them;
all return a :class:`KernelEigenScores`, and the kernel-eigen strategies consume nothing else. Everything derived
from the scores (the inducing covariance :math:`K_{uu}`, the interpolation term, the residual) is written here, once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from ..validation import check_choice

SIDES = ("left", "right")


def inducing_covariance(singular_values: Tensor) -> DiagLinearOperator:
    r""":math:`K_{uu} = \Lambda^2` as a :class:`~linear_operator.operators.DiagLinearOperator`: inverse and
    log-determinant in O(s), never a Cholesky factorisation.

    :param singular_values: :math:`\Lambda`, shape ``(*batch, s)``.
    :return: shape ``(*batch, s, s)``.
    """
    return DiagLinearOperator(singular_values.pow(2))


def numerically_nonzero(singular_values: Tensor, size: int) -> Tensor:
    r"""Which singular values are numerically nonzero: above :math:`\max(N, M)\, \varepsilon\, \lambda_1` (the
    numerical-rank tolerance of ``numpy.linalg.matrix_rank``), for a matrix of ``size = max(N, M)``.

    A direction at or below it is rounding noise of the SVD: :math:`e \Lambda^{-1}` would amplify that noise and the
    prior :math:`\mathcal N(0, \lambda_i^2)` would give the KL a term of order :math:`\lambda_i^{-2}`, so the
    kernel-eigen strategies leave such a direction out (see :attr:`KernelEigenScores.active`).

    :param singular_values: :math:`\Lambda`, shape ``(*batch, s)``, sorted in decreasing order.
    :param size: :math:`\max(N, M)` of the decomposed matrix.
    :return: Boolean, shape ``(*batch, s)``.
    """
    floor = size * torch.finfo(singular_values.dtype).eps * singular_values[..., :1]
    return singular_values.detach() > floor.detach()


def induced_kernel_diag(features: Tensor, other_features: Tensor, other_mask: Tensor | None = None) -> Tensor:
    r"""The diagonal of an induced kernel from primal features:
    :math:`k_e(x_i, x_i) = \|\kappa(x_i, Z)\|^2 = \sum_{j \in V} \langle \phi_q(x_i), \phi_k(z_j) \rangle^2`
    (and :math:`k_r` with the roles swapped) over the visible tokens :math:`V` of the other side, computed as
    :math:`\phi^\top (\Phi'^\top \Phi') \phi` without forming :math:`\kappa(X, Z)`.

    :param features: :math:`\phi(x_i)`, shape ``(*batch, N, p)``.
    :param other_features: :math:`\Phi'`, shape ``(*batch, M, p)``.
    :param other_mask: ``(*batch, M)`` boolean, ``True`` for visible tokens, or ``None`` (all visible).
    :return: shape ``(*batch, N)``.

    .. note:: Cost O((N + M) p^2).
    """
    if other_mask is not None:
        other_features = other_features * other_mask.unsqueeze(-1).to(other_features.dtype)
    gram = other_features.mT @ other_features  # Phi'^T Phi'; shape: (*batch, p, p)
    return ((features @ gram) * features).sum(-1)


# not frozen: torch 2.3's dynamo cannot build a frozen dataclass inside a compiled layer (InternalTorchDynamoError
# "'KernelEigenScores' object has no attribute ..."); derived copies are made with dataclasses.replace
@dataclass
class KernelEigenScores:
    r"""The kernel-eigen inducing features evaluated at the inputs of one call.

    For left inputs :math:`X` (queries; ``N`` points) and right inputs :math:`Z` (keys; ``M`` points):

    .. math::

        e(X) = \kappa(X, Z_\star) H_r, \qquad r(Z) = \kappa(X_\star, Z)^\top H_e, \qquad
        K_{uu} = \Lambda^2, \qquad K_{fu} = e \Lambda \ (\text{left}), \; r \Lambda \ (\text{right}),

    with the landmarks :math:`X_\star, Z_\star` of :class:`~gpattn.features.KernelEigenFeatures` (GP models), or
    the sequence itself, :math:`X_\star = X`, :math:`Z_\star = Z`, for the
    :class:`~gpattn.features.AttentionKernelEigenFeatures`.
    A strategy's GP branch needs only :meth:`interp` (:math:`e \Lambda^{-1}`) and, with a residual,
    :meth:`residual_diag`; the KSVD penalty reads :meth:`ksvd_objective`.

    :ivar left_scores: :math:`e(X)`, shape ``(*batch, N, s)``, or ``None`` (not evaluated).
    :ivar right_scores: :math:`r(Z)`, shape ``(*batch, M, s)``, or ``None``.
    :ivar singular_values: :math:`\Lambda`, shape ``(*batch', s)`` with ``*batch'`` broadcastable against the scores'
        batch (a learned :math:`\Lambda` has no sequence dimension; an exact one has).
    :ivar objective: :math:`J` (sum form), or ``None`` when not computed.
    :ivar left_kernel_diag: :math:`k_e(x, x) = \|\kappa(x, Z_\star)\|^2`, shape ``(*batch, N)``, or ``None``.
    :ivar right_kernel_diag: :math:`k_r(z, z) = \|\kappa(X_\star, z)\|^2`, shape ``(*batch, M)``, or ``None``.
    :ivar active: Which of the ``s`` directions are numerically nonzero (boolean, the shape of ``singular_values``), or
        ``None`` (all; learned :math:`\Lambda` always are). An inactive direction (an exact decomposition of a kernel
        of rank below :math:`s`) is left out consistently: its interpolation column is zero, so it adds nothing to
        :math:`q(f)`, and its prior is the unit normal, so its KL term vanishes at :math:`q = p` instead of being of
        order :math:`\lambda_i^{-2}` (:meth:`prior_variances`).
    :ivar stacked: :math:`[e^\top; r^\top]` of shape ``(B, 2, H, s, N)`` when the features computed both branches as
        halves of one tensor (the fused amortised and the paired primal-token self-attention paths: ``left_scores``
        and ``right_scores`` are then its transposed halves), else ``None``; read it through :meth:`columns`, which
        stacks the other layouts.
    :ivar token_sums: The token sums of the squared scores of both branches,
        :math:`S_k = \sum_i m_i e_{ik}^2 + \sum_j m_j r_{jk}^2` (:math:`m` the padding mask), shape ``(*batch, s)``,
        when the features formed them for :math:`J` (the paired primal-token path), else ``None``.
    """

    left_scores: Tensor | None
    right_scores: Tensor | None
    singular_values: Tensor
    objective: Tensor | None = None
    left_kernel_diag: Tensor | None = None
    right_kernel_diag: Tensor | None = None
    active: Tensor | None = None
    stacked: Tensor | None = None
    token_sums: Tensor | None = None

    @property
    def num_inducing(self) -> int:
        """:math:`s`, the number of inducing variables per branch (the KSVD rank)."""
        return self.singular_values.shape[-1]

    def Kuu(self) -> DiagLinearOperator:  # noqa: N802 (GPflow's name for the inducing covariance)
        r""":math:`K_{uu} = \Lambda^2`, a ``DiagLinearOperator`` of shape ``(*batch', s, s)``."""
        return inducing_covariance(self.singular_values)

    def _get(self, side: str, name: str) -> Tensor:
        check_choice("side", side, SIDES, where="KernelEigenScores")
        value = getattr(self, f"{side}_{name}")
        if value is None:
            raise RuntimeError(f"the {side} {name.replace('_', ' ')} were not evaluated in this call")
        return value

    def scores(self, side: str) -> Tensor:
        """:math:`e(X)` (``side="left"``) or :math:`r(Z)` (``"right"``), shape ``(*batch, N or M, s)``."""
        return self._get(side, "scores")

    def kernel_diag(self, side: str) -> Tensor:
        """:math:`k_e(x, x)` (``"left"``) or :math:`k_r(z, z)` (``"right"``), shape ``(*batch, N or M)``."""
        return self._get(side, "kernel_diag")

    def interp(self, side: str, whiten: bool = False) -> Tensor:
        r"""The interpolation term :math:`K_{fu} K_{uu}^{-1} = e \Lambda^{-1}` (:math:`e` when whitened,
        :math:`u = \Lambda v`), shape ``(*batch, N or M, s)``; O(N s)."""
        scores = self.scores(side)
        interp = scores if whiten else scores / self.singular_values.unsqueeze(-2)
        if self.active is not None:  # numerically zero directions are left out (see ``active``)
            interp = torch.where(self.active.unsqueeze(-2), interp, 0.0)
        return interp

    def prior_variances(self) -> Tensor:
        r"""The variances of the (unwhitened) prior :math:`p(u) = \mathcal N(0, \Lambda^2)`, with 1 for an inactive
        direction (see ``active``), shape ``(*batch', s)``."""
        return prior_variances(self.singular_values, self.active)

    def residual_diag(self, side: str) -> Tensor:
        r"""The residual variance :math:`K_{ff} - Q_{ff}` on the diagonal: :math:`k_e(x, x) - \|e(x)\|^2` (``"left"``)
        or :math:`k_r(z, z) - \|r(z)\|^2` (``"right"``), clamped at 0 (it is PSD; rounding can make it negative).
        Zero iff :math:`\operatorname{rank} K \leq s` on the landmarks. Shape ``(*batch, N or M)``."""
        return (self.kernel_diag(side) - self.scores(side).pow(2).sum(-1)).clamp_min(0.0)

    def columns(self, sides: tuple[str, ...] = SIDES) -> Tensor:
        r"""The scores of the branches ``sides`` at the queries in column layout, stacked on a branch dimension in
        front of the last batch dimension: for attention scores of batch ``(B, H)``, :math:`[e^\top; r^\top]` of shape
        ``(B, 2, H, s, N)`` (``(B, 1, H, s, N)`` for one side), so that its ``(B, 2 H s, N)`` view is the left operand
        of one output GEMM over both branches and every head.

        The fused path's :attr:`stacked` tensor is returned as it is; both branches of another path are stacked once
        (a copy of the ``(s, N)`` scores); one branch is a view.

        :param sides: ``("left", "right")`` (both branches at the same points, i.e. self-attention) or one side.
        :return: shape ``(*batch[:-1], len(sides), batch[-1], s, N)``.
        """
        if self.stacked is not None and tuple(sides) == SIDES:
            return self.stacked
        branches = [self.scores(side).mT for side in sides]  # (*batch, s, N) each
        return branches[0].unsqueeze(-4) if len(branches) == 1 else torch.stack(branches, dim=-4)

    def ksvd_objective(self) -> Tensor:
        r""":math:`J` (sum form; see :func:`~gpattn.ksvd.ksvd_objective`) of this call, shape ``(*batch)`` (e.g.
        ``(B, H)``: one per sequence and head)."""
        if self.objective is None:
            raise RuntimeError("the KSVD objective J was not computed in this call (ask for objective=True)")
        return self.objective

    def for_outputs(self, num_dims: int = 1) -> KernelEigenScores:
        r"""The same features for a batch of independent GP outputs that share them (e.g. the ``d_out`` outputs of
        an attention head): ``num_dims`` singleton dimensions inserted in front of the event dimensions of every
        tensor, so that they broadcast against a :math:`q(u)` of batch shape ``(*batch, *outputs)``."""
        if num_dims == 0:
            return self

        def insert(tensor: Tensor | None, event_dims: int) -> Tensor | None:
            if tensor is None:
                return None
            index = tensor.dim() - event_dims
            return tensor.reshape(*tensor.shape[:index], *(1,) * num_dims, *tensor.shape[index:])

        return replace(
            self,
            left_scores=insert(self.left_scores, 2),
            right_scores=insert(self.right_scores, 2),
            singular_values=insert(self.singular_values, 1),
            left_kernel_diag=insert(self.left_kernel_diag, 1),
            right_kernel_diag=insert(self.right_kernel_diag, 1),
            active=insert(self.active, 1),
            token_sums=insert(self.token_sums, 1),
            stacked=None,  # the stacked tensor does not follow the inserted dimensions
        )


def prior_variances(singular_values: Tensor, active: Tensor | None) -> Tensor:
    r""":math:`\lambda_i^2`, or 1 where the direction is inactive (``active`` false), shape ``(*batch, s)``: the prior
    variances of the kernel-eigen inducing variables."""
    variances = singular_values.pow(2)
    return variances if active is None else torch.where(active, variances, 1.0)
