"""GPyTorch's own variational-strategy harness run on
:class:`~gpattn.variational.KernelEigenVariationalStrategy`, through the shipped
:class:`~gpattn.test.KernelEigenVariationalTestCase` (see its docstring for what it checks: shapes, nonzero gradients,
and that no Cholesky of :math:`K_{uu}` runs)."""

from __future__ import annotations

import functools
import unittest

import gpytorch
import pytest
import torch

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


if __name__ == "__main__":
    unittest.main()


# -- per-token ("marginal") noise: moments by one GEMM against the dense computation, then Monte Carlo ---------------
def _noise_layer(seed: int, **kwargs):
    from gpattn.attention import KEPSVGPAttention

    torch.manual_seed(seed)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, num_outputs=3, **kwargs).double()
    # a full, random S per output and branch (the layer starts at a diagonal one)
    chol = layer.strategy._variational_distribution.chol_variational_covar
    with torch.no_grad():
        chol.copy_(torch.randn_like(chol).tril(-1) + torch.diag_embed(torch.rand(chol.shape[:-1]).double() + 0.5))
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    return layer, layer.features(x, objective=False, kernel_diag=True)


def _dense_token_covariance(layer, scores, first: str, second: str) -> torch.Tensor:
    """a_n S_c b_n^T from the dense S of every output, (B, H, d_out, N), and the same by the old root (a L)(b L)^T."""
    strategy = layer.strategy
    covariance = strategy.variational_distribution.covariance_matrix  # (H, d_out, branches, s, s)
    index = {"left": 0, "right": 1}
    s_first = covariance[:, :, 0 if covariance.shape[2] == 1 else index[first]]
    a, b = scores.interp(first), scores.interp(second)  # (B, H, N, s)
    dense = torch.einsum("bhni,hcij,bhnj->bhcn", a, s_first, b)
    root = torch.linalg.cholesky(s_first)  # (H, d_out, s, s)
    by_root = (torch.einsum("bhni,hcij->bhcnj", a, root) * torch.einsum("bhni,hcij->bhcnj", b, root)).sum(-1)
    torch.testing.assert_close(dense, by_root)
    return dense


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
def test_token_noise_moments_equal_the_dense_computation(shared: bool):
    layer, scores = _noise_layer(1, shared_posterior=shared)
    moments = layer.strategy.token_noise_moments(scores, ("left", "right"))
    assert set(moments) == ({("left", "left"), ("right", "right")} | ({("left", "right")} if shared else set()))
    for (first, second), value in moments.items():
        assert value.shape == (2, 2, 3, 4)
        torch.testing.assert_close(value, _dense_token_covariance(layer, scores, first, second), rtol=1e-12, atol=1e-12)


def _monte_carlo(layer, scores, num_draws: int, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    draws = [layer.strategy.token_noise(scores, ("left", "right"), **kwargs) for _ in range(num_draws)]
    return {side: torch.stack([draw[side] for draw in draws]) for side in draws[0]}


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
@pytest.mark.parametrize("residual", ["none", "diag"])
def test_token_noise_monte_carlo_agrees(shared: bool, residual: str):
    layer, scores = _noise_layer(2, shared_posterior=shared, residual=residual)
    num_draws = 2000
    samples = _monte_carlo(layer, scores, num_draws, marginal=True)
    residuals = {side: scores.residual_diag(side)[:, :, None, :] if residual == "diag" else 0.0 for side in samples}
    variance = {side: _dense_token_covariance(layer, scores, side, side) + residuals[side] for side in samples}
    for side, draws in samples.items():
        assert draws.shape == (num_draws, 2, 2, 3, 4)
        assert (draws.mean(0).abs() <= 5 * (variance[side] / num_draws).sqrt()).all()
        relative = (draws.pow(2).mean(0) - variance[side]).abs() / variance[side]
        assert (relative <= 5 * (2.0 / num_draws) ** 0.5).all(), side
    cross = (samples["left"] * samples["right"]).mean(0)
    expected = _dense_token_covariance(layer, scores, "left", "right") if shared else torch.zeros_like(cross)
    scale = (variance["left"] * variance["right"] / num_draws).sqrt()
    assert ((cross - expected).abs() <= 5 * scale).all()
    if shared:  # the branches are clearly correlated: a shared q(u) must not be drawn independently
        assert (expected.abs() > 10 * scale).any()
    # different inputs and outputs are uncorrelated
    left = samples["left"]
    assert (
        (left[..., 0] * left[..., 1]).mean(0).abs()
        <= 5 * (variance["left"][..., 0] * variance["left"][..., 1] / num_draws).sqrt()
    ).all()


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
def test_token_noise_of_the_summed_branches(shared: bool):
    layer, scores = _noise_layer(4, shared_posterior=shared, residual="diag")
    num_draws = 2000
    samples = _monte_carlo(layer, scores, num_draws, marginal=True, sum_sides=True)
    assert set(samples) == {"left"}  # the noise of F_e + F_r under the first side
    expected = sum(_dense_token_covariance(layer, scores, a, b) for a in ("left", "right") for b in ("left", "right"))
    if not shared:
        expected = _dense_token_covariance(layer, scores, "left", "left") + _dense_token_covariance(
            layer, scores, "right", "right"
        )
    expected = expected + (scores.residual_diag("left") + scores.residual_diag("right"))[:, :, None, :]
    relative = (samples["left"].pow(2).mean(0) - expected).abs() / expected
    assert (relative <= 5 * (2.0 / num_draws) ** 0.5).all()
    # the variance the draw is scaled by is exactly this one (one normal per input and output)
    torch.manual_seed(9)
    noise = layer.strategy.token_noise(scores, ("left", "right"), True, sum_sides=True)["left"]
    torch.manual_seed(9)
    standard = torch.randn(expected.shape, dtype=expected.dtype)
    torch.testing.assert_close(noise, expected.sqrt() * standard)
