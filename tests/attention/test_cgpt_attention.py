"""CGPT attention against a dense re-implementation of the paper's formulas (explicit inverses, padded tokens dropped,
one head and sequence at a time, float64): the mean, the predictive covariance, the samples (Monte Carlo), the CGP
regulariser, masks and errors."""

from __future__ import annotations

import math

import pytest
import torch
from linear_operator.utils.errors import NotPSDError
from torch.distributions import MultivariateNormal

from gpattn.attention import CGPTAttention, sample_attention
from gpattn.mlls import AttentionELBO, CGPAddedLossTerm

DTYPE = torch.float64
EMBED, HEADS = 8, 2
WIDTH = EMBED // HEADS
SETTINGS = ("none", "padding", "cross")


def make_layer(seed: int = 0, **kwargs) -> CGPTAttention:
    torch.manual_seed(seed)
    layer = CGPTAttention(EMBED, HEADS, **kwargs).to(DTYPE)
    with torch.no_grad():  # away from the initial values, and different per head
        layer.outputscale = torch.tensor([0.7, 1.6], dtype=DTYPE)
        layer.query_variance_ratio = torch.tensor([1.4, 2.5], dtype=DTYPE)
        layer.key_variance_ratio = torch.tensor([3.0, 1.2], dtype=DTYPE)
        for projection in (layer.query_proj, layer.key_proj, layer.latent_proj):
            projection.weight.mul_(1.5)
    return layer


def make_inputs(setting: str, seed: int = 1, batch: int = 2, length: int = 5, context_length: int = 7):
    """``(x, mask, context)``; padding masks hide the last two keys (the queries too in self-attention) of the first
    sequence."""
    generator = torch.Generator().manual_seed(seed)
    x, context = (
        torch.randn(batch, size, EMBED, generator=generator, dtype=DTYPE) for size in (length, context_length)
    )
    keys = context if setting == "cross" else x
    real = torch.full((batch, 1), keys.shape[1])
    real[0] -= 2
    mask = None if setting == "none" else torch.arange(keys.shape[1]) < real
    return x, mask, context if setting == "cross" else None


# -- dense reference -------------------------------------------------------------------------------------------------
def rbf(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * torch.cdist(left, right).square())


def dense_head(layer: CGPTAttention, head: int, seq: int, x, mask, context, origin=None) -> dict[str, torch.Tensor]:
    """The paper's matrices for one head and sequence on the real tokens only, with explicit inverses.

    ``origin``: a point o subtracted from the tokens before the projections, W_0 o from every projection (so the
    queries become W_q (x - o) + (W_q - W_0) o), which leaves every RBF value unchanged in exact arithmetic and lets
    tokens at a large offset o + z be handled at the scale of z (x - o is exact for float64 tokens and o)."""
    rows = slice(head * WIDTH, (head + 1) * WIDTH)
    query_weight, key_weight = layer.query_proj.weight[rows], layer.key_proj.weight[rows]
    latent_weight = layer.latent_proj.weight[rows]
    source = x if context is None else context
    real_keys = torch.ones(source.shape[1], dtype=torch.bool) if mask is None else mask[seq]
    real_queries = real_keys if context is None else torch.ones(x.shape[1], dtype=torch.bool)
    origin = torch.zeros(x.shape[-1], dtype=DTYPE) if origin is None else origin
    queries = (x[seq][real_queries] - origin) @ query_weight.T + origin @ (query_weight - latent_weight).T
    keys = (source[seq][real_keys] - origin) @ key_weight.T + origin @ (key_weight - latent_weight).T
    latents = (source[seq][real_keys] - origin) @ latent_weight.T  # x_0 - W_0 o
    values = source[seq][real_keys] @ layer.value_proj.weight[rows].T
    eps, amplitude = layer.jitter, layer.outputscale[head]
    sigma_q, sigma_k = layer.query_variance_ratio[head], layer.key_variance_ratio[head]
    # the kernel matrices K of the unit-amplitude GPs (with the nugget); the GPs' covariances are a^2 K
    latent_covar = rbf(latents, latents) + eps * torch.eye(len(latents), dtype=DTYPE)  # K_00
    latent_inv = torch.linalg.inv(latent_covar)
    query_latent, key_latent = rbf(queries, latents), rbf(keys, latents)  # K_q0, K_k0
    query_key = query_latent @ latent_inv @ key_latent.T  # K_qk = K_q0 K_00^-1 K_0k
    query_covar = sigma_q * (rbf(queries, queries) + eps * torch.eye(len(queries), dtype=DTYPE))
    key_covar = sigma_k * (rbf(keys, keys) + eps * torch.eye(len(keys), dtype=DTYPE))
    return {
        "real_queries": real_queries,
        "mean": query_key @ values,  # K_qk K_kk^-1 z_k with z_k = K_kk v
        "covar": amplitude * (query_covar - query_key @ torch.linalg.inv(key_covar) @ query_key.T),
        "latent_covar": amplitude * latent_covar,
        "observed_keys": key_covar @ values,
        "query_interp": query_latent @ latent_inv,  # the conditional mean map of z_q given z_0
        "key_interp": key_latent @ latent_inv,
        "query_conditional": amplitude * (query_covar - query_latent @ latent_inv @ query_latent.T),  # Sigma_q
        "key_conditional": amplitude * (key_covar - key_latent @ latent_inv @ key_latent.T),
    }


