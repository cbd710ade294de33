"""The predictions the training loop validates with: Monte Carlo probabilities by batches, the data sets they read,
and the one NLL used for selection and reporting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from gpattn import metrics
from gpattn.comparison import load_task
from gpattn.data import ImageDataset, make_pointer_task
from gpattn.models import Transformer, predict_probabilities
from gpattn.training import dataset_inputs, dataset_labels, ensemble_probabilities, evaluate, validation_metrics


@pytest.fixture(scope="module")
def digits() -> ImageDataset:
    return load_task("digits").test


def _digits_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(8, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="patches", image_size=8,
                       patch_size=2, in_channels=1).eval()  # fmt: skip


# -- the NLL of selection and reports --------------------------------------------------------------------------------
def test_validation_metrics_are_the_reported_accuracy_and_floored_nll():
    probabilities = torch.tensor(
        [[0.7, 0.3, 0.0], [0.2, 0.5, 0.3], [1.0, 0.0, 0.0], [0.1, 0.1, 0.8]], dtype=torch.float64
    )
    labels = torch.tensor([0, 2, 1, 2])  # the third input gives its true class probability 0
    accuracy, nll = validation_metrics(probabilities, labels)
    picked = np.array([0.7, 0.3, 0.0, 0.8], dtype=np.float64)
    assert nll == pytest.approx(-np.log(np.maximum(picked, 1e-12)).mean(), rel=1e-12)  # -log(1e-12) for the zero
    assert accuracy == 0.5
    assert (accuracy, nll) == (
        metrics.accuracy(probabilities, labels),
        metrics.negative_log_likelihood(probabilities, labels),
    )


# -- predictions -----------------------------------------------------------------------------------------------------
def test_evaluate_by_batches_equals_one_pass(digits):
    model = _digits_model()
    whole = predict_probabilities(model, digits.images, num_samples=3)
    torch.testing.assert_close(evaluate(model, digits, num_samples=3, batch_size=50), whole, rtol=1e-6, atol=1e-7)
    assert evaluate(model, digits, num_samples=3).shape == (len(digits), 8)


def test_token_data_sets_carry_their_mask():
    data = make_pointer_task(8, 4, 4, length=6, seed=0, vocab_size=6, min_length=3)
    inputs, mask = dataset_inputs(data.train)
    assert inputs is data.train.tokens and mask is data.train.mask
    assert dataset_labels(data.train) is data.train.labels


def test_data_sets_of_the_wrong_kind_are_refused():
    @dataclass
    class Inputs:
        inputs: torch.Tensor
        labels: object

    with pytest.raises(TypeError, match=r"\.tokens, \.images or \.inputs"):
        dataset_inputs(object())
    with pytest.raises(TypeError, match="integer class labels"):
        dataset_labels(Inputs(torch.zeros(3, 2), torch.zeros(3)))
    with pytest.raises(ValueError, match="2 labels for 3 inputs"):
        dataset_labels(Inputs(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="at least one model"):
        ensemble_probabilities([], Inputs(torch.zeros(3, 2), None))


def test_evaluate_with_mc_dropout_is_the_mean_of_dropout_passes(digits):
    """``mc_dropout=True``: the mean softmax of T passes with fresh dropout masks, by hand (eval mode with the dropout
    modules switched on, the same seed), not the eval-mode prediction; a model without dropout raises."""
    torch.manual_seed(0)
    model = Transformer(8, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="patches", image_size=8,
                        patch_size=2, in_channels=1, dropout=0.3).eval()  # fmt: skip
    images = digits.images[:40]
    subset = ImageDataset(images, digits.labels[:40], digits.num_classes, digits.class_names, "digits")
    torch.manual_seed(5)
    got = evaluate(model, subset, num_samples=4, batch_size=256, mc_dropout=True)
    torch.manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.train(True)
        expected = torch.stack([model(images).softmax(dim=-1) for _ in range(4)]).mean(dim=0)
        model.eval()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    deterministic = evaluate(model, subset, num_samples=4)
    assert (got - deterministic).abs().max() > 1e-3  # the masks change the prediction
    assert not model.training and all(not module.training for module in model.modules())  # modes restored
    with pytest.raises(ValueError, match="no dropout"):
        evaluate(_digits_model(), subset, num_samples=2, mc_dropout=True)
    with pytest.raises(ValueError, match="expected mc_dropout to be True or False, got 1"):
        evaluate(model, subset, mc_dropout=1)


def test_evaluate_restores_mixed_modes(digits):
    """A model in training with a block left in eval mode (and one dropout of an eval block in training) gets back
    every module's own mode, and predicts as in eval mode (no dropout)."""
    torch.manual_seed(0)
    model = Transformer(8, embed_dim=16, depth=2, num_heads=2, attention="sgpa", input="patches", image_size=8,
                        patch_size=2, in_channels=1, dropout=0.3).train()  # fmt: skip
    model.blocks[0].eval()
    model.blocks[0].mlp[2].train()
    modes = [module.training for module in model.modules()]
    subset = ImageDataset(digits.images[:20], digits.labels[:20], digits.num_classes, digits.class_names, "digits")
    torch.manual_seed(5)
    got = evaluate(model, subset, num_samples=3)
    assert [module.training for module in model.modules()] == modes
    assert model.training and not model.blocks[0].training and model.blocks[0].mlp[2].training
    torch.manual_seed(5)
    expected = predict_probabilities(model.eval(), subset.images, num_samples=3)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_misplaced_models_and_empty_data_sets_are_named(digits):
    """An empty data set, a model that is no module, a single model or train_ensemble's (model, result) pairs given
    to the ensemble: errors naming them (torch.cat's "expected a non-empty list of Tensors", AttributeErrors on
    ``.parameters`` before); ensemble_probabilities checks every member before predicting with any."""
    model = _digits_model()
    empty = ImageDataset(digits.images[:0], digits.labels[:0], digits.num_classes, digits.class_names, "digits")
    with pytest.raises(ValueError, match=r"evaluate: expected a non-empty data set, got 0 inputs"):
        evaluate(model, empty)
    with pytest.raises(ValueError, match=r"non-empty data set"):
        ensemble_probabilities([model], empty)
    with pytest.raises(TypeError, match=r"evaluate: expected model to be a torch\.nn\.Module, got function"):
        evaluate(lambda images: images, digits)
    with pytest.raises(TypeError, match=r"expected a list of models, got a single Transformer; pass \[model\]"):
        ensemble_probabilities(model, digits)
    with pytest.raises(TypeError, match=r"models\[1\] to be a torch\.nn\.Module, got tuple \(train_ensemble returns"):
        ensemble_probabilities([model, (model, None)], digits)
    subset = ImageDataset(digits.images[:10], digits.labels[:10], digits.num_classes, digits.class_names, "digits")
    torch.manual_seed(5)
    got = ensemble_probabilities(torch.nn.ModuleList([model]), subset, num_samples=1)  # a ModuleList is a list
    torch.testing.assert_close(got, model(subset.images).softmax(dim=-1), rtol=1e-6, atol=1e-7)
