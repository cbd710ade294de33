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
    branches = 1  # the shared posterior's branch dimension is added below
    strategy_cls = functools.partial(KernelEigenPairVariationalStrategy, shared_posterior=True)

    def _make_model_and_likelihood(self, *args, batch_shape=torch.Size([]), **kwargs):
        return super()._make_model_and_likelihood(*args, batch_shape=torch.Size(batch_shape) + (1,), **kwargs)


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


if __name__ == "__main__":
    unittest.main()
