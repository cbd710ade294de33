"""The training loop at its edges: one AdamW step against a hand-written one, the history against the steps that ran
(a last batch smaller than the others, the scheduled rates, the annealed KL weight), a validation set of one example,
a resume crossing the KL warm-up, early stopping and clipping in float64, a resume with emulated CUDA graphs, a
checkpoint of the oldest format (no manifest, no ``prior`` in its history, no later settings), callbacks that raise at
the end, and a float16 model (:mod:`gpattn.training`).

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gpattn.data import make_pointer_task
from gpattn.mlls import AttentionELBO
from gpattn.models import Transformer
from gpattn.training import (
    Callback,
    CheckpointError,
    TrainConfig,
    load_checkpoint,
    train_model,
    warmup_cosine_lr,
)
from gpattn.training import graphs as graphs_module
from gpattn.training.checkpoint_files import MANIFEST, content_checksum
from gpattn.training.graphs import EmulatedGraph

#: 70 training sequences: in batches of 32, three steps an epoch, the last of 6 sequences
NUM_TRAIN, BATCH = 70, 32


@pytest.fixture(scope="module")
def data():
    """70 / 5 / 1 pointer sequences of length 6 (vocabulary 6)."""
    return make_pointer_task(NUM_TRAIN, 5, 1, length=6, seed=0, vocab_size=6)


def _model(dtype: torch.dtype = torch.float32, attention: str = "kep_svgp", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    sizes = {"num_inducing": 3} if attention == "kep_svgp" else {}
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention=attention, vocab_size=6, max_len=6, **sizes)
    return model.to(dtype)


def _config(**overrides) -> TrainConfig:
    settings = {"epochs": 2, "batch_size": BATCH, "lr": 1e-2, "eval_samples": 1, "progress": False}
    return TrainConfig(**{**settings, **overrides})


def _without_time(history: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if key != "seconds"} for record in history]


def _same_state(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    one, two = first.state_dict(), second.state_dict()
    return one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)


class _Steps(Callback):
    """Records every step's values and every hook's name."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, dict]] = []
        self.hooks: list[str] = []
        self.errors: list[BaseException] = []

    def on_train_begin(self, context) -> None:
        self.hooks.append("train_begin")

    def on_step_end(self, context, epoch, step, values) -> None:
        self.steps.append((epoch, step, dict(values)))

    def on_train_end(self, context) -> None:
        self.hooks.append("train_end")

    def on_exception(self, context, error) -> None:
        self.errors.append(error)


class _Interrupt(Exception):
    pass


class _InterruptAtStep(Callback):
    """Raises :class:`_Interrupt` at the end of the ``at``-th optimiser step of the run (from 1)."""

    def __init__(self, at: int) -> None:
        self.at, self.count = at, 0

    def on_step_end(self, context, epoch, step, values) -> None:
        self.count += 1
        if self.count == self.at:
            raise _Interrupt


