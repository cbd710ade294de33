"""Attention kernel-eigen features against dense references written here (docs/math.md sections 2 and 6), float64.

Every reference is computed from the module's parameters alone: the query/key weights and output scale of the
kernel, the amortised maps, the learned singular values and, for the exact mode, a numpy SVD of the dense kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.attention.kep_svgp_attention import KEPSVGPAttention
from gpattn.features import AttentionKernelEigenFeatures, KernelEigenScores, build_attention_features

DTYPE = torch.float64
ATOL = 1e-10
C, H = 16, 2  # token width and heads: feature dimension p = C / H = 8


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _features(num_inducing: int = 3, seed: int = 0, **kwargs) -> AttentionKernelEigenFeatures:
    """A module with every parameter randomised (biases, output scales and distinct singular values included)."""
    torch.manual_seed(seed)
    rank = num_inducing
    module = build_attention_features(C, H, rank, **kwargs).double()
    with torch.no_grad():
        module.kernel.raw_outputscale.copy_(_randn(H, seed=seed + 1))
        for name in ("left_bias", "right_bias"):
            if hasattr(module, name):
                getattr(module, name).copy_(0.3 * _randn(H, rank, seed=seed + 2 + len(name)))
        if module.mode != "exact":
            module.raw_singular_values.copy_(_randn(H, rank, seed=seed + 9))
    return module


def _dense_features(module: AttentionKernelEigenFeatures, tokens: Tensor, side: str) -> Tensor:
    r""":math:`\phi(x) = \sqrt{\sigma_f} W x / \|W x\|` per head, shape ``(B, H, n, p)``."""
    kernel = module.kernel
    weight = kernel.query_weight if side == "query" or module.tie_qk else kernel.key_weight
    projected = torch.einsum("hpc,bnc->bhnp", weight, tokens)
    return projected / projected.norm(dim=-1, keepdim=True) * kernel.outputscale.sqrt()[None, :, None, None]


def _dense_kernel(module: AttentionKernelEigenFeatures, queries: Tensor, keys: Tensor) -> Tensor:
    """The dense attention kernel per sequence and head, shape ``(B, H, N, M)``."""
    kernel = module.kernel
    if hasattr(kernel, "max_logit"):  # exponential dot-product kernel
        weight_k = kernel.query_weight if module.tie_qk else kernel.key_weight
        query_proj = torch.einsum("hpc,bnc->bhnp", kernel.query_weight, queries)
        key_proj = torch.einsum("hpc,bmc->bhmp", weight_k, keys)
        logits = query_proj @ key_proj.mT / math.sqrt(kernel.feature_dim)
        return kernel.outputscale[None, :, None, None] * logits.exp()
    return _dense_features(module, queries, "query") @ _dense_features(module, keys, "key").mT


def _maps(module: AttentionKernelEigenFeatures, tokens: Tensor, side: str) -> Tensor:
    """:math:`A_e` (``"left"``) or :math:`A_r` (``"right"``) of every token, shape ``(B, H, n, s)``."""
    if side == "right" and not module.tie_qk:
        weight, bias = module.right_map, module.right_bias
    else:
        weight, bias = module.left_map, module.left_bias
    return torch.einsum("bnc,hcs->bhns", tokens, weight) + bias[None, :, None, :]


def _dense_amortized(module, queries, keys, mask=None, causal=False):
    """Scores, kernel diagonals and J of the amortised mode by explicit loops over sequences, heads, tokens."""
    self_attention = queries is keys
    kernel = _dense_kernel(module, queries, keys)
    phi_q, phi_k = _dense_features(module, queries, "query"), _dense_features(module, keys, "key")
    left_values, right_values = _maps(module, keys, "left"), _maps(module, queries, "right")
    lam = module.singular_values
    batch, _, num_q, num_k = kernel.shape
    left = torch.zeros(batch, H, num_q, module.num_inducing, dtype=DTYPE)
    right = torch.zeros(batch, H, num_k, module.num_inducing, dtype=DTYPE)
    left_diag, right_diag = torch.zeros(batch, H, num_q, dtype=DTYPE), torch.zeros(batch, H, num_k, dtype=DTYPE)
    objective = torch.zeros(batch, H, dtype=DTYPE)
    for b in range(batch):
        real_keys = list(range(num_k)) if mask is None else mask[b].nonzero().flatten().tolist()
        real_queries = real_keys if (self_attention and mask is not None) else list(range(num_q))
        for h in range(H):
            k = kernel[b, h]
            for i in range(num_q):
                visible = range(i + 1) if causal else real_keys
                left[b, h, i] = sum(k[i, j] * left_values[b, h, j] for j in visible) / len(visible)
                left_diag[b, h, i] = sum(k[i, j] ** 2 for j in visible)
            for j in range(num_k):
                visible = range(j + 1) if causal else real_queries
                right[b, h, j] = sum(k[i, j] * right_values[b, h, i] for i in visible) / len(visible)
                right_diag[b, h, j] = sum(k[i, j] ** 2 for i in visible)
            # J (sum form) over the real tokens with W_e = Phi_k^T A_e(Z) / M, W_r = Phi_q^T A_r(X) / N
            left_weight = phi_k[b, h, real_keys].T @ left_values[b, h, real_keys] / len(real_keys)
            right_weight = phi_q[b, h, real_queries].T @ right_values[b, h, real_queries] / len(real_queries)
            e = phi_q[b, h, real_queries] @ left_weight
            r = phi_k[b, h, real_keys] @ right_weight
            objective[b, h] = (
                0.5 * (e.pow(2) / lam[h]).sum()
                + 0.5 * (r.pow(2) / lam[h]).sum()
                - torch.trace(left_weight.T @ right_weight)
            )
    return left, right, objective, left_diag, right_diag


def _assert_scores(scores: KernelEigenScores, reference, objective: bool = True) -> None:
    left, right, J, left_diag, right_diag = reference
    torch.testing.assert_close(scores.left_scores, left, atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.right_scores, right, atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.left_kernel_diag, left_diag, atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.right_kernel_diag, right_diag, atol=ATOL, rtol=0)
    if objective:
        torch.testing.assert_close(scores.objective, J, atol=ATOL, rtol=0)


def _padding_mask() -> Tensor:
    return torch.tensor([[True] * 6, [True, True, False, True, False, True], [True] * 4 + [False] * 2])


# -- amortized -----------------------------------------------------------------------------------------------------
def test_amortized_scores_match_dense():
    module = _features(num_inducing=3)
    x = _randn(3, 6, C, seed=10)
    scores = module(x, x)
    _assert_scores(scores, _dense_amortized(module, x, x))
    assert scores.left_scores.shape == (3, H, 6, 3) and scores.singular_values.shape == (H, 3)
    torch.testing.assert_close(scores.singular_values, module.singular_values, atol=0, rtol=0)
    # e(X) = K A_e(Z) / M, r(Z) = K^T A_r(X) / N in matrix form as well
    kernel = _dense_kernel(module, x, x)
    torch.testing.assert_close(scores.left_scores, kernel @ _maps(module, x, "left") / 6, atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.right_scores, kernel.mT @ _maps(module, x, "right") / 6, atol=ATOL, rtol=0)


def test_amortized_tied_is_symmetric():
    module = _features(num_inducing=3, tie_qk=True)
    x = _randn(2, 5, C, seed=11)
    kernel = _dense_kernel(module, x, x)
    torch.testing.assert_close(kernel, kernel.mT, atol=ATOL, rtol=0)
    scores = module(x, x)
    _assert_scores(scores, _dense_amortized(module, x, x))
    torch.testing.assert_close(scores.left_scores, scores.right_scores, atol=ATOL, rtol=0)  # A_e = A_r and K = K^T


def test_amortized_padding_mask():
    module = _features(num_inducing=3)
    x, mask = _randn(3, 6, C, seed=12), _padding_mask()
    scores = module(x, x, mask)
    _assert_scores(scores, _dense_amortized(module, x, x, mask=mask))
    # padded tokens perturbed: the scores, kernel diagonals and J of the real tokens are unchanged
    perturbed = torch.where(mask[..., None], x, x + 5.0 * _randn(3, 6, C, seed=13))
    other = module(perturbed, perturbed, mask)
    real = mask[:, None, :].expand(-1, H, -1)
    for name in ("left_scores", "right_scores"):
        torch.testing.assert_close(getattr(other, name)[real], getattr(scores, name)[real], atol=ATOL, rtol=0)
        diag = name.replace("scores", "kernel_diag")
        torch.testing.assert_close(getattr(other, diag)[real], getattr(scores, diag)[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(other.objective, scores.objective, atol=ATOL, rtol=0)
    # an all-True mask is no mask
    full = module(x, x, torch.ones(3, 6, dtype=torch.bool))
    torch.testing.assert_close(full.objective, module(x, x).objective, atol=ATOL, rtol=0)


def test_amortized_causal_prefix_means():
    module = _features(num_inducing=3)
    x = _randn(2, 6, C, seed=14)
    scores = module(x, x, causal=True)
    _assert_scores(scores, _dense_amortized(module, x, x, causal=True), objective=False)
    # causality: changing the last token leaves every earlier score unchanged
    changed = x.clone()
    changed[:, -1] += 1.0
    other = module(changed, changed, causal=True)
    torch.testing.assert_close(other.left_scores[..., :-1, :], scores.left_scores[..., :-1, :], atol=ATOL, rtol=0)
    torch.testing.assert_close(other.right_scores[..., :-1, :], scores.right_scores[..., :-1, :], atol=ATOL, rtol=0)
    # the last position sees the whole sequence: the non-causal scores
    full = module(x, x)
    torch.testing.assert_close(scores.left_scores[..., -1, :], full.left_scores[..., -1, :], atol=ATOL, rtol=0)


def test_a_causal_call_with_a_padding_mask_and_empty_calls_are_refused():
    """The causal scores read no mask: a causal call with one gave the unmasked scores (a left-padded sequence's
    first real token mixed in its padding); empty batches and sequences raised torch's reshape error or a
    ZeroDivisionError."""
    module = _features(num_inducing=3)
    x = _randn(2, 6, C, seed=14)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    with pytest.raises(ValueError, match=r"^features='amortized': a causal call takes no key_mask"):
        module(x, x, mask, causal=True)
    for empty in (x[:0], x[:, :0]):
        for kernel_diag in (False, True):  # the fused path and the general one
            with pytest.raises(ValueError, match=r"expected at least one sequence and one token, got queries of sh"):
                module(empty, empty, kernel_diag=kernel_diag)
    with pytest.raises(ValueError, match=r"keys of shape \(2, 0, 16\)"):
        module(x, x[:, :0])


@pytest.mark.parametrize("masked", [False, True])
def test_amortized_cross_attention(masked: bool):
    module = _features(num_inducing=3)
    x, context = _randn(3, 4, C, seed=15), _randn(3, 7, C, seed=16)
    mask = torch.tensor([[True] * 7, [True, False, True, True, False, True, True], [False] + [True] * 6])
    mask = mask if masked else None
    scores = module(x, context, mask)
    assert scores.left_scores.shape == (3, H, 4, 3) and scores.right_scores.shape == (3, H, 7, 3)
    _assert_scores(scores, _dense_amortized(module, x, context, mask=mask))


def test_residual_diag_is_clamped():
    module = _features(num_inducing=3)
    x = _randn(2, 5, C, seed=17)
    scores = module(x, x)
    left_residual = scores.left_kernel_diag - scores.left_scores.pow(2).sum(-1)
    torch.testing.assert_close(scores.residual_diag("left"), left_residual.clamp_min(0.0), atol=0, rtol=0)
    right_residual = scores.right_kernel_diag - scores.right_scores.pow(2).sum(-1)
    torch.testing.assert_close(scores.residual_diag("right"), right_residual.clamp_min(0.0), atol=0, rtol=0)
    # hand-made scores exceeding the kernel diagonal: the residual is zero there, exact elsewhere
    left = torch.tensor([[[[1.0, 1.0], [0.5, 0.0]]]], dtype=DTYPE)  # ||e||^2 = 2, 0.25
    diag = torch.tensor([[[1.0, 1.0]]], dtype=DTYPE)
    handmade = KernelEigenScores(left, left, torch.ones(1, 2, dtype=DTYPE), torch.zeros(1, 1, dtype=DTYPE), diag, diag)
    torch.testing.assert_close(handmade.residual_diag("left"), torch.tensor([[[0.0, 0.75]]], dtype=DTYPE))
    torch.testing.assert_close(handmade.residual_diag("right"), torch.tensor([[[0.0, 0.75]]], dtype=DTYPE))


# -- the KSVD objective ----------------------------------------------------------------------------------------------
def test_objective_vanishes_when_the_maps_reproduce_the_singular_vectors():
    """docs/math.md identity 2 for the amortised parametrisation: with C >= N the maps can be solved for so that
    A_e(Z)/M = H_r and A_r(X)/N = H_e (numpy SVD of the dense kernel), Lambda = its singular values; then
    e(X) = H_e Lambda, r(Z) = H_r Lambda and J = 0. Random maps give J != 0."""
    rank, length = 4, 6
    module = _features(num_inducing=rank, seed=3)
    x = _randn(1, length, C, seed=18)
    assert module(x, x).objective.abs().min() > 1e-3  # random init: not stationary
    kernel = _dense_kernel(module, x, x)[0].detach().numpy()
    left_vectors, right_vectors, singular_values = [], [], []
    for h in range(H):
        u, sigma, vt = np.linalg.svd(kernel[h])
        left_vectors.append(u[:, :rank])
        right_vectors.append(vt[:rank].T)
        singular_values.append(sigma[:rank])
    tokens = x[0].detach().numpy()
    with torch.no_grad():
        for h in range(H):
            # tokens @ W = target has an exact solution: the N x C token matrix has full row rank
            left_map = np.linalg.lstsq(tokens, length * right_vectors[h], rcond=None)[0]
            right_map = np.linalg.lstsq(tokens, length * left_vectors[h], rcond=None)[0]
            module.left_map[h] = torch.from_numpy(left_map)
            module.right_map[h] = torch.from_numpy(right_map)
        module.left_bias.zero_()
        module.right_bias.zero_()
        lam = torch.from_numpy(np.stack(singular_values))
        module.raw_singular_values.copy_(module.raw_singular_values_constraint.inverse_transform(lam))
    torch.testing.assert_close(_maps(module, x, "left")[0] / length, torch.from_numpy(np.stack(right_vectors)))
    scores = module(x, x)
    torch.testing.assert_close(scores.objective, torch.zeros(1, H, dtype=DTYPE), atol=ATOL, rtol=0)
    for h in range(H):
        expected_left = torch.from_numpy(left_vectors[h] * singular_values[h])
        expected_right = torch.from_numpy(right_vectors[h] * singular_values[h])
        torch.testing.assert_close(scores.left_scores[0, h], expected_left, atol=ATOL, rtol=0)
        torch.testing.assert_close(scores.right_scores[0, h], expected_right, atol=ATOL, rtol=0)
    # any other Lambda leaves the stationary point
    with torch.no_grad():
        module.raw_singular_values.add_(0.5)
    assert module(x, x).objective.abs().min() > 1e-3


def _mean_abs_objective(module: AttentionKernelEigenFeatures, tokens: Tensor) -> float:
    with torch.no_grad():
        return module(tokens, tokens).objective.abs().mean().item()


def test_amortized_objective_decreases_under_the_ksvd_loss():
    """eta J^2 alone (mean over a fixed batch of sequences, sum over heads) drives |J| down by > 5x."""
    torch.manual_seed(0)
    module = build_attention_features(C, H, 4).double()
    tokens = _randn(64, 12, C, seed=19)
    before = _mean_abs_objective(module, tokens)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    for _ in range(200):
        optimizer.zero_grad()
        objective = module(tokens, tokens).objective
        loss = 1.0 * objective.pow(2).sum(-1).mean()
        loss.backward()
        optimizer.step()
    after = _mean_abs_objective(module, tokens)
    print(f"\n[ksvd loss only] mean |J| before {before:.4g}, after 200 Adam steps {after:.4g}")
    assert after < 0.2 * before


def test_amortized_objective_decreases_with_a_joint_objective():
    """A tiny regression loss on the KEP-SVGP layer output plus the layer's KSVD added loss term: |J| goes down."""
    torch.manual_seed(1)
    layer = KEPSVGPAttention(C, H, num_inducing=4).double()
    tokens = _randn(64, 12, C, seed=20)
    targets = torch.tanh(tokens @ _randn(C, C, seed=21) / math.sqrt(C))
    before = _mean_abs_objective(layer.features, tokens)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    layer.train()
    mse = []
    for _ in range(200):
        optimizer.zero_grad()
        fit = (layer(tokens) - targets).pow(2).mean()
        ksvd = dict(layer.features.named_added_loss_terms())["ksvd_loss"].loss()
        (fit + ksvd).backward()
        optimizer.step()
        mse.append(fit.item())
    after = _mean_abs_objective(layer.features, tokens)
    print(
        f"\n[regression + ksvd loss] mean |J| before {before:.4g}, after {after:.4g}; "
        f"mse first {mse[0]:.4g}, last {mse[-1]:.4g}"
    )
    assert after < 0.25 * before
    assert mse[-1] < mse[0]


