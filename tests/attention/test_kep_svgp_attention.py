"""KEP-SVGP attention against dense references written here (docs/math.md sections 3 and 6), float64.

The references use only the layer's parameters: the kernel's W_q, W_k and output scale, the amortised maps (or the
per-position token weights), the learned singular values (or a numpy SVD in exact mode), the variational means and
Cholesky factors, the per-head output maps and the output projection.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.attention import KEPSVGPAttention, sample_attention
from gpattn.kernels import CosineFeatureKernel
from gpattn.models import KernelEigenPairSVGP

DTYPE = torch.float64
ATOL = 1e-10
C, H, RANK, D_OUT = 8, 2, 3, 3  # head width C / H = 4 = feature dimension p


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _posteriors(layer: KEPSVGPAttention) -> list[tuple[Tensor, Tensor]]:
    """Views ``(m, raw L)`` into the strategy's stacked q(u) (batch (H, d_out, branches)): one per q(u) the layer holds
    (two branches; one when the posterior is shared or the kernel tied)."""
    q = layer.strategy._variational_distribution
    if layer.tie_qk:
        return [(q.variational_mean, q.chol_variational_covar)]
    branches = q.variational_mean.shape[-2]
    return [(q.variational_mean[..., i, :], q.chol_variational_covar[..., i, :, :]) for i in range(branches)]


def _branch_q(layer: KEPSVGPAttention, side: str) -> tuple[Tensor, Tensor]:
    """The mean (H, d_out, s) and Cholesky factor (H, d_out, s, s) of a branch's q(u)."""
    posteriors = _posteriors(layer)
    mean, chol = posteriors[1 if (side == "right" and len(posteriors) == 2) else 0]
    return mean, chol.tril()


def _branch_draw(layer: KEPSVGPAttention, draw: Tensor, side: str) -> Tensor:
    """A branch's part (..., H, d_out, s) of a draw of the strategy's q(u), (..., H, d_out[, branches], s)."""
    if layer.tie_qk:
        return draw
    return draw[..., 1 if (side == "right" and draw.shape[-2] == 2) else 0, :]


def _layer(seed: int = 0, num_outputs: int | None = D_OUT, **kwargs) -> KEPSVGPAttention:
    """A float64 layer with every parameter randomised, full (non-triangular) Cholesky parameters included: the
    variational distribution must use their lower triangle only."""
    torch.manual_seed(seed)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, num_outputs=num_outputs, **kwargs).double()
    features = layer.features
    with torch.no_grad():
        features.kernel.raw_outputscale.copy_(_randn(H, seed=seed + 1))
        for offset, name in enumerate(("left_bias", "right_bias")):
            if hasattr(features, name):
                getattr(features, name).copy_(0.3 * _randn(H, RANK, seed=seed + 2 + offset))
        if features.mode != "exact":
            features.raw_singular_values.copy_(_randn(H, RANK, seed=seed + 4))
        for offset, (mean, chol) in enumerate(_posteriors(layer)):
            mean.copy_(_randn(H, layer.num_outputs, RANK, seed=seed + 5 + offset))
            chol.copy_(
                torch.eye(RANK, dtype=DTYPE) + 0.4 * _randn(H, layer.num_outputs, RANK, RANK, seed=seed + 7 + offset)
            )
        layer.out_proj.bias.copy_(_randn(C, seed=seed + 9))
        if hasattr(layer, "token_weight"):
            layer.token_weight.add_(0.3 * _randn(*layer.token_weight.shape, seed=seed + 10))
    return layer


# -- dense references ------------------------------------------------------------------------------------------------
def _features(layer: KEPSVGPAttention, tokens: Tensor, side: str) -> Tensor:
    r""":math:`\phi(x) = \sqrt{\sigma_f} W x / \|W x\|` per head, shape ``(B, H, n, p)``."""
    kernel = layer.features.kernel
    weight = kernel.query_weight if side == "query" or layer.tie_qk else kernel.key_weight
    projected = torch.einsum("hpc,bnc->bhnp", weight, tokens)
    return projected / projected.norm(dim=-1, keepdim=True) * kernel.outputscale.sqrt()[None, :, None, None]


def _maps(layer: KEPSVGPAttention, tokens: Tensor, side: str) -> Tensor:
    """:math:`A_e` or :math:`A_r` of every token, shape ``(B, H, n, s)``."""
    features = layer.features
    if side == "right" and not layer.tie_qk:
        weight, bias = features.right_map, features.right_bias
    else:
        weight, bias = features.left_map, features.left_bias
    return torch.einsum("bnc,hcs->bhns", tokens, weight) + bias[None, :, None, :]


