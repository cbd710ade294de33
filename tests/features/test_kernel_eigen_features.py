"""Kernel-eigen features against dense references (docs/math.md identities 1, 3, 5, 9 and the primal mode), float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from gpattn.features import SINGULAR_VALUE_FLOOR, KernelEigenFeatures
from gpattn.kernels import AsymmetricKernel, CosineFeatureKernel, ExponentialDotProductKernel, ShiftedRBFKernel

DTYPE = torch.float64
ATOL = 1e-10


def _tokens(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _cosine_kernel(tie: bool = False, feature_dim: int = 12) -> CosineFeatureKernel:
    torch.manual_seed(3)
    kernel = CosineFeatureKernel(3, feature_dim=feature_dim, tie=tie, lift="rff", lift_dim=16, seed=4).double()
    kernel.outputscale = 1.6
    kernel.lift.initialize(raw_lengthscale=kernel.lift.raw_lengthscale_constraint.inverse_transform(torch.tensor(0.5)))
    return kernel


def _shifted_rbf_kernel() -> ShiftedRBFKernel:
    kernel = ShiftedRBFKernel(3).double()
    with torch.no_grad():
        kernel.shift.copy_(torch.tensor([0.6, -0.4, 0.2], dtype=DTYPE))
    kernel.initialize(raw_lengthscale=kernel.raw_lengthscale_constraint.inverse_transform(torch.full((3,), 1.2)))
    kernel.outputscale = 0.9
    return kernel


def _exponential_kernel() -> ExponentialDotProductKernel:
    torch.manual_seed(5)
    return ExponentialDotProductKernel(3, feature_dim=4).double()


def _dense(kernel: AsymmetricKernel, x: Tensor, z: Tensor) -> np.ndarray:
    """kappa(x, z) recomputed from each kernel's definition (docs/math.md section 1)."""
    with torch.no_grad():
        if isinstance(kernel, CosineFeatureKernel):
            lift = kernel.lift

            def feature(tokens: Tensor, weight: Tensor) -> Tensor:
                lifted = math.sqrt(2.0 / lift.output_dim) * torch.cos(
                    tokens @ lift.frequencies.T / lift.lengthscale + lift.phases
                )
                projected = lifted @ weight.T
                return projected / projected.norm(dim=-1, keepdim=True)

            key_weight = kernel.query_weight if kernel.tie else kernel.key_weight
            matrix = kernel.outputscale * feature(x, kernel.query_weight) @ feature(z, key_weight).T
        elif isinstance(kernel, ShiftedRBFKernel):
            difference = (x[:, None, :] - z[None, :, :] - kernel.shift) / kernel.lengthscale
            matrix = kernel.outputscale * torch.exp(-0.5 * difference.pow(2).sum(-1))
        else:
            logits = (x @ kernel.query_weight.T) @ (z @ kernel.key_weight.T).T / math.sqrt(kernel.feature_dim)
            matrix = kernel.outputscale * torch.exp(logits)
    return matrix.numpy()