# -- exact -----------------------------------------------------------------------------------------------------------
def _assert_exact_svd(scores: KernelEigenScores, kernel: np.ndarray, b: int, h: int, rank: int) -> None:
    """Scores of sequence b, head h against numpy's SVD of the dense kernel (signs: largest |H_e| entry > 0)."""
    u, sigma, vt = np.linalg.svd(kernel)
    lam = scores.singular_values[b, h].detach().numpy()
    np.testing.assert_allclose(lam, sigma[:rank], atol=ATOL, rtol=0)
    left = scores.left_scores[b, h].detach().numpy()
    right = scores.right_scores[b, h].detach().numpy()
    left_vectors, right_vectors = left / lam, right / lam
    # orthonormal columns, adjointness K H_r = H_e Lambda, K^T H_e = H_r Lambda, K = H_e Lambda H_r^T
    np.testing.assert_allclose(left_vectors.T @ left_vectors, np.eye(rank), atol=ATOL, rtol=0)
    np.testing.assert_allclose(right_vectors.T @ right_vectors, np.eye(rank), atol=ATOL, rtol=0)
    np.testing.assert_allclose(kernel @ right_vectors, left, atol=ATOL, rtol=0)
    np.testing.assert_allclose(kernel.T @ left_vectors, right, atol=ATOL, rtol=0)
    truncated = (u[:, :rank] * sigma[:rank]) @ vt[:rank]
    np.testing.assert_allclose(left_vectors @ np.diag(lam) @ right_vectors.T, truncated, atol=ATOL, rtol=0)
    # the numpy singular vectors up to the deterministic sign
    pivots = np.abs(u[:, :rank]).argmax(0)
    signs = np.sign(u[pivots, np.arange(rank)])
    np.testing.assert_allclose(left_vectors, u[:, :rank] * signs, atol=1e-8, rtol=0)
    assert (left_vectors[np.abs(left_vectors).argmax(0), np.arange(rank)] > 0).all()


