"""State: a trained Transformer survives ``state_dict`` and whole-model ``torch.save`` round trips with identical
predictions, and Monte Carlo evaluation is a function of the seed, for every registered attention. (Bitwise resume of
an interrupted run is tested with the training loop, tests/training/test_loop.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gpattn.attention import ATTENTIONS, attention_names
from gpattn.data import make_pointer_task
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
