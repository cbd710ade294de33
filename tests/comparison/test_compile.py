"""``gpattn compare --compile``: the option reaches every run's model, the compile options follow the device (CUDA
graphs on CUDA), the model really compiles (dynamo traces it, and keeps tracing past its default limit of graphs),
the hooked passes after training (Laplace features, KSVD fidelity) still see their hooks, and a compiled model trains
to the numbers of the eager one (slow: a cold torch.compile)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from gpattn._torch_compat import recompile_limit_name
from gpattn.cli import main
from gpattn.comparison import CompareConfig, build_model, model_fidelity
from gpattn.comparison import config as config_module
from gpattn.comparison import runner as runner_module
from gpattn.comparison.runs import RECOMPILE_LIMIT, compile_model
from gpattn.methods import get_method
from gpattn.models import LastLayerLaplace, Transformer


@pytest.mark.parametrize(
    ("device", "cudagraphs"), [("cpu", False), ("cuda", True), ("cuda:1", True), (torch.device("cuda"), True)]
)
def test_compile_options_follow_the_device(monkeypatch, device, cudagraphs: bool):
    # reduce-overhead (CUDA graphs) on CUDA; eager's random numbers everywhere
    calls = []
    monkeypatch.setattr(torch, "compile", lambda function, **options: calls.append(options) or function)
    model = torch.nn.Linear(2, 2)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    assert compile_model(model, device) is model  # in place: the same module, parameters and state dict
    expected = {"fallback_random": True, **({"triton.cudagraphs": True} if cudagraphs else {})}
    assert calls == [{"dynamic": False, "options": expected}]
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in state.items())


def _small_transformer(row: str = "kep_svgp") -> torch.nn.Module:
    method = get_method(row)
    config = CompareConfig(embed_dim=16, depth=1, num_heads=2)
    hyperparameters = config.hyperparameters("mnist1d", method, {"num_inducing": 4})
    return build_model(method, hyperparameters, 10, {"input": "vectors", "input_dim": 1, "max_len": 16})


def test_the_compiled_forward_runs_in_a_gpytorch_module(eager_backend):
    """The Transformer is a ``gpytorch.Module``, whose ``__call__`` calls ``forward`` and never reads
    ``_compiled_call_impl``: ``Module.compile`` compiled nothing there. Dynamo (its eager backend: tracing without code
    generation) now captures the forward pass at the model's call."""
    torch.manual_seed(0)
    model = compile_model(_small_transformer().eval(), "cpu")
    logits = model(torch.randn(3, 16, 1))
    assert logits.shape == (3, 10)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@pytest.fixture
