"""The comparison's results side at its edges: the seed statistics (two seeds, unequal seed sets, identical rows, a
constant shift, NaN, magnitudes from 1e-8 to 1e8) against scipy, the headline's Holm column and the primary estimate
on huge values, the verdict check between two runs, the files of a run folder (results.csv and results.json with odd
row names, read back exactly), the rendering of row names in the markdown tables (by Python-Markdown, which renders
the documentation site, and by markdown-it, a CommonMark parser) and the comparison figures of one row and one seed.

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from fractions import Fraction
from urllib.parse import unquote

import markdown
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from bs4 import BeautifulSoup
from markdown_it import MarkdownIt
from scipy import stats

from gpattn.comparison import CompareConfig, RunRecord
from gpattn.comparison.endpoints import DECLARED_OOD_SCORE, PRIMARY_ENDPOINT, SECONDARY_ENDPOINTS
from gpattn.comparison.headline import FAMILY_WISE_LEVEL, estimate_endpoint, estimate_secondaries, headline_text
from gpattn.comparison.report import markdown_table, write_outputs
from gpattn.comparison.results_page import (
    RunFolders,
    _temperature_caveat,
    compare_verdicts,
    read_run_folders,
    results_page,
)
from gpattn.comparison.statistics import paired_difference, paired_p_value, scaled_mean, summarize_seeds
from gpattn.comparison.table_rows import flat_rows, markdown_cell
from gpattn.plotting.comparison import plot_ood_histograms, plot_reliability_diagrams, plot_spectra

matplotlib.use("Agg")  # the figures are drawn off screen

OTHER_FIELDS = ("confidence", "ece", "mce", "brier", "aurc", "eaurc", "auroc", "fpr95")


# -- helpers -----------------------------------------------------------------------------------------------------------
def _record(row: str, seed: int, *, nll: float = 0.4, accuracy: float = 0.9, ood=None, task="mnist1d") -> RunRecord:
    """A record read from JSON data: the test metrics (``nll``, ``accuracy``, the others 0.1) are also its ``+ts``
    variant's; ``ood``: ``{set: (auroc_max_prob, auroc_mutual_information)}`` (``None``: undefined)."""
    metrics = {"test": {"accuracy": accuracy, "nll": nll, **dict.fromkeys(OTHER_FIELDS, 0.1)}}
    if ood:
        metrics["ood"] = {
            name: {"auroc_max_prob": maximum, "auroc_entropy": 0.7, "aupr_max_prob": 0.8, "fpr95_max_prob": 0.5,
                   "auroc_mutual_information": information}
            for name, (maximum, information) in ood.items()
        }  # fmt: skip
    data = {"task": task, "attention": row, "seed": seed, "metrics": metrics,
            "temperature_scaled": {"temperature": 1.5, "metrics": metrics}}  # fmt: skip
    return RunRecord.from_dict(json.loads(json.dumps(data)))


def _cells_of_first_body_row(html: str) -> list[str]:
    body = BeautifulSoup(html, "html.parser").find("tbody")
    return [cell.get_text() for cell in body.find("tr").find_all("td")]


def _rendered_rows(name: str) -> dict[str, list[str]]:
    """The cells of a one-row markdown table holding ``name`` (escaped by :func:`markdown_cell`) and ``5``, as
    Python-Markdown (the documentation site's renderer) and markdown-it (CommonMark with GFM tables) show them."""
    text = "| row | n |\n|---|---|\n| " + markdown_cell(name) + " | 5 |\n"
    return {
        "python-markdown": _cells_of_first_body_row(markdown.markdown(text, extensions=["tables"])),
        "markdown-it": _cells_of_first_body_row(MarkdownIt("commonmark").enable("table").render(text)),
    }


# -- seed statistics against scipy -------------------------------------------------------------------------------------
def test_two_seeds_give_the_t_interval_of_one_degree_of_freedom() -> None:
    # n = 2: t_{0.975, 1} = 12.706..., the interval mean +- 12.706 |d1 - d2| / 2; scipy's ttest_rel gives both
    reference, other = [0.3, 0.5], [0.1, 0.2]
    result = paired_difference(reference, other)
    test = stats.ttest_rel(reference, other)
    interval = test.confidence_interval(0.95)
    assert result.n == 2 and result.mean == pytest.approx(0.25, abs=1e-15)
    assert (result.low, result.high) == pytest.approx((interval.low, interval.high), abs=1e-14)
    assert result.high - result.mean == pytest.approx(stats.t.ppf(0.975, 1) * 0.1 / 2, rel=1e-12)
    assert paired_p_value(reference, other) == pytest.approx(test.pvalue, rel=1e-12)
    assert not result.significant and test.pvalue > 0.05


