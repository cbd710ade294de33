"""SGPA attention against a dense, loop-based re-implementation of docs/math.md section 5 (float64), plus masks,
sampling moments and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from gpattn.attention._base import sample_attention
from gpattn.attention.sgpa_attention import SGPAAttention

DTYPE = torch.float64
EMBED, HEADS, GLOBAL = 8, 2, 3
SETTINGS = ("none", "padding", "causal", "cross")


def make_layer(kernel: str = "ard", seed: int = 0, **kwargs) -> SGPAAttention:
    torch.manual_seed(seed)
    layer = SGPAAttention(EMBED, HEADS, kwargs.pop("num_inducing", GLOBAL), kernel=kernel, **kwargs).to(DTYPE)
    with torch.no_grad():  # move the variational parameters and hyperparameters away from their initial values
        layer.inducing_values.normal_()
        layer.chol_variational_covar.normal_(std=0.3)
        layer.lengthscale = layer.lengthscale * (0.8 + 0.4 * torch.rand_like(layer.lengthscale))
        layer.outputscale = torch.tensor([0.7, 1.3], dtype=DTYPE)
    return layer


def make_inputs(setting: str, seed: int = 1, batch: int = 2, length: int = 5, context_length: int = 7):
    """``(x, mask, context)`` for a setting; padding masks hide the tail of the first sequence."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, EMBED, generator=generator, dtype=DTYPE)
    if setting == "none":
        return x, None, None
    if setting == "causal":
        return x, "causal", None
    keys_length = context_length if setting == "cross" else length
    mask = torch.ones(batch, keys_length, dtype=torch.bool)
    mask[0, -2:] = False
    context = (
        torch.randn(batch, context_length, EMBED, generator=generator, dtype=DTYPE) if setting == "cross" else None
    )
    return x, mask, context


