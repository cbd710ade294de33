"""Models built from the kernel-eigen strategies."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP

__all__ = ["KernelEigenPairSVGP"]
