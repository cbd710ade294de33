"""Models built from the kernel-eigen strategies."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP
from .transformer import Transformer

__all__ = ["KernelEigenPairSVGP", "Transformer"]
