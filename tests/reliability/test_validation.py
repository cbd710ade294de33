"""Input validation of the public entry points (issue 7): a bad argument or input raises a ``TypeError`` or
``ValueError`` whose message says what was expected and what came, before anything is computed, so that no NaN ever
reaches a parameter.

Every case asserts the exception type and a message fragment; the attention and model cases also assert that the
parameters are unchanged (and finite) after the rejected call and that the next valid call still works.
"""

from __future__ import annotations

import math
from typing import Any

import gpytorch
import numpy as np
import pytest
import torch

from gpattn.attention import (
    CGPTAttention,
    KEPSVGPAttention,
    PrimalAttention,
    SGPAAttention,
    SoftmaxAttention,
    SymmetricSVGPAttention,
    attention_arguments,
    attention_names,
    build_attention,
    sample_attention,
)
from gpattn.comparison import CompareConfig, ToyRegressionConfig, plan_runs
from gpattn.data import (
    ImageDataset,
    images_to_patches,
    load_cifar10,
    load_cifar10_c,
    load_digits_splits,
    make_asymmetric_regression_1d,
    make_asymmetric_regression_2d,
    make_noise_ood,
    make_pointer_task,
    make_shifted_test_sets,
    make_successor_task,
    patches_to_images,
    shift_images,
)
from gpattn.features import KernelEigenFeatures, build_attention_features
from gpattn.kernels import (
    CosineFeatureKernel,
    ExponentialDotProductKernel,
    FeatureLift,
    InducedKernel,
    ShiftedRBFKernel,
)
from gpattn.metrics import (
    accuracy,
    aurc,
    brier_score,
    expected_calibration_error,
    negative_log_likelihood,
    ood_auroc,
)
from gpattn.mlls import AttentionELBO, KSVDAddedLossTerm
from gpattn.models import KernelEigenPairSVGP, TemperatureScaling, Transformer, predict_probabilities
from gpattn.plotting import plot_pair_posterior, write_comparison_figures
from gpattn.validation import (
    InputTypeError,
    all_finite,
    check_choice,
    check_device,
    check_float,
    check_int,
    check_tensor,
)
from gpattn.variational import KernelEigenVariationalStrategy

EMBED_DIM, NUM_HEADS, BATCH, LENGTH = 8, 2, 2, 5
NAMES = attention_names()
SIZES = {"num_inducing": 2}


# -- helpers -----------------------------------------------------------------------------------------------------------
def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


