"""The user-facing names of the attention feature modes (``features="exact"`` etc. of the attention layers) and the one
place that maps a name to its class."""

from __future__ import annotations

from typing import Any

from ..validation import check_choice
from .amortized_attention_features import AmortizedAttentionFeatures
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .exact_attention_features import ExactAttentionFeatures
from .primal_features_attention_features import PrimalFeaturesAttentionFeatures
from .primal_tokens_attention_features import PrimalTokensAttentionFeatures

#: mode name -> feature class (each class's ``mode`` attribute is its name here)
ATTENTION_FEATURES: dict[str, type[AttentionKernelEigenFeatures]] = {
    cls.mode: cls
    for cls in (
        AmortizedAttentionFeatures,
        PrimalTokensAttentionFeatures,
        PrimalFeaturesAttentionFeatures,
        ExactAttentionFeatures,
    )
}


def attention_feature_class(mode: str) -> type[AttentionKernelEigenFeatures]:
    """The attention feature class of a mode name (its capabilities can be read before building it).

    Example:
        >>> attention_feature_class("exact").spectrum_per_call, attention_feature_class("amortized").supports_causal
        (True, True)

    :param mode: One of the keys of :data:`ATTENTION_FEATURES`: ``"amortized"``, ``"primal_tokens"``,
        ``"primal_features"`` or ``"exact"``.
    :raises ValueError: An unknown name.
    """
    check_choice("features", mode, tuple(ATTENTION_FEATURES), where="AttentionKernelEigenFeatures")
    return ATTENTION_FEATURES[mode]


def build_attention_features(
    embed_dim: int, num_heads: int, num_inducing: int | None = None, mode: str = "amortized", **kwargs: Any
) -> AttentionKernelEigenFeatures:
    r"""Build the attention features of a mode by its name (what ``features="..."`` of
    :class:`~gpattn.attention.KEPSVGPAttention` and :class:`~gpattn.attention.PrimalAttention` does).

    Example:
        >>> features = build_attention_features(16, 2, num_inducing=3, mode="primal_tokens", max_len=32)
        >>> type(features).__name__, features.mode, features.supports_causal
        ('PrimalTokensAttentionFeatures', 'primal_tokens', False)

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s` (default: the class's, :math:`\min(10, p)`).
    :param mode: A key of :data:`ATTENTION_FEATURES`.
    :param kwargs: The other arguments of :class:`~gpattn.features.AttentionKernelEigenFeatures`.
    :return: An instance of ``ATTENTION_FEATURES[mode]``.
    """
    return attention_feature_class(mode)(embed_dim, num_heads, num_inducing, **kwargs)
