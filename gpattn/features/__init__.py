"""Kernel-eigen inducing features."""

from .kernel_eigen_features import KernelEigenFeatures

__all__ = ["KernelEigenFeatures"]
