"""The fused amortised self-attention scores against autograd through the general path (float64): values, and the
gradients of every parameter; the hand-written backward pass against finite differences (gradcheck)."""

from __future__ import annotations

import pytest
import torch

from gpattn.features import AttentionKernelEigenFeatures
from gpattn.features.amortized_scores import AmortizedSelfScores

DTYPE = torch.float64


def _loss(scores, probes):
    left, right = scores.left_scores, scores.right_scores
    loss = (left * probes[0]).sum() + (right * probes[1]).sum()
    if scores.objective is not None:
        loss = loss + (scores.objective * probes[2]).sum()
    return loss


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "padding"])
@pytest.mark.parametrize("objective", [False, True], ids=["no-objective", "objective"])
def test_fused_path_equals_the_general_path(masked: bool, objective: bool):
    torch.manual_seed(0)
    features = AttentionKernelEigenFeatures(12, 3, num_inducing=2, feature_dim=4).to(DTYPE)
    with torch.no_grad():  # away from the initial values: a nontrivial outputscale and biases
        features.kernel.outputscale = 1.7
        features.left_bias.normal_()
        features.right_bias.normal_()
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]]) if masked else None
    probes = [
        torch.randn(2, 3, 5, 2, dtype=DTYPE),
        torch.randn(2, 3, 5, 2, dtype=DTYPE),
        torch.randn(2, 3, dtype=DTYPE),
    ]
    results = {}
    for name, kernel_diag in (("fused", False), ("general", True)):  # the kernel diagonal takes the general path
        features.zero_grad(set_to_none=True)
        scores = features(x, key_mask=mask, objective=objective, kernel_diag=kernel_diag)
        assert (scores.left_kernel_diag is None) == (name == "fused")
        _loss(scores, probes).backward()
        grads = {key: value.grad.clone() for key, value in features.named_parameters() if value.grad is not None}
        results[name] = (scores, grads)
    (fused, fused_grads), (general, general_grads) = results["fused"], results["general"]
    torch.testing.assert_close(fused.left_scores, general.left_scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.right_scores, general.right_scores, rtol=1e-12, atol=1e-12)
    if objective:
        torch.testing.assert_close(fused.objective, general.objective, rtol=1e-12, atol=1e-12)
    assert fused_grads.keys() == general_grads.keys()
    assert {"kernel.query_weight", "kernel.key_weight", "left_map", "right_bias"} <= set(general_grads)
    for key, value in general_grads.items():
        torch.testing.assert_close(fused_grads[key], value, rtol=1e-10, atol=1e-12, msg=key)


def test_backward_pass_against_finite_differences():
    torch.manual_seed(1)
    columns = torch.randn(2, 2, 3, 4, 5, dtype=DTYPE, requires_grad=True)
    values = torch.randn(2, 2, 3, 2, 5, dtype=DTYPE, requires_grad=True)
    weights = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=DTYPE).expand(2, 1, 1, 1, 5) / 3
    root_scale = torch.rand(3, 1, 1, dtype=DTYPE).add(0.5).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda c, v, r: AmortizedSelfScores.apply(c, v, weights, r), (columns, values, root_scale)
    )
    # some outputs unused (their gradient is None)
    assert torch.autograd.gradcheck(
        lambda c, v, r: AmortizedSelfScores.apply(c, v, weights, r)[0], (columns, values, root_scale)
    )
