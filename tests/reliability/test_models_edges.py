"""The models and readouts at their edges: temperature scaling (against a bounded scalar search and direct float64
NLLs, its invariances and degenerate inputs), the Transformer's masks, batches and dtypes, the comparison's predictive
averaging over Monte Carlo samples and ensemble members (against a direct float64 computation from the same draws),
and the kernel-eigen readout's KL and predictive variance (against torch.distributions and a dense computation).

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import itertools
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from torch.distributions import MultivariateNormal, kl_divergence

from gpattn.attention import KEPSVGPAttention, attention_arguments, attention_names, sample_attention
from gpattn.comparison import TaskData, random_stream
from gpattn.comparison.evaluation import ensemble_logits, evaluate_models
from gpattn.models import TemperatureScaling, Transformer, fit_temperature, predict_probabilities
from gpattn.training import ensemble_probabilities

DTYPE = torch.float64


# -- helpers -----------------------------------------------------------------------------------------------------------
def _mixture_nll(samples: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """-1/n sum_i log(1/T sum_t softmax(z_ti / tau)_{y_i}) in float64, from log-probabilities (logsumexp)."""
    samples = samples.to(DTYPE)
    samples = samples if samples.dim() == 3 else samples.unsqueeze(0)
    log_probs = samples / temperature - torch.logsumexp(samples / temperature, dim=-1, keepdim=True)
    picked = log_probs[:, torch.arange(labels.shape[0]), labels]  # (T, n)
    return float(-(torch.logsumexp(picked, dim=0) - math.log(samples.shape[0])).mean())


def _scipy_temperature(samples: torch.Tensor, labels: torch.Tensor, bounds=(0.01, 100.0)) -> float:
    result = minimize_scalar(
        lambda u: _mixture_nll(samples, labels, math.exp(u)),
        bounds=(math.log(bounds[0]), math.log(bounds[1])),
        method="bounded",
        options={"xatol": 1e-10},
    )
    return math.exp(result.x)


def _small_transformer(name: str, seed: int = 0, **kwargs) -> Transformer:
    sizes = {"num_inducing": 4} if "num_inducing" in attention_arguments(name) else {}
    arguments = {"embed_dim": 16, "num_heads": 2, "depth": 2, "input": "tokens", "vocab_size": 11, "max_len": 9}
    torch.manual_seed(seed)
    return Transformer(3, attention=name, **{**arguments, **sizes, **kwargs})


def _padded_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 11, (4, 9), generator=generator)
    mask = torch.arange(9) < torch.tensor([9, 3, 6, 1])[:, None]
    return torch.where(mask, ids, 0), mask


# -- temperature scaling -----------------------------------------------------------------------------------------------
def test_fitted_temperature_of_mixed_scale_monte_carlo_logits_is_the_bounded_scalar_minimum():
    """Monte Carlo samples of very different sharpness (a mixture objective that is not convex in 1 / tau): the fitted
    temperature is the minimiser of the mixture NLL found by a bounded scalar search (scipy), and its NLL is no
    higher than that of a dense grid over the whole interval."""
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        scales = torch.tensor([0.5, 3.0, 8.0], dtype=DTYPE)[:, None, None]
        samples = scales * torch.randn(3, 60, 4, generator=generator, dtype=DTYPE)
        labels = torch.randint(0, 4, (60,), generator=generator)
        fitted = fit_temperature(samples, labels)
        grid = np.exp(np.linspace(math.log(0.01), math.log(100.0), 2001))
        values = [_mixture_nll(samples, labels, t) for t in grid]
        assert _mixture_nll(samples, labels, fitted) <= min(values) + 1e-12
        best = grid[int(np.argmin(values))]
        if 0.02 < best < 50:  # an interior minimum: scipy's bounded search (started around it) agrees
            assert fitted == pytest.approx(_scipy_temperature(samples, labels), rel=1e-5)


def test_the_wrapper_keeps_the_arg_max_and_never_raises_the_fitting_nll():
    """For one logit vector per input the temperature keeps the arg max (the accuracy), and the NLL at the fitted
    temperature is never above the unscaled one nor above that of temperatures 1 % either side."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(200, 5, generator=generator, dtype=DTYPE)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 4).double()
    with torch.no_grad():
        model.weight.mul_(6.0)  # over-confident
    labels = (model(inputs) + 3.0 * torch.randn(200, 4, generator=generator, dtype=DTYPE)).argmax(-1).detach()
    scaled = TemperatureScaling(model).fit(inputs, labels, num_samples=1)
    tau = float(scaled.temperature.detach())
    assert tau > 1.5  # softened
    with torch.no_grad():
        logits, scaled_logits = model(inputs), scaled(inputs)
    assert torch.equal(logits.argmax(-1), scaled_logits.argmax(-1))
    torch.testing.assert_close(scaled_logits, logits / tau, rtol=1e-15, atol=0)
    nll = _mixture_nll(logits, labels, tau)
    for other in (1.0, 0.99 * tau, 1.01 * tau):
        assert nll <= _mixture_nll(logits, labels, other) + 1e-12


