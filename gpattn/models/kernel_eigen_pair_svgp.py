"""KEP-SVGP as a GPyTorch ApproximateGP: a left and a right kernel-eigen SVGP over one KSVD."""

from __future__ import annotations

from collections.abc import Iterator

import pyro
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.means import Mean, ZeroMean
from gpytorch.models import ApproximateGP
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    MeanFieldVariationalDistribution,
    NaturalVariationalDistribution,
    _VariationalDistribution,
)
from torch import Tensor

from ..features import KernelEigenFeatures
from ..kernels import AsymmetricKernel
from ..validation import InputTypeError, check_bool, check_choice, check_int, check_tensor
from ..variational import KernelEigenPairVariationalStrategy
from ..variational.structured_covariance import low_rank_plus_diag

VARIATIONAL_DISTRIBUTIONS = {
    "cholesky": CholeskyVariationalDistribution,
    "mean_field": MeanFieldVariationalDistribution,
    "natural": NaturalVariationalDistribution,
}


#: Why kernel-eigen models have no ``get_fantasy_model`` (the message of its ``NotImplementedError``).
FANTASY_UNSUPPORTED = (
    "online variational conditioning (get_fantasy_model, Maddox et al. 2021) is not supported by kernel-eigen "
    "models: GPyTorch builds it from pseudo-observations of f at the inducing points Z with covariance K(Z, Z), but "
    "the kernel-eigen inducing variables are projections u = H^T f (K_uu = Lambda^2), not values f(Z), so that "
    "construction would condition on the wrong quantities; train (or keep training) the model on the data with the "
    "new points instead"
)


def no_fantasy_model(owner: object) -> NotImplementedError:
    """The ``NotImplementedError`` that ``owner.get_fantasy_model`` raises (see :data:`FANTASY_UNSUPPORTED`)."""
    return NotImplementedError(f"{type(owner).__name__}: {FANTASY_UNSUPPORTED}")