def test_unequal_seed_sets_pair_on_the_common_seeds_in_the_reference_order() -> None:
    reference = {3: 0.41, 0: 0.40, 7: 0.52, 1: 0.38, 4: 0.45, 9: 0.47}
    other = {0: 0.44, 1: 0.40, 2: 0.9, 3: 0.46, 4: 0.47, 7: 0.55}  # 9 only in reference, 2 only in other
    common = [3, 0, 7, 1, 4]
    result = paired_difference(reference, other)
    test = stats.ttest_rel([reference[s] for s in common], [other[s] for s in common])
    interval = test.confidence_interval(0.95)
    assert result.seeds == tuple(common) and result.n == 5
    assert (result.low, result.high) == pytest.approx((interval.low, interval.high), abs=1e-14)
    assert paired_p_value(reference, other) == pytest.approx(test.pvalue, rel=1e-12)


def test_identical_rows_and_a_constant_shift_give_points_with_the_documented_p_values() -> None:
    values = [0.31, 0.47, 0.29, 0.52]
    same = paired_difference(values, values)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0) and not same.significant
    assert paired_p_value(values, values) == 1.0  # scipy: NaN (0 / 0); documented as 1, no evidence
    shifted = [value - 0.25 for value in values]  # 0.25 = 2**-2: every difference exactly 0.25
    shift = paired_difference(values, shifted)
    assert shift.low == shift.high == shift.mean == 0.25 and shift.significant
    assert paired_p_value(values, shifted) == 0.0


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e8])
def test_the_p_value_is_below_five_percent_exactly_when_the_interval_excludes_zero(scale: float) -> None:
    # the docstring's promise, on 400 random paired samples of 2 to 11 seeds at three magnitudes
    rng = np.random.default_rng(5)
    for _ in range(400):
        n = int(rng.integers(2, 12))
        left = rng.normal(size=n) * scale
        right = left + rng.normal(0.6, 1.0, size=n) * scale
        p_value, interval = paired_p_value(left, right), paired_difference(left, right)
        assert (p_value < 0.05) == interval.significant, (n, p_value, interval)
        assert p_value == pytest.approx(stats.ttest_rel(left, right).pvalue, rel=1e-9)


def test_a_nan_metric_is_refused_and_one_seed_has_a_mean_without_spread() -> None:
    with pytest.raises(ValueError, match="finite reference values.*drop the failed seeds"):
        paired_difference([0.4, math.nan, 0.5], [0.3, 0.3, 0.3])
    assert math.isnan(paired_p_value({0: 0.4, 1: 0.5}, {0: 0.3}))  # one paired seed: no test
    one = summarize_seeds({4: 0.37})
    assert one.mean == 0.37 and one.n == 1 and math.isnan(one.std)


# -- the headline ------------------------------------------------------------------------------------------------------
def _accuracy_records(holm_target: float) -> list[RunRecord]:
    """Five seeds whose +ts accuracy differences give the accuracy secondary (one of m = 3 tests: the untempered NLL
    and the ECE have p = 1, identical rows) a Holm-adjusted p of ``holm_target``: differences a + b z with z of mean 0
    and standard deviation 1, t = a sqrt(5) / b."""
    z = np.array([1.0, -1.5, 0.5, 0.25, -0.25])
    z = (z - z.mean()) / z.std(ddof=1)
    b = 0.01
    a = stats.t.isf(holm_target / 3 / 2, 4) * b / math.sqrt(5)
    return [
        record
        for seed in range(5)
        for record in (_record("kep_svgp", seed, accuracy=0.9 + a + b * z[seed]), _record("softmax", seed))
    ]


