"""GPyTorch's own variational-strategy harness run on :class:`~gpattn.variational.KernelEigenVariationalStrategy`.

The shipped :class:`gpytorch.test.variational_test_case.VariationalTestCase` trains and evaluates a small SVGP over a
grid of batch shapes and checks shapes, that every parameter receives a nonzero gradient, and (through its mocks) which
linear-algebra routines run. Here the model's kernel is a :class:`~gpattn.kernels.CosineFeatureKernel` (RFF lift, so
the 16 x 16 landmark matrix of 2-D inputs has full rank 16) and the strategy is the kernel-eigen one, whose
:math:`K_{uu} = \\Lambda^2` is diagonal: the O(s) claim is that no Cholesky (and no CG/CIQ) of :math:`K_{uu}` ever runs.

* Cholesky and mean-field :math:`q(u)`: ``torch.linalg.cholesky_ex`` is never called, in training or evaluation.
* Natural :math:`q(u)`: :class:`~gpytorch.variational.NaturalVariationalDistribution` turns its natural parameters into
  :math:`(m, S)` by two Cholesky factorisations of s x s matrices built from the *variational* parameters
  (:math:`-2\\Theta_2` and :math:`S`). Those calls are legitimate (they are :math:`q(u)`'s, not :math:`K_{uu}`'s); the
  natural cases therefore assert that every Cholesky call originates in
  ``gpytorch/variational/natural_variational_distribution.py`` and nowhere else.
* The strategy has no online-conditioning (fantasy) support: ``get_fantasy_model`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import traceback
import unittest
from unittest.mock import patch

import gpytorch
import pytest
import torch
from gpytorch.test.variational_test_case import VariationalTestCase
from linear_operator.operators import LowRankRootLinearOperator

from gpattn.kernels import CosineFeatureKernel
from gpattn.variational import KernelEigenVariationalStrategy

NATURAL_FILE = "natural_variational_distribution.py"


class _KernelEigenSVGP(gpytorch.models.ApproximateGP):
    """The harness's regression model with the cosine-feature kernel in place of a scaled RBF."""

    def __init__(self, inducing_points, num_inducing, batch_shape, strategy_cls, distribution_cls, constant_mean, tie):
        variational_distribution = distribution_cls(num_inducing, batch_shape=batch_shape)
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

    def forward(self, x):
        # The exact (untruncated) prior of the left branch: f(x) = kappa(x, Z) w, w ~ N(0, I). Used by the harness only
        # through ``prior=True`` and the fantasy path.
        root = self.covar_module(x, self.variational_strategy.inducing_points)  # shape: (*batch, N, M)
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), LowRankRootLinearOperator(root))


class _CholeskyCallSites:
    """A stand-in for ``torch.linalg.cholesky_ex`` that records the gpytorch/linear_operator file that called it."""

    def __init__(self, wrapped):
        self.wrapped = wrapped
        self.callers: list[str] = []

    def __call__(self, *args, **kwargs):
        frames = traceback.extract_stack()[:-1]
        # the innermost frame outside linear_operator's Cholesky helpers
        outer = [f.filename for f in frames if not f.filename.endswith(("cholesky.py", "mock.py"))]
        self.callers.append(outer[-1])
        return self.wrapped(*args, **kwargs)


class _KernelEigenVariationalTestCase(VariationalTestCase):
    seed = 0
    tie = True
    strategy_cls = KernelEigenVariationalStrategy
    mll_cls = gpytorch.mlls.VariationalELBO
    distribution_cls = gpytorch.variational.CholeskyVariationalDistribution

    @property
    def batch_shape(self):
        return torch.Size([])

    @property
    def natural(self) -> bool:
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
        model = _KernelEigenSVGP(
            inducing_points, num_inducing, batch_shape, strategy_cls, distribution_cls, constant_mean, self.tie
        )
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
        recorder = _CholeskyCallSites(torch.linalg.cholesky_ex)
        with patch("torch.linalg.cholesky_ex", new=recorder):  # the harness's mock wraps the recorder
            cg_mock, cholesky_mock, ciq_mock = super().test_eval_iteration(*args, **kwargs)
        self._check_no_kuu_factorisation(cg_mock, cholesky_mock, ciq_mock, recorder)

    def test_training_iteration(self, *args, **kwargs):
        recorder = _CholeskyCallSites(torch.linalg.cholesky_ex)
        with patch("torch.linalg.cholesky_ex", new=recorder):
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
            with self.assertRaisesRegex(NotImplementedError, "No fantasy model support"):
                self._fantasy_iter(model, likelihood, data_batch_shape, num_fant=10, **cm_dict)

    def test_prior_call_is_model_forward(self):
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


def _fixed_landmark_strategy(*args, learn_inducing_locations=True, **kwargs):
    return KernelEigenVariationalStrategy(*args, learn_inducing_locations=False, **kwargs)


class TestCholeskyELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    def test_fixed_landmarks_are_not_learned(self):
        # learn_inducing_locations=False must reach the features: no landmark parameter anywhere, one landmark tensor
        model, likelihood = self._make_model_and_likelihood(strategy_cls=_fixed_landmark_strategy)
        strategy = model.variational_strategy
        self.assertNotIn("landmarks", " ".join(name for name, _ in model.named_parameters()))
        self.assertNotIn("inducing_points", " ".join(name for name, _ in model.named_parameters()))
        self.assertIs(strategy.inducing_points, strategy.features.landmarks)
        landmarks = strategy.inducing_points.clone()
        self._training_iter(model, likelihood, mll_cls=self.mll_cls)
        self.assertTrue(torch.equal(strategy.features.landmarks, landmarks))


