"""Under ``torch.compile`` a training step of the attention layers gives eager mode's gradients, for every parameter.

The layers' hand-written autograd functions (the fused amortised scores, the readout, the marginal noise, the KL) are
traced by dynamo into one graph with their backward passes. torch 2.11's dynamo gives every input of such a function
a zero gradient when the function returns a tensor that its forward pass modified in place (torch 2.13 does not): the
fused scores did, so a compiled KEP-SVGP or Primal-Attention layer trained with frozen features, silently. The
functions now form their outputs out of place while compiling. The check runs the whole step (the layer, its KL and
its KSVD penalty) under the ``aot_eager`` backend, which traces as the default backend does but compiles no kernels,
against the same step in eager mode; the draws are the same in both (``aot_eager`` draws from the global generator).
That check fails only on a torch with the defect; :func:`test_no_fused_function_returns_a_tensor_modified_in_place`
guards the cause on any torch."""

from __future__ import annotations

import pytest
import torch
from torch.torch_version import TorchVersion

from gpattn._torch_compat import COMPILES_ASSERTS, TRACES_FUNCTIONS
from gpattn.attention import build_attention
from gpattn.features.amortized_scores import AmortizedSelfScores
from gpattn.variational.cholesky_prior_kl import CholeskyPriorKL

EMPTY = "every sequence needs at least one real token"
CONFIGURATIONS = {
    "kep_svgp": ("kep_svgp", {}),  # the fused amortised scores, joint draws through LinearOutput, CholeskyPriorKL
    "kep_svgp_marginal": ("kep_svgp", {"sampling": "marginal"}),  # MarginalNoiseOutput
    "kep_svgp_paper": ("kep_svgp_paper", {"max_len": 8}),  # primal-token features, the official KSVD form
    "primal": ("primal", {}),  # the fused amortised scores without a GP
}


def _step(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = layer(x).square().sum() + layer.kl_divergence()
    for term in layer.added_loss_terms():  # the KSVD penalty of this call, in training mode
        loss = loss + term.loss()
    return loss


def _assert_same_step(layer: torch.nn.Module, step, compiled, *arguments: torch.Tensor) -> None:
    # the loss and every parameter's gradient of the compiled step are the eager step's, with the same draws
    results = []
    for run in (step, compiled):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        loss = run(*arguments)
        loss.backward()
        results.append((loss.detach(), {key: value.grad.clone() for key, value in layer.named_parameters()}))
    (eager_loss, eager), (compiled_loss, compiled_gradients) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for key, value in eager.items():
        scale = 1e-5 * float(value.abs().max())
        torch.testing.assert_close(compiled_gradients[key], value, rtol=1e-4, atol=scale, msg=key)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_compiled_step_gives_the_eager_gradients_of_every_parameter(name, training):
    attention, options = CONFIGURATIONS[name]
    torch.manual_seed(0)
    layer = build_attention(attention, 16, 2, **options).train(training)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=False)
    results = {}
    for label, step in (("eager", _step), ("compiled", compiled)):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(2)  # the same noise in both steps
        loss = step(layer, x)
        loss.backward()
        gradients = {key: value.grad.clone() for key, value in layer.named_parameters() if value.grad is not None}
        results[label] = (loss.detach(), gradients)
    (eager_loss, eager), (compiled_loss, compiled_gradients) = results["eager"], results["compiled"]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    if not TRACES_FUNCTIONS:  # torch < 2.4: graph breaks; a parameter outside eager's graph may get a zero gradient
        compiled_gradients = {key: value for key, value in compiled_gradients.items() if key in eager or value.any()}
    assert compiled_gradients.keys() == eager.keys()
    if training:  # every parameter learns (in eval mode those of the draws and of the KSVD penalty need not)
        assert len(eager) == sum(1 for value in layer.parameters() if value.requires_grad)
    for key, value in eager.items():
        scale = value.abs().max()
        assert scale > 0, key  # a gradient that is not trivially zero in eager mode
        # float32 sums in another order: entries far below the largest differ by its rounding, not by their own
        torch.testing.assert_close(compiled_gradients[key], value, rtol=1e-4, atol=1e-5 * float(scale), msg=key)


