"""An audit of docs/math.md against independent float64 references: the identities and stated properties that no other
test asserted strongly enough (see each test's docstring for the gap it closes).

The references are computed here: kernels from their definitions, SVDs and eigendecompositions by numpy, KL
divergences by ``torch.distributions``, and the operators the code runs as seen by a dispatch-level spy.
"""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import CholeskyVariationalDistribution, MeanFieldVariationalDistribution
from linear_operator.operators import DiagLinearOperator
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from gpattn.attention import KEPSVGPAttention
from gpattn.attention.sgpa_attention import SGPAAttention
from gpattn.features import KernelEigenFeatures
from gpattn.kernels import CosineFeatureKernel, ExponentialDotProductKernel
from gpattn.ksvd import kernel_svd
from gpattn.mlls import AttentionELBO
from gpattn.models import KernelEigenPairSVGP
from gpattn.variational import KernelEigenVariationalStrategy

DTYPE = torch.float64
ATOL = 1e-10


def _tokens(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _cosine_kernel(tie: bool = False, feature_dim: int = 12) -> CosineFeatureKernel:
    torch.manual_seed(11)
    kernel = CosineFeatureKernel(3, feature_dim=feature_dim, tie=tie, lift="rff", lift_dim=16, seed=5).double()
    kernel.outputscale = 1.4
    kernel.lift.initialize(raw_lengthscale=kernel.lift.raw_lengthscale_constraint.inverse_transform(torch.tensor(0.5)))
    return kernel


def _dense_cosine(kernel: CosineFeatureKernel, x: Tensor, z: Tensor) -> np.ndarray:
    """kappa(x, z) = sigma_f <W_q g(x) / ||.||, W_k g(z) / ||.||> with the random Fourier lift g (definition)."""
    lift = kernel.lift
    with torch.no_grad():

        def feature(tokens: Tensor, weight: Tensor) -> Tensor:
            lifted = math.sqrt(2.0 / lift.output_dim) * torch.cos(
                tokens @ lift.frequencies.T / lift.lengthscale + lift.phases
            )
            projected = lifted @ weight.T
            return projected / projected.norm(dim=-1, keepdim=True)

        key_weight = kernel.query_weight if kernel.tie else kernel.key_weight
        return (kernel.outputscale * feature(x, kernel.query_weight) @ feature(z, key_weight).T).numpy()


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _set_q(strategy: KernelEigenVariationalStrategy, mean: np.ndarray, chol: np.ndarray) -> None:
    """Write q(u) = N(mean, chol chol^T) into a strategy's variational distribution, marked initialised."""
    distribution = strategy._variational_distribution
    with torch.no_grad():
        distribution.variational_mean.copy_(torch.from_numpy(mean))
        if isinstance(distribution, MeanFieldVariationalDistribution):
            distribution._variational_stddev.copy_(torch.from_numpy(np.diagonal(chol, axis1=-2, axis2=-1).copy()))
        else:
            distribution.chol_variational_covar.copy_(torch.from_numpy(chol))
    strategy.variational_params_initialized.fill_(1)


class _Branch(gpytorch.models.ApproximateGP):
    """One kernel-eigen branch over given features (a GPyTorch user's model)."""

    def __init__(self, features: KernelEigenFeatures, side: str, distribution: type, residual: str = "none"):
        q_u = distribution(features.num_inducing)
        super().__init__(
            KernelEigenVariationalStrategy(self, None, q_u, side=side, residual=residual, features=features)
        )

    def forward(self, x: Tensor) -> MultivariateNormal:  # the strategy gives q(f) directly
        raise NotImplementedError


# -- identity 1: the squared adjoint relations and Lambda^2 as eigenvalues, rectangular landmark sets --------------
@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_identity_1_squared_relations_against_numpy_eigh(method: str) -> None:
    """docs/math.md section 2: ``K K^T H_e = H_e Lambda^2`` and ``K^T K H_r = H_r Lambda^2``, with ``Lambda^2`` the top
    eigenvalues of ``K K^T`` by numpy's ``eigh`` (the existing tests assert the first-order pairs only)."""
    kernel = _cosine_kernel()
    queries, keys = _tokens(7, 3, seed=1), _tokens(10, 3, seed=2)
    matrix = torch.from_numpy(_dense_cosine(kernel, queries, keys))
    svd = kernel_svd(matrix, 4, method=method, oversampling=3, power_iterations=8)
    squares = svd.singular_values.pow(2)
    torch.testing.assert_close(matrix @ matrix.T @ svd.left, svd.left * squares, atol=1e-9, rtol=0)
    torch.testing.assert_close(matrix.T @ matrix @ svd.right, svd.right * squares, atol=1e-9, rtol=0)
    eigenvalues = np.linalg.eigvalsh(matrix.numpy() @ matrix.numpy().T)[::-1][:4]
    np.testing.assert_allclose(_numpy(squares), eigenvalues, atol=1e-9, rtol=0)
    assert bool((svd.singular_values[:-1] > svd.singular_values[1:]).all()) and svd.singular_values[-1] > 0


def test_identity_1_and_5_on_rectangular_landmarks() -> None:
    """Sections 2-3 on landmark features with N != M (the existing identity-5 test uses one landmark set):
    ``e(X) = H_e Lambda``, ``r(Z) = H_r Lambda``, ``(e Lambda^-1)^T (e Lambda^-1) = I``, and the residual over the query
    landmarks (left) and over the key landmarks (right) is PSD with trace ``sum_{i>s} lambda_i^2``."""
    kernel = _cosine_kernel()
    queries, keys = _tokens(7, 3, seed=3), _tokens(11, 3, seed=4)
    rank = 3
    features = KernelEigenFeatures(kernel, queries, rank, key_landmarks=keys, learn_landmarks=False)
    matrix = _dense_cosine(kernel, queries, keys)
    all_values = np.linalg.svd(matrix, compute_uv=False)
    assert all_values[rank] > 1e-3  # a genuine tail
    # Lambda^2 = eigenvalues of K K^T (numpy), independent of any SVD sign convention
    np.testing.assert_allclose(
        _numpy(features.singular_values) ** 2, np.linalg.eigvalsh(matrix @ matrix.T)[::-1][:rank], atol=ATOL, rtol=0
    )
    left = _numpy(features.scores(queries, "left"))  # e(X) = K H_r
    right = _numpy(features.scores(keys, "right"))  # r(Z) = K^T H_e
    lam = _numpy(features.singular_values)
    np.testing.assert_allclose((left / lam).T @ (left / lam), np.eye(rank), atol=ATOL, rtol=0)
    np.testing.assert_allclose((right / lam).T @ (right / lam), np.eye(rank), atol=ATOL, rtol=0)
    # K^T (e Lambda^-1) = r (adjointness through the scores alone: K^T H_e = H_r Lambda)
    np.testing.assert_allclose(matrix.T @ (left / lam), right, atol=ATOL, rtol=0)
    np.testing.assert_allclose(matrix @ (right / lam), left, atol=ATOL, rtol=0)
    tail = (all_values[rank:] ** 2).sum()
    for side, gram, scores, points in (
        ("left", matrix @ matrix.T, left, queries),
        ("right", matrix.T @ matrix, right, keys),
    ):
        residual = gram - scores @ scores.T
        assert np.linalg.eigvalsh(residual).min() > -1e-10
        np.testing.assert_allclose(np.trace(residual), tail, atol=ATOL, rtol=0)
        diag = _numpy(features.residual_diag(points, side))
        np.testing.assert_allclose(diag, np.diag(residual), atol=ATOL, rtol=0)
        np.testing.assert_allclose(diag.sum(), tail, atol=ATOL, rtol=0)


# -- identity 6: q = p for the right branch, a mean-field q and the pair -------------------------------------------
@pytest.mark.parametrize("distribution", [CholeskyVariationalDistribution, MeanFieldVariationalDistribution])
@pytest.mark.parametrize("side", ["left", "right"])
def test_identity_6_q_equals_p_each_branch(side: str, distribution: type) -> None:
    """q = p (m = 0, S = Lambda^2): KL = 0 and the predictive covariance at the landmarks of the branch is
    ``H Lambda^2 H^T`` (``H_e`` at the query landmarks, ``H_r`` at the key landmarks). The existing test covers the
    left branch with a Cholesky q(u) only."""
    kernel = _cosine_kernel()
    queries, keys = _tokens(7, 3, seed=5), _tokens(9, 3, seed=6)
    rank = 4
    features = KernelEigenFeatures(kernel, queries, rank, key_landmarks=keys, learn_landmarks=False)
    model = _Branch(features, side, distribution).double()
    left, values, right_h = np.linalg.svd(_dense_cosine(kernel, queries, keys))
    vectors = left[:, :rank] if side == "left" else right_h[:rank].T  # the sign cancels in H Lambda^2 H^T
    values = values[:rank]
    _set_q(model.variational_strategy, np.zeros(rank), np.diag(values))
    kl = model.variational_strategy.kl_divergence()
    assert abs(kl.item()) < 1e-12
    output = model(queries if side == "left" else keys)
    np.testing.assert_allclose(_numpy(output.mean), 0.0, atol=1e-14)
    expected = vectors @ np.diag(values**2) @ vectors.T
    np.testing.assert_allclose(_numpy(output.covariance_matrix), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shared_posterior", [False, True])
def test_identity_6_q_equals_p_for_the_pair(shared_posterior: bool) -> None:
    """q = p for both branches of the pair (one landmark set): KL = 0 and, at the landmarks, the merged covariance is
    ``H_e Lambda^2 H_e^T + H_r Lambda^2 H_r^T`` (independent posteriors) or
    ``(H_e + H_r) Lambda^2 (H_e + H_r)^T`` (one shared u)."""
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=7)
    rank = 4
    model = KernelEigenPairSVGP(
        landmarks, kernel, rank, residual="none", shared_posterior=shared_posterior, learn_inducing_locations=False
    ).double()
    left, values, right_h = np.linalg.svd(_dense_cosine(kernel, landmarks, landmarks))
    left, values, right = left[:, :rank], values[:rank], right_h[:rank].T
    branches = 1 if shared_posterior else 2
    _set_q(model.variational_strategy, np.zeros((branches, rank)), np.stack([np.diag(values)] * branches))
    assert abs(model.variational_strategy.kl_divergence().item()) < 1e-12
    output = model(landmarks)
    if shared_posterior:
        summed = left + right
        expected = summed @ np.diag(values**2) @ summed.T
    else:
        expected = left @ np.diag(values**2) @ left.T + right @ np.diag(values**2) @ right.T
    np.testing.assert_allclose(_numpy(output.covariance_matrix), expected, atol=ATOL, rtol=0)


# -- identity 7: the KL of the whitened pair ------------------------------------------------------------------------
@pytest.mark.parametrize("distribution", ["cholesky", "mean_field"])
@pytest.mark.parametrize("shared_posterior", [False, True])
def test_identity_7_whitened_pair_kl(shared_posterior: bool, distribution: str) -> None:
    """The pair's KL with ``whiten=True`` (prior ``N(0, I)``) by ``torch.distributions``, summed over the branches (one
    term with a shared posterior); the existing pair KL test covers the unwhitened Cholesky case only."""
    kernel = _cosine_kernel()
    model = KernelEigenPairSVGP(
        _tokens(8, 3, seed=20),
        kernel,
        4,
        whiten=True,
        shared_posterior=shared_posterior,
        variational_distribution=distribution,
    ).double()
    branches = 1 if shared_posterior else 2
    generator = np.random.default_rng(21)
    mean = generator.normal(size=(branches, 4))
    chol = np.tril(generator.normal(scale=0.3, size=(branches, 4, 4)), -1)
    chol = chol + np.eye(4) * generator.uniform(0.5, 1.2, size=(branches, 1, 4))
    if distribution == "mean_field":
        chol = np.eye(4) * np.diagonal(chol, axis1=-2, axis2=-1)[:, None, :]
    _set_q(model.variational_strategy, mean, chol)
    prior = torch.distributions.MultivariateNormal(torch.zeros(4, dtype=DTYPE), torch.eye(4, dtype=DTYPE))
    expected = sum(
        torch.distributions.kl_divergence(
            torch.distributions.MultivariateNormal(torch.from_numpy(mean[b]), scale_tril=torch.from_numpy(chol[b])),
            prior,
        )
        for b in range(branches)
    )
    kl = model.variational_strategy.kl_divergence()
    assert kl.item() > 0.1
    torch.testing.assert_close(kl.detach(), expected, atol=1e-10, rtol=0)


# -- identity 9: the symmetric limit of the dual-only exponential kernel --------------------------------------------
def test_identity_9_tied_exponential_kernel() -> None:
    """``W_q = W_k`` for the exponential kernel (dual only; the existing identity-9 tests use the cosine kernel): ``K``
    is symmetric PSD, ``H_e = H_r`` up to sign, ``Lambda`` are its top eigenvalues, and both branches score alike."""
    torch.manual_seed(12)
    kernel = ExponentialDotProductKernel(3, feature_dim=4, tie=True).double()
    landmarks = _tokens(8, 3, seed=8)
    features = KernelEigenFeatures(kernel, landmarks, 4, learn_landmarks=False)
    with torch.no_grad():
        logits = (landmarks @ kernel.query_weight.T) @ (landmarks @ kernel.query_weight.T).T / 2.0
        matrix = (kernel.outputscale * torch.exp(logits)).numpy()
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-14, rtol=0)
    np.testing.assert_allclose(
        _numpy(features.singular_values), np.linalg.eigvalsh(matrix)[::-1][:4], atol=1e-9, rtol=1e-12
    )
    svd = features.decomposition()
    np.testing.assert_allclose(np.abs(_numpy((svd.left * svd.right).sum(0))), np.ones(4), atol=ATOL, rtol=0)
    x = _tokens(5, 3, seed=9)
    torch.testing.assert_close(features.scores(x, "left"), features.scores(x, "right"), atol=1e-9, rtol=1e-12)