class TestCholeskyELBOBatch(_KernelEigenVariationalTestCase, unittest.TestCase):
    @property
    def batch_shape(self):
        return torch.Size([2])


@pytest.mark.filterwarnings("ignore:Negative variance values detected")
class TestMeanFieldELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    r"""GPyTorch's mean-field initialisation reads ``prior.stddev``; in float32 the smallest :math:`\lambda_j^2` of the
    16 x 16 landmark matrix fall below GPyTorch's ``min_variance`` (1e-6) and are clamped with a NumericalWarning."""

    distribution_cls = gpytorch.variational.MeanFieldVariationalDistribution


class TestCholeskyPredictiveLL(_KernelEigenVariationalTestCase, unittest.TestCase):
    mll_cls = gpytorch.mlls.PredictiveLogLikelihood


class TestNaturalELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    r"""Unwhitened natural q(u). The harness's "every parameter has a nonzero gradient" check is kept for every
    parameter but ``covar_module.raw_outputscale``, whose gradient vanishes legitimately at the harness's evaluation
    point:

    * :math:`\kappa = \sigma_f \hat\kappa` gives :math:`\Lambda = \sigma_f \hat\Lambda` and
      :math:`e(x) = \sigma_f \hat e(x)`, so the interpolation :math:`e(x) \Lambda^{-1}` is independent of
      :math:`\sigma_f`, and a natural q(u) has :math:`(m, S)` independent of :math:`\sigma_f` too;
    * with s = M (16 landmarks, 16 inducing variables) the residual :math:`k_e(x, x) - \|e(x)\|^2` is exactly 0;
    * the only remaining dependence is the KL through :math:`p(u) = \mathcal N(0, \sigma_f^2 \hat\Lambda^2)`, which
      is stationary in p at q = p: the harness never steps the optimiser, and the natural initialisation sets
      :math:`S = \Lambda^2` exactly (its 1e-3 noise enters :math:`\theta_1 = S^{-1} m`, so the gradient is
      O(1e-6) and rounds to 0 in float32).

    :meth:`test_outputscale_gradient_vanishes_only_at_q_equal_p` checks this in float64; the whitened natural case
    below runs the harness's check unchanged."""

    distribution_cls = gpytorch.variational.NaturalVariationalDistribution
    exempt = "covar_module.raw_outputscale"

    def _training_iter(
        self, model, likelihood, batch_shape=torch.Size([]), mll_cls=gpytorch.mlls.VariationalELBO, cuda=False
    ):
        # the harness's _training_iter with one documented exemption (see the class docstring)
        train_x = torch.randn(*batch_shape, 32, 2).clamp(-2.5, 2.5)
        train_y = torch.linspace(-1, 1, self.event_shape[0]).expand(*self.event_shape)
        mll = mll_cls(likelihood, model, num_data=train_x.size(-2))
        model.train()
        likelihood.train()
        output = model(train_x)
        loss = -mll(output, train_y)
        loss.sum().backward()
        for name, param in [*model.named_parameters(), *likelihood.named_parameters()]:
            self.assertIsNotNone(param.grad, name)
            if name == self.exempt:
                self.assertLess(param.grad.norm().item(), 1e-4, name)
            else:
                self.assertGreater(param.grad.norm().item(), 0, name)
        return output, loss

    def test_outputscale_gradient_vanishes_only_at_q_equal_p(self):
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model, likelihood = self._make_model_and_likelihood(distribution_cls=self.distribution_cls)
            train_x = torch.randn(32, 2).clamp(-2.5, 2.5)
            mll = self.mll_cls(likelihood, model, num_data=32)
            grads = []
            for _ in range(2):
                model.zero_grad()
                output = model(train_x)
                # s = M: the residual vanishes
                self.assertLess(model.variational_strategy.interp_and_residual(train_x)[1].abs().max().item(), 1e-10)
                (-mll(output, torch.linspace(-1, 1, 32))).backward()
                grads.append(model.covar_module.raw_outputscale.grad.abs().item())
                with torch.no_grad():  # move S away from the prior Lambda^2
                    model.variational_strategy._variational_distribution.natural_mat.mul_(1.1)
        finally:
            torch.set_default_dtype(dtype)
        self.assertLess(grads[0], 1e-4)
        self.assertGreater(grads[1], 1e-3)


class TestWhitenedNaturalELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    distribution_cls = gpytorch.variational.NaturalVariationalDistribution
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, whiten=True)


class TestWhitenedCholeskyELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, whiten=True)

    def test_whitened_prior_is_identity(self):
        model, _ = self._make_model_and_likelihood(strategy_cls=self.strategy_cls)
        prior = model.variational_strategy.prior_distribution
        self.assertTrue(torch.equal(prior.covariance_matrix, torch.eye(16)))


class TestAsymmetricCholeskyELBO(_KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False


class TestAsymmetricRightCholeskyELBOBatch(_KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, side="right")

    @property
    def batch_shape(self):
        return torch.Size([2])


if __name__ == "__main__":
    unittest.main()
