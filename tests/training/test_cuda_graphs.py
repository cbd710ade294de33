"""``TrainConfig(cuda_graphs=True)``: the full-size steps' forward and backward passes captured once and replayed
(:mod:`gpattn.training.graphs`).

CI has no GPU: the loop's use of the graph is checked with :class:`~gpattn.training.graphs.EmulatedGraph`, which
captures without consuming random numbers and replays by running the step again into the captured tensors (the
parameters' ``.grad`` attributes left as a CUDA graph's replay leaves them). With it a run must equal the eager run
bit for bit: the static inputs, the loss parts, the gradients pointed back after an eager step of a smaller batch, the
annealed KL weight filled into its tensor. ``benchmarks/gpu_check.py`` runs the real graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from gpattn.mlls import AttentionELBO
from gpattn.training import TrainConfig, TrainingDivergedError, train_model
from gpattn.training import graphs as graphs_module
from gpattn.training.graphs import CapturedStep, EmulatedGraph


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
    (graph,) = emulated
    assert graph.replays == 2 * 5  # every full-size step of both epochs; the smaller batches ran eagerly


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
    with pytest.raises(ValueError, match="expected cuda_graphs to be a bool"):
        TrainConfig(cuda_graphs="yes")


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


def _counting(reads: list[str], name: str, original):
    def read(self, *args):
        reads.append(name)
        return original(self, *args)

    return read


@pytest.mark.parametrize("task", ["pointer", "digits", "mnist1d"])
def test_the_comparison_models_train_without_a_read_while_captured(monkeypatch, task):
    """The models of ``gpattn compare --cuda-graphs`` (each task's input kind, every default row whose layers capture):
    a training step's forward pass, loss and backward pass read no value on the host while captured (the token ids'
    range and the targets' checked on the device) and compute the uncaptured step."""
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
        reads: list[str] = []
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda, "is_initialized", lambda: True)
            patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                original = getattr(torch.Tensor, name)
                patch.setattr(torch.Tensor, name, _counting(reads, name, original))
            captured = _model_step(model, loss, inputs, mask, labels)
        assert reads == [], (task, row, reads)
        for value, reference in zip(captured, expected, strict=True):
            torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-12)


def test_compare_refuses_cuda_graphs_without_cuda_or_with_compile(monkeypatch):
    from gpattn.comparison import CompareConfig
    from gpattn.comparison import config as config_module

    with pytest.raises(ValueError, match=r"cuda_graphs=True needs device='cuda', got 'cpu'"):
        CompareConfig(cuda_graphs=True)
    monkeypatch.setattr(config_module, "check_device", lambda *args, **kwargs: None)  # no GPU here: accept "cuda"
    assert CompareConfig(cuda_graphs=True, device="cuda").cuda_graphs
    with pytest.raises(ValueError, match="choose compile=True or cuda_graphs=True, not both"):
        CompareConfig(cuda_graphs=True, compile=True, device="cuda")