def _dense_scores(layer: KEPSVGPAttention, x: Tensor, context=None, mask=None, causal: bool = False) -> dict:
    """e (B, H, N, s), r (B, H, M, s), Lambda (H, s) or (B, H, s), kernel diagonals and J from the dense kernel."""
    keys = x if context is None else context
    phi_q, phi_k = _features(layer, x, "query"), _features(layer, keys, "key")
    kernel = phi_q @ phi_k.mT  # (B, H, N, M)
    key_weight = torch.ones(keys.shape[:2], dtype=DTYPE) if mask is None else mask.to(DTYPE)
    query_weight = key_weight if (context is None and mask is not None) else torch.ones(x.shape[:2], dtype=DTYPE)
    visible = kernel * key_weight[:, None, None, :] * query_weight[:, None, :, None]
    mode = layer.features.mode
    if mode == "exact":
        # numpy SVD of the masked kernel; sign: the largest-magnitude entry of each left vector is positive
        u, sigma, vt = np.linalg.svd(visible.detach().numpy())
        u, sigma, v = u[..., :RANK], sigma[..., :RANK], vt[..., :RANK, :].swapaxes(-1, -2)
        signs = np.sign(np.take_along_axis(u, np.abs(u).argmax(-2)[..., None, :], axis=-2))
        left, right = (torch.from_numpy(a * signs * sigma[..., None, :]) for a in (u, v))
        lam = torch.from_numpy(sigma.copy())
        objective = torch.zeros(visible.shape[:2], dtype=DTYPE)
    elif mode == "primal_features":
        tokens_e = layer.features.left_token_weights
        tokens_r = tokens_e if layer.tie_qk else layer.features.right_token_weights
        left, right, lam = kernel @ tokens_e, kernel.mT @ tokens_r, layer.features.singular_values
        left_w, right_w = phi_k.mT @ tokens_e, phi_q.mT @ tokens_r
    else:
        left_values, right_values = _maps(layer, keys, "left"), _maps(layer, x, "right")
        lam = layer.features.singular_values
        if causal:  # prefix means e(x_i) = sum_{j <= i} kappa(x_i, z_j) A_e(z_j) / i, r(z_j): queries i <= j
            lower = torch.ones(x.shape[1], x.shape[1], dtype=DTYPE).tril()
            counts = lower.sum(-1)[:, None]
            left = (kernel * lower) @ left_values / counts
            right = (kernel * lower.T).mT @ right_values / counts
            left_diag, right_diag = (kernel * lower).pow(2).sum(-1), (kernel * lower.T).pow(2).sum(-2)
        else:
            left = visible @ left_values / key_weight.sum(-1)[:, None, None, None]
            right = visible.mT @ right_values / query_weight.sum(-1)[:, None, None, None]
        # J (sum form, real tokens) with W_e = Phi_k^T A_e(Z) / M, W_r = Phi_q^T A_r(X) / N
        left_w = (phi_k * key_weight[:, None, :, None]).mT @ left_values / key_weight.sum(-1)[:, None, None, None]
        right_w = (phi_q * query_weight[:, None, :, None]).mT @ right_values / query_weight.sum(-1)[:, None, None, None]
    if mode != "exact":
        e_real = (phi_q @ left_w) * query_weight[:, None, :, None]
        r_real = (phi_k @ right_w) * key_weight[:, None, :, None]
        objective = (
            0.5 * (e_real.pow(2) / lam[:, None]).sum((-2, -1))
            + 0.5 * (r_real.pow(2) / lam[:, None]).sum((-2, -1))
            - (left_w * right_w).sum((-2, -1))
        )
    if not causal:
        left_diag, right_diag = visible.pow(2).sum(-1), visible.pow(2).sum(-2)
    return {
        "left": left,
        "right": right,
        "lam": lam,
        "objective": objective,
        "left_residual": (left_diag - left.pow(2).sum(-1)).clamp_min(0.0),
        "right_residual": (right_diag - right.pow(2).sum(-1)).clamp_min(0.0),
    }


def _branches(layer: KEPSVGPAttention, x: Tensor, context=None, mask=None, causal: bool = False) -> list[dict]:
    """Per branch at the queries: interp e Lambda^{-1} (B, H, N, s), m (H, d, s), L (H, d, s, s), the combined output
    weights C[h, c, j] (H, d, C) of the per-head output map and the output projection, the residual (B, H, N)."""
    scores = _dense_scores(layer, x, context, mask, causal)
    lam = scores["lam"]
    inverse = (1.0 / lam)[..., None, :] if lam.dim() == 3 else (1.0 / lam)[None, :, None, :]
    single = layer.tie_qk or context is not None
    projection = layer.out_proj.weight.view(C, H, -1)  # P[j, h, k]
    branches = []
    for index, side in enumerate(("left", "right")):
        if index == 1 and single:
            break
        mean, chol = _branch_q(layer, side)
        d = layer.num_outputs
        rows = slice(d, 2 * d) if (layer.merge == "concat" and index == 1) else slice(0, d)
        weight = torch.einsum("hck,jhk->hcj", layer.output_weight[:, rows], projection)
        branches.append(
            {
                "interp": scores[side] * inverse,
                "mean": mean,
                "chol": chol,
                "weight": weight,
                "residual": scores[f"{side}_residual"],
            }
        )
    return branches


def _dense_mean(layer: KEPSVGPAttention, x: Tensor, context=None, mask=None, causal: bool = False) -> Tensor:
    branches = _branches(layer, x, context, mask, causal)
    outputs = [torch.einsum("bhns,hcs->bhnc", branch["interp"], branch["mean"]) for branch in branches]
    d = layer.num_outputs
    if len(outputs) == 1:
        heads = torch.einsum("bhnc,hck->bhnk", outputs[0], layer.output_weight[:, :d])
    elif layer.merge == "sum":
        heads = torch.einsum("bhnc,hck->bhnk", outputs[0] + outputs[1], layer.output_weight)
    elif layer.merge == "concat":
        heads = torch.einsum("bhnc,hck->bhnk", torch.cat(outputs, -1), layer.output_weight)
    else:  # concat_tokens: W_tok [F_e; F_r] along the tokens
        merged = torch.einsum("hnm,bhmc->bhnc", layer.token_weight, torch.cat(outputs, -2))
        heads = torch.einsum("bhnc,hck->bhnk", merged, layer.output_weight)
    batch, _, length, _ = heads.shape
    concatenated = heads.permute(0, 2, 1, 3).reshape(batch, length, C)
    return concatenated @ layer.out_proj.weight.T + layer.out_proj.bias


def _dense_covariance(layer: KEPSVGPAttention, x: Tensor, context=None, mask=None, residual: bool = True) -> Tensor:
    """Covariance across tokens of every output channel, (B, C, N, N): y_{nj} = sum_{b,h,c} C^b_{hcj} F^b_{hnc}
    + const with F^b_{h,:,c} = e^b_h Lambda^{-1} u^b_{hc}; branches correlate only through a shared posterior."""
    branches = _branches(layer, x, context, mask)
    covariance = 0.0
    for a, first in enumerate(branches):
        for b, second in enumerate(branches):
            if a != b and not layer.shared_posterior:
                continue
            covar_u = first["chol"] @ first["chol"].mT  # S_{hc} (the same for both branches when shared)
            cross = torch.einsum("bhns,hcst,bhmt->bhcnm", first["interp"], covar_u, second["interp"])
            covariance = covariance + torch.einsum("bhcnm,hcj,hcj->bjnm", cross, first["weight"], second["weight"])
    if residual and layer.residual == "diag":
        for branch in branches:
            diagonal = torch.einsum("bhn,hcj->bjn", branch["residual"], branch["weight"].pow(2))
            covariance = covariance + torch.diag_embed(diagonal)
    return covariance


def _padding_mask() -> Tensor:
    return torch.tensor([[True] * 5, [True, False, True, True, False]])


