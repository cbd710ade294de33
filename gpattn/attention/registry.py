"""Attention layers by name: a new attention is one file plus one line in :data:`ATTENTIONS`."""

from __future__ import annotations

import inspect
from typing import Any

from ._base import AttentionLayer
from .cgpt_attention import CGPTAttention
from .kep_svgp_attention import KEPSVGPAttention
from .primal_attention import PrimalAttention
from .sgpa_attention import SGPAAttention
from .softmax_attention import SoftmaxAttention
from .symmetric_svgp_attention import SymmetricSVGPAttention

#: name -> (layer class, default keyword arguments). Every class takes ``(embed_dim, num_heads, **kwargs)``.
ATTENTIONS: dict[str, tuple[type[AttentionLayer], dict[str, Any]]] = {
    # KEP-SVGP (Chen et al. 2024): asymmetric cosine kernel, left/right kernel-eigen SVGP pair
    "kep_svgp": (KEPSVGPAttention, {}),
    # the symmetric KEP ablation: W_q = W_k makes the kernel symmetric PSD (MATH.md section 5)
    "kep_svgp_sym": (KEPSVGPAttention, {"tie_qk": True}),
    # SGPA (Chen & Li 2023): symmetric kernel, decoupled SVGP with amortised and global inducing keys
    "sgpa": (SGPAAttention, {}),
    # a standard whitened GPyTorch SVGP per head on the projected tokens
    "svgp": (SymmetricSVGPAttention, {}),
    # canonical multi-head scaled dot-product attention (deterministic)
    "softmax": (SoftmaxAttention, {}),
    # Primal-Attention (Chen et al. 2023): deterministic KSVD scores, KSVD loss
    "primal": (PrimalAttention, {}),
    # CGPT (Bui et al. 2024): asymmetric kernel as the cross-covariance of two GPs correlated through a latent GP
    "cgpt": (CGPTAttention, {}),
}


def attention_names() -> list[str]:
    """The registered attention names.

    :return: The keys of :data:`ATTENTIONS`, in registry order.
    """
    return list(ATTENTIONS)


def _layer_class(name: str) -> type[AttentionLayer]:
    if not isinstance(name, str):
        raise TypeError(f"expected an attention name to be a string, got {type(name).__name__}: {name!r}")
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; expected one of {attention_names()}")
    return ATTENTIONS[name][0]


def attention_arguments(name: str) -> list[str]:
    """The keyword arguments the layer registered as ``name`` accepts besides ``embed_dim`` and ``num_heads``
    (e.g. to pass ``num_inducing`` only to the layers that have one).

    :param name: One of :func:`attention_names`.
    :return: Argument names, in signature order.
    """
    parameters = inspect.signature(_layer_class(name)).parameters
    return [key for key in parameters if key not in ("embed_dim", "num_heads")]


def build_attention(name: str, embed_dim: int, num_heads: int, **kwargs: Any) -> AttentionLayer:
    """Build the attention layer registered as ``name``.

    :param name: One of :func:`attention_names`.
    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads (must divide ``embed_dim``).
    :param kwargs: Keyword arguments of the layer class (:func:`attention_arguments`); they override the registry
        defaults.
    :return: The layer, an :class:`~gpattn.attention.AttentionLayer`.
    """
    layer_cls = _layer_class(name)
    accepted = attention_arguments(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{layer_cls.__name__} ({name!r}) got unexpected arguments {unknown}; it accepts {accepted}")
    return layer_cls(embed_dim, num_heads, **{**ATTENTIONS[name][1], **kwargs})
