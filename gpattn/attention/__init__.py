"""Attention layers with one interface: KEP-SVGP, its symmetric ablation, SGPA, symmetric SVGP, softmax, Primal,
CGPT."""

from ._base import AttentionInputs, AttentionLayer, sample_attention
from .cgpt_attention import CGPTAttention
from .kep_svgp_attention import KEPSVGPAttention
from .primal_attention import PrimalAttention
from .registry import (
    ATTENTIONS,
    accepts_argument,
    attention_arguments,
    attention_names,
    build_attention,
    register_attention,
    select_arguments,
    unregister_attention,
)
from .sgpa_attention import SGPAAttention
from .softmax_attention import SoftmaxAttention
from .symmetric_svgp_attention import SymmetricSVGPAttention

__all__ = [
    "ATTENTIONS",
    "AttentionInputs",
    "AttentionLayer",
    "CGPTAttention",
    "KEPSVGPAttention",
    "PrimalAttention",
    "SGPAAttention",
    "SoftmaxAttention",
    "SymmetricSVGPAttention",
    "accepts_argument",
    "attention_arguments",
    "attention_names",
    "build_attention",
    "register_attention",
    "sample_attention",
    "select_arguments",
    "unregister_attention",
]
