"""The kernel-eigen strategy and the pair SVGP against dense references (docs/math.md section 3, identities 4, 6-8, 10).

Every reference is computed densely in this file: the cosine kernel from its definition, the KSVD by numpy (signed
by the convention of docs/math.md section 2), exact GP posteriors by linear algebra and by GPyTorch's ``ExactGP``, KL
divergences by ``torch.distributions``.
"""

from __future__ import annotations

import math
from unittest import mock

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.variational import CholeskyVariationalDistribution, MeanFieldVariationalDistribution
from linear_operator.operators import LowRankRootAddedDiagLinearOperator, LowRankRootLinearOperator
from torch import Tensor

from gpattn.features import KernelEigenFeatures
from gpattn.kernels import CosineFeatureKernel, InducedKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.variational import KernelEigenPairVariationalStrategy, KernelEigenVariationalStrategy

DTYPE = torch.float64
ATOL = 1e-8
NOISE = 0.05


def _tokens(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _cosine_kernel(feature_dim: int = 12) -> CosineFeatureKernel:
    torch.manual_seed(7)
    kernel = CosineFeatureKernel(3, feature_dim=feature_dim, lift="rff", lift_dim=16, seed=2).double()
    kernel.outputscale = 1.5
    kernel.lift.initialize(raw_lengthscale=kernel.lift.raw_lengthscale_constraint.inverse_transform(torch.tensor(0.5)))
    return kernel


def _dense(kernel: CosineFeatureKernel, x: Tensor, z: Tensor) -> np.ndarray:
    """kappa(x, z) = outputscale <W_q g(x) / ||.||, W_k g(z) / ||.||> with the random Fourier lift g."""
    lift = kernel.lift
    with torch.no_grad():

        def feature(tokens: Tensor, weight: Tensor) -> Tensor:
            lifted = math.sqrt(2.0 / lift.output_dim) * torch.cos(
                tokens @ lift.frequencies.T / lift.lengthscale + lift.phases
            )
            projected = lifted @ weight.T
            return projected / projected.norm(dim=-1, keepdim=True)

        return (kernel.outputscale * feature(x, kernel.query_weight) @ feature(z, kernel.key_weight).T).numpy()


def _numpy_svd(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-``rank`` SVD, each pair signed so that the largest-|.| entry of the left vector is positive."""
    left, singular_values, right_h = np.linalg.svd(matrix, full_matrices=False)
    left, singular_values, right = left[:, :rank], singular_values[:rank], right_h[:rank].T
    signs = np.sign(left[np.abs(left).argmax(axis=0), np.arange(rank)])
    return left * signs, singular_values, right * signs


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _random_q(rank: int, seed: int, batch_shape: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """A random mean and lower-triangular Cholesky factor (positive diagonal) of q(u)."""
    generator = np.random.default_rng(seed)
    mean = generator.normal(size=(*batch_shape, rank))
    chol = np.tril(generator.normal(scale=0.4, size=(*batch_shape, rank, rank)), -1)
    chol = chol + np.eye(rank) * generator.uniform(0.3, 1.2, size=(*batch_shape, 1, rank))
    return mean, chol


def _set_q(strategy: KernelEigenVariationalStrategy, mean: np.ndarray, chol: np.ndarray) -> None:
    """Write q(u) = N(mean, chol chol^T) into a strategy and mark it initialised (else the first call resets it)."""
    distribution = strategy._variational_distribution
    with torch.no_grad():
        distribution.variational_mean.copy_(torch.from_numpy(mean))
        if isinstance(distribution, MeanFieldVariationalDistribution):
            distribution._variational_stddev.copy_(torch.from_numpy(np.diagonal(chol, axis1=-2, axis2=-1).copy()))
        else:
            distribution.chol_variational_covar.copy_(torch.from_numpy(chol))
    strategy.variational_params_initialized.fill_(1)


def _set_pair_q(
    strategy: KernelEigenPairVariationalStrategy,
    left: tuple[np.ndarray, np.ndarray],
    right: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Write the stacked q(u) of a pair: the left and right branches on the last batch dimension, or one shared
    posterior (``right=None``)."""
    branches = [left] if right is None else [left, right]
    mean = np.stack([branch[0] for branch in branches], axis=-2)
    chol = np.stack([branch[1] for branch in branches], axis=-3)
    _set_q(strategy, mean, chol)


class SingleBranchSVGP(gpytorch.models.ApproximateGP):
    """One kernel-eigen branch with the asymmetric kernel as ``covar_module``."""

    def __init__(
        self,
        kernel: CosineFeatureKernel,
        landmarks: Tensor,
        rank: int,
        side: str = "left",
        residual: str = "none",
        whiten: bool = False,
        key_landmarks: Tensor | None = None,
        distribution: type = CholeskyVariationalDistribution,
    ):
        features = None
        if key_landmarks is not None:
            features = KernelEigenFeatures(kernel, landmarks, rank, key_landmarks=key_landmarks)
        strategy = KernelEigenVariationalStrategy(
            self, landmarks, distribution(rank), side=side, residual=residual, whiten=whiten, features=features
        )
        super().__init__(strategy)
        self.covar_module = kernel

    def forward(self, x: Tensor) -> MultivariateNormal:
        raise NotImplementedError


class ExactReference(gpytorch.models.ExactGP):
    def __init__(self, train_x: Tensor, train_y: Tensor, covar_module: gpytorch.kernels.Kernel):
        likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        likelihood.noise = torch.tensor(NOISE, dtype=DTYPE)
        super().__init__(train_x, train_y, likelihood)
        self.covar_module = covar_module

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(torch.zeros(x.shape[:-1], dtype=x.dtype), self.covar_module(x))


def _exact_posterior(root_star: np.ndarray, root_data: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Posterior of f = R w, w ~ N(0, I), at R_* given y = R_data w + N(0, NOISE I)."""
    gram = root_data @ root_data.T + NOISE * np.eye(len(y))
    cross = root_star @ root_data.T
    return cross @ np.linalg.solve(gram, y), root_star @ root_star.T - cross @ np.linalg.solve(gram, cross.T)


# --- identity 4: full rank equals the exact GP -----------------------------------------------------------------

CASES = {
    # name: (feature_dim, number of query landmarks, number of key landmarks or None, s = rank K)
    "square_full_rank": (12, 8, None, 8),
    "rank_deficient": (3, 8, None, 3),
    "rectangular": (12, 6, 10, 6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("residual", ["none", "diag"])
def test_full_rank_optimal_q_is_the_exact_gp_identity_4(case: str, side: str, residual: str) -> None:
    feature_dim, num_queries, num_keys, rank = CASES[case]
    kernel = _cosine_kernel(feature_dim)
    landmarks = _tokens(num_queries, 3, seed=1)
    keys = landmarks if num_keys is None else _tokens(num_keys, 3, seed=2)
    model = SingleBranchSVGP(
        kernel, landmarks, rank, side=side, residual=residual, key_landmarks=None if num_keys is None else keys
    ).double()
    matrix = _dense(kernel, landmarks, keys)  # K, (N, M)
    assert np.linalg.matrix_rank(matrix, tol=1e-10) == rank  # s = rank K
    left, singular_values, right = _numpy_svd(matrix, rank)
    x_star = _tokens(5, 3, seed=3)
    if side == "left":  # f_e(x) = kappa(x, Z) w, data at the query landmarks X
        root_star, root_data, vectors, weight_vectors = _dense(kernel, x_star, keys), matrix, left, right
        train_x = landmarks
    else:  # f_r(z) = kappa(X, z)^T w', data at the key landmarks Z
        root_star, root_data, vectors, weight_vectors = _dense(kernel, landmarks, x_star).T, matrix.T, right, left
        train_x = keys
    y = np.random.default_rng(4).normal(size=root_data.shape[0])
    shrink = singular_values**2 / (singular_values**2 + NOISE)
    _set_q(model.variational_strategy, shrink * (vectors.T @ y), np.diag(np.sqrt(NOISE * shrink)))

    exact_mean, exact_covar = _exact_posterior(root_star, root_data, y)
    scores = root_star @ weight_vectors  # e(x) = kappa(x, Z) H_r or r(z) = kappa(X, z)^T H_e
    residual_matrix = root_star @ root_star.T - scores @ scores.T  # k(x, x') - e(x) e(x')^T
    if case == "square_full_rank":
        np.testing.assert_allclose(residual_matrix, 0.0, atol=1e-10)

    output = model(x_star)
    np.testing.assert_allclose(_numpy(output.mean), exact_mean, atol=ATOL, rtol=0)
    expected_covar = exact_covar - residual_matrix  # the low-rank part alone
    if residual == "diag":
        expected_covar = expected_covar + np.diag(np.diag(residual_matrix))
        np.testing.assert_allclose(_numpy(output.variance), np.diag(exact_covar), atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(output.covariance_matrix), expected_covar, atol=ATOL, rtol=0)

    # the second reference: GPyTorch's ExactGP with the induced kernel
    induced = InducedKernel(kernel, landmarks, side=side, key_landmarks=keys)
    reference = ExactReference(train_x, torch.from_numpy(y), induced).double().eval()
    with torch.no_grad():
        exact_output = reference(x_star)
    np.testing.assert_allclose(_numpy(exact_output.mean), exact_mean, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(exact_output.covariance_matrix), exact_covar, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(output.mean), _numpy(exact_output.mean), atol=ATOL, rtol=0)
    if residual == "diag" or case == "square_full_rank":
        np.testing.assert_allclose(_numpy(output.variance), _numpy(exact_output.variance), atol=ATOL, rtol=0)


def test_truncated_rank_is_not_the_exact_gp() -> None:
    """Control for identity 4: with s < rank K the optimal q(u) does not reproduce the exact posterior mean."""
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=1)
    model = SingleBranchSVGP(kernel, landmarks, 4, residual="diag").double()
    matrix = _dense(kernel, landmarks, landmarks)
    left, singular_values, _ = _numpy_svd(matrix, 4)
    y = np.random.default_rng(4).normal(size=8)
    shrink = singular_values**2 / (singular_values**2 + NOISE)
    _set_q(model.variational_strategy, shrink * (left.T @ y), np.diag(np.sqrt(NOISE * shrink)))
    x_star = _tokens(5, 3, seed=3)
    exact_mean, _ = _exact_posterior(_dense(kernel, x_star, landmarks), matrix, y)
    assert np.abs(_numpy(model(x_star).mean) - exact_mean).max() > 1e-3


# --- whitening ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("distribution", [CholeskyVariationalDistribution, MeanFieldVariationalDistribution])
def test_whitened_equals_unwhitened(side: str, distribution: type) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=5)
    matrix = _dense(kernel, landmarks, landmarks)
    left, singular_values, right = _numpy_svd(matrix, 5)
    whitened_mean, whitened_chol = _random_q(5, seed=6)
    if distribution is MeanFieldVariationalDistribution:
        whitened_chol = np.diag(np.diag(whitened_chol))
    models = {}
    for whiten in (False, True):
        model = SingleBranchSVGP(
            kernel, landmarks, 5, side=side, residual="diag", whiten=whiten, distribution=distribution
        ).double()
        if whiten:
            _set_q(model.variational_strategy, whitened_mean, whitened_chol)
        else:  # u = Lambda v: m = Lambda m_v, S = Lambda S_v Lambda
            _set_q(
                model.variational_strategy, singular_values * whitened_mean, singular_values[:, None] * whitened_chol
            )
        models[whiten] = model
    x_star = _tokens(6, 3, seed=7)
    whitened, unwhitened = models[True](x_star), models[False](x_star)
    torch.testing.assert_close(whitened.mean, unwhitened.mean, atol=ATOL, rtol=0)
    torch.testing.assert_close(whitened.covariance_matrix, unwhitened.covariance_matrix, atol=ATOL, rtol=0)
    kl_whitened = models[True].variational_strategy.kl_divergence()
    torch.testing.assert_close(kl_whitened, models[False].variational_strategy.kl_divergence(), atol=ATOL, rtol=0)
    # and both equal the dense whitened formulas: mean e(x) m_v, covariance e S_v e^T + diag(residual)
    root_star = _dense(kernel, x_star, landmarks) if side == "left" else _dense(kernel, landmarks, x_star).T
    scores = root_star @ (right if side == "left" else left)
    residual_diag = (root_star**2).sum(-1) - (scores**2).sum(-1)
    np.testing.assert_allclose(_numpy(whitened.mean), scores @ whitened_mean, atol=ATOL, rtol=0)
    expected_covar = scores @ whitened_chol @ whitened_chol.T @ scores.T + np.diag(residual_diag)
    np.testing.assert_allclose(_numpy(whitened.covariance_matrix), expected_covar, atol=ATOL, rtol=0)
    expected_kl = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(
            torch.from_numpy(whitened_mean), scale_tril=torch.from_numpy(whitened_chol)
        ),
        torch.distributions.MultivariateNormal(torch.zeros(5, dtype=DTYPE), torch.eye(5, dtype=DTYPE)),
    )
    torch.testing.assert_close(kl_whitened.detach(), expected_kl, atol=ATOL, rtol=0)


# --- identity 6: q = p --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [3, 8])
@pytest.mark.parametrize("whiten", [False, True])
def test_q_equals_p_identity_6(rank: int, whiten: bool) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=8)
    model = SingleBranchSVGP(kernel, landmarks, rank, residual="none", whiten=whiten).double()
    left, singular_values, _ = _numpy_svd(_dense(kernel, landmarks, landmarks), rank)
    _set_q(model.variational_strategy, np.zeros(rank), np.eye(rank) if whiten else np.diag(singular_values))
    assert abs(model.variational_strategy.kl_divergence().item()) < 1e-12
    output = model(landmarks)
    np.testing.assert_allclose(_numpy(output.mean), 0.0, atol=1e-14)
    expected = left @ np.diag(singular_values**2) @ left.T  # H_e Lambda^2 H_e^T
    np.testing.assert_allclose(_numpy(output.covariance_matrix), expected, atol=ATOL, rtol=0)


def test_uninitialised_q_starts_at_the_prior() -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=8)
    model = SingleBranchSVGP(kernel, landmarks, 4).double()
    torch.manual_seed(0)
    model(landmarks)
    _, singular_values, _ = _numpy_svd(_dense(kernel, landmarks, landmarks), 4)
    q_u = model.variational_strategy.variational_distribution
    np.testing.assert_allclose(_numpy(q_u.covariance_matrix), np.diag(singular_values**2), atol=1e-12, rtol=0)
    assert abs(model.variational_strategy.kl_divergence().item()) < 1e-4  # mean_init_std = 1e-3


# --- identity 7: the KL ------------------------------------------------------------------------------------------


def _dense_kl(mean: np.ndarray, chol: np.ndarray, singular_values: np.ndarray) -> Tensor:
    """KL(N(m, L L^T) || N(0, diag(Lambda^2))) by torch.distributions, batched over leading dimensions."""
    return torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(torch.from_numpy(mean), scale_tril=torch.from_numpy(chol)),
        torch.distributions.MultivariateNormal(
            torch.zeros(len(singular_values), dtype=DTYPE), torch.from_numpy(np.diag(singular_values**2))
        ),
    )


def _closed_form_kl(mean: np.ndarray, chol: np.ndarray, singular_values: np.ndarray) -> float:
    """docs/math.md: 1/2 [Tr(Lambda^-2 S) + m^T Lambda^-2 m - s + sum log lambda^2 - log|S|]."""
    covar, inverse_prior = chol @ chol.T, 1.0 / singular_values**2
    log_det = 2 * np.log(np.abs(np.diag(chol))).sum()
    return 0.5 * (
        (np.diag(covar) * inverse_prior).sum()
        + (mean**2 * inverse_prior).sum()
        - len(mean)
        + np.log(singular_values**2).sum()
        - log_det
    )


@pytest.mark.parametrize("distribution", [CholeskyVariationalDistribution, MeanFieldVariationalDistribution])
@pytest.mark.parametrize("side", ["left", "right"])
def test_kl_identity_7_single_branch(distribution: type, side: str) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=9)
    model = SingleBranchSVGP(kernel, landmarks, 5, side=side, distribution=distribution).double()
    _, singular_values, _ = _numpy_svd(_dense(kernel, landmarks, landmarks), 5)
    mean, chol = _random_q(5, seed=10)
    if distribution is MeanFieldVariationalDistribution:
        chol = np.diag(np.diag(chol))
    _set_q(model.variational_strategy, mean, chol)
    kl = model.variational_strategy.kl_divergence()
    torch.testing.assert_close(kl.detach(), _dense_kl(mean, chol, singular_values), atol=1e-10, rtol=0)
    assert abs(kl.item() - _closed_form_kl(mean, chol, singular_values)) < 1e-10
    assert kl.item() > 0.1


@pytest.mark.parametrize("shared_posterior", [False, True])
@pytest.mark.parametrize("batch_shape", [(), (3,)])
def test_kl_identity_7_pair(shared_posterior: bool, batch_shape: tuple[int, ...]) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=11)
    model = KernelEigenPairSVGP(
        landmarks, kernel, 5, shared_posterior=shared_posterior, batch_shape=torch.Size(batch_shape)
    ).double()
    _, singular_values, _ = _numpy_svd(_dense(kernel, landmarks, landmarks), 5)
    strategy = model.variational_strategy
    left_q, right_q = _random_q(5, seed=12, batch_shape=batch_shape), _random_q(5, seed=13, batch_shape=batch_shape)
    if shared_posterior:
        _set_pair_q(strategy, left_q)
        expected = _dense_kl(*left_q, singular_values)
    else:
        _set_pair_q(strategy, left_q, right_q)
        expected = _dense_kl(*left_q, singular_values) + _dense_kl(*right_q, singular_values)
    model(_tokens(4, 3, seed=14))
    kl = strategy.kl_divergence()
    assert kl.shape == batch_shape
    torch.testing.assert_close(kl.detach(), expected, atol=1e-10, rtol=0)
    assert strategy.variational_distribution.batch_shape == (*batch_shape, 1 if shared_posterior else 2)


# --- the pair model ----------------------------------------------------------------------------------------------


def _pair_reference(kernel, landmarks, x, rank, left_q, right_q, whiten=False):
    """Dense branch means, covariance roots (e Lambda^-1 L) and residual diagonals of the pair at x."""
    left, singular_values, right = _numpy_svd(_dense(kernel, landmarks, landmarks), rank)
    left_root_star, right_root_star = _dense(kernel, x, landmarks), _dense(kernel, landmarks, x).T
    reference = {}
    for side, root_star, vectors, (mean, chol) in (
        ("left", left_root_star, right, left_q),
        ("right", right_root_star, left, right_q),
    ):
        scores = root_star @ vectors
        interp = scores if whiten else scores / singular_values
        reference[side] = dict(
            mean=interp @ mean,
            root=interp @ chol,
            residual=(root_star**2).sum(-1) - (scores**2).sum(-1),
        )
    return reference


@pytest.mark.parametrize("residual", ["none", "diag"])
@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("shared_posterior", [False, True])
def test_pair_sum(residual: str, whiten: bool, shared_posterior: bool) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=15)
    model = KernelEigenPairSVGP(
        landmarks, kernel, 4, whiten=whiten, residual=residual, shared_posterior=shared_posterior
    ).double()
    left_q = _random_q(4, seed=16)
    right_q = left_q if shared_posterior else _random_q(4, seed=17)
    _set_pair_q(model.variational_strategy, left_q, None if right_q is left_q else right_q)
    x = _tokens(6, 3, seed=18)
    ref = _pair_reference(kernel, landmarks, x, 4, left_q, right_q, whiten)
    output = model(x)
    assert isinstance(output, MultivariateNormal) and not isinstance(output, MultitaskMultivariateNormal)
    np.testing.assert_allclose(_numpy(output.mean), ref["left"]["mean"] + ref["right"]["mean"], atol=ATOL, rtol=0)
    if shared_posterior:  # (e + r) Lambda^-1 S Lambda^-1 (e + r)^T
        root = ref["left"]["root"] + ref["right"]["root"]
        expected = root @ root.T
    else:  # independent posteriors: the covariances add
        expected = ref["left"]["root"] @ ref["left"]["root"].T + ref["right"]["root"] @ ref["right"]["root"].T
    residual_diag = ref["left"]["residual"] + ref["right"]["residual"]
    assert residual_diag.min() > 1e-4  # s = 4 < rank K: a genuine residual
    if residual == "diag":
        expected = expected + np.diag(residual_diag)
    np.testing.assert_allclose(_numpy(output.covariance_matrix), expected, atol=ATOL, rtol=0)
    # each branch alone, without the prior mean
    for side in ("left", "right"):
        branch = model.branch(x, side)
        np.testing.assert_allclose(_numpy(branch.mean), ref[side]["mean"], atol=ATOL, rtol=0)
        branch_covar = ref[side]["root"] @ ref[side]["root"].T
        if residual == "diag":
            branch_covar = branch_covar + np.diag(ref[side]["residual"])
        np.testing.assert_allclose(_numpy(branch.covariance_matrix), branch_covar, atol=ATOL, rtol=0)


def test_pair_sum_with_mean_module_and_batch() -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=19)
    mean_module = gpytorch.means.ConstantMean()
    model = KernelEigenPairSVGP(landmarks, kernel, 3, mean_module=mean_module, batch_shape=torch.Size([2])).double()
    with torch.no_grad():
        mean_module.constant.fill_(0.7)
    left_q, right_q = _random_q(3, seed=20, batch_shape=(2,)), _random_q(3, seed=21, batch_shape=(2,))
    _set_pair_q(model.variational_strategy, left_q, right_q)
    x = _tokens(5, 3, seed=22)
    output = model(x)
    assert output.mean.shape == (2, 5) and output.covariance_matrix.shape == (2, 5, 5)
    for batch in range(2):
        ref = _pair_reference(kernel, landmarks, x, 3, [a[batch] for a in left_q], [a[batch] for a in right_q])
        expected_mean = ref["left"]["mean"] + ref["right"]["mean"] + 0.7
        np.testing.assert_allclose(_numpy(output.mean[batch]), expected_mean, atol=ATOL, rtol=0)
        expected = sum(ref[side]["root"] @ ref[side]["root"].T + np.diag(ref[side]["residual"]) for side in ref)
        np.testing.assert_allclose(_numpy(output.covariance_matrix[batch]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shared_posterior", [False, True])
def test_pair_concat(shared_posterior: bool) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=23)
    model = KernelEigenPairSVGP(landmarks, kernel, 4, merge="concat", shared_posterior=shared_posterior).double()
    left_q = _random_q(4, seed=24)
    right_q = left_q if shared_posterior else _random_q(4, seed=25)
    _set_pair_q(model.variational_strategy, left_q, None if right_q is left_q else right_q)
    x = _tokens(6, 3, seed=26)
    ref = _pair_reference(kernel, landmarks, x, 4, left_q, right_q)
    output = model(x)
    assert isinstance(output, MultitaskMultivariateNormal) and output.num_tasks == 2
    assert output.mean.shape == (6, 2)
    np.testing.assert_allclose(_numpy(output.mean[:, 0]), ref["left"]["mean"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(output.mean[:, 1]), ref["right"]["mean"], atol=ATOL, rtol=0)
    left_root, right_root = ref["left"]["root"], ref["right"]["root"]
    cross = left_root @ right_root.T if shared_posterior else np.zeros((6, 6))
    expected = np.block(
        [
            [left_root @ left_root.T + np.diag(ref["left"]["residual"]), cross],
            [cross.T, right_root @ right_root.T + np.diag(ref["right"]["residual"])],
        ]
    )
    # the joint covariance of (F_e(x_1..x_N), F_r(x_1..x_N)), tasks as blocks
    np.testing.assert_allclose(_numpy(output.lazy_covariance_matrix.to_dense()), expected, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(output.variance[:, 0]), np.diag(expected)[:6], atol=ATOL, rtol=0)
    np.testing.assert_allclose(_numpy(output.variance[:, 1]), np.diag(expected)[6:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("merge", ["sum", "concat"])
def test_pair_prior_is_the_dense_induced_kernel(merge: str) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=27)
    model = KernelEigenPairSVGP(landmarks, kernel, 4, merge=merge).double()
    x = _tokens(6, 3, seed=28)
    left_covar = _dense(kernel, x, landmarks) @ _dense(kernel, x, landmarks).T  # k_e = kappa(x, Z) kappa(x', Z)^T
    right_covar = _dense(kernel, landmarks, x).T @ _dense(kernel, landmarks, x)  # k_r = kappa(X, x)^T kappa(X, x')
    prior = model(x, prior=True)
    np.testing.assert_allclose(_numpy(prior.mean), 0.0, atol=1e-14)
    if merge == "sum":
        np.testing.assert_allclose(_numpy(prior.covariance_matrix), left_covar + right_covar, atol=ATOL, rtol=0)
    else:
        expected = np.block([[left_covar, np.zeros((6, 6))], [np.zeros((6, 6)), right_covar]])
        np.testing.assert_allclose(_numpy(prior.lazy_covariance_matrix.to_dense()), expected, atol=ATOL, rtol=0)


# --- identity 8: joint sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", ["none", "diag"])
def test_joint_sampling_identity_8(residual: str) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=29)
    model = KernelEigenPairSVGP(landmarks, kernel, 2, residual=residual).double()
    left_q, right_q = _random_q(2, seed=30), _random_q(2, seed=31)
    _set_pair_q(model.variational_strategy, left_q, right_q)
    x = _tokens(6, 3, seed=32)
    ref = _pair_reference(kernel, landmarks, x, 2, left_q, right_q)
    mean = ref["left"]["mean"] + ref["right"]["mean"]
    root = np.concatenate([ref["left"]["root"], ref["right"]["root"]], axis=-1)  # rank 2s = 4 < N = 6
    covar = root @ root.T + (np.diag(ref["left"]["residual"] + ref["right"]["residual"]) if residual == "diag" else 0)
    num_samples = 20000
    torch.manual_seed(33)
    with torch.no_grad():
        samples = model(x).rsample(torch.Size([num_samples])).numpy()
    assert samples.shape == (num_samples, 6)
    centred = samples - samples.mean(0)
    empirical = centred.T @ centred / (num_samples - 1)
    # Monte-Carlo: Var(hat C_ij) = (C_ii C_jj + C_ij^2) / n for Gaussian samples
    stderr = np.sqrt((np.outer(np.diag(covar), np.diag(covar)) + covar**2) / num_samples)
    assert np.abs(empirical - covar).max() < 5 * stderr.max()
    assert np.linalg.norm(empirical - covar) / np.linalg.norm(covar) < 0.05
    assert np.abs(samples.mean(0) - mean).max() < 5 * np.sqrt(np.diag(covar).max() / num_samples)
    if residual == "none":  # joint, not per-token: every draw lies in the 4-dimensional span of the root
        deviations = samples - mean
        projector = root @ np.linalg.pinv(root)
        np.testing.assert_allclose(deviations @ projector.T, deviations, atol=1e-9)


# --- identity 10 and structure -------------------------------------------------------------------------------------

FACTORISATIONS = ("cholesky_ex", "cholesky", "inv")


def _mocked_factorisations():
    """Patch torch.linalg.cholesky_ex / cholesky / inv and torch.cholesky_inverse with call-counting wrappers."""
    mocks = {name: mock.MagicMock(wraps=getattr(torch.linalg, name)) for name in FACTORISATIONS}
    mocks["cholesky_inverse"] = mock.MagicMock(wraps=torch.cholesky_inverse)
    patches = [mock.patch.object(torch.linalg, name, mocks[name]) for name in FACTORISATIONS]
    patches.append(mock.patch.object(torch, "cholesky_inverse", mocks["cholesky_inverse"]))
    return mocks, patches


def _elbo_step(model: gpytorch.models.ApproximateGP, x: Tensor, y: Tensor) -> None:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(y))
    loss = -mll(model(x), y)
    loss.backward()


@pytest.mark.parametrize("distribution", ["cholesky", "mean_field"])
@pytest.mark.parametrize("mode", ["exact", "primal"])
@pytest.mark.parametrize("shared_posterior", [False, True])
def test_no_cholesky_or_inverse_identity_10(distribution: str, mode: str, shared_posterior: bool) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=34)
    model = KernelEigenPairSVGP(
        landmarks, kernel, 4, mode=mode, variational_distribution=distribution, shared_posterior=shared_posterior
    ).double()
    x, y = _tokens(7, 3, seed=35), _tokens(7, seed=36)
    mocks, patches = _mocked_factorisations()
    for patch in patches:
        patch.start()
    try:
        _elbo_step(model, x, y)  # initialises q(u), forward, KL, backward
        _elbo_step(model, x, y)
    finally:
        for patch in patches:
            patch.stop()
    for name, wrapped in mocks.items():
        assert wrapped.call_count == 0, name
    assert model.variational_strategy._variational_distribution.variational_mean.grad is not None
    assert kernel.query_weight.grad is not None and kernel.query_weight.grad.abs().max() > 0


def test_the_mocks_catch_a_standard_svgp() -> None:
    """Control for identity 10: GPyTorch's own whitened SVGP does factorise K_uu under the same mocks."""

    class StandardSVGP(gpytorch.models.ApproximateGP):
        def __init__(self, inducing_points: Tensor):
            distribution = CholeskyVariationalDistribution(inducing_points.shape[0])
            super().__init__(gpytorch.variational.VariationalStrategy(self, inducing_points, distribution))
            self.covar_module = gpytorch.kernels.RBFKernel()

        def forward(self, x: Tensor) -> MultivariateNormal:
            return MultivariateNormal(torch.zeros(x.shape[:-1], dtype=x.dtype), self.covar_module(x))

    model = StandardSVGP(_tokens(6, 3, seed=37)).double()
    mocks, patches = _mocked_factorisations()
    for patch in patches:
        patch.start()
    try:
        _elbo_step(model, _tokens(7, 3, seed=38), _tokens(7, seed=39))
    finally:
        for patch in patches:
            patch.stop()
    assert mocks["cholesky_ex"].call_count + mocks["cholesky"].call_count > 0


@pytest.mark.parametrize("residual", ["none", "diag"])
@pytest.mark.parametrize("merge", ["sum", "concat"])
def test_structured_covariance_is_returned(residual: str, merge: str) -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=40)
    expected_type = LowRankRootAddedDiagLinearOperator if residual == "diag" else LowRankRootLinearOperator
    model = KernelEigenPairSVGP(landmarks, kernel, 4, merge=merge, residual=residual).double()
    x = _tokens(6, 3, seed=41)
    assert type(model(x).lazy_covariance_matrix) is expected_type
    single = SingleBranchSVGP(kernel, landmarks, 4, residual=residual).double()
    assert type(single(x).lazy_covariance_matrix) is expected_type
    assert type(model(x, prior=True).lazy_covariance_matrix) is LowRankRootLinearOperator


def test_parameter_changes_reach_the_predictions() -> None:
    """The memoised KSVD and q(u) are refreshed by every training call and by eval(): no stale decomposition."""
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=42)
    model = KernelEigenPairSVGP(landmarks, kernel, 4).double()
    left_q, right_q = _random_q(4, seed=43), _random_q(4, seed=44)
    _set_pair_q(model.variational_strategy, left_q, right_q)
    x = _tokens(6, 3, seed=45)
    model.train()
    for step in range(3):
        with torch.no_grad():  # an optimiser step on the kernel and on q(u)
            kernel.query_weight.add_(0.2 * _tokens(*kernel.query_weight.shape, seed=46 + step))
            model.variational_strategy._variational_distribution.variational_mean[..., 0, :].add_(0.1)  # left branch
        left_q = (left_q[0] + 0.1, left_q[1])
        if step == 2:
            model.eval()
        ref = _pair_reference(kernel, landmarks, x, 4, left_q, right_q)
        with torch.no_grad():
            output = model(x)
        np.testing.assert_allclose(_numpy(output.mean), ref["left"]["mean"] + ref["right"]["mean"], atol=ATOL, rtol=0)
        expected = sum(ref[side]["root"] @ ref[side]["root"].T + np.diag(ref[side]["residual"]) for side in ref)
        np.testing.assert_allclose(_numpy(output.covariance_matrix), expected, atol=ATOL, rtol=0)


def test_primal_mode_training_call_refreshes_the_ksvd_penalty() -> None:
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=50)
    model = KernelEigenPairSVGP(landmarks, kernel, 4, mode="primal", ksvd_weight=3.0, learn_inducing_locations=False)
    model = model.double()
    features = model.features
    with torch.no_grad():
        features.left_weights.add_(0.2 * _tokens(12, 4, seed=51))
    # J from its definition with dense features: phi rows of kappa = Phi_q Phi_k^T, token sums
    with torch.no_grad():
        query_features, key_features = kernel.query_features(landmarks), kernel.key_features(landmarks)
    left_scores = _numpy(query_features) @ _numpy(features.left_weights)
    right_scores = _numpy(key_features) @ _numpy(features.right_weights)
    singular_values = _numpy(features.singular_values)
    objective = (
        0.5 * (left_scores**2 / singular_values).sum()
        + 0.5 * (right_scores**2 / singular_values).sum()
        - np.trace(_numpy(features.left_weights).T @ _numpy(features.right_weights))
    )
    assert abs(objective) > 1e-2
    model.train()
    model(_tokens(5, 3, seed=52))
    penalty = sum(term.loss() for term in model.added_loss_terms())
    assert abs(penalty.item() - 3.0 * objective**2) < 1e-10
    # and the ELBO subtracts it: -ELBO(primal) - (-ELBO without the penalty) = eta J^2
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    x, y = _tokens(5, 3, seed=52), _tokens(5, seed=53)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=5)
    loss = -mll(model(x), y)
    output = model(x)
    expected = -likelihood.expected_log_prob(y, output).sum() / 5 + model.variational_strategy.kl_divergence() / 5
    assert abs((loss - expected).item() - 3.0 * objective**2) < 1e-10