def test_no_fused_function_returns_a_tensor_modified_in_place(monkeypatch):
    """The cause, on any torch: in their compiling branch (``torch.compiler.is_compiling`` made true, run eagerly) the
    fused scores and the closed-form KL return tensors that no in-place operator has touched (version 0)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True, raising=False)
    monkeypatch.setattr(torch._dynamo, "is_compiling", lambda: True)  # what gpattn reads on torch 2.1 and 2.2
    generator = torch.Generator().manual_seed(3)

    def parameter(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    batch, length, width, heads, features, rank = 2, 8, 16, 2, 8, 3
    tokens, weights = parameter(batch, length, width), (parameter(heads, features, width) for _ in range(2))
    maps, biases = (parameter(heads, width, rank) for _ in range(2)), (parameter(heads, rank) for _ in range(2))
    outputscale, spectrum = parameter(heads).exp(), parameter(heads, rank).exp()
    scores, objective, _ = AmortizedSelfScores.apply(
        None, tokens, *weights, *maps, *biases, 1.0 / length, outputscale, spectrum, None, False, None
    )
    assert scores.shape == (batch, 2, heads, rank, length) and objective.shape == (batch, heads)
    assert scores._version == 0 and objective._version == 0
    mean, factor, scales = parameter(heads, rank), parameter(heads, rank, rank), parameter(heads, rank).exp()
    for total in (False, True):
        kl = CholeskyPriorKL.apply(mean, factor, scales, total)
        assert kl._version == 0 and kl.shape == (() if total else (heads,))


@pytest.mark.parametrize("name", ["kep_svgp", "kep_svgp_paper", "softmax"])
def test_a_masked_step_adds_no_graph_break_gives_the_eager_gradients_and_still_refuses_an_empty_sequence(name):
    """The layers' check that every sequence keeps a real token is a data-dependent branch in eager mode (a graph
    break each call: four graphs per KEP step); while compiling it is an asynchronous assertion instead. The masked
    step has the graphs of the step without a mask (torch >= 2.9, whose inductor keeps the assertion; dynamo traces
    the autograd functions from 2.4), one on the torch of CI, gives eager mode's loss and gradients, and a mask that
    hides a whole sequence still fails, when the compiled step runs."""
    attention, options = {"kep_svgp_paper": ("kep_svgp_paper", {"max_len": 8})}.get(name, (name, {}))
    torch.manual_seed(0)
    layer = build_attention(attention, 16, 2, **options).train()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False

    def step(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        outputs = layer(x, mask=mask)
        loss = (outputs if mask is None else outputs * mask[..., None]).square().sum() + layer.kl_divergence()
        for term in layer.added_loss_terms():
            loss = loss + term.loss()
        return loss

    if TRACES_FUNCTIONS and COMPILES_ASSERTS:  # the mask check adds no graph break to the step without a mask
        counts = []
        for given in (None, mask):
            torch._dynamo.reset()
            explained = torch._dynamo.explain(step)(x, given)
            counts.append((explained.graph_count, explained.graph_break_count))
        assert counts[1] == counts[0], explained.break_reasons
        if TorchVersion(torch.__version__) >= (2, 11):  # 2.9's dynamo breaks in gpytorch's added-loss-term walk
            assert counts[1] == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    _assert_same_step(layer, step, compiled, x, mask)
    empty = mask.clone()
    empty[0] = False
    with pytest.raises(ValueError, match=r"sequence\(s\) \[0\]: " + EMPTY):
        step(x, empty)
    with pytest.raises(RuntimeError if COMPILES_ASSERTS else ValueError, match=EMPTY):
        compiled(x, empty)


def test_the_default_compiler_keeps_the_check_for_empty_sequences():
    """Inductor (the default backend) decomposed ``torch._assert_async`` to nothing before torch 2.9: there the
    layers keep the Python check while compiling (graph breaks), so that a compiled layer never lets a mask that
    hides a whole sequence through."""
    layer = build_attention("softmax", 16, 2).eval()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    torch.testing.assert_close(compiled(x, mask=mask), layer(x, mask=mask), rtol=1e-5, atol=1e-6)
    mask[1] = False
    with pytest.raises(RuntimeError if COMPILES_ASSERTS else ValueError, match=EMPTY):
        compiled(x, mask=mask)


def test_no_backward_pass_reads_the_layout_of_its_gradient_while_compiling(monkeypatch):
    """torch 2.4's dynamo traces a backward pass in strict mode, where reading ``Tensor.is_contiguous`` is a graph
    break: ``LinearOutput`` made its gradient contiguous only when it was not, and a compiled KEP step had five graphs
    on torch 2.4.1 (one since). In their compiling branch (made true, run eagerly) the hand-written backward passes of
    a KEP step read no layout, and give the gradients of the eager branch."""
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", 16, 2).train()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    gradients = []
    for compiling in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda value=compiling: value, raising=False)
            patch.setattr(torch._dynamo, "is_compiling", lambda value=compiling: value)
            layer.zero_grad(set_to_none=True)
            torch.manual_seed(2)
            loss = _step(layer, x)
            if compiling:

                def refuse(self, *args, **kwargs):
                    raise AssertionError("a backward pass read is_contiguous while compiling")

                patch.setattr(torch.Tensor, "is_contiguous", refuse)
            loss.backward()
        gradients.append({key: value.grad.clone() for key, value in layer.named_parameters()})
    for key, value in gradients[0].items():
        torch.testing.assert_close(gradients[1][key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.skipif(not TRACES_FUNCTIONS, reason="dynamo traces gpattn's autograd functions from torch 2.4")
@pytest.mark.parametrize("name", ["kep_svgp", "primal"])
def test_a_masked_step_compiles_for_a_second_batch_size(name):
    """``torch.compile``'s default shapes: static at the first call, the batch dimension dynamic at a second batch
    size. Dynamo traces the fused scores' backward pass with the gradient of their objective :math:`J` laid out as
    the forward pass's output; that output had strides (1, B), and dynamo read the symbolic batch size from them, so
    the second size failed with the gradient autograd gives (contiguous): ``shape '[1, 1, 2, 4, 1]' is invalid``. The
    output is contiguous while compiling; every batch size gives eager mode's loss and gradients."""
    torch.manual_seed(0)
    layer = build_attention(name, 16, 2, num_inducing=4).train()

    def step(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = (layer(x, mask=mask) * mask[..., None]).square().sum() + layer.kl_divergence()
        for term in layer.added_loss_terms():
            loss = loss + term.loss()
        return loss

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    generator = torch.Generator().manual_seed(1)
    for batch in (4, 3, 1, 5):  # 1: the size at which .contiguous() returns its tensor (torch 2.11 then erred)
        x = torch.randn(batch, 8, 16, generator=generator)
        mask = torch.arange(8) < torch.randint(4, 9, (batch, 1), generator=generator)
        _assert_same_step(layer, step, compiled, x, mask)
