"""Numerical robustness: the safeguarded SVD backward of ``kernel_svd``, positivity of the learned singular values,
overflow of the exponential kernel, float64 end to end and bfloat16 autocast for every attention."""

from __future__ import annotations

import math

import pytest
import torch
from gpytorch.constraints import GreaterThan, Positive
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpattn.attention import KEPSVGPAttention, attention_names
from gpattn.features import SINGULAR_VALUE_FLOOR, AttentionKernelEigenFeatures, KernelEigenFeatures
from gpattn.kernels import CosineFeatureKernel, ExponentialDotProductKernel, InducedKernel
from gpattn.kernels.exponential_dot_product_kernel import safe_max_logit
from gpattn.ksvd import default_gradient_tolerance, kernel_svd
from gpattn.mlls import AttentionELBO
from gpattn.models import KernelEigenPairSVGP, predict_probabilities
from gpattn.variational import KernelEigenReadout

DTYPE = torch.float64
NAMES = attention_names()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _with_spectrum(num_rows: int, num_cols: int, singular_values: list[float], seed: int, dtype=DTYPE) -> Tensor:
    """``U diag(s) V^T`` with random orthonormal ``U`` (N x k) and ``V`` (M x k), k = len(s)."""
    generator, rank = _generator(seed), len(singular_values)
    left = torch.linalg.qr(torch.randn(num_rows, rank, generator=generator, dtype=DTYPE)).Q
    right = torch.linalg.qr(torch.randn(num_cols, rank, generator=generator, dtype=DTYPE)).Q
    return (left @ torch.diag(torch.tensor(singular_values, dtype=DTYPE)) @ right.T).to(dtype)


