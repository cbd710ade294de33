""":func:`~gpattn.features.ksvd_fidelity` against layers whose distance to the exact KSVD is known (exact features and a
layer set to its stationary point: zero; random weights: not), dense float64 references of every kernel quantity
(``numpy.linalg.svd`` of the dense kernel), the chance level of random subspaces against closed forms and scipy's Haar
sampler, and a layer trained towards the rank-s KSVD of its kernel against the same layer at initialisation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.linalg import subspace_angles
from scipy.stats import ortho_group

from gpattn.attention import KEPSVGPAttention, PrimalAttention
from gpattn.features import AmortizedAttentionFeatures, KSVDFidelity, ksvd_fidelity

DTYPE = torch.float64
C, H, RANK, LENGTH = 8, 2, 3, 6
#: the comparison's MNIST-1D shape: 20 tokens, rank s = 5, head width p = 16
WIDE, TOKENS, S = 32, 20, 5
RANDOM_FIELDS = ("random_left_cosine", "random_right_cosine", "random_max_angle")  # Monte Carlo


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _dense_kernel(features, x: torch.Tensor) -> np.ndarray:
    return features.kernel.forward(x.unsqueeze(1), x.unsqueeze(1)).detach().numpy()  # (B, H, N, M)


def _assert_exact(fidelity: KSVDFidelity) -> None:
    for name in ("relative_objective", "singular_value_error"):
        torch.testing.assert_close(
            getattr(fidelity, name), torch.zeros_like(getattr(fidelity, name)), atol=1e-9, rtol=0
        )
    for name in ("left_cosine", "right_cosine"):
        torch.testing.assert_close(getattr(fidelity, name), torch.ones_like(getattr(fidelity, name)), atol=1e-9, rtol=0)
    assert fidelity.max_angle.max() < 1e-3  # degrees (arccos near 1 loses half the digits)
    torch.testing.assert_close(fidelity.kernel_error, fidelity.optimal_error, atol=1e-9, rtol=0)  # K_hat = K_s
    torch.testing.assert_close(fidelity.kernel_scale, fidelity.energy.sqrt(), atol=1e-9, rtol=0)  # ||K_s|| / ||K||


def _assert_kernel_quantities(fidelity: KSVDFidelity, kernel: np.ndarray, rank: int) -> None:
    # optimal error, energy and effective rank from an independent numpy SVD of the dense kernel
    sigma = np.linalg.svd(kernel, compute_uv=False)
    total = (sigma**2).sum(-1)
    np.testing.assert_allclose(fidelity.energy.numpy(), (sigma[..., :rank] ** 2).sum(-1) / total, atol=1e-12, rtol=0)
    np.testing.assert_allclose(
        fidelity.optimal_error.numpy(), np.sqrt((sigma[..., rank:] ** 2).sum(-1) / total), atol=1e-12, rtol=0
    )
    shares = sigma**2 / total[..., None]
    entropy = -(shares * np.log(np.where(shares > 0, shares, 1.0))).sum(-1)
    np.testing.assert_allclose(fidelity.effective_rank.numpy(), np.exp(entropy), atol=1e-10, rtol=0)


def test_exact_features_are_the_exact_ksvd():
    torch.manual_seed(0)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, features="exact").double()
    x = _tokens(3, LENGTH, C, seed=1)
    fidelity = ksvd_fidelity(layer, x)
    assert fidelity.left_cosine.shape == (3, H)
    _assert_exact(fidelity)
    _assert_kernel_quantities(fidelity, _dense_kernel(layer.features, x), RANK)
    assert (fidelity.optimal_error > 1e-3).all()  # rank K = 4 > s = 3: the truncation has an error


def test_cross_attention_compares_the_rectangular_kernel():
    """Queries of N = 9 tokens against M = 6 keys (one sequence padded to 4): the exact layer is exact, and the chance
    level of the kernel error is sqrt(1 - s^2 / (N M)) with each sequence's real keys."""
    torch.manual_seed(13)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, features="exact").double()
    queries, keys = _tokens(2, 9, C, seed=14), _tokens(2, LENGTH, C, seed=15)
    mask = torch.tensor([[True] * LENGTH, [True] * 4 + [False] * 2])
    fidelity = ksvd_fidelity(layer, queries, keys, key_mask=mask)
    _assert_exact(fidelity)
    kernel = layer.features.kernel.forward(queries.unsqueeze(1), keys.unsqueeze(1)).detach().numpy()
    kernel[1, :, :, 4:] = 0.0
    _assert_kernel_quantities(fidelity, kernel, RANK)
    expected = np.sqrt(1 - RANK**2 / (9 * np.array([LENGTH, 4])))[:, None].repeat(H, 1)
    np.testing.assert_allclose(fidelity.random_kernel_error.numpy(), expected, rtol=1e-12)


