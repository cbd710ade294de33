"""The fused amortised self-attention scores against autograd through the general path (float64): values, and the
gradients of every parameter; the hand-written backward pass against finite differences (gradcheck)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gpattn.features import AmortizedAttentionFeatures
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
    features = AmortizedAttentionFeatures(12, 3, num_inducing=2, feature_dim=4).to(DTYPE)
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


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
def test_token_sums_of_squares_and_their_gradient(masked: bool):
    """The third output, sum_i m_i e_ik^2 per block and direction, against a direct sum of the first output's squares;
    its hand-written gradient (folded into the scores' gradient) against finite differences."""
    torch.manual_seed(2)
    columns = torch.randn(2, 2, 3, 4, 5, dtype=DTYPE, requires_grad=True)
    values = torch.randn(2, 2, 3, 2, 5, dtype=DTYPE, requires_grad=True)
    weights = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=DTYPE).expand(2, 1, 1, 1, 5) / 3
    root_scale = torch.rand(3, 1, 1, dtype=DTYPE).add(0.5).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5], dtype=DTYPE)[:, None, None, None] if masked else None
    scores, _, sums = AmortizedSelfScores.apply(columns, values, weights, root_scale, True, mask)
    expected = (scores.square() * (1.0 if mask is None else mask)).sum(-1)
    assert sums.shape == (2, 2, 3, 2)
    torch.testing.assert_close(sums, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda c, v, r: AmortizedSelfScores.apply(c, v, weights, r, True, mask), (columns, values, root_scale)
    )
    assert torch.autograd.gradcheck(  # the sums alone
        lambda c, v, r: AmortizedSelfScores.apply(c, v, weights, r, True, mask)[2], (columns, values, root_scale)
    )
    # without sums the third output is empty and carries no gradient
    _, _, empty = AmortizedSelfScores.apply(columns, values, weights, root_scale)
    assert empty.numel() == 0 and not empty.requires_grad


def test_backward_pass_twice_with_a_retained_graph():
    """The backward pass reuses a buffer of the forward pass as scratch: a second backward pass through the same
    graph (retain_graph) gives the same gradients."""
    torch.manual_seed(3)
    columns = torch.randn(2, 2, 3, 4, 5, dtype=DTYPE, requires_grad=True)
    values = torch.randn(2, 2, 3, 2, 5, dtype=DTYPE, requires_grad=True)
    weights = torch.full((1, 1, 1, 1, 1), 0.2, dtype=DTYPE)
    root_scale = torch.rand(3, 1, 1, dtype=DTYPE).add(0.5).requires_grad_()
    scores, score_weights, sums = AmortizedSelfScores.apply(columns, values, weights, root_scale, True)
    loss = scores.sin().sum() + score_weights.cos().sum() + sums.sqrt().sum()
    first = torch.autograd.grad(loss, (columns, values, root_scale), retain_graph=True)
    second = torch.autograd.grad(loss, (columns, values, root_scale))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_scores_are_halves_of_one_stacked_tensor():
    """The fused path returns both branches as halves of one (B, 2, H, s, N) tensor (for one output GEMM), which
    ``columns()`` hands out as it is; the per-output view drops it; the general path exposes the same layout by
    stacking once."""
    torch.manual_seed(4)
    features = AmortizedAttentionFeatures(12, 3, num_inducing=2, feature_dim=4).to(DTYPE)
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    scores = features(x, kernel_diag=False)
    assert scores.stacked is not None and scores.stacked.shape == (2, 2, 3, 2, 5)
    assert scores.columns() is scores.stacked
    assert torch.equal(scores.stacked[:, 0].mT, scores.left_scores)
    assert torch.equal(scores.stacked[:, 1].mT, scores.right_scores)
    assert scores.left_scores.data_ptr() == scores.stacked.data_ptr()  # views, no copy
    per_output = scores.for_outputs(1)
    assert per_output.stacked is None and per_output.left_scores.shape == (2, 3, 1, 5, 2)
    assert scores.for_outputs(0) is scores
    general = features(x)  # the kernel diagonal takes the general path: one tensor per branch
    assert general.stacked is None
    torch.testing.assert_close(general.columns(), scores.stacked, rtol=1e-12, atol=1e-12)  # stacked once
    left = general.columns(("left",))  # one branch: a view
    assert left.shape == (2, 1, 3, 2, 5) and left.data_ptr() == general.left_scores.data_ptr()


EXCLUSIONS = ["cross-attention", "causal", "kernel_diag", "tie_qk", "autocast"]


@pytest.mark.parametrize("exclusion", EXCLUSIONS)
def test_each_exclusion_of_the_fused_path(exclusion: str):
    """The fused path is one predicate, ``takes_fused_path``: true for plain self-attention, false for each
    exclusion, and an excluded call is answered by the general path (no stacked tensor) with the fused path's scores
    where the call means the same (cross-attention on keys equal to the queries, or with the kernel diagonals)."""
    torch.manual_seed(6)
    tied = exclusion == "tie_qk"
    features = AmortizedAttentionFeatures(12, 3, num_inducing=2, feature_dim=4, tie_qk=tied).to(DTYPE)
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    keys = x.clone() if exclusion == "cross-attention" else x  # the same values, but not the queries
    causal, kernel_diag = exclusion == "causal", exclusion == "kernel_diag"
    assert features.takes_fused_path(x, x, causal=False, kernel_diag=False) is not tied
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if exclusion == "autocast" else contextlib.nullcontext()
    with autocast:
        assert features.takes_fused_path(x, keys, causal, kernel_diag) is False
        scores = features(x, keys, causal=causal, kernel_diag=kernel_diag)
    assert scores.stacked is None and scores.left_scores.shape == (2, 3, 5, 2)
    if exclusion in ("cross-attention", "kernel_diag"):
        fused = features(x, kernel_diag=False)
        assert fused.stacked is not None
        torch.testing.assert_close(scores.columns(), fused.columns(), rtol=1e-12, atol=1e-12)


def test_backward_pass_with_create_graph_gives_the_same_gradients():
    """With create_graph the backward pass writes into no buffer (a concatenation instead): same first-order
    gradients as the in-place pass."""
    torch.manual_seed(5)
    columns = torch.randn(2, 2, 3, 4, 5, dtype=DTYPE, requires_grad=True)
    values = torch.randn(2, 2, 3, 2, 5, dtype=DTYPE, requires_grad=True)
    weights = torch.full((1, 1, 1, 1, 1), 0.2, dtype=DTYPE)
    root_scale = torch.rand(3, 1, 1, dtype=DTYPE).add(0.5).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0] * 5], dtype=DTYPE)[:, None, None, None]
    gradients = {}
    for create_graph in (False, True):
        scores, score_weights, sums = AmortizedSelfScores.apply(columns, values, weights, root_scale, True, mask)
        loss = scores.sin().sum() + score_weights.cos().sum() + sums.sqrt().sum()
        gradients[create_graph] = torch.autograd.grad(loss, (columns, values, root_scale), create_graph=create_graph)
    for a, b in zip(gradients[False], gradients[True], strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)
