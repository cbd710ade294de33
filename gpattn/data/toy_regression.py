r"""Toy regression data sets drawn from an asymmetric generating process.

The data sets are meant for studying kernel-eigen SVGPs whose *left* and *right* branches see a function through an
asymmetric kernel :math:`\kappa(x, z) \neq \kappa(z, x)`. The generating kernel is a directional "shifted RBF"

.. math::

    \kappa(x, z) = \exp\!\Big(-\frac{\lVert x - z - \delta \rVert^2}{2 \ell^2}\Big),

with a shift vector :math:`\delta \in \mathbb{R}^d` and lengthscale :math:`\ell`. Swapping the arguments flips the sign
of the shift, :math:`\kappa(z, x) = \exp(-\lVert x - z + \delta \rVert^2 / (2 \ell^2))`, so the kernel is symmetric only
for :math:`\delta = 0`.

Generating process. Draw :math:`M` source points :math:`z_j` uniformly in the input box and independent weights
:math:`w_j, w'_j \sim \mathcal{N}(0, s^2)`, then set

.. math::

    f_{\text{left}}(x)  &= \sum_{j=1}^M w_j \, \kappa(x, z_j)
        \quad \text{(x attends to the sources; bumps centred at } z_j + \delta\text{)}, \\
    f_{\text{right}}(x) &= \sum_{j=1}^M w'_j \, \kappa(z_j, x)
        \quad \text{(the sources see x; bumps centred at } z_j - \delta\text{)}, \\
    f(x) &= f_{\text{left}}(x) + f_{\text{right}}(x), \qquad y = f(x) + \sigma \varepsilon, \quad
        \varepsilon \sim \mathcal{N}(0, 1).

Conditionally on the sources, :math:`f` is a draw from the zero-mean GP prior with the symmetric PSD kernel
:math:`s^2 (k_e + k_r)` induced by the asymmetric one,

.. math::

    k_e(x, x') = \sum_j \kappa(x, z_j) \, \kappa(x', z_j), \qquad k_r(x, x') = \sum_j \kappa(z_j, x) \, \kappa(z_j, x'),

so a symmetric stationary kernel would need both shifted copies of every bump to explain it.

Amplitude. The weight scale :math:`s` makes the expected mean square of :math:`f` over the grid
:math:`\{x_g\}_{g=1}^G` exactly one, :math:`\mathbb{E}\big[\frac{1}{G}\sum_g f(x_g)^2\big] = 1`, i.e.
:math:`s^{-2} = M (A_{+\delta} + A_{-\delta})` with the box-truncated Gaussian integrals (the expectation is over the
uniform sources; boundary effects and the shift are accounted for exactly)

.. math::

    A_{\pm\delta} = \frac{1}{G} \sum_{g=1}^G \mathbb{E}_z\big[e^{-\lVert x_g - z \mp \delta \rVert^2 / \ell^2}\big]
    = \frac{1}{G} \sum_{g=1}^G \prod_{k=1}^d \frac{\sqrt{\pi}\,\ell}{2 (b - a)}
      \Big[\operatorname{erf}\Big(\frac{x_{gk} \mp \delta_k - a}{\ell}\Big)
         - \operatorname{erf}\Big(\frac{x_{gk} \mp \delta_k - b}{\ell}\Big)\Big]

for the box :math:`[a, b]^d`. Hence :math:`f` is of order one; a single draw's standard deviation over the grid is
typically 0.6 to 1.1 (it fluctuates with the few sources in reach and excludes the grid mean).

All randomness comes from a local ``torch.Generator`` seeded with ``seed``; the global RNG is never touched. Everything
is computed in float64 and cast to the requested dtype at the end, so float32 data sets equal rounded float64 ones.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..validation import InputTypeError, check_seed

__all__ = ["RegressionData", "make_asymmetric_regression_1d", "make_asymmetric_regression_2d"]

_BOX_1D = (-3.0, 3.0)
_GAP_1D = (0.8, 1.6)
_GRID_SIZE_1D = 400
_BOX_2D = (-2.0, 2.0)
_GRID_SIDE_2D = 40


@dataclass(frozen=True)
class RegressionData:
    r"""A regression data set with its noiseless generating function on a dense grid.

    Attributes:
        train_x: Training inputs, shape ``(n_train, d)``.
        train_y: Noisy training targets, shape ``(n_train,)``.
        test_x: Test inputs, shape ``(n_test, d)``.
        test_y: Noisy test targets, shape ``(n_test,)``.
        test_f: Noiseless :math:`f` at ``test_x``, shape ``(n_test,)``.
        grid_x: Dense grid over the input box, shape ``(n_grid, d)``; 1-D: 400 points, 2-D: a 40 x 40 grid flattened
            row-major (the first coordinate varies slowest).
        grid_f: :math:`f = f_{\text{left}} + f_{\text{right}}` at ``grid_x``, shape ``(n_grid,)``.
        grid_f_left: Left-branch component :math:`f_{\text{left}}` at ``grid_x``, shape ``(n_grid,)``.
        grid_f_right: Right-branch component :math:`f_{\text{right}}` at ``grid_x``, shape ``(n_grid,)``.
        noise_std: Observation noise standard deviation :math:`\sigma`.
        shift: The shift vector :math:`\delta`, shape ``(d,)``.
        lengthscale: The kernel lengthscale :math:`\ell`.
        description: One-sentence description of the data set.
    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    test_f: Tensor
    grid_x: Tensor
    grid_f: Tensor
    grid_f_left: Tensor
    grid_f_right: Tensor
    noise_std: float
    shift: Tensor
    lengthscale: float
    description: str