@pytest.mark.parametrize("kernel_name", ["cosine", "exponential"])
def test_exact_full_rank_reproduces_the_dense_svd(kernel_name: str):
    length = 5
    module = _features(num_inducing=length, mode="exact", kernel=kernel_name, seed=4)
    x = _randn(2, length, C, seed=22)
    scores = module(x, x)
    kernel = _dense_kernel(module, x, x).detach().numpy()
    torch.testing.assert_close(scores.objective, torch.zeros(2, H, dtype=DTYPE), atol=0, rtol=0)
    assert scores.singular_values.shape == (2, H, length)
    for b in range(2):
        for h in range(H):
            _assert_exact_svd(scores, kernel[b, h], b, h, length)
            # full rank: K = H_e Lambda H_r^T exactly
            left_vectors = scores.left_scores[b, h] / scores.singular_values[b, h]
            np.testing.assert_allclose(
                (left_vectors @ scores.right_scores[b, h].mT).detach().numpy(), kernel[b, h], atol=ATOL, rtol=0
            )
    np.testing.assert_allclose(scores.left_kernel_diag.detach().numpy(), (kernel**2).sum(-1), atol=ATOL)
    np.testing.assert_allclose(scores.right_kernel_diag.detach().numpy(), (kernel**2).sum(-2), atol=ATOL)
    torch.testing.assert_close(scores.residual_diag("left"), torch.zeros(2, H, length, dtype=DTYPE), atol=1e-9, rtol=0)


