"""Test harnesses shipped with gpattn (as ``gpytorch.test`` ships GPyTorch's), for strategies built on it."""

from .kernel_eigen_variational_test_case import KernelEigenVariationalTestCase

__all__ = ["KernelEigenVariationalTestCase"]
