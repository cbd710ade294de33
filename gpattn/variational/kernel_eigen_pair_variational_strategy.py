"""The paired (left/right) kernel-eigen variational strategy of KEP-SVGP."""

from __future__ import annotations

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.module import Module
from torch import Tensor

from ..validation import checked_inputs
from ._structured import low_rank_plus_diag, times_covariance_root
from .kernel_eigen_variational_strategy import KernelEigenVariationalStrategy

MERGES = ("sum", "concat")


class KernelEigenPairVariationalStrategy(Module):
    r"""Two kernel-eigen branches over one :class:`~gpattn.features.KernelEigenFeatures`, merged (MATH.md section 3).

    * ``merge="sum"``: :math:`F = F_e + F_r`. Independent posteriors add their covariances; the KL is
      :math:`\mathrm{KL}_e + \mathrm{KL}_r` (as ``_DeepGPVariationalStrategy`` sums its sub-strategies).
    * ``merge="concat"``: the two outputs side by side, a
      :class:`~gpytorch.distributions.MultitaskMultivariateNormal` with two tasks (left, right).
    * ``shared_posterior=True`` (the official KEP-SVGP code): both branches use the *same* :math:`q(u)`, so
      :math:`F = (e + r) \Lambda^{-1} u` for ``"sum"``, and there is one KL. The right strategy must then hold
      the left strategy's variational distribution.

    Both branches are evaluated in one pass over the features: one KSVD per call.

    :param model: The owning model (its ``mean_module`` adds a prior mean).
    :param left: Strategy with ``side="left"``.
    :param right: Strategy with ``side="right"`` over the same features.
    :param merge: ``"sum"`` or ``"concat"``.
    :param shared_posterior: Share :math:`q(u)` between the branches.

    .. note:: Cost: one feature evaluation per branch plus O(N s^2); the KL is O(s) for the prior part.
    """

    def __init__(
        self,
        model: Module,
        left: KernelEigenVariationalStrategy,
        right: KernelEigenVariationalStrategy,
        merge: str = "sum",
        shared_posterior: bool = False,
    ):
        super().__init__()
        if merge not in MERGES:
            raise ValueError(f"expected merge in {MERGES}, got {merge!r}")
        if (left.side, right.side) != ("left", "right"):
            raise ValueError(f"expected a left and a right strategy, got sides {left.side!r} and {right.side!r}")
        if left.features is not right.features:
            raise ValueError("the left and right strategies must share one KernelEigenFeatures object")
        if shared_posterior and left._variational_distribution is not right._variational_distribution:
            raise ValueError("shared_posterior=True needs both strategies to hold the same variational distribution")
        object.__setattr__(self, "model", model)
        self.left = left
        self.right = right
        self.merge = merge
        self.shared_posterior = bool(shared_posterior)

    @property
    def features(self):
        """The :class:`~gpattn.features.KernelEigenFeatures` both branches share."""
        return self.left.features

    def branches(self) -> list[tuple[str, KernelEigenVariationalStrategy]]:
        """``[(name, strategy)]`` of the branches that own a :math:`q(u)`: one when the posterior is shared."""
        return [("shared", self.left)] if self.shared_posterior else [("left", self.left), ("right", self.right)]

    def kl_divergence(self) -> Tensor:
        r""":math:`\mathrm{KL}_e + \mathrm{KL}_r` (one KL with a shared posterior), shape ``(*batch)``."""
        return sum(strategy.kl_divergence() for _, strategy in self.branches())

    def _prepare(self) -> None:
        if self.training:
            for strategy in (self.left, self.right):
                strategy._clear_cache()
            self.features.refresh_ksvd_loss()
        for strategy in (self.left, self.right):
            if not strategy.variational_params_initialized.item():
                strategy._variational_distribution.initialize_variational_distribution(strategy.prior_distribution)
                strategy.variational_params_initialized.fill_(1)

    def _stacked(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        # Mean, covariance root and residual of the stacked vector [F_e(x); F_r(x)], shape (*batch, 2N, ...).
        left_interp, left_residual = self.left.interp_and_residual(x)
        right_interp, right_residual = self.right.interp_and_residual(x)
        left_q, right_q = self.left.variational_distribution, self.right.variational_distribution
        batch_shape = torch.broadcast_shapes(left_interp.shape[:-2], left_q.batch_shape, right_q.batch_shape)
        left_root = times_covariance_root(left_interp, left_q.lazy_covariance_matrix)  # e Lambda^{-1} L_e
        right_root = times_covariance_root(right_interp, right_q.lazy_covariance_matrix)  # r Lambda^{-1} L_r
        left_root = left_root.expand(*batch_shape, *left_root.shape[-2:])
        right_root = right_root.expand(*batch_shape, *right_root.shape[-2:])
        if self.shared_posterior:
            root = torch.cat([left_root, right_root], dim=-2)
        else:  # block-diagonal root: independent branches
            root = torch.cat(
                [
                    torch.cat([left_root, torch.zeros_like(left_root[..., :, :1]).expand_as(left_root)], dim=-1),
                    torch.cat([torch.zeros_like(right_root[..., :, :1]).expand_as(right_root), right_root], dim=-1),
                ],
                dim=-2,
            )
        mean = torch.cat(
            [
                (left_interp @ left_q.mean.unsqueeze(-1)).squeeze(-1).expand(*batch_shape, x.shape[-2]),
                (right_interp @ right_q.mean.unsqueeze(-1)).squeeze(-1).expand(*batch_shape, x.shape[-2]),
            ],
            dim=-1,
        )
        residual = None
        if left_residual is not None:
            residual = torch.cat([left_residual, right_residual], dim=-1).expand(*batch_shape, 2 * x.shape[-2])
        return mean, root, residual

    def __call__(self, x: Tensor, prior: bool = False, **kwargs) -> MultivariateNormal:
        r"""The merged posterior :math:`q(F(x))`, or the prior :math:`p(F(x))` with ``prior=True``.

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param prior: Return the model's prior (``model.forward``) instead.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` over ``N`` points (``"sum"``; mean shape
            ``(*batch, N)``) or a two-task :class:`~gpytorch.distributions.MultitaskMultivariateNormal` (``"concat"``;
            mean shape ``(*batch, N, 2)``), with a low-rank-plus-diagonal covariance.
        """
        self.features.check_inputs(x, type(self.model).__name__)
        with checked_inputs():  # x is checked: the kernels evaluated on it below skip their own pass
            if prior:
                return self.model.forward(x, **kwargs)
            self._prepare()
            mean, root, residual = self._stacked(x)
        num_points = x.shape[-2]
        prior_mean = self.left.prior_mean(x)
        if self.merge == "sum":
            summed_residual = None if residual is None else residual[..., :num_points] + residual[..., num_points:]
            summed_root = root[..., :num_points, :] + root[..., num_points:, :]
            merged_mean = mean[..., :num_points] + mean[..., num_points:] + prior_mean
            return MultivariateNormal(merged_mean, low_rank_plus_diag(summed_root, summed_residual))
        task_mean = torch.stack([mean[..., :num_points], mean[..., num_points:]], dim=-1)  # shape: (*batch, N, 2)
        if torch.is_tensor(prior_mean):
            task_mean = task_mean + prior_mean.unsqueeze(-1)
        return MultitaskMultivariateNormal(task_mean, low_rank_plus_diag(root, residual), interleaved=False)

    def branch(self, x: Tensor, side: str) -> MultivariateNormal:
        r""":math:`q(f_e(x))` (``side="left"``) or :math:`q(f_r(x))` (``"right"``) alone, without the prior mean.

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param side: ``"left"`` or ``"right"``.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)``.
        """
        if side not in ("left", "right"):
            raise ValueError(f"expected side 'left' or 'right', got {side!r}")
        self.features.check_inputs(x, type(self.model).__name__)
        with checked_inputs():
            self._prepare()
            mean, root, residual = self._stacked(x)
        rows = slice(0, x.shape[-2]) if side == "left" else slice(x.shape[-2], None)
        return MultivariateNormal(
            mean[..., rows], low_rank_plus_diag(root[..., rows, :], None if residual is None else residual[..., rows])
        )