def test_the_docstring_example_of_a_monte_carlo_prediction_moving_with_the_temperature():
    """Three samples (5, 0), (0, 0.5), (0, 0.5): class 0 has probability 0.58 at tau = 1 and 0.34 at tau = 0.1 (the
    module docstring), through the wrapper and predict_probabilities."""
    samples = torch.tensor([[[5.0, 0.0]], [[0.0, 0.5]], [[0.0, 0.5]]], dtype=DTYPE)
    for tau, expected in ((1.0, 0.5828), (0.1, 0.3378)):
        probability = float((samples / tau).softmax(-1).mean(0)[0, 0])
        assert probability == pytest.approx(expected, abs=1e-4)
    # exact values: (sigma(5) + 2 sigma(-0.5)) / 3 and (sigma(50) + 2 sigma(-5)) / 3
    sigmoid = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
    assert float(samples.softmax(-1).mean(0)[0, 0]) == pytest.approx((sigmoid(5) + 2 * sigmoid(-0.5)) / 3, rel=1e-14)


def test_degenerate_validation_sets_give_the_documented_temperatures_and_warnings():
    """Perfectly separated logits: the lower bound, with the warning; confidently wrong ones: the upper bound; logits
    equal across the classes: 1 with its warning; two tied classes that the labels split (the NLL falls to 2 log 2 / 3
    as tau -> 0): the lower bound."""
    separated = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0]], dtype=DTYPE)
    labels = torch.tensor([0, 1, 2])
    with pytest.warns(UserWarning, match="optimum lies on the boundary .* goes down"):
        assert fit_temperature(separated, labels) == pytest.approx(0.01, rel=1e-6)
    with pytest.warns(UserWarning, match="optimum lies on the boundary .* grows"):
        assert fit_temperature(separated, torch.tensor([1, 2, 0])) == pytest.approx(100.0, rel=1e-6)
    with pytest.warns(UserWarning, match="equal across the classes"):
        assert fit_temperature(torch.full((3, 4, 3), 2.5, dtype=DTYPE), torch.tensor([0, 1, 2, 0])) == 1.0
    tied = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 3.0]], dtype=DTYPE)
    with pytest.warns(UserWarning, match="goes down"):
        tau = fit_temperature(tied, labels)
    assert tau == pytest.approx(0.01, rel=1e-6)
    assert _mixture_nll(tied, labels, tau) == pytest.approx(2 * math.log(2) / 3, rel=1e-12)


@pytest.mark.parametrize(
    ("logits", "labels", "match"),
    [
        (torch.tensor([[0.0, float("nan")]], dtype=DTYPE), torch.tensor([0]), "NaN or Inf"),
        (torch.tensor([[0.0, float("inf")]], dtype=DTYPE), torch.tensor([0]), "NaN or Inf"),
        (torch.zeros(2, 1, dtype=DTYPE), torch.tensor([0, 0]), "at least 2 classes"),
        (torch.zeros(0, 3, dtype=DTYPE), torch.zeros(0, dtype=torch.long), "non-empty"),
        (torch.zeros(2, 3, dtype=DTYPE), torch.tensor([0, 3]), r"labels in \[0, 2\]"),
    ],
)
def test_bad_logits_are_refused_not_fitted(logits, labels, match):
    with pytest.raises(ValueError, match=match):
        fit_temperature(logits, labels)


