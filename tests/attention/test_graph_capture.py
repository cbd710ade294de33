"""Issue 25: a training step of a layer that says ``supports_graph_capture`` can be captured into a CUDA graph: while a
graph is captured it reads no value on the host (a read ends the capture with an error) and computes what it computes
outside one.

CI has no GPU, so capture is simulated: ``torch.cuda.is_initialized`` and ``torch.cuda.is_current_stream_capturing``,
the two functions :func:`gpattn._torch_compat.is_capturing` asks, answer ``True``. A read is any call of a tensor's
``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__`` or ``numpy`` (forward and backward
passes). ``benchmarks/gpu_check.py`` captures real graphs of the KEP and floor steps on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from gpattn._torch_compat import is_capturing, rehearsing_capture
from gpattn.attention import attention_names, build_attention, select_arguments

#: configurations that capture (``supports_graph_capture``): every learned feature mode, both samplings, both merges
CAPTURED = [
    ("softmax", {}),
    ("kep_svgp", {}),
    ("kep_svgp", {"sampling": "marginal", "residual": "diag"}),
    ("kep_svgp", {"merge": "concat"}),
    ("kep_svgp", {"merge": "concat_tokens", "max_len": 8}),
    ("kep_svgp", {"features": "primal_features", "max_len": 8}),
    ("kep_svgp_paper", {"max_len": 8}),
    ("kep_svgp_sym", {}),
    ("primal", {}),
    ("primal_paper", {"max_len": 8}),
]


def _mask(kind: str | None, batch: int, length: int):
    if kind == "padding":  # the second sequence ends two or three tokens early
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[1, -min(3, length - 3) :] = False
        return mask
    return kind


def _training_step(layer: torch.nn.Module, x: torch.Tensor, mask, context=None) -> list[torch.Tensor]:
    """Output, loss and every gradient (parameters and input) of one training step from seed 0."""
    torch.manual_seed(0)
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    output = layer(x, mask) if context is None else layer(x, mask, context=context)
    loss = output.sum() + layer.kl_divergence()
    for term in getattr(layer, "added_loss_terms", tuple)():
        loss = loss + term.loss()
    loss.backward()
    gradients = [parameter.grad for parameter in layer.parameters() if parameter.grad is not None]
    return [output.detach(), loss.detach(), x.grad, *gradients]


def _layer(name: str, options: dict) -> torch.nn.Module:
    torch.manual_seed(1)
    return build_attention(name, 16, 4, **select_arguments(name, num_inducing=3), **options).double().train()


def test_is_capturing_asks_cuda_only_once_it_is_initialised(monkeypatch):
    def refuse():
        raise AssertionError("asked while CUDA is not initialised")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", refuse)
    assert not is_capturing()  # a CPU-only build raises when asked: not asked
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for answer in (True, False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda answer=answer: answer)
        assert is_capturing() is answer


def test_a_rehearsal_answers_as_a_capture_and_restores_the_answer(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not is_capturing()
    with rehearsing_capture():
        assert is_capturing()
        with rehearsing_capture():
            assert is_capturing()
        assert is_capturing()
    assert not is_capturing()
    with pytest.raises(KeyError), rehearsing_capture():
        raise KeyError  # restored after an error too
    assert not is_capturing()


@pytest.mark.parametrize("mask_kind", [None, "padding", "causal", "cross"])
@pytest.mark.parametrize("name, options", CAPTURED)
def test_a_captured_training_step_reads_nothing_and_computes_the_uncaptured_step(
    simulated_capture, counted_reads, name, options, mask_kind
):
    layer = _layer(name, options)
    assert layer.supports_graph_capture
    if mask_kind == "causal" and not layer.supports_causal:
        pytest.skip(f"{name} {options} is not causal")
    features = getattr(layer, "features", None)
    if mask_kind == "padding" and features is not None and not features.supports_padding_mask:
        pytest.skip(f"{name} {options} takes no padding mask")
    if mask_kind is not None and options.get("merge") == "concat_tokens":
        pytest.skip("merge='concat_tokens' takes no mask")
    if mask_kind == "cross" and not layer.supports_cross_attention:
        pytest.skip(f"{name} {options} has no cross-attention")
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    # cross-attention: 5 keys of a context, the second sequence's last two padded
    context = torch.randn(2, 5, 16, dtype=torch.float64) if mask_kind == "cross" else None
    mask = _mask("padding", 2, 5) if mask_kind == "cross" else _mask(mask_kind, 2, 8)
    captured_layer = copy.deepcopy(layer)
    _training_step(layer, x, mask, context)  # lazy initialisations (cached constants), as the warm-up before a capture
    _training_step(captured_layer, x, mask, context)
    with counted_reads() as outside:
        expected = _training_step(layer, x, mask, context)
    with simulated_capture(), counted_reads() as inside:
        captured = _training_step(captured_layer, x, mask, context)
    assert inside == []
    assert len(captured) == len(expected)
    for value, reference in zip(captured, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
    if mask_kind is None:  # the counter sees the guards' reads outside a capture
        assert outside, f"{name} {options}: no read counted outside a capture"


@pytest.mark.parametrize("name, options", CAPTURED)
def test_a_captured_evaluation_reads_nothing(simulated_capture, counted_reads, name, options):
    layer = _layer(name, options).eval()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        expected = layer(x)
        with simulated_capture(), counted_reads() as inside:
            captured = layer(x)
    assert inside == []
    torch.testing.assert_close(captured, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", attention_names())
def test_supports_graph_capture_says_whether_a_step_reads_while_captured(simulated_capture, counted_reads, name):
    """Every registry layer: one that supports capture reads nothing while captured; one that does not (GPyTorch's
    Cholesky factorisation, the exact KSVD) does read, which would end a real capture."""
    options = {"max_len": 8} if name.endswith("_paper") else {}
    layer = _layer(name, options)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    _training_step(layer, x, None)
    with simulated_capture(), counted_reads() as inside:
        _training_step(layer, x, None)
    assert (inside == []) is layer.supports_graph_capture, (name, inside)
    exact = _layer("kep_svgp", {"features": "exact"})
    assert not exact.supports_graph_capture
    with simulated_capture(), counted_reads() as inside:
        _training_step(exact, x, None)
    assert inside


def test_a_mask_hiding_a_sequence_fails_on_the_device_while_captured(simulated_capture, counted_reads):
    """The eager check raises a ValueError naming the sequence; while captured it is an asynchronous assertion (on a
    GPU a device-side assert at the replay; on a CPU at once), a RuntimeError with the same explanation, without the
    sequence's index."""
    layer = _layer("kep_svgp", {})
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0] = False
    with pytest.raises(ValueError, match=r"hides every token of sequence\(s\) \[0\]"):
        layer(x, mask)
    with simulated_capture(), counted_reads() as inside:
        with pytest.raises(RuntimeError, match="KEPSVGPAttention: every sequence needs at least one real token"):
            layer(x, mask)
    assert inside == []
