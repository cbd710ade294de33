"""Comparison figures built from synthetic runner records."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
import zlib

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from gpattn.experiments import RunRecord
from gpattn.plotting import (
    comparison_figure_names,
    plot_gap_vs_shift_ece,
    plot_ood_histograms,
    plot_reliability_diagrams,
    plot_shift_curves,
    plot_spectra,
    write_comparison_figures,
)

ATTENTIONS = ("kep_svgp", "softmax")
SEEDS = (0, 1)
KINDS = ("gaussian_noise", "rotation", "blur")
NUM_BINS = 15


def _reliability(rng: np.random.Generator) -> dict:
    count = rng.integers(0, 20, NUM_BINS)
    count[:3] = 0  # confidences below 0.2 never occur
    count[5] = rng.integers(0, 2)  # sometimes empty in one seed only
    centres = (np.arange(NUM_BINS) + 0.5) / NUM_BINS
    confidence = [float(c + rng.uniform(-0.02, 0.02)) if n else None for c, n in zip(centres, count, strict=True)]
    accuracy = [float(rng.uniform(0, 1)) if n else None for n in count]
    return {"confidence": confidence, "accuracy": accuracy, "count": [int(n) for n in count]}


def _record(task: str, attention: str, seed: int) -> RunRecord:
    rng = np.random.default_rng(zlib.crc32(f"{task}-{attention}-{seed}".encode()))
    test = {
        key: float(rng.uniform(0, 1))
        for key in ("accuracy", "nll", "ece", "mce", "brier", "aurc", "eaurc", "auroc", "fpr95", "confidence")
    }
    record = {
        "task": task,
        "attention": attention,
        "seed": seed,
        "metrics": {"test": test, "shift": {}, "ood": {}},
        "reliability": _reliability(rng),
        "ood_scores": {},
        "spectra": {},
        "train": {"seconds": 1.0, "epochs": 3, "best_epoch": 2, "num_parameters": 100, "ensemble": 1},
    }
    if task == "digits":
        record["metrics"]["shift"] = {
            kind: {
                str(s): {m: float(rng.uniform(0, 1)) for m in ("accuracy", "nll", "ece", "brier")} for s in range(1, 6)
            }
            for kind in KINDS
        }
        ood_keys = ("auroc_max_prob", "auroc_entropy", "aupr_max_prob", "fpr95_max_prob")
        record["metrics"]["ood"] = {
            name: {k: float(rng.uniform(0.5, 1)) for k in ood_keys} for name in ("held_out", "noise")
        }
        record["ood_scores"] = {
            "in": rng.beta(8, 1, 60).tolist(),
            "held_out": rng.beta(3, 2, 40).tolist(),
            "noise": rng.uniform(0.1, 1, 40).tolist(),
        }
    if attention == "kep_svgp":
        record["spectra"] = {
            f"layer_{layer}": [np.sort(rng.uniform(0.01, 10, 6))[::-1].tolist() for _ in range(2)] for layer in (1, 2)
        }
    return RunRecord.from_dict(json.loads(json.dumps(record)))  # JSON round trip: what the runner writes


@pytest.fixture(scope="module")
def records() -> list[RunRecord]:
    return [_record(task, a, s) for task in ("digits", "pointer") for a in ATTENTIONS for s in SEEDS]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _labelled(figure, xlabel_on=None) -> None:
    for axis in figure.axes:
        assert axis.get_title(), "every panel has a title"
        assert axis.get_ylabel(), "every panel has a y label"
        if xlabel_on is None or axis in xlabel_on:
            assert axis.get_xlabel(), "every (bottom) panel has an x label"


def _bars(axis, gid: str) -> list:
    return [patch for patch in axis.patches if patch.get_gid() == gid]


def _panels(figure, label: str) -> list:
    return [axis for axis in figure.axes if axis.get_label() == label]


def test_reliability_panels_pool_seeds(records) -> None:
    figure = plot_reliability_diagrams(records, "pointer")
    assert [axis.get_label() for axis in figure.axes] == ["reliability", "count"] * len(ATTENTIONS)
    _labelled(figure, xlabel_on=_panels(figure, "count"))
    assert [axis.get_xlabel() for axis in _panels(figure, "count")] == ["confidence"] * 2
    assert [axis.get_ylabel() for axis in _panels(figure, "reliability")] == ["accuracy"] * 2
    for axis, counts, attention in zip(
        _panels(figure, "reliability"), _panels(figure, "count"), ATTENTIONS, strict=True
    ):
        group = [r for r in records if r.task == "pointer" and r.attention == attention]
        # hand computation of the pooled bins
        count = np.zeros(NUM_BINS)
        accuracy = np.zeros(NUM_BINS)
        confidence = np.zeros(NUM_BINS)
        for record in group:
            for b, n in enumerate(record.reliability.count):
                if n:
                    count[b] += n
                    accuracy[b] += n * record.reliability.accuracy[b]
                    confidence[b] += n * record.reliability.confidence[b]
        filled = count > 0
        expected_accuracy = accuracy[filled] / count[filled]
        expected_confidence = confidence[filled] / count[filled]
        bars = sorted(_bars(axis, "accuracy"), key=lambda p: p.get_x())
        assert len(bars) == filled.sum()
        np.testing.assert_allclose([p.get_x() for p in bars], np.flatnonzero(filled) / NUM_BINS)
        np.testing.assert_allclose([p.get_height() for p in bars], expected_accuracy)
        gaps = sorted(_bars(axis, "gap"), key=lambda p: p.get_x())
        np.testing.assert_allclose([p.get_y() + p.get_height() for p in gaps], expected_confidence)
        ece = np.mean([r.metrics.test.ece for r in group])
        assert attention in axis.get_title() and f"ECE {100 * ece:.2f}" in axis.get_title()
        assert "(2 seeds)" in axis.get_title() and "n=" not in axis.get_title()
        # the count panel: one bar per bin with the pooled number of predictions (empty bins: height 0)
        count_bars = sorted(_bars(counts, "count"), key=lambda p: p.get_x())
        np.testing.assert_allclose([p.get_height() for p in count_bars], count)
        assert counts.get_shared_x_axes().joined(axis, counts)
        assert f"({int(count.sum())} in all)" in counts.get_title()
    assert len(figure.legends) == 1
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert sorted(legend) == [
        "accuracy (bar colour: the attention)",
        "gap to the mean confidence (red hatched)",
        "perfect calibration",
    ]
    assert "pointer" in figure.get_suptitle()


def test_reliability_refuses_a_task_without_data(records) -> None:
    with pytest.raises(ValueError, match="no reliability data"):
        plot_reliability_diagrams(records, "cifar10")


def test_shift_curves_grid(records) -> None:
    metrics = ("accuracy", "ece", "nll")
    figure = plot_shift_curves(records, metrics)
    assert len(figure.axes) == len(metrics) * len(KINDS)
    _labelled(figure)
    assert [axis.get_ylabel() for axis in figure.axes] == [m for m in metrics for _ in KINDS]
    assert len(figure.legends) == 1 and all(axis.get_legend() is None for axis in figure.axes)
    assert len(figure.legends[0].get_texts()) == len(ATTENTIONS)
    # the first panel (gaussian noise, accuracy): severities 0..5, mean over seeds, clean test at 0
    lines = figure.axes[0].get_lines()
    assert len(lines) == len(ATTENTIONS)
    group = [r for r in records if r.task == "digits" and r.attention == ATTENTIONS[0]]
    expected = [np.mean([r.metrics.test.accuracy for r in group])] + [
        np.mean([r.metrics.shift["gaussian_noise"][str(s)].accuracy for r in group]) for s in range(1, 6)
    ]
    np.testing.assert_allclose(lines[0].get_xdata(), np.arange(6))
    np.testing.assert_allclose(lines[0].get_ydata(), expected)
    assert len(figure.axes[0].collections) == len(ATTENTIONS)  # the ±std bands


def test_shift_curves_skip_records_without_shift(records) -> None:
    partial = [
        dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, shift={})) if r.attention == "softmax" else r
        for r in records
    ]
    figure = plot_shift_curves(partial, metrics=("accuracy",))
    assert len(figure.axes) == len(KINDS)
    assert len(figure.axes[0].get_lines()) == 1


def test_ood_histograms(records) -> None:
    figure = plot_ood_histograms(records)
    assert len(figure.axes) == len(ATTENTIONS)
    _labelled(figure)
    for axis, attention in zip(figure.axes, ATTENTIONS, strict=True):
        group = [r for r in records if r.task == "digits" and r.attention == attention]
        for name, short in (("held_out", "held-out"), ("noise", "noise")):  # both AUROCs, mean ± std and n
            values = [r.metrics.ood[name].auroc_max_prob for r in group]
            expected = f"AUROC ({short}) {np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
            assert expected in axis.get_title()
        assert attention in axis.get_title() and "(2 seeds)" in axis.get_title()
        texts = [text.get_text() for text in axis.get_legend().get_texts()]
        assert len(texts) == 3 and texts[0].startswith("in-distribution") and "(120 inputs)" in texts[0]
        assert axis.get_xlabel() == "max probability" and axis.get_ylabel() == "density (log)"
        assert axis.get_yscale() == "log"
    # an AUROC undefined on one seed: the mean of the others, counted
    first = records[0]
    name = "held_out"
    undefined = dataclasses.replace(first.metrics.ood[name], auroc_max_prob=math.nan)
    metrics = dataclasses.replace(first.metrics, ood={**first.metrics.ood, name: undefined})
    partial = [dataclasses.replace(first, metrics=metrics), *records[1:]]
    group = [r for r in partial if r.task == first.task and r.attention == first.attention]
    values = [r.metrics.ood[name].auroc_max_prob for r in group[1:]]
    title = plot_ood_histograms(partial).axes[ATTENTIONS.index(first.attention)].get_title()
    shown = f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else f"{values[0]:.3f}"
    assert f"AUROC (held-out) {shown} ({len(values)} seed{'s' if len(values) > 1 else ''} of {len(group)})" in title


def test_spectra_share_one_linear_scale_from_zero(records) -> None:
    figure = plot_spectra(records)
    assert len(figure.axes) == 2  # kep_svgp on digits and on pointer; softmax has no spectra
    _labelled(figure)
    top = max(float(line.get_ydata().max()) for axis in figure.axes for line in axis.get_lines())
    for axis, task in zip(figure.axes, ("digits", "pointer"), strict=True):
        assert axis.get_yscale() == "linear"
        assert axis.get_ylim() == pytest.approx((0.0, 1.05 * top))  # the same scale in every panel, from 0
        assert "lambda_i" in axis.get_ylabel()
        assert task in axis.get_title() and "kep_svgp" in axis.get_title()
        lines = axis.get_lines()
        assert len(lines) == 4  # 2 layers x 2 heads
        assert axis.get_legend() is not None and len(axis.get_legend().get_texts()) == 4
        group = [r for r in records if r.task == task and r.attention == "kep_svgp"]
        np.testing.assert_allclose(lines[0].get_xdata(), np.arange(1, 7))
        np.testing.assert_allclose(lines[0].get_ydata(), np.mean([r.spectra["layer_1"][0] for r in group], axis=0))


def test_write_comparison_figures(records, tmp_path) -> None:
    paths = write_comparison_figures(records, tmp_path / "figures")
    names = [p.name for p in paths]
    assert names == [  # per task with the data, then the figures of every task
        "reliability_digits.png",
        "shift_digits.png",
        "gap_vs_shift_ece_digits.png",
        "ood_histograms_digits.png",
        "reliability_pointer.png",
        "spectra.png",
    ]
    assert set(names) <= set(comparison_figure_names(["digits", "pointer"]))
    for path in paths:
        assert path.is_file() and path.stat().st_size > 10_000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []


def test_write_skips_figures_without_data(records, tmp_path) -> None:
    pointer = [r for r in records if r.task == "pointer" and r.attention == "softmax"]
    paths = write_comparison_figures(pointer, tmp_path)
    assert [p.name for p in paths] == ["reliability_pointer.png"]
    pointer = [dataclasses.replace(record, reliability=None) for record in pointer]
    assert write_comparison_figures(pointer, tmp_path / "empty") == []


@pytest.mark.parametrize("task", ["../outside", "a/b"])
def test_a_task_that_is_no_file_name_is_refused_before_any_figure(records, tmp_path, task) -> None:
    # the task names the files: "reliability_a/b.png" failed half-way (FileNotFoundError, no folder reliability_a)
    renamed = [dataclasses.replace(r, task=task) for r in records if r.task == "pointer"]
    with pytest.raises(ValueError, match=f"write_comparison_figures: the task name {task!r} of the records cannot"):
        write_comparison_figures([*records, *renamed], tmp_path / "figures")
    assert not (tmp_path / "figures").exists() and plt.get_fignums() == []


@pytest.mark.parametrize(
    "bad",
    [[], {}, "records", None, [1, 2], [{"task": "digits", "attention": "softmax", "seed": 0}]],
    ids=["empty", "dict", "string", "none", "not-dicts", "missing-metrics"],
)
def test_bad_records_are_refused(bad) -> None:
    for function in (plot_shift_curves, plot_ood_histograms, plot_spectra):
        with pytest.raises(ValueError):
            function(bad)
    with pytest.raises(ValueError):
        plot_reliability_diagrams(bad, "digits")
    with pytest.raises(ValueError):
        write_comparison_figures(bad, "/tmp/never-written")


def test_plots_refuse_records_without_their_data(records) -> None:
    pointer = [r for r in records if r.task == "pointer" and r.attention == "softmax"]
    with pytest.raises(ValueError, match="shift"):
        plot_shift_curves(pointer)
    with pytest.raises(ValueError, match="OOD"):
        plot_ood_histograms(pointer)
    with pytest.raises(ValueError, match="spectra"):
        plot_spectra(pointer)


def test_dicts_are_refused_with_a_pointer_to_the_reader(records) -> None:
    with pytest.raises(TypeError, match=r"record 0 is a dict, expected a RunRecord \(read .*read_records"):
        plot_spectra([records[0].to_dict()])


def test_attentions_come_in_registry_order(records) -> None:
    # records in the reverse order, and an attention the registry does not know (an ensemble): registry order first
    ensemble = [dataclasses.replace(r, attention="kep_svgp_ens2") for r in records if r.attention == "kep_svgp"]
    figure = plot_reliability_diagrams([*ensemble, *reversed(records)], "pointer")
    panels = _panels(figure, "reliability")
    titles = [axis.get_title().split("\n")[0] for axis in panels]
    assert titles == ["kep_svgp", "softmax", "kep_svgp_ens2"]
    colours = [_bars(axis, "accuracy")[0].get_facecolor()[:3] for axis in panels[:2]]
    assert colours == [matplotlib.colors.to_rgb("C0"), matplotlib.colors.to_rgb("C4")]  # registry positions 0 and 4


def test_shift_metrics_must_be_known(records) -> None:
    known = r"\['accuracy', 'nll', 'ece', 'brier', 'debiased_ce'\]"  # the fields of ShiftMetrics
    with pytest.raises(ValueError, match=rf"expected metrics to be one of {known}"):
        plot_shift_curves(records, metrics=("mce",))


# -- one shift figure per task, the +ts rows, the gap against the shift ECE, the list of figure files ------------------
def _scaled(record: RunRecord, factor: float) -> RunRecord:
    """The record with a temperature-scaled variant whose clean and shifted ECEs are ``factor`` times its own."""
    from gpattn.comparison import TemperatureScaled

    metrics = record.metrics
    shift = {kind: {level: dataclasses.replace(values, ece=factor * values.ece) for level, values in levels.items()}
             for kind, levels in metrics.shift.items()}  # fmt: skip
    test = dataclasses.replace(metrics.test, ece=factor * metrics.test.ece)
    scaled = TemperatureScaled(1.5, dataclasses.replace(metrics, test=test, shift=shift))
    return dataclasses.replace(record, temperature_scaled=scaled)


def test_shift_curves_one_task_with_the_ts_rows(records) -> None:
    two_tasks = [*records, *(dataclasses.replace(r, task="mnist1d") for r in records if r.task == "digits")]
    with pytest.raises(ValueError, match="several tasks.*pass task="):
        plot_shift_curves(two_tasks)
    scaled = [_scaled(r, 0.5) for r in two_tasks]
    figure = plot_shift_curves(scaled, metrics=("ece",), task="mnist1d", scaled=True)
    lines = figure.axes[0].get_lines()
    labels = [line.get_label() for line in lines]
    assert labels == ["kep_svgp (2 seeds)", "kep_svgp+ts (2 seeds)", "softmax (2 seeds)", "softmax+ts (2 seeds)"]
    assert [line.get_linestyle() for line in lines] == ["-", "--", "-", "--"]
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()  # a +ts row in its row's colour
    # the +ts curve is the scaled records' mean: half the row's ECE at every severity (no point of another task)
    np.testing.assert_allclose(lines[1].get_ydata(), 0.5 * lines[0].get_ydata())
    group = [r for r in scaled if r.task == "mnist1d" and r.attention == "kep_svgp"]
    expected = [np.mean([r.metrics.test.ece for r in group])] + [
        np.mean([r.metrics.shift["gaussian_noise"][str(s)].ece for r in group]) for s in range(1, 6)
    ]
    np.testing.assert_allclose(lines[0].get_ydata(), expected)
    assert "mnist1d" in figure.get_suptitle() and "digits" not in figure.get_suptitle()


def test_one_seed_figures_say_so_without_a_zero_spread(records) -> None:
    single = [r for r in records if r.seed == 0]
    figures = [plot_shift_curves(single), plot_reliability_diagrams(single, "digits"), plot_ood_histograms(single)]
    titles = [figure.get_suptitle() for figure in figures]
    titles += [axis.get_title() for figure in figures for axis in figure.axes]
    assert "Metrics under distribution shift on digits (1 seed)" in titles
    assert not any("± 0.00" in title or "± 0.000" in title or "n=1" in title for title in titles)
    assert any("(1 seed)" in title for title in titles[1:])
    assert all(not axis.collections for axis in figures[0].axes)  # no band for one seed


def test_gap_against_shift_ece_is_the_rows_means_with_their_rank_correlation(records) -> None:
    from scipy import stats

    scaled = [_scaled(r, 0.5) for r in records]
    figure = plot_gap_vs_shift_ece(scaled)
    (axis,) = figure.axes
    points = {}
    for container in axis.containers:  # one errorbar per row: (marker line, caps, bars)
        label = container.get_label()
        x, y = container.lines[0].get_data()
        points[label.split(" (")[0]] = (float(x[0]), float(y[0]))
    assert list(points) == ["kep_svgp", "kep_svgp+ts", "softmax", "softmax+ts"]
    for name, (x, y) in points.items():
        group = [r for r in records if r.task == "digits" and r.attention == name.removesuffix("+ts")]
        factor = 0.5 if name.endswith("+ts") else 1.0
        gap = np.mean([100 * (r.metrics.test.confidence - r.metrics.test.accuracy) for r in group])
        shift = np.mean([100 * factor * np.mean([e.ece for kind in r.metrics.shift.values() for e in kind.values()])
                         for r in group])  # fmt: skip
        assert (x, y) == pytest.approx((gap, shift), rel=1e-12)
    rho = stats.spearmanr([x for x, _ in points.values()], [y for _, y in points.values()]).statistic
    assert f"Spearman {rho:+.2f} over 4 rows" in axis.get_title() and "digits" in axis.get_title()


def test_figure_names_cover_everything_the_writers_write(records, tmp_path) -> None:
    from gpattn.comparison import TASKS
    from gpattn.plotting import write_fidelity_figure

    names = comparison_figure_names(TASKS)
    assert len(names) == len(set(names)) and {"shift.png", "ood_histograms.png"} <= set(names)  # earlier versions'
    every_task = [dataclasses.replace(r, task=task) for task in TASKS for r in records if r.task == "digits"]
    written = write_comparison_figures([_scaled(r, 0.5) for r in every_task], tmp_path / "all")
    assert {path.name for path in written} == set(names) - {"fidelity.png", "shift.png", "ood_histograms.png"}
    fidelity = dataclasses.replace(records[0], fidelity={"layer_2": {"relative_objective": [0.5], "energy": [0.9]}})
    assert [path.name for path in write_fidelity_figure([fidelity], tmp_path / "fidelity")] == ["fidelity.png"]
    assert "fidelity.png" in names


def test_figure_names_refuse_a_bare_task_string() -> None:
    # "pointer" was split into its characters; a list of names, as CompareConfig's tasks
    with pytest.raises(TypeError, match="expected tasks to be a sequence of names, got the string 'pointer'"):
        comparison_figure_names("pointer")
    with pytest.raises(TypeError, match="expected tasks to be a sequence of names, got 3"):
        comparison_figure_names(3)
    assert "reliability_pointer.png" in comparison_figure_names(["pointer"])
    assert comparison_figure_names(("pointer",)) == comparison_figure_names(iter(["pointer"]))


# -- empty and out-of-range data: a deliberate note or a clear error, never a NumPy warning or a silent drop -----------
def _with_shift(record: RunRecord, shift: dict) -> RunRecord:
    return dataclasses.replace(record, metrics=dataclasses.replace(record.metrics, shift=shift))


def test_spectra_leave_nan_out_of_the_seed_mean_without_warnings(records) -> None:
    nan = float("nan")
    group = [r for r in records if r.task == "pointer" and r.attention == "kep_svgp"]  # seeds 0 and 1
    spectra = (  # head 1: index 1 NaN in both seeds, index 2 in one; head 2: NaN everywhere
        {"layer_1": [[nan, 6.0, 2.0], [nan, nan]]},
        {"layer_1": [[nan, nan, 4.0], [nan, nan]]},
    )
    nan_records = [dataclasses.replace(r, spectra=s) for r, s in zip(group, spectra, strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "Mean of empty slice" was a RuntimeWarning
        figure = plot_spectra(nan_records)
    (axis,) = figure.axes
    (line,) = axis.get_lines()  # head 2 has no finite value: not drawn, and the panel says so
    np.testing.assert_allclose(line.get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(line.get_ydata(), [nan, 6.0, 3.0])  # the mean over the seeds with a value
    notes = [text.get_text() for text in axis.texts if text.get_gid() == "note"]
    assert notes == ["1 head without a finite value not drawn"]
    assert axis.get_ylim() == pytest.approx((0.0, 1.05 * 6.0))


def test_gap_against_shift_ece_refuses_only_the_shuffled_split(records, tmp_path) -> None:
    digits = [r for r in records if r.task == "digits"]
    blur = digits[0].metrics.shift["blur"]["1"]
    shuffled = [_with_shift(r, {"shuffled": {"1": dataclasses.replace(blur, ece=0.9)}}) for r in digits]
    open_figures = plt.get_fignums()  # (other tests of this worker may have left some open)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "Mean of empty slice" was a RuntimeWarning
        with pytest.raises(ValueError, match="no records with shift data besides the shuffled split"):
            plot_gap_vs_shift_ece(shuffled)
        assert plt.get_fignums() == open_figures  # refused before a figure was made
        paths = write_comparison_figures(shuffled, tmp_path)  # the shift curves, without the gap figure
    names = [path.name for path in paths]
    assert names == ["reliability_digits.png", "shift_digits.png", "ood_histograms_digits.png", "spectra.png"]
    # beside the other kinds, the shuffled split stays out of the mean shift ECE
    both = [_with_shift(r, {**r.metrics.shift, **s.metrics.shift}) for r, s in zip(digits, shuffled, strict=True)]
    figure = plot_gap_vs_shift_ece(both)
    (axis,) = figure.axes
    for container in axis.containers:
        group = [r for r in digits if r.attention == container.get_label().split(" (")[0]]
        ece = np.mean(
            [100 * np.mean([e.ece for kind in r.metrics.shift.values() for e in kind.values()]) for r in group]
        )
        assert float(container.lines[0].get_data()[1][0]) == pytest.approx(ece, rel=1e-12)
    plt.close(figure)


@pytest.mark.parametrize("bad", [1.5, -0.25], ids=["above-1", "negative"])
def test_ood_histograms_refuse_scores_that_are_not_probabilities(records, bad) -> None:
    digits = [r for r in records if r.task == "digits"]
    scores = dict(digits[1].ood_scores, noise=[0.5, bad, bad])  # e.g. entropies in place of max probabilities
    broken = [digits[0], dataclasses.replace(digits[1], ood_scores=scores), *digits[2:]]
    message = (
        r"plot_ood_histograms: the 'noise' OOD scores of kep_svgp \(task 'digits', seed 1\) must be maximum "
        rf"probabilities in \[0, 1\], got 2 outside, in \[{bad:g}, {bad:g}\]"
    )
    open_figures = plt.get_fignums()
    with pytest.raises(ValueError, match=message):
        plot_ood_histograms(broken)
    assert plt.get_fignums() == open_figures


def test_ood_histograms_say_when_a_panel_has_no_finite_score(records) -> None:
    digits = [r for r in records if r.task == "digits"]
    blank = [
        dataclasses.replace(r, ood_scores={"in": [float("nan")]}) if r.attention == "softmax" else r for r in digits
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warned of a legend without entries
        figure = plot_ood_histograms(blank)
    kep, softmax = figure.axes
    assert [text.get_text() for text in softmax.texts] == ["no finite scores"] and softmax.get_legend() is None
    assert not kep.texts and "(120 inputs)" in kep.get_legend().get_texts()[0].get_text()


def _cut_bins(record: RunRecord, size: int) -> RunRecord:
    bins = record.reliability
    cut = dataclasses.replace(
        bins, confidence=bins.confidence[:size], accuracy=bins.accuracy[:size], count=bins.count[:size]
    )
    return dataclasses.replace(record, reliability=cut)


def test_reliability_refuses_seeds_with_different_bins_and_leaves_no_figure_open(records) -> None:
    # the figure used to be created before the seeds were pooled: the error left it open
    kep = [r for r in records if r.task == "digits" and r.attention == "kep_svgp"]
    plt.close("all")
    with pytest.raises(ValueError, match=r"different numbers of bins: \[10, 15\]"):
        plot_reliability_diagrams([kep[0], _cut_bins(kep[1], 10)], "digits")
    assert plt.get_fignums() == []


def test_reliability_title_names_the_bins_of_every_row(records) -> None:
    # rows with 15 and 10 bins: each panel draws its own bins, and the title no longer names the last row's only
    kep = [r for r in records if r.task == "digits" and r.attention == "kep_svgp"]
    soft = [_cut_bins(r, 10) for r in records if r.task == "digits" and r.attention == "softmax"]
    figure = plot_reliability_diagrams(kep + soft, "digits")
    assert "(test set, 15/10 bins, seeds pooled)" in figure.get_suptitle()
    for counts, group, size in zip(_panels(figure, "count"), (kep, soft), (15, 10), strict=True):
        bars = sorted(_bars(counts, "count"), key=lambda p: p.get_x())
        expected = np.sum([r.reliability.count for r in group], axis=0)
        np.testing.assert_allclose([p.get_height() for p in bars], expected)
        np.testing.assert_allclose([p.get_x() for p in bars], np.arange(size) / size)
    figure = plot_reliability_diagrams(kep, "digits")
    assert "(test set, 15 bins, seeds pooled)" in figure.get_suptitle()


@pytest.mark.parametrize("field", ["confidence", "accuracy"])
def test_reliability_refuses_a_filled_bin_without_its_mean(records, field) -> None:
    # a bin holding predictions with confidence (or accuracy) None was pooled as 0: bars of a made-up gap
    record = next(r for r in records if r.task == "digits" and r.attention == "kep_svgp")
    filled = int(np.flatnonzero(record.reliability.count)[0])
    values = list(getattr(record.reliability, field))
    values[filled] = None
    broken = dataclasses.replace(record, reliability=dataclasses.replace(record.reliability, **{field: values}))
    plt.close("all")
    with pytest.raises(ValueError, match=rf"kep_svgp \(task 'digits', seed 0\) has no finite .* bin\(s\) \[{filled}\]"):
        plot_reliability_diagrams([broken], "digits")
    assert plt.get_fignums() == []


def test_each_shift_kind_keeps_its_own_severity_ticks_and_the_legend_names_dashes_only_when_drawn(records) -> None:
    # a kind with severities 1-5 beside a one-level kind (MNIST-1D's "shuffled"): with one x axis shared by all the
    # panels the last column's ticks (0, 1) were every panel's, severities 2-5 unlabelled; and the legend said
    # "dashed: +ts" with no +ts row drawn
    digits = [r for r in records if r.task == "digits"]
    one_level = [
        _with_shift(r, {**r.metrics.shift, "shuffled": {"1": r.metrics.shift["gaussian_noise"]["1"]}}) for r in digits
    ]
    figure = plot_shift_curves(one_level, metrics=("accuracy", "ece"))
    columns = len(KINDS) + 1
    for row in range(2):
        for column in range(columns):
            ticks = figure.axes[row * columns + column].get_xticks()
            np.testing.assert_array_equal(ticks, [0, 1] if column == columns - 1 else np.arange(6))
    assert figure.legends[0].get_title().get_text() == "row"
    scaled = plot_shift_curves([_scaled(r, 0.5) for r in digits], metrics=("ece",), scaled=True)
    assert scaled.legends[0].get_title().get_text() == "row (dashed: +ts)"


# -- colours, named severities, seeds left out, OOD set colours ------------------------------------------------------
def test_every_row_of_the_protocol_and_its_ensembles_has_a_colour_of_its_own(records) -> None:
    # with ten colours by registry position (method rows hashed), primal_paper and softmax_mc_dropout were both C8
    # and deep_ensemble and laplace both C1: two solid lines of one colour, the legend could not tell them apart
    from gpattn.comparison.config import MAIN_TABLE_ROWS

    rows = [*MAIN_TABLE_ROWS, "kep_svgp_ens5", "softmax_ens5"]
    digits = [r for r in records if r.task == "digits" and r.attention == "softmax"]
    many = [dataclasses.replace(r, attention=row) for row in rows for r in digits]
    lines = plot_shift_curves(many, ("ece",)).axes[0].get_lines()
    shades = {line.get_label().split(" (")[0]: matplotlib.colors.to_rgb(line.get_color()) for line in lines}
    assert sorted(shades) == sorted(rows) and len(set(shades.values())) == len(rows)
    # the same colour in the other figures of the same records
    gap = plot_gap_vs_shift_ece(many)
    for container in gap.axes[0].containers:
        name = container.get_label().split(" (")[0]
        assert matplotlib.colors.to_rgb(container.lines[0].get_color()) == shades[name]
    reliability = plot_reliability_diagrams(many, "digits")
    for axis in _panels(reliability, "reliability"):
        name = axis.get_title().split("\n")[0]
        assert _bars(axis, "accuracy")[0].get_facecolor()[:3] == pytest.approx(shades[name])


def test_named_severities_are_drawn_at_their_ranks(records) -> None:
    # a severity that is no number was placed at x = NaN: its points were silently not drawn, only the clean one
    digits = [r for r in records if r.task == "digits"]
    named = [_with_shift(r, {"fog": {"low": r.metrics.shift["blur"]["1"], "high": r.metrics.shift["blur"]["2"]}})
             for r in digits]  # fmt: skip
    axis = plot_shift_curves(named, ("accuracy",)).axes[0]
    line = axis.get_lines()[0]
    group = [r for r in digits if r.attention == ATTENTIONS[0]]
    expected = [np.mean([r.metrics.test.accuracy for r in group])] + [
        np.mean([r.metrics.shift["blur"][level].accuracy for r in group])
        for level in ("2", "1")  # "high", "low"
    ]
    np.testing.assert_allclose(line.get_xdata(), [0, 1, 2])
    np.testing.assert_allclose(line.get_ydata(), expected)
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["0", "high", "low"]


def test_a_point_of_fewer_seeds_is_ringed_and_an_undefined_metric_said(records) -> None:
    # a seed's NaN (or missing severity) made the point the other seed's value, labelled "(2 seeds)", with a band of 0
    digits = [r for r in records if r.task == "digits"]
    shift = {kind: dict(levels) for kind, levels in digits[0].metrics.shift.items()}
    shift["gaussian_noise"]["3"] = dataclasses.replace(shift["gaussian_noise"]["3"], accuracy=float("nan"))
    del shift["gaussian_noise"]["4"]
    figure = plot_shift_curves([_with_shift(digits[0], shift), *digits[1:]], ("accuracy",))
    axis = figure.axes[0]
    (ring,) = [line for line in axis.get_lines() if line.get_gid() == "partial"]
    other = digits[1].metrics.shift["gaussian_noise"]  # kep_svgp, seed 1
    np.testing.assert_allclose(ring.get_xdata(), [3, 4])
    np.testing.assert_allclose(ring.get_ydata(), [other["3"].accuracy, other["4"].accuracy])
    band = axis.collections[0].get_paths()
    assert all(not np.any(np.isclose(path.vertices[:, 0], 3.0)) for path in band)  # no band of one seed
    assert "rings: fewer seeds" in figure.get_suptitle()
    assert "rings" not in plot_shift_curves(digits, ("accuracy",)).get_suptitle()
    # debiased_ce NaN in every record (older records): the panel says so instead of staying blank
    undefined = plot_shift_curves(digits, ("debiased_ce",)).axes[0]
    assert [text.get_text() for text in undefined.texts if text.get_gid() == "note"] == ["no finite debiased_ce"]


def test_gap_figure_counts_the_seeds_behind_each_mean(records) -> None:
    digits = [r for r in records if r.task == "digits"]
    shift = {kind: dict(levels) for kind, levels in digits[0].metrics.shift.items()}
    shift["blur"]["2"] = dataclasses.replace(shift["blur"]["2"], ece=float("nan"))
    figure = plot_gap_vs_shift_ece([_with_shift(digits[0], shift), *digits[1:]])
    kep, softmax = figure.axes[0].containers
    assert kep.get_label() == "kep_svgp (2 seeds; finite: gap 2, shift ECE 1)" and softmax.get_label() == (
        "softmax (2 seeds)"
    )
    # the point is seed 1's shift ECE (as the tables, which leave the NaN seed out), without a y bar of one seed
    ece = 100 * np.mean([e.ece for levels in digits[1].metrics.shift.values() for e in levels.values()])
    assert float(kep.lines[0].get_ydata()[0]) == pytest.approx(ece, rel=1e-12)
    assert kep.has_xerr and not kep.has_yerr


def test_an_ood_set_has_one_colour_in_every_panel(records) -> None:
    # a panel without the held-out set drew the noise scores in the held-out set's colour of the other panel
    digits = [r for r in records if r.task == "digits"]
    no_held_out = [
        dataclasses.replace(r, ood_scores={k: v for k, v in r.ood_scores.items() if k != "held_out"})
        if r.attention == "softmax" else r for r in digits
    ]  # fmt: skip
    figure = plot_ood_histograms(no_held_out)
    shades = [
        {text.get_text().split(" (")[0]: patch.get_facecolor()[:3]
         for text, patch in zip(axis.get_legend().get_texts(), axis.get_legend().get_patches(), strict=True)}
        for axis in figure.axes
    ]  # fmt: skip
    assert list(shades[1]) == ["in-distribution", "noise"]
    assert shades[1]["noise"] == shades[0]["noise"] != shades[0]["held-out classes"]


def test_spectra_show_a_negative_value_below_zero(records) -> None:
    # the y axis started at 0 whatever the values: a negative singular value (an edited results.json) was off the figure
    group = [r for r in records if r.task == "pointer" and r.attention == "kep_svgp"]
    negative = [dataclasses.replace(r, spectra={"layer_1": [[4.0, 1.0, -2.0]]}) for r in group]
    (axis,) = plot_spectra(negative).axes
    np.testing.assert_allclose(axis.get_lines()[0].get_ydata(), [4.0, 1.0, -2.0])
    assert axis.get_ylim() == pytest.approx((1.05 * -2.0, 1.05 * 4.0))
    assert axis.figure.get_suptitle().endswith("(mean over the seeds; one scale, below 0: a negative value, -2)")


def test_shift_curves_refuse_a_scaled_flag_that_is_no_bool(records) -> None:
    # scaled="no" is truthy: the +ts rows were drawn without a word; metrics=5 failed with "'int' object is not
    # iterable"
    scaled = [_scaled(r, 0.5) for r in records]
    with pytest.raises(TypeError, match="plot_shift_curves: expected scaled to be True or False, got 'no'"):
        plot_shift_curves(scaled, ("ece",), scaled="no")
    with pytest.raises(TypeError, match=r"plot_shift_curves: expected metrics to be a sequence, e\.g\. .*, got 5"):
        plot_shift_curves(scaled, 5)
    lines = plot_shift_curves(scaled, "ece", scaled=np.bool_(False)).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["kep_svgp (2 seeds)", "softmax (2 seeds)"]
