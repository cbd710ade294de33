"""Kernel SVD and the KSVD objective against numpy and hand-written references (docs/math.md identities 1-2),
float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.kernels import CosineFeatureKernel
from gpattn.ksvd import KernelSVD, kernel_svd, ksvd_objective

DTYPE = torch.float64


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _numpy_svd(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-``rank`` SVD by numpy, each pair signed so that the largest-|.| entry of the left vector is positive."""
    left, singular_values, right_h = np.linalg.svd(matrix, full_matrices=False)
    left, singular_values, right = left[:, :rank], singular_values[:rank], right_h[:rank].T
    signs = np.sign(left[np.abs(left).argmax(axis=0), np.arange(rank)])
    return left * signs, singular_values, right * signs


def _assert_adjoint_pairs(matrix: Tensor, svd: KernelSVD, atol: float) -> None:
    """Identity 1: K H_r = H_e Lambda, K^T H_e = H_r Lambda, orthonormal columns."""
    rank = svd.singular_values.shape[-1]
    eye = torch.eye(rank, dtype=DTYPE)
    scaled_left = svd.left * svd.singular_values.unsqueeze(-2)
    scaled_right = svd.right * svd.singular_values.unsqueeze(-2)
    torch.testing.assert_close(matrix @ svd.right, scaled_left, atol=atol, rtol=0)
    torch.testing.assert_close(matrix.mT @ svd.left, scaled_right, atol=atol, rtol=0)
    torch.testing.assert_close(svd.left.mT @ svd.left, eye.expand_as(svd.left.mT @ svd.left), atol=atol, rtol=0)
    torch.testing.assert_close(svd.right.mT @ svd.right, eye.expand_as(svd.right.mT @ svd.right), atol=atol, rtol=0)


@pytest.mark.parametrize("shape", [(7, 7), (9, 5), (4, 8)])
@pytest.mark.parametrize("rank", [1, 3, 4])
def test_exact_svd_identity_1_and_numpy(shape: tuple[int, int], rank: int) -> None:
    matrix = _randn(*shape, seed=shape[0] + 10 * shape[1])
    svd = kernel_svd(matrix, rank)
    num_rows, num_cols = shape
    assert svd.left.shape == (num_rows, rank) and svd.right.shape == (num_cols, rank)
    assert svd.singular_values.shape == (rank,)
    _assert_adjoint_pairs(matrix, svd, atol=1e-12)
    left, singular_values, right = _numpy_svd(matrix.numpy(), rank)
    np.testing.assert_allclose(svd.singular_values.numpy(), singular_values, atol=1e-12, rtol=0)
    np.testing.assert_allclose(svd.left.numpy(), left, atol=1e-10, rtol=0)
    np.testing.assert_allclose(svd.right.numpy(), right, atol=1e-10, rtol=0)
    assert bool((svd.singular_values[:-1] >= svd.singular_values[1:]).all())
    assert bool((svd.singular_values > 0).all())


def test_full_rank_reconstructs_the_matrix() -> None:
    matrix = _randn(6, 4, seed=1)
    svd = kernel_svd(matrix, 4)
    reconstruction = svd.left @ torch.diag(svd.singular_values) @ svd.right.T
    torch.testing.assert_close(reconstruction, matrix, atol=1e-12, rtol=0)


def test_batched_svd() -> None:
    matrix = _randn(2, 3, 6, 5, seed=2)
    svd = kernel_svd(matrix, 3)
    assert svd.left.shape == (2, 3, 6, 3) and svd.singular_values.shape == (2, 3, 3) and svd.right.shape == (2, 3, 5, 3)
    _assert_adjoint_pairs(matrix, svd, atol=1e-12)
    for index in np.ndindex(2, 3):
        left, singular_values, right = _numpy_svd(matrix[index].numpy(), 3)
        np.testing.assert_allclose(svd.singular_values[index].numpy(), singular_values, atol=1e-12, rtol=0)
        np.testing.assert_allclose(svd.left[index].numpy(), left, atol=1e-10, rtol=0)
        np.testing.assert_allclose(svd.right[index].numpy(), right, atol=1e-10, rtol=0)


