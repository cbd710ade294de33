"""The readout's fused autograd functions against direct computations (float64): the KL of a Cholesky q(u) against a
diagonal prior (CholeskyPriorKL, against torch.distributions) and the linear output y = b + S^T A with the
coefficients A = Lambda^{-1} sum_c u_c C_c of the mean or a joint draw (LinearOutput, against the formula written
here), the per-token noise of the summed branches through the output map (MarginalNoiseOutput, against the dense
quadratic forms written here and against the layer's unfused path); their hand-written backward passes against finite
differences (gradcheck)."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from gpattn.attention import KEPSVGPAttention
from gpattn.variational.cholesky_prior_kl import CholeskyPriorKL
from gpattn.variational.kernel_eigen_readout import KernelEigenReadout, _triangle_selections
from gpattn.variational.linear_output import LinearOutput
from gpattn.variational.marginal_noise import MarginalNoiseOutput

DTYPE = torch.float64
H, D_OUT, S, C, B, N = 2, 3, 4, 5, 3, 6


def _randn(*shape: int, seed: int, positive: bool = False) -> torch.Tensor:
    value = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)
    return (value.abs() + 0.5 if positive else value).requires_grad_()


# -- CholeskyPriorKL -------------------------------------------------------------------------------------------------
def _factor(seed: int) -> torch.Tensor:
    """A full (not triangular) Cholesky parameter (H, d_out, s, s) with a diagonal away from zero: only its lower
    triangle may enter."""
    value = torch.randn(H, D_OUT, S, S, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)
    return (value + 3.0 * torch.eye(S, dtype=DTYPE)).requires_grad_()


@pytest.mark.parametrize("total", [False, True], ids=["per-batch", "total"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-scales", "scales-per-head"])
def test_cholesky_prior_kl_against_torch_distributions(total: bool, aligned: bool):
    """sigma aligned with q(u)'s batch, (H, 1, s), or of Lambda's shape (H, s): the singleton dimension inserted."""
    mean, factor, scales = _randn(H, D_OUT, S, seed=1), _factor(2), _randn(H, S, seed=3, positive=True)
    scales = scales.unsqueeze(1) if aligned else scales
    kl = CholeskyPriorKL.apply(mean, factor, scales, total, 0 if aligned else 1)
    variances = (scales if aligned else scales.unsqueeze(1)).square().expand_as(mean)
    q = MultivariateNormal(mean, scale_tril=factor.tril())
    p = MultivariateNormal(torch.zeros_like(mean), covariance_matrix=torch.diag_embed(variances))
    expected = kl_divergence(q, p)
    torch.testing.assert_close(kl, expected.sum() if total else expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("total", [False, True], ids=["per-batch", "total"])
def test_cholesky_prior_kl_with_a_spectrum_per_sequence(total: bool):
    """sigma with a batch of its own in front of q(u)'s, (B, H, s) against q(u) of batch (H, d_out) (a spectrum per
    sequence, as the exact attention features give): the KL of every (sequence, head, output), and their sum with
    ``total`` (-s/2 counted once per element of the broadcast batch, not once per element of q(u))."""
    mean, factor, scales = _randn(H, D_OUT, S, seed=11), _factor(12), _randn(B, H, S, seed=13, positive=True)
    kl = CholeskyPriorKL.apply(mean, factor, scales, total, 1)
    variances = scales.unsqueeze(2).square().expand(B, H, D_OUT, S)
    covariance = factor.tril() @ factor.tril().mT
    q = MultivariateNormal(mean.expand(B, H, D_OUT, S), covariance_matrix=covariance.expand(B, H, D_OUT, S, S))
    p = MultivariateNormal(torch.zeros_like(variances), covariance_matrix=torch.diag_embed(variances))
    expected = kl_divergence(q, p)  # (B, H, d_out)
    torch.testing.assert_close(kl, expected.sum() if total else expected, rtol=1e-12, atol=1e-12)


def test_cholesky_prior_kl_gradients():
    """gradcheck of every input; the upper triangle of the parameter gets a zero gradient."""
    inputs = (_randn(H, D_OUT, S, seed=4), _factor(5), _randn(H, 1, S, seed=6, positive=True))
    per_head = (*inputs[:2], _randn(H, S, seed=7, positive=True))  # sigma of Lambda's shape (H, s)
    for total in (False, True):
        for arguments, singletons in ((inputs, 0), (per_head, 1)):
            function = lambda m, f, s, t=total, n=singletons: CholeskyPriorKL.apply(m, f, s, t, n)  # noqa: E731
            assert torch.autograd.gradcheck(function, arguments)
    (grad,) = torch.autograd.grad(CholeskyPriorKL.apply(*inputs, True), inputs[1])
    assert torch.equal(grad.triu(1), torch.zeros_like(grad))


# -- LinearOutput ----------------------------------------------------------------------------------------------------
def _expected_output(columns, bias, mean, factor, noise, singular_values, active, maps, branches):
    """y = b + sum_branch S_branch^T A_branch with A = Lambda^{-1} sum_c u_c C_c, written per sequence, branch and
    head with explicit loops (u = m + L eps, or the draws given as a 5-dimensional mean)."""
    stacked = mean.shape[2]
    output = bias.expand(columns.shape[0], columns.shape[-1], -1).clone()
    for b in range(columns.shape[0]):
        for q in range(branches):
            source = 0 if stacked == 1 else q
            for h in range(H):
                if mean.dim() == 5:
                    u = mean[h, :, source, :, b]  # (d_out, s)
                elif factor is None:
                    u = mean[h, :, source]
                else:
                    u = mean[h, :, source] + (factor[h, :, source].tril() @ noise[b, h, :, source, :, None])[..., 0]
                weights = maps[h] if maps.dim() == 3 else maps[q, h]  # (d_out, C)
                coefficients = u.mT @ weights  # (s, C)
                if singular_values is not None:
                    lam = singular_values[h] if singular_values.dim() == 2 else singular_values[b, h]
                    coefficients = coefficients / lam[:, None]
                if active is not None:
                    on = active[h] if active.dim() == 2 else active[b, h]
                    coefficients = coefficients * on[:, None].to(DTYPE)
                rows = columns[b, (q * H + h) * S : (q * H + h + 1) * S]  # (s, N)
                output[b] = output[b] + rows.mT @ coefficients
    return output


CASES = {
    # name: (stacked Q, branches read, joint draw, maps per branch, Lambda per sequence, whitened, draws given[,
    # the active directions: "shared" (H, s) or "none"; by default per sequence with Lambda per sequence])
    "pair-joint": (2, 2, True, False, False, False, False),
    "pair-mean": (2, 2, False, False, False, False, False),
    "concat-maps": (2, 2, True, True, False, False, False),
    "shared-posterior": (1, 2, True, False, False, False, False),
    "cross-attention": (2, 1, True, False, False, False, False),
    "single-branch": (1, 1, True, False, False, False, False),
    "spectrum-per-sequence": (2, 2, False, False, True, False, False),
    "spectrum-per-sequence-joint": (2, 2, True, False, True, False, False),
    "whitened": (2, 2, True, False, False, True, False),
    "draws-given": (2, 2, False, False, False, False, True),
    # the active directions given with a learned spectrum (H, s), and a spectrum per sequence with every direction
    # active (U / Lambda: the division path)
    "spectrum-with-inactive": (2, 2, True, False, False, False, False, "shared"),
    "spectrum-per-sequence-all-active": (2, 2, True, False, True, False, False, "none"),
}


def _linear_output_inputs(case: str, seed: int = 10) -> tuple:
    stacked, branches, joint, per_branch, per_sequence, whitened, drawn, *actives = CASES[case]
    columns = _randn(B, branches * H * S, N, seed=seed)
    bias = _randn(C, seed=seed + 1)
    mean = _randn(H, D_OUT, stacked, S, *((B,) if drawn else ()), seed=seed + 2)
    factor = noise = None
    if joint:
        factor = _randn(H, D_OUT, stacked, S, S, seed=seed + 3)
        noise = torch.randn(B, H, D_OUT, stacked, S, generator=torch.Generator().manual_seed(seed + 4), dtype=DTYPE)
    singular_values = _randn(*((B,) if per_sequence else ()), H, S, seed=seed + 5, positive=True)
    active = None
    if per_sequence:  # the last direction of one sequence is numerically zero
        active = torch.ones(B, H, S, dtype=torch.bool)
        active[1, :, -1] = False
    if whitened:
        singular_values, active = None, torch.tensor([[True] * (S - 1) + [False]] * H)
    if actives == ["shared"]:  # one mask (H, s) for every sequence, its last direction inactive
        active = torch.tensor([[True] * (S - 1) + [False]] * H)
    elif actives == ["none"]:
        active = None
    maps = _randn(*((branches,) if per_branch else ()), H, D_OUT, C, seed=seed + 6)
    return columns, bias, mean, factor, noise, singular_values, active, maps, branches


@pytest.mark.parametrize("case", list(CASES))
def test_linear_output_against_the_formula(case: str):
    inputs = _linear_output_inputs(case)
    torch.testing.assert_close(LinearOutput.apply(*inputs), _expected_output(*inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_linear_output_gradients(case: str):
    """gradcheck of every differentiable input: the columns, the bias, the mean (or the draws), the Cholesky
    parameter, the singular values and the maps."""
    columns, bias, mean, factor, noise, singular_values, active, maps, branches = _linear_output_inputs(case)
    names = ["columns", "bias", "mean", "factor", "singular_values", "maps"]
    values = dict(zip(names, (columns, bias, mean, factor, singular_values, maps), strict=True))
    present = [name for name in names if values[name] is not None]

    def function(*tensors):
        given = values | dict(zip(present, tensors, strict=True))
        arguments = (given["mean"], given["factor"], noise, given["singular_values"], active, given["maps"])
        return LinearOutput.apply(given["columns"], given["bias"], *arguments, branches)

    assert torch.autograd.gradcheck(function, [values[name] for name in present])


def test_linear_output_with_one_sequence_of_its_own_spectrum():
    """A spectrum per sequence (B, H, s) with B = 1 keeps its sequence dimension in the gradient (the shapes of (H, s)
    and (1, H, s) draws differ only there): gradcheck and the formula."""
    columns, bias, mean, factor, noise, singular_values, active, maps, branches = _linear_output_inputs(
        "spectrum-per-sequence-joint"
    )
    columns = columns[:1].detach().requires_grad_()
    singular_values = singular_values[:1].detach().requires_grad_()
    noise, active = noise[:1], active[:1]
    inputs = (columns, bias, mean, factor, noise, singular_values, active, maps, branches)
    torch.testing.assert_close(LinearOutput.apply(*inputs), _expected_output(*inputs), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *tensors: LinearOutput.apply(*tensors[:3], tensors[3], noise, tensors[4], active, tensors[5], branches),
        (columns, bias, mean, factor, singular_values, maps),
    )


@pytest.mark.parametrize("case", ["pair-joint", "pair-mean", "shared-posterior", "spectrum-per-sequence-joint"])
def test_linear_output_copies_one_small_tensor_per_pass(case: str):
    """The products are laid out so that no operand is copied (each copy is a kernel launch on a GPU): one copy of the
    coefficients forward (into the output GEMM's layout) and one of their gradient backward, whatever the case, besides
    the output GEMM's copy of the bias (the einsums of the code before copied operands three to five more times)."""
    from torch.profiler import ProfilerActivity, profile

    inputs = _linear_output_inputs(case)
    grad = torch.randn(B, N, C, dtype=DTYPE)  # contiguous, as a next layer hands it back
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        LinearOutput.apply(*inputs).backward(grad)

    def inside_the_function(event) -> bool:  # not the AccumulateGrad of the leaf inputs
        parent = event.cpu_parent
        while parent is not None and "LinearOutput" not in parent.name:
            parent = parent.cpu_parent
        return parent is not None

    copies = [event for event in profiler.events() if event.name == "aten::copy_" and inside_the_function(event)]
    copies = [event for event in copies if event.cpu_parent.name != "aten::baddbmm"]  # the bias into the output GEMM's
    assert len(copies) == 2, [event.cpu_parent.name for event in copies]


# -- MarginalNoiseOutput ---------------------------------------------------------------------------------------------
def _noise_inputs(branches: int, extra: bool, seed: int = 20) -> tuple:
    interps = _randn(branches, B, H, N, S, seed=seed)
    factor = torch.randn(H, D_OUT, branches, S, S, generator=torch.Generator().manual_seed(seed + 1), dtype=DTYPE)
    factor = (factor + 2.0 * torch.eye(S, dtype=DTYPE)).requires_grad_()
    variance = _randn(B, H, D_OUT, N, seed=seed + 2, positive=True) if extra else None
    noise = torch.randn(B, H, D_OUT, N, generator=torch.Generator().manual_seed(seed + 3), dtype=DTYPE)
    return interps, factor, variance, noise, _randn(H, D_OUT, C, seed=seed + 4)


@pytest.mark.parametrize("branches", [1, 2], ids=["shared", "independent"])
@pytest.mark.parametrize("extra", [False, True], ids=["no-residual", "residual"])
def test_marginal_noise_output_against_dense_quadratic_forms(branches: int, extra: bool):
    """y_n = sum_{h,c} sqrt(sum_q a^q_n L^q_c L^q_c^T a^q_n^T + extra) xi C_hc, every quadratic form dense."""
    interps, factor, variance, noise, maps = _noise_inputs(branches, extra)
    got = MarginalNoiseOutput.apply(interps, factor, variance, noise, maps, *_triangle_selections(S, DTYPE, "cpu"))
    covariance = factor.tril() @ factor.tril().mT  # (H, d, Q, s, s)
    dense = torch.einsum("qbhni,hdqij,qbhnj->bhdn", interps, covariance, interps)
    dense = dense + (variance if extra else 0.0)
    expected = torch.einsum("bhdn,hdc->bnc", dense.sqrt() * noise, maps)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("branches", [1, 2], ids=["shared", "independent"])
@pytest.mark.parametrize("extra", [False, True], ids=["no-residual", "residual"])
def test_marginal_noise_output_gradients(branches: int, extra: bool):
    """gradcheck of the interpolation terms, the Cholesky parameter (its upper triangle gets no gradient), the extra
    variance and the map."""
    interps, factor, variance, noise, maps = _noise_inputs(branches, extra, seed=30)
    selections = _triangle_selections(S, DTYPE, "cpu")

    def function(a, f, v, m):
        return MarginalNoiseOutput.apply(a, f, v, noise, m, *selections)

    assert torch.autograd.gradcheck(function, (interps, factor, variance, maps))
    (grad,) = torch.autograd.grad(function(interps, factor, variance, maps).sum(), factor)
    assert torch.equal(grad.triu(1), torch.zeros_like(grad))


@pytest.mark.parametrize("shared", [False, True], ids=["independent", "shared"])
@pytest.mark.parametrize("residual", ["none", "diag"])
def test_the_layer_fused_noise_equals_its_unfused_path(monkeypatch, shared: bool, residual: str):
    """KEP-SVGP with marginal sampling and merge='sum': the fused noise gives the draw, the output and every gradient
    of the path through token_noise (float64, the same seed)."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, sampling="marginal", shared_posterior=shared, residual=residual)
    layer = layer.double().train()
    x = torch.randn(3, 5, 8, dtype=DTYPE)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(KernelEigenReadout, "summed_noise_output", lambda *args, **kwargs: None)
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        output = layer(x)
        output.square().sum().backward()
        results.append((output.detach(), {name: p.grad.clone() for name, p in layer.named_parameters()}))
    (output, grads), (reference, reference_grads) = results
    torch.testing.assert_close(output, reference, rtol=1e-12, atol=1e-12)
    assert grads.keys() == reference_grads.keys()
    for name, value in reference_grads.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_marginal_noise_output_below_the_variance_floor():
    """Variances below the dtype's epsilon are floored before the square root, with no gradient there (as
    ``clamp_min`` gives): a tiny S leaves the output at sqrt(eps) xi C and every gradient but the map's zero."""
    interps, factor, _, noise, maps = _noise_inputs(1, False, seed=40)
    tiny = (1e-12 * factor.detach()).requires_grad_()
    output = MarginalNoiseOutput.apply(interps, tiny, None, noise, maps, *_triangle_selections(S, DTYPE, "cpu"))
    floor = torch.finfo(DTYPE).eps
    expected = torch.einsum("bhdn,hdc->bnc", floor**0.5 * noise, maps)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-14)
    grad_interps, grad_factor, grad_maps = torch.autograd.grad(output.sum(), (interps, tiny, maps))
    assert not grad_interps.any() and not grad_factor.any() and grad_maps.abs().sum() > 0
