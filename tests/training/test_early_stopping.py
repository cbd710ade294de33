"""Early stopping of the training loop (``TrainConfig.patience``): it stops after the patience, keeps the best state,
and a resumed run stops where the uninterrupted one did, bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import gpattn.training.loop as loop_module
from gpattn.training import Callback, CheckpointError, TrainConfig, train_model

#: scripted validation NLLs by epoch (from 1): the best is epoch 2, epochs 3-5 do not improve on it, epoch 6 would
SCRIPT = [1.0, 0.8, 0.9, 0.8, 0.95, 0.5, 0.4, 0.3]


@pytest.fixture
def scripted_nll(monkeypatch):
    """Replace the loop's validation metrics by :data:`SCRIPT` (accuracy 0.5), one value per call."""
    calls = []

    def scripted(probabilities, labels):
        calls.append(None)
        return 0.5, SCRIPT[len(calls) - 1]

    monkeypatch.setattr(loop_module, "validation_metrics", scripted)
    return calls


def _same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    one, two = first.state_dict(), second.state_dict()
    return one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)


def _without_time(history):
    return [{key: value for key, value in entry.items() if key != "seconds"} for entry in history]


def test_patience_must_be_a_positive_integer(small_config):
    for patience in (0, -1, 1.5):
        with pytest.raises(ValueError, match="patience"):
            small_config(patience=patience)
    assert small_config(patience=3).patience == 3 and TrainConfig().patience is None


def test_training_stops_after_the_patience_with_the_best_state(data, small_model, small_config, scripted_nll):
    model = small_model(attention="softmax")
    reference = copy.deepcopy(model)
    result = train_model(model, data.train, data.val, small_config(epochs=8, patience=3))
    # epoch 5 is the third without improving on epoch 2 (0.8; the tie of epoch 4 is no improvement)
    assert [entry["epoch"] for entry in result.history] == [1, 2, 3, 4, 5]
    assert (result.best_epoch, result.best_val_nll) == (2, 0.8)
    # the model holds the state after epoch 2 of the same schedule (8 epochs): that of a run of 2 epochs of it
    scripted_nll.clear()
    train_model(reference, data.train, data.val, small_config(epochs=2, schedule_epochs=8))
    assert _same_parameters(model, reference)


def test_a_patience_longer_than_the_run_trains_every_epoch(data, small_model, small_config, scripted_nll):
    result = train_model(small_model(attention="softmax"), data.train, data.val, small_config(epochs=6, patience=4))
    assert len(result.history) == 6 and result.best_epoch == 6


def test_a_resumed_run_stops_where_the_uninterrupted_one_did(
    data, tmp_path, small_model, small_config, scripted_nll, faulty_elbo
):
    reference = small_model(attention="softmax")
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, small_config(epochs=8, patience=3))

    scripted_nll.clear()
    config = small_config(epochs=8, patience=3, checkpoint_dir=tmp_path)
    faulty_elbo.interrupt_at = 14  # 4 steps an epoch: during epoch 4
    with pytest.raises(KeyboardInterrupt):
        train_model(interrupted, data.train, data.val, config)
    faulty_elbo.interrupt_at = None
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 3
    resumed = train_model(interrupted, data.train, data.val, config, resume=True)
    assert _without_time(resumed.history) == _without_time(full.history)
    assert _same_parameters(interrupted, reference)

    # resuming the stopped run trains nothing more, and restores the best state
    again = small_model(attention="softmax", seed=1)
    calls = len(scripted_nll)
    repeated = train_model(again, data.train, data.val, config, resume=True)
    assert len(scripted_nll) == calls, "a stopped run was trained further"
    assert _without_time(repeated.history) == _without_time(full.history)
    assert _same_parameters(again, reference)


def test_mc_dropout_validation_selects_on_the_mc_dropout_predictive(data, small_config):
    """``mc_dropout=True``: the same training (an epoch's loss is computed before its validation) and another
    validation NLL, the MC-dropout predictive's; resuming a checkpoint written before the setting existed works for
    ``mc_dropout=False`` only."""
    from gpattn.models import Transformer
    from gpattn.training.checkpoints import check_resumable

    def model() -> Transformer:
        torch.manual_seed(0)
        return Transformer(2, embed_dim=16, depth=1, num_heads=2, attention="softmax", vocab_size=6, max_len=6,
                           dropout=0.3)  # fmt: skip

    plain = train_model(model(), data.train, data.val, small_config(epochs=1, eval_samples=4))
    dropout = train_model(model(), data.train, data.val, small_config(epochs=1, eval_samples=4, mc_dropout=True))
    assert plain.history[0]["loss"] == dropout.history[0]["loss"]
    assert abs(plain.history[0]["val_nll"] - dropout.history[0]["val_nll"]) > 1e-4
    with pytest.raises(ValueError, match="mc_dropout to be True or False"):
        small_config(mc_dropout="yes")

    older = small_config().to_dict()
    del older["mc_dropout"]
    assert check_resumable(older, small_config().to_dict(), 1, Path("last.pt")) == []
    with pytest.raises(CheckpointError, match="mc_dropout"):
        check_resumable(older, small_config(mc_dropout=True).to_dict(), 1, Path("last.pt"))


def test_mc_dropout_validation_of_a_model_without_dropout_is_refused_before_training(data, small_model, small_config):
    # was a ValueError of the first validation, after a whole epoch had trained the model (left in training mode, no
    # checkpoint written)
    model = small_model("softmax")
    before = copy.deepcopy(model.state_dict())
    steps = []

    class Steps(Callback):
        def on_step_end(self, context, epoch, step, values):
            steps.append(step)

    with pytest.raises(ValueError, match=r"^train_model: TrainConfig\(mc_dropout=True\) .*no dropout module"):
        train_model(model, data.train, data.val, small_config(mc_dropout=True), callbacks=[Steps()])
    assert steps == []
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
