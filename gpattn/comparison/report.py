"""The comparison's report: one flat row per run (:func:`flat_rows`, ``results.csv``), the markdown table of means
± std with n, the published reference accuracies and the paired differences of KEP-SVGP against every other row with
95 % paired-t intervals (:func:`markdown_table`, ``table.md``), and the run folder's files (:func:`write_outputs`)."""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import CompareConfig
from .evaluation import DEFAULT_ECE_BINS
from .records import RunRecord, write_json_atomically, write_text_atomically
from .statistics import paired_difference
from .tasks import PUBLISHED_ACCURACIES

__all__ = [
    "FIDELITY_COLUMNS",
    "MIN_SEEDS_FOR_INTERVALS",
    "PAIRED_COLUMNS",
    "REFERENCE_ROW",
    "TABLE_METRICS",
    "flat_rows",
    "format_difference",
    "markdown_table",
    "paired_table",
    "published_table",
    "table_text",
    "with_temperature_scaled",
    "write_outputs",
]

#: the in-distribution columns of the table; "confidence" (mean top-label probability) next to the accuracy shows the
#: sign of the miscalibration: over-confident when above it, under-confident when below
TABLE_METRICS = ("accuracy", "confidence", "nll", "ece", "classwise_ece", "brier", "aurc", "auroc", "fpr95")
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
#: The reference row of the paired differences in the table.
REFERENCE_ROW = "kep_svgp"
#: The columns of the paired differences: (flat_rows column, header, percent).
PAIRED_COLUMNS = (
    ("test_accuracy", "accuracy", True),
    ("test_nll", "nll", False),
    ("test_ece", "ece", True),
    ("test_brier", "brier", True),
    ("shift_accuracy", "shift_accuracy", True),
    ("shift_ece", "shift_ece", True),
    ("ood_held_out_auroc", "ood_held_out_auroc", True),
    ("ood_noise_auroc", "ood_noise_auroc", True),
)
#: Fewest seeds from which the table forms a paired interval.
MIN_SEEDS_FOR_INTERVALS = 5


def with_temperature_scaled(records: list[RunRecord]) -> list[RunRecord]:
    """The records with, after each one that has a temperature-scaled variant, that variant as a record of its own
    (attention ``"<attention>+ts"``, the same seed and training; no spectra or fidelity): the rows of the table, and
    what the figures take to draw the ``+ts`` rows."""
    expanded = []
    for record in records:
        expanded.append(record)
        scaled = record.temperature_scaled
        if scaled is not None:
            expanded.append(
                RunRecord(
                    task=record.task,
                    attention=f"{record.attention}+ts",
                    seed=record.seed,
                    metrics=scaled.metrics,
                    reliability=scaled.reliability,
                    train=record.train,
                )
            )
    return expanded


def _mean_shift(record: RunRecord, key: str, shuffled: bool = False) -> float | None:
    values = [
        getattr(entry, key)
        for kind, levels in record.metrics.shift.items()
        if (kind == "shuffled") == shuffled
        for entry in levels.values()
    ]
    return statistics.fmean(values) if values else None


def _fidelity_means(record: RunRecord) -> dict[str, float]:
    # mean over layers and heads of every fidelity field
    values: dict[str, list[float]] = {}
    for fields_ in record.fidelity.values():
        for name, heads in fields_.items():
            values.setdefault(name, []).extend(heads)
    return {name: statistics.fmean(entries) for name, entries in values.items() if entries}


