"""What a forward call leaves on a layer (added loss terms, a per-call KL) and the layer's modes: deep copies and
pickles after a training step, ``posterior()`` / ``predictive_mean()`` as in eval mode without touching the loss of
the last training step, and ``gpattn._module_state.restored_modes`` (every registered layer, float64)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from gpattn._module_state import GraphFreeState, restored_modes
from gpattn.attention import (
    AttentionLayer,
    attention_arguments,
    attention_names,
    build_attention,
    sample_attention,
)
from gpattn.features import AttentionKernelEigenFeatures, ksvd_fidelity
from gpattn.models import Transformer, monte_carlo_logits, predict_probabilities

EMBED_DIM, NUM_HEADS = 16, 2
#: every registered layer, and the settings whose training forward stores a result on the graph besides the KSVD
#: penalty and SGPA's sequence KL: exact features (the KL of the call) and CGPT's regulariser
CASES = [pytest.param(name, {}, id=name) for name in attention_names()] + [
    pytest.param("kep_svgp", {"features": "exact"}, id="kep_svgp-exact"),
    pytest.param("primal", {"features": "primal_features", "max_len": 7}, id="primal-primal_features"),
    pytest.param("cgpt", {"cgp_weight": 0.1}, id="cgpt-cgp_weight"),
]


def _layer(name: str, options: dict, dropout: float = 0.0) -> AttentionLayer:
    torch.manual_seed(0)
    sizes = {"num_inducing": 4} if "num_inducing" in attention_arguments(name) else {}
    return build_attention(name, EMBED_DIM, NUM_HEADS, dropout=dropout, **sizes, **options).double()


def _tokens(batch: int = 3, length: int = 7, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, EMBED_DIM, dtype=torch.float64, generator=generator)


def _terms(layer: AttentionLayer) -> dict[tuple[str, str], object]:
    """Every computed added loss term of the layer and its submodules, by (module, term) name."""
    return {
        (module_name, term_name): term
        for module_name, module in layer.named_modules()
        for term_name, term in getattr(module, "_added_loss_terms", {}).items()
        if term is not None
    }


def _loss(layer: AttentionLayer, output: torch.Tensor) -> torch.Tensor:
    return output.square().mean() + layer.kl_divergence() + sum(term.loss() for term in _terms(layer).values())


def _modes(module: torch.nn.Module) -> list[bool]:
    return [child.training for child in module.modules()]


# -- deep copies and pickles after a training step ---------------------------------------------------------------------
@pytest.mark.parametrize(("name", "options"), CASES)
def test_a_layer_is_copied_after_a_training_step(name: str, options: dict):
    """Before and after the backward pass of a training step, ``copy.deepcopy`` and ``pickle`` copy the layer (its last
    call's results detached), the copy's eval-mode output, KL and loss terms equal the original's, and the original's
    terms still reach the graph (the backward pass after the first copy runs)."""
    layer, x = _layer(name, options).train(), _tokens()
    torch.manual_seed(3)
    loss = _loss(layer, layer(x))
    terms = _terms(layer)
    on_graph = [term.objective for term in terms.values()] + [getattr(layer, key) for key in layer.call_results]
    on_graph = [tensor for tensor in on_graph if tensor is not None and tensor.grad_fn is not None]
    if name in ("kep_svgp", "primal", "sgpa") or options:  # not vacuous: a result hangs on the graph
        assert on_graph
    copies = [copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))]
    assert all(tensor.grad_fn is not None for tensor in on_graph)  # the original is left as it is
    loss.backward()
    copies.append(copy.deepcopy(layer))
    expected_kl, expected_terms = layer.kl_divergence().detach(), {k: t.loss().detach() for k, t in terms.items()}
    expected = layer.eval()(x)
    for duplicate in copies:
        assert duplicate.training
        assert set(_terms(duplicate)) == set(terms)
        for key, term in _terms(duplicate).items():
            assert term.objective.grad_fn is None
            torch.testing.assert_close(term.loss(), expected_terms[key], rtol=0, atol=0)
        torch.testing.assert_close(duplicate.kl_divergence(), expected_kl, rtol=0, atol=0)
        torch.testing.assert_close(duplicate.eval()(x), expected, rtol=0, atol=0)


def test_graph_free_state_detaches_only_what_hangs_on_a_graph():
    """The state of a module: non-leaf tensor attributes detached (same values), leaves and other values as they
    are, and an added loss term copied only when it holds a tensor on a graph."""
    layer = _layer("primal", {}).train()
    layer(_tokens())
    features = layer.features
    penalty = features._added_loss_terms["ksvd_loss"]
    features.leaf = torch.ones(2, requires_grad=True)
    state = GraphFreeState.__getstate__(features)
    copied = state["_added_loss_terms"]["ksvd_loss"]
    assert copied is not penalty and copied.objective.grad_fn is None and copied.weight == penalty.weight
    torch.testing.assert_close(copied.objective, penalty.objective.detach(), rtol=0, atol=0)
    assert penalty.objective.grad_fn is not None  # the module's own term still reaches the graph
    assert state["leaf"] is features.leaf and state["_modules"] is features.__dict__["_modules"]
    penalty.objective = penalty.objective.detach()
    assert GraphFreeState.__getstate__(features)["_added_loss_terms"]["ksvd_loss"] is penalty  # nothing to detach


# -- posterior() and predictive_mean() as in eval mode -----------------------------------------------------------------
@pytest.mark.parametrize(("name", "options"), CASES)
def test_posterior_in_training_mode_is_the_eval_mode_posterior(name: str, options: dict):
    """With output dropout 0.5, ``posterior()`` and ``predictive_mean()`` of a layer in training mode (or inside
    :func:`sample_attention`) are those of eval mode: no dropout, no sample; every mode is restored."""
    layer, x = _layer(name, options, dropout=0.5), _tokens()
    mean, variance = layer.eval().posterior(x)
    predictive = layer.predictive_mean(x)
    torch.testing.assert_close(predictive, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(predictive, layer(x), rtol=0, atol=1e-12)  # the eval-mode forward
    layer.train()
    for _ in range(2):  # a random posterior would differ between calls
        got_mean, got_variance = layer.posterior(x)
        torch.testing.assert_close(got_mean, mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_variance, variance, rtol=0, atol=1e-12)
        torch.testing.assert_close(layer.predictive_mean(x), mean, rtol=0, atol=1e-12)
    assert all(_modes(layer))
    with sample_attention(layer.eval()):
        torch.testing.assert_close(layer.predictive_mean(x), mean, rtol=0, atol=1e-12)
        assert layer.sample_in_eval


@pytest.mark.parametrize(("name", "options"), CASES)
def test_posterior_leaves_the_loss_of_the_last_training_step(name: str, options: dict):
    """After a training forward, ``posterior()`` and ``predictive_mean()`` on other sequences (another batch size)
    leave every added loss term (the same objects, the same values) and the KL as the forward call set them."""
    layer = _layer(name, options).train()
    torch.manual_seed(3)
    layer(_tokens())
    terms = _terms(layer)
    values = {key: term.loss().detach().clone() for key, term in terms.items()}
    kl = layer.kl_divergence().detach().clone()
    other = 3 * _tokens(batch=2, length=options.get("max_len", 5), seed=9)  # primal_features: one length
    layer.posterior(other)
    layer.predictive_mean(other)
    assert _terms(layer) == terms and all(_terms(layer)[key] is term for key, term in terms.items())
    for key, term in terms.items():
        torch.testing.assert_close(term.loss(), values[key], rtol=0, atol=0)
    torch.testing.assert_close(layer.kl_divergence(), kl, rtol=0, atol=0)
    layer.eval()(other)  # not vacuous where a call's result is stored: a forward call does replace it
    if name == "sgpa" or options.get("features") == "exact":
        assert not torch.equal(
            layer.kl_divergence() + sum(t.loss() for t in _terms(layer).values()), kl + sum(values.values())
        )


@pytest.mark.parametrize(("name", "options"), CASES)
def test_predictions_between_a_training_forward_and_its_loss_leave_the_loss(name: str, options: dict):
    """``predict_probabilities``, ``monte_carlo_logits`` and ``ksvd_fidelity`` call the model in eval mode, where a
    call clears the KSVD and CGPT terms and SGPA's replaces its per-sequence KL: run between a training forward and its
    loss they zeroed the KSVD part of that loss (measured: 0.316 -> 0) until they kept the call's results. A plain
    eval-mode forward does clear the terms (not vacuous)."""
    torch.manual_seed(0)
    sizes = {"num_inducing": 4} if "num_inducing" in attention_arguments(name) else {}
    model = Transformer(2, embed_dim=EMBED_DIM, num_heads=NUM_HEADS, attention=name, vocab_size=9, max_len=7, **sizes,
                        **{key: value for key, value in options.items() if key != "max_len"})  # fmt: skip
    model = model.double().train()
    ids = torch.randint(1, 9, (3, 7), generator=torch.Generator().manual_seed(1))
    other = torch.randint(1, 9, (2, 7), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    model(ids)
    layer = model.blocks[0].attention
    terms = _terms(layer)
    values = {key: term.loss().detach().clone() for key, term in terms.items()}
    kl = model.kl_divergence().detach().clone()
    predict_probabilities(model, other, num_samples=2)
    monte_carlo_logits(model, other, num_samples=2)
    if hasattr(layer, "features") and isinstance(layer.features, AttentionKernelEigenFeatures):
        ksvd_fidelity(layer.features, _tokens(), random_samples=2)
    assert _terms(layer) == terms and all(_terms(layer)[key] is term for key, term in terms.items())
    for key, term in terms.items():
        torch.testing.assert_close(term.loss(), values[key], rtol=0, atol=0)
    torch.testing.assert_close(model.kl_divergence(), kl, rtol=0, atol=0)
    model.eval()(other)  # a plain eval-mode forward clears the terms of the training call (SGPA's: replaced)
    if terms and name != "sgpa":
        assert not _terms(layer)


@pytest.mark.parametrize("name", attention_names())
def test_posterior_keeps_mixed_modes(name: str):
    """A submodule's own mode survives ``posterior()``: the output projection left in eval inside a layer in training,
    and the dropout left in training inside a layer in eval mode (where it is still off during the call)."""
    layer, x = _layer(name, {}, dropout=0.5), _tokens()
    expected = layer.eval().posterior(x)
    layer.train()
    layer.out_proj.eval()
    before = _modes(layer)
    torch.testing.assert_close(layer.posterior(x), expected, rtol=0, atol=1e-12)
    assert _modes(layer) == before and layer.training and not layer.out_proj.training
    layer.eval()
    layer.dropout.train()
    torch.testing.assert_close(layer.predictive_mean(x), expected[0], rtol=0, atol=1e-12)
    assert layer.dropout.training and not layer.training


def test_restored_modes_restores_every_module_on_exit_and_on_error():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model = torch.nn.Sequential(inner, torch.nn.Dropout(0.5), torch.nn.Linear(2, 2)).train()
    inner[1].eval()
    model[2].eval()
    before = _modes(model)
    assert before == [True, True, True, False, True, False]
    with restored_modes(model) as entered:
        assert entered is model
        model.eval()
    assert _modes(model) == before
    with pytest.raises(RuntimeError, match="inside"), restored_modes(model):
        model.train()
        raise RuntimeError("inside")
    assert _modes(model) == before
    with pytest.raises(TypeError, match="restored_modes: expected a torch.nn.Module"), restored_modes(object()):
        pass


def test_restored_modes_restores_a_module_shared_by_parents_of_different_modes():
    # the second parent's train(False) recursed into the shared module after it had got its mode back
    shared = torch.nn.Linear(2, 2)
    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)}).train()
    model["b"].training = False  # a frozen branch sharing a module that trains
    before = _modes(model)
    with restored_modes(model):
        model.eval()
    assert _modes(model) == before and shared.training and not model["b"].training


def test_a_copy_of_a_compiled_layer_runs_its_own_weights():
    # Module.compile() stores the compiled call on the instance, which torch's Module.__getstate__ leaves out and the
    # copy must not share: GraphFreeState starts from it (a copy with zeroed weights gave the original's output)
    layer, x = _layer("softmax", {}), _tokens()
    layer.compile(backend="eager")
    expected = layer(x)
    duplicate = copy.deepcopy(layer)
    assert "_compiled_call_impl" not in duplicate.__dict__
    with torch.no_grad():
        for parameter in duplicate.parameters():
            parameter.zero_()
        assert (duplicate(x) == 0).all()
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    pickle.loads(pickle.dumps(layer))