def _numpy_svd(matrix: np.ndarray, rank: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-``rank`` SVD, each pair signed so that the largest-|.| entry of the left vector is positive
    (docs/math.md 2)."""
    left, singular_values, right_h = np.linalg.svd(matrix, full_matrices=False)
    rank = len(singular_values) if rank is None else rank
    left, singular_values, right = left[:, :rank], singular_values[:rank], right_h[:rank].T
    signs = np.sign(left[np.abs(left).argmax(axis=0), np.arange(rank)])
    return left * signs, singular_values, right * signs


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


KERNELS = {"cosine": _cosine_kernel, "shifted_rbf": _shifted_rbf_kernel, "exponential": _exponential_kernel}


# --- exact mode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("num_keys", [8, 11])
def test_exact_scores_identity_3(kernel_name: str, num_keys: int) -> None:
    kernel = KERNELS[kernel_name]()
    landmarks, keys = _tokens(8, 3, seed=0), _tokens(num_keys, 3, seed=1)
    key_landmarks = None if num_keys == 8 else keys
    keys = landmarks if key_landmarks is None else keys
    features = KernelEigenFeatures(kernel, landmarks, 4, key_landmarks=key_landmarks, learn_landmarks=False)
    matrix = _dense(kernel, landmarks, keys)
    left, singular_values, right = _numpy_svd(matrix, 4)
    np.testing.assert_allclose(_numpy(features.singular_values), singular_values, atol=ATOL, rtol=0)
    x, z = _tokens(5, 3, seed=2), _tokens(6, 3, seed=3)  # out of sample
    left_scores, right_scores = _numpy(features.scores(x, "left")), _numpy(features.scores(z, "right"))
    assert left_scores.shape == (5, 4) and right_scores.shape == (6, 4)
    # K_fu(x) = e(x) Lambda = kappa(x, Z) K^T H_e and r(z) Lambda = kappa(X, z)^T K H_r
    np.testing.assert_allclose(left_scores * singular_values, _dense(kernel, x, keys) @ matrix.T @ left, atol=ATOL)
    np.testing.assert_allclose(
        right_scores * singular_values, _dense(kernel, landmarks, z).T @ matrix @ right, atol=ATOL
    )
    np.testing.assert_allclose(
        right_scores, _dense(kernel, landmarks, z).T @ left, atol=ATOL
    )  # r(z) = kappa(X, z)^T H_e
    np.testing.assert_allclose(left_scores, _dense(kernel, x, keys) @ right, atol=ATOL)  # e(x) = kappa(x, Z) H_r


def test_a_dtype_change_in_eval_mode_recomputes_the_memoised_ksvd() -> None:
    """The eval-mode memo of the KSVD survived ``.double()``: the next call raised "expected m1 and m2 to have the same
    dtype" (also through a KernelEigenPairSVGP), or with ``.to(device)`` would have mixed devices."""
    kernel = _shifted_rbf_kernel().float()
    landmarks = _tokens(8, 3, seed=0)
    features = KernelEigenFeatures(kernel, landmarks.float(), 4, learn_landmarks=False).eval()
    x = _tokens(5, 3, seed=2)
    features.scores(x.float())  # memoises the float32 KSVD
    features.double()
    left_scores = features.scores(x)
    assert left_scores.dtype == DTYPE and features.singular_values.dtype == DTYPE
    # e(x) = kappa(x, Z) H_r of the (float32-rounded) landmarks, in float64
    landmarks = landmarks.float().double()
    _, singular_values, right = _numpy_svd(_dense(kernel, landmarks, landmarks), 4)
    np.testing.assert_allclose(_numpy(features.singular_values), singular_values, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(left_scores), _dense(kernel, x, landmarks) @ right, atol=ATOL)


def test_every_training_call_decomposes_the_current_landmarks() -> None:
    """Features trained on their own (no strategy to clear the memo) kept the first step's KSVD: the second step's
    backward pass raised "Trying to backward through the graph a second time", and its scores were those of the old
    landmarks."""
    kernel = _shifted_rbf_kernel()
    features = KernelEigenFeatures(kernel, _tokens(8, 3, seed=0), 4).train()
    optimizer = torch.optim.SGD(features.parameters(), lr=0.05)
    x = _tokens(5, 3, seed=2)
    for _ in range(2):
        optimizer.zero_grad()
        left_scores = features.scores(x)
        left_scores.square().sum().backward()
        optimizer.step()
    landmarks = features.landmarks.detach()
    assert not torch.equal(landmarks, _tokens(8, 3, seed=0))  # the steps moved them
    left_scores = features.scores(x)  # a third training call: the KSVD of the landmarks after two steps
    _, singular_values, right = _numpy_svd(_dense(kernel, landmarks, landmarks), 4)
    np.testing.assert_allclose(_numpy(features.singular_values), singular_values, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(left_scores), _dense(kernel, x, landmarks) @ right, atol=ATOL)


@pytest.mark.parametrize("num_keys", [8, 11])
def test_kuu_is_diagonal_lambda_squared_and_the_inducing_covariance(num_keys: int) -> None:
    kernel = _cosine_kernel()
    landmarks, keys = _tokens(8, 3, seed=4), _tokens(num_keys, 3, seed=5)
    keys = landmarks if num_keys == 8 else keys
    features = KernelEigenFeatures(kernel, landmarks, 5, key_landmarks=keys, learn_landmarks=False)
    kuu = features.Kuu()
    assert isinstance(kuu, DiagLinearOperator) and kuu.shape == (5, 5)
    matrix = _dense(kernel, landmarks, keys)
    left, singular_values, right = _numpy_svd(matrix, 5)
    np.testing.assert_allclose(_numpy(kuu.to_dense()), np.diag(singular_values**2), atol=ATOL, rtol=0)
    # K_uu = cov(u_e) = H_e^T (K K^T) H_e, and cov(u_r) = H_r^T (K^T K) H_r
    np.testing.assert_allclose(_numpy(kuu.to_dense()), left.T @ matrix @ matrix.T @ left, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(kuu.to_dense()), right.T @ matrix.T @ matrix @ right, atol=ATOL, rtol=0)
    # identity 1 at the landmarks: (e Lambda^-1)^T (e Lambda^-1) = I and (r Lambda^-1)^T (r Lambda^-1) = I
    left_interp = _numpy(features.scores(landmarks, "left") / features.singular_values)
    right_interp = _numpy(features.scores(keys, "right") / features.singular_values)
    np.testing.assert_allclose(left_interp.T @ left_interp, np.eye(5), atol=ATOL, rtol=0)
    np.testing.assert_allclose(right_interp.T @ right_interp, np.eye(5), atol=ATOL, rtol=0)
    np.testing.assert_allclose(left_interp, left, atol=ATOL, rtol=0)
    np.testing.assert_allclose(right_interp, right, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("rank", [2, 5])
def test_truncated_residual_identity_5(kernel_name: str, rank: int) -> None:
    kernel = KERNELS[kernel_name]()
    landmarks = _tokens(8, 3, seed=6)
    features = KernelEigenFeatures(kernel, landmarks, rank, learn_landmarks=False)
    matrix = _dense(kernel, landmarks, landmarks)
    all_singular_values = np.linalg.svd(matrix, compute_uv=False)
    assert all_singular_values[rank] > 1e-4  # rank K > s: the residual is not zero
    left_scores = _numpy(features.scores(landmarks, "left"))
    residual = matrix @ matrix.T - left_scores @ left_scores.T  # K_ff - Q_ff on the landmarks
    np.testing.assert_allclose(residual, residual.T, atol=ATOL, rtol=0)
    assert np.linalg.eigvalsh(residual).min() > -1e-10
    np.testing.assert_allclose(np.trace(residual), (all_singular_values[rank:] ** 2).sum(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(features.residual_diag(landmarks, "left")), np.diag(residual), atol=ATOL, rtol=0)
    # right branch: K^T K - r r^T
    right_scores = _numpy(features.scores(landmarks, "right"))
    right_residual = matrix.T @ matrix - right_scores @ right_scores.T
    assert np.linalg.eigvalsh(right_residual).min() > -1e-10
    np.testing.assert_allclose(np.trace(right_residual), (all_singular_values[rank:] ** 2).sum(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        _numpy(features.residual_diag(landmarks, "right")), np.diag(right_residual), atol=ATOL, rtol=0
    )
    # out of sample the residual diagonal is still k_e(x, x) - ||e(x)||^2 >= 0
    x = _tokens(5, 3, seed=7)
    cross = _dense(kernel, x, landmarks)
    expected = (cross**2).sum(-1) - (_numpy(features.scores(x, "left")) ** 2).sum(-1)
    assert expected.min() > 0
    np.testing.assert_allclose(_numpy(features.residual_diag(x, "left")), expected, atol=ATOL, rtol=0)


def test_residual_vanishes_at_full_rank() -> None:
    kernel = _cosine_kernel(feature_dim=3)  # rank K = 3 < M
    landmarks = _tokens(8, 3, seed=8)
    assert np.linalg.svd(_dense(kernel, landmarks, landmarks), compute_uv=False)[3] < 1e-12
    features = KernelEigenFeatures(kernel, landmarks, 3, learn_landmarks=False)
    x = _tokens(6, 3, seed=9)
    np.testing.assert_allclose(_numpy(features.residual_diag(x, "left")), np.zeros(6), atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(features.residual_diag(x, "right")), np.zeros(6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_kernel_diag_equals_dense_row_norms(kernel_name: str) -> None:
    kernel = KERNELS[kernel_name]()
    landmarks, keys = _tokens(7, 3, seed=10), _tokens(9, 3, seed=11)
    features = KernelEigenFeatures(kernel, landmarks, 3, key_landmarks=keys, learn_landmarks=False)
    x = _tokens(5, 3, seed=12)
    np.testing.assert_allclose(
        _numpy(features.kernel_diag(x, "left")), (_dense(kernel, x, keys) ** 2).sum(-1), atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(
        _numpy(features.kernel_diag(x, "right")), (_dense(kernel, landmarks, x) ** 2).sum(0), atol=ATOL, rtol=0
    )


def test_batched_features() -> None:
    kernel = CosineFeatureKernel(3, feature_dim=6, batch_shape=torch.Size([2])).double()
    landmarks = _tokens(2, 7, 3, seed=13)
    features = KernelEigenFeatures(kernel, landmarks, 3, learn_landmarks=False)
    x = _tokens(2, 4, 3, seed=14)
    scores = features.scores(x, "left")
    assert scores.shape == (2, 4, 3) and features.singular_values.shape == (2, 3)
    for head in range(2):
        matrix = _numpy(kernel(landmarks, landmarks)[head])
        left, singular_values, right = _numpy_svd(matrix, 3)
        np.testing.assert_allclose(_numpy(features.singular_values[head]), singular_values, atol=ATOL, rtol=0)
        np.testing.assert_allclose(_numpy(scores[head]), _numpy(kernel(x, landmarks)[head]) @ right, atol=ATOL)


# --- primal mode -----------------------------------------------------------------------------------------------


def _primal_objective(kernel: CosineFeatureKernel, features: KernelEigenFeatures) -> float:
    """J (sum form) from the definitions, with Phi recomputed densely through kappa = Phi_q Phi_k^T."""
    query_features = _numpy(kernel.query_features(features.landmarks))
    key_features = _numpy(kernel.key_features(features.key_landmarks))
    left_weights, right_weights = _numpy(features.left_weights), _numpy(features.right_weights)
    inverse = 1.0 / _numpy(features.singular_values)
    left_scores, right_scores = query_features @ left_weights, key_features @ right_weights
    return (
        0.5 * ((left_scores**2) * inverse).sum()
        + 0.5 * ((right_scores**2) * inverse).sum()
        - np.trace(left_weights.T @ right_weights)
    )


def _ksvd_loss(features: KernelEigenFeatures) -> float:
    terms = dict(features.named_added_loss_terms())
    assert set(terms) == {"ksvd_loss"}
    return terms["ksvd_loss"].loss().item()


@pytest.mark.parametrize("num_keys", [8, 10])
def test_primal_mode_starts_at_the_stationary_point(num_keys: int) -> None:
    kernel = _cosine_kernel()
    landmarks, keys = _tokens(8, 3, seed=15), _tokens(num_keys, 3, seed=16)
    keys = landmarks if num_keys == 8 else keys
    features = KernelEigenFeatures(kernel, landmarks, 4, mode="primal", key_landmarks=keys, ksvd_weight=2.5)
    assert features.left_weights.shape == (12, 4) and features.right_weights.shape == (12, 4)
    matrix = _dense(kernel, landmarks, keys)
    left, singular_values, right = _numpy_svd(matrix, 4)
    np.testing.assert_allclose(_numpy(features.singular_values), singular_values, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(features.Kuu().to_dense()), np.diag(singular_values**2), atol=ATOL, rtol=0)
    assert abs(features.ksvd_objective().item()) < 1e-10
    assert abs(_primal_objective(kernel, features)) < 1e-10
    # primal scores W_e^T phi_q(x), W_r^T phi_k(z) equal the exact dual scores, out of sample too
    x, z = _tokens(5, 3, seed=17), _tokens(6, 3, seed=18)
    np.testing.assert_allclose(_numpy(features.scores(x, "left")), _dense(kernel, x, keys) @ right, atol=ATOL)
    np.testing.assert_allclose(_numpy(features.scores(z, "right")), _dense(kernel, landmarks, z).T @ left, atol=ATOL)
    exact = KernelEigenFeatures(kernel, landmarks, 4, key_landmarks=keys)
    torch.testing.assert_close(features.scores(x, "left"), exact.scores(x, "left"), atol=ATOL, rtol=0)
    # the registered penalty is eta J^2 = 0
    assert _ksvd_loss(features) == 0.0


def test_primal_mode_penalty_after_perturbation() -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=19)
    features = KernelEigenFeatures(kernel, landmarks, 4, mode="primal", ksvd_weight=2.5)
    with torch.no_grad():
        features.left_weights.add_(0.3 * _tokens(12, 4, seed=20))
        features.raw_singular_values.add_(0.2)
    expected = _primal_objective(kernel, features)
    assert abs(expected) > 1e-2
    objective = features.ksvd_objective()
    assert abs(objective.item() - expected) < 1e-10
    assert _ksvd_loss(features) == 0.0  # stale until refreshed
    features.refresh_ksvd_loss()
    assert abs(_ksvd_loss(features) - 2.5 * expected**2) < 1e-10
    # the penalty is differentiable in the primal parameters
    features.named_added_loss_terms().__next__()[1].loss().backward()
    assert features.left_weights.grad is not None and features.left_weights.grad.abs().max() > 0


def test_exact_mode_objective_is_zero_and_refresh_is_a_no_op() -> None:
    features = KernelEigenFeatures(_cosine_kernel(), _tokens(6, 3, seed=21), 3)
    assert torch.equal(features.ksvd_objective(), torch.zeros((), dtype=DTYPE))
    features.refresh_ksvd_loss()
    assert list(features.named_added_loss_terms()) == []


# --- symmetric limit -------------------------------------------------------------------------------------------


def test_tied_kernel_identity_9() -> None:
    kernel = _cosine_kernel(tie=True)
    landmarks = _tokens(8, 3, seed=22)
    matrix = _dense(kernel, landmarks, landmarks)
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-14, rtol=0)
    features = KernelEigenFeatures(kernel, landmarks, 5, learn_landmarks=False)
    svd = features.decomposition()
    products = (svd.left * svd.right).sum(0)  # H_e = H_r up to the sign of each pair
    np.testing.assert_allclose(np.abs(_numpy(products)), np.ones(5), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.abs(_numpy(svd.left)), np.abs(_numpy(svd.right)), atol=ATOL, rtol=0)
    # eigenvalues of the symmetric PSD K are its singular values
    np.testing.assert_allclose(_numpy(features.singular_values), np.linalg.eigvalsh(matrix)[::-1][:5], atol=ATOL)
    x = _tokens(6, 3, seed=23)
    torch.testing.assert_close(features.scores(x, "left"), features.scores(x, "right"), atol=ATOL, rtol=0)
    torch.testing.assert_close(features.kernel_diag(x, "left"), features.kernel_diag(x, "right"), atol=ATOL, rtol=0)
    # primal mode in the symmetric limit: W_e = W_r
    primal = KernelEigenFeatures(kernel, landmarks, 5, mode="primal")
    torch.testing.assert_close(primal.left_weights, primal.right_weights, atol=ATOL, rtol=0)


def test_untied_branches_differ() -> None:
    features = KernelEigenFeatures(_cosine_kernel(), _tokens(8, 3, seed=24), 4, learn_landmarks=False)
    x = _tokens(6, 3, seed=25)
    assert (features.scores(x, "left") - features.scores(x, "right")).abs().max() > 1e-3


# --- errors ----------------------------------------------------------------------------------------------------


def test_learn_landmarks_must_be_a_bool() -> None:
    """Truthiness read learn_landmarks="no" as learned landmarks (parameters) without a word."""
    landmarks = _tokens(6, 3, seed=26)
    with pytest.raises(TypeError, match="KernelEigenFeatures: expected learn_landmarks to be True or False, got 'no'"):
        KernelEigenFeatures(_cosine_kernel(), landmarks, 2, learn_landmarks="no")
    features = KernelEigenFeatures(_cosine_kernel(), landmarks, 2, learn_landmarks=np.bool_(False))
    assert "landmarks" not in dict(features.named_parameters())


def test_feature_errors() -> None:
    kernel = _cosine_kernel()
    landmarks, keys = _tokens(6, 3, seed=26), _tokens(4, 3, seed=27)
    for rank in (7, 0, 2.0):
        with pytest.raises(ValueError, match="rank"):
            KernelEigenFeatures(kernel, landmarks, rank)
    with pytest.raises(ValueError, match="rank"):
        KernelEigenFeatures(kernel, landmarks, 5, key_landmarks=keys)
    for dual_only in (_shifted_rbf_kernel(), _exponential_kernel()):
        with pytest.raises(ValueError, match="primal"):
            KernelEigenFeatures(dual_only, landmarks, 2, mode="primal")
    with pytest.raises(ValueError, match="feature_dim"):
        KernelEigenFeatures(_cosine_kernel(feature_dim=3), landmarks, 4, mode="primal")
    with pytest.raises(ValueError, match="mode"):
        KernelEigenFeatures(kernel, landmarks, 2, mode="amortised")
    with pytest.raises(ValueError, match="landmarks"):
        KernelEigenFeatures(kernel, landmarks[0], 1)
    # no landmarks: named as such (it was a rank "in [1, 0]")
    with pytest.raises(ValueError, match=r"expected landmarks of shape \(\.\.\., M, 3\), non-empty, got \(0, 3\)"):
        KernelEigenFeatures(kernel, landmarks[:0], 1)
    with pytest.raises(ValueError, match=r"expected key_landmarks of shape \(\.\.\., M, 3\), non-empty"):
        KernelEigenFeatures(kernel, landmarks, 1, key_landmarks=keys[:0])
    with pytest.raises(TypeError):
        KernelEigenFeatures("cosine", landmarks, 2)
    features = KernelEigenFeatures(kernel, landmarks, 2)
    with pytest.raises(ValueError, match="side"):
        features.scores(landmarks, "up")
    with pytest.raises(ValueError, match="side"):
        features.kernel_diag(landmarks, "both")
    primal = KernelEigenFeatures(kernel, landmarks, 2, mode="primal")
    with pytest.raises(RuntimeError, match="exact mode"):
        primal.decomposition()


def test_primal_residual_is_clamped_at_zero() -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=28)
    features = KernelEigenFeatures(kernel, landmarks, 3, mode="primal")
    with torch.no_grad():
        features.left_weights.mul_(1.1)  # ||e(x)||^2 grows by 21 %, exceeding k_e(x, x) where the fit was good
    x = _tokens(7, 3, seed=29)
    raw = (_dense(kernel, x, landmarks) ** 2).sum(-1) - (_numpy(features.scores(x, "left")) ** 2).sum(-1)
    assert raw.min() < 0 < raw.max()
    np.testing.assert_allclose(_numpy(features.residual_diag(x, "left")), np.maximum(raw, 0.0), atol=ATOL, rtol=0)


# -- degenerate kernels (issue 14): a clear error, never a KL of 1e25 -------------------------------------------------
def test_directions_beyond_the_numerical_rank_are_left_out_consistently() -> None:
    """Duplicated landmarks: 8 landmarks, 4 distinct, num_inducing 8. The 4 numerically zero directions get a zero
    interpolation column and a unit prior, so q(f) is the rank-4 model's and their KL vanishes at q = p; primal mode,
    whose learned Lambda cannot leave a direction out, is an error naming the cause."""
    landmarks = _tokens(4, 3, seed=60).repeat(2, 1)
    kernel = _shifted_rbf_kernel()
    features = KernelEigenFeatures(kernel, landmarks, 8)
    x = _tokens(5, 3, seed=61)
    scores = features(x, kernel_diag=True)
    assert features.numerical_rank == 4 and scores.active.tolist() == [True] * 4 + [False] * 4
    reference = KernelEigenFeatures(kernel, landmarks, 4)(x, kernel_diag=True)
    for side in ("left", "right"):
        torch.testing.assert_close(scores.interp(side)[:, :4], reference.interp(side), atol=ATOL, rtol=0)
        assert (scores.interp(side)[:, 4:] == 0).all()
        torch.testing.assert_close(scores.residual_diag(side), reference.residual_diag(side), atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.prior_variances()[4:], torch.ones(4, dtype=DTYPE), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"numerical rank 3 < num_inducing = 4.*mode='exact'"):
        # no lift: the projections W x of 3-D inputs span at most 3 of the p = 4 feature dimensions, so rank K <= 3
        KernelEigenFeatures(CosineFeatureKernel(3, 4).double(), _tokens(6, 3, seed=62), 4, mode="primal")


def test_learned_singular_values_stay_positive_and_finite_for_any_raw_value() -> None:
    kernel = CosineFeatureKernel(input_dim=2, feature_dim=8, lift="rff", lift_dim=16).double()
    features = KernelEigenFeatures(kernel, _tokens(10, 2, seed=63), 4, mode="primal").double()
    with torch.no_grad():
        features.raw_singular_values.fill_(-1e4)  # a plain softplus underflows to exactly 0 here
    values = features.singular_values
    torch.testing.assert_close(values, torch.full_like(values, SINGULAR_VALUE_FLOOR), rtol=1e-6, atol=0)
    assert torch.isfinite(features.Kuu().inverse().to_dense()).all() and torch.isfinite(features.Kuu().logdet())