# -- one step against a hand-written AdamW step ------------------------------------------------------------------------
def test_one_step_equals_a_hand_written_clipped_adamw_step_in_float64(data):
    # One epoch of one step (batch 128 > 70 sequences), no warm-up: the step uses the peak rate. The loop seeds the
    # global RNG with the seed (the ELBO's draws) and the batch order with a generator of the same seed; AdamW's first
    # step with bias correction is p <- p (1 - lr wd) - lr g / (|g| + eps) for the clipped gradient g. The best (and
    # only) epoch is the stepped state.
    lr, weight_decay, clip, seed = 0.05, 0.1, 0.01, 7
    model = _model(torch.float64)
    reference = copy.deepcopy(model)
    config = _config(
        epochs=1, batch_size=128, lr=lr, weight_decay=weight_decay, warmup_steps=0, grad_clip=clip, seed=seed
    )
    result = train_model(model, data.train, data.val, config)

    torch.manual_seed(seed)
    order = torch.randperm(NUM_TRAIN, generator=torch.Generator().manual_seed(seed))
    reference.train()
    assert data.train.mask is None  # sequences of one length
    logits = reference(data.train.tokens[order], mask=None)
    loss = AttentionELBO(reference, num_data=NUM_TRAIN)(logits, data.train.labels[order])
    parameters = list(reference.parameters())
    gradients = torch.autograd.grad(loss, parameters)
    norm = float(torch.linalg.vector_norm(torch.cat([gradient.reshape(-1) for gradient in gradients])))
    scale = min(1.0, clip / (norm + 1e-6))  # torch's clip_grad_norm_ coefficient
    assert scale < 0.01  # the clipping is active
    with torch.no_grad():
        for parameter, gradient in zip(parameters, gradients, strict=True):
            clipped = gradient * scale
            parameter.mul_(1 - lr * weight_decay).sub_(lr * clipped / (clipped.abs() + 1e-8))

    record = result.history[0]
    assert record["loss"] == pytest.approx(float(loss), rel=1e-14)
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-12)  # before clipping
    assert record["lr"] == lr
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-14, msg=name)


# -- the history against the steps that ran --------------------------------------------------------------------------
def test_the_history_is_the_batch_weighted_mean_of_the_steps_with_the_scheduled_rates(data):
    # three steps an epoch of 32, 32 and 6 sequences; warm-up one epoch (3 steps) of a 2-epoch cosine; KL annealed over
    # the first epoch (A = 3): beta_t = (t + 1) / 3
    steps = _Steps()
    lr = 1e-3
    result = train_model(
        _model(torch.float64), data.train, data.val, _config(lr=lr, kl_anneal_epochs=1.0), callbacks=[steps]
    )
    assert [(epoch, step) for epoch, step, _ in steps.steps] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    sizes = [32, 32, 6]
    for index, record in enumerate(result.history):
        values = [step[2] for step in steps.steps[3 * index : 3 * index + 3]]
        for name in ("loss", "nll", "kl", "ksvd", "prior", "grad_norm"):
            mean = math.fsum(value[name] * size for value, size in zip(values, sizes, strict=True)) / NUM_TRAIN
            assert record[name] == pytest.approx(mean, rel=1e-14, abs=1e-300), (index, name)
        assert record["lr"] == values[-1]["lr"]
        for value in values:
            assert value["loss"] == pytest.approx(value["nll"] + value["kl"] + value["ksvd"] + value["prior"], 1e-14)
    # the rates by the closed form of the schedule (W = 3, S = 6), independent of the LambdaLR
    expected = [lr * (t + 1) / 4 for t in range(3)] + [lr * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)]
    assert [step[2]["lr"] for step in steps.steps] == pytest.approx(expected, rel=1e-15)
    assert expected == pytest.approx([warmup_cosine_lr(t, 6, 3, lr) for t in range(6)], rel=1e-15)
    # the annealed KL: the first epoch's KL terms at weights 1/3, 2/3 (same order of magnitude as the third's at 1)
    first, second, third = (steps.steps[t][2]["kl"] for t in range(3))
    assert 2.5 < third / first < 3.5 and 1.2 < third / second < 1.8


def test_a_validation_set_of_one_example_records_its_nll(data):
    # softmax attention predicts deterministically in eval mode: the recorded validation NLL of the best epoch is
    # -log p(y | x) of the returned (best) model, by torch.log_softmax in float64
    model = _model(torch.float64, attention="softmax")
    result = train_model(model, data.train, data.test, _config(epochs=3, lr=3e-2))
    assert len(result.history) == 3 and data.test.labels.shape == (1,)
    record = result.history[result.best_epoch - 1]
    with torch.no_grad():
        log_p = torch.log_softmax(model(data.test.tokens, mask=None), dim=-1)[0, data.test.labels[0]]
    assert record["val_nll"] == pytest.approx(-float(log_p), rel=1e-12)
    assert record["val_accuracy"] == float(log_p > math.log(0.5))
    assert result.best_val_nll == min(entry["val_nll"] for entry in result.history)