def test_tied_kernel_gives_identical_branches_identity_9() -> None:
    torch.manual_seed(7)
    kernel = CosineFeatureKernel(3, feature_dim=12, tie=True, lift="rff", lift_dim=16, seed=2).double()
    landmarks = _tokens(8, 3, seed=54)
    model = KernelEigenPairSVGP(landmarks, kernel, 4, shared_posterior=True, merge="concat").double()
    _set_pair_q(model.variational_strategy, _random_q(4, seed=55))
    x = _tokens(6, 3, seed=56)
    output = model(x)
    torch.testing.assert_close(output.mean[:, 0], output.mean[:, 1], atol=ATOL, rtol=0)
    covar = output.lazy_covariance_matrix.to_dense()
    left_block, cross_block, right_block = covar[:6, :6], covar[:6, 6:], covar[6:, 6:]
    torch.testing.assert_close(right_block, left_block, atol=ATOL, rtol=0)
    # one shared u: F_e and F_r are the same function up to the (independent, diagonal) residuals
    off_diagonal = 1 - torch.eye(6, dtype=DTYPE)
    torch.testing.assert_close(cross_block * off_diagonal, left_block * off_diagonal, atol=ATOL, rtol=0)
    torch.testing.assert_close(cross_block, cross_block.T, atol=ATOL, rtol=0)


