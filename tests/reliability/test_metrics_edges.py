"""The classification metrics at their edges (ties on bin edges and in rankings, one example, one class, exact zeros,
row sums off by rounding, low-precision and NumPy inputs, 2e5 examples, invariances) against hand computations,
scikit-learn, torchmetrics and the ``uncertainty-calibration`` package (module ``calibration``), and the way the
comparison's evaluation feeds them (:mod:`gpattn.comparison.evaluation`).

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from calibration.utils import get_equal_bins, get_equal_prob_bins, lower_bound_scaling_ce
from scipy import optimize
from scipy import stats as scipy_stats
from sklearn.metrics import average_precision_score, brier_score_loss, log_loss, roc_auc_score, roc_curve

import gpattn.integrations  # noqa: F401  (before torchmetrics: makes torchvision importable beside this torch)
from gpattn import metrics as M
from gpattn.comparison.evaluation import classification_metrics, per_example_predictions
from gpattn.comparison.statistics import paired_difference
from gpattn.models import fit_temperature
from gpattn.validation import InputTypeError


# -- helpers -----------------------------------------------------------------------------------------------------------
def _torchmetrics_ece(probs: np.ndarray, labels: np.ndarray, num_bins: int, norm: str = "l1") -> float:
    from torchmetrics.functional.classification import multiclass_calibration_error

    value = multiclass_calibration_error(
        torch.from_numpy(probs), torch.from_numpy(labels), probs.shape[1], n_bins=num_bins, norm=norm
    )
    return float(value)


def _binary(confidence) -> np.ndarray:
    """Rows ``[c, 1 - c]``: class 0 predicted (for c >= 0.5), with confidence c."""
    confidence = np.asarray(confidence, dtype=np.float64)
    return np.stack([confidence, 1.0 - confidence], axis=1)


def _softmax_rows(rng: np.random.Generator, n: int, num_classes: int, scale: float = 2.0) -> np.ndarray:
    logits = rng.normal(size=(n, num_classes)) * scale
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def _reference_ece(probs: np.ndarray, labels: np.ndarray, num_bins: int) -> tuple[float, float]:
    """Top-label ECE and MCE on right-closed bins (e_b, e_{b+1}] of numpy.linspace edges, by np.digitize (float64)."""
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    bins = np.digitize(confidence, np.linspace(0.0, 1.0, num_bins + 1)[1:-1], right=True)
    ece, mce = 0.0, 0.0
    for b in np.unique(bins):
        inside = bins == b
        gap = abs(correct[inside].mean() - confidence[inside].mean())
        ece += inside.sum() / labels.shape[0] * gap
        mce = max(mce, gap)
    return ece, mce


def _reference_calibration_ece(probs: np.ndarray, labels: np.ndarray, num_bins: int, mode: str) -> float:
    """The ``calibration`` package's l1 ECE on equal-width right-closed bins with edges i / B (top-label or
    marginal = classwise)."""
    return float(
        lower_bound_scaling_ce(
            probs, labels, p=1, debias=False, num_bins=num_bins, binning_scheme=get_equal_prob_bins, mode=mode
        )
    )


def _all_scalar_metrics(probs, labels) -> dict[str, float]:
    return {
        "accuracy": M.accuracy(probs, labels),
        "nll": M.negative_log_likelihood(probs, labels),
        "brier": M.brier_score(probs, labels),
        "ece": M.expected_calibration_error(probs, labels),
        "mce": M.maximum_calibration_error(probs, labels),
        "cw_ece": M.expected_calibration_error(probs, labels, kind="classwise"),
        "cw_mce": M.maximum_calibration_error(probs, labels, kind="classwise"),
        "debiased": M.debiased_calibration_error(probs, labels),
        "debiased_sq": M.debiased_calibration_error(probs, labels, squared=True),
        "cw_debiased": M.debiased_calibration_error(probs, labels, kind="classwise"),
        "sweep": M.sweep_calibration_error(probs, labels),
        "cw_sweep": M.sweep_calibration_error(probs, labels, kind="classwise"),
        "aurc": M.aurc(probs, labels),
        "eaurc": M.eaurc(probs, labels),
        "auroc": M.misclassification_auroc(probs, labels),
        "fpr95": M.fpr_at_95_tpr(probs, labels),
    }


def _assert_same(left: dict[str, float], right: dict[str, float], rel: float = 0.0, abs_: float = 0.0) -> None:
    assert left.keys() == right.keys()
    for name in left:
        a, b = left[name], right[name]
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), name
        else:
            assert a == pytest.approx(b, rel=rel, abs=abs_), name


# -- equal-width bins: edges and ties ----------------------------------------------------------------------------------
def test_ece_bins_are_right_closed_at_exact_edges() -> None:
    # B = 2, bins (0, 0.5] and (0.5, 1]: confidences 0.5, 0.5 (both correct) -> bin 0, gap |1 - 0.5| = 0.5;
    # 1.0 (correct), 0.75 (wrong) -> bin 1, mean confidence 0.875, accuracy 0.5, gap 0.375;
    # ECE = 2/4 * 0.5 + 2/4 * 0.375 = 0.4375, MCE = 0.5.
    probs, labels = _binary([0.5, 0.5, 1.0, 0.75]), np.array([0, 0, 0, 1])
    assert M.expected_calibration_error(probs, labels, num_bins=2) == pytest.approx(0.4375, abs=1e-15)
    assert M.maximum_calibration_error(probs, labels, num_bins=2) == pytest.approx(0.5, abs=1e-15)
    diagram = M.reliability_diagram_data(probs, labels, num_bins=2)
    np.testing.assert_array_equal(diagram.count, [2, 2])
    np.testing.assert_allclose(diagram.confidence, [0.5, 0.875], atol=1e-15)
    np.testing.assert_allclose(diagram.accuracy, [1.0, 0.5], atol=1e-15)
    # the calibration package bins right-closed too (edges i / B, bisect_left)
    assert _reference_calibration_ece(probs, labels, 2, "top-label") == pytest.approx(0.4375, abs=1e-15)
    # torchmetrics closes its bins on the left: [0.5, 1) holds 0.5, 0.5, 0.75 (confidence 7/12, accuracy 2/3) and 1.0
    # gets a bin of its own (gap 0): ECE 3/4 * 1/12 = 0.0625, a legitimately different convention (docstring)
    assert _torchmetrics_ece(probs, labels, 2) == pytest.approx(0.0625, abs=1e-7)


def test_ece_confidences_at_multiples_of_one_fifteenth() -> None:
    # fl(k / 15), k = 8 .. 15, one sample each: bin k - 1 of the 15 right-closed bins (numpy.linspace's edges equal
    # fl(k / 15) for B = 15), every sample correct: ECE = mean (1 - k / 15)
    ks = np.arange(8, 16)
    probs, labels = _binary(ks / 15.0), np.zeros(8, dtype=np.int64)
    diagram = M.reliability_diagram_data(probs, labels, num_bins=15)
    expected_count = np.zeros(15, dtype=np.int64)
    expected_count[ks - 1] = 1
    np.testing.assert_array_equal(diagram.count, expected_count)
    expected = float(np.mean(1.0 - ks / 15.0))
    assert M.expected_calibration_error(probs, labels) == pytest.approx(expected, abs=1e-15)
    assert _reference_calibration_ece(probs, labels, 15, "top-label") == pytest.approx(expected, abs=1e-15)


def test_ece_edges_are_numpy_linspace_as_documented() -> None:
    # The docstring defines the edges as numpy.linspace(0, 1, B + 1); for B = 10 its edge e_3 = 3 * 0.1 is
    # 0.30000000000000004, one ulp above fl(0.3). A confidence equal to that float (e.g. 1 - 0.7) lies above 3 / 10
    # in exact arithmetic, yet falls in the bin (0.2, 0.3] under the documented edges; the calibration package (edges
    # i / B) puts it in (0.3, 0.4]. Pinned here as documented; only values within an ulp of an edge are affected.
    value = 1.0 - 0.7
    assert value == np.linspace(0.0, 1.0, 11)[3] and value > 0.3
    probs = np.array([[value, 0.25, 0.25, 1.0 - value - 0.5]])
    diagram = M.reliability_diagram_data(probs, np.array([0]), num_bins=10)
    assert int(np.flatnonzero(diagram.count)[0]) == 2
    from calibration.utils import fast_bin

    reference_bin = [len(b) for b in fast_bin([(value, 1)], get_equal_prob_bins([value], 10))].index(1)
    assert reference_bin == 3


def test_ece_many_ties_at_one_half() -> None:
    # 1000 rows [0.5, 0.5]: prediction class 0 (first maximum), confidence 0.5 (bin (7/15, 8/15]); with a fraction
    # q of labels 0, the accuracy is q: ECE = MCE = |q - 0.5|. Classwise: class 0's outcomes have mean q, class 1's
    # 1 - q, both with mean probability 0.5: cwECE = |q - 0.5|.
    rng = np.random.default_rng(0)
    labels = (rng.uniform(size=1000) < 0.3).astype(np.int64) ^ 1  # about 70 % zeros
    q = float((labels == 0).mean())
    probs = np.full((1000, 2), 0.5)
    for kind in ("top_label", "classwise"):
        assert M.expected_calibration_error(probs, labels, kind=kind) == pytest.approx(abs(q - 0.5), abs=1e-14)
        assert M.maximum_calibration_error(probs, labels, kind=kind) == pytest.approx(abs(q - 0.5), abs=1e-14)
    assert M.reliability_diagram_data(probs, labels).count[7] == 1000


def test_ece_ties_at_one_against_torchmetrics() -> None:
    # Many one-hot rows (confidence exactly 1.0, some wrong) beside confidences 0.62 (away from the edges 9/15 and
    # 10/15): the bin (14/15, 1] holds only the 1.0s, so torchmetrics' left-closed bins (1.0 alone) agree.
    probs = np.concatenate([np.tile([[1.0, 0.0, 0.0]], (40, 1)), np.tile([[0.62, 0.3, 0.08]], (25, 1))])
    labels = np.r_[np.zeros(33), np.ones(7), np.zeros(15), np.full(10, 2)].astype(np.int64)
    # 1.0 bin: 40 samples, accuracy 33/40, gap 7/40; 0.62 bin: 25 samples, accuracy 15/25 = 0.6, gap 0.02
    expected = 40 / 65 * 7 / 40 + 25 / 65 * 0.02
    assert M.expected_calibration_error(probs, labels) == pytest.approx(expected, abs=1e-14)
    assert M.expected_calibration_error(probs, labels) == pytest.approx(_torchmetrics_ece(probs, labels, 15), abs=1e-7)
    assert M.maximum_calibration_error(probs, labels) == pytest.approx(7 / 40, abs=1e-14)
    assert M.maximum_calibration_error(probs, labels) == pytest.approx(
        _torchmetrics_ece(probs, labels, 15, norm="max"), abs=1e-7
    )


@pytest.mark.parametrize("num_bins", [2, 4, 15])
def test_ece_on_quantised_probabilities_against_calibration_package(num_bins: int) -> None:
    # Probabilities on the grid k / (2B) (many exactly on edges, zeros and ones), C = 3; the calibration package's
    # equal-width right-closed bins (edges i / B, which equal numpy.linspace's for these B): top-label and classwise.
    rng = np.random.default_rng(num_bins)
    grid = np.arange(2 * num_bins + 1) / (2 * num_bins)
    for _ in range(30):
        first = rng.choice(grid, size=40)
        second = rng.choice(grid, size=40) * (1.0 - first)
        probs = np.clip(np.stack([first, second, 1.0 - first - second], axis=1), 0.0, 1.0)
        labels = rng.integers(0, 3, size=40)
        assert M.expected_calibration_error(probs, labels, num_bins) == pytest.approx(
            _reference_calibration_ece(probs, labels, num_bins, "top-label"), abs=1e-13
        )
        assert M.expected_calibration_error(probs, labels, num_bins, kind="classwise") == pytest.approx(
            _reference_calibration_ece(probs, labels, num_bins, "marginal"), abs=1e-13
        )


def test_ece_thousand_classes_against_torchmetrics_and_calibration_package() -> None:
    rng = np.random.default_rng(3)
    probs = _softmax_rows(rng, 300, 1000, scale=3.0)
    labels = rng.integers(0, 1000, size=300)
    labels[:100] = probs[:100].argmax(axis=1)  # some correct predictions
    ece, mce = _reference_ece(probs, labels, 15)
    assert M.expected_calibration_error(probs, labels) == pytest.approx(ece, abs=1e-13)
    assert M.maximum_calibration_error(probs, labels) == pytest.approx(mce, abs=1e-13)
    assert M.expected_calibration_error(probs, labels) == pytest.approx(_torchmetrics_ece(probs, labels, 15), abs=1e-6)
    assert M.expected_calibration_error(probs, labels, kind="classwise") == pytest.approx(
        _reference_calibration_ece(probs, labels, 15, "marginal"), abs=1e-13
    )


def test_classwise_with_a_single_class_present() -> None:
    # C = 3, every label 0: classes 1 and 2 have outcome 0 everywhere; against the calibration package's marginal ECE
    rng = np.random.default_rng(4)
    probs = _softmax_rows(rng, 60, 3)
    labels = np.zeros(60, dtype=np.int64)
    assert M.expected_calibration_error(probs, labels, kind="classwise") == pytest.approx(
        _reference_calibration_ece(probs, labels, 15, "marginal"), abs=1e-13
    )
    # classwise MCE: the largest |mean outcome - mean probability| over classes and bins, by a loop
    edges = np.linspace(0.0, 1.0, 16)[1:-1]
    gaps = []
    for c in range(3):
        bins = np.searchsorted(edges, probs[:, c], side="left")
        for b in np.unique(bins):
            inside = bins == b
            gaps.append(abs((labels[inside] == c).mean() - probs[inside, c].mean()))
    assert M.maximum_calibration_error(probs, labels, kind="classwise") == pytest.approx(max(gaps), abs=1e-14)


# -- one class, one example, all correct / all wrong -------------------------------------------------------------------
def test_one_class() -> None:
    probs, labels = np.ones((4, 1)), np.zeros(4, dtype=np.int64)
    values = _all_scalar_metrics(probs, labels)
    for name in ("nll", "brier", "ece", "mce", "cw_ece", "cw_mce", "debiased", "cw_debiased", "sweep", "aurc", "eaurc"):
        assert values[name] == 0.0, name
    assert values["accuracy"] == 1.0
    assert math.isnan(values["auroc"]) and math.isnan(values["fpr95"])  # documented: undefined with one outcome
    # OOD scores of one class: every score ties -> AUROC 0.5, AUPR-In n_in / n, FPR@95 1 (ties accepted together)
    assert M.ood_auroc(probs, np.ones((2, 1))) == 0.5
    assert M.ood_aupr(probs, np.ones((2, 1))) == pytest.approx(4 / 6, abs=1e-15)
    assert M.ood_fpr_at_95_tpr(probs, np.ones((2, 1))) == 1.0


@pytest.mark.parametrize("label", [0, 1])
def test_one_example(label: int) -> None:
    probs, labels = np.array([[0.7, 0.3]]), np.array([label])
    gap = 0.3 if label == 0 else 0.7
    values = _all_scalar_metrics(probs, labels)
    for name in ("ece", "mce", "cw_ece", "cw_mce", "sweep", "cw_sweep"):
        assert values[name] == pytest.approx(gap, abs=1e-15), name
    assert values["brier"] == pytest.approx(2 * gap**2, abs=1e-15)
    assert values["nll"] == pytest.approx(-math.log(probs[0, label]), abs=1e-15)
    assert values["aurc"] == (0.0 if label == 0 else 1.0)
    assert values["eaurc"] == 0.0
    # one equal-mass bin of one example: the variance estimate needs two, so the bin contributes 0 (reference too)
    assert values["debiased"] == 0.0 and values["debiased_sq"] == 0.0
    assert float(lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=15, mode="top-label")) == 0.0


@pytest.mark.parametrize("all_correct", [True, False])
def test_all_correct_or_all_wrong(all_correct: bool) -> None:
    rng = np.random.default_rng(5)
    probs = _softmax_rows(rng, 200, 4)
    predicted = probs.argmax(axis=1)
    labels = predicted if all_correct else (predicted + 1) % 4
    confidence = probs.max(axis=1)
    # every gap has the same sign: ECE = |accuracy - mean confidence| overall
    expected = 1.0 - confidence.mean() if all_correct else confidence.mean()
    assert M.expected_calibration_error(probs, labels) == pytest.approx(expected, abs=1e-14)
    assert M.aurc(probs, labels) == (0.0 if all_correct else 1.0)
    assert M.eaurc(probs, labels) == 0.0
    assert math.isnan(M.misclassification_auroc(probs, labels)) and math.isnan(M.fpr_at_95_tpr(probs, labels))


# -- inputs: row sums, zeros, dtypes, labels, views, size -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_summing_to_one_minus_1e7_are_accepted(dtype) -> None:
    probs = np.array([[0.6, 0.4 - 1e-7], [1.0 - 1e-7, 0.0], [0.25, 0.75]], dtype=dtype)
    labels = np.array([0, 1, 1])
    values = probs.astype(np.float64)
    one_hot = np.eye(2)[labels]
    assert M.brier_score(probs, labels) == pytest.approx(float(((values - one_hot) ** 2).sum(axis=1).mean()), abs=0)
    # the true class of row 1 has probability 0: floored at 1e-12
    expected_nll = -(math.log(values[0, 0]) + math.log(1e-12) + math.log(values[2, 1])) / 3
    assert M.negative_log_likelihood(probs, labels) == pytest.approx(expected_nll, rel=1e-15)


def test_rows_off_by_more_than_the_tolerance_are_refused_clearly() -> None:
    probs = np.array([[0.6, 0.4 - 2e-4]], dtype=np.float32)
    with pytest.raises(ValueError, match=r"sum to 1 within 0\.0001.*dim=-1"):
        M.expected_calibration_error(probs, np.array([0]))
    # float16 gets 4 eps = 0.0039 (documented), so the same row is accepted there
    assert M.accuracy(probs.astype(np.float16), np.array([0])) == 1.0


def test_nll_with_exact_zeros_and_against_sklearn() -> None:
    probs = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    labels = np.array([1, 2, 2])
    expected = (-math.log(1e-12) - math.log(0.5) - 0.0) / 3
    assert M.negative_log_likelihood(probs, labels) == pytest.approx(expected, rel=1e-15)
    records = per_example_predictions(probs, labels)
    assert records["test_nll"] == pytest.approx([-math.log(1e-12), -math.log(0.5), 0.0], rel=1e-15)
    assert float(np.mean(records["test_nll"])) == M.negative_log_likelihood(probs, labels)
    # without zeros sklearn's log_loss (which clips at float64's eps, not 1e-12) agrees
    rng = np.random.default_rng(6)
    probs = _softmax_rows(rng, 50, 5)
    labels = rng.integers(0, 5, size=50)
    assert M.negative_log_likelihood(probs, labels) == pytest.approx(
        log_loss(labels, probs, labels=range(5)), rel=1e-12
    )
    assert M.brier_score(probs, labels) == pytest.approx(
        float(((probs - np.eye(5)[labels]) ** 2).sum(axis=1).mean()), rel=1e-14
    )


def test_binary_brier_against_sklearn() -> None:
    rng = np.random.default_rng(7)
    probs = _binary(rng.choice([0.0, 0.5, 0.75, 1.0], size=40))
    labels = rng.integers(0, 2, size=40)
    # sum over classes = twice sklearn's binary default; sklearn's y_proba is the probability of class 1
    assert M.brier_score(probs, labels) == pytest.approx(2 * brier_score_loss(labels, probs[:, 1]), abs=1e-15)


@pytest.mark.parametrize(
    "cast",
    [
        lambda p: p.astype(np.float16),
        lambda p: p.astype(np.float32),
        lambda p: torch.from_numpy(p).to(torch.float16),
        lambda p: torch.from_numpy(p).to(torch.bfloat16),
        lambda p: torch.from_numpy(p).to(torch.float32),
        lambda p: torch.from_numpy(p),
    ],
    ids=["np16", "np32", "torch16", "bf16", "torch32", "torch64"],
)
def test_low_precision_inputs_use_their_values_in_float64(cast) -> None:
    # Every metric of a low-precision input equals the metric of its values cast exactly to float64 (no
    # renormalisation), computed here by independent references.
    rng = np.random.default_rng(8)
    probs = _softmax_rows(rng, 200, 5)
    labels = rng.integers(0, 5, size=200)
    low = cast(probs)
    values = (low.to(torch.float64).numpy() if isinstance(low, torch.Tensor) else low.astype(np.float64)).copy()
    ece, mce = _reference_ece(values, labels, 15)
    assert M.expected_calibration_error(low, labels) == pytest.approx(ece, abs=1e-14)
    assert M.maximum_calibration_error(low, labels) == pytest.approx(mce, abs=1e-14)
    one_hot = np.eye(5)[labels]
    assert M.brier_score(low, labels) == pytest.approx(float(((values - one_hot) ** 2).sum(axis=1).mean()), abs=1e-14)
    true_class = values[np.arange(200), labels]
    assert M.negative_log_likelihood(low, labels) == pytest.approx(float(-np.log(true_class).mean()), rel=1e-14)
    correct = values.argmax(axis=1) == labels
    assert M.misclassification_auroc(low, labels) == pytest.approx(
        roc_auc_score(correct, values.max(axis=1)), abs=1e-14
    )


def test_numpy_and_torch_float16_agree_exactly() -> None:
    rng = np.random.default_rng(9)
    probs = _softmax_rows(rng, 100, 4).astype(np.float16)
    labels = rng.integers(0, 4, size=100)
    _assert_same(_all_scalar_metrics(probs, labels), _all_scalar_metrics(torch.from_numpy(probs), labels))


def test_label_dtypes_and_containers_give_identical_results() -> None:
    rng = np.random.default_rng(10)
    probs = _softmax_rows(rng, 80, 4)
    labels = rng.integers(0, 4, size=80)
    reference = _all_scalar_metrics(probs, labels)
    variants = [
        labels.astype(np.int32),
        labels.astype(np.uint8),
        labels.astype(np.int8),
        labels.astype(np.uint64),
        torch.from_numpy(labels).to(torch.int32),
        torch.from_numpy(labels).to(torch.uint8),
        labels.tolist(),
    ]
    for variant in variants:
        _assert_same(_all_scalar_metrics(probs, variant), reference)
        _assert_same(_all_scalar_metrics(torch.from_numpy(probs), variant), reference)


def test_float_and_bool_labels_are_refused_with_the_argument_named() -> None:
    probs = _binary([0.7, 0.6])
    for labels in (np.array([0.0, 1.0]), torch.tensor([0.0, 1.0]), np.array([True, False])):
        with pytest.raises(InputTypeError, match="labels"):
            M.expected_calibration_error(probs, labels)
    with pytest.raises(ValueError, match=r"labels in \[0, C - 1\] = \[0, 1\]"):
        M.expected_calibration_error(probs, np.array([0, 2]))


def test_grad_tracking_and_non_contiguous_tensors() -> None:
    rng = np.random.default_rng(11)
    probs = _softmax_rows(rng, 60, 3)
    labels = rng.integers(0, 3, size=60)
    reference = _all_scalar_metrics(probs, labels)
    transposed = torch.tensor(probs.T.copy(), requires_grad=True).T  # non-contiguous, tracks gradients
    assert not transposed.is_contiguous() and transposed.requires_grad
    _assert_same(_all_scalar_metrics(transposed, torch.from_numpy(labels)), reference)
    padded = torch.zeros(120, 3, dtype=torch.float64)
    padded[::2] = torch.from_numpy(probs)
    strided_labels = torch.zeros(120, dtype=torch.int64)
    strided_labels[::2] = torch.from_numpy(labels)
    _assert_same(_all_scalar_metrics(padded[::2], strided_labels[::2]), reference)
    _assert_same(_all_scalar_metrics(np.asfortranarray(probs), labels[::-1].copy()[::-1]), reference)
    # OOD and Monte Carlo metrics of the same views
    assert M.ood_auroc(transposed[:30], transposed[30:]) == M.ood_auroc(probs[:30], probs[30:])
    stacked = np.stack([probs, probs[::-1]])  # (T=2, n, C)
    samples = torch.tensor(stacked.transpose(1, 0, 2).copy(), requires_grad=True).transpose(0, 1)  # a view
    assert not samples.is_contiguous()
    np.testing.assert_array_equal(M.mutual_information(samples), M.mutual_information(stacked))


def test_two_hundred_thousand_examples_against_the_references() -> None:
    rng = np.random.default_rng(12)
    n = 2 * 10**5
    confidence = rng.uniform(0.5, 1.0, size=n)
    probs = _binary(confidence)
    labels = (rng.uniform(size=n) > 0.9 * confidence).astype(np.int64)
    ece = M.expected_calibration_error(probs, labels)
    mce = M.maximum_calibration_error(probs, labels)
    diagram = M.reliability_diagram_data(probs, labels)
    auroc = M.misclassification_auroc(probs, labels)
    aurc = M.aurc(probs, labels)
    debiased = M.debiased_calibration_error(probs, labels)
    sweep = M.sweep_calibration_error(probs, labels)
    reference_ece, reference_mce = _reference_ece(probs, labels, 15)
    assert ece == pytest.approx(reference_ece, abs=1e-12) and mce == pytest.approx(reference_mce, abs=1e-12)
    # torchmetrics accumulates in float32 here: 1e-5
    assert ece == pytest.approx(_torchmetrics_ece(probs, labels, 15), abs=1e-5)
    assert int(diagram.count.sum()) == n
    assert auroc == pytest.approx(roc_auc_score(labels == 0, confidence), abs=1e-12)
    correct = labels == 0
    risk = np.cumsum(~correct[np.argsort(-confidence, kind="stable")]) / np.arange(1, n + 1)
    assert aurc == pytest.approx(float(risk.mean()), abs=1e-12)
    assert 0.0 <= debiased <= ece + 0.01 and 0.0 <= sweep <= 1.0


def test_out_of_range_error_names_the_offending_value() -> None:
    probs = np.array([[np.nextafter(np.float32(1.0), np.float32(2.0)), 0.0]], dtype=np.float32)
    with pytest.raises(ValueError) as error:
        M.accuracy(probs, np.array([0]))
    assert "1.0000001" in str(error.value)


def test_out_of_range_below_zero_is_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"\[-1e-09, 1\.000000001\]"):
        M.brier_score(np.array([[1.0 + 1e-9, -1e-9]]), np.array([0]))


# -- invariances ----------------------------------------------------------------------------------------------------
def _distinct_confidence_data(seed: int, n: int = 120, num_classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    probs = _softmax_rows(rng, n, num_classes)
    labels = np.where(rng.uniform(size=n) < probs.max(axis=1), probs.argmax(axis=1), rng.integers(0, num_classes, n))
    return probs, labels


def test_permuting_examples_changes_nothing() -> None:
    probs, labels = _distinct_confidence_data(13)
    order = np.random.default_rng(0).permutation(probs.shape[0])
    _assert_same(_all_scalar_metrics(probs[order], labels[order]), _all_scalar_metrics(probs, labels), rel=1e-12)
    rng = np.random.default_rng(1)
    tied = _binary(rng.choice([0.5, 0.7, 0.9, 1.0], size=100))
    tied_labels = rng.integers(0, 2, size=100)
    order = rng.permutation(100)
    # rank-based scores with average ranks are exactly invariant, also with ties
    assert M.misclassification_auroc(tied[order], tied_labels[order]) == M.misclassification_auroc(tied, tied_labels)
    assert M.fpr_at_95_tpr(tied[order], tied_labels[order]) == M.fpr_at_95_tpr(tied, tied_labels)
    inside, outside = tied[:40], tied[40:]
    shuffled_in, shuffled_out = inside[rng.permutation(40)], outside[rng.permutation(60)]
    for score in ("max_prob", "entropy"):
        assert M.ood_auroc(shuffled_in, shuffled_out, score) == M.ood_auroc(inside, outside, score)
        assert M.ood_aupr(shuffled_in, shuffled_out, score) == M.ood_aupr(inside, outside, score)
        assert M.ood_fpr_at_95_tpr(shuffled_in, shuffled_out, score) == M.ood_fpr_at_95_tpr(inside, outside, score)


def test_duplicating_the_data_set() -> None:
    probs, labels = _distinct_confidence_data(14)
    twice_probs, twice_labels = np.concatenate([probs, probs]), np.concatenate([labels, labels])
    for kind in ("top_label", "classwise"):
        assert M.expected_calibration_error(twice_probs, twice_labels, kind=kind) == pytest.approx(
            M.expected_calibration_error(probs, labels, kind=kind), rel=1e-13
        )
        assert M.maximum_calibration_error(twice_probs, twice_labels, kind=kind) == pytest.approx(
            M.maximum_calibration_error(probs, labels, kind=kind), rel=1e-13
        )
    once, twice = M.reliability_diagram_data(probs, labels), M.reliability_diagram_data(twice_probs, twice_labels)
    np.testing.assert_array_equal(twice.count, 2 * once.count)
    np.testing.assert_allclose(twice.confidence, once.confidence, rtol=1e-14)
    np.testing.assert_allclose(twice.accuracy, once.accuracy, rtol=1e-14)
    # ranking scores: exactly invariant (ties between a sample and its copy count half on both sides)
    assert M.misclassification_auroc(twice_probs, twice_labels) == M.misclassification_auroc(probs, labels)
    assert M.ood_auroc(np.concatenate([probs[:50]] * 2), np.concatenate([probs[50:]] * 2)) == M.ood_auroc(
        probs[:50], probs[50:]
    )
    assert M.ood_aupr(np.concatenate([probs[:50]] * 2), np.concatenate([probs[50:]] * 2)) == pytest.approx(
        M.ood_aupr(probs[:50], probs[50:]), rel=1e-14
    )
    assert M.ood_fpr_at_95_tpr(np.concatenate([probs[:50]] * 2), np.concatenate([probs[50:]] * 2)) == (
        M.ood_fpr_at_95_tpr(probs[:50], probs[50:])
    )


def test_relabelling_classes_consistently_changes_nothing() -> None:
    probs, labels = _distinct_confidence_data(15, num_classes=6)
    permutation = np.random.default_rng(2).permutation(6)  # class c becomes permutation[c]
    relabelled = np.empty_like(probs)
    relabelled[:, permutation] = probs
    names = ("cw_ece", "cw_mce", "cw_debiased", "cw_sweep", "brier", "nll", "accuracy", "ece", "mce", "aurc")
    before = _all_scalar_metrics(probs, labels)
    after = _all_scalar_metrics(relabelled, permutation[labels])
    for name in names:
        assert after[name] == pytest.approx(before[name], rel=1e-12, abs=1e-15), name
    np.testing.assert_allclose(M.predictive_entropy(relabelled), M.predictive_entropy(probs), rtol=0, atol=0)


def test_argmax_ties_go_to_the_first_class_as_documented() -> None:
    # [0.5, 0.5] predicts class 0: relabelling the two classes turns a wrong prediction into a correct one for the
    # top-label metrics (documented), while the classwise ECE is unchanged
    probs, labels = np.array([[0.5, 0.5], [0.9, 0.1]]), np.array([1, 0])
    assert M.accuracy(probs, labels) == 0.5
    # swapped classes: row 1 becomes [0.5, 0.5] with label 0 (now correct), row 2 [0.1, 0.9] with label 1 (correct)
    assert M.accuracy(probs[:, ::-1], 1 - labels) == 1.0
    assert M.accuracy(np.array([[0.5, 0.5]]), np.array([0])) == 1.0
    assert M.expected_calibration_error(probs, labels, kind="classwise") == pytest.approx(
        M.expected_calibration_error(probs[:, ::-1].copy(), 1 - labels, kind="classwise"), abs=1e-15
    )


# -- OOD detection ----------------------------------------------------------------------------------------------------
def test_ood_equal_scores_in_and_out() -> None:
    probs_in, probs_out = _binary([0.6] * 3), _binary([0.6] * 5)
    assert M.ood_auroc(probs_in, probs_out) == 0.5
    assert M.ood_aupr(probs_in, probs_out) == pytest.approx(3 / 8, abs=1e-15)
    assert M.ood_aupr(probs_in, probs_out, positive="out") == pytest.approx(5 / 8, abs=1e-15)
    assert M.ood_fpr_at_95_tpr(probs_in, probs_out) == 1.0
    is_in, scores = np.r_[np.ones(3), np.zeros(5)], np.full(8, 0.6)
    assert roc_auc_score(is_in, scores) == 0.5
    assert average_precision_score(is_in, scores) == pytest.approx(3 / 8, abs=1e-15)


@pytest.mark.parametrize("score", ["max_prob", "entropy"])
def test_ood_ties_against_sklearn(score: str) -> None:
    rng = np.random.default_rng(16)
    # rows from a few vectors and their permutations: max probabilities and entropies tie across in and out
    base = np.array([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.4, 0.4, 0.2]])
    for _ in range(20):
        rows = base[rng.integers(0, 4, size=30)]
        rows = np.take_along_axis(rows, np.argsort(rng.uniform(size=rows.shape), axis=1), axis=1)
        probs_in, probs_out = rows[:12], rows[12:]
        values = rows.max(axis=1) if score == "max_prob" else np.array([-scipy_stats.entropy(r) for r in rows])
        values = np.round(values, 12)  # the reference's own rounding must not split ties
        is_in = np.r_[np.ones(12, dtype=bool), np.zeros(18, dtype=bool)]
        assert M.ood_auroc(probs_in, probs_out, score) == pytest.approx(roc_auc_score(is_in, values), abs=1e-14)
        assert M.ood_aupr(probs_in, probs_out, score) == pytest.approx(
            average_precision_score(is_in, values), abs=1e-14
        )
        assert M.ood_aupr(probs_in, probs_out, score, positive="out") == pytest.approx(
            average_precision_score(~is_in, -values), abs=1e-14
        )
        fpr, tpr, _ = roc_curve(is_in, values, drop_intermediate=False)
        assert M.ood_fpr_at_95_tpr(probs_in, probs_out, score) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-15)


def test_ood_entropy_of_permuted_rows_ties_exactly() -> None:
    assert M.ood_auroc(np.array([[0.2, 0.3, 0.5]]), np.array([[0.5, 0.2, 0.3]]), score="entropy") == 0.5


def test_ood_one_in_distribution_sample() -> None:
    # n_in = 1: accepting 95 % of one sample accepts it: FPR = fraction of OOD scores >= its score
    probs_in, probs_out = _binary([0.8]), _binary([0.9, 0.8, 0.7, 0.6])
    assert M.ood_fpr_at_95_tpr(probs_in, probs_out) == 0.5
    assert M.ood_auroc(probs_in, probs_out) == pytest.approx((2 + 0.5) / 4, abs=1e-15)


# -- entropy and mutual information ---------------------------------------------------------------------------------
def test_mutual_information_closed_forms() -> None:
    disagree = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # (T=2, n=1, C=2)
    assert M.mutual_information(disagree)[0] == pytest.approx(math.log(2), abs=1e-15)
    assert M.expected_entropy(disagree)[0] == 0.0
    same = np.repeat(np.array([[[0.3, 0.7], [0.5, 0.5]]]), 4, axis=0)
    np.testing.assert_array_equal(M.mutual_information(same), [0.0, 0.0])
    np.testing.assert_array_equal(M.mutual_information(same[:1]), [0.0, 0.0])  # T = 1
    assert M.ood_auroc_mutual_information(same, same) == 0.5
    with pytest.raises(ValueError, match="T >= 2"):
        M.ood_auroc_mutual_information(same[:1], same)


def test_mutual_information_against_scipy_and_bounds() -> None:
    rng = np.random.default_rng(17)
    samples = np.stack([_softmax_rows(rng, 30, 5) for _ in range(3)])  # (T=3, n=30, C=5)
    samples[:, 0] = [1.0, 0.0, 0.0, 0.0, 0.0]  # a zero-probability column: 0 log 0 = 0
    total = np.array([scipy_stats.entropy(samples[:, i].mean(axis=0)) for i in range(30)])
    expected = np.array([np.mean([scipy_stats.entropy(samples[t, i]) for t in range(3)]) for i in range(30)])
    np.testing.assert_allclose(M.predictive_entropy(samples.mean(axis=0)), total, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(M.expected_entropy(samples), expected, rtol=1e-13, atol=1e-15)
    information = M.mutual_information(samples)
    np.testing.assert_allclose(information, np.maximum(total - expected, 0.0), rtol=1e-12, atol=1e-14)
    assert information[0] == 0.0 and np.all(information >= 0.0) and np.all(information <= math.log(3) + 1e-12)
    # the OOD score -MI against sklearn, ties (equal samples) included
    outside = np.stack([_softmax_rows(rng, 20, 5) for _ in range(3)])
    outside[:, :5] = outside[:1, :5]  # five inputs whose samples agree: MI exactly 0, tied with input 0
    scores = -np.r_[M.mutual_information(samples), M.mutual_information(outside)]
    is_in = np.r_[np.ones(30), np.zeros(20)]
    assert M.ood_auroc_mutual_information(samples, outside) == pytest.approx(roc_auc_score(is_in, scores), abs=1e-15)


# -- selective classification -----------------------------------------------------------------------------------------
def test_aurc_and_eaurc_hand_computed() -> None:
    # confidences 0.9, 0.8, 0.7, 0.6 with correct, wrong, correct, wrong: selective risks 0, 1/2, 1/3, 2/4;
    # the perfect ranking of 2 errors in 4: 0, 0, 1/3, 2/4
    probs, labels = _binary([0.9, 0.8, 0.7, 0.6]), np.array([0, 1, 0, 1])
    assert M.aurc(probs, labels) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 2) / 4, abs=1e-15)
    assert M.eaurc(probs, labels) == pytest.approx((1 / 2) / 4, abs=1e-15)


def test_aurc_endpoints() -> None:
    # coverage 1 is the plain error: n AURC(n) - (n - 1) AURC(n - 1 most confident) = error rate
    probs, labels = _distinct_confidence_data(18, n=200)
    order = np.argsort(-probs.max(axis=1))
    top = order[:-1]
    error = 1.0 - M.accuracy(probs, labels)
    difference = 200 * M.aurc(probs, labels) - 199 * M.aurc(probs[top], labels[top])
    assert difference == pytest.approx(error, abs=1e-12)
    # coverage 1/n: the most confident sample's 0/1 loss
    first = order[:1]
    assert M.aurc(probs[first], labels[first]) == 1.0 - M.accuracy(probs[first], labels[first])


def test_eaurc_perfect_ranking_and_geifman_continuous_limit() -> None:
    # a perfect ranking has E-AURC 0, and its AURC (the discrete optimum) exceeds the continuous limit
    # r + (1 - r) log(1 - r) by at most r / n (a right Riemann sum of an increasing function)
    for n, errors in [(10, 3), (100, 1), (1000, 250), (37, 37)]:
        confidence = np.linspace(0.99, 0.51, n)
        labels = np.r_[np.zeros(n - errors), np.ones(errors)].astype(np.int64)  # the least confident are wrong
        probs = _binary(confidence)
        assert M.eaurc(probs, labels) == 0.0
        r = errors / n
        continuous = r + (1 - r) * math.log(1 - r) if r < 1 else 1.0
        discrete = M.aurc(probs, labels)
        assert continuous - 1e-15 <= discrete <= continuous + r / n + 1e-15


def test_aurc_never_increases_when_an_error_moves_below_the_correct_predictions() -> None:
    # lowering a wrong prediction's confidence below every other (its top class kept) is a better ranking
    rng = np.random.default_rng(19)
    for seed in range(20):
        probs, labels = _distinct_confidence_data(100 + seed, n=60)
        wrong = np.flatnonzero(probs.argmax(axis=1) != labels)
        index = wrong[rng.integers(wrong.size)]
        num_classes = probs.shape[1]
        low = (probs.max(axis=1).min() + 1.0 / num_classes) / 2  # in (1 / C, every confidence)
        moved = probs.copy()
        moved[index] = (1.0 - low) / (num_classes - 1)
        moved[index, probs[index].argmax()] = low
        assert M.aurc(moved, labels) <= M.aurc(probs, labels)
        assert M.eaurc(moved, labels) <= M.eaurc(probs, labels) and M.eaurc(moved, labels) >= 0.0


def test_aurc_ties_follow_the_documented_input_order() -> None:
    # Three samples tie at 0.9 (one wrong) above a correct 0.6: the stable sort keeps the input order, so the value
    # depends on where the wrong one stands (documented); the tie-invariant AUROC does not.
    probs = _binary([0.9, 0.9, 0.9, 0.6])
    wrong_second, wrong_first = np.array([0, 1, 0, 0]), np.array([1, 0, 0, 0])
    assert M.aurc(probs, wrong_second) == pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 4) / 4, abs=1e-15)
    assert M.aurc(probs, wrong_first) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, abs=1e-15)
    assert M.misclassification_auroc(probs, wrong_second) == M.misclassification_auroc(probs, wrong_first)


def test_selective_ties_against_sklearn() -> None:
    rng = np.random.default_rng(20)
    checked = 0
    for _ in range(200):
        n = int(rng.integers(2, 40))
        probs = _binary(rng.choice([0.5, 0.6, 0.75, 1.0], size=n))
        labels = rng.integers(0, 2, size=n)
        correct = probs.argmax(axis=1) == labels
        if correct.all() or not correct.any():
            continue
        checked += 1
        confidence = probs.max(axis=1)
        assert M.misclassification_auroc(probs, labels) == pytest.approx(roc_auc_score(correct, confidence), abs=1e-14)
        fpr, tpr, _ = roc_curve(correct, confidence, drop_intermediate=False)
        assert M.fpr_at_95_tpr(probs, labels) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-15)
    assert checked > 100
    # every confidence equal: AUROC 0.5, FPR@95 1 (all accepted together)
    probs, labels = np.full((6, 2), 0.5), np.array([0, 1, 0, 1, 0, 0])
    assert M.misclassification_auroc(probs, labels) == 0.5 and M.fpr_at_95_tpr(probs, labels) == 1.0


# -- debiased and sweep estimators -------------------------------------------------------------------------------------
def test_debiased_closed_form_on_a_tiny_input() -> None:
    # scores 0.6, 0.6, 0.9, 0.9 with outcomes 1, 0, 1, 1, two equal-mass bins:
    # bin 1: (0.6 - 0.5)^2 - 0.5 * 0.5 / 1 = -0.24; bin 2: (0.9 - 1)^2 - 0 = 0.01; CE^2 = (-0.24 + 0.01) / 2
    probs, labels = _binary([0.6, 0.6, 0.9, 0.9]), np.array([0, 1, 0, 0])
    assert M.debiased_calibration_error(probs, labels, num_bins=2, squared=True) == pytest.approx(-0.115, abs=1e-15)
    assert M.debiased_calibration_error(probs, labels, num_bins=2) == 0.0
    # one bin (B = 1): (0.75 - 0.75)^2 - 0.75 * 0.25 / 3 = -0.0625
    assert M.debiased_calibration_error(probs, labels, num_bins=1, squared=True) == pytest.approx(-0.0625, abs=1e-15)
    # every score equal: one bin whatever B
    same = _binary([0.7] * 5)
    assert M.debiased_calibration_error(same, np.array([0, 0, 0, 1, 1]), num_bins=15, squared=True) == pytest.approx(
        (0.7 - 0.6) ** 2 - 0.6 * 0.4 / 4, abs=1e-15
    )


@pytest.mark.parametrize("ties", [False, True])
def test_debiased_against_the_reference_implementation(ties: bool) -> None:
    rng = np.random.default_rng(21 + ties)
    for n, num_bins in [(2, 15), (5, 2), (7, 3), (30, 15), (100, 15), (100, 40)]:
        confidence = rng.uniform(0.5, 1.0, size=n)
        if ties:
            confidence = np.round(confidence * 4) / 4
        probs = _binary(confidence)
        labels = (rng.uniform(size=n) > confidence).astype(np.int64)
        for kind, mode in (("top_label", "top-label"), ("classwise", "marginal")):
            reference = lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=num_bins, mode=mode)
            assert M.debiased_calibration_error(probs, labels, num_bins, kind=kind) == pytest.approx(
                float(reference), abs=1e-13
            )


def test_sweep_closed_forms_on_tiny_inputs() -> None:
    probs = _binary([0.6, 0.7, 0.8, 0.9])
    # outcomes 0, 1, 0, 1: B = 2 gives bin means 0.5, 0.5 (monotone), B = 3 gives 0.5, 0, 1 (not): B* = 2,
    # ECE = (2 |0.65 - 0.5| + 2 |0.85 - 0.5|) / 4 = 0.25, l2: sqrt((2 * 0.15^2 + 2 * 0.35^2) / 4)
    labels = np.array([1, 0, 1, 0])
    assert M.sweep_calibration_error(probs, labels) == pytest.approx(0.25, abs=1e-15)
    assert M.sweep_calibration_error(probs, labels, power=2) == pytest.approx(math.sqrt(0.0725), abs=1e-15)
    # outcomes 0, 0, 1, 1: monotone at every B, so one bin per score: mean |s - o| = (0.6 + 0.7 + 0.2 + 0.1) / 4
    assert M.sweep_calibration_error(probs, np.array([1, 1, 0, 0])) == pytest.approx(0.4, abs=1e-15)


def _brute_force_sweep(scores: np.ndarray, outcomes: np.ndarray, power: int) -> float:
    # Roelofs et al.'s sweep over B = 1, 2, ... with the calibration package's equal-mass bins (ties kept together)
    from calibration.utils import fast_bin

    data = list(zip(scores, outcomes, strict=True))
    chosen = None
    for num_bins in range(1, scores.shape[0] + 1):
        binned = [np.array(b) for b in fast_bin(data, get_equal_bins(list(scores), num_bins)) if len(b)]
        if np.any(np.diff([b[:, 1].mean() for b in binned]) < 0):
            break
        chosen = binned
    total = sum(len(b) * abs(b[:, 0].mean() - b[:, 1].mean()) ** power for b in chosen)
    return (total / scores.shape[0]) ** (1.0 / power)


def test_sweep_against_a_brute_force_with_the_reference_binning() -> None:
    rng = np.random.default_rng(23)
    for trial in range(60):
        n = int(rng.integers(1, 25))
        confidence = rng.uniform(0.5, 1.0, size=n) if trial % 2 else rng.choice([0.5, 0.6, 0.8, 1.0], size=n)
        labels = (rng.uniform(size=n) > confidence).astype(np.int64)
        probs = _binary(confidence)
        for power in (1, 2):
            expected = _brute_force_sweep(confidence, (labels == 0).astype(np.float64), power)
            assert M.sweep_calibration_error(probs, labels, power=power) == pytest.approx(expected, abs=1e-13)


def test_estimators_are_deterministic_and_leave_the_global_rngs_alone() -> None:
    probs, labels = _distinct_confidence_data(24, n=300)
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
    first = _all_scalar_metrics(probs, labels)
    _assert_same(_all_scalar_metrics(probs, labels), first)  # bit-identical on a second call
    _assert_same(_all_scalar_metrics(torch.from_numpy(probs), torch.from_numpy(labels)), first)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.random.get_state()[1].tolist() == numpy_state[1].tolist()


def test_bootstrap_interval_is_seeded_and_has_its_closed_form() -> None:
    # paired differences d = (0, 1): resampled means are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5 % and
    # 97.5 % quantiles of 10 000 resamples are 0 and 1
    state = np.random.get_state()
    first = paired_difference([1.0, 2.0], [1.0, 1.0], method="bootstrap", seed=3)
    again = paired_difference([1.0, 2.0], [1.0, 1.0], method="bootstrap", seed=3)
    assert (first.low, first.high, first.mean) == (again.low, again.high, again.mean) == (0.0, 1.0, 0.5)
    assert np.random.get_state()[1].tolist() == state[1].tolist()
    rng = np.random.default_rng(25)
    reference, other = rng.normal(size=8), rng.normal(size=8)
    one = paired_difference(reference, other, method="bootstrap", seed=1)
    two = paired_difference(reference, other, method="bootstrap", seed=2)
    assert one == paired_difference(reference, other, method="bootstrap", seed=1)
    assert (one.low, one.high) != (two.low, two.high)


# -- the evaluation's feed ---------------------------------------------------------------------------------------------
def _tied_evaluation_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(26)
    rows = np.array([[0.5, 0.5, 0.0], [0.6, 0.3, 0.1], [1.0, 0.0, 0.0], [0.2, 0.2, 0.6], [0.4, 0.35, 0.25]])
    probs = rows[rng.integers(0, 5, size=60)]
    labels = rng.integers(0, 3, size=60)
    return probs, labels


def test_classification_metrics_against_independent_references() -> None:
    probs, labels = _tied_evaluation_data()
    result = classification_metrics(torch.from_numpy(probs), torch.from_numpy(labels))
    correct = probs.argmax(axis=1) == labels
    confidence = probs.max(axis=1)
    assert result.accuracy == pytest.approx(correct.mean(), abs=1e-15)
    assert result.confidence == pytest.approx(confidence.mean(), abs=1e-15)
    true_class = probs[np.arange(60), labels]
    assert result.nll == pytest.approx(float(-np.log(np.maximum(true_class, 1e-12)).mean()), rel=1e-14)
    assert result.brier == pytest.approx(brier_score_loss(labels, probs, labels=[0, 1, 2]), abs=1e-14)
    ece, mce = _reference_ece(probs, labels, 15)
    assert result.ece == pytest.approx(ece, abs=1e-14) and result.mce == pytest.approx(mce, abs=1e-14)
    assert result.classwise_ece == pytest.approx(_reference_calibration_ece(probs, labels, 15, "marginal"), abs=1e-14)
    assert result.debiased_ce == pytest.approx(
        float(lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=15, mode="top-label")), abs=1e-14
    )
    assert result.auroc == pytest.approx(roc_auc_score(correct, confidence), abs=1e-14)
    fpr, tpr, _ = roc_curve(correct, confidence, drop_intermediate=False)
    assert result.fpr95 == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-15)
    # per-example records average to the aggregates
    records = per_example_predictions(torch.from_numpy(probs), torch.from_numpy(labels))
    assert float(np.mean(records["test_nll"])) == pytest.approx(result.nll, rel=1e-15)
    assert float(np.mean(records["test_correct"])) == result.accuracy
    assert float(np.mean(records["test_confidence"])) == pytest.approx(result.confidence, rel=1e-15)


def test_classification_metrics_of_low_precision_tensors() -> None:
    probs, labels = _tied_evaluation_data()
    half = torch.from_numpy(probs).to(torch.bfloat16)
    values = half.double().numpy()
    result = classification_metrics(half, torch.from_numpy(labels))
    assert result.confidence == pytest.approx(values.max(axis=1).mean(), abs=1e-15)
    assert result.ece == pytest.approx(_reference_ece(values, labels, 15)[0], abs=1e-14)


def test_fitted_temperature_minimises_the_reported_nll_of_the_monte_carlo_mean() -> None:
    # the temperature of the '+ts' rows: T = 3 Monte Carlo logit samples; the reported predictive is the mean of the
    # scaled softmaxes, and its NLL (gpattn.metrics) is what the fitted temperature should minimise
    generator = torch.Generator().manual_seed(27)
    centre = torch.randn(80, 4, generator=generator, dtype=torch.float64) * 3
    logits = centre + torch.randn(3, 80, 4, generator=generator, dtype=torch.float64)
    labels = torch.distributions.Categorical(logits=centre / 2.5).sample()

    def reported_nll(log_temperature: float) -> float:
        probabilities = (logits / math.exp(log_temperature)).softmax(dim=-1).mean(dim=0)
        return M.negative_log_likelihood(probabilities, labels)

    best = optimize.minimize_scalar(reported_nll, bounds=(math.log(0.01), math.log(100.0)), method="bounded")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        temperature = fit_temperature(logits, labels)
    assert math.log(temperature) == pytest.approx(best.x, abs=1e-4)
    assert reported_nll(math.log(temperature)) <= best.fun + 1e-10


def test_classification_metrics_accepts_reversed_numpy_views() -> None:
    probs, labels = _tied_evaluation_data()
    reversed_view = classification_metrics(probs[::-1], labels[::-1])
    assert reversed_view == classification_metrics(probs[::-1].copy(), labels[::-1].copy())


def test_classification_metrics_of_a_read_only_array_is_silent() -> None:
    probs, labels = _tied_evaluation_data()
    probs.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        classification_metrics(probs, labels)


def test_classification_metrics_confidence_of_lists_is_float64() -> None:
    rng = np.random.default_rng(0)
    probs = _softmax_rows(rng, 50, 3)
    labels = rng.integers(0, 3, size=50)
    result = classification_metrics(probs.tolist(), labels.tolist())
    assert result.confidence == pytest.approx(float(probs.max(axis=1).mean()), rel=1e-14)
    assert result.ece == M.expected_calibration_error(probs, labels)
