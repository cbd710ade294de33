"""Objectives: the KSVD and CGP added loss terms and the attention ELBO."""

from .attention_elbo import AttentionELBO
from .cgp_added_loss_term import CGPAddedLossTerm
from .ksvd_added_loss_term import KSVDAddedLossTerm
from .sequence_kl_added_loss_term import SequenceKLAddedLossTerm

__all__ = ["AttentionELBO", "CGPAddedLossTerm", "KSVDAddedLossTerm", "SequenceKLAddedLossTerm"]
