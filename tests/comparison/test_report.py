"""The comparison's report from synthetic records built here: the flat rows, the full tables (n once per row, n/a with
its reason, the temperature at its bound, like-for-like paired differences), the headline of the declared endpoints
(the primary estimate against scipy and the seeds-and-examples bootstrap, the verdict rule, Holm over the
secondaries), results.json's environment, the results page, the verdict check between two run folders and the run
folder's outputs that ``--overwrite`` replaces."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import re
import statistics

import numpy as np
import pytest
import torch
from scipy import stats

from gpattn.cli import build_parser, main
from gpattn.comparison import (
    CompareConfig,
    RunRecord,
    hierarchical_difference,
    holm_adjusted,
    paired_difference,
    read_records,
)
from gpattn.comparison.endpoints import DECLARED_OOD_SCORE, PRIMARY_ENDPOINT, SECONDARY_ENDPOINTS, declaration_text
from gpattn.comparison.headline import estimate_endpoint, estimate_secondaries, headline_text, verdict
from gpattn.comparison.report import (
    TEMPERATURE_BOUNDS,
    format_difference,
    markdown_table,
    paired_table,
    table_text,
    write_outputs,
)
from gpattn.comparison.results_page import (
    _hyperparameters_text,
    _temperature_caveat,
    compare_verdicts,
    read_run_folders,
    results_page,
)
from gpattn.comparison.table_rows import flat_rows

EXAMPLES = 40
FAMILIES = ("flat", "smooth_noise", "pooled")


def _record(
    task: str,
    row: str,
    seed: int,
    *,
    nll_shift: float = 0.0,
    deterministic: bool = False,
    temperature: float = 1.5,
    old: bool = False,
) -> RunRecord:
    """A record whose numbers are functions of (task, row, seed): per-example NLLs, their mean the test NLL (and
    0.9 times both for the +ts variant), shifts on two kinds, OOD families with the mutual information unless
    ``deterministic``; ``old``: as written before the protocol's fields."""
    rng = np.random.default_rng([seed, len(row), sum(map(ord, row + task))])
    nll = rng.gamma(2.0, 0.2, EXAMPLES) + nll_shift
    accuracy = 0.85 + 0.01 * seed + (0.02 if row.startswith("kep") else 0.0)
    test = dict(accuracy=accuracy, confidence=accuracy - 0.03, nll=float(nll.mean()), ece=0.02 + 0.001 * seed,
                mce=0.1, brier=0.2, aurc=0.05, eaurc=0.01, auroc=0.8, fpr95=0.4, classwise_ece=0.01)  # fmt: skip
    if not old:
        test.update(debiased_ce=0.015 + 0.002 * seed, sweep_ece=0.02)
    shift = {
        kind: {str(level): dict(accuracy=0.7, nll=0.8 + 0.1 * level + nll_shift, ece=0.1 + 0.01 * level + 0.002 * seed,
                                brier=0.3 + 0.01 * level, **({} if old else {"debiased_ce": 0.05}))
               for level in range(1, 6)}
        for kind in ("iid_noise", "shear")
    }  # fmt: skip
    sets = ("noise",) if old else FAMILIES
    ood = {
        name: dict(auroc_max_prob=0.7 + 0.01 * seed, auroc_entropy=0.7, aupr_max_prob=0.8, fpr95_max_prob=0.5,
                   aupr_out_max_prob=0.6, **({} if old or deterministic else {"auroc_mutual_information": 0.8}))
        for name in sets
    }  # fmt: skip
    data = {
        "task": task,
        "attention": row,
        "seed": seed,
        "metrics": {"test": test, "shift": shift, "ood": ood},
        "train": {"seconds": 2.0, "epochs": 60, "best_epoch": 30, "num_parameters": 1000, "ensemble": 1},
        "temperature_scaled": {
            "temperature": temperature,
            "metrics": {"test": {**test, "nll": 0.9 * float(nll.mean())}, "shift": shift, "ood": ood},
            **({} if old else {"per_example": {"test_nll": (0.9 * nll).tolist()}}),
        },
    }
    if not old:
        correct = [1.0] * EXAMPLES
        data.update(
            per_example={"test_nll": nll.tolist(), "test_correct": correct, "test_confidence": correct},
            hyperparameters={"lr": 0.003, "epochs": 60, "num_inducing": None},
            tuned=True,
        )
    return RunRecord.from_dict(json.loads(json.dumps(data)))


def _records(kep_shift: float = -0.1, old: bool = False, seeds: int = 10) -> list[RunRecord]:
    records = []
    for task in ("mnist1d", "digits"):
        for row, shift, deterministic in (("kep_svgp", kep_shift, False), ("softmax", 0.0, True)):
            records += [
                _record(task, row, s, nll_shift=shift, deterministic=deterministic, old=old) for s in range(seeds)
            ]
        records += [_record(task, "sgpa", s, temperature=TEMPERATURE_BOUNDS[1] if s == 0 else 2.0) for s in range(5)]
    return records


def _cells(table: str, row: str, task: str = "mnist1d") -> dict[str, str]:
    """The cells of ``row`` in the main table of ``task``, by header."""
    section = table.split(f"### {task}\n\n")[1]
    lines = section.splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    line = next(line for line in lines if line.startswith(f"| {row} |"))
    return dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))


@pytest.fixture(scope="module")
def records() -> list[RunRecord]:
    return _records()


# -- records and flat rows -------------------------------------------------------------------------------------------
def test_protocol_fields_round_trip_and_old_records_read_back() -> None:
    record = _record("mnist1d", "kep_svgp", 3)
    again = RunRecord.from_dict(json.loads(json.dumps(record.to_dict(), allow_nan=False)))
    assert again.per_example == record.per_example and len(again.per_example["test_nll"]) == EXAMPLES
    assert again.temperature_scaled.per_example["test_nll"] == record.temperature_scaled.per_example["test_nll"]
    assert again.hyperparameters == {"lr": 0.003, "epochs": 60, "num_inducing": None} and again.tuned is True
    assert again.metrics.ood["pooled"].auroc_mutual_information == 0.8
    assert again.metrics.test.debiased_ce == pytest.approx(0.021)
    old = _record("mnist1d", "kep_svgp", 3, old=True)
    assert old.per_example == {} and old.hyperparameters == {} and old.tuned is False
    assert math.isnan(old.metrics.test.debiased_ce) and math.isnan(old.metrics.ood["noise"].auroc_mutual_information)
    softmax = _record("mnist1d", "softmax", 0, deterministic=True).to_dict()
    assert softmax["undefined"]["metrics.ood.pooled.auroc_mutual_information"].startswith("nan: deterministic")


def test_flat_rows(records) -> None:
    rows = flat_rows(records[:1])
    record = records[0]
    plain, scaled = rows
    assert (plain["attention"], scaled["attention"]) == ("kep_svgp", "kep_svgp+ts")
    assert plain["test_gap"] == pytest.approx(record.metrics.test.confidence - record.metrics.test.accuracy)
    shifted = [entry for levels in record.metrics.shift.values() for entry in levels.values()]
    assert plain["shift_nll"] == pytest.approx(statistics.fmean(entry.nll for entry in shifted), abs=1e-15)
    assert plain["shift_brier"] == pytest.approx(statistics.fmean(entry.brier for entry in shifted), abs=1e-15)
    assert plain["ood_pooled_auroc_mi"] == 0.8 and plain["test_examples"] == EXAMPLES and plain["tuned"] is True
    assert scaled["test_nll"] == pytest.approx(0.9 * plain["test_nll"]) and scaled["temperature"] == 1.5
    assert plain["temperature"] is None


# -- the full tables -------------------------------------------------------------------------------------------------
def test_main_table_has_n_once_per_row_and_the_means(records) -> None:
    table = markdown_table(records)
    cells = _cells(table, "kep_svgp")
    group = [r for r in records if r.task == "mnist1d" and r.attention == "kep_svgp"]
    accuracy = [100 * r.metrics.test.accuracy for r in group]
    assert (
        cells["n"] == "10"
        and cells["accuracy"] == f"{statistics.fmean(accuracy):.2f} ± {statistics.stdev(accuracy):.2f}"
    )
    nll = [r.metrics.test.nll for r in group]
    assert cells["NLL"] == f"{statistics.fmean(nll):.3f} ± {statistics.stdev(nll):.3f}"
    gap = [100 * (r.metrics.test.confidence - r.metrics.test.accuracy) for r in group]
    assert cells["conf − acc"] == f"{statistics.fmean(gap):.2f} ± {statistics.stdev(gap):.2f}"
    assert cells["T"] == "1 (as trained)" and _cells(table, "kep_svgp+ts")["T"] == "1.50 ± 0.00"
    assert "(n=" not in table.split("### mnist1d")[1].split("OOD AUROC per set")[0]  # every value on every seed
    header = table.split("### mnist1d\n\n")[1].splitlines()[0]
    assert header.count("|") == 15  # row, n and 12 metrics


