"""Matplotlib figures."""

from .posteriors import plot_pair_posterior

__all__ = ["plot_pair_posterior"]