def test_sign_convention_and_reproducibility() -> None:
    matrix = _randn(8, 6, seed=3)
    svd = kernel_svd(matrix, 4)
    pivots = svd.left.abs().argmax(dim=0)
    assert bool((svd.left[pivots, torch.arange(4)] > 0).all())
    again = kernel_svd(matrix.clone(), 4)
    for first, second in zip(svd, again, strict=True):
        assert torch.equal(first, second)
    # flipping K flips the right vectors only: the left ones keep their (fixed) sign
    negated = kernel_svd(-matrix, 4)
    torch.testing.assert_close(negated.left, svd.left, atol=1e-12, rtol=0)
    torch.testing.assert_close(negated.right, -svd.right, atol=1e-12, rtol=0)
    # so does the transposed problem with roles swapped up to the sign of each pair
    transposed = kernel_svd(matrix.T, 4)
    torch.testing.assert_close(transposed.singular_values, svd.singular_values, atol=1e-12, rtol=0)
    products = (transposed.right * svd.left).sum(0)
    torch.testing.assert_close(products.abs(), torch.ones(4, dtype=DTYPE), atol=1e-10, rtol=0)


def _decaying_matrix(num_rows: int, num_cols: int, seed: int) -> tuple[Tensor, Tensor]:
    """K = U diag(2^-i) V^T with random orthonormal U, V: a spectrum with gap ratio 1/2 between neighbours."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.linalg.qr(torch.randn(num_rows, num_cols, generator=generator, dtype=DTYPE)).Q
    right = torch.linalg.qr(torch.randn(num_cols, num_cols, generator=generator, dtype=DTYPE)).Q
    singular_values = 0.5 ** torch.arange(num_cols, dtype=DTYPE)
    return left @ torch.diag(singular_values) @ right.T, singular_values


def test_randomized_matches_exact_on_decaying_spectrum() -> None:
    # Halko, Martinsson & Tropp (2011, Cor. 10.10): with sketch k = s + p = 15 columns and q = 4 power iterations the
    # range-finder error is ~ sigma_{k+1} (sigma_{k+1} / sigma_s)^(2q) ~ 2^-15 * 2^-80, far below float64 rounding;
    # triplets then agree with the exact ones to rounding times the gap factor 1 / (1 - 1/2). We allow 1e-10.
    matrix, singular_values = _decaying_matrix(30, 20, seed=4)
    exact = kernel_svd(matrix, 5)
    randomized = kernel_svd(matrix, 5, method="randomized", oversampling=10, power_iterations=4, seed=7)
    torch.testing.assert_close(randomized.singular_values, singular_values[:5], atol=1e-10, rtol=0)
    torch.testing.assert_close(randomized.singular_values, exact.singular_values, atol=1e-10, rtol=0)
    # the common sign convention makes the vectors directly comparable
    torch.testing.assert_close(randomized.left, exact.left, atol=1e-10, rtol=0)
    torch.testing.assert_close(randomized.right, exact.right, atol=1e-10, rtol=0)
    _assert_adjoint_pairs(matrix, randomized, atol=1e-10)


def test_randomized_batched() -> None:
    first, _ = _decaying_matrix(12, 10, seed=5)
    second, _ = _decaying_matrix(12, 10, seed=6)
    matrix = torch.stack([first, 3.0 * second])
    randomized = kernel_svd(matrix, 3, method="randomized", oversampling=5, power_iterations=6)
    assert randomized.left.shape == (2, 12, 3)
    torch.testing.assert_close(
        randomized.singular_values[1], 3.0 * 0.5 ** torch.arange(3, dtype=DTYPE), atol=1e-10, rtol=0
    )
    _assert_adjoint_pairs(matrix, randomized, atol=1e-9)


def test_randomized_is_seeded_and_leaves_global_rng_untouched() -> None:
    matrix = _randn(10, 8, seed=8)  # flat spectrum, no power iterations: the sketch shows through
    options = dict(method="randomized", oversampling=0, power_iterations=0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = kernel_svd(matrix, 3, seed=1, **options)
    assert torch.equal(torch.get_rng_state(), state)
    second = kernel_svd(matrix, 3, seed=1, **options)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    other = kernel_svd(matrix, 3, seed=2, **options)
    assert (other.singular_values - first.singular_values).abs().max() > 1e-3
    # even a poor sketch gives orthonormal columns and singular values that never exceed the exact ones
    eye = torch.eye(3, dtype=DTYPE)
    torch.testing.assert_close(first.left.T @ first.left, eye, atol=1e-12, rtol=0)
    torch.testing.assert_close(first.right.T @ first.right, eye, atol=1e-12, rtol=0)
    assert bool((first.singular_values <= kernel_svd(matrix, 3).singular_values + 1e-12).all())


def test_kernel_svd_errors() -> None:
    matrix = _randn(5, 4, seed=9)
    for rank in (5, 0, -1, 2.0, True):
        with pytest.raises(ValueError, match="rank"):
            kernel_svd(matrix, rank)
    with pytest.raises(ValueError, match="rank"):
        kernel_svd(matrix.T, 5, method="randomized")
    for bad in (float("nan"), float("inf")):
        corrupted = matrix.clone()
        corrupted[2, 1] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            kernel_svd(corrupted, 2)
    with pytest.raises(ValueError, match="method"):
        kernel_svd(matrix, 2, method="lanczos")
    with pytest.raises(ValueError, match="shape"):
        kernel_svd(matrix[0], 1)
    with pytest.raises(TypeError):
        kernel_svd(matrix.numpy(), 2)
    with pytest.raises(TypeError):
        kernel_svd(torch.ones(3, 3, dtype=torch.long), 2)


def test_kernel_svd_accepts_numpy_integer_ranks() -> None:
    """A rank read from a NumPy array (e.g. ``np.int64``) is an integer (before: refused as "an integer rank");
    NumPy's bool is not."""
    matrix = _randn(5, 4, seed=10)
    expected = kernel_svd(matrix, 2)
    for rank in (np.int64(2), np.int32(2)):
        result = kernel_svd(matrix, rank)
        for part, reference in zip(result, expected, strict=True):
            assert torch.equal(part, reference)
    refused = r"kernel_svd: expected rank .* to be an integer in \[1, 4\], got (np\.True_|True)"  # NumPy 2 / 1
    with pytest.raises(ValueError, match=refused):
        kernel_svd(matrix, np.bool_(True))


