"""Posterior figures of the kernel-eigen pair SVGP."""

from __future__ import annotations

from contextlib import ExitStack

# no backend switching here: matplotlib falls back to Agg on headless machines, and notebooks keep their inline backend
import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from .._module_state import kept_call_results, restored_modes
from ..data import RegressionData
from ..models import KernelEigenPairSVGP

#: The interval without training inputs of :func:`~gpattn.data.make_asymmetric_regression_1d`, shaded.
_TOY_GAP = (0.8, 1.6)


def _band(axis, x, mean, variance, color: str, label: str) -> None:
    std = variance.clamp_min(0).sqrt().numpy()
    axis.plot(x, mean, color=color, lw=2, label=f"{label} mean")
    axis.fill_between(x, mean - 2 * std, mean + 2 * std, color=color, alpha=0.25, label=f"{label} ±2σ")


def plot_pair_posterior(
    model: KernelEigenPairSVGP, data: RegressionData, exact_gp=None, pyro_model: KernelEigenPairSVGP | None = None
) -> Figure:
    r"""Three panels over the 1-D grid: the left branch :math:`q(f_e)`, the right branch :math:`q(f_r)` and the
    merged :math:`q(F)`, each mean with a :math:`\pm 2\sigma` band of the latent function, against the generating
    components, the training data and (merged panel) the exact GP's posterior mean and :math:`\pm 2\sigma` band (its
    latent function) and the merged mean of the Pyro SVI fit. The gap :math:`[0.8, 1.6]` of
    :func:`~gpattn.data.make_asymmetric_regression_1d` is shaded when the data have no training input in it and the
    grid spans it.

    The branches are identified up to swapping: a learned shift of the opposite sign to the generating one
    explains the left component with the right branch and vice versa.

    :param model: A trained :class:`~gpattn.models.KernelEigenPairSVGP` with ``merge="sum"`` on 1-D inputs, evaluated
        in eval mode (it, ``exact_gp`` and ``pyro_model`` get back their modes afterwards, every submodule its own).
    :param data: The 1-D :class:`~gpattn.data.RegressionData`.
    :param exact_gp: Optional trained exact GP (its posterior mean dashed, its :math:`\pm 2\sigma` band hatched),
        evaluated in eval mode.
    :param pyro_model: Optional second :class:`~gpattn.models.KernelEigenPairSVGP`, trained by Pyro SVI (its merged
        posterior mean is drawn dash-dotted in the merged panel).
    :return: The figure.
    """
    if not isinstance(model, KernelEigenPairSVGP):
        raise TypeError(f"plot_pair_posterior: expected model to be a KernelEigenPairSVGP, got {type(model).__name__}")
    if pyro_model is not None and not isinstance(pyro_model, KernelEigenPairSVGP):
        raise TypeError(
            f"plot_pair_posterior: expected pyro_model to be a KernelEigenPairSVGP, got {type(pyro_model).__name__}"
        )
    if not isinstance(data, RegressionData):
        raise TypeError(f"plot_pair_posterior: expected data to be a RegressionData, got {type(data).__name__}")
    if model.variational_strategy.merge != "sum":
        raise ValueError(
            f"plot_pair_posterior: expected a model with merge='sum', got merge={model.variational_strategy.merge!r}"
        )
    if data.grid_x.shape[-1] != 1:
        raise ValueError(f"expected 1-D inputs, got grid of shape {tuple(data.grid_x.shape)}")
    grid = data.grid_x
    x = grid.squeeze(-1).numpy()
    with torch.no_grad(), ExitStack() as modes:  # the posteriors in eval mode; every module's own mode restored
        for evaluated in (model, pyro_model, exact_gp):
            if isinstance(evaluated, torch.nn.Module):  # (an exact GP may be any callable)
                modes.enter_context(kept_call_results(evaluated))
                modes.enter_context(restored_modes(evaluated)).eval()
        left, right, merged = model.branch(grid, "left"), model.branch(grid, "right"), model(grid)
        exact = exact_gp(grid) if exact_gp is not None else None
        pyro_mean = pyro_model(grid).mean if pyro_model is not None else None
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.2), sharex=True)
    panels = (
        (axes[0], left, data.grid_f_left, "C0", "left branch $q(f_e)$", "generating $f_{left}$"),
        (axes[1], right, data.grid_f_right, "C1", "right branch $q(f_r)$", "generating $f_{right}$"),
        (axes[2], merged, data.grid_f, "C2", "merged $q(F) = q(f_e + f_r)$", "generating $f$"),
    )
    for axis, distribution, truth, color, title, truth_label in panels:
        _band(axis, x, distribution.mean.numpy(), distribution.variance, color, "posterior")
        axis.plot(x, truth.numpy(), color="k", lw=1, ls=":", label=truth_label)
        axis.set_title(title)
        axis.set_xlabel("x")
    axes[2].scatter(data.train_x.squeeze(-1), data.train_y, s=6, color="k", alpha=0.5, label="training data")
    if exact is not None:
        exact_std = exact.variance.clamp_min(0).sqrt().numpy()
        exact_mean = exact.mean.numpy()
        axes[2].plot(x, exact_mean, color="C3", ls="--", lw=1.5, label="exact GP mean ($k_e + k_r$)")
        axes[2].fill_between(
            x,
            exact_mean - 2 * exact_std,
            exact_mean + 2 * exact_std,
            facecolor="none",
            edgecolor="C3",
            hatch="///",
            lw=0.8,
            label="exact GP ±2σ",
        )
    if pyro_mean is not None:
        axes[2].plot(x, pyro_mean.numpy(), color="C4", ls="-.", lw=1.5, label="KEP-SVGP by Pyro SVI: mean")
    # the gap of make_asymmetric_regression_1d, shaded where it is one of these data: other data (training inputs in
    # it, or a grid elsewhere, whose axis the shading stretched) were said to have no training data there
    gap = _TOY_GAP
    train = data.train_x.squeeze(-1)
    shaded = bool(x.min() <= gap[0] and x.max() >= gap[1] and not ((train >= gap[0]) & (train <= gap[1])).any())
    for axis in axes:
        if shaded:
            axis.axvspan(*gap, color="grey", alpha=0.12, lw=0, gid="gap")
        axis.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("f(x)")
    figure.suptitle(
        f"KEP-SVGP on the asymmetric toy data (rank s = {model.features.num_inducing}, "
        f"{model.features.landmarks.shape[-2]} landmarks{'; shaded: no training data' if shaded else ''})"
    )
    figure.tight_layout()
    return figure
