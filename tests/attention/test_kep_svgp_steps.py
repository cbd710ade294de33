"""One default KEP-SVGP training step (issue 25): the number of operators it runs (the profiler's top-level aten
calls, forward and backward, as benchmarks/attention_scaling.py --count-ops counts them) and its bfloat16 autocast
output against float32 on the benchmark's inputs (B = 16, N = 256, C = 128, 4 heads, s = 10)."""

from __future__ import annotations

import pytest
import torch

from gpattn._torch_compat import TRACES_FUNCTIONS
from gpattn.attention import build_attention

#: the operators of one step before issue 25 (amortised features, joint sampling, KL, KSVD penalty, backward)
OPERATORS_BEFORE = 402


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("attention_scaling", "attention_scaling_for_steps")


def _step(layer: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = layer(x)
        loss = output.float().sum() + layer.kl_divergence()
        for term in layer.added_loss_terms():
            loss = loss + term.loss()
    loss.backward()
    return output


@pytest.mark.skipif(not TRACES_FUNCTIONS, reason="counted on torch 2.4+; torch 2.1 records more operators (227)")
def test_a_training_step_runs_at_most_half_the_operators_of_before(bench):
    """The count does not depend on the sizes: a small layer stands for the benchmark's."""
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", 16, 4, num_inducing=3).train()
    x = torch.randn(2, 8, 16)
    _step(layer, x)  # first call: lazy initialisations out of the count
    operators = bench.count_ops(lambda: bench._step(layer, x))
    assert operators <= OPERATORS_BEFORE // 2, operators


@pytest.mark.parametrize(
    "name, options",
    [
        ("kep_svgp", {}),
        ("kep_svgp", {"sampling": "marginal", "residual": "diag"}),
        ("kep_svgp", {"merge": "concat"}),
        ("kep_svgp", {"features": "exact"}),
        ("kep_svgp", {"features": "primal_features", "max_len": 8}),
        ("kep_svgp_paper", {"max_len": 8}),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_a_training_step_searches_no_einsum_contraction_path(bench, monkeypatch, name, options, causal):
    """``torch.einsum`` with three or more operands asks opt_einsum (installed with pyro-ppl) for a contraction path on
    every call, about 0.5 ms of Python each: half of a small step's host time before this was checked. Every product
    of a KEP step has two operands; a path search is counted by wrapping opt_einsum's ``contract_path``."""
    opt_einsum = pytest.importorskip("opt_einsum")
    import torch.backends.opt_einsum  # noqa: F401 (not imported by ``import torch`` on torch 2.1)

    assert torch.backends.opt_einsum.is_available() and torch.backends.opt_einsum.enabled
    searches = []
    original = opt_einsum.contract_path

    def counted(*args, **kwargs):
        searches.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(opt_einsum, "contract_path", counted)
    torch.manual_seed(0)
    layer = build_attention(name, 16, 4, num_inducing=3, **options).train()
    if causal and not layer.supports_causal:
        pytest.skip(f"{name} {options} is not causal")
    x = torch.randn(2, 8, 16)
    mask = "causal" if causal else None
    torch.einsum("ij,jk,kl->il", torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2))  # the wrapper counts
    assert len(searches) == 1
    layer.zero_grad(set_to_none=True)
    loss = layer(x, mask=mask).sum() + layer.kl_divergence() + sum(term.loss() for term in layer.added_loss_terms())
    loss.backward()
    mean, variance = layer.posterior(x, mask=mask)
    (mean.sum() + variance.sum()).backward()
    assert searches[1:] == []


def test_bfloat16_autocast_step_against_float32_on_the_benchmark_inputs():
    """Under CPU autocast the output is bfloat16 within 2e-2 (relative, in norm and in the largest entry) of the float32
    output under the same draw; the KL and the KSVD penalty stay float32 and close to float32's; every gradient is
    finite."""
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", 128, 4, num_inducing=10).train()
    x = torch.randn(16, 256, 128)
    results = {}
    for autocast in (False, True):
        torch.manual_seed(5)  # the same joint draw
        output = _step(layer, x, autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            kl, penalty = layer.kl_divergence(), sum(term.loss() for term in layer.added_loss_terms())
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        results[autocast] = (output.detach(), kl.detach(), penalty.detach(), grads)
    (reference, ref_kl, ref_penalty, _), (low, kl, penalty, grads) = results[False], results[True]
    assert low.dtype == torch.bfloat16 and kl.dtype == penalty.dtype == torch.float32
    difference = low.float() - reference
    assert difference.norm() / reference.norm() < 2e-2
    assert difference.abs().max() / reference.abs().max() < 2e-2
    torch.testing.assert_close(kl, ref_kl, rtol=1e-6, atol=0)  # the KL never sees the tokens: float32 throughout
    torch.testing.assert_close(penalty, ref_penalty, rtol=2e-2, atol=0)
    assert grads and all(torch.isfinite(grad).all() for grad in grads)
