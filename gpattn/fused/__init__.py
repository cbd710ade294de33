"""Fused kernels of the KEP-SVGP training step and their plumbing: the autocast state that the hand-written autograd
functions carry from their forward into their backward pass (:mod:`gpattn.fused.autocast`), and the Triton kernels of
the fused amortised scores with the predicate that decides when they run (:mod:`gpattn.fused.triton_scores`; the
PyTorch code of :mod:`gpattn.features.amortized_scores` is their reference and the CPU path), and the guard that
refuses second derivatives through those functions (:mod:`gpattn.fused.first_order`)."""

from .autocast import AutocastState, autocast_state, full_precision, restored_autocast, wide_dtype
from .first_order import first_derivatives_only

__all__ = [
    "AutocastState",
    "autocast_state",
    "first_derivatives_only",
    "full_precision",
    "restored_autocast",
    "wide_dtype",
]
