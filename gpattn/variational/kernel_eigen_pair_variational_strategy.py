"""The paired (left/right) kernel-eigen variational strategy of KEP-SVGP: both branches on one batch dimension."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.module import Module
from gpytorch.variational import (
    IndependentMultitaskVariationalStrategy,
    LMCVariationalStrategy,
    _VariationalDistribution,
)
from linear_operator.operators import LinearOperator
from torch import Tensor

from ..features import KernelEigenFeaturesBase, KernelEigenScores
from ..validation import check_bool, check_choice
from .kernel_eigen_variational_strategy import SIDES, KernelEigenVariationalStrategy
from .structured_covariance import low_rank_plus_diag

MERGES = ("sum", "concat")


class TaskMajorMultitaskNormal(MultitaskMultivariateNormal):
    r"""GPyTorch's :class:`~gpytorch.distributions.MultitaskMultivariateNormal` with a task-major covariance
    (``interleaved=False``: the two branches' blocks), whose :meth:`log_prob` reads its ``(*batch, N, T)`` value in
    that order.

    GPyTorch 1.15's ``log_prob`` of a non-interleaved distribution reorders the value with ``view`` before its
    transpose, which pairs targets with the wrong entries of the mean and covariance (also for its own
    ``from_independent_mvns``: -15.98 against the independent MVNs' -15.79 on 4 points and 2 tasks), so
    ``likelihood(model(x)).log_prob(y)`` and ``gpytorch.metrics.negative_log_predictive_density`` of a
    ``merge="concat"`` model were wrong while its moments and samples were right. Here the value is flattened task by
    task, as the covariance is. ``likelihood(...)`` keeps the class (GPyTorch's multitask likelihoods rebuild the
    distribution with ``function_dist.__class__``). Cost: that of GPyTorch's ``MultivariateNormal.log_prob``.
    """

    def log_prob(self, value: Tensor) -> Tensor:
        if self._interleaved:
            return super().log_prob(value)
        # (*batch, N, T) -> (*batch, T N), task-major as the covariance
        return MultivariateNormal.log_prob(self, value.transpose(-1, -2).reshape(*value.shape[:-2], -1))


class KernelEigenPairVariationalStrategy(KernelEigenVariationalStrategy):
    r"""The two kernel-eigen branches of KEP-SVGP over one set of features, stacked on the last batch dimension of
    :math:`q(u)` and merged (docs/math.md section 3).

    As GPyTorch's :class:`~gpytorch.variational.BatchDecoupledVariationalStrategy` stacks its two inducing sets on a
    batch dimension, this strategy is the single-branch :class:`KernelEigenVariationalStrategy` whose
    :math:`q(u)` has batch shape ``(*batch, 2)``: ``[..., 0, :]`` is the left branch's :math:`u_e` (scores
    :math:`e`, prior :math:`\mathcal N(0, \Lambda^2)`), ``[..., 1, :]`` the right branch's :math:`u_r` (scores
    :math:`r`, the same prior). The features are evaluated once for both branches, their interpolation terms are
    stacked on that dimension, and the single strategy's algebra gives both :math:`q(f_e)` and :math:`q(f_r)` at
    once; only the merge is new:

    * ``merge="sum"``: :math:`F = F_e + F_r`. Independent posteriors add their covariances (the roots are
      concatenated), and the KL is :math:`\mathrm{KL}_e + \mathrm{KL}_r` (as ``_DeepGPVariationalStrategy`` sums its
      sub-strategies).
    * ``merge="concat"``: the two outputs side by side, a
      :class:`~gpytorch.distributions.MultitaskMultivariateNormal` with two tasks (left, right).
    * ``shared_posterior=True`` (the official KEP-SVGP code): both branches use the *same* :math:`q(u)`, a batch
      shape ``(*batch, 1)`` broadcast over the two branches, so :math:`F = (e + r)\Lambda^{-1} u` for ``"sum"``
      (the roots add) and there is one KL.

    GPyTorch's multi-output wrappers (:class:`~gpytorch.variational.IndependentMultitaskVariationalStrategy`,
    :class:`~gpytorch.variational.LMCVariationalStrategy`) take single-branch strategies only: their KL is GPyTorch's
    generic one of ``variational_distribution`` and ``prior_distribution``, which would not sum the branch dimension,
    so a wrapped pair raises ``NotImplementedError`` on its first call. For :math:`T` independent outputs, give the
    model a batch of outputs (``KernelEigenPairSVGP(..., batch_shape=(T,))``, :math:`q(u)` of batch ``(T, 2)``), a
    likelihood of that batch (``GaussianLikelihood(batch_shape=(T,))``) and targets ``y.mT`` of shape ``(T, N)``: the
    ELBO of output :math:`t` is entry :math:`t` of ``VariationalELBO``'s, to be summed.

    :param model: The owning model (its ``mean_module`` adds a prior mean to the merged output).
    :param inducing_points: Landmarks, shape ``(*batch, M, d)`` (``None`` when ``features`` are given, or the
        features' own landmarks).
    :param variational_distribution: :math:`q(u)` with batch shape ``(*batch, 2)`` (``(*batch, 1)`` with
        ``shared_posterior=True``).
    :param learn_inducing_locations: Learn the landmarks (of the default features).
    :param merge: ``"sum"`` or ``"concat"``.
    :param shared_posterior: One :math:`q(u)` for both branches.
    :param whiten: Parametrise :math:`q(v)` with :math:`u = \Lambda v`.
    :param residual: ``"none"`` or ``"diag"``.
    :param features: Shared kernel-eigen features (default: exact-mode landmark features, see
        :class:`KernelEigenVariationalStrategy`).
    :param num_output_dims: Batch dimensions of :math:`q(u)` before the branch dimension that index outputs sharing
        the features.

    Example:
        >>> from gpytorch.variational import CholeskyVariationalDistribution
        >>> from gpattn.features import KernelEigenFeatures
        >>> from gpattn.kernels import ShiftedRBFKernel
        >>> landmarks = torch.linspace(-2, 2, 8).unsqueeze(-1)
        >>> features = KernelEigenFeatures(ShiftedRBFKernel(input_dim=1), landmarks, num_inducing=4)  # shared
        >>> q_u = CholeskyVariationalDistribution(4, batch_shape=torch.Size([2]))  # (left, right)
        >>> model = torch.nn.Module()  # the owner (its mean_module, if any, is the prior mean)
        >>> strategy = KernelEigenPairVariationalStrategy(model, None, q_u, merge="concat", features=features)
        >>> x = torch.linspace(-3, 3, 5).unsqueeze(-1)
        >>> strategy(x).mean.shape, strategy.branch(x, "right").mean.shape  # [F_e, F_r]; F_r alone
        (torch.Size([5, 2]), torch.Size([5]))
        >>> strategy.kl_divergence().shape  # KL_e + KL_r
        torch.Size([])

    .. note:: Cost: one feature evaluation for both branches plus O(N s^2); the KL is O(s) for the prior part.
    """

    def __init__(
        self,
        model: ApproximateGP | Module,
        inducing_points: Tensor | None,
        variational_distribution: _VariationalDistribution,
        learn_inducing_locations: bool = True,
        merge: str = "sum",
        shared_posterior: bool = False,
        whiten: bool = False,
        residual: str = "diag",
        features: KernelEigenFeaturesBase | None = None,
        jitter_val: float | None = None,
        num_output_dims: int = 0,
    ):
        super().__init__(
            model,
            inducing_points,
            variational_distribution,
            side="left",
            learn_inducing_locations=learn_inducing_locations,
            whiten=whiten,
            residual=residual,
            features=features,
            jitter_val=jitter_val,
            num_output_dims=num_output_dims,
        )
        where = type(self).__name__
        check_choice("merge", merge, MERGES, where=where)
        shared_posterior = check_bool("shared_posterior", shared_posterior, where=where)  # "no" would read as true
        branches = 1 if shared_posterior else 2
        batch_shape = variational_distribution.batch_shape
        if len(batch_shape) < 1 + num_output_dims or batch_shape[-1] != branches:
            raise ValueError(
                f"{where}: expected a variational distribution with batch shape (*batch, {branches}) (the last "
                f"dimension indexes the branches{'; one shared posterior' if shared_posterior else ': left, right'}), "
                f"got {tuple(batch_shape)}"
            )
        self.merge = merge
        self.shared_posterior = shared_posterior

    @property
    def _branch_sides(self) -> tuple[str, ...]:
        return SIDES

    def _select_branch(self, tensor: Tensor, side: str, event_dims: int) -> Tensor:
        # a selection on the branch dimension (*batch, 2 or 1) in front of the event dimensions (the one shared
        # posterior for both sides when it has size 1)
        check_choice("side", side, SIDES, where=type(self).__name__)
        dim = tensor.dim() - 1 - event_dims
        return tensor.select(dim, 0 if tensor.shape[dim] == 1 else SIDES.index(side))

    def _select_branch_covariance(self, covariance: LinearOperator | None, side: str) -> LinearOperator | None:
        # the branch of a covariance laid out like q(u)'s, (*batch, 2 or 1, s, s)
        check_choice("side", side, SIDES, where=type(self).__name__)
        if covariance is None:
            return None
        return covariance[..., 0 if covariance.shape[-3] == 1 else SIDES.index(side), :, :]

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        """As :meth:`KernelEigenVariationalStrategy.__call__`, after refusing a multi-output wrapper of GPyTorch around
        the pair (see the class docstring).

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param prior: Return the prior :math:`p(f(x))` instead.
        :return: The merged :math:`q(f(x))` (see :meth:`forward`): mean shape ``(*batch, N)`` (``"sum"``) or
            ``(*batch, N, 2)`` (``"concat"``).
        :raises NotImplementedError: Inside GPyTorch's ``IndependentMultitaskVariationalStrategy`` or
            ``LMCVariationalStrategy``.
        """
        outer = getattr(self.model, "variational_strategy", None)
        if isinstance(outer, (IndependentMultitaskVariationalStrategy, LMCVariationalStrategy)):
            raise NotImplementedError(
                f"{type(self).__name__} inside {type(outer).__name__}: GPyTorch's multi-output wrappers take "
                "single-branch strategies (their generic KL would not sum the pair's branch dimension): wrap "
                "KernelEigenVariationalStrategy, or give the pair a batch of outputs (see its docstring)"
            )
        return super().__call__(x, prior=prior, **kwargs)

    def kl_divergence(self, scores: KernelEigenScores | None = None) -> Tensor:
        r""":math:`\mathrm{KL}_e + \mathrm{KL}_r` (one KL with a shared posterior), shape ``(*batch)``: the single
        strategy's closed form on the stacked :math:`q(u)`, summed over the branch dimension.

        :param scores: The features of one call whose :math:`\Lambda` makes the prior, or ``None`` (the features'
            own; see :meth:`KernelEigenVariationalStrategy.kl_divergence`).
        """
        return super().kl_divergence(scores).sum(-1)

    def forward(
        self,
        x: Tensor,
        inducing_points: Tensor,
        inducing_values: Tensor,
        variational_inducing_covar: LinearOperator | None = None,
        diag: bool = True,
        merge_branches: bool = True,
        **kwargs,
    ) -> MultivariateNormal:
        r"""The merged posterior :math:`q(F(x))` (called through GPyTorch's ``__call__``: call the strategy or the
        model, not this method).

        :param merge_branches: Merge (default), or return the stacked branches :math:`q(f_e(x))`, :math:`q(f_r(x))`
            as a batch ``(*batch, 2)`` of distributions over ``N`` points, without the prior mean.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` over ``N`` points (``"sum"``; mean shape
            ``(*batch, N)``) or a two-task :class:`~gpytorch.distributions.MultitaskMultivariateNormal` (``"concat"``;
            mean shape ``(*batch, N, 2)``), with a low-rank-plus-diagonal covariance.
        """
        scores = self._evaluate_features(x)
        means, roots, residuals = [], [], []
        for side in SIDES:  # the single strategy's algebra, once per branch of the stacked q(u)
            branch_mean = self._select_branch(inducing_values, side, 1)
            branch_covar = self._select_branch_covariance(variational_inducing_covar, side)
            mean, root, residual = self._predictive_parts(scores, side, branch_mean, branch_covar)
            means.append(mean)
            roots.append(root)
            residuals.append(residual)
        if not merge_branches:
            residual = None if residuals[0] is None else torch.stack(residuals, dim=-2)
            return MultivariateNormal(torch.stack(means, -2), low_rank_plus_diag(torch.stack(roots, -3), residual))
        (left_mean, right_mean), (left_root, right_root), residual = means, roots, residuals
        prior_mean = self._prior_mean(x)
        if self.merge == "sum":
            # shared u: (A_e + A_r) L; independent: [A_e L_e, A_r L_r], whose product adds the covariances
            summed_root = left_root + right_root if self.shared_posterior else torch.cat([left_root, right_root], -1)
            summed_residual = None if residual[0] is None else residual[0] + residual[1]
            covariance = low_rank_plus_diag(summed_root, summed_residual)
            return MultivariateNormal(left_mean + right_mean + prior_mean, covariance)
        if self.shared_posterior:  # one u: the tasks are correlated
            joint_root = torch.cat([left_root, right_root], dim=-2)  # (*batch, 2N, s)
        else:  # block-diagonal root: independent tasks
            zeros = torch.zeros_like(left_root)
            joint_root = torch.cat(
                [torch.cat([left_root, zeros], dim=-1), torch.cat([zeros, right_root], dim=-1)], dim=-2
            )
        joint_residual = None if residual[0] is None else torch.cat(residual, dim=-1)  # (*batch, 2N)
        task_mean = torch.stack([left_mean, right_mean], dim=-1)  # shape: (*batch, N, 2)
        if torch.is_tensor(prior_mean):
            task_mean = task_mean + prior_mean.unsqueeze(-1)
        return TaskMajorMultitaskNormal(task_mean, low_rank_plus_diag(joint_root, joint_residual), interleaved=False)

    def branch(self, x: Tensor, side: str) -> MultivariateNormal:
        r""":math:`q(f_e(x))` (``side="left"``) or :math:`q(f_r(x))` (``"right"``) alone, without the prior mean.

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param side: ``"left"`` or ``"right"``.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)``.
        """
        check_choice("side", side, SIDES, where=type(self).__name__)
        stacked = self(x, merge_branches=False)
        index = SIDES.index(side)
        return MultivariateNormal(stacked.mean[..., index, :], stacked.lazy_covariance_matrix[..., index, :, :])
