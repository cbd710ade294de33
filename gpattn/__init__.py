"""gpattn: Gaussian-process self-attention for GPyTorch.

Asymmetric kernels, kernel SVD (KSVD), kernel-eigen inducing features with a diagonal :math:`K_{uu}`, the
kernel-eigen variational strategy and the paired left/right SVGP of KEP-SVGP (Chen et al., ICML 2024).
"""

from . import data, features, kernels, ksvd, mlls, models, variational
from .features import KernelEigenFeatures
from .kernels import CosineFeatureKernel, ExponentialDotProductKernel, InducedKernel, ShiftedRBFKernel
from .ksvd import kernel_svd, ksvd_objective
from .mlls import KSVDAddedLossTerm
from .models import KernelEigenPairSVGP
from .variational import KernelEigenPairVariationalStrategy, KernelEigenVariationalStrategy

__version__ = "0.1.0"

__all__ = [
    "CosineFeatureKernel",
    "ExponentialDotProductKernel",
    "InducedKernel",
    "KSVDAddedLossTerm",
    "KernelEigenFeatures",
    "KernelEigenPairSVGP",
    "KernelEigenPairVariationalStrategy",
    "KernelEigenVariationalStrategy",
    "ShiftedRBFKernel",
    "data",
    "features",
    "kernel_svd",
    "kernels",
    "ksvd",
    "ksvd_objective",
    "mlls",
    "models",
    "variational",
]
