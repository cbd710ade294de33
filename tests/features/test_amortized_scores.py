"""The fused amortised self-attention scores against autograd through the general path (float64): values, and the
gradients of every parameter; the hand-written backward pass against finite differences (gradcheck)."""

from __future__ import annotations

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


def _inputs(seed: int, lift_dim: int | None = None) -> dict:
    """Random inputs of the fused function for B = 2, N = 5, C = 6, H = 3, p = 4, s = 2 (float64, with gradients):
    the tokens, the lifted tokens (the tokens themselves unless ``lift_dim``), the six parameters of the projections,
    the output scale and the singular values."""
    generator = torch.Generator().manual_seed(seed)

    def parameter(*shape: int, positive: bool = False) -> torch.Tensor:
        value = torch.randn(*shape, generator=generator, dtype=DTYPE)
        return (value.abs() + 0.5 if positive else value).requires_grad_()

    tokens = parameter(2, 5, 6)
    lifted = tokens if lift_dim is None else parameter(2, 5, lift_dim)
    width = lifted.shape[-1]
    return {
        "lifted": lifted,
        "tokens": tokens,
        "query_weight": parameter(3, 4, width),
        "key_weight": parameter(3, 4, width),
        "right_map": parameter(3, 6, 2),
        "left_map": parameter(3, 6, 2),
        "right_bias": parameter(3, 2),
        "left_bias": parameter(3, 2),
        "outputscale": parameter(3, positive=True),
        "singular_values": parameter(3, 2, positive=True),
    }


PADDED = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=DTYPE)
#: the token weights 1/|V| of three visible tokens of five, per sequence: (B, 1, 1, 1, N)
THIRDS = PADDED.expand(2, 1, 1, 1, 5) / 3


def _arguments(inputs: dict, token_weights, mask, objective: bool = True) -> list:
    """The function's arguments in its order from ``inputs`` (a dict of :func:`_inputs`)."""
    names = ("lifted", "tokens", "query_weight", "key_weight", "right_map", "left_map", "right_bias", "left_bias")
    singular_values = inputs["singular_values"] if objective else None
    arguments = [inputs[name] for name in names] + [token_weights, inputs["outputscale"], singular_values, mask]
    return [None if arguments[0] is arguments[1] else arguments[0], *arguments[1:]]  # no lift: None


def _apply(inputs: dict, token_weights=THIRDS, objective: bool = True, mask=None):
    return AmortizedSelfScores.apply(*_arguments(inputs, token_weights, mask, objective))


