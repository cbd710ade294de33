"""Models built from the kernel-eigen strategies, and Monte Carlo prediction."""

from .kernel_eigen_pair_svgp import KernelEigenPairSVGP
from .prediction import predict_probabilities
from .presets import VIT_CIFAR_PRESET
from .transformer import Transformer

__all__ = ["VIT_CIFAR_PRESET", "KernelEigenPairSVGP", "Transformer", "predict_probabilities"]
