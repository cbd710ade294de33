r"""GPyTorch's variational-strategy harness for kernel-eigen strategies.

:class:`gpytorch.test.variational_test_case.VariationalTestCase` trains and evaluates a small SVGP over a grid of
batch shapes and checks shapes, that every parameter receives a nonzero gradient, and (through its mocks) which
linear-algebra routines run. :class:`KernelEigenVariationalTestCase` runs it on a kernel-eigen strategy: the model's
kernel is a :class:`~gpattn.kernels.CosineFeatureKernel` (random Fourier lift, so the 16 x 16 landmark matrix of 2-D
inputs has full rank 16), and the O(s) claim is checked on every iteration: no Cholesky (and no CG or CIQ) of
:math:`K_{uu} = \Lambda^2` ever runs.

* Cholesky and mean-field :math:`q(u)`: neither ``torch.linalg.cholesky_ex`` (GPyTorch's and linear_operator's
  factorisations) nor ``torch.linalg.cholesky`` (a strategy's own) is ever called, in training or evaluation.
* Natural :math:`q(u)`: :class:`~gpytorch.variational.NaturalVariationalDistribution` turns its natural parameters into
  :math:`(m, S)` by Cholesky factorisations of s x s matrices built from the *variational* parameters. Those calls are
  legitimate (they are :math:`q(u)`'s, not :math:`K_{uu}`'s); the natural cases therefore assert that every Cholesky
  call originates in ``gpytorch/variational/natural_variational_distribution.py`` and nowhere else.
* Kernel-eigen models have no online-conditioning (fantasy) support: GPyTorch's ``test_fantasy_call*`` tests are
  replaced by :meth:`~KernelEigenVariationalTestCase.test_fantasy_call`, which asserts that ``get_fantasy_model``
  raises ``NotImplementedError`` with the explanation
  :data:`~gpattn.models.kernel_eigen_pair_svgp.FANTASY_UNSUPPORTED` (GPyTorch's conditioning treats the inducing
  variables as values :math:`f(Z)`; kernel-eigen inducing variables are projections with :math:`K_{uu} = \Lambda^2`),
  and that the strategy itself reports no fantasy strategy. The harness's model raises it as
  :class:`~gpattn.models.KernelEigenPairSVGP` does.

* The numbers, against a reference independent of the strategy: with :math:`q(u) = p(u)` exactly, the KL is 0 and
  :math:`q(f(x))` is the exact prior of the branches (:math:`s = M`: no truncation), mean ``mean_module(x)`` and
  covariance :math:`\sum_b \kappa_b \kappa_b^\top` (:math:`\kappa(x, Z)` on the left, :math:`\kappa(Z, x)^\top`
  on the right), formed densely from the kernel in float64
  (:meth:`~KernelEigenVariationalTestCase.test_posterior_at_the_prior_is_the_exact_prior`; for a shared posterior
  the KL and the mean only, its covariance couples the branches).

A pair strategy (``branches = 2``) gets a variational distribution with a trailing branch dimension, as
:class:`~gpattn.variational.KernelEigenPairVariationalStrategy` expects; a pair with one shared posterior
(``shared_posterior = True``, ``strategy_cls = functools.partial(KernelEigenPairVariationalStrategy,
shared_posterior=True)``) a branch dimension of size 1.

Example::

    class TestMyStrategy(KernelEigenVariationalTestCase, unittest.TestCase):
        strategy_cls = KernelEigenVariationalStrategy
"""

from __future__ import annotations

import traceback
from unittest.mock import patch

import gpytorch
import torch
from gpytorch.test.variational_test_case import VariationalTestCase
from linear_operator.operators import LowRankRootLinearOperator

from ..kernels import CosineFeatureKernel
from ..models.kernel_eigen_pair_svgp import FANTASY_UNSUPPORTED, no_fantasy_model
from ..variational import KernelEigenVariationalStrategy

NATURAL_FILE = "natural_variational_distribution.py"


