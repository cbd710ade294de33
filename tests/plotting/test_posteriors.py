"""Posterior figures."""

from __future__ import annotations

import pytest
import torch

from gpattn.data import make_asymmetric_regression_1d, make_asymmetric_regression_2d
from gpattn.kernels import ShiftedRBFKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.plotting import plot_pair_posterior


def _model() -> KernelEigenPairSVGP:
    landmarks = torch.linspace(-3, 3, 10, dtype=torch.float64).unsqueeze(-1)
    return KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(1).double(), num_inducing=6).double()


def test_three_labelled_panels() -> None:
    figure = plot_pair_posterior(_model(), make_asymmetric_regression_1d(n_train=30, n_test=10))
    axes = figure.axes
    assert len(axes) == 3
    assert [axis.get_xlabel() for axis in axes] == ["x", "x", "x"]
    assert axes[0].get_ylabel() == "f(x)"
    assert all(axis.get_title() for axis in axes)
    assert all(axis.get_legend() is not None for axis in axes)
    assert "training data" in [text.get_text() for text in axes[2].get_legend().get_texts()]


def test_two_dimensional_data_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 1-D inputs"):
        plot_pair_posterior(_model(), make_asymmetric_regression_2d(n_train=10, n_test=10))
