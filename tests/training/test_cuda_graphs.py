"""``TrainConfig(cuda_graphs=True)``: the full-size steps' forward and backward passes captured once and replayed
(:mod:`gpattn.training.graphs`).

CI has no GPU: the loop's use of the graph is checked with :class:`~gpattn.training.graphs.EmulatedGraph`, which
captures without consuming random numbers and replays by running the step again into the captured tensors (the
parameters' ``.grad`` attributes left as a CUDA graph's replay leaves them). With it a run must equal the eager run
bit for bit: the static inputs, the loss parts, the gradients pointed back after an eager step of a smaller batch, the
annealed KL weight filled into its tensor. ``benchmarks/gpu_check.py`` runs the real graphs on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.attention import sample_attention
from gpattn.mlls import AttentionELBO
from gpattn.models import mc_dropout as mc_dropout_masks
from gpattn.training import TrainConfig, TrainingDivergedError, train_model
from gpattn.training import graphs as graphs_module
from gpattn.training.graphs import CapturedForward, CapturedStep, EmulatedGraph


@pytest.fixture
def emulated(monkeypatch):
    """Every captured step of the block uses an :class:`EmulatedGraph` (on the CPU); the graphs made are listed."""
    made = []

    def emulated_graph(device):
        def build(parameters, device):
            made.append(EmulatedGraph(parameters, device))
            return made[-1]

        return build

    monkeypatch.setattr(graphs_module, "graph_class", emulated_graph)
    return made


def _without_time(history: list[dict]) -> list[dict]:
    return [{name: value for name, value in entry.items() if name != "seconds"} for entry in history]


def _parameters(model) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


@pytest.mark.parametrize("attention", ["kep_svgp", "softmax"])
def test_an_emulated_graph_trains_as_the_eager_loop(data, small_model, small_config, emulated, attention):
    """Batches of 48 (five full-size steps and one of 16 an epoch: the eager step between replays), the KL weight
    annealed over the first epoch, two epochs: the same history and parameters, bit for bit."""
    settings = dict(batch_size=48, kl_anneal_epochs=1.0)
    eager_model, graphed_model = small_model(attention), small_model(attention)
    eager = train_model(eager_model, data.train, data.val, small_config(**settings))
    graphed = train_model(graphed_model, data.train, data.val, small_config(cuda_graphs=True, **settings))
    assert _without_time(graphed.history) == _without_time(eager.history)
    for value, reference in zip(_parameters(graphed_model), _parameters(eager_model), strict=True):
        assert torch.equal(value, reference)
    (step,) = [graph for graph in emulated if graph.parameters]
    assert step.replays == 2 * 5  # every full-size step of both epochs; the smaller batches ran eagerly
    # the validation's passes (one batch of 64, T = 2 samples for KEP-SVGP, one pass for softmax) from their own graph
    (validation,) = [graph for graph in emulated if not graph.parameters]
    assert validation.replays == 2 * (2 if attention == "kep_svgp" else 1)


def test_without_pointing_the_gradients_back_an_eager_step_would_freeze_them(data, small_model, small_config, emulated):
    """The check above can fail: a loop that left ``.grad`` where the eager step put it would step the parameters
    with that step's gradients after every later replay."""
    original = CapturedStep.__call__

    def forgetful(self, inputs, mask, labels):
        attributes = [parameter.grad for parameter in self.parameters]
        output = original(self, inputs, mask, labels)
        if self.replays_seen > 0:
            for parameter, attribute in zip(self.parameters, attributes, strict=True):
                parameter.grad = attribute
        self.replays_seen += 1
        return output

    CapturedStep.replays_seen = 0
    try:
        CapturedStep.__call__ = forgetful
        eager = train_model(small_model(), data.train, data.val, small_config(batch_size=48))
        graphed = train_model(small_model(), data.train, data.val, small_config(batch_size=48, cuda_graphs=True))
    finally:
        CapturedStep.__call__ = original
        del CapturedStep.replays_seen
    assert _without_time(graphed.history) != _without_time(eager.history)