def test_missing_values_say_why(records) -> None:
    table = markdown_table(records)
    assert _cells(table, "softmax")["OOD AUROC (MI)"] == "n/a: deterministic"
    assert _cells(table, "kep_svgp")["OOD AUROC (MI)"] == "80.00 ± 0.00"
    old = markdown_table(_records(old=True, seeds=5)[:5] + records[10:15])  # old kep_svgp records, new softmax ones
    assert _cells(old, "kep_svgp")["debiased CE"] == "n/a: not recorded (an older record)"
    assert _cells(old, "kep_svgp")["OOD AUROC"].startswith("n/a: no pooled OOD set")  # its only set: noise
    # a task without shifts or OOD sets, a value on fewer seeds than the row has
    bare = [dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, shift={}, ood={})) for r in records[:3]]
    undefined = dataclasses.replace(bare[2].metrics.test, auroc=math.nan, ece=math.nan)
    bare[2] = dataclasses.replace(bare[2], metrics=dataclasses.replace(bare[2].metrics, test=undefined))
    cells = _cells(markdown_table(bare), "kep_svgp")
    assert cells["shift NLL"] == "n/a: no shift sets" and cells["OOD AUROC"] == "n/a: no OOD sets"
    ece = [100 * r.metrics.test.ece for r in bare[:2]]
    assert cells["ECE"] == f"{statistics.fmean(ece):.2f} ± {statistics.stdev(ece):.2f} (n=2)"
    assert " |  |" not in markdown_table(bare) and "| - |" not in markdown_table(bare)  # never a silent blank


def test_a_row_name_with_a_bar_stays_one_cell(records) -> None:
    # register_attention takes any name without whitespace: "a|b" split its row into one cell more than the header
    barred = [dataclasses.replace(r, attention="my|row") for r in records[:2]]
    table = markdown_table(records[:2] + barred)
    section = table.split("### mnist1d\n\n")[1].split("\n\n")  # its tables and their titles
    tables = [block.splitlines() for block in section if block.startswith("|")]
    for lines in tables:  # every row of every table has as many cells as its header
        assert [len(re.split(r"(?<!\\)\|", line)) for line in lines] == [lines[0].count("|") + 1] * len(lines)
    lines = [line for lines in tables for line in lines]
    assert any(line.startswith(r"| my\|row | 2 | ") for line in lines)
    assert any(line.startswith(r"| my\|row+ts | 2 | ") for line in lines)
    # the headline's table of the other tasks names the task in a cell
    other = [dataclasses.replace(r, task="a|b") for r in records if r.task == "mnist1d" and r.seed < 2]
    headline = headline_text(other + records[:2], num_resamples=10)
    assert r"| a\|b | " in headline


def test_every_main_table_cell_is_the_mean_and_std_of_its_records(records) -> None:
    # recomputed from the records, not the flat rows: percent where the legend says so, the +ts rows from the scaled
    def shifted(metrics, key):
        return statistics.fmean(getattr(entry, key) for levels in metrics.shift.values() for entry in levels.values())

    columns = {
        "accuracy": (lambda m: m.test.accuracy, 100, 2), "NLL": (lambda m: m.test.nll, 1, 3),
        "ECE": (lambda m: m.test.ece, 100, 2), "debiased CE": (lambda m: m.test.debiased_ce, 100, 2),
        "conf − acc": (lambda m: m.test.confidence - m.test.accuracy, 100, 2),
        "Brier": (lambda m: m.test.brier, 100, 2), "shift NLL": (lambda m: shifted(m, "nll"), 1, 3),
        "shift Brier": (lambda m: shifted(m, "brier"), 100, 2), "shift ECE": (lambda m: shifted(m, "ece"), 100, 2),
        "OOD AUROC": (lambda m: m.ood["pooled"].auroc_max_prob, 100, 2),
    }  # fmt: skip
    table = markdown_table(records)
    for task in ("mnist1d", "digits"):
        for row in ("kep_svgp", "softmax", "sgpa"):
            group = [r for r in records if (r.task, r.attention) == (task, row)]
            for scaled in (False, True):
                cells = _cells(table, row + ("+ts" if scaled else ""), task)
                assert cells["n"] == str(len(group))
                for header, (value, scale, digits) in columns.items():
                    values = [value(r.temperature_scaled.metrics if scaled else r.metrics) for r in group]
                    mean, std = statistics.fmean(values) * scale, statistics.stdev(values) * scale
                    assert cells[header] == f"{mean:.{digits}f} ± {std:.{digits}f}", (task, row, scaled, header)


def test_repeated_runs_of_a_seed_are_refused_naming_the_row_task_and_seed(records, tmp_path) -> None:
    # {seed: value} kept the last of two runs of one seed while n counted both: "softmax | 11 | ... (n=10)"
    softmax = [r for r in records if (r.task, r.attention, r.seed) == ("mnist1d", "softmax", 0)]
    other = dataclasses.replace(softmax[0], metrics=records[0].metrics)  # another run of the same seed
    message = r"more than one run of row softmax on mnist1d, seed\(s\) \[0\]; expected one run per task, row"
    config = CompareConfig(seeds=tuple(range(10)))
    for repeated in (records + softmax, records + [other]):
        for call, arguments in (
            (markdown_table, (repeated,)),
            (paired_table, (repeated, "mnist1d", True)),
            (table_text, (repeated, config)),
            (write_outputs, (repeated, config, tmp_path / "out")),
        ):
            with pytest.raises(ValueError, match=f"{call.__name__}: {message}") as error:
                call(*arguments)
            assert "softmax+ts" not in str(error.value)  # the run, once
    assert not (tmp_path / "out").exists()  # refused before any file was written
    reference = [r for r in records if (r.task, r.attention, r.seed) == ("mnist1d", "kep_svgp", 3)]
    with pytest.raises(
        ValueError, match=r"paired_table: more than one run of row kep_svgp on mnist1d, seed\(s\) \[3\]"
    ):
        paired_table(records + reference, "mnist1d", scaled=False)


def test_numpy_scalars_in_records_are_numbers_in_the_tables_and_the_csv(records, tmp_path) -> None:
    # a numpy.float32 metric of a record built in memory read as undefined: "n/a: undefined on every seed"
    group = [r for r in records if (r.task, r.attention) == ("mnist1d", "kep_svgp") and r.seed < 3]

    def numpy_metrics(record: RunRecord) -> RunRecord:
        test = record.metrics.test
        ece = np.float32("nan") if record.seed == 2 else np.float32(test.ece)
        test = dataclasses.replace(test, accuracy=np.float32(test.accuracy), ece=ece, brier=np.int64(0))
        scaled = dataclasses.replace(record.temperature_scaled, temperature=np.float32(1.5))
        return dataclasses.replace(record, metrics=dataclasses.replace(record.metrics, test=test),
                                   temperature_scaled=scaled)  # fmt: skip

    changed = [numpy_metrics(r) for r in group]
    cells = _cells(markdown_table(changed), "kep_svgp")
    accuracy = [100 * float(np.float32(r.metrics.test.accuracy)) for r in group]
    ece = [100 * float(np.float32(r.metrics.test.ece)) for r in group[:2]]
    assert cells["accuracy"] == f"{statistics.fmean(accuracy):.2f} ± {statistics.stdev(accuracy):.2f}"
    assert cells["ECE"] == f"{statistics.fmean(ece):.2f} ± {statistics.stdev(ece):.2f} (n=2)"
    assert cells["Brier"] == "0.00 ± 0.00" and _cells(markdown_table(changed), "kep_svgp+ts")["T"] == "1.50 ± 0.00"
    write_outputs(changed, CompareConfig(seeds=(0, 1, 2)), tmp_path)
    lines = list(csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text())))
    assert [line["test_ece"] for line in lines if line["attention"] == "kep_svgp"][2] == ""  # undefined: empty
    assert float(lines[0]["test_accuracy"]) == float(np.float32(group[0].metrics.test.accuracy))


