"""Figures of a comparison under distribution shift, one task each: the metrics against the shift's severity
(:func:`plot_shift_curves`), and every row's clean-data miscalibration against its shift ECE
(:func:`plot_gap_vs_shift_ece`), which shows whether a row's lower shift ECE is its under-confidence on clean data
carried over rather than a better model of its uncertainty.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from scipy import stats

from ..comparison.records import RunRecord, ShiftMetrics
from ..comparison.table_rows import with_temperature_scaled
from ..validation import check_bool, check_choice, check_sequence
from ._records import (
    attention_order,
    colour,
    linestyle,
    mean_std,
    row_colours,
    seeds_text,
    severity_key,
    task_records,
    unique,
    validate,
)

__all__ = ["SHIFT_METRICS", "gap_records", "plot_gap_vs_shift_ece", "plot_shift_curves", "shift_records"]

#: The shift kind of the spatially shuffled MNIST-1D split, apart from the others in the mean shift ECE.
SHUFFLED = "shuffled"
#: The metrics a shift curve can show (those of :class:`~gpattn.comparison.ShiftMetrics`).
SHIFT_METRICS = tuple(entry.name for entry in dataclasses.fields(ShiftMetrics))


def shift_records(records: list[RunRecord]) -> list[RunRecord]:
    """The records with shift data."""
    return [r for r in records if r.metrics.shift]


def gap_records(records: list[RunRecord]) -> list[RunRecord]:
    """The records with shift data besides the spatially shuffled MNIST-1D split (:func:`plot_gap_vs_shift_ece`'s)."""
    return [r for r in records if any(levels for kind, levels in r.metrics.shift.items() if kind != SHUFFLED)]


def _shift_ece(record: RunRecord) -> float:
    # the mean ECE over the kinds (the shuffled split apart) and severities; NaN without any
    values = [
        entry.ece for kind, levels in record.metrics.shift.items() if kind != SHUFFLED for entry in levels.values()
    ]
    return float(np.mean(values)) if values else math.nan


def _shifted(record: RunRecord, kind: str, severity: str, metric: str) -> float:
    entry = record.metrics.shift.get(kind, {}).get(severity)
    return math.nan if entry is None else getattr(entry, metric)


def _severity_positions(severities: list[str]) -> tuple[np.ndarray, list[str]]:
    # x positions and tick labels of the clean set (0) and the severities: their values when every one is a finite
    # number, else their ranks 1, 2, ... (a named severity was at x = NaN: its points were not drawn)
    values = [severity_key(s)[1] if severity_key(s)[0] == 0 else math.nan for s in severities]
    if all(math.isfinite(value) and value > 0 for value in values):
        return np.asarray([0.0, *values]), ["0", *severities]
    return np.arange(len(severities) + 1, dtype=np.float64), ["0", *severities]


def _group_seeds(groups: dict[str, list[RunRecord]]) -> str:
    counts = unique(len(group) for group in groups.values())
    return seeds_text(counts[0]) if len(counts) == 1 else "seeds: " + "/".join(map(str, sorted(counts)))


def plot_shift_curves(
    records: list[RunRecord],
    metrics: Sequence[str] = ("accuracy", "ece", "nll"),
    task: str | None = None,
    scaled: bool = False,
) -> Figure:
    """Metrics under distribution shift against severity on one task, one line per row: the mean over seeds, with a
    ± 1 standard deviation band when there are several seeds.

    Severity 0 is the clean test set (``metrics.test``). Records without shift data are skipped. The x axis of a kind
    gives its severities' values, or their ranks 1, 2, ... (ticks named) where one is not a positive number. NaN
    values (an undefined metric, a severity missing in a seed) are left out of the mean: a point of fewer seeds than
    its row has is ringed (and has no band where one seed is left), and a panel without a finite value says so.

    :param records: The comparison records.
    :param metrics: Metric names among :data:`SHIFT_METRICS`, one row of panels each.
    :param task: The task; ``None``: the only task with shift data.
    :param scaled: Also draw each row's temperature-scaled ``+ts`` variant (dashed, in the row's colour).
    :return: The figure: rows = metrics, columns = shift kinds, one legend for the figure.
    :raises ValueError: An unknown metric, no shift data, or several tasks with shift data and no ``task``.
    :raises InputTypeError: ``scaled`` not a bool (a string such as ``"no"`` is truthy), or ``metrics`` neither a
        name nor a sequence of names.
    """
    records = validate(records)
    scaled = check_bool("scaled", scaled, where="plot_shift_curves")  # "no" was truthy: the +ts rows drawn
    if not isinstance(metrics, str):  # one name, or a sequence of them
        check_sequence("metrics", metrics, "('accuracy', 'ece')", where="plot_shift_curves")
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    if not metrics:
        raise ValueError("metrics must name at least one metric")
    for metric in metrics:
        check_choice("metrics", metric, SHIFT_METRICS)
    task, selected = task_records(records, task, shift_records, "shift data")
    colours = row_colours(r.attention for r in records)  # of every row: each figure of the records gives it the same
    if scaled:
        selected = with_temperature_scaled(selected)
    kinds = unique(kind for r in selected for kind in r.metrics.shift)
    groups = {a: [r for r in selected if r.attention == a] for a in attention_order(r.attention for r in selected)}
    size = (3.8 * max(len(kinds), 2), 2.9 * len(metrics) + 0.3 * len(groups) / 4 + 0.6)  # the legend below
    figure, axes = plt.subplots(
        len(metrics), len(kinds), figsize=size, squeeze=False, sharex="col", layout="constrained"
    )  # one x axis per column: the kinds have their own severities (a shared axis kept the last column's ticks)
    partial = False  # a point of fewer seeds than its row has (a severity missing, or a metric undefined)
    for column, kind in enumerate(kinds):
        severities = sorted(
            unique(s for r in selected for s in r.metrics.shift.get(kind, {}) if s != "0"), key=severity_key
        )
        x, ticks = _severity_positions(severities)
        for row, metric in enumerate(metrics):
            axis = axes[row, column]
            for attention, group in groups.items():
                per_seed = np.asarray(
                    [[getattr(r.metrics.test, metric)] + [_shifted(r, kind, s, metric) for s in severities]
                     for r in group], dtype=np.float64,
                )  # fmt: skip
                summary = [mean_std(per_seed[:, j]) for j in range(per_seed.shape[1])]
                mean = np.asarray([m for m, _, _ in summary])
                count = np.asarray([n for _, _, n in summary])
                shade = colour(attention, colours)
                axis.plot(
                    x, mean, marker="o", ms=3, color=shade, ls=linestyle(attention), lw=1.6,
                    label=f"{attention} ({seeds_text(len(group))})",
                )  # fmt: skip
                fewer = (count > 0) & (count < len(group))
                if fewer.any():  # a hollow ring: the mean of fewer seeds than the legend says
                    partial = True
                    axis.plot(
                        x[fewer], mean[fewer], ls="none", marker="o", ms=7, mfc="none", mec=shade, mew=1.2,
                        gid="partial",
                    )  # fmt: skip
                if len(group) > 1:
                    std = np.asarray([s if n > 1 else np.nan for _, s, n in summary])  # no spread of one seed
                    axis.fill_between(x, mean - std, mean + std, color=shade, alpha=0.15, lw=0)
            if not any(np.isfinite(line.get_ydata()).any() for line in axis.get_lines()):
                axis.text(0.5, 0.5, f"no finite {metric}", transform=axis.transAxes, ha="center", va="center",
                          gid="note")  # fmt: skip
            axis.set_title(f"{kind.replace('_', ' ')}: {metric}", fontsize=10)
            axis.set_xlabel("severity (0 = clean)")
            axis.set_ylabel(metric)
            axis.set_xticks(x, ticks)
            axis.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    title = "row (dashed: +ts)" if any(linestyle(attention) != "-" for attention in groups) else "row"
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=8, title=title)
    several = any(len(group) > 1 for group in groups.values())
    spread = "mean over seeds, band ± 1 std" if several else "1 seed"
    if partial:
        spread += "; rings: fewer seeds than the row's, the others' value missing or undefined"
    figure.suptitle(f"Metrics under distribution shift on {task} ({spread})")
    return figure


