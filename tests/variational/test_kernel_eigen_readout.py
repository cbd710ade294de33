"""The readout of a kernel-eigen strategy's q(f) (:class:`~gpattn.variational.KernelEigenReadout`): the per-token
noise by one GEMM against the dense computation, then Monte Carlo (float64). The readout's other paths (the mean, joint
draws, the variance through the output maps) are tested through the attention layer against dense references in
``tests/attention/test_kep_svgp_attention.py``."""

from __future__ import annotations

import re

import gpytorch
import pytest
import torch

from gpattn.attention import KEPSVGPAttention
from gpattn.variational import KernelEigenReadout, KernelEigenVariationalStrategy


# -- per-token ("marginal") noise: moments by one GEMM against the dense computation, then Monte Carlo ---------------
def _noise_layer(seed: int, **kwargs):
    torch.manual_seed(seed)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=3, **kwargs).double()
    # a full, random S per output and branch (the layer starts at a diagonal one)
    chol = layer.strategy._variational_distribution.chol_variational_covar
    with torch.no_grad():
        chol.copy_(torch.randn_like(chol).tril(-1) + torch.diag_embed(torch.rand(chol.shape[:-1]).double() + 0.5))
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    return layer, layer.features(x, objective=False, kernel_diag=True)


def _dense_token_covariance(layer, scores, first: str, second: str) -> torch.Tensor:
    """a_n S_c b_n^T from the dense S of every output, (B, H, d_out, N), and the same by the old root (a L)(b L)^T."""
    strategy = layer.strategy
    covariance = strategy.variational_distribution.covariance_matrix  # (H, d_out, branches, s, s)
    index = {"left": 0, "right": 1}
    s_first = covariance[:, :, 0 if covariance.shape[2] == 1 else index[first]]
    a, b = scores.interp(first), scores.interp(second)  # (B, H, N, s)
    dense = torch.einsum("bhni,hcij,bhnj->bhcn", a, s_first, b)
    root = torch.linalg.cholesky(s_first)  # (H, d_out, s, s)
    by_root = (torch.einsum("bhni,hcij->bhcnj", a, root) * torch.einsum("bhni,hcij->bhcnj", b, root)).sum(-1)
    torch.testing.assert_close(dense, by_root)
    return dense


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
def test_token_noise_moments_equal_the_dense_computation(shared: bool):
    layer, scores = _noise_layer(1, shared_posterior=shared)
    moments = layer.readout.token_noise_moments(scores, ("left", "right"))
    assert set(moments) == ({("left", "left"), ("right", "right")} | ({("left", "right")} if shared else set()))
    for (first, second), value in moments.items():
        assert value.shape == (2, 2, 3, 4)
        torch.testing.assert_close(value, _dense_token_covariance(layer, scores, first, second), rtol=1e-12, atol=1e-12)


def test_token_noise_moments_of_a_cholesky_posterior_equal_the_generic_path(monkeypatch):
    """A Cholesky q(u) forms S = L L^T from its parameter (no GPyTorch distribution per call); any other q(u) goes
    through the strategy's variational distribution: both give the same moments (float64)."""
    from gpattn.variational import kernel_eigen_readout

    layer, scores = _noise_layer(2, shared_posterior=True)
    fast = layer.readout.token_noise_moments(scores, ("left", "right"))
    monkeypatch.setattr(kernel_eigen_readout, "CholeskyVariationalDistribution", type("Other", (), {}))
    generic = layer.readout.token_noise_moments(scores, ("left", "right"))
    assert set(fast) == set(generic) == {("left", "left"), ("right", "right"), ("left", "right")}
    for key, value in fast.items():
        torch.testing.assert_close(value, generic[key], rtol=1e-13, atol=1e-13)


def test_marginal_noise_trains_after_a_first_call_under_inference_mode():
    """The constant matrices of the quadratic forms are cached per size, dtype and device: built first under
    ``torch.inference_mode`` (e.g. a Monte Carlo evaluation), they must still serve a training step's backward pass."""
    from gpattn.attention import sample_attention
    from gpattn.variational import kernel_eigen_readout

    kernel_eigen_readout._cached_triangle_selections.cache_clear()
    torch.manual_seed(0)
    layer = KEPSVGPAttention(16, 4, num_inducing=3, sampling="marginal")
    x = torch.randn(2, 8, 16)
    with torch.inference_mode(), sample_attention(layer.eval()):
        assert torch.isfinite(layer(x)).all()
    layer.train()(x).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    assert layer.strategy._variational_distribution.chol_variational_covar.grad.abs().sum() > 0