def eager_backend(monkeypatch):
    """``torch.compile`` with dynamo's eager backend (tracing without code generation: seconds, not minutes), from a
    reset dynamo with cleared counters."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, **options: real_compile(function, backend="eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def test_the_hooked_passes_after_training_see_their_hooks(eager_backend):
    """Dynamo does not guard on forward hooks added after a graph was compiled: the Laplace features and the KSVD
    fidelity, whose hooks capture a layer's inputs, ran the compiled evaluation graph and captured nothing. They now
    run the model eagerly, and capture what the eager model gives them."""
    torch.manual_seed(0)
    eager = _small_transformer("primal")
    model = compile_model(_small_transformer("primal"), "cpu")
    model.load_state_dict(eager.state_dict())
    for batch in (8, 5):  # training, then evaluation graphs at the sizes of the passes below
        model.train()
        model(torch.randn(batch, 16, 1)).sum().backward()
        model.eval()
        with torch.no_grad():
            model(torch.randn(9, 16, 1))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    inputs = torch.randn(9, 16, 1)
    features = LastLayerLaplace(model).features(inputs)
    torch.testing.assert_close(features, LastLayerLaplace(eager).features(inputs), rtol=1e-5, atol=1e-6)
    dataset = SimpleNamespace(inputs=inputs, labels=torch.zeros(9, dtype=torch.long))
    fidelity = model_fidelity(model, dataset, 9)
    assert fidelity.keys() == model_fidelity(eager, dataset, 9).keys() == {"layer_1"}


def test_a_compiled_model_trains_on_padded_batches_of_changing_sizes(monkeypatch):
    """Static shapes: with dynamic ones, the second batch size made dynamo trace a symbolic batch, and the backward
    pass of KEP-SVGP's fused scores under a padding mask failed to trace (a batch dimension of 1 against the symbolic
    one). Here every batch compiles (AOT autograd without code generation), and its loss and gradients are those of
    the eager model."""
    real_compile = torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda function, **options: real_compile(function, backend="aot_eager", dynamic=options["dynamic"]),
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    sizes = {"embed_dim": 16, "depth": 1, "num_heads": 2, "vocab_size": 6, "max_len": 6, "num_inducing": 4}
    eager = Transformer(6, attention="kep_svgp", dropout=0.0, **sizes)
    model = compile_model(copy.deepcopy(eager), "cpu")
    generator = torch.Generator().manual_seed(1)
    for batch in (8, 5, 1, 3):
        tokens = torch.randint(0, 6, (batch, 6), generator=generator)
        mask = torch.arange(6) < torch.randint(3, 7, (batch, 1), generator=generator)
        losses, gradients = [], []
        for network in (eager, model):
            network.zero_grad(set_to_none=True)
            torch.manual_seed(2)  # the same joint draws
            layer = next(iter(network.attention_layers()))
            loss = (
                network(tokens, mask=mask).sum()
                + layer.kl_divergence()
                + sum(t.loss() for t in layer.added_loss_terms())
            )
            loss.backward()
            losses.append(loss.detach())
            gradients.append([p.grad for p in network.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for compiled, reference in zip(gradients[1], gradients[0], strict=True):
            torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-5)


def test_past_dynamos_default_limit_a_compiled_model_still_compiles(eager_backend):
    """The models of one process share the compiled forward's cache, and dynamo's default allows 8 graphs per function
    (past it, a model runs eagerly with only a log line): ``compile_model`` raises the limit. Eleven batch sizes with
    static shapes make eleven graphs, every one of them compiled."""
    torch.manual_seed(0)
    model = compile_model(_small_transformer("softmax").eval(), "cpu")
    assert getattr(torch._dynamo.config, recompile_limit_name()) >= RECOMPILE_LIMIT > 11
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False), torch.no_grad():
        for batch in range(1, 12):
            model(torch.randn(batch, 16, 1))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 11


def test_compile_needs_a_torch_that_can_run_compiled_models_eagerly(monkeypatch):
    monkeypatch.setattr(config_module, "SETS_STANCE", False)  # torch 2.1-2.5: no torch.compiler.set_stance
    with pytest.raises(ValueError, match=r"compile=True needs torch 2.6 or later"):
        CompareConfig(compile=True)
    assert CompareConfig(compile=False).compile is False


def test_on_cuda_every_call_returns_copies_of_the_graphs_outputs(monkeypatch):
    """A CUDA graph writes its outputs into the same buffers at every replay: a stand-in compiled function that does
    the same (on CPU) shows that the callers get copies, as Monte Carlo passes kept side by side need."""
    buffer = torch.zeros(2)

    def graph_like(function, **options):
        def replay(*args, **kwargs):
            return {"logits": buffer.copy_(function(*args, **kwargs)), "step": 1}

        return replay

    monkeypatch.setattr(torch, "compile", graph_like)
    model = compile_model(torch.nn.Linear(1, 2, bias=False), "cuda")
    first, second = model(torch.ones(1)), model(2 * torch.ones(1))
    weight = model.weight.detach().view(2)
    torch.testing.assert_close(first["logits"], weight)
    torch.testing.assert_close(second["logits"], 2 * weight)
    assert first["step"] == 1 and first["logits"].data_ptr() != buffer.data_ptr()


def test_the_option_reaches_the_runs(monkeypatch, tmp_path):
    """``--compile`` sets ``CompareConfig.compile`` (a result setting: resume checks it) and each run's model is
    compiled once."""
    seen = {}

    def execute(config, runs, out=None, resume=False, executor=None):
        seen["config"] = config
        raise KeyboardInterrupt  # stop before training: the command reports the interruption

    monkeypatch.setattr(runner_module, "execute_runs", execute)
    status = main(["compare", "--compile", "--quick", "--attentions", "softmax", "--out", str(tmp_path / "run")])
    assert status != 0 and seen["config"].compile is True
    assert "compile" in runner_module.result_settings(seen["config"])
    assert CompareConfig().compile is False


@pytest.mark.slow  # a cold torch.compile of a small model takes a minute or more on 2 cores
@pytest.mark.parametrize("dropout", [False, True])
def test_compiled_model_trains_to_the_eager_numbers(dropout: bool):
    """Three AdamW steps of a small KEP-SVGP Transformer (joint draws, the KSVD penalty, the KL; with and without
    dropout) from the same initialisation and seeds: the compiled model (compiled for real: dynamo captured its graph)
    draws eager's random numbers, and its losses and parameters equal the eager model's up to float32 rounding of
    reordered sums."""
    if dropout and torch.__version__ < (2, 13):  # seen with torch 2.11: its compiled step draws other dropout masks
        pytest.skip(f"torch {torch.__version__}: a compiled step with dropout draws other random numbers than eager")
    tokens = torch.randn(8, 16, 1, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _small_transformer()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) and not dropout:
                module.p = 0.0
        model = compile_model(model, "cpu") if compiled else model
        torch._dynamo.utils.counters.clear()
        # AdamW with an eps of 1e-3: its default of 1e-8 makes a first step divide each gradient by its own magnitude,
        # so that an entry near 1e-8 (2.9e-8 against 3.0e-8, rounding apart) moved its parameter by 0.742 lr against
        # 0.748 lr, beyond any rounding tolerance; plain SGD diverges on this model (the KSVD penalty)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
        losses = []
        torch.manual_seed(3)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            for layer in model.attention_layers():
                loss = loss + 1e-2 * layer.kl_divergence()
                for term in layer.added_loss_terms():
                    loss = loss + term.loss()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        results[compiled] = (torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()})
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1) is compiled  # the compiled one compiled
    (eager_losses, eager_state), (compiled_losses, compiled_state) = results[False], results[True]
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert compiled_state.keys() == eager_state.keys()
    for key, value in eager_state.items():
        torch.testing.assert_close(compiled_state[key], value, rtol=1e-4, atol=1e-5, msg=key)