def dense_objective(reference: dict[str, torch.Tensor]) -> torch.Tensor:
    """-E_{z_0}[log p(z_q = mu | z_0) + log p(z_k | z_0)] in closed form: the Gaussian log-density (from
    torch.distributions) of z at mean 0 plus 1/2 tr(Sigma^-1 A K_00 A^T) per value dimension."""
    total = torch.zeros((), dtype=DTYPE)
    for side, observed in (("query", reference["mean"]), ("key", reference["observed_keys"])):
        conditional, interp = reference[f"{side}_conditional"], reference[f"{side}_interp"]
        density = MultivariateNormal(torch.zeros(len(conditional), dtype=DTYPE), covariance_matrix=conditional)
        explained = interp @ reference["latent_covar"] @ interp.T  # Cov(E[z | z_0])
        trace = torch.trace(torch.linalg.solve(conditional, explained))
        total = total - density.log_prob(observed.T).sum() + 0.5 * observed.shape[1] * trace
    return total


def output_projection(layer: CGPTAttention, heads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(heads, dim=-1) @ layer.out_proj.weight.T + layer.out_proj.bias


# -- mean, covariance --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", SETTINGS)
def test_mean_and_variance_match_the_dense_formulas(setting):
    layer = make_layer().eval()
    x, mask, context = make_inputs(setting)
    output = layer(x, mask=mask, context=context)
    mean, variance = layer.posterior(x, mask=mask, context=context)
    torch.testing.assert_close(mean, output, rtol=0, atol=0)
    for seq in range(x.shape[0]):
        references = [dense_head(layer, head, seq, x, mask, context) for head in range(HEADS)]
        real = references[0]["real_queries"]
        expected_mean = output_projection(layer, [reference["mean"] for reference in references])
        # independent value dimensions: the variance of y = W h + b is (W * W) diag(Cov h)
        head_variances = [reference["covar"].diagonal()[:, None].expand(-1, WIDTH) for reference in references]
        expected_variance = torch.cat(head_variances, dim=-1) @ layer.out_proj.weight.square().T
        torch.testing.assert_close(output[seq][real], expected_mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(variance[seq][real], expected_variance, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("setting", SETTINGS)
def test_predictive_covariance_matches_the_dense_formula_and_is_psd(setting):
    layer = make_layer()
    x, mask, context = make_inputs(setting)
    mean, covar = layer.head_covariance(x, mask=mask, context=context)
    assert mean.shape == (2, HEADS, x.shape[1], WIDTH) and covar.shape == (2, HEADS, x.shape[1], x.shape[1])
    for seq in range(x.shape[0]):
        for head in range(HEADS):
            reference = dense_head(layer, head, seq, x, mask, context)
            real = reference["real_queries"]
            torch.testing.assert_close(mean[seq, head][real], reference["mean"], rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(covar[seq, head][real][:, real], reference["covar"], rtol=1e-8, atol=1e-10)
            if not real.all():  # padded queries are decoupled from the real ones
                assert covar[seq, head][~real][:, real].abs().max() == 0
    torch.testing.assert_close(covar, covar.mT, rtol=0, atol=1e-12)
    # PSD: the nugget bounds the spectrum from below (K_qq - K_qk K_kk^-1 K_kq >= Sigma_q >= eps a^2 sigma_q^2)
    floor = layer.jitter * (layer.outputscale * layer.query_variance_ratio)[:, None]
    assert (torch.linalg.eigvalsh(covar).min(-1).values >= floor * (1 - 1e-4)).all()


def test_conditional_covariance_at_queries_on_the_latent_inputs_is_the_excess_variance():
    # q = x_0: Sigma_q = sigma_q^2 kappa(q, q) - kappa(q, q) = (sigma_q^2 - 1) kappa(q, q), PSD if and only if
    # sigma_q^2 >= 1, the reason for the constraint
    layer = make_layer(jitter=0.0)
    with torch.no_grad():
        layer.latent_proj.weight.copy_(layer.query_proj.weight)
        layer.query_variance_ratio = 1.0 + 1e-3
    x, _, _ = make_inputs("none")
    reference = dense_head(layer, 0, 0, x, None, None)
    queries = x[0] @ layer.query_proj.weight[:WIDTH].T
    excess = 1e-3 * layer.outputscale[0] * rbf(queries, queries)
    torch.testing.assert_close(reference["query_conditional"], excess, rtol=1e-6, atol=1e-9)
    assert torch.linalg.eigvalsh(reference["query_conditional"]).min() > 0


def test_kernel_is_asymmetric():
    layer = make_layer()
    x, _, _ = make_inputs("none")
    reference = dense_head(layer, 0, 0, x, None, None)
    latent_inv = torch.linalg.inv(reference["latent_covar"])
    queries = x[0] @ layer.query_proj.weight[:WIDTH].T
    keys = x[0] @ layer.key_proj.weight[:WIDTH].T
    latents = x[0] @ layer.latent_proj.weight[:WIDTH].T
    query_key = rbf(queries, latents) @ latent_inv @ rbf(latents, keys)
    assert (query_key - query_key.T).abs().max() > 1e-2


# -- sampling ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["none", "padding"])
def test_samples_have_the_predictive_mean_and_joint_covariance(setting):
    layer = make_layer().eval()
    with torch.no_grad():  # identity output map: the outputs are the concatenated heads
        layer.out_proj.weight.copy_(torch.eye(EMBED, dtype=DTYPE))
        layer.out_proj.bias.zero_()
    x, mask, _ = make_inputs(setting, batch=1)
    draws = 4000
    torch.manual_seed(3)
    with torch.no_grad(), sample_attention(layer):
        samples = layer(x.expand(draws, -1, -1), mask=None if mask is None else mask.expand(draws, -1))
    for head in range(HEADS):
        reference = dense_head(layer, head, 0, x, mask, None)
        real = reference["real_queries"]
        # value dimensions are independent draws with the same covariance: draws * WIDTH vectors over the tokens
        residuals = (samples[:, real, head * WIDTH : (head + 1) * WIDTH] - reference["mean"]).permute(0, 2, 1)
        residuals = residuals.reshape(-1, int(real.sum()))
        count = residuals.shape[0]
        covar = reference["covar"]
        variance = covar.diagonal()
        # mean: z = (mean - mu) / sqrt(var / n); covariance (known mean): Var(C_hat_ij) = (C_ii C_jj + C_ij^2) / n
        mean_z = residuals.mean(0) / (variance / count).sqrt()
        empirical = residuals.T @ residuals / count
        covar_z = (empirical - covar) / ((variance[:, None] * variance[None, :] + covar.square()) / count).sqrt()
        assert mean_z.abs().max() < 5 and covar_z.abs().max() < 5, (mean_z.abs().max(), covar_z.abs().max())
        # not vacuous: the tokens are correlated, which independent per-token noise would miss
        correlation = covar / (variance[:, None] * variance[None, :]).sqrt()
        assert (correlation - torch.eye(len(covar), dtype=DTYPE)).abs().max() > 0.1  # 0.1 = 12 standard errors


def test_training_mode_samples_and_eval_mode_is_the_mean():
    layer = make_layer()
    x, mask, _ = make_inputs("padding")
    torch.manual_seed(0)
    first = layer.train()(x, mask=mask)
    second = layer(x, mask=mask)
    assert (first - second).abs().max() > 1e-3
    torch.testing.assert_close(layer.eval()(x, mask=mask), layer.posterior(x, mask=mask)[0], rtol=0, atol=0)


# -- the CGP regulariser ---------------------------------------------------------------------------------------------
def test_the_regulariser_is_off_by_default():
    layer = CGPTAttention(EMBED, HEADS).train()
    layer(make_inputs("none")[0].float())
    assert layer.cgp_weight == 0 and list(layer.added_loss_terms()) == []


@pytest.mark.parametrize("setting", SETTINGS)
def test_objective_matches_the_dense_closed_form(setting):
    layer = make_layer(cgp_weight=0.7).train()
    x, mask, context = make_inputs(setting)
    layer(x, mask=mask, context=context)
    (term,) = list(layer.added_loss_terms())
    assert isinstance(term, CGPAddedLossTerm) and term.objective.shape == (2,)
    expected = torch.stack(
        [
            sum(dense_objective(dense_head(layer, head, seq, x, mask, context)) for head in range(HEADS))
            for seq in range(x.shape[0])
        ]
    )
    torch.testing.assert_close(term.objective, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(term.loss(), 0.7 * expected.mean(), rtol=1e-9, atol=1e-9)


def test_objective_is_the_expectation_over_the_latent_gp():
    # Monte Carlo over z_0 ~ N(0, K_00) of -[log N(z_q | A_q z_0, Sigma_q) + log N(z_k | A_k z_0, Sigma_k)] (the
    # official code's one-draw estimator) agrees with the closed form within its standard error
    layer = make_layer()
    x, _, _ = make_inputs("none")
    reference = dense_head(layer, 0, 0, x, None, None)
    draws = 20000
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(draws, len(reference["latent_covar"]), WIDTH, generator=generator, dtype=DTYPE)
    latent = torch.linalg.cholesky(reference["latent_covar"]) @ noise  # (draws, M, WIDTH)
    estimates = torch.zeros(draws, dtype=DTYPE)
    for side, observed in (("query", reference["mean"]), ("key", reference["observed_keys"])):
        conditional = MultivariateNormal(torch.zeros(len(observed), dtype=DTYPE), reference[f"{side}_conditional"])
        residual = observed - reference[f"{side}_interp"] @ latent  # (draws, n, WIDTH)
        estimates -= conditional.log_prob(residual.mT).sum(-1)
    standard_error = estimates.std() / math.sqrt(draws)
    assert (estimates.mean() - dense_objective(reference)).abs() < 5 * standard_error


def test_objective_reaches_every_parameter_and_the_elbo_adds_it():
    layer = make_layer(cgp_weight=0.5).train()
    x, mask, _ = make_inputs("padding")
    layer(x, mask=mask)
    (term,) = list(layer.added_loss_terms())
    term.loss().backward()
    for name, parameter in layer.named_parameters():
        if name.startswith(("out_proj", "value_proj")) and name != "value_proj.weight":
            continue
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    model = torch.nn.Sequential(layer)
    model.kl_divergence = layer.kl_divergence
    parts = AttentionELBO(model, num_data=10, combine_terms=False)(torch.zeros(2, 3, dtype=DTYPE), torch.tensor([0, 1]))
    assert parts["kl"] == 0
    torch.testing.assert_close(parts["ksvd"], term.loss())  # the sum of the added loss terms


def test_an_eval_forward_clears_the_objective_and_posterior_keeps_it():
    """An eval-mode call computes no objective: its loss has no CGP term (the last training call's, on that call's
    graph, made an eval-mode ELBO's backward fail), as the KSVD layers; ``posterior()`` leaves the training term."""
    layer = make_layer(cgp_weight=1.0).train()
    x, mask, _ = make_inputs("padding")
    layer(x, mask=mask)
    (term,) = list(layer.added_loss_terms())
    layer.posterior(2 * x, mask=mask)
    assert list(layer.added_loss_terms()) == [term]
    layer.eval()(2 * x, mask=mask)
    assert list(layer.added_loss_terms()) == []
    layer.train()(x, mask=mask)
    with sample_attention(layer.eval()):
        layer(2 * x, mask=mask)
    assert list(layer.added_loss_terms()) == []


# -- masks -------------------------------------------------------------------------------------------------------------
def test_padding_equals_the_truncated_sequence():
    layer = make_layer(cgp_weight=1.0)
    x, mask, _ = make_inputs("padding")
    short = x[:1, :3]
    for getter in (lambda *a, **k: layer.eval()(*a, **k), lambda *a, **k: layer.posterior(*a, **k)[1]):
        torch.testing.assert_close(getter(x, mask=mask)[0, :3], getter(short)[0], rtol=1e-10, atol=1e-12)
    layer.train()
    layer(x, mask=mask)
    padded_objective = next(iter(layer.added_loss_terms())).objective[0]
    layer(short)
    torch.testing.assert_close(padded_objective, next(iter(layer.added_loss_terms())).objective[0], rtol=1e-10, atol=0)


def test_padded_tokens_change_nothing_real_in_training():
    layer = make_layer(cgp_weight=1.0).train()
    x, mask, _ = make_inputs("padding")
    changed = torch.where(mask[..., None], x, 7.0 * torch.randn_like(x))
    results = []
    for tokens in (x, changed):
        torch.manual_seed(11)  # the same noise
        output = layer(tokens, mask=mask)
        results.append((output[mask], next(iter(layer.added_loss_terms())).objective))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-10)


# -- parameters and errors ---------------------------------------------------------------------------------------------
def test_scales_are_constrained():
    layer = CGPTAttention(EMBED, HEADS)
    torch.testing.assert_close(layer.outputscale, torch.full((HEADS,), 0.1))
    torch.testing.assert_close(layer.query_variance_ratio, torch.full((HEADS,), 2.0))
    with torch.no_grad():
        layer.raw_query_variance_ratio.fill_(-40.0)
        layer.raw_outputscale.fill_(-40.0)
    assert (layer.query_variance_ratio >= 1).all() and (layer.outputscale > 0).all()
    layer.key_variance_ratio = torch.tensor([1.5, 4.0])
    layer.outputscale = 0.25
    torch.testing.assert_close(layer.key_variance_ratio, torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(layer.outputscale, torch.full((HEADS,), 0.25))
    with pytest.raises(ValueError, match="key_variance_ratio > 1"):
        layer.key_variance_ratio = 0.9
    with pytest.raises(ValueError, match="query_variance_ratio"):
        layer.query_variance_ratio = -1.0
    with pytest.raises(ValueError, match="outputscale"):
        layer.outputscale = 0.0


@pytest.mark.parametrize("name", ["outputscale", "query_variance_ratio", "key_variance_ratio"])
def test_a_scale_of_the_wrong_shape_is_a_named_error_and_leaves_the_layer_alone(name: str):
    """Three values for two heads raised torch's "shape '[2]' is invalid for input of size 3" (a RuntimeError)."""
    layer = CGPTAttention(EMBED, HEADS)
    before = getattr(layer, name).detach().clone()
    with pytest.raises(ValueError, match=rf"expected {name} to be a number or a tensor that expands to shape \(2,\)"):
        setattr(layer, name, torch.full((HEADS + 1,), 3.0))
    torch.testing.assert_close(getattr(layer, name), before, rtol=0, atol=0)
    setattr(layer, name, [2.5, 4.0])  # one value per head, as a list
    torch.testing.assert_close(getattr(layer, name), torch.tensor([2.5, 4.0]))


def test_bad_arguments_and_unsupported_masks_raise():
    with pytest.raises(ValueError, match="jitter"):
        CGPTAttention(EMBED, HEADS, jitter=-1e-3)
    with pytest.raises(ValueError, match="cgp_weight"):
        CGPTAttention(EMBED, HEADS, cgp_weight=-1.0)
    with pytest.raises(ValueError, match="causal"):
        make_layer()(make_inputs("none")[0], mask="causal")
    with pytest.raises(ValueError, match="objective"):
        CGPAddedLossTerm(torch.zeros(2, 3), 1.0)


def test_a_failed_factorisation_names_the_matrix_and_the_jitter():
    # identical tokens give a rank-one K_00: without a nugget its Cholesky factorisation fails (no silent retry)
    layer = make_layer(jitter=0.0).eval()
    x = torch.ones(2, 4, EMBED, dtype=DTYPE)
    with pytest.raises(NotPSDError, match=r"K_00 .*jitter=0 in torch.float64"):
        layer(x)
    layer.jitter = 1e-6
    assert torch.isfinite(layer(x)).all()


# -- numerics: offsets, the range of the dtype, half precision -------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "magnitude", "rtol"),
    [
        (torch.float32, 1e3, 1e-4),  # the plain expansion: K_00 not positive definite
        (torch.float32, 1e6, 1e-4),
        (torch.float64, 1e6, 1e-9),
        (torch.float64, 1e12, 1e-9),
    ],
)
@pytest.mark.parametrize("setting", SETTINGS)
def test_exact_at_large_offsets(dtype, magnitude, rtol, setting):
    """Mean and predictive covariance of tokens at a constant offset, against the dense float64 formulas on the same
    tokens. The projections differ by about 1 / offset, so that the queries and keys stay O(1) away from the latent
    inputs (with unrelated projections an offset moves them apart and every cross-covariance is 0)."""
    layer = make_layer()
    with torch.no_grad():
        for projection, seed in ((layer.key_proj, 2), (layer.latent_proj, 3)):
            noise = torch.randn(EMBED, EMBED, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)
            projection.weight.copy_(layer.query_proj.weight + 0.5 * noise / magnitude)
    layer = layer.to(dtype)
    x, mask, context = make_inputs(setting)
    offset = torch.full((EMBED,), magnitude, dtype=DTYPE)
    tokens = (x + offset).to(dtype)
    context_tokens = None if context is None else (context + offset).to(dtype)
    mean, covar = layer.head_covariance(tokens, mask=mask, context=context_tokens)
    reference = make_layer().requires_grad_(False)
    reference.load_state_dict(layer.state_dict())  # the stored (rounded) parameters, in float64
    exact_tokens, exact_context = tokens.double(), None if context is None else context_tokens.double()
    dense = [
        [dense_head(reference, head, seq, exact_tokens, mask, exact_context, origin=offset) for head in range(HEADS)]
        for seq in range(x.shape[0])
    ]
    scale = max(float(head["mean"].abs().max()) for heads in dense for head in heads)
    assert scale > 0.1  # the cross-covariances are not all 0
    for seq, heads in enumerate(dense):
        for head, reference_head in enumerate(heads):
            real = reference_head["real_queries"]
            torch.testing.assert_close(
                mean[seq, head][real].double(), reference_head["mean"], rtol=rtol, atol=rtol * scale
            )
            torch.testing.assert_close(
                covar[seq, head][real][:, real].double(), reference_head["covar"], rtol=rtol, atol=rtol
            )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layer_computes_the_gps_in_float32(dtype):
    """A .half() / .bfloat16() layer (before: torch's "cholesky_cpu not implemented for 'Half'") projects in its
    precision and runs the GPs in float32: its mean equals, to the half precision's rounding, that of the float32
    layer with the same (rounded) parameters, and training reaches every parameter."""
    layer = make_layer().to(dtype).eval()
    x, mask, _ = make_inputs("padding")
    tokens = x.to(dtype)
    output = layer(tokens, mask=mask)
    reference = make_layer().float().eval().requires_grad_(False)
    reference.load_state_dict(layer.state_dict())
    expected = reference(tokens.float(), mask=mask)
    assert output.dtype == dtype
    tolerance = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(output.float(), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    layer.cgp_weight = 0.1
    layer.train()
    output = layer(tokens, mask=mask)
    assert output.dtype == dtype and layer.added_loss_terms is not None
    (output.float().sum() + sum(term.loss() for term in layer.added_loss_terms())).backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad.dtype == dtype and torch.isfinite(parameter.grad).all(), name