# --- KSVD objective --------------------------------------------------------------------------------------------


def _cosine_features(kernel: CosineFeatureKernel, tokens: Tensor, weight: Tensor) -> Tensor:
    """phi(x) = sqrt(outputscale) W x / ||W x|| from the definition (no lift)."""
    projected = tokens @ weight.T
    return kernel.outputscale.sqrt() * projected / projected.norm(dim=-1, keepdim=True)


def _objective_loop(left_scores, right_scores, left_weights, right_weights, singular_values) -> float:
    """J = 1/2 sum_i e_i^T Lambda^-1 e_i + 1/2 sum_j r_j^T Lambda^-1 r_j - Tr(W_e^T W_r), token by token."""
    inverse = np.diag(1.0 / singular_values)
    total = 0.0
    for score in left_scores:
        total += 0.5 * score @ inverse @ score
    for score in right_scores:
        total += 0.5 * score @ inverse @ score
    return total - np.trace(left_weights.T @ right_weights)


@pytest.mark.parametrize("rank", [2, 4, 6])
def test_objective_vanishes_at_stationary_point_and_primal_equals_dual(rank: int) -> None:
    torch.manual_seed(20)
    kernel = CosineFeatureKernel(4, feature_dim=6).double()
    kernel.outputscale = 1.3
    queries, keys = _randn(7, 4, seed=21), _randn(9, 4, seed=22)
    with torch.no_grad():
        query_features = _cosine_features(kernel, queries, kernel.query_weight)  # Phi_q, (7, 6)
        key_features = _cosine_features(kernel, keys, kernel.key_weight)  # Phi_k, (9, 6)
    matrix = (query_features @ key_features.T).numpy()
    left, singular_values, right = _numpy_svd(matrix, rank)
    left_weights = key_features.numpy().T @ right  # W_e = Phi_k^T H_r
    right_weights = query_features.numpy().T @ left  # W_r = Phi_q^T H_e
    left_scores = query_features.numpy() @ left_weights  # W_e^T phi_q(x_i)
    right_scores = key_features.numpy() @ right_weights
    np.testing.assert_allclose(left_scores, left * singular_values, atol=1e-12, rtol=0)  # e(X) = H_e Lambda
    np.testing.assert_allclose(right_scores, right * singular_values, atol=1e-12, rtol=0)  # r(Z) = H_r Lambda
    objective = ksvd_objective(
        *(torch.from_numpy(a) for a in (left_scores, right_scores, left_weights, right_weights, singular_values))
    )
    assert objective.shape == ()
    assert abs(objective.item()) < 1e-10
    # primal scores equal dual scores for out-of-sample queries and keys
    new_queries, new_keys = _randn(5, 4, seed=23), _randn(3, 4, seed=24)
    with torch.no_grad():
        new_query_features = _cosine_features(kernel, new_queries, kernel.query_weight).numpy()
        new_key_features = _cosine_features(kernel, new_keys, kernel.key_weight).numpy()
        dual_left = kernel(new_queries, keys).numpy() @ right  # kappa(x, Z) H_r
        dual_right = kernel(queries, new_keys).numpy().T @ left  # kappa(X, z)^T H_e
    np.testing.assert_allclose(new_query_features @ left_weights, dual_left, atol=1e-12, rtol=0)
    np.testing.assert_allclose(new_key_features @ right_weights, dual_right, atol=1e-12, rtol=0)