def test_the_kl_weight_is_one_tensor_filled_before_each_replay(data, small_model, small_config, emulated, monkeypatch):
    """A real graph freezes a Python number read by the step, which the emulated graph reads afresh: the annealed
    weight must be one tensor, filled in place (the same object and memory at every step of the graph), with the
    scheduled value."""
    from gpattn.training import loop as loop_module

    seen = []

    class WatchedELBO(AttentionELBO):
        def forward(self, logits, targets):
            beta = self.beta
            seen.append((id(beta), beta.data_ptr(), float(beta)) if torch.is_tensor(beta) else (None, None, beta))
            return super().forward(logits, targets)

    monkeypatch.setattr(loop_module, "AttentionELBO", WatchedELBO)
    train_model(small_model(), data.train, data.val, small_config(cuda_graphs=True, kl_anneal_epochs=1.0, epochs=1))
    assert len(seen) == 1 + 4  # the emulated capture, then the four steps' replays
    assert len({(identity, pointer) for identity, pointer, _ in seen}) == 1 and seen[0][0] is not None
    assert [value for _, _, value in seen[1:]] == [0.25, 0.5, 0.75, 1.0]  # beta min(1, (t + 1) / 4)


def test_cuda_graphs_need_a_cuda_device(data, small_model, small_config):
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device, got cpu"):
        train_model(small_model(), data.train, data.val, small_config(cuda_graphs=True))


def test_cuda_graphs_refuse_layers_that_read_values(data, small_model, small_config, emulated):
    with pytest.raises(ValueError, match=r"\['SGPAAttention'\] cannot be captured in a CUDA graph"):
        train_model(small_model("sgpa"), data.train, data.val, small_config(cuda_graphs=True))


def test_cuda_graphs_is_a_bool(small_config):
    with pytest.raises(ValueError, match="expected cuda_graphs to be True or False"):
        TrainConfig(cuda_graphs="yes")
    # NumPy's bools are flags, kept as Python's (np.True_ was refused: "expected ... to be a bool")
    config = TrainConfig(progress=np.False_, mc_dropout=np.True_)
    assert config.progress is False and config.mc_dropout is True


def test_a_non_finite_replayed_loss_stops_before_the_optimiser_step(
    data, small_model, small_config, emulated, faulty_elbo
):
    """The loss parts are read after the replay and before the optimiser step: a NaN loss (the fifth call of the
    loss: the emulated capture's call, then the replays of the first epoch's steps) stops the run with the state of
    the best epoch."""
    faulty_elbo.fail_at = 5
    model = small_model()
    initial = _parameters(model)
    with pytest.raises(TrainingDivergedError, match=r"non-finite training loss at epoch 1, step 4/4"):
        train_model(model, data.train, data.val, small_config(cuda_graphs=True))
    for value, reference in zip(_parameters(model), initial, strict=True):
        assert torch.equal(value, reference)  # no epoch was completed: the initial state


def test_a_captured_step_refuses_another_batch_shape():
    weight = torch.nn.Parameter(torch.ones(3))
    step = CapturedStep(lambda x, mask, y: (x * weight).sum()[None], [weight], torch.device("cpu"), graph=EmulatedGraph)
    step(torch.ones(2, 3), None, torch.zeros(2))
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"captured for inputs \(2, 3\) without a mask, got inputs \(4, 3\)"):
        step(torch.ones(4, 3), None, torch.zeros(4))
    with pytest.raises(ValueError, match=r"got inputs \(2, 3\) with a mask"):
        step(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2))


