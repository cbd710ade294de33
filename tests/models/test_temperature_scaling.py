"""Tests of temperature scaling: the fitted temperature is the NLL minimum (brute-force grid, scipy), 1 on calibrated
data and the over-confidence factor on sharpened data, for single and Monte Carlo logits; the wrapper lowers the
validation NLL, keeps the accuracy, reads only the data it is given; errors on bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gpytorch.constraints import Positive
from scipy.optimize import minimize_scalar

from gpattn.metrics import accuracy, negative_log_likelihood
from gpattn.models import (
    TemperatureScaling,
    Transformer,
    fit_temperature,
    monte_carlo_logits,
    predict_probabilities,
)


def calibrated_logits(n: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits z and labels drawn from softmax(z): perfectly calibrated at temperature 1."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, num_classes, generator=generator, dtype=torch.float64)
    labels = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
    return logits, labels


def reference_nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """-mean log of the sample-averaged scaled softmax, computed directly in probability space."""
    samples = logits if logits.dim() == 3 else logits.unsqueeze(0)
    probs = (samples / temperature).softmax(-1).mean(0)
    return float(-probs[torch.arange(labels.shape[0]), labels].log().mean())


def test_calibrated_data_give_temperature_one() -> None:
    logits, labels = calibrated_logits(20000, 5, seed=0)
    assert fit_temperature(logits, labels) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("factor", [0.5, 3.0])
def test_sharpened_logits_give_the_factor(factor: float) -> None:
    # labels drawn from softmax(z), logits factor * z: the NLL is minimal near tau = factor
    logits, labels = calibrated_logits(20000, 4, seed=1)
    assert fit_temperature(factor * logits, labels) == pytest.approx(factor, rel=0.03)


@pytest.mark.parametrize("num_samples", [1, 6])
def test_equals_the_brute_force_minimum(num_samples: int) -> None:
    logits, labels = calibrated_logits(500, 3, seed=2)
    generator = torch.Generator().manual_seed(3)
    samples = 2.5 * logits + torch.randn(num_samples, *logits.shape, generator=generator, dtype=torch.float64)
    samples = samples[0] if num_samples == 1 else samples
    fitted = fit_temperature(samples, labels)
    grid = np.exp(np.linspace(np.log(0.2), np.log(20.0), 4001))  # spacing 0.12 % in tau
    values = [reference_nll(samples, labels, t) for t in grid]
    best = grid[int(np.argmin(values))]
    assert fitted == pytest.approx(best, rel=2e-3)
    assert reference_nll(samples, labels, fitted) <= min(values) + 1e-9
    bounded = minimize_scalar(
        lambda u: reference_nll(samples, labels, math.exp(u)), bounds=(math.log(0.2), math.log(20)), method="bounded"
    )
    assert fitted == pytest.approx(math.exp(bounded.x), rel=1e-4)
    assert reference_nll(samples, labels, fitted) < reference_nll(samples, labels, 1.0)


def test_float32_and_float64_agree() -> None:
    logits, labels = calibrated_logits(300, 4, seed=4)
    assert fit_temperature(2 * logits.float(), labels) == pytest.approx(fit_temperature(2 * logits, labels), rel=1e-5)


class RecordingLinear(torch.nn.Linear):
    """A linear classifier that records every input batch it is called on."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.weight.copy_(weight)
        self.seen: list[torch.Tensor] = []

    def forward(self, inputs: torch.Tensor, mask=None) -> torch.Tensor:
        self.seen.append(inputs.clone())
        return super().forward(inputs)


def linear_task(n: int, seed: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, weight.shape[1], generator=generator, dtype=torch.float64)
    labels = torch.multinomial((inputs @ weight.T).softmax(-1), 1, generator=generator).squeeze(-1)
    return inputs, labels


