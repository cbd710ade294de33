"""Variational strategies with kernel-eigen inducing variables."""

from .kernel_eigen_pair_variational_strategy import KernelEigenPairVariationalStrategy
from .kernel_eigen_variational_strategy import KernelEigenVariationalStrategy

__all__ = ["KernelEigenPairVariationalStrategy", "KernelEigenVariationalStrategy"]