def make_asymmetric_regression_1d(
    n_train: int = 200,
    n_test: int = 200,
    noise_std: float = 0.1,
    shift: float = 0.6,
    lengthscale: float = 0.35,
    num_sources: int = 12,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> RegressionData:
    r"""1-D regression data on :math:`[-3, 3]` with no training inputs in the gap :math:`[0.8, 1.6]`.

    Training inputs are uniform on :math:`[-3, 3] \setminus [0.8, 1.6]` and test inputs uniform on the whole box
    (gap included), both sorted ascending; the grid is 400 equispaced points including the endpoints.

    Args:
        n_train: Number of training points, at least 1.
        n_test: Number of test points, at least 1.
        noise_std: Observation noise standard deviation :math:`\sigma \geq 0`.
        shift: The scalar shift :math:`\delta` of the kernel.
        lengthscale: The kernel lengthscale :math:`\ell > 0`.
        num_sources: Number of source points :math:`M`, at least 1.
        seed: Seed of the local random generator, in ``[0, 2**64 - 1]``.
        dtype: Floating dtype of the returned tensors.

    Returns:
        The data set, with ``d = 1``.

    Raises:
        ValueError: If an argument is out of range.
    """
    _validate(n_train, n_test, noise_std, lengthscale, num_sources, dtype, seed)
    shift_vec = _as_shift([shift], dim=1)
    low, high = _BOX_1D
    gap_low, gap_high = _GAP_1D

    def draw_inputs(generator: torch.Generator) -> tuple[Tensor, Tensor]:
        # Uniform on the union [low, gap_low) u [gap_high, high]: draw on an interval of the total length, then move
        # the part beyond gap_low past the gap.
        u = low + (high - low - (gap_high - gap_low)) * torch.rand(n_train, generator=generator, dtype=torch.float64)
        train_x = torch.where(u < gap_low, u, u + (gap_high - gap_low)).sort().values.unsqueeze(-1)  # (n_train, 1)
        test_x = _uniform(n_test, 1, low, high, generator).sort(dim=0).values  # shape: (n_test, 1)
        return train_x, test_x

    grid_x = torch.linspace(low, high, _GRID_SIZE_1D, dtype=torch.float64).unsqueeze(-1)  # shape: (400, 1)
    description = (
        f"1-D asymmetric shifted-RBF regression on [{low:g}, {high:g}] (shift {float(shift_vec[0]):g}, lengthscale "
        f"{lengthscale:g}, {num_sources} sources, noise std {noise_std:g}) with no training inputs in "
        f"[{gap_low:g}, {gap_high:g}]."
    )
    return _generate(
        noise_std, shift_vec, lengthscale, num_sources, seed, dtype, _BOX_1D, grid_x, draw_inputs, description
    )


def make_asymmetric_regression_2d(
    n_train: int = 400,
    n_test: int = 400,
    noise_std: float = 0.1,
    shift: Sequence[float] = (0.5, -0.3),
    lengthscale: float = 0.4,
    num_sources: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> RegressionData:
    r"""2-D regression data on :math:`[-2, 2]^2` with uniform training and test inputs.

    The grid is 40 x 40 equispaced points (endpoints included) flattened row-major:
    ``grid_x[40 * i + j] = (g[i], g[j])``.

    Args:
        n_train: Number of training points, at least 1.
        n_test: Number of test points, at least 1.
        noise_std: Observation noise standard deviation :math:`\sigma \geq 0`.
        shift: The shift vector :math:`\delta`, two finite numbers.
        lengthscale: The kernel lengthscale :math:`\ell > 0`.
        num_sources: Number of source points :math:`M`, at least 1.
        seed: Seed of the local random generator, in ``[0, 2**64 - 1]``.
        dtype: Floating dtype of the returned tensors.

    Returns:
        The data set, with ``d = 2``.

    Raises:
        ValueError: If an argument is out of range.
    """
    _validate(n_train, n_test, noise_std, lengthscale, num_sources, dtype, seed)
    shift_vec = _as_shift(shift, dim=2)
    low, high = _BOX_2D

    def draw_inputs(generator: torch.Generator) -> tuple[Tensor, Tensor]:
        train_x = _uniform(n_train, 2, low, high, generator)  # shape: (n_train, 2)
        test_x = _uniform(n_test, 2, low, high, generator)  # shape: (n_test, 2)
        return train_x, test_x

    axis = torch.linspace(low, high, _GRID_SIDE_2D, dtype=torch.float64)  # shape: (40,)
    grid_x = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), dim=-1).reshape(-1, 2)  # shape: (1600, 2)
    description = (
        f"2-D asymmetric shifted-RBF regression on [{low:g}, {high:g}]^2 (shift ({shift_vec[0]:g}, {shift_vec[1]:g}), "
        f"lengthscale {lengthscale:g}, {num_sources} sources, noise std {noise_std:g}) with uniform inputs."
    )
    return _generate(
        noise_std, shift_vec, lengthscale, num_sources, seed, dtype, _BOX_2D, grid_x, draw_inputs, description
    )


