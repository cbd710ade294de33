"""Posterior figures."""

from __future__ import annotations

import gpytorch
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


def test_exact_gp_band_and_pyro_fit_are_drawn() -> None:
    import gpytorch
    import numpy as np
    from linear_operator.operators import DiagLinearOperator

    data = make_asymmetric_regression_1d(n_train=30, n_test=10)
    grid = data.grid_x.squeeze(-1).double()
    mean, variance = torch.sin(grid), 0.1 + grid.abs()

    def exact_gp(x):  # a stand-in for a trained ExactGP: a known posterior on the grid
        return gpytorch.distributions.MultivariateNormal(mean, DiagLinearOperator(variance))

    torch.manual_seed(1)
    pyro_model = _model()
    figure = plot_pair_posterior(_model(), data, exact_gp=exact_gp, pyro_model=pyro_model)
    merged = figure.axes[2]
    labels = [text.get_text() for text in merged.get_legend().get_texts()]
    assert "exact GP ±2σ" in labels and "KEP-SVGP by Pyro SVI: mean" in labels
    band = next(c for c in merged.collections if c.get_label() == "exact GP ±2σ")
    vertices = band.get_paths()[0].vertices
    upper = (mean + 2 * variance.sqrt()).numpy()
    lower = (mean - 2 * variance.sqrt()).numpy()
    assert np.isclose(vertices[:, 1].max(), upper.max()) and np.isclose(vertices[:, 1].min(), lower.min())
    pyro_line = next(line for line in merged.get_lines() if line.get_label() == "KEP-SVGP by Pyro SVI: mean")
    with torch.no_grad():
        np.testing.assert_allclose(pyro_line.get_ydata(), pyro_model(data.grid_x.double()).mean.numpy())


def test_the_models_get_back_their_modes() -> None:
    """The posteriors are drawn in eval mode; afterwards the model (in training, with one submodule left in eval) and
    the Pyro model (in eval) have every module's own mode back."""
    data = make_asymmetric_regression_1d(n_train=30, n_test=10)
    model, pyro_model = _model().train(), _model().eval()
    child = next(module for module in model.modules() if module is not model)
    child.eval()
    modes = [module.training for module in model.modules()]
    assert any(modes) and not all(modes)
    figure = plot_pair_posterior(model, data, pyro_model=pyro_model)
    assert [module.training for module in model.modules()] == modes
    assert not any(module.training for module in pyro_model.modules())
    with torch.no_grad():
        expected = model.eval()(data.grid_x.double()).mean.numpy()
    merged = next(line for line in figure.axes[2].get_lines() if line.get_label() == "posterior mean")
    torch.testing.assert_close(torch.as_tensor(merged.get_ydata()), torch.as_tensor(expected), rtol=0, atol=0)


def test_an_exact_gp_in_training_mode_is_drawn_in_eval_mode_and_gets_its_mode_back() -> None:
    # GPyTorch's ExactGP in training mode refuses inputs other than its training data ("You must train on the
    # training inputs!"): the figure evaluates it in eval mode, as it does the KEP-SVGP models
    data = make_asymmetric_regression_1d(n_train=30, n_test=10)

    class Exact(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(data.train_x.double(), data.train_y.double(), gpytorch.likelihoods.GaussianLikelihood())
            self.mean_module, self.covar_module = gpytorch.means.ZeroMean(), gpytorch.kernels.RBFKernel()

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    exact = Exact().double().train()
    figure = plot_pair_posterior(_model(), data, exact_gp=exact)
    assert exact.training and all(module.training for module in exact.modules())
    with torch.no_grad():
        expected = exact.eval()(data.grid_x.double()).mean.numpy()
    line = next(line for line in figure.axes[2].get_lines() if line.get_label().startswith("exact GP"))
    torch.testing.assert_close(torch.as_tensor(line.get_ydata()), torch.as_tensor(expected), rtol=0, atol=0)


def test_every_panel_draws_its_posterior_mean_and_two_std_band() -> None:
    # each panel against the model's own predictive (eval mode, as a user computes it): the branch panels are not
    # swapped, the band is mean ± 2 std of the latent variance (not the variance itself), and the merged mean is the
    # sum of the branch means (merge="sum")
    import numpy as np

    torch.manual_seed(0)
    model = _model()
    with torch.no_grad():  # away from the initial posterior (mean 0 everywhere would hide a swap)
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    data = make_asymmetric_regression_1d(n_train=30, n_test=10)
    figure = plot_pair_posterior(model, data)
    with torch.no_grad():
        model.eval()
        grid = data.grid_x
        posteriors = (model.branch(grid, "left"), model.branch(grid, "right"), model(grid))
    x = grid.squeeze(-1).numpy()
    for axis, posterior in zip(figure.axes, posteriors, strict=True):
        mean, std = posterior.mean.numpy(), posterior.variance.sqrt().numpy()
        line = next(line for line in axis.get_lines() if line.get_label() == "posterior mean")
        np.testing.assert_allclose(line.get_xdata(), x)
        np.testing.assert_allclose(line.get_ydata(), mean, rtol=1e-12)
        band = next(c for c in axis.collections if c.get_label() == "posterior ±2σ").get_paths()[0].vertices
        n = len(x)  # fill_between's path: start, the lower edge left to right, the upper edge right to left, ...
        np.testing.assert_allclose(band[1 : n + 1], np.stack([x, mean - 2 * std], axis=1), rtol=1e-12)
        np.testing.assert_allclose(band[n + 2 : 2 * n + 2][::-1], np.stack([x, mean + 2 * std], axis=1), rtol=1e-12)
    np.testing.assert_allclose(posteriors[2].mean.numpy(), posteriors[0].mean + posteriors[1].mean, rtol=1e-10)
    assert np.ptp(posteriors[0].mean.numpy() - posteriors[1].mean.numpy()) > 1e-3  # the branches differ


def test_the_gap_is_shaded_only_where_the_data_have_no_training_input() -> None:
    # [0.8, 1.6] was shaded as "no training data" for any data: inputs inside it, or a grid on [10, 12] stretched to 0.8
    import dataclasses

    import matplotlib.pyplot as plt

    data = make_asymmetric_regression_1d(n_train=30, n_test=10)
    inside = dataclasses.replace(data, train_x=torch.cat([data.train_x, torch.tensor([[1.2]], dtype=torch.float64)]),
                                 train_y=torch.cat([data.train_y, torch.zeros(1, dtype=torch.float64)]))  # fmt: skip
    moved = dataclasses.replace(data, grid_x=data.grid_x / 3 + 11, train_x=data.train_x / 3 + 11)
    for other in (inside, moved):
        figure = plot_pair_posterior(_model(), other)
        assert "shaded" not in figure.get_suptitle()
        assert not any(axis.patches for axis in figure.axes)
        plt.close(figure)
    assert figure.axes[0].get_xlim()[0] > 9  # no stretch to the toy gap (the grid is [10, 12])
    figure = plot_pair_posterior(_model(), data)
    assert all(len([p for p in axis.patches if p.get_gid() == "gap"]) == 1 for axis in figure.axes)
    assert "shaded: no training data" in figure.get_suptitle()
    plt.close("all")