def test_exact_truncated_residual_is_the_tail_of_the_spectrum():
    """docs/math.md identity 5: the left residual sums to sum_{i>s} lambda_i^2 (nothing is clamped here)."""
    rank = 2
    module = _features(num_inducing=rank, mode="exact", seed=5)
    x = _randn(2, 6, C, seed=23)
    scores = module(x, x)
    kernel = _dense_kernel(module, x, x).detach().numpy()
    for b in range(2):
        for h in range(H):
            _assert_exact_svd(scores, kernel[b, h], b, h, rank)
            tail = (np.linalg.svd(kernel[b, h], compute_uv=False)[rank:] ** 2).sum()
            for side in ("left", "right"):
                residual = scores.residual_diag(side)[b, h].detach().numpy()
                assert residual.min() >= 0
                np.testing.assert_allclose(residual.sum(), tail, atol=ATOL, rtol=0)


def test_exact_cross_attention_with_padding():
    rank = 3
    module = _features(num_inducing=rank, mode="exact", kernel="exponential", seed=6)
    x, context = _randn(2, 4, C, seed=24), _randn(2, 6, C, seed=25)
    mask = torch.tensor([[True, False, True, True, True, False], [True] * 6])
    scores = module(x, context, mask)
    kernel = _dense_kernel(module, x, context).detach().numpy() * mask[:, None, None, :].numpy()
    for b in range(2):
        for h in range(H):
            _assert_exact_svd(scores, kernel[b, h], b, h, rank)
    assert scores.right_scores[0, :, ~mask[0]].abs().max() < ATOL  # masked keys: zero columns, zero scores


