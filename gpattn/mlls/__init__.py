"""Objectives: the KSVD added loss term, the attention ELBO and Monte Carlo prediction."""

from .attention_elbo import AttentionELBO, predict_probabilities
from .ksvd_added_loss_term import KSVDAddedLossTerm

__all__ = ["AttentionELBO", "KSVDAddedLossTerm", "predict_probabilities"]