# -- predictive mean -------------------------------------------------------------------------------------------------
MEAN_CASES = [
    pytest.param({}, {}, id="sum"),
    pytest.param({"merge": "concat"}, {}, id="concat"),
    pytest.param({"shared_posterior": True}, {}, id="shared"),
    pytest.param({"merge": "concat", "shared_posterior": True}, {}, id="concat-shared"),
    pytest.param({"tie_qk": True}, {}, id="tie_qk"),
    pytest.param({"num_outputs": None}, {}, id="default-d_out"),
    pytest.param({}, {"mask": True}, id="padding"),
    pytest.param({"merge": "concat"}, {"causal": True}, id="causal"),
    pytest.param({}, {"context": True}, id="cross-sum"),
    pytest.param({"merge": "concat"}, {"context": True, "mask": True}, id="cross-concat-padding"),
    pytest.param({"features": "exact"}, {}, id="exact"),
    pytest.param({"features": "exact", "merge": "concat"}, {"mask": True}, id="exact-padding"),
    pytest.param({"features": "primal_features", "max_len": 5}, {}, id="primal_features"),
    pytest.param({"merge": "concat_tokens", "max_len": 5}, {}, id="concat_tokens"),
]


def _call_args(options: dict, seed: int = 40) -> tuple[Tensor, dict, dict]:
    x = _randn(2, 5, C, seed=seed)
    context = _randn(2, 7, C, seed=seed + 1) if options.get("context") else None
    mask = None
    if options.get("mask"):
        mask = (
            torch.tensor([[True] * 7, [False, True, True, True, False, True, True]])
            if context is not None
            else _padding_mask()
        )
    layer_kwargs = {"context": context, "mask": "causal" if options.get("causal") else mask}
    dense_kwargs = {"context": context, "mask": mask, "causal": bool(options.get("causal"))}
    return x, layer_kwargs, dense_kwargs