# -- identity 10: no factorisation or solve of any kind, seen at the dispatcher -------------------------------------
_FORBIDDEN = (
    "cholesky",  # linalg_cholesky(_ex), cholesky, cholesky_solve, cholesky_inverse
    "inverse",
    "linalg_inv",
    "solve",  # linalg_solve(_ex), _linalg_solve_ex, triangular_solve, linalg_solve_triangular, lu_solve
    "lu_factor",
    "linalg_lu",
    "eigh",
    "pinv",
    "lstsq",
)


class _OperatorSpy(TorchDispatchMode):
    """Records the name of every ATen operator dispatched (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def forbidden(self) -> set[str]:
        return {name for name in self.names if any(word in name for word in _FORBIDDEN)}


def _pair_elbo_step(model: gpytorch.models.ApproximateGP, x: Tensor, y: Tensor) -> None:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(y))
    (-mll(model(x), y)).backward()


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "exact"},
        {"mode": "primal"},
        {"mode": "exact", "variational_distribution": "mean_field", "whiten": True},
        {"mode": "primal", "shared_posterior": True, "merge": "concat"},
    ],
)
def test_identity_10_pair_svgp_dispatches_no_factorisation(options: dict) -> None:
    """Identity 10 for the pair SVGP, forward, KL and backward: no Cholesky, inverse or solve of any kind reaches the
    dispatcher (the existing test patches four Python functions and would miss ``torch.linalg.solve``,
    ``solve_triangular``, ``torch.inverse`` or an operator called from C++)."""
    kernel = _cosine_kernel()
    model = KernelEigenPairSVGP(_tokens(8, 3, seed=10), kernel, 4, **options).double()
    x, y = _tokens(6, 3, seed=11), _tokens(6, seed=12)
    if options.get("merge") == "concat":
        likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
        mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=6)
        with _OperatorSpy() as spy:
            (-mll(model(x), torch.stack([y, y], -1))).backward()
            model.variational_strategy.kl_divergence()
    else:
        with _OperatorSpy() as spy:
            _pair_elbo_step(model, x, y)
            _pair_elbo_step(model, x, y)
    assert spy.forbidden() == set()
    assert "mm" in spy.names or "bmm" in spy.names  # the spy saw the computation


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"features": "exact", "residual": "diag"},
        {"features": "primal_features", "max_len": 5},
        {"shared_posterior": True, "merge": "concat"},
    ],
)
def test_identity_10_kep_attention_dispatches_no_factorisation(options: dict) -> None:
    """Identity 10 for the KEP-SVGP attention layer (training forward with joint sampling, KL, KSVD loss, backward;
    then the posterior in eval mode), which the existing identity-10 test does not cover."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, **options).double()
    x = _tokens(2, 5, 8, seed=13)
    with _OperatorSpy() as spy:
        output = layer.train()(x)
        loss = output.square().mean() + layer.kl_divergence()
        loss = loss + sum(term.loss() for term in layer.added_loss_terms())
        loss.backward()
        layer.posterior(x)
    assert spy.forbidden() == set()
    assert layer.features.kernel.query_weight.grad.abs().max() > 0


