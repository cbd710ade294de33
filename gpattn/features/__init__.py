"""Kernel-eigen inducing features: one interface (:class:`KernelEigenFeaturesBase`), evaluated into one per-call
object (:class:`KernelEigenScores`) by the landmark features of GP models and the per-sequence features of attention
(one class per mode on :class:`AttentionKernelEigenFeatures`, built by name with :func:`build_attention_features`)."""

from .amortized_attention_features import AmortizedAttentionFeatures
from .attention_feature_modes import ATTENTION_FEATURES, attention_feature_class, build_attention_features
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .exact_attention_features import ExactAttentionFeatures
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
from .learned_attention_features import LearnedAttentionFeatures
from .primal_features_attention_features import PrimalFeaturesAttentionFeatures
from .primal_tokens_attention_features import PrimalTokensAttentionFeatures

__all__ = [
    "ATTENTION_FEATURES",
    "SINGULAR_VALUE_FLOOR",
    "AmortizedAttentionFeatures",
    "AttentionKernelEigenFeatures",
    "ExactAttentionFeatures",
    "KernelEigenFeatures",
    "KernelEigenFeaturesBase",
    "KernelEigenScores",
    "KSVDFidelity",
    "LearnedAttentionFeatures",
    "PrimalFeaturesAttentionFeatures",
    "PrimalTokensAttentionFeatures",
    "attention_feature_class",
    "build_attention_features",
    "induced_kernel_diag",
    "inducing_covariance",
    "ksvd_fidelity",
    "numerically_nonzero",
    "prior_variances",
]