class _KernelEigenSVGP(gpytorch.models.ApproximateGP):
    """The harness's regression model with the cosine-feature kernel in place of a scaled RBF."""

    def __init__(self, inducing_points, variational_distribution, strategy_cls, constant_mean, tie):
        variational_strategy = strategy_cls(
            self, inducing_points, variational_distribution, learn_inducing_locations=True
        )
        super().__init__(variational_strategy)
        if constant_mean:
            self.mean_module = gpytorch.means.ConstantMean()
            self.mean_module.initialize(constant=1.0)
        else:
            self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = CosineFeatureKernel(input_dim=2, feature_dim=32, tie=tie, lift="rff", lift_dim=64)

    def get_fantasy_model(self, inputs, targets, **kwargs):
        """Not supported, as for :class:`~gpattn.models.KernelEigenPairSVGP` (see :data:`FANTASY_UNSUPPORTED`)."""
        raise no_fantasy_model(self)

    def forward(self, x):
        # The exact (untruncated) prior of the left branch: f(x) = kappa(x, Z) w, w ~ N(0, I). Used by the harness only
        # through ``prior=True`` and the fantasy path.
        root = self.covar_module(x, self.variational_strategy.inducing_points)  # shape: (*batch, N, M)
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), LowRankRootLinearOperator(root))


class _CholeskyCallSites:
    """A stand-in for ``torch.linalg.cholesky_ex`` (or ``torch.linalg.cholesky``) that records the file that called
    it."""

    def __init__(self, wrapped):
        self.wrapped = wrapped
        self.callers: list[str] = []

    def __call__(self, *args, **kwargs):
        frames = traceback.extract_stack()[:-1]
        # the innermost frame outside linear_operator's Cholesky helpers
        outer = [f.filename for f in frames if not f.filename.endswith(("cholesky.py", "mock.py"))]
        self.callers.append(outer[-1])
        return self.wrapped(*args, **kwargs)


class _CholeskyRecorder:
    """Records the callers of ``torch.linalg.cholesky_ex`` and ``torch.linalg.cholesky`` while active (a strategy may
    factorise :math:`K_{uu}` by the latter, which GPyTorch's mocks do not see)."""

    def __init__(self) -> None:
        self.recorders = [_CholeskyCallSites(torch.linalg.cholesky_ex), _CholeskyCallSites(torch.linalg.cholesky)]
        self._patches = [
            patch("torch.linalg.cholesky_ex", new=self.recorders[0]),
            patch("torch.linalg.cholesky", new=self.recorders[1]),
        ]

    @property
    def callers(self) -> list[str]:
        return [caller for recorder in self.recorders for caller in recorder.callers]

    def __enter__(self) -> _CholeskyRecorder:
        for active in self._patches:
            active.start()
        return self

    def __exit__(self, *exc_info) -> None:
        for active in reversed(self._patches):
            active.stop()


