"""Matplotlib figures."""

from .comparison import (
    comparison_figure_names,
    plot_ood_histograms,
    plot_reliability_diagrams,
    plot_spectra,
    write_comparison_figures,
)
from .fidelity import plot_fidelity, write_fidelity_figure
from .posteriors import plot_pair_posterior
from .shift import plot_gap_vs_shift_ece, plot_shift_curves

__all__ = [
    "comparison_figure_names",
    "plot_fidelity",
    "plot_gap_vs_shift_ece",
    "plot_ood_histograms",
    "plot_pair_posterior",
    "plot_reliability_diagrams",
    "plot_shift_curves",
    "plot_spectra",
    "write_comparison_figures",
    "write_fidelity_figure",
]
