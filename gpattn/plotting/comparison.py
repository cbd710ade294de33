"""Figures of the attention comparison: reliability diagrams (with counts per bin), OOD histograms and KSVD spectra,
the shift figures of :mod:`gpattn.plotting.shift`, and the writer of every figure of a run folder
(:func:`write_comparison_figures`, whose file names :func:`comparison_figure_names` lists).

Every function takes the runner's list of :class:`~gpattn.comparison.RunRecord` s, one per ``(task, attention,
seed)`` (:func:`~gpattn.comparison.run_comparison`, or :func:`~gpattn.comparison.read_records` of a
``results.json``). A record lacking the data of a figure (no shift, no OOD scores, no spectra, ...) is skipped by that
figure. Seeds are pooled (reliability bins, OOD scores) or averaged (metrics, spectra). Rows appear in registry
order (:func:`~gpattn.attention.attention_names`), a ``+ts`` row after its row, and each keeps its colour across all
figures of the same records (:func:`~gpattn.plotting._records.row_colours`: its position in the row registry
:func:`~gpattn.methods.method_names`; other rows, e.g. ensembles, colours no registered row has).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

# no backend switching here: matplotlib falls back to Agg on headless machines, and notebooks keep their inline backend
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..comparison.records import RunRecord
from ..validation import InputTypeError
from ._records import (
    DPI,
    attention_order,
    colour,
    grid,
    mean_std,
    natural_key,
    panel_name,
    row_colours,
    save,
    seeds_text,
    spread_text,
    task_records,
    unique,
    validate,
    values_array,
)
from .fidelity import write_fidelity_figure
from .shift import gap_records, plot_gap_vs_shift_ece, plot_shift_curves, shift_records

OOD_SETS = {"in": "in-distribution (test)", "held_out": "held-out classes", "noise": "noise"}
#: The OOD set that pools every family: its scores are the families' together, so the histograms leave it out.
POOLED = "pooled"

#: The figure files :func:`write_comparison_figures` writes, ``{task}`` standing for each task with the data.
RELIABILITY_FILE = "reliability_{task}.png"
SHIFT_FILE = "shift_{task}.png"
GAP_FILE = "gap_vs_shift_ece_{task}.png"
OOD_FILE = "ood_histograms_{task}.png"
SPECTRA_FILE = "spectra.png"
FIDELITY_FILE = "fidelity.png"  # gpattn.plotting.fidelity.write_fidelity_figure's
FIGURE_FILES = (RELIABILITY_FILE, SHIFT_FILE, GAP_FILE, OOD_FILE, SPECTRA_FILE, FIDELITY_FILE)
#: Figures earlier versions wrote into a run folder (one figure for every task), replaced by the files above.
FORMER_FIGURE_FILES = ("shift.png", "ood_histograms.png")
#: The metrics of the shift figures.
SHIFT_FIGURE_METRICS = ("accuracy", "nll", "brier", "ece")

__all__ = [
    "DPI",
    "FIGURE_FILES",
    "FORMER_FIGURE_FILES",
    "comparison_figure_names",
    "plot_ood_histograms",
    "plot_reliability_diagrams",
    "plot_spectra",
    "pool_reliability",
    "write_comparison_figures",
]


# ------------------------------------------------------------------------------------------------------ reliability
def _reliability_records(records: list[RunRecord], task: str) -> list[RunRecord]:
    return [r for r in records if r.task == task and r.reliability is not None and r.reliability.count]


def pool_reliability(records: Sequence[RunRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pool the per-bin reliability data of several records (e.g. seeds).

    Counts are summed; confidence and accuracy are count-weighted means over the records whose bin is non-empty.

    :param records: Records with a ``reliability`` entry, all with the same number of bins.
    :return: ``(confidence, accuracy, count)``, NumPy arrays of one value per bin (NaN for bins empty in all).
    :raises ValueError: Records with different numbers of bins, or a bin holding predictions (count > 0) without a
        finite confidence or accuracy (which the pooled means would otherwise read as 0).
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
        conf, acc = values_array(record.reliability.confidence), values_array(record.reliability.accuracy)
        filled = n > 0
        missing = np.flatnonzero(filled & ~(np.isfinite(conf) & np.isfinite(acc)))
        if missing.size:
            raise ValueError(
                f"the reliability data of {record.attention} (task {record.task!r}, seed {record.seed}) has no finite "
                f"confidence or accuracy in bin(s) {missing.tolist()}, which hold predictions (count > 0)"
            )
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
    figure. Panel titles give the ECE in percent (mean ± std over the seeds; one seed: the value, said so).

    :param records: The comparison records.
    :param task: The task whose records are drawn.
    :return: The figure, two panels per attention (``figure.axes`` alternates reliability and count panels); the
        title gives the number of bins (of every row, separated by ``/``, where rows differ).
    :raises ValueError: No reliability data for ``task``, or data that :func:`pool_reliability` refuses (no figure is
        left open).
    """
    records = validate(records)
    selected = _reliability_records(records, task)
    if not selected:
        raise ValueError(f"no reliability data for task {task!r}")
    attentions = attention_order(r.attention for r in selected)
    colours = row_colours(r.attention for r in records)  # of every row: each figure of the records gives it the same
    # pooled before the figure exists, so that refused data (e.g. seeds with different bins) leaves no figure open
    pooled = {a: pool_reliability([r for r in selected if r.attention == a]) for a in attentions}
    columns = min(len(attentions), 3)
    rows = math.ceil(len(attentions) / columns)
    figure = plt.figure(figsize=(3.6 * columns, 4.6 * rows), layout="constrained")
    panels = figure.add_gridspec(2 * rows, columns, height_ratios=[3, 1] * rows)
    for position, attention in enumerate(attentions):
        row, column = divmod(position, columns)
        axis = figure.add_subplot(panels[2 * row, column], label="reliability")
        counts_axis = figure.add_subplot(panels[2 * row + 1, column], sharex=axis, label="count")
        group = [r for r in selected if r.attention == attention]
        confidence, accuracy, count = pooled[attention]
        size = len(count)
        edges = np.linspace(0.0, 1.0, size + 1)
        filled = count > 0
        left, width = edges[:-1][filled], np.diff(edges)[filled]
        axis.bar(
            left, accuracy[filled], width=width, align="edge", color=colour(attention, colours), edgecolor="k",
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
        ece_text = spread_text((r.metrics.test.ece for r in group), scale=100.0, unit="%")
        axis.set_title(f"{attention}\nECE {ece_text}", fontsize=10)
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
    sizes = "/".join(map(str, unique(len(count) for _, _, count in pooled.values())))  # rows may differ
    figure.suptitle(f"Reliability diagrams on {task} (test set, {sizes} bins, seeds pooled)")
    return figure


# -------------------------------------------------------------------------------------------------------------- OOD
def _ood_records(records: list[RunRecord]) -> list[RunRecord]:
    return [r for r in records if r.ood_scores.get("in")]


def _task_attention_panels(selected: list[RunRecord]):
    # the (task, attention) groups of the selected records and one panel per group
    tasks = unique(r.task for r in selected)
    groups = [(t, a) for t in tasks for a in attention_order(r.attention for r in selected if r.task == t)]
    figure, axes = grid(len(groups), 4.0, 3.2)
    return tasks, groups, figure, axes


def _auroc_lines(group: list[RunRecord]) -> list[str]:
    # the pooled set's AUROCs when there is one (the families' are in table.md), else every set's
    names = unique(name for r in group for name in r.metrics.ood)
    names = [POOLED] if POOLED in names else names
    lines = []
    for name in names:
        short = {"held_out": "held-out"}.get(name, name)
        for field, score in (("auroc_max_prob", ""), ("auroc_mutual_information", ", MI")):
            values = [getattr(r.metrics.ood[name], field) for r in group if name in r.metrics.ood]
            mean, std, count = mean_std(values)
            if count == 0 and score:
                continue  # no mutual information: a deterministic row (or an older record)
            text = "n/a" if count == 0 else (f"{mean:.3f} ± {std:.3f}" if count > 1 else f"{mean:.3f}")
            if 0 < count < len(group):  # a seed without the set or with the AUROC undefined: the others' mean
                text += f" ({seeds_text(count)} of {len(group)})"
            lines.append(f"AUROC ({short}{score}) {text}")
    return lines


def plot_ood_histograms(records: list[RunRecord], task: str | None = None) -> Figure:
    """Densities of the maximum predicted probability on the in-distribution test inputs and on each OOD set (the
    held-out classes and every noise family; the pooled set, their union, is left out).

    Scores are pooled over seeds; the density axis is logarithmic (most scores sit near 1, where a linear axis hides
    the rest). The panel title gives the AUROC against the pooled OOD set (else against every OOD set) by the maximum
    probability and, where the record has it, by the mutual information (MI): the mean ± std over the seeds of
    ``metrics.ood.<set>`` (over the seeds where it is defined, then counted: "(2 seeds of 3)"). Records without OOD
    scores are skipped; non-finite scores are left out (the legend counts the inputs drawn), and a panel without a
    finite score says so.

    :param records: The comparison records.
    :param task: The task to draw; ``None``: every task with OOD scores (a panel per task and row).
    :return: The figure, one panel per row (per task and row for several tasks).
    :raises ValueError: No OOD scores (for ``task``), or a score outside [0, 1]: the scores are maximum probabilities
        (:attr:`~gpattn.comparison.RunRecord.ood_scores`), drawn on [0, 1].
    """
    records = validate(records)
    if task is None:
        selected = _ood_records(records)
        if not selected:
            raise ValueError("no records with OOD scores")
    else:
        task, selected = task_records(records, task, _ood_records, "OOD scores")
    for record in selected:  # before any figure is made
        for name, values in record.ood_scores.items():
            scores = np.asarray(values, dtype=np.float64)
            outside = scores[(scores < 0.0) | (scores > 1.0)]
            if outside.size:
                raise ValueError(
                    f"plot_ood_histograms: the {name!r} OOD scores of {record.attention} (task {record.task!r}, seed "
                    f"{record.seed}) must be maximum probabilities in [0, 1], got {outside.size} outside, in "
                    f"[{outside.min():g}, {outside.max():g}]"
                )
    tasks, groups, figure, axes = _task_attention_panels(selected)
    bins = np.linspace(0.0, 1.0, 41)
    # a set's colour from its place among the sets of every panel: a panel without a set (held-out classes) drew the
    # next set (noise) in the colour the other panels give the missing one
    every = [n for n in unique(name for r in selected for name in r.ood_scores) if n != POOLED]
    every = [n for n in OOD_SETS if n in every] + [n for n in every if n not in OOD_SETS]
    for axis, (name_of_task, attention) in zip(axes, groups, strict=True):
        group = [r for r in selected if r.task == name_of_task and r.attention == attention]
        present = {name for r in group for name in r.ood_scores}
        for index, name in enumerate(every):
            if name not in present:
                continue
            scores = np.asarray([v for r in group for v in r.ood_scores.get(name, [])], dtype=np.float64)
            scores = scores[np.isfinite(scores)]
            if scores.size == 0:
                continue
            shade = "C0" if name == "in" else f"C{(index + 2) % 10}"
            label = f"{OOD_SETS.get(name, name.replace('_', ' '))} ({scores.size} inputs)"
            axis.hist(scores, bins=bins, density=True, color=shade, alpha=0.25 if name == "in" else 0.15, label=label)
            axis.hist(scores, bins=bins, density=True, color=shade, histtype="step", lw=1.2)
        title = f"{panel_name(name_of_task, attention, tasks)} ({seeds_text(len(group))})"
        axis.set_title(title + "\n" + "\n".join(_auroc_lines(group)), fontsize=9)
        axis.set_xlim(0, 1)
        axis.set_yscale("log")  # most scores sit near 1: a linear axis hides everything below 0.95
        axis.set_xlabel("max probability")
        axis.set_ylabel("density (log)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper left")
        else:
            axis.text(0.5, 0.5, "no finite scores", transform=axis.transAxes, ha="center", va="center", gid="note")
    figure.suptitle(f"Maximum-probability OOD scores on {', '.join(tasks)} (seeds pooled)")
    return figure


# ---------------------------------------------------------------------------------------------------------- spectra
def _spectra_records(records: list[RunRecord]) -> list[RunRecord]:
    return [r for r in records if any(heads for heads in r.spectra.values())]


def plot_spectra(records: list[RunRecord]) -> Figure:
    """Learned KSVD singular values :math:`\\lambda_i` of every attention layer and head (mean over seeds), on one
    linear y-scale shared by all panels and starting at 0 (below it when a mean is negative, which the learned values
    never are: an edited ``results.json``), so that panels compare by eye.

    Records without spectra are skipped; seeds with spectra of different lengths are truncated to the shortest. NaN
    values are left out of the mean: an index that is NaN in every seed is a gap in the line, and a head without
    any finite mean is not drawn (the panel says how many were left out).

    :param records: The comparison records.
    :return: The figure, one panel per attention (per task and attention when several tasks have spectra).
    """
    selected = _spectra_records(validate(records))
    if not selected:
        raise ValueError("no records with spectra")
    tasks, groups, figure, axes = _task_attention_panels(selected)
    top = bottom = 0.0
    for axis, (task, attention) in zip(axes, groups, strict=True):
        group = [r for r in selected if r.task == task and r.attention == attention]
        layers = sorted(unique(layer for r in group for layer in r.spectra), key=natural_key)
        lines = left_out = 0
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
                stacked = np.stack([c[:length] for c in curves])
                known = ~np.isnan(stacked)
                seeds = known.sum(axis=0)  # np.nanmean warns where it is 0
                mean = np.where(known, stacked, 0.0).sum(axis=0) / np.maximum(seeds, 1)
                mean[seeds == 0] = np.nan
                if not np.isfinite(mean).any():
                    left_out += 1
                    continue
                index = np.arange(1, length + 1)
                axis.plot(
                    index, mean, color=f"C{layer_index % 10}", ls=("-", "--", ":", "-.")[head % 4], marker=".",
                    label=f"{layer.replace('_', ' ')}, head {head + 1}",
                )  # fmt: skip
                lines += 1
                finite = mean[np.isfinite(mean)]
                top, bottom = max(top, float(finite.max())), min(bottom, float(finite.min()))
        if left_out:
            note = f"{left_out} head{'' if left_out == 1 else 's'} without a finite value not drawn"
            axis.text(0.5, 0.5, note, transform=axis.transAxes, ha="center", va="center", fontsize=8, gid="note")
        axis.set_title(f"{panel_name(task, attention, tasks)} ({seeds_text(len(group))})", fontsize=10)
        axis.set_xlabel("index i")
        axis.set_ylabel(r"singular value $\lambda_i$")
        axis.grid(alpha=0.3, which="both")
        if lines > 1:
            axis.legend(fontsize=7, loc="lower left", framealpha=0.8)
    for axis in axes:  # one scale for every panel, from 0 (or below it: a negative value was cut off the figure)
        axis.set_ylim(1.05 * bottom, 1.05 * top if top > 0 else 1.0)
    start = "from 0" if bottom == 0 else f"below 0: a negative value, {bottom:g}"
    figure.suptitle(f"Learned KSVD singular values on {', '.join(tasks)} (mean over the seeds; one scale, {start})")
    return figure


# ----------------------------------------------------------------------------------------------------------- writing
def comparison_figure_names(tasks: Iterable[str]) -> list[str]:
    """Every file name :func:`write_comparison_figures` can write for records of ``tasks`` (each
    :data:`FIGURE_FILES` entry, ``{task}`` filled in per task), then :data:`FORMER_FIGURE_FILES`: what a run folder
    may hold from an earlier run, and ``gpattn compare --overwrite`` deletes.

    :raises InputTypeError: ``tasks`` a bare string (a sequence of its characters: pass ``[task]``), or not iterable.
    """
    if isinstance(tasks, (str, bytes)):  # as CompareConfig's tasks
        raise InputTypeError(
            f"comparison_figure_names: expected tasks to be a sequence of names, got the string {tasks!r}"
        )
    try:
        tasks = list(tasks)
    except TypeError:
        raise InputTypeError(
            f"comparison_figure_names: expected tasks to be a sequence of names, got {tasks!r}"
        ) from None
    names = [name.format(task=task) for name in FIGURE_FILES for task in (tasks if "{task}" in name else [None])]
    return unique([*names, *FORMER_FIGURE_FILES])


def write_comparison_figures(records: list[RunRecord], out_dir: str | Path) -> list[Path]:
    """Write every comparison figure for which the records have data, as PNG at 110 dpi, each through a temporary
    file and a rename.

    Files (:data:`FIGURE_FILES`), per task with the data: ``reliability_<task>.png`` (the rows as trained),
    ``shift_<task>.png`` (accuracy, NLL, Brier and ECE against severity, the ``+ts`` rows dashed),
    ``gap_vs_shift_ece_<task>.png`` (:func:`~gpattn.plotting.shift.plot_gap_vs_shift_ece`) and
    ``ood_histograms_<task>.png``; then ``spectra.png`` and ``fidelity.png``
    (:func:`~gpattn.plotting.fidelity.write_fidelity_figure`) for every task together. Figures are closed after
    writing.

    :param records: The comparison records.
    :param out_dir: Output directory (created if missing).
    :return: The paths written, in that order.
    :raises ValueError: A task name that cannot be part of a file name (a path separator, e.g. ``"a/b"`` from an
        edited ``results.json``), before anything is written.
    """
    records = validate(records)
    for task in unique(r.task for r in records):  # a task names files, which a separator would put in a folder
        if any(character in task for character in {"/", os.sep, "\0"}):
            raise ValueError(
                f"write_comparison_figures: the task name {task!r} of the records cannot be part of a file name "
                "(it holds a path separator)"
            )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for task in unique(r.task for r in records):
        if _reliability_records(records, task):
            jobs.append((RELIABILITY_FILE, task, lambda t: plot_reliability_diagrams(records, t)))
        if any(r.task == task for r in shift_records(records)):
            jobs.append((SHIFT_FILE, task, lambda t: plot_shift_curves(records, SHIFT_FIGURE_METRICS, t, scaled=True)))
            if any(r.task == task for r in gap_records(records)):
                jobs.append((GAP_FILE, task, lambda t: plot_gap_vs_shift_ece(records, t)))
        if any(r.task == task for r in _ood_records(records)):
            jobs.append((OOD_FILE, task, lambda t: plot_ood_histograms(records, t)))
    if _spectra_records(records):
        jobs.append((SPECTRA_FILE, None, lambda _: plot_spectra(records)))
    written = [save(make(task), out_dir / name.format(task=task)) for name, task, make in jobs]
    return written + write_fidelity_figure(records, out_dir)  # FIDELITY_FILE
