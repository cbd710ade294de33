"""The debiased and sweep calibration errors (gpattn.metrics.calibration_estimators) against the reference
implementation of Kumar et al. (the ``uncertainty-calibration`` package), hand-computed cases and the closed-form
expectation of the estimators for a perfectly calibrated predictor."""

from __future__ import annotations

import calibration  # the reference implementation of Kumar et al. (package uncertainty-calibration, test extra)
import numpy as np
import pytest
import torch

from gpattn.metrics import debiased_calibration_error, expected_calibration_error, sweep_calibration_error
from gpattn.metrics.calibration_estimators import equal_mass_bin_indices


def _random_predictions(seed: int, num_samples: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_samples, num_classes)) * rng.uniform(0.5, 3.0)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = np.array([rng.choice(num_classes, p=row) for row in probs])  # roughly calibrated
    flip = rng.random(num_samples) < 0.2  # and some miscalibration
    labels[flip] = rng.integers(0, num_classes, flip.sum())
    return probs, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("num_samples", "num_classes", "num_bins"), [(200, 3, 15), (1000, 10, 15), (57, 2, 10)])
def test_debiased_top_label_matches_the_reference(seed, num_samples, num_classes, num_bins) -> None:
    probs, labels = _random_predictions(seed, num_samples, num_classes)
    reference = calibration.lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=num_bins, mode="top-label")
    ours = debiased_calibration_error(probs, labels, num_bins=num_bins)
    assert ours == pytest.approx(reference, abs=1e-12)
    plugin = calibration.lower_bound_scaling_ce(probs, labels, p=2, debias=False, num_bins=num_bins, mode="top-label")
    assert ours < plugin  # the bias correction lowers the estimate


@pytest.mark.parametrize("seed", [0, 1])
def test_debiased_classwise_matches_the_reference_marginal_mode(seed) -> None:
    probs, labels = _random_predictions(seed, 600, 4)
    reference = calibration.lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=15, mode="marginal")
    assert debiased_calibration_error(probs, labels, num_bins=15, kind="classwise") == pytest.approx(reference, 1e-12)


def test_equal_mass_bins_split_sorted_scores_evenly_and_keep_ties_together() -> None:
    scores = np.array([0.9, 0.1, 0.5, 0.3, 0.7, 0.2])
    # sorted: [0.1, 0.2 | 0.3, 0.5 | 0.7, 0.9]
    assert equal_mass_bin_indices(scores, 3).tolist() == [2, 0, 1, 1, 2, 0]
    tied = np.array([0.5, 0.5, 0.5, 0.5, 0.9, 0.1])
    bins = equal_mass_bin_indices(tied, 3)
    assert len(set(bins[:4].tolist())) == 1  # equal scores share a bin
    assert equal_mass_bin_indices(scores, 100).tolist() == np.argsort(np.argsort(scores)).tolist()  # at most n bins


def test_debiased_hand_computed() -> None:
    # one bin (B = 1) of four predictions with confidence 0.8, three correct: plug-in (0.8 - 0.75)^2 = 0.0025, the
    # variance term 0.75 * 0.25 / 3 = 0.0625
    probs = np.array([[0.8, 0.2]] * 4)
    labels = np.array([0, 0, 0, 1])
    assert debiased_calibration_error(probs, labels, num_bins=1, squared=True) == pytest.approx(0.0025 - 0.0625)
    assert debiased_calibration_error(probs, labels, num_bins=1) == 0.0


def test_debiased_expectation_for_a_calibrated_predictor_is_the_closed_form() -> None:
    # conditional on the scores the bins are fixed; outcome_i ~ Bernoulli(s_i) gives
    # E[plug-in^2] = sum_b 1 / (n n_b) sum_{i in b} s_i (1 - s_i) and E[debiased^2] = -sum_b (n_b / n) v_b / (n_b - 1)
    rng = np.random.default_rng(0)
    num_samples, num_bins, repeats = 1000, 15, 4000
    confidence = rng.uniform(0.5, 1.0, num_samples)
    probs = np.stack([confidence, 1.0 - confidence], axis=1)
    bins = equal_mass_bin_indices(confidence, num_bins)
    expected_plugin = expected_debiased = 0.0
    for b in np.unique(bins):
        scores = confidence[bins == b]
        size = scores.shape[0]
        expected_plugin += (scores * (1 - scores)).sum() / (num_samples * size)
        expected_debiased -= (size / num_samples) * scores.var() / (size - 1)
    correct = rng.random((repeats, num_samples)) < confidence
    labels = np.where(correct, 0, 1)
    debiased = np.array([debiased_calibration_error(probs, row, num_bins, squared=True) for row in labels])
    plugin = np.array(
        [calibration.lower_bound_scaling_ce(probs, row, p=2, debias=False, num_bins=num_bins) ** 2 for row in labels]
    )
    standard_error = debiased.std() / repeats**0.5
    assert abs(debiased.mean() - expected_debiased) < 4 * standard_error
    assert abs(expected_debiased) < 1e-5  # ~ 0: narrow equal-mass bins
    assert plugin.mean() == pytest.approx(expected_plugin, rel=0.05)
    assert expected_plugin > 50 * abs(expected_debiased)  # the plug-in bias, of order B / n


