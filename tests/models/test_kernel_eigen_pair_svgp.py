"""Training and bookkeeping tests of :class:`~gpattn.models.KernelEigenPairSVGP` on a small 1-D toy (float64).

The toy is ``make_asymmetric_regression_1d(n_train=60)`` with 12 evenly spaced landmarks and rank 8; every number that
is compared is float64 and every run is seeded, so the loss drops asserted below are deterministic up to BLAS rounding.
"""

from __future__ import annotations

import copy
from unittest.mock import patch

import gpytorch
import numpy as np
import pyro
import pytest
import torch

import gpattn.features.kernel_eigen_features as kernel_eigen_features
from gpattn.data import make_asymmetric_regression_1d
from gpattn.kernels import CosineFeatureKernel, ShiftedRBFKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.models.kernel_eigen_pair_svgp import FANTASY_UNSUPPORTED

NUM_LANDMARKS = 12
RANK = 8


@pytest.fixture(scope="module")
def data():
    toy = make_asymmetric_regression_1d(n_train=60, dtype=torch.float64)
    landmarks = torch.linspace(toy.train_x.min(), toy.train_x.max(), NUM_LANDMARKS, dtype=torch.float64)
    return toy.train_x, toy.train_y, landmarks.unsqueeze(-1)  # shapes: (60, 1), (60,), (12, 1)


def _model(landmarks, kernel=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    kernel = ShiftedRBFKernel(1) if kernel is None else kernel
    return KernelEigenPairSVGP(
        landmarks, kernel.double(), num_inducing=kwargs.pop("num_inducing", RANK), **kwargs
    ).double()


def _train(gp, likelihood, mll, x, y, steps, lr=0.05):
    optimizer = torch.optim.Adam([*gp.parameters(), *likelihood.parameters()], lr=lr)
    gp.train()
    likelihood.train()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = -mll(gp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "mll_cls, kwargs, min_drop",
    [
        # observed (float64, seed 0): 5.68 -> 1.44, 1.93 -> 0.40, 5.68 -> 1.07
        (gpytorch.mlls.VariationalELBO, {}, 3.0),
        (gpytorch.mlls.PredictiveLogLikelihood, {}, 1.0),
        (gpytorch.mlls.VariationalELBO, {"whiten": True}, 3.0),
    ],
    ids=["elbo", "predictive-ll", "elbo-whitened"],
)
def test_training_lowers_the_loss(data, mll_cls, kwargs, min_drop):
    x, y, landmarks = data
    gp = _model(landmarks, **kwargs)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    losses = _train(gp, likelihood, mll_cls(likelihood, gp, num_data=x.shape[0]), x, y, steps=60)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] - losses[-1] > min_drop, (losses[0], losses[-1])
    assert losses[-1] < 0.5 * losses[0]


def test_concat_merge_with_multitask_likelihood_runs_one_step(data):
    x, y, landmarks = data
    gp = _model(landmarks, merge="concat")
    likelihood = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2).double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0])
    targets = torch.stack([y, -y], dim=-1)  # shape: (60, 2)
    output = gp(x)
    assert isinstance(output, gpytorch.distributions.MultitaskMultivariateNormal)
    assert output.mean.shape == (x.shape[0], 2)
    losses = _train(gp, likelihood, mll, x, targets, steps=1)
    assert torch.isfinite(torch.tensor(losses[0]))
    # both branches of the stacked q(u) receive gradients
    assert (gp.variational_strategy._variational_distribution.variational_mean.grad.abs().sum(-1) > 0).all()


