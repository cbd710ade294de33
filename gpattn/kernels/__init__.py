"""Asymmetric kernels :math:`\\kappa(x, z) \\neq \\kappa(z, x)` and the symmetric kernels they induce."""

from .asymmetric_kernel import AsymmetricKernel
from .cosine_feature_kernel import CosineFeatureKernel, inverse_norms
from .exponential_dot_product_kernel import ExponentialDotProductKernel, safe_max_logit
from .feature_lift import FeatureLift
from .induced_kernel import InducedKernel
from .shifted_rbf_kernel import ShiftedRBFKernel

__all__ = [
    "AsymmetricKernel",
    "CosineFeatureKernel",
    "ExponentialDotProductKernel",
    "FeatureLift",
    "InducedKernel",
    "ShiftedRBFKernel",
    "inverse_norms",
    "safe_max_logit",
]