def test_the_elbo_and_the_model_check_their_indices_on_the_device_while_captured(monkeypatch, small_model):
    """No read while a CUDA graph is captured: the targets' range, and the model's token ids', become asynchronous
    assertions (on a CPU they raise at once, on a GPU at the replay)."""
    model = small_model()
    loss = AttentionELBO(model, num_data=10)
    tokens = torch.randint(0, 6, (3, 6))
    logits = model(tokens)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read while captured"))
    assert torch.isfinite(loss(logits, torch.tensor([0, 1, 1])))
    with pytest.raises(RuntimeError, match=r"expected targets in \[0, 1\]"):
        loss(logits, torch.tensor([0, 2, 1]))
    with pytest.raises(RuntimeError, match=r"Transformer: token ids must lie in \[0, 6\)"):
        model(torch.tensor([[0, 1, 2, 3, 4, 6]]))  # an id past the vocabulary, checked on the device


def _model_step(model, loss, inputs, mask, labels) -> list[torch.Tensor]:
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    parts = loss(model(inputs.double() if inputs.is_floating_point() else inputs, mask=mask), labels)
    parts["loss"].backward()
    return [parts["loss"].detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


def _evaluation_pass(model, inputs, mask, mc_dropout: bool) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad(), sample_attention(model), mc_dropout_masks(model, enabled=mc_dropout):
            torch.manual_seed(1)
            return model(inputs.double() if inputs.is_floating_point() else inputs, mask=mask)
    finally:
        model.train()


@pytest.mark.parametrize("task", ["pointer", "digits", "mnist1d"])
def test_the_comparison_models_train_without_a_read_while_captured(simulated_capture, counted_reads, task):
    """The models of ``gpattn compare --cuda-graphs`` (each task's input kind, every default row whose layers capture):
    a training step's forward pass, loss and backward pass, and an evaluation pass (eval mode, samples or dropout
    masks drawn, no gradients), read no value on the host while captured (the token ids' range and the targets'
    checked on the device) and compute the uncaptured ones."""
    from gpattn.comparison import CompareConfig, load_task
    from gpattn.comparison.runs import build_model
    from gpattn.methods import get_method
    from gpattn.training import dataset_inputs, dataset_labels

    data = load_task(task, 0)
    inputs, mask = dataset_inputs(data.train)
    inputs, mask, labels = inputs[:8], None if mask is None else mask[:8], dataset_labels(data.train)[:8]
    config = CompareConfig(tuned=False)
    rows = [row for row in config.attentions if row != "sgpa"]
    assert rows == ["kep_svgp", "softmax", "softmax_mc_dropout", "primal"]
    for row in rows:
        method = get_method(row)
        hyperparameters = config.hyperparameters(task, method, data.defaults)
        torch.manual_seed(0)
        model = build_model(method, hyperparameters, data.num_classes, data.model_kwargs).double().train()
        assert graphs_module.capture_refusals(model) == []
        loss = AttentionELBO(model, num_data=100, combine_terms=False)

        expected = _model_step(model, loss, inputs, mask, labels)
        with simulated_capture(), counted_reads() as reads:
            captured = _model_step(model, loss, inputs, mask, labels)
        assert reads == [], (task, row, reads)
        for value, reference in zip(captured, expected, strict=True):
            torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)
        # the evaluation's Monte Carlo pass (CapturedForward): eval mode, samples drawn, no gradients
        mc_dropout = method.predictive.mc_dropout
        expected = _evaluation_pass(model, inputs, mask, mc_dropout)
        with simulated_capture(), counted_reads() as reads:
            captured = _evaluation_pass(model, inputs, mask, mc_dropout)
        assert reads == [], (task, row, "evaluation", reads)
        torch.testing.assert_close(captured, expected, rtol=1e-12, atol=1e-12)


def test_compare_refuses_cuda_graphs_without_cuda_or_with_compile(monkeypatch):
    from gpattn.comparison import CompareConfig
    from gpattn.comparison import config as config_module

    with pytest.raises(ValueError, match=r"cuda_graphs=True needs device='cuda', got 'cpu'"):
        CompareConfig(cuda_graphs=True)
    monkeypatch.setattr(config_module, "check_device", lambda *args, **kwargs: None)  # no GPU here: accept "cuda"
    assert CompareConfig(cuda_graphs=True, device="cuda").cuda_graphs
    with pytest.raises(ValueError, match="choose compile=True or cuda_graphs=True, not both"):
        CompareConfig(cuda_graphs=True, compile=True, device="cuda")