def test_float32_logits_near_their_largest_value_give_the_upper_bound():
    """Confidently wrong float32 logits of 3e38 (cast to float64 before scaling: no overflow at tau = 0.01)."""
    logits = torch.tensor([[3e38, 0.0], [0.0, 1e38]], dtype=torch.float32)
    with pytest.warns(UserWarning, match="grows"):
        assert fit_temperature(logits, torch.tensor([1, 1])) == pytest.approx(100.0, rel=1e-6)


def test_finite_float64_logits_near_the_largest_double_give_the_upper_bound():
    """The same confidently wrong prediction at 2e306 (finite, accepted by the input check): the NLL ~ 2e306 / tau
    falls as tau grows, so the answer is the upper bound with its warning (or a clear error), never a temperature
    picked from NaNs."""
    logits = torch.tensor([[2e306, 0.0], [0.0, 1e306]], dtype=DTYPE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        temperature = fit_temperature(logits, torch.tensor([1, 1]))
    assert temperature == pytest.approx(100.0, rel=1e-6)
    assert any("grows" in str(warning.message) for warning in caught)
    # an interior optimum at that scale: the fit of the same logits divided by 1e305, times 1e305 (up to rounding)
    mixed = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0]], dtype=DTYPE)
    labels = torch.tensor([0, 1, 1, 0])
    reference = fit_temperature(mixed, labels)
    assert 0.01 < reference < 100.0
    # at the largest doubles themselves (the scale of the shift is a power of 2 at most the largest logit: 2**1024,
    # one above it, overflowed)
    for top in (9e307, 1.7e308, torch.finfo(DTYPE).max):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            wrong = torch.tensor([[top, 0.0], [0.0, top / 2]], dtype=DTYPE)
            assert fit_temperature(wrong, torch.tensor([1, 1])) == pytest.approx(100.0, rel=1e-6)
    # the search's low end overflows logits / tau (the shifted path), its optimum is interior
    fitted = fit_temperature(mixed * 1e306, labels, bounds=(0.01, 1e308))
    assert fitted == pytest.approx(reference * 1e306, rel=1e-6)


def test_the_temperature_survives_a_state_dict_round_trip_and_a_dtype_change():
    torch.manual_seed(0)
    scaled = TemperatureScaling(torch.nn.Linear(3, 2), temperature=2.5)
    other = TemperatureScaling(torch.nn.Linear(3, 2))
    other.load_state_dict(scaled.state_dict())
    assert float(other.temperature.detach()) == pytest.approx(2.5, rel=1e-6)
    inputs = torch.randn(4, 3)
    torch.testing.assert_close(other(inputs), scaled(inputs), rtol=0, atol=0)
    scaled.double()
    assert scaled.temperature.dtype == DTYPE and float(scaled.temperature.detach()) == pytest.approx(2.5, rel=1e-6)
    for value in (1e-6, 1e6):  # the Positive constraint's inverse at the ends of the usual bounds
        assert float(TemperatureScaling(torch.nn.Linear(3, 2).double(), value).temperature.detach()) == pytest.approx(
            value
        )


# -- the Transformer ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", attention_names())
def test_eval_logits_are_per_sequence_and_do_not_see_the_padding(name):
    """In eval mode: two calls agree bit for bit; every sequence's logits are those of it alone (no coupling across
    the batch), and those of it without its padding (a shorter, unmasked sequence); the float32 model agrees with the
    float64 one to float32 rounding and returns float32."""
    model = _small_transformer(name).double().eval()
    ids, mask = _padded_tokens()
    with torch.no_grad():
        logits = model(ids, mask=mask)
        assert torch.equal(model(ids, mask=mask), logits)
        alone = torch.cat([model(ids[i : i + 1], mask=mask[i : i + 1]) for i in range(4)])
        unpadded = torch.cat([model(ids[i : i + 1, : int(mask[i].sum())]) for i in range(4)])
        single = model.float()(ids, mask=mask)
    torch.testing.assert_close(alone, logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(unpadded, logits, rtol=0, atol=1e-12)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), logits, rtol=0, atol=1e-4)


