"""Variational strategies with kernel-eigen inducing variables, and the readout of their q(f) that attention layers
hold."""

from .kernel_eigen_pair_variational_strategy import KernelEigenPairVariationalStrategy
from .kernel_eigen_readout import KernelEigenReadout
from .kernel_eigen_variational_strategy import KernelEigenVariationalStrategy

__all__ = ["KernelEigenPairVariationalStrategy", "KernelEigenReadout", "KernelEigenVariationalStrategy"]
