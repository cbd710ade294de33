"""AttentionLayer.accumulate_heads (gpattn/attention/_base.py): the head-folded output GEMM against a loop over heads
(float64), its gradients (finite differences, double backward) and the layout of the scores' gradient."""

from __future__ import annotations

import pytest
import torch

from gpattn.attention._base import AttentionLayer

DTYPE = torch.float64
B, H, N, K, C = 2, 3, 5, 2, 4


def _reference(output, head_values, coefficients):
    result = output.expand(B, N, C).clone()
    for h in range(H):
        result = result + head_values[:, h] @ coefficients[..., h, :, :]
    return result


@pytest.mark.parametrize("column_layout", [True, False], ids=["columns", "rows"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared-coefficients", "per-sequence"])
def test_accumulate_heads_against_a_loop_over_heads(column_layout: bool, per_sequence: bool):
    torch.manual_seed(0)
    if column_layout:  # a transposed view of a contiguous (B, H, k, N) tensor: the custom product
        head_values = torch.randn(B, H, K, N, dtype=DTYPE).mT
    else:
        head_values = torch.randn(B, H, N, K, dtype=DTYPE)
    coefficients = torch.randn(*((B,) if per_sequence else ()), H, K, C, dtype=DTYPE)
    bias = torch.randn(C, dtype=DTYPE)
    got = AttentionLayer.accumulate_heads(bias, head_values, coefficients)
    torch.testing.assert_close(got, _reference(bias, head_values, coefficients), rtol=1e-12, atol=1e-12)
    inputs = (bias.requires_grad_(), head_values.requires_grad_(), coefficients.requires_grad_())
    assert torch.autograd.gradcheck(AttentionLayer.accumulate_heads, inputs)
    assert torch.autograd.gradgradcheck(AttentionLayer.accumulate_heads, inputs)


def test_the_scores_gradient_comes_back_in_their_column_layout():
    """Scores held as (B, H, k, N) and used through their (N, k) view get a contiguous (B, H, k, N) gradient (not
    a transposed one, which every elementwise pass of a backward pass downstream would read with a stride)."""
    torch.manual_seed(1)
    columns = torch.randn(B, H, K, N, dtype=DTYPE, requires_grad=True)
    seen = {}

    def keep(grad):
        seen["grad"] = grad
        return grad

    scores = columns * 1.0  # a non-leaf: the gradient the hook sees is the one a backward pass would receive
    scores.register_hook(keep)
    coefficients = torch.randn(H, K, C, dtype=DTYPE)
    AttentionLayer.accumulate_heads(torch.zeros(C, dtype=DTYPE), scores.mT, coefficients).pow(2).sum().backward()
    assert seen["grad"].is_contiguous()
    output = AttentionLayer.accumulate_heads(torch.zeros(C, dtype=DTYPE), columns.detach().mT, coefficients)
    torch.testing.assert_close(seen["grad"], coefficients @ (2 * output).mT.unsqueeze(1))  # dS_h = A_h (2 y)^T