def test_objective_nonzero_for_random_weights_and_matches_loop() -> None:
    generator = np.random.default_rng(30)
    batch, tokens, keys, features, rank = (2, 3), 6, 5, 4, 3
    left_scores = generator.normal(size=(*batch, tokens, rank))
    right_scores = generator.normal(size=(*batch, keys, rank))
    left_weights = generator.normal(size=(*batch, features, rank))
    right_weights = generator.normal(size=(*batch, features, rank))
    singular_values = generator.uniform(0.5, 2.0, size=(*batch, rank))
    arrays = (left_scores, right_scores, left_weights, right_weights, singular_values)
    objective = ksvd_objective(*(torch.from_numpy(a) for a in arrays))
    assert objective.shape == batch
    for index in np.ndindex(*batch):
        expected = _objective_loop(*(a[index] for a in arrays))
        assert abs(objective[index].item() - expected) < 1e-12
        assert abs(expected) > 1e-3


def test_objective_nonzero_after_perturbing_stationary_weights() -> None:
    features = _randn(6, 8, seed=32).numpy()  # Phi_q = Phi_k arbitrary: K = Phi Phi^T
    matrix = features @ features.T
    left, singular_values, right = _numpy_svd(matrix, 3)
    left_weights, right_weights = features.T @ right, features.T @ left
    arrays = [features @ left_weights, features @ right_weights, left_weights, right_weights, singular_values]
    assert abs(ksvd_objective(*(torch.from_numpy(a) for a in arrays)).item()) < 1e-10
    arrays[2] = 1.5 * left_weights  # J = (1.5^2 / 2 + 1 / 2 - 1.5) Tr(Lambda) = Tr(Lambda) / 8
    arrays[0] = features @ arrays[2]
    objective = ksvd_objective(*(torch.from_numpy(a) for a in arrays)).item()
    assert abs(objective - _objective_loop(*arrays)) < 1e-12
    np.testing.assert_allclose(objective, singular_values.sum() / 8, atol=1e-10, rtol=0)


def test_randomized_options_are_validated():
    """A negative oversampling shrank the sketch below the rank: fewer triplets than asked, silently; other bad
    options failed in torch's words (or not at all, a bool power count); NumPy integers and floats are numbers."""
    left_factor, right_factor = _randn(7, 3, seed=20), _randn(6, 3, seed=21)
    matrix = left_factor @ right_factor.T  # rank 3: the randomised SVD is exact
    exact = kernel_svd(matrix, 3)
    for option, bad in [
        ("oversampling", -1),
        ("oversampling", 1.5),
        ("power_iterations", -1),
        ("power_iterations", True),
        ("seed", 1.5),
        ("seed", 2**64),
    ]:
        with pytest.raises(ValueError, match=f"kernel_svd: expected {option} to be"):
            kernel_svd(matrix, 3, method="randomized", **{option: bad})
    with pytest.raises(TypeError, match="kernel_svd: expected seed"):
        kernel_svd(matrix, 3, seed="0")
    svd = kernel_svd(matrix, 3, method="randomized", oversampling=0, power_iterations=np.int64(2), seed=np.int64(5))
    assert svd.left.shape == (7, 3) and svd.singular_values.shape == (3,) and svd.right.shape == (6, 3)
    torch.testing.assert_close(svd.singular_values, torch.linalg.svdvals(matrix)[:3], atol=1e-12, rtol=0)
    for part, reference in zip(svd, exact, strict=True):
        torch.testing.assert_close(part, reference, atol=1e-10, rtol=0)
    same = kernel_svd(matrix, 3, method="randomized", oversampling=0, power_iterations=2, seed=5)
    for part, reference in zip(svd, same, strict=True):
        assert torch.equal(part, reference)
    gradients = []
    for tolerance in (np.float32(0.25), 0.25):  # the same broadening of the backward pass
        leaf = matrix.clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(kernel_svd(leaf, 2, gradient_tolerance=tolerance).left.sum(), leaf)
        gradients.append(gradient)
    assert torch.equal(*gradients)
