"""Kernel-eigen inducing features: on a landmark set (GP models) and per sequence (attention)."""

from .attention_kernel_eigen_features import AttentionKernelEigenFeatures, AttentionScores
from .kernel_eigen_features import KernelEigenFeatures

__all__ = ["AttentionKernelEigenFeatures", "AttentionScores", "KernelEigenFeatures"]
