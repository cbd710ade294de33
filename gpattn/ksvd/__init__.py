"""Kernel singular value decomposition (KSVD) of asymmetric kernel matrices."""

from .kernel_svd import KernelSVD, kernel_svd
from .ksvd_objective import ksvd_objective

__all__ = ["KernelSVD", "kernel_svd", "ksvd_objective"]