def test_the_training_means_say_on_how_many_runs_they_are(records) -> None:
    # a run without its training summary (an older record) left the means over fewer runs than n, unsaid
    group = [r for r in records if (r.task, r.attention) == ("mnist1d", "kep_svgp") and r.seed < 3]
    first = dataclasses.replace(group[0].train, seconds=10.0, best_epoch=10, num_parameters=1200)
    group = [dataclasses.replace(group[0], train=first), group[1], dataclasses.replace(group[2], train=None)]
    cells = _table_cells(markdown_table(group), "Training:", "kep_svgp")
    seconds, best = statistics.fmean([10.0, 2.0]), statistics.fmean([10, 30])
    assert cells == ["kep_svgp", "3", "60", "n/a: not recorded", f"{best:.1f} (n=2)", "1000/1200",
                     f"{seconds:.1f} (n=2)", "tuned"]  # fmt: skip
    cells = _table_cells(markdown_table(group[:2]), "Training:", "kep_svgp")
    assert cells[4] == f"{best:.1f}" and cells[6] == f"{seconds:.1f}"


def test_temperature_at_its_bound_is_noted(records) -> None:
    cell = _cells(markdown_table(records), "sgpa+ts")["T"]
    assert cell.endswith("(1 of 5 at the fit's upper bound 100)")
    single = [r for r in records if r.attention == "sgpa" and r.seed == 0]
    assert _cells(markdown_table(single), "sgpa+ts")["T"] == "100.00 (1 of 1 at the fit's upper bound 100)"
    low = [dataclasses.replace(single[0], temperature_scaled=dataclasses.replace(single[0].temperature_scaled,
                                                                                 temperature=0.01))]  # fmt: skip
    assert "at the fit's lower bound 0.01" in _cells(markdown_table(low), "sgpa+ts")["T"]
    assert TEMPERATURE_BOUNDS == (0.01, 100.0)


def test_paired_tables_are_like_for_like(records) -> None:
    table = markdown_table(records).split("### digits")[0]
    untempered = table.split("Paired differences, kep_svgp − every other row")[1].split("\n\n", 2)[1]
    scaled = table.split("Paired differences, kep_svgp+ts − every other +ts row")[1].split("\n\n", 2)[1]
    assert [line.split(" |")[0] for line in untempered.splitlines()[2:]] == ["| softmax", "| sgpa"]
    assert [line.split(" |")[0] for line in scaled.splitlines()[2:]] == ["| softmax+ts", "| sgpa+ts"]
    # kep_svgp+ts - softmax+ts NLL: the paired t interval of the scaled NLLs over the 10 seeds
    left = {
        r.seed: r.temperature_scaled.metrics.test.nll
        for r in records
        if (r.task, r.attention) == ("mnist1d", "kep_svgp")
    }
    right = {
        r.seed: r.temperature_scaled.metrics.test.nll
        for r in records
        if (r.task, r.attention) == ("mnist1d", "softmax")
    }
    expected = paired_difference(left, right)
    row = next(line for line in scaled.splitlines() if line.startswith("| softmax+ts |"))
    assert f"{expected.mean:+.3f} [{expected.low:+.3f}, {expected.high:+.3f}]" in row and "| 10 |" in row
    assert "*" not in table  # descriptive: no significance marks


def test_format_difference_is_the_paired_t_interval() -> None:
    reference = {0: 0.90, 1: 0.85, 2: 0.88, 3: 0.91, 4: 0.87}
    other = {0: 0.80, 1: 0.82, 2: 0.79, 3: 0.85, 4: 0.81}
    interval = stats.ttest_rel(list(reference.values()), list(other.values())).confidence_interval(0.95)
    mean = statistics.fmean(reference[s] - other[s] for s in reference)
    assert format_difference(reference, other, True) == (
        f"{100 * mean:+.2f} [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}]"
    )
    four = {seed: value for seed, value in reference.items() if seed < 4}
    assert format_difference(four, other, False).endswith("(n = 4 < 5, no interval)")
    assert format_difference({7: 1.0}, other, False) == "-"


def test_published_numbers_are_listed(records) -> None:
    table = markdown_table(records)
    assert "| mnist1d | CNN | 94 |" in table and "| mnist1d | human | 96 |" in table and "not measured here" in table


# -- the headline ----------------------------------------------------------------------------------------------------
def _per_seed(records, row: str, scaled: bool, task: str = "mnist1d") -> dict[int, list[float]]:
    return {
        r.seed: (r.temperature_scaled.per_example if scaled else r.per_example)["test_nll"]
        for r in records
        if r.task == task and r.attention == row
    }


def test_primary_estimate_against_scipy_and_the_bootstrap(records) -> None:
    estimate = estimate_endpoint(records, PRIMARY_ENDPOINT, num_resamples=2000)
    left = {
        r.seed: r.temperature_scaled.metrics.test.nll
        for r in records
        if (r.task, r.attention) == ("mnist1d", "kep_svgp")
    }
    right = {
        r.seed: r.temperature_scaled.metrics.test.nll
        for r in records
        if (r.task, r.attention) == ("mnist1d", "softmax")
    }
    differences = [left[s] - right[s] for s in left]
    interval = stats.ttest_rel(list(left.values()), list(right.values())).confidence_interval(0.95)
    assert estimate.mean == pytest.approx(statistics.fmean(differences), abs=1e-14) and estimate.n == 10
    assert (estimate.t.low, estimate.t.high) == pytest.approx((interval.low, interval.high), abs=1e-12)
    assert estimate.p_value == pytest.approx(stats.ttest_rel(list(left.values()), list(right.values())).pvalue)
    bootstrap = hierarchical_difference(_per_seed(records, "kep_svgp", True), _per_seed(records, "softmax", True),
                                        num_resamples=2000)  # fmt: skip
    assert (estimate.hierarchical.low, estimate.hierarchical.high) == (bootstrap.low, bootstrap.high)
    assert estimate.examples == EXAMPLES and estimate.hierarchical.mean == pytest.approx(estimate.mean, abs=1e-12)


def test_verdict_rule() -> None:
    better = estimate_endpoint(_records(kep_shift=-0.1), PRIMARY_ENDPOINT, num_resamples=2000)
    kind, sentence = verdict(better)
    assert kind == "lower" and better.t.high < 0 and better.hierarchical.high < 0
    assert sentence.startswith("kep_svgp+ts − softmax+ts = ") and "has the lower test NLL, by" in sentence
    assert f"{abs(better.mean):.3f} nats" in sentence
    tie = estimate_endpoint(_records(kep_shift=0.0), PRIMARY_ENDPOINT, num_resamples=2000)
    kind, sentence = verdict(tie)
    hull = max(abs(min(tie.t.low, tie.hierarchical.low)), abs(max(tie.t.high, tie.hierarchical.high)))
    assert kind == "none" and sentence.startswith("No difference detected")
    assert f"exclude differences larger than {hull:.3f} nats in either direction" in sentence
    worse = estimate_endpoint(_records(kep_shift=0.1), PRIMARY_ENDPOINT, num_resamples=2000)
    assert verdict(worse)[0] == "higher"
    few = estimate_endpoint(_records(seeds=3), PRIMARY_ENDPOINT)
    # below 5 seeds: the mean difference, said to be no verdict
    nll = {
        (r.attention, r.seed): r.temperature_scaled.metrics.test.nll for r in _records(seeds=3) if r.task == "mnist1d"
    }
    mean = statistics.fmean(nll["kep_svgp", seed] - nll["softmax", seed] for seed in range(3))
    assert verdict(few) == (
        "missing",
        f"No verdict: kep_svgp+ts − softmax+ts = {mean:+.3f} nats, the mean over 3 paired seeds without an interval "
        "(an interval, and so a verdict, needs at least 5).",
    )
    absent = estimate_endpoint([r for r in _records() if r.attention != "softmax"], PRIMARY_ENDPOINT)
    assert verdict(absent)[1] == "Not measured: no softmax+ts runs on mnist1d."
    # the intervals disagree: no difference is stated, and the sentence says which one excludes 0
    from gpattn.comparison import PairedDifference
    from gpattn.comparison.headline import EndpointEstimate

    t = PairedDifference(-0.02, -0.03, -0.01, 10, 0.95, "t", tuple(range(10)))
    wide = PairedDifference(-0.02, -0.045, 0.01, 10, 0.95, "hierarchical", tuple(range(10)))
    kind, sentence = verdict(EndpointEstimate(PRIMARY_ENDPOINT, -0.02, 10, t, wide, EXAMPLES))
    assert kind == "none" and "(only the paired t interval excludes 0)" in sentence
    assert "exclude differences larger than 0.045 nats in either direction" in sentence
    opposite = PairedDifference(-0.02, 0.01, 0.05, 10, 0.95, "hierarchical", tuple(range(10)))  # both exclude 0
    kind, sentence = verdict(EndpointEstimate(PRIMARY_ENDPOINT, -0.02, 10, t, opposite, EXAMPLES))
    assert kind == "none" and "(the intervals exclude 0 on opposite sides)" in sentence and "only" not in sentence