class KernelEigenVariationalTestCase(VariationalTestCase):
    """:class:`~gpytorch.test.variational_test_case.VariationalTestCase` for kernel-eigen strategies.

    :ivar strategy_cls: The strategy class (called as GPyTorch's harness calls strategies).
    :ivar branches: 2 for a pair strategy (the variational distribution gets a trailing branch dimension), else 1.
    :ivar shared_posterior: A pair strategy with one :math:`q(u)` for both branches (``branches = 1``): the variational
        distribution gets a trailing branch dimension of size 1.
    :ivar tie: Tie the cosine kernel's query and key maps (a symmetric kernel).
    """

    seed = 0
    tie = True
    branches = 1
    shared_posterior = False
    strategy_cls = KernelEigenVariationalStrategy
    mll_cls = gpytorch.mlls.VariationalELBO
    distribution_cls = gpytorch.variational.CholeskyVariationalDistribution

    @property
    def batch_shape(self) -> torch.Size:
        """The model's batch shape in the shape-independent tests (a subclass overrides it, e.g. ``(2,)``)."""
        return torch.Size([])

    @property
    def natural(self) -> bool:
        """Whether :math:`q(u)` is natural-parametrised (its own Cholesky factorisations are then expected)."""
        return issubclass(self.distribution_cls, gpytorch.variational.NaturalVariationalDistribution)

    def _make_model_and_likelihood(
        self,
        num_inducing=16,
        batch_shape=torch.Size([]),
        inducing_batch_shape=torch.Size([]),
        strategy_cls=KernelEigenVariationalStrategy,
        distribution_cls=gpytorch.variational.CholeskyVariationalDistribution,
        constant_mean=True,
    ):
        inducing_points = torch.randn(num_inducing, 2).repeat(*inducing_batch_shape, 1, 1)
        if self.shared_posterior and self.branches != 1:
            raise ValueError(
                f"{type(self).__name__}: a shared posterior is one branch of q(u), got branches = {self.branches}"
            )
        paired = self.branches > 1 or self.shared_posterior
        branch_shape = torch.Size([self.branches]) if paired else torch.Size()
        variational_distribution = distribution_cls(num_inducing, batch_shape=torch.Size(batch_shape) + branch_shape)
        model = _KernelEigenSVGP(inducing_points, variational_distribution, strategy_cls, constant_mean, self.tie)
        return model, self.likelihood_cls()

    def _check_no_kuu_factorisation(self, cg_mock, cholesky_mock, ciq_mock, recorder):
        self.assertFalse(cg_mock.called)
        self.assertFalse(ciq_mock.called)
        if self.natural:
            # q(u)'s own Cholesky factorisations only (see the module docstring)
            self.assertTrue(recorder.callers)
            for caller in recorder.callers:
                self.assertTrue(caller.endswith(NATURAL_FILE), f"Cholesky called from {caller}")
        else:
            self.assertFalse(cholesky_mock.called)
            self.assertEqual(recorder.callers, [])

    # The batch variants (test_eval_*_pred_batch, test_training_iteration_batch_*, test_training_all_batch_zero_mean)
    # call these two through ``self``, so the Cholesky/CG checks below run for every one of them.
    def test_eval_iteration(self, *args, **kwargs):
        """GPyTorch's evaluation test, plus: no Cholesky, CG or CIQ of :math:`K_{uu}` during the call."""
        with _CholeskyRecorder() as recorder:  # the harness's mock wraps the cholesky_ex recorder
            cg_mock, cholesky_mock, ciq_mock = super().test_eval_iteration(*args, **kwargs)
        self._check_no_kuu_factorisation(cg_mock, cholesky_mock, ciq_mock, recorder)

    def test_training_iteration(self, *args, **kwargs):
        """GPyTorch's training test (nonzero gradients everywhere), plus: no factorisation of :math:`K_{uu}`."""
        with _CholeskyRecorder() as recorder:
            cg_mock, cholesky_mock, ciq_mock = super().test_training_iteration(*args, **kwargs)
        self._check_no_kuu_factorisation(cg_mock, cholesky_mock, ciq_mock, recorder)

    def test_fantasy_call(
        self,
        data_batch_shape=None,
        inducing_batch_shape=None,
        model_batch_shape=None,
        expected_batch_shape=None,
        constant_mean=True,
    ):
        """Online conditioning is not supported: after a training iteration, ``get_fantasy_model`` raises
        ``NotImplementedError`` with :data:`~gpattn.models.kernel_eigen_pair_svgp.FANTASY_UNSUPPORTED` (with and
        without replacement mean and covariance modules), and the strategy reports no fantasy strategy (calling its
        ``get_fantasy_model`` directly gives GPyTorch's own ``NotImplementedError``). GPyTorch's
        ``test_fantasy_call_batch_*`` variants call this method with their batch shapes."""
        model_batch_shape = model_batch_shape if model_batch_shape is not None else self.batch_shape
        data_batch_shape = data_batch_shape if data_batch_shape is not None else self.batch_shape
        inducing_batch_shape = inducing_batch_shape if inducing_batch_shape is not None else self.batch_shape
        model, likelihood = self._make_model_and_likelihood(
            batch_shape=model_batch_shape,
            inducing_batch_shape=inducing_batch_shape,
            distribution_cls=self.distribution_cls,
            strategy_cls=self.strategy_cls,
            constant_mean=constant_mean,
        )
        self.assertFalse(model.variational_strategy.has_fantasy_strategy)
        self._training_iter(model, likelihood, data_batch_shape, mll_cls=self.mll_cls)
        for cm_dict in (
            {"covar_module": None, "mean_module": None},
            {"covar_module": gpytorch.kernels.MaternKernel(), "mean_module": gpytorch.means.ZeroMean()},
        ):
            with self.assertRaises(NotImplementedError) as caught:
                self._fantasy_iter(model, likelihood, data_batch_shape, num_fant=10, **cm_dict)
            self.assertEqual(str(caught.exception), f"_KernelEigenSVGP: {FANTASY_UNSUPPORTED}")
        with self.assertRaisesRegex(NotImplementedError, "No fantasy model support"):
            model.variational_strategy.get_fantasy_model(torch.randn(3, 2), torch.randn(3))

    def test_prior_call_is_model_forward(self):
        """``model(x, prior=True)`` is the model's exact prior: a low-rank root :math:`\\kappa(x, Z)` of shape
        ``(*batch, N, M)``, never densified."""
        model, _ = self._make_model_and_likelihood(
            batch_shape=self.batch_shape,
            inducing_batch_shape=self.batch_shape,
            distribution_cls=self.distribution_cls,
            strategy_cls=self.strategy_cls,
        )
        x = torch.randn(*self.batch_shape, 5, 2)
        prior = model(x, prior=True)
        self.assertIsInstance(prior.lazy_covariance_matrix, LowRankRootLinearOperator)
        root = model.covar_module(x, model.variational_strategy.inducing_points)
        self.assertAllClose(prior.covariance_matrix, root @ root.mT)

    def test_posterior_at_the_prior_is_the_exact_prior(self):
        r"""At :math:`q(u) = p(u)` exactly (GPyTorch's initialisation without its noise), in float64: the KL is 0, and
        with :math:`s = M` (no truncation) :math:`q(f(x))` is the exact prior of the branches, mean ``mean_module(x)``
        and covariance :math:`\sum_b \kappa_b \kappa_b^\top` formed densely from the kernel (see the module
        docstring). A strategy that scales, drops or double-counts :math:`m`, :math:`S` or :math:`\Lambda` fails
        here, where the shape and gradient tests pass."""
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            torch.manual_seed(self.seed)
            model, _ = self._make_model_and_likelihood(
                batch_shape=self.batch_shape,
                inducing_batch_shape=self.batch_shape,
                distribution_cls=self.distribution_cls,
                strategy_cls=self.strategy_cls,
            )
            strategy = model.variational_strategy
            strategy._variational_distribution.mean_init_std = 0.0  # q(u) starts at p(u) exactly
            x = torch.randn(*self.batch_shape, 7, 2)
            model.eval()
            # a mean-field q(u) starts at prior.stddev, which GPyTorch clamps at min_variance (1e-10 in float64)
            with torch.no_grad(), gpytorch.settings.min_variance(double_value=1e-300):
                output = model(x)
                kl = strategy.kl_divergence()
                landmarks = strategy.inducing_points
                sides = getattr(strategy, "_branch_sides", (getattr(strategy, "side", "left"),))
                covariance = torch.zeros(())
                for side in sides:
                    if side == "left":
                        root = model.covar_module(x, landmarks).to_dense()
                    else:
                        root = model.covar_module(landmarks, x).to_dense().mT
                    covariance = covariance + root @ root.mT
                mean = model.mean_module(x)
        finally:
            torch.set_default_dtype(dtype)
        self.assertEqual(output.mean.dtype, torch.float64)
        self.assertAllClose(kl, torch.zeros_like(kl), rtol=0.0, atol=1e-8)
        self.assertAllClose(output.mean, mean.expand_as(output.mean), rtol=1e-10, atol=1e-10)
        if not self.shared_posterior:
            scale = covariance.abs().max().item()
            self.assertAllClose(
                output.covariance_matrix, covariance.expand_as(output.covariance_matrix), rtol=0.0, atol=1e-8 * scale
            )
