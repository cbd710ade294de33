"""Evaluation: Monte Carlo predictions by batches, the metrics of a run, and the one NLL used for selection and
reporting."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from gpattn import metrics
from gpattn.data import make_pointer_task
from gpattn.experiments import TaskData, ensemble_probabilities, evaluate, load_task
from gpattn.experiments.evaluation import (
    classification_metrics,
    dataset_inputs,
    dataset_labels,
    evaluate_run,
    validation_metrics,
)
from gpattn.models import Transformer, predict_probabilities


@pytest.fixture(scope="module")
def digits() -> TaskData:
    return load_task("digits")


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


def test_classification_metrics_of_a_prediction():
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.softmax(torch.randn(200, 4, generator=generator), dim=-1)
    labels = torch.randint(0, 4, (200,), generator=generator)
    result = classification_metrics(probabilities, labels)
    p = probabilities.double().numpy()
    one_hot = np.eye(4)[labels.numpy()]
    assert result.accuracy == pytest.approx((p.argmax(1) == labels.numpy()).mean(), abs=1e-15)
    assert result.confidence == pytest.approx(p.max(1).mean(), rel=1e-6)
    assert result.nll == pytest.approx(-np.log(p[np.arange(200), labels.numpy()]).mean(), rel=1e-12)
    assert result.brier == pytest.approx(((p - one_hot) ** 2).sum(1).mean(), rel=1e-12)
    correct = p.argmax(1) == labels.numpy()
    assert result.auroc == pytest.approx(roc_auc_score(correct, p.max(1)), rel=1e-12)
    assert result.ece == metrics.expected_calibration_error(probabilities, labels)
    assert result.fpr95 == metrics.fpr_at_95_tpr(probabilities, labels)


# -- predictions -----------------------------------------------------------------------------------------------------
def test_evaluate_by_batches_equals_one_pass(digits):
    model = _digits_model()
    whole = predict_probabilities(model, digits.test.images, num_samples=3)
    torch.testing.assert_close(evaluate(model, digits.test, num_samples=3, batch_size=50), whole, rtol=1e-6, atol=1e-7)
    assert evaluate(model, digits.test, num_samples=3).shape == (len(digits.test), 8)


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


# -- a run's metrics -------------------------------------------------------------------------------------------------
def test_evaluate_run_on_digits(digits):
    members = [_digits_model(0), _digits_model(1)]
    metrics_, reliability, ood_scores = evaluate_run(members, digits, num_samples=1)

    def mean(dataset):  # softmax attention is deterministic: the ensemble is the mean of the members' softmax
        with torch.no_grad():
            return torch.stack([m(dataset.images).softmax(-1) for m in members]).mean(0)

    test = mean(digits.test)
    expected = classification_metrics(test, digits.test.labels)
    assert metrics_.test.accuracy == expected.accuracy
    assert metrics_.test.nll == pytest.approx(expected.nll, rel=1e-6)
    assert metrics_.test.brier == pytest.approx(expected.brier, rel=1e-6)
    assert sum(reliability.count) == len(digits.test) and len(reliability.count) == 15
    assert set(metrics_.shift) == {"gaussian_noise", "rotation", "blur"}
    blurred = digits.shifted[("blur", 3)]
    assert metrics_.shift["blur"]["3"].accuracy == pytest.approx(
        metrics.accuracy(mean(blurred), blurred.labels), abs=1e-12
    )
    torch.testing.assert_close(torch.tensor(ood_scores["in"]), test.max(-1).values, rtol=1e-6, atol=1e-7)
    noise = torch.tensor(ood_scores["noise"]).double()
    scores = torch.cat([torch.tensor(ood_scores["in"]).double(), noise]).numpy()
    is_in = np.r_[np.ones(len(ood_scores["in"])), np.zeros(len(noise))]
    assert metrics_.ood["noise"].auroc_max_prob == pytest.approx(roc_auc_score(is_in, scores), abs=1e-12)