def test_primal_mode_includes_the_ksvd_penalty_and_keeps_J_small(data):
    x, y, landmarks = data
    eta = 1.0
    torch.manual_seed(0)  # the projections W_q, W_k are drawn from the global generator
    kernel = CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32)
    # rank 4: the top singular values of the 12 x 12 cosine matrix are well separated from 0 (lambda_4 ~ 0.29)
    gp = _model(landmarks, kernel=kernel, num_inducing=4, mode="primal", ksvd_weight=eta)
    features = gp.features
    # one feature object shared by both branches: the penalty is registered (and subtracted) once
    assert [name for name, _ in gp.named_added_loss_terms()] == ["variational_strategy.features.ksvd_loss"]
    assert abs(features.ksvd_objective().item()) < 1e-10  # the exact-KSVD initialisation is stationary

    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0])
    optimizer = torch.optim.Adam([*gp.parameters(), *likelihood.parameters()], lr=0.01)
    losses, objectives = [], []
    for _ in range(40):
        optimizer.zero_grad()
        loss = -mll(gp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        with torch.no_grad():
            objectives.append(abs(features.ksvd_objective().item()))
    # observed (float64, seed 0): loss 2.84 -> 1.11; |J| jumps from 0 to 2.33 on the first Adam step (Adam moves every
    # weight by ~lr, and eta J^2 has no restoring gradient at J = 0), then oscillates with a decaying amplitude: at
    # most 0.19 over the last 10 steps (0.12 at the end), against Tr(W_e^T W_r) = 3.6 (J's two halves are each about
    # Tr(Lambda) = Tr(W_e^T W_r), so |J| / Tr is a relative violation of stationarity)
    coupling = (features.left_weights * features.right_weights).sum().item()
    assert losses[-1] < losses[0] - 1.0, (losses[0], losses[-1])
    assert max(objectives[-10:]) < 0.1 * coupling, (objectives, coupling)
    assert max(objectives[-10:]) < 0.25 * max(objectives[:10]), objectives

    # the mll subtracts eta J^2 (GPyTorch adds it un-normalised by num_data)
    gp.train()
    likelihood.train()
    output = gp(x)
    log_likelihood, kl, log_prior, added = gpytorch.mlls.VariationalELBO(
        likelihood, gp, num_data=x.shape[0], combine_terms=False
    )(output, y)
    objective = features.ksvd_objective()
    assert abs(objective.item()) > 1e-4  # a non-trivial check: J has moved off 0
    torch.testing.assert_close(added, eta * objective.pow(2))
    by_hand = (
        likelihood.expected_log_prob(y, output).sum() / x.shape[0]
        - gp.variational_strategy.kl_divergence() / x.shape[0]
        - eta * objective.pow(2)
    )
    torch.testing.assert_close(mll(output, y), by_hand)
    torch.testing.assert_close(log_likelihood - kl + log_prior - added, by_hand)
    assert log_prior.item() == 0.0


def _pyro_model_and_guide(gp, likelihood, num_data=None):
    def model(x, y):
        pyro.module("gp", gp)
        pyro.module("likelihood", likelihood)
        function_dist = gp.pyro_model(x, name_prefix="gp", num_data=num_data)
        with pyro.plate("gp.data_plate", dim=-1):
            function_samples = pyro.sample("gp.f(x)", function_dist)
            return pyro.sample("gp.y", pyro.distributions.Normal(function_samples, likelihood.noise.sqrt()), obs=y)

    def guide(x, y):
        function_dist = gp.pyro_guide(x, name_prefix="gp")
        with pyro.plate("gp.data_plate", dim=-1):
            pyro.sample("gp.f(x)", function_dist)

    return model, guide


def _latent_sites(trace):
    return [
        name for name, site in trace.nodes.items() if site["type"] == "sample" and not site["is_observed"]
    ]  # pyro.factor sites are observed


def test_pyro_svi_lowers_the_loss(data):
    x, y, landmarks = data
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    gp = _model(landmarks)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    initial_noise = likelihood.noise.item()
    model, guide = _pyro_model_and_guide(gp, likelihood)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    gp.train()
    likelihood.train()
    losses = [svi.step(x, y) for _ in range(60)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # observed (seed 0): mean of the first five 335, of the last five 91
    assert last < 0.5 * first, (first, last)
    assert likelihood.noise.item() != initial_noise  # the noise is learned through pyro.module

    assert _latent_sites(pyro.poutine.trace(guide).get_trace(x, y)) == ["gp.u", "gp.f(x)"]
    model_trace = pyro.poutine.trace(model).get_trace(x, y)
    assert _latent_sites(model_trace) == ["gp.u", "gp.f(x)"]
    assert model_trace.nodes["gp.y"]["is_observed"]


def test_an_eval_mode_elbo_reads_the_current_ksvd_penalty(data):
    # a validation loss in eval mode after an optimiser step: the penalty of the current weights, not the last step's
    x, y, landmarks = data
    torch.manual_seed(0)
    kernel = CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32)
    gp = _model(landmarks, kernel=kernel, num_inducing=4, mode="primal", ksvd_weight=2.0)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0], combine_terms=False)
    _train(gp, likelihood, gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0]), x, y, steps=1)
    with torch.no_grad():
        gp.features.left_weights.add_(0.2)  # J far from where the training step left it
    gp.eval()
    likelihood.eval()
    with torch.no_grad():
        added = mll(gp(x), y)[3]
        objective = gp.features.ksvd_objective()
    assert abs(objective.item()) > 1.0
    torch.testing.assert_close(added, 2.0 * objective.pow(2), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("num_data", [None, 600])
def test_pyro_svi_weighs_the_ksvd_penalty_as_the_variational_elbo_does(data, num_data):
    # Pyro's loss sums over the data set: n times VariationalELBO's per-datum loss, whose penalty eta J^2 is not divided
    # by n. With the same sampling (one seed), two penalty weights must therefore differ by n * eta * J^2 in Pyro's loss
    x, y, landmarks = data
    n = x.shape[0] if num_data is None else num_data
    torch.manual_seed(0)
    kernel = CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32)
    gp = _model(landmarks, kernel=kernel, num_inducing=4, mode="primal", ksvd_weight=2.0)
    with torch.no_grad():  # J off its stationary 0
        gp.features.left_weights.add_(0.1 * torch.randn_like(gp.features.left_weights))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    gp.train()
    likelihood.train()
    gp(x)  # initialises q(u) (a random jitter of its mean): both losses below then draw the same samples
    pyro.clear_param_store()
    model, guide = _pyro_model_and_guide(gp, likelihood, num_data)
    losses, penalties = {}, {}
    for eta in (2.0, 0.0):
        gp.features.ksvd_weight = eta
        pyro.set_rng_seed(1)
        losses[eta] = pyro.infer.Trace_ELBO().loss(model, guide, x, y)
        mll = gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0], combine_terms=False)
        penalties[eta] = mll(gp(x), y)[3].item()  # the added loss term, as VariationalELBO subtracts it
    objective = gp.features.ksvd_objective().item()
    assert abs(objective) > 0.1 and penalties[0.0] == 0.0
    assert penalties[2.0] == pytest.approx(2.0 * objective**2, rel=1e-12)
    assert losses[2.0] - losses[0.0] == pytest.approx(n * penalties[2.0], rel=1e-9)