def plot_gap_vs_shift_ece(records: list[RunRecord], task: str | None = None) -> Figure:
    """Every row's clean-data miscalibration against its shift ECE on one task: x = mean confidence minus accuracy
    on the clean test set (negative: under-confident), y = the ECE under shift (mean over kinds and severities, the
    shuffled MNIST-1D split apart), both in percent, one point per row (the mean over seeds, ± 1 std bars with several
    seeds); a row's ``+ts`` variant is a hollow marker in the same colour. A seed whose gap or shift ECE is NaN (as in
    the report's tables) is left out of that mean, and the row's label gives the number of finite values of each.

    The title gives Spearman's rank correlation between the two over the points: near 1, the order of the rows'
    shift ECEs is the order of their clean-data gaps, so a low shift ECE says no more than "under-confident on
    clean data".

    :param records: The comparison records (their ``+ts`` variants are drawn too); records without shift data
        besides the shuffled split are skipped.
    :param task: The task; ``None``: the only task with shift data besides the shuffled split.
    :return: The figure, one panel.
    :raises ValueError: No record (of ``task``) has shift data besides the shuffled split, or several tasks do and
        ``task`` is ``None``.
    """
    records = validate(records)
    task, selected = task_records(records, task, gap_records, "shift data besides the shuffled split")
    colours = row_colours(r.attention for r in records)  # of every row: each figure of the records gives it the same
    selected = with_temperature_scaled(selected)
    figure, axis = plt.subplots(figsize=(7.0, 5.2), layout="constrained")
    points = []
    groups = {a: [r for r in selected if r.attention == a] for a in attention_order(r.attention for r in selected)}
    for attention, group in groups.items():
        gaps = [100 * (r.metrics.test.confidence - r.metrics.test.accuracy) for r in group]
        shift = [100 * _shift_ece(r) for r in group]
        (gap, gap_std, gap_count), (ece, ece_std, ece_count) = mean_std(gaps), mean_std(shift)
        label = f"{attention} ({seeds_text(len(group))})"
        if min(gap_count, ece_count) < len(group):  # a seed's value undefined (NaN): the point is the others' mean
            label = f"{attention} ({seeds_text(len(group))}; finite: gap {gap_count}, shift ECE {ece_count})"
        hollow, shade = attention.endswith("+ts"), colour(attention, colours)
        axis.errorbar(
            gap, ece, xerr=gap_std if gap_count > 1 else None, yerr=ece_std if ece_count > 1 else None,
            fmt="s" if hollow else "o", ms=7, color=shade, mfc="white" if hollow else shade, capsize=2, label=label,
        )  # fmt: skip
        axis.annotate(attention, (gap, ece), textcoords="offset points", xytext=(5, 4), fontsize=7)
        points.append((gap, ece))
    axis.axvline(0.0, color="grey", ls=":", lw=1)
    axis.set_xlabel("clean confidence − accuracy (percent; < 0: under-confident)")
    axis.set_ylabel("shift ECE (percent, mean over kinds and severities)")
    axis.grid(alpha=0.3)
    finite = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    xs, ys = [x for x, _ in finite], [y for _, y in finite]
    if len(finite) >= 3 and len(set(xs)) > 1 and len(set(ys)) > 1:
        correlation = f"Spearman {stats.spearmanr(xs, ys).statistic:+.2f} over {len(finite)} rows"
    else:
        correlation = f"{len(finite)} rows: no rank correlation (too few, or constant values)"
    axis.set_title(f"Clean-data gap against shift ECE on {task}\n{_group_seeds(groups)}; {correlation}", fontsize=10)
    axis.legend(fontsize=7, loc="best", title="row (hollow: +ts)", title_fontsize=7)
    return figure