def assert_unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(module.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.isfinite(after[name]).all(), name
        assert torch.equal(after[name].detach(), value), name


def assert_parameters_finite(module: torch.nn.Module) -> None:
    for name, parameter in module.named_parameters():
        assert torch.isfinite(parameter).all(), name


def layer(name: str, **kwargs: Any):
    torch.manual_seed(0)
    sizes = {key: value for key, value in SIZES.items() if key in attention_arguments(name)}
    return build_attention(name, EMBED_DIM, NUM_HEADS, **{**sizes, **kwargs})


def tokens(batch: int = BATCH, length: int = LENGTH, width: int = EMBED_DIM, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(1)).to(dtype)


def mask(*rows: list[bool]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# -- the helper module -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: check_int("rank", 0), ValueError, "rank to be a positive integer, got 0"),
        (lambda: check_int("rank", 2.0), InputTypeError, "rank to be a positive integer, got 2.0"),
        (lambda: check_int("rank", True), TypeError, "got True"),
        (lambda: check_int("seed", -1, minimum=0), ValueError, "non-negative integer"),
        (lambda: check_int("severity", 6, 1, 5), ValueError, r"in \[1, 5\], got 6"),
        (lambda: check_float("lr", float("nan"), 0.0, strict_minimum=True), ValueError, "lr to be a finite number > 0"),
        (lambda: check_float("lr", "0.1"), TypeError, "got '0.1'"),
        (lambda: check_float("dropout", 1.0, 0.0, 1.0, strict_maximum=True), ValueError, "< 1"),
        (lambda: check_choice("merge", "max", ("sum", "concat")), ValueError, r"\['sum', 'concat'\], got 'max'"),
        (lambda: check_choice("merge", ["sum"], ("sum",)), ValueError, "got \\['sum'\\]"),
        (lambda: check_device("device", "banana"), ValueError, "'cpu', 'cuda' or 'cuda:0', got 'banana'"),
        (lambda: check_tensor("x", [1.0]), TypeError, "torch.Tensor, got list"),
        (lambda: check_tensor("x", torch.ones(2, 3), ("B", "N", 3)), ValueError, r"\(B, N, 3\), got \(2, 3\)"),
        (lambda: check_tensor("x", torch.ones(2, 3), ("...", "N", 4)), ValueError, r"\(\.\.\., N, 4\)"),
        (lambda: check_tensor("x", torch.ones(0, 3), ("N", 3), non_empty=True), ValueError, "non-empty"),
        (lambda: check_tensor("x", torch.ones(2, dtype=torch.long), floating=True), TypeError, "floating-point"),
        (lambda: check_tensor("y", torch.ones(2), integer=True), TypeError, "integer tensor, got torch.float32"),
        (lambda: check_tensor("x", torch.tensor([1.0, math.inf]), finite=True), ValueError, "NaN or Inf"),
        (lambda: check_tensor("x", torch.ones(2).double(), like=torch.ones(1)), TypeError, "float64.*float32"),
        (lambda: check_tensor("x", torch.ones(2, device="meta"), like=torch.ones(1)), ValueError, "meta.*cpu"),
    ],
)
def test_helpers(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_helpers_accept_good_values():
    assert check_int("n", np.int64(3)) == 3 and check_float("lr", torch.tensor(0.5)) == 0.5
    assert check_device("device", "cpu") == torch.device("cpu")
    assert check_tensor("x", torch.ones(2, 3, 4), ("...", "N", 4), floating=True, finite=True).shape == (2, 3, 4)
    # meta tensors have no values: the finiteness check is skipped rather than failing
    check_tensor("x", torch.ones(2, device="meta"), finite=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast mixes dtypes on purpose
        check_tensor("x", torch.ones(2, dtype=torch.bfloat16), like=torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_against_isfinite(dtype):
    """all_finite against torch.isfinite(...).all(): finite values, a NaN, both infinities, and finite entries whose sum
    overflows (settled by the second pass); complex, integer and empty tensors."""
    largest = torch.finfo(dtype).max
    cases = [
        torch.randn(5, 7).to(dtype),
        torch.tensor([1.0, math.nan, 2.0], dtype=dtype),
        torch.tensor([1.0, math.inf], dtype=dtype),
        torch.tensor([-math.inf, 0.0], dtype=dtype),
        torch.tensor([largest, largest, largest], dtype=dtype),
    ]
    for value in cases:
        assert all_finite(value) is bool(torch.isfinite(value).all()), value
    assert all_finite(torch.tensor([1 + 2j, math.nan + 0j])) is False
    assert all_finite(torch.tensor([1 + 2j, 3 - 1j])) is True
    assert all_finite(torch.arange(4)) is True
    assert all_finite(torch.empty(0)) is True


def test_all_finite_reads_a_finite_tensor_with_two_operators():
    """The finite path is the sum and its read (on a GPU one kernel and one synchronisation; it was three operators,
    with torch.isfinite on the sum)."""
    from torch.profiler import ProfilerActivity, profile

    value = torch.randn(100)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        assert all_finite(value)
    top_level = [
        event.name for event in profiler.events() if event.name.startswith("aten::") and event.cpu_parent is None
    ]
    assert top_level == ["aten::sum", "aten::item"], top_level


def test_input_type_error_is_both():
    # code written against the ValueError that some of these checks raised before keeps working
    assert issubclass(InputTypeError, TypeError) and issubclass(InputTypeError, ValueError)


# -- attention layers: constructors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"),
    [
        (SoftmaxAttention, {"embed_dim": 0, "num_heads": 1}, ValueError, "embed_dim.*got 0"),
        (SoftmaxAttention, {"embed_dim": -8, "num_heads": 2}, ValueError, "embed_dim.*got -8"),
        (SoftmaxAttention, {"embed_dim": 8.0, "num_heads": 2}, TypeError, "embed_dim.*got 8.0"),
        (SoftmaxAttention, {"embed_dim": True, "num_heads": 1}, TypeError, "embed_dim.*got True"),
        (SoftmaxAttention, {"embed_dim": "8", "num_heads": 2}, TypeError, "embed_dim.*got '8'"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 0}, ValueError, "num_heads.*got 0"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 3}, ValueError, r"embed_dim \(8\).*num_heads \(3\)"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 2, "dropout": 1.0}, ValueError, "dropout.*got 1.0"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 2, "dropout": -0.1}, ValueError, "dropout"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 2, "dropout": math.nan}, ValueError, "dropout"),
        (SoftmaxAttention, {"embed_dim": 8, "num_heads": 2, "dropout": "0.1"}, TypeError, "dropout.*got '0.1'"),
        (KEPSVGPAttention, {"num_inducing": 0}, ValueError, "num_inducing.*got 0"),
        (KEPSVGPAttention, {"num_inducing": 2.5}, TypeError, "num_inducing.*got 2.5"),
        (
            KEPSVGPAttention,
            {"num_inducing": 5},
            ValueError,
            r"AttentionFeatures: num_inducing \(5\) must not exceed the feature dimension \(4\) of a cosine kernel",
        ),
        (
            KEPSVGPAttention,
            {"max_len": 0},
            ValueError,
            "max_len to be a positive integer, got 0",
        ),  # unused, not ignored
        (KEPSVGPAttention, {"max_len": 2.0}, TypeError, "max_len.*got 2.0"),
        (KEPSVGPAttention, {"features": "dense"}, ValueError, "features.*'dense'"),
        (KEPSVGPAttention, {"merge": "max"}, ValueError, "merge.*'max'"),
        (KEPSVGPAttention, {"sampling": "iid"}, ValueError, "sampling.*'iid'"),
        (KEPSVGPAttention, {"residual": "full"}, ValueError, "residual.*'full'"),
        (KEPSVGPAttention, {"kernel": "rbf"}, ValueError, "kernel.*'rbf'"),
        (
            KEPSVGPAttention,
            {"kernel": "exponential"},
            ValueError,
            "AttentionFeatures: the exponential kernel has no finite primal features: use features='exact'",
        ),
        (KEPSVGPAttention, {"features": "primal_tokens"}, ValueError, "primal_tokens' needs max_len"),
        (
            KEPSVGPAttention,
            {"features": "primal_features", "max_len": 1},
            ValueError,
            r"max_len \(the sequence length of features='primal_features'\) to be an integer >= 2, got 1",
        ),
        (KEPSVGPAttention, {"features": "exact", "max_len": 1}, ValueError, r"num_inducing \(2\).*max_len=1"),
        (KEPSVGPAttention, {"merge": "concat_tokens"}, ValueError, "max_len"),
        (KEPSVGPAttention, {"merge": "concat", "tie_qk": True}, ValueError, "tie_qk"),
        (KEPSVGPAttention, {"num_outputs": 0}, ValueError, "num_outputs.*got 0"),
        (KEPSVGPAttention, {"num_outputs": 2.0}, TypeError, "num_outputs.*got 2.0"),
        (PrimalAttention, {"features": "exact"}, ValueError, "features"),
        (PrimalAttention, {"num_inducing": -1}, ValueError, "num_inducing"),
        (SGPAAttention, {"num_inducing": 0}, ValueError, "num_inducing"),
        (SGPAAttention, {"kernel": "rbf"}, ValueError, "kernel"),
        (SGPAAttention, {"jitter": -1e-6}, ValueError, "jitter"),
        (SGPAAttention, {"jitter": math.nan}, ValueError, "jitter"),
        (SymmetricSVGPAttention, {"num_inducing": 0}, ValueError, "num_inducing"),
        (SymmetricSVGPAttention, {"num_inducing": 2.0}, TypeError, "num_inducing"),
    ],
)
def test_attention_constructor_rejects(cls, kwargs, error, match):
    sizes = {"embed_dim": EMBED_DIM, "num_heads": NUM_HEADS}
    if cls in (KEPSVGPAttention, PrimalAttention):
        sizes["num_inducing"] = 2  # within the head width 4, so that the case's own error is the first
    with pytest.raises(error, match=match):
        cls(**{**sizes, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_heads": 0}, ValueError, "num_heads.*got 0"),
        ({"embed_dim": 0}, ValueError, "embed_dim.*got 0"),
        ({"num_inducing": 0}, ValueError, "num_inducing"),
        ({"feature_dim": 0}, ValueError, "feature_dim.*got 0"),
        ({"mode": "dense"}, ValueError, "features.*'dense'"),
        ({"mode": "exact", "max_len": 1}, ValueError, r"num_inducing \(2\).*max_len=1"),
    ],
)
def test_attention_features_constructor_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_attention_features(**{"embed_dim": EMBED_DIM, "num_heads": NUM_HEADS, "num_inducing": 2, **kwargs})


