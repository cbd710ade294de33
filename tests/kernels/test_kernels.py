"""Closed-form tests of the asymmetric kernels (docs/math.md section 1), float64."""

from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.kernels import (
    CosineFeatureKernel,
    ExponentialDotProductKernel,
    FeatureLift,
    InducedKernel,
    ShiftedRBFKernel,
    inverse_norms,
)

DTYPE = torch.float64
ATOL = 1e-12


def _tokens(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _lift_closed_form(kernel: CosineFeatureKernel, tokens: Tensor) -> Tensor:
    """g(x) from the lift's definition: identity, sqrt(2/D) cos(Omega x / l + b) or tanh(A x + c)."""
    lift = kernel.lift
    if lift.kind == "rff":
        projection = tokens @ lift.frequencies.T / lift.lengthscale + lift.phases
        return math.sqrt(2.0 / lift.output_dim) * torch.cos(projection)
    if lift.kind == "mlp":
        return torch.tanh(tokens @ lift.linear.weight.T + lift.linear.bias)
    return tokens


def _cosine_closed_form(kernel: CosineFeatureKernel, x: Tensor, z: Tensor) -> Tensor:
    """outputscale * <W_q g(x) / ||W_q g(x)||, W_k g(z) / ||W_k g(z)||> for an unbatched kernel."""
    key_weight = kernel.query_weight if kernel.tie else kernel.key_weight
    queries = _lift_closed_form(kernel, x) @ kernel.query_weight.T
    keys = _lift_closed_form(kernel, z) @ key_weight.T
    queries = queries / queries.norm(dim=-1, keepdim=True)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    return kernel.outputscale * queries @ keys.T


def _cosine(lift: str, tie: bool = False, batch_shape: torch.Size = torch.Size()) -> CosineFeatureKernel:
    torch.manual_seed(11)
    kernel = CosineFeatureKernel(3, feature_dim=5, tie=tie, lift=lift, lift_dim=7, batch_shape=batch_shape).double()
    kernel.outputscale = 1.7
    if lift == "rff":
        kernel.lift.initialize(
            raw_lengthscale=kernel.lift.raw_lengthscale_constraint.inverse_transform(torch.tensor(0.6))
        )
    return kernel


# --- cosine kernel ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lift", ["none", "rff", "mlp"])
def test_cosine_closed_form(lift: str) -> None:
    kernel = _cosine(lift)
    x, z = _tokens(6, 3, seed=0), _tokens(4, 3, seed=1)
    matrix = kernel(x, z)
    assert matrix.shape == (6, 4) and matrix.dtype == DTYPE
    torch.testing.assert_close(matrix, _cosine_closed_form(kernel, x, z), atol=ATOL, rtol=0)
    # |kappa| <= outputscale (Cauchy-Schwarz) with equality on the diagonal of the tied kernel only
    assert matrix.abs().max() <= 1.7 + 1e-12


@pytest.mark.parametrize("lift", ["none", "rff", "mlp"])
def test_cosine_features_factorise_the_kernel(lift: str) -> None:
    kernel = _cosine(lift)
    x, z = _tokens(6, 3, seed=2), _tokens(5, 3, seed=3)
    query_features, key_features = kernel.query_features(x), kernel.key_features(z)
    assert query_features.shape == (6, 5) and key_features.shape == (5, 5)
    # each feature vector has squared norm outputscale
    torch.testing.assert_close(query_features.pow(2).sum(-1), torch.full((6,), 1.7, dtype=DTYPE), atol=ATOL, rtol=0)
    torch.testing.assert_close(query_features @ key_features.T, _cosine_closed_form(kernel, x, z), atol=ATOL, rtol=0)
    torch.testing.assert_close(query_features @ key_features.T, kernel(x, z), atol=ATOL, rtol=0)


@pytest.mark.parametrize("lift", ["none", "rff", "mlp"])
def test_cosine_is_asymmetric_untied(lift: str) -> None:
    kernel = _cosine(lift)
    x = _tokens(6, 3, seed=4)
    matrix = kernel(x, x)
    assert (matrix - matrix.T).abs().max() > 1e-3
    # kappa(z, x) is the transpose of kappa(x, z) only when tied: here it is a different matrix
    assert (kernel(x[:3], x[3:]) - kernel(x[3:], x[:3]).T).abs().max() > 1e-3


@pytest.mark.parametrize("lift", ["none", "rff", "mlp"])
def test_cosine_tied_is_symmetric_psd(lift: str) -> None:
    kernel = _cosine(lift, tie=True)
    assert not hasattr(kernel, "key_weight")
    x = _tokens(9, 3, seed=5)
    matrix = kernel(x, x)
    torch.testing.assert_close(matrix, matrix.T, atol=ATOL, rtol=0)
    torch.testing.assert_close(matrix, _cosine_closed_form(kernel, x, x), atol=ATOL, rtol=0)
    assert torch.linalg.eigvalsh(matrix).min() > -1e-12
    torch.testing.assert_close(matrix.diagonal(), torch.full((9,), 1.7, dtype=DTYPE), atol=ATOL, rtol=0)


def test_cosine_batch_shape_heads_broadcast() -> None:
    kernel = _cosine("none", batch_shape=torch.Size([3]))
    kernel.outputscale = torch.tensor([0.5, 1.0, 2.0], dtype=DTYPE)
    assert kernel.query_weight.shape == (3, 5, 3)
    x, z = _tokens(2, 3, 6, 3, seed=6), _tokens(2, 3, 4, 3, seed=7)  # (batch, head, N, d)
    matrix = kernel(x, z)
    assert matrix.shape == (2, 3, 6, 4)
    # unbatched tokens broadcast over the heads
    assert kernel(x[0, 0], z[0, 0]).shape == (3, 6, 4)
    for head in range(3):
        single = CosineFeatureKernel(3, feature_dim=5).double()
        with torch.no_grad():
            single.query_weight.copy_(kernel.query_weight[head])
            single.key_weight.copy_(kernel.key_weight[head])
        single.outputscale = kernel.outputscale[head]
        for batch in range(2):
            expected = _cosine_closed_form(single, x[batch, head], z[batch, head])
            torch.testing.assert_close(matrix[batch, head], expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            kernel(x[0, 0], z[0, 0])[head], _cosine_closed_form(single, x[0, 0], z[0, 0]), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("lift", ["none", "rff"])
@pytest.mark.parametrize("tie", [False, True])
def test_cosine_paired_feature_columns(lift: str, tie: bool) -> None:
    """[P_q; P_k] and [nu_q; nu_k] of one call are the two feature_columns calls stacked, and the normalised columns
    give the closed-form kernel of every head."""
    kernel = _cosine(lift, tie=tie, batch_shape=torch.Size([3]))
    x = _tokens(2, 6, 3, seed=8)
    columns, inverse = kernel.paired_feature_columns(x)
    assert columns.shape == (2, 2, 3, 5, 6) and inverse.shape == (2, 2, 3, 1, 6) and columns.is_contiguous()
    for half, side in enumerate(("query", "key")):
        expected_columns, expected_inverse = kernel.feature_columns(x, side)
        torch.testing.assert_close(columns[:, half], expected_columns, atol=ATOL, rtol=0)
        torch.testing.assert_close(inverse[:, half], expected_inverse, atol=ATOL, rtol=0)
    features = columns * inverse * kernel.outputscale.sqrt()[:, None, None]  # Phi^T: (B, 2, H, p, N)
    torch.testing.assert_close(features[:, 0].mT @ features[:, 1], kernel(x[:, None], x[:, None]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="paired_feature_columns needs tokens of shape"):
        kernel.paired_feature_columns(x[0])


# --- exponential dot-product kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_exponential_closed_form(tie: bool) -> None:
    torch.manual_seed(12)
    kernel = ExponentialDotProductKernel(3, feature_dim=4, tie=tie).double()
    kernel.outputscale = 0.8
    x, z = _tokens(7, 3, seed=8), _tokens(5, 3, seed=9)
    key_weight = kernel.query_weight if tie else kernel.key_weight
    expected = torch.empty(7, 5, dtype=DTYPE)
    for i in range(7):
        for j in range(5):
            logit = torch.dot(kernel.query_weight @ x[i], key_weight @ z[j]) / math.sqrt(4)
            expected[i, j] = 0.8 * torch.exp(logit)
    torch.testing.assert_close(kernel(x, z), expected, atol=ATOL, rtol=0)
    square = kernel(x, x)
    if tie:
        torch.testing.assert_close(square, square.T, atol=ATOL, rtol=0)
        assert torch.linalg.eigvalsh(square).min() > -1e-12
    else:
        assert (square - square.T).abs().max() > 1e-3


def test_exponential_batch_shape() -> None:
    torch.manual_seed(13)
    kernel = ExponentialDotProductKernel(3, feature_dim=4, batch_shape=torch.Size([2])).double()
    kernel.outputscale = torch.tensor([0.5, 2.0], dtype=DTYPE)
    x, z = _tokens(2, 5, 3, seed=10), _tokens(2, 6, 3, seed=11)
    matrix = kernel(x, z)
    assert matrix.shape == (2, 5, 6)
    for head, scale in enumerate((0.5, 2.0)):
        logits = (x[head] @ kernel.query_weight[head].T) @ (z[head] @ kernel.key_weight[head].T).T / 2.0
        torch.testing.assert_close(matrix[head], scale * torch.exp(logits), atol=ATOL, rtol=0)


# --- shifted RBF kernel ----------------------------------------------------------------------------------------


def _shifted_rbf(shift: Tensor | None = None) -> ShiftedRBFKernel:
    """Parameters are set after ``.double()`` (constructor arguments are rounded to the default dtype)."""
    kernel = ShiftedRBFKernel(2, tie=shift is None).double()
    kernel.initialize(
        raw_lengthscale=kernel.raw_lengthscale_constraint.inverse_transform(torch.tensor([0.7, 1.3], dtype=DTYPE))
    )
    kernel.outputscale = 1.4
    if shift is not None:
        with torch.no_grad():
            kernel.shift.copy_(shift)
    return kernel


def _shifted_rbf_closed_form(x: Tensor, z: Tensor, shift: Tensor, lengthscale: Tensor, scale: float) -> Tensor:
    expected = torch.empty(x.shape[0], z.shape[0], dtype=DTYPE)
    for i in range(x.shape[0]):
        for j in range(z.shape[0]):
            expected[i, j] = scale * torch.exp(-0.5 * (((x[i] - z[j] - shift) / lengthscale) ** 2).sum())
    return expected


def test_shifted_rbf_closed_form_and_reversal() -> None:
    shift = torch.tensor([0.4, -0.3], dtype=DTYPE)
    kernel = _shifted_rbf(shift=shift)
    lengthscale = torch.tensor([0.7, 1.3], dtype=DTYPE)
    torch.testing.assert_close(kernel.lengthscale.detach(), lengthscale, atol=1e-14, rtol=0)
    x, z = _tokens(6, 2, seed=12), _tokens(4, 2, seed=13)
    torch.testing.assert_close(kernel(x, z), _shifted_rbf_closed_form(x, z, shift, lengthscale, 1.4), atol=ATOL, rtol=0)
    # kappa(z, x) is the kernel with the negated shift
    negated = _shifted_rbf(shift=-shift)
    torch.testing.assert_close(kernel(z, x).T, negated(x, z), atol=ATOL, rtol=0)
    assert (kernel(z, x).T - kernel(x, z)).abs().max() > 1e-2
    # query x responds maximally (kappa = outputscale) to the key x - shift
    torch.testing.assert_close(kernel(x, x - shift).diagonal(), torch.full((6,), 1.4, dtype=DTYPE), atol=ATOL, rtol=0)


def test_shifted_rbf_tied_is_gpytorch_rbf() -> None:
    kernel = _shifted_rbf()
    assert not hasattr(kernel, "shift")
    reference = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).double()
    reference.base_kernel.lengthscale = torch.tensor([0.7, 1.3], dtype=DTYPE)
    reference.outputscale = torch.tensor(1.4, dtype=DTYPE)  # a Python float would be rounded to float32
    x, z = _tokens(6, 2, seed=14), _tokens(5, 2, seed=15)
    with torch.no_grad():
        torch.testing.assert_close(kernel(x, z), reference(x, z).to_dense(), atol=1e-12, rtol=0)
        square = kernel(x, x)
    torch.testing.assert_close(square, square.T, atol=ATOL, rtol=0)


def test_shifted_rbf_batch_shape() -> None:
    kernel = ShiftedRBFKernel(2, shift=0.3, lengthscale=0.9, batch_shape=torch.Size([3])).double()
    shifts = torch.tensor([[0.1, 0.2], [-0.5, 0.0], [1.0, -1.0]], dtype=DTYPE)
    lengthscales = torch.tensor([[0.5, 0.9], [1.0, 2.0], [0.3, 0.4]], dtype=DTYPE)
    with torch.no_grad():
        kernel.shift.copy_(shifts)
    kernel.initialize(raw_lengthscale=kernel.raw_lengthscale_constraint.inverse_transform(lengthscales))
    kernel.outputscale = torch.tensor([1.0, 0.5, 3.0], dtype=DTYPE)
    x, z = _tokens(5, 2, seed=16), _tokens(4, 2, seed=17)
    matrix = kernel(x, z)
    assert matrix.shape == (3, 5, 4)
    for head, scale in enumerate((1.0, 0.5, 3.0)):
        expected = _shifted_rbf_closed_form(x, z, shifts[head], lengthscales[head], scale)
        torch.testing.assert_close(matrix[head], expected, atol=ATOL, rtol=0)


# --- induced kernel --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right", "both"])
def test_induced_kernel_dense(side: str) -> None:
    kernel = _cosine("rff")
    landmarks, key_landmarks = _tokens(5, 3, seed=18), _tokens(7, 3, seed=19)
    induced = InducedKernel(kernel, landmarks, side=side, key_landmarks=key_landmarks)
    x1, x2 = _tokens(6, 3, seed=20), _tokens(4, 3, seed=21)
    left = _cosine_closed_form(kernel, x1, key_landmarks) @ _cosine_closed_form(kernel, x2, key_landmarks).T
    right = _cosine_closed_form(kernel, landmarks, x1).T @ _cosine_closed_form(kernel, landmarks, x2)
    expected = {"left": left, "right": right, "both": left + right}[side]
    with torch.no_grad():
        torch.testing.assert_close(induced(x1, x2).to_dense(), expected, atol=ATOL, rtol=0)
        square = induced(x1, x1).to_dense()
        diag = induced(x1, x1, diag=True)
    assert diag.shape == (6,)
    torch.testing.assert_close(square, square.T, atol=ATOL, rtol=0)
    assert torch.linalg.eigvalsh(square).min() > -1e-12
    torch.testing.assert_close(diag, square.diagonal(), atol=ATOL, rtol=0)
    # induced kernel of the dual-only shifted RBF on one landmark set
    shift, lengthscale = torch.tensor([0.5, 0.2], dtype=DTYPE), torch.tensor([0.7, 1.3], dtype=DTYPE)
    rbf = _shifted_rbf(shift=shift)
    landmarks, x1, x2 = landmarks[:, :2], x1[:, :2], x2[:, :2]
    induced = InducedKernel(rbf, landmarks, side=side)
    left = _shifted_rbf_closed_form(x1, landmarks, shift, lengthscale, 1.4)
    left = left @ _shifted_rbf_closed_form(x2, landmarks, shift, lengthscale, 1.4).T
    right = _shifted_rbf_closed_form(landmarks, x1, shift, lengthscale, 1.4).T
    right = right @ _shifted_rbf_closed_form(landmarks, x2, shift, lengthscale, 1.4)
    expected = {"left": left, "right": right, "both": left + right}[side]
    with torch.no_grad():
        torch.testing.assert_close(induced(x1, x2).to_dense(), expected, atol=ATOL, rtol=0)


# --- bad inputs ------------------------------------------------------------------------------------------------


def test_bad_inputs_raise() -> None:
    kernel = _cosine("none")
    x = _tokens(4, 3, seed=22)
    with pytest.raises(ValueError, match="shape"):
        kernel(_tokens(4, 2, seed=23), x)
    with pytest.raises(ValueError, match="shape"):
        kernel(x, _tokens(4, 5, seed=23))
    with pytest.raises(ValueError, match="shape"):
        kernel(torch.ones(3, dtype=DTYPE), x)
    with pytest.raises(ValueError, match="shape"):
        kernel.query_features(_tokens(4, 2, seed=24))
    with pytest.raises(TypeError, match="floating-point"):
        kernel(torch.ones(4, 3, dtype=torch.long), x)
    with pytest.raises(TypeError, match="floating-point"):
        kernel.key_features(torch.ones(4, 3, dtype=torch.int32))
    with pytest.raises(TypeError):
        kernel(x.tolist(), x)
    with pytest.raises(ValueError, match="lift"):
        CosineFeatureKernel(3, feature_dim=4, lift="fourier")
    with pytest.raises(ValueError, match="lift_dim"):
        CosineFeatureKernel(3, feature_dim=4, lift="rff", lift_dim=0)
    for feature_dim in (0, -2, 2.5):
        with pytest.raises(ValueError, match="feature_dim"):
            CosineFeatureKernel(3, feature_dim=feature_dim)
        with pytest.raises(ValueError, match="feature_dim"):
            ExponentialDotProductKernel(3, feature_dim=feature_dim)
    for input_dim in (0, 1.5):
        with pytest.raises(ValueError, match="input_dim"):
            ShiftedRBFKernel(input_dim)
    with pytest.raises(ValueError, match="side"):
        InducedKernel(kernel, x, side="up")
    with pytest.raises(NotImplementedError):
        _shifted_rbf().query_features(_tokens(4, 2, seed=25))


# -- the cosine kernel's normalisation does not overflow (issue 14) -------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 1e19, 1e25, 1e35])
def test_inverse_norms_match_float64_without_overflow(scale: float) -> None:
    vectors = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(70)) * scale
    expected = 1.0 / vectors.double().norm(dim=-1, keepdim=True)
    torch.testing.assert_close(inverse_norms(vectors, dim=-1).double(), expected, rtol=1e-5, atol=0)
    # the default F.normalize of such vectors is zero beyond ~1e19 in float32: a cosine kernel of zeros
    if scale >= 1e25:
        assert torch.nn.functional.normalize(vectors, dim=-1).abs().max() == 0


def test_exact_attention_on_huge_float32_tokens_equals_float64() -> None:
    from gpattn.attention import KEPSVGPAttention

    torch.manual_seed(71)
    layer = KEPSVGPAttention(16, 2, num_inducing=3, features="exact").eval()
    reference = KEPSVGPAttention(16, 2, num_inducing=3, features="exact").double().eval()
    reference.load_state_dict(layer.state_dict())
    tokens = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(72))
    for scale in (1e19, 1e30):  # the cosine kernel is scale invariant: the output must not collapse to the bias
        output, expected = layer(tokens * scale), reference(tokens.double() * scale)
        torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(output, layer(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kernel",
    [CosineFeatureKernel(3, 4), CosineFeatureKernel(3, 4, lift="rff"), ExponentialDotProductKernel(3, 4)],
    ids=["cosine", "cosine-rff", "exponential"],
)
def test_kernels_with_projections_refuse_tokens_of_another_dtype(kernel):
    # W_q x is a matrix product, which does not promote: name the dtypes instead of torch's "mat1 and mat2 ..."
    with pytest.raises(TypeError, match=rf"{type(kernel).__name__}: x is torch.float64 but the parameters are"):
        kernel(torch.randn(5, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="z is torch.float64"):
        kernel(torch.randn(5, 3), torch.randn(4, 3, dtype=torch.float64))
    assert kernel.double()(torch.randn(5, 3, dtype=torch.float64)).dtype == torch.float64


def test_a_kernel_without_projections_promotes_mixed_dtypes():
    kernel = ShiftedRBFKernel(3, shift=0.3)  # float32 parameters, elementwise arithmetic only
    x = torch.randn(5, 3, dtype=torch.float64)
    matrix = kernel(x)
    assert matrix.dtype == torch.float64
    torch.testing.assert_close(matrix, kernel.double()(x), rtol=1e-6, atol=1e-7)  # the float32 parameters, rounded


# -- argument and shape checks ----------------------------------------------------------------------------------


def test_feature_columns_refuse_an_unknown_side() -> None:
    """Any side but "query" read W_k (side="keys", "q", ... silently gave the key features)."""
    kernel = _cosine("none", batch_shape=torch.Size([3]))
    x = _tokens(2, 6, 3, seed=40)
    for side in ("keys", "q", None):
        with pytest.raises(ValueError, match="feature_columns: expected side to be one of"):
            kernel.feature_columns(x, side)
    for side, weight in (("query", kernel.query_weight), ("key", kernel.key_weight)):
        columns, inverse = kernel.feature_columns(x, side)
        projected = x[:, None] @ weight.mT  # W g(x): (B, H, N, p)
        expected = projected / projected.norm(dim=-1, keepdim=True)
        torch.testing.assert_close((columns * inverse).mT, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("value", ["False", 0, None])
def test_tie_and_learn_landmarks_must_be_bools(value) -> None:
    """Truthiness read tie="False" as a tied (symmetric) kernel and learn_landmarks="no" as learned landmarks."""
    for build in (lambda: CosineFeatureKernel(3, 4, tie=value), lambda: ShiftedRBFKernel(3, tie=value)):
        with pytest.raises(TypeError, match=f"expected tie to be True or False, got {value!r}"):
            build()
    kernel = ExponentialDotProductKernel(3, 4, tie=np.bool_(False))
    assert kernel.tie is False and "key_weight" in dict(kernel.named_parameters())
    landmarks = _tokens(5, 3, seed=7)
    with pytest.raises(TypeError, match=f"InducedKernel: expected learn_landmarks to be True or False, got {value!r}"):
        InducedKernel(kernel, landmarks, learn_landmarks=value)


def test_batch_shape_and_sizes_are_checked() -> None:
    """A bare int or a negative size failed in torch's words; NumPy sizes were stored as NumPy integers."""
    with pytest.raises(TypeError, match="CosineFeatureKernel: expected batch_shape to be a torch.Size"):
        CosineFeatureKernel(3, 4, batch_shape=3)
    for bad in ((-1,), (2, 0)):
        with pytest.raises(ValueError, match=r"ShiftedRBFKernel: expected batch_shape\[\d\] to be a positive"):
            ShiftedRBFKernel(3, batch_shape=bad)
    kernel = ExponentialDotProductKernel(np.int64(3), np.int64(4), batch_shape=[np.int64(2)])
    assert type(kernel.input_dim) is int and type(kernel.feature_dim) is int
    assert kernel.batch_shape == torch.Size([2]) and kernel.query_weight.shape == (2, 4, 3)
    lift = FeatureLift("rff", np.int64(3), np.int64(5))
    assert type(lift.input_dim) is int and type(lift.output_dim) is int


def test_tokens_whose_batch_does_not_broadcast_are_refused() -> None:
    """Batch dimensions that do not broadcast (with each other or with batch_shape) failed in torch's words."""
    kernel = _cosine("none", batch_shape=torch.Size([2]))
    with pytest.raises(ValueError, match=r"the batch dimensions of x \(3,\) do not broadcast with the kernel's"):
        kernel(_tokens(3, 5, 3, seed=41))
    with pytest.raises(ValueError, match=r"the batch dimensions of x \(3,\) do not broadcast"):
        kernel.query_features(_tokens(3, 5, 3, seed=41))
    unbatched = _cosine("none")
    with pytest.raises(ValueError, match=r"the batch dimensions of x \(2,\) and z \(3,\) do not broadcast"):
        unbatched(_tokens(2, 5, 3, seed=42), _tokens(3, 4, 3, seed=43))
    # broadcasting batches are the closed form of every pair
    x, z = _tokens(2, 1, 5, 3, seed=44), _tokens(4, 3, seed=45)
    matrix = unbatched(x, z)
    assert matrix.shape == (2, 1, 5, 4)
    for batch in range(2):
        expected = _cosine_closed_form(unbatched, x[batch, 0], z)
        torch.testing.assert_close(matrix[batch, 0], expected, atol=ATOL, rtol=0)


def test_positive_parameters_of_a_wrong_shape_are_refused() -> None:
    """GPyTorch's initialize failed with "shape '[2]' is invalid for input of size 3"; what it can fit is set."""
    kernel = _cosine("none", batch_shape=torch.Size([2]))
    with pytest.raises(ValueError, match=r"CosineFeatureKernel: expected outputscale .* expands to shape \(2,\)"):
        kernel.outputscale = torch.ones(3, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"ShiftedRBFKernel: expected lengthscale .* expands to shape \(3,\)"):
        ShiftedRBFKernel(3, lengthscale=torch.ones(2))
    with pytest.raises(ValueError, match=r"FeatureLift: expected lengthscale .* expands to shape \(\)"):
        FeatureLift("rff", 3, 5, lengthscale=torch.ones(2))
    kernel.outputscale = torch.tensor([[0.5], [3.0]], dtype=DTYPE)  # as many elements: GPyTorch's view
    torch.testing.assert_close(kernel.outputscale.detach(), torch.tensor([0.5, 3.0], dtype=DTYPE), atol=1e-14, rtol=0)
    rbf = ShiftedRBFKernel(2, batch_shape=torch.Size([2])).double()
    rbf.initialize(raw_lengthscale=torch.zeros(2, 2, dtype=DTYPE))
    lengthscale = torch.tensor([0.7, 1.3], dtype=DTYPE)
    rbf.outputscale = torch.tensor(1.4, dtype=DTYPE)  # a scalar expands to every kernel
    torch.testing.assert_close(rbf.outputscale.detach(), torch.full((2,), 1.4, dtype=DTYPE), atol=1e-14, rtol=0)
    with pytest.raises(TypeError, match="ShiftedRBFKernel: expected shift to be a number or a tensor of numbers"):
        ShiftedRBFKernel(2, shift="left")
    tied = ShiftedRBFKernel(2, tie=True, lengthscale=lengthscale).double()  # set in float32, then cast
    tied.outputscale = 1.0
    torch.testing.assert_close(tied.lengthscale.detach(), lengthscale, atol=1e-6, rtol=0)
    x, z = _tokens(4, 2, seed=46), _tokens(3, 2, seed=47)
    expected = _shifted_rbf_closed_form(x, z, torch.zeros(2, dtype=DTYPE), tied.lengthscale.detach(), 1.0)
    torch.testing.assert_close(tied(x, z), expected, atol=ATOL, rtol=0)


def test_max_logit_takes_real_numbers_and_refuses_minus_infinity() -> None:
    """A NumPy float or a 0-d tensor was refused as "not a number"; -inf was accepted and clamped every logit to
    exp(-inf) = 0, a kernel of zeros."""
    for bad in ("3", True, torch.tensor(3.0)):
        with pytest.raises(TypeError, match="ExponentialDotProductKernel: expected max_logit to be a real number"):
            ExponentialDotProductKernel(3, 4, max_logit=bad)
    for bad in (-math.inf, math.nan):
        with pytest.raises(ValueError, match="ExponentialDotProductKernel: expected max_logit"):
            ExponentialDotProductKernel(3, 4, max_logit=bad)
    torch.manual_seed(48)
    kernel = ExponentialDotProductKernel(3, feature_dim=4, max_logit=np.float32(0.5)).double()
    kernel.outputscale = 1.0
    assert kernel.max_logit == 0.5 and type(kernel.max_logit) is float
    x, z = _tokens(6, 3, seed=49) * 3, _tokens(5, 3, seed=50) * 3
    logits = (x @ kernel.query_weight.T) @ (z @ kernel.key_weight.T).T / 2.0
    assert (logits > 0.5).any() and (logits < 0.5).any()
    torch.testing.assert_close(kernel(x, z), torch.exp(logits.clamp(max=0.5)), atol=ATOL, rtol=0)


def test_lengthscales_are_set_as_gpytorchs_kernels_set_them() -> None:
    """``kernel.lengthscale = value`` and ``initialize(lengthscale=...)`` as for GPyTorch's kernels (the properties were
    read-only: both raised, and so did pyro_sample_from_prior for a prior registered on "lengthscale")."""
    kernel = ShiftedRBFKernel(2).double()
    kernel.lengthscale = torch.tensor([0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(kernel.lengthscale, torch.tensor([0.5, 2.0], dtype=torch.float64), rtol=1e-15, atol=0)
    kernel.initialize(lengthscale=0.25)
    torch.testing.assert_close(kernel.lengthscale, torch.full((2,), 0.25, dtype=torch.float64), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="lengthscale"):
        kernel.lengthscale = -1.0
    lift = FeatureLift("rff", 3, lift_dim=4).double()
    lift.lengthscale = 0.75
    assert lift.lengthscale.item() == pytest.approx(0.75, rel=1e-15)
    with pytest.raises(AttributeError, match=r"FeatureLift: a 'mlp' lift has no lengthscale"):
        FeatureLift("mlp", 3, lift_dim=4).lengthscale = 0.5
    kernel.register_prior("lengthscale_prior", gpytorch.priors.GammaPrior(3.0, 6.0), "lengthscale")
    torch.manual_seed(0)
    sampled = kernel.pyro_sample_from_prior()
    assert not torch.allclose(sampled.lengthscale, torch.full((2,), 0.25, dtype=torch.float64))