def test_secondaries_are_holm_adjusted_over_the_family(records) -> None:
    estimates = estimate_secondaries(records)
    assert [e.endpoint for e in estimates] == list(SECONDARY_ENDPOINTS)
    p_values = []
    for estimate in estimates:
        column = estimate.endpoint.column
        rows = [row for row in flat_rows(records) if row["task"] == "mnist1d"]
        if column == "ood_declared_auroc":  # kep_svgp+ts (stochastic): mutual information, softmax+ts: max probability
            assert estimate.note == "pooled OOD set; kep_svgp+ts: mutual information, softmax+ts: max probability"
            left = [row["ood_pooled_auroc_mi"] for row in rows if row["attention"] == "kep_svgp+ts"]
            right = [row["ood_pooled_auroc"] for row in rows if row["attention"] == "softmax+ts"]
        else:
            left = [row[column] for row in rows if row["attention"] == estimate.endpoint.reference]
            right = [row[column] for row in rows if row["attention"] == estimate.endpoint.other]
        expected = stats.ttest_rel(left, right).pvalue if np.std(np.subtract(left, right)) > 0 else None
        if expected is not None:
            assert estimate.p_value == pytest.approx(expected, rel=1e-9)
        p_values.append(estimate.p_value)
    assert [e.holm for e in estimates] == holm_adjusted(p_values)
    text = headline_text(records, num_resamples=500)
    assert "### Secondary endpoints (Holm-adjusted over m = 6 tests)" in text
    assert "Holm-adjusted over the m = 6 secondary tests" in text


def test_the_ood_endpoint_reads_the_score_declared_by_the_row_kind_not_the_better_one(records) -> None:
    """A stochastic row is scored by its mutual information even where its maximum probability separates better on
    the OOD data (choosing the better one would select on the test data); a deterministic row by the maximum
    probability."""
    endpoint = next(e for e in SECONDARY_ENDPOINTS if e.column == DECLARED_OOD_SCORE)
    rows = flat_rows(records)
    for row in rows:
        if row["attention"] == "kep_svgp+ts":
            row["ood_pooled_auroc"], row["ood_pooled_auroc_mi"] = 0.95, 0.55 + 0.01 * row["seed"]
    reference, other, note = endpoint.seed_values(rows)
    kep = [row for row in rows if row["attention"] == "kep_svgp+ts" and row["task"] == "mnist1d"]
    softmax = [row for row in rows if row["attention"] == "softmax+ts" and row["task"] == "mnist1d"]
    assert reference == {row["seed"]: row["ood_pooled_auroc_mi"] for row in kep}
    assert other == {row["seed"]: row["ood_pooled_auroc"] for row in softmax}
    assert note == "pooled OOD set; kep_svgp+ts: mutual information, softmax+ts: max probability"


def test_table_states_the_endpoint_before_any_number(records) -> None:
    text = table_text(records, CompareConfig(seeds=tuple(range(10))))
    declared = text.index(declaration_text().split("\n")[0])
    assert declared < text.index("### Primary endpoint") < text.index("**Verdict**") < text.index("## Full tables")
    numbers = text.index("| paired t |")
    assert declared < numbers and text.index("### Secondary endpoints") > numbers
    assert "### The primary difference on the other tasks" in text and "| digits |" in text


def test_old_records_give_a_t_interval_only() -> None:
    estimate = estimate_endpoint(_records(old=True), PRIMARY_ENDPOINT)
    assert estimate.t is not None and estimate.hierarchical is None
    assert "no per-example values in these records" in estimate.note


# -- results.json, the page, the verdict check, --overwrite -----------------------------------------------------------
def test_results_json_records_the_environment(records, tmp_path) -> None:
    config = CompareConfig(seeds=tuple(range(10)), threads=1)
    written = write_outputs(records, config, tmp_path)
    assert [path.name for path in written] == ["results.json", "results.csv", "table.md"]
    saved = json.loads((tmp_path / "results.json").read_text())
    environment = saved["environment"]
    assert environment["torch"] == torch.__version__ and environment["numpy"] == np.__version__
    assert environment["machine"]["cores"] == os.cpu_count() and environment["machine"]["cpu"]
    assert environment["threads"]["intra_op"] == torch.get_num_threads()
    assert "BLAS_INFO=" in environment["blas"] and "get_num_threads" in environment["parallel_info"]
    assert environment["gpattn"] and "git_commit" in environment
    again = read_records(tmp_path / "results.json")
    assert [r.to_dict() for r in again] == [r.to_dict() for r in records]  # every record back, in order
    # results.csv: one line per flat row, in the same order, each cell under its own header
    rows, lines = flat_rows(records), list(csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text())))
    assert [(r["task"], r["attention"], str(r["seed"])) for r in rows] == [
        (line["task"], line["attention"], line["seed"]) for line in lines
    ]
    for row, line in zip(rows, lines, strict=True):  # an undefined value (NaN: softmax's MI AUROC) is an empty cell
        numbers = {key: value for key, value in row.items() if isinstance(value, float)}
        assert {key: float(line[key] or "nan") for key in numbers} == pytest.approx(numbers, nan_ok=True, rel=0, abs=0)
        assert all(line[key] == "" for key, value in row.items() if value is None)


def test_a_row_that_wraps_softmax_models_is_described_as_softmax() -> None:
    # Deep Ensembles and the Laplace row train softmax models: no KL weight, KSVD weight or s in their description
    values = [dict(embed_dim=32, depth=4, num_heads=2, epochs=60, lr=0.0049, beta=1.0, ksvd_weight=1.0, dropout=0.16)]
    softmax = _hyperparameters_text("softmax", values)
    assert softmax == "width 32 x depth 4 x 2 heads, at most 60 epochs, lr 0.0049, dropout 0.16"
    assert _hyperparameters_text("deep_ensemble", values) == _hyperparameters_text("laplace", values) == softmax
    assert "KL weight beta 1, KSVD weight eta 1" in _hyperparameters_text("kep_svgp", values)
    # s recorded as None (the layer's default, e.g. digits): said for the rows whose layer has an s, not for softmax
    default_s = [{**values[0], "num_inducing": None}]
    assert _hyperparameters_text("kep_svgp", default_s).endswith("KSVD weight eta 1, s = the layer's default")
    assert _hyperparameters_text("softmax", default_s) == softmax


def test_the_page_describes_a_row_this_process_does_not_know(records, tmp_path) -> None:
    # a row of an attention that the run's process registered (register_attention) is unknown to `gpattn report`:
    # the whole page failed with get_method's "unknown comparison row"; it shows every recorded hyperparameter
    values = [dict(embed_dim=32, depth=4, num_heads=2, epochs=60, lr=0.0049, beta=1.0, ksvd_weight=1.0, dropout=0.16)]
    assert _hyperparameters_text("my_attention", values) == (
        "width 32 x depth 4 x 2 heads, at most 60 epochs, lr 0.0049, dropout 0.16, KL weight beta 1, KSVD weight eta 1"
    )
    custom = [dataclasses.replace(r, attention="my_attention_ens2") for r in records[:2]]
    write_outputs(records[:2] + custom, CompareConfig(seeds=(0, 1)), tmp_path)
    page = results_page(read_run_folders([tmp_path]), [])
    assert "    * my_attention_ens2: at most 60 epochs, lr 0.003, s = the layer's default" in page


def test_the_page_names_the_rows_whose_temperature_raised_the_test_nll(records, tmp_path) -> None:
    assert _temperature_caveat(records) == []  # every +ts row of the fixture lowers the NLL (x 0.9)

    def sharpened(record: RunRecord, factor: float) -> RunRecord:  # T = 0.5, test NLL x factor
        scaled = record.temperature_scaled
        test = dataclasses.replace(scaled.metrics.test, nll=factor * record.metrics.test.nll)
        metrics = dataclasses.replace(scaled.metrics, test=test)
        return dataclasses.replace(
            record, temperature_scaled=dataclasses.replace(scaled, temperature=0.5, metrics=metrics)
        )

    # digits' sgpa raised by 6 % (named), mnist1d's by 4 % (under the 5 % threshold: not named)
    factors = {("digits", "sgpa"): 1.06, ("mnist1d", "sgpa"): 1.04}
    changed = [sharpened(r, factors[r.task, r.attention]) if (r.task, r.attention) in factors else r for r in records]
    (line,) = _temperature_caveat(changed)
    untempered = sum(r.metrics.test.nll for r in records if (r.task, r.attention) == ("digits", "sgpa")) / 5
    expected = f"digits sgpa+ts (sgpa: {untempered:.3f}, +ts: {1.06 * untempered:.3f}, mean T 0.50)"
    assert "mnist1d sgpa" not in line
    assert line.startswith(
        f"* Temperature scaling raised the mean clean test NLL by more than 5 % for 1 of 6 rows: {expected}."
    )
    write_outputs(changed, CompareConfig(seeds=tuple(range(10))), tmp_path)
    assert line in results_page(read_run_folders([tmp_path]), [])
    # a run with an undefined NLL (a diverged run) made every mean NaN and dropped the row: the others still count
    diverged = [
        dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, test=dataclasses.replace(r.metrics.test,
                                                                                               nll=math.nan)))
        if (r.task, r.attention, r.seed) == ("digits", "sgpa", 0) else r
        for r in changed
    ]  # fmt: skip
    (line,) = _temperature_caveat(diverged)
    nlls = [r.metrics.test.nll for r in records if (r.task, r.attention) == ("digits", "sgpa") and r.seed > 0]
    untempered = statistics.fmean(nlls)
    assert (
        f"digits sgpa+ts (sgpa: {untempered:.3f}, +ts: {1.06 * untempered:.3f}, mean T 0.50, over the 4 of 5 runs"
        in line
    )