def _monte_carlo(layer, scores, num_draws: int, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    draws = [layer.readout.token_noise(scores, ("left", "right"), **kwargs) for _ in range(num_draws)]
    return {side: torch.stack([draw[side] for draw in draws]) for side in draws[0]}


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
@pytest.mark.parametrize("residual", ["none", "diag"])
def test_token_noise_monte_carlo_agrees(shared: bool, residual: str):
    layer, scores = _noise_layer(2, shared_posterior=shared, residual=residual)
    num_draws = 2000
    samples = _monte_carlo(layer, scores, num_draws, marginal=True)
    residuals = {side: scores.residual_diag(side)[:, :, None, :] if residual == "diag" else 0.0 for side in samples}
    variance = {side: _dense_token_covariance(layer, scores, side, side) + residuals[side] for side in samples}
    for side, draws in samples.items():
        assert draws.shape == (num_draws, 2, 2, 3, 4)
        assert (draws.mean(0).abs() <= 5 * (variance[side] / num_draws).sqrt()).all()
        relative = (draws.pow(2).mean(0) - variance[side]).abs() / variance[side]
        assert (relative <= 5 * (2.0 / num_draws) ** 0.5).all(), side
    cross = (samples["left"] * samples["right"]).mean(0)
    expected = _dense_token_covariance(layer, scores, "left", "right") if shared else torch.zeros_like(cross)
    scale = (variance["left"] * variance["right"] / num_draws).sqrt()
    assert ((cross - expected).abs() <= 5 * scale).all()
    if shared:  # the branches are clearly correlated: a shared q(u) must not be drawn independently
        assert (expected.abs() > 10 * scale).any()
    # different inputs and outputs are uncorrelated
    left = samples["left"]
    assert (
        (left[..., 0] * left[..., 1]).mean(0).abs()
        <= 5 * (variance["left"][..., 0] * variance["left"][..., 1] / num_draws).sqrt()
    ).all()


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
def test_token_noise_of_the_summed_branches(shared: bool):
    layer, scores = _noise_layer(4, shared_posterior=shared, residual="diag")
    num_draws = 2000
    samples = _monte_carlo(layer, scores, num_draws, marginal=True, sum_sides=True)
    assert set(samples) == {"left"}  # the noise of F_e + F_r under the first side
    expected = sum(_dense_token_covariance(layer, scores, a, b) for a in ("left", "right") for b in ("left", "right"))
    if not shared:
        expected = _dense_token_covariance(layer, scores, "left", "left") + _dense_token_covariance(
            layer, scores, "right", "right"
        )
    expected = expected + (scores.residual_diag("left") + scores.residual_diag("right"))[:, :, None, :]
    relative = (samples["left"].pow(2).mean(0) - expected).abs() / expected
    assert (relative <= 5 * (2.0 / num_draws) ** 0.5).all()
    # the variance the draw is scaled by is exactly this one (one normal per input and output)
    torch.manual_seed(9)
    noise = layer.readout.token_noise(scores, ("left", "right"), True, sum_sides=True)["left"]
    torch.manual_seed(9)
    standard = torch.randn(expected.shape, dtype=expected.dtype)
    torch.testing.assert_close(noise, expected.sqrt() * standard)


def test_the_readout_maps_one_output_dimension():
    q_u = gpytorch.variational.CholeskyVariationalDistribution(3)
    strategy = KernelEigenVariationalStrategy(torch.nn.Module(), torch.randn(6, 2), q_u)  # num_output_dims=0
    with pytest.raises(ValueError, match="one output dimension of q\\(u\\), the strategy has 0"):
        KernelEigenReadout(strategy)


def test_initialize_at_prior_draw_checks_lambda_before_touching_q():
    """The starting q(u) = N(m_0, c^2 Lambda^2) takes Lambda of shape (H, s) or one broadcasting to it; a NaN, a zero or
    a negative Lambda (a q(u) of NaN or of infinite KL before), another shape (a broadcasting error before) and a q(u)
    it cannot set (a delta one: its mean was overwritten before the refusal) are refused, q(u) left as it was."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=2).double()
    readout, posterior = layer.readout, layer.strategy._variational_distribution
    scales = torch.tensor([[1.0, 2.0, 4.0], [0.5, 1.0, 3.0]], dtype=torch.float64)
    readout.initialize_at_prior_draw(scales, covariance_scale=0.25)
    diagonal = posterior.chol_variational_covar.diagonal(dim1=-2, dim2=-1)  # (H, d_out, 2, s)
    torch.testing.assert_close(diagonal, (0.25 * scales)[:, None, None, :].expand_as(diagonal), rtol=0, atol=0)
    state = {name: value.clone() for name, value in posterior.state_dict().items()}
    for bad, error, message in [
        (torch.tensor([[1.0, float("nan"), 1.0]] * 2), ValueError, "NaN or Inf"),
        (torch.tensor([[1.0, 0.0, 1.0]] * 2), ValueError, "positive singular_values .* minimum of 0"),
        (-torch.ones(2, 3), ValueError, "positive singular_values"),
        (torch.ones(3, 3), ValueError, r"shape \(2, 3\) .* got \(3, 3\)"),
        (torch.ones(2, 4), ValueError, r"shape \(\.\.\., 3\), got \(2, 4\)"),
        ([[1.0] * 3] * 2, TypeError, "torch.Tensor, got list"),
    ]:
        with pytest.raises(error, match=message):
            readout.initialize_at_prior_draw(bad)
        assert all(torch.equal(value, state[name]) for name, value in posterior.state_dict().items())
    delta = gpytorch.variational.DeltaVariationalDistribution(3, batch_shape=posterior.batch_shape).double()
    layer.strategy._variational_distribution = delta
    mean = delta.variational_mean.clone()
    with pytest.raises(TypeError, match="Cholesky or mean-field .* got DeltaVariationalDistribution"):
        readout.initialize_at_prior_draw(torch.ones(2, 3))
    assert torch.equal(delta.variational_mean, mean)


@pytest.mark.parametrize("sampling", ["joint", "marginal"])
@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
def test_a_delta_posterior_is_read_as_a_point_mass(sampling: str, shared: bool):
    """A delta q(u) (MAP; the strategy's KL is GPyTorch's -log p(m)) has no covariance: every path of the readout read
    ``lazy_covariance_matrix`` and raised an AttributeError. Its draws are its mean: a sampled output equals the mean
    output, which equals that of a Cholesky q(u) of the same mean; the variance through the maps is the residual's."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=2, sampling=sampling, shared_posterior=shared).double()
    cholesky = layer.strategy._variational_distribution
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = layer.eval()(x)  # the mean of the Cholesky q(u)
    delta = gpytorch.variational.DeltaVariationalDistribution(3, batch_shape=cholesky.batch_shape).double()
    with torch.no_grad():
        delta.variational_mean.copy_(cholesky.variational_mean)
    layer.strategy._variational_distribution = delta
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.train()(x), expected, rtol=1e-12, atol=1e-12)  # a draw of a point mass
    mean, variance = layer.posterior(x)
    torch.testing.assert_close(mean, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(variance, torch.zeros_like(variance))
    readout, scores = layer.readout, layer.features(x, objective=False, kernel_diag=True)
    draws = readout.inducing_draw(torch.Size([4]))
    assert draws.shape == (4, *delta.variational_mean.shape) and (draws == delta.variational_mean).all()
    assert readout.token_noise(scores, ("left", "right"), marginal=True) == {}
    moments = readout.token_noise_moments(scores, ("left", "right"))
    assert all(torch.equal(value, torch.zeros_like(value)) for value in moments.values())
    prior = torch.distributions.Normal(0.0, layer.features.singular_values.double()[:, None, None, :])
    expected_kl = -prior.log_prob(delta.variational_mean).sum()
    torch.testing.assert_close(readout.kl_divergence(), expected_kl, rtol=1e-12, atol=1e-12)


def test_linear_output_refuses_no_sides():
    """No side reads no branch: the output was the bias alone, silently; a side that is not a leading part of the
    strategy's (``("right",)`` of a pair) was refused already."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=2)
    scores = layer.features(torch.randn(2, 5, 8), objective=False, kernel_diag=False)
    columns, maps = scores.columns(("left",)).flatten(1, 3), layer._output_maps(1)
    for sides in [(), ("right",)]:
        with pytest.raises(ValueError, match=rf"non-empty leading part of them, got {re.escape(str(sides))}"):
            layer.readout.linear_output(columns[:, : 6 * len(sides)], layer.out_proj.bias, maps, scores, sides)
