"""GPyTorch's own variational-strategy harness run on
:class:`~gpattn.variational.KernelEigenVariationalStrategy`, through the shipped
:class:`~gpattn.test.KernelEigenVariationalTestCase` (see its docstring for what it checks: shapes, nonzero gradients,
and that no Cholesky of :math:`K_{uu}` runs)."""

from __future__ import annotations

import functools
import unittest

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.variational._variational_strategy import _VariationalStrategy
from torch.distributions import MultivariateNormal

from gpattn.features import KernelEigenFeatures
from gpattn.kernels import ShiftedRBFKernel
from gpattn.test import KernelEigenVariationalTestCase
from gpattn.variational import KernelEigenVariationalStrategy


def _fixed_landmark_strategy(*args, learn_inducing_locations=True, **kwargs):
    return KernelEigenVariationalStrategy(*args, learn_inducing_locations=False, **kwargs)


class TestCholeskyELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    def test_fixed_landmarks_are_not_learned(self):
        # learn_inducing_locations=False must reach the features: no landmark parameter anywhere, one landmark tensor
        model, likelihood = self._make_model_and_likelihood(strategy_cls=_fixed_landmark_strategy)
        strategy = model.variational_strategy
        self.assertNotIn("landmarks", " ".join(name for name, _ in model.named_parameters()))
        self.assertNotIn("inducing_points", " ".join(name for name, _ in model.named_parameters()))
        self.assertIs(strategy.inducing_points, strategy.features.landmarks)
        landmarks = strategy.inducing_points.clone()
        self._training_iter(model, likelihood, mll_cls=self.mll_cls)
        self.assertTrue(torch.equal(strategy.features.landmarks, landmarks))


class TestCholeskyELBOBatch(KernelEigenVariationalTestCase, unittest.TestCase):
    @property
    def batch_shape(self):
        return torch.Size([2])


@pytest.mark.filterwarnings("ignore:Negative variance values detected")
class TestMeanFieldELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    r"""GPyTorch's mean-field initialisation reads ``prior.stddev``; in float32 the smallest :math:`\lambda_j^2` of the
    16 x 16 landmark matrix fall below GPyTorch's ``min_variance`` (1e-6) and are clamped with a NumericalWarning."""

    distribution_cls = gpytorch.variational.MeanFieldVariationalDistribution


class TestCholeskyPredictiveLL(KernelEigenVariationalTestCase, unittest.TestCase):
    mll_cls = gpytorch.mlls.PredictiveLogLikelihood


class TestNaturalELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    r"""Unwhitened natural q(u). The harness's "every parameter has a nonzero gradient" check is kept for every
    parameter but ``covar_module.raw_outputscale``, whose gradient vanishes legitimately at the harness's evaluation
    point:

    * :math:`\kappa = \sigma_f \hat\kappa` gives :math:`\Lambda = \sigma_f \hat\Lambda` and
      :math:`e(x) = \sigma_f \hat e(x)`, so the interpolation :math:`e(x) \Lambda^{-1}` is independent of
      :math:`\sigma_f`, and a natural q(u) has :math:`(m, S)` independent of :math:`\sigma_f` too;
    * with s = M (16 landmarks, 16 inducing variables) the residual :math:`k_e(x, x) - \|e(x)\|^2` is exactly 0;
    * the only remaining dependence is the KL through :math:`p(u) = \mathcal N(0, \sigma_f^2 \hat\Lambda^2)`, which
      is stationary in p at q = p: the harness never steps the optimiser, and the natural initialisation sets
      :math:`S = \Lambda^2` exactly (its 1e-3 noise enters :math:`\theta_1 = S^{-1} m`, so the gradient is
      O(1e-6) and rounds to 0 in float32).

    :meth:`test_outputscale_gradient_vanishes_only_at_q_equal_p` checks this in float64; the whitened natural case
    below runs the harness's check unchanged."""

    distribution_cls = gpytorch.variational.NaturalVariationalDistribution
    exempt = "covar_module.raw_outputscale"

    def _training_iter(
        self, model, likelihood, batch_shape=torch.Size([]), mll_cls=gpytorch.mlls.VariationalELBO, cuda=False
    ):
        # the harness's _training_iter with one documented exemption (see the class docstring)
        train_x = torch.randn(*batch_shape, 32, 2).clamp(-2.5, 2.5)
        train_y = torch.linspace(-1, 1, self.event_shape[0]).expand(*self.event_shape)
        mll = mll_cls(likelihood, model, num_data=train_x.size(-2))
        model.train()
        likelihood.train()
        output = model(train_x)
        loss = -mll(output, train_y)
        loss.sum().backward()
        for name, param in [*model.named_parameters(), *likelihood.named_parameters()]:
            self.assertIsNotNone(param.grad, name)
            if name == self.exempt:
                self.assertLess(param.grad.norm().item(), 1e-4, name)
            else:
                self.assertGreater(param.grad.norm().item(), 0, name)
        return output, loss

    def test_outputscale_gradient_vanishes_only_at_q_equal_p(self):
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            model, likelihood = self._make_model_and_likelihood(distribution_cls=self.distribution_cls)
            train_x = torch.randn(32, 2).clamp(-2.5, 2.5)
            mll = self.mll_cls(likelihood, model, num_data=32)
            grads = []
            for _ in range(2):
                model.zero_grad()
                output = model(train_x)
                # s = M: the residual vanishes
                self.assertLess(model.variational_strategy.features.residual_diag(train_x).abs().max().item(), 1e-10)
                (-mll(output, torch.linspace(-1, 1, 32))).backward()
                grads.append(model.covar_module.raw_outputscale.grad.abs().item())
                with torch.no_grad():  # move S away from the prior Lambda^2
                    model.variational_strategy._variational_distribution.natural_mat.mul_(1.1)
        finally:
            torch.set_default_dtype(dtype)
        self.assertLess(grads[0], 1e-4)
        self.assertGreater(grads[1], 1e-3)


class TestWhitenedNaturalELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    distribution_cls = gpytorch.variational.NaturalVariationalDistribution
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, whiten=True)


class TestWhitenedCholeskyELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, whiten=True)

    def test_whitened_prior_is_identity(self):
        model, _ = self._make_model_and_likelihood(strategy_cls=self.strategy_cls)
        prior = model.variational_strategy.prior_distribution
        self.assertTrue(torch.equal(prior.covariance_matrix, torch.eye(16)))


class TestAsymmetricCholeskyELBO(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False


class TestAsymmetricRightCholeskyELBOBatch(KernelEigenVariationalTestCase, unittest.TestCase):
    tie = False
    strategy_cls = functools.partial(KernelEigenVariationalStrategy, side="right")

    @property
    def batch_shape(self):
        return torch.Size([2])


class _GPyTorchBase(_VariationalStrategy):
    """GPyTorch's strategy base alone (its __init__, nothing else)."""

    prior_distribution = None


def _own_state(module: torch.nn.Module) -> tuple[set[str], set[str], set[str]]:
    return set(module._parameters), set(module._buffers), set(module._modules)


def test_init_sets_up_what_gpytorch_does_but_the_copy_of_the_landmarks():
    """``_VariationalStrategy.__init__`` is not called (see the class docstring): it registers a *copy* of the inducing
    points on the strategy. Everything else it sets up is set up alike (same parameters, buffers, submodules and
    attributes but ``inducing_points``), and the landmarks are one tensor, owned by the features."""
    landmarks = torch.randn(8, 2)
    model = torch.nn.Module()
    ours = KernelEigenVariationalStrategy(model, landmarks, gpytorch.variational.CholeskyVariationalDistribution(4))
    base = _GPyTorchBase(model, landmarks, gpytorch.variational.CholeskyVariationalDistribution(4))
    parameters, buffers, modules = _own_state(base)
    assert parameters == {"inducing_points"}  # GPyTorch's copy
    assert base.inducing_points.data_ptr() != landmarks.data_ptr()
    assert _own_state(ours) == (set(), buffers, modules | {"features"})
    assert ours.model is base.model is model and ours._jitter_val is base._jitter_val is None
    assert ours.jitter_val == base.jitter_val and not ours.variational_params_initialized.item()
    assert ours.inducing_points is ours.features.landmarks
    assert [name for name, _ in ours.named_parameters() if "landmarks" in name or "inducing" in name] == [
        "features.landmarks"
    ]


class _DeltaBranchGP(gpytorch.models.ApproximateGP):
    def __init__(self, landmarks: torch.Tensor, num_inducing: int, whiten: bool):
        q_u = gpytorch.variational.DeltaVariationalDistribution(num_inducing)
        super().__init__(KernelEigenVariationalStrategy(self, landmarks, q_u, whiten=whiten))
        self.covar_module = ShiftedRBFKernel(input_dim=landmarks.shape[-1])


@pytest.mark.parametrize("whiten", [False, True], ids=["unwhitened", "whitened"])
def test_a_delta_posterior_has_gpytorch_kl_and_trains(whiten: bool):
    r"""A delta :math:`q(u) = \delta_m` (GPyTorch's MAP ``DeltaVariationalDistribution``): its KL term is GPyTorch's,
    :math:`-\log \mathcal N(m; 0, \Lambda^2)` (or :math:`\mathcal N(0, I)` whitened), written here from the dense
    prior; ``VariationalELBO`` and ``PredictiveLogLikelihood`` evaluate, and :math:`q(f)` is the delta's mean
    :math:`e \Lambda^{-1} m` with only the residual as covariance."""
    torch.manual_seed(0)
    landmarks, inputs = torch.randn(7, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    model = _DeltaBranchGP(landmarks, 4, whiten).double()
    model(inputs)  # GPyTorch starts q(u) at the prior mean (plus a jitter)
    strategy = model.variational_strategy
    with torch.no_grad():
        strategy._variational_distribution.variational_mean.copy_(torch.randn(4, dtype=torch.float64))
    mean = strategy._variational_distribution.variational_mean.detach()
    singular_values = torch.linalg.svdvals(model.covar_module(landmarks, landmarks).to_dense())[:4].detach()
    variances = torch.ones_like(singular_values) if whiten else singular_values.square()
    prior = MultivariateNormal(torch.zeros_like(variances), covariance_matrix=torch.diag(variances))
    torch.testing.assert_close(strategy.kl_divergence(), -prior.log_prob(mean), rtol=1e-10, atol=1e-10)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    targets = torch.randn(5, dtype=torch.float64)
    for mll_cls in (gpytorch.mlls.VariationalELBO, gpytorch.mlls.PredictiveLogLikelihood):
        loss = -mll_cls(likelihood, model, num_data=5)(model(inputs), targets)
        loss.backward()
        assert torch.isfinite(loss) and mean.abs().sum() > 0
        assert strategy._variational_distribution.variational_mean.grad.abs().sum() > 0


def test_num_output_dims_needs_as_many_batch_dimensions_of_q():
    """``num_output_dims`` trailing batch dimensions of q(u) index outputs: a q(u) with fewer is refused at
    construction, naming the argument (it used to fail at the first call with a message about the landmarks' batch,
    and ``kl_divergence()`` before any call returned shape (1,) for a q(u) without a batch)."""
    features = KernelEigenFeatures(ShiftedRBFKernel(input_dim=2), torch.randn(6, 2), num_inducing=3)
    with pytest.raises(ValueError, match=r"num_output_dims=1 .* batch shape \(\)"):
        KernelEigenVariationalStrategy(
            torch.nn.Module(),
            None,
            gpytorch.variational.CholeskyVariationalDistribution(3),
            features=features,
            num_output_dims=1,
        )
    q_u = gpytorch.variational.CholeskyVariationalDistribution(3, batch_shape=torch.Size([4]))
    strategy = KernelEigenVariationalStrategy(torch.nn.Module(), None, q_u, features=features, num_output_dims=1)
    assert strategy.kl_divergence().shape == (4,)


class _KernelAs(gpytorch.models.ApproximateGP):
    def __init__(self, kernel_name: str, kernel: torch.nn.Module):
        q_u = gpytorch.variational.CholeskyVariationalDistribution(3)
        super().__init__(KernelEigenVariationalStrategy(self, torch.randn(6, 2), q_u))
        setattr(self, kernel_name, kernel)


@pytest.mark.parametrize(
    "kernel_name, kernel, got",
    [
        ("kernel", ShiftedRBFKernel(input_dim=2), "NoneType"),
        ("covar_module", gpytorch.kernels.RBFKernel(), "RBFKernel"),
    ],
    ids=["no-covar-module", "gpytorch-kernel"],
)
def test_a_model_without_an_asymmetric_covar_module_gets_a_clear_error(kernel_name, kernel, got):
    """The default features read ``model.covar_module``: a model without one (the kernel under another name) got
    "'KernelEigenFeatures' object has no attribute 'singular_values'" (an AttributeError inside a property, replaced by
    torch's), and a GPyTorch kernel a TypeError about a LazyEvaluatedKernelTensor; both now name the model and
    ``covar_module``, at the call and at ``kl_divergence()``."""
    model = _KernelAs(kernel_name, kernel)
    message = rf"_KernelAs: .*model\.covar_module.*AsymmetricKernel.*got {got}"
    with pytest.raises(TypeError, match=message):
        model(torch.randn(4, 2))
    with pytest.raises(TypeError, match=message):
        model.variational_strategy.kl_divergence()


def test_landmarks_other_than_the_given_features_are_refused():
    """With ``features`` given, the features' landmarks are the ones used: other ``inducing_points`` were silently
    ignored (predictions on the features' landmarks, not the ones given); the features' own landmarks (the same tensor
    or equal values) and ``None`` are accepted."""
    landmarks = torch.randn(6, 2, generator=torch.Generator().manual_seed(0))
    features = KernelEigenFeatures(ShiftedRBFKernel(input_dim=2), landmarks, num_inducing=3)
    q_u = gpytorch.variational.CholeskyVariationalDistribution(3)
    for given in (None, landmarks, features.landmarks, landmarks.double()):
        strategy = KernelEigenVariationalStrategy(torch.nn.Module(), given, q_u, features=features)
        assert strategy.inducing_points is features.landmarks
    for other, described in [(landmarks + 1.0, r"of shape \(6, 2\)"), (landmarks[:4], r"of shape \(4, 2\)")]:
        with pytest.raises(ValueError, match=rf"inducing_points {described} that are not the landmarks .* \(6, 2\)"):
            KernelEigenVariationalStrategy(torch.nn.Module(), other, q_u, features=features)


def test_a_strategy_over_per_call_features_names_the_missing_landmarks():
    """An attention layer's features have no landmarks: ``strategy.inducing_points`` raised an AttributeError whose
    reason torch.nn.Module replaced by "object has no attribute 'inducing_points'", and so did calling the strategy
    (GPyTorch's ``__call__`` reads them); both now name the features, and the call points to the readout."""
    from gpattn.attention import KEPSVGPAttention

    torch.manual_seed(0)
    strategy = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=2).strategy
    with pytest.raises(AttributeError, match=r"Strategy.inducing_points: AmortizedAttentionFeatures has no landmarks"):
        getattr(strategy, "inducing_points")  # noqa: B009 - the attribute lookup is what is tested
    assert not hasattr(strategy, "inducing_points")
    with pytest.raises(RuntimeError, match=r"AmortizedAttentionFeatures has no landmarks.*KernelEigenReadout"):
        strategy(torch.randn(2, 5, 8))
    with pytest.raises(AttributeError, match="has no attribute 'other'"):  # torch's lookup otherwise
        getattr(strategy, "other")  # noqa: B009


if __name__ == "__main__":
    unittest.main()


def _strategy(**kwargs) -> KernelEigenVariationalStrategy:
    features = KernelEigenFeatures(ShiftedRBFKernel(input_dim=2), torch.randn(6, 2), num_inducing=3)
    q_u = gpytorch.variational.CholeskyVariationalDistribution(3)
    return KernelEigenVariationalStrategy(torch.nn.Module(), None, q_u, features=features, **kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [("whiten", "no"), ("whiten", "False"), ("whiten", 2), ("whiten", None), ("learn_inducing_locations", "no")],
)
def test_flags_that_are_not_bools_are_refused(name, value):
    """``whiten="no"`` was read as ``bool("no") = True``: a whitened q(u) (prior N(0, I)) without a word."""
    with pytest.raises(TypeError, match=rf"KernelEigenVariationalStrategy: expected {name} to be True or False, got"):
        _strategy(**{name: value})


@pytest.mark.parametrize("whiten", [False, True, np.bool_(True)])
def test_whiten_is_kept_as_a_python_bool(whiten):
    assert _strategy(whiten=whiten).whiten is bool(whiten)


@pytest.mark.parametrize("jitter_val", [-1e-6, float("nan"), "1e-6"])
def test_a_bad_jitter_val_is_refused(jitter_val):
    """``jitter_val`` is unused (K_uu is diagonal) but GPyTorch's signature takes it: a bad one is still named."""
    with pytest.raises(ValueError, match=r"KernelEigenVariationalStrategy: expected jitter_val"):
        _strategy(jitter_val=jitter_val)
    assert _strategy(jitter_val=1e-6)._jitter_val == 1e-6