def test_wrapper_lowers_validation_nll_and_reads_only_validation() -> None:
    # labels follow softmax(W x); the model's logits are 4 W x (over-confident by 4)
    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    val_inputs, val_labels = linear_task(3000, seed=1, weight=weight)
    test_inputs, test_labels = linear_task(3000, seed=2, weight=weight)
    model = RecordingLinear(4 * weight)
    scaled = TemperatureScaling(model)
    assert scaled.temperature.item() == pytest.approx(1.0)
    scaled.fit(val_inputs, val_labels, num_samples=3, batch_size=1000)
    # fit ran the model on the validation inputs, once each (a deterministic model is run once), and nothing else
    torch.testing.assert_close(torch.cat(model.seen), val_inputs, rtol=0, atol=0)
    assert scaled.temperature.item() == pytest.approx(4.0, rel=0.1)
    # the fitted temperature is fit_temperature's on the validation logits
    expected = fit_temperature(val_inputs @ (4 * weight).T, val_labels)
    assert scaled.temperature.item() == pytest.approx(expected, rel=1e-6)
    before_val = negative_log_likelihood(model(val_inputs).softmax(-1).detach(), val_labels)
    after_val = negative_log_likelihood(predict_probabilities(scaled, val_inputs), val_labels)
    assert after_val < before_val - 0.1
    # predicting on the test split changes nothing in the wrapper, and the calibration carries over to it
    fitted = scaled.temperature.item()
    test_probs = predict_probabilities(scaled, test_inputs)
    assert scaled.temperature.item() == fitted
    raw_probs = predict_probabilities(model, test_inputs)
    assert negative_log_likelihood(test_probs, test_labels) < negative_log_likelihood(raw_probs, test_labels) - 0.1
    assert accuracy(test_probs, test_labels) == accuracy(raw_probs, test_labels)  # the arg max is kept


def test_stochastic_model_uses_monte_carlo_logits() -> None:
    torch.manual_seed(0)
    model = Transformer(3, embed_dim=16, depth=1, num_heads=2, attention="kep_svgp", vocab_size=7, num_inducing=3)
    model = model.double()
    inputs = torch.randint(0, 7, (40, 5), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    scaled = TemperatureScaling(model).fit(inputs, labels, num_samples=4, batch_size=None)
    torch.manual_seed(5)
    logits = monte_carlo_logits(model, inputs, num_samples=4)
    assert scaled.temperature.item() == pytest.approx(fit_temperature(logits, labels), rel=1e-9)
    # the wrapper's prediction is the mean of the scaled samples' softmaxes
    torch.manual_seed(6)
    probs = predict_probabilities(scaled, inputs, num_samples=4)
    torch.manual_seed(6)
    samples = monte_carlo_logits(model, inputs, num_samples=4)
    torch.testing.assert_close(probs, (samples / scaled.temperature.detach()).softmax(-1).mean(0))


def test_gpytorch_style_parameter() -> None:
    scaled = TemperatureScaling(torch.nn.Linear(2, 3), temperature=2.5)
    assert isinstance(scaled.raw_temperature_constraint, Positive)
    assert scaled.temperature.item() == pytest.approx(2.5)
    scaled.temperature = 0.3
    assert scaled.temperature.item() == pytest.approx(0.3)
    state = scaled.state_dict()
    copy = TemperatureScaling(torch.nn.Linear(2, 3))
    copy.load_state_dict(state)
    assert copy.temperature.item() == pytest.approx(0.3)
    x = torch.randn(4, 2)
    torch.testing.assert_close(copy(x), copy.model(x) / 0.3)


def test_boundary_optimum_warns() -> None:
    # every sample correct with a margin: the NLL keeps falling as tau -> 0
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [4.0, 1.0]])
    labels = torch.tensor([0, 1, 0])
    with pytest.warns(UserWarning, match="boundary.*falling as the temperature goes down"):
        fitted = fit_temperature(logits, labels, bounds=(0.1, 10.0))
    assert fitted == pytest.approx(0.1, rel=1e-6)
    # every sample confidently wrong: the NLL falls towards log C as tau -> infinity (the upper bound's reason)
    with pytest.warns(
        UserWarning, match="boundary.*falling as the temperature grows .*overconfident even at the largest"
    ):
        fitted = fit_temperature(torch.tensor([[10.0, -10.0], [-10.0, 10.0]]), torch.tensor([1, 0]))
    assert fitted == pytest.approx(100.0, rel=1e-6)
    nll = F.cross_entropy(torch.tensor([[10.0, -10.0], [-10.0, 10.0]]) / fitted, torch.tensor([1, 0])).item()
    assert math.log(2) < nll < F.cross_entropy(torch.tensor([[10.0, -10.0]]) / 50.0, torch.tensor([1])).item()
    # better than uniform (3 of 4 right) but overconfident beyond the bound: the same reason, no claim of "worse"
    margin = torch.tensor([[250.0, 0.0], [250.0, 0.0], [250.0, 0.0], [250.0, 0.0]])
    with pytest.warns(UserWarning, match="overconfident even at the largest temperature"):
        assert fit_temperature(margin, torch.tensor([0, 0, 0, 1])) == pytest.approx(100.0, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_temperature(*calibrated_logits(200, 3, seed=0))


@pytest.mark.parametrize("bounds", [(0.01, 100.0), (2.0, 5.0), (0.1, 0.5)])
def test_logits_equal_across_the_classes_give_the_unscaled_temperature_with_a_warning(bounds) -> None:
    # the NLL is log C at every temperature: the grid's argmin was rounding noise (0.01, "the NLL keeps falling")
    logits = torch.full((2, 5, 3), 0.7)  # Monte Carlo samples, each uniform
    with pytest.warns(UserWarning, match="equal across the classes, so the NLL does not depend on the temperature"):
        fitted = fit_temperature(logits, torch.tensor([0, 1, 2, 0, 1]), bounds=bounds)
    assert fitted == min(max(1.0, bounds[0]), bounds[1])


@pytest.mark.parametrize(
    ("logits", "labels", "bounds", "match"),
    [
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long), (0.01, 100.0), "floating"),
        (torch.tensor([[0.0, math.nan]]), torch.zeros(1, dtype=torch.long), (0.01, 100.0), "NaN"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.long), (0.01, 100.0), r"\(n, C\)"),
        (torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), (0.01, 100.0), "2 classes"),
        (torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), (0.01, 100.0), "non-empty"),
        (torch.zeros(3, 2), torch.zeros(3), (0.01, 100.0), "integer"),
        (torch.zeros(3, 2), torch.zeros(4, dtype=torch.long), (0.01, 100.0), "labels"),
        (torch.zeros(3, 2), torch.tensor([0, 1, 2]), (0.01, 100.0), r"labels in \[0, 1\]"),
        (torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), (0.0, 100.0), "bounds"),
        (torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), (2.0, 1.0), "bounds"),
        (torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), 5.0, "bounds"),
    ],
)
def test_bad_inputs_raise(logits, labels, bounds, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_temperature(logits, labels, bounds)


def test_bad_wrapper_arguments_raise() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        TemperatureScaling(lambda x: x)
    for value in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            TemperatureScaling(torch.nn.Linear(2, 2), temperature=value)
    with pytest.raises(ValueError, match="num_samples"):
        TemperatureScaling(torch.nn.Linear(2, 2)).fit(
            torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), num_samples=0
        )


