"""The comparison's report: ``table.md`` (:func:`table_text`: the headline of the declared endpoints first,
:func:`~gpattn.comparison.headline.headline_text`, then the full tables of :func:`markdown_table`), ``results.csv``
(:func:`~gpattn.comparison.table_rows.flat_rows`) and ``results.json`` (the settings, the records and the
``environment``), written by :func:`write_outputs`; :data:`OUTPUT_FILES` names them.
"""

from __future__ import annotations

import csv
import inspect
import io
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ..models import fit_temperature
from .config import PRIMARY_ROWS, CompareConfig
from .endpoints import DECLARED_ECE_BINS
from .environment import run_environment, run_file_codes
from .headline import MIN_SEEDS_FOR_INTERVALS, headline_text
from .records import RunRecord, write_json_atomically, write_text_atomically
from .statistics import paired_difference, scaled_mean
from .table_rows import (
    POOLED,
    TS_SUFFIX,
    check_one_run_per_seed,
    ensemble_row,
    flat_rows,
    group_rows,
    markdown_cell,
    missing_reason,
    ood_sets,
    pooled_ood_set,
    seed_values,
    split_ensemble_row,
    with_temperature_scaled,
)
from .tasks import PUBLISHED_ACCURACIES

__all__ = [
    "FIDELITY_COLUMNS",
    "MAIN_COLUMNS",
    "MIN_SEEDS_FOR_INTERVALS",
    "OUTPUT_FILES",
    "PAIRED_COLUMNS",
    "REFERENCE_ROW",
    "TEMPERATURE_BOUNDS",
    "flat_rows",
    "format_difference",
    "markdown_table",
    "paired_table",
    "published_table",
    "table_text",
    "with_temperature_scaled",
    "write_outputs",
]

#: The files :func:`write_outputs` writes into a run folder (the figures are
#: :func:`gpattn.plotting.comparison_figure_names`).
OUTPUT_FILES = ("results.json", "results.csv", "table.md")
#: The columns of each task's main table: (flat-row column, header, percent). ``ood_auroc`` / ``ood_auroc_mi`` stand
#: for the task's pooled OOD set (:func:`~gpattn.comparison.table_rows.pooled_ood_set`).
MAIN_COLUMNS = (
    ("test_accuracy", "accuracy", True),
    ("test_nll", "NLL", False),
    ("test_ece", "ECE", True),
    ("test_debiased_ce", "debiased CE", True),
    ("test_gap", "conf − acc", True),
    ("test_brier", "Brier", True),
    ("shift_nll", "shift NLL", False),
    ("shift_brier", "shift Brier", True),
    ("shift_ece", "shift ECE", True),
    ("ood_auroc", "OOD AUROC", True),
    ("ood_auroc_mi", "OOD AUROC (MI)", True),
    ("temperature", "T", False),
)
#: The KSVD-fidelity summaries in the table (fields of :func:`~gpattn.comparison.model_fidelity`: the trained model,
#: ``initial_*`` the model at initialisation, ``random_*`` random subspaces; every field is in ``results.csv``).
FIDELITY_COLUMNS = (
    "relative_objective",
    "left_cosine",
    "initial_left_cosine",
    "random_left_cosine",
    "kernel_error",
    "initial_kernel_error",
    "optimal_error",
    "kernel_scale",
    "effective_rank",
)
#: The reference row of the paired tables (its ``+ts`` variant in the temperature-scaled one; in an ``--ensemble K``
#: grid its ensemble ``kep_svgp_ens<K>``: :func:`~gpattn.comparison.table_rows.ensemble_row`).
REFERENCE_ROW = "kep_svgp"
#: The columns of the paired differences: (flat-row column, header, percent).
PAIRED_COLUMNS = (
    ("test_accuracy", "accuracy", True),
    ("test_nll", "NLL", False),
    ("test_ece", "ECE", True),
    ("test_debiased_ce", "debiased CE", True),
    ("test_brier", "Brier", True),
    ("shift_nll", "shift NLL", False),
    ("shift_ece", "shift ECE", True),
    ("ood_auroc", "OOD AUROC", True),
)
#: The search interval of the ``+ts`` rows' temperature (:func:`~gpattn.models.fit_temperature`'s default).
TEMPERATURE_BOUNDS: tuple[float, float] = inspect.signature(fit_temperature).parameters["bounds"].default


def _digits(column: str) -> int:
    return 3 if column.endswith("nll") else 2


def _resolved(column: str, ood_set: str | None) -> str:
    # the main and paired tables' "ood_auroc" columns are the task's pooled OOD set
    if column.startswith("ood_auroc"):
        return f"ood_{ood_set or POOLED}_auroc{column[len('ood_auroc') :]}"  # no such set: n/a with the reason
    return column


