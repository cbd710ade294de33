"""The kernel-eigen variational strategy: one branch of the KEP-SVGP pair, with a diagonal K_uu."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.module import Module
from gpytorch.utils.memoize import clear_cache_hook
from gpytorch.variational import CholeskyVariationalDistribution, _VariationalDistribution
from gpytorch.variational._variational_strategy import _VariationalStrategy
from linear_operator.operators import DiagLinearOperator, LinearOperator
from torch import Tensor

from .._module_state import GraphFreeState
from .._torch_compat import autocast_enabled, compilable
from ..features import KernelEigenFeatures, KernelEigenFeaturesBase, KernelEigenScores
from ..kernels import AsymmetricKernel
from ..validation import InputTypeError, check_bool, check_choice, check_float, check_int
from .cholesky_prior_kl import CholeskyPriorKL
from .structured_covariance import diagonal_prior_kl, low_rank_plus_diag, times_covariance_root

# the closed-form KL as torch.compile should meet it (gpattn._torch_compat.compilable: a graph break on torch < 2.4)
_cholesky_prior_kl = compilable(CholeskyPriorKL.apply)

SIDES = ("left", "right")
RESIDUALS = ("none", "diag")


class _CovarModuleOf:
    """Picklable zero-argument callable returning ``model.covar_module`` (read lazily: strategies are built
    before the model's modules exist), checked to be an asymmetric kernel.

    :raises TypeError: The model has no ``covar_module``, or one that is not a gpattn
        :class:`~gpattn.kernels.AsymmetricKernel` (e.g. a GPyTorch kernel). Not an ``AttributeError``: the features
        read the kernel inside properties, where ``torch.nn.Module`` would replace it by "no attribute
        'singular_values'".
    """

    def __init__(self, model: ApproximateGP):
        self.model = model

    def __call__(self) -> AsymmetricKernel:
        kernel = getattr(self.model, "covar_module", None)
        if not isinstance(kernel, AsymmetricKernel):
            raise TypeError(
                f"{type(self.model).__name__}: KernelEigenVariationalStrategy reads its kernel from "
                f"model.covar_module, which must be an AsymmetricKernel (gpattn.kernels), got {type(kernel).__name__}; "
                "or give the strategy features=..."
            )
        return kernel


def _same_landmarks(given: Tensor, own: Tensor | None) -> bool:
    # whether landmarks given to a strategy are the features' own (the same tensor, or equal values); O(M d)
    if own is None:
        return False
    if given is own:
        return True
    if not isinstance(given, Tensor):
        return False
    if given.shape != own.shape or "meta" in (given.device.type, own.device.type):
        return given.shape == own.shape
    return torch.equal(given.detach().to(own), own.detach())


def _described(value: object) -> str:
    return f"of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"of type {type(value).__name__}"


class KernelEigenVariationalStrategy(GraphFreeState, _VariationalStrategy):
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

    The surface is GPyTorch's: ``strategy(x)`` (:meth:`__call__`/:meth:`forward`), :attr:`prior_distribution`,
    :attr:`variational_distribution`, :meth:`kl_divergence`. The features can be any
    :class:`~gpattn.features.KernelEigenFeaturesBase`: the landmark :class:`~gpattn.features.KernelEigenFeatures` of
    GP models (the default, built over ``model.covar_module`` and ``inducing_points``; ``strategy(x)`` evaluates
    them), or the per-sequence :class:`~gpattn.features.AttentionKernelEigenFeatures` of the attention layers, which
    evaluate the features themselves and read the strategy's :math:`q(f)` at the scores of each call through a
    :class:`~gpattn.variational.KernelEigenReadout`. When the features' :math:`\Lambda` belongs to each call
    (:attr:`~gpattn.features.KernelEigenFeaturesBase.spectrum_per_call`), the KL is that of a call's scores
    (:meth:`kl_divergence` with ``scores``). ``num_output_dims`` trailing batch dimensions of :math:`q(u)` may index
    independent outputs that share the features (GPyTorch's batch-independent multi-output idiom; e.g. the ``d_out``
    outputs of an attention head): the features' batch then aligns with the batch dimensions in front of them.

    ``_VariationalStrategy.__init__`` is not called: it would register a copy of ``inducing_points`` on the strategy,
    while the landmarks belong to the (possibly shared) features (so that a tied pair registers each parameter once;
    attention features have none). Everything else it sets up is set up here alike (``model``, the variational
    distribution, ``variational_params_initialized``, the jitter); :attr:`inducing_points` reads the features'.

    Example:
        >>> from gpytorch.models import ApproximateGP
        >>> from gpytorch.variational import CholeskyVariationalDistribution
        >>> from gpattn.kernels import ShiftedRBFKernel
        >>> class BranchGP(ApproximateGP):
        ...     def __init__(self, landmarks):
        ...         q_u = CholeskyVariationalDistribution(4)
        ...         super().__init__(KernelEigenVariationalStrategy(self, landmarks, q_u, side="left"))
        ...         self.covar_module = ShiftedRBFKernel(input_dim=1)
        >>> model = BranchGP(torch.linspace(-2, 2, 8).unsqueeze(-1))
        >>> q_f = model(torch.linspace(-3, 3, 5).unsqueeze(-1))  # q(f_e) at 5 points
        >>> q_f.mean.shape, model.variational_strategy.prior_distribution.covariance_matrix.shape
        (torch.Size([5]), torch.Size([4, 4]))
        >>> kl = model.variational_strategy.kl_divergence()  # q(u) starts at the prior (GPyTorch jitters m by 1e-3)
        >>> kl.shape, bool(kl < 1e-4)
        (torch.Size([]), True)

    :param model: The owning model (an :class:`~gpytorch.models.ApproximateGP` whose ``covar_module`` is an
        :class:`~gpattn.kernels.AsymmetricKernel`, or an attention layer).
    :param inducing_points: Landmarks :math:`Z`, shape ``(*batch, M, d)`` (``None`` when ``features`` are given, or
        the features' own landmarks: others raise a ``ValueError``).
    :param variational_distribution: :math:`q(u)` over ``s`` inducing variables.
    :param side: ``"left"`` (:math:`e`, queries) or ``"right"`` (:math:`r`, keys).
    :param learn_inducing_locations: Learn the landmarks (of the default features; given ``features`` decide it
        themselves).
    :param whiten: Parametrise :math:`q(v)` with :math:`u = \Lambda v`.
    :param residual: ``"none"`` or ``"diag"``.
    :param features: Shared kernel-eigen features (e.g. the other branch's, a ``primal``-mode
        :class:`~gpattn.features.KernelEigenFeatures`, or an attention layer's); by default exact-mode landmark
        features over ``model.covar_module`` and the landmarks.
    :param jitter_val: Accepted for GPyTorch's signature and unused: :math:`K_{uu} = \Lambda^2` is diagonal and
        inverted exactly, with no Cholesky factor to stabilise (``None`` or a non-negative number).
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
        whiten = check_bool("whiten", whiten, where=where)
        learn_inducing_locations = check_bool("learn_inducing_locations", learn_inducing_locations, where=where)
        if jitter_val is not None:
            jitter_val = check_float("jitter_val", jitter_val, 0.0, where=where)
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
        # what _VariationalStrategy.__init__ sets up, but the copy of the inducing points (see the class docstring)
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
        elif inducing_points is not None and not _same_landmarks(inducing_points, features.inducing_points):
            # the features own the landmarks: other ones given here would be ignored without a word
            own = features.inducing_points
            theirs = "have none (per-call features)" if own is None else f"have landmarks of shape {tuple(own.shape)}"
            raise ValueError(
                f"{where}: got inducing_points {_described(inducing_points)} that are not the landmarks of "
                f"the features given, which own the landmarks used (they {theirs}): give inducing_points=None or the "
                "features' landmarks"
            )
        self.features = features
        self.side = side
        self.whiten = whiten
        self.residual = residual
        self.num_output_dims = num_output_dims
        # (a pair checks its branch dimension and the outputs in front of it itself)
        if len(self._branch_sides) == 1 and len(variational_distribution.batch_shape) < num_output_dims:
            raise ValueError(
                f"{where}: num_output_dims={num_output_dims} trailing batch dimensions of q(u) index the outputs, but "
                f"the variational distribution has batch shape {tuple(variational_distribution.batch_shape)}"
            )

    # -- GPyTorch's strategy interface ------------------------------------------------------------------------------
    @property
    def inducing_points(self) -> Tensor:
        """The landmarks :math:`Z` (owned by :attr:`features`), shape ``(*batch, M, d)``."""
        landmarks = self.features.inducing_points
        if landmarks is None:
            raise AttributeError(self._no_landmarks())
        return landmarks

    def _no_landmarks(self) -> str:
        return f"{type(self.features).__name__} has no landmarks: its inducing features are per call"

    def __getattr__(self, name: str):
        # torch.nn.Module's lookup of parameters, buffers and submodules, which Python also calls when a property raised
        # an AttributeError and whose "object has no attribute 'inducing_points'" would replace the property's reason
        if name == "inducing_points":
            raise AttributeError(f"{type(self).__name__}.inducing_points: {self._no_landmarks()}")
        return super().__getattr__(name)

    def _clear_cache(self) -> None:
        clear_cache_hook(self)
        if "features" in self._modules:  # (not yet while the strategy is being built)
            self.features._clear_cache()

    @property
    def variational_distribution(self) -> MultivariateNormal:
        r""":math:`q(u)`, not memoised: the attention layers use the strategy outside GPyTorch's ``__call__`` (which
        clears memos in training), and building it costs O(s^2) (O(s^3) for natural parameters)."""
        return self._variational_distribution()

    @property
    def prior_distribution(self) -> MultivariateNormal:
        r""":math:`p(u) = \mathcal N(0, \Lambda^2)`, a ``DiagLinearOperator`` covariance (identity when whitened), with
        :math:`\Lambda` the features' and unit variance for a numerically zero direction
        (:attr:`~gpattn.features.KernelEigenScores.active`: its interpolation column is zero, so the KL term of an
        unused variable vanishes at q = p); O(s), not memoised. Raises ``RuntimeError`` for features whose
        :math:`\Lambda` belongs to each call (see :meth:`kl_divergence`)."""
        variances = self._prior_variances()
        return MultivariateNormal(torch.zeros_like(variances), DiagLinearOperator(variances))

    def kl_divergence(self, scores: KernelEigenScores | None = None) -> Tensor:
        r""":math:`\mathrm{KL}(q(u) \| p(u))` in closed form against the diagonal prior (no solve with :math:`K_{uu}`):
        O(s) for the prior terms and a mean-field :math:`q`, O(s^2) for a Cholesky :math:`q`; for a delta :math:`q(u)`
        (``DeltaVariationalDistribution``, MAP) GPyTorch's :math:`-\log p(m)`, O(s).

        :param scores: The features of one call, whose :math:`\Lambda` (and active directions) make the prior: needed
            when the features' spectrum belongs to each call (exact attention features), else ``None`` (the
            features' own :math:`\Lambda`, as GPyTorch's ``kl_divergence()``).
        :return: shape ``(*batch)``, with the batch of the call's :math:`\Lambda` in front when it has one (e.g.
            ``(B, *q_batch)`` for exact attention features).
        """
        distribution = self._variational_distribution
        if type(distribution) is CholeskyVariationalDistribution:  # from its parameters, by one fused function
            mean, factor = distribution.variational_mean, distribution.chol_variational_covar
            return _cholesky_prior_kl(mean, factor, self._prior_scales(scores))
        variational = distribution()
        # a delta q(u) (GPyTorch's Delta, not a MultivariateNormal) has no covariance
        covariance = variational.lazy_covariance_matrix if isinstance(variational, MultivariateNormal) else None
        return diagonal_prior_kl(variational.mean, covariance, self._prior_variances(scores))

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        """GPyTorch's ``__call__`` (:math:`q(f(x))`, initialising :math:`q(u)` at the prior on the first call and
        clearing the memos in training; the prior with ``prior=True``) after checking ``x`` once, before anything
        changes (see :meth:`~gpattn.features.KernelEigenFeatures.check_inputs`; errors name the model).

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param prior: Return the prior :math:`p(f(x))` instead.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)`` (a pair: see
            :meth:`~gpattn.variational.KernelEigenPairVariationalStrategy.forward`).
        """
        if self.features.inducing_points is None:  # GPyTorch's __call__ reads the landmarks
            raise RuntimeError(
                f"{type(self).__name__}: calling the strategy evaluates landmark features, but {self._no_landmarks()} "
                "(its layer evaluates them): read q(f) at the scores of a call, KernelEigenReadout.predictive(scores, "
                "side)"
            )
        self.features.check_inputs(x, type(self.model).__name__)
        variational = next(self._variational_distribution.parameters(), None)
        # a kernel may promote mixed dtypes, q(u)'s products do not (autocast mixes them on purpose); outside autocast
        # check_inputs has matched x to the landmarks
        if variational is not None and variational.dtype != x.dtype and not autocast_enabled(x.device.type):
            raise InputTypeError(
                f"{type(self.model).__name__}: x and the landmarks are {x.dtype} but q(u) is {variational.dtype}: cast "
                f"the model (model.to({x.dtype})) or the inputs"
            )
        if not prior and not self.variational_params_initialized.item() and self.features.inducing_points is not None:
            self._check_prior_batch()
        return super().__call__(x, prior=prior, **kwargs)

    def _check_prior_batch(self) -> None:
        # GPyTorch starts q(u) at p(u) by copying the prior's parameters into q(u)'s: with landmarks of a batch q(u)
        # lacks, each batch member has its own Lambda and one q(u) cannot start at all of them
        q_batch = self._variational_distribution.batch_shape
        try:
            prior_batch = self._prior_variances().shape[:-1]
        except RuntimeError:  # not even broadcastable
            prior_batch = None
        if prior_batch != q_batch:
            landmark_batch = tuple(self.features.landmarks.shape[:-2])
            prior = (
                "a prior p(u) not broadcastable to q(u)"
                if prior_batch is None
                else f"p(u) of batch {tuple(prior_batch)}"
            )
            branches = " (its last dimension: the pair's branches)" if len(self._branch_sides) > 1 else ""
            raise ValueError(
                f"{type(self.model).__name__}: the landmarks of batch shape {landmark_batch} give {prior}, which "
                f"q(u) of batch shape {tuple(q_batch)}{branches} cannot start at (GPyTorch starts q(u) at the "
                "prior): give q(u) the landmarks' batch shape (e.g. KernelEigenPairSVGP(..., batch_shape=...)), or "
                "landmarks without a batch"
            )

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
        scores = self._evaluate_features(x)
        mean, root, residual = self._predictive_parts(scores, self.side, inducing_values, variational_inducing_covar)
        return MultivariateNormal(mean + self._prior_mean(x), low_rank_plus_diag(root, residual))

    # -- the algebra shared by the pair and the readout (package-internal) ------------------------------------------
    @property
    def _branch_sides(self) -> tuple[str, ...]:
        # the sides of the branches of q(u): (side,) here, ("left", "right") for a pair
        return (self.side,)

    def _select_branch(self, tensor: Tensor, side: str, event_dims: int) -> Tensor:
        # the part of a tensor laid out like q(u)'s batch, (*batch, *event) with event_dims event dimensions, that
        # belongs to the branch `side`: the tensor itself here; a pair selects on its branch dimension
        check_choice("side", side, self._branch_sides, where=type(self).__name__)
        return tensor

    def _select_branch_covariance(self, covariance: LinearOperator | None, side: str) -> LinearOperator | None:
        # the branch `side` of a covariance laid out like q(u)'s, (*batch, s, s): the operator itself here
        check_choice("side", side, self._branch_sides, where=type(self).__name__)
        return covariance

    @property
    def _aligned_dims(self) -> int:
        # the singleton dimensions that align Lambda with q(u)'s batch: the outputs (and the branches of a pair)
        return self.num_output_dims + (len(self._branch_sides) > 1)

    def _aligned(self, tensor: Tensor) -> Tensor:
        # Lambda (or its active directions) of the features, (*batch_f, s), with singleton dimensions for the outputs
        # (and the branches of a pair) so that it broadcasts against q(u)'s batch shape
        return tensor.reshape(*tensor.shape[:-1], *(1,) * self._aligned_dims, tensor.shape[-1])

    def _prior_scales(self, scores: KernelEigenScores | None = None, aligned: bool = True) -> Tensor:
        # the prior standard deviations Lambda (1 for an inactive direction, all 1 when whitened), from a call's scores
        # or from the features; aligned with q(u)'s batch (broadcastable to it), or in Lambda's shape
        if scores is None:
            singular_values, active = self.features.singular_values, self.features.active_inducing
        else:
            singular_values, active = scores.singular_values, scores.active
        if self.whiten:
            scales = torch.ones_like(singular_values)
        else:
            scales = singular_values if active is None else torch.where(active, singular_values, 1.0)
        return self._aligned(scales) if aligned else scales

    def _prior_variances(self, scores: KernelEigenScores | None = None) -> Tensor:
        # the prior variances Lambda^2 (1 for an inactive direction, all 1 when whitened) broadcast to q(u)'s batch
        variances = self._prior_scales(scores).pow(2)
        batch_shape = torch.broadcast_shapes(variances.shape[:-1], self._variational_distribution.batch_shape)
        return variances.expand(*batch_shape, variances.shape[-1])

    def _prior_mean(self, x: Tensor) -> Tensor | float:
        # mu(x) from model.mean_module (0 when the model has none), shape (*batch, N)
        mean_module = getattr(self.model, "mean_module", None)
        return 0.0 if mean_module is None else mean_module(x)

    def _evaluate_features(self, x: Tensor) -> KernelEigenScores:
        # the landmark features at x for this strategy's branches (with the kernel diagonals when the residual is
        # kept), checked by __call__; refreshes the KSVD penalty (in eval mode too: an mll read there, e.g. a validation
        # loss, must see the current eta J^2, not the last training step's; O(M p s))
        self.features.refresh_ksvd_loss()
        return self.features(x, sides=self._branch_sides, kernel_diag=self.residual == "diag", check=False)

    def _interpolation(self, scores: KernelEigenScores, side: str) -> tuple[Tensor, Tensor | None]:
        # the interpolation term e Lambda^{-1} (r Lambda^{-1} for the right branch; without Lambda^{-1} when
        # whitened) of one branch, (*batch, *outputs, N, s), and its residual diagonal (None when residual="none"),
        # (*batch, *outputs, N)
        check_choice("side", side, self._branch_sides, where=type(self).__name__)
        scores = scores.for_outputs(self.num_output_dims)
        residual = scores.residual_diag(side) if self.residual == "diag" else None
        return scores.interp(side, self.whiten), residual

    def _predictive_parts(
        self,
        scores: KernelEigenScores,
        side: str,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        # mean A m, covariance root A L (S = L L^T; zero for a delta q(u)) and residual diagonal of q(f) of one branch
        # for the interpolation term A of the scores, shapes (*batch, N), (*batch, N, s), (*batch, N) or None (the
        # batch is the broadcast of A's and q(u)'s), without the prior mean. O(N s^2)
        interp, residual = self._interpolation(scores, side)
        mean = (interp @ inducing_values.unsqueeze(-1)).squeeze(-1)  # A m
        if variational_inducing_covar is None:
            root = torch.zeros_like(interp[..., :1])
        else:
            root = times_covariance_root(interp, variational_inducing_covar)  # A L
        root = root.expand(*mean.shape, root.shape[-1])
        return mean, root, None if residual is None else residual.expand(mean.shape)
