"""The Triton kernels of the fused amortised scores (gpattn.fused.triton_scores) on CPU under Triton's interpreter,
against the PyTorch code of the same autograd function (its reference and CPU path): values and every gradient in
float64 and float32, bfloat16 under autocast, finite differences through the kernels.

Triton's interpreter must be on when Triton is first imported (its standard library is decorated then), so these cases
run in a fresh process started by ``tests/fused/test_triton_scores.py`` with ``TRITON_INTERPRET=1``; run directly
they are skipped unless that variable is set."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported", allow_module_level=True)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402 (in the module's globals: the interpreter looks for it there)

from gpattn.features import AmortizedAttentionFeatures  # noqa: E402
from gpattn.features.amortized_scores import AmortizedSelfScores  # noqa: E402
from gpattn.fused import triton_scores  # noqa: E402

if not triton_scores.triton_available():
    pytest.skip("Triton is older than the kernels' minimum", allow_module_level=True)


def _float64_dot_failure() -> str | None:
    """Why this Triton cannot run ``tl.dot`` in float64 (Triton 3.0: "Unsupported dtype fp64"), or ``None``. The
    kernels take float64 under the interpreter only (on a GPU, float64 keeps PyTorch's path), so only the float64 cases
    depend on it."""

    @triton.jit
    def product(x):  # a 16 x 16 matrix squared in place (no annotation: PEP 563 strings, see triton_scores._compiled)
        offsets = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        block = tl.load(x + offsets)
        tl.store(x + offsets, tl.dot(block, block))

    try:
        product[(1,)](torch.eye(16, dtype=torch.float64))
    except Exception as error:  # noqa: BLE001 - the interpreter wraps what the language raised
        if "fp64" not in str(error):
            raise
        return f"float64 case: Triton {triton.__version__} has no float64 tl.dot ({error})"
    return None


FLOAT64_DOT = _float64_dot_failure()
needs_float64_dot = pytest.mark.skipif(FLOAT64_DOT is not None, reason=str(FLOAT64_DOT))

NAMES = ("tokens", "lifted", "query_weight", "key_weight", "right_map", "left_map", "right_bias", "left_bias")


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on, the kernels asked for (GPATTN_TRITON=1); both restored after the test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(triton_scores.TRITON_VARIABLE, "1")


def _inputs(dtype: torch.dtype, lift_dim: int | None, seed: int = 0) -> dict:
    """B = 2, N = 70 (two tiles of 64, the second partial), C = 6, H = 2, p = 5, s = 3 (neither a power of two)."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape: int, positive: bool = False) -> torch.Tensor:
        value = torch.randn(*shape, generator=generator, dtype=dtype)
        return (value.abs() + 0.5 if positive else value).requires_grad_()

    width = 6 if lift_dim is None else lift_dim
    return {
        "tokens": leaf(2, 70, 6),
        "lifted": None if lift_dim is None else leaf(2, 70, lift_dim),
        "query_weight": leaf(2, 5, width),
        "key_weight": leaf(2, 5, width),
        "right_map": leaf(2, 6, 3),
        "left_map": leaf(2, 6, 3),
        "right_bias": leaf(2, 3),
        "left_bias": leaf(2, 3),
        "outputscale": leaf(2, positive=True),
        "singular_values": leaf(2, 3, positive=True),
    }


def _apply(inputs: dict, masked: bool, objective: bool):
    mask = (torch.arange(70) < torch.tensor([70, 41])[:, None]).to(inputs["tokens"].dtype)
    weights = (mask / mask.sum(-1, keepdim=True))[:, None, None, None] if masked else 1.0 / 70
    arguments = [inputs["lifted"], *(inputs[name] for name in NAMES if name != "lifted")]
    singular_values = inputs["singular_values"] if objective else None
    square_mask = mask[:, None, None, None] if masked else None
    return AmortizedSelfScores.apply(*arguments, weights, inputs["outputscale"], singular_values, square_mask)


def _run(monkeypatch, inputs: dict, kernels: bool, masked: bool, objective: bool, uses_scores: bool = True):
    """Values and gradients of a loss of both outputs through the kernels or the PyTorch code."""
    monkeypatch.setenv(triton_scores.TRITON_VARIABLE, "1" if kernels else "0")
    leaves = [value for name, value in inputs.items() if value is not None and (objective or name != "singular_values")]
    scores, value, magnitude = _apply(inputs, masked, objective)
    assert torch.isfinite(magnitude)
    loss = (scores * scores.cos()).sum() if uses_scores else 0.0
    if objective:
        loss = loss + value.square().sum()
    return scores.detach(), value.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float64, marks=needs_float64_dot), torch.float32], ids=["float64", "float32"]
)
@pytest.mark.parametrize(
    ("masked", "objective", "lift_dim", "uses_scores"),
    [(False, True, None, True), (True, True, None, True), (True, False, 4, True), (False, True, 4, False)],
    ids=["plain", "padding", "lifted-no-objective", "objective-alone"],
)
def test_kernels_equal_the_pytorch_code(interpreter, monkeypatch, dtype, masked, objective, lift_dim, uses_scores):
    inputs = _inputs(dtype, lift_dim)
    assert triton_scores.runs_triton(torch.empty(1, dtype=dtype))
    reference = _run(monkeypatch, inputs, False, masked, objective, uses_scores)
    kernels = _run(monkeypatch, inputs, True, masked, objective, uses_scores)
    tolerance = {"rtol": 1e-11, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(kernels[0], reference[0], **tolerance)
    torch.testing.assert_close(kernels[1], reference[1], **tolerance)
    for got, expected in zip(kernels[2], reference[2], strict=True):
        torch.testing.assert_close(got, expected, **tolerance)


@needs_float64_dot
@pytest.mark.parametrize(
    ("masked", "objective", "lift_dim", "uses_scores"),
    [(False, True, None, True), (True, True, None, True), (True, False, 4, True), (False, True, 4, False)],
    ids=["plain", "padding", "lifted-no-objective", "objective-alone"],
)
def test_kernels_with_the_tokens_split(interpreter, monkeypatch, masked, objective, lift_dim, uses_scores):
    """At most 64 tokens per program: the 70 tokens in two chunks (a whole tile and a partial one), their sums over the
    tokens written per chunk and reduced between two launches per pass, against the PyTorch code in float64."""
    monkeypatch.setattr(triton_scores, "TOKENS_PER_PROGRAM", 64)
    assert triton_scores._chunks(70) == (64, 2) and triton_scores._chunks(64) == (64, 1)
    inputs = _inputs(torch.float64, lift_dim, seed=5)
    reference = _run(monkeypatch, inputs, False, masked, objective, uses_scores)
    kernels = _run(monkeypatch, inputs, True, masked, objective, uses_scores)
    tolerance = {"rtol": 1e-11, "atol": 1e-12}
    torch.testing.assert_close(kernels[0], reference[0], **tolerance)
    torch.testing.assert_close(kernels[1], reference[1], **tolerance)
    for got, expected in zip(kernels[2], reference[2], strict=True):
        torch.testing.assert_close(got, expected, **tolerance)


def test_chunks_of_long_sequences():
    """Whole tiles per chunk, every chunk within TOKENS_PER_PROGRAM, the last one shorter, none empty."""
    limit = triton_scores.TOKENS_PER_PROGRAM
    for length in (limit, limit + 1, 3 * limit - 7, 4 * limit, 16384, 16384 + 70):
        per_chunk, chunks = triton_scores._chunks(length)
        assert per_chunk % triton_scores.BLOCK_N == 0 or chunks == 1
        assert per_chunk <= max(limit, length if chunks == 1 else 0) and (chunks - 1) * per_chunk < length
        assert chunks * per_chunk >= length and chunks == -(-length // limit)


@needs_float64_dot
def test_kernels_against_finite_differences(interpreter):
    inputs = _inputs(torch.float64, None, seed=3)
    leaves = [name for name, value in inputs.items() if value is not None]

    def function(*values):
        return _apply(dict(inputs, **dict(zip(leaves, values, strict=True))), masked=True, objective=True)[:2]

    assert torch.autograd.gradcheck(function, [inputs[name] for name in leaves], fast_mode=True)


def test_kernels_under_bfloat16_autocast(interpreter, monkeypatch):
    """The layer's features under CPU autocast through the kernels (bfloat16 loads and stores; the interpreter
    multiplies in float32) against the PyTorch autocast path: scores within bfloat16 rounding, J float32, gradients
    close."""
    torch.manual_seed(7)
    features = AmortizedAttentionFeatures(32, 2, num_inducing=4)
    x = torch.randn(3, 70, 32)
    results = {}
    for kernels in ("0", "1"):
        monkeypatch.setenv(triton_scores.TRITON_VARIABLE, kernels)
        features.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = features(x, objective=True, kernel_diag=False)
        assert scores.stacked.dtype == torch.bfloat16 and scores.objective.dtype == torch.float32
        (scores.stacked.float().square().mean() + scores.objective.square().mean()).backward()
        grads = {name: value.grad.clone() for name, value in features.named_parameters()}
        results[kernels] = (scores.stacked.float(), scores.objective.detach(), grads)
    (reference, reference_objective, reference_grads), (got, objective, grads) = results["0"], results["1"]
    assert (got - reference).norm() / reference.norm() < 2e-2
    torch.testing.assert_close(objective, reference_objective, rtol=2e-2, atol=1e-3)
    for name, value in reference_grads.items():
        assert (grads[name] - value).norm() <= 3e-2 * value.norm(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_layer_outside_autocast_trains_through_the_kernels(interpreter, monkeypatch, dtype):
    """A layer converted to bfloat16/float16 (no autocast; on CUDA the kernels are the default for these dtypes): the
    kernels' float32 token sums meet J's half-precision terms (a dtype error at the first training step before), and
    the scores, J and gradients agree with the PyTorch path within the dtype's rounding."""
    torch.manual_seed(7)
    features = AmortizedAttentionFeatures(32, 2, num_inducing=4).to(dtype)
    x = torch.randn(3, 40, 32).to(dtype)
    results = {}
    for kernels in ("0", "1"):
        monkeypatch.setenv(triton_scores.TRITON_VARIABLE, kernels)
        features.zero_grad(set_to_none=True)
        scores = features(x, objective=True, kernel_diag=False)
        assert scores.stacked.dtype == dtype and scores.objective.dtype == dtype
        (scores.stacked.float().square().mean() + scores.objective.float().square().mean()).backward()
        grads = {name: value.grad.float() for name, value in features.named_parameters()}
        results[kernels] = (scores.stacked.float(), scores.objective.detach().float(), grads)
    (reference, reference_objective, reference_grads), (got, objective, grads) = results["0"], results["1"]
    assert (got - reference).norm() / reference.norm() < 2e-2
    assert (objective - reference_objective).norm() <= 3e-2 * reference_objective.norm()
    for name, value in reference_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert (grads[name] - value).norm() <= 5e-2 * value.norm() + 1e-3, name


def test_a_captured_training_step_through_the_kernels_reads_nothing(interpreter, monkeypatch):
    """A KEP-SVGP training step through both kernels while a CUDA graph is captured (simulated: gpattn's
    ``is_capturing`` answers ``True``, see tests/attention/test_graph_capture.py) reads no value on the host, and
    gives the uncaptured step's loss and gradients."""
    import copy

    from gpattn.attention import build_attention
    from gpattn.features import amortized_scores

    launches = []
    for name in ("scores_forward", "scores_backward"):  # counted where the autograd function calls them
        kernel = getattr(amortized_scores, name)
        monkeypatch.setattr(
            amortized_scores, name, lambda *a, kernel=kernel, name=name, **k: launches.append(name) or kernel(*a, **k)
        )
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", 16, 2, num_inducing=3).train()
    captured_layer = copy.deepcopy(layer)
    x = torch.randn(2, 70, 16)

    def step(module):
        torch.manual_seed(1)
        module.zero_grad(set_to_none=True)
        loss = module(x).sum() + module.kl_divergence() + sum(term.loss() for term in module.added_loss_terms())
        loss.backward()
        return [loss.detach(), *(parameter.grad for parameter in module.parameters() if parameter.grad is not None)]

    expected = step(layer)
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_initialized", lambda: True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        for name, original in originals.items():
            patch.setattr(torch.Tensor, name, lambda self, *a, o=original, n=name: reads.append(n) or o(self, *a))
        got = step(captured_layer)
    assert reads == []
    assert launches == ["scores_forward", "scores_backward"] * 2
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