def test_the_page_names_the_code_of_runs_made_by_other_code(records, tmp_path) -> None:
    """A folder whose run files were made by other code than the report writer's (``--resume`` kept them) says so on
    the page, with each code's number of runs; runs of the writer's code, or a folder without run files, add nothing."""
    from gpattn.comparison.environment import code_label, code_version

    config = CompareConfig(seeds=tuple(range(10)))
    write_outputs(records, config, tmp_path / "plain")  # no run files: no codes entry
    assert "made by other code" not in results_page(read_run_folders([tmp_path / "plain"]), [])
    runs_folder = tmp_path / "mixed" / "runs"
    runs_folder.mkdir(parents=True)
    other = {"gpattn": "0.0.1", "git_commit": "abc123"}
    for index, record in enumerate(records):
        code = other if index < 3 else code_version()
        content = {"code": code, "record": record.to_dict()}
        (runs_folder / f"{record.task}-{record.attention}-{record.seed}.json").write_text(json.dumps(content))
    write_outputs(records, config, tmp_path / "mixed")
    page = results_page(read_run_folders([tmp_path / "mixed"]), [])
    expected = f"{code_label(code_version())}: {len(records) - 3} runs; gpattn 0.0.1, commit abc123: 3 runs"
    assert f"* the runs were made by other code than the report's: {expected}" in page
    for path in runs_folder.iterdir():  # every run of the writer's code
        path.write_text(json.dumps({**json.loads(path.read_text()), "code": code_version()}))
    write_outputs(records, config, tmp_path / "mixed")
    assert "made by other code" not in results_page(read_run_folders([tmp_path / "mixed"]), [])


def test_results_page_and_verdict_check(records, tmp_path) -> None:
    config = CompareConfig(seeds=tuple(range(10)))
    write_outputs(records, config, tmp_path / "one")
    write_outputs(records[:10], dataclasses.replace(config, jobs=2), tmp_path / "part")  # other scheduling only
    merged = read_run_folders([tmp_path / "one", tmp_path / "part"])  # the same runs in both: kept once
    assert len(merged.records) == len(records)
    page = results_page(merged, ["results_figures/shift_mnist1d.png"])
    assert page.index("## The question, declared before the run") < page.index("## Headline")
    assert page.index(declaration_text()) < page.index("| paired t |") < page.index("## Machine")
    assert "![shift_mnist1d](<results_figures/shift_mnist1d.png>)" in page and "CPU " in page
    assert "mnist1d: kep_svgp (10 seeds, tuned)" in page
    # each row's recorded hyperparameters, the row parameters only where the row uses them (softmax: no s)
    assert "    * kep_svgp: at most 60 epochs, lr 0.003, s = the layer's default\n" in page  # recorded s: None
    assert "    * softmax: at most 60 epochs, lr 0.003\n" in page
    hyperparameters = dict(embed_dim=64, depth=1, num_heads=2, epochs=60, lr=0.0064, beta=2914.5, ksvd_weight=18.46,
                           num_inducing=5, dropout=0.29, patience=15)  # fmt: skip
    tuned = [dataclasses.replace(r, hyperparameters=hyperparameters) for r in records]
    write_outputs(tuned, config, tmp_path / "tuned")
    page = results_page(read_run_folders([tmp_path / "tuned"]), [])
    assert (
        "    * kep_svgp: width 64 x depth 1 x 2 heads, at most 60 epochs, lr 0.0064, dropout 0.29, KL weight beta "
        "2.91e+03, KSVD weight eta 18.5, s = 5, early stopping after 15 epochs\n" in page
    )
    softmax = "    * softmax: width 64 x depth 1 x 2 heads, at most 60 epochs, lr 0.0064, dropout 0.29, early stopping"
    assert softmax in page
    # the verdict check: the same records hold; a run where kep_svgp is worse differs
    holds, lines = compare_verdicts(merged, read_run_folders([tmp_path / "one"]))
    assert holds and lines[0] == "The primary verdict holds (lower / lower)."
    write_outputs(_records(kep_shift=0.1), config, tmp_path / "worse")
    holds, lines = compare_verdicts(read_run_folders([tmp_path / "one"]), read_run_folders([tmp_path / "worse"]))
    assert not holds and lines[0] == "The primary verdict differs (lower / higher)."
    changed = dataclasses.replace(
        records[0], metrics=dataclasses.replace(records[0].metrics, test=records[1].metrics.test)
    )
    write_outputs([changed], config, tmp_path / "clash")
    with pytest.raises(ValueError, match="differs between"):
        read_run_folders([tmp_path / "one", tmp_path / "clash"])


def test_gpattn_report_command(records, tmp_path, capsys) -> None:
    config = CompareConfig(seeds=tuple(range(10)))
    records = [r for r in records if r.task == "mnist1d"]  # fewer figures to draw
    write_outputs(records, config, tmp_path / "a")
    write_outputs(records, dataclasses.replace(config, threads=2), tmp_path / "b")
    assert main(["report", str(tmp_path / "a"), "--same-verdict", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("The primary verdict holds") and "settings that differ: threads: 1 / 2" in printed
    page = tmp_path / "docs" / "results.md"
    (tmp_path / "docs" / "results_figures").mkdir(parents=True)
    # an earlier page's figure of a task these runs do not have, and a file that is not gpattn's
    (tmp_path / "docs" / "results_figures" / "shift_digits.png").write_bytes(b"earlier")
    (tmp_path / "docs" / "results_figures" / "notes.txt").write_text("the user's")
    capsys.readouterr()
    assert main(["report", str(tmp_path / "a"), "--page", str(page)]) == 0
    assert "gpattn report: note: removed shift_digits.png from" in capsys.readouterr().err
    assert (tmp_path / "docs" / "results_figures" / "notes.txt").read_text() == "the user's"
    (tmp_path / "docs" / "results_figures" / "notes.txt").unlink()
    figures = sorted(path.name for path in (tmp_path / "docs" / "results_figures").iterdir())
    assert "shift_digits.png" not in figures
    assert "shift_mnist1d.png" in figures and "gap_vs_shift_ece_mnist1d.png" in figures
    assert all(f"(<results_figures/{name}>)" in page.read_text() for name in figures)
    assert main(["report", str(tmp_path / "a")]) == 0 and "**Verdict**" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # not a run folder: a usage error
        main(["report", str(tmp_path / "docs")])


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ("", "expected a markdown file name ending in .md, got ''"),
        ("results.txt", "expected a markdown file name ending in .md, got 'results.txt'"),  # results_figures/ shared
        (".md", "expected a markdown file name ending in .md, got '.md'"),
        ("{folder}", "expected a markdown file, got the folder"),
    ],
)
def test_a_page_that_is_not_a_markdown_file_is_refused_by_the_parser(page, message, tmp_path, capsys) -> None:
    folder = tmp_path / "pages.md"
    folder.mkdir()
    with pytest.raises(SystemExit) as error:
        build_parser().parse_args(["report", "--page", page.format(folder=folder), str(tmp_path)])  # --page first
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_each_other_folder_is_checked_and_the_checks_are_a_section_of_the_page(records, tmp_path, capsys) -> None:
    config = CompareConfig(seeds=tuple(range(10)))
    write_outputs([r for r in records if r.task == "mnist1d"], config, tmp_path / "a")
    write_outputs([r for r in records if r.task == "mnist1d"], dataclasses.replace(config, threads=2), tmp_path / "b")
    write_outputs([r for r in _records(kep_shift=0.1) if r.task == "mnist1d"], config, tmp_path / "worse")
    page = tmp_path / "results.md"
    others = [str(tmp_path / "b"), str(tmp_path / "worse")]
    # one folder whose verdict differs: exit status 1, each folder checked on its own (not merged)
    assert main(["report", str(tmp_path / "a"), "--page", str(page), "--same-verdict", *others]) == 1
    printed = capsys.readouterr().out
    assert printed.count("The primary verdict holds (lower / lower).") == 1
    assert printed.count("The primary verdict differs (lower / higher).") == 1
    text = page.read_text()
    (a,), (b,), (worse,) = (read_run_folders([folder]).names for folder in [tmp_path / "a", *others])  # as shown
    assert f"`gpattn report {a} --same-verdict {b} {worse} --page PAGE`" in text
    section = text.split("## The primary verdict on other runs\n")[1].split("## Full tables")[0]
    assert f"`{b}`: The primary verdict holds (lower / lower)." in section
    assert f"`{worse}`: The primary verdict differs (lower / higher)." in section
    assert "* settings that differ: threads: 1 / 2" in section
    assert main(["report", str(tmp_path / "a"), "--same-verdict", str(tmp_path / "b")]) == 0  # all hold: 0