# -- the evaluation's passes -----------------------------------------------------------------------------------------
def _emulated_forward(model, **kwargs) -> CapturedForward:
    return CapturedForward(model, torch.device("cpu"), graph=EmulatedGraph, **kwargs)


def test_a_captured_forward_gives_the_model_s_monte_carlo_logits(small_model):
    """``monte_carlo_logits`` through the wrapper, batches of 5 over 12 sequences (two signatures: 5 and the last 2),
    equals the model's, bit for bit; each pass returns its own tensor (the graph's output is copied out)."""
    from gpattn.models import monte_carlo_logits

    model = small_model()
    tokens = torch.randint(0, 6, (12, 6), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    expected = monte_carlo_logits(model, tokens, num_samples=4, batch_size=5)
    captured = _emulated_forward(model)
    torch.manual_seed(3)
    value = monte_carlo_logits(captured, tokens, num_samples=4, batch_size=5)
    assert torch.equal(value, expected)
    assert not torch.equal(value[0], value[1])  # fresh draws at every replay, not one output repeated
    assert len(captured.graphs) == 2
    assert sorted(graph.replays for graph, *_ in captured.graphs.values()) == [4, 2 * 4]
    assert model.training  # the modes restored through the wrapper


def test_a_captured_forward_runs_other_calls_eagerly(small_model):
    """With gradients on, or in training mode, or called otherwise than ``(inputs)`` / ``(inputs, mask=mask)``, the
    wrapper is the model (nothing captured); a new mode of the modules (the samples switched off) is a new signature,
    not a replay of the sampled graph."""
    from gpattn.attention import sample_attention

    model = small_model()
    captured = _emulated_forward(model)
    tokens = torch.randint(0, 6, (3, 6))
    torch.manual_seed(0)
    expected = model(tokens)
    torch.manual_seed(0)
    logits = captured(tokens)  # training mode, gradients on
    assert torch.equal(logits, expected) and logits.requires_grad
    assert captured.graphs == {}
    captured.eval()
    with torch.no_grad():
        deterministic = captured(tokens)  # eval mode without sampling: the posterior mean
        with sample_attention(captured):
            captured(tokens)
        assert torch.equal(captured(tokens), deterministic)
        assert torch.equal(deterministic, model(tokens))
        assert len(captured.graphs) == 2
        assert torch.equal(captured(tokens, None), deterministic)  # a call of another form: eager
    assert len(captured.graphs) == 2


def test_a_captured_forward_whose_capture_fails_warns_and_runs_eagerly(small_model):
    class Mapping(torch.nn.Module):  # an output the graph cannot hold
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def forward(self, inputs, mask=None):
            return {"logits": self.inner(inputs, mask=mask)}

    model = Mapping(small_model()).eval()
    captured = _emulated_forward(model)
    tokens = torch.randint(0, 6, (3, 6))
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"cannot be captured .*expected the model to return a tensor"):
            first = captured(tokens)
        second = captured(tokens)  # no second warning, no second attempt
    assert torch.equal(first["logits"], second["logits"])
    assert list(captured.graphs.values()) == [None]