def test_the_holm_column_is_three_tests_over_the_secondaries_that_have_one() -> None:
    records = _accuracy_records(0.03)
    estimates = {estimate.endpoint.column: estimate for estimate in estimate_secondaries(records)}
    tested = [column for column, estimate in estimates.items() if not math.isnan(estimate.p_value)]
    assert sorted(tested) == ["test_accuracy", "test_ece", "test_nll"]
    kep = [r.temperature_scaled.metrics.test.accuracy for r in records if r.attention == "kep_svgp"]
    p_value = stats.ttest_rel(kep, [0.9] * 5).pvalue
    assert estimates["test_accuracy"].p_value == pytest.approx(p_value, rel=1e-9)
    assert estimates["test_accuracy"].holm == pytest.approx(min(1.0, 3 * p_value), rel=1e-9)
    assert estimates["test_accuracy"].holm == pytest.approx(0.03, rel=1e-9)
    assert estimates["test_nll"].holm == 1.0 and estimates["test_ece"].holm == 1.0


def test_the_shown_holm_p_value_agrees_with_the_statement_beside_it() -> None:
    records = _accuracy_records(0.050004)
    accuracy = next(e for e in estimate_secondaries(records) if e.endpoint.column == "test_accuracy")
    assert FAMILY_WISE_LEVEL < accuracy.holm < 0.05001  # the set-up: just above the level, so not stated
    line = next(line for line in headline_text(records).splitlines() if line.startswith("| accuracy ("))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    shown, stated = cells[-2], cells[-1]
    assert stated == "no"
    # the reader applies the printed rule to the printed number: it must give the statement beside it
    assert float(shown) > FAMILY_WISE_LEVEL, f"p (Holm) shown as {shown} but stated {stated!r}"
    assert shown == "0.0501"  # rounded up at 4 decimals, as the legend says
    assert "The p-values are rounded up at 4 decimals" in headline_text(records)


@pytest.mark.parametrize("holm_target", [0.0499996, 0.050004, 0.123449, 0.9])
def test_the_shown_p_values_are_the_true_ones_rounded_up(holm_target: float) -> None:
    # both columns against the estimates: ceil(p 1e4) / 1e4, and the rule read on the shown Holm p gives the statement
    records = _accuracy_records(holm_target)
    accuracy = next(e for e in estimate_secondaries(records) if e.endpoint.column == "test_accuracy")
    line = next(line for line in headline_text(records).splitlines() if line.startswith("| accuracy ("))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    for shown, value in zip(cells[-3:-1], (accuracy.p_value, accuracy.holm), strict=True):
        assert float(shown) == math.ceil(value * 1e4) / 1e4 and len(shown.split(".")[1]) == 4, (shown, value)
    assert cells[-1] == ("yes" if float(cells[-2]) <= FAMILY_WISE_LEVEL else "no")


def test_a_p_value_below_the_shown_precision_reads_as_such_in_the_printed_table() -> None:
    # markdown_cell leaves a "<" that starts no HTML tag: the printed headline stays readable
    records = _accuracy_records(1e-7)
    line = next(line for line in headline_text(records).splitlines() if line.startswith("| accuracy ("))
    assert line.endswith("| < 0.0001 | < 0.0001 | yes |"), line


def test_huge_finite_differences_give_the_paired_difference_not_an_overflow() -> None:
    kep = [1.0e308, 1.1e308, 0.9e308, 1.05e308, 0.95e308]
    records = [_record("kep_svgp", s, nll=kep[s]) for s in range(5)]
    records += [_record("softmax", s, nll=0.0) for s in range(5)]
    reference = paired_difference(kep, [0.0] * 5)
    estimate = estimate_endpoint(records, PRIMARY_ENDPOINT, hierarchical=False)
    assert estimate.mean == pytest.approx(1.0e308, rel=1e-15)
    assert (estimate.t.low, estimate.t.high) == pytest.approx((reference.low, reference.high), rel=1e-12)
    verdict_line = next(line for line in headline_text(records).splitlines() if line.startswith("**Verdict**"))
    assert "kep_svgp+ts has the higher test NLL" in verdict_line