def _mean_std(values: list[float], percent: bool, digits: int) -> str:
    scale = 100.0 if percent else 1.0
    mean = scaled_mean(values) * scale  # finite for finite values up to the largest double
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values) * scale:.{digits}f}"


def _at_bound(temperatures: list[float]) -> str:
    # the test of fit_temperature's warning: within a relative 1e-6 of a bound
    low, high = TEMPERATURE_BOUNDS
    lower = sum(value <= low * (1 + 1e-6) for value in temperatures)
    upper = sum(value >= high * (1 - 1e-6) for value in temperatures)
    notes = [f"{count} of {len(temperatures)} at the fit's {side} bound {bound:g}"
             for count, side, bound in ((lower, "lower", low), (upper, "upper", high)) if count]  # fmt: skip
    return f" ({'; '.join(notes)})" if notes else ""


def _cell(group: list[dict[str, Any]], column: str, percent: bool) -> str:
    if column == "temperature" and not group[0]["attention"].endswith(TS_SUFFIX):
        return "1 (as trained)"
    values = list(seed_values(group, column).values())
    if not values:
        return f"n/a: {missing_reason(group, column)}"
    text = _mean_std(values, percent, _digits(column))
    if len(values) < len(group):
        text += f" (n={len(values)})"
    return text + (_at_bound(values) if column == "temperature" else "")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(map(markdown_cell, cells)) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(header), "|" + "---|" * len(header), *(_row(cells) for cells in rows)]


def _task_groups(rows: list[dict[str, Any]], task: str) -> dict[str, list[dict[str, Any]]]:
    return {attention: group for (name, attention), group in group_rows(rows).items() if name == task}


def _main_table(rows: list[dict[str, Any]], task: str) -> list[str]:
    groups = _task_groups(rows, task)
    ood_set = pooled_ood_set([row for group in groups.values() for row in group])
    header = ["row", "n"] + [name for _, name, _ in MAIN_COLUMNS]
    body = [
        [attention, str(len(group))]
        + [_cell(group, _resolved(column, ood_set), percent) for column, _, percent in MAIN_COLUMNS]
        for attention, group in groups.items()
    ]
    return _table(header, body)


def _ood_tables(rows: list[dict[str, Any]], task: str) -> list[str]:
    groups = _task_groups(rows, task)
    names = ood_sets([row for group in groups.values() for row in group])
    if len(names) < 2:
        return []  # the main table's OOD column is the only set
    lines = []
    for suffix, score in (("", "maximum probability"), ("_mi", "mutual information")):
        lines += ["", f"OOD AUROC per set, {score} (percent):", ""]
        body = [
            [attention, str(len(group))] + [_cell(group, f"ood_{name}_auroc{suffix}", True) for name in names]
            for attention, group in groups.items()
        ]
        lines += _table(["row", "n", *names], body)
    return lines