def flat_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One flat row per run and per temperature-scaled variant (:func:`with_temperature_scaled`): test metrics, shift
    means over kinds and severities (the shuffled MNIST-1D apart), OOD AUROC/AUPR-In/AUPR-Out/FPR95, the fitted
    temperature, the KSVD fidelity means over layers and heads (for CSV)."""
    rows = []
    for record in records:
        variants = [(record, None)]
        if record.temperature_scaled is not None:
            variants.append((with_temperature_scaled([record])[1], record.temperature_scaled.temperature))
        for variant, temperature in variants:
            row = {"task": variant.task, "attention": variant.attention, "seed": variant.seed}
            row.update({f"test_{key}": value for key, value in asdict(variant.metrics.test).items()})
            for key in ("accuracy", "nll", "ece", "brier"):
                row[f"shift_{key}"] = _mean_shift(variant, key)
            if "shuffled" in variant.metrics.shift:
                row["shuffled_accuracy"] = _mean_shift(variant, "accuracy", shuffled=True)
                row["shuffled_ece"] = _mean_shift(variant, "ece", shuffled=True)
            for name, values in variant.metrics.ood.items():
                row[f"ood_{name}_auroc"] = values.auroc_max_prob
                row[f"ood_{name}_aupr_in"] = values.aupr_max_prob
                row[f"ood_{name}_aupr_out"] = values.aupr_out_max_prob
                row[f"ood_{name}_fpr95"] = values.fpr95_max_prob
            row["temperature"] = temperature
            row.update({f"fidelity_{name}": value for name, value in _fidelity_means(variant).items()})
            row["train_seconds"] = None if variant.train is None else variant.train.seconds
            rows.append(row)
    return rows


def _finite(values: list[Any]) -> list[float]:
    return [float(value) for value in values if value is not None and value == value]


def _mean_std(values: list[float], percent: bool) -> str:
    # n with every cell: a metric may be defined on fewer seeds than the group has; one value has no spread
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    if len(values) == 1:
        return f"{mean:.2f} (n=1)"
    return f"{mean:.2f} ± {statistics.stdev(values) * scale:.2f} (n={len(values)})"


def format_difference(reference: dict[int, float], other: dict[int, float], percent: bool) -> str:
    """``"+d [low, high] *"``: the paired difference ``reference - other`` over the seeds both have, with its 95 %
    paired-t interval (:func:`~gpattn.comparison.paired_difference`); ``*`` when the interval excludes 0.
    Fewer than :data:`MIN_SEEDS_FOR_INTERVALS` paired seeds: the mean difference and ``(n = k < 5, no interval)``."""
    scale = 100.0 if percent else 1.0
    paired = [seed for seed in reference if seed in other]
    if not paired:
        return "-"
    if len(paired) < MIN_SEEDS_FOR_INTERVALS:
        mean = statistics.fmean(reference[seed] - other[seed] for seed in paired) * scale
        return f"{mean:+.2f} (n = {len(paired)} < {MIN_SEEDS_FOR_INTERVALS}, no interval)"
    difference = paired_difference(reference, other, min_pairs=MIN_SEEDS_FOR_INTERVALS)
    mark = " *" if difference.significant else ""
    return f"{difference.mean * scale:+.2f} [{difference.low * scale:+.2f}, {difference.high * scale:+.2f}]{mark}"


def _is_percent(column: str) -> bool:
    return not (column.endswith("nll") or column in ("train_seconds", "temperature") or column.startswith("fidelity"))


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["attention"]), []).append(row)
    return groups


def paired_table(records: list[RunRecord], reference: str = REFERENCE_ROW) -> str:
    """The paired differences ``reference - row`` over seeds of every other row of each task (``+ts`` rows
    included), one column per :data:`PAIRED_COLUMNS` entry (:func:`format_difference`); ``""`` when no task has the
    reference row."""
    groups = _groups(flat_rows(records))
    lines = []
    for task in dict.fromkeys(task for task, _ in groups):
        if (task, reference) not in groups:
            continue
        columns = [c for c in PAIRED_COLUMNS if any(row.get(c[0]) is not None for row in groups[(task, reference)])]
        base = {row["seed"]: row for row in groups[(task, reference)]}
        header = ["task", f"{reference} − row", "n"] + [name for _, name, _ in columns]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for (row_task, attention), group in groups.items():
            if row_task != task or attention == reference:
                continue
            other = {row["seed"]: row for row in group}
            cells = [task, attention, str(len([seed for seed in base if seed in other]))]
            for column, _, percent in columns:
                left = {seed: row[column] for seed, row in base.items() if _finite([row.get(column)])}
                right = {seed: row[column] for seed, row in other.items() if _finite([row.get(column)])}
                cells.append(format_difference(left, right, percent))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


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


def markdown_table(records: list[RunRecord]) -> str:
    """The comparison's report: mean ± std over seeds (n shown) per task and row (the ``+ts`` rows after their
    model), percent for the rates, plain numbers for NLL, temperature and fidelity; then the published reference
    accuracies, the paired differences of KEP-SVGP against every other row with 95 % paired-t intervals
    (:func:`paired_table`) and a legend."""
    rows = flat_rows(records)
    present = {key for row in rows for key in row if row[key] is not None}
    columns = [f"test_{key}" for key in TABLE_METRICS] + ["shift_accuracy", "shift_ece", "shift_nll"]
    columns += [c for c in ("shuffled_accuracy", "shuffled_ece") if c in present]
    columns += sorted(
        key for key in present if key.startswith("ood_") and key.endswith(("_auroc", "_aupr_in", "_aupr_out"))
    )
    columns += [c for c in ("temperature",) if c in present]
    columns += [f"fidelity_{name}" for name in FIDELITY_COLUMNS if f"fidelity_{name}" in present]
    columns += ["train_seconds"]
    header = ["task", "attention", "n"] + [column.replace("test_", "") for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (task, attention), group in _groups(rows).items():
        cells = [task, attention, str(len(group))]
        for column in columns:
            values = _finite([row.get(column) for row in group])
            cells.append(_mean_std(values, _is_percent(column)) if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    tasks = list(dict.fromkeys(row["task"] for row in rows))
    legend = " ".join(
        [
            "\nRates (accuracy, confidence, ECE, classwise ECE, Brier, AURC, AUROC, AUPR, FPR95) in percent",
            "(Brier: sum over classes x 100), NLL in nats, train_seconds in seconds; mean ± std over the n seeds where",
            "the metric is defined (n=1: the value alone).",
            f"ECE: {_bins(records)} equal-width bins, top-label; classwise_ece: Kull et al. 2019.",
            "shift_*: mean over the shift kinds at severities 1-5 (digits: noise, rotation, blur; mnist1d: i.i.d.",
            "noise, correlated noise, shear, translation, scale); shuffled_*: the spatially shuffled MNIST-1D test",
            "split. ood_*: maximum-probability AUROC, AUPR-In (in-distribution positive) and AUPR-Out against",
            "held-out classes / noise. `+ts` rows: the same trained models, temperature-scaled (temperature fitted",
            "by NLL on the validation split; column temperature). softmax_mc_dropout: softmax trained with dropout,",
            "dropout on at test time. fidelity_*: KSVD fidelity of the KEP/Primal layers on test sequences (mean",
            "over sequences, layers and heads): relative_objective |J| over its terms (0 at a stationary point),",
            "left/right_cosine of the principal angles to the exact top-s singular subspaces (1: the same),",
            "energy the share of ||K||_F^2 in the top s exact singular values.",
        ]
    )
    text = "\n".join(lines) + "\n" + legend + "\n"
    published = published_table(tasks)
    if published:
        text += (
            "\nPublished reference numbers (MNIST-1D README, github.com/greydanus/mnist1d; other models, the same"
            " standard split of all ten classes; not measured here):\n\n" + published + "\n"
        )
    paired = paired_table(records)
    if paired:
        text += (
            f"\nPaired differences {REFERENCE_ROW} − row over seeds (same units as above; for accuracy and AUROC a"
            " positive difference favours kep_svgp, for NLL, ECE and Brier a negative one), mean [95 % paired-t"
            " interval]; * = the interval excludes 0. Intervals only from n >= "
            f"{MIN_SEEDS_FOR_INTERVALS} paired seeds.\n\n" + paired
        )
    return text


def _bins(records: list[RunRecord]) -> int:
    counts = {len(record.reliability.count) for record in records if record.reliability is not None}
    return counts.pop() if len(counts) == 1 else DEFAULT_ECE_BINS


def table_text(records: list[RunRecord], config: CompareConfig) -> str:
    """``table.md``: a title that says what was run (a smoke test for ``--quick``), then :func:`markdown_table`."""
    seeds = len(config.seeds)
    title = f"# gpattn compare: {len(records)} runs, {seeds} seed{'s' if seeds > 1 else ''}"
    if config.smoke_test:
        title += (
            "\n\n**Smoke test (`--quick`)**: one seed and a few epochs, to check that everything runs. The pointer task"
            " is not learned in this budget; these numbers compare nothing."
        )
    settings = f"threads {config.threads} per run, jobs {config.jobs}, device {config.device}"
    return f"{title}\n\n{settings}\n\n{markdown_table(records)}"


def write_outputs(records: list[RunRecord], config: CompareConfig, out: str | Path) -> list[Path]:
    """Write ``results.json`` (config + records, :meth:`~gpattn.comparison.RunRecord.to_dict`; strict JSON: an
    undefined metric is ``null`` with its reason), ``results.csv`` (:func:`flat_rows`) and ``table.md``
    (:func:`table_text`) into ``out`` (created if missing), each through a temporary file and an atomic rename. The
    figures are :func:`gpattn.plotting.write_comparison_figures`'s (``gpattn compare`` writes both).

    :return: The three paths.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv", out / "table.md"]
    content = {"config": asdict(config), "records": [record.to_dict() for record in records]}
    write_json_atomically(written[0], content)
    rows = flat_rows(records)
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))
    handle = io.StringIO()
    writer = csv.DictWriter(handle, fieldnames=fieldnames)
    writer.writeheader()
    # an undefined value is an empty cell, as a missing one
    writer.writerows(
        {key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in row.items()}
        for row in rows
    )
    write_text_atomically(written[1], handle.getvalue())
    write_text_atomically(written[2], table_text(records, config))
    return written