@pytest.mark.parametrize("scale", [1e-300, 1.0, 1e300])
def test_the_scaled_mean_is_the_exact_mean_and_the_plain_one_where_that_is_finite(scale: float) -> None:
    # against the exact rational mean (Fraction), and the same double as fsum / n (the mean the tables used before)
    rng = np.random.default_rng(11)
    for _ in range(200):
        values = (rng.normal(size=int(rng.integers(1, 9))) * scale).tolist()
        exact = float(sum(map(Fraction, values)) / len(values))
        assert scaled_mean(values) == pytest.approx(exact, rel=1e-15, abs=1e-320)
        assert scaled_mean(values) == math.fsum(values) / len(values)
    huge = [1.7e308, 1.6e308, 1.75e308]
    assert scaled_mean(huge) == float(sum(map(Fraction, huge)) / 3)  # math.fsum(huge) overflows
    assert math.isnan(scaled_mean([0.1, math.nan])) and scaled_mean([-1e308, -1e308]) == -1e308
    with pytest.raises(ValueError, match="at least one value"):
        scaled_mean([])


def test_the_shift_mean_of_a_row_near_the_largest_double_is_finite() -> None:
    data = _record("softmax", 0).to_dict()
    level = {"accuracy": 0.5, "nll": 1.5e308, "ece": 0.1, "brier": 0.2, "debiased_ce": 0.1}
    data["metrics"]["shift"] = {kind: {str(severity): level for severity in (1, 2)} for kind in ("noise", "warp")}
    data.pop("temperature_scaled")
    row = flat_rows([RunRecord.from_dict(data)])[0]
    assert row["shift_nll"] == 1.5e308 and row["shift_accuracy"] == 0.5


def test_the_temperature_caveat_averages_nlls_near_the_largest_double() -> None:
    # the results page's caveat on +ts rows whose temperature raised the mean clean test NLL by more than 5 %
    records = []
    for seed in range(3):
        data = _record("softmax", seed, nll=1.0e308).to_dict()
        data["temperature_scaled"]["metrics"]["test"]["nll"] = 1.5e308
        records.append(RunRecord.from_dict(data))
    (line,) = _temperature_caveat(records)
    shown = f"mnist1d softmax+ts (softmax: {1.0e308:.3f}, +ts: {1.5e308:.3f}, mean T 1.50)"
    assert line.startswith(
        f"* Temperature scaling raised the mean clean test NLL by more than 5 % for 1 of 1 rows: {shown}."
    )


def test_the_main_table_mean_of_values_near_the_largest_double_is_finite() -> None:
    nll = [1.0e308, 1.2e308, 0.8e308, 1.1e308, 0.9e308]
    records = [_record("softmax", seed, nll=nll[seed]) for seed in range(5)]
    section = markdown_table(records).split("### mnist1d\n\n")[1].split("\n\n")[0]
    cells = _cells_of_first_body_row(markdown.markdown(section, extensions=["tables"]))
    mean, std = (float(text) for text in cells[3].split(" ± "))
    scaled = np.array(nll) / 2.0**1000  # exact; the squared deviations of the values themselves overflow
    assert mean == pytest.approx(1.0e308, rel=1e-15)
    assert std == pytest.approx(float(np.std(scaled, ddof=1)) * 2.0**1000, rel=1e-12)


def test_a_row_with_the_mutual_information_on_every_seed_is_read_by_it() -> None:
    ood_endpoint = next(e for e in SECONDARY_ENDPOINTS if e.column == DECLARED_OOD_SCORE)
    records = []
    for seed in range(6):
        maximum = None if seed == 0 else 0.80 + 0.01 * seed  # undefined on seed 0 only
        records.append(_record("kep_svgp", seed, ood={"pooled": (maximum, 0.90 + 0.005 * seed)}))
        records.append(_record("softmax", seed, ood={"pooled": (0.78 + 0.01 * seed, None)}))  # deterministic
    estimate = estimate_endpoint(records, ood_endpoint)
    assert "kep_svgp+ts: mutual information" in estimate.note
    assert estimate.n == 6 and estimate.left_out == ()
    expected = [0.90 + 0.005 * s - (0.78 + 0.01 * s) for s in range(6)]
    assert estimate.mean == pytest.approx(np.mean(expected), abs=1e-15)