# -- dense reference -------------------------------------------------------------------------------------------------
def dense_kernel(layer: SGPAAttention, head: int, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    lengthscale, outputscale = layer.lengthscale[head], layer.outputscale[head]
    left, right = left / lengthscale, right / lengthscale
    if layer.kernel_type == "ard":
        return outputscale * torch.exp(-0.5 * (left[:, None, :] - right[None, :, :]).square().sum(-1))
    return outputscale * torch.exp(left @ right.T)


def dense_head(layer: SGPAAttention, head: int, seq: int, x, mask, context, origin=None):
    """Mean ``(N, p)``, variance ``(N,)`` and the data KL term of one head and sequence, built token by token.

    ``origin`` (ARD only): a point o subtracted from the tokens before the projection and, projected, from the global
    keys, which leaves every ARD kernel value unchanged in exact arithmetic (||W (x - o) - (k_b - W o)|| =
    ||W x - k_b||), so that tokens at a large offset o + z are handled at the scale of z (the differences x - o of
    float64 tokens and a float64 o are exact)."""
    width = layer.head_dim
    rows = slice(head * width, (head + 1) * width)
    key_weight, value_weight = layer.key_proj.weight[rows], layer.value_proj.weight[rows]
    source = x if context is None else context
    origin = torch.zeros(x.shape[-1], dtype=DTYPE) if origin is None else origin
    queries, keys = (x[seq] - origin) @ key_weight.T, (source[seq] - origin) @ key_weight.T
    values = source[seq] @ value_weight.T
    induc_keys, induc_values = layer.inducing_keys[head] - origin @ key_weight.T, layer.inducing_values[head]

    def kern(left, right):
        return dense_kernel(layer, head, left, right)

    induc_induc = kern(induc_keys, induc_keys)
    induc_induc = induc_induc + layer.jitter * induc_induc.diagonal().mean() * torch.eye(len(induc_keys), dtype=DTYPE)
    chol = torch.linalg.cholesky(induc_induc)  # L_bb defines the whitening
    covar_root = layer.variational_covar_root[head]
    variational_covar = covar_root @ covar_root.T  # S

    real = torch.ones(len(keys), dtype=torch.bool) if not isinstance(mask, torch.Tensor) else mask[seq]
    means, variances = [], []
    for i, query in enumerate(queries):
        visible = real.clone()
        if mask == "causal":
            visible[i + 1 :] = False
        keys_i, values_i = keys[visible], values[visible]
        query_induc = kern(query[None], induc_keys)  # shape: (1, M_g)
        mean = kern(query[None], keys_i) @ values_i
        mean = mean - query_induc @ torch.linalg.solve(induc_induc, kern(induc_keys, keys_i) @ values_i)
        mean = mean + query_induc @ induc_values
        interp = torch.linalg.solve(chol, query_induc.T)  # L^{-1} K_bq
        variance = (
            kern(query[None], query[None])
            - query_induc @ torch.linalg.solve(induc_induc, query_induc.T)
            + interp.T @ variational_covar @ interp
        )
        means.append(mean[0])
        variances.append(variance.reshape(()))
    keys_g, values_g = (keys, values) if mask == "causal" else (keys[real], values[real])  # causal: the full sequence
    residual = kern(keys_g, keys_g) - kern(keys_g, induc_keys) @ torch.linalg.solve(
        induc_induc, kern(induc_keys, keys_g)
    )
    data_term = 0.5 * torch.einsum("nd,nm,md->", values_g, residual, values_g)
    return torch.stack(means), torch.stack(variances), data_term


def dense_global_kl(layer: SGPAAttention) -> torch.Tensor:
    total = torch.zeros((), dtype=DTYPE)
    for head in range(HEADS):
        induc_keys = layer.inducing_keys[head]
        induc_induc = dense_kernel(layer, head, induc_keys, induc_keys)
        induc_induc = induc_induc + layer.jitter * induc_induc.diagonal().mean() * torch.eye(
            len(induc_keys), dtype=DTYPE
        )
        covar_root = layer.variational_covar_root[head]
        variational_covar = covar_root @ covar_root.T
        per_dim = variational_covar.trace() - len(induc_keys) - torch.logdet(variational_covar)
        induc_values = layer.inducing_values[head]
        total = total + 0.5 * (
            layer.head_dim * per_dim + torch.einsum("md,mn,nd->", induc_values, induc_induc, induc_values)
        )
    return total


# -- tests -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_inducing": 0},
        {"num_inducing": 2.0},
        {"kernel": "rbf"},
        {"jitter": -1e-6},
        {"embed_dim": 6, "num_heads": 4},
        {"dropout": 1.0},
    ],
)
def test_constructor_validation(kwargs):
    arguments = {"embed_dim": EMBED, "num_heads": HEADS, **kwargs}
    with pytest.raises(ValueError, match="expected|divisible"):
        SGPAAttention(**arguments)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_matches_dense_reference(kernel, setting):
    layer = make_layer(kernel)
    x, mask, context = make_inputs(setting)
    mean, variance = layer.head_moments(x, mask, context)
    layer.eval()
    layer(x, mask=mask, context=context)
    data_kl = torch.zeros(x.shape[0], dtype=DTYPE)
    for seq in range(x.shape[0]):
        real_queries = mask[seq] if isinstance(mask, torch.Tensor) and context is None else slice(None)
        for head in range(HEADS):
            dense_mean, dense_variance, data_term = dense_head(layer, head, seq, x, mask, context)
            torch.testing.assert_close(mean[seq, head][real_queries], dense_mean[real_queries], rtol=1e-9, atol=1e-9)
            expected_variance = dense_variance.clamp_min(0)[real_queries, None].expand(-1, layer.head_dim)
            torch.testing.assert_close(variance[seq, head][real_queries], expected_variance, rtol=1e-9, atol=1e-9)
            data_kl[seq] = data_kl[seq] + data_term
    # the global q(u) part, and the v_g part of every sequence (the added loss term "sequence_kl")
    torch.testing.assert_close(layer.kl_divergence(), dense_global_kl(layer), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(layer.sequence_kl(), data_kl, rtol=1e-9, atol=1e-9)
    term = dict(layer.named_added_loss_terms())["sequence_kl"]
    torch.testing.assert_close(term.loss(), data_kl.mean(), rtol=1e-9, atol=1e-9)
    assert layer.kl_divergence() >= 0 and (layer.sequence_kl() >= 0).all()


def total_kl(layer: SGPAAttention) -> torch.Tensor:
    """The global KL plus the batch mean of the per-sequence v_g terms of the last forward."""
    per_sequence = layer.sequence_kl()
    return layer.kl_divergence() + (0.0 if per_sequence is None else per_sequence.mean())


def test_kl_divergence_is_the_global_part_and_the_sequence_part_is_a_term():
    layer = make_layer()
    torch.testing.assert_close(layer.kl_divergence(), dense_global_kl(layer), rtol=1e-10, atol=1e-10)
    assert layer.sequence_kl() is None
    x, _, _ = make_inputs("none")
    layer(x)
    torch.testing.assert_close(layer.kl_divergence(), dense_global_kl(layer), rtol=1e-10, atol=1e-10)
    assert layer.sequence_kl().shape == (x.shape[0],) and (layer.sequence_kl() > 0).all()
    copy.deepcopy(layer)  # the term hangs on the graph; copies detach it


@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_kl_nonnegative_and_zero_at_prior(kernel):
    layer = make_layer(kernel)
    x, mask, _ = make_inputs("padding")
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            layer.chol_variational_covar.normal_(std=0.5)
            layer.inducing_values.normal_()
        layer(x, mask=mask)
        assert total_kl(layer) >= 0
    with torch.no_grad():  # q(u) = p(u): S = I, v_b = 0; the v_g term vanishes with zero values
        layer.chol_variational_covar.zero_()
        layer.inducing_values.zero_()
        layer.value_proj.weight.zero_()
    layer(x, mask=mask)
    assert abs(total_kl(layer).item()) < 1e-12


@pytest.mark.parametrize("kernel", ["ard", "exponential"])
@pytest.mark.parametrize("setting", ["padding", "cross"])
def test_padding_mask_invariance(kernel, setting):
    layer = make_layer(kernel).eval()
    x, mask, context = make_inputs(setting)
    output = layer(x, mask=mask, context=context)
    kl = layer.sequence_kl()
    perturbed = (x if context is None else context).clone()
    perturbed[~mask] = 10 * torch.randn_like(perturbed[~mask])
    if context is None:
        output_perturbed = layer(perturbed, mask=mask)
        real = mask
    else:
        output_perturbed = layer(x, mask=mask, context=perturbed)
        real = torch.ones(x.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(output_perturbed[real], output[real], rtol=0, atol=1e-10)
    torch.testing.assert_close(layer.sequence_kl(), kl, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_causal_invariance(kernel):
    layer = make_layer(kernel).eval()
    x, mask, _ = make_inputs("causal", length=6)
    output = layer(x, mask=mask)
    _, variance = layer.posterior(x, mask=mask)
    for position in range(x.shape[1] - 1):
        perturbed = x.clone()
        perturbed[:, position + 1 :] = torch.randn_like(perturbed[:, position + 1 :])
        torch.testing.assert_close(layer(perturbed, mask=mask)[:, : position + 1], output[:, : position + 1])
        _, variance_perturbed = layer.posterior(perturbed, mask=mask)
        torch.testing.assert_close(variance_perturbed[:, : position + 1], variance[:, : position + 1])


def test_cross_attention_shapes():
    layer = make_layer()
    x, mask, context = make_inputs("cross", length=4, context_length=9)
    assert layer(x, context=context).shape == x.shape
    assert layer(x, mask=mask, context=context).shape == x.shape
    mean, variance = layer.posterior(x, mask=mask, context=context)
    assert mean.shape == variance.shape == x.shape
    with pytest.raises(ValueError, match="causal"):
        layer(x, mask="causal", context=context)


@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_sampling_moments_match_posterior(kernel):
    layer = make_layer(kernel).eval()
    x, _, _ = make_inputs("none", batch=1)
    with torch.no_grad():
        mean, variance = layer.posterior(x)
        torch.testing.assert_close(mean, layer(x))
    samples = 20000
    torch.manual_seed(3)
    with torch.no_grad(), sample_attention(layer):
        draws = layer(x.expand(samples, -1, -1))
    torch.testing.assert_close(
        draws.mean(0, keepdim=True), mean, rtol=0, atol=5 * (variance.max().item() / samples) ** 0.5
    )
    relative = (draws.var(0, keepdim=True) - variance).abs() / variance
    assert relative.max() < 5 * (2 / samples) ** 0.5
    assert not layer.sampling and torch.equal(layer(x).detach(), mean)


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_parameter_gets_a_gradient(setting):
    layer = make_layer("ard").train()
    x, mask, context = make_inputs(setting)
    (layer(x, mask=mask, context=context).sum() + total_kl(layer)).backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_gradcheck(kernel, setting):
    torch.manual_seed(0)
    layer = SGPAAttention(4, 2, num_inducing=2, kernel=kernel).double().eval()
    x, mask, context = make_inputs(setting, batch=1, length=3, context_length=4)
    x, context = x[..., :4].clone(), None if context is None else context[..., :4].clone()
    mask = mask[:1] if isinstance(mask, torch.Tensor) else mask
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda tokens: layer(tokens, mask=mask, context=context), (x,))


def test_default_dtype_then_double_and_deepcopy():
    torch.manual_seed(0)
    layer = SGPAAttention(EMBED, HEADS, GLOBAL, dropout=0.1)
    x = torch.randn(2, 5, EMBED)
    output = layer(x)
    assert output.dtype == torch.float32 and layer.kl_divergence().dtype == torch.float32
    copy.deepcopy(layer)  # the stored KL hangs on the graph of the last forward
    layer.double()
    assert layer(x.double()).dtype == DTYPE and layer.kl_divergence().dtype == DTYPE
    assert SGPAAttention.is_stochastic


class _Classifier(torch.nn.Module):
    """A linear head on the mean of one SGPA layer's output, with the layer's KL (for AttentionELBO)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.head = torch.nn.Linear(EMBED, 3).to(DTYPE)

    def forward(self, x, mask=None):
        return self.head(self.layer(x, mask=mask).mean(1))

    def kl_divergence(self):
        return self.layer.kl_divergence()


def test_sgpa_loss_weights_each_sequence_kl_once_and_the_global_kl_by_one_over_n():
    """The SGPA objective (Chen & Li 2023; the official code's loss with its global part divided by n):
    mean_b CE_b + beta / n KL_global + beta mean_b KL_vg,b, against the dense per-head transcription."""
    from gpattn.mlls import AttentionELBO

    layer = make_layer().eval()
    model = _Classifier(layer)
    x, mask, _ = make_inputs("padding")
    targets = torch.tensor([0, 2])
    beta, num_data = 0.8, 500
    parts = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(model(x, mask), targets)
    data_kl = torch.zeros(x.shape[0], dtype=DTYPE)
    for seq in range(x.shape[0]):
        for head in range(HEADS):
            data_kl[seq] += dense_head(layer, head, seq, x, mask, None)[2]
    expected_kl = beta / num_data * dense_global_kl(layer) + beta * data_kl.mean()
    torch.testing.assert_close(parts["kl"], expected_kl, rtol=1e-10, atol=1e-10)
    nll = torch.nn.functional.cross_entropy(model(x, mask), targets)
    torch.testing.assert_close(parts["loss"], nll + expected_kl, rtol=1e-10, atol=1e-10)
    assert parts["ksvd"] == 0
    # the per-sequence part is not divided by n: it dominates the global part at initialisation-like scales
    assert beta * data_kl.mean() > beta / num_data * dense_global_kl(layer)


def test_official_kl_weighting_adds_the_whole_kl_to_every_sequence():
    """``kl_weighting="official"``: the official code's loss mean_b CE_b + beta (KL_global + mean_b KL_vg,b), the
    global part at weight beta rather than beta / n, against the dense per-head transcription."""
    from gpattn.mlls import AttentionELBO

    layer = make_layer(kl_weighting="official").eval()
    model = _Classifier(layer)
    x, mask, _ = make_inputs("padding")
    targets = torch.tensor([0, 2])
    beta, num_data = 0.8, 500
    parts = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(model(x, mask), targets)
    data_kl = torch.zeros(x.shape[0], dtype=DTYPE)
    for seq in range(x.shape[0]):
        for head in range(HEADS):
            data_kl[seq] += dense_head(layer, head, seq, x, mask, None)[2]
    global_kl = dense_global_kl(layer)
    expected_kl = beta * global_kl + beta * data_kl.mean()  # no 1 / n anywhere
    torch.testing.assert_close(parts["kl"], expected_kl, rtol=1e-10, atol=1e-10)
    nll = torch.nn.functional.cross_entropy(model(x, mask), targets)
    torch.testing.assert_close(parts["loss"], nll + expected_kl, rtol=1e-10, atol=1e-10)
    # the split: nothing global left to divide by n, the whole KL in every sequence's term
    assert layer.kl_divergence() == 0
    torch.testing.assert_close(layer.sequence_kl(), global_kl + data_kl, rtol=1e-10, atol=1e-10)


def test_elbo_kl_weighting_is_the_default_and_changes_nothing():
    x, mask, _ = make_inputs("padding")
    default, explicit = make_layer(), make_layer(kl_weighting="elbo")
    assert default.kl_weighting == "elbo"
    torch.manual_seed(5)
    output = default(x, mask=mask)
    torch.manual_seed(5)
    assert torch.equal(explicit(x, mask=mask), output)
    assert torch.equal(explicit.sequence_kl(), default.sequence_kl())
    assert torch.equal(explicit.kl_divergence(), default.kl_divergence())
    with pytest.raises(ValueError, match=r"kl_weighting to be one of \['elbo', 'official'\]"):
        make_layer(kl_weighting="paper")


# -- numerics: offsets, scales, the range of the dtype, half precision ------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "magnitude", "rtol"),
    [
        (torch.float32, 1e3, 1e-4),  # the plain expansion: 1e-2 relative error
        (torch.float32, 1e6, 1e-4),  # 0.3
        (torch.float64, 1e6, 1e-9),  # 2e-5
        (torch.float64, 1e12, 1e-9),  # 0.3
    ],
)
@pytest.mark.parametrize("setting", SETTINGS)
def test_ard_kernel_is_exact_at_large_offsets(dtype, magnitude, rtol, setting):
    """Mean, variance and per-sequence KL of tokens at a constant offset in ``dtype``, against the dense float64
    reference on the same tokens (handled at the scale of the data by ``origin``)."""
    layer = make_layer().to(dtype).eval()
    x, mask, context = make_inputs(setting)
    offset = torch.full((EMBED,), magnitude, dtype=DTYPE)
    tokens = (x + offset).to(dtype)
    context_tokens = None if context is None else (context + offset).to(dtype)
    mean, variance = layer.head_moments(tokens, mask, context_tokens)
    layer(tokens, mask=mask, context=context_tokens)
    reference = copy.deepcopy(layer).double().requires_grad_(False)
    exact_tokens, exact_context = tokens.double(), None if context is None else context_tokens.double()
    for seq in range(x.shape[0]):
        real_queries = mask[seq] if isinstance(mask, torch.Tensor) and context is None else slice(None)
        data_kl = 0.0
        for head in range(HEADS):
            dense_mean, dense_variance, data_term = dense_head(
                reference, head, seq, exact_tokens, mask, exact_context, origin=offset
            )
            dense_mean = dense_mean[real_queries]
            scale = float(dense_mean.abs().max())
            torch.testing.assert_close(mean[seq, head][real_queries].double(), dense_mean, rtol=rtol, atol=rtol * scale)
            expected_variance = dense_variance.clamp_min(0)[real_queries]
            torch.testing.assert_close(
                variance[seq, head][real_queries, 0].double(), expected_variance, rtol=rtol, atol=rtol
            )
            data_kl = data_kl + data_term
        torch.testing.assert_close(layer.sequence_kl()[seq].double(), data_kl, rtol=rtol, atol=0)


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 1e20), (torch.float64, 1e160)])
@pytest.mark.parametrize("kind", ["offset", "scale"])
def test_tokens_beyond_the_range_of_the_dtype_raise(dtype, magnitude, kind):
    """Beyond sqrt(finfo.max) / 1e3 the values' quadratic form in the KL overflows (before: a NaN output)."""
    layer = make_layer().to(dtype)
    x, _, _ = make_inputs("none")
    tokens = (x + magnitude if kind == "offset" else x * magnitude).to(dtype)
    with pytest.raises(
        ValueError,
        match=rf"SGPAAttention \(kernel='ard'\): the input tokens reach \|x\| = .*, too large "
        rf"for {dtype}: .*rescale the inputs \(e.g. a LayerNorm before the layer\)",
    ):
        layer(tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exponential_kernel_refuses_saturated_logits(dtype):
    """At the clamp of its logits (safe_max_logit) the exponential kernel is constant: K_bb has rank one and the KL
    loses its sign (before: a finite output of 1e303 and a KL of -3e307 in float64, NaN in float32)."""
    layer = make_layer("exponential").to(dtype)
    x, _, _ = make_inputs("none")
    layer(x.to(dtype))  # unit-scale tokens are far from the clamp
    with pytest.raises(
        ValueError, match=r"kernel='exponential'\): the kernel's logits .* beyond the clamp .*saturates"
    ):
        layer((x + 1e3).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["ard", "exponential"])
def test_half_precision_layer_computes_the_gp_in_float32(dtype, kernel):
    """A .half() / .bfloat16() layer (before: torch's "cholesky_cpu not implemented for 'Half'") projects in its
    precision and runs the GP in float32: its output equals, to the half precision's rounding, that of the float32
    layer with the same (rounded) parameters."""
    layer = make_layer(kernel).to(dtype).eval()
    x, mask, _ = make_inputs("padding")
    tokens = x.to(dtype)
    output = layer(tokens, mask=mask)
    reference = copy.deepcopy(layer).float()(tokens.float(), mask=mask).detach()
    assert output.dtype == dtype and layer.sequence_kl().dtype == torch.float32
    tolerance = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(output.float(), reference, rtol=tolerance, atol=tolerance * float(reference.abs().max()))
    layer.train()
    (layer(tokens, mask=mask).float().sum() + layer.kl_divergence() + layer.sequence_kl().mean()).backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad.dtype == dtype and torch.isfinite(parameter.grad).all(), name


def test_ard_kernel_is_exact_at_a_large_scale():
    """Tokens 1e10 lengthscales apart (float64): K_qg is s_f^2 I, so the mean is each token's own value times s_f^2
    (and K_qb = 0). The plain expansion's diagonal distances read about eps |q|^2 = 1e4 instead of 0, which made the
    diagonal exp(-5e3) = 0: relative error 0.4 to 0.9 for heads of width 8 and more."""
    torch.manual_seed(0)
    layer = SGPAAttention(32, 2, num_inducing=3).double().eval()
    x = 1e10 * torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    mean, variance = layer.head_moments(x)
    outputscale = layer.outputscale[None, :, None, None]  # K_qg = s_f^2 I
    torch.testing.assert_close(mean, outputscale * layer.split_heads(layer.value_proj(x)), rtol=1e-12, atol=0)
    torch.testing.assert_close(variance, outputscale.expand_as(variance), rtol=1e-12, atol=0)


def test_scales_of_a_shape_that_does_not_fit_are_refused_by_name():
    """The setters share the kernels' positive-parameter check: a value that expands to the parameter's shape (or has
    as many elements) is set, another shape is a ValueError naming the parameter (it was GPyTorch's RuntimeError)."""
    layer = SGPAAttention(8, 2, num_inducing=3)
    layer.outputscale = torch.tensor([0.5, 2.0])
    layer.lengthscale = 1.5
    torch.testing.assert_close(layer.outputscale.detach(), torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(layer.lengthscale.detach(), torch.full((2, 4), 1.5))
    with pytest.raises(ValueError, match=r"SGPAAttention: expected outputscale .* shape \(2,\), got shape \(3,\)"):
        layer.outputscale = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"SGPAAttention: expected lengthscale .* shape \(2, 4\), got shape \(3,\)"):
        layer.lengthscale = torch.ones(3)