def test_pyro_shared_posterior_samples_one_u_for_both_branches(data):
    x, y, landmarks = data
    pyro.clear_param_store()
    gp = _model(landmarks, shared_posterior=True)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model, guide = _pyro_model_and_guide(gp, likelihood)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(3)]  # several steps: the guide must not reuse a freed graph
    assert all(torch.isfinite(torch.tensor(losses)))
    guide_trace = pyro.poutine.trace(guide).get_trace(x, y)
    assert _latent_sites(guide_trace) == ["gp.u", "gp.f(x)"]
    assert _latent_sites(pyro.poutine.trace(model).get_trace(x, y)) == ["gp.u", "gp.f(x)"]
    assert guide_trace.nodes["gp.u"]["value"].shape == (1, RANK)  # one shared posterior for both branches


def test_state_dict_round_trip_gives_identical_predictions(data):
    x, y, landmarks = data
    gp = _model(landmarks)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    _train(gp, likelihood, gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0]), x, y, steps=5)
    fresh = _model(landmarks + 0.3, seed=1)
    fresh.load_state_dict(gp.state_dict())
    # the landmarks stay tied: strategies, features and key landmarks share one tensor after loading
    strategy = fresh.variational_strategy
    assert strategy.inducing_points is fresh.features.landmarks
    assert fresh.features.key_landmarks is fresh.features.landmarks
    gp.eval()
    fresh.eval()
    test_x = torch.linspace(-2.5, 2.5, 25, dtype=torch.float64).unsqueeze(-1)
    with torch.no_grad():
        expected, actual = gp(test_x), fresh(test_x)
        assert torch.equal(actual.mean, expected.mean)
        assert torch.equal(actual.covariance_matrix, expected.covariance_matrix)


