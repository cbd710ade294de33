"""GPyTorch's variational-strategy harness run on :class:`~gpattn.variational.KernelEigenPairVariationalStrategy`
(both branches stacked on the last batch dimension of q(u)), through the shipped
:class:`~gpattn.test.KernelEigenVariationalTestCase`: shapes over GPyTorch's grid of batch shapes, a nonzero gradient
for every parameter, no Cholesky of :math:`K_{uu}` anywhere, and the pair's checks of its own arguments."""

from __future__ import annotations

import functools
import unittest

import gpytorch
import pytest
import torch

from gpattn.kernels import ShiftedRBFKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.test import KernelEigenVariationalTestCase
from gpattn.variational import KernelEigenPairVariationalStrategy


class TestPairCholeskyELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    branches = 2
    strategy_cls = KernelEigenPairVariationalStrategy


class TestPairCholeskyELBOBatch(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    branches = 2
    strategy_cls = KernelEigenPairVariationalStrategy

    @property
    def batch_shape(self):
        return torch.Size([2])


class TestPairWhitenedNaturalELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    branches = 2
    distribution_cls = gpytorch.variational.NaturalVariationalDistribution
    strategy_cls = functools.partial(KernelEigenPairVariationalStrategy, whiten=True)


@pytest.mark.filterwarnings("ignore:Negative variance values detected")
class TestPairMeanFieldPredictiveLL(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    branches = 2
    distribution_cls = gpytorch.variational.MeanFieldVariationalDistribution
    mll_cls = gpytorch.mlls.PredictiveLogLikelihood
    strategy_cls = KernelEigenPairVariationalStrategy


class TestPairSharedPosteriorELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    """One shared q(u) for both branches: a branch dimension of size 1."""

    tie = False
    shared_posterior = True  # the harness gives q(u) a branch dimension of size 1
    strategy_cls = functools.partial(KernelEigenPairVariationalStrategy, shared_posterior=True)


def test_the_branch_dimension_is_checked():
    model_args = (torch.nn.Module(), torch.randn(8, 2))
    with pytest.raises(ValueError, match=r"batch shape \(\*batch, 2\).*got \(3,\)"):
        KernelEigenPairVariationalStrategy(*model_args, gpytorch.variational.CholeskyVariationalDistribution(4, (3,)))
    with pytest.raises(ValueError, match=r"batch shape \(\*batch, 1\).*one shared posterior"):
        KernelEigenPairVariationalStrategy(
            *model_args, gpytorch.variational.CholeskyVariationalDistribution(4, (2,)), shared_posterior=True
        )
    with pytest.raises(ValueError, match="merge"):
        KernelEigenPairVariationalStrategy(
            *model_args, gpytorch.variational.CholeskyVariationalDistribution(4, (2,)), merge="product"
        )


@pytest.mark.parametrize("shared_posterior", ["no", "False", 0, None])
def test_shared_posterior_must_be_a_bool(shared_posterior):
    """``shared_posterior="no"`` was read as true: one q(u) shared by both branches (the official code's posterior)."""
    message = r"KernelEigenPairVariationalStrategy: expected shared_posterior to be True or False, got "
    with pytest.raises(TypeError, match=message):
        KernelEigenPairVariationalStrategy(
            torch.nn.Module(),
            torch.randn(8, 2),
            gpytorch.variational.CholeskyVariationalDistribution(4, (1,)),
            shared_posterior=shared_posterior,
        )


def test_a_pair_inside_a_multi_output_wrapper_is_refused_and_a_batch_of_outputs_works():
    # GPyTorch's IndependentMultitaskVariationalStrategy takes GPyTorch's generic KL of the base strategy's
    # distributions, which would not sum the branch dimension (it failed with "a Tensor with 3 elements cannot be
    # converted to Scalar" in the ELBO): refused on the first call, naming what to do instead
    torch.manual_seed(0)
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    landmarks, kernel = torch.randn(8, 2, dtype=torch.float64), ShiftedRBFKernel(2).double()

    class Wrapped(gpytorch.models.ApproximateGP):
        def __init__(self):
            q_u = gpytorch.variational.CholeskyVariationalDistribution(4, batch_shape=torch.Size([3, 2]))
            pair = KernelEigenPairVariationalStrategy(self, landmarks, q_u)
            super().__init__(gpytorch.variational.IndependentMultitaskVariationalStrategy(pair, num_tasks=3))
            self.covar_module, self.mean_module = kernel, gpytorch.means.ZeroMean()

    with pytest.raises(NotImplementedError, match="inside IndependentMultitaskVariationalStrategy"):
        Wrapped().double()(x)
    # the batch of outputs: entry t of the ELBO is output t's, by hand from the likelihood and the KL
    model = KernelEigenPairSVGP(landmarks, kernel, 4, batch_shape=torch.Size([3])).double()
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([3])).double()
    output = model(x)
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=12)(output, y.mT)
    kl = model.variational_strategy.kl_divergence()
    assert elbo.shape == kl.shape == (3,)
    expected = likelihood.expected_log_prob(y.mT, output).sum(-1) / 12 - kl / 12
    torch.testing.assert_close(elbo, expected, rtol=1e-12, atol=1e-12)
    elbo.sum().backward()