def format_difference(reference: dict[int, float], other: dict[int, float], percent: bool, digits: int = 2) -> str:
    """``"+d [low, high]"``: the paired difference ``reference - other`` over the seeds both have, with its 95 %
    paired-t interval (:func:`~gpattn.comparison.paired_difference`), in percentage points when ``percent``; not a
    test (no multiplicity correction: the declared tests are the headline's). Fewer than
    :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds: the mean difference and ``(n = k < 5, no interval)``; none: ``"-"``.
    """
    scale = 100.0 if percent else 1.0
    paired = [seed for seed in reference if seed in other]
    if not paired:
        return "-"
    if len(paired) < MIN_SEEDS_FOR_INTERVALS:
        mean = scaled_mean([reference[seed] - other[seed] for seed in paired]) * scale
        return f"{mean:+.{digits}f} (n = {len(paired)} < {MIN_SEEDS_FOR_INTERVALS}, no interval)"
    difference = paired_difference(reference, other, min_pairs=MIN_SEEDS_FOR_INTERVALS)
    low, high = difference.low * scale, difference.high * scale
    return f"{difference.mean * scale:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def paired_table(records: list[RunRecord], task: str, scaled: bool, reference: str = REFERENCE_ROW) -> list[str]:
    """The paired differences ``reference - row`` over seeds on ``task``, like for like: the untempered rows against
    ``reference`` (``scaled=False``), or the ``+ts`` rows against ``reference+ts`` (``scaled=True``); one column per
    :data:`PAIRED_COLUMNS` entry (:func:`format_difference`). ``n`` is the seeds both rows ran (as the main table's
    ``n`` counts a row's runs); a cell paired on fewer seeds (a value undefined on some) says on how many: ``(n = k <
    5, no interval)`` below :data:`MIN_SEEDS_FOR_INTERVALS`, else ``(n=k)`` as the main table's cells. Only the rows of
    the reference's ensemble size are paired with it (``reference="kep_svgp_ens2"``: the ``<row>_ens2`` rows). ``[]``
    without the reference row. O(records x columns).

    :raises ValueError: More than one run of a ``(task, row, seed)``
        (:func:`~gpattn.comparison.table_rows.check_one_run_per_seed`).
    """
    rows = flat_rows(records)
    check_one_run_per_seed(rows, "paired_table")
    groups = _task_groups(rows, task)
    name = reference + (TS_SUFFIX if scaled else "")
    if name not in groups:
        return []
    size = split_ensemble_row(name)[1]
    ood_set = pooled_ood_set([row for group in groups.values() for row in group])
    columns = [(_resolved(c, ood_set), header, percent) for c, header, percent in PAIRED_COLUMNS]
    columns = [entry for entry in columns if seed_values(groups[name], entry[0])]
    body = []
    for attention, group in groups.items():
        if attention == name or attention.endswith(TS_SUFFIX) != scaled or split_ensemble_row(attention)[1] != size:
            continue
        seeds = {row["seed"] for row in group}
        paired = [row["seed"] for row in groups[name] if row["seed"] in seeds]  # the runs both rows have
        cells = [attention, str(len(paired))]
        for column, _, percent in columns:
            left, right = seed_values(groups[name], column), seed_values(group, column)
            cell = format_difference(left, right, percent, _digits(column)) if right else "n/a"
            count = sum(seed in right for seed in left)
            if MIN_SEEDS_FOR_INTERVALS <= count < len(paired):  # below it, format_difference gives the count
                cell += f" (n={count})"
            cells.append(cell)
        body.append(cells)
    return _table([f"{name} − row", "n", *(header for _, header, _ in columns)], body) if body else []


def _fidelity_table(rows: list[dict[str, Any]], task: str) -> list[str]:
    groups = {a: g for a, g in _task_groups(rows, task).items() if seed_values(g, f"fidelity_{FIDELITY_COLUMNS[0]}")}
    body = [
        [attention, str(len(group))] + [_cell(group, f"fidelity_{name}", False) for name in FIDELITY_COLUMNS]
        for attention, group in groups.items()
    ]
    return _table(["row", "n", *FIDELITY_COLUMNS], body) if body else []


def _training_table(records: list[RunRecord], task: str) -> list[str]:
    body = []
    for attention in dict.fromkeys(r.attention for r in records if r.task == task):
        group = [r for r in records if r.task == task and r.attention == attention]
        trained = [r.train for r in group if r.train is not None]
        if not trained:
            body.append([attention, str(len(group))] + ["n/a: not recorded"] * 5 + [_tuned(group)])
            continue
        # the means are over the runs that recorded their training, as many as n or said: (n=k)
        fewer = f" (n={len(trained)})" if len(trained) < len(group) else ""
        seconds = statistics.fmean(t.seconds for t in trained)
        best = statistics.fmean(t.best_epoch for t in trained)
        epochs = sorted({t.epochs for t in trained})
        parameters = sorted({t.num_parameters for t in trained})  # several: a mixed configuration
        counts = [epochs_trained(r) for r in group if r.train is not None]
        counted = (
            "n/a: not recorded" if any(math.isnan(c) for c in counts) else f"{statistics.fmean(counts):.1f}{fewer}"
        )
        body.append(
            [attention, str(len(group)), "/".join(map(str, epochs)), counted, f"{best:.1f}{fewer}",
             "/".join(map(str, parameters)), f"{seconds:.1f}{fewer}", _tuned(group)]
        )  # fmt: skip
    header = ["row", "n", "max epochs", "epochs trained (mean)", "best epoch (mean)", "parameters",
              "train seconds (mean)", "configuration"]  # fmt: skip
    return _table(header, body) if body else []


def epochs_trained(record: RunRecord) -> float:
    r"""The epochs ``record``'s run trained (the mean over its members): as recorded, or, for a single model recorded
    before :attr:`~gpattn.comparison.TrainingSummary.epochs_trained` existed, where the training loop stops it,
    :math:`\min(E, e^\star + P)` (maximum :math:`E`, best epoch :math:`e^\star`, patience :math:`P`; :math:`E`
    without early stopping); NaN when neither is known (an older ensemble)."""
    train = record.train
    if train is None:
        return math.nan
    if not math.isnan(train.epochs_trained):
        return train.epochs_trained
    if train.ensemble != 1 or "patience" not in (record.hyperparameters or {}):
        return math.nan
    patience = record.hyperparameters["patience"]
    return float(train.epochs if patience is None else min(train.epochs, train.best_epoch + patience))


