"""Matplotlib figures."""

from .comparison import (
    plot_ood_histograms,
    plot_reliability_diagrams,
    plot_shift_curves,
    plot_spectra,
    write_comparison_figures,
)
from .posteriors import plot_pair_posterior

__all__ = [
    "plot_ood_histograms",
    "plot_pair_posterior",
    "plot_reliability_diagrams",
    "plot_shift_curves",
    "plot_spectra",
    "write_comparison_figures",
]
