"""The readout of a kernel-eigen strategy's q(f) (:class:`~gpattn.variational.KernelEigenReadout`): the per-token
noise by one GEMM against the dense computation, then Monte Carlo (float64). The readout's other paths (the mean, joint
draws, the variance through the output maps) are tested through the attention layer against dense references in
``tests/attention/test_kep_svgp_attention.py``."""

from __future__ import annotations

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