if __name__ == "__main__":
    unittest.main()


# -- the harness fails on a broken strategy ---------------------------------------------------------------------------
class _FactorisingPair(KernelEigenPairVariationalStrategy):
    """Factorises K_uu = Lambda^2 by torch.linalg.cholesky on every call (the O(s^3) the harness must catch)."""

    def forward(self, x, *args, **kwargs):
        torch.linalg.cholesky(self.prior_distribution.covariance_matrix)
        return super().forward(x, *args, **kwargs)


class _DoubledCovariancePair(KernelEigenPairVariationalStrategy):
    """Right shapes and gradients, wrong numbers: the predictive covariance doubled."""

    def forward(self, x, *args, **kwargs):
        output = super().forward(x, *args, **kwargs)
        return gpytorch.distributions.MultivariateNormal(output.mean, output.lazy_covariance_matrix * 2.0)


class _ShiftedMeanPair(KernelEigenPairVariationalStrategy):
    """Right shapes and gradients, wrong numbers: the predictive mean shifted by one."""

    def forward(self, x, *args, **kwargs):
        output = super().forward(x, *args, **kwargs)
        return gpytorch.distributions.MultivariateNormal(output.mean + 1.0, output.lazy_covariance_matrix)


def _harness_failures(strategy_cls, methods: tuple[str, ...]) -> list[str]:
    attributes = {"tie": False, "branches": 2, "strategy_cls": strategy_cls}
    case = type("Case", (KernelEigenVariationalTestCase, unittest.TestCase), attributes)
    result = unittest.TestResult()
    unittest.TestSuite(case(method) for method in methods).run(result)
    assert result.testsRun == len(methods) and not result.errors, result.errors
    return sorted(test._testMethodName for test, _ in result.failures)


def test_the_harness_fails_a_broken_strategy():
    # a strategy calling torch.linalg.cholesky on K_uu, or returning wrong numbers of the right shapes, passed every
    # test of the harness: only cholesky_ex was watched, and nothing checked a number
    factorisation = ("test_training_iteration", "test_eval_iteration")
    numbers = ("test_posterior_at_the_prior_is_the_exact_prior",)
    assert _harness_failures(KernelEigenPairVariationalStrategy, factorisation + numbers) == []
    assert _harness_failures(_FactorisingPair, factorisation) == sorted(factorisation)
    assert _harness_failures(_DoubledCovariancePair, numbers + factorisation) == list(numbers)
    assert _harness_failures(_ShiftedMeanPair, numbers) == list(numbers)
