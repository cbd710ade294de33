"""Fused kernels of the KEP-SVGP training step and their plumbing: the autocast state that the hand-written autograd
functions carry from their forward into their backward pass (:mod:`gpattn.fused.autocast`), and the Triton kernels of
the fused amortised scores with the predicate that decides when they run (:mod:`gpattn.fused.triton_scores`; the
PyTorch code of :mod:`gpattn.features.amortized_scores` is their reference and the CPU path)."""

from .autocast import AutocastState, autocast_state, full_precision, restored_autocast, wide_dtype

__all__ = ["AutocastState", "autocast_state", "full_precision", "restored_autocast", "wide_dtype"]