# -- resume --------------------------------------------------------------------------------------------------------
def test_a_float64_resume_across_the_kl_warm_up_with_clipping_and_patience_is_bit_exact(data, tmp_path):
    # 3 steps an epoch (the last of 6 sequences), warm-up of 3 steps, KL annealed over 5 steps (1.5 epochs), clipping
    # active, floor min_lr, early stopping: the run stopped at the end of step 5 (inside the KL warm-up, epoch 2)
    # resumes from epoch 1 to the uninterrupted run's history, best epoch and best parameters
    settings = dict(
        epochs=4, lr=2e-2, warmup_steps=3, kl_anneal_epochs=1.5, grad_clip=0.05, patience=2, min_lr=1e-3, seed=3
    )
    reference = _model(torch.float64)
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, _config(**settings, checkpoint_dir=tmp_path / "full"))
    assert all(record["grad_norm"] > 0.05 for record in full.history)  # clipping changed every epoch's steps

    config = _config(**settings, checkpoint_dir=tmp_path / "stopped")
    with pytest.raises(_Interrupt):
        train_model(interrupted, data.train, data.val, config, callbacks=[_InterruptAtStep(5)])
    assert load_checkpoint(tmp_path / "stopped" / "last.pt")["epoch"] == 1
    resumed = train_model(interrupted, data.train, data.val, config, resume=True)
    assert _without_time(resumed.history) == _without_time(full.history)
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    assert _same_state(interrupted, reference)
    last = [load_checkpoint(tmp_path / run / "last.pt") for run in ("full", "stopped")]
    assert last[0]["scheduler"]["last_epoch"] == last[1]["scheduler"]["last_epoch"] == 3 * len(full.history)
    assert all(torch.equal(last[0]["rng"][key], last[1]["rng"][key]) for key in ("torch", "batch_generator"))


def test_a_resume_with_emulated_cuda_graphs_is_bit_exact(data, tmp_path, monkeypatch):
    # the captured step (emulated on the CPU) with the KL weight as a tensor filled before each replay, across an
    # interruption inside the KL warm-up: the same history and parameters as the uninterrupted graphed run
    monkeypatch.setattr(graphs_module, "graph_class", lambda device: lambda parameters, d: EmulatedGraph(parameters, d))
    settings = dict(epochs=3, cuda_graphs=True, kl_anneal_epochs=1.5, eval_samples=2)
    reference = _model()
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, _config(**settings, checkpoint_dir=tmp_path / "full"))
    config = _config(**settings, checkpoint_dir=tmp_path / "stopped")
    with pytest.raises(_Interrupt):
        train_model(interrupted, data.train, data.val, config, callbacks=[_InterruptAtStep(5)])
    resumed = train_model(interrupted, data.train, data.val, config, resume=True)
    assert _without_time(resumed.history) == _without_time(full.history)
    assert _same_state(interrupted, reference)


