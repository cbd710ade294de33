"""The kernel-eigen variational strategy: one branch of the KEP-SVGP pair, with a diagonal K_uu."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.module import Module
from gpytorch.utils.memoize import cached, clear_cache_hook
from gpytorch.variational import _VariationalDistribution
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor

from ..features import KernelEigenFeatures
from ..validation import checked_inputs
from ._structured import diagonal_prior_kl, low_rank_plus_diag, times_covariance_root

SIDES = ("left", "right")
RESIDUALS = ("none", "diag")


class _CovarModuleOf:
    """Picklable zero-argument callable returning ``model.covar_module`` (read lazily: strategies are built
    before the model's modules exist)."""

    def __init__(self, model: ApproximateGP):
        self.model = model

    def __call__(self):
        return self.model.covar_module


class KernelEigenVariationalStrategy(_VariationalStrategy):
    r"""Sparse variational GP with kernel-eigen inducing variables (KEP-SVGP, Chen et al. 2024, one branch).

    For ``side="left"`` the GP is the weight-space prior :math:`f_e(x) = \kappa(x, Z) w`,
    :math:`w \sim \mathcal N(0, I)`, with the asymmetric kernel :math:`\kappa` = ``model.covar_module`` and the
    landmarks :math:`Z` = ``inducing_points``. The inducing variables are projections on the left singular
    vectors, :math:`u = H_e^\top f_e(X)`, so that

    .. math::

        K_{uu} = \Lambda^2, \qquad K_{fu}(x) = e(x) \Lambda, \qquad
        q(f(x)) = \mathcal N\big(\mu(x) + e(x) \Lambda^{-1} m,\;
            e(x) \Lambda^{-1} S \Lambda^{-1} e(x')^\top + [k_e(x, x') - e(x) e(x')^\top]\big),

    with :math:`q(u) = \mathcal N(m, S)`. The prior is ``MultivariateNormal(0, DiagLinearOperator(Lambda^2))``:
    its inverse and log-determinant cost O(s) and no Cholesky of :math:`K_{uu}` ever runs. With
    ``whiten=True``, :math:`u = \Lambda v`, :math:`p(v) = \mathcal N(0, I)` and the mean is :math:`e(x) m_v`.
    ``side="right"`` swaps roles: :math:`f_r(z) = \kappa(Z, z)^\top w'`, scores :math:`r(z)`,
    :math:`u = H_r^\top f_r(Z)`.
    The bracket (the residual :math:`K_{ff} - Q_{ff}`) is dropped (``residual="none"``) or kept on the
    diagonal (``"diag"``). The mean :math:`\mu` is ``model.mean_module`` when the model has one, else zero.

    The number of inducing variables :math:`s` (the KSVD rank) is ``variational_distribution.num_inducing_points``
    (at most the number of landmarks).
    Any GPyTorch variational distribution works (Cholesky, mean-field, natural).

    :param model: The :class:`~gpytorch.models.ApproximateGP` (its ``covar_module`` must be an
        :class:`~gpattn.kernels.AsymmetricKernel`).
    :param inducing_points: Landmarks :math:`Z`, shape ``(*batch, M, d)``.
    :param variational_distribution: :math:`q(u)` over ``s`` inducing variables.
    :param side: ``"left"`` (:math:`e`, queries) or ``"right"`` (:math:`r`, keys).
    :param learn_inducing_locations: Learn the landmarks.
    :param whiten: Parametrise :math:`q(v)` with :math:`u = \Lambda v`.
    :param residual: ``"none"`` or ``"diag"``.
    :param features: Shared :class:`~gpattn.features.KernelEigenFeatures` (e.g. the other branch's, or a
        ``primal``-mode object); by default exact-mode features over ``model.covar_module`` and the landmarks.

    .. note:: Cost per call: the features (exact mode O(M^2 p + M^3) for the SVD, primal O(N p s)), plus
        O(N s^2) for the predictive covariance root and O(s) for the prior and its KL (O(s^3) for the
        variational term of a full-covariance :math:`q(u)`, as in any SVGP).
    """

    def __init__(
        self,
        model: ApproximateGP,
        inducing_points: Tensor,
        variational_distribution: _VariationalDistribution,
        side: str = "left",
        learn_inducing_locations: bool = True,
        whiten: bool = False,
        residual: str = "diag",
        features: KernelEigenFeatures | None = None,
        jitter_val: float | None = None,
    ):
        if side not in SIDES:
            raise ValueError(f"expected side in {SIDES}, got {side!r}")
        if residual not in RESIDUALS:
            raise ValueError(f"expected residual in {RESIDUALS}, got {residual!r}")
        if not isinstance(variational_distribution, _VariationalDistribution):
            raise TypeError(
                "KernelEigenVariationalStrategy: expected variational_distribution to be a gpytorch "
                f"_VariationalDistribution, got {type(variational_distribution).__name__}"
            )
        if features is not None and not isinstance(features, KernelEigenFeatures):
            raise TypeError(f"expected features to be KernelEigenFeatures or None, got {type(features).__name__}")
        # _VariationalStrategy.__init__ would register a copy of the inducing points here; the landmarks belong to
        # the (possibly shared) features instead, so that a tied pair registers each parameter exactly once
        Module.__init__(self)
        self._jitter_val = jitter_val
        object.__setattr__(self, "model", model)
        self._variational_distribution = variational_distribution
        self.register_buffer("variational_params_initialized", torch.tensor(0))
        num_inducing = variational_distribution.num_inducing_points
        if features is None:
            features = KernelEigenFeatures(
                _CovarModuleOf(model), inducing_points, num_inducing, learn_landmarks=learn_inducing_locations
            )
        elif features.num_inducing != num_inducing:
            raise ValueError(
                f"the features have {features.num_inducing} inducing variables but the variational distribution has "
                f"{num_inducing}"
            )
        self.features = features
        self.side = side
        self.whiten = bool(whiten)
        self.residual = residual

    @property
    def inducing_points(self) -> Tensor:
        """The landmarks :math:`Z` (owned by :attr:`features`), shape ``(*batch, M, d)``."""
        return self.features.landmarks

    def _clear_cache(self) -> None:
        clear_cache_hook(self)
        if "features" in self._modules:
            self.features._clear_cache()

    @property
    @cached(name="prior_distribution_memo")
    def prior_distribution(self) -> MultivariateNormal:
        r""":math:`p(u) = \mathcal N(0, \Lambda^2)`, a ``DiagLinearOperator`` covariance (identity when whitened)."""
        variances = self.features.singular_values.pow(2)  # shape: (*batch, s)
        batch_shape = torch.broadcast_shapes(variances.shape[:-1], self._variational_distribution.batch_shape)
        variances = variances.expand(*batch_shape, variances.shape[-1])
        if self.whiten:
            variances = torch.ones_like(variances)
        return MultivariateNormal(torch.zeros_like(variances), DiagLinearOperator(variances))

    def kl_divergence(self) -> Tensor:
        r""":math:`\mathrm{KL}(q(u) \| p(u))` in closed form against the diagonal prior (no solve with :math:`K_{uu}`):
        O(s) for the prior terms and a mean-field :math:`q`, O(s^2) for a Cholesky :math:`q`. Shape ``(*batch)``."""
        variational = self.variational_distribution
        prior_variances = self.prior_distribution.lazy_covariance_matrix.diagonal()
        return diagonal_prior_kl(variational.mean, variational.lazy_covariance_matrix, prior_variances)

    def interp_and_residual(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        r"""The interpolation term :math:`e(x) \Lambda^{-1}` (:math:`e(x)` when whitened), shape ``(*batch, N, s)``,
        and the residual diagonal (``None`` when ``residual="none"``), shape ``(*batch, N)``."""
        scores = self.features.scores(x, self.side)
        interp = scores if self.whiten else scores / self.features.singular_values.unsqueeze(-2)
        residual = self.features.residual_diag(x, self.side, scores) if self.residual == "diag" else None
        return interp, residual

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        """GPyTorch's ``__call__`` (:math:`q(f(x))`, or the prior with ``prior=True``) after checking ``x`` once (see
        :meth:`~gpattn.features.KernelEigenFeatures.check_inputs`).

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param prior: Return the prior :math:`p(f(x))` instead.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)``.
        """
        self.features.check_inputs(x, type(self).__name__)
        with checked_inputs():
            return super().__call__(x, prior=prior, **kwargs)

    def prior_mean(self, x: Tensor) -> Tensor | float:
        """:math:`\\mu(x)` from ``model.mean_module`` (0 when the model has none), shape ``(*batch, N)``."""
        mean_module = getattr(self.model, "mean_module", None)
        return 0.0 if mean_module is None else mean_module(x)

    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None = None,
        diag: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        r"""The predictive :math:`q(f(x))` for a given :math:`q(u)` (GPyTorch's ``_VariationalStrategy.forward``; call
        the strategy, or the model, rather than this method).

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param inducing_points: The landmarks (unused: the features own them).
        :param inducing_values: :math:`m` (:math:`m_v` when whitened), shape ``(*batch, s)``.
        :param variational_inducing_covar: :math:`S`, shape ``(*batch, s, s)``, or ``None`` for a delta :math:`q(u)`.
        :param diag: Unused (the covariance is structured, never dense).
        :return: :math:`\mathcal N(\mu(x) + e(x) \Lambda^{-1} m,\; e \Lambda^{-1} L (e \Lambda^{-1} L)^\top +
            \operatorname{diag}(\rho))` with mean shape ``(*batch, N)``, a ``LowRankRootAddedDiagLinearOperator``
            covariance (:math:`S = L L^\top`, :math:`\rho` the residual diagonal when ``residual="diag"``).
        """
        if self.training:
            self.features.refresh_ksvd_loss()
        interp, residual = self.interp_and_residual(x)
        # e Lambda^{-1} m; shape: (*batch, N)
        predictive_mean = (interp @ inducing_values.unsqueeze(-1)).squeeze(-1) + self.prior_mean(x)
        if variational_inducing_covar is None:  # a Delta q(u): only the residual is uncertain
            root = torch.zeros_like(interp[..., :1])
        else:
            root = times_covariance_root(interp, variational_inducing_covar)  # e Lambda^{-1} L
        root = root.expand(*predictive_mean.shape, root.shape[-1])
        return MultivariateNormal(predictive_mean, low_rank_plus_diag(root, residual))
