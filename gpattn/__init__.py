"""gpattn: Gaussian-process self-attention for GPyTorch.

Asymmetric kernels, kernel SVD (KSVD), kernel-eigen inducing features with a diagonal :math:`K_{uu}`, the
kernel-eigen variational strategy and the paired left/right SVGP of KEP-SVGP (Chen et al., ICML 2024), and
attention layers (KEP-SVGP and its baselines) under one interface.
"""

from . import attention, data, features, kernels, ksvd, mlls, models, variational
from .attention import KEPSVGPAttention, build_attention
from .features import AttentionKernelEigenFeatures, KernelEigenFeatures
from .kernels import CosineFeatureKernel, ExponentialDotProductKernel, InducedKernel, ShiftedRBFKernel
from .ksvd import kernel_svd, ksvd_objective
from .mlls import AttentionELBO, KSVDAddedLossTerm
from .models import KernelEigenPairSVGP, Transformer, predict_probabilities
from .variational import KernelEigenPairVariationalStrategy, KernelEigenVariationalStrategy

__version__ = "0.1.0"

__all__ = [
    "AttentionELBO",
    "AttentionKernelEigenFeatures",
    "CosineFeatureKernel",
    "ExponentialDotProductKernel",
    "InducedKernel",
    "KEPSVGPAttention",
    "KSVDAddedLossTerm",
    "KernelEigenFeatures",
    "KernelEigenPairSVGP",
    "KernelEigenPairVariationalStrategy",
    "KernelEigenVariationalStrategy",
    "ShiftedRBFKernel",
    "Transformer",
    "attention",
    "build_attention",
    "data",
    "features",
    "kernel_svd",
    "kernels",
    "ksvd",
    "ksvd_objective",
    "mlls",
    "models",
    "predict_probabilities",
    "variational",
]