@pytest.mark.parametrize("mode", ["exact", "primal"])
def test_the_model_is_deep_copied_after_a_call(data, mode):
    # a call leaves results on its autograd graph (GPyTorch's memos, the KSVD penalty), which deepcopy refuses ("Only
    # Tensors created explicitly by the user..."; GPyTorch's own SVGP too): the copy takes them detached, or not at all
    x, y, landmarks = data
    torch.manual_seed(0)
    kernel = ShiftedRBFKernel(1) if mode == "exact" else CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32)
    gp = _model(landmarks, kernel=kernel, num_inducing=4, mode=mode)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    _train(gp, likelihood, gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0]), x, y, steps=2)
    loss = -gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0])(gp(x), y)
    copies = [copy.deepcopy(gp)]
    loss.backward()  # the original's graph is intact
    copies.append(copy.deepcopy(gp))
    gp.eval()
    with torch.no_grad():
        expected = gp(x)
    gp(x)  # an eval-mode call with gradients: the memoised KSVD hangs on the graph
    copies.append(copy.deepcopy(gp))
    for duplicate in copies:
        with torch.no_grad():
            got = duplicate.eval()(x)
        assert torch.equal(got.mean, expected.mean) and torch.equal(got.covariance_matrix, expected.covariance_matrix)
        assert duplicate.covar_module is duplicate.features.kernel and duplicate.covar_module is not gp.covar_module


def test_eval_mode_caches_the_ksvd_and_train_clears_it(data):
    x, y, landmarks = data
    gp = _model(landmarks)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    _train(gp, likelihood, gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0]), x, y, steps=3)
    counter = patch.object(kernel_eigen_features, "kernel_svd", wraps=kernel_eigen_features.kernel_svd)
    with counter as kernel_svd, torch.no_grad():
        gp.eval()
        first, second = gp(x), gp(x)
        assert kernel_svd.call_count == 1
        assert torch.equal(first.mean, second.mean)
        assert torch.equal(first.covariance_matrix, second.covariance_matrix)
        cached = gp.features.decomposition()
        assert kernel_svd.call_count == 1

        gp.train()
        assert gp.features.decomposition() is not cached  # train() cleared the memo
        assert kernel_svd.call_count == 2
        gp(x), gp(x)  # training calls recompute every time
        assert kernel_svd.call_count == 4


