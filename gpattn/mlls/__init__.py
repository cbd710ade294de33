"""Objectives: the KSVD added loss term."""

from .ksvd_added_loss_term import KSVDAddedLossTerm

__all__ = ["KSVDAddedLossTerm"]
