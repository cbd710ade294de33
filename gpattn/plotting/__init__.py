"""Matplotlib figures."""

from .comparison import (
    plot_ood_histograms,
    plot_reliability_diagrams,
    plot_shift_curves,
    plot_spectra,
    write_comparison_figures,
)
from .fidelity import plot_fidelity, write_fidelity_figure
from .posteriors import plot_pair_posterior

__all__ = [
    "plot_fidelity",
    "plot_ood_histograms",
    "plot_pair_posterior",
    "plot_reliability_diagrams",
    "plot_shift_curves",
    "plot_spectra",
    "write_comparison_figures",
    "write_fidelity_figure",
]
