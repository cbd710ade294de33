"""Data: toy regression sets drawn from an asymmetric generating process."""

from .toy_regression import RegressionData, make_asymmetric_regression_1d, make_asymmetric_regression_2d

__all__ = ["RegressionData", "make_asymmetric_regression_1d", "make_asymmetric_regression_2d"]
