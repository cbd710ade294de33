"""State: a trained Transformer survives ``state_dict`` and whole-model ``torch.save`` round trips with identical
predictions, Monte Carlo evaluation is a function of the seed, and an interrupted run resumes bit for bit on the CPU,
for every registered attention."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor

from gpattn.attention import ATTENTIONS, attention_names
from gpattn.data import make_pointer_task
from gpattn.experiments import TrainConfig, load_checkpoint, train_model
from gpattn.mlls import AttentionELBO
from gpattn.models import predict_probabilities

NAMES = attention_names()
STOCHASTIC = [name for name in NAMES if ATTENTIONS[name][0].is_stochastic]


@pytest.fixture(scope="module")
def data():
    # variable lengths: the padding mask travels through every path
    return make_pointer_task(128, 32, 32, length=6, seed=0, vocab_size=6, min_length=4)


def _trained(make_transformer, name: str, data, steps: int = 3):
    """A model after a few optimiser steps (so that no parameter is at its initial value)."""
    model = make_transformer(name)
    loss_fn = AttentionELBO(model, num_data=len(data.train.labels))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for step in range(steps):
        rows = slice(32 * step, 32 * (step + 1))
        loss = loss_fn(model(data.train.tokens[rows], mask=data.train.mask[rows]), data.train.labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def _outputs(model, data, seed: int = 11) -> dict[str, Tensor]:
    """Eval logits, Monte Carlo probabilities and a training-mode (sampled) pass, each under a fixed seed."""
    tokens, mask = data.test.tokens, data.test.mask
    was_training = model.training
    with torch.no_grad():
        model.eval()
        logits = model(tokens, mask=mask)
        torch.manual_seed(seed)
        probabilities = predict_probabilities(model, tokens, mask=mask, num_samples=4)
        model.train()
        torch.manual_seed(seed)
        sampled = model(tokens, mask=mask)
        kl = model.kl_divergence()
    model.train(was_training)
    return {"eval_logits": logits, "mc_probabilities": probabilities, "train_logits": sampled, "kl": kl}


def _assert_identical(first: dict[str, Tensor], second: dict[str, Tensor]) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def _assert_equal_nested(first, second, where: str = "") -> None:
    """Bitwise equality of nested dicts / lists of tensors and plain values (optimiser and checkpoint states)."""
    if isinstance(first, Tensor):
        assert isinstance(second, Tensor) and first.dtype == second.dtype and torch.equal(first, second), where
    elif isinstance(first, dict):
        assert isinstance(second, dict) and first.keys() == second.keys(), where
        for key in first:
            _assert_equal_nested(first[key], second[key], f"{where}/{key}")
    elif isinstance(first, (list, tuple)):
        assert isinstance(second, (list, tuple)) and len(first) == len(second), where
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            _assert_equal_nested(a, b, f"{where}[{index}]")
    elif isinstance(first, float) and math.isnan(first):
        assert isinstance(second, float) and math.isnan(second), where
    else:
        assert first == second, where


# -- round trips -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_gives_identical_predictions(make_transformer, data, name):
    model = _trained(make_transformer, name, data)
    expected = _outputs(model, data)
    restored = make_transformer(name, seed=1)  # other initial values, overwritten by the state
    restored.load_state_dict(model.state_dict())
    _assert_identical(_outputs(restored, data), expected)


@pytest.mark.parametrize("name", NAMES)
def test_torch_save_and_load_give_identical_predictions(make_transformer, data, name, tmp_path):
    model = _trained(make_transformer, name, data)
    expected = _outputs(model, data)
    # the whole module (pickled; GPyTorch caches and stored KL graphs must not get in the way)
    torch.save(model, tmp_path / "model.pt")
    whole = torch.load(tmp_path / "model.pt", weights_only=False)
    _assert_identical(_outputs(whole, data), expected)
    # the state dict through a file, loaded with the safe unpickler
    torch.save(model.state_dict(), tmp_path / "state.pt")
    restored = make_transformer(name, seed=2)
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    _assert_identical(_outputs(restored, data), expected)
    # and the original is unchanged by being saved
    _assert_identical(_outputs(model, data), expected)


# -- deterministic evaluation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_monte_carlo_prediction_is_a_function_of_the_seed(make_transformer, data, name):
    model = _trained(make_transformer, name, data).eval()
    tokens, mask = data.test.tokens, data.test.mask

    def predict(seed: int) -> Tensor:
        torch.manual_seed(seed)
        return predict_probabilities(model, tokens, mask=mask, num_samples=5)

    first, again, other = predict(3), predict(3), predict(4)
    assert torch.equal(first, again)
    assert not model.training  # the mode is restored
    if name in STOCHASTIC:
        assert not torch.equal(first, other)  # the samples do come from the seeded RNG
    else:
        assert torch.equal(first, other)
    # prediction under a forked RNG leaves the caller's stream untouched
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        forked = predict_probabilities(model, tokens, mask=mask, num_samples=5)
    assert torch.equal(forked, first) and torch.equal(torch.get_rng_state(), state)


# -- bitwise resume --------------------------------------------------------------------------------------------------
def _without_time(history):
    return [{key: value for key, value in record.items() if key != "seconds"} for record in history]


@pytest.mark.parametrize("name", NAMES)
def test_interrupted_run_resumes_bit_identically(make_transformer, data, name, tmp_path, faulty_elbo):
    settings = dict(epochs=3, batch_size=48, lr=1e-2, warmup_epochs=1, eval_samples=2, progress=False)
    reference = make_transformer(name)
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, TrainConfig(**settings, checkpoint_dir=tmp_path / "full"))

    # 3 steps per epoch: the 8th loss is the second step of epoch 3, after two checkpoints
    faulty_elbo.interrupt_at = 8
    config = TrainConfig(**settings, checkpoint_dir=tmp_path / "staged")
    with pytest.raises(KeyboardInterrupt):
        train_model(interrupted, data.train, data.val, config)
    faulty_elbo.interrupt_at = None
    assert load_checkpoint(tmp_path / "staged" / "last.pt")["epoch"] == 2
    resumed = train_model(interrupted, data.train, data.val, config, resume=True)

    # metrics, selection and the final (best) parameters
    assert _without_time(resumed.history) == _without_time(full.history)
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    _assert_equal_nested(interrupted.state_dict(), reference.state_dict(), "best state")
    # the last state, the optimiser moments, the schedule and the RNG streams
    last = [load_checkpoint(tmp_path / run / "last.pt") for run in ("full", "staged")]
    for key in ("model", "optimizer", "scheduler", "rng", "epoch", "best_epoch", "best_val_nll"):
        _assert_equal_nested(last[0][key], last[1][key], key)