def _tuned(group: list[RunRecord]) -> str:
    tuned = {record.tuned for record in group}
    return "tuned" if tuned == {True} else ("default" if tuned == {False} else "mixed")


def published_table(tasks: list[str]) -> str:
    """The published reference accuracies (:data:`~gpattn.comparison.tasks.PUBLISHED_ACCURACIES`) of the tasks that
    have them, as a markdown table; ``""`` for none."""
    lines = []
    for task in tasks:
        if task in PUBLISHED_ACCURACIES:
            if not lines:
                lines = ["| task | model (published, not run here) | test accuracy |", "|---|---|---|"]
            published = PUBLISHED_ACCURACIES[task].items()
            lines += [f"| {task} | {model} | {100 * value:.0f} |" for model, value in published]
    return "\n".join(lines)


def _legend(tasks: list[str], ece_bins: int) -> str:
    low, high = TEMPERATURE_BOUNDS
    return " ".join(
        [
            "Legend. Rates (accuracy, ECE, debiased CE, conf − acc, Brier, AUROC) in percent (Brier: the sum over",
            "classes x 100), NLL in nats; mean ± standard deviation over the n seeds of the row, with (n=k) where a",
            f"value is defined on fewer seeds; one seed: the value alone. ECE: {ece_bins} equal-width bins, top label;",
            f"debiased CE: Kumar et al. 2019's debiased estimate on {ece_bins} equal-mass bins (top label);",
            "conf − acc: mean confidence minus accuracy on the clean test set (positive: over-confident). shift_*:",
            "mean over the shift kinds at severities 1-5 (MNIST-1D's shuffled split apart). OOD AUROC:",
            "in-distribution test set against",
            "the pooled OOD set (every family; older records of a task with one OOD set: that set), by the maximum",
            "probability; (MI): by the mutual information of the Monte Carlo samples, defined for stochastic rows.",
            "`+ts` rows: the same trained models, temperature-scaled (T fitted by NLL on the validation split, in",
            f"[{low:g}, {high:g}]; a T at a bound means the validation NLL was still falling there, so the fit is not",
            "an optimum: say so before reading the row). n/a: the value does not exist, with the reason. Paired",
            "tables: mean difference [95 % paired-t interval] over the paired seeds, like for like (untempered against",
            "untempered, +ts against +ts), n the seeds both rows ran, with (n=k) where a difference is defined on",
            "fewer; descriptive, not corrected for multiplicity: the declared tests are the",
            "headline's. deep_ensemble has no +ts row. Training: max epochs is the budget; epochs trained the mean",
            "over seeds (and ensemble members) of the epochs before early stopping (records written before it was",
            "recorded: min(max, best epoch + patience), where the loop stops a single model).",
        ]
    )


def markdown_table(records: list[RunRecord], ece_bins: int = DECLARED_ECE_BINS) -> str:
    """The full tables, per task: the main table (n once per row, then the metrics of :data:`MAIN_COLUMNS`, n/a
    with its reason where a value does not exist), the OOD AUROC per set (tasks with several OOD sets), the paired
    differences of :data:`REFERENCE_ROW` (untempered) and of its ``+ts`` row against the others like for like
    (:func:`paired_table`; in an ``--ensemble K`` grid, of ``kep_svgp_ens<K>`` against the other ensembles of
    ``K``), the KSVD fidelity, the training; then the published reference accuracies and a legend, which states
    ``ece_bins``, the run's ECE bins (``--ece-bins``). O(records x columns).

    :raises ValueError: More than one run of a ``(task, row, seed)``
        (:func:`~gpattn.comparison.table_rows.check_one_run_per_seed`).
    """
    rows = flat_rows(records)
    check_one_run_per_seed(rows, "markdown_table")
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    lines: list[str] = []
    for task in tasks:
        lines += [f"### {task}", "", *_main_table(rows, task), *_ood_tables(rows, task)]
        sizes = dict.fromkeys(split_ensemble_row(r.attention)[1] for r in records if r.task == task)
        for reference in (ensemble_row(REFERENCE_ROW, size) for size in sizes):
            for scaled in (False, True):
                paired = paired_table(records, task, scaled, reference)
                if paired:
                    suffix = TS_SUFFIX if scaled else ""
                    title = f"{reference}{suffix} − every other {'+ts ' if scaled else ''}row"
                    lines += ["", f"Paired differences, {title} (same units):", "", *paired]
        fidelity = _fidelity_table(rows, task)
        if fidelity:
            lines += ["", "KSVD fidelity on test sequences (mean over layers and heads):", "", *fidelity]
        training = _training_table(records, task)
        if training:
            lines += ["", "Training:", "", *training]
        lines.append("")
    text = "\n".join(lines) + "\n" + _legend(tasks, ece_bins) + "\n"
    published = published_table(tasks)
    if published:
        text += (
            "\nPublished reference numbers (MNIST-1D README, github.com/greydanus/mnist1d; other models, the same"
            " standard split of all ten classes; not measured here):\n\n" + published + "\n"
        )
    return text


