r"""The kernel-eigen strategies and models used the GPyTorch way, in float64, each against an independent reference.

A GPyTorch user builds ``ApproximateGP`` models with batch shapes and multi-output wrappers, trains them with GPyTorch's
marginal log likelihoods and optimisers (``NGD`` with natural variational distributions), toggles its settings, and
reads predictions through ``likelihood(model(x))``. The references here are independent of gpattn's own algebra:

* the kernel :math:`\kappa(x, z) = \sigma_f \exp(-\tfrac12 ((x - z - \delta) / \ell)^2)` of
  :class:`~gpattn.kernels.ShiftedRBFKernel` evaluated in NumPy, its KSVD by ``numpy.linalg.svd`` (signed by the
  convention of docs/math.md section 2: the largest-magnitude entry of each left vector positive), and the predictive
  :math:`q(f)` of docs/math.md section 3 formed densely from them;
* GPyTorch's own ``UnwhitenedVariationalStrategy`` on the equivalent model: with :math:`s = M` the kernel-eigen inducing
  variables :math:`u = H^\top f(Z)` of one branch are an orthogonal change of basis of GPyTorch's :math:`f(Z)` under the
  induced kernel (:class:`~gpattn.kernels.InducedKernel`), so :math:`q(f(Z)) = \mathcal N(\mu(Z) + H m, H S H^\top)`
  gives the same :math:`q(f)`, the same KL and hence the same value of every GPyTorch MLL;
* ``torch.distributions`` for densities and KL divergences, quadrature in NumPy for expectations under the Gaussian
  marginals, torch's finite differences for gradients, per-member models for batches, the dense exact GP for
  ``ExactGP`` on the induced kernel, and the closed-form optimal :math:`q(u)` of a Gaussian likelihood for natural
  gradient descent.

Where GPyTorch itself behaves the same way for its own ``VariationalStrategy`` (settings it does not honour for
variational models, the random copy of ``pyro_sample_from_prior``), the test asserts that gpattn matches GPyTorch. The
``xfail(strict=True)`` tests are known defects, described in their reasons.
"""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.models import ApproximateGP
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    IndependentMultitaskVariationalStrategy,
    LMCVariationalStrategy,
    MeanFieldVariationalDistribution,
    NaturalVariationalDistribution,
    UnwhitenedVariationalStrategy,
    VariationalStrategy,
)
from torch import Tensor

from gpattn.kernels import CosineFeatureKernel, InducedKernel, ShiftedRBFKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.variational import KernelEigenPairVariationalStrategy, KernelEigenVariationalStrategy

DTYPE = torch.float64
NUM_LANDMARKS = 7  # M
RANK = 4  # s < M: the truncated case (the residual matters)
NOISE = 0.1
NUM_DATA = 9


# -- the model, the data and the dense references ---------------------------------------------------------------------
def _kernel(shift: float = 0.4, lengthscale: float = 0.9, outputscale: float = 1.3, batch_shape=()) -> ShiftedRBFKernel:
    kernel = ShiftedRBFKernel(1, shift=shift, lengthscale=lengthscale, batch_shape=torch.Size(batch_shape)).double()
    kernel.outputscale = outputscale
    return kernel


def _landmarks(offset: float = 0.0) -> Tensor:
    return torch.linspace(-2.0, 2.0, NUM_LANDMARKS, dtype=DTYPE).unsqueeze(-1) + offset


def _data(n: int = NUM_DATA) -> tuple[Tensor, Tensor]:
    x = torch.linspace(-2.5, 2.5, n, dtype=DTYPE).unsqueeze(-1)
    return x, torch.sin(2.0 * x).squeeze(-1) + 0.3


def _gaussian_likelihood(noise: float = NOISE, **kwargs) -> gpytorch.likelihoods.GaussianLikelihood:
    likelihood = gpytorch.likelihoods.GaussianLikelihood(**kwargs).double()
    likelihood.noise = torch.tensor(noise, dtype=DTYPE)  # (a Python float would pass through float32)
    return likelihood


class BranchGP(ApproximateGP):
    """One kernel-eigen branch, written as a GPyTorch user writes an SVGP (the strategy reads ``covar_module``)."""

    def __init__(
        self,
        landmarks: Tensor,
        num_inducing: int = RANK,
        side: str = "left",
        whiten: bool = False,
        residual: str = "diag",
        distribution: type = CholeskyVariationalDistribution,
        kernel: ShiftedRBFKernel | None = None,
        mean_module: gpytorch.means.Mean | None = None,
        batch_shape=(),
        learn_inducing_locations: bool = True,
    ):
        q_u = distribution(num_inducing, batch_shape=torch.Size(batch_shape))
        strategy = KernelEigenVariationalStrategy(
            self,
            landmarks,
            q_u,
            side=side,
            whiten=whiten,
            residual=residual,
            learn_inducing_locations=learn_inducing_locations,
        )
        super().__init__(strategy)
        self.covar_module = _kernel() if kernel is None else kernel
        self.mean_module = gpytorch.means.ZeroMean() if mean_module is None else mean_module
        self.double()

    def forward(self, x: Tensor) -> MultivariateNormal:
        raise NotImplementedError


def _set_q(strategy: KernelEigenVariationalStrategy, seed: int = 0) -> None:
    """A random q(u) = N(m, L L^T) on the scale of the prior (so that the KL stays of order one), marked initialised."""
    generator = torch.Generator().manual_seed(seed)
    distribution = strategy._variational_distribution
    with torch.no_grad():
        scale = strategy.prior_distribution.stddev  # (*batch, s)
        mean = distribution.variational_mean
        mean.copy_(scale * torch.randn(mean.shape, generator=generator, dtype=DTYPE))
        if isinstance(distribution, MeanFieldVariationalDistribution):
            stddev = distribution._variational_stddev
            stddev.copy_(scale * (0.3 + torch.rand(stddev.shape, generator=generator, dtype=DTYPE)))
        else:
            factor = distribution.chol_variational_covar
            lower = 0.3 * torch.randn(factor.shape, generator=generator, dtype=DTYPE).tril(-1)
            diagonal = 0.3 + torch.rand(factor.shape[:-1], generator=generator, dtype=DTYPE)
            factor.copy_(scale.unsqueeze(-1) * (lower + torch.diag_embed(diagonal)))
    strategy.variational_params_initialized.fill_(1)


def _kappa(kernel: ShiftedRBFKernel, x: Tensor, z: Tensor) -> np.ndarray:
    """kappa(x, z) = sigma_f exp(-((x - z - delta) / ell)^2 / 2) for 1-D points, in NumPy (one unbatched kernel)."""
    with torch.no_grad():
        shift, lengthscale = kernel.shift.item(), kernel.lengthscale.item()
        outputscale = kernel.outputscale.item()
    diff = x.detach().numpy()[:, 0][:, None] - z.detach().numpy()[:, 0][None, :] - shift
    return outputscale * np.exp(-0.5 * (diff / lengthscale) ** 2)