@pytest.mark.parametrize(("layer_kwargs", "options"), MEAN_CASES)
def test_predictive_mean_matches_dense(layer_kwargs: dict, options: dict):
    layer = _layer(**layer_kwargs).eval()
    x, call, dense = _call_args(options)
    expected = _dense_mean(layer, x, **dense)
    output = layer(x, **call)
    rows = slice(None) if dense["mask"] is None or dense["context"] is not None else dense["mask"]
    torch.testing.assert_close(output[rows], expected[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(layer.predictive_mean(x, **call)[rows], expected[rows], atol=ATOL, rtol=0)
    if dense["mask"] is not None:  # padded tokens have no influence on the real outputs
        keys = x if dense["context"] is None else dense["context"]
        perturbed = torch.where(dense["mask"][..., None], keys, keys + 3.0 * _randn(*keys.shape, seed=49))
        if dense["context"] is None:
            other = layer(perturbed, mask=dense["mask"])
        else:
            other = layer(x, mask=dense["mask"], context=perturbed)
        torch.testing.assert_close(other[rows], output[rows], atol=ATOL, rtol=0)


def test_training_mode_returns_samples_around_the_mean():
    layer = _layer()
    x = _randn(2, 5, C, seed=41)
    mean = layer.eval()(x)
    layer.train()
    first, second = layer(x), layer(x)
    assert not torch.allclose(first, second) and not torch.allclose(first, mean)
    layer.eval()
    torch.testing.assert_close(layer(x), mean, atol=0, rtol=0)  # eval: the mean again, deterministic


# -- sampling --------------------------------------------------------------------------------------------------------
NUM_SAMPLES = 20000


def _empirical(layer: KEPSVGPAttention, x: Tensor, context=None) -> tuple[Tensor, Tensor]:
    """Mean (N, C) and covariance across tokens per channel (C, N, N) of NUM_SAMPLES samples for one sequence,
    drawn in one call with the sequence repeated along the batch (samples are independent per sequence)."""
    torch.manual_seed(123)
    repeated = x.expand(NUM_SAMPLES, -1, -1).contiguous()
    repeated_context = None if context is None else context.expand(NUM_SAMPLES, -1, -1).contiguous()
    with torch.no_grad(), sample_attention(layer):
        samples = layer.eval()(repeated, context=repeated_context)  # (S, N, C)
    centred = samples - samples.mean(0)
    return samples.mean(0), torch.einsum("snj,smj->jnm", centred, centred) / (NUM_SAMPLES - 1)


def _standard_errors(covariance: Tensor) -> Tensor:
    # sd of an empirical covariance of Gaussians: sqrt((s_nm^2 + s_nn s_mm) / S)
    variances = torch.diagonal(covariance, dim1=-2, dim2=-1)
    return ((covariance.pow(2) + variances[..., :, None] * variances[..., None, :]) / NUM_SAMPLES).sqrt()


SAMPLING_CASES = [
    pytest.param({}, False, id="sum"),
    pytest.param({"merge": "concat", "residual": "diag"}, False, id="concat-residual"),
    pytest.param({"shared_posterior": True}, False, id="shared"),
    pytest.param({"tie_qk": True, "residual": "diag"}, False, id="tie_qk-residual"),
    pytest.param({}, True, id="cross"),
]


@pytest.mark.parametrize(("layer_kwargs", "cross"), SAMPLING_CASES)
def test_joint_sampling_covariance_across_tokens(layer_kwargs: dict, cross: bool):
    """docs/math.md identity 8 on the layer output: empirical covariance across tokens of 20000 joint samples."""
    layer = _layer(**layer_kwargs)
    x = _randn(1, 5, C, seed=42)
    context = _randn(1, 6, C, seed=43) if cross else None
    mean, covariance = _empirical(layer, x, context)
    expected = _dense_covariance(layer, x, context)[0]  # (C, N, N)
    expected_mean = _dense_mean(layer, x, context)[0]
    variances = torch.diagonal(expected, dim1=-2, dim2=-1)  # (C, N)
    assert ((mean - expected_mean).abs() <= 5 * (variances.T / NUM_SAMPLES).sqrt()).all()
    for channel in (0, C - 1):
        error = torch.linalg.matrix_norm(covariance[channel] - expected[channel]) / torch.linalg.matrix_norm(
            expected[channel]
        )
        entrywise = (covariance[channel] - expected[channel]).abs() <= 5 * _standard_errors(expected[channel])
        assert error < 0.05 or entrywise.all(), f"channel {channel}: relative error {error:.3g}"
    # the tokens are clearly correlated: the joint draw shares u across tokens (the residual noise is independent)
    low_rank = _dense_covariance(layer, x, context, residual=False)[0]
    low_rank_variances = torch.diagonal(low_rank, dim1=-2, dim2=-1)
    correlation = low_rank / (low_rank_variances[..., :, None] * low_rank_variances[..., None, :]).sqrt()
    assert (correlation - torch.eye(5, dtype=DTYPE)).abs().max() > 0.3
    if layer.residual == "diag":
        assert (variances - low_rank_variances).min() > 1e-3


@pytest.mark.parametrize(
    "layer_kwargs",
    [
        pytest.param({}, id="sum"),
        pytest.param({"merge": "concat", "residual": "diag"}, id="concat-residual"),
        pytest.param({"shared_posterior": True}, id="shared"),
        pytest.param({"shared_posterior": True, "merge": "concat"}, id="shared-concat"),
    ],
)
def test_marginal_sampling_has_the_right_marginals_and_no_token_correlation(layer_kwargs: dict):
    layer = _layer(sampling="marginal", **layer_kwargs)
    x = _randn(1, 5, C, seed=44)
    mean, covariance = _empirical(layer, x)
    expected = _dense_covariance(layer, x)[0]
    variances = torch.diagonal(expected, dim1=-2, dim2=-1)
    sampled_variances = torch.diagonal(covariance, dim1=-2, dim2=-1)
    assert ((mean - _dense_mean(layer, x)[0]).abs() <= 5 * (variances.T / NUM_SAMPLES).sqrt()).all()
    # the marginals are right: variance within 5 standard errors (sqrt(2 / S) relative)
    assert ((sampled_variances - variances).abs() <= 5 * (2.0 / NUM_SAMPLES) ** 0.5 * variances).all()
    # ... but tokens are uncorrelated (the joint covariance is clearly not), up to noise once the output
    # projection mixes the heads: the covariance of y is then still diagonal across tokens
    off_diagonal = ~torch.eye(5, dtype=torch.bool)
    standard_errors = (variances[..., :, None] * variances[..., None, :] / NUM_SAMPLES).sqrt()
    assert (covariance.abs()[:, off_diagonal] <= 5 * standard_errors[:, off_diagonal]).all()
    joint = _dense_covariance(layer, x, residual=False)[0]  # what joint sampling would give off the diagonal
    assert (joint.abs()[:, off_diagonal] > 20 * standard_errors[:, off_diagonal]).any()


# -- posterior() -----------------------------------------------------------------------------------------------------
POSTERIOR_CASES = [
    pytest.param({}, {}, id="sum"),
    pytest.param({"residual": "diag"}, {}, id="sum-residual"),
    pytest.param({"shared_posterior": True}, {}, id="shared"),
    pytest.param({"shared_posterior": True, "residual": "diag"}, {"mask": True}, id="shared-residual-padding"),
    pytest.param({"merge": "concat", "residual": "diag"}, {}, id="concat-residual"),
    pytest.param({"merge": "concat", "shared_posterior": True}, {}, id="concat-shared"),
    pytest.param({"tie_qk": True, "residual": "diag"}, {}, id="tie_qk-residual"),
    pytest.param({"residual": "diag"}, {"context": True}, id="cross-residual"),
    pytest.param({"features": "exact", "residual": "diag"}, {}, id="exact-residual"),
]


@pytest.mark.parametrize(("layer_kwargs", "options"), POSTERIOR_CASES)
def test_posterior_matches_dense(layer_kwargs: dict, options: dict):
    layer = _layer(**layer_kwargs)  # training mode: posterior() must switch to the mean and restore the mode
    x, call, dense = _call_args(options, seed=45)
    mean, variance = layer.posterior(x, **call)
    assert layer.training
    expected_variance = torch.diagonal(_dense_covariance(layer, x, dense["context"], dense["mask"]), dim1=-2, dim2=-1)
    rows = slice(None) if dense["mask"] is None or dense["context"] is not None else dense["mask"]
    torch.testing.assert_close(mean[rows], _dense_mean(layer, x, **dense)[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(variance[rows], expected_variance.mT[rows], atol=ATOL, rtol=0)
    if layer.residual == "diag":  # the residual contributes (the tail of the spectrum in exact mode)
        without = _dense_covariance(layer, x, dense["context"], dense["mask"], residual=False)
        assert (expected_variance - torch.diagonal(without, dim1=-2, dim2=-1)).max() > 1e-5


def test_posterior_is_not_available_for_concat_tokens():
    layer = _layer(merge="concat_tokens", max_len=5)
    with pytest.raises(NotImplementedError):
        layer.posterior(_randn(1, 5, C, seed=46))


# -- KL and the KSVD loss --------------------------------------------------------------------------------------------
def _dense_kl(mean: Tensor, chol: Tensor, lam: Tensor) -> Tensor:
    """sum over heads and outputs of KL(N(m, L L^T) || N(0, diag(Lambda_h^2))) with torch.distributions."""
    total = torch.zeros((), dtype=DTYPE)
    for h in range(mean.shape[0]):
        prior = torch.distributions.MultivariateNormal(torch.zeros(RANK, dtype=DTYPE), torch.diag(lam[h] ** 2))
        for c in range(mean.shape[1]):
            posterior = torch.distributions.MultivariateNormal(mean[h, c], chol[h, c] @ chol[h, c].T)
            total = total + torch.distributions.kl_divergence(posterior, prior)
    return total


@pytest.mark.parametrize(
    "layer_kwargs",
    [
        pytest.param({}, id="sum"),
        pytest.param({"merge": "concat"}, id="concat"),
        pytest.param({"shared_posterior": True}, id="shared"),
        pytest.param({"tie_qk": True}, id="tie_qk"),
        pytest.param({"features": "primal_features", "max_len": 5}, id="primal_features"),
    ],
)
def test_kl_matches_torch_distributions(layer_kwargs: dict):
    layer = _layer(**layer_kwargs)
    lam = layer.features.singular_values
    expected = _dense_kl(*_branch_q(layer, "left"), lam)
    if not (layer.shared_posterior or layer.tie_qk):
        expected = expected + _dense_kl(*_branch_q(layer, "right"), lam)
    else:
        assert len(_posteriors(layer)) == 1  # one KL per head and output
    kl = layer.kl_divergence()
    assert kl.shape == ()
    torch.testing.assert_close(kl, expected, atol=ATOL, rtol=0)


def test_kl_at_the_prior_is_zero():
    layer = _layer()
    with torch.no_grad():
        lam = layer.features.singular_values
        for mean, chol in _posteriors(layer):
            mean.zero_()
            chol.copy_(torch.diag_embed(lam[:, None].expand(-1, D_OUT, -1)))
    torch.testing.assert_close(layer.kl_divergence(), torch.zeros((), dtype=DTYPE), atol=ATOL, rtol=0)


def test_exact_mode_kl_uses_the_last_batch():
    layer = _layer(features="exact")
    with pytest.raises(RuntimeError, match="call the features"):
        layer.kl_divergence()
    x = _randn(3, 5, C, seed=47)
    layer.eval()(x)
    lam = _dense_scores(layer, x)["lam"]  # (B, H, s) from numpy SVDs
    per_sequence = []
    for b in range(3):
        kl = _dense_kl(*_branch_q(layer, "left"), lam[b]) + _dense_kl(*_branch_q(layer, "right"), lam[b])
        per_sequence.append(kl)
    torch.testing.assert_close(layer.kl_divergence(), torch.stack(per_sequence).mean(), atol=ATOL, rtol=0)


def _dense_exact_kl(layer: KEPSVGPAttention, x: Tensor) -> Tensor:
    """The exact layer's KL for the sequences x: per sequence against its own Lambda (numpy SVD), then the mean."""
    lam = _dense_scores(layer, x)["lam"]  # (B, H, s)
    per_sequence = [
        _dense_kl(*_branch_q(layer, "left"), lam[b]) + _dense_kl(*_branch_q(layer, "right"), lam[b])
        for b in range(x.shape[0])
    ]
    return torch.stack(per_sequence).mean()


def test_exact_mode_kl_belongs_to_its_forward_call():
    """With exact features the KL is computed from the scores of the forward call it belongs to: a posterior() call or
    a call of the features on other sequences in between leaves kl_divergence() unchanged, its gradient reaches q(u)
    and the kernel (Lambda is the call's), and the next forward call's KL is that call's."""
    layer = _layer(features="exact").train()
    x, other = _randn(3, 5, C, seed=47), _randn(2, 6, C, seed=91)
    layer(x)
    expected = _dense_exact_kl(layer, x)
    layer.posterior(other)
    layer.features(other)
    assert layer.training
    kl = layer.kl_divergence()
    torch.testing.assert_close(kl, expected, atol=ATOL, rtol=0)
    assert (_dense_exact_kl(layer, other) - expected).abs() > 1e-3  # not vacuous: another batch has another KL
    kl.backward()
    assert layer.strategy._variational_distribution.variational_mean.grad.abs().max() > 0
    assert layer.features.kernel.raw_outputscale.grad.abs().max() > 0
    layer.eval()(other)
    torch.testing.assert_close(layer.kl_divergence(), _dense_exact_kl(layer, other), atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [{}, {"mask": True}, {"causal": True}], ids=["plain", "padding", "causal"])
def test_ksvd_loss_term_after_a_training_forward(options: dict):
    layer = _layer().train()
    x, call, dense = _call_args(options, seed=48)
    layer(x, **call)
    term = dict(layer.features.named_added_loss_terms())["ksvd_loss"]
    if options.get("causal"):
        # J on the causal scores the layer uses: e_i, r_i of the prefix j <= i, and the trace averaged over the
        # prefix weights W_{e,i} = sum_{j<=i} phi_k(z_j) A_e(z_j)^T / i, W_{r,i} = sum_{j<=i} phi_q(x_j) A_r(x_j)^T / i
        scores = _dense_scores(layer, x, causal=True)
        lam = layer.features.singular_values[None, :, None, :]
        phi_q, phi_k = _features(layer, x, "query"), _features(layer, x, "key")
        a_e, a_r = _maps(layer, x, "left"), _maps(layer, x, "right")
        counts = torch.arange(1, x.shape[1] + 1, dtype=DTYPE)[:, None, None]
        w_e = torch.einsum("bhnp,bhns->bhnps", phi_k, a_e).cumsum(2) / counts
        w_r = torch.einsum("bhnp,bhns->bhnps", phi_q, a_r).cumsum(2) / counts
        objective = (
            0.5 * (scores["left"].pow(2) / lam).sum((-2, -1))
            + 0.5 * (scores["right"].pow(2) / lam).sum((-2, -1))
            - (w_e * w_r).sum((-2, -1)).mean(-1)
        )
        full = _dense_scores(layer, x)["objective"]
        assert (objective - full).abs().max() > 1e-3  # not the full-sequence J
    else:  # J of the whole sequence over the real tokens
        objective = _dense_scores(layer, x, mask=dense["mask"])["objective"]  # (B, H)
    torch.testing.assert_close(term.loss(), objective.pow(2).sum(-1).mean(), atol=ATOL, rtol=0)


def test_exact_mode_has_no_ksvd_loss():
    layer = _layer(features="exact").train()
    layer(_randn(2, 5, C, seed=50))
    torch.testing.assert_close(
        dict(layer.features.named_added_loss_terms())["ksvd_loss"].loss(), torch.zeros((), dtype=DTYPE), atol=0, rtol=0
    )


# -- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"merge": "product"}, "merge"),
        ({"sampling": "independent"}, "sampling"),
        ({"residual": "full"}, "residual"),
        ({"tie_qk": True, "merge": "concat"}, "tie_qk"),
        ({"tie_qk": True, "shared_posterior": True}, "tie_qk"),
        ({"merge": "concat_tokens"}, "max_len"),
        ({"merge": "concat_tokens", "max_len": 0}, "max_len"),
        ({"features": "primal_tokens"}, "max_len"),
        ({"features": "amortized", "kernel": "exponential"}, "exponential"),
    ],
)
def test_constructor_errors(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        KEPSVGPAttention(C, H, num_inducing=RANK, **kwargs)


@pytest.mark.parametrize("flag", ["shared_posterior", "tie_qk"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_flags_must_be_bools(flag: str, value):
    """Truthiness read shared_posterior="no" (or tie_qk="False", 1) as True: one q(u) for both branches, or tied
    W_q = W_k, without a word."""
    with pytest.raises(TypeError, match=f"KEPSVGPAttention: expected {flag} to be True or False, got {value!r}"):
        KEPSVGPAttention(C, H, num_inducing=RANK, **{flag: value})
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, **{flag: np.bool_(True)})
    assert getattr(layer, flag) is True


def test_sample_attention_takes_a_bool_flag():
    """sample_attention(layer, "no") switched sampling on."""
    layer = KEPSVGPAttention(C, H, num_inducing=RANK).eval()
    with pytest.raises(TypeError, match="sample_attention: expected enabled to be True or False, got 'no'"):
        with sample_attention(layer, "no"):
            pass
    assert layer.sample_in_eval is False
    with sample_attention(layer, np.bool_(False)):
        assert layer.sample_in_eval is False and not layer.sampling


def test_call_errors():
    x = _randn(2, 5, C, seed=51)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="primal_features"):
        _layer(features="primal_features", max_len=5)(x, mask=mask)
    with pytest.raises(ValueError, match="does not support causal masks"):
        _layer(features="primal_tokens", max_len=5)(x, mask="causal")
    with pytest.raises(ValueError, match="does not support cross-attention"):
        _layer(features="primal_tokens", max_len=5)(x, context=_randn(2, 5, C, seed=53))
    with pytest.raises(ValueError, match="primal_tokens"):  # the features alone name the mode
        _layer(features="primal_tokens", max_len=5).features(x, causal=True)
    with pytest.raises(ValueError, match="max_len=5"):
        _layer(features="primal_features", max_len=5)(_randn(2, 4, C, seed=52))
    with pytest.raises(ValueError, match="at most max_len=5"):
        _layer(features="primal_tokens", max_len=5)(_randn(2, 6, C, seed=52))
    with pytest.raises(ValueError, match="concat_tokens"):
        _layer(merge="concat_tokens", max_len=5)(x, mask=mask)
    with pytest.raises(ValueError, match="concat_tokens"):
        _layer(merge="concat_tokens", max_len=5)(x, context=_randn(2, 5, C, seed=53))
    with pytest.raises(ValueError, match="length 5"):
        _layer(merge="concat_tokens", max_len=5)(_randn(2, 4, C, seed=54))
    with pytest.raises(ValueError, match="causal"):
        _layer(features="exact")(x, mask="causal")
    with pytest.raises(ValueError, match="shortest sequence"):
        _layer(features="exact")(x, mask=torch.tensor([[True] * 5, [True, True] + [False] * 3]))


# -- the layer IS the pair SVGP of the GPyTorch strategy (equivalence, float64) -------------------------------------
SEQUENCE = 6  # tokens of the one sequence whose tokens are the landmarks


def _one_head_layer(seed: int, **kwargs) -> KEPSVGPAttention:
    """A one-head layer (head width = feature dimension C) with exact features and random q(u)."""
    torch.manual_seed(seed)
    layer = KEPSVGPAttention(C, 1, num_inducing=RANK, num_outputs=D_OUT, features="exact", **kwargs).double()
    with torch.no_grad():
        layer.features.kernel.raw_outputscale.fill_(0.4)
        for offset, (mean, chol) in enumerate(_posteriors(layer)):
            mean.copy_(_randn(*mean.shape, seed=seed + 1 + offset))
            chol.copy_(torch.eye(RANK, dtype=DTYPE) + 0.4 * _randn(*chol.shape, seed=seed + 3 + offset))
        layer.out_proj.bias.copy_(_randn(C, seed=seed + 5))
    return layer.eval()


def _as_pair_svgp(layer: KEPSVGPAttention, tokens: Tensor) -> KernelEigenPairSVGP:
    """``KernelEigenPairSVGP`` on the tokens of one sequence as landmarks, with the layer's head-0 kernel and q(u):
    the d_out outputs of the head become the model's batch of independent outputs."""
    source = layer.features.kernel
    kernel = CosineFeatureKernel(C, C).double()
    with torch.no_grad():
        kernel.query_weight.copy_(source.query_weight[0])
        kernel.key_weight.copy_(source.key_weight[0])
        kernel.raw_outputscale.copy_(source.raw_outputscale[0])
    model = KernelEigenPairSVGP(
        tokens,
        kernel,
        num_inducing=RANK,
        residual=layer.residual,
        shared_posterior=layer.shared_posterior,
        batch_shape=torch.Size([D_OUT]),
        learn_inducing_locations=False,
    ).double()
    target, source_q = model.variational_strategy._variational_distribution, layer.strategy._variational_distribution
    with torch.no_grad():
        target.variational_mean.copy_(source_q.variational_mean[0])
        target.chol_variational_covar.copy_(source_q.chol_variational_covar[0])
    model.variational_strategy.variational_params_initialized.fill_(1)
    return model.eval()


def _output_map(layer: KEPSVGPAttention) -> Tensor:
    """C (d_out, C): y = b + F^T C for one head and merge="sum"."""
    return layer.output_weight[0] @ layer.out_proj.weight.T


EQUIVALENCE_CASES = [
    pytest.param({}, id="independent"),
    pytest.param({"shared_posterior": True}, id="shared"),
    pytest.param({"residual": "diag"}, id="residual"),
    pytest.param({"shared_posterior": True, "residual": "diag"}, id="shared-residual"),
]


@pytest.mark.parametrize("layer_kwargs", EQUIVALENCE_CASES)
def test_exact_layer_on_one_sequence_is_the_pair_svgp(layer_kwargs: dict):
    layer = _one_head_layer(60, **layer_kwargs)
    x = _randn(1, SEQUENCE, C, seed=66)
    model = _as_pair_svgp(layer, x[0])
    # exact per-sequence features = exact landmark features on the same points
    per_sequence, landmark = layer.features(x, kernel_diag=True), model.features(x[0], kernel_diag=True)
    for name in ("left_scores", "right_scores", "singular_values", "left_kernel_diag", "right_kernel_diag"):
        torch.testing.assert_close(getattr(per_sequence, name)[0, 0], getattr(landmark, name), atol=ATOL, rtol=0)
    # each branch's q(f) at the tokens: the layer's strategy against the model's (mean and covariance)
    for side in ("left", "right"):
        from_layer, from_model = layer.readout.predictive(per_sequence, side), model.branch(x[0], side)
        torch.testing.assert_close(from_layer.mean[0, 0], from_model.mean, atol=ATOL, rtol=0)
        torch.testing.assert_close(from_layer.covariance_matrix[0, 0], from_model.covariance_matrix, atol=ATOL, rtol=0)
    # the layer's output is the model's merged q(F) pushed through the output map: mean and variance
    merged, output_map = model(x[0]), _output_map(layer)
    mean, variance = layer.posterior(x)
    torch.testing.assert_close(layer(x)[0], merged.mean.mT @ output_map + layer.out_proj.bias, atol=ATOL, rtol=0)
    torch.testing.assert_close(mean[0], merged.mean.mT @ output_map + layer.out_proj.bias, atol=ATOL, rtol=0)
    torch.testing.assert_close(variance[0], merged.variance.mT @ output_map.pow(2), atol=ATOL, rtol=0)
    # the KL (the model's sums the d_out outputs; one sequence, so the layer's mean over sequences is that one)
    torch.testing.assert_close(
        layer.kl_divergence(), model.variational_strategy.kl_divergence().sum(), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("layer_kwargs", EQUIVALENCE_CASES)
def test_exact_layer_samples_are_the_pair_svgp_samples(layer_kwargs: dict):
    """Under one seed, the layer's joint sample equals F = sum_b e_b Lambda^{-1} (m_b + L_b eps_b) (+ the residual
    noise) computed here from the model's q(u) and features, pushed through the output map."""
    layer = _one_head_layer(70, **layer_kwargs)
    x = _randn(1, SEQUENCE, C, seed=76)
    model = _as_pair_svgp(layer, x[0])
    torch.manual_seed(5)
    with sample_attention(layer):
        sample = layer(x)[0]
    torch.manual_seed(5)
    q = model.variational_strategy._variational_distribution
    mean, chol = q.variational_mean, q.chol_variational_covar.tril()  # (d_out, branches, s), (d_out, branches, s, s)
    draw = mean + (chol @ torch.randn(1, 1, *mean.shape, dtype=DTYPE)[0, 0].unsqueeze(-1)).squeeze(-1)
    features = model.features(x[0], kernel_diag=True)
    outputs = 0.0
    for index, side in enumerate(("left", "right")):
        branch = draw[:, 0 if layer.shared_posterior else index]  # (d_out, s)
        outputs = outputs + branch @ features.interp(side).mT  # (d_out, N)
    if layer.residual == "diag":
        for side in ("left", "right"):
            noise = torch.randn(1, 1, D_OUT, SEQUENCE, dtype=DTYPE)[0, 0]
            outputs = outputs + features.residual_diag(side).clamp_min(torch.finfo(DTYPE).eps).sqrt() * noise
    expected = outputs.mT @ _output_map(layer) + layer.out_proj.bias
    torch.testing.assert_close(sample, expected, atol=ATOL, rtol=0)


STRATEGY_CASES = [
    pytest.param({}, {}, id="sum"),
    pytest.param({"merge": "concat"}, {}, id="concat"),
    pytest.param({"shared_posterior": True}, {}, id="shared"),
    pytest.param({"tie_qk": True}, {}, id="tie_qk"),
    pytest.param({"residual": "diag"}, {"mask": True}, id="residual-padding"),
    pytest.param({"merge": "concat"}, {"causal": True}, id="causal"),
    pytest.param({}, {"context": True}, id="cross"),
]


@pytest.mark.parametrize(("layer_kwargs", "options"), STRATEGY_CASES)
def test_amortised_layer_is_the_strategy_q_f_through_the_output_maps(layer_kwargs: dict, options: dict):
    """The fused output path (coefficients Lambda^{-1} u^T C, one GEMM per branch) against the strategy's q(f) at the
    tokens (``predictive``: its mean and covariance), mapped by the per-head output maps and out_proj; and the
    layer's joint sample against u = m + L eps drawn by the strategy under the same seed."""
    layer = _layer(**layer_kwargs).eval()
    x, call, dense = _call_args(options, seed=80)
    scores = layer.features(x, dense["context"], dense["mask"], dense["causal"], kernel_diag=True)
    branches = _branches(layer, x, **dense)  # the combined output weights C^b (H, d_out, C) of each branch
    sides = ("left", "right")[: len(branches)]
    q_f = [layer.readout.predictive(scores, side) for side in sides]  # batch (B, H, d_out) over the N queries
    expected_mean = layer.out_proj.bias + sum(
        torch.einsum("bhcn,hcj->bnj", branch_q.mean, branch["weight"])
        for branch_q, branch in zip(q_f, branches, strict=True)
    )
    torch.testing.assert_close(layer(x, **call), expected_mean, atol=ATOL, rtol=0)
    if not layer.shared_posterior:  # independent branches: the variances add (shared: test_posterior_matches_dense)
        expected_variance = sum(
            torch.einsum("bhcn,hcj->bnj", branch_q.variance, branch["weight"].pow(2))
            for branch_q, branch in zip(q_f, branches, strict=True)
        )
        torch.testing.assert_close(layer.posterior(x, **call)[1], expected_variance, atol=ATOL, rtol=0)
    torch.manual_seed(9)
    with sample_attention(layer):
        sample = layer(x, **call)
    torch.manual_seed(9)
    draw = layer.readout.inducing_draw(torch.Size([x.shape[0]]))  # (B, H, d_out[, branches], s)
    expected_sample = layer.out_proj.bias
    for side, branch in zip(sides, branches, strict=True):
        interp = scores.for_outputs(1).interp(side)  # (B, H, 1, N, s)
        outputs = interp @ _branch_draw(layer, draw, side).unsqueeze(-1)  # (B, H, d_out, N, 1)
        expected_sample = expected_sample + torch.einsum("bhcn,hcj->bnj", outputs.squeeze(-1), branch["weight"])
    if layer.residual == "none":  # (the residual adds per-token noise: covered by the dense sampling tests)
        torch.testing.assert_close(sample, expected_sample, atol=ATOL, rtol=0)


def test_shared_posterior_set_by_the_user_is_kept():
    """A q(u) written into the (one, shared) posterior after construction survives training and eval calls and is the
    one the outputs use: the layer initialised it at construction, so nothing re-initialises it lazily."""
    layer = _layer(shared_posterior=True)
    q = layer.strategy._variational_distribution
    mean, chol = _randn(*q.variational_mean.shape, seed=60), _randn(*q.chol_variational_covar.shape, seed=61)
    with torch.no_grad():
        q.variational_mean.copy_(mean)
        q.chol_variational_covar.copy_(chol)
    x = _randn(2, 5, C, seed=62)
    layer.train()(x)
    layer.kl_divergence()
    output = layer.eval()(x)
    assert torch.equal(q.variational_mean, mean) and torch.equal(q.chol_variational_covar, chol)
    # the output is (e + r) Lambda^{-1} m through the output maps, with the m written above
    scores = _dense_scores(layer, x)
    interp = (scores["left"] + scores["right"]) / scores["lam"][None, :, None, :]  # (B, H, N, s)
    gp = torch.einsum("bhns,hcs->bhnc", interp, mean[..., 0, :])  # (B, H, N, d_out)
    heads = torch.einsum("bhnc,hcj->bnhj", gp, layer.output_weight).flatten(2)
    torch.testing.assert_close(output, heads @ layer.out_proj.weight.T + layer.out_proj.bias, atol=ATOL, rtol=0)


def test_exact_features_jump_along_a_smooth_input_path():
    """Exact features index q(u_i) by the rank i of a singular pair signed by its largest-magnitude entry: along a
    smooth path of inputs the output jumps (hundreds of times the median step) exactly where that entry moves to
    another token and the sign rule flips the pair (docs/guide/papers.md)."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(C, H, num_inducing=2, features="exact").to(DTYPE).eval()
    start, end = _randn(1, 5, C, seed=63), _randn(1, 5, C, seed=64)
    path = torch.linspace(0, 1, 401, dtype=DTYPE)
    with torch.no_grad():
        outputs, references = [], []
        for t in path:
            x = (1 - t) * start + t * end
            outputs.append(layer(x))
            scores = layer.features(x)
            vectors = scores.left_scores / scores.singular_values.unsqueeze(-2)  # H_e: (1, H, N, s)
            references.append(vectors.abs().argmax(-2))  # the token that fixes each pair's sign
    steps = (torch.stack(outputs)[1:] - torch.stack(outputs)[:-1]).flatten(1).norm(dim=-1)
    jump = int(steps.argmax())
    assert steps[jump] > 100 * steps.median()
    assert not torch.equal(references[jump], references[jump + 1])  # the sign reference moved at the jump
    # away from such switches the path is smooth: no step without a switch is larger than 10 median steps
    smooth = [k for k in range(len(steps)) if torch.equal(references[k], references[k + 1])]
    assert steps[smooth].max() < 10 * steps.median()


# -- exact features on a sequence whose kernel has rank < s (issue 14) -------------------------------------------------
def test_exact_features_leave_numerically_zero_directions_out_of_the_output_and_the_kl():
    """One token repeated: the kernel of the sequence has rank 1 < s = 3. The two zero directions must leave the
    output and the KL consistently (zero interpolation column, unit prior), not be floored at sqrt(eps) lambda_1 (a
    prior variance ~1e-18 and a KL ~1e18): the output does not depend on their q(u), and the KL equals the dense
    KL of q(u) against N(0, diag(lambda_1^2, 1, 1)) from torch.distributions."""
    layer = _layer(seed=80, features="exact").train(False)
    token = _randn(1, 1, C, seed=81)
    x = torch.cat([token.expand(1, 5, C), _randn(1, 5, C, seed=82)])  # sequence 0 repeats one token, sequence 1 not
    output = layer(x)
    assert torch.isfinite(output).all()
    scores = layer.features(x)  # the call's directions and singular values (they belong to its sequences)
    active = scores.active
    assert active[0].tolist() == [[True, False, False]] * H and bool(active[1].all())
    singular_values = scores.singular_values
    kl = layer.kl_divergence()
    assert torch.isfinite(kl) and kl < 1e3
    # the dense KL per sequence, head, output and branch against the masked prior, averaged over the sequences
    q = layer.strategy.variational_distribution  # batch (H, d_out, 2|1)
    mean, covariance = q.mean.detach(), q.covariance_matrix.detach()
    expected = torch.zeros((), dtype=DTYPE)
    for b in range(2):
        variances = torch.where(active[b], singular_values[b].detach() ** 2, 1.0)  # (H, s)
        prior = torch.distributions.MultivariateNormal(
            torch.zeros_like(mean), torch.diag_embed(variances[:, None, None, :].expand_as(mean))
        )
        expected = (
            expected
            + torch.distributions.kl_divergence(torch.distributions.MultivariateNormal(mean, covariance), prior).sum()
            / 2
        )
    torch.testing.assert_close(kl.detach(), expected, rtol=1e-10, atol=1e-10)
    # the inactive directions' q(u) does not reach the output of sequence 0
    with torch.no_grad():
        variational = layer.strategy._variational_distribution
        variational.variational_mean[..., 1:] += 5.0
        changed = layer(x)
    torch.testing.assert_close(changed[0], output[0], rtol=1e-12, atol=1e-12)
    assert (changed[1] - output[1]).abs().max() > 1e-3


def test_the_sampling_mode_of_a_built_layer_can_be_switched():
    # sampling_mode is the switch the forward pass reads: a joint layer switched to "marginal" draws what a layer built
    # marginal draws (it was a plain attribute, set once, which the forward pass ignored)
    x = _randn(2, 5, C, seed=42)
    switched, marginal = _layer(residual="diag"), _layer(residual="diag", sampling="marginal")
    switched.sampling_mode = "marginal"
    assert switched.sampling_mode == "marginal" and not switched.joint_sampling
    draws = []
    for layer in (switched, marginal, _layer(residual="diag")):
        torch.manual_seed(7)
        with torch.no_grad(), sample_attention(layer.eval()):
            draws.append(layer(x))
    assert torch.equal(draws[0], draws[1])
    assert not torch.allclose(draws[0], draws[2])  # a joint draw differs
    switched.sampling_mode = "joint"
    torch.manual_seed(7)
    with torch.no_grad(), sample_attention(switched):
        assert torch.equal(switched(x), draws[2])
    with pytest.raises(ValueError, match="sampling"):
        switched.sampling_mode = "independent"
    assert switched.sampling_mode == "joint"
