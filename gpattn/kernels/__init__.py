"""Asymmetric kernels :math:`\\kappa(x, z) \\neq \\kappa(z, x)` and the symmetric kernels they induce."""

from .asymmetric_kernel import AsymmetricKernel
from .cosine_feature_kernel import CosineFeatureKernel, inverse_norms
from .exponential_dot_product_kernel import ExponentialDotProductKernel, safe_max_logit
from .feature_lift import FeatureLift
from .induced_kernel import InducedKernel
from .shifted_rbf_kernel import ShiftedRBFKernel
from .squared_distance import first_real_token, padding_filled, squared_distance

__all__ = [
    "AsymmetricKernel",
    "CosineFeatureKernel",
    "ExponentialDotProductKernel",
    "FeatureLift",
    "InducedKernel",
    "ShiftedRBFKernel",
    "first_real_token",
    "padding_filled",
    "inverse_norms",
    "safe_max_logit",
    "squared_distance",
]
