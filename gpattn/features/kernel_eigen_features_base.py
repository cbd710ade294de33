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
    them). Two families:

    * :class:`~gpattn.features.KernelEigenFeatures`: a fixed landmark set, for GP models
      (:class:`~gpattn.models.KernelEigenPairSVGP`); ``features(x)`` evaluates both branches at ``x``.
    * :class:`~gpattn.features.AttentionKernelEigenFeatures`: one KSVD per sequence and head, for attention layers,
      one class per mode; ``features(queries, keys, ...)`` evaluates :math:`e` at the queries and :math:`r` at the
      keys.

    This class declares every member a strategy or a layer reads, with the defaults of features that have no such
    part: no landmarks (:attr:`inducing_points` is ``None``), no input check (:meth:`check_inputs`), no KSVD penalty
    to refresh (:meth:`refresh_ksvd_loss`), every direction active (:attr:`active_inducing`). What a feature class
    *is* is said by its capability attributes, never by comparing its :attr:`mode` name.

    :ivar num_inducing: :math:`s`, the number of inducing variables per branch (the KSVD rank).
    :ivar mode: The name of the parametrisation, for records and messages (no code compares it).
    :ivar learns_spectrum: :math:`\Lambda` is a learned parameter, kept near a KSVD stationary point by the KSVD
        penalty: the prior :math:`\mathcal N(0, \Lambda^2)` and the KL do not depend on any call.
    :ivar spectrum_per_call: :math:`\Lambda` belongs to each call (an exact SVD per sequence): the prior and the KL
        are those of a call's :class:`~gpattn.features.KernelEigenScores`, and :attr:`singular_values` raises.
    """

    # torch's call (hooks included) rather than gpytorch.Module's, which accepts tensors and distributions only
    __call__ = torch.nn.Module.__call__

    num_inducing: int
    mode: str
    learns_spectrum: bool = False
    spectrum_per_call: bool = False

    def _register_singular_values(self, initial: Tensor) -> None:
        r"""Register a learned :math:`\Lambda` as ``raw_singular_values`` under a ``GreaterThan(SINGULAR_VALUE_FLOOR)``
        constraint (softplus above the floor), starting at ``initial`` (clamped to twice the floor)."""
        constraint = GreaterThan(SINGULAR_VALUE_FLOOR)
        raw = constraint.inverse_transform(initial.clamp_min(2 * SINGULAR_VALUE_FLOOR))
        self.register_parameter("raw_singular_values", torch.nn.Parameter(raw))
        self.register_constraint("raw_singular_values", constraint)

    @property
    def singular_values(self) -> Tensor:
        r""":math:`\Lambda`, shape ``(*batch, s)``: the learned parameter, or the exact decomposition's (raises when
        :attr:`spectrum_per_call`: read it from the scores of a call)."""
        if self.learns_spectrum:
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

    @property
    def inducing_points(self) -> Tensor | None:
        r"""The landmarks :math:`Z` of shape ``(*batch, M, d)`` that the features are built on (what a GPyTorch
        strategy calls ``inducing_points``), or ``None`` (the default) for features evaluated per call."""
        return None

    def Kuu(self) -> DiagLinearOperator:  # noqa: N802 (GPflow's name for the inducing covariance)
        r""":math:`K_{uu} = \Lambda^2` as a ``DiagLinearOperator`` (inverse and log-determinant in O(s))."""
        return inducing_covariance(self.singular_values)

    def check_inputs(self, x: Tensor, where: str) -> None:
        """Check a model's inputs of shape ``(*batch, N, d)`` once per call, before anything is computed (a strategy's
        ``__call__`` does); a no-op by default (the attention layers check their tokens themselves).

        :param x: The inputs.
        :param where: The caller named in error messages.
        """

    def refresh_ksvd_loss(self) -> None:
        """Recompute the added loss term ``"ksvd_loss"`` outside a call (a strategy does on every training call); a
        no-op by default: features without a penalty, or whose calls refresh it themselves."""

    def forward(self, *inputs: Tensor, **kwargs) -> KernelEigenScores:
        """Evaluate the features at the inputs of one call: points ``(*batch, N, d)`` (landmark features) or
        sequences ``(B, N, C)`` (attention features); see the subclasses for the shapes of the scores."""
        raise NotImplementedError