def test_a_calibrated_predictor_shows_an_ece_but_little_debiased_error() -> None:
    # the motivating fact: 15-bin ECE of a calibrated predictor on 1000 test points is ~ 2.6 %
    rng = np.random.default_rng(1)
    confidence = rng.uniform(0.3, 1.0, 1000)
    probs = np.stack([confidence, 1.0 - confidence], axis=1)
    eces, debiased = [], []
    for _ in range(200):
        labels = np.where(rng.random(1000) < confidence, 0, 1)
        eces.append(expected_calibration_error(probs, labels))
        debiased.append(debiased_calibration_error(probs, labels, squared=True))
    assert 0.015 < np.mean(eces) < 0.04
    assert abs(np.mean(debiased)) < 3 * np.std(debiased) / len(debiased) ** 0.5 + 1e-5


def test_sweep_hand_computed_and_monotone_stopping_rule() -> None:
    # scores 0.1..0.8, outcomes 0 0 1 0 1 1 1 1: two bins are monotone (0.25 -> 1.0), four bins are
    # (0 -> 0.5 -> 1 -> 1), eight bins are not (0, 0, 1, 0, ...): B* = 4 or more up to the first violation
    scores = np.arange(1, 9) / 10.0
    outcomes = np.array([0, 0, 1, 0, 1, 1, 1, 1])
    probs = np.stack([1.0 - scores, scores], axis=1)  # class 1 has probability `score`
    labels = outcomes.astype(np.int64)
    # classwise on class 1 is the binary problem (scores, outcomes); find B* by brute force
    best = None
    for num_bins in range(1, 9):
        bins = equal_mass_bin_indices(scores, num_bins)
        means = [outcomes[bins == b].mean() for b in np.unique(bins)]
        if np.any(np.diff(means) < 0):
            break
        best = bins
    expected = sum(
        (best == b).sum() / 8 * abs(scores[best == b].mean() - outcomes[best == b].mean()) for b in np.unique(best)
    )
    error_class_0 = sweep_calibration_error(probs[:, [1, 0]], 1 - labels, kind="classwise")  # symmetric problem
    assert sweep_calibration_error(probs, labels, kind="classwise") == pytest.approx(expected)
    assert error_class_0 == pytest.approx(expected)


def _sweep_by_brute_force(scores: np.ndarray, outcomes: np.ndarray, power: int) -> float:
    # Roelofs et al.'s rule read literally: bins of equal_mass_bin_indices for B = 1, 2, ... up to the first
    # non-monotone one, each binned afresh
    chosen = None
    for num_bins in range(1, scores.shape[0] + 1):
        bins = equal_mass_bin_indices(scores, num_bins)
        means = [outcomes[bins == b].mean() for b in np.unique(bins)]
        if np.any(np.diff(means) < 0):
            break
        chosen = bins
    return sum(
        (chosen == b).mean() * abs(scores[chosen == b].mean() - outcomes[chosen == b].mean()) ** power
        for b in np.unique(chosen)
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("power", [1, 2])
def test_sweep_equals_the_brute_force_search(seed, power) -> None:
    # random sizes, ties (rounded logits) and all-correct sets, where the search runs to one bin per distinct score
    rng = np.random.default_rng(seed)
    probs, labels = _random_predictions(seed, int(rng.integers(2, 120)), int(rng.integers(2, 5)))
    if seed % 2:
        probs = np.round(probs, 1) + 1e-3
        probs /= probs.sum(axis=1, keepdims=True)
    if seed % 3 == 0:
        labels = probs.argmax(axis=1)
    expected = np.mean(
        [_sweep_by_brute_force(probs[:, c], (labels == c).astype(float), power) for c in range(probs.shape[1])]
    )
    got = sweep_calibration_error(probs, labels, kind="classwise", power=power)
    assert got == pytest.approx(expected ** (1.0 / power), rel=1e-12, abs=1e-14)
    confidence, correct = probs.max(axis=1), (probs.argmax(axis=1) == labels).astype(float)
    got = sweep_calibration_error(probs, labels, power=power)
    assert got == pytest.approx(_sweep_by_brute_force(confidence, correct, power) ** (1.0 / power), rel=1e-12)


def test_sweep_of_an_all_correct_test_set_is_one_bin_per_score() -> None:
    # monotone outcomes (all 1): every binning is monotone, so B* = n and the error is mean |s - 1| = 1 - mean s; the
    # search over n bin counts took 4.5 s at n = 3000 (quadratic): it is not run now
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(10), 20_000)
    labels = probs.argmax(axis=1)
    confidence = probs.max(axis=1)
    assert sweep_calibration_error(probs, labels) == pytest.approx(1.0 - confidence.mean(), rel=1e-12)
    assert sweep_calibration_error(probs, labels, power=2) == pytest.approx(
        np.sqrt(np.mean((1.0 - confidence) ** 2)), rel=1e-12
    )