def test_exact_self_attention_with_padding_zeroes_rows_and_columns():
    module = _features(num_inducing=4, mode="exact", seed=7)
    x, mask = _randn(3, 6, C, seed=26), _padding_mask()  # the shortest sequence has 4 real tokens
    scores = module(x, x, mask)
    dense = _dense_kernel(module, x, x).detach().numpy()
    for b in range(3):
        real = mask[b].numpy()
        zeroed = dense[b] * real[None, :, None] * real[None, None, :]
        for h in range(H):
            _assert_exact_svd(scores, zeroed[h], b, h, 4)
            sub = np.linalg.svd(dense[b, h][np.ix_(real, real)], compute_uv=False)
            np.testing.assert_allclose(scores.singular_values[b, h].detach().numpy(), sub[:4], atol=ATOL, rtol=0)
        for name in ("left_scores", "right_scores"):  # padded rows of K are zero, hence so are their scores
            torch.testing.assert_close(
                getattr(scores, name)[b] * ~mask[b, :, None], getattr(scores, name)[b] * 0, atol=ATOL, rtol=0
            )
    # padded tokens perturbed: nothing at the real tokens changes
    perturbed = torch.where(mask[..., None], x, x + 3.0 * _randn(3, 6, C, seed=27))
    other = module(perturbed, perturbed, mask)
    real = mask[:, None, :].expand(-1, H, -1)
    torch.testing.assert_close(other.left_scores[real], scores.left_scores[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(other.singular_values, scores.singular_values, atol=ATOL, rtol=0)


def test_exact_errors():
    module = _features(num_inducing=4, mode="exact")
    x = _randn(2, 6, C, seed=28)
    with pytest.raises(ValueError, match="causal"):
        module(x, x, causal=True)
    with pytest.raises(ValueError, match="shortest sequence"):
        module(x, x, torch.tensor([[True] * 6, [True] * 3 + [False] * 3]))
    with pytest.raises(ValueError, match="shortest sequence"):
        module(x, _randn(2, 3, C, seed=29))  # cross-attention with 3 keys
    with pytest.raises(ValueError, match="exponential"):
        build_attention_features(C, H, 2, mode="amortized", kernel="exponential")
    with pytest.raises(ValueError, match="exponential"):
        build_attention_features(C, H, 2, mode="primal_features", kernel="exponential", max_len=4)
    with pytest.raises(RuntimeError, match="each sequence"):
        _ = module.singular_values


def test_exact_cosine_rank_above_the_feature_dimension_is_rejected():
    with pytest.raises(ValueError, match="feature dimension"):
        build_attention_features(C, H, C // H + 1, mode="exact")


# -- primal_features ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie_qk", [False, True])
def test_primal_features_match_dense(tie_qk: bool):
    length, rank = 5, 3
    module = _features(num_inducing=rank, mode="primal_features", max_len=length, tie_qk=tie_qk, seed=8)
    x = _randn(2, length, C, seed=30)
    scores = module(x, x)
    phi_q, phi_k = _dense_features(module, x, "query"), _dense_features(module, x, "key")
    left_tokens = module.left_token_weights
    right_tokens = left_tokens if tie_qk else module.right_token_weights
    left_weight = phi_k.mT @ left_tokens  # W_e|X = Phi_k(X)^T W~_e: (B, H, p, s)
    right_weight = phi_q.mT @ right_tokens
    kernel = _dense_kernel(module, x, x)
    torch.testing.assert_close(scores.left_scores, kernel @ left_tokens, atol=ATOL, rtol=0)  # e(X) = K W~_e
    torch.testing.assert_close(scores.right_scores, kernel.mT @ right_tokens, atol=ATOL, rtol=0)
    lam = module.singular_values
    objective = (
        0.5 * (scores.left_scores.pow(2) / lam[:, None]).sum((-2, -1))
        + 0.5 * (scores.right_scores.pow(2) / lam[:, None]).sum((-2, -1))
        - (left_weight * right_weight).sum((-2, -1))
    )
    torch.testing.assert_close(scores.objective, objective, atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.left_kernel_diag, kernel.pow(2).sum(-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.right_kernel_diag, kernel.pow(2).sum(-2), atol=ATOL, rtol=0)


def test_primal_features_errors():
    module = _features(num_inducing=3, mode="primal_features", max_len=5)
    with pytest.raises(ValueError, match="max_len=5"):
        module(*(2 * [_randn(2, 4, C, seed=31)]))
    x = _randn(2, 5, C, seed=32)
    with pytest.raises(ValueError, match="self-attention only"):
        module(x, x, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="self-attention only"):
        module(x, x, causal=True)
    with pytest.raises(ValueError, match="self-attention only"):
        module(x, _randn(2, 5, C, seed=33))
    with pytest.raises(ValueError, match="max_len"):
        build_attention_features(C, H, 3, mode="primal_features")
    with pytest.raises(ValueError, match="max_len"):
        build_attention_features(C, H, 3, mode="primal_features", max_len=2)


def test_constructor_errors():
    with pytest.raises(ValueError, match="features"):
        build_attention_features(C, H, 2, mode="dual")
    with pytest.raises(ValueError, match="kernel"):
        build_attention_features(C, H, 2, kernel="rbf")
    with pytest.raises(ValueError, match="num_inducing"):
        build_attention_features(C, H, 0)
    with pytest.raises(ValueError, match="feature dimension"):
        build_attention_features(C, H, C // H + 1)


@pytest.mark.parametrize("mode", ["amortized", "exact"])
def test_tie_qk_must_be_a_bool(mode: str):
    """Truthiness read tie_qk="False" as tied weights W_q = W_k (a symmetric kernel) without a word."""
    with pytest.raises(TypeError, match="expected tie_qk to be True or False, got 'False'"):
        build_attention_features(C, H, 2, mode=mode, tie_qk="False")
    features = build_attention_features(C, H, 2, mode=mode, tie_qk=np.bool_(False))
    assert features.tie_qk is False and features.kernel.tie is False


# -- extreme input magnitudes (issue 14) -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["amortized", "primal_tokens"])
def test_float32_inputs_of_huge_magnitude_are_correct_or_a_clear_error(mode: str):
    """In float32 the learned scores multiply weights that grow like |x| with unnormalised projections (|x|^2), and
    their squares (J, the variances of the draws) like |x|^2 again: up to about sqrt(finfo.max) / 1e3 = 1.8e16 the
    scores equal float64's to float32 rounding; scores whose squares would overflow (beyond sqrt(finfo.max / 1e3) =
    5.8e17, reached at 1e19, where the draws of kep_svgp_paper were NaN, issue 24) name the cause instead of returning
    NaN or the bias alone."""
    module = _features(num_inducing=3, seed=70, mode=mode, max_len=6).float()
    reference = _features(num_inducing=3, seed=70, mode=mode, max_len=6)
    x = _randn(2, 6, C, seed=71)
    for scale in (1.0, 1e15, 1e16):
        scores = module((x * scale).float(), objective=False, kernel_diag=False)
        expected = reference(x * scale, objective=False, kernel_diag=False)
        for got, want in ((scores.left_scores, expected.left_scores), (scores.right_scores, expected.right_scores)):
            assert torch.isfinite(got).all()
            assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()  # float32 rounding only
    for scale in (1e19, 1e21, 1e30):
        with pytest.raises(ValueError, match=r"input tokens reach \|x\| = .*too large for torch.float32.*\|x\|\^2"):
            module((x * scale).float(), objective=False, kernel_diag=False)
    # float64 has the room: the same inputs give finite scores
    assert torch.isfinite(reference(x * 1e30, objective=False, kernel_diag=False).left_scores).all()