def test_a_sequence_of_max_len_is_taken_and_positions_matter():
    """N = max_len is accepted (N = max_len + 1 is refused elsewhere); the learned positions make the logits depend
    on the order of the tokens."""
    model = _small_transformer("softmax").double().eval()
    ids = torch.arange(1, 10)[None]
    with torch.no_grad():
        logits = model(ids)
        flipped = model(ids.flip(-1))
    assert logits.shape == (1, 3)
    assert (logits - flipped).abs().max() > 1e-6


def test_monte_carlo_prediction_is_the_mean_of_the_sample_softmaxes_in_float64():
    """predict_probabilities of a stochastic model: the mean over T samples of softmax (not the softmax of the mean
    logits), recomputed here from the same draws as exp(z - logsumexp z)."""
    model = _small_transformer("kep_svgp").double()
    ids, mask = _padded_tokens()
    torch.manual_seed(11)
    probabilities = predict_probabilities(model, ids, mask, num_samples=5)
    torch.manual_seed(11)
    with torch.no_grad(), sample_attention(model.eval()):
        samples = torch.stack([model(ids, mask=mask) for _ in range(5)])
    assert (samples[0] - samples[1]).abs().max() > 1e-6  # the samples differ
    expected = (samples - torch.logsumexp(samples, -1, keepdim=True)).exp().mean(0)
    torch.testing.assert_close(probabilities, expected, rtol=0, atol=1e-14)
    logits_average = samples.mean(0).softmax(-1)
    assert (probabilities - logits_average).abs().max() > 1e-6  # the other average is not what is returned


# -- the comparison's predictive ---------------------------------------------------------------------------------------
def _vector_set(n: int, seed: int) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        inputs=torch.randn(n, 5, 3, generator=generator, dtype=DTYPE),
        labels=torch.randint(0, 3, (n,), generator=generator),
        num_classes=3,
    )


def test_the_reported_prediction_averages_every_member_and_sample_and_the_temperature_is_the_mixture_minimiser():
    """evaluate_models on two stochastic members with T = 3: the test prediction is the mean of the K T sample
    softmaxes (every member weighted alike), recomputed from the same draws (the set's stream, members in order);
    the +ts temperature minimises the validation NLL of the K T mixture (scipy), and the +ts test NLL is that of the
    scaled mixture."""
    members = []
    for seed in (0, 1):
        model = _small_transformer("kep_svgp", seed=seed, input="vectors", vocab_size=None, input_dim=3)
        with torch.no_grad():
            model.head.weight.mul_(8.0)  # confident enough that the temperature moves away from 1
        members.append(model.double().eval())
    val, test = _vector_set(40, 2), _vector_set(30, 3)
    data = TaskData("toy", train=val, val=val, test=test, model_kwargs={})
    evaluation = evaluate_models(members, data, num_samples=3, seed=4)

    def draws(dataset, name):
        with random_stream(4, name), torch.no_grad():
            logits = []
            for model in members:
                with sample_attention(model):
                    logits.append(torch.stack([model(dataset.inputs) for _ in range(3)]))
        return torch.cat(logits)  # (K T, n, C)

    test_logits, val_logits = draws(test, "test"), draws(val, "val")
    assert (test_logits[0] - test_logits[3]).abs().max() > 1e-3  # the members differ
    probabilities = (test_logits - torch.logsumexp(test_logits, -1, keepdim=True)).exp().mean(0)
    true_class = probabilities[torch.arange(30), test.labels]
    assert evaluation.metrics.test.nll == pytest.approx(float(-true_class.log().mean()), rel=1e-12)
    np.testing.assert_allclose(evaluation.per_example["test_nll"], (-true_class.log()).numpy(), rtol=1e-12)
    accuracy = float((probabilities.argmax(-1) == test.labels).double().mean())
    assert evaluation.metrics.test.accuracy == pytest.approx(accuracy, abs=1e-15)
    tau = evaluation.temperature_scaled.temperature
    assert abs(math.log(tau)) > 0.05
    assert tau == pytest.approx(_scipy_temperature(val_logits, val.labels), rel=1e-5)
    assert evaluation.temperature_scaled.metrics.test.nll == pytest.approx(
        _mixture_nll(test_logits, test.labels, tau), rel=1e-10
    )


