"""Tests of AURC, E-AURC and misclassification detection against brute force and scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score, roc_curve
from torchmetrics.functional.classification import binary_auroc

from gpattn.metrics import aurc, eaurc, fpr_at_95_tpr, misclassification_auroc

# Confidences 0.9 (correct), 0.8 (wrong), 0.7 (correct).
PROBS = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
LABELS = np.array([0, 1, 1])


def _random_inputs(seed: int, num_samples: int, num_classes: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if ties:
        weights = rng.integers(1, 4, size=(num_samples, num_classes)).astype(np.float64)
    else:
        weights = rng.dirichlet(np.full(num_classes, 0.5), size=num_samples) + 1e-9
    return weights / weights.sum(axis=1, keepdims=True), rng.integers(0, num_classes, size=num_samples)


def _brute_force_aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    # Python's sort is stable: tied samples keep their input order.
    order = sorted(range(len(confidence)), key=lambda i: -confidence[i])
    risks = []
    for k in range(1, len(order) + 1):
        risks.append(sum(not correct[i] for i in order[:k]) / k)
    return sum(risks) / len(risks)


inputs = st.builds(
    _random_inputs,
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(1, 80),
    num_classes=st.integers(2, 5),
    ties=st.booleans(),
)


def test_aurc_eaurc_hand_computed() -> None:
    # Risks at coverage 1/3, 2/3, 3/3: 0/1, 1/2, 1/3 -> AURC = (0 + 1/2 + 1/3) / 3 = 5/18.
    # Perfect ranking (1 error in 3): risks 0, 0, 1/3 -> AURC* = 1/9; E-AURC = 5/18 - 2/18 = 1/6.
    assert aurc(PROBS, LABELS) == pytest.approx(5 / 18, abs=1e-12)
    assert eaurc(PROBS, LABELS) == pytest.approx(1 / 6, abs=1e-12)


def test_misclassification_hand_computed() -> None:
    # Correct confidences {0.9, 0.7} vs wrong {0.8}: pairs (0.9 > 0.8) and (0.7 < 0.8) -> AUROC = 1/2.
    assert misclassification_auroc(PROBS, LABELS) == pytest.approx(0.5)
    # TPR >= 0.95 needs both correct samples, i.e. threshold 0.7, which accepts the wrong one too: FPR = 1.
    assert fpr_at_95_tpr(PROBS, LABELS) == 1.0


def test_aurc_ties_follow_input_order() -> None:
    # Two samples tied at confidence 0.6, one wrong; the stable sort keeps the input order.
    probs = np.array([[0.6, 0.4], [0.6, 0.4]])
    # Wrong first: risks 1/1, 1/2 -> 3/4; correct first: risks 0/1, 1/2 -> 1/4.
    assert aurc(probs, np.array([1, 0])) == pytest.approx(0.75)
    assert aurc(probs, np.array([0, 1])) == pytest.approx(0.25)


def test_degenerate_cases_are_nan() -> None:
    all_correct = (np.eye(3), np.arange(3))
    all_wrong = (np.eye(3), np.array([1, 2, 0]))
    for probs, labels in (all_correct, all_wrong):
        assert math.isnan(misclassification_auroc(probs, labels))
        assert math.isnan(fpr_at_95_tpr(probs, labels))
    assert aurc(*all_correct) == 0.0 and eaurc(*all_correct) == 0.0
    assert aurc(*all_wrong) == 1.0 and eaurc(*all_wrong) == 0.0


@settings(max_examples=50, deadline=None)
@given(data=inputs)
def test_aurc_eaurc_against_brute_force(data: tuple[np.ndarray, np.ndarray]) -> None:
    probs, labels = data
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    assert aurc(probs, labels) == pytest.approx(_brute_force_aurc(confidence, correct), abs=1e-12)
    # The optimal ranking puts every correct sample first.
    optimal = _brute_force_aurc(correct.astype(float), correct)
    assert eaurc(probs, labels) == pytest.approx(_brute_force_aurc(confidence, correct) - optimal, abs=1e-12)
    assert eaurc(probs, labels) >= -1e-12


@settings(max_examples=50, deadline=None)
@given(data=inputs)
def test_misclassification_against_sklearn(data: tuple[np.ndarray, np.ndarray]) -> None:
    probs, labels = data
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    if correct.all() or not correct.any():
        assert math.isnan(misclassification_auroc(probs, labels))
        assert math.isnan(fpr_at_95_tpr(probs, labels))
        return
    assert misclassification_auroc(probs, labels) == pytest.approx(roc_auc_score(correct, confidence), abs=1e-12)
    fpr, tpr, _ = roc_curve(correct, confidence, drop_intermediate=False)
    assert fpr_at_95_tpr(probs, labels) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-12)


@pytest.mark.parametrize("metric", [aurc, eaurc, misclassification_auroc, fpr_at_95_tpr])
@pytest.mark.parametrize("ties", [False, True])
def test_numpy_and_torch_inputs_agree(metric, ties: bool) -> None:
    probs, labels = _random_inputs(3, 60, 4, ties)
    probs32 = torch.tensor(probs, dtype=torch.float32)
    from_torch = metric(probs32, torch.tensor(labels))
    assert isinstance(from_torch, float) and from_torch == metric(probs32.numpy(), labels)


@pytest.mark.parametrize("metric", [aurc, eaurc, misclassification_auroc, fpr_at_95_tpr])
def test_bad_inputs_raise(metric) -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        metric(np.array([[0.7, 0.7]]), np.array([0]))
    with pytest.raises(ValueError, match="integer"):
        metric(PROBS, LABELS.astype(float))
    with pytest.raises(ValueError, match="shape"):
        metric(PROBS, LABELS[:2])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_samples=st.integers(2, 120), num_classes=st.integers(2, 5))
def test_misclassification_auroc_against_torchmetrics(seed: int, num_samples: int, num_classes: int) -> None:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(num_classes, 0.5), size=num_samples) + 1e-9
    probs /= probs.sum(axis=1, keepdims=True)
    labels = rng.integers(0, num_classes, size=num_samples)
    correct = probs.argmax(axis=1) == labels
    if correct.all() or not correct.any():
        return  # AUROC is undefined with one class (ours is NaN, see test_degenerate_cases_are_nan)
    expected = float(binary_auroc(torch.tensor(probs.max(axis=1)), torch.tensor(correct.astype(np.int64))))
    assert misclassification_auroc(probs, labels) == pytest.approx(expected, abs=1e-6)