class KernelEigenPairSVGP(ApproximateGP):
    r"""The kernel-eigen pair SVGP (KEP-SVGP, Chen et al. 2024) for regression and classification on toy data.

    Two sparse variational GPs share the rank-:math:`s` KSVD of an asymmetric kernel on the landmarks:
    the left branch :math:`f_e(x) = \kappa(x, Z) w` (prior kernel :math:`k_e = \kappa(\cdot, Z)\kappa(\cdot, Z)^\top`)
    with inducing variables :math:`u_e = H_e^\top f_e(X)`, and the right branch :math:`f_r(x) = \kappa(X, x)^\top w'`
    with :math:`u_r = H_r^\top f_r(Z)`. Both have :math:`K_{uu} = \Lambda^2`. The output is
    :math:`F = F_e + F_r` (``merge="sum"``: the GP with kernel :math:`k_e + k_r`, see
    :class:`~gpattn.kernels.InducedKernel`) or the pair (``"concat"``, a two-task
    :class:`~gpytorch.distributions.MultitaskMultivariateNormal`). The KL sums both branches.

    Trains with :class:`gpytorch.mlls.VariationalELBO`, :class:`gpytorch.mlls.PredictiveLogLikelihood`, and Pyro
    SVI through :meth:`pyro_model`/:meth:`pyro_guide` (one sample site ``{prefix}.u`` holding both branches).

    :param inducing_points: Landmarks :math:`X = Z`, shape ``(*batch, M, d)``.
    :param kernel: The asymmetric kernel, ``covar_module`` (one module with the features': see :attr:`covar_module`).
    :param num_inducing: :math:`s \leq M`, the KSVD rank.
    :param merge: ``"sum"`` or ``"concat"``.
    :param shared_posterior: One :math:`q(u)` for both branches (the official code's choice).
    :param whiten: Whitened parametrisation :math:`u = \Lambda v`.
    :param residual: ``"diag"`` (default for GP models) or ``"none"``.
    :param mode: Feature mode, ``"exact"`` or ``"primal"`` (see :class:`~gpattn.features.KernelEigenFeatures`).
    :param variational_distribution: ``"cholesky"``, ``"mean_field"``, ``"natural"`` or a
        :class:`~gpytorch.variational._VariationalDistribution` class.
    :param learn_inducing_locations: Learn the landmarks.
    :param mean_module: Prior mean :math:`\mu` (default :class:`~gpytorch.means.ZeroMean`).
    :param batch_shape: Batch shape of :math:`q(u)`.
    :param ksvd_weight: :math:`\eta` of the primal-mode KSVD penalty.

    Example:
        >>> from gpattn.kernels import ShiftedRBFKernel
        >>> _ = torch.manual_seed(0)
        >>> landmarks = torch.linspace(-2, 2, 10).unsqueeze(-1)
        >>> model = KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(input_dim=1), num_inducing=4)
        >>> output = model(torch.linspace(-3, 3, 7).unsqueeze(-1))  # q(F) = q(f_e + f_r) at 7 points
        >>> output.mean.shape, output.lazy_covariance_matrix.shape
        (torch.Size([7]), torch.Size([7, 7]))
        >>> model.features.singular_values.detach()  # Lambda of the landmarks' KSVD (K_uu = Lambda^2)
        tensor([4.8303, 3.0462, 1.4304, 0.5081])
        >>> kl = model.variational_strategy.kl_divergence()  # q(u) starts at the prior (GPyTorch jitters m by 1e-3)
        >>> kl.shape, bool(kl < 1e-4)
        (torch.Size([]), True)

    .. note:: Cost per call: O(N M p) for the scores in exact mode plus O(M^2 p + M^3) for the KSVD of the
        landmarks (primal mode: O(N p s)), O(N s^2) for the covariance roots, O(s^2) for the KL of a Cholesky
        :math:`q(u)` (O(s) mean-field, O(s^3) natural: its own factorisation) and O(s) for its prior terms.
    """

    def __init__(
        self,
        inducing_points: Tensor,
        kernel: AsymmetricKernel,
        num_inducing: int,
        merge: str = "sum",
        shared_posterior: bool = False,
        whiten: bool = False,
        residual: str = "diag",
        mode: str = "exact",
        variational_distribution: str | type[_VariationalDistribution] = "cholesky",
        learn_inducing_locations: bool = True,
        mean_module: Mean | None = None,
        batch_shape: torch.Size = torch.Size(),
        ksvd_weight: float = 1.0,
    ):
        if isinstance(variational_distribution, str):
            check_choice("variational_distribution", variational_distribution, tuple(VARIATIONAL_DISTRIBUTIONS))
            variational_distribution = VARIATIONAL_DISTRIBUTIONS[variational_distribution]
        elif not isinstance(variational_distribution, type) or not issubclass(
            variational_distribution, _VariationalDistribution
        ):
            raise TypeError(
                f"KernelEigenPairSVGP: expected variational_distribution in {tuple(VARIATIONAL_DISTRIBUTIONS)} or a "
                f"gpytorch _VariationalDistribution class, got {variational_distribution!r}"
            )
        features = KernelEigenFeatures(
            kernel,
            inducing_points,
            num_inducing,
            mode=mode,
            learn_landmarks=learn_inducing_locations,
            ksvd_weight=ksvd_weight,
        )
        # a flag read before the strategy sees it: the string "no" would otherwise build one shared q(u)
        shared_posterior = check_bool("shared_posterior", shared_posterior, where="KernelEigenPairSVGP")
        # one q(u) for both branches, stacked on the last batch dimension: (left, right), or one shared posterior
        branches = torch.Size([1 if shared_posterior else 2])
        posterior = variational_distribution(num_inducing, batch_shape=torch.Size(batch_shape) + branches)
        strategy = KernelEigenPairVariationalStrategy(
            self,
            features.landmarks,
            posterior,
            merge=merge,
            shared_posterior=shared_posterior,
            whiten=whiten,
            residual=residual,
            features=features,
        )
        super().__init__(strategy)
        # the features' kernel under GPyTorch's name too (state_dict keys, initialize("covar_module.<name>")); torch's
        # own __setattr__: the redirect below is for later assignments
        torch.nn.Module.__setattr__(self, "covar_module", kernel)
        self.mean_module = ZeroMean() if mean_module is None else mean_module

    @property
    def covar_module(self) -> AsymmetricKernel:
        r"""The asymmetric kernel :math:`\kappa`, GPyTorch's name for what the features hold
        (``features.base_kernel``): one module, read by the prior (:meth:`forward`) and the posterior alike (registered
        under both names, as a shared module: both ``state_dict`` key sets, ``initialize(**{"covar_module.shift":
        ...})``). Assigning another kernel (``model.covar_module = kernel``) replaces it under both names and clears
        the memoised KSVD, in exact mode; in primal mode the learned feature weights belong to the kernel they were
        initialised from, so a new kernel needs a new model.

        :raises TypeError: Assigning anything but an :class:`~gpattn.kernels.AsymmetricKernel`, or one of another dtype
            than the landmarks.
        :raises ValueError: Assigning a kernel of another input width than the landmarks, or in primal mode.
        """
        return self.features.kernel

    def __setattr__(self, name: str, value) -> None:
        # torch.nn.Module.__setattr__ files a module under _modules before any property setter could see it
        if name == "covar_module" and "variational_strategy" in self.__dict__.get("_modules", {}):
            self._replace_kernel(value)
        else:
            super().__setattr__(name, value)

    def _replace_kernel(self, kernel: AsymmetricKernel) -> None:
        where = f"{type(self).__name__}.covar_module"
        if not isinstance(kernel, AsymmetricKernel):
            raise TypeError(f"{where}: expected an AsymmetricKernel (gpattn.kernels), got {type(kernel).__name__}")
        features = self.features
        width = features.landmarks.shape[-1]
        if kernel.input_dim != width:
            raise ValueError(
                f"{where}: expected a kernel of input_dim {width} (the landmarks'), got {kernel.input_dim}"
            )
        if features.mode == "primal":
            raise ValueError(
                f"{where}: cannot replace the kernel of a primal-mode model (its feature weights W_e, W_r were "
                "initialised from the old kernel's features); build a new model with the new kernel"
            )
        if kernel.raw_outputscale.dtype != features.landmarks.dtype:
            raise InputTypeError(
                f"{where}: expected a kernel of the landmarks' dtype {features.landmarks.dtype}, got "
                f"{kernel.raw_outputscale.dtype} (cast it with .to())"
            )
        features.base_kernel = kernel
        torch.nn.Module.__setattr__(self, "covar_module", kernel)
        self.variational_strategy._clear_cache()

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """torch's :meth:`~torch.nn.Module.named_children`, without ``covar_module`` while it is the features' kernel
        (``variational_strategy.features.base_kernel``, the same module): walks that recurse through the children
        without a memo, such as GPyTorch's ``named_priors()`` (summed by ``VariationalELBO`` and the other MLLs, and by
        :meth:`pyro_model`), would meet the kernel twice and count each of its priors twice. ``state_dict``,
        ``named_modules`` and ``named_parameters`` read the registered modules as before (both names); GPyTorch's
        ``pyro_sample_from_prior`` goes through :meth:`to_random_module`, which keeps the two names on one kernel."""
        strategy = self._modules.get("variational_strategy")
        inner = {id(module) for module in strategy.modules()} if strategy is not None else set()
        for name, module in super().named_children():
            if name != "covar_module" or id(module) not in inner:
                yield name, module

    def to_random_module(self) -> KernelEigenPairSVGP:
        """GPyTorch's random copy (``pyro_sample_from_prior``), with ``covar_module`` the copy's features' kernel again:
        GPyTorch copies each child on its own, and the copy's ``covar_module`` would be a second kernel, sampled as a
        second site that the likelihood never reads."""
        new = super().to_random_module()
        torch.nn.Module.__setattr__(new, "covar_module", new.features.base_kernel)
        return new

    def get_fantasy_model(self, inputs: Tensor, targets: Tensor, **kwargs):
        """Not supported: raises ``NotImplementedError`` explaining why (:data:`FANTASY_UNSUPPORTED`): GPyTorch's
        online variational conditioning treats the inducing variables as function values at the landmarks, which the
        kernel-eigen inducing variables are not. Refit with the new points instead.

        :param inputs: New points, shape ``(*batch, N', d)`` (unused).
        :param targets: Their targets, shape ``(*batch, N')`` (unused).
        :raises NotImplementedError: Always.
        """
        raise no_fantasy_model(self)

    @property
    def features(self) -> KernelEigenFeatures:
        """The :class:`~gpattn.features.KernelEigenFeatures` (the KSVD state) shared by both branches."""
        return self.variational_strategy.features

    def forward(self, x: Tensor) -> MultivariateNormal:
        r"""The exact prior of the pair before truncation: :math:`\mathcal N(\mu(x), k_e + k_r)` (``"sum"``) or
        the two independent branch priors (``"concat"``), with low-rank roots :math:`\kappa(x, Z)` and
        :math:`\kappa(X, x)^\top`.

        :param x: Inputs, shape ``(*batch, N, d)``.
        :return: Mean shape ``(*batch, N)`` (``"sum"``) or ``(*batch, N, 2)`` (``"concat"``).
        """
        features = self.features
        left_root = self.covar_module(x, features.key_landmarks)  # kappa(x, Z)
        right_root = self.covar_module(features.landmarks, x).mT  # kappa(X, x)^T
        mean = self.mean_module(x)
        if self.variational_strategy.merge == "sum":
            return MultivariateNormal(mean, low_rank_plus_diag(torch.cat([left_root, right_root], dim=-1), None))
        zeros_left, zeros_right = torch.zeros_like(left_root), torch.zeros_like(right_root)
        root = torch.cat([torch.cat([left_root, zeros_right], -1), torch.cat([zeros_left, right_root], -1)], -2)
        return MultitaskMultivariateNormal(
            torch.stack([mean, mean], dim=-1).expand(*root.shape[:-2], x.shape[-2], 2),
            low_rank_plus_diag(root, None),
            interleaved=False,
        )

    def __call__(self, inputs: Tensor, prior: bool = False, **kwargs):
        r"""The posterior :math:`q(F(x))` (or the prior with ``prior=True``), as for any GPyTorch ``ApproximateGP``.

        :param inputs: Inputs :math:`x`, shape ``(*batch, N, d)``.
        :param prior: Return the prior :meth:`forward` instead of the posterior.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)`` (``"sum"``)
            or a two-task :class:`~gpytorch.distributions.MultitaskMultivariateNormal`, mean ``(*batch, N, 2)``
            (``"concat"``).
        """
        # GPyTorch's ApproximateGP.__call__ reads inputs.dim() first: check the type before, the rest in the strategy
        check_tensor("x", inputs, where=type(self).__name__)
        return super().__call__(inputs, prior=prior, **kwargs)

    def branch(self, x: Tensor, side: str) -> MultivariateNormal:
        r""":math:`q(f_e(x))` or :math:`q(f_r(x))` alone (``side="left"``/``"right"``), for plots and diagnostics.

        :param x: Inputs, shape ``(*batch, N, d)``.
        :param side: ``"left"`` or ``"right"``.
        :return: A :class:`~gpytorch.distributions.MultivariateNormal` with mean shape ``(*batch, N)``.
        """
        return self.variational_strategy.branch(x, side)

    @staticmethod
    def _masked_function_dist(function_dist: MultivariateNormal) -> pyro.distributions.Distribution:
        # GPyTorch's convention: f is sampled with the marginals and its log-density masked out of the ELBO
        normal = pyro.distributions.Normal(loc=function_dist.mean, scale=function_dist.stddev)
        return normal.to_event(len(function_dist.event_shape) - 1).mask(False)

    def pyro_guide(self, input: Tensor, beta: float = 1.0, name_prefix: str = "") -> pyro.distributions.Distribution:
        r"""Pyro guide: samples :math:`u` of both branches from :math:`q(u)` and returns :math:`q(f(x))`.

        :param input: Inputs, shape ``(*batch, N, d)``.
        :param beta: Scale of the sample site (the KL weight).
        :param name_prefix: Prefix of the sample site ``{prefix}.u``: both branches' :math:`u`, event shape
            ``(*batch, 2, s)`` (``(*batch, 1, s)`` with a shared posterior).
        :return: The marginals of :math:`q(f(x))` as a masked ``pyro.distributions.Normal`` with event shape
            ``(N,)`` (``(N, 2)`` for ``"concat"``), as GPyTorch's ``pyro_guide`` returns.
        """
        # q(f(x)) first: in training mode the call clears the memoised q(u) of the previous step (whose autograd
        # graph was freed by its backward pass) and initialises q(u) on the first step, so the sites below sample
        # the current q(u)
        function_dist = self(input, prior=False)
        with pyro.poutine.scale(scale=beta):
            q_u = self.variational_strategy.variational_distribution
            pyro.sample(f"{name_prefix}.u", q_u.to_event(len(q_u.batch_shape)))
        return self._masked_function_dist(function_dist)

    def pyro_model(
        self, input: Tensor, beta: float = 1.0, name_prefix: str = "", *, num_data: int | None = None
    ) -> pyro.distributions.Distribution:
        r"""Pyro model: samples :math:`u` of both branches from :math:`p(u) = \mathcal N(0, \Lambda^2)`, adds GPyTorch
        priors and subtracts the added loss terms (the KSVD penalty), and returns the prior :math:`p(f(x))`.

        Pyro's loss is a sum over the data set, :math:`n` times :class:`gpytorch.mlls.VariationalELBO`'s per-datum loss
        (whose KL and GPyTorch priors are divided by :math:`n`, and whose added loss terms, the KSVD penalty
        :math:`\eta J^2`, are not). So that both train the same objective, the penalty enters the log joint as
        :math:`-n \eta J^2`, with :math:`n` = ``num_data``.

        :param input: Inputs, shape ``(*batch, N, d)``.
        :param beta: Scale of the sample site (the KL weight).
        :param name_prefix: Prefix of the sample site (as in :meth:`pyro_guide`).
        :param num_data: :math:`n`, the size of the training set (default: ``N``, the points of this call, which is
            :math:`n` for full-batch SVI; pass it when ``input`` is a minibatch).
        :return: The marginals of :math:`p(f(x))` as a masked ``pyro.distributions.Normal`` with event shape
            ``(N,)`` (``(N, 2)`` for ``"concat"``).
        """
        check_tensor("x", input, where=type(self).__name__)
        with pyro.poutine.scale(scale=beta):
            p_u = self.variational_strategy.prior_distribution
            pyro.sample(f"{name_prefix}.u", p_u.to_event(len(p_u.batch_shape)))
        log_prior = sum(
            (prior.log_prob(closure(module)).sum() for _, module, prior, closure, _ in self.named_priors()),
            input.new_zeros(()),
        )
        pyro.factor(f"{name_prefix}.log_prior", log_prior)
        # a penalty lowers the log joint (GPyTorch's own mixin adds it with the opposite sign)
        if num_data is None:  # the points of this call: (N, d), or (N,) read as (N, 1) as GPyTorch's models read it
            num_data = input.shape[-2] if input.dim() >= 2 else input.shape[0]
        else:
            num_data = check_int("num_data", num_data, where=type(self).__name__)
        added_loss = sum((term.loss() for term in self.added_loss_terms()), input.new_zeros(()))
        pyro.factor(f"{name_prefix}.added_loss", -num_data * added_loss)
        return self._masked_function_dist(self(input, prior=True))