def _shifted_rbf(x1: Tensor, x2: Tensor, shift: Tensor, lengthscale: float) -> Tensor:
    r"""Shifted-RBF kernel matrix :math:`K_{ij} = \exp(-\lVert x_{1,i} - x_{2,j} - \delta \rVert^2 / (2 \ell^2))`.

    Args:
        x1: First inputs, shape ``(n1, d)``.
        x2: Second inputs, shape ``(n2, d)``.
        shift: The shift :math:`\delta`, shape ``(d,)``.
        lengthscale: The lengthscale :math:`\ell`.

    Returns:
        The kernel matrix, shape ``(n1, n2)``.
    """
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3) - shift  # shape: (n1, n2, d)
    return torch.exp(-diff.pow(2).sum(-1) / (2.0 * lengthscale**2))


def _component(
    x: Tensor, sources: Tensor, weights: Tensor, shift: Tensor, lengthscale: float, side: Literal["left", "right"]
) -> Tensor:
    r"""One branch of the generating function.

    ``side="left"`` gives :math:`\sum_j w_j \kappa(x, z_j)` (bumps at :math:`z_j + \delta`) and ``side="right"``
    gives :math:`\sum_j w_j \kappa(z_j, x)` (bumps at :math:`z_j - \delta`); with equal weights the right branch is
    the left one translated by :math:`2\delta`: :math:`f_{\text{right}}(x) = f_{\text{left}}(x + 2\delta)`.

    Args:
        x: Inputs, shape ``(n, d)``.
        sources: Source points :math:`z_j`, shape ``(M, d)``.
        weights: Weights :math:`w_j`, shape ``(M,)``.
        shift: The shift :math:`\delta`, shape ``(d,)``.
        lengthscale: The lengthscale :math:`\ell`.
        side: ``"left"`` or ``"right"``.

    Returns:
        The branch evaluated at ``x``, shape ``(n,)``.

    Raises:
        ValueError: If ``side`` is neither ``"left"`` nor ``"right"``.
    """
    if side == "left":
        kern = _shifted_rbf(x, sources, shift, lengthscale)  # shape: (n, M)
    elif side == "right":
        kern = _shifted_rbf(sources, x, shift, lengthscale).mT  # shape: (n, M)
    else:
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    return kern @ weights