def _smoke_test_banner(config: CompareConfig) -> str:
    # what the --quick run trained: its seed count and epochs as set (options override the preset's)
    seeds = len(config.seeds)
    epochs = ", ".join(
        f"{getattr(config, f'{task}_epochs')} epoch{'' if getattr(config, f'{task}_epochs') == 1 else 's'} on {task}"
        for task in config.tasks
    )
    pointer = "The pointer task is not learned in this budget; these" if "pointer" in config.tasks else "These"
    return (
        f"**Smoke test (`--quick`)**: {seeds} seed{'' if seeds == 1 else 's'} and {epochs}, to check that everything "
        f"runs. {pointer} numbers compare nothing."
    )


def table_text(records: list[RunRecord], config: CompareConfig) -> str:
    """``table.md``: a title that says what was run (a smoke test for ``--quick``, with its seed count and epochs), the
    settings, the headline of the declared endpoints (:func:`~gpattn.comparison.headline.headline_text`), then
    :func:`markdown_table`, both with the run's ECE bins. Cost: :func:`~gpattn.comparison.headline.headline_text`'s.

    :raises ValueError: More than one run of a ``(task, row, seed)``
        (:func:`~gpattn.comparison.table_rows.check_one_run_per_seed`).
    """
    check_one_run_per_seed(flat_rows(records), "table_text")
    seeds = len(config.seeds)
    runs = len(records)
    title = f"# gpattn compare: {runs} run{'' if runs == 1 else 's'}, {seeds} seed{'' if seeds == 1 else 's'}"
    if config.primary_seeds:
        title += f" ({seeds + len(config.primary_seeds)} for {' and '.join(PRIMARY_ROWS)})"
    if config.smoke_test:
        title += "\n\n" + _smoke_test_banner(config)
    settings = f"threads {config.threads} per run, jobs {config.jobs}, device {config.device}"
    headline = headline_text(records, ece_bins=config.ece_bins)
    return f"{title}\n\n{settings}\n\n{headline}\n## Full tables\n\n{markdown_table(records, config.ece_bins)}"


def _csv_value(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_outputs(records: list[RunRecord], config: CompareConfig, out: str | Path) -> list[Path]:
    """Write :data:`OUTPUT_FILES` into ``out`` (created if missing), each through a temporary file and an atomic
    rename: ``results.json`` (``config``, ``environment``: :func:`~gpattn.comparison.environment.run_environment`,
    the records, :meth:`~gpattn.comparison.RunRecord.to_dict`, strict JSON: an undefined metric is ``null`` with
    its reason, and, when ``out/runs`` holds run files, ``codes``: the code that made each run,
    :func:`~gpattn.comparison.environment.run_file_codes`, more than one group when ``--resume`` kept runs of
    other code than the report's), ``results.csv`` (:func:`flat_rows`) and ``table.md`` (:func:`table_text`). The
    figures are :func:`gpattn.plotting.write_comparison_figures`'s (``gpattn compare`` writes both).

    :return: The three paths.
    :raises ValueError: More than one run of a ``(task, row, seed)``
        (:func:`~gpattn.comparison.table_rows.check_one_run_per_seed`), before any file is written.
    """
    rows = flat_rows(records)
    check_one_run_per_seed(rows, "write_outputs")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / name for name in OUTPUT_FILES]
    content = {
        "config": asdict(config),
        "environment": run_environment(),
        "records": [record.to_dict() for record in records],
    }
    codes = run_file_codes(out / "runs", [(record.task, record.attention, record.seed) for record in records])
    if codes:
        content["codes"] = codes
    write_json_atomically(written[0], content)
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))
    handle = io.StringIO()
    writer = csv.DictWriter(handle, fieldnames=fieldnames)
    writer.writeheader()
    # an undefined value is an empty cell, as a missing one; a NumPy scalar is written as the Python value it holds
    writer.writerows({key: _csv_value(value) for key, value in row.items()} for row in rows)
    write_text_atomically(written[1], handle.getvalue())
    write_text_atomically(written[2], table_text(records, config))
    return written