def test_sweep_of_a_calibrated_predictor_is_smaller_than_the_binned_ece() -> None:
    rng = np.random.default_rng(2)
    confidence = rng.uniform(0.3, 1.0, 1000)
    probs = np.stack([confidence, 1.0 - confidence], axis=1)
    sweeps, eces = [], []
    for _ in range(100):
        labels = np.where(rng.random(1000) < confidence, 0, 1)
        sweeps.append(sweep_calibration_error(probs, labels))
        eces.append(expected_calibration_error(probs, labels))
    # less biased than the 15-bin ECE (Roelofs et al. 2022), though not zero: the sweep stops at a few bins of
    # 100-200 examples, whose accuracies still vary by ~0.03
    assert np.mean(sweeps) < np.mean(eces)


def test_numpy_and_torch_inputs_agree_and_bad_inputs_raise() -> None:
    probs, labels = _random_predictions(0, 300, 5)
    for metric in (debiased_calibration_error, sweep_calibration_error):
        assert metric(torch.from_numpy(probs), torch.from_numpy(labels)) == metric(probs, labels)
        with pytest.raises(ValueError, match="kind"):
            metric(probs, labels, kind="marginal")
    with pytest.raises(ValueError, match="num_bins"):
        debiased_calibration_error(probs, labels, num_bins=0)
    with pytest.raises(ValueError, match="power"):
        sweep_calibration_error(probs, labels, power=3)
    with pytest.raises(ValueError, match="sum to 1"):
        debiased_calibration_error(probs * 0.5, labels)


def test_the_power_and_squared_arguments_are_checked_and_give_plain_floats() -> None:
    probs, labels = _random_predictions(3, 200, 4)
    confidence, correct = probs.max(1), (probs.argmax(1) == labels).astype(float)
    squared_sweep = _sweep_by_brute_force(confidence, correct, 2)
    got = sweep_calibration_error(probs, labels, power=np.int64(2))  # a NumPy integer: was a numpy.float64
    assert type(got) is float and got == pytest.approx(squared_sweep**0.5, rel=1e-12)
    with pytest.raises(
        TypeError, match=r"sweep_calibration_error: expected power to be an integer in \[1, 2\], got True"
    ):
        sweep_calibration_error(probs, labels, power=True)  # was read as power 1
    with pytest.raises(TypeError, match="power to be an integer in .1, 2., got 2.0"):
        sweep_calibration_error(probs, labels, power=2.0)
    squared = debiased_calibration_error(probs, labels, squared=True)
    assert debiased_calibration_error(probs, labels, squared=np.bool_(True)) == squared
    assert debiased_calibration_error(probs, labels) == pytest.approx(max(squared, 0.0) ** 0.5, rel=1e-15)
    with pytest.raises(TypeError, match="debiased_calibration_error: expected squared to be a bool, got 'False'"):
        debiased_calibration_error(probs, labels, squared="False")  # was read as true: the squared estimate


@pytest.mark.parametrize(
    ("scores", "num_bins", "error", "message"),
    [
        (np.array([]), 2, ValueError, r"scores of shape \(n,\) with n >= 1, got shape \(0,\)"),
        (np.array([[0.1, 0.2]]), 1, ValueError, r"scores of shape \(n,\) with n >= 1, got shape \(1, 2\)"),
        (np.array([0.1, 0.2]), 0, ValueError, "num_bins to be a positive integer, got 0"),
        (np.array([0.1, 0.2]), -1, ValueError, "num_bins to be a positive integer, got -1"),
        (np.array([0.1, 0.2]), 2.5, TypeError, "num_bins to be a positive integer, got 2.5"),
    ],
    ids=["empty", "2-d", "zero-bins", "negative-bins", "float-bins"],
)
def test_equal_mass_bins_refuse_bad_input_clearly(scores, num_bins, error, message) -> None:
    # numpy's "number sections must be larger than 0" before; a (1, n) array and 2.5 bins were binned silently
    with pytest.raises(error, match="equal_mass_bin_indices: expected " + message):
        equal_mass_bin_indices(scores, num_bins)
    # valid input as before, the bins of the reference implementation (Kumar et al.'s get_equal_bins edges)
    scores = np.random.default_rng(0).uniform(size=50)
    edges = np.asarray(calibration.utils.get_equal_bins(scores, num_bins=5))
    expected = np.searchsorted(edges[:-1], scores, side="left")
    assert equal_mass_bin_indices(scores, np.int64(5)).tolist() == expected.tolist()
