"""Tests of the headline's endpoint estimates against independent references: the paired t interval and p-value
against scipy.stats.ttest_rel on the seeds both rows hold with a finite value, the seeds the pairing leaves out (a
metric that is not finite, a seed one row did not run) named in the note rather than dropped silently, and the
direction of the difference (reference - other) for a lower-is-better and a higher-is-better metric."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from gpattn.comparison import RunRecord
from gpattn.comparison.endpoints import PRIMARY_ENDPOINT, SECONDARY_ENDPOINTS
from gpattn.comparison.headline import estimate_endpoint, headline_text, verdict

FIELDS = ("confidence", "ece", "mce", "brier", "aurc", "eaurc", "auroc", "fpr95")


def _record(row: str, seed: int, nll: float, accuracy: float) -> RunRecord:
    """A minimal mnist1d record: ``nll`` and ``accuracy`` are the temperature-scaled (``+ts``) test metrics, the
    untempered NLL 0.1 higher."""
    test = {"accuracy": accuracy, "nll": nll + 0.1, **dict.fromkeys(FIELDS, 0.1)}
    return RunRecord.from_dict(
        {
            "task": "mnist1d",
            "attention": row,
            "seed": seed,
            "metrics": {"test": test},
            "temperature_scaled": {"temperature": 1.5, "metrics": {"test": {**test, "nll": nll}}},
        }
    )


# test NLL (+ts) and accuracy per seed: kep_svgp lower NLL (better) and higher accuracy (better) on most seeds
KEP_NLL = [0.40, 0.42, 0.38, 0.45, 0.41, 0.39, 0.44, 0.43, 0.40, 0.37]
SOFTMAX_NLL = [0.45, 0.44, 0.43, 0.46, 0.47, 0.41, 0.45, 0.48, 0.44, 0.42]
KEP_ACCURACY = [0.91, 0.90, 0.92, 0.89, 0.93, 0.90, 0.91, 0.92, 0.90, 0.94]
SOFTMAX_ACCURACY = [0.90, 0.89, 0.90, 0.89, 0.91, 0.88, 0.90, 0.90, 0.89, 0.91]


def _records(kep_nll=KEP_NLL, softmax_nll=SOFTMAX_NLL, kep_seeds=range(10), softmax_seeds=range(10)):
    return [_record("kep_svgp", s, kep_nll[s], KEP_ACCURACY[s]) for s in kep_seeds] + [
        _record("softmax", s, softmax_nll[s], SOFTMAX_ACCURACY[s]) for s in softmax_seeds
    ]


def test_the_primary_is_reference_minus_other_against_scipy() -> None:
    estimate = estimate_endpoint(_records(), PRIMARY_ENDPOINT, hierarchical=False)
    test = stats.ttest_rel(KEP_NLL, SOFTMAX_NLL)
    interval = test.confidence_interval(0.95)
    assert estimate.mean == pytest.approx(np.mean(np.subtract(KEP_NLL, SOFTMAX_NLL)), abs=1e-15) and estimate.mean < 0
    assert (estimate.t.low, estimate.t.high) == pytest.approx((interval.low, interval.high), abs=1e-14)
    assert estimate.p_value == pytest.approx(test.pvalue, rel=1e-12) and estimate.n == 10
    # lower is better for the NLL: the reference has the lower one, and the declaration says negative favours it
    assert verdict(estimate)[0] == "lower" and "kep_svgp+ts has the lower test NLL" in verdict(estimate)[1]
    accuracy = next(e for e in SECONDARY_ENDPOINTS if e.column == "test_accuracy")
    assert accuracy.higher_is_better and not PRIMARY_ENDPOINT.higher_is_better
    estimate = estimate_endpoint(_records(), accuracy)
    test = stats.ttest_rel(KEP_ACCURACY, SOFTMAX_ACCURACY)
    assert estimate.mean == pytest.approx(np.mean(np.subtract(KEP_ACCURACY, SOFTMAX_ACCURACY)), abs=1e-15)
    assert estimate.mean > 0  # higher is better for the accuracy: a positive difference favours the reference
    assert (estimate.t.low, estimate.t.high) == pytest.approx(tuple(test.confidence_interval(0.95)), abs=1e-14)
    assert estimate.p_value == pytest.approx(test.pvalue, rel=1e-12)
    assert estimate.note == "" and estimate.left_out == ()


def test_a_seed_whose_metric_is_not_finite_is_named_not_dropped_silently() -> None:
    """softmax+ts's NLL is infinite on seed 3 (the seed where kep_svgp+ts is worse by the most): the estimate is the
    t interval of the 9 other seeds (scipy's, on them), and the note and the headline say which seed was left out and
    why, instead of calling the 9 seeds a subset of the declared run."""
    softmax = list(SOFTMAX_NLL)
    softmax[3] = math.inf
    records = _records(softmax_nll=softmax)
    estimate = estimate_endpoint(records, PRIMARY_ENDPOINT, hierarchical=False)
    kept = [seed for seed in range(10) if seed != 3]
    interval = stats.ttest_rel([KEP_NLL[s] for s in kept], [SOFTMAX_NLL[s] for s in kept]).confidence_interval(0.95)
    assert estimate.n == 9 and estimate.seeds == tuple(kept) and estimate.left_out == (3,)
    assert (estimate.t.low, estimate.t.high) == pytest.approx((interval.low, interval.high), abs=1e-14)
    assert estimate.note == "seeds left out of the pairing: 3 (no finite test NLL of softmax+ts)"
    text = headline_text(records, num_resamples=200)
    assert "Note: seeds left out of the pairing: 3 (no finite test NLL of softmax+ts); no per-example" in text
    assert "1 seed of these records left out of the pairing (note above)" in text
    # a NaN secondary is named in its row of the secondaries' table
    accuracy = next(e for e in SECONDARY_ENDPOINTS if e.column == "test_accuracy")
    nan_accuracy = [_record("kep_svgp", s, KEP_NLL[s], math.nan if s == 0 else KEP_ACCURACY[s]) for s in range(10)]
    records = nan_accuracy + [_record("softmax", s, SOFTMAX_NLL[s], SOFTMAX_ACCURACY[s]) for s in range(10)]
    assert estimate_endpoint(records, accuracy).note == (
        "seeds left out of the pairing: 0 (no finite accuracy of kep_svgp+ts)"
    )


def test_seeds_run_by_one_row_only_are_named() -> None:
    records = _records(kep_seeds=range(10), softmax_seeds=range(7))
    estimate = estimate_endpoint(records, PRIMARY_ENDPOINT, hierarchical=False)
    test = stats.ttest_rel(KEP_NLL[:7], SOFTMAX_NLL[:7])
    assert estimate.n == 7 and estimate.left_out == (7, 8, 9)
    assert (estimate.t.low, estimate.t.high) == pytest.approx(tuple(test.confidence_interval(0.95)), abs=1e-14)
    assert estimate.note == "seeds left out of the pairing: 7, 8, 9 (of kep_svgp+ts: no softmax+ts run)"
    # both rows on the same seeds 0-6 (make main's subset): nothing left out, and the subset is named as such
    subset = estimate_endpoint(
        _records(kep_seeds=range(7), softmax_seeds=range(7)), PRIMARY_ENDPOINT, hierarchical=False
    )
    assert subset.note == "" and subset.left_out == ()
    text = headline_text(_records(kep_seeds=range(7), softmax_seeds=range(7)), num_resamples=200)
    assert "these records are the subset of `make main`" in text and "left out" not in text


def test_two_runs_of_one_seed_are_refused() -> None:
    # softmax+ts's seed 3 twice (NLL 0.46 and 9.0): {seed: value} kept the last, silently, and the tables counted 11
    records = [*_records(), _record("softmax", 3, 9.0, 0.5)]
    with pytest.raises(
        ValueError, match=r"estimate_endpoint: more than one run of row softmax\+ts on mnist1d, seed\(s\) \[3\]"
    ):
        estimate_endpoint(records, PRIMARY_ENDPOINT)
