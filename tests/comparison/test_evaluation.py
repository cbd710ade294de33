"""Evaluation of the comparison's runs: the metrics of a prediction and of a run, temperature scaling, MC dropout,
ensembles and the KSVD fidelity (the predictions by batches and the validation NLL: tests/training/test_predictions.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from gpattn import metrics
from gpattn.comparison import TaskData, load_task
from gpattn.comparison.evaluation import (
    classification_metrics,
    ensemble_logits,
    evaluate_models,
    evaluate_run,
)
from gpattn.models import Transformer
from gpattn.training import TrainConfig, ensemble_probabilities, train_model


@pytest.fixture(scope="module")
def digits() -> TaskData:
    return load_task("digits")


def _digits_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(8, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="patches", image_size=8,
                       patch_size=2, in_channels=1).eval()  # fmt: skip


# -- the metrics of a prediction ---------------------------------------------------------------------------------------
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


# -- temperature scaling, MC dropout, classwise ECE, AUPR-Out, KSVD fidelity ------------------------------------------
def _with_labels(task: TaskData, split: str, labels: torch.Tensor) -> TaskData:
    """``task`` with the labels of ``split`` replaced (a copy; the inputs are shared)."""
    dataset = getattr(task, split)
    replaced = type(dataset)(**{**vars(dataset), "labels": labels})
    return dataclasses.replace(task, **{split: replaced})


@pytest.fixture(scope="module")
def trained(digits) -> Transformer:
    """A softmax digits model trained for 4 epochs (informative logits, so that the temperature is interior)."""
    model = _digits_model(0).train()
    config = TrainConfig(epochs=4, batch_size=64, lr=1e-2, warmup_epochs=1, eval_samples=1, progress=False)
    train_model(model, digits.train, digits.val, config)  # leaves the best epoch's state in the model
    return model.eval()


def test_temperature_is_fitted_on_the_validation_split_only(digits, trained):
    model = trained
    scaled = evaluate_models(model, digits, num_samples=1).temperature_scaled
    # poisoned test labels (a permutation, so that every metric would move): the temperature is unchanged ...
    poisoned = torch.roll(digits.test.labels, 1)
    assert not torch.equal(poisoned, digits.test.labels)
    again = evaluate_models(model, _with_labels(digits, "test", poisoned), num_samples=1).temperature_scaled
    assert again.temperature == scaled.temperature
    assert again.metrics.test.accuracy != scaled.metrics.test.accuracy  # ... while the test metrics did read them
    # ... and poisoned validation labels move it: the check above could fail
    moved = evaluate_models(model, _with_labels(digits, "val", torch.roll(digits.val.labels, 1)), num_samples=1)
    assert abs(moved.temperature_scaled.temperature - scaled.temperature) > 1e-3


def test_temperature_scaling_lowers_the_validation_nll_and_scales_the_test_logits(digits, trained):
    model = trained
    evaluation = evaluate_models(model, digits, num_samples=1)
    temperature = evaluation.temperature_scaled.temperature
    with torch.no_grad():
        val_logits, test_logits = model(digits.val.images).double(), model(digits.test.images).double()
    before = metrics.negative_log_likelihood(val_logits.softmax(-1), digits.val.labels)
    after = metrics.negative_log_likelihood((val_logits / temperature).softmax(-1), digits.val.labels)
    assert after < before - 1e-4
    # the fitted temperature is the minimiser: a brute-force grid around it finds nothing lower
    grid = temperature * torch.linspace(0.9, 1.1, 41, dtype=torch.float64)
    nlls = [metrics.negative_log_likelihood((val_logits / t).softmax(-1), digits.val.labels) for t in grid]
    assert after <= min(nlls) + 1e-9
    # the +ts test metrics are those of softmax(f(x) / tau), the accuracy unchanged
    expected = classification_metrics((test_logits / temperature).softmax(-1), digits.test.labels)
    scaled = evaluation.temperature_scaled.metrics.test
    assert scaled.nll == pytest.approx(expected.nll, rel=1e-9) and scaled.ece == pytest.approx(expected.ece, abs=1e-9)
    assert scaled.accuracy == evaluation.metrics.test.accuracy
    shifted = digits.shifted[("rotation", 2)]
    with torch.no_grad():
        rotated = (model(shifted.images).double() / temperature).softmax(-1)
    assert evaluation.temperature_scaled.metrics.shift["rotation"]["2"].nll == pytest.approx(
        metrics.negative_log_likelihood(rotated, shifted.labels), rel=1e-9
    )


def test_mc_dropout_averages_dropout_passes(digits):
    torch.manual_seed(0)
    model = Transformer(8, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="patches", image_size=8,
                        patch_size=2, in_channels=1, dropout=0.3).eval()  # fmt: skip
    torch.manual_seed(5)
    evaluation = evaluate_models(model, digits, num_samples=3, mc_dropout=True, temperature_scaling=False)
    torch.manual_seed(5)  # the same masks: test inputs first, three passes over one batch of 256 ...
    model.train()  # every dropout module on (the model has nothing else that depends on the mode)
    with torch.no_grad():
        parts = [torch.stack([model(chunk).softmax(-1) for _ in range(3)]).mean(0) for chunk in
                 digits.test.images.split(256)]  # fmt: skip
    expected = classification_metrics(torch.cat(parts).double(), digits.test.labels)
    assert evaluation.metrics.test.nll == pytest.approx(expected.nll, rel=1e-6)
    deterministic = evaluate_models(model.eval(), digits, num_samples=3, temperature_scaling=False)
    assert deterministic.metrics.test.nll != evaluation.metrics.test.nll
    with pytest.raises(ValueError, match="no dropout"):
        evaluate_models(_digits_model(0), digits, num_samples=2, mc_dropout=True)


def test_classwise_ece_aupr_out_and_bins(digits):
    model = _digits_model(0)
    evaluation = evaluate_models(model, digits, num_samples=1, num_bins=10, temperature_scaling=False)
    with torch.no_grad():
        # float64 softmax of the float32 logits, as the evaluation
        test = model(digits.test.images).double().softmax(-1)
        noise = model(digits.ood["noise"].images).double().softmax(-1)
    labels = digits.test.labels
    assert evaluation.metrics.test.classwise_ece == pytest.approx(
        metrics.expected_calibration_error(test, labels, 10, kind="classwise"), abs=1e-9
    )
    assert evaluation.metrics.test.ece == pytest.approx(metrics.expected_calibration_error(test, labels, 10), abs=1e-9)
    assert len(evaluation.reliability.count) == 10
    ood = evaluation.metrics.ood["noise"]
    # AUPR-Out: OOD positive, ranked by minus the max probability (scikit-learn)
    scores = -torch.cat([test, noise]).max(-1).values.numpy()
    is_out = np.r_[np.zeros(len(test)), np.ones(len(noise))]
    assert ood.aupr_out_max_prob == pytest.approx(average_precision_score(is_out, scores), abs=1e-9)
    assert ood.aupr_max_prob == pytest.approx(average_precision_score(1 - is_out, -scores), abs=1e-9)


def test_ensemble_logits_give_the_ensemble_probabilities(digits):
    members = [_digits_model(0), _digits_model(1)]
    logits = ensemble_logits(members, digits.test, num_samples=4)
    assert logits.shape == (2, 1, len(digits.test), 8)  # deterministic members: one pass each
    torch.testing.assert_close(
        logits.softmax(-1).mean((0, 1)), ensemble_probabilities(members, digits.test, 4).double(), rtol=0, atol=1e-6
    )
