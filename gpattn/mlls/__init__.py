"""Objectives: the KSVD added loss term and the attention ELBO."""

from .attention_elbo import AttentionELBO
from .ksvd_added_loss_term import KSVDAddedLossTerm

__all__ = ["AttentionELBO", "KSVDAddedLossTerm"]
