"""Kernel-eigen inducing features: one interface (:class:`KernelEigenFeaturesBase`), evaluated into one per-call
object (:class:`KernelEigenScores`) by the landmark features of GP models and the per-sequence features of attention."""

from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .kernel_eigen_features import KernelEigenFeatures
from .kernel_eigen_features_base import SINGULAR_VALUE_FLOOR, KernelEigenFeaturesBase
from .kernel_eigen_scores import (
    KernelEigenScores,
    induced_kernel_diag,
    inducing_covariance,
    numerically_nonzero,
    prior_variances,
)
from .ksvd_fidelity import KSVDFidelity, ksvd_fidelity

__all__ = [
    "SINGULAR_VALUE_FLOOR",
    "AttentionKernelEigenFeatures",
    "KernelEigenFeatures",
    "KernelEigenFeaturesBase",
    "KernelEigenScores",
    "KSVDFidelity",
    "induced_kernel_diag",
    "inducing_covariance",
    "ksvd_fidelity",
    "numerically_nonzero",
    "prior_variances",
]