def test_learned_kernel_error_is_the_dense_error_of_e_inverse_lambda_r():
    """The amortised layer's K_hat = e Lambda^{-1} r^T with e = K A_e(Z) / M, r = K^T A_r(X) / N, formed densely in
    numpy from the kernel matrix and the maps' parameters (docs/math.md section 2)."""
    torch.manual_seed(1)
    features = AmortizedAttentionFeatures(WIDE, H, S).double()
    x = _tokens(3, TOKENS, WIDE, seed=2)
    fidelity = ksvd_fidelity(features, x)
    kernel = _dense_kernel(features, x)
    tokens = x.numpy()
    lam = features.singular_values.detach().numpy()  # (H, s)
    expected, scale = np.empty((3, H)), np.empty((3, H))
    for b in range(3):
        for h in range(H):
            left_values = tokens[b] @ features.left_map[h].detach().numpy() + features.left_bias[h].detach().numpy()
            right_values = tokens[b] @ features.right_map[h].detach().numpy() + features.right_bias[h].detach().numpy()
            e = kernel[b, h] @ left_values / TOKENS
            r = kernel[b, h].T @ right_values / TOKENS
            approximation = e / lam[h] @ r.T
            expected[b, h] = np.linalg.norm(kernel[b, h] - approximation) / np.linalg.norm(kernel[b, h])
            scale[b, h] = np.linalg.norm(approximation) / np.linalg.norm(kernel[b, h])
    np.testing.assert_allclose(fidelity.kernel_error.numpy(), expected, rtol=1e-10, atol=0)
    np.testing.assert_allclose(fidelity.kernel_scale.numpy(), scale, rtol=1e-10, atol=0)
    _assert_kernel_quantities(fidelity, kernel, S)
    assert (fidelity.kernel_error > fidelity.optimal_error + 0.1).all()  # random maps: far from the truncation


def test_a_layer_at_its_stationary_point_is_the_exact_ksvd():
    """Amortised maps solved so that A_e(Z)/M = H_r, A_r(X)/N = H_e and Lambda the singular values (possible for one
    sequence of N <= C tokens): zero objective, angles and error; random maps are not."""
    torch.manual_seed(2)
    features = AmortizedAttentionFeatures(C, H, RANK).double()
    x = _tokens(1, LENGTH, C, seed=3)
    before = ksvd_fidelity(features, x)
    assert before.relative_objective.min() > 1e-3 and before.max_angle.min() > 1.0
    assert before.singular_value_error.min() > 1e-2
    assert (before.kernel_error > before.optimal_error + 1e-2).all()
    kernel = _dense_kernel(features, x)[0]
    tokens = x[0].numpy()
    with torch.no_grad():
        values = []
        for h in range(H):
            u, sigma, vt = np.linalg.svd(kernel[h])
            features.left_map[h] = torch.from_numpy(np.linalg.lstsq(tokens, LENGTH * vt[:RANK].T, rcond=None)[0])
            features.right_map[h] = torch.from_numpy(np.linalg.lstsq(tokens, LENGTH * u[:, :RANK], rcond=None)[0])
            values.append(sigma[:RANK])
        features.left_bias.zero_()
        features.right_bias.zero_()
        lam = torch.from_numpy(np.stack(values))
        features.raw_singular_values.copy_(features.raw_singular_values_constraint.inverse_transform(lam))
    _assert_exact(ksvd_fidelity(features, x))


def test_padding_compares_the_real_tokens_only():
    torch.manual_seed(4)
    layer = PrimalAttention(C, H, num_inducing=RANK).double()
    x = _tokens(2, LENGTH, C, seed=5)
    mask = torch.tensor([[True] * LENGTH, [True] * 4 + [False] * 2])
    padded = ksvd_fidelity(layer, x, key_mask=mask)
    alone = ksvd_fidelity(layer, x[1:, :4])  # the second sequence without its padding
    summary = padded.summary()
    assert set(summary) == {
        "relative_objective",
        "left_cosine",
        "right_cosine",
        "max_angle",
        "singular_value_error",
        "kernel_error",
        "kernel_scale",
        "optimal_error",
        "energy",
        "effective_rank",
        *RANDOM_FIELDS,
        "random_kernel_error",
    }
    assert all(isinstance(value, float) for value in summary.values())
    for name in set(summary) - set(RANDOM_FIELDS):  # the random frames are other draws on other shapes
        torch.testing.assert_close(getattr(padded, name)[1], getattr(alone, name)[0], atol=1e-9, rtol=0)
    # the random frames live on the real tokens: 4 tokens, rank 3, random_kernel_error^2 = 1 - 3^2 / 4^2
    np.testing.assert_allclose(padded.random_kernel_error[1].numpy(), math.sqrt(1 - 9 / 16), rtol=1e-12)