def test_the_operator_spy_catches_gpytorch_svgp() -> None:
    """Control for identity 10: GPyTorch's own SVGP factorises K_uu, and the spy sees it."""

    class StandardSVGP(gpytorch.models.ApproximateGP):
        def __init__(self, inducing_points: Tensor):
            distribution = CholeskyVariationalDistribution(inducing_points.shape[0])
            super().__init__(gpytorch.variational.VariationalStrategy(self, inducing_points, distribution))
            self.covar_module = gpytorch.kernels.RBFKernel()

        def forward(self, x: Tensor) -> MultivariateNormal:
            return MultivariateNormal(torch.zeros(x.shape[:-1], dtype=x.dtype), self.covar_module(x))

    model = StandardSVGP(_tokens(6, 3, seed=14)).double()
    with _OperatorSpy() as spy:
        _pair_elbo_step(model, _tokens(7, 3, seed=15), _tokens(7, seed=16))
    assert any("cholesky" in name for name in spy.forbidden())


# -- section 3: the prior and the residual defaults -----------------------------------------------------------------
def test_prior_is_diagonal_lambda_squared_and_residual_defaults() -> None:
    """Section 3: ``p(u) = N(0, DiagLinearOperator(Lambda^2))`` (Lambda from numpy's SVD), and the residual defaults:
    ``"none"`` in attention, ``"diag"`` in the GP models."""
    kernel = _cosine_kernel()
    landmarks = _tokens(8, 3, seed=17)
    model = KernelEigenPairSVGP(landmarks, kernel, 4).double()
    assert model.variational_strategy.residual == "diag"
    prior = model.variational_strategy.prior_distribution
    assert isinstance(prior.lazy_covariance_matrix, DiagLinearOperator)
    values = np.linalg.svd(_dense_cosine(kernel, landmarks, landmarks), compute_uv=False)[:4]
    np.testing.assert_allclose(_numpy(prior.lazy_covariance_matrix.diagonal()), np.stack([values**2] * 2), atol=ATOL)
    np.testing.assert_allclose(_numpy(prior.mean), 0.0, atol=0)
    assert KEPSVGPAttention(8, 2, num_inducing=3).residual == "none"