def test_registry_rejects_unknown_names_and_arguments():
    with pytest.raises(ValueError, match=r"unknown attention 'nope'; expected one of \['kep_svgp'"):
        build_attention("nope", EMBED_DIM, NUM_HEADS)
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        attention_arguments("nope")
    with pytest.raises(TypeError, match="attention name to be a string, got list"):
        build_attention(["kep_svgp"], EMBED_DIM, NUM_HEADS)
    with pytest.raises(TypeError, match=r"unexpected arguments \['ranks'\]"):
        build_attention("kep_svgp", EMBED_DIM, NUM_HEADS, ranks=2)
    with pytest.raises(TypeError, match="torch.nn.Module, got int"):
        with sample_attention(3):
            pass


# -- attention layers: forward -----------------------------------------------------------------------------------------
def _x(**kwargs):
    return lambda: (tokens(**kwargs), None, None)


def _nan(value: float):
    def make():
        x = tokens()
        x[1, 2, 3] = value
        return x, None, None

    return make


BAD_CALLS = {
    # name: (make (x, mask, context), error, message fragment)
    "x not a tensor": (lambda: (tokens().tolist(), None, None), TypeError, "x to be a torch.Tensor, got list"),
    "x integer": (lambda: (tokens().long(), None, None), TypeError, "x to be a floating-point tensor, got torch.int64"),
    "x bool": (lambda: (tokens() > 0, None, None), TypeError, "floating-point tensor, got torch.bool"),
    "x rank 2": (lambda: (tokens()[0], None, None), ValueError, r"x of shape \(B, N, 8\).*got \(5, 8\)"),
    "x rank 4": (lambda: (tokens()[None], None, None), ValueError, r"x of shape \(B, N, 8\).*got \(1, 2, 5, 8\)"),
    "x wrong width": (_x(width=4), ValueError, r"x of shape \(B, N, 8\) = \(batch, tokens, embed_dim\).*\(2, 5, 4\)"),
    "x no tokens": (_x(length=0), ValueError, r"non-empty.*got \(2, 0, 8\)"),
    "x no sequences": (_x(batch=0), ValueError, r"non-empty.*got \(0, 5, 8\)"),
    "x NaN": (_nan(math.nan), ValueError, "x contains NaN or Inf"),
    "x Inf": (_nan(-math.inf), ValueError, "x contains NaN or Inf"),
    "x float64 vs float32 layer": (_x(dtype=torch.float64), TypeError, "x is torch.float64 but the parameters are"),
    "x on another device": (
        lambda: (torch.empty(BATCH, LENGTH, EMBED_DIM, device="meta"), None, None),
        ValueError,
        "x is on meta but the parameters are on cpu",
    ),
    "mask not boolean": (lambda: (tokens(), torch.ones(BATCH, LENGTH), None), TypeError, "boolean padding mask"),
    "mask a list": (lambda: (tokens(), [[True] * LENGTH] * BATCH, None), TypeError, "boolean padding mask.*list"),
    "mask wrong shape": (
        lambda: (tokens(), torch.ones(BATCH, LENGTH - 1, dtype=torch.bool), None),
        ValueError,
        r"padding mask of shape \(2, 5\).*got \(2, 4\)",
    ),
    "mask (B, N, N)": (
        lambda: (tokens(), torch.ones(BATCH, LENGTH, LENGTH, dtype=torch.bool), None),
        ValueError,
        r"padding mask of shape \(2, 5\) = \(batch, keys\), got \(2, 5, 5\)",
    ),
    "mask hides a whole sequence": (
        lambda: (tokens(), mask([True] * LENGTH, [False] * LENGTH), None),
        ValueError,
        r"the mask hides every token of sequence\(s\) \[1\]",
    ),
    "mask on another device": (
        lambda: (tokens(), torch.ones(BATCH, LENGTH, dtype=torch.bool, device="meta"), None),
        ValueError,
        "mask is on meta",
    ),
    "mask unknown string": (lambda: (tokens(), "anti-causal", None), ValueError, "'causal', got 'anti-causal'"),
    "context wrong width": (
        lambda: (tokens(), None, tokens(width=4)),
        ValueError,
        r"context of shape \(B, N, 8\).*got \(2, 5, 4\)",
    ),
    "context other batch": (lambda: (tokens(), None, tokens(batch=3)), ValueError, "batch size"),
    "context NaN": (lambda: (tokens(), None, tokens() / 0.0), ValueError, "context contains NaN"),
    "context integer": (lambda: (tokens(), None, tokens().long()), TypeError, "context to be a floating-point"),
    "context float64": (lambda: (tokens(), None, tokens(dtype=torch.float64)), TypeError, "context is torch.float64"),
    "context with causal": (lambda: (tokens(), "causal", tokens(length=3)), ValueError, "causal mask needs self"),
    "context mask of x's length": (
        lambda: (tokens(), torch.ones(BATCH, LENGTH, dtype=torch.bool), tokens(length=3)),
        ValueError,
        r"padding mask of shape \(2, 3\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("name", NAMES)
def test_attention_forward_rejects(name, case):
    make, error, match = BAD_CALLS[case]
    attention = layer(name).train()
    if case == "context with causal" and not attention.supports_causal:
        match = "does not support causal masks"  # no causal mode at all: the more precise message comes first
    before = snapshot(attention)
    x, padding, context = make()
    if context is not None and not attention.supports_cross_attention:
        error, match = ValueError, "does not support cross-attention"  # no context at all: this message comes first
    with pytest.raises(error, match=match):
        attention(x, mask=padding, context=context)
    assert_unchanged(attention, before)
    # the layer still works, and its next training step keeps the parameters finite
    out = attention(tokens())
    assert out.shape == (BATCH, LENGTH, EMBED_DIM) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_attention_errors_name_the_layer(name):
    attention = layer(name)
    with pytest.raises(ValueError, match=f"^{type(attention).__name__}: expected x of shape"):
        attention(tokens(width=4))


@pytest.mark.parametrize("name", NAMES)
def test_attention_posterior_is_checked_too(name):
    attention = layer(name)
    before = snapshot(attention)
    with pytest.raises(ValueError, match="NaN or Inf"):
        attention.posterior(tokens() * math.inf)
    with pytest.raises(ValueError, match="every token"):
        attention.posterior(tokens(), mask=mask([False] * LENGTH, [True] * LENGTH))
    assert attention.training  # restored after the rejected call
    assert_unchanged(attention, before)


@pytest.mark.parametrize("name", NAMES)
def test_attention_float64_works_where_float32_does(name):
    attention = layer(name).double()
    padding = mask([True] * LENGTH, [True, True, True, False, False])
    out = attention(tokens(dtype=torch.float64), mask=padding)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()
    # causal masks need no check: the diagonal is always visible
    if attention.supports_causal:
        assert torch.isfinite(attention(tokens(dtype=torch.float64), mask="causal")).all()


def test_rank_larger_than_the_sequence_in_exact_mode():
    attention = KEPSVGPAttention(EMBED_DIM, NUM_HEADS, num_inducing=3, features="exact")
    before = snapshot(attention)
    with pytest.raises(ValueError, match=r"num_inducing \(3\) exceeds the shortest sequence in the batch \(2 tokens\)"):
        attention(tokens(length=2))
    with pytest.raises(ValueError, match=r"num_inducing \(3\) exceeds the shortest sequence in the batch \(2 tokens\)"):
        attention(tokens(), mask=mask([True] * LENGTH, [True, True, False, False, False]))
    assert_unchanged(attention, before)


def test_primal_features_length_is_checked():
    attention = KEPSVGPAttention(EMBED_DIM, NUM_HEADS, num_inducing=2, features="primal_features", max_len=LENGTH)
    with pytest.raises(ValueError, match=f"length max_len={LENGTH}, got 3"):
        attention(tokens(length=3))


def test_rejected_training_step_leaves_parameters_finite():
    """A NaN batch is refused before the forward pass, so an optimiser step never sees a NaN gradient."""
    model = Transformer(2, embed_dim=EMBED_DIM, depth=1, num_heads=NUM_HEADS, attention="kep_svgp", num_inducing=2,
                        input="vectors", input_dim=3, max_len=LENGTH)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    loss_fn = AttentionELBO(model, num_data=8)
    before = snapshot(model)
    inputs = torch.randn(BATCH, LENGTH, 3)
    inputs[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="inputs contains NaN or Inf"):
        loss_fn(model(inputs), torch.tensor([0, 1])).backward()
    optimizer.step()
    assert_unchanged(model, before)


# -- kernels -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: CosineFeatureKernel(0, 4), ValueError, "input_dim.*got 0"),
        (lambda: CosineFeatureKernel(True, 4), TypeError, "input_dim.*got True"),
        (lambda: CosineFeatureKernel(2.0, 4), TypeError, "input_dim.*got 2.0"),
        (lambda: CosineFeatureKernel(3, 0), ValueError, "feature_dim.*got 0"),
        (lambda: CosineFeatureKernel(3, 4, lift="fourier"), ValueError, "lift.*'fourier'"),
        (lambda: CosineFeatureKernel(3, 4, lift="rff", lift_dim=0), ValueError, "lift_dim"),
        (lambda: CosineFeatureKernel(3, 4, lift="rff", lift_lengthscale=-1.0), ValueError, "lengthscale.*> 0"),
        (lambda: ExponentialDotProductKernel(3, 0), ValueError, "feature_dim"),
        (lambda: ExponentialDotProductKernel(3, 4, max_logit=math.nan), ValueError, "max_logit"),
        (lambda: ShiftedRBFKernel(1, lengthscale=-1.0), ValueError, "lengthscale to be a finite number > 0"),
        (lambda: ShiftedRBFKernel(1, lengthscale=0.0), ValueError, "lengthscale.*got 0.0"),
        (lambda: ShiftedRBFKernel(1, shift=math.nan), ValueError, "finite shift, got nan"),
        (lambda: ShiftedRBFKernel(1, shift=[0.1, 0.2]), ValueError, r"shift.*\(1,\).*\(2,\)"),
        (lambda: FeatureLift("rff", 2, lengthscale=math.inf), ValueError, "lengthscale"),
        (lambda: FeatureLift("mlp", 0), ValueError, "input_dim"),
        (lambda: FeatureLift("rff", 2, seed=2**64), ValueError, r"seed to be an integer in \[-9223372036854775808, "),
    ],
)
def test_kernel_constructor_rejects(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_feature_lift_takes_numpy_and_negative_seeds():
    # torch.Generator.manual_seed refuses NumPy integers: the checked seed is handed on as a Python int
    reference = FeatureLift("rff", 2, 4, seed=3).frequencies
    torch.testing.assert_close(FeatureLift("rff", 2, 4, seed=np.int64(3)).frequencies, reference, rtol=0, atol=0)
    FeatureLift("rff", 2, 4, seed=-(2**63))


@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf])
def test_positive_setters_reject_values_that_would_be_nan(value):
    kernel = ShiftedRBFKernel(1)
    attention = SGPAAttention(EMBED_DIM, NUM_HEADS, num_inducing=3)
    for module, name in ((kernel, "outputscale"), (attention, "lengthscale"), (attention, "outputscale")):
        before = snapshot(module)
        with pytest.raises(ValueError, match=f"{name}.*> 0"):
            setattr(module, name, value)
        assert_unchanged(module, before)