# -- issue 24 item 8: short sequences, rank-deficient kernels ----------------------------------------------------------
def test_sequences_shorter_than_the_rank_are_refused_with_n_and_s():
    torch.manual_seed(6)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK).double()  # learned (amortised) features
    with pytest.raises(ValueError, match=r"N = 2 real queries and M = 2 real keys.*rank s = 3"):
        ksvd_fidelity(layer, _tokens(2, 2, C, seed=7))
    mask = torch.tensor([[True] * LENGTH, [True] * 2 + [False] * (LENGTH - 2)])  # one padded sequence of 2 tokens
    with pytest.raises(ValueError, match=r"N = 2 real queries.*rank s = 3"):
        ksvd_fidelity(layer, _tokens(2, LENGTH, C, seed=8), key_mask=mask)


@pytest.mark.parametrize(("features", "dtype"), [("exact", torch.float64), ("amortized", torch.float32)])
def test_a_rank_deficient_kernel_compares_the_active_directions_only(features, dtype):
    """Identical tokens: K has rank 1 < s. The exact layer is exact (its zero directions inactive, Lambda = 1 there);
    the learned scores e = K A_e(Z) / M span the one direction of K. Neither is compared on the kernel's null space
    (before: singular-value errors 0.4-5.8 for the exact layer, angles of 60-85 degrees for the learned one)."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, features=features).to(dtype)
    x = torch.randn(4, 1, C, dtype=dtype).expand(4, LENGTH, C).contiguous()
    fidelity = ksvd_fidelity(layer, x)
    kernel = _dense_kernel(layer.features, x)
    assert np.linalg.matrix_rank(kernel[0, 0]) == 1  # identical tokens: identical rows and columns
    atol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fidelity.left_cosine, torch.ones_like(fidelity.left_cosine), atol=atol, rtol=0)
    torch.testing.assert_close(fidelity.right_cosine, torch.ones_like(fidelity.right_cosine), atol=atol, rtol=0)
    assert fidelity.max_angle.max() < (1e-3 if dtype == torch.float64 else 0.1)  # degrees
    torch.testing.assert_close(fidelity.optimal_error, torch.zeros_like(fidelity.optimal_error), atol=atol, rtol=0)
    torch.testing.assert_close(fidelity.effective_rank, torch.ones_like(fidelity.effective_rank), atol=atol, rtol=0)
    if features == "exact":
        _assert_exact(fidelity)
        # the random frames have as many columns as the layer's active directions (1): 1 - 1 / N^2
        np.testing.assert_allclose(fidelity.random_kernel_error.numpy(), math.sqrt(1 - 1 / LENGTH**2), rtol=1e-12)


# -- the chance level ------------------------------------------------------------------------------------------------
def _haar_reference(kernel: np.ndarray, rank: int, samples: int, seed: int) -> tuple[float, float]:
    """Mean cosine of the principal angles between scipy's Haar s-frames of R^N and the top-s left singular subspace
    of one kernel, and the root-mean-square relative error of Q Q^T K V V^T, by Monte Carlo."""
    rng = np.random.default_rng(seed)
    u, _, vt = np.linalg.svd(kernel)
    n, m = kernel.shape
    cosines, squared_errors = [], []
    for _ in range(samples):
        q = ortho_group.rvs(n, random_state=rng)[:, :rank]
        v = ortho_group.rvs(m, random_state=rng)[:, :rank]
        cosines.append(np.cos(subspace_angles(q, u[:, :rank])).mean())
        squared_errors.append(1 - np.linalg.norm(q.T @ kernel @ v) ** 2 / np.linalg.norm(kernel) ** 2)
    return float(np.mean(cosines)), float(np.sqrt(np.mean(squared_errors)))


def test_random_subspaces_against_haar_references():
    torch.manual_seed(9)
    layer = KEPSVGPAttention(WIDE, H, num_inducing=S).double()
    x = _tokens(1, TOKENS, WIDE, seed=10)
    fidelity = ksvd_fidelity(layer, x, random_samples=2000, seed=3)
    kernel = _dense_kernel(layer.features, x)[0, 0]
    cosine, error = _haar_reference(kernel, S, samples=2000, seed=0)
    # both Monte Carlo over 2000 frames: the standard error of each mean is about 0.0015
    assert abs(float(fidelity.random_left_cosine[0, 0]) - cosine) < 0.01
    assert abs(float(fidelity.random_right_cosine[0, 0]) - cosine) < 0.01  # the same law on R^M, M = N
    # the closed form sqrt(1 - s^2 / (N M)) against the Monte Carlo root mean square on this kernel
    assert float(fidelity.random_kernel_error[0, 0]) == pytest.approx(math.sqrt(1 - S**2 / TOKENS**2), abs=1e-15)
    assert abs(float(fidelity.random_kernel_error[0, 0]) - error) < 0.005
    assert fidelity.summary() == ksvd_fidelity(layer, x, random_samples=2000, seed=3).summary()  # seeded


def test_random_one_dimensional_subspaces_match_the_sphere_closed_form():
    """s = 1: the cosine is |q_1| for q uniform on the sphere S^{N-1}, whose mean is
    Gamma(N/2) / (sqrt(pi) Gamma((N+1)/2))."""
    torch.manual_seed(11)
    layer = KEPSVGPAttention(WIDE, H, num_inducing=1).double()
    fidelity = ksvd_fidelity(layer, _tokens(1, TOKENS, WIDE, seed=12), random_samples=20000)
    expected = math.exp(math.lgamma(TOKENS / 2) - math.lgamma((TOKENS + 1) / 2)) / math.sqrt(math.pi)  # 0.1790
    # standard error sqrt(1/N - expected^2) / sqrt(20000) = 0.0010
    np.testing.assert_allclose(fidelity.random_left_cosine.numpy(), expected, atol=0.005, rtol=0)
    np.testing.assert_allclose(fidelity.random_right_cosine.numpy(), expected, atol=0.005, rtol=0)


# -- the diagnostic separates a layer trained towards the KSVD from its initialisation ---------------------------------
def _train(features: AmortizedAttentionFeatures, x: torch.Tensor, reconstruction: float, steps: int = 150) -> None:
    """Adam on ``reconstruction * ||K - e Lambda^{-1} r^T||_F^2 / ||K||_F^2 + J^2`` (the layer's KSVD penalty at
    weight 1), the kernel frozen: the first term's minimisers are the rank-s truncations (Eckart-Young)."""
    features.kernel.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in features.parameters() if p.requires_grad], lr=3e-2)
    kernel = features.kernel.forward(x.unsqueeze(1), x.unsqueeze(1))
    for _ in range(steps):
        scores = features(x, objective=True, kernel_diag=False)
        approximation = (scores.left_scores / scores.singular_values.unsqueeze(-2)) @ scores.right_scores.mT
        error = (kernel - approximation).pow(2).sum((-2, -1)) / kernel.pow(2).sum((-2, -1))
        loss = reconstruction * error.mean() + scores.objective.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def twenty_tokens() -> tuple[torch.Tensor, AmortizedAttentionFeatures, KSVDFidelity]:
    torch.manual_seed(0)
    features = AmortizedAttentionFeatures(WIDE, H, S).double()
    x = _tokens(4, TOKENS, WIDE, seed=1)
    return x, features, ksvd_fidelity(features, x)