def test_ensemble_logits_draw_as_the_ensemble_probabilities_across_a_batch_boundary():
    """Two stochastic members on 300 inputs (two batches of at most 256): the comparison's logits and the training
    loop's ensemble probabilities make the same draws in the same order, so the mean of the K T softmaxes is the
    ensemble probability (the documented equality)."""
    members = [
        _small_transformer("kep_svgp", seed=seed, input="vectors", vocab_size=None, input_dim=3).double().eval()
        for seed in (0, 1)
    ]
    dataset = _vector_set(300, 5)
    torch.manual_seed(3)
    logits = ensemble_logits(members, dataset, num_samples=2)
    torch.manual_seed(3)
    probabilities = ensemble_probabilities(members, dataset, num_samples=2)
    assert logits.shape == (2, 2, 300, 3) and (logits[:, 0] - logits[:, 1]).abs().max() > 1e-6
    torch.testing.assert_close(logits.softmax(-1).mean((0, 1)), probabilities, rtol=0, atol=1e-14)


# -- the kernel-eigen readout ------------------------------------------------------------------------------------------
LAYER_VARIANTS = {
    "pair": {},
    "shared-posterior": {"shared_posterior": True},
    "tied": {"tie_qk": True},
    "concat": {"merge": "concat"},
    "exact": {"features": "exact"},
}


def _kep_layer(**kwargs) -> KEPSVGPAttention:
    torch.manual_seed(0)
    layer = KEPSVGPAttention(embed_dim=8, num_heads=2, num_inducing=3, num_outputs=2, **kwargs).double()
    with torch.no_grad():  # a posterior away from its initial diagonal
        factor = layer.strategy._variational_distribution.chol_variational_covar
        factor.add_(0.3 * torch.randn_like(factor))
    return layer


@pytest.mark.parametrize("variant", ["pair", "shared-posterior", "tied", "concat"])
def test_the_layer_kl_is_the_sum_of_the_gaussian_kls_against_the_learned_spectrum(variant):
    """KL(N(m, L L^T) || N(0, diag(Lambda^2))) summed over heads, outputs and branches, by torch.distributions."""
    layer = _kep_layer(**LAYER_VARIANTS[variant])
    distribution = layer.strategy._variational_distribution
    mean, lower = distribution.variational_mean.detach(), distribution.chol_variational_covar.detach().tril()
    spectrum = layer.features.singular_values.detach()  # (H, s)
    scales = spectrum.reshape(spectrum.shape[0], *(1,) * (mean.dim() - 2), -1).expand_as(mean)
    q = MultivariateNormal(mean, covariance_matrix=lower @ lower.mT)  # some diagonal entries of L < 0
    p = MultivariateNormal(torch.zeros_like(mean), covariance_matrix=torch.diag_embed(scales.square()))
    torch.testing.assert_close(layer.kl_divergence(), kl_divergence(q, p).sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_the_posterior_variance_is_the_variance_of_the_output_under_q_u(variant):
    """The output is linear in u, so Var(y) = sum over the (head, output, branch) blocks of ||J L||^2; each column of
    J L is the change of the mean output when the block's mean moves by a column of L (dense, by finite shifts, exact
    for a linear map)."""
    layer = _kep_layer(**LAYER_VARIANTS[variant]).eval()
    inputs = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    distribution = layer.strategy._variational_distribution
    with torch.no_grad():
        mean, variance = layer.posterior(inputs, mask)
        start, lower = distribution.variational_mean.clone(), distribution.chol_variational_covar.tril().clone()
        dense = torch.zeros_like(variance)
        for block in itertools.product(*map(range, start.shape[:-1])):
            for column in range(start.shape[-1]):
                distribution.variational_mean.copy_(start)
                distribution.variational_mean[block] += lower[block][:, column]
                dense += (layer.posterior(inputs, mask)[0] - mean).square()
        distribution.variational_mean.copy_(start)
    assert variance.abs().max() > 1e-3
    torch.testing.assert_close(variance, dense, rtol=1e-10, atol=1e-14)