@pytest.mark.parametrize("value", [True, np.True_, torch.tensor(True), [True, True]])
def test_positive_setters_reject_bools(value):
    # a bool was read as 1.0 (check_float refuses it; the setters took it)
    kernel = ShiftedRBFKernel(1)
    attention = SGPAAttention(EMBED_DIM, NUM_HEADS, num_inducing=3)
    cgpt = CGPTAttention(EMBED_DIM, NUM_HEADS)
    for module, name in ((kernel, "outputscale"), (attention, "lengthscale"), (cgpt, "outputscale")):
        before = snapshot(module)
        with pytest.raises(TypeError, match=f"{name} to be a finite number > 0"):
            setattr(module, name, value)
        assert_unchanged(module, before)
    with pytest.raises(TypeError, match="temperature to be a finite number > 0"):
        TemperatureScaling(torch.nn.Identity()).temperature = value
    attention.lengthscale = 0.1  # a float is read once, in the parameter's dtype
    torch.testing.assert_close(attention.lengthscale, torch.full_like(attention.lengthscale, 0.1))


@pytest.mark.parametrize(
    ("x", "z", "error", "match"),
    [
        ([[0.0, 1.0, 2.0]], None, TypeError, "x to be a torch.Tensor"),
        (torch.ones(4, 3, dtype=torch.long), None, TypeError, "floating-point"),
        (torch.ones(4), None, ValueError, r"\(\.\.\., n, 3\), got \(4,\)"),
        (torch.ones(4, 2), None, ValueError, r"\(\.\.\., n, 3\), got \(4, 2\)"),
        (torch.ones(4, 3), torch.ones(5, 2), ValueError, r"z of shape \(\.\.\., n, 3\)"),
        (torch.full((4, 3), math.nan), None, ValueError, "x contains NaN or Inf"),
        (torch.ones(4, 3), torch.full((4, 3), math.inf), ValueError, "z contains NaN or Inf"),
        (torch.ones(4, 3, device="meta"), None, ValueError, "x is on meta but the parameters are on cpu"),
    ],
)
@pytest.mark.parametrize("kernel_cls", [CosineFeatureKernel, ExponentialDotProductKernel, ShiftedRBFKernel])
def test_kernel_call_rejects(kernel_cls, x, z, error, match):
    kernel = kernel_cls(3) if kernel_cls is ShiftedRBFKernel else kernel_cls(3, 4)
    with pytest.raises(error, match=match):
        kernel(x, z)