def _torch_svd(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-``rank`` triplets by ``torch.linalg.svd`` and its own autograd, signed as ``kernel_svd`` signs them."""
    left, singular_values, right_h = torch.linalg.svd(matrix, full_matrices=False)
    left, right = left[..., :rank], right_h[..., :rank, :].mT
    signs = torch.sign(torch.gather(left, -2, left.abs().argmax(-2, keepdim=True))).detach()
    return left * signs, singular_values[..., :rank], right * signs


def _random_projection(svd, seed: int) -> Tensor:
    """A loss that depends on every entry of every output: sum of random projections."""
    generator = _generator(seed)
    return sum((part * torch.randn(part.shape, generator=generator, dtype=part.dtype)).sum() for part in svd)


def _gradient(function, matrix: Tensor, seed: int = 0) -> Tensor:
    matrix = matrix.detach().clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(_random_projection(function(matrix), seed), matrix)
    return gradient


# -- kernel_svd: separated spectra are differentiated exactly ------------------------------------------------------
SEPARATED = [  # (batch, N, M, rank)
    ((), 6, 4, 3),
    ((), 4, 7, 2),
    ((), 5, 5, 5),
    ((2,), 6, 5, 3),
]


@pytest.mark.parametrize(("batch", "num_rows", "num_cols", "rank"), SEPARATED)
def test_svd_gradient_matches_torch_and_finite_differences(batch, num_rows, num_cols, rank):
    matrix = torch.randn(*batch, num_rows, num_cols, generator=_generator(num_rows + num_cols), dtype=DTYPE)
    values = torch.linalg.svdvals(matrix)
    squares = values.square()
    assert (squares[..., :-1] - squares[..., 1:]).min() > 1e-2 * squares[..., :1].min()  # well separated
    ours = _gradient(lambda a: kernel_svd(a, rank), matrix)
    reference = _gradient(lambda a: _torch_svd(a, rank), matrix)
    scale = reference.abs().max()
    # the broadening's relative bias is below (delta / gap)^2 ~ 2e-16 / 1e-4
    torch.testing.assert_close(ours, reference, atol=1e-9 * scale, rtol=0)
    unbroadened = _gradient(lambda a: kernel_svd(a, rank, gradient_tolerance=0.0), matrix)
    torch.testing.assert_close(unbroadened, reference, atol=1e-12 * scale, rtol=0)
    assert torch.autograd.gradcheck(
        lambda a: _random_projection(kernel_svd(a, rank), seed=1), (matrix.clone().requires_grad_(True),)
    )


@pytest.mark.parametrize(("dtype", "smallest"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_svd_gradient_is_exact_for_a_fast_decaying_spectrum(dtype, smallest):
    # smooth kernels (RBF) have spectra that decay over many decades: small but well separated singular values (far
    # above the noise floor max(N, M) eps s_1) keep torch's exact gradient; only near-degenerate pairs are broadened
    values = torch.logspace(0, math.log10(smallest), 8, dtype=DTYPE).tolist()
    matrix = _with_spectrum(12, 10, values, seed=30, dtype=dtype)
    ours = _gradient(lambda a: kernel_svd(a, 6), matrix)
    reference = _gradient(lambda a: _torch_svd(a, 6), matrix)
    assert reference.abs().max() > 1e3  # the small singular values matter
    rtol = 1e-8 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(ours, reference, atol=rtol * reference.abs().max().item(), rtol=0)


def test_randomized_gradient_is_exact_when_the_rank_is_reached():
    # K = P Q^T has rank 3: the randomised method's backward (its 3 triplets, tail taken as zero) is then exact
    generator = _generator(3)
    factors = [torch.randn(rows, 3, generator=generator, dtype=DTYPE, requires_grad=True) for rows in (8, 6)]

    def loss(method: str, left_factor: Tensor, right_factor: Tensor) -> Tensor:
        return _random_projection(kernel_svd(left_factor @ right_factor.T, 3, method=method), seed=2)

    exact = torch.autograd.grad(loss("exact", *factors), factors)
    randomized = torch.autograd.grad(loss("randomized", *factors), factors)
    for first, second in zip(exact, randomized, strict=True):
        torch.testing.assert_close(first, second, atol=1e-10, rtol=0)
    assert torch.autograd.gradcheck(lambda a, b: loss("randomized", a, b), tuple(factors))
    assert torch.autograd.gradcheck(lambda a, b: loss("exact", a, b), tuple(factors))


# -- kernel_svd: degenerate spectra give finite gradients ----------------------------------------------------------
def _padded(seed: int) -> Tensor:
    matrix = torch.randn(8, 8, generator=_generator(seed), dtype=DTYPE)
    matrix[5:] = 0.0  # padded queries and keys, as the exact attention features zero them
    matrix[:, 6:] = 0.0
    return matrix


DEGENERATE = {  # name -> (matrix, rank)
    "identity": (torch.eye(5, dtype=DTYPE), 2),
    "repeated_inside": (_with_spectrum(6, 5, [2.0, 2.0, 1.0, 0.5], seed=4), 3),
    "repeated_at_the_cut": (_with_spectrum(6, 5, [3.0, 1.0, 1.0, 0.2], seed=5), 2),
    "repeated_discarded": (_with_spectrum(5, 6, [3.0, 1.0, 1.0, 1.0], seed=6), 1),
    "rank_deficient_keeping_zeros": (_with_spectrum(8, 6, [2.0, 1.0], seed=7), 4),
    "padded": (_padded(8), 3),
    "constant": (torch.full((5, 5), 4.0, dtype=DTYPE), 2),  # a saturated exponential kernel
    "zero": (torch.zeros(4, 3, dtype=DTYPE), 2),
}


@pytest.mark.parametrize("method", ["exact", "randomized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(DEGENERATE))
def test_svd_gradient_is_finite_on_degenerate_spectra(name, dtype, method):
    matrix, rank = DEGENERATE[name]
    batch = torch.stack([matrix, 0.5 * matrix.flip(-1)]).to(dtype)  # and batched
    for case in (matrix.to(dtype), batch):
        gradient = _gradient(lambda a, case=case: kernel_svd(a, rank, method=method), case)
        assert torch.isfinite(gradient).all(), name
        # O(1) matrices and losses: O(1) gradients (observed <= 7), where torch gives NaN or up to 1e15
        assert gradient.abs().max() <= 100.0, name


def test_near_degenerate_gradient_is_bounded_where_torch_explodes():
    matrix = _with_spectrum(5, 4, [1.0 + 1e-13, 1.0, 0.5], seed=9)
    ours = _gradient(lambda a: kernel_svd(a, 2), matrix)
    reference = _gradient(lambda a: _torch_svd(a, 2), matrix)
    assert reference.abs().max() > 1e10  # 1 / (s_1^2 - s_2^2) ~ 5e12
    assert ours.abs().max() < 1.0 / default_gradient_tolerance(DTYPE)


def test_degenerate_gradients_of_invariant_losses_are_exact():
    # losses invariant to rotations inside a degenerate singular subspace have a gradient; the safeguard gives it
    # sum of all singular values (nuclear norm): d/dK = U V^T, with a repeated pair
    left = torch.linalg.qr(torch.randn(5, 3, generator=_generator(10), dtype=DTYPE)).Q
    right = torch.linalg.qr(torch.randn(3, 3, generator=_generator(11), dtype=DTYPE)).Q
    matrix = (left @ torch.diag(torch.tensor([2.0, 2.0, 1.0], dtype=DTYPE)) @ right.T).requires_grad_(True)
    (gradient,) = torch.autograd.grad(kernel_svd(matrix, 3).singular_values.sum(), matrix)
    torch.testing.assert_close(gradient, left @ right.T, atol=1e-12, rtol=0)
    # energy of the top-2 truncation with a repeated top pair: d/dK sum_{i<=2} s_i^2 = 2 K_2 (the truncation)
    matrix = _with_spectrum(6, 5, [3.0, 3.0, 1.0, 1.0], seed=12).requires_grad_(True)
    svd = kernel_svd(matrix, 2)
    (gradient,) = torch.autograd.grad(svd.singular_values.square().sum(), matrix)
    truncation = svd.left @ torch.diag(svd.singular_values) @ svd.right.T
    torch.testing.assert_close(gradient, 2 * truncation.detach(), atol=1e-12, rtol=0)
    # projectors on the top-2 singular subspaces (smooth in K: the cut has a gap) and the singular values
    weights = [torch.randn(size, size, generator=_generator(seed), dtype=DTYPE) for size, seed in ((6, 13), (5, 14))]

    def subspace_loss(a: Tensor) -> Tensor:
        svd = kernel_svd(a, 2)
        projectors = (svd.left @ svd.left.T, svd.right @ svd.right.T)
        return sum((p * w).sum() for p, w in zip(projectors, weights, strict=True)) + svd.singular_values.sum()

    assert torch.autograd.gradcheck(subspace_loss, (matrix.detach().clone().requires_grad_(True),))


def test_degenerate_gradient_of_a_coupled_loss_has_the_documented_bias():
    # <W, H_e Lambda H_r^T> with a repeated value among the kept ones is smooth in K, but its gradient needs the 0/0
    # limit of the pair: the safeguard drops 1/2 H_b (B + B^T - 2 diag B) G_b^T, B = H_b^T W G_b (the docstring)
    weight = torch.randn(6, 5, generator=_generator(15), dtype=DTYPE)

    def truncation_loss(a: Tensor) -> Tensor:
        svd = kernel_svd(a, 2)
        return ((svd.left * svd.singular_values.unsqueeze(-2)) @ svd.right.T * weight).sum()

    matrix = _with_spectrum(6, 5, [3.0, 3.0, 1.0, 0.5], seed=16).requires_grad_(True)
    (gradient,) = torch.autograd.grad(truncation_loss(matrix), matrix)
    numerical = torch.zeros_like(gradient)
    with torch.no_grad():
        for index in torch.cartesian_prod(torch.arange(6), torch.arange(5)).tolist():
            step = torch.zeros_like(matrix)
            step[tuple(index)] = 1e-6
            numerical[tuple(index)] = (truncation_loss(matrix + step) - truncation_loss(matrix - step)) / 2e-6
        svd = kernel_svd(matrix, 2)
        block = svd.left.T @ weight @ svd.right  # B
        dropped = 0.5 * svd.left @ (block + block.T - 2 * torch.diag(block.diagonal())) @ svd.right.T
    assert dropped.abs().max() > 1e-2  # a real bias, which the test pins down
    torch.testing.assert_close(gradient + dropped, numerical, atol=1e-7, rtol=0)
    # one step away from degeneracy the gradient is exact again
    separated = _with_spectrum(6, 5, [3.0, 2.9, 1.0, 0.5], seed=16).requires_grad_(True)
    assert torch.autograd.gradcheck(truncation_loss, (separated,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_svd_in_half_precision_runs_in_float32(dtype):
    matrix = _with_spectrum(7, 5, [3.0, 2.0, 1.0, 0.5], seed=14, dtype=dtype)
    svd = kernel_svd(matrix, 3)
    assert all(part.dtype == dtype for part in svd)
    reference = kernel_svd(matrix.float(), 3)
    for part, expected in zip(svd, reference, strict=True):
        torch.testing.assert_close(part.float(), expected, atol=1e-2, rtol=1e-2)
    gradient = _gradient(lambda a: kernel_svd(a, 3), matrix)
    assert gradient.dtype == dtype and torch.isfinite(gradient).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the randomised products stay in float32 too
        randomized = kernel_svd(matrix.float(), 3, method="randomized")
    torch.testing.assert_close(randomized.singular_values, reference.singular_values, atol=1e-5, rtol=1e-5)


def test_gradient_tolerance_is_validated():
    matrix = torch.eye(3, dtype=DTYPE)
    for bad in (-1.0, math.inf, math.nan, True, "small"):
        with pytest.raises(ValueError, match="gradient_tolerance"):
            kernel_svd(matrix, 2, gradient_tolerance=bad)
    assert default_gradient_tolerance(torch.float64) == pytest.approx(2**-26)
    assert default_gradient_tolerance(torch.float32) == pytest.approx(2**-11.5)


@pytest.mark.parametrize("kernel", ["cosine", "exponential"])
def test_exact_attention_with_padding_has_finite_gradients(kernel):
    # padded rows and columns make the kernel matrix rank-deficient with repeated zero singular values, where
    # torch.linalg.svd's own backward returns NaN in float32
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=2, features="exact", kernel=kernel)
    tokens = torch.randn(3, 5, 8, generator=_generator(15), requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 4:] = False
    output = layer(tokens, mask=mask)
    (output.square().sum() + layer.kl_divergence()).backward()
    assert torch.isfinite(output).all() and torch.isfinite(tokens.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_exact_attention_with_padding_and_residual_has_finite_gradients():
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=2, features="exact", residual="diag")
    tokens = torch.randn(3, 5, 8, generator=_generator(15), requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    layer(tokens, mask=mask).square().sum().backward()
    assert torch.isfinite(tokens.grad).all()


@pytest.mark.parametrize("kernel", ["cosine", "exponential"])
def test_exact_attention_on_a_rank_deficient_sequence_is_finite(kernel):
    torch.manual_seed(0)
    layer = KEPSVGPAttention(8, 2, num_inducing=3, features="exact", kernel=kernel)
    tokens = torch.randn(1, 1, 8, generator=_generator(20)).expand(2, 5, 8).clone()  # K has rank 1
    output = layer(tokens)
    assert torch.isfinite(output).all() and torch.isfinite(layer.kl_divergence())


# -- learned singular values stay positive ---------------------------------------------------------------------
LEARNED = [  # (layer class name in the registry, keyword arguments): every layer with a learned Lambda
    ("kep_svgp", {}),
    ("kep_svgp_sym", {}),
    ("primal", {}),
    ("kep_svgp", {"features": "primal_tokens", "max_len": 5}),
    ("primal", {"features": "primal_tokens", "max_len": 5}),
]


def _positive_transform_range(dtype: torch.dtype) -> Tensor:
    # raw values down to where Lambda^2 (the prior variance of the KL) is still a normal number with a finite
    # reciprocal: softplus(-40) ~ 4e-18 in float32, softplus(-350) ~ 1e-152 in float64
    low = -40.0 if dtype == torch.float32 else -350.0
    return torch.linspace(low, -low, 2001, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_positive_constraint_keeps_lambda_positive_over_the_raw_range(dtype):
    values = Positive().transform(_positive_transform_range(dtype))
    assert (values > 0).all() and torch.isfinite(values.square().reciprocal()).all()
    assert torch.isfinite(values.square().log()).all()


def _push_lambda_down(raw: torch.nn.Parameter, singular_values, steps: int = 30) -> None:
    # gradient descent on sum(log Lambda): d/draw log softplus(raw) -> 1 for raw << 0, so each step lowers raw by the
    # learning rate however small Lambda already is (an adversary stronger than any loss term of the models)
    optimizer = torch.optim.SGD([raw], lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        singular_values().log().sum().backward()
        optimizer.step()


@pytest.mark.parametrize(("name", "kwargs"), LEARNED)
def test_learned_lambda_stays_positive_under_adversarial_training(make_layer, name, kwargs):
    layer = make_layer(name, **kwargs)
    features = layer.features
    assert isinstance(features, AttentionKernelEigenFeatures)
    assert isinstance(features.raw_singular_values_constraint, GreaterThan)
    assert features.raw_singular_values_constraint.lower_bound.item() == pytest.approx(SINGULAR_VALUE_FLOOR, rel=1e-6)
    _push_lambda_down(features.raw_singular_values, lambda: features.singular_values)
    singular_values = features.singular_values
    assert singular_values.max() < 1e-4  # the push worked
    assert (singular_values > 0).all() and torch.isfinite(singular_values.square().reciprocal()).all()
    tokens = torch.randn(2, 5, 16, generator=_generator(16))
    layer.train()
    output = layer(tokens)
    kl = layer.kl_divergence()
    assert torch.isfinite(output).all() and torch.isfinite(kl)


def test_primal_kernel_eigen_features_lambda_stays_positive():
    torch.manual_seed(1)
    kernel = CosineFeatureKernel(2, feature_dim=8, lift="rff", lift_dim=16)
    landmarks = torch.randn(10, 2, generator=_generator(17))
    features = KernelEigenFeatures(kernel, landmarks, num_inducing=4, mode="primal")
    assert isinstance(features.raw_singular_values_constraint, GreaterThan)
    _push_lambda_down(features.raw_singular_values, lambda: features.singular_values)
    assert features.singular_values.max() < 1e-4
    assert (features.singular_values > 0).all()
    assert torch.isfinite(features.Kuu().inverse().to_dense()).all() and torch.isfinite(features.Kuu().logdet())


# -- the exponential kernel does not overflow ----------------------------------------------------------------------
def _large_logit_kernel(dtype: torch.dtype, logit: float = 1e4) -> tuple[ExponentialDotProductKernel, Tensor]:
    """A kernel with W_q = W_k = c I and unit tokens, so that the largest logit is ``logit``; and the tokens."""
    torch.manual_seed(2)
    kernel = ExponentialDotProductKernel(4, feature_dim=4).to(dtype)
    tokens = torch.nn.functional.normalize(torch.randn(6, 4, generator=_generator(18), dtype=dtype), dim=-1)
    with torch.no_grad():
        scale = math.sqrt(logit * 2.0)  # logits = c^2 <x, z> / sqrt(p), p = 4
        kernel.query_weight.copy_(scale * torch.eye(4))  # torch 2.1 has no bfloat16 eye
        kernel.key_weight.copy_(scale * torch.eye(4))
    return kernel, tokens.requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_exponential_kernel_with_large_logits_stays_finite(dtype):
    kernel, tokens = _large_logit_kernel(dtype)
    matrix = kernel(tokens, tokens)
    bound = safe_max_logit(dtype)
    assert matrix.dtype == dtype and torch.isfinite(matrix).all()
    # the diagonal logits 1e4 saturate (bfloat16 keeps 8 bits: the clamp and exp round by ~2^-5 together)
    assert matrix.max().item() == pytest.approx(kernel.outputscale.item() * math.exp(bound), rel=2**-4)
    # its square summed over tokens (induced kernels, residual diagonals) stays finite too
    assert torch.isfinite(matrix.square().sum(-1)).all()
    (matrix.sum() + matrix.square().sum()).backward()
    assert torch.isfinite(tokens.grad).all()
    assert torch.isfinite(kernel.query_weight.grad).all() and torch.isfinite(kernel.key_weight.grad).all()
    induced = InducedKernel(kernel, tokens.detach(), side="both")
    assert torch.isfinite(induced(tokens.detach()).to_dense()).all()


def test_exponential_kernel_clamp_bounds():
    assert safe_max_logit(torch.float32) == pytest.approx(36.04, abs=0.01)
    assert safe_max_logit(torch.float64) == pytest.approx(346.6, abs=0.1)
    assert 0 < safe_max_logit(torch.float16) < math.log(torch.finfo(torch.float16).max)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert math.isfinite(math.exp(safe_max_logit(dtype)) ** 2 * 2**24 / torch.finfo(dtype).max)
        assert math.exp(safe_max_logit(dtype)) ** 2 * 2**24 <= torch.finfo(dtype).max * 1.0001
    # inactive at moderate logits: the closed form exactly
    kernel, tokens = _large_logit_kernel(torch.float64, logit=20.0)
    logits = (tokens @ kernel.query_weight.T) @ (tokens @ kernel.key_weight.T).T / 2.0
    torch.testing.assert_close(kernel(tokens, tokens), kernel.outputscale * logits.exp(), atol=0, rtol=1e-13)
    # an explicit clamp is honoured
    explicit = ExponentialDotProductKernel(4, feature_dim=4, max_logit=5.0).double()
    explicit.load_state_dict(kernel.state_dict())
    assert explicit(tokens, tokens).max().item() == pytest.approx(kernel.outputscale.item() * math.exp(5.0))
    with pytest.raises(ValueError, match="max_logit"):
        ExponentialDotProductKernel(4, feature_dim=4, max_logit=math.nan)


def test_exact_exponential_attention_with_large_logits_is_finite():
    torch.manual_seed(3)
    layer = KEPSVGPAttention(8, 2, num_inducing=2, features="exact", kernel="exponential")
    with torch.no_grad():
        layer.features.kernel.query_weight.mul_(300.0)  # logits in the thousands
    tokens = (3.0 * torch.randn(3, 5, 8, generator=_generator(19))).requires_grad_(True)
    kernel = layer.features.kernel
    matrix = kernel(tokens.detach().unsqueeze(1), tokens.detach().unsqueeze(1))  # (B, H, N, N)
    saturated = kernel.outputscale.max().item() * math.exp(safe_max_logit(torch.float32))
    assert matrix.max().item() == pytest.approx(saturated, rel=1e-5)  # logits far beyond the clamp
    output = layer(tokens)
    (output.square().sum() + layer.kl_divergence()).backward()
    assert torch.isfinite(output).all() and torch.isfinite(tokens.grad).all()


# -- float64 end to end --------------------------------------------------------------------------------------------
class _LowPrecisionSpy(TorchDispatchMode):
    """Records every operator that produces a floating-point tensor that is not float64."""

    def __init__(self):
        super().__init__()
        self.offenders: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for value in tree_flatten(output)[0]:
            if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float64:
                self.offenders.add((str(func), value.dtype))
        return output


@pytest.fixture
def float32_default():
    # with a float32 default dtype any tensor created without an explicit dtype is float32, which the spy reports
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(previous)


def test_the_spy_sees_float32_operations():
    with _LowPrecisionSpy() as spy:
        (torch.ones(2, dtype=DTYPE) + torch.zeros(2)).sum()
    assert spy.offenders


@pytest.mark.usefixtures("float32_default")
@pytest.mark.parametrize("name", NAMES)
def test_double_transformer_computes_in_float64_only(make_transformer, name):
    model = make_transformer(name).double()
    tokens = torch.randint(0, 6, (4, 6), generator=_generator(20))
    mask = torch.arange(6) < torch.tensor([6, 3, 5, 6])[:, None]
    loss_fn = AttentionELBO(model, num_data=100)
    with _LowPrecisionSpy() as spy:
        model.train()
        logits = model(tokens, mask=mask)
        loss = loss_fn(logits, torch.tensor([0, 1, 1, 0]))
        loss.backward()
        probabilities = predict_probabilities(model, tokens, mask=mask, num_samples=2)
    assert logits.dtype == loss.dtype == probabilities.dtype == DTYPE
    assert all(p.grad.dtype == DTYPE for p in model.parameters() if p.grad is not None)
    assert not spy.offenders, sorted(spy.offenders)


LAYER_VARIANTS = [
    ("kep_svgp", {"features": "exact", "residual": "diag"}),
    ("kep_svgp", {"features": "exact", "kernel": "exponential"}),
    ("kep_svgp", {"features": "primal_tokens", "max_len": 5, "merge": "concat"}),
    ("kep_svgp", {"shared_posterior": True, "sampling": "marginal", "residual": "diag"}),
    ("kep_svgp", {"merge": "concat_tokens", "max_len": 5}),
    ("sgpa", {"kernel": "exponential"}),
    ("primal", {"features": "primal_tokens", "max_len": 5}),
]


@pytest.mark.usefixtures("float32_default")
@pytest.mark.parametrize(("name", "kwargs"), LAYER_VARIANTS)
def test_double_layer_variants_compute_in_float64_only(make_layer, name, kwargs):
    layer = make_layer(name, **kwargs).double()
    tokens = torch.randn(2, 5, 16, generator=_generator(21), dtype=DTYPE)
    with _LowPrecisionSpy() as spy:
        layer.train()
        output = layer(tokens)
        (output.sum() + layer.kl_divergence()).backward()
        layer.eval()
        mean, variance = layer.posterior(tokens) if kwargs.get("merge") != "concat_tokens" else (output, output)
    assert output.dtype == mean.dtype == variance.dtype == DTYPE
    assert not spy.offenders, sorted(spy.offenders)


@pytest.mark.usefixtures("float32_default")
@pytest.mark.parametrize("mode", ["exact", "primal"])
def test_double_pair_svgp_computes_in_float64_only(mode):
    import gpytorch

    torch.manual_seed(4)
    landmarks = torch.linspace(-2, 2, 12, dtype=DTYPE).unsqueeze(-1)
    kernel = CosineFeatureKernel(1, feature_dim=8, lift="rff", lift_dim=16).double()
    model = KernelEigenPairSVGP(landmarks, kernel, num_inducing=4, mode=mode).double()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    x = torch.linspace(-2, 2, 20, dtype=DTYPE).unsqueeze(-1)
    y = torch.sin(2 * x).squeeze(-1)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=20)
    with _LowPrecisionSpy() as spy:
        model.train()
        loss = -mll(model(x), y)
        loss.backward()
        model.eval()
        posterior = model(x)
        mean, variance = posterior.mean, posterior.variance
    assert loss.dtype == mean.dtype == variance.dtype == DTYPE
    assert not spy.offenders, sorted(spy.offenders)


# -- bfloat16 autocast ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_autocast_gives_finite_outputs_close_to_float32(make_layer, name, mode):
    layer = make_layer(name).train(mode == "train")
    tokens = torch.randn(3, 6, 16, generator=_generator(22))
    mask = torch.arange(6) < torch.tensor([6, 4, 5])[:, None]
    torch.manual_seed(5)
    reference = layer(tokens, mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)  # the same noise as the float32 pass
        output = layer(tokens, mask=mask)
        kl = layer.kl_divergence()
    assert output.dtype == torch.bfloat16 and torch.isfinite(output).all() and torch.isfinite(kl)
    # bfloat16 keeps 8 significant bits (relative rounding 2^-8 ~ 4e-3) per product
    error = (output.float() - reference).abs().max() / reference.abs().max()
    assert error < 5e-2, error
    if mode == "train":
        (output.float().square().mean() + kl.float()).backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


@pytest.mark.parametrize(
    "options",
    [
        {"sampling": "marginal", "shared_posterior": True},  # the fused draw of the summed branches
        {"sampling": "marginal"},  # independent branches: the fused draw of their sum
        {"sampling": "marginal", "merge": "concat"},  # one draw per branch (token_noise)
        {"sampling": "marginal", "merge": "concat", "shared_posterior": True},  # correlated draws (token_noise)
    ],
    ids=["shared", "independent", "concat", "concat_shared"],
)
def test_the_same_seed_draws_the_same_noise_with_or_without_bfloat16_autocast(options):
    """torch's CPU generator draws other numbers for a bfloat16 tensor than for a float32 one (on torch 2.13 for more
    than 16 numbers that are not a multiple of 16, on torch 2.11 for any tensor): the layer draws its per-token noise
    in float32 and rounds it, so that a seed fixes the sample under autocast too. Two heads, two outputs and six tokens:
    24 noise numbers per draw. The per-token variances (here down to 6e-4) are floored at float32's epsilon under
    autocast too: bfloat16's (2^-7) raised the smallest standard deviations fourfold and the error to 13 %."""
    torch.manual_seed(0)
    layer = KEPSVGPAttention(embed_dim=16, num_heads=2, num_inducing=2, num_outputs=2, **options).train()
    with torch.no_grad():  # a wide posterior: the noise is a large part of the output
        layer.strategy._variational_distribution.chol_variational_covar.mul_(10.0)
    tokens = torch.randn(1, 6, 16, generator=_generator(24))
    outputs = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        outputs.append(layer(tokens))
    reference, scale = outputs[0], outputs[0].abs().max()
    assert (outputs[1] - reference).abs().max() > 0.2 * scale  # another seed: another sample
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)
        output = layer(tokens)
    error = (output.float() - reference).abs().max() / scale
    assert error < 2e-2, error  # 0.5-1 %; 6-13 % before (the draws or the bfloat16 variance floor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2, 2, 6), (3, 100)])
def test_half_precision_draws_are_the_float32_draws_rounded(shape, dtype):
    # the draws of token_noise (the fused path calls the same function; the test above covers both through the layer)
    torch.manual_seed(7)
    expected = torch.randn(shape).to(dtype)
    torch.manual_seed(7)
    drawn = KernelEigenReadout._standard_normal(torch.empty(shape, dtype=dtype))
    assert drawn.dtype == dtype and torch.equal(drawn, expected)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_autocast_transformer(make_transformer, name):
    model = make_transformer(name).eval()
    tokens = torch.randint(0, 6, (4, 6), generator=_generator(23))
    torch.manual_seed(5)  # one Monte Carlo sample: the same noise in both passes
    reference = predict_probabilities(model, tokens, num_samples=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)
        probabilities = predict_probabilities(model, tokens, num_samples=1)
    assert torch.isfinite(probabilities).all()
    torch.testing.assert_close(probabilities.float(), reference, atol=0.1, rtol=0)