@pytest.mark.parametrize(
    ("maximum_seeds", "information_seeds", "score"),
    [
        (range(1, 6), range(1, 6), "mutual information"),  # a failed seed 0: neither score, still a stochastic row
        (range(0, 5), range(1, 6), "max probability"),  # as many seeds, not the same: the MI misses seed 0
        (range(0, 6), range(1, 6), "max probability"),  # the MI undefined where the maximum probability is not
    ],
)
def test_the_declared_ood_score_compares_the_seeds_where_each_score_is_defined(
    maximum_seeds: range, information_seeds: range, score: str
) -> None:
    ood_endpoint = next(e for e in SECONDARY_ENDPOINTS if e.column == DECLARED_OOD_SCORE)
    records = []
    for seed in range(6):
        maximum = 0.80 + 0.01 * seed if seed in maximum_seeds else None
        information = 0.90 + 0.005 * seed if seed in information_seeds else None
        records.append(_record("kep_svgp", seed, ood={"pooled": (maximum, information)}))
        records.append(_record("softmax", seed, ood={"pooled": (0.78 + 0.01 * seed, None)}))
    estimate = estimate_endpoint(records, ood_endpoint, hierarchical=False)
    assert f"kep_svgp+ts: {score}" in estimate.note
    seeds = information_seeds if score == "mutual information" else maximum_seeds
    value = (lambda s: 0.90 + 0.005 * s) if score == "mutual information" else (lambda s: 0.80 + 0.01 * s)
    assert estimate.seeds == tuple(seeds)
    assert estimate.mean == pytest.approx(np.mean([value(s) - (0.78 + 0.01 * s) for s in seeds]), abs=1e-15)


# -- the verdict check between two runs --------------------------------------------------------------------------------
def test_a_secondary_stated_in_opposite_directions_is_not_the_same_decision() -> None:
    noise = [0.001, -0.002, 0.0015, 0.0, -0.0005]

    def folder(sign: float) -> RunFolders:
        records = []
        for seed in range(5):
            accuracy = 0.9 + sign * (0.05 + noise[seed])
            records += [_record("kep_svgp", seed, nll=0.40 + noise[seed], accuracy=accuracy), _record("softmax", seed)]
        return RunFolders([f"run{sign:+g}"], records, [{}], [{}], [[]])

    first, second = folder(1.0), folder(-1.0)
    # the set-up: kep_svgp+ts 5 points more accurate in one run, 5 points less in the other, both stated
    for runs, sign in ((first, 1), (second, -1)):
        accuracy = next(e for e in estimate_secondaries(runs.records) if e.endpoint.column == "test_accuracy")
        assert accuracy.holm <= FAMILY_WISE_LEVEL and sign * accuracy.mean == pytest.approx(0.05, abs=1e-12)
    holds, lines = compare_verdicts(first, second)
    assert holds  # the primary (the NLL) is the same in both
    line = next(line for line in lines if line.startswith("secondary accuracy:"))
    assert "(same)" not in line, line
    assert line == "secondary accuracy: stated, higher / stated, lower (DIFFERS)"
    _, again = compare_verdicts(first, first)
    assert "secondary accuracy: stated, higher / stated, higher (same)" in again


# -- the files of a run folder -----------------------------------------------------------------------------------------
ODD_NAMES = ('kép,"svgp"', "a|b", "x\\y", "ß<&>")


def test_odd_row_names_and_numbers_read_back_exactly_from_the_csv_and_the_json(tmp_path) -> None:
    rng = np.random.default_rng(3)
    records = [
        _record(name, seed, nll=float(rng.gamma(2.0, 0.2)), accuracy=float(rng.uniform(0.8, 0.95)))
        for name in ODD_NAMES
        for seed in range(3)
    ]
    records[1] = RunRecord.from_dict({**records[1].to_dict(), "metrics": {"test": {
        **records[1].to_dict()["metrics"]["test"], "nll": None, "fpr95": None}}})  # fmt: skip
    write_outputs(records, CompareConfig(seeds=(0, 1, 2)), tmp_path)
    rows = flat_rows(records)
    lines = list(csv.DictReader(io.StringIO((tmp_path / "results.csv").read_text(encoding="utf-8"))))
    assert [(line["attention"], int(line["seed"])) for line in lines] == [(r["attention"], r["seed"]) for r in rows]
    for line, row in zip(lines, rows, strict=True):
        for column in ("test_nll", "test_accuracy", "test_gap", "temperature"):
            value = row[column]
            assert line[column] == ("" if value is None or not math.isfinite(value) else repr(value)), column
            if line[column]:
                assert float(line[column]) == value  # the shortest repr: the same double
    text = (tmp_path / "results.json").read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    runs = read_run_folders([tmp_path])
    assert [r.attention for r in runs.records] == [r.attention for r in records]
    assert runs.records[0] == records[0] and math.isnan(runs.records[1].metrics.test.nll)
    assert runs.records[1].to_dict()["undefined"]["metrics.test.nll"].startswith("nan:")