def test_kernels_accept_float64():
    kernel = CosineFeatureKernel(3, 4).double()
    assert kernel(torch.randn(4, 3, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: InducedKernel(gpytorch.kernels.RBFKernel(), torch.ones(3, 1)), TypeError, "AsymmetricKernel"),
        (lambda: InducedKernel(ShiftedRBFKernel(1), [[0.0]]), TypeError, "landmarks to be a torch.Tensor"),
        (lambda: InducedKernel(ShiftedRBFKernel(1), torch.ones(3, 2)), ValueError, r"of shape \(\.\.\., M, 1\)"),
        (lambda: InducedKernel(ShiftedRBFKernel(1), torch.full((3, 1), math.nan)), ValueError, "NaN"),
        (lambda: InducedKernel(ShiftedRBFKernel(1), torch.ones(3, 1), side="up"), ValueError, "side"),
    ],
)
def test_induced_kernel_rejects(make, error, match):
    with pytest.raises(error, match=match):
        make()


# -- kernel-eigen features, strategies and the pair SVGP ---------------------------------------------------------------
def landmarks(count: int = 6, dim: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.linspace(-2, 2, count * dim).reshape(count, dim).to(dtype)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kernel": gpytorch.kernels.RBFKernel()}, TypeError, "AsymmetricKernel.*got RBFKernel"),
        ({"kernel": 3}, TypeError, "AsymmetricKernel"),
        ({"landmarks": [[0.0], [1.0]]}, TypeError, "landmarks to be a torch.Tensor, got list"),
        ({"landmarks": torch.arange(6).reshape(6, 1)}, TypeError, "landmarks.*floating-point"),
        ({"landmarks": torch.ones(6)}, ValueError, r"landmarks of shape \(\.\.\., M, 1\), got \(6,\)"),
        ({"landmarks": landmarks(dim=2)}, ValueError, r"landmarks of shape \(\.\.\., M, 1\), got \(6, 2\)"),
        ({"landmarks": landmarks() / 0.0}, ValueError, "landmarks contains NaN or Inf"),
        ({"key_landmarks": landmarks(dim=2)}, ValueError, "key_landmarks of shape"),
        ({"num_inducing": 7}, ValueError, r"num_inducing \(the KSVD rank\) to be an integer in \[1, 6\], got 7"),
        ({"num_inducing": 0}, ValueError, "num_inducing"),
        ({"mode": "dual"}, ValueError, "mode"),
        ({"svd_method": "lanczos"}, ValueError, "svd_method.*'lanczos'"),
        ({"ksvd_weight": -1.0}, ValueError, "ksvd_weight.*>= 0"),
        ({"ksvd_weight": math.nan}, ValueError, "ksvd_weight"),
        ({"mode": "primal"}, ValueError, "primal features"),
    ],
)
def test_kernel_eigen_features_constructor_rejects(kwargs, error, match):
    arguments = {"kernel": ShiftedRBFKernel(1), "landmarks": landmarks(), "num_inducing": 3, **kwargs}
    with pytest.raises(error, match=match):
        KernelEigenFeatures(**arguments)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kernel": gpytorch.kernels.RBFKernel()}, TypeError, "AsymmetricKernel"),
        ({"inducing_points": landmarks() * math.inf}, ValueError, "NaN or Inf"),
        ({"num_inducing": 9}, ValueError, "num_inducing"),
        ({"merge": "max"}, ValueError, "merge"),
        ({"residual": "full"}, ValueError, "residual"),
        ({"variational_distribution": "delta"}, ValueError, "variational_distribution"),
        ({"variational_distribution": int}, TypeError, "_VariationalDistribution"),
        ({"mode": "dual"}, ValueError, "mode"),
    ],
)
def test_pair_svgp_constructor_rejects(kwargs, error, match):
    arguments = {"inducing_points": landmarks(), "kernel": ShiftedRBFKernel(1), "num_inducing": 3, **kwargs}
    with pytest.raises(error, match=match):
        KernelEigenPairSVGP(**arguments)


PAIR_BAD_INPUTS = {
    "not a tensor": ([[0.0]], TypeError, "x to be a torch.Tensor"),
    "integer": (torch.arange(4).reshape(4, 1), TypeError, "floating-point"),
    "wrong width": (torch.ones(4, 2), ValueError, r"x of shape \(\.\.\., N, 1\), got \(4, 2\)"),
    "empty": (torch.ones(0, 1), ValueError, "non-empty"),
    "NaN": (torch.tensor([[0.0], [math.nan]]), ValueError, "x contains NaN or Inf"),
    "float64": (torch.ones(4, 1, dtype=torch.float64), TypeError, "x is torch.float64 but the parameters"),
    "meta": (torch.ones(4, 1, device="meta"), ValueError, "x is on meta"),
}


@pytest.mark.parametrize("case", list(PAIR_BAD_INPUTS))
@pytest.mark.parametrize("call", ["posterior", "prior", "branch"])
def test_pair_svgp_call_rejects(call, case):
    x, error, match = PAIR_BAD_INPUTS[case]
    model = KernelEigenPairSVGP(landmarks(), ShiftedRBFKernel(1), num_inducing=3)
    before = snapshot(model)
    with pytest.raises(error, match=f"KernelEigenPairSVGP: .*{match}"):
        if call == "branch":
            model.branch(x, "left")
        else:
            model(x, prior=call == "prior")
    assert_unchanged(model, before)
    assert torch.isfinite(model(landmarks(4)).mean).all()


def test_pair_svgp_branch_side():
    model = KernelEigenPairSVGP(landmarks(), ShiftedRBFKernel(1), num_inducing=3)
    with pytest.raises(ValueError, match=r"side to be one of \['left', 'right'\], got 'up'"):
        model.branch(landmarks(), "up")


