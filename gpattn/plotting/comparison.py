"""Figures of the attention comparison: reliability diagrams (with counts per bin), shift curves, OOD histograms
and KSVD spectra.

Every function takes the runner's list of :class:`~gpattn.comparison.RunRecord` s, one per ``(task, attention,
seed)`` (:func:`~gpattn.comparison.run_comparison`, or :func:`~gpattn.comparison.read_records` of a
``results.json``). A record lacking the data of a figure (no shift, no OOD scores, no spectra, ...) is skipped by that
figure. Seeds are pooled (reliability bins, OOD scores) or averaged (metrics, spectra). Attentions appear in registry
order (:func:`~gpattn.attention.attention_names`), and each keeps its colour across all figures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

# no backend switching here: matplotlib falls back to Agg on headless machines, and notebooks keep their inline backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..attention import attention_names
from ..comparison.records import RunRecord, ShiftMetrics
from ..validation import InputTypeError, check_choice
from .fidelity import write_fidelity_figure

#: The metrics a shift curve can show (those of :class:`~gpattn.comparison.ShiftMetrics`).
SHIFT_METRICS = tuple(entry.name for entry in dataclasses.fields(ShiftMetrics))
OOD_SETS = {"in": "in-distribution (test)", "held_out": "held-out classes", "noise": "noise"}
DPI = 110

__all__ = [
    "plot_ood_histograms",
    "plot_reliability_diagrams",
    "plot_shift_curves",
    "plot_spectra",
    "write_comparison_figures",
]


# ----------------------------------------------------------------------------------------------------------- helpers
def _validate(records) -> list[RunRecord]:
    if isinstance(records, (str, bytes, dict)) or not isinstance(records, Sequence):
        raise InputTypeError(f"records must be a non-empty list of RunRecords, got {type(records).__name__}")
    if len(records) == 0:
        raise ValueError("records must be a non-empty list of RunRecords, got an empty list")
    for index, record in enumerate(records):
        if not isinstance(record, RunRecord):
            raise InputTypeError(
                f"record {index} is a {type(record).__name__}, expected a RunRecord (read the dicts of a "
                f"results.json with gpattn.comparison.read_records or RunRecord.from_dict)"
            )
    return list(records)


def _unique(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def _attention_order(attentions: Iterable[str]) -> list[str]:
    # registered attentions in registry order, then the others (e.g. ensembles "<name>_ens<K>") as they come
    present, registered = _unique(attentions), attention_names()
    return [a for a in registered if a in present] + [a for a in present if a not in registered]


def _colour(attention: str) -> str:
    registered = attention_names()
    if attention in registered:
        return f"C{registered.index(attention) % 10}"
    return f"C{(len(registered) + sum(map(ord, attention))) % 10}"


def _values(values: Iterable[float | None]) -> np.ndarray:
    """Floats with ``None`` (an empty reliability bin) as NaN."""
    return np.asarray([math.nan if value is None else value for value in values], dtype=np.float64)


def _mean_std(values: Iterable[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and number of the finite values."""
    finite = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return math.nan, math.nan, 0
    std = float(finite.std(ddof=1)) if finite.size > 1 else 0.0
    return float(finite.mean()), std, int(finite.size)


def _grid(count: int, panel_width: float, panel_height: float, max_columns: int = 3):
    """A figure with exactly ``count`` axes on a grid of at most ``max_columns`` columns (unused cells removed)."""
    columns = min(count, max_columns)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(panel_width * columns, panel_height * rows), squeeze=False, layout="constrained"
    )
    flat = list(axes.ravel())
    for axis in flat[count:]:
        figure.delaxes(axis)
    return figure, flat[:count]


def _severity_key(severity: str):
    try:
        return (0, float(severity))
    except ValueError:
        return (1, severity)


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _panel_name(task: str, attention: str, tasks: Sequence[str]) -> str:
    return attention if len(tasks) == 1 else f"{task}: {attention}"


# ------------------------------------------------------------------------------------------------------ reliability
def _reliability_records(records: list[RunRecord], task: str) -> list[RunRecord]:
    return [r for r in records if r.task == task and r.reliability is not None and r.reliability.count]