# -- row names in the rendered tables ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a|b", "kep_svgp_ens2+ts", "a\\"])
def test_a_row_name_renders_as_itself_in_one_cell(name: str) -> None:
    for renderer, cells in _rendered_rows(name).items():
        assert cells == [name, "5"], renderer


def test_a_row_name_with_a_backslash_before_a_bar_stays_one_cell() -> None:
    rendered = _rendered_rows("a\\|b")
    assert rendered["python-markdown"] == ["a\\|b", "5"]
    assert rendered["markdown-it"] == ["a\\|b", "5"]


@pytest.mark.parametrize("name", ["sgpa<v2>", "a&amp;b"])
def test_a_row_name_with_html_characters_renders_as_itself(name: str) -> None:
    for renderer, cells in _rendered_rows(name).items():
        assert cells == [name, "5"], renderer


def test_the_main_table_cell_of_a_row_name_with_a_bar_holds_its_numbers() -> None:
    records = [_record("a|b", seed, nll=0.3 + 0.1 * seed, accuracy=0.8 + 0.05 * seed) for seed in range(3)]
    table = markdown_table(records)
    section = table.split("### mnist1d\n\n")[1].split("\n\n")[0]
    cells = _cells_of_first_body_row(markdown.markdown(section, extensions=["tables"]))
    assert cells[:4] == ["a|b", "3", "85.00 ± 5.00", "0.400 ± 0.100"]


@pytest.mark.parametrize("folder", ["my results_figures", "results_figures"])
def test_a_figure_path_with_a_space_is_an_image_in_commonmark_and_python_markdown(folder: str) -> None:
    runs = RunFolders(["run"], [_record("softmax", 0)], [{}], [{}], [[]])
    page = results_page(runs, [f"{folder}/reliability_mnist1d.png"])
    rendered = {
        "markdown-it": MarkdownIt("commonmark").enable("table").render(page),
        "python-markdown": markdown.markdown(page, extensions=["tables", "attr_list", "md_in_html"]),
    }
    for renderer, html in rendered.items():
        images = BeautifulSoup(html, "html.parser").find_all("img")
        assert [image["alt"] for image in images] == ["reliability_mnist1d"], renderer
        assert unquote(images[0]["src"]) == f"{folder}/reliability_mnist1d.png", renderer


# -- figures of one row and one seed -----------------------------------------------------------------------------------
def test_figures_of_one_row_and_one_seed_say_what_is_undefined() -> None:
    data = _record("softmax", 0, task="t").to_dict()
    data["metrics"]["test"]["ece"] = None
    data["reliability"] = {"confidence": [None, 0.75], "accuracy": [None, 0.5], "count": [0, 4]}
    data["metrics"]["ood"] = {"pooled": {"auroc_max_prob": None, "auroc_entropy": 0.7, "aupr_max_prob": 0.8,
                                         "fpr95_max_prob": 0.5}}  # fmt: skip
    data["ood_scores"] = {"in": [0.9, None, 1.0], "noise": [0.5, 0.6]}
    data["spectra"] = {"layer_0": [[2.0]]}
    data.pop("temperature_scaled")
    record = RunRecord.from_dict(data)
    try:
        reliability = plot_reliability_diagrams([record], "t")
        axis, counts = reliability.axes
        assert axis.get_title() == "softmax\nECE n/a"
        bars = [patch for patch in axis.patches if patch.get_gid() == "accuracy"]
        assert [(p.get_x(), p.get_height()) for p in bars] == [(0.5, 0.5)]
        assert counts.get_title() == "predictions per bin (4 in all)"
        ood = plot_ood_histograms([record], "t")
        assert ood.axes[0].get_title() == "softmax (1 seed)\nAUROC (pooled) n/a"
        labels = ood.axes[0].get_legend_handles_labels()[1]
        assert labels == ["in-distribution (test) (2 inputs)", "noise (2 inputs)"]  # the NaN score left out
        spectra = plot_spectra([record])
        assert spectra.axes[0].get_ylim() == pytest.approx((0.0, 2.1))
        assert re.search(r"one scale, from 0\)$", spectra.get_suptitle())
    finally:
        plt.close("all")