def test_pair_svgp_float64_works():
    model = KernelEigenPairSVGP(landmarks(dtype=torch.float64), ShiftedRBFKernel(1).double(), num_inducing=3).double()
    assert model(landmarks(4, dtype=torch.float64)).mean.dtype == torch.float64


class _OneBranchSVGP(gpytorch.models.ApproximateGP):
    def __init__(self, variational_distribution):
        super().__init__(KernelEigenVariationalStrategy(self, landmarks(), variational_distribution))
        self.covar_module = ShiftedRBFKernel(1)


def test_single_strategy_checks_its_inputs():
    with pytest.raises(TypeError, match="_VariationalDistribution, got int"):
        _OneBranchSVGP(3)
    model = _OneBranchSVGP(gpytorch.variational.CholeskyVariationalDistribution(3))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"_OneBranchSVGP: expected x of shape \(\.\.\., N, 1\)"):
        model(torch.ones(4, 2))
    with pytest.raises(ValueError, match="NaN or Inf"):
        model(torch.full((4, 1), math.nan))
    assert_unchanged(model, before)
    assert torch.isfinite(model(landmarks(4)).mean).all()


# -- objectives --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: KSVDAddedLossTerm(torch.ones(2), weight=-1.0), ValueError, "eta"),
        (lambda: KSVDAddedLossTerm(torch.ones(2), weight=math.nan), ValueError, "eta"),
        (lambda: KSVDAddedLossTerm(torch.ones(2), weight="1"), TypeError, "got '1'"),
        (lambda: KSVDAddedLossTerm([1.0, 2.0]), TypeError, "objective to be a torch.Tensor"),
        (lambda: KSVDAddedLossTerm(torch.ones(2), num_averaged_dims=2), ValueError, "num_averaged_dims"),
        (lambda: KSVDAddedLossTerm(torch.ones(2), num_averaged_dims=0.5), TypeError, "num_averaged_dims"),
    ],
)
def test_ksvd_added_loss_term_rejects(make, error, match):
    with pytest.raises(error, match=match):
        make()


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)

    def forward(self, x, mask=None):
        return self.linear(x)

    def kl_divergence(self):
        return torch.zeros(())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_data": 0}, ValueError, "num_data"),
        ({"num_data": 10.0}, TypeError, "num_data"),
        ({"beta": -1.0}, ValueError, "beta"),
        ({"beta": math.inf}, ValueError, "beta"),
        ({"beta": "1"}, TypeError, "beta.*got '1'"),
        ({"model": torch.nn.Linear(2, 2)}, ValueError, "kl_divergence"),
    ],
)
def test_attention_elbo_constructor_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionELBO(**{"model": _Classifier(), "num_data": 10, **kwargs})


@pytest.mark.parametrize(
    ("logits", "targets", "error", "match"),
    [
        ([[0.0] * 4] * 2, torch.tensor([0, 1]), TypeError, "logits to be a torch.Tensor"),
        (torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 1]), TypeError, "logits.*floating-point"),
        (torch.zeros(4), torch.tensor([0, 1]), ValueError, r"logits of shape \(B, C\) or \(T, B, C\)"),
        (torch.zeros(2, 4), [0, 1], TypeError, "targets to be a torch.Tensor"),
        (torch.zeros(2, 4), torch.tensor([0.0, 1.0]), TypeError, "targets to be an integer tensor"),
        (torch.zeros(2, 4), torch.tensor([0, 1, 2]), ValueError, r"targets of shape \(2,\)"),
        (torch.zeros(2, 4), torch.tensor([0, 4]), ValueError, r"targets in \[0, 3\].*got values in \[0, 4\]"),
        (torch.zeros(2, 4), torch.tensor([-1, 0]), ValueError, r"targets in \[0, 3\]"),
        (torch.zeros(2, 4), torch.tensor([0, 1], device="meta"), ValueError, "targets is on meta"),
    ],
)
def test_attention_elbo_call_rejects(logits, targets, error, match):
    with pytest.raises(error, match=match):
        AttentionELBO(_Classifier(), 10)(logits, targets)


def test_predict_probabilities_rejects():
    model = _Classifier()
    with pytest.raises(TypeError, match="model to be a torch.nn.Module, got function"):
        predict_probabilities(lambda x, mask=None: x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="num_samples"):
        predict_probabilities(model, torch.ones(2, 3), num_samples=0)
    with pytest.raises(ValueError, match="average"):
        predict_probabilities(model, torch.ones(2, 3), average="median")


# -- the Transformer ---------------------------------------------------------------------------------------------------
def transformer(**kwargs: Any) -> Transformer:
    torch.manual_seed(0)
    arguments = {"num_classes": 2, "embed_dim": EMBED_DIM, "depth": 1, "num_heads": NUM_HEADS, "num_inducing": 2}
    return Transformer(**{**arguments, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_classes": 0, "vocab_size": 5}, ValueError, "num_classes"),
        ({"depth": 0, "vocab_size": 5}, ValueError, "depth"),
        ({"gp_layers": 2, "vocab_size": 5}, ValueError, "gp_layers"),
        ({"attention": "nope", "vocab_size": 5}, ValueError, "expected one of"),
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        ({"vocab_size": 5, "max_len": 0}, ValueError, "max_len"),
        ({"vocab_size": 5, "num_inducing": 5}, ValueError, "feature dimension"),
        ({"vocab_size": 5, "mlp_ratio": "2"}, TypeError, "mlp_ratio"),
        ({"vocab_size": 5, "dropout": "0"}, TypeError, "dropout"),
        ({"input": "images", "vocab_size": 5}, ValueError, "input"),
        ({"input": "patches", "image_size": 8, "patch_size": 0, "in_channels": 1}, ValueError, "patch_size"),
    ],
)
def test_transformer_constructor_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        transformer(**kwargs)


TRANSFORMER_BAD_INPUTS = {
    "tokens float": ("tokens", lambda: torch.ones(BATCH, LENGTH), TypeError, "integer token ids"),
    "tokens out of range": ("tokens", lambda: torch.full((BATCH, LENGTH), 5), ValueError, r"\[0, 5\)"),
    "tokens too long": ("tokens", lambda: torch.ones(BATCH, 9, dtype=torch.long), ValueError, "max_len=8"),
    "tokens empty": ("tokens", lambda: torch.ones(BATCH, 0, dtype=torch.long), ValueError, "non-empty"),
    "tokens on meta": ("tokens", lambda: torch.ones(BATCH, 3, dtype=torch.long, device="meta"), ValueError, "meta"),
    "vectors NaN": ("vectors", lambda: torch.full((BATCH, LENGTH, 3), math.nan), ValueError, "inputs contains NaN"),
    "vectors float64": ("vectors", lambda: torch.ones(BATCH, LENGTH, 3).double(), TypeError, "float64"),
    "vectors wrong width": ("vectors", lambda: torch.ones(BATCH, LENGTH, 4), ValueError, r"\(B, N, 3\)"),
    "patches wrong size": ("patches", lambda: torch.ones(BATCH, 1, 6, 6), ValueError, r"\(B, 1, 8, 8\)"),
    "patches Inf": ("patches", lambda: torch.full((BATCH, 1, 8, 8), math.inf), ValueError, "NaN or Inf"),
}