def test_the_diagnostic_separates_a_trained_layer_from_its_initialisation(twenty_tokens):
    x, initial_features, initial = twenty_tokens
    features = AmortizedAttentionFeatures(WIDE, H, S).double()
    features.load_state_dict(initial_features.state_dict())
    _train(features, x, reconstruction=1.0)
    trained = ksvd_fidelity(features, x)
    _assert_kernel_quantities(trained, _dense_kernel(features, x), S)
    for name in ("optimal_error", "energy", "effective_rank", "random_kernel_error", *RANDOM_FIELDS):
        torch.testing.assert_close(getattr(trained, name), getattr(initial, name), atol=0, rtol=0)  # same kernel
    assert float(trained.effective_rank.mean()) > S  # s is below the kernel's effective rank (about 6.6 here)
    mean = {name: (initial.summary()[name], trained.summary()[name]) for name in initial.summary()}
    # the learned rank-s kernel: from about the zero matrix (error 1.00) to near the truncation (0.43 vs 0.37)
    initial_excess = mean["kernel_error"][0] - mean["optimal_error"][0]
    trained_excess = mean["kernel_error"][1] - mean["optimal_error"][1]
    assert initial_excess > 0.5 and trained_excess < 0.2 * initial_excess
    # its size: from almost nothing (0.015) to near that of the truncation, sqrt(energy) = 0.93 (0.89)
    assert mean["kernel_scale"][0] < 0.05 and abs(mean["kernel_scale"][1] - math.sqrt(mean["energy"][1])) < 0.1
    assert mean["random_kernel_error"][0] > 0.95  # chance: sqrt(1 - 25/400) = 0.968
    # subspaces: initialisation (0.82) above chance (0.42), training (0.93) above initialisation
    for side in ("left", "right"):
        random, (before, after) = mean[f"random_{side}_cosine"][0], mean[f"{side}_cosine"]
        assert random < 0.5 and before > random + 0.25 and after > before + 0.05
    assert mean["max_angle"][1] < mean["max_angle"][0] - 20 and mean["random_max_angle"][0] > 80
    assert mean["singular_value_error"][1] < 0.5 * mean["singular_value_error"][0]
    assert mean["relative_objective"][0] > 0.5 and mean["relative_objective"][1] < 0.05


