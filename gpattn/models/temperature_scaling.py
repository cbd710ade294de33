r"""Temperature scaling (Guo et al., "On calibration of modern neural networks", ICML 2017) of any trained classifier,
with the temperature fitted on validation logits, including Monte Carlo logits of stochastic models.

For logits :math:`f(x) \in \mathbb{R}^C` the scaled prediction is :math:`\operatorname{softmax}(f(x) / \tau)` with
one temperature :math:`\tau > 0` for all classes, fitted by minimising the negative log-likelihood on a held-out
(validation) set; :math:`\tau > 1` softens over-confident predictions. For one logit vector per input the accuracy
never changes (the arg max of the logits is kept); for Monte Carlo logits (below) it can: the prediction is the arg
max of the mean of the scaled probabilities, which moves with :math:`\tau` (e.g. three samples with logits
:math:`(5, 0)`, :math:`(0, 0.5)`, :math:`(0, 0.5)` give class 0 probability 0.58 at :math:`\tau = 1` and 0.34 at
:math:`\tau = 0.1`).

Stochastic models (GP attention, MC dropout) give :math:`T` logit samples :math:`f^{(t)}(x)` per input. The
temperature divides every sample's logits, and the prediction is the mean of the scaled probabilities,

.. math::

    p_\tau(y \mid x) = \frac1T \sum_{t=1}^T \operatorname{softmax}\big(f^{(t)}(x) / \tau\big)_y, \qquad
    \hat\tau = \arg\min_{\tau} -\frac1n \sum_{i=1}^n \log p_\tau(y_i \mid x_i),

the predictive distribution that :func:`~gpattn.models.predict_probabilities` computes for the wrapped model
(``average="probabilities"``, the papers' choice), so the fitted temperature is the one that the evaluation uses.
Scaling the mean logit instead would calibrate a different predictor than the one reported.

The one-dimensional minimisation runs over :math:`\log \tau` in float64: a grid of 41 points over ``bounds`` picks
the best bracket, which golden-section search narrows until the bracket is about :math:`10^{-10}` wide; near the
minimum the NLL is flat to rounding, so the fitted :math:`\log \tau` lies within about :math:`10^{-7}` of the
minimiser (measured against a bounded Brent search: :math:`6 \times 10^{-8}`), at an NLL within :math:`10^{-14}` of
the minimum. For
:math:`T = 1` the NLL is convex in :math:`1 / \tau`, so this finds the global minimum; the grid guards against
local minima of the Monte Carlo objective.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from gpytorch.constraints import Positive
from gpytorch.module import Module
from torch import Tensor

from ..mlls.attention_elbo import model_logits
from ..validation import InputTypeError, check_float, check_int, check_positive, check_tensor
from .monte_carlo import monte_carlo_logits

__all__ = ["TemperatureScaling", "fit_temperature"]

GRID_POINTS = 41
GOLDEN_STEPS = 60


def _check_logits(logits: Any, labels: Any, where: str) -> tuple[Tensor, Tensor]:
    """Logits as float64 ``(T, n, C)`` and labels as int64 ``(n,)``."""
    check_tensor("logits", logits, floating=True, finite=True, where=where)
    if logits.dim() not in (2, 3):
        raise ValueError(f"{where}: expected logits of shape (n, C) or (T, n, C), got {tuple(logits.shape)}")
    samples = logits.detach().to(torch.float64)
    samples = samples.unsqueeze(0) if samples.dim() == 2 else samples
    num_samples, n, num_classes = samples.shape
    if num_samples == 0 or n == 0 or num_classes < 2:
        raise ValueError(f"{where}: expected non-empty logits with at least 2 classes, got {tuple(logits.shape)}")
    check_tensor("labels", labels, (n,), integer=True, where=where)
    targets = labels.detach().to(device=samples.device, dtype=torch.int64)
    if targets.min() < 0 or targets.max() >= num_classes:
        raise ValueError(
            f"{where}: expected labels in [0, {num_classes - 1}], got values in [{targets.min()}, {targets.max()}]"
        )
    return samples, targets


#: Logits above this times the lower bound of the search are shifted before they are divided (about the largest double
#: over 1e8: no logits a model produces)
OVERFLOW_SAFE = 1e300


def _shifted_to_their_maximum(samples: Tensor) -> Tensor:
    # x - max_c x, computed as (x / s - max_c x / s) * s with s the power of 2 at most max |x| (exact, and
    # representable for every finite logit): entries <= 0, the largest 0
    scale = math.ldexp(1.0, math.frexp(float(samples.abs().max()))[1] - 1)
    scaled = samples / scale
    return (scaled - scaled.amax(dim=-1, keepdim=True)) * scale


def _scaled_nll(samples: Tensor, targets: Tensor, temperature: float) -> float:
    # -1/n sum_i log( 1/T sum_t softmax(f_t(x_i) / tau)_{y_i} ), with a logsumexp over the samples
    log_probs = (samples / temperature).log_softmax(dim=-1)  # shape: (T, n, C)
    picked = log_probs.gather(-1, targets.expand(samples.shape[0], -1).unsqueeze(-1)).squeeze(-1)  # shape: (T, n)
    mixture = torch.logsumexp(picked, dim=0) - math.log(samples.shape[0])
    return float(-mixture.mean())


def fit_temperature(logits: Tensor, labels: Tensor, bounds: tuple[float, float] = (0.01, 100.0)) -> float:
    r"""The temperature :math:`\hat\tau` minimising the NLL of the temperature-scaled predictive distribution.

    See the module docstring for the objective (every sample's logits divided by :math:`\tau`, probabilities
    averaged over samples) and the search (a grid over :math:`\log \tau`, then golden-section search).

    .. note:: Cost: about 100 evaluations of the NLL, each O(T n C); no gradients, no model calls. Logits so large
        that dividing them by the lower bound would overflow (above 1e300 times it) are first shifted by each row's
        largest entry (the softmax is unchanged), so that the NLL stays a number.

    :param logits: Validation logits ``(n, C)``, or Monte Carlo samples ``(T, n, C)``. Never the test split's.
    :param labels: Validation labels ``(n,)``, integers in ``[0, C)``.
    :param bounds: Search interval ``(low, high)`` of :math:`\tau`, ``0 < low < high``. An optimum on the boundary
        warns (e.g. a perfectly separated validation set, whose NLL falls as :math:`\tau \to 0`, or confidently
        wrong predictions, whose NLL falls as :math:`\tau \to \infty`); so do logits equal across the classes in
        every sample (no temperature changes the prediction: 1, or the bound nearest to it, is returned).
    :return: :math:`\hat\tau` as a Python float.
    """
    where = "fit_temperature"
    samples, targets = _check_logits(logits, labels, where)
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise InputTypeError(f"{where}: expected bounds to be a pair (low, high), got {bounds!r}")
    low = check_float("bounds[0]", bounds[0], 0.0, strict_minimum=True, where=where)
    high = check_float("bounds[1]", bounds[1], low, strict_minimum=True, where=where)

    if float(samples.abs().max()) > OVERFLOW_SAFE * low:
        # logits / tau would overflow to inf at the low end (finite float64 logits near the largest double), and the
        # NLL be NaN there: the logits are shifted by their largest entry first (log_softmax does not see a shift),
        # the shift made in a copy scaled by a power of 2 (exact), so that it cannot overflow either; an entry whose
        # distance from the largest is beyond the largest double becomes -inf (a probability of 0)
        samples = _shifted_to_their_maximum(samples)

    def objective(log_temperature: float) -> float:
        return _scaled_nll(samples, targets, math.exp(log_temperature))

    if bool((samples == samples[..., :1]).all()):  # uniform predictions at every temperature: nothing to fit
        temperature = min(max(1.0, low), high)
        warnings.warn(
            f"fit_temperature: every validation sample's logits are equal across the classes, so the NLL does not "
            f"depend on the temperature; temperature {temperature:.4g} (the logits unscaled where the bounds allow)",
            stacklevel=2,
        )
        return temperature
    grid = torch.linspace(math.log(low), math.log(high), GRID_POINTS, dtype=torch.float64).tolist()
    best = min(range(GRID_POINTS), key=lambda k: objective(grid[k]))
    left, right = grid[max(best - 1, 0)], grid[min(best + 1, GRID_POINTS - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    inner_left, inner_right = right - ratio * (right - left), left + ratio * (right - left)
    value_left, value_right = objective(inner_left), objective(inner_right)
    for _ in range(GOLDEN_STEPS):
        if value_left <= value_right:  # the minimum lies in [left, inner_right]
            right, inner_right, value_right = inner_right, inner_left, value_left
            inner_left = right - ratio * (right - left)
            value_left = objective(inner_left)
        else:
            left, inner_left, value_left = inner_left, inner_right, value_right
            inner_right = left + ratio * (right - left)
            value_right = objective(inner_right)
    temperature = math.exp((left + right) / 2)
    if not low * (1 + 1e-6) < temperature < high * (1 - 1e-6):
        lower = temperature <= low * (1 + 1e-6)
        why = (
            "falling as the temperature goes down (e.g. every validation sample classified correctly with growing "
            "confidence)"
            if lower
            else "falling as the temperature grows (predictions overconfident even at the largest temperature, "
            "e.g. confidently wrong ones, whose NLL falls towards log C)"
        )
        warnings.warn(
            f"fit_temperature: the optimum lies on the boundary of bounds={bounds} (temperature {temperature:.4g}); "
            f"the validation NLL keeps {why}; widen the bounds or use a larger validation set",
            stacklevel=2,
        )
    return temperature


class TemperatureScaling(Module):
    r"""A trained classifier with its logits divided by a fitted temperature: :math:`f(x) / \tau`.

    The wrapper is itself a model (``forward(inputs, *args, **kwargs)`` returns the wrapped model's logits over
    :math:`\tau`), so everything that takes a classifier takes it, e.g.
    ``predict_probabilities(scaled, inputs, num_samples=10)`` gives
    :math:`\frac1T \sum_t \operatorname{softmax}(f^{(t)}(x) / \tau)`. The temperature is a GPyTorch-style
    constrained parameter (``raw_temperature`` with a :class:`~gpytorch.constraints.Positive` constraint; read and
    set ``temperature``); :meth:`fit` sets it from validation data by :func:`fit_temperature` and leaves the wrapped
    model's parameters untouched.

    Example::

        scaled = TemperatureScaling(model).fit(val.tokens, val.labels, num_samples=10)
        probs = predict_probabilities(scaled, test.tokens, num_samples=10)

    .. note:: Cost: fitting runs the model :math:`T` times on the validation inputs once (:func:`monte_carlo_logits`)
        plus O(100 T n C) for the search; prediction adds one division per logit.

    :param model: A trained classifier mapping ``(inputs, ...)`` to logits ``(B, C)``, or to a mapping holding them
        under ``"logits"`` (a dict, a ``transformers`` ``ModelOutput``).
    :param temperature: Initial :math:`\tau > 0` (1 = the model as it is).
    :raises TypeError: A ``model`` that is not a module, a ``temperature`` that is not a number (e.g. a bool).
    :raises ValueError: A ``temperature`` that is not one finite number > 0 (e.g. a tensor of several).
    """

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"TemperatureScaling: expected model to be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        # the model's dtype and device: its first floating parameter, else its first floating buffer (a model of stored
        # logits), else float64 (a float32 model's logits divided by a 0-dim float64 temperature stay float32)
        tensors = (tensor for tensor in (*model.parameters(), *model.buffers()) if tensor.is_floating_point())
        reference = next(tensors, torch.zeros((), dtype=torch.float64))
        self.register_parameter(
            "raw_temperature",
            torch.nn.Parameter(torch.zeros((), dtype=reference.dtype, device=reference.device)),
        )
        self.register_constraint("raw_temperature", Positive())
        self.temperature = temperature

    @property
    def temperature(self) -> Tensor:
        """:math:`\\tau`, a positive scalar tensor."""
        return self.raw_temperature_constraint.transform(self.raw_temperature)

    @temperature.setter
    def temperature(self, value: float | Tensor) -> None:
        if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
            raise InputTypeError(f"TemperatureScaling: expected temperature to be a finite number > 0, got {value!r}")
        value = check_positive("temperature", value, self.raw_temperature, where="TemperatureScaling")
        if value.numel() != 1:  # one temperature for all classes
            raise ValueError(
                f"TemperatureScaling: expected temperature to be one finite number > 0, got {value.numel()} values "
                f"(shape {tuple(value.shape)})"
            )
        self.initialize(raw_temperature=self.raw_temperature_constraint.inverse_transform(value.reshape(())))

    def forward(self, inputs: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The wrapped model's logits (its output, or its ``"logits"`` entry) divided by the temperature, ``(B, C)``."""
        return model_logits(self.model(inputs, *args, **kwargs), "TemperatureScaling") / self.temperature

    def fit(
        self,
        inputs: Tensor,
        labels: Tensor,
        mask: Tensor | str | None = None,
        num_samples: int = 10,
        mc_dropout: bool = False,
        batch_size: int | None = 256,
        bounds: tuple[float, float] = (0.01, 100.0),
    ) -> TemperatureScaling:
        r"""Fit :math:`\tau` on validation data: :math:`T` Monte Carlo logit samples of the wrapped model
        (:func:`~gpattn.models.monte_carlo_logits`, one pass for a deterministic model), then
        :func:`fit_temperature`. Pass the validation split, never the test split.

        :param inputs: Validation inputs.
        :param labels: Validation labels ``(n,)``.
        :param mask: The model's mask argument for ``inputs``.
        :param num_samples: :math:`T`, the same as for the predictions that will be reported.
        :param mc_dropout: Sample dropout masks too (for an MC-dropout model).
        :param batch_size: Inputs per forward pass (``None``: all at once).
        :param bounds: Search interval of :math:`\tau`.
        :return: ``self``, with the fitted temperature.
        """
        check_int("num_samples", num_samples, where="TemperatureScaling.fit")
        logits = monte_carlo_logits(self.model, inputs, mask, num_samples, mc_dropout, batch_size)
        self.temperature = fit_temperature(logits, labels, bounds)
        return self