@pytest.mark.parametrize("case", list(TRANSFORMER_BAD_INPUTS))
def test_transformer_forward_rejects(case):
    kind, make, error, match = TRANSFORMER_BAD_INPUTS[case]
    sizes = {
        "tokens": {"vocab_size": 5, "max_len": 8},
        "vectors": {"input_dim": 3, "max_len": 8},
        "patches": {"image_size": 8, "patch_size": 4, "in_channels": 1},
    }[kind]
    model = transformer(input=kind, **sizes)
    before = snapshot(model)
    with pytest.raises(error, match=match):
        model(make())
    assert_unchanged(model, before)


def test_transformer_mask_checks():
    model = transformer(vocab_size=5, max_len=8)
    ids = torch.ones(BATCH, LENGTH, dtype=torch.long)
    with pytest.raises(TypeError, match="boolean padding mask.*torch.int64"):
        model(ids, mask=torch.ones(BATCH, LENGTH, dtype=torch.long))
    with pytest.raises(ValueError, match=r"padding mask of shape \(2, 5\), got torch.bool \(2, 4\)"):
        model(ids, mask=torch.ones(BATCH, LENGTH - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="every token"):
        model(ids, mask=mask([True] * LENGTH, [False] * LENGTH))
    assert torch.isfinite(model(ids, mask="causal")).all()


# -- metrics -----------------------------------------------------------------------------------------------------------
PROBS = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
LABELS = np.array([0, 1, 1])


@pytest.mark.parametrize(
    ("probs", "labels", "error", "match"),
    [
        (PROBS > 0.5, LABELS, TypeError, "real probabilities, got dtype bool"),
        (PROBS, LABELS.astype(float), TypeError, "integer labels, got dtype float64"),
        (PROBS, LABELS.astype(bool), TypeError, "integer labels"),
        (PROBS[:0], LABELS[:0], ValueError, r"n >= 1.*got shape \(0, 2\)"),
        (PROBS[0], LABELS, ValueError, r"shape \(n, C\)"),
        (np.log(PROBS), LABELS, ValueError, "not logits"),
        (PROBS * np.nan, LABELS, ValueError, "NaN or Inf"),
        (PROBS, LABELS + 1, ValueError, r"labels in \[0, C - 1\] = \[0, 1\]"),
        (PROBS, LABELS[:2], ValueError, r"labels of shape \(n,\) = \(3,\)"),
    ],
)
@pytest.mark.parametrize("metric", [accuracy, negative_log_likelihood, brier_score, expected_calibration_error, aurc])
def test_metrics_reject(metric, probs, labels, error, match):
    with pytest.raises(error, match=match):
        metric(probs, labels)


def test_metric_options_reject():
    with pytest.raises(ValueError, match="num_bins"):
        expected_calibration_error(PROBS, LABELS, num_bins=0)
    with pytest.raises(ValueError, match="eps"):
        negative_log_likelihood(PROBS, LABELS, eps=0.0)
    with pytest.raises(ValueError, match="score"):
        ood_auroc(PROBS, PROBS, score="energy")
    with pytest.raises(ValueError, match="number of classes"):
        ood_auroc(PROBS, np.ones((2, 3)) / 3)


# -- data --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: make_pointer_task(-1, 0, 0), ValueError, "n_train"),
        (lambda: make_pointer_task(4, 0, 0, length=1), ValueError, "length"),
        (lambda: make_pointer_task(4, 0, 0, length=4, min_length=5), ValueError, "min_length"),
        (lambda: make_pointer_task(4, 0, 0, vocab_size=3), ValueError, "vocab_size"),
        (lambda: make_pointer_task(4, 0, 0, seed=-1), ValueError, "seed to be a non-negative integer, got -1"),
        (lambda: make_pointer_task(4, 0, 0, seed=1.5), TypeError, "seed.*got 1.5"),
        (lambda: make_pointer_task(4, 0, 0, seed="0"), TypeError, "seed.*got '0'"),
        (lambda: make_successor_task(4, 0, 0, num_symbols=4), ValueError, "num_symbols"),
        (lambda: make_successor_task(4, 0, 0, seed=None), TypeError, "seed.*got None"),
        (lambda: make_asymmetric_regression_1d(n_train=0), ValueError, "n_train"),
        (lambda: make_asymmetric_regression_1d(noise_std=-0.1), ValueError, "noise_std"),
        (lambda: make_asymmetric_regression_1d(noise_std="0.1"), TypeError, "noise_std.*got '0.1'"),
        (lambda: make_asymmetric_regression_1d(lengthscale=0.0), ValueError, "lengthscale"),
        (lambda: make_asymmetric_regression_1d(shift=math.nan), ValueError, "shift"),
        (lambda: make_asymmetric_regression_1d(dtype=torch.int64), ValueError, "dtype"),
        (lambda: make_asymmetric_regression_1d(seed=-3), ValueError, "seed"),
        (lambda: make_asymmetric_regression_2d(shift=(0.5,)), ValueError, "shift must be 2"),
        (lambda: make_asymmetric_regression_2d(num_sources=0), ValueError, "num_sources"),
        (lambda: load_digits_splits(seed=-1), ValueError, "seed"),
        (lambda: load_digits_splits(val_fraction=1.0), ValueError, "val_fraction"),
        (lambda: load_digits_splits(held_out_classes=(10,)), ValueError, "held_out_classes"),
        (lambda: make_noise_ood(-1), ValueError, "make_noise_ood: expected n to be a positive integer, got -1"),
        (lambda: make_noise_ood(4, image_size=1), ValueError, "image_size"),
        (lambda: make_noise_ood(4, seed=2.0), ValueError, "seed"),
    ],
)
def test_data_generators_reject(make, error, match):
    with pytest.raises(error, match=match):
        make()


