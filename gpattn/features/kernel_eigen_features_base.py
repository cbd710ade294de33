"""The interface every kernel-eigen feature class implements (the role of GPflow's inducing variables)."""

from __future__ import annotations

import torch
from gpytorch.constraints import GreaterThan
from gpytorch.module import Module
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from .kernel_eigen_scores import KernelEigenScores, inducing_covariance

#: The smallest learned singular value: :math:`\Lambda = 10^{-12} + \operatorname{softplus}(\text{raw})` stays
#: positive and finite for any raw value (a plain softplus underflows to 0 for raw values below about -100, and then
#: :math:`\Lambda^{-1}` and the KL against :math:`\mathcal N(0, \Lambda^2)` are not finite); :math:`10^{-24}` as a
#: prior variance still has a finite inverse in float32.
SINGULAR_VALUE_FLOOR = 1e-12


class KernelEigenFeaturesBase(Module):
    r"""Kernel-eigen inducing features: the state of a kernel SVD :math:`\kappa \approx H_e \Lambda H_r^\top` whose
    projections are the inducing variables of the kernel-eigen SVGP pair (docs/math.md section 3).

    Subclasses hold the KSVD state (exact, or learned with the KSVD penalty) and are *called* on the inputs of a
    model; the call returns a :class:`~gpattn.features.KernelEigenScores`, the one object the strategies consume
    (scores, :math:`\Lambda`, :math:`J`, kernel diagonals; :math:`K_{uu}`, interpolation and residual derived from
    them). Two implementations:

    * :class:`~gpattn.features.KernelEigenFeatures`: a fixed landmark set, for GP models
      (:class:`~gpattn.models.KernelEigenPairSVGP`); ``features(x)`` evaluates both branches at ``x``.
    * :class:`~gpattn.features.AttentionKernelEigenFeatures`: one KSVD per sequence and head, for attention layers;
      ``features(queries, keys, ...)`` evaluates :math:`e` at the queries and :math:`r` at the keys.

    :ivar num_inducing: :math:`s`, the number of inducing variables per branch (the KSVD rank).
    """

    # torch's call (hooks included) rather than gpytorch.Module's, which accepts tensors and distributions only
    __call__ = torch.nn.Module.__call__

    num_inducing: int

    def _register_singular_values(self, initial: Tensor) -> None:
        r"""Register a learned :math:`\Lambda` as ``raw_singular_values`` under a ``GreaterThan(SINGULAR_VALUE_FLOOR)``
        constraint (softplus above the floor), starting at ``initial`` (clamped to twice the floor)."""
        constraint = GreaterThan(SINGULAR_VALUE_FLOOR)
        raw = constraint.inverse_transform(initial.clamp_min(2 * SINGULAR_VALUE_FLOOR))
        self.register_parameter("raw_singular_values", torch.nn.Parameter(raw))
        self.register_constraint("raw_singular_values", constraint)

    @property
    def learns_singular_values(self) -> bool:
        r"""Whether :math:`\Lambda` is a learned parameter (kept near a KSVD stationary point by the penalty)."""
        return "raw_singular_values" in self._parameters

    @property
    def singular_values(self) -> Tensor:
        r""":math:`\Lambda`, shape ``(*batch, s)``: the learned parameter, or the exact decomposition's."""
        if self.learns_singular_values:
            return self.raw_singular_values_constraint.transform(self.raw_singular_values)
        return self._exact_singular_values()

    def _exact_singular_values(self) -> Tensor:
        raise NotImplementedError

    @property
    def active_inducing(self) -> Tensor | None:
        r"""Which directions are numerically nonzero, boolean with the shape of :attr:`singular_values` ``(*batch, s)``,
        or ``None`` when all are (always for a learned :math:`\Lambda`); see
        :attr:`~gpattn.features.KernelEigenScores.active`."""
        return None

    def Kuu(self) -> DiagLinearOperator:  # noqa: N802 (GPflow's name for the inducing covariance)
        r""":math:`K_{uu} = \Lambda^2` as a ``DiagLinearOperator`` (inverse and log-determinant in O(s))."""
        return inducing_covariance(self.singular_values)

    def forward(self, *inputs: Tensor, **kwargs) -> KernelEigenScores:
        """Evaluate the features at the inputs of one call: points ``(*batch, N, d)`` (landmark features) or
        sequences ``(B, N, C)`` (attention features); see the subclasses for the shapes of the scores."""
        raise NotImplementedError