def _weight_scale(
    grid_x: Tensor, shift: Tensor, lengthscale: float, low: float, high: float, num_sources: int
) -> float:
    r"""Weight scale :math:`s = (M (A_{+\delta} + A_{-\delta}))^{-1/2}`: unit expected mean square of f on the grid.

    Args:
        grid_x: The grid, shape ``(G, d)``.
        shift: The shift :math:`\delta`, shape ``(d,)``.
        lengthscale: The lengthscale :math:`\ell`.
        low: Lower edge :math:`a` of the box :math:`[a, b]^d`.
        high: Upper edge :math:`b` of the box.
        num_sources: Number of sources :math:`M`.

    Returns:
        The scale :math:`s` (see the module docstring for :math:`A_{\pm\delta}`).

    Raises:
        ValueError: If the shift moves every bump so far off the box that :math:`A_{+\delta} + A_{-\delta}`
            underflows to zero.
    """
    factor = math.sqrt(math.pi) * lengthscale / (2.0 * (high - low))
    mean_square = 0.0  # A_{+delta} + A_{-delta}
    for centred in (grid_x - shift, grid_x + shift):  # shape: (G, d) each
        per_dim = factor * (torch.erf((centred - low) / lengthscale) - torch.erf((centred - high) / lengthscale))
        mean_square += per_dim.prod(dim=-1).mean().item()
    if mean_square <= 0.0:
        raise ValueError(
            f"shift {shift.tolist()} with lengthscale {lengthscale:g} puts every bump off the box [{low:g}, {high:g}]; "
            "expected a shift of at most about the box width"
        )
    return 1.0 / math.sqrt(num_sources * mean_square)