class _MappingClassifier(torch.nn.Module):
    """A Hugging Face style classifier: called with the inputs alone, the logits under "logits" of a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, inputs: torch.Tensor) -> dict:
        return {"logits": 4.0 * self.linear(inputs)}


def test_a_classifier_without_a_mask_argument_and_with_a_mapping_output_is_scaled_and_fitted() -> None:
    # fit() passed mask=None to the model (a TypeError without a mask argument) and forward divided the dict by tau
    model = _MappingClassifier()
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(60, 4, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (60,), generator=generator)
    scaled = TemperatureScaling(model).fit(inputs, labels, bounds=(0.05, 20.0))
    logits = 4.0 * (inputs @ model.linear.weight.T + model.linear.bias)
    result = minimize_scalar(
        lambda log_t: reference_nll(logits, labels, math.exp(log_t)),
        bounds=(math.log(0.05), math.log(20.0)),
        method="bounded",
        options={"xatol": 1e-10},
    )
    assert math.log(scaled.temperature.item()) == pytest.approx(result.x, abs=1e-6)
    torch.testing.assert_close(scaled(inputs), logits / scaled.temperature.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        predict_probabilities(scaled, inputs), (logits / scaled.temperature.detach()).softmax(-1), rtol=1e-12, atol=0
    )


@pytest.mark.parametrize(
    "value, error, match",
    [
        (True, TypeError, "temperature"),  # was taken as 1.0
        (torch.tensor(True), TypeError, "temperature"),
        (torch.tensor([1.0, 2.0]), ValueError, "one finite number"),  # was torch's "shape '[]' is invalid"
        (np.array([0.5, 2.0]), ValueError, "one finite number"),
    ],
)
def test_a_temperature_that_is_not_one_number_is_refused(value, error, match: str) -> None:
    scaled = TemperatureScaling(torch.nn.Linear(2, 2), temperature=1.5)
    with pytest.raises(error, match=match):
        scaled.temperature = value
    assert scaled.temperature.item() == pytest.approx(1.5)  # unchanged
    scaled.temperature = torch.tensor([0.25])  # one value in a tensor of any shape is fine
    assert scaled.temperature.item() == pytest.approx(0.25)