# -- section 5: the SGPA KL is a whitened Gaussian KL ----------------------------------------------------------------
def test_sgpa_global_kl_is_the_whitened_gaussian_kl() -> None:
    """Section 5: ``1/2 [Tr S - M_g - log|S| + v_b^T K_bb v_b]`` per value dimension is
    ``KL(N(L_bb^T v_b, S) || N(0, I))`` by ``torch.distributions`` (the existing test re-implements the formula)."""
    torch.manual_seed(3)
    layer = SGPAAttention(8, 2, 3).double()
    with torch.no_grad():
        layer.inducing_values.normal_()
        layer.chol_variational_covar.normal_(std=0.3)
    expected = torch.zeros((), dtype=DTYPE)
    with torch.no_grad():
        for head in range(2):
            keys = layer.inducing_keys[head]
            lengthscale, outputscale = layer.lengthscale[head], layer.outputscale[head]
            scaled = keys / lengthscale
            gram = outputscale * torch.exp(-0.5 * (scaled[:, None] - scaled[None]).square().sum(-1))
            gram = gram + layer.jitter * gram.diagonal().mean() * torch.eye(3, dtype=DTYPE)
            chol = torch.linalg.cholesky(gram)
            root = layer.variational_covar_root[head]
            covariance = root @ root.T
            prior = torch.distributions.MultivariateNormal(torch.zeros(3, dtype=DTYPE), torch.eye(3, dtype=DTYPE))
            for value in layer.inducing_values[head].T:  # one value dimension at a time
                posterior = torch.distributions.MultivariateNormal(chol.T @ value, covariance)
                expected = expected + torch.distributions.kl_divergence(posterior, prior)
    kl = layer.kl_divergence()
    assert kl.item() > 0.1
    torch.testing.assert_close(kl.detach(), expected, atol=1e-10, rtol=1e-10)