def _dense(inputs: dict, token_weights: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[e^T; r^T] (B, 2, H, s, N) and J (B, H) written directly from the formulas of the module docstring."""
    lifted, tokens, scale = inputs["lifted"], inputs["tokens"], inputs["outputscale"].sqrt()[:, None, None]
    phi_q = torch.nn.functional.normalize(torch.einsum("hpd,bnd->bhpn", inputs["query_weight"], lifted), dim=-2)
    phi_k = torch.nn.functional.normalize(torch.einsum("hpd,bnd->bhpn", inputs["key_weight"], lifted), dim=-2)
    a_r = torch.einsum("hcs,bnc->bhsn", inputs["right_map"], tokens) + inputs["right_bias"][..., None]
    a_e = torch.einsum("hcs,bnc->bhsn", inputs["left_map"], tokens) + inputs["left_bias"][..., None]
    weight = token_weights.squeeze(1)  # (B, 1, 1, N)
    w_e = (a_e * weight) @ (scale * phi_k).mT  # W_e^T: (B, H, s, p)
    w_r = (a_r * weight) @ (scale * phi_q).mT
    left, right = w_e @ (scale * phi_q), w_r @ (scale * phi_k)  # e^T, r^T: (B, H, s, N)
    m = 1.0 if mask is None else mask.squeeze(1)
    sums = ((left.square() + right.square()) * m).sum(-1)  # S_k: (B, H, s)
    objective = 0.5 * (sums / inputs["singular_values"]).sum(-1) - (w_e * w_r).sum((-2, -1))
    return torch.stack([left, right], dim=1), objective


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
@pytest.mark.parametrize("lift_dim", [None, 7], ids=["tokens", "lifted"])
def test_scores_and_objective_against_the_formulas(masked: bool, lift_dim: int | None):
    """The scores and J (with the token sums S_k over the real tokens) against a direct computation of the formulas;
    the magnitude is the sum of the squared norms, the token sums and |J|."""
    inputs = _inputs(2, lift_dim)
    token_weights = THIRDS
    mask = torch.stack([PADDED, torch.ones(5, dtype=DTYPE)])[:, None, None, None] if masked else None
    scores, objective, magnitude = _apply(inputs, token_weights, mask=mask)
    expected_scores, expected_objective = _dense(inputs, token_weights, mask)
    assert scores.shape == (2, 2, 3, 2, 5) and objective.shape == (2, 3)
    torch.testing.assert_close(scores, expected_scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(objective, expected_objective, rtol=1e-12, atol=1e-12)
    weights = (inputs["query_weight"], inputs["key_weight"])
    squared_norms = sum(torch.einsum("hpd,bnd->bhpn", w, inputs["lifted"]).square().sum() for w in weights)
    token_sums = (expected_scores.square() * (1.0 if mask is None else mask)).sum()
    expected_magnitude = squared_norms + token_sums + expected_objective.abs().sum()
    assert magnitude.shape == () and magnitude.dtype == DTYPE and not magnitude.requires_grad
    torch.testing.assert_close(magnitude, expected_magnitude, rtol=1e-12, atol=0)
    # the rescaled (overflow-safe) norms give the same numbers on ordinary inputs
    rescaled = AmortizedSelfScores.apply(*_arguments(inputs, token_weights, mask), True)
    torch.testing.assert_close(rescaled[0], scores, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rescaled[1], objective, rtol=1e-12, atol=1e-12)
    # without the singular values the objective is empty and carries no gradient
    _, empty, magnitude = _apply(inputs, token_weights, objective=False)
    assert empty.numel() == 0 and not empty.requires_grad and not magnitude.requires_grad
    torch.testing.assert_close(magnitude, squared_norms + expected_scores.sum(), rtol=1e-12, atol=1e-12)


def _gradcheck(function, inputs: dict) -> bool:
    names = [name for name in inputs if not (name == "lifted" and inputs["lifted"] is inputs["tokens"])]

    def call(*values):
        return function(dict(zip(names, values, strict=True)) | ({} if "lifted" in names else {"lifted": values[0]}))

    return torch.autograd.gradcheck(call, [inputs[name] for name in names])


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
@pytest.mark.parametrize("lift_dim", [None, 7], ids=["tokens", "lifted"])
def test_backward_pass_against_finite_differences(masked: bool, lift_dim: int | None):
    """The hand-written backward pass of every input (tokens, lifted tokens, the six projection parameters, the output
    scale, the singular values) against finite differences, with both outputs, the scores alone and J alone."""
    inputs = _inputs(1, lift_dim)
    mask = torch.stack([PADDED, torch.ones(5, dtype=DTYPE)])[:, None, None, None] if masked else None
    assert _gradcheck(lambda values: _apply(values, mask=mask)[:2], inputs)
    assert _gradcheck(lambda values: _apply(values, mask=mask)[0], inputs)  # J unused: its gradient is None
    assert _gradcheck(lambda values: _apply(values, mask=mask)[1], inputs)  # the scores unused
    assert _gradcheck(lambda values: _apply(values, objective=False)[0], inputs)  # no objective
    assert _gradcheck(lambda values: _apply(values, token_weights=0.2)[:2], inputs)  # one weight for every token


def test_backward_pass_twice_with_a_retained_graph():
    """The backward pass reuses a buffer of the forward pass as scratch: a second backward pass through the same
    graph (retain_graph) gives the same gradients."""
    inputs = _inputs(3)
    scores, objective, _ = _apply(inputs, token_weights=0.2)
    loss = scores.sin().sum() + objective.cos().sum()
    leaves = [value for name, value in inputs.items() if name != "lifted"]
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
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


EXCLUSIONS = ["cross-attention", "causal", "kernel_diag", "tie_qk"]


@pytest.mark.parametrize("exclusion", EXCLUSIONS)
def test_each_exclusion_of_the_fused_path(exclusion: str):
    """The fused path is one predicate, ``takes_paired_path``: true for plain self-attention, false for each
    exclusion, and an excluded call is answered by the general path (no stacked tensor) with the fused path's scores
    where the call means the same (cross-attention on keys equal to the queries, or with the kernel diagonals)."""
    torch.manual_seed(6)
    tied = exclusion == "tie_qk"
    features = AmortizedAttentionFeatures(12, 3, num_inducing=2, feature_dim=4, tie_qk=tied).to(DTYPE)
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    keys = x.clone() if exclusion == "cross-attention" else x  # the same values, but not the queries
    causal, kernel_diag = exclusion == "causal", exclusion == "kernel_diag"
    assert features.takes_paired_path(x, x, causal=False, kernel_diag=False) is not tied
    assert features.takes_paired_path(x, keys, causal, kernel_diag) is False
    scores = features(x, keys, causal=causal, kernel_diag=kernel_diag)
    assert scores.stacked is None and scores.left_scores.shape == (2, 3, 5, 2)
    if exclusion in ("cross-attention", "kernel_diag"):
        fused = features(x, kernel_diag=False)
        assert fused.stacked is not None
        torch.testing.assert_close(scores.columns(), fused.columns(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
def test_fused_path_under_bfloat16_autocast(masked: bool):
    """Under CPU autocast (bfloat16) the fused path runs its products in bfloat16 (scores within bfloat16 rounding of
    float32's) and forms J in float32 from them; its backward pass restores autocast and gives finite gradients close
    to float32's."""
    torch.manual_seed(7)
    features = AmortizedAttentionFeatures(32, 2, num_inducing=4)
    x = torch.randn(3, 40, 32)
    mask = (torch.arange(40) < torch.tensor([40, 31, 17])[:, None]) if masked else None
    gradients = {}
    for precision in ("float32", "bfloat16"):
        features.zero_grad(set_to_none=True)
        enabled = precision == "bfloat16"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            assert features.takes_paired_path(x, x, causal=False, kernel_diag=False)
            scores = features(x, key_mask=mask, objective=True, kernel_diag=False)
        assert scores.stacked is not None and scores.stacked.dtype == getattr(torch, precision)
        assert scores.objective.dtype == torch.float32
        (scores.stacked.float().square().mean() + scores.objective.square().mean()).backward()
        gradients[precision] = (scores, {k: v.grad.clone() for k, v in features.named_parameters()})
    (reference, reference_grads), (low, low_grads) = gradients["float32"], gradients["bfloat16"]
    relative = (low.stacked.float() - reference.stacked).norm() / reference.stacked.norm()
    assert relative < 2e-2, relative
    scale = float(reference.objective.detach().abs().max())
    torch.testing.assert_close(low.objective, reference.objective, rtol=2e-2, atol=2e-2 * scale)
    for name, value in reference_grads.items():
        assert torch.isfinite(low_grads[name]).all() and low_grads[name].dtype == torch.float32, name
        assert (low_grads[name] - value).norm() <= 5e-2 * value.norm() + 1e-6, name