def test_overwrite_deletes_every_output_the_writers_can_write(tmp_path) -> None:
    from gpattn.cli.compare import run_folder_outputs

    out = tmp_path / "run"
    out.mkdir()
    outputs = run_folder_outputs()
    for name in (*outputs[1:], "notes.txt"):
        (out / name).write_text("stale")
    (out / "runs").mkdir()
    (out / "runs" / "pointer-softmax-0.json").write_text("stale")
    assert {"fidelity.png", "reliability_mnist1d.png", "shift_digits.png", "gap_vs_shift_ece_mnist1d.png",
            "ood_histograms_mnist1d.png", "shift.png", "ood_histograms.png"} <= set(outputs)  # fmt: skip
    argv = ["compare", "--out", str(out), "--overwrite", "--attentions", "softmax", "--tasks", "pointer"]
    assert main([*argv, "--seeds", "0", "--pointer-epochs", "1", "--eval-samples", "2", "--no-progress"]) == 0
    left = {path.name for path in out.iterdir() if path.is_file() and path.read_text(errors="ignore") == "stale"}
    assert left == {"notes.txt"}  # every output replaced or deleted; another file kept
    assert {"reliability_pointer.png", "table.md", "results.json"} <= {path.name for path in out.iterdir()}


def test_the_results_page_states_the_declared_endpoints() -> None:
    # docs/guide/results.md, written by hand before the protocol's run and by gpattn report after it, declares the
    # endpoints in the words the report uses
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "guide" / "results.md"
    text = page.read_text()
    assert declaration_text() in text
    numbers = [position for position in (text.find("**Verdict**"), text.find("\n| ")) if position >= 0]
    assert text.index(declaration_text()) < min(numbers, default=len(text))  # before the first verdict or table


def test_a_primary_estimate_on_fewer_seeds_than_declared_says_it_is_a_subset() -> None:
    """make main runs 7 of the endpoint's 10 seeds: its headline says so and names the declared run; 10 seeds do not."""
    note = "7 paired seeds, fewer than the 10 the endpoint is declared on"
    assert note in headline_text(_records(seeds=7), num_resamples=200)
    assert "fewer than the 10 the endpoint is declared on" not in headline_text(_records(), num_resamples=200)


def test_rows_that_share_no_seed_say_so(records) -> None:
    # kep_svgp on seeds 0-1, softmax on 2-3: the verdict read "0 paired seed(s), fewer than 5", as if too few seeds ran
    kept = [
        r
        for r in records
        if r.task == "mnist1d"
        and (r.seed, r.attention) in {(0, "kep_svgp"), (1, "kep_svgp"), (2, "softmax"), (3, "softmax")}
    ]
    estimate = estimate_endpoint(kept, PRIMARY_ENDPOINT)
    assert estimate.n == 0 and math.isnan(estimate.mean) and estimate.t is None
    reason = "kep_svgp+ts and softmax+ts share no seed on mnist1d (seeds 0, 1 and 2, 3): nothing to pair"
    assert estimate.missing == reason and verdict(estimate) == ("missing", f"Not measured: {reason}.")
    assert "n/a: kep_svgp and softmax share no seed on mnist1d (seeds 0, 1 and 2, 3)" in headline_text(kept)


def test_two_executions_of_one_run_merge_but_other_numbers_do_not(records, tmp_path) -> None:
    """make main's runs and --full's, trained separately, differ in their wall time (and older records lack the epoch
    count): they merge; a run whose numbers differ is refused."""
    config = CompareConfig(seeds=tuple(range(10)))
    write_outputs(records[:4], config, tmp_path / "one")
    timed = [
        dataclasses.replace(r, train=dataclasses.replace(r.train, seconds=r.train.seconds + 7.0, epochs_trained=3.0))
        for r in records[:4]
    ]
    write_outputs(timed, config, tmp_path / "again")
    assert len(read_run_folders([tmp_path / "one", tmp_path / "again"]).records) == 4
    changed = [dataclasses.replace(timed[0], train=dataclasses.replace(timed[0].train, best_epoch=1)), *timed[1:]]
    write_outputs(changed, config, tmp_path / "other")
    with pytest.raises(ValueError, match="differs between"):
        read_run_folders([tmp_path / "one", tmp_path / "other"])


# -- fewer seeds than an interval needs: no test either ----------------------------------------------------------------
def _secondary_cells(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} ("))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.mark.parametrize("seeds", [2, 3, 4])
def test_below_five_seeds_the_secondaries_have_no_p_value_and_no_statement(seeds, tmp_path) -> None:
    """The paired-t interval and the paired-t test are one inference: below MIN_SEEDS_FOR_INTERVALS neither exists.
    The fixture's accuracy differs by the same 2 points on every seed, whose p-value would be exactly 0 ("stated")."""
    records = _records(seeds=seeds)
    estimates = estimate_secondaries(records)
    assert all(e.n == seeds and e.t is None for e in estimates)
    assert all(math.isnan(e.p_value) and math.isnan(e.holm) for e in estimates)
    assert all(math.isnan(estimate_endpoint(records, e).p_value) for e in (PRIMARY_ENDPOINT, *SECONDARY_ENDPOINTS))
    text = headline_text(records, num_resamples=200)
    assert "### Secondary endpoints (Holm-adjusted over m = 0 tests)" in text
    assert "Note: 6 of the 6 declared secondaries have no test in these records" in text
    cells = _secondary_cells(text, "accuracy")
    assert cells[1] == "+2.00" and cells[2] == f"n/a: {seeds} paired seed(s), fewer than 5: no interval"
    assert cells[3:] == [str(seeds), "n/a", "n/a", "n/a"]
    assert "| yes |" not in text and "| no |" not in text
    # the verdict check between two such folders, and the results page, say the same
    config = CompareConfig(seeds=tuple(range(seeds)))
    write_outputs(records, config, tmp_path / "one")
    write_outputs(records, dataclasses.replace(config, threads=2), tmp_path / "two")
    folders = [read_run_folders([tmp_path / name]) for name in ("one", "two")]
    _, lines = compare_verdicts(*folders)
    assert "secondary accuracy: no test / no test (same)" in lines
    assert (
        "| yes |" not in results_page(folders[0], []) and "| yes |" not in (tmp_path / "one" / "table.md").read_text()
    )


def test_a_secondary_below_five_seeds_leaves_the_holm_family() -> None:
    """With 10 seeds but the accuracy of kep_svgp+ts defined on 3, that endpoint has no test and does not count in
    m: the others are Holm-adjusted over the 5 tests there are (holm_adjusted's NaN, the declared treatment)."""
    records = []
    for record in _records():
        if (record.task, record.attention) == ("mnist1d", "kep_svgp") and record.seed >= 3:
            scaled = record.temperature_scaled
            test = dataclasses.replace(scaled.metrics.test, accuracy=math.nan)
            scaled = dataclasses.replace(scaled, metrics=dataclasses.replace(scaled.metrics, test=test))
            record = dataclasses.replace(record, temperature_scaled=scaled)
        records.append(record)
    estimates = estimate_secondaries(records)
    accuracy = next(e for e in estimates if e.endpoint.column == "test_accuracy")
    assert accuracy.n == 3 and math.isnan(accuracy.p_value) and math.isnan(accuracy.holm)
    others = [e for e in estimates if e is not accuracy]
    assert all(e.n == 10 and not math.isnan(e.p_value) for e in others)
    assert [e.holm for e in others] == holm_adjusted([e.p_value for e in others])
    text = headline_text(records, num_resamples=200)
    assert "### Secondary endpoints (Holm-adjusted over m = 5 tests)" in text
    assert "Note: 1 of the 6 declared secondaries has no test in these records" in text
    assert _secondary_cells(text, "accuracy")[3:] == ["3", "n/a", "n/a", "n/a"]


def test_the_paired_n_counts_the_seeds_both_rows_ran_and_each_cell_its_own(records) -> None:
    """n beside the paired cells is the seeds both rows ran (the main table's n); a cell defined on fewer seeds says
    how many, as the main table's cells do."""

    def without_nll(records, seeds):  # kep_svgp's untempered NLL undefined on ``seeds`` of mnist1d
        changed = []
        for r in records:
            if (r.task, r.attention) == ("mnist1d", "kep_svgp") and r.seed in seeds:
                test = dataclasses.replace(r.metrics.test, nll=math.nan)
                r = dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, test=test))
            changed.append(r)
        return changed

    def softmax_cells(records):
        table = markdown_table(records).split("### digits")[0]
        section = table.split("Paired differences, kep_svgp − every other row")[1].split("\n\n", 2)[1]
        header, *_ = section.splitlines()
        line = next(line for line in section.splitlines() if line.startswith("| softmax |"))
        names = [cell.strip() for cell in header.strip("|").split("|")]
        return dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")), strict=True))

    three = [r for r in records if r.seed < 3]
    cells = softmax_cells(without_nll(three, {0}))
    assert cells["n"] == "3" and cells["accuracy"].endswith("(n = 3 < 5, no interval)")
    assert cells["NLL"].endswith("(n = 2 < 5, no interval)")
    cells = softmax_cells(without_nll(records, {0, 1}))
    assert cells["n"] == "10" and cells["NLL"].endswith("] (n=8)") and cells["accuracy"].endswith("]")


