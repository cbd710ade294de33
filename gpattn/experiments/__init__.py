"""Experiments: the toy regression fit (exact GP vs KEP-SVGP via VariationalELBO and Pyro SVI)."""

from .toy_regression import (
    ToyRegressionConfig,
    ToyRegressionResult,
    fit_exact_gp,
    fit_pair_svgp,
    fit_pair_svgp_pyro,
    format_result,
    run_toy_regression,
)

__all__ = [
    "ToyRegressionConfig",
    "ToyRegressionResult",
    "fit_exact_gp",
    "fit_pair_svgp",
    "fit_pair_svgp_pyro",
    "format_result",
    "run_toy_regression",
]
