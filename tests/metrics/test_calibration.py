"""Tests of accuracy, NLL, Brier score, ECE and MCE (top-label and classwise) and reliability-diagram data, against
hand computations, loops, scikit-learn and torchmetrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sklearn.metrics import brier_score_loss, log_loss
from torchmetrics.functional.classification import multiclass_calibration_error

from gpattn.metrics import (
    accuracy,
    brier_score,
    expected_calibration_error,
    maximum_calibration_error,
    negative_log_likelihood,
    reliability_diagram_data,
)
from gpattn.metrics.calibration import row_sum_tolerance

# Four binary samples; confidence = max prob, prediction = argmax.
#   [0.90, 0.10], y=0: conf 0.90, correct -> bin (0.8, 1.0]
#   [0.70, 0.30], y=1: conf 0.70, wrong   -> bin (0.6, 0.8]
#   [0.30, 0.70], y=1: conf 0.70, correct -> bin (0.6, 0.8]
#   [0.55, 0.45], y=0: conf 0.55, correct -> bin (0.4, 0.6]
PROBS = np.array([[0.9, 0.1], [0.7, 0.3], [0.3, 0.7], [0.55, 0.45]])
LABELS = np.array([0, 1, 1, 0])


def _random_inputs(seed: int, num_samples: int, num_classes: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if ties:
        weights = rng.integers(1, 4, size=(num_samples, num_classes)).astype(np.float64)
    else:
        weights = rng.dirichlet(np.full(num_classes, 0.5), size=num_samples) + 1e-9
    return weights / weights.sum(axis=1, keepdims=True), rng.integers(0, num_classes, size=num_samples)


def test_accuracy_hand_computed() -> None:
    # 3 of 4 predictions are correct.
    assert accuracy(PROBS, LABELS) == 0.75


def test_nll_hand_computed() -> None:
    # True-class probabilities 0.9, 0.3, 0.7, 0.55:
    # -(ln 0.9 + ln 0.3 + ln 0.7 + ln 0.55) / 4 = -(-0.1053605 - 1.2039728 - 0.3566749 - 0.5978370) / 4 = 0.5659613
    expected = -(math.log(0.9) + math.log(0.3) + math.log(0.7) + math.log(0.55)) / 4
    assert expected == pytest.approx(0.5659613, abs=1e-7)
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(expected, abs=1e-12)


def test_nll_eps_floors_zero_probability() -> None:
    # The true class has probability 0: -ln(1e-12) = 27.6310211.
    assert negative_log_likelihood(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(27.6310211, abs=1e-6)
    with pytest.raises(ValueError, match="eps"):
        negative_log_likelihood(PROBS, LABELS, eps=0.0)
    # one class: -log 1 = -0.0 in IEEE arithmetic, reported as 0.0 (the docstring's ">= 0")
    assert math.copysign(1.0, negative_log_likelihood(np.ones((3, 1)), np.zeros(3, dtype=int))) == 1.0


def test_brier_hand_computed() -> None:
    # Sum over classes of squared errors against one-hot labels:
    #   (0.9 - 1)^2 + 0.1^2        = 0.01 + 0.01     = 0.02
    #   0.7^2 + (0.3 - 1)^2        = 0.49 + 0.49     = 0.98
    #   0.3^2 + (0.7 - 1)^2        = 0.09 + 0.09     = 0.18
    #   (0.55 - 1)^2 + 0.45^2      = 0.2025 + 0.2025 = 0.405
    # mean = (0.02 + 0.98 + 0.18 + 0.405) / 4 = 1.585 / 4 = 0.39625
    assert brier_score(PROBS, LABELS) == pytest.approx(0.39625, abs=1e-12)


def test_ece_mce_hand_computed() -> None:
    # num_bins=5, edges 0, 0.2, 0.4, 0.6, 0.8, 1.0:
    #   (0.4, 0.6]: n=1, acc 1,   conf 0.55, gap 0.45
    #   (0.6, 0.8]: n=2, acc 1/2, conf 0.70, gap 0.20
    #   (0.8, 1.0]: n=1, acc 1,   conf 0.90, gap 0.10
    # ECE = (1 * 0.45 + 2 * 0.20 + 1 * 0.10) / 4 = 0.95 / 4 = 0.2375; MCE = 0.45
    assert expected_calibration_error(PROBS, LABELS, num_bins=5) == pytest.approx(0.2375, abs=1e-12)
    assert maximum_calibration_error(PROBS, LABELS, num_bins=5) == pytest.approx(0.45, abs=1e-12)


def test_reliability_diagram_hand_computed() -> None:
    diagram = reliability_diagram_data(PROBS, LABELS, num_bins=5)
    np.testing.assert_allclose(diagram.bin_edges, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_array_equal(diagram.count, [0, 0, 1, 2, 1])
    np.testing.assert_allclose(diagram.confidence, [np.nan, np.nan, 0.55, 0.7, 0.9])
    np.testing.assert_allclose(diagram.accuracy, [np.nan, np.nan, 1.0, 0.5, 1.0])


def test_bins_are_right_closed() -> None:
    # num_bins=2, edges 0, 0.5, 1: confidence 0.5 falls in (0, 0.5] and confidence 1.0 in (0.5, 1].
    probs = np.array([[0.5, 0.5], [1.0, 0.0]])
    diagram = reliability_diagram_data(probs, np.array([1, 0]), num_bins=2)
    np.testing.assert_array_equal(diagram.count, [1, 1])
    # Bin 0: conf 0.5, prediction 0 (first maximal class) vs label 1 -> acc 0, gap 0.5; bin 1: conf 1, acc 1.
    # ECE = (1 * 0.5 + 1 * 0) / 2 = 0.25; MCE = 0.5
    assert expected_calibration_error(probs, np.array([1, 0]), num_bins=2) == pytest.approx(0.25)
    assert maximum_calibration_error(probs, np.array([1, 0]), num_bins=2) == pytest.approx(0.5)


def test_perfect_confident_predictions() -> None:
    probs = np.eye(3)
    labels = np.arange(3)
    assert expected_calibration_error(probs, labels) == 0.0
    assert maximum_calibration_error(probs, labels) == 0.0
    assert brier_score(probs, labels) == 0.0
    assert negative_log_likelihood(probs, labels) == 0.0
    assert accuracy(probs, labels) == 1.0


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(1, 80),
    num_classes=st.integers(2, 6),
    ties=st.booleans(),
    num_bins=st.integers(1, 20),
)
def test_ece_mce_against_loop(seed: int, num_samples: int, num_classes: int, ties: bool, num_bins: int) -> None:
    probs, labels = _random_inputs(seed, num_samples, num_classes, ties)
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    ece, mce = 0.0, 0.0
    edges = np.linspace(0, 1, num_bins + 1)
    for lower, upper in zip(edges[:-1], edges[1:], strict=True):
        members = [i for i in range(num_samples) if lower < confidence[i] <= upper]
        if members:
            gap = abs(np.mean(correct[members]) - np.mean(confidence[members]))
            ece += len(members) / num_samples * gap
            mce = max(mce, gap)
    assert expected_calibration_error(probs, labels, num_bins) == pytest.approx(ece, abs=1e-12)
    assert maximum_calibration_error(probs, labels, num_bins) == pytest.approx(mce, abs=1e-12)
    assert 0.0 <= expected_calibration_error(probs, labels, num_bins) <= mce + 1e-12 <= 1.0 + 1e-12
    assert reliability_diagram_data(probs, labels, num_bins).count.sum() == num_samples


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_samples=st.integers(2, 80), ties=st.booleans())
def test_binary_against_sklearn(seed: int, num_samples: int, ties: bool) -> None:
    probs, labels = _random_inputs(seed, num_samples, 2, ties)
    labels[:2] = [0, 1]  # log_loss needs both classes to infer the label set
    assert negative_log_likelihood(probs, labels) == pytest.approx(log_loss(labels, probs), abs=1e-9)
    # sklearn halves the binary Brier score by default; the sum-over-classes form is scale_by_half=False.
    expected = brier_score_loss(labels, probs[:, 1], scale_by_half=False)
    assert brier_score(probs, labels) == pytest.approx(expected, abs=1e-12)
    assert brier_score(probs, labels) == pytest.approx(2 * brier_score_loss(labels, probs[:, 1]), abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_samples=st.integers(1, 80), num_classes=st.integers(3, 6))
def test_multiclass_against_sklearn(seed: int, num_samples: int, num_classes: int) -> None:
    probs, labels = _random_inputs(seed, num_samples, num_classes, ties=False)
    classes = np.arange(num_classes)
    assert negative_log_likelihood(probs, labels) == pytest.approx(log_loss(labels, probs, labels=classes), abs=1e-9)
    assert brier_score(probs, labels) == pytest.approx(brier_score_loss(labels, probs, labels=classes), abs=1e-12)


@pytest.mark.parametrize(
    "metric",
    [accuracy, negative_log_likelihood, brier_score, expected_calibration_error, maximum_calibration_error],
)
def test_numpy_and_torch_inputs_agree(metric) -> None:
    probs, labels = _random_inputs(0, 50, 4, ties=False)
    probs32 = torch.tensor(probs, dtype=torch.float32)
    from_torch = metric(probs32, torch.tensor(labels))
    from_numpy = metric(probs32.numpy(), labels)
    assert isinstance(from_torch, float) and from_torch == from_numpy
    assert metric(torch.tensor(probs, requires_grad=True), torch.tensor(labels, dtype=torch.int32)) == metric(
        probs, labels
    )


def test_reliability_diagram_numpy_and_torch_agree() -> None:
    probs, labels = _random_inputs(1, 40, 3, ties=True)
    from_torch = reliability_diagram_data(torch.tensor(probs), torch.tensor(labels))
    from_numpy = reliability_diagram_data(probs, labels)
    for left, right in zip(from_torch, from_numpy, strict=True):
        np.testing.assert_array_equal(left, right)


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        (np.array([0.5, 0.5]), np.array([0]), "shape"),
        (np.zeros((0, 2)), np.zeros(0, dtype=int), "shape"),
        (np.array([[0.5, np.nan]]), np.array([0]), "NaN"),
        (np.array([[1.5, -0.5]]), np.array([0]), r"\[0, 1\]"),
        (np.array([[0.5, 0.4]]), np.array([0]), "sum to 1"),
        (np.array([[0.5, 0.5]]), np.array([0.0]), "integer"),
        (np.array([[0.5, 0.5]]), np.array([True]), "integer"),
        (np.array([[0.5, 0.5]]), np.array([2]), "labels in"),
        (np.array([[0.5, 0.5]]), np.array([-1]), "labels in"),
        (np.array([[0.5, 0.5]]), np.array([0, 1]), "shape"),
        (np.array([[0.5, 0.5]]), np.array([[0]]), "shape"),
        (np.array([["a", "b"]]), np.array([0]), "dtype"),
    ],
)
def test_bad_inputs_raise(probs: np.ndarray, labels: np.ndarray, match: str) -> None:
    for metric in (accuracy, negative_log_likelihood, brier_score, expected_calibration_error):
        with pytest.raises(ValueError, match=match):
            metric(probs, labels)


@pytest.mark.parametrize("num_bins", [0, -3, 2.5, True, 15.0, np.float64(15), np.bool_(True)])
def test_bad_num_bins_raise(num_bins) -> None:
    with pytest.raises(ValueError, match="num_bins"):
        expected_calibration_error(PROBS, LABELS, num_bins=num_bins)


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint8])
def test_numpy_integer_num_bins_equal_python_integers(integer) -> None:
    """A bin count read from a NumPy array (before: "expected a positive integer num_bins, got np.int64(5)")."""
    for kind in ("top_label", "classwise"):
        expected = expected_calibration_error(PROBS, LABELS, num_bins=5, kind=kind)
        assert expected_calibration_error(PROBS, LABELS, num_bins=integer(5), kind=kind) == expected
        assert maximum_calibration_error(PROBS, LABELS, num_bins=integer(5), kind=kind) == maximum_calibration_error(
            PROBS, LABELS, num_bins=5, kind=kind
        )
    diagram = reliability_diagram_data(PROBS, LABELS, num_bins=np.int64(5))
    np.testing.assert_array_equal(diagram.count, reliability_diagram_data(PROBS, LABELS, num_bins=5).count)


@pytest.mark.parametrize("eps", [2.0, 1.0, 0.0, -1e-3, float("nan"), float("inf"), "0.1", True])
def test_nll_eps_must_be_a_probability_floor(eps) -> None:
    """0 < eps < 1: a floor of 1 or more replaces every probability (before: eps=2.0 returned -log 2 = -0.693)."""
    with pytest.raises(ValueError, match=r"negative_log_likelihood: expected eps to be a finite number > 0 and < 1"):
        negative_log_likelihood(PROBS, LABELS, eps=eps)
    floor = 0.5  # above 0.3, the smallest true-class probability: -(ln 0.9 + ln 0.5 + ln 0.7 + ln 0.55) / 4
    expected = -(math.log(0.9) + math.log(0.5) + math.log(0.7) + math.log(0.55)) / 4
    assert negative_log_likelihood(PROBS, LABELS, eps=np.float32(floor)) == pytest.approx(expected, abs=1e-12)


def test_classwise_hand_computed() -> None:
    # num_bins=5, every class binned on its own probability; each cell holds one sample:
    #   class 0: p = 0.9, 0.7, 0.3, 0.55 with [y = 0] = 1, 0, 0, 1 -> gaps 0.1, 0.7, 0.3, 0.45 (sum 1.55)
    #   class 1: p = 0.1, 0.3, 0.7, 0.45 with [y = 1] = 0, 1, 1, 0 -> gaps 0.1, 0.7, 0.3, 0.45 (sum 1.55)
    # cwECE = 1/2 (1.55 / 4 + 1.55 / 4) = 0.3875; cwMCE = 0.7
    assert expected_calibration_error(PROBS, LABELS, num_bins=5, kind="classwise") == pytest.approx(0.3875, abs=1e-12)
    assert maximum_calibration_error(PROBS, LABELS, num_bins=5, kind="classwise") == pytest.approx(0.7, abs=1e-12)
    # the default is the top-label error
    assert expected_calibration_error(PROBS, LABELS, num_bins=5) == expected_calibration_error(
        PROBS, LABELS, num_bins=5, kind="top_label"
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(1, 60),
    num_classes=st.integers(2, 5),
    ties=st.booleans(),
    num_bins=st.integers(1, 20),
)
def test_classwise_against_loop(seed: int, num_samples: int, num_classes: int, ties: bool, num_bins: int) -> None:
    probs, labels = _random_inputs(seed, num_samples, num_classes, ties)
    edges = np.linspace(0, 1, num_bins + 1)
    total, worst = 0.0, 0.0
    for c in range(num_classes):
        for b, (lower, upper) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
            members = [i for i in range(num_samples) if lower < probs[i, c] <= upper or (b == 0 and probs[i, c] == 0)]
            if members:
                gap = abs(np.mean(labels[members] == c) - np.mean(probs[members, c]))
                total += len(members) / num_samples * gap
                worst = max(worst, gap)
    expected = total / num_classes
    assert expected_calibration_error(probs, labels, num_bins, kind="classwise") == pytest.approx(expected, abs=1e-12)
    assert maximum_calibration_error(probs, labels, num_bins, kind="classwise") == pytest.approx(worst, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_samples=st.integers(1, 200),
    num_classes=st.integers(2, 6),
    num_bins=st.sampled_from([1, 5, 10, 15, 20]),
)
def test_top_label_against_torchmetrics(seed: int, num_samples: int, num_classes: int, num_bins: int) -> None:
    probs, labels = _random_inputs(seed, num_samples, num_classes, ties=False)
    # torchmetrics closes its bins on the left and bins in float32: keep confidences away from the edges
    confidence = probs.max(axis=1)
    assume(np.abs(confidence[:, None] - np.linspace(0, 1, num_bins + 1)).min() > 1e-6)
    preds, target = torch.tensor(probs), torch.tensor(labels)
    for norm, ours in (("l1", expected_calibration_error), ("max", maximum_calibration_error)):
        reference = multiclass_calibration_error(preds, target, num_classes, n_bins=num_bins, norm=norm)
        assert ours(probs, labels, num_bins) == pytest.approx(float(reference), abs=1e-6)


@pytest.mark.parametrize("kind", ["marginal", "top-label", None])
def test_bad_kind_raises(kind) -> None:
    for metric in (expected_calibration_error, maximum_calibration_error):
        with pytest.raises(ValueError, match="kind"):
            metric(PROBS, LABELS, kind=kind)


# -- low-precision probabilities (issue 14) --------------------------------------------------------------------------
def test_row_sum_tolerance_follows_the_dtype() -> None:
    assert row_sum_tolerance(torch.bfloat16) == 4 * 2.0**-7
    assert row_sum_tolerance(torch.float16) == row_sum_tolerance(np.float16) == 4 * 2.0**-10
    for dtype in (torch.float32, torch.float64, np.float32, np.float64, torch.int64, np.int32):
        assert row_sum_tolerance(dtype) == 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("num_classes", [2, 10, 1000])
def test_low_precision_probabilities_are_accepted_and_exact(dtype, num_classes) -> None:
    # a softmax computed in bfloat16 has rows off by ~2e-3 (the old fixed 1e-4 rejected them); the metrics now take
    # them, computed in float64 on exactly the stored values, and close to the float64 softmax's metrics
    generator = torch.Generator().manual_seed(num_classes)
    logits = 3 * torch.randn(400, num_classes, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, num_classes, (400,), generator=generator)
    low = torch.softmax(logits.to(dtype), dim=-1)
    exact = torch.softmax(logits, dim=-1)
    worst = (low.double().sum(-1) - 1).abs().max().item()
    assert worst <= row_sum_tolerance(dtype) and (dtype == torch.float16 or worst > 1e-4 or num_classes == 2)
    stored = low.double()  # the float64 reference on the very values passed
    picked = stored[torch.arange(400), labels]
    assert negative_log_likelihood(low, labels) == pytest.approx(-picked.clamp_min(1e-12).log().mean().item(), 1e-12)
    assert accuracy(low, labels) == (stored.argmax(-1) == labels).double().mean().item()
    one_hot = torch.nn.functional.one_hot(labels, num_classes).double()
    assert brier_score(low, labels) == pytest.approx((stored - one_hot).pow(2).sum(-1).mean().item(), rel=1e-12)
    # against the float64 softmax: bfloat16 keeps 8 bits of every probability, float16 loses the tiny ones (below
    # its smallest subnormal, 6e-8) among 1000 classes
    assert negative_log_likelihood(low, labels) == pytest.approx(negative_log_likelihood(exact, labels), rel=5e-2)
    assert expected_calibration_error(low, labels) == pytest.approx(expected_calibration_error(exact, labels), abs=2e-2)


def test_low_precision_rows_that_do_not_sum_to_one_are_still_rejected() -> None:
    bad = torch.tensor([[0.6, 0.3], [0.5, 0.5]], dtype=torch.bfloat16)  # off by 0.1
    with pytest.raises(ValueError, match=r"sum to 1 within 0\.03125 \(for torch\.bfloat16 inputs\), got a row off"):
        negative_log_likelihood(bad, torch.tensor([0, 1]))
    off = torch.tensor([[0.5005, 0.5]], dtype=torch.float32)  # float32: the 1e-4 tolerance stays
    with pytest.raises(ValueError, match=r"sum to 1 within 0\.0001 \(for torch\.float32 inputs\)"):
        accuracy(off, torch.tensor([0]))


def test_unsigned_labels_are_range_checked_before_the_cast() -> None:
    # uint64 labels of 2**63 and more wrapped to negative in the int64 cast before the range check, so the error named
    # a value that was not passed; in-range unsigned labels give scikit-learn's numbers
    from sklearn.metrics import accuracy_score

    big = np.array([0, 2**63 + 5, 1, 0], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"got values in \[0, 9223372036854775813\]"):
        accuracy(PROBS, big)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64, np.int8):
        labels = LABELS.astype(dtype)
        assert accuracy(PROBS, labels) == accuracy_score(LABELS, PROBS.argmax(1)) == 0.75
        assert brier_score(PROBS, labels) == pytest.approx(2 * brier_score_loss(LABELS == 1, PROBS[:, 1]), rel=1e-12)
        assert negative_log_likelihood(PROBS, labels) == pytest.approx(log_loss(LABELS, PROBS), rel=1e-12)
