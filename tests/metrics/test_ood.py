"""Tests of OOD-detection AUROC, AUPR-In / AUPR-Out and FPR at 95% TPR against scikit-learn and torchmetrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve
from torchmetrics.functional.classification import binary_auroc, binary_average_precision

from gpattn.metrics import ood_aupr, ood_auroc, ood_fpr_at_95_tpr


def _random_probs(seed: int, num_samples: int, num_classes: int, ties: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if ties:
        weights = rng.integers(1, 4, size=(num_samples, num_classes)).astype(np.float64)
    else:
        weights = rng.dirichlet(np.full(num_classes, 0.5), size=num_samples) + 1e-9
    return weights / weights.sum(axis=1, keepdims=True)


def _reference_scores(probs: np.ndarray, score: str) -> np.ndarray:
    if score == "max_prob":
        return probs.max(axis=1)
    # summed in ascending order: rows that are permutations of each other (the integer weights of ``ties``) tie
    return np.array([sum(p * np.log(p) for p in sorted(row) if p > 0) for row in probs])


def test_hand_computed_max_prob() -> None:
    # In max probs {0.9, 0.8}, OOD max probs {0.6, 0.8}:
    # pairs (0.9 > 0.6), (0.9 > 0.8), (0.8 > 0.6) count 1 and (0.8 = 0.8) counts 1/2 -> AUROC = 3.5 / 4 = 0.875.
    probs_in = np.array([[0.9, 0.1], [0.2, 0.8]])
    probs_out = np.array([[0.6, 0.4], [0.8, 0.2]])
    assert ood_auroc(probs_in, probs_out) == pytest.approx(0.875)
    # AUPR-In, thresholds 0.9, 0.8, 0.6 accept {in}, {in, in, out}, all:
    #   precision 1/1, 2/3, 2/4; recall 1/2, 2/2, 2/2 -> AP = 1/2 * 1 + 1/2 * 2/3 = 5/6.
    assert ood_aupr(probs_in, probs_out) == pytest.approx(5 / 6)
    # AUPR-Out ranks by -max prob, thresholds -0.6, -0.8, -0.9 accept {out}, {out, out, in}, all:
    #   precision 1/1, 2/3, 2/4; recall 1/2, 1, 1 -> AP = 5/6.
    assert ood_aupr(probs_in, probs_out, positive="out") == pytest.approx(5 / 6)
    # TPR >= 0.95 needs threshold 0.8, which accepts 1 of 2 OOD samples.
    assert ood_fpr_at_95_tpr(probs_in, probs_out) == pytest.approx(0.5)


def test_entropy_score_handles_zeros() -> None:
    # One-hot in-distribution rows have entropy 0 (the highest score); uniform OOD rows have entropy ln 3.
    probs_in = np.eye(3)
    probs_out = np.full((2, 3), 1 / 3)
    assert ood_auroc(probs_in, probs_out, score="entropy") == 1.0
    assert ood_fpr_at_95_tpr(probs_in, probs_out, score="entropy") == 0.0
    assert ood_auroc(probs_out, probs_in, score="entropy") == 0.0


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_in=st.integers(1, 60),
    num_out=st.integers(1, 60),
    num_classes=st.integers(2, 5),
    ties=st.booleans(),
    score=st.sampled_from(["max_prob", "entropy"]),
)
def test_against_sklearn(seed: int, num_in: int, num_out: int, num_classes: int, ties: bool, score: str) -> None:
    probs_in = _random_probs(seed, num_in, num_classes, ties)
    probs_out = _random_probs(seed + 1, num_out, num_classes, ties)
    scores = np.concatenate([_reference_scores(probs_in, score), _reference_scores(probs_out, score)])
    is_in = np.r_[np.ones(num_in, dtype=bool), np.zeros(num_out, dtype=bool)]
    assert ood_auroc(probs_in, probs_out, score=score) == pytest.approx(roc_auc_score(is_in, scores), abs=1e-12)
    expected_in = average_precision_score(is_in, scores)
    assert ood_aupr(probs_in, probs_out, score=score) == pytest.approx(expected_in, abs=1e-12)
    expected_out = average_precision_score(~is_in, -scores)
    assert ood_aupr(probs_in, probs_out, score=score, positive="out") == pytest.approx(expected_out, abs=1e-12)
    fpr, tpr, _ = roc_curve(is_in, scores, drop_intermediate=False)
    assert ood_fpr_at_95_tpr(probs_in, probs_out, score=score) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-12)


def test_rows_that_are_permutations_of_each_other_tie_by_entropy() -> None:
    # the negative entropy of permuted rows differed by rounding (summed in the rows' own orders), which the AUROC read
    # as an order: 0.4825 where max_prob gave 0.5
    rng = np.random.default_rng(0)
    row = rng.dirichlet(np.ones(6))
    inside = np.stack([rng.permutation(row) for _ in range(50)])
    outside = np.stack([rng.permutation(row) for _ in range(50)])
    assert len({float(sum(p * np.log(p) for p in permuted)) for permuted in inside}) > 1  # not vacuous
    for score in ("entropy", "max_prob"):
        assert ood_auroc(inside, outside, score) == 0.5


@pytest.mark.parametrize("score", ["max_prob", "entropy"])
def test_numpy_and_torch_inputs_agree(score: str) -> None:
    probs_in = torch.tensor(_random_probs(0, 40, 4, ties=False), dtype=torch.float32)
    probs_out = torch.tensor(_random_probs(1, 30, 4, ties=True), dtype=torch.float32)
    for metric in (ood_auroc, ood_aupr, ood_fpr_at_95_tpr):
        from_torch = metric(probs_in, probs_out, score=score)
        assert isinstance(from_torch, float) and from_torch == metric(probs_in.numpy(), probs_out.numpy(), score=score)


def test_bad_inputs_raise() -> None:
    probs = np.full((2, 3), 1 / 3)
    with pytest.raises(ValueError, match="score"):
        ood_auroc(probs, probs, score="energy")
    with pytest.raises(ValueError, match="positive"):
        ood_aupr(probs, probs, positive="both")
    with pytest.raises(ValueError, match="number of classes"):
        ood_auroc(probs, np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="probs_out"):
        ood_fpr_at_95_tpr(probs, np.zeros((0, 3)))
    with pytest.raises(ValueError, match="probs_in"):
        ood_auroc(np.array([[2.0, -1.0, 0.0]]), probs)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_in=st.integers(1, 80),
    num_out=st.integers(1, 80),
    num_classes=st.integers(2, 5),
    score=st.sampled_from(["max_prob", "entropy"]),
)
def test_against_torchmetrics(seed: int, num_in: int, num_out: int, num_classes: int, score: str) -> None:
    # AUROC, AUPR-In and AUPR-Out against torchmetrics' binary metrics on the same scores (in-distribution positive;
    # AUPR-Out: OOD positive, ranked by -s). torchmetrics maps scores outside [0, 1] through a sigmoid (monotone).
    probs_in = _random_probs(seed, num_in, num_classes, ties=False)
    probs_out = _random_probs(seed + 1, num_out, num_classes, ties=False)
    scores = torch.tensor(np.concatenate([_reference_scores(probs_in, score), _reference_scores(probs_out, score)]))
    is_in = torch.cat([torch.ones(num_in, dtype=torch.long), torch.zeros(num_out, dtype=torch.long)])
    assert ood_auroc(probs_in, probs_out, score=score) == pytest.approx(float(binary_auroc(scores, is_in)), abs=1e-6)
    expected_in = float(binary_average_precision(scores, is_in))
    assert ood_aupr(probs_in, probs_out, score=score, positive="in") == pytest.approx(expected_in, abs=1e-6)
    expected_out = float(binary_average_precision(-scores, 1 - is_in))
    assert ood_aupr(probs_in, probs_out, score=score, positive="out") == pytest.approx(expected_out, abs=1e-6)
