"""Second derivatives through the hand-written autograd functions (gpattn/fused/first_order.py): refused with the
function's name, where autograd would otherwise miss the terms through their saved intermediates (a gradient penalty
on a KEP-SVGP layer came out zero for every parameter); first derivatives unchanged; layers built of autograd
operations keep their second derivatives (checked against finite differences)."""

from __future__ import annotations

import pytest
import torch

from gpattn.attention import build_attention

DTYPE = torch.float64


def _layer(name: str, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_attention(name, 8, 2, **options).to(DTYPE).train()


def _tokens() -> torch.Tensor:
    return torch.randn(2, 5, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(1), requires_grad=True)


@pytest.mark.parametrize(
    ("name", "options", "function"),
    [
        ("primal", {}, "AmortizedSelfScores"),
        ("kep_svgp", {}, "LinearOutput"),  # the output's backward runs first, then the scores'
        ("kep_svgp", {"sampling": "marginal"}, "MarginalNoiseOutput"),
    ],
)
def test_a_gradient_penalty_through_a_fused_function_is_refused_with_its_name(name, options, function):
    layer, tokens = _layer(name, **options), _tokens()
    loss = layer(tokens).square().sum()
    with pytest.raises(RuntimeError, match=rf"^{function}: second derivatives are not implemented"):
        torch.autograd.grad(loss, tokens, create_graph=True)
    # first derivatives as before: the guard is silent without create_graph
    layer.zero_grad()
    torch.manual_seed(2)
    layer(tokens).square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_the_kl_refuses_second_derivatives():
    layer = _layer("kep_svgp")
    layer(_tokens())
    kl = layer.kl_divergence()
    with pytest.raises(RuntimeError, match=r"^CholeskyPriorKL: second derivatives are not implemented"):
        torch.autograd.grad(kl, list(layer.parameters()), create_graph=True, allow_unused=True)


def test_a_layer_of_autograd_operations_keeps_its_second_derivatives():
    """SGPA (no hand-written function on its path): double backward agrees with finite differences."""
    layer = _layer("sgpa").eval()
    assert torch.autograd.gradgradcheck(lambda tokens: layer(tokens), (_tokens(),))
