"""Models built from the kernel-eigen strategies."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP
from .presets import VIT_CIFAR_PRESET
from .transformer import Transformer

__all__ = ["VIT_CIFAR_PRESET", "KernelEigenPairSVGP", "Transformer"]