def _numpy_svd(matrix: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    left, singular_values, right_h = np.linalg.svd(matrix)
    left, singular_values, right = left[:, :rank], singular_values[:rank], right_h[:rank].T
    signs = np.sign(left[np.abs(left).argmax(axis=0), np.arange(rank)])
    return left * signs, singular_values, right * signs


def _dense_branch(
    kernel: ShiftedRBFKernel, landmarks: Tensor, x: Tensor, rank: int, side: str, whiten: bool, residual: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The interpolation A (e Lambda^{-1}, or e when whitened; r for the right side), the residual diagonal
    k(x, x) - ||scores||^2 (zeros when dropped), and Lambda."""
    left, singular_values, right = _numpy_svd(_kappa(kernel, landmarks, landmarks), rank)
    cross = _kappa(kernel, x, landmarks) if side == "left" else _kappa(kernel, landmarks, x).T
    scores = cross @ (right if side == "left" else left)
    interp = scores if whiten else scores / singular_values
    rho = np.clip((cross**2).sum(-1) - (scores**2).sum(-1), 0.0, None) if residual else np.zeros(len(x))
    return interp, rho, singular_values


def _q(strategy: KernelEigenVariationalStrategy) -> tuple[np.ndarray, np.ndarray]:
    q_u = strategy.variational_distribution
    return q_u.mean.detach().numpy(), q_u.covariance_matrix.detach().numpy()


def _dense_branch_posterior(model: BranchGP, x: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q(f(x)) of a single-branch model densely (mean, covariance) and Lambda (docs/math.md section 3)."""
    strategy = model.variational_strategy
    interp, rho, singular_values = _dense_branch(
        model.covar_module,
        strategy.inducing_points,
        x,
        strategy._variational_distribution.num_inducing_points,
        strategy.side,
        strategy.whiten,
        strategy.residual == "diag",
    )
    mean, covariance = _q(strategy)
    prior_mean = model.mean_module(x).detach().numpy()
    return prior_mean + interp @ mean, interp @ covariance @ interp.T + np.diag(rho), singular_values


def _dense_pair_posterior(model: KernelEigenPairSVGP, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """q(F(x)) of an unbatched pair model densely: ``"sum"`` (mean (N,), covariance (N, N)) or ``"concat"`` (mean
    (N, 2), covariance (2N, 2N) with the left task's N points first)."""
    strategy = model.variational_strategy
    mean, covariance = _q(strategy)  # (branches, s), (branches, s, s)
    parts = []
    for index, side in enumerate(("left", "right")):
        interp, rho, _ = _dense_branch(
            model.covar_module,
            model.features.landmarks,
            x,
            model.features.num_inducing,
            side,
            strategy.whiten,
            strategy.residual == "diag",
        )
        branch = 0 if strategy.shared_posterior else index
        parts.append((interp, rho, mean[branch], covariance[branch]))
    prior_mean = model.mean_module(x).detach().numpy()
    (a_e, rho_e, m_e, s_e), (a_r, rho_r, m_r, s_r) = parts
    if strategy.merge == "sum":
        if strategy.shared_posterior:  # F = (A_e + A_r) u
            both = a_e + a_r
            return prior_mean + both @ m_e, both @ s_e @ both.T + np.diag(rho_e + rho_r)
        return prior_mean + a_e @ m_e + a_r @ m_r, a_e @ s_e @ a_e.T + a_r @ s_r @ a_r.T + np.diag(rho_e + rho_r)
    means = np.stack([a_e @ m_e, a_r @ m_r], -1) + prior_mean[:, None]
    cross = a_e @ s_e @ a_r.T if strategy.shared_posterior else np.zeros((len(x), len(x)))
    covariance = np.block([[a_e @ s_e @ a_e.T, cross], [cross.T, a_r @ s_r @ a_r.T]])
    return means, covariance + np.diag(np.concatenate([rho_e, rho_r]))


def _dense_kl(mean: np.ndarray, covariance: np.ndarray, prior_variances: np.ndarray) -> float:
    q_u = torch.distributions.MultivariateNormal(torch.from_numpy(mean), torch.from_numpy(covariance))
    p_u = torch.distributions.MultivariateNormal(
        torch.zeros(len(mean), dtype=DTYPE), torch.diag(torch.from_numpy(prior_variances))
    )
    return torch.distributions.kl_divergence(q_u, p_u).item()


def _expected_log_lik(y: np.ndarray, mean: np.ndarray, variance: np.ndarray, noise) -> np.ndarray:
    """E_{N(f; mean, variance)} log N(y; f, noise), pointwise."""
    return -0.5 * np.log(2 * math.pi * noise) - ((y - mean) ** 2 + variance) / (2 * noise)


def _predictive_log_lik(y: np.ndarray, mean: np.ndarray, variance: np.ndarray, noise) -> np.ndarray:
    total = variance + noise
    return -0.5 * np.log(2 * math.pi * total) - (y - mean) ** 2 / (2 * total)


def _gamma_term(y: np.ndarray, mean: np.ndarray, variance: np.ndarray, noise, gamma: float) -> np.ndarray:
    r"""The pointwise term of GPyTorch's gamma-robust ELBO (Knoblauch 2019) as GPyTorch 1.15 computes it, by the
    trapezoidal rule on a fine grid of +-12 standard deviations of q(f) (spectrally accurate for these smooth
    integrands) instead of its closed form:
    :math:`\frac{\gamma}{\gamma - 1} E_{q(f)}[p(y \mid f)^{\gamma - 1}]
    (\int p(y' \mid f)^\gamma dy')^{(\gamma-1)/\gamma}`
    with :math:`\int N(y'; f, \sigma^2)^\gamma dy' = (2 \pi \sigma^2)^{(1 - \gamma)/2} \gamma^{-1/2}` (GPyTorch's
    docstring divides by the integral; its code, the reference for any GPyTorch model, multiplies)."""
    standard = np.linspace(-12.0, 12.0, 4001)
    f = mean[..., None] + np.sqrt(variance)[..., None] * standard  # (..., 4001)
    noise = np.asarray(noise)[..., None]
    density = np.exp(-((y[..., None] - f) ** 2) / (2 * noise)) / np.sqrt(2 * math.pi * noise)
    normal = np.exp(-0.5 * standard**2) / math.sqrt(2 * math.pi)
    expectation = np.trapezoid(normal * density ** (gamma - 1), standard, axis=-1)
    integral = (2 * math.pi * noise[..., 0]) ** ((1 - gamma) / 2) / math.sqrt(gamma)
    return gamma / (gamma - 1) * expectation * integral ** ((gamma - 1) / gamma)


class TwinGP(ApproximateGP):
    """GPyTorch's ``UnwhitenedVariationalStrategy`` over the landmarks with the induced kernel of one branch and
    q(f(Z)) = N(mean, covariance)."""

    def __init__(
        self, kernel, landmarks, side, mean, covariance, mean_module, strategy_cls=UnwhitenedVariationalStrategy
    ):
        q_f = CholeskyVariationalDistribution(landmarks.shape[-2])
        strategy = strategy_cls(self, landmarks, q_f, learn_inducing_locations=False, jitter_val=1e-14)
        super().__init__(strategy)
        self.covar_module = InducedKernel(kernel, landmarks, side=side)
        self.mean_module = mean_module
        self.double()
        with torch.no_grad():
            q_f.variational_mean.copy_(mean)
            q_f.chol_variational_covar.copy_(torch.linalg.cholesky(covariance))
        strategy.variational_params_initialized.fill_(1)

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _twin(model: BranchGP) -> TwinGP:
    """GPyTorch's equivalent of a full-rank (s = M) single-branch model: q(f(Z)) = N(mu(Z) + H m, H S H^T), with
    H = H_e (left) or H_r (right), and u = Lambda v when whitened (GPyTorch's inducing values include the prior mean,
    the kernel-eigen ones do not)."""
    strategy = model.variational_strategy
    landmarks = strategy.inducing_points.detach()
    left, singular_values, right = _numpy_svd(_kappa(model.covar_module, landmarks, landmarks), NUM_LANDMARKS)
    basis = torch.from_numpy(left if strategy.side == "left" else right)
    mean, covariance = (torch.from_numpy(part) for part in _q(strategy))
    if strategy.whiten:
        scale = torch.from_numpy(singular_values)
        mean, covariance = scale * mean, scale[:, None] * covariance * scale[None, :]
    offset = model.mean_module(landmarks).detach().expand(NUM_LANDMARKS)
    return TwinGP(
        model.covar_module,
        landmarks,
        strategy.side,
        offset + basis @ mean,
        basis @ covariance @ basis.T,
        model.mean_module,
    )


def _constant_mean(value: float = 0.7) -> gpytorch.means.ConstantMean:
    mean = gpytorch.means.ConstantMean().double()
    mean.initialize(constant=value)
    return mean


# -- one branch against GPyTorch's own strategy -----------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("whiten", [False, True])
def test_a_full_rank_branch_is_gpytorchs_unwhitened_strategy_on_the_induced_kernel(side: str, whiten: bool) -> None:
    x, _ = _data()
    model = BranchGP(_landmarks(), NUM_LANDMARKS, side=side, whiten=whiten, mean_module=_constant_mean())
    _set_q(model.variational_strategy)
    twin = _twin(model)
    twin(x)  # in training, GPyTorch's unwhitened strategy memoises the prior of its KL with its own jitter (1e-14)
    twin_kl = twin.variational_strategy.kl_divergence()  # (outside a training call: add_jitter()'s 1e-3)
    for mode in ("train", "eval"):
        model.train(mode == "train")
        twin.train(mode == "train")
        ours, theirs = model(x), twin(x)
        torch.testing.assert_close(ours.mean, theirs.mean, rtol=0.0, atol=1e-9)
        torch.testing.assert_close(ours.covariance_matrix, theirs.covariance_matrix, rtol=0.0, atol=1e-9)
        kl = model.variational_strategy.kl_divergence()
        torch.testing.assert_close(kl, twin_kl, rtol=1e-9, atol=0.0)
    mean, covariance = _q(model.variational_strategy)
    variances = (
        np.ones(NUM_LANDMARKS)
        if whiten
        else _numpy_svd(_kappa(model.covar_module, _landmarks(), _landmarks()), NUM_LANDMARKS)[1] ** 2
    )
    assert kl.item() == pytest.approx(_dense_kl(mean, covariance, variances), rel=1e-10)


@pytest.mark.parametrize(
    "mll_cls, kwargs",
    [
        (gpytorch.mlls.VariationalELBO, {}),
        (gpytorch.mlls.VariationalELBO, {"beta": 0.3}),
        (gpytorch.mlls.PredictiveLogLikelihood, {"beta": 0.5}),
        (gpytorch.mlls.GammaRobustVariationalELBO, {"gamma": 1.05}),
    ],
    ids=["elbo", "elbo-beta", "predictive-ll", "gamma-robust"],
)
def test_every_mll_of_a_full_rank_branch_is_its_value_for_gpytorchs_strategy(mll_cls, kwargs) -> None:
    x, y = _data()
    model = BranchGP(_landmarks(), NUM_LANDMARKS, mean_module=_constant_mean())
    _set_q(model.variational_strategy, seed=3)
    twin = _twin(model)
    likelihood = _gaussian_likelihood()
    ours = mll_cls(likelihood, model, num_data=20, **kwargs)
    theirs = mll_cls(likelihood, twin, num_data=20, **kwargs)
    torch.testing.assert_close(ours(model(x), y), theirs(twin(x), y), rtol=1e-10, atol=1e-10)
    # combine_terms=False: the same parts (log-likelihood, KL, log prior), each divided by num_data
    ours.combine_terms = theirs.combine_terms = False
    for part, reference in zip(ours(model(x), y), theirs(twin(x), y), strict=True):
        torch.testing.assert_close(part, reference, rtol=1e-10, atol=1e-12)


# -- the pair model's MLLs against dense computations ------------------------------------------------------------------
def _pair(merge: str = "sum", shared_posterior: bool = False, whiten: bool = False, seed: int = 0, **kwargs):
    model = KernelEigenPairSVGP(
        _landmarks(), _kernel(), RANK, merge=merge, shared_posterior=shared_posterior, whiten=whiten, **kwargs
    ).double()
    _set_q(model.variational_strategy, seed=seed)
    return model


@pytest.mark.parametrize(
    "merge, shared_posterior, whiten",
    [
        ("sum", False, False),
        ("sum", True, False),
        ("sum", False, True),
        ("concat", False, False),
        ("concat", True, True),
    ],
)
def test_the_pair_models_mlls_are_their_dense_values(merge: str, shared_posterior: bool, whiten: bool) -> None:
    x, y = _data()
    model = _pair(merge, shared_posterior, whiten, mean_module=_constant_mean())
    mean, covariance = _dense_pair_posterior(model, x)
    output = model(x)
    torch.testing.assert_close(output.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(output.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    # KL: each branch's (one with a shared posterior) against N(0, Lambda^2), by torch.distributions
    q_mean, q_covariance = _q(model.variational_strategy)
    singular_values = _numpy_svd(_kappa(model.covar_module, _landmarks(), _landmarks()), RANK)[1]
    prior_variances = np.ones(RANK) if whiten else singular_values**2
    kl = sum(_dense_kl(q_mean[b], q_covariance[b], prior_variances) for b in range(len(q_mean)))
    assert model.variational_strategy.kl_divergence().item() == pytest.approx(kl, rel=1e-10)
    variance = np.diag(covariance).reshape(mean.shape[::-1]).T if merge == "concat" else np.diag(covariance)
    if merge == "concat":
        targets = torch.stack([y, 0.5 - y], -1)
        likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False)
        likelihood.double()
        likelihood.task_noises = torch.tensor([NOISE, 2 * NOISE], dtype=DTYPE)
        noise = np.array([NOISE, 2 * NOISE])
    else:
        targets, likelihood, noise = y, _gaussian_likelihood(), NOISE
    target = targets.numpy()
    num_data, gamma = 30, 1.1
    expected = {
        gpytorch.mlls.VariationalELBO: _expected_log_lik(target, mean, variance, noise).sum() / len(x) - kl / num_data,
        gpytorch.mlls.PredictiveLogLikelihood: _predictive_log_lik(target, mean, variance, noise).sum() / len(x)
        - kl / num_data,
        gpytorch.mlls.GammaRobustVariationalELBO: _gamma_term(target, mean, variance, noise, gamma).sum() / len(x)
        - kl / num_data,
    }
    for mll_cls, value in expected.items():
        kwargs = {"gamma": gamma} if mll_cls is gpytorch.mlls.GammaRobustVariationalELBO else {}
        mll = mll_cls(likelihood, model, num_data=num_data, **kwargs)
        assert mll(model(x), targets).item() == pytest.approx(value, rel=1e-9, abs=1e-10), mll_cls.__name__
    # combine_terms=False: (expected log-likelihood / n_batch, KL / num_data, log prior / num_data)
    parts = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data, combine_terms=False)(model(x), targets)
    assert len(parts) == 3
    assert parts[0].item() == pytest.approx(_expected_log_lik(target, mean, variance, noise).sum() / len(x), rel=1e-10)
    assert parts[1].item() == pytest.approx(kl / num_data, rel=1e-10)
    assert parts[2].item() == 0.0


def test_a_non_gaussian_likelihoods_elbo_is_its_quadrature_value() -> None:
    # Student-t: GPyTorch's Gauss-Hermite quadrature over the 1-D marginals of q(F), against the dense marginals with
    # the integrand by torch.distributions; GPyTorch's rule is taken as given (its nodes and weights come from float32
    # and differ from NumPy's by ~1e-7, which moves this ELBO by more than the tolerance)
    x, y = _data()
    model = _pair()
    mean, covariance = _dense_pair_posterior(model, x)
    likelihood = gpytorch.likelihoods.StudentTLikelihood().double()
    likelihood.deg_free = torch.tensor(4.0, dtype=DTYPE)
    likelihood.noise = torch.tensor(0.2, dtype=DTYPE)
    nodes, weights = (tensor.numpy() for tensor in (likelihood.quadrature.locations, likelihood.quadrature.weights))
    f = torch.from_numpy(mean[:, None] + np.sqrt(2 * np.diag(covariance))[:, None] * nodes)
    scale = likelihood.noise.detach().sqrt()
    log_lik = torch.distributions.StudentT(likelihood.deg_free.detach(), f, scale).log_prob(y[:, None]).numpy()
    expected_log_lik = (weights * log_lik).sum(-1) / math.sqrt(math.pi)
    kl = model.variational_strategy.kl_divergence().item()
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=NUM_DATA)(model(x), y)
    assert elbo.item() == pytest.approx(expected_log_lik.mean() - kl / NUM_DATA, rel=1e-10)


def test_the_primal_models_fourth_part_is_the_ksvd_penalty() -> None:
    # with an added loss term (primal mode's eta J^2), combine_terms=False returns four parts and the combined value is
    # log-likelihood - KL + log prior - penalty
    x, y = _data()
    torch.manual_seed(0)
    kernel = CosineFeatureKernel(1, feature_dim=8, lift="rff", lift_dim=16).double()
    model = KernelEigenPairSVGP(_landmarks(), kernel, RANK, mode="primal", ksvd_weight=0.5).double()
    with torch.no_grad():
        model.features.left_weights.add_(0.1)  # away from the stationary point: J != 0
    likelihood = _gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=NUM_DATA, combine_terms=False)
    log_lik, kl, log_prior, penalty = mll(model(x), y)
    # J of docs/math.md section 2 (sum form) on the landmarks, from the kernel's feature maps and the learned weights
    features = model.features
    with torch.no_grad():
        left = kernel.query_features(_landmarks()) @ features.left_weights  # e(x_i) = W_e^T phi_q(x_i)
        right = kernel.key_features(_landmarks()) @ features.right_weights  # r(z_j) = W_r^T phi_k(z_j)
        singular_values = features.singular_values
        objective = (
            0.5 * (left.pow(2) / singular_values).sum()
            + 0.5 * (right.pow(2) / singular_values).sum()
            - (features.left_weights * features.right_weights).sum()
        ).item()
    assert abs(objective) > 0.1
    assert penalty.item() == pytest.approx(0.5 * objective**2, rel=1e-12)
    mll.combine_terms = True
    assert mll(model(x), y).item() == pytest.approx((log_lik - kl + log_prior - penalty).item(), rel=1e-12)


# -- batch shapes and GPyTorch's multi-output wrappers -----------------------------------------------------------------
NUM_OUTPUTS = 3
SHIFTS = (0.2, 0.4, -0.3)
LENGTHSCALES = (0.9, 0.7, 1.2)


class BatchBranchGP(ApproximateGP):
    """A batch of independent single-branch GPs (batched kernel, landmarks and q(u)), optionally wrapped."""

    def __init__(self, wrapper: str | None = None, distribution: type = CholeskyVariationalDistribution, whiten=False):
        landmarks = torch.stack([_landmarks(0.1 * t) for t in range(NUM_OUTPUTS)])
        q_u = distribution(RANK, batch_shape=torch.Size([NUM_OUTPUTS]))
        strategy = KernelEigenVariationalStrategy(self, landmarks, q_u, whiten=whiten)
        if wrapper == "independent":
            strategy = IndependentMultitaskVariationalStrategy(strategy, num_tasks=NUM_OUTPUTS)
        elif wrapper == "lmc":
            strategy = LMCVariationalStrategy(strategy, num_tasks=4, num_latents=NUM_OUTPUTS, latent_dim=-1)
        super().__init__(strategy)
        shift = torch.tensor(SHIFTS).unsqueeze(-1)
        self.covar_module = ShiftedRBFKernel(1, shift=shift, batch_shape=torch.Size([NUM_OUTPUTS]))
        self.covar_module.initialize(raw_lengthscale=torch.tensor(LENGTHSCALES).expm1().log().unsqueeze(-1))
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=torch.Size([NUM_OUTPUTS]))
        self.mean_module.initialize(constant=torch.tensor([0.5, -0.2, 0.1]))
        self.double()

    @property
    def base_strategy(self) -> KernelEigenVariationalStrategy:
        strategy = self.variational_strategy
        return getattr(strategy, "base_variational_strategy", strategy)

    def forward(self, x: Tensor) -> MultivariateNormal:
        raise NotImplementedError