@pytest.mark.parametrize("whiten", [False, True])
def test_kl_closed_form_matches_gpytorch_generic_kl_for_natural_distribution(whiten: bool) -> None:
    """The closed-form KL override agrees with GPyTorch's generic ``kl_mvn_mvn`` for a distribution (natural
    parameters) whose covariance is neither diagonal nor given by a Cholesky factor parameter."""
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=21)
    model = SingleBranchSVGP(
        kernel, landmarks, 5, whiten=whiten, distribution=gpytorch.variational.NaturalVariationalDistribution
    ).double()
    model.train()
    model(_tokens(4, 3, seed=22))  # initialises q(u) from the prior
    distribution = model.variational_strategy._variational_distribution
    generator = torch.Generator().manual_seed(23)
    with torch.no_grad():
        distribution.natural_vec.add_(0.3 * torch.randn(distribution.natural_vec.shape, generator=generator))
        step = torch.randn(5, 5, generator=generator, dtype=torch.float64)
        distribution.natural_mat.sub_(0.05 * step @ step.mT)  # stays negative definite
    model(_tokens(4, 3, seed=22))  # a training call drops the memoised q(u)
    strategy = model.variational_strategy
    q_u, p_u = strategy.variational_distribution, strategy.prior_distribution
    reference = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(q_u.mean, q_u.covariance_matrix),
        torch.distributions.MultivariateNormal(p_u.mean, p_u.covariance_matrix),
    )
    kl = strategy.kl_divergence()
    torch.testing.assert_close(kl.detach(), reference, atol=1e-9, rtol=0)
    assert kl.item() > 1e-3
