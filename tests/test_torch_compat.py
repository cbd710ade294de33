"""The fallbacks of ``gpattn._torch_compat`` for torch 2.1-2.3, run on this torch against its own newer functions.

CI runs one torch (2.13), where the fallbacks are not taken: each test forces the fallback branch and checks it
against what the current API answers (the suite itself was run on torch 2.1.2 and 2.4.1 too; see
docs/installation.md)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from gpattn import _torch_compat


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-2.4+", "fallback"])
def test_autocast_state_matches_torch(monkeypatch, fallback):
    if not _torch_compat.DEVICE_AUTOCAST and not fallback:
        pytest.skip("torch < 2.4: no torch.get_autocast_dtype to compare with")
    if fallback:
        monkeypatch.setattr(_torch_compat, "DEVICE_AUTOCAST", False)
    assert not _torch_compat.autocast_enabled("cpu") and not _torch_compat.autocast_enabled("cuda")
    if fallback:  # CUDA autocast's state without a GPU: torch.is_autocast_enabled() reads it
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *device: not device)
        assert _torch_compat.autocast_enabled("cuda") and not _torch_compat.autocast_enabled("cpu")
        monkeypatch.undo()
        monkeypatch.setattr(_torch_compat, "DEVICE_AUTOCAST", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _torch_compat.autocast_enabled("cpu") and not _torch_compat.autocast_enabled("cuda")
        assert _torch_compat.autocast_dtype("cpu") == torch.bfloat16
        if not fallback:  # the answers of torch itself
            assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert _torch_compat.autocast_dtype("cuda") == torch.float16  # the default


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-2.3+", "fallback"])
def test_is_compiling_is_true_only_inside_torch_compile(monkeypatch, fallback):
    if fallback:  # torch 2.1 and 2.2 have no torch.compiler.is_compiling
        monkeypatch.setattr(_torch_compat, "COMPILER_IS_COMPILING", False)
    torch._dynamo.reset()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1.0 if _torch_compat.is_compiling() else x - 1.0

    x = torch.zeros(2)
    assert torch.equal(step(x), -torch.ones(2))
    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(x), torch.ones(2))


class _Square(torch.autograd.Function):
    """x^2 with a backward pass of 3 x (not its derivative: which backward ran shows in the gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3.0 * x * grad


@pytest.mark.parametrize("traces", [True, False], ids=["torch-2.4+", "fallback"])
def test_compilable_function_gives_eager_values_and_gradients(monkeypatch, traces):
    """torch 2.4+: ``apply`` itself, traced into one graph; before: run eagerly inside the compiled function (two
    graphs around the break); both with the function's own backward pass (eager mode's output and gradient)."""
    monkeypatch.setattr(_torch_compat, "TRACES_FUNCTIONS", traces)
    square = _torch_compat.compilable(_Square.apply)
    assert (square == _Square.apply) is traces  # apply itself (a bound method: equal, not identical)

    def step(x: torch.Tensor) -> torch.Tensor:
        return (square(x.sin()) + 1.0).exp().sum()

    x = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64, requires_grad=True)
    # d/dx exp(sin^2 x + 1) through the function's backward pass: exp(sin^2 x + 1) * 3 sin x * cos x
    expected = ((x.sin().square() + 1.0).exp() * 3.0 * x.sin() * x.cos()).detach()
    torch._dynamo.reset()
    counters.clear()
    value = torch.compile(step, backend="aot_eager")(x)
    (gradient,) = torch.autograd.grad(value, x)
    torch.testing.assert_close(value, (x.sin().square() + 1.0).exp().sum(), rtol=1e-14, atol=0)
    torch.testing.assert_close(gradient, expected, rtol=1e-14, atol=0)
    assert counters["stats"]["unique_graphs"] == (1 if traces else 2), dict(counters["stats"])


def test_the_dataclasses_built_inside_a_compiled_layer_are_not_frozen():
    """torch 2.3's dynamo cannot construct a frozen dataclass inside a compiled function (measured on torch 2.3.1:
    every compiled KEP and Primal step failed with InternalTorchDynamoError "'AttentionInputs' object has no attribute
    'queries'", and passed once these two were plain dataclasses); keep them unfrozen while torch 2.3 is supported."""
    import dataclasses

    from gpattn.attention._base import AttentionInputs
    from gpattn.features import KernelEigenScores

    for cls in (AttentionInputs, KernelEigenScores):
        assert dataclasses.is_dataclass(cls) and not cls.__dataclass_params__.frozen, cls.__name__


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-2.3+", "fallback"])
def test_mha_fastpath_is_off_inside_the_block_and_restored_after_an_error(monkeypatch, fallback):
    """torch 2.3+: the switch reads False inside the block and its previous value (True or False) after it, also when
    the block raises; torch 2.1-2.2 (no ``torch.backends.mha``): the block runs and touches nothing."""
    mha = pytest.importorskip("torch.backends.mha")
    if fallback:
        monkeypatch.setattr(_torch_compat, "_MHA", None)
    for before in (True, False):
        mha.set_fastpath_enabled(before)
        try:
            with pytest.raises(RuntimeError, match="inside"), _torch_compat.mha_fastpath_disabled():
                assert mha.get_fastpath_enabled() is (before if fallback else False)
                raise RuntimeError("inside")
            assert mha.get_fastpath_enabled() is before
        finally:
            mha.set_fastpath_enabled(True)