def pool_reliability(records: Sequence[RunRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pool the per-bin reliability data of several records (e.g. seeds).

    Counts are summed; confidence and accuracy are count-weighted means over the records whose bin is non-empty.

    :param records: Records with a ``reliability`` entry, all with the same number of bins.
    :return: ``(confidence, accuracy, count)``, NumPy arrays of one value per bin (NaN for bins empty in all).
    """
    num_bins = {len(r.reliability.count) for r in records}
    if len(num_bins) != 1:
        raise ValueError(f"reliability data with different numbers of bins: {sorted(num_bins)}")
    (size,) = num_bins
    count = np.zeros(size)
    confidence_sum = np.zeros(size)
    accuracy_sum = np.zeros(size)
    for record in records:
        n = np.asarray(record.reliability.count, dtype=np.float64)
        conf, acc = _values(record.reliability.confidence), _values(record.reliability.accuracy)
        filled = n > 0
        count += n
        confidence_sum += np.where(filled, n * np.nan_to_num(conf), 0.0)
        accuracy_sum += np.where(filled, n * np.nan_to_num(acc), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return confidence_sum / count, accuracy_sum / count, count.astype(np.int64)


def plot_reliability_diagrams(records: list[RunRecord], task: str) -> Figure:
    """Reliability diagram of every attention on ``task``'s test set, seeds pooled, with the number of test points
    in each bin below it.

    Upper panel (label ``"reliability"``): bars in the attention's colour give the accuracy of each non-empty
    confidence bin, pooled over seeds (counts summed, count-weighted mean confidence and accuracy); red hatched bars
    give the gap to the bin's mean confidence (above the bar: over-confident, below: under-confident); dashed: the
    diagonal of perfect calibration. Lower panel (label ``"count"``): the number of test predictions in each bin
    (seeds summed), so that a bin of 2 predictions is not read like one holding most of them. One legend for the
    figure. Panel titles give the ECE (mean ± std over the n seeds, in percent).

    :param records: The comparison records.
    :param task: The task whose records are drawn.
    :return: The figure, two panels per attention (``figure.axes`` alternates reliability and count panels).
    """
    records = _validate(records)
    selected = _reliability_records(records, task)
    if not selected:
        raise ValueError(f"no reliability data for task {task!r}")
    attentions = _attention_order(r.attention for r in selected)
    columns = min(len(attentions), 3)
    rows = math.ceil(len(attentions) / columns)
    figure = plt.figure(figsize=(3.6 * columns, 4.6 * rows), layout="constrained")
    grid = figure.add_gridspec(2 * rows, columns, height_ratios=[3, 1] * rows)
    for position, attention in enumerate(attentions):
        row, column = divmod(position, columns)
        axis = figure.add_subplot(grid[2 * row, column], label="reliability")
        counts_axis = figure.add_subplot(grid[2 * row + 1, column], sharex=axis, label="count")
        group = [r for r in selected if r.attention == attention]
        confidence, accuracy, count = pool_reliability(group)
        size = len(count)
        edges = np.linspace(0.0, 1.0, size + 1)
        filled = count > 0
        left, width = edges[:-1][filled], np.diff(edges)[filled]
        axis.bar(
            left, accuracy[filled], width=width, align="edge", color=_colour(attention), edgecolor="k",
            linewidth=0.6, alpha=0.85, label="accuracy (bar colour: the attention)", gid="accuracy",
        )  # fmt: skip
        axis.bar(
            left, (confidence - accuracy)[filled], bottom=accuracy[filled], width=width, align="edge",
            color="C3", alpha=0.3, hatch="//", edgecolor="C3", linewidth=0.6,
            label="gap to the mean confidence (red hatched)", gid="gap",
        )  # fmt: skip
        axis.plot([0, 1], [0, 1], ls="--", color="k", lw=1, label="perfect calibration")
        axis.set_xlim(0, 1)
        axis.set_ylim(0, 1)
        axis.set_ylabel("accuracy")
        axis.tick_params(labelbottom=False)
        ece, ece_std, seeds = _mean_std(r.metrics.test.ece for r in group)
        if seeds > 1:
            ece_text = f"ECE {100 * ece:.2f} ± {100 * ece_std:.2f}% (n={seeds})"
        else:
            ece_text = f"ECE {100 * ece:.2f}% (n=1)" if seeds else "ECE n/a"
        axis.set_title(f"{attention}\n{ece_text}", fontsize=10)
        counts_axis.bar(
            edges[:-1], count, width=np.diff(edges), align="edge", color="0.55", edgecolor="k", linewidth=0.4,
            gid="count",
        )  # fmt: skip
        total = int(count.sum())
        counts_axis.set_ylabel("predictions")
        counts_axis.set_xlabel("confidence")
        counts_axis.set_title(f"predictions per bin ({total} in all)", fontsize=8)
        counts_axis.set_ylim(0, max(1, int(count.max())) * 1.1)
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8)
    figure.suptitle(f"Reliability diagrams on {task} (test set, {size} bins, seeds pooled)")
    return figure


# ------------------------------------------------------------------------------------------------------------ shift
def _shift_records(records: list[RunRecord]) -> list[RunRecord]:
    return [r for r in records if r.metrics.shift]


def _shifted(record: RunRecord, kind: str, severity: str, metric: str) -> float:
    entry = record.metrics.shift.get(kind, {}).get(severity)
    return math.nan if entry is None else getattr(entry, metric)


def plot_shift_curves(records: list[RunRecord], metrics: Sequence[str] = ("accuracy", "ece", "nll")) -> Figure:
    """Metrics under distribution shift against severity, one line per attention (mean ± std band over seeds).

    Severity 0 is the clean test set (``metrics.test``). Records without shift data are skipped.

    :param records: The comparison records.
    :param metrics: Metric names among :data:`SHIFT_METRICS`, one row each.
    :return: The figure: rows = metrics, columns = shift kinds, one legend for the figure.
    """
    records = _validate(records)
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    if not metrics:
        raise ValueError("metrics must name at least one metric")
    for metric in metrics:
        check_choice("metrics", metric, SHIFT_METRICS)
    selected = _shift_records(records)
    if not selected:
        raise ValueError("no records with shift data")
    kinds = _unique(kind for r in selected for kind in r.metrics.shift)
    tasks = _unique(r.task for r in selected)
    groups = [(t, a) for t in tasks for a in _attention_order(r.attention for r in selected if r.task == t)]
    figure, axes = plt.subplots(
        len(metrics), len(kinds), figsize=(3.8 * len(kinds) + 1.8, 2.9 * len(metrics)), squeeze=False,
        sharex=True, layout="constrained",
    )  # fmt: skip
    linestyles = ("-", "--", ":", "-.")
    for column, kind in enumerate(kinds):
        severities = sorted(
            _unique(s for r in selected for s in r.metrics.shift.get(kind, {}) if s != "0"), key=_severity_key
        )
        x = np.asarray([0.0] + [_severity_key(s)[1] if _severity_key(s)[0] == 0 else np.nan for s in severities])
        for row, metric in enumerate(metrics):
            axis = axes[row, column]
            for task, attention in groups:
                group = [r for r in selected if r.task == task and r.attention == attention]
                per_seed = np.asarray(
                    [
                        [getattr(r.metrics.test, metric)] + [_shifted(r, kind, s, metric) for s in severities]
                        for r in group
                    ]
                )
                stats = [_mean_std(per_seed[:, j]) for j in range(per_seed.shape[1])]
                mean = np.asarray([m for m, _, _ in stats])
                std = np.asarray([s for _, s, _ in stats])
                colour = _colour(attention)
                label = _panel_name(task, attention, tasks) + f" (n={len(group)})"
                style = linestyles[tasks.index(task) % len(linestyles)]
                axis.plot(x, mean, marker="o", ms=3, color=colour, ls=style, lw=1.6, label=label)
                axis.fill_between(x, mean - std, mean + std, color=colour, alpha=0.18, lw=0)
            axis.set_title(f"{kind.replace('_', ' ')}: {metric}", fontsize=10)
            axis.set_xlabel("severity (0 = clean)")
            axis.set_ylabel(metric)
            axis.set_xticks(x[np.isfinite(x)])
            axis.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right upper", fontsize=8, title="attention")
    figure.suptitle(f"Metrics under distribution shift on {', '.join(tasks)} (mean ± std over seeds)")
    return figure


# -------------------------------------------------------------------------------------------------------------- OOD
def _ood_records(records: list[RunRecord]) -> list[RunRecord]:
    return [r for r in records if r.ood_scores.get("in")]


def _task_attention_panels(records, select, what: str):
    # the records with the data a figure needs, their (task, attention) groups and one panel per group
    records = _validate(records)
    selected = select(records)
    if not selected:
        raise ValueError(f"no records with {what}")
    tasks = _unique(r.task for r in selected)
    groups = [(t, a) for t in tasks for a in _attention_order(r.attention for r in selected if r.task == t)]
    figure, axes = _grid(len(groups), 4.0, 3.2)
    return selected, tasks, groups, figure, axes


def plot_ood_histograms(records: list[RunRecord]) -> Figure:
    """Densities of the maximum predicted probability on in-distribution, held-out-class and noise inputs.

    Scores are pooled over seeds; the density axis is logarithmic (most scores sit near 1, where a linear axis hides
    the rest). The panel title gives the AUROC of the maximum probability against every OOD set (held-out classes and
    noise: mean ± std over the n seeds of ``metrics.ood.<set>.auroc_max_prob``). Records without OOD scores are
    skipped.

    :param records: The comparison records.
    :return: The figure, one panel per attention (per task and attention when several tasks have OOD scores).
    """
    selected, tasks, groups, figure, axes = _task_attention_panels(records, _ood_records, "OOD scores")
    bins = np.linspace(0.0, 1.0, 41)
    colours = {"in": "C0", "held_out": "C3", "noise": "C7"}
    for axis, (task, attention) in zip(axes, groups, strict=True):
        group = [r for r in selected if r.task == task and r.attention == attention]
        names = _unique(name for r in group for name in r.ood_scores)
        names = [n for n in OOD_SETS if n in names] + [n for n in names if n not in OOD_SETS]
        for index, name in enumerate(names):
            scores = np.asarray([v for r in group for v in r.ood_scores.get(name, [])], dtype=np.float64)
            scores = scores[np.isfinite(scores)]
            if scores.size == 0:
                continue
            colour = colours.get(name, f"C{(index + 4) % 10}")
            label = f"{OOD_SETS.get(name, name)} (n={scores.size})"
            axis.hist(scores, bins=bins, density=True, color=colour, alpha=0.3, label=label)
            axis.hist(scores, bins=bins, density=True, color=colour, histtype="step", lw=1.2)
        aurocs = []
        for name in [n for n in names if n != "in"]:
            values = [r.metrics.ood[name].auroc_max_prob for r in group if name in r.metrics.ood]
            auroc, auroc_std, seeds = _mean_std(values)
            short = {"held_out": "held-out"}.get(name, name)
            if seeds > 1:
                aurocs.append(f"AUROC ({short}) {auroc:.3f} ± {auroc_std:.3f}")
            else:
                aurocs.append(f"AUROC ({short}) {auroc:.3f}" if seeds else f"AUROC ({short}) n/a")
        seeds_text = f" (n={len(group)})"
        axis.set_title(f"{_panel_name(task, attention, tasks)}{seeds_text}\n" + "\n".join(aurocs), fontsize=9)
        axis.set_xlim(0, 1)
        axis.set_yscale("log")  # most scores sit near 1: a linear axis hides everything below 0.95
        axis.set_xlabel("max probability")
        axis.set_ylabel("density (log)")
        axis.legend(fontsize=7, loc="upper left")
    figure.suptitle(f"Maximum-probability OOD scores on {', '.join(tasks)} (seeds pooled)")
    return figure


# ---------------------------------------------------------------------------------------------------------- spectra
def _spectra_records(records: list[RunRecord]) -> list[RunRecord]:
    return [r for r in records if any(heads for heads in r.spectra.values())]


def plot_spectra(records: list[RunRecord]) -> Figure:
    """Learned KSVD singular values :math:`\\lambda_i` of every attention layer and head (mean over seeds), on one
    linear y-scale shared by all panels and starting at 0, so that panels compare by eye.

    Records without spectra are skipped; seeds with spectra of different lengths are truncated to the shortest.

    :param records: The comparison records.
    :return: The figure, one panel per attention (per task and attention when several tasks have spectra).
    """
    selected, tasks, groups, figure, axes = _task_attention_panels(records, _spectra_records, "spectra")
    top = 0.0
    for axis, (task, attention) in zip(axes, groups, strict=True):
        group = [r for r in selected if r.task == task and r.attention == attention]
        layers = sorted(_unique(layer for r in group for layer in r.spectra), key=_natural_key)
        lines = 0
        for layer_index, layer in enumerate(layers):
            num_heads = max(len(r.spectra.get(layer, [])) for r in group)
            for head in range(num_heads):
                curves = [
                    np.asarray(r.spectra[layer][head], dtype=np.float64)
                    for r in group
                    if len(r.spectra.get(layer, [])) > head and len(r.spectra[layer][head]) > 0
                ]
                if not curves:
                    continue
                length = min(len(c) for c in curves)
                mean = np.nanmean(np.stack([c[:length] for c in curves]), axis=0)
                index = np.arange(1, length + 1)
                axis.plot(
                    index, mean, color=f"C{layer_index % 10}", ls=("-", "--", ":", "-.")[head % 4], marker=".",
                    label=f"{layer.replace('_', ' ')}, head {head + 1}",
                )  # fmt: skip
                lines += 1
                finite = mean[np.isfinite(mean)]
                top = max(top, float(finite.max()) if finite.size else 0.0)
        axis.set_title(f"{_panel_name(task, attention, tasks)} (n={len(group)})", fontsize=10)
        axis.set_xlabel("index i")
        axis.set_ylabel(r"singular value $\lambda_i$")
        axis.grid(alpha=0.3, which="both")
        if lines > 1:
            axis.legend(fontsize=7, loc="lower left", framealpha=0.8)
    for axis in axes:  # one scale for every panel, from 0
        axis.set_ylim(0.0, 1.05 * top if top > 0 else 1.0)
    figure.suptitle(f"Learned KSVD singular values on {', '.join(tasks)} (mean over the n seeds; one scale, from 0)")
    return figure


# ----------------------------------------------------------------------------------------------------------- writing
def write_comparison_figures(records: list[RunRecord], out_dir: str | Path) -> list[Path]:
    """Write every comparison figure for which the records have data, as PNG at 110 dpi.

    Files: ``reliability_<task>.png`` per task with reliability data, ``shift.png``, ``ood_histograms.png``,
    ``spectra.png`` and ``fidelity.png`` (:func:`~gpattn.plotting.fidelity.write_fidelity_figure`). Figures are
    closed after writing.

    :param records: The comparison records.
    :param out_dir: Output directory (created if missing).
    :return: The paths written, in that order.
    """
    records = _validate(records)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for task in _unique(r.task for r in records):
        if _reliability_records(records, task):
            jobs.append((f"reliability_{task}.png", lambda task=task: plot_reliability_diagrams(records, task)))
    if _shift_records(records):
        jobs.append(("shift.png", lambda: plot_shift_curves(records)))
    if _ood_records(records):
        jobs.append(("ood_histograms.png", lambda: plot_ood_histograms(records)))
    if _spectra_records(records):
        jobs.append(("spectra.png", lambda: plot_spectra(records)))
    written = []
    for name, make in jobs:
        figure = make()
        try:
            path = out_dir / name
            temporary = out_dir / f".{name}.tmp"  # written whole, then renamed: never a half-written figure
            figure.savefig(temporary, dpi=DPI, format="png")
            os.replace(temporary, path)
            written.append(path)
        finally:
            plt.close(figure)
    return written + write_fidelity_figure(records, out_dir)  # fidelity.png (gpattn.plotting.fidelity)