def test_a_replaced_covar_module_is_the_kernel_of_the_prior_and_the_posterior(data):
    # one kernel module, held by the features: model.covar_module = k replaces it for q(f) and p(f) alike
    x, y, landmarks = data
    gp = _model(landmarks)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    _train(gp, likelihood, gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0]), x, y, steps=3)
    old = gp.covar_module
    # one module under two names (GPyTorch's covar_module and the features'): both key sets, one set of parameters
    state = gp.state_dict()
    assert gp.features.kernel is old and gp._modules["covar_module"] is old
    shared = [key.removeprefix("covar_module.") for key in state if key.startswith("covar_module.")]
    features_key = "variational_strategy.features.base_kernel."
    assert shared and all(state[f"covar_module.{k}"].data_ptr() == state[features_key + k].data_ptr() for k in shared)
    gp.initialize(**{"covar_module.shift": 0.25})  # GPyTorch's dotted names reach the features' kernel
    assert gp.features.kernel.shift.item() == 0.25
    gp.eval()
    with torch.no_grad():
        before = gp(x).mean  # memoises the old kernel's KSVD
    kernel = ShiftedRBFKernel(1, lengthscale=0.3, shift=1.0).double()
    gp.covar_module = kernel
    assert gp.covar_module is kernel and gp.features.kernel is kernel
    assert {id(p) for p in kernel.parameters()} <= {id(p) for p in gp.parameters()}
    assert not {id(p) for p in old.parameters()} & {id(p) for p in gp.parameters()}
    # the reference: a model built with that kernel and the same q(u)
    reference = _model(landmarks, kernel=ShiftedRBFKernel(1, lengthscale=0.3, shift=1.0))
    reference.load_state_dict(gp.state_dict())
    reference.eval()
    with torch.no_grad():
        posterior, expected = gp(x), reference(x)
        assert not torch.allclose(posterior.mean, before)  # the memoised KSVD was cleared
        torch.testing.assert_close(posterior.mean, expected.mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(posterior.covariance_matrix, expected.covariance_matrix, rtol=1e-12, atol=1e-12)
        prior = gp(x, prior=True).covariance_matrix
        torch.testing.assert_close(prior, reference(x, prior=True).covariance_matrix, rtol=1e-12, atol=1e-12)
    gp.train()
    (-gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0])(gp(x), y)).backward()
    assert kernel.raw_lengthscale.grad is not None and kernel.raw_lengthscale.grad.abs().item() > 0

    with pytest.raises(TypeError, match="covar_module: expected an AsymmetricKernel"):
        gp.covar_module = gpytorch.kernels.RBFKernel()
    with pytest.raises(ValueError, match="input_dim 1"):
        gp.covar_module = ShiftedRBFKernel(2).double()
    with pytest.raises(TypeError, match="landmarks' dtype torch.float64, got torch.float32"):
        gp.covar_module = ShiftedRBFKernel(1)
    primal = _model(
        landmarks, kernel=CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32), mode="primal", num_inducing=4
    )
    with pytest.raises(ValueError, match="primal-mode"):
        primal.covar_module = CosineFeatureKernel(1, feature_dim=16, lift="rff", lift_dim=32).double()
    assert gp.covar_module is kernel and gp._modules["covar_module"] is kernel  # the refused kernels changed nothing


def test_landmarks_of_a_batch_that_q_u_lacks_are_refused_clearly() -> None:
    # GPyTorch starts q(u) at p(u): with landmarks (3, M, d) each batch member has its own Lambda, which one unbatched
    # q(u) cannot start at (it failed with "output with shape [2, 5] doesn't match the broadcast shape [3, 2, 5]")
    torch.manual_seed(0)
    kernel, x = ShiftedRBFKernel(2).double(), torch.randn(5, 2, dtype=torch.float64)
    for landmarks, batch_shape in ((torch.randn(3, 8, 2), ()), (torch.randn(2, 8, 2), (3,))):
        model = KernelEigenPairSVGP(landmarks.double(), kernel, 5, batch_shape=torch.Size(batch_shape)).double()
        with pytest.raises(ValueError, match=r"KernelEigenPairSVGP: the landmarks of batch shape \(\d,\)"):
            model(x)
        assert model(x, prior=True).mean.shape[-1] == 5  # the prior needs no q(u)
    # with the landmarks' batch in q(u), or landmarks without a batch, as in GPyTorch
    batched = KernelEigenPairSVGP(torch.randn(3, 8, 2).double(), kernel, 5, batch_shape=torch.Size([3])).double()
    assert batched(x).mean.shape == (3, 5)
    shared = KernelEigenPairSVGP(torch.randn(8, 2).double(), kernel, 5, batch_shape=torch.Size([3])).double()
    assert shared(x).mean.shape == (3, 5)


