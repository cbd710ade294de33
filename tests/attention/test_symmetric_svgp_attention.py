"""Symmetric SVGP attention: context summaries, a dense whitened-SVGP reference (float64), masks, KL, sampling."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from gpattn.attention._base import sample_attention
from gpattn.attention.symmetric_svgp_attention import SymmetricSVGPAttention

DTYPE = torch.float64
EMBED, HEADS, INDUCING = 8, 2, 4
SETTINGS = ("none", "padding", "causal", "cross")


def make_layer(seed: int = 0, **kwargs) -> SymmetricSVGPAttention:
    torch.manual_seed(seed)
    layer = SymmetricSVGPAttention(EMBED, HEADS, kwargs.pop("num_inducing", INDUCING), **kwargs).to(DTYPE)
    distribution = layer.gp.variational_strategy._variational_distribution
    with torch.no_grad():  # a q(u) away from the prior
        distribution.variational_mean.normal_()
        distribution.chol_variational_covar.copy_(
            torch.eye(INDUCING, dtype=DTYPE) + 0.3 * torch.randn_like(distribution.chol_variational_covar).tril()
        )
    return layer


def make_inputs(setting: str, seed: int = 1, batch: int = 2, length: int = 5, context_length: int = 7, width=EMBED):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, width, generator=generator, dtype=DTYPE)
    if setting == "none":
        return x, None, None
    if setting == "causal":
        return x, "causal", None
    keys_length = context_length if setting == "cross" else length
    mask = torch.ones(batch, keys_length, dtype=torch.bool)
    mask[0, -2:] = False
    context = (
        torch.randn(batch, context_length, width, generator=generator, dtype=DTYPE) if setting == "cross" else None
    )
    return x, mask, context


def dense_moments(layer: SymmetricSVGPAttention, x, mask, context):
    """Context summaries token by token, then the whitened SVGP marginals by the textbook formulas."""
    width = layer.head_dim
    source = x if context is None else context
    gp = layer.gp
    kernel = gp.covar_module
    jitter = gp.variational_strategy.jitter_val
    distribution = gp.variational_strategy._variational_distribution
    means = torch.zeros(*x.shape[:2], HEADS, width, dtype=DTYPE)
    variances = torch.zeros_like(means)
    for seq in range(x.shape[0]):
        real = mask[seq] if isinstance(mask, torch.Tensor) else torch.ones(source.shape[1], dtype=torch.bool)
        for head in range(HEADS):
            rows = slice(head * width, (head + 1) * width)
            queries = x[seq] @ layer.query_proj.weight[rows].T
            keys = source[seq] @ layer.key_proj.weight[rows].T
            features = []
            for i in range(x.shape[1]):
                visible = real.clone()
                if mask == "causal":
                    visible[i + 1 :] = False
                features.append(queries[i] + keys[visible].mean(0))
            features = torch.stack(features)  # shape: (N, p)
            inducing = gp.variational_strategy.inducing_points[head, 0]
            lengthscale = kernel.base_kernel.lengthscale[head, 0]
            outputscale = kernel.outputscale[head, 0]

            def kern(left, right, lengthscale=lengthscale, outputscale=outputscale):
                diff = (left[:, None, :] - right[None, :, :]) / lengthscale
                return outputscale * torch.exp(-0.5 * diff.square().sum(-1))

            induc_induc = kern(inducing, inducing) + jitter * torch.eye(len(inducing), dtype=DTYPE)
            interp = torch.linalg.solve(torch.linalg.cholesky(induc_induc), kern(inducing, features))  # L^{-1} K_uf
            for dim in range(width):
                root = distribution.chol_variational_covar[head, dim].tril()
                means[seq, :, head, dim] = interp.T @ distribution.variational_mean[head, dim]
                variances[seq, :, head, dim] = (
                    outputscale - interp.square().sum(0) + (root.T @ interp).square().sum(0) + jitter
                )
    return means.transpose(1, 2), variances.transpose(1, 2)


@pytest.mark.parametrize(
    "kwargs",
    [{"num_inducing": 0}, {"num_inducing": 3.5}, {"num_inducing": True}, {"embed_dim": 6, "num_heads": 4}],
)
def test_constructor_validation(kwargs):
    with pytest.raises(ValueError, match="expected|divisible"):
        SymmetricSVGPAttention(**{"embed_dim": EMBED, "num_heads": HEADS, **kwargs})


@pytest.mark.parametrize("setting", SETTINGS)
def test_shapes(setting):
    layer = make_layer()
    x, mask, context = make_inputs(setting)
    for mode in (True, False):
        layer.train(mode)
        assert layer(x, mask=mask, context=context).shape == x.shape
        mean, variance = layer.posterior(x, mask=mask, context=context)
        assert mean.shape == variance.shape == x.shape and (variance > 0).all()
    assert layer.gp_inputs(x, mask, context).shape == (x.shape[0], HEADS, x.shape[1], EMBED // HEADS)


@pytest.mark.parametrize("setting", SETTINGS)
def test_matches_dense_reference(setting):
    layer = make_layer().eval()
    x, mask, context = make_inputs(setting)
    mean, variance = layer.head_moments(x, mask, context)
    dense_mean, dense_variance = dense_moments(layer, x, mask, context)
    real = mask if isinstance(mask, torch.Tensor) and context is None else torch.ones(x.shape[:2], dtype=torch.bool)
    real = real[:, None, :].expand(-1, HEADS, -1)
    torch.testing.assert_close(mean[real], dense_mean[real], rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(variance[real], dense_variance[real], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("setting", ["padding", "cross"])
def test_padding_mask_invariance(setting):
    layer = make_layer().eval()
    x, mask, context = make_inputs(setting)
    output = layer(x, mask=mask, context=context)
    perturbed = (x if context is None else context).clone()
    perturbed[~mask] = 10 * torch.randn_like(perturbed[~mask])
    if context is None:
        output_perturbed, real = layer(perturbed, mask=mask), mask
    else:
        output_perturbed, real = layer(x, mask=mask, context=perturbed), torch.ones(x.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(output_perturbed[real], output[real], rtol=0, atol=1e-10)


def test_causal_invariance():
    layer = make_layer().eval()
    x, mask, _ = make_inputs("causal", length=6)
    mean, variance = layer.posterior(x, mask=mask)
    for position in range(x.shape[1] - 1):
        perturbed = x.clone()
        perturbed[:, position + 1 :] = torch.randn_like(perturbed[:, position + 1 :])
        mean_perturbed, variance_perturbed = layer.posterior(perturbed, mask=mask)
        torch.testing.assert_close(mean_perturbed[:, : position + 1], mean[:, : position + 1], rtol=0, atol=1e-10)
        torch.testing.assert_close(variance_perturbed[:, : position + 1], variance[:, : position + 1])


def test_cross_attention():
    layer = make_layer()
    x, mask, context = make_inputs("cross", length=3, context_length=8)
    assert layer(x, context=context).shape == x.shape
    summary = layer.gp_inputs(x, context=context) - layer.split_heads(layer.query_proj(x))
    expected = layer.split_heads(layer.key_proj(context)).mean(-2, keepdim=True).expand_as(summary)
    torch.testing.assert_close(summary, expected)
    with pytest.raises(ValueError, match="causal"):
        layer(x, mask="causal", context=context)


def test_kl_equals_torch_distributions():
    layer = make_layer()
    distribution = layer.gp.variational_strategy._variational_distribution
    q_u = MultivariateNormal(distribution.variational_mean, scale_tril=distribution.chol_variational_covar.tril())
    p_u = MultivariateNormal(
        torch.zeros_like(q_u.loc), scale_tril=torch.eye(INDUCING, dtype=DTYPE).expand_as(q_u.scale_tril)
    )
    expected = kl_divergence(q_u, p_u).sum()
    torch.testing.assert_close(layer.kl_divergence(), expected, rtol=1e-10, atol=1e-10)
    x, _, _ = make_inputs("none")
    layer(x)  # data independent
    torch.testing.assert_close(layer.kl_divergence(), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("setting", ["none", "causal"])
def test_sampling_moments_match_posterior(setting):
    layer = make_layer().eval()
    x, mask, _ = make_inputs(setting, batch=1)
    with torch.no_grad():
        mean, variance = layer.posterior(x, mask=mask)
        torch.testing.assert_close(mean, layer(x, mask=mask))
        samples = 20000
        torch.manual_seed(3)
        with sample_attention(layer):
            draws = layer(x.expand(samples, -1, -1), mask=mask)
    tolerance = 5 * (variance.max().item() / samples) ** 0.5
    torch.testing.assert_close(draws.mean(0, keepdim=True), mean, rtol=0, atol=tolerance)
    relative = (draws.var(0, keepdim=True) - variance).abs() / variance
    assert relative.max() < 5 * (2 / samples) ** 0.5


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_parameter_gets_a_gradient(setting):
    layer = make_layer().train()
    x, mask, context = make_inputs(setting)
    (layer(x, mask=mask, context=context).sum() + layer.kl_divergence()).backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("setting", SETTINGS)
def test_gradcheck(setting):
    torch.manual_seed(0)
    layer = SymmetricSVGPAttention(4, 2, num_inducing=3).double().eval()
    x, mask, context = make_inputs(setting, batch=1, length=3, context_length=4, width=4)
    x.requires_grad_(True)
    # linear_operator's custom autograd functions do not accept undefined output gradients: skip that extra probe
    assert torch.autograd.gradcheck(
        lambda tokens: layer(tokens, mask=mask, context=context), (x,), check_undefined_grad=False
    )


def test_default_dtype_then_double_and_deepcopy():
    torch.manual_seed(0)
    layer = SymmetricSVGPAttention(EMBED, HEADS, INDUCING, dropout=0.1).eval()
    x = torch.randn(2, 5, EMBED)
    output = layer(x)  # caches the K_uu Cholesky in float32
    assert output.dtype == torch.float32
    layer.double()
    output_double = layer(x.double())
    assert output_double.dtype == DTYPE and layer.kl_divergence().dtype == DTYPE
    fresh = copy.deepcopy(layer)  # deep copies start without caches
    torch.testing.assert_close(output_double, fresh(x.double()), rtol=1e-12, atol=1e-12)
    assert SymmetricSVGPAttention.is_stochastic


# -- no cache survives a call (issue 14) -----------------------------------------------------------------------------
def test_eval_mode_backward_twice_through_fresh_calls():
    # GPyTorch memoises the K_uu Cholesky in eval mode; a memo holding the first call's graph made the second call's
    # backward fail with "Trying to backward through the graph a second time"
    layer = make_layer().eval()
    x, mask, context = make_inputs("padding")
    gradients = []
    for _ in range(2):
        layer.zero_grad()
        layer(x, mask=mask, context=context).sum().backward()
        gradients.append(layer.gp.covar_module.base_kernel.raw_lengthscale.grad.clone())
    torch.testing.assert_close(gradients[0], gradients[1], rtol=0, atol=0)
    assert gradients[0].abs().sum() > 0


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_eval_mode_output_follows_an_in_place_parameter_update(grad):
    # after an in-place update of the kernel or the inducing points the output must be that of the new parameters
    # (compared with the dense float64 reference), never the memoised Cholesky of the old ones
    layer = make_layer().eval()
    x, mask, context = make_inputs("none")
    with torch.set_grad_enabled(grad):
        layer.head_moments(x, mask, context)  # fills any memo
        with torch.no_grad():
            layer.gp.covar_module.base_kernel.raw_lengthscale.add_(0.7)
            layer.gp.variational_strategy.inducing_points.mul_(1.3)
        mean, variance = layer.head_moments(x, mask, context)
    dense_mean, dense_variance = dense_moments(layer, x, mask, context)
    torch.testing.assert_close(mean.detach(), dense_mean, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(variance.detach(), dense_variance, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layer_says_what_needs_float32(dtype):
    """GPyTorch's variational strategy has no half-precision jitter (before: ``TypeError: must be real number, not
    NoneType`` in float16, "Unsupported dtype for variational_cholesky_jitter" in bfloat16); the advice holds: the
    float32 layer under bfloat16 autocast gives the float32 result up to bfloat16's rounding of the output map."""
    layer = make_layer().float().eval()
    x, _, _ = make_inputs("none")
    with pytest.raises(
        TypeError,
        match=rf"SymmetricSVGPAttention: GPyTorch's variational strategy .* needs float32 or float64 .*got {dtype}",
    ):
        copy.deepcopy(layer).to(dtype)(x.to(dtype))
    with torch.no_grad():
        expected = layer(x.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = layer(x.float())
    tolerance = 4 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(output.float(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