def _output_model(batched: BatchBranchGP, t: int) -> BranchGP:
    """Output t of a batch, as an unbatched model with the same kernel, landmarks, mean and q(u)."""
    kernel = _kernel()
    with torch.no_grad():
        for name, value in batched.covar_module.named_parameters():
            getattr(kernel, name).copy_(value[t])
    distribution = type(batched.base_strategy._variational_distribution)
    model = BranchGP(
        _landmarks(0.1 * t),
        kernel=kernel,
        mean_module=_constant_mean(batched.mean_module.constant[t].item()),
        distribution=distribution,
        whiten=batched.base_strategy.whiten,
    )
    state = batched.base_strategy._variational_distribution.state_dict()
    model.variational_strategy._variational_distribution.load_state_dict({k: v[t] for k, v in state.items()})
    model.variational_strategy.variational_params_initialized.fill_(1)
    return model


@pytest.mark.parametrize("distribution", [CholeskyVariationalDistribution, MeanFieldVariationalDistribution])
@pytest.mark.parametrize("whiten", [False, True])
def test_a_batch_of_branches_is_the_batch_of_its_outputs(distribution: type, whiten: bool) -> None:
    x, y = _data()
    model = BatchBranchGP(distribution=distribution, whiten=whiten)
    _set_q(model.variational_strategy)
    output = model(x)
    assert output.mean.shape == (NUM_OUTPUTS, NUM_DATA)
    kl = model.variational_strategy.kl_divergence()
    targets = torch.stack([y, -y, 2 * y])
    likelihood = _gaussian_likelihood(batch_shape=torch.Size([NUM_OUTPUTS]))
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=NUM_DATA)(output, targets)
    assert elbo.shape == (NUM_OUTPUTS,)
    for t in range(NUM_OUTPUTS):
        mean, covariance, singular_values = _dense_branch_posterior(_output_model(model, t), x)
        torch.testing.assert_close(output.mean[t], torch.from_numpy(mean), rtol=0.0, atol=1e-10)
        torch.testing.assert_close(output.covariance_matrix[t], torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
        q_mean, q_covariance = _q(model.variational_strategy)
        variances = np.ones(RANK) if whiten else singular_values**2
        kl_t = _dense_kl(q_mean[t], q_covariance[t], variances)
        assert kl[t].item() == pytest.approx(kl_t, rel=1e-10)
        value = _expected_log_lik(targets[t].numpy(), mean, np.diag(covariance), NOISE).mean() - kl_t / NUM_DATA
        assert elbo[t].item() == pytest.approx(value, rel=1e-10)


def test_gpytorchs_independent_multitask_wrapper_gives_each_task_its_output() -> None:
    x, y = _data()
    model = BatchBranchGP("independent")
    _set_q(model.base_strategy)
    output = model(x)
    assert isinstance(output, MultitaskMultivariateNormal) and output.mean.shape == (NUM_DATA, NUM_OUTPUTS)
    targets = torch.stack([y, -y, 2 * y], -1)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=NUM_OUTPUTS, rank=0).double()
    likelihood.task_noises = torch.tensor([0.1, 0.2, 0.05], dtype=DTYPE)
    likelihood.noise = torch.tensor(1e-4, dtype=DTYPE)
    noises = np.array([0.1, 0.2, 0.05]) + 1e-4
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=NUM_DATA)(output, targets)
    expected, total_kl = 0.0, 0.0
    for t in range(NUM_OUTPUTS):
        mean, covariance, singular_values = _dense_branch_posterior(_output_model(model, t), x)
        torch.testing.assert_close(output.mean[:, t], torch.from_numpy(mean), rtol=0.0, atol=1e-10)
        task_covariance = output.covariance_matrix[t::NUM_OUTPUTS, t::NUM_OUTPUTS]  # interleaved
        torch.testing.assert_close(task_covariance, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
        q_mean, q_covariance = _q(model.base_strategy)
        total_kl += _dense_kl(q_mean[t], q_covariance[t], singular_values**2)
        expected += _expected_log_lik(targets[:, t].numpy(), mean, np.diag(covariance), noises[t]).sum()
    assert model.variational_strategy.kl_divergence().item() == pytest.approx(total_kl, rel=1e-10)
    assert elbo.item() == pytest.approx(expected / NUM_DATA - total_kl / NUM_DATA, rel=1e-10)


def test_gpytorchs_lmc_wrapper_mixes_the_latent_outputs() -> None:
    x, _ = _data(5)
    model = BatchBranchGP("lmc")
    _set_q(model.base_strategy)
    with torch.no_grad():
        model.variational_strategy.lmc_coefficients.copy_(
            torch.randn(NUM_OUTPUTS, 4, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
        )
    coefficients = model.variational_strategy.lmc_coefficients.detach().numpy()  # (latents, tasks)
    output = model(x)
    latents = [_dense_branch_posterior(_output_model(model, t), x) for t in range(NUM_OUTPUTS)]
    mean = sum(np.outer(latent[0], coefficients[t]) for t, latent in enumerate(latents))  # (N, tasks)
    # interleaved (point-major) covariance: cov[(i, a), (j, b)] = sum_l c_la c_lb K_l[i, j]
    covariance = sum(np.kron(latent[1], np.outer(coefficients[t], coefficients[t])) for t, latent in enumerate(latents))
    covariance += model.variational_strategy.jitter_val * np.eye(len(covariance))  # GPyTorch's LMC adds its jitter
    torch.testing.assert_close(output.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(output.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    # one task per input (task_indices): the entries of the all-task output
    tasks = torch.tensor([0, 3, 1, 2, 3])
    single = model(x, task_indices=tasks)
    torch.testing.assert_close(single.mean, output.mean[torch.arange(5), tasks], rtol=0.0, atol=1e-12)
    torch.testing.assert_close(single.variance, output.variance[torch.arange(5), tasks], rtol=0.0, atol=1e-12)
    q_mean, q_covariance = _q(model.base_strategy)
    kl = sum(_dense_kl(q_mean[t], q_covariance[t], latents[t][2] ** 2) for t in range(NUM_OUTPUTS))
    assert model.variational_strategy.kl_divergence().item() == pytest.approx(kl, rel=1e-10)


def test_a_pair_inside_gpytorchs_lmc_wrapper_is_refused_clearly() -> None:
    # the pair's branch dimension would be summed wrongly by GPyTorch's generic KL: refused, naming what to do
    class WrappedPair(ApproximateGP):
        def __init__(self):
            q_u = CholeskyVariationalDistribution(RANK, batch_shape=torch.Size([NUM_OUTPUTS, 2]))
            pair = KernelEigenPairVariationalStrategy(self, _landmarks(), q_u)
            super().__init__(LMCVariationalStrategy(pair, num_tasks=4, num_latents=NUM_OUTPUTS, latent_dim=-2))
            self.covar_module = _kernel()
            self.double()

    with pytest.raises(NotImplementedError, match="KernelEigenPairVariationalStrategy inside LMCVariationalStrategy"):
        WrappedPair()(_data()[0])


@pytest.mark.parametrize("merge", ["sum", "concat"])
def test_a_batch_of_inputs_broadcasts_through_an_unbatched_model(merge: str) -> None:
    # GPyTorch broadcasts inputs (b, n, d) through a model without a batch: each batch member is its own call
    model = _pair(merge)
    model.eval()
    x = torch.randn(4, 5, 1, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    output = model(x)
    assert output.mean.shape == ((4, 5) if merge == "sum" else (4, 5, 2))
    for b in range(4):
        mean, covariance = _dense_pair_posterior(model, x[b])
        torch.testing.assert_close(output.mean[b], torch.from_numpy(mean), rtol=0.0, atol=1e-10)
        torch.testing.assert_close(output.covariance_matrix[b], torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    # 1-D inputs of a 1-D model: GPyTorch's ApproximateGP adds the feature dimension
    torch.testing.assert_close(model(x[0, :, 0]).mean, output.mean[0], rtol=0.0, atol=0.0)


# -- gradients ---------------------------------------------------------------------------------------------------------
class _Objective(torch.nn.Module):
    """The ELBO of a model as a module, so that torch.func.functional_call replaces every parameter for one call (the
    KL is read outside the model's call)."""

    def __init__(self, model: ApproximateGP, likelihood: gpytorch.likelihoods.Likelihood, x: Tensor, y: Tensor):
        super().__init__()
        self.model, self.likelihood, self.x, self.y = model, likelihood, x, y
        self.mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(x))

    def forward(self) -> Tensor:
        return self.mll(self.model(self.x), self.y).sum()


@pytest.mark.parametrize("case", ["branch", "branch-outputs", "pair-batch", "pair-shared-whitened", "pair-concat"])
def test_the_elbo_gradients_are_finite_differences(case: str) -> None:
    # every parameter (q(u), kernel, landmarks, mean, noise) against torch's finite differences, through GPyTorch's ELBO
    x, y = _data(6)
    if case == "branch":
        model, targets, batch = BranchGP(_landmarks(), mean_module=_constant_mean()), y, ()
    elif case == "branch-outputs":  # q(u) with a batch of outputs sharing Lambda
        model, targets, batch = BranchGP(_landmarks(), batch_shape=(3,)), torch.stack([y, -y, 2 * y]), (3,)
    elif case == "pair-batch":
        model = KernelEigenPairSVGP(_landmarks(), _kernel(), RANK, batch_shape=torch.Size([3])).double()
        targets, batch = torch.stack([y, -y, 2 * y]), (3,)
    elif case == "pair-shared-whitened":
        model, targets, batch = _pair(shared_posterior=True, whiten=True), y, ()
    else:
        model, targets, batch = _pair("concat"), torch.stack([y, 0.5 - y], -1), ()
    _set_q(model.variational_strategy)
    if case == "pair-concat":
        likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=1).double()
    else:
        likelihood = _gaussian_likelihood(batch_shape=torch.Size(batch))
    objective = _Objective(model, likelihood, x, targets)
    names, values = zip(*((name, value.detach().clone()) for name, value in objective.named_parameters()), strict=True)

    def elbo(*tensors: Tensor) -> Tensor:
        return torch.func.functional_call(objective, dict(zip(names, tensors, strict=True)), ())

    inputs = tuple(value.requires_grad_(True) for value in values)
    assert torch.autograd.gradcheck(elbo, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_prediction_gradients_with_respect_to_the_inputs_are_finite_differences() -> None:
    # acquisition functions differentiate the predictive mean and variance in eval mode (after a no-grad call memoised
    # the KSVD)
    model = _pair(mean_module=_constant_mean())
    likelihood = _gaussian_likelihood()
    model.eval()
    likelihood.eval()
    x, y = _data(6)
    with torch.no_grad():
        model(x)

    def predictive(points: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        output = likelihood(model(points))
        return output.mean, output.variance, output.log_prob(y)

    assert torch.autograd.gradcheck(predictive, (x.clone().requires_grad_(True),), eps=1e-6, atol=1e-6, rtol=1e-5)


# -- settings: predictions equal the default path's --------------------------------------------------------------------
SETTINGS = {
    "fast_pred_var": gpytorch.settings.fast_pred_var,
    "skip_posterior_variances": gpytorch.settings.skip_posterior_variances,
    "cholesky_jitter": lambda: gpytorch.settings.cholesky_jitter(float_value=1e-2, double_value=1e-2),
    "debug_off": lambda: gpytorch.settings.debug(False),
    "max_cholesky_size_0": lambda: gpytorch.settings.max_cholesky_size(0),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_settings_leave_the_predictions_of_the_default_path(setting: str) -> None:
    x, y = _data(6)
    model = BranchGP(_landmarks(), mean_module=_constant_mean())
    _set_q(model.variational_strategy)
    likelihood = _gaussian_likelihood()
    model.eval()
    likelihood.eval()
    mean, covariance, _ = _dense_branch_posterior(model, x)
    reference = torch.distributions.MultivariateNormal(
        torch.from_numpy(mean), torch.from_numpy(covariance) + NOISE * torch.eye(6, dtype=DTYPE)
    )
    with torch.no_grad():
        default = likelihood(model(x))
        with SETTINGS[setting]():
            predictive = likelihood(model(x))
            log_prob = predictive.log_prob(y)  # under max_cholesky_size(0) too: the low-rank Woodbury identities
            lower, upper = predictive.confidence_region()
    torch.testing.assert_close(predictive.mean, default.mean, rtol=0.0, atol=0.0)
    torch.testing.assert_close(predictive.variance, default.variance, rtol=0.0, atol=0.0)
    torch.testing.assert_close(predictive.mean, reference.mean, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(predictive.covariance_matrix, reference.covariance_matrix, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(log_prob, reference.log_prob(y), rtol=1e-10, atol=0.0)
    stddev = reference.variance.sqrt()
    torch.testing.assert_close(lower, reference.mean - 2 * stddev, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(upper, reference.mean + 2 * stddev, rtol=0.0, atol=1e-10)
    # GPyTorch's metric: the negative log predictive density per point
    nlpd = gpytorch.metrics.negative_log_predictive_density(predictive, y)
    torch.testing.assert_close(nlpd, -reference.log_prob(y) / 6, rtol=1e-10, atol=0.0)
    # and the training objective
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=6)
    default_elbo = mll(model(x), y)
    with SETTINGS[setting]():
        elbo = mll(model(x), y)
    torch.testing.assert_close(elbo, default_elbo, rtol=1e-12, atol=0.0)


def test_skip_posterior_variances_is_ignored_as_by_gpytorchs_variational_strategy() -> None:
    # GPyTorch honours skip_posterior_variances for ExactGP (and its unwhitened strategy) only; its default
    # VariationalStrategy computes the variances anyway, and so does the kernel-eigen strategy
    x, _ = _data(6)
    model = BranchGP(_landmarks(), NUM_LANDMARKS)
    _set_q(model.variational_strategy)
    twin = _twin(model)
    whitened = TwinGP(
        model.covar_module,
        _landmarks(),
        "left",
        torch.zeros(NUM_LANDMARKS, dtype=DTYPE),
        torch.eye(NUM_LANDMARKS, dtype=DTYPE),
        gpytorch.means.ZeroMean(),
        strategy_cls=VariationalStrategy,
    )
    for gp in (model, twin, whitened):
        gp.eval()
    with torch.no_grad():
        defaults = [gp(x) for gp in (model, whitened)]
        with gpytorch.settings.skip_posterior_variances():
            skipped = [gp(x) for gp in (model, whitened)]
            unwhitened = twin(x)
    for default, output in zip(defaults, skipped, strict=True):
        torch.testing.assert_close(output.mean, default.mean, rtol=0.0, atol=0.0)
        torch.testing.assert_close(output.variance, default.variance, rtol=0.0, atol=0.0)
        assert (output.variance > 0).all()
    torch.testing.assert_close(unwhitened.mean, defaults[0].mean, rtol=0.0, atol=1e-9)  # the mean is GPyTorch's


# -- predictive samples -----------------------------------------------------------------------------------------------
def test_samples_have_the_dense_posterior_moments() -> None:
    torch.manual_seed(0)
    x, _ = _data(4)
    model = _pair()
    likelihood = _gaussian_likelihood()
    model.eval()
    likelihood.eval()
    mean, covariance = _dense_pair_posterior(model, x)
    num_samples = 40_000
    with torch.no_grad():
        for draws, extra in (
            (model(x).sample(torch.Size([num_samples])), 0.0),
            (likelihood(model(x)).rsample(torch.Size([num_samples])), NOISE),
        ):
            assert draws.shape == (num_samples, 4)
            target = torch.from_numpy(covariance) + extra * torch.eye(4, dtype=DTYPE)
            scale = target.diagonal().max().sqrt()
            # a standard error of sqrt(var / S) ~ 0.005 scale; 5 standard errors
            torch.testing.assert_close(draws.mean(0), torch.from_numpy(mean), rtol=0.0, atol=0.03 * scale)
            torch.testing.assert_close(draws.T.cov(), target, rtol=0.0, atol=0.04 * scale**2)


def _concat_predictive(shared_posterior: bool) -> tuple[KernelEigenPairSVGP, MultitaskMultivariateNormal, Tensor]:
    """A concat pair model in eval mode, its predictive distribution under a two-task likelihood (task noises 0.1 and
    0.3) at 4 points, and the dense predictive covariance (task-major: the left task's 4 points first)."""
    x, _ = _data(4)
    model = _pair("concat", shared_posterior)
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False)
    likelihood.double()
    likelihood.task_noises = torch.tensor([0.1, 0.3], dtype=DTYPE)
    model.eval()
    likelihood.eval()
    mean, covariance = _dense_pair_posterior(model, x)
    noise = np.diag(np.repeat([0.1, 0.3], 4))
    with torch.no_grad():
        predictive = likelihood(model(x))
    return model, predictive, torch.from_numpy(covariance + noise)


@pytest.mark.parametrize("shared_posterior", [False, True])
def test_the_concat_predictive_has_the_dense_moments_and_samples(shared_posterior: bool) -> None:
    torch.manual_seed(0)
    x, _ = _data(4)
    model, predictive, covariance = _concat_predictive(shared_posterior)
    mean, _ = _dense_pair_posterior(model, x)
    assert isinstance(predictive, MultitaskMultivariateNormal) and predictive.mean.shape == (4, 2)
    torch.testing.assert_close(predictive.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(predictive.variance, covariance.diagonal().reshape(2, 4).T, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(predictive.lazy_covariance_matrix.to_dense(), covariance, rtol=0.0, atol=1e-10)
    lower, upper = predictive.confidence_region()
    torch.testing.assert_close(upper - lower, 4 * covariance.diagonal().sqrt().reshape(2, 4).T, rtol=0.0, atol=1e-10)
    # one task, one point: GPyTorch's indexing of a multitask distribution
    torch.testing.assert_close(predictive[:, 1].covariance_matrix, covariance[4:, 4:], rtol=0.0, atol=1e-10)
    draws = predictive.sample(torch.Size([40_000]))  # (S, N, tasks)
    flat = draws.transpose(-1, -2).reshape(40_000, 8)  # task-major
    scale = covariance.diagonal().max().sqrt()
    torch.testing.assert_close(flat.mean(0), torch.from_numpy(mean.T.reshape(-1)), rtol=0.0, atol=0.03 * scale)
    torch.testing.assert_close(flat.T.cov(), covariance, rtol=0.0, atol=0.04 * scale**2)


@pytest.mark.parametrize("shared_posterior", [False, True])
def test_the_concat_predictive_log_density_is_the_dense_one(shared_posterior: bool) -> None:
    x, y = _data(4)
    model, predictive, covariance = _concat_predictive(shared_posterior)
    mean, _ = _dense_pair_posterior(model, x)
    targets = torch.stack([y, 0.5 - y], -1)
    reference = torch.distributions.MultivariateNormal(torch.from_numpy(mean.T.reshape(-1)), covariance)
    expected = reference.log_prob(targets.T.reshape(-1))  # task-major, as the covariance
    torch.testing.assert_close(predictive.log_prob(targets), expected, rtol=1e-10, atol=0.0)
    nlpd = gpytorch.metrics.negative_log_predictive_density(predictive, targets)
    torch.testing.assert_close(nlpd, -expected / 4, rtol=1e-10, atol=0.0)


def test_rsample_gradients_reach_q_u() -> None:
    # d/dm of the sum of reparameterised draws F = A m + (noise) is S * A^T 1, whatever root the sampler uses
    x, _ = _data(5)
    model = BranchGP(_landmarks())
    _set_q(model.variational_strategy)
    output = model(x)
    base = torch.randn(7, 5, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    output.rsample(base_samples=base).sum().backward()
    interp, _, _ = _dense_branch(model.covar_module, _landmarks(), x, RANK, "left", False, True)
    gradient = model.variational_strategy._variational_distribution.variational_mean.grad
    torch.testing.assert_close(gradient, torch.from_numpy(7 * interp.sum(0)), rtol=1e-10, atol=0.0)


def test_num_likelihood_samples_sets_the_monte_carlo_batch_of_a_marginal() -> None:
    # a Student-t marginal is a Monte Carlo mixture: num_likelihood_samples draws of f, each a Student-t around it
    torch.manual_seed(0)
    x, _ = _data(4)
    model = _pair()
    likelihood = gpytorch.likelihoods.StudentTLikelihood().double()
    model.eval()
    likelihood.eval()
    mean, covariance = _dense_pair_posterior(model, x)
    with torch.no_grad(), gpytorch.settings.num_likelihood_samples(20_000):
        marginal = likelihood(model(x))
    assert marginal.batch_shape == (20_000, 4)
    draws = marginal.loc
    scale = math.sqrt(np.diag(covariance).max())
    torch.testing.assert_close(draws.mean(0), torch.from_numpy(mean), rtol=0.0, atol=0.04 * scale)
    torch.testing.assert_close(draws.T.cov(), torch.from_numpy(covariance), rtol=0.0, atol=0.05 * scale**2)


# -- the induced kernel in GPyTorch's ExactGP ------------------------------------------------------------------------
class ExactInducedGP(gpytorch.models.ExactGP):
    def __init__(self, x: Tensor, y: Tensor, kernel: InducedKernel):
        super().__init__(x, y, _gaussian_likelihood())
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = kernel
        self.double()

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _dense_exact_posterior(kernel, x: Tensor, y: Tensor, points: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The exact GP posterior with the kernel k_e + k_r (roots kappa(x, Z) and kappa(Z, x)^T) at ``points``."""

    def root(z: Tensor) -> np.ndarray:
        return np.concatenate([_kappa(kernel, z, _landmarks()), _kappa(kernel, _landmarks(), z).T], -1)

    data, star = root(x), root(points)
    gram, cross = data @ data.T + NOISE * np.eye(len(x)), star @ data.T
    return cross @ np.linalg.solve(gram, y.numpy()), star @ star.T - cross @ np.linalg.solve(gram, cross.T)


def test_the_induced_kernel_in_an_exact_gp_is_the_dense_gp() -> None:
    x, y = _data(8)
    points = torch.linspace(-3.0, 3.0, 5, dtype=DTYPE).unsqueeze(-1)
    kernel = _kernel()
    induced = InducedKernel(kernel, _landmarks(), side="both")
    model = ExactInducedGP(x, y, induced)
    model.eval()
    mean, covariance = _dense_exact_posterior(kernel, x, y, points)
    with torch.no_grad():
        output = model(points)
        torch.testing.assert_close(output.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
        torch.testing.assert_close(output.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
        diagonal = induced(points, diag=True)
        torch.testing.assert_close(diagonal, induced(points).to_dense().diagonal(), rtol=0.0, atol=1e-12)
        with gpytorch.settings.fast_pred_var():  # LOVE: exact here (the kernel has rank <= 2M = 14 >= 8 points)
            fast = ExactInducedGP(x, y, induced).eval()(points)
        torch.testing.assert_close(fast.variance, torch.from_numpy(np.diag(covariance).copy()), rtol=0.0, atol=1e-8)
        # GPyTorch's fantasy model (supported for exact GPs): the exact GP on the data and the new point
        new_x, new_y = torch.tensor([[0.3]], dtype=DTYPE), torch.tensor([0.5], dtype=DTYPE)
        fantasy = model.get_fantasy_model(new_x, new_y)(points)
        mean, covariance = _dense_exact_posterior(kernel, torch.cat([x, new_x]), torch.cat([y, new_y]), points)
        torch.testing.assert_close(fantasy.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-9)
        torch.testing.assert_close(fantasy.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-9)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(NotImplementedError, match="does not support last_dim_is_batch"),
    ):
        induced(points, points, last_dim_is_batch=True).to_dense()  # (GPyTorch deprecates the argument)


@pytest.mark.parametrize("batched", ["kernel", "landmarks"])
def test_an_induced_kernel_of_a_batch_is_the_batch_of_induced_kernels(batched: str) -> None:
    points = torch.linspace(-3.0, 3.0, 5, dtype=DTYPE).unsqueeze(-1)
    # (a refusal at construction that names the batch would do as well as a batch of kernels)
    if batched == "kernel":
        kernel = ShiftedRBFKernel(1, shift=torch.tensor(SHIFTS).unsqueeze(-1), batch_shape=torch.Size([3])).double()
        try:
            induced = InducedKernel(kernel, _landmarks())
        except (ValueError, TypeError) as error:
            assert "batch" in str(error)
            return
        members = []
        for t in range(3):
            member = _kernel()
            with torch.no_grad():
                for name, value in kernel.named_parameters():
                    getattr(member, name).copy_(value[t])
            members.append(InducedKernel(member, _landmarks()))
    else:
        try:
            induced = InducedKernel(_kernel(), torch.stack([_landmarks(0.1 * t) for t in range(3)]))
        except (ValueError, TypeError) as error:
            assert "batch" in str(error) or "landmarks" in str(error)
            return
        members = [InducedKernel(_kernel(), _landmarks(0.1 * t)) for t in range(3)]
    with torch.no_grad():
        expected = torch.stack([member(points).to_dense() for member in members])
        torch.testing.assert_close(induced(points).to_dense(), expected, rtol=0.0, atol=1e-12)


# -- model bookkeeping ------------------------------------------------------------------------------------------------
def test_fantasy_models_are_refused_with_an_explanation() -> None:
    x, y = _data(3)
    with pytest.raises(NotImplementedError, match="KernelEigenPairSVGP: online variational conditioning"):
        _pair().get_fantasy_model(x, y)
    # a user's own ApproximateGP around the strategy: GPyTorch's refusal, naming the strategy
    with pytest.raises(NotImplementedError, match="No fantasy model support for KernelEigenVariationalStrategy"):
        BranchGP(_landmarks()).get_fantasy_model(x, y)


def test_dtype_round_trips_keep_the_predictions() -> None:
    x, _ = _data(6)
    model = KernelEigenPairSVGP(_landmarks().float(), ShiftedRBFKernel(1, shift=0.4, lengthscale=0.9), RANK)
    torch.manual_seed(0)
    with torch.no_grad():
        model.variational_strategy._variational_distribution.variational_mean.normal_()
    model.variational_strategy.variational_params_initialized.fill_(1)
    model.eval()
    single = model(x.float())
    assert single.mean.dtype == torch.float32
    double = model.double()(x)  # the eval-mode KSVD memo is recomputed in float64
    mean, covariance = _dense_pair_posterior(model, x)
    torch.testing.assert_close(double.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(double.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(single.mean.double(), double.mean, rtol=0.0, atol=1e-4)
    back = model.to(torch.float32)(x.float())
    assert back.mean.dtype == torch.float32
    torch.testing.assert_close(back.mean, single.mean, rtol=0.0, atol=0.0)  # float32 -> float64 -> float32 is exact
    torch.testing.assert_close(back.variance, single.variance, rtol=0.0, atol=0.0)


def test_a_state_dict_loaded_in_eval_mode_replaces_the_memoised_ksvd() -> None:
    x, _ = _data(6)
    first = BranchGP(_landmarks())
    second = BranchGP(_landmarks(0.3), kernel=_kernel(shift=-0.3, lengthscale=0.6, outputscale=0.8))
    _set_q(first.variational_strategy, seed=0)
    _set_q(second.variational_strategy, seed=1)
    first.eval()
    first(x)  # memoises the KSVD of the first kernel and landmarks
    first.load_state_dict(second.state_dict())
    mean, covariance, _ = _dense_branch_posterior(second, x)
    output = first(x)
    torch.testing.assert_close(output.mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(output.covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    # a fresh model loaded from a trained one keeps its q(u) on the first training call (no re-initialisation)
    fresh = BranchGP(_landmarks())
    fresh.load_state_dict(second.state_dict())
    fresh.train()
    torch.testing.assert_close(fresh(x).mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)


def test_a_kernel_prior_enters_the_elbo_once() -> None:
    x, y = _data()
    kernel = _kernel()
    prior = gpytorch.priors.GammaPrior(3.0, 2.0)
    kernel.register_prior("outputscale_prior", prior, "outputscale")
    model = BranchGP(_landmarks(), kernel=kernel)
    _set_q(model.variational_strategy)
    assert [name for name, *_ in model.named_priors()] == ["covar_module.outputscale_prior"]
    likelihood = _gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=20, combine_terms=False)
    log_lik, kl, log_prior = mll(model(x), y)
    rates = torch.tensor([3.0, 2.0], dtype=DTYPE)
    expected = torch.distributions.Gamma(*rates).log_prob(kernel.outputscale.detach()).item()
    assert log_prior.item() == pytest.approx(expected / 20, rel=1e-12)
    mll.combine_terms = True
    assert mll(model(x), y).item() == pytest.approx((log_lik - kl + log_prior).item(), rel=1e-12)


def test_a_lengthscale_is_set_and_sampled_as_gpytorchs() -> None:
    kernel = _kernel()
    kernel.initialize(lengthscale=0.5)
    assert kernel.lengthscale.item() == pytest.approx(0.5)
    kernel.register_prior("lengthscale_prior", gpytorch.priors.GammaPrior(3.0, 6.0), "lengthscale")
    model = KernelEigenPairSVGP(_landmarks(), kernel, RANK).double()
    torch.manual_seed(0)
    sampled = model.pyro_sample_from_prior()
    assert sampled.covar_module.lengthscale.item() != pytest.approx(0.5)


def test_pyro_sample_from_prior_reaches_the_pair_models_predictions() -> None:
    # the pair model rebinds covar_module to the copy's features' kernel: the sampled outputscale is the one predicted
    x, _ = _data(5)
    kernel = _kernel()
    kernel.register_prior("outputscale_prior", gpytorch.priors.GammaPrior(3.0, 2.0), "outputscale")
    model = _pair()
    model.covar_module = kernel
    torch.manual_seed(0)
    sampled = model.pyro_sample_from_prior()
    outputscale = sampled.covar_module.outputscale.item()
    assert outputscale != pytest.approx(1.3)
    reference = _pair()
    reference.covar_module.outputscale = outputscale
    sampled.eval()
    reference.eval()
    mean, covariance = _dense_pair_posterior(reference, x)
    torch.testing.assert_close(sampled(x).mean, torch.from_numpy(mean), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(sampled(x).covariance_matrix, torch.from_numpy(covariance), rtol=0.0, atol=1e-10)
    torch.testing.assert_close(sampled(x, prior=True).variance, reference(x, prior=True).variance, rtol=1e-12, atol=0)


def test_pyro_sample_from_prior_of_a_users_model_matches_gpytorchs_strategy() -> None:
    # GPyTorch's to_random_module copies each child on its own: the strategy's model is then a stale copy, and its own
    # VariationalStrategy predicts with the unsampled kernel; a user's model around the kernel-eigen strategy alike
    x, _ = _data(5)

    class ExactKernelSVGP(ApproximateGP):
        def __init__(self):
            strategy = VariationalStrategy(self, _landmarks(), CholeskyVariationalDistribution(NUM_LANDMARKS))
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            self.covar_module.register_prior("outputscale_prior", gpytorch.priors.GammaPrior(3.0, 2.0), "outputscale")
            self.double()

        def forward(self, x):
            return MultivariateNormal(self.mean_module(x), self.covar_module(x))

    kernel = _kernel()
    kernel.register_prior("outputscale_prior", gpytorch.priors.GammaPrior(3.0, 2.0), "outputscale")
    ours, theirs = BranchGP(_landmarks(), kernel=kernel), ExactKernelSVGP()
    _set_q(ours.variational_strategy)
    for model, unsampled in ((ours, 1.3), (theirs, math.log(2.0))):
        torch.manual_seed(0)
        sampled = model.pyro_sample_from_prior()
        assert sampled.covar_module.outputscale.item() != pytest.approx(unsampled)
        assert sampled.variational_strategy.model is not sampled
        assert sampled.variational_strategy.model.covar_module.outputscale.item() == pytest.approx(unsampled)
    # so the sample of a user's kernel-eigen model predicts as the model itself, as GPyTorch's does
    sampled = ours.pyro_sample_from_prior().eval()
    ours.eval()
    torch.testing.assert_close(sampled(x).mean, ours(x).mean, rtol=0.0, atol=0.0)
    torch.testing.assert_close(sampled(x).variance, ours(x).variance, rtol=0.0, atol=0.0)


def _roles(model: torch.nn.Module) -> tuple[set[str], set[str]]:
    return {name for name, _ in model.named_hyperparameters()}, {
        name for name, _ in model.named_variational_parameters()
    }


def test_hyperparameters_and_variational_parameters_split_as_gpytorchs() -> None:
    # GPyTorch: the parameters of the variational distribution are variational, everything else (kernel, mean,
    # inducing points) a hyperparameter; every parameter once
    model = BranchGP(_landmarks(), mean_module=_constant_mean())
    hyper, variational = _roles(model)
    assert variational == {
        "variational_strategy._variational_distribution.variational_mean",
        "variational_strategy._variational_distribution.chol_variational_covar",
    }
    assert hyper == {
        "covar_module.raw_outputscale",
        "covar_module.raw_lengthscale",
        "covar_module.shift",
        "mean_module.raw_constant",
        "variational_strategy.features.landmarks",
    }
    twin = _twin(BranchGP(_landmarks(), NUM_LANDMARKS))
    twin_hyper, twin_variational = _roles(twin)
    assert {name.rsplit(".", 1)[-1] for name in twin_variational} == {"variational_mean", "chol_variational_covar"}
    pair = KernelEigenPairSVGP(_landmarks(), _kernel(), RANK, variational_distribution="natural").double()
    hyper, variational = _roles(pair)
    assert {name.rsplit(".", 1)[-1] for name in variational} == {"natural_vec", "natural_mat"}
    assert {name.rsplit(".", 1)[-1] for name in hyper} == {"raw_outputscale", "raw_lengthscale", "shift", "landmarks"}
    assert len(list(pair.hyperparameters())) + len(list(pair.variational_parameters())) == len(list(pair.parameters()))


# -- natural gradient descent ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["branch", "branch-whitened", "shared-pair", "shared-pair-whitened"])
def test_one_ngd_step_of_unit_length_reaches_the_optimal_q(case: str) -> None:
    # Gaussian likelihood, full batch, a model linear in one Gaussian q(u): a natural-gradient step of length 1 from any
    # q(u) lands on the optimum S = (P^{-1} + A^T A / sigma^2)^{-1}, m = S A^T (y - mu) / sigma^2 (P = Lambda^2, or I
    # when whitened; A = e Lambda^{-1} for a branch, (e + r) Lambda^{-1} for a pair with one shared posterior)
    x, y = _data(15)
    whiten = case.endswith("whitened")
    if case.startswith("branch"):
        model = BranchGP(
            _landmarks(),
            whiten=whiten,
            distribution=NaturalVariationalDistribution,
            mean_module=_constant_mean(0.2),
            learn_inducing_locations=False,
        )
        sides = ("left",)
    else:
        model = KernelEigenPairSVGP(
            _landmarks(),
            _kernel(),
            RANK,
            shared_posterior=True,
            whiten=whiten,
            variational_distribution="natural",
            mean_module=_constant_mean(0.2),
            learn_inducing_locations=False,
        ).double()
        sides = ("left", "right")
    likelihood = _gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=15)
    optimiser = gpytorch.optim.NGD(model.variational_parameters(), num_data=15, lr=1.0)
    model.train()
    losses = []
    for _ in range(2):
        optimiser.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    branches = [_dense_branch(model.covar_module, _landmarks(), x, RANK, side, whiten, True) for side in sides]
    interp = sum(branch[0] for branch in branches)
    prior_precision = np.eye(RANK) if whiten else np.diag(branches[0][2] ** -2)
    covariance = np.linalg.inv(prior_precision + interp.T @ interp / NOISE)
    mean = covariance @ interp.T @ (y.numpy() - 0.2) / NOISE
    q_mean, q_covariance = _q(model.variational_strategy)
    np.testing.assert_allclose(q_mean.reshape(RANK), mean, rtol=0.0, atol=1e-7)
    np.testing.assert_allclose(q_covariance.reshape(RANK, RANK), covariance, rtol=0.0, atol=1e-7)
    assert losses[1] < losses[0] - 1.0


def test_ngd_and_adam_train_the_natural_pair_model() -> None:
    # GPyTorch's recipe: NGD on the variational parameters, Adam on the hyperparameters and the likelihood
    x, y = _data(20)
    model = KernelEigenPairSVGP(_landmarks(), _kernel(), RANK, variational_distribution="natural").double()
    likelihood = _gaussian_likelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=20)
    ngd = gpytorch.optim.NGD(model.variational_parameters(), num_data=20, lr=0.5)
    adam = torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=0.05)
    model.train()
    likelihood.train()
    losses = []
    for _ in range(8):
        ngd.zero_grad()
        adam.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        ngd.step()
        adam.step()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    # the KL of the natural q(u) is the dense one against N(0, Lambda^2)
    model(x)  # the prior of the KL is that of the last call (GPyTorch's strategies memoise theirs alike)
    q_mean, q_covariance = _q(model.variational_strategy)
    landmarks = model.features.landmarks.detach()  # learned: moved by Adam
    singular_values = _numpy_svd(_kappa(model.covar_module, landmarks, landmarks), RANK)[1]
    kl = sum(_dense_kl(q_mean[b], q_covariance[b], singular_values**2) for b in range(2))
    assert model.variational_strategy.kl_divergence().item() == pytest.approx(kl, rel=1e-8)