IMAGES = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: shift_images(IMAGES, "fog", 1), ValueError, "kind.*'fog'"),
        (lambda: shift_images(IMAGES, "blur", 0), ValueError, r"severity to be an integer in \[1, 5\], got 0"),
        (lambda: shift_images(IMAGES, "blur", 6), ValueError, r"severity to be an integer in \[1, 5\], got 6"),
        (lambda: shift_images(IMAGES, "blur", 2.0), ValueError, "severity"),
        (lambda: shift_images(IMAGES, "rotation", 1, seed=-1), ValueError, "seed"),
        (lambda: shift_images((IMAGES * 16).long(), "blur", 1), TypeError, "floating images"),
        (lambda: shift_images(IMAGES[0], "blur", 1), ValueError, r"\(n, C, H, W\), got \(1, 8, 8\)"),
        (lambda: shift_images(IMAGES / 0.0, "blur", 1), ValueError, "NaN"),
        (lambda: shift_images(IMAGES.numpy(), "blur", 1), TypeError, "torch.Tensor"),
        (lambda: make_shifted_test_sets(IMAGES, severities=(1,)), TypeError, "ImageDataset, got Tensor"),
        (lambda: make_shifted_test_sets(_digits(), severities=(0,)), ValueError, "severity"),
        (lambda: make_shifted_test_sets(_digits(), kinds=("fog",)), ValueError, "kind"),
        (lambda: images_to_patches(IMAGES, 3), ValueError, "divide"),
        (lambda: images_to_patches(IMAGES.tolist(), 2), TypeError, "torch.Tensor"),
        (lambda: images_to_patches(IMAGES, 0), ValueError, "patch_size"),
        (lambda: patches_to_images(torch.ones(3, 4, 16), 8, 0, 1), ValueError, "patch_size.*got 0"),
        (lambda: patches_to_images(torch.ones(3, 4, 16), 8, 4, 0), ValueError, "in_channels.*got 0"),
        (lambda: patches_to_images(torch.ones(3, 4, 16).tolist(), 8, 4, 1), TypeError, "patches to be a torch"),
        (lambda: patches_to_images(torch.ones(3, 4, 15), 8, 4, 1), ValueError, r"patches \(n, 4, 16\)"),
    ],
)
def test_image_transforms_reject(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _digits() -> ImageDataset:
    return ImageDataset(IMAGES, torch.zeros(3, dtype=torch.long), 1, ("0",), "three images")


def test_file_loaders_reject(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1.*Nothing is downloaded"):
        load_cifar10(tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_cifar10(tmp_path, split="val")
    with pytest.raises(FileNotFoundError, match="fog.npy"):
        load_cifar10_c(tmp_path, "fog", 1)
    with pytest.raises(ValueError, match="corruption 'mist'"):
        load_cifar10_c(tmp_path, "mist", 1)
    for severity in (0, 6, 2.5, True):
        with pytest.raises(ValueError, match="severity in 1..5"):
            load_cifar10_c(tmp_path, "fog", severity)


# -- experiments and plotting ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"attentions": ("nope",)}, ValueError, "expected attentions"),
        ({"tasks": ("mnist",)}, ValueError, "expected tasks"),
        ({"seeds": (0, 0)}, ValueError, "distinct seeds"),
        ({"seeds": (-1,)}, ValueError, "seeds"),
        ({"pointer_epochs": 0}, ValueError, "pointer_epochs"),
        ({"digits_epochs": -2}, ValueError, "digits_epochs"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"lr": 0.0}, ValueError, "lr"),
        ({"embed_dim": 30, "num_heads": 4}, ValueError, r"embed_dim \(30\).*num_heads \(4\)"),
        ({"depth": 0}, ValueError, "depth"),
        ({"gp_layers": 3}, ValueError, "gp_layers"),
        # the shared width 32 with 2 heads, and a tuned one (digits' kep_svgp: 48 wide, 4 heads)
        ({"num_inducing": 17, "tuned": False}, ValueError, r"num_inducing \(17\).*embed_dim / num_heads = 16"),
        ({"num_inducing": 13}, ValueError, r"num_inducing \(13\).*head width embed_dim / num_heads = 12"),  # tuned
        ({"num_inducing": 0}, ValueError, "num_inducing"),
        ({"eval_samples": 0}, ValueError, "eval_samples"),
        ({"ensemble": 0}, ValueError, "ensemble size"),
        ({"beta": -1.0}, ValueError, "beta"),
        ({"ksvd_weight": math.nan}, ValueError, "ksvd_weight"),
        ({"device": "banana"}, ValueError, "device"),
    ],
)
def test_compare_config_rejects(kwargs, error, match):
    # the settings are checked on construction, what needs a layer (the size) once before any run by plan_runs
    with pytest.raises(error, match=match):
        plan_runs(CompareConfig(**kwargs))


def test_compare_config_size_is_only_bounded_for_ksvd_layers():
    # a size above the head width is only an error for the KSVD layers, whose cosine kernel has rank <= p
    config = CompareConfig(attentions=("softmax", "sgpa"), num_inducing=64)
    assert config.num_inducing == 64 and len(plan_runs(config)) == len(config.tasks) * 2 * len(config.seeds)


def test_compare_config_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        CompareConfig(device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_inducing": 30}, r"num_inducing \(30\) must not exceed num_landmarks \(24\)"),
        ({"num_landmarks": 0}, "num_landmarks"),
        ({"iterations": 0}, "iterations"),
        ({"lr": -0.1}, "lr"),
        ({"pyro_particles": 0}, "pyro_particles"),
        ({"initial_lengthscale": 0.0}, "initial_lengthscale"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, r"seed to be a non-negative integer at most 2\*\*64 - 1"),
    ],
)
def test_toy_regression_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToyRegressionConfig(**kwargs)


def test_plotting_rejects(tmp_path):
    data = make_asymmetric_regression_1d(n_train=8, n_test=4, dtype=torch.float32)
    with pytest.raises(TypeError, match="KernelEigenPairSVGP, got Linear"):
        plot_pair_posterior(torch.nn.Linear(1, 1), data)
    model = KernelEigenPairSVGP(landmarks(), ShiftedRBFKernel(1), num_inducing=3)
    with pytest.raises(TypeError, match="RegressionData, got dict"):
        plot_pair_posterior(model, {})
    concat = KernelEigenPairSVGP(landmarks(), ShiftedRBFKernel(1), num_inducing=3, merge="concat")
    with pytest.raises(ValueError, match="merge='sum'"):
        plot_pair_posterior(concat, data)
    with pytest.raises(ValueError, match="expected 1-D inputs"):
        plot_pair_posterior(model, make_asymmetric_regression_2d(n_train=4, n_test=4))
    with pytest.raises(ValueError, match="non-empty list"):
        write_comparison_figures([], tmp_path)
