"""Evaluation of the comparison's runs: the metrics of a prediction and of a run, temperature scaling, MC dropout,
ensembles, the Laplace predictive, OOD families with mutual information, per-example predictions, separate random
streams and the KSVD fidelity (the predictions by batches and the validation NLL: tests/training/test_predictions.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from gpattn import metrics
from gpattn.comparison import TaskData, load_task, random_stream, stream_seed
from gpattn.comparison.evaluation import (
    classification_metrics,
    ensemble_logits,
    evaluate_models,
    evaluate_run,
    per_example_predictions,
)
from gpattn.models import LastLayerLaplace, Transformer, fit_temperature
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
    assert result.debiased_ce == metrics.debiased_calibration_error(probabilities, labels, 15) > 0
    assert result.sweep_ece == metrics.sweep_calibration_error(probabilities, labels) > 0
    assert classification_metrics(probabilities, labels, 5).debiased_ce == metrics.debiased_calibration_error(
        probabilities, labels, 5
    )  # as many equal-mass bins as the ECE has bins


def test_per_example_predictions_average_to_the_metrics():
    generator = torch.Generator().manual_seed(1)
    probabilities = torch.softmax(3 * torch.randn(300, 5, generator=generator, dtype=torch.float64), dim=-1)
    probabilities[0] = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # a zero on the label: the floor
    labels = torch.randint(0, 5, (300,), generator=generator)
    labels[0] = 1
    examples = per_example_predictions(probabilities, labels)
    assert list(examples) == ["test_nll", "test_correct", "test_confidence"]
    assert all(len(values) == 300 and isinstance(values[0], float) for values in examples.values())
    assert examples["test_nll"][0] == pytest.approx(-np.log(1e-12), rel=1e-15)
    # the means are the recorded metrics: the NLL exactly
    assert float(np.mean(examples["test_nll"])) == metrics.negative_log_likelihood(probabilities, labels)
    assert float(np.mean(examples["test_correct"])) == metrics.accuracy(probabilities, labels)
    p = probabilities.numpy()
    np.testing.assert_array_equal(examples["test_confidence"], p.max(1))
    np.testing.assert_array_equal(examples["test_nll"][1:], -np.log(p[np.arange(1, 300), labels.numpy()[1:]]))


def test_per_example_predictions_check_their_inputs_as_the_metrics():
    probabilities = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]], dtype=torch.float64)
    # a negative label indexed the last classes (NumPy's negative indices): NLLs of another class, no error
    with pytest.raises(ValueError, match=r"expected labels in \[0, C - 1\] = \[0, 2\], got values in \[-1, 0\]"):
        per_example_predictions(probabilities, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="expected each row of probs to sum to 1"):  # logits-like scores were read
        per_example_predictions(probabilities / 2, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"expected labels of shape \(n,\) = \(2,\), got shape \(1,\)"):
        per_example_predictions(probabilities, torch.tensor([0]))
    # NumPy inputs, as the metrics take them
    examples = per_example_predictions(probabilities.numpy(), np.array([0, 2]))
    assert examples["test_nll"] == pytest.approx([-np.log(0.7), -np.log(0.6)], rel=1e-15)
    assert examples["test_correct"] == [1.0, 1.0] and examples["test_confidence"] == [0.7, 0.6]


def test_classification_metrics_take_numpy_and_average_the_confidence_in_float64():
    generator = torch.Generator().manual_seed(2)
    probabilities = torch.softmax(torch.randn(500, 4, generator=generator, dtype=torch.float64), dim=-1)
    labels = torch.randint(0, 4, (500,), generator=generator)
    half = probabilities.half()
    expected = half.double().max(dim=-1).values.mean().item()  # the mean of the stored float16 values, in float64
    assert classification_metrics(half, labels).confidence == pytest.approx(expected, abs=1e-12)
    result = classification_metrics(probabilities.numpy(), labels.numpy())  # was: a TypeError of torch's max(dim=)
    assert result == classification_metrics(probabilities, labels)
    assert result.confidence == pytest.approx(probabilities.numpy().max(1).mean(), rel=1e-15)


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


def _dropout_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(8, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="patches", image_size=8,
                       patch_size=2, in_channels=1, dropout=0.3).eval()  # fmt: skip


def test_mc_dropout_averages_dropout_passes(digits):
    model = _dropout_model()
    evaluation = evaluate_models(model, digits, num_samples=3, mc_dropout=True, temperature_scaling=False, seed=5)
    model.train()  # every dropout module on (the model has nothing else that depends on the mode)
    with random_stream(5, "test"), torch.no_grad():  # the same masks: the test set's stream, passes by 256 inputs
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


# -- separate random streams ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_dropout(digits) -> Transformer:
    """A digits model with dropout 0.3 trained for 4 epochs (an interior temperature under MC dropout)."""
    model = _dropout_model().train()
    config = TrainConfig(epochs=4, batch_size=64, lr=1e-2, warmup_epochs=1, eval_samples=1, progress=False)
    train_model(model, digits.train, digits.val, config)
    return model.eval()


def test_the_temperature_depends_on_the_validation_split_and_the_seed_only(digits, trained_dropout):
    """Issue 24 item 6: dropping test sequences (or every shifted and OOD set) leaves the temperature bit-identical,
    for a row whose predictions are random (MC dropout); another seed draws other validation masks."""
    model = trained_dropout
    scaled = evaluate_models(model, digits, num_samples=3, mc_dropout=True, seed=2).temperature_scaled
    fewer = dataclasses.replace(digits, test=_first(digits.test, len(digits.test) - 1), shifted={}, ood={})
    again = evaluate_models(model, fewer, num_samples=3, mc_dropout=True, seed=2).temperature_scaled
    assert again.temperature == scaled.temperature
    other = evaluate_models(model, fewer, num_samples=3, mc_dropout=True, seed=3).temperature_scaled
    assert 0.1 < scaled.temperature < 10  # an interior optimum, which the validation draws move:
    assert abs(other.temperature - scaled.temperature) > 1e-4  # the check above could fail
    with random_stream(2, "val"):  # the temperature is fitted on the validation set's own stream
        logits = ensemble_logits([model], digits.val, 3, mc_dropout=True)
    assert scaled.temperature == fit_temperature(logits.flatten(0, 1), digits.val.labels)


def _first(dataset, size: int):
    return type(dataset)(**{**vars(dataset), "images": dataset.images[:size], "labels": dataset.labels[:size]})


def test_every_set_draws_from_its_own_stream(digits):
    model = _dropout_model()
    full = evaluate_models(model, digits, num_samples=2, mc_dropout=True, temperature_scaling=False, seed=4)
    alone = evaluate_models(
        model, dataclasses.replace(digits, shifted={}, ood={}), 2, mc_dropout=True, temperature_scaling=False, seed=4
    )
    assert alone.metrics.test == full.metrics.test  # without the other sets: the same test draws
    state = torch.get_rng_state()
    with random_stream(4, "shift/blur/2"):
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is restored
    assert len({stream_seed(4, name) for name in ("val", "test", "ood/noise", "shift/blur/2")}) == 4
    assert stream_seed(4, "test") != stream_seed(5, "test") and 0 <= stream_seed(4, "test") < 2**63


# -- OOD families, mutual information, the Laplace predictive -------------------------------------------------------
def test_ood_per_family_and_pooled_with_the_mutual_information_of_the_stored_samples(digits):
    model = _dropout_model()
    evaluation = evaluate_models(model, digits, num_samples=4, mc_dropout=True, seed=1)
    assert list(evaluation.metrics.ood) == ["held_out", "noise", "pooled"]
    assert list(evaluation.ood_scores) == ["in", "held_out", "noise"]

    def samples(name, dataset, temperature=1.0):  # the run's draws, again: (K T, n, C) probabilities
        with random_stream(1, name):
            return (ensemble_logits([model], dataset, 4, mc_dropout=True) / temperature).softmax(-1).flatten(0, 1)

    for variant, temperature in ((evaluation, 1.0), (evaluation.temperature_scaled, None)):
        temperature = temperature or evaluation.temperature_scaled.temperature
        test = samples("test", digits.test, temperature)
        families = {name: samples(f"ood/{name}", dataset, temperature) for name, dataset in digits.ood.items()}
        families["pooled"] = torch.cat([families["held_out"], families["noise"]], dim=1)
        for name, family in families.items():
            recorded = variant.metrics.ood[name]
            expected = metrics.ood_auroc_mutual_information(test, family)
            assert recorded.auroc_mutual_information == pytest.approx(expected, abs=1e-12)
            assert recorded.auroc_max_prob == pytest.approx(metrics.ood_auroc(test.mean(0), family.mean(0)), abs=1e-12)
        assert 0.0 < variant.metrics.ood["pooled"].auroc_mutual_information < 1.0
    # the pooled set is the union: its AUROC is the size-weighted mean of the families' (one positive set)
    sizes = {name: len(dataset) for name, dataset in digits.ood.items()}
    weighted = sum(sizes[n] * evaluation.metrics.ood[n].auroc_mutual_information for n in sizes) / sum(sizes.values())
    assert evaluation.metrics.ood["pooled"].auroc_mutual_information == pytest.approx(weighted, abs=1e-12)


def test_a_deterministic_row_has_no_mutual_information(digits):
    evaluation = evaluate_models(_digits_model(0), digits, num_samples=4)
    for variant in (evaluation, evaluation.temperature_scaled):
        assert all(np.isnan(ood.auroc_mutual_information) for ood in variant.metrics.ood.values())
        assert all(0 <= ood.auroc_max_prob <= 1 for ood in variant.metrics.ood.values())
    ensemble = evaluate_models([_digits_model(0), _digits_model(1)], digits, num_samples=4, temperature_scaling=False)
    assert all(0 < ood.auroc_mutual_information < 1 for ood in ensemble.metrics.ood.values())  # two members vary


def test_per_example_predictions_of_a_run(digits, trained):
    evaluation = evaluate_models(trained, digits, num_samples=1)
    for variant, examples in ((evaluation, evaluation.per_example), (evaluation.temperature_scaled, None)):
        examples = examples or variant.per_example
        assert all(len(values) == len(digits.test) for values in examples.values())
        assert float(np.mean(examples["test_nll"])) == variant.metrics.test.nll  # exactly
        assert float(np.mean(examples["test_correct"])) == variant.metrics.test.accuracy
        assert float(np.mean(examples["test_confidence"])) == pytest.approx(variant.metrics.test.confidence, rel=1e-12)
    assert evaluation.per_example["test_correct"] == evaluation.temperature_scaled.per_example["test_correct"]
    assert evaluation.per_example["test_nll"] != evaluation.temperature_scaled.per_example["test_nll"]


def test_a_laplace_member_predicts_by_its_glm_samples(digits, trained):
    laplace = LastLayerLaplace(trained).fit(digits.train.images, digits.train.labels)
    with random_stream(0, "test"):
        logits = ensemble_logits([laplace], digits.test, num_samples=5, batch_size=100)
    with random_stream(0, "test"):
        expected = torch.cat(
            [laplace.sample_logits(chunk, num_samples=5) for chunk in digits.test.images.split(100)], 1
        )
    assert logits.shape == (1, 5, len(digits.test), 8) and torch.equal(logits[0], expected)
    evaluation = evaluate_models(laplace, digits, num_samples=5, seed=0)
    assert all(0 < ood.auroc_mutual_information < 1 for ood in evaluation.metrics.ood.values())
    mean, _ = laplace.predictive_moments(digits.test.images)
    assert evaluation.metrics.test.accuracy == pytest.approx(  # the samples scatter around the trained logits
        metrics.accuracy(mean.softmax(-1), digits.test.labels), abs=0.03
    )


def test_members_that_are_not_models_are_named(digits):
    # an AttributeError ("'str' object has no attribute 'parameters'") from inside the loop over the members
    with pytest.raises(TypeError, match=r"ensemble_logits: expected every member to be a torch.nn.Module, got str "
                                        r"'softmax' as member 1"):  # fmt: skip
        ensemble_logits([_digits_model(0), "softmax"], digits.test)
    with pytest.raises(TypeError, match="evaluate_models: expected a model or a list of models, got the string 'kep'"):
        evaluate_models("kep", digits, num_samples=1)  # was read as the members "k", "e", "p"


def test_ensemble_logits_give_the_ensemble_probabilities(digits):
    members = [_digits_model(0), _digits_model(1)]
    logits = ensemble_logits(members, digits.test, num_samples=4)
    assert logits.shape == (2, 1, len(digits.test), 8)  # deterministic members: one pass each
    torch.testing.assert_close(
        logits.softmax(-1).mean((0, 1)), ensemble_probabilities(members, digits.test, 4).double(), rtol=0, atol=1e-6
    )


def test_a_model_of_another_class_count_is_named_as_such(digits):
    torch.manual_seed(0)
    model = Transformer(3, embed_dim=16, depth=1, num_heads=2, attention="softmax", **digits.model_kwargs).eval()
    message = (
        rf"evaluate_models: the model's logits have 3 classes, but the digits task's labels are in \[0, "
        rf"{digits.num_classes}\) \({digits.num_classes} classes\): build the model with num_classes="
        rf"{digits.num_classes}"
    )
    with pytest.raises(ValueError, match=message):
        evaluate_models(model, digits, num_samples=1)


def test_the_confidence_of_float64_probabilities_is_torchs_mean_bit_for_bit():
    # records of runs made before the NumPy fix must stay bit-equal: gpattn report merges run folders (runs/main and
    # runs/full share seeds) by comparing their records exactly; NumPy's mean differs in the last bit on some inputs
    generator = torch.Generator().manual_seed(0)
    differing = 0
    for _ in range(20):
        probabilities = torch.softmax(torch.randn(337, 10, generator=generator, dtype=torch.float64), dim=-1)
        labels = torch.randint(0, 10, (337,), generator=generator)
        earlier = float(probabilities.max(dim=-1).values.mean())  # the expression of the records' code
        assert classification_metrics(probabilities, labels).confidence == earlier
        differing += earlier != float(probabilities.numpy().max(1).mean())
    assert differing > 0  # the inputs do tell the two summation orders apart