def test_inputs_of_another_dtype_than_q_u_are_refused_clearly() -> None:
    # float64 landmarks and inputs, a float32 kernel and q(u): the shifted RBF kernel promotes, q(u)'s products do not
    landmarks, x = torch.randn(8, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    model = KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(2), num_inducing=4)
    with pytest.raises(TypeError, match=r"KernelEigenPairSVGP: x and the landmarks are torch.float64 but q\(u\) is"):
        model(x)
    assert model.double()(x).mean.dtype == torch.float64  # the usual order: build, then cast the model


def test_a_deep_kernel_model_trains_under_bfloat16_autocast() -> None:
    # autocast hands the GP bfloat16 features while q(u) stays float32 on purpose: the dtype check of the inputs
    # against q(u) must not refuse it (it did, for one commit)
    torch.manual_seed(0)
    network, x, y = torch.nn.Linear(3, 4), torch.randn(20, 3), torch.randn(20)
    model = KernelEigenPairSVGP(torch.randn(10, 4), ShiftedRBFKernel(4), num_inducing=4)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = network(x)
        loss = -mll(model(features), y)
    assert features.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    assert network.weight.grad is not None and torch.isfinite(network.weight.grad).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"merge": "mean"}, "merge"),
        ({"residual": "full"}, "residual"),
        ({"variational_distribution": "delta"}, "variational_distribution"),
    ],
)
def test_bad_names_raise(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _model(data[2], **kwargs)


def test_a_prior_of_the_kernel_counts_once_in_gpytorchs_elbo_and_in_pyro(data):
    # the kernel is a child under two names (covar_module, variational_strategy.features.base_kernel): GPyTorch's
    # named_priors() walks the children without a memo, so VariationalELBO (and pyro_model) added its prior twice
    x, y, landmarks = data
    kernel = ShiftedRBFKernel(1).double()
    kernel.register_prior("lengthscale_prior", gpytorch.priors.GammaPrior(3.0, 2.0), lambda module: module.lengthscale)
    gp = _model(landmarks, kernel=kernel)
    rates = torch.tensor([3.0, 2.0], dtype=torch.float64)
    expected = torch.distributions.Gamma(*rates).log_prob(kernel.lengthscale.detach()).sum()  # counted once
    assert [name for name, *_ in gp.named_priors()] == ["variational_strategy.features.base_kernel.lengthscale_prior"]
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, gp, num_data=x.shape[0], combine_terms=False)
    log_prior = mll(gp(x), y)[2]
    torch.testing.assert_close(log_prior, expected / x.shape[0], rtol=1e-6, atol=0.0, check_dtype=False)
    trace = pyro.poutine.trace(gp.pyro_model).get_trace(x, name_prefix="gp")
    log_factor = trace.nodes["gp.log_prior"]["fn"].log_factor
    torch.testing.assert_close(log_factor, expected, rtol=1e-6, atol=0.0, check_dtype=False)  # float32 prior rates
    # the kernel is still one module under both names for the state dict, the modes and the dtype
    assert gp.covar_module is gp.features.base_kernel and "covar_module.raw_lengthscale" in gp.state_dict()
    assert not gp.eval().covar_module.training and gp.float().covar_module.raw_lengthscale.dtype == torch.float32