# -- section 4: the objective of a KEP-SVGP attention model ----------------------------------------------------------
def test_attention_elbo_of_a_kep_layer_is_nll_plus_beta_over_n_kl_plus_eta_j_squared() -> None:
    """Section 4 end to end on a real KEP-SVGP layer: ``loss = NLL + (beta / n) KL + eta sum J^2``, with the KL by
    ``torch.distributions`` and J (sum form) recomputed densely from the layer's parameters."""
    torch.manual_seed(1)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, ksvd_weight=2.0).double()
    head = torch.nn.Linear(8, 3).double()

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.head = layer, head

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.layer(x).mean(1))

    model = Classifier()
    x, targets = _tokens(4, 5, 8, seed=18), torch.tensor([0, 2, 1, 1])
    beta, num_data = 0.7, 50
    torch.manual_seed(2)
    logits = model(x)
    loss = AttentionELBO(model, num_data, beta=beta)(logits, targets)
    # KL by torch.distributions: q(u) = N(m, L L^T) per head, output and branch against N(0, diag(Lambda_h^2))
    q = layer.strategy._variational_distribution
    lam = layer.features.singular_values.detach()  # (H, s)
    mean, chol = q.variational_mean.detach(), q.chol_variational_covar.detach().tril()  # (H, d_out, 2, s[, s])
    kl = torch.zeros((), dtype=DTYPE)
    for h, c, b in np.ndindex(*mean.shape[:3]):
        kl = kl + torch.distributions.kl_divergence(
            torch.distributions.MultivariateNormal(mean[h, c, b], scale_tril=chol[h, c, b]),
            torch.distributions.MultivariateNormal(torch.zeros(3, dtype=DTYPE), torch.diag(lam[h] ** 2)),
        )
    # J per sequence and head, sum form, W_e = Phi_k^T A_e(Z) / N, W_r = Phi_q^T A_r(X) / N (self-attention)
    features, kernel = layer.features, layer.features.kernel
    with torch.no_grad():

        def phi(weight: Tensor) -> Tensor:
            projected = torch.einsum("hpc,bnc->bhnp", weight, x)
            return projected / projected.norm(dim=-1, keepdim=True) * kernel.outputscale.sqrt()[None, :, None, None]

        phi_q, phi_k = phi(kernel.query_weight), phi(kernel.key_weight)
        maps_e = torch.einsum("bnc,hcs->bhns", x, features.left_map) + features.left_bias[None, :, None, :]
        maps_r = torch.einsum("bnc,hcs->bhns", x, features.right_map) + features.right_bias[None, :, None, :]
        weights_e, weights_r = phi_k.mT @ maps_e / 5, phi_q.mT @ maps_r / 5
        e, r = phi_q @ weights_e, phi_k @ weights_r
        objective = (
            0.5 * (e.pow(2) / lam[:, None]).sum((-2, -1))
            + 0.5 * (r.pow(2) / lam[:, None]).sum((-2, -1))
            - (weights_e * weights_r).sum((-2, -1))
        )  # (B, H)
    assert objective.abs().max() > 1e-3
    nll = torch.nn.functional.cross_entropy(logits.detach(), targets)
    parts = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(logits, targets)
    torch.testing.assert_close(parts["kl"].detach(), beta / num_data * kl, atol=1e-10, rtol=0)
    # the layer's penalty: eta J^2 summed over heads, averaged over the sequences of the batch
    torch.testing.assert_close(parts["ksvd"].detach(), 2.0 * objective.pow(2).sum(-1).mean(), atol=1e-10, rtol=0)
    torch.testing.assert_close(loss.detach(), nll + beta / num_data * kl + parts["ksvd"].detach(), atol=1e-10, rtol=0)