def _uniform(n: int, dim: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    """Draw ``n`` points uniformly in ``[low, high]^dim`` in float64, shape ``(n, dim)``."""
    return low + (high - low) * torch.rand(n, dim, generator=generator, dtype=torch.float64)


def _generate(
    noise_std: float,
    shift: Tensor,
    lengthscale: float,
    num_sources: int,
    seed: int,
    dtype: torch.dtype,
    box: tuple[float, float],
    grid_x: Tensor,
    draw_inputs: Callable[[torch.Generator], tuple[Tensor, Tensor]],
    description: str,
) -> RegressionData:
    r"""Draw a data set from the generating process (the module docstring) on the box :math:`[a, b]^d`, from one local
    generator seeded with ``seed``, in this order: the ``M`` sources (uniform in the box) and their unit-variance
    left / right weights, the inputs (``draw_inputs(generator)``, the constructor's own: ``(train_x, test_x)``), the
    training noise, then the test noise; the weights are scaled by :func:`_weight_scale` on ``grid_x``. :math:`f` is
    evaluated in float64 and everything cast to ``dtype`` at the end.

    Args:
        noise_std: Observation noise standard deviation :math:`\sigma`.
        shift: The shift :math:`\delta`, float64, shape ``(d,)``.
        lengthscale: The lengthscale :math:`\ell`.
        num_sources: Number of sources :math:`M`.
        seed: Seed of the local generator.
        dtype: Floating dtype of the returned tensors.
        box: ``(a, b)``.
        grid_x: The dense grid, float64, shape ``(n_grid, d)``.
        draw_inputs: Draws the training and test inputs from the generator, float64, shapes ``(n_train, d)`` and
            ``(n_test, d)``.
        description: The data set's description.

    Raises:
        ValueError: If the shift puts every bump off the box (:func:`_weight_scale`).

    .. note:: Cost: O((n_train + n_test + n_grid) M d).
    """
    generator = torch.Generator().manual_seed(int(seed))  # an int: manual_seed refuses NumPy integers
    low, high = box
    dim = grid_x.shape[-1]
    sources = _uniform(num_sources, dim, low, high, generator)  # shape: (M, d)
    unit_weights = torch.randn(2, num_sources, generator=generator, dtype=torch.float64)  # shape: (2, M): left, right
    train_x, test_x = draw_inputs(generator)
    weights = _weight_scale(grid_x, shift, lengthscale, low, high, num_sources) * unit_weights  # shape: (2, M)

    def f(x: Tensor) -> tuple[Tensor, Tensor]:
        left = _component(x, sources, weights[0], shift, lengthscale, "left")  # shape: (n,)
        right = _component(x, sources, weights[1], shift, lengthscale, "right")  # shape: (n,)
        return left, right

    train_f_left, train_f_right = f(train_x)  # shape: (n_train,) each
    test_f_left, test_f_right = f(test_x)  # shape: (n_test,) each
    grid_f_left, grid_f_right = f(grid_x)  # shape: (n_grid,) each
    train_f = train_f_left + train_f_right  # shape: (n_train,)
    test_f = test_f_left + test_f_right  # shape: (n_test,)
    train_y = train_f + noise_std * torch.randn(train_x.shape[0], generator=generator, dtype=torch.float64)
    test_y = test_f + noise_std * torch.randn(test_x.shape[0], generator=generator, dtype=torch.float64)
    return RegressionData(
        train_x=train_x.to(dtype),
        train_y=train_y.to(dtype),
        test_x=test_x.to(dtype),
        test_y=test_y.to(dtype),
        test_f=test_f.to(dtype),
        grid_x=grid_x.to(dtype),
        grid_f=(grid_f_left + grid_f_right).to(dtype),
        grid_f_left=grid_f_left.to(dtype),
        grid_f_right=grid_f_right.to(dtype),
        noise_std=float(noise_std),
        shift=shift.to(dtype),
        lengthscale=float(lengthscale),
        description=description,
    )


def _validate(
    n_train: int, n_test: int, noise_std: float, lengthscale: float, num_sources: int, dtype: torch.dtype, seed: int
) -> None:
    """Check the arguments shared by both constructors, raising ``ValueError`` with what was expected and what came."""
    # numbers.Integral / numbers.Real: NumPy integers and floats (np.int64, np.float32) are numbers too
    for name, value in (("n_train", n_train), ("n_test", n_test), ("num_sources", num_sources)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value, bound in (("noise_std", noise_std, ">= 0"), ("lengthscale", lengthscale, "> 0")):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputTypeError(f"{name} must be a finite number {bound}, got {value!r}")
    if not math.isfinite(noise_std) or noise_std < 0:
        raise ValueError(f"noise_std must be a finite number >= 0, got {noise_std!r}")
    if not math.isfinite(lengthscale) or lengthscale <= 0:
        raise ValueError(f"lengthscale must be a finite number > 0, got {lengthscale!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype (e.g. torch.float64), got {dtype!r}")
    check_seed("seed", seed)


def _as_shift(shift: Sequence[float], dim: int) -> Tensor:
    """Convert a shift to a float64 tensor of shape ``(dim,)``; raise ``ValueError`` on a wrong length or value."""
    entries = shift.reshape(-1).tolist() if isinstance(shift, Tensor) and shift.dim() <= 1 else shift
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):  # e.g. one number for the 2-D shift
        raise InputTypeError(f"shift must be {dim} finite number(s), got {shift!r}")
    entries = tuple(v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for v in entries)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in entries):  # strings, nested lists
        raise InputTypeError(f"shift must be {dim} finite number(s), got {entries!r}")
    values = [float(v) for v in entries]
    if len(values) != dim or not all(math.isfinite(v) for v in values):
        raise ValueError(f"shift must be {dim} finite number(s), got {entries!r}")
    return torch.tensor(values, dtype=torch.float64)