def test_a_checkpoint_of_the_oldest_format_resumes_and_continues_bit_exactly(data, tmp_path):
    # A folder as the first versions wrote it: no manifest, histories without "prior", settings without patience,
    # mc_dropout, cuda_graphs, threads, num_data, num_val and the model description. Written by a staged run (2 of 3
    # epochs of one schedule), it resumes to epoch 3 as the uninterrupted 3-epoch run, with the old epochs as stored.
    reference = _model()
    staged = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, _config(epochs=3))
    new = tmp_path / "new"
    train_model(staged, data.train, data.val, _config(epochs=2, schedule_epochs=3, checkpoint_dir=new))
    old = tmp_path / "old"
    old.mkdir()
    later = ("patience", "mc_dropout", "cuda_graphs", "threads", "num_data", "num_val", "model")
    for name in ("last.pt", "best.pt"):
        if not (new / name).exists():
            continue
        checkpoint = torch.load(new / name, weights_only=True)
        checkpoint["history"] = [{k: v for k, v in record.items() if k != "prior"} for record in checkpoint["history"]]
        checkpoint["config"] = {k: v for k, v in checkpoint["config"].items() if k not in later}
        del checkpoint["checksum"]
        checkpoint["checksum"] = content_checksum(checkpoint)
        torch.save(checkpoint, old / name)
    assert not (old / MANIFEST).exists()

    begun = _Steps()
    resumed = train_model(
        _model(seed=5), data.train, data.val, _config(epochs=3, checkpoint_dir=old), True, callbacks=[begun]
    )
    expected = _without_time(full.history)
    assert [sorted(record) for record in resumed.history[:2]] == [sorted({*expected[0], "seconds"} - {"prior"})] * 2
    assert _without_time(resumed.history)[2] == expected[2]
    for stored, record in zip(resumed.history[:2], expected[:2], strict=True):
        assert {k: v for k, v in stored.items() if k != "seconds"} == {k: v for k, v in record.items() if k != "prior"}
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    assert [step[:2] for step in begun.steps] == [(3, 1), (3, 2), (3, 3)]
    # the new pair is committed by a manifest and reads back
    assert load_checkpoint(old / "last.pt")["epoch"] == 3 and (old / MANIFEST).exists()


# -- callbacks -------------------------------------------------------------------------------------------------------
class _RaiseAtTrainEnd(Callback):
    def on_train_end(self, context) -> None:
        raise RuntimeError("cannot write the report")


def test_a_callback_raising_at_train_end_tells_every_callback(data):
    watcher = _Steps()
    with pytest.raises(RuntimeError, match="cannot write the report"):
        train_model(_model(), data.train, data.val, _config(epochs=1), callbacks=[_RaiseAtTrainEnd(), watcher])
    assert len(watcher.errors) == 1 and isinstance(watcher.errors[0], RuntimeError)


# -- float16 ---------------------------------------------------------------------------------------------------------
def test_a_float16_model_is_refused_before_training(data):
    """AdamW's eps = 1e-8 is 0 in float16, so a float16 model diverged at step one whatever the learning rate (0/0 for
    a zero gradient entry) and the message advised a lower one; it is refused before anything trains, naming the
    parameters, and left as it was."""
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0.0  # the cause
    model = _model(torch.float16, attention="softmax")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"train_model: the model has float16 parameters \(position_embedding, "):
        train_model(model, data.train, data.val, _config(epochs=1, batch_size=128, lr=1e-7, grad_clip=1e-3))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert model.training  # not switched to eval by a run that never started


def test_a_missing_best_checkpoint_is_a_checkpoint_error_and_leaves_the_model(data, tmp_path):
    """``last.pt`` that records a best epoch without its pair ``best.pt`` is a damaged folder (a CheckpointError,
    as train_model documents for a checkpoint that does not pair with best.pt), not the FileNotFoundError of a
    fresh start without ``last.pt``; the model is left untouched."""
    config = _config(epochs=2, checkpoint_dir=tmp_path)
    train_model(_model(), data.train, data.val, _config(epochs=1, checkpoint_dir=tmp_path))
    (tmp_path / "best.pt").unlink()
    model = _model(seed=3)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=r"records a best epoch \(1\) but its pair .*best\.pt is missing"):
        train_model(model, data.train, data.val, config, resume=True)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_a_frozen_float16_part_does_not_stop_training(data):
    """Only the trained parameters must not be float16 (AdamW never steps a frozen one): a model with a frozen float16
    parameter trains."""
    model = _model(attention="softmax")
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(3, dtype=torch.float16), requires_grad=False))
    result = train_model(model, data.train, data.val, _config(epochs=1))
    assert len(result.history) == 1 and math.isfinite(result.history[0]["loss"])
    assert torch.equal(model.frozen, torch.zeros(3, dtype=torch.float16))
