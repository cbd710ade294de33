"""Kernel singular value decomposition (KSVD) of asymmetric kernel matrices."""

from .kernel_svd import SVD_METHODS, KernelSVD, default_gradient_tolerance, kernel_svd
from .ksvd_objective import ksvd_objective

__all__ = ["SVD_METHODS", "KernelSVD", "default_gradient_tolerance", "kernel_svd", "ksvd_objective"]