def test_a_comparison_run_with_graphs_evaluates_as_the_eager_run(monkeypatch, emulated):
    """``gpattn compare --cuda-graphs``'s run (``train_and_evaluate``) with emulated graphs: the training steps, the
    validation and the final evaluation (the test set, and the validation set for temperature scaling) replayed, the
    record equal to the eager run's, for a GP row and the MC-dropout row; SGPA's run is refused the graphs and trains
    and evaluates eagerly."""
    import dataclasses

    from gpattn.comparison import CompareConfig, load_task
    from gpattn.comparison import runs as runs_module

    data = load_task("pointer", 0)
    eager_config = CompareConfig.quick(pointer_epochs=1, eval_samples=2, fidelity_sequences=0)
    graphed_config = dataclasses.replace(eager_config)
    object.__setattr__(graphed_config, "cuda_graphs", True)  # on the CPU: past CompareConfig's device check
    for row in ("kep_svgp", "softmax_mc_dropout", "sgpa"):
        emulated.clear()
        eager = runs_module.train_and_evaluate(eager_config, "pointer", row, 0, data)
        assert emulated == []
        graphed = runs_module.train_and_evaluate(graphed_config, "pointer", row, 0, data)
        assert graphed.metrics == eager.metrics and graphed.temperature_scaled == eager.temperature_scaled, row
        assert graphed.per_example == eager.per_example, row
        forward_graphs = [graph for graph in emulated if not graph.parameters]
        assert not eager.train.cuda_graphs and graphed.train.cuda_graphs is (row != "sgpa"), row  # said as it ran
        if row == "sgpa":
            assert emulated == []
        else:
            # the validation after the one epoch (one batch of 256, T = 2) and the final evaluation: the test set's
            # two batches and the validation set's one (temperature scaling), T = 2 each, all of 256 sequences
            assert [graph.replays for graph in forward_graphs] == [2, (2 + 1) * 2], row


def test_a_captured_forward_captures_again_when_the_parameters_move(small_model):
    """The graphs read the parameters' memory: ``load_state_dict(..., assign=True)`` puts new tensors in their place,
    so every graph is dropped and the next pass captures again (a wrapper that replayed the old graphs would give the
    old parameters' logits)."""
    model = small_model().eval()
    captured = _emulated_forward(model)
    tokens = torch.randint(0, 6, (3, 6))
    with torch.no_grad():
        before = captured(tokens)
        (old_graph,) = captured.graphs.values()
        state = {
            name: value + 0.25 if value.is_floating_point() else value for name, value in model.state_dict().items()
        }
        model.load_state_dict(state, assign=True)
        after = captured(tokens)
        assert torch.equal(after, model(tokens)) and not torch.equal(after, before)
        (new_graph,) = captured.graphs.values()
        assert new_graph is not old_graph
        model.load_state_dict(model.state_dict())  # in place: the graph stays
        captured(tokens)
        assert next(iter(captured.graphs.values())) is new_graph
    captured.release()
    assert captured.graphs == {}


def _failing_graph(error: BaseException) -> type:
    """A graph class whose capture raises ``error``."""

    class FailingGraph:
        def __init__(self, parameters, device):
            pass

        def capture(self, function, warmup, check_syncs=False):
            raise error

    return FailingGraph


@pytest.mark.parametrize(
    "error",
    [
        graphs_module.GraphCaptureError("the capture of a CUDA graph failed"),
        torch.OutOfMemoryError("CUDA out of memory"),
    ],
)
def test_a_failed_capture_and_a_lack_of_memory_are_raised_not_run_eagerly(small_model, error):
    # after a capture that failed inside torch.cuda.graph the process's CUDA state may be unusable, and an eager pass
    # would run out of memory too: neither is hidden behind the eager fallback
    captured = CapturedForward(small_model().eval(), torch.device("cpu"), graph=_failing_graph(error))
    with torch.no_grad(), pytest.raises(type(error), match=str(error)):
        captured(torch.randint(0, 6, (3, 6)))


def test_a_failed_warm_up_runs_eagerly(small_model):
    model = small_model().eval()
    failing = _failing_graph(RuntimeError("synchronizing operation in the rehearsal"))
    captured = CapturedForward(model, torch.device("cpu"), graph=failing)
    tokens = torch.randint(0, 6, (3, 6))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="synchronizing operation in the rehearsal"):
        assert torch.equal(captured(tokens), model(tokens))
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"on inputs \(3, 6\) with the mask 'causal' cannot"):
        captured(tokens, mask="causal")