def test_the_page_says_one_seed_not_one_seeds(records, tmp_path) -> None:
    single = [r for r in records if r.seed == 0]
    write_outputs(single, CompareConfig(seeds=(0,)), tmp_path)
    page = results_page(read_run_folders([tmp_path]), [])
    assert "1 seed per row;" in page and "kep_svgp (1 seed, tuned)" in page
    assert "1 seeds" not in page and "1 seeds" not in (tmp_path / "table.md").read_text()


# -- ensemble grids, folders of other settings, damaged results.json, the ECE bins, few seeds, --quick -----------------
def _table_cells(text: str, title: str, row: str) -> list[str]:
    """The cells of ``row`` in the first table after the line ``title``."""
    section = text.split(title + "\n")[1]
    line = next(line for line in section.splitlines() if line.startswith(f"| {row} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_an_ensemble_grid_is_paired_against_the_kep_svgp_ensemble_of_its_size(tmp_path, capsys) -> None:
    """gpattn compare --ensemble 2 records kep_svgp_ens2 and softmax_ens2 (and their +ts rows): compare's table.md,
    gpattn report and its page pair them like for like, as the tables of single models pair kep_svgp with the other
    rows, and the headline reads the primary difference on the ensembles' +ts rows (before: no paired tables, a
    headline of "no kep_svgp+ts runs", and the page failed on "unknown comparison row 'softmax_ens2'")."""
    out, page = tmp_path / "ens", tmp_path / "page.md"
    argv = ["compare", "--attentions", "kep_svgp", "softmax", "--tasks", "pointer", "--seeds", "0", "1"]
    argv += ["--pointer-epochs", "1", "--eval-samples", "1", "--fidelity-sequences", "0", "--ensemble", "2"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    report = capsys.readouterr().out
    assert main(["report", str(out), "--page", str(page)]) == 0
    entries = json.loads((out / "results.json").read_text())["records"]
    nll = {(e["attention"], e["seed"]): e["metrics"]["test"]["nll"] for e in entries}
    scaled = {(e["attention"], e["seed"]): e["temperature_scaled"]["metrics"]["test"]["nll"] for e in entries}
    assert set(nll) == {(row, seed) for row in ("kep_svgp_ens2", "softmax_ens2") for seed in (0, 1)}
    untempered = statistics.fmean(nll["kep_svgp_ens2", s] - nll["softmax_ens2", s] for s in (0, 1))
    tempered = statistics.fmean(scaled["kep_svgp_ens2", s] - scaled["softmax_ens2", s] for s in (0, 1))
    for text in ((out / "table.md").read_text(), report, page.read_text()):
        title = "Paired differences, kep_svgp_ens2 − every other row (same units):"
        cells = _table_cells(text, title, "softmax_ens2")
        assert cells[:2] == ["softmax_ens2", "2"] and cells[3] == f"{untempered:+.3f} (n = 2 < 5, no interval)"
        title = "Paired differences, kep_svgp_ens2+ts − every other +ts row (same units):"
        cells = _table_cells(text, title, "softmax_ens2+ts")
        assert cells[:2] == ["softmax_ens2+ts", "2"] and cells[3] == f"{tempered:+.3f} (n = 2 < 5, no interval)"
        assert f"| pointer | {tempered:+.3f} | n/a: 2 paired seed(s), fewer than 5: no interval | 2 |" in text
        assert "Note: these records are ensembles of 2 members (`gpattn compare --ensemble 2`)" in text
        assert "no kep_svgp_ens2+ts runs on mnist1d" in text  # the declared task is not in this grid
    # each ensemble's hyperparameters as its members' row's: the KL and KSVD weights for KEP-SVGP, not for softmax
    assert (
        "    * kep_svgp_ens2: width 32 x depth 2 x 2 heads, at most 1 epochs, lr 0.003, weight decay 0.01, dropout "
        "0.00, KL weight beta 1, KSVD weight eta 1" in page.read_text()
    )
    assert (
        "    * softmax_ens2: width 32 x depth 2 x 2 heads, at most 1 epochs, lr 0.003, weight decay 0.01, dropout "
        "0.00\n" in page.read_text()
    )


def test_the_endpoints_of_an_ensemble_grid_are_read_on_its_ensembles() -> None:
    """Records of kep_svgp_ens2 and softmax_ens2 on mnist1d (10 seeds): the primary estimate is the paired-t interval of
    their +ts NLLs (scipy), its secondaries those of the ensembles, and verdict checks read them too."""
    records = [dataclasses.replace(r, attention=f"{r.attention}_ens2") for r in _records()]
    mnist = [r for r in records if r.task == "mnist1d"]
    left = {r.seed: r.temperature_scaled.metrics.test.nll for r in mnist if r.attention == "kep_svgp_ens2"}
    right = {r.seed: r.temperature_scaled.metrics.test.nll for r in mnist if r.attention == "softmax_ens2"}
    differences = [left[seed] - right[seed] for seed in range(10)]
    low, high = stats.t.interval(0.95, 9, loc=np.mean(differences), scale=stats.sem(differences))
    text = headline_text(records, num_resamples=200)
    cells = _table_cells(text, "|---|---|---|---|", "paired t")
    assert cells[1:] == [f"{np.mean(differences):+.3f} nats", f"[{low:+.3f}, {high:+.3f}]", "10 seeds"]
    assert "kep_svgp_ens2+ts − softmax_ens2+ts = " in text
    secondaries = estimate_secondaries(records)
    assert [e.endpoint.reference for e in secondaries] == ["kep_svgp_ens2"] + ["kep_svgp_ens2+ts"] * 5
    assert all(e.n == 10 and not math.isnan(e.p_value) for e in secondaries)
    single = estimate_secondaries(_records())  # the same numbers under the declared names: the same tests
    assert [e.p_value for e in secondaries] == [e.p_value for e in single]


def test_folders_made_with_other_settings_are_not_merged(records, tmp_path, capsys) -> None:
    """kep_svgp trained 3 epochs in one folder and softmax 1 in another were paired without a word: the settings that
    determine a run's numbers (those --resume checks) must agree; the rows, tasks, seeds and scheduling may differ."""
    config = CompareConfig(seeds=tuple(range(10)))
    kep, softmax = ([r for r in records if r.attention == row] for row in ("kep_svgp", "softmax"))
    write_outputs(kep, dataclasses.replace(config, mnist1d_epochs=3), tmp_path / "kep")
    write_outputs(softmax, dataclasses.replace(config, mnist1d_epochs=1, ece_bins=5), tmp_path / "softmax")
    message = (
        f"{tmp_path / 'kep'} and {tmp_path / 'softmax'} were made with other settings (ece_bins: 15 / 5, "
        "mnist1d_epochs: 3 / 1): their runs are not comparable; report each folder on its own (--same-verdict "
        "compares the verdicts of two folders)"
    )
    with pytest.raises(ValueError) as error:
        read_run_folders([tmp_path / "kep", tmp_path / "softmax"])
    assert str(error.value) == message
    assert main(["report", str(tmp_path / "kep"), str(tmp_path / "softmax")]) == 1
    assert capsys.readouterr().err == f"gpattn report: error: {message}\n"
    write_outputs(kep[:2], dataclasses.replace(config, mnist1d_epochs=1), tmp_path / "again")  # runs of both folders
    with pytest.raises(ValueError, match=r"again were made with other settings \(mnist1d_epochs: 3 / 1\)"):
        read_run_folders([tmp_path / "kep", tmp_path / "again"])
    other = dataclasses.replace(config, mnist1d_epochs=3, attentions=("softmax",), tasks=("mnist1d",), seeds=(0, 1))
    other = dataclasses.replace(other, jobs=2)
    write_outputs(softmax, dataclasses.replace(other, progress=False, smoke_test=True), tmp_path / "rows")
    merged = read_run_folders([tmp_path / "kep", tmp_path / "rows"])
    assert len(merged.records) == len(kep) + len(softmax)
    bare = tmp_path / "rows" / "results.json"
    bare.write_text(json.dumps({**json.loads(bare.read_text()), "config": {}}))
    with pytest.raises(ValueError, match=r"rows: its results.json records no settings \('config'\)"):
        read_run_folders([tmp_path / "kep", tmp_path / "rows"])


def test_the_report_states_the_runs_ece_bins(records, tmp_path, capsys) -> None:
    """--ece-bins 5: table.md, gpattn report and the page say 5 bins (the legend, the ECE endpoint's label, a note
    that the declared endpoint has 15), and the ECE difference is that of the records."""
    write_outputs(records, CompareConfig(seeds=tuple(range(10)), ece_bins=5), tmp_path / "five")
    assert main(["report", str(tmp_path / "five")]) == 0
    page = results_page(read_run_folders([tmp_path / "five"]), [])
    ece = {(r.attention, r.seed): r.temperature_scaled.metrics.test.ece for r in records if r.task == "mnist1d"}
    difference = 100 * statistics.fmean(ece["kep_svgp", s] - ece["softmax", s] for s in range(10))
    for text in ((tmp_path / "five" / "table.md").read_text(), capsys.readouterr().out, page):
        assert "ECE: 5 equal-width bins, top label" in text and "estimate on 5 equal-mass bins" in text
        assert "Note: the ECE is on 5 equal-width bins (`--ece-bins 5`), not the 15 it is declared on." in text
        cells = _secondary_cells(text, "ECE (5 bins)")
        assert cells[:2] == ["ECE (5 bins) (kep_svgp+ts − softmax+ts), points", f"{difference:+.2f}"]
        assert "15 equal" not in text and "| ECE (15 bins)" not in text
    assert declaration_text() in page  # the declaration stays as declared
    from gpattn.comparison.endpoints import DECLARED_ECE_BINS
    from gpattn.comparison.evaluation import DEFAULT_ECE_BINS

    assert DECLARED_ECE_BINS == DEFAULT_ECE_BINS == CompareConfig().ece_bins == 15  # the default is the declared
    default = table_text(records, CompareConfig(seeds=tuple(range(10))))
    assert "ECE: 15 equal-width bins" in default and "| ECE (15 bins) (" in default and "--ece-bins" not in default


@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        ("config", None, "expected 'config' to be an object, got null"),
        ("config", [1], "expected 'config' to be an object, got a list"),
        ("config", {"seeds": 5}, "expected config 'seeds' to be a list, got a number"),
        ("config", {"primary_seeds": ["5"]}, "expected config 'primary_seeds' to be a list of integers, got ['5']"),
        ("environment", "cpu", "expected 'environment' to be an object, got a string"),
        ("environment", {"machine": None}, "expected environment 'machine' to be an object, got null"),
        ("codes", {"runs": []}, "expected 'codes' to be a list, got an object"),
        ("codes", [None], "expected each entry of 'codes' to be an object, got null"),
    ],
)
def test_a_results_json_entry_of_the_wrong_type_is_one_line_naming_the_file(
    entry, value, message, records, tmp_path, capsys
) -> None:
    # before: AttributeError tracebacks ('NoneType' object has no attribute 'get' / 'items')
    config = CompareConfig(seeds=(0, 1))
    write_outputs(records[:2], config, tmp_path / "bad")
    write_outputs(records[:2], config, tmp_path / "good")
    path = tmp_path / "bad" / "results.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), entry: value}))
    with pytest.raises(ValueError) as error:
        read_run_folders([tmp_path / "bad"])
    assert str(error.value).startswith(f"{path}: {message} (edited or damaged: ")
    page = str(tmp_path / "page.md")
    for argv in (
        [str(tmp_path / "bad"), "--page", page],
        [str(tmp_path / "good"), "--same-verdict", str(tmp_path / "bad")],
    ):
        assert main(["report", *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"gpattn report: error: {path}: {message} ") and err.count("\n") == 1


def test_a_record_that_cannot_be_read_is_named_with_its_file_and_run(records, tmp_path, capsys) -> None:
    write_outputs(records[:3], CompareConfig(seeds=(0, 1, 2)), tmp_path)
    path = tmp_path / "results.json"
    content = json.loads(path.read_text())
    del content["records"][1]["metrics"]["test"]["nll"]
    path.write_text(json.dumps(content))
    expected = (
        f"{path}: record 2 (task mnist1d, row kep_svgp, seed 1): record.metrics.test: missing entries ['nll'], "
        "unexpected entries []"
    )
    with pytest.raises(ValueError) as error:
        read_run_folders([tmp_path])
    assert str(error.value) == expected
    assert main(["report", str(tmp_path)]) == 1 and capsys.readouterr().err == f"gpattn report: error: {expected}\n"


@pytest.mark.parametrize(("seeds", "main_subset"), [(range(3), False), (range(6), False), (range(7), True),
                                                    (range(3, 10), False)])  # fmt: skip
def test_the_primary_mean_below_five_seeds_and_a_subset_note_that_is_true(seeds, main_subset) -> None:
    """Below 5 paired seeds the headline shows the primary mean difference (no interval, no verdict, said so), not
    "Not measured"; the note names make main only for make main's seeds 0-6, else it says the count."""
    records = [r for r in _records() if r.seed in seeds]
    primary = headline_text(records, num_resamples=200).split("### Primary endpoint")[1].split("### Secondary")[0]
    nll = {(r.attention, r.seed): r.temperature_scaled.metrics.test.nll for r in records if r.task == "mnist1d"}
    mean = statistics.fmean(nll["kep_svgp", seed] - nll["softmax", seed] for seed in seeds)
    n = len(seeds)
    assert f"| paired t | {mean:+.3f} nats | " in primary
    if n < 5:
        assert f"| paired t | {mean:+.3f} nats | none: fewer than 5 paired seeds | {n} seeds |" in primary
        assert (
            f"**Verdict**: No verdict: kep_svgp+ts − softmax+ts = {mean:+.3f} nats, the mean over {n} paired seeds "
            "without an interval (an interval, and so a verdict, needs at least 5)." in primary
        )
        assert "Not measured" not in primary
    assert f"Note: {n} paired seeds, fewer than the 10 the endpoint is declared on: " in primary
    assert ("these records are the subset of `make main` (seeds 0-6)" in primary) == main_subset
    assert "`make main`" in primary if main_subset else "make main" not in primary
    assert "the declared estimate is the one of `gpattn compare --full` (seeds 0-9)." in primary


def test_the_smoke_test_banner_says_the_seeds_and_epochs_it_ran(records) -> None:
    # before: "one seed and a few epochs" whatever --seeds was
    config = CompareConfig.quick(seeds=(0, 1, 2), pointer_epochs=1)
    assert (
        "**Smoke test (`--quick`)**: 3 seeds and 1 epoch on pointer, 10 epochs on digits, to check that everything "
        "runs. The pointer task is not learned in this budget; these numbers compare nothing."
        in table_text(records, config)
    )
    one = table_text(records, CompareConfig.quick(tasks=("digits",)))
    assert (
        "**Smoke test (`--quick`)**: 1 seed and 10 epochs on digits, to check that everything runs. These numbers "
        "compare nothing." in one
    )


def test_a_results_file_is_read_as_utf8_whatever_the_locale(records, tmp_path, monkeypatch) -> None:
    """A results.json holding raw UTF-8 (edited by hand, or written by another JSON tool) is read as written also
    where the locale's encoding is ASCII (where the folder was refused as unreadable)."""
    import io

    write_outputs(records[:2], CompareConfig(seeds=(0, 1)), tmp_path)
    path = tmp_path / "results.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    content["records"][0]["attention"] = "softmax_σ"
    path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: encoding or "ascii")  # an ASCII locale
    assert "softmax_σ" in {record.attention for record in read_run_folders([tmp_path]).records}
