"""The magnitude guard shared by the attention layers (gpattn.validation.check_overflow): its rule, its message, and
the layers that raise it where their results would otherwise be NaN (issue 24, item 4)."""

from __future__ import annotations

import math

import pytest
import torch

from gpattn.attention import CGPTAttention, SGPAAttention, SoftmaxAttention
from gpattn.validation import check_overflow, check_token_magnitude, token_magnitude_limit

GROWTH = "the scores grow like |x|^2"


@pytest.mark.parametrize(
    ("dtype", "limit"), [(torch.float16, 0.25594), (torch.bfloat16, 1.8411e16), (torch.float32, 1.8447e16)]
)
def test_limit_is_the_square_root_of_the_largest_value_over_a_thousand(dtype, limit):
    assert token_magnitude_limit(dtype) == pytest.approx(limit, rel=1e-4)
    assert token_magnitude_limit(torch.float64) == pytest.approx(math.sqrt(1.7976931348623157e308) / 1e3)


def test_message_names_the_magnitude_the_dtype_and_the_remedy():
    tokens = torch.tensor([[1.0, -2e17]])
    message = (
        r"MyLayer: the input tokens reach \|x\| = 2e\+17, too large for torch.float32: the scores grow like \|x\|\^2, "
        r"which overflows beyond about sqrt\(finfo.max\) = 1.84e\+19; rescale the inputs \(e.g. a LayerNorm before "
        r"the layer\) or use float64$"
    )
    with pytest.raises(ValueError, match=message):
        check_token_magnitude(tokens, GROWTH, where="MyLayer")
    with pytest.raises(ValueError, match=r"too large for torch.float64: .*before the layer\)$"):  # no "use float64"
        check_token_magnitude(torch.tensor([1e152], dtype=torch.float64), GROWTH)
    limit = token_magnitude_limit(torch.float32)
    check_token_magnitude([torch.tensor([limit * 0.99]), torch.tensor([-limit * 0.99])], GROWTH)  # within: nothing


def test_overflow_check_reads_the_tokens_only_once_a_result_is_not_finite():
    huge, small = torch.tensor([1e30]), torch.tensor([1.0])
    assert check_overflow((torch.ones(3), None), huge, GROWTH)  # finite results: the tokens are not looked at
    assert not check_overflow((torch.tensor([1.0, math.nan]),), small, GROWTH)  # NaN from small tokens: the caller's
    with pytest.raises(ValueError, match="reach"):
        check_overflow((torch.ones(2), torch.tensor([math.inf])), [small, huge], GROWTH, where="Layer")
    assert check_overflow((torch.empty(2, device="meta"),), huge, GROWTH)  # no values on meta: skipped


LAYERS = {
    "softmax": lambda: SoftmaxAttention(16, 2),
    "sgpa": lambda: SGPAAttention(16, 2, num_inducing=3),
    "cgpt": lambda: CGPTAttention(16, 2),
}


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 1e20), (torch.float64, 1e160)])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_refuse_tokens_beyond_the_range_of_their_dtype(name, training, dtype, magnitude):
    """Tokens spread over 1e20 (float32) or 1e160 (float64): before, NaN outputs (softmax, SGPA) or a NotPSDError
    blaming the jitter (CGPT); now the guard's message, in eval and in training mode."""
    torch.manual_seed(0)
    layer = LAYERS[name]().to(dtype).train(training)
    tokens = magnitude * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)
    layer_name = type(layer).__name__
    with pytest.raises(ValueError, match=rf"{layer_name}.*: the input tokens reach .*too large for {dtype}.*rescale"):
        layer(tokens)