def test_pyro_sample_from_prior_samples_the_kernel_once(data):
    """GPyTorch's random copy copies each child on its own: its covar_module was a second kernel, sampled as a second
    site (a latent variable the likelihood never reads)."""
    kernel = ShiftedRBFKernel(1).double()
    kernel.register_prior(
        "lengthscale_prior",
        gpytorch.priors.GammaPrior(3.0, 2.0),
        lambda module: module.lengthscale,
        lambda module, value: module.initialize(
            raw_lengthscale=module.raw_lengthscale_constraint.inverse_transform(value)
        ),
    )
    gp = _model(data[2], kernel=kernel)
    trace = pyro.poutine.trace(gp.pyro_sample_from_prior).get_trace()
    sites = [name for name, node in trace.nodes.items() if node["type"] == "sample"]
    assert sites == ["variational_strategy.features.base_kernel.lengthscale_prior"]
    sampled = trace.nodes["_RETURN"]["value"]
    assert sampled.covar_module is sampled.features.base_kernel
    value = trace.nodes[sites[0]]["value"]
    torch.testing.assert_close(sampled.covar_module.lengthscale, value.expand_as(sampled.covar_module.lengthscale))


def test_shared_posterior_is_a_flag_not_a_truthy_value(data):
    # shared_posterior="no" built one shared q(u) (a non-empty string is true); NumPy's bools are flags
    with pytest.raises(TypeError, match="KernelEigenPairSVGP: expected shared_posterior to be True or False, got 'no'"):
        _model(data[2], shared_posterior="no")
    model = _model(data[2], shared_posterior=np.False_)
    assert model.variational_strategy.shared_posterior is False
    assert model.variational_strategy.variational_distribution.batch_shape == (2,)  # left and right


@pytest.mark.parametrize("shared_posterior", [False, True])
def test_every_parameter_is_listed_once(shared_posterior: bool) -> None:
    """The landmarks, kernel and (shared) q(u) are tied across the two branches: GPyTorch's per-module
    ``hyperparameters()``/``variational_parameters()`` must still list each tensor once (an optimiser rejects
    duplicates)."""
    landmarks = torch.linspace(-3, 3, 10, dtype=torch.float64).unsqueeze(-1)
    model = KernelEigenPairSVGP(
        landmarks, ShiftedRBFKernel(1).double(), num_inducing=6, shared_posterior=shared_posterior
    )
    for named in (model.named_hyperparameters(), model.named_variational_parameters(), model.named_parameters()):
        params = [param for _, param in named]
        assert len(params) == len({id(param) for param in params})
    hyper = {id(param) for param in model.hyperparameters()}
    variational = {id(param) for param in model.variational_parameters()}
    assert hyper.isdisjoint(variational)
    assert hyper | variational == {id(param) for param in model.parameters()}
    # one q(u) stacked over the branches (or shared): its mean and Cholesky factor
    assert len(variational) == 2


def test_duplicated_landmarks_give_a_finite_elbo_and_prediction() -> None:
    """Issue 14: duplicated landmarks with num_inducing equal to their number gave an all-NaN mean in eval and a NaN
    first ELBO; the numerically zero directions are now left out (zero interpolation, unit prior)."""
    torch.manual_seed(3)
    landmarks = torch.linspace(-2, 2, 6, dtype=torch.float64).unsqueeze(-1).repeat(2, 1)  # 12 landmarks, 6 distinct
    model = KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(1).double(), num_inducing=12).double()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    x = torch.linspace(-2, 2, 20, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(x).squeeze(-1)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=20)
    model.train()
    loss = -mll(model(x), y)
    assert torch.isfinite(loss)
    assert model.features.numerical_rank <= 6
    assert 0 <= model.variational_strategy.kl_divergence().item() < 100  # not ~1/lambda^2 of the zero directions
    model.eval()
    assert torch.isfinite(model(x).mean).all() and torch.isfinite(model(x).variance).all()


def test_get_fantasy_model_explains_why_it_is_not_supported(data):
    # GPyTorch's online conditioning would treat the kernel-eigen inducing variables as values f(Z): refuse, and say so
    x, y, landmarks = data
    gp = _model(landmarks)
    with pytest.raises(NotImplementedError) as caught:
        gp.get_fantasy_model(x[:3], y[:3])
    assert str(caught.value) == f"KernelEigenPairSVGP: {FANTASY_UNSUPPORTED}"
    assert "projections u = H^T f (K_uu = Lambda^2), not values f(Z)" in FANTASY_UNSUPPORTED
