"""The kernel-eigen variational strategy: one branch of the KEP-SVGP pair, with a diagonal K_uu."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.module import Module
from gpytorch.utils.memoize import clear_cache_hook
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    MeanFieldVariationalDistribution,
    _VariationalDistribution,
)
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor

from ..features import KernelEigenFeatures, KernelEigenFeaturesBase, KernelEigenScores, prior_variances
from ..validation import check_choice, check_float, check_int
from .structured_covariance import (
    diagonal_prior_kl,
    low_rank_plus_diag,
    reparameterised_draw,
    times_covariance_root,
)
from .token_noise import TokenNoise

SIDES = ("left", "right")
RESIDUALS = ("none", "diag")


class _CovarModuleOf:
    """Picklable zero-argument callable returning ``model.covar_module`` (read lazily: strategies are built
    before the model's modules exist)."""

    def __init__(self, model: ApproximateGP):
        self.model = model

    def __call__(self):
        return self.model.covar_module


class KernelEigenVariationalStrategy(TokenNoise, _VariationalStrategy):
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
    (at most the number of landmarks). Any GPyTorch variational distribution works (Cholesky, mean-field, natural).

    The features can be any :class:`~gpattn.features.KernelEigenFeaturesBase`: the landmark
    :class:`~gpattn.features.KernelEigenFeatures` of GP models (the default, built over ``model.covar_module`` and
    ``inducing_points``), or the per-sequence :class:`~gpattn.features.AttentionKernelEigenFeatures` of the attention
    layers, which evaluate the features themselves and hand the strategy the
    :class:`~gpattn.features.KernelEigenScores` of each call (:meth:`predictive`, :meth:`inducing_draw`,
    :meth:`linear_coefficients`, :meth:`token_noise`). ``num_output_dims`` trailing batch dimensions of
    :math:`q(u)` may index independent outputs that share the features (GPyTorch's batch-independent multi-output
    idiom; e.g. the ``d_out`` outputs of an attention head): the features' batch then aligns with the batch
    dimensions in front of them.

    :param model: The owning model (an :class:`~gpytorch.models.ApproximateGP` whose ``covar_module`` is an
        :class:`~gpattn.kernels.AsymmetricKernel`, or an attention layer).
    :param inducing_points: Landmarks :math:`Z`, shape ``(*batch, M, d)`` (``None`` when ``features`` are given).
    :param variational_distribution: :math:`q(u)` over ``s`` inducing variables.
    :param side: ``"left"`` (:math:`e`, queries) or ``"right"`` (:math:`r`, keys).
    :param learn_inducing_locations: Learn the landmarks.
    :param whiten: Parametrise :math:`q(v)` with :math:`u = \Lambda v`.
    :param residual: ``"none"`` or ``"diag"``.
    :param features: Shared kernel-eigen features (e.g. the other branch's, a ``primal``-mode
        :class:`~gpattn.features.KernelEigenFeatures`, or an attention layer's); by default exact-mode landmark
        features over ``model.covar_module`` and the landmarks.
    :param num_output_dims: Trailing batch dimensions of :math:`q(u)` that index outputs sharing the features.

    .. note:: Cost per call: the features (exact mode O(M^2 p + M^3) for the SVD, primal O(N p s)), plus
        O(N s^2) for the predictive covariance root and O(s) for the prior and its KL (O(s^2) for the
        variational term of a Cholesky :math:`q(u)`, O(s) for a mean-field one).
    """

    def __init__(
        self,
        model: ApproximateGP | Module,
        inducing_points: Tensor | None,
        variational_distribution: _VariationalDistribution,
        side: str = "left",
        learn_inducing_locations: bool = True,
        whiten: bool = False,
        residual: str = "diag",
        features: KernelEigenFeaturesBase | None = None,
        jitter_val: float | None = None,
        num_output_dims: int = 0,
    ):
        where = type(self).__name__
        check_choice("side", side, SIDES, where=where)
        check_choice("residual", residual, RESIDUALS, where=where)
        num_output_dims = check_int("num_output_dims", num_output_dims, 0, where=where)
        if not isinstance(variational_distribution, _VariationalDistribution):
            raise TypeError(
                f"{where}: expected variational_distribution to be a gpytorch _VariationalDistribution, got "
                f"{type(variational_distribution).__name__}"
            )
        if features is not None and not isinstance(features, KernelEigenFeaturesBase):
            raise TypeError(
                f"{where}: expected features to be kernel-eigen features (gpattn.features) or None, got "
                f"{type(features).__name__}"
            )
        # _VariationalStrategy.__init__ would register a copy of the inducing points here; the landmarks belong to
        # the (possibly shared) features instead, so that a tied pair registers each parameter exactly once
        Module.__init__(self)
        self._jitter_val = jitter_val
        object.__setattr__(self, "model", model)
        self._variational_distribution = variational_distribution
        self.register_buffer("variational_params_initialized", torch.tensor(0))
        num_inducing = variational_distribution.num_inducing_points
        if features is None:
            if inducing_points is None:
                raise ValueError(f"{where}: expected inducing_points (the landmarks) when no features are given")
            features = KernelEigenFeatures(
                _CovarModuleOf(model), inducing_points, num_inducing, learn_landmarks=learn_inducing_locations
            )
        elif features.num_inducing != num_inducing:
            raise ValueError(
                f"{where}: the features have {features.num_inducing} inducing variables but the variational "
                f"distribution has {num_inducing}"
            )
        self.features = features
        self.side = side
        self.whiten = bool(whiten)
        self.residual = residual
        self.num_output_dims = num_output_dims

    # -- the branches this strategy holds ---------------------------------------------------------------------------
    @property
    def branch_sides(self) -> tuple[str, ...]:
        """The sides of the branches of :math:`q(u)`: ``(side,)`` here, ``("left", "right")`` for a pair."""
        return (self.side,)

    def select_branch(self, tensor: Tensor, side: str, event_dims: int) -> Tensor:
        """The part of a tensor laid out like :math:`q(u)`'s batch, ``(*batch, *event)`` with ``event_dims`` event
        dimensions, that belongs to the branch ``side``: the tensor itself here; a pair selects on its branch dimension
        (``(*batch, 2 or 1, *event)`` -> ``(*batch, *event)``)."""
        check_choice("side", side, self.branch_sides, where=type(self).__name__)
        return tensor

    def select_branch_covariance(self, covariance: LinearOperator | None, side: str) -> LinearOperator | None:
        """The branch ``side`` of a covariance laid out like :math:`q(u)`'s, ``(*batch, s, s)`` (see
        :meth:`select_branch`); the operator itself here."""
        check_choice("side", side, self.branch_sides, where=type(self).__name__)
        return covariance

    def branch_posterior(self, side: str) -> tuple[Tensor, LinearOperator]:
        r"""The mean :math:`m` and covariance :math:`S` of the branch ``side`` of :math:`q(u)`, shapes
        ``(*batch, s)`` and ``(*batch, s, s)`` (a structured operator)."""
        variational = self.variational_distribution
        mean, covariance = variational.mean, variational.lazy_covariance_matrix
        return self.select_branch(mean, side, 1), self.select_branch_covariance(covariance, side)

    def _aligned(self, singular_values: Tensor) -> Tensor:
        r""":math:`\Lambda` of the features, ``(*batch_f, s)``, with singleton dimensions for the outputs (and the
        branches of a pair) so that it broadcasts against :math:`q(u)`'s batch shape."""
        extra = self.num_output_dims + (len(self.branch_sides) > 1)
        return singular_values.reshape(*singular_values.shape[:-1], *(1,) * extra, singular_values.shape[-1])

    # -- GPyTorch's strategy interface ------------------------------------------------------------------------------
    @property
    def inducing_points(self) -> Tensor:
        """The landmarks :math:`Z` (owned by :attr:`features`), shape ``(*batch, M, d)``."""
        landmarks = getattr(self.features, "landmarks", None)
        if landmarks is None:
            raise AttributeError(f"{type(self.features).__name__} has no landmarks: its inducing features are per call")
        return landmarks

    def _clear_cache(self) -> None:
        clear_cache_hook(self)
        if "features" in self._modules and hasattr(self.features, "_clear_cache"):
            self.features._clear_cache()

    @property
    def variational_distribution(self) -> MultivariateNormal:
        r""":math:`q(u)`, not memoised: the attention layers use the strategy outside GPyTorch's ``__call__`` (which
        clears memos in training), and building it costs O(s^2) (O(s^3) for natural parameters)."""
        return self._variational_distribution()

    @property
    def prior_distribution(self) -> MultivariateNormal:
        r""":math:`p(u) = \mathcal N(0, \Lambda^2)`, a ``DiagLinearOperator`` covariance (identity when whitened),
        with :math:`\Lambda` the features' (the last call's for per-sequence exact features) and unit variance for a
        numerically zero direction (:attr:`~gpattn.features.KernelEigenScores.active`: its interpolation column is
        zero, so the KL term of an unused variable vanishes at q = p); O(s), not memoised."""
        features = self.features
        active = features.active_inducing
        variances = prior_variances(
            self._aligned(features.singular_values), None if active is None else self._aligned(active)
        )
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

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        """GPyTorch's ``__call__`` (:math:`q(f(x))`, initialising :math:`q(u)` at the prior on the first call and
        clearing the memos in training; the prior with ``prior=True``) after checking ``x`` once, before anything
        changes (see :meth:`~gpattn.features.KernelEigenFeatures.check_inputs`; errors name the model).

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param prior: Return the prior :math:`p(f(x))` instead.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)`` (a pair: see
            :meth:`~gpattn.variational.KernelEigenPairVariationalStrategy.forward`).
        """
        self.features.check_inputs(x, type(self.model).__name__)
        return super().__call__(x, prior=prior, **kwargs)

    def prior_mean(self, x: Tensor) -> Tensor | float:
        """:math:`\\mu(x)` from ``model.mean_module`` (0 when the model has none), shape ``(*batch, N)``."""
        mean_module = getattr(self.model, "mean_module", None)
        return 0.0 if mean_module is None else mean_module(x)

    def evaluate_features(self, x: Tensor) -> KernelEigenScores:
        """The landmark features at ``x``, shape ``(*batch, N, d)``, for this strategy's branches (with the kernel
        diagonals when the residual is kept), checked by :meth:`__call__`; refreshes the KSVD penalty in training."""
        if self.training and hasattr(self.features, "refresh_ksvd_loss"):
            self.features.refresh_ksvd_loss()
        return self.features(x, sides=self.branch_sides, kernel_diag=self.residual == "diag", check=False)

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
        interp, residual = self.interpolation(self.evaluate_features(x))
        mean, root = self.predictive_terms(interp, inducing_values, variational_inducing_covar)
        if residual is not None:
            residual = residual.expand(mean.shape)
        return MultivariateNormal(mean + self.prior_mean(x), low_rank_plus_diag(root, residual))

    # -- the branch algebra shared by the pair and the attention layers ---------------------------------------------
    def interpolation(self, scores: KernelEigenScores, side: str | None = None) -> tuple[Tensor, Tensor | None]:
        r"""The interpolation term :math:`e \Lambda^{-1}` (:math:`r \Lambda^{-1}` for the right branch; without
        :math:`\Lambda^{-1}` when whitened) of one branch, ``(*batch, *outputs, N, s)``, and its residual diagonal
        (``None`` when ``residual="none"``), ``(*batch, *outputs, N)``.

        :param side: The branch (default: this strategy's ``side``).
        """
        side = self.side if side is None else side
        check_choice("side", side, self.branch_sides, where=type(self).__name__)
        scores = scores.for_outputs(self.num_output_dims)
        residual = scores.residual_diag(side) if self.residual == "diag" else None
        return scores.interp(side, self.whiten), residual

    @staticmethod
    def predictive_terms(
        interp: Tensor, inducing_values: Tensor, variational_inducing_covar: LinearOperator | None
    ) -> tuple[Tensor, Tensor]:
        r"""Mean :math:`A m` and covariance root :math:`A L` (:math:`S = L L^\top`) of :math:`q(f) = \mathcal N(A m, A S
        A^\top)` for the interpolation term :math:`A`, shapes ``(*batch, N)`` and ``(*batch, N, s)`` (the batch is the
        broadcast of :math:`A`'s and :math:`q(u)`'s). A delta :math:`q(u)` has a zero root. O(N s^2)."""
        mean = (interp @ inducing_values.unsqueeze(-1)).squeeze(-1)  # A m
        if variational_inducing_covar is None:
            root = torch.zeros_like(interp[..., :1])
        else:
            root = times_covariance_root(interp, variational_inducing_covar)  # A L
        return mean, root.expand(*mean.shape, root.shape[-1])

    def predictive_parts(
        self, scores: KernelEigenScores, side: str | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        r"""Mean, covariance root and residual diagonal of :math:`q(f)` of one branch at the inputs of one call of the
        features (e.g. the tokens of a sequence), without the prior mean: shapes ``(*batch, *outputs, N)``,
        ``(*batch, *outputs, N, s)`` and ``(*batch, *outputs, N)`` or ``None`` -- the algebra of :meth:`forward`."""
        side = self.side if side is None else side
        interp, residual = self.interpolation(scores, side)
        mean, root = self.predictive_terms(interp, *self.branch_posterior(side))
        return mean, root, None if residual is None else residual.expand(mean.shape)

    def predictive(self, scores: KernelEigenScores, side: str | None = None) -> MultivariateNormal:
        r""":math:`q(f)` of one branch (default: ``side``) at the inputs of one call of the features, without the prior
        mean: a batch ``(*batch, *outputs)`` of distributions over ``N`` points with a low-rank-plus-diagonal
        covariance (see :meth:`predictive_parts`)."""
        mean, root, residual = self.predictive_parts(scores, side)
        return MultivariateNormal(mean, low_rank_plus_diag(root, residual))

    def inducing_draw(self, sample_shape: torch.Size | None = None) -> Tensor:
        r"""The mean :math:`m` of :math:`q(u)` (``sample_shape=None``), or joint reparameterised draws
        :math:`u = m + L \varepsilon`, shape ``(*sample_shape, *batch, s)``. Branches that share a posterior share the
        draw."""
        variational = self.variational_distribution
        if sample_shape is None:
            return variational.mean
        noise = torch.randn(
            (*sample_shape, *variational.mean.shape), dtype=variational.mean.dtype, device=variational.mean.device
        )
        return reparameterised_draw(variational.mean, variational.lazy_covariance_matrix, noise)

    def linear_coefficients(
        self,
        side: str,
        inducing_values: Tensor,
        weights: Tensor,
        singular_values: Tensor,
        active: Tensor | None = None,
    ) -> Tensor:
        r"""The coefficients of a linear map of the outputs: with :math:`F_c(x) = e(x) \Lambda^{-1} u_c` over the
        last output dimension :math:`c` and a map :math:`W` (``(*batch, d_out, C)``),

        .. math::

            \sum_c F_c(x) W_c = e(x)\, A, \qquad A = \Lambda^{-1} \textstyle\sum_c u_c W_c
            \quad (\text{whitened: } \textstyle\sum_c u_c W_c),

        so that the outputs are never formed: ``(*sample, *batch, s, C)`` coefficients, then one product with the
        scores. O(d_out s C) per batch element.

        :param side: The branch.
        :param inducing_values: :meth:`inducing_draw` (mean or draws), ``(*sample, *batch, d_out[, branches], s)``.
        :param weights: :math:`W`, shape ``(*batch, d_out, C)``.
        :param singular_values: :math:`\Lambda` of the call, shape ``(*batch', s)``.
        :param active: The call's numerically nonzero directions (:attr:`~gpattn.features.KernelEigenScores.active`),
            shape ``(*batch', s)``, or ``None``: an inactive direction's coefficients are zero, as its interpolation
            column is.
        """
        if self.num_output_dims != 1:
            raise ValueError(f"linear_coefficients maps one output dimension, this strategy has {self.num_output_dims}")
        values = self.select_branch(inducing_values, side, 1)  # (*sample, *batch, d_out, s)
        coefficients = values.mT @ weights  # sum_c u_c W_c; (*sample, *batch, s, C)
        if not self.whiten:
            coefficients = coefficients / singular_values.unsqueeze(-1)
        return coefficients if active is None else torch.where(active.unsqueeze(-1), coefficients, 0.0)

    def initialize_at_prior_draw(self, singular_values: Tensor, covariance_scale: float = 0.1) -> None:
        r"""Set :math:`q(u) = \mathcal N(m_0, c^2 \Lambda^2)` with a draw :math:`m_0 \sim \mathcal N(0, \Lambda^2)` of
        the (unwhitened) prior: :math:`\Lambda^{-1} m_0` then acts like a random projection, so the outputs start
        away from zero, and the posterior starts tighter than the prior (:math:`c` = ``covariance_scale``).

        :param singular_values: The :math:`\Lambda` to scale with, ``(*batch_f, s)`` (e.g. ones when the prior is
            per call).
        :param covariance_scale: :math:`c > 0`.
        """
        check_float("covariance_scale", covariance_scale, 0.0, strict_minimum=True, where=type(self).__name__)
        distribution = self._variational_distribution
        with torch.no_grad():
            scale = (
                self._aligned(singular_values)
                .to(distribution.variational_mean)
                .expand_as(distribution.variational_mean)
            )
            distribution.variational_mean.copy_(scale * torch.randn_like(scale))
            if isinstance(distribution, CholeskyVariationalDistribution):
                distribution.chol_variational_covar.copy_(torch.diag_embed(covariance_scale * scale))
            elif isinstance(distribution, MeanFieldVariationalDistribution):
                distribution._variational_stddev.copy_(covariance_scale * scale)
            else:
                raise TypeError(
                    "initialize_at_prior_draw needs a Cholesky or mean-field variational distribution, got "
                    f"{type(distribution).__name__}"
                )
        self.variational_params_initialized.fill_(1)