def test_the_ksvd_penalty_alone_satisfies_j_and_fails_the_diagnostic(twenty_tokens):
    """J^2 alone (J = 0 is necessary, not sufficient): the relative objective falls, but by shrinking the scores: the
    learned kernel collapses, is no closer to K than the zero matrix and its subspaces fall towards chance; the
    diagnostic says so."""
    x, initial_features, initial = twenty_tokens
    features = AmortizedAttentionFeatures(WIDE, H, S).double()
    features.load_state_dict(initial_features.state_dict())
    _train(features, x, reconstruction=0.0)
    trained = ksvd_fidelity(features, x).summary()
    assert trained["relative_objective"] < 0.5 * initial.summary()["relative_objective"]
    assert trained["kernel_error"] > trained["random_kernel_error"]
    assert trained["kernel_scale"] < 0.2 * initial.summary()["kernel_scale"]  # collapsed
    assert trained["left_cosine"] < initial.summary()["left_cosine"] - 0.2
    assert trained["left_cosine"] < trained["random_left_cosine"] + 0.15


def test_other_layers_are_refused():
    from gpattn.attention import SoftmaxAttention

    with pytest.raises(TypeError, match="AttentionKernelEigenFeatures"):
        ksvd_fidelity(SoftmaxAttention(C, H), _tokens(1, LENGTH, C, seed=6).float())
    with pytest.raises(ValueError, match="random_samples"):
        ksvd_fidelity(KEPSVGPAttention(C, H, num_inducing=RANK), _tokens(1, LENGTH, C, seed=6), random_samples=0)
    with pytest.raises(ValueError, match=r"ksvd_fidelity: expected seed to be a non-negative integer at most 2\*\*64"):
        ksvd_fidelity(KEPSVGPAttention(C, H, num_inducing=RANK), _tokens(1, LENGTH, C, seed=6), seed=2**64)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda x, mask: (x.numpy(), None, None), TypeError, r"expected queries to be a torch.Tensor, got ndarray"),
        (lambda x, mask: (x[..., :-1], None, None), ValueError, r"expected queries of shape \(B, N, 8\).*7\)"),
        (lambda x, mask: (x[0], None, None), ValueError, r"expected queries of shape \(B, N, 8\)"),
        (lambda x, mask: (x.float(), None, None), TypeError, r"queries is torch.float32 but the parameters are"),
        (lambda x, mask: (x.clone().fill_(math.nan), None, None), ValueError, r"queries contains NaN or Inf"),
        (lambda x, mask: (x, x[:1], None), ValueError, r"keys must match queries in batch size"),
        (lambda x, mask: (x, None, mask.long()), TypeError, r"expected a boolean key_mask .* got torch.int64"),
        (lambda x, mask: (x, None, mask[:, :-1]), ValueError, r"expected key_mask of shape \(2, 6\) = \(batch, keys\)"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, error, match):
    """The inputs went to the features unchecked (they take the layers' checked tokens): torch's shape and dtype errors
    ("Expected size for first two dimensions of batch2 tensor"), a numpy array failing in torch.full, NaN tokens
    failing in linalg.svd, and an integer mask accepted."""
    torch.manual_seed(6)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK).double()
    x, mask = _tokens(2, LENGTH, C, seed=7), torch.tensor([[True] * LENGTH, [True] * 4 + [False] * 2])
    queries, keys, key_mask = change(x, mask)
    with pytest.raises(error, match=f"^ksvd_fidelity: {match}"):
        ksvd_fidelity(layer, queries, keys, key_mask)
    ksvd_fidelity(layer, x, x.clone(), mask)  # the same call with good inputs runs
