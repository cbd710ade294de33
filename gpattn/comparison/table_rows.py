"""The comparison's records as flat rows: one per run and per temperature-scaled variant (:func:`flat_rows`, the
rows of ``results.csv`` and of every table), grouped by task and row, with the reason a value is missing.

Every table, endpoint and statistic of the report reads its numbers from these rows, so that one column means one
thing everywhere (e.g. ``shift_nll``: the mean over the shift kinds and severities, the shuffled MNIST-1D split
apart).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import asdict
from typing import Any

import numpy as np

from .records import RunRecord
from .statistics import scaled_mean

__all__ = [
    "ENSEMBLE_SUFFIX",
    "NOT_RECORDED",
    "POOLED",
    "TS_SUFFIX",
    "check_one_run_per_seed",
    "ensemble_row",
    "flat_rows",
    "group_rows",
    "markdown_cell",
    "missing_reason",
    "ood_sets",
    "pooled_ood_set",
    "seed_values",
    "split_ensemble_row",
    "with_temperature_scaled",
]

#: The suffix of the temperature-scaled variant of a row (``kep_svgp+ts``).
TS_SUFFIX = "+ts"
#: The reason of a value a record does not hold because it was written before the field existed.
NOT_RECORDED = "not recorded (an older record)"
#: The name of the OOD set that pools every OOD family of a task (issue 23's protocol).
POOLED = "pooled"
#: The suffix of the records of an ensemble of ``K`` members of a single-model row (``gpattn compare --ensemble K``):
#: ``"<row>_ens<K>"``.
ENSEMBLE_SUFFIX = "_ens"
_ENSEMBLE_NAME = re.compile(rf"^(?P<row>.+){ENSEMBLE_SUFFIX}(?P<size>[1-9][0-9]*)$")
# what markdown renders as HTML in a table cell: an entity or character reference (Python-Markdown takes
# &[#]<letters or digits>;, a superset of CommonMark's), and the < of a tag, a comment, a declaration, a processing
# instruction or an autolink
_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
_HTML_TAG = re.compile(r"<(?=[A-Za-z/!?])")


def markdown_cell(text: str) -> str:
    r"""``text`` as the content of a markdown table cell that renders as ``text`` itself, in Python-Markdown (the
    documentation site) and in CommonMark with GFM tables (GitHub); a registered attention may be named with any
    character but whitespace. O(len(text)).

    * an ``&`` that starts an entity (``&name;``, ``&#38;``) becomes ``&amp;`` (first, so that the ``&lt;`` below
      stays), so that ``"a&amp;b"`` is no entity;
    * a ``<`` that starts an HTML tag, comment or autolink (a letter, ``/``, ``!`` or ``?`` after it) becomes
      ``&lt;``, so that ``"sgpa<v2>"`` is no tag;
    * every ``\`` is escaped (``\\``), then every ``|`` (``\|``), so that a name holding a bar (``"a|b"``,
      ``"a\|b"``) stays one cell instead of splitting the row.

    Every other character is kept (``"< 0.0001"``, ``"a & b"``), so that the printed table stays readable.

    Example:
        >>> markdown_cell("a|b"), markdown_cell("a\\|b"), markdown_cell("sgpa<v2>&x;"), markdown_cell("< 0.0001")
        ('a\\|b', 'a\\\\\\|b', 'sgpa&lt;v2>&amp;x;', '< 0.0001')
    """
    text = _HTML_TAG.sub("&lt;", _ENTITY.sub("&amp;", text))
    return text.replace("\\", "\\\\").replace("|", "\\|")


def ensemble_row(row: str, size: int) -> str:
    """The row name of the records of an ensemble of ``size`` members of the single-model row ``row`` (``gpattn compare
    --ensemble K``), ``row`` itself for one member; a ``+ts`` suffix stays last. O(len(row)).

    Example:
        >>> ensemble_row("kep_svgp", 2), ensemble_row("kep_svgp+ts", 2), ensemble_row("softmax", 1)
        ('kep_svgp_ens2', 'kep_svgp_ens2+ts', 'softmax')
    """
    if size == 1:
        return row
    scaled = row.endswith(TS_SUFFIX)
    return f"{row.removesuffix(TS_SUFFIX)}{ENSEMBLE_SUFFIX}{size}{TS_SUFFIX if scaled else ''}"


def split_ensemble_row(name: str) -> tuple[str, int]:
    """``(row, K)`` of a record's row name, the inverse of :func:`ensemble_row`: the single-model row and the ensemble
    size of ``"<row>_ens<K>"`` (a ``+ts`` suffix kept on the row), ``(name, 1)`` for any other name (a single model,
    or a row that is an ensemble by itself, ``deep_ensemble``). O(len(name)).

    Example:
        >>> split_ensemble_row("kep_svgp_ens2+ts"), split_ensemble_row("deep_ensemble")
        (('kep_svgp+ts', 2), ('deep_ensemble', 1))
    """
    scaled = name.endswith(TS_SUFFIX)
    match = _ENSEMBLE_NAME.match(name.removesuffix(TS_SUFFIX))
    if match is None:
        return name, 1
    return match["row"] + (TS_SUFFIX if scaled else ""), int(match["size"])


def with_temperature_scaled(records: list[RunRecord]) -> list[RunRecord]:
    """The records with, after each one that has a temperature-scaled variant, that variant as a record of its own
    (attention ``"<attention>+ts"``, the same seed, training, hyperparameters and per-example data of the scaled
    predictions; no spectra, fidelity or OOD scores): the rows of the tables, and what the figures take to draw the
    ``+ts`` rows."""
    expanded = []
    for record in records:
        expanded.append(record)
        scaled = record.temperature_scaled
        if scaled is not None:
            expanded.append(
                RunRecord(
                    task=record.task,
                    attention=f"{record.attention}{TS_SUFFIX}",
                    seed=record.seed,
                    metrics=scaled.metrics,
                    reliability=scaled.reliability,
                    train=record.train,
                    per_example=scaled.per_example,
                    hyperparameters=record.hyperparameters,
                    tuned=record.tuned,
                )
            )
    return expanded


def _mean_shift(record: RunRecord, key: str, shuffled: bool = False) -> float | None:
    # NaN when a kind lacks the field (older records): the mean propagates it
    values = [
        getattr(entry, key)
        for kind, levels in record.metrics.shift.items()
        if (kind == "shuffled") == shuffled
        for entry in levels.values()
    ]
    return scaled_mean(values) if values else None


def _fidelity_means(record: RunRecord) -> dict[str, float]:
    # mean over layers and heads of every fidelity field
    values: dict[str, list[float]] = {}
    for fields_ in record.fidelity.values():
        for name, heads in fields_.items():
            values.setdefault(name, []).extend(heads)
    return {name: scaled_mean(entries) for name, entries in values.items() if entries}


def flat_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One flat row per run and per temperature-scaled variant (:func:`with_temperature_scaled`), the columns of
    ``results.csv``:

    * ``task``, ``attention`` (the row), ``seed``, ``tuned``, ``test_examples`` (the number of per-example values;
      ``None`` in records without them);
    * ``test_<metric>`` for every field of :class:`~gpattn.comparison.ClassificationMetrics`, and ``test_gap`` =
      confidence - accuracy (positive: over-confident);
    * ``shift_<metric>`` (accuracy, NLL, ECE, Brier, debiased CE): the mean over the shift kinds and severities, the
      spatially shuffled MNIST-1D split apart (``shuffled_accuracy``, ``shuffled_ece``); ``None`` without shifts;
    * ``ood_<set>_auroc`` (maximum probability), ``ood_<set>_auroc_mi`` (mutual information), ``_aupr_in``,
      ``_aupr_out``, ``_fpr95`` per OOD set;
    * ``temperature`` (the ``+ts`` rows' fitted temperature, ``None`` for the others), ``fidelity_<field>`` (KSVD
      fidelity, mean over layers and heads), ``train_seconds``.
    """
    rows = []
    for record in records:
        variants = [(record, None)]
        if record.temperature_scaled is not None:
            variants.append((with_temperature_scaled([record])[1], record.temperature_scaled.temperature))
        for variant, temperature in variants:
            examples = variant.per_example.get("test_nll")
            row = {
                "task": variant.task,
                "attention": variant.attention,
                "seed": variant.seed,
                "tuned": variant.tuned,
                "test_examples": None if examples is None else len(examples),
            }
            row.update({f"test_{key}": value for key, value in asdict(variant.metrics.test).items()})
            row["test_gap"] = variant.metrics.test.confidence - variant.metrics.test.accuracy
            for key in ("accuracy", "nll", "ece", "brier", "debiased_ce"):
                row[f"shift_{key}"] = _mean_shift(variant, key)
            if "shuffled" in variant.metrics.shift:
                row["shuffled_accuracy"] = _mean_shift(variant, "accuracy", shuffled=True)
                row["shuffled_ece"] = _mean_shift(variant, "ece", shuffled=True)
            for name, values in variant.metrics.ood.items():
                row[f"ood_{name}_auroc"] = values.auroc_max_prob
                row[f"ood_{name}_auroc_mi"] = values.auroc_mutual_information
                row[f"ood_{name}_aupr_in"] = values.aupr_max_prob
                row[f"ood_{name}_aupr_out"] = values.aupr_out_max_prob
                row[f"ood_{name}_fpr95"] = values.fpr95_max_prob
            row["temperature"] = temperature
            row.update({f"fidelity_{name}": value for name, value in _fidelity_means(variant).items()})
            row["train_seconds"] = None if variant.train is None else variant.train.seconds
            rows.append(row)
    return rows


def group_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``(task, row) -> its flat rows`` (one per seed), in the order the rows come."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["attention"]), []).append(row)
    return groups


def check_one_run_per_seed(rows: list[dict[str, Any]], where: str) -> None:
    """Refuse flat rows (:func:`flat_rows`) that hold more than one run of a ``(task, row, seed)``: every table keys a
    row's values by seed (:func:`seed_values`), so a repeated run would be counted in ``n`` and silently replaced by
    the last one in the means. A repeated run's ``+ts`` variant is not named again. O(rows).

    :param where: The caller, first in the message.
    :raises ValueError: Naming each row, task and seed that is repeated.
    """
    runs: dict[tuple[str, str], dict[int, int]] = {}
    for row in rows:
        seeds = runs.setdefault((row["task"], row["attention"]), {})
        seeds[row["seed"]] = seeds.get(row["seed"], 0) + 1
    repeated = {key: sorted(seed for seed, count in seeds.items() if count > 1) for key, seeds in runs.items()}
    named = [
        f"row {name} on {task}, seed(s) {seeds}"
        for (task, name), seeds in repeated.items()
        if seeds and not (name.endswith(TS_SUFFIX) and repeated.get((task, name.removesuffix(TS_SUFFIX))) == seeds)
    ]
    if named:
        raise ValueError(
            f"{where}: more than one run of {'; '.join(named)}; expected one run per task, row and seed (merge run "
            "folders with read_run_folders, which checks that repeated runs agree)"
        )


def _finite(value: Any) -> bool:
    # a NumPy scalar (a numpy.float32 metric of a record built in memory) is a number too, a bool is not
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def seed_values(group: list[dict[str, Any]], column: str) -> dict[int, float]:
    """``{seed: value}`` of ``column`` over a group's rows, the seeds where it is a finite number (a NumPy scalar
    included), as a Python float."""
    return {row["seed"]: float(row[column]) for row in group if _finite(row.get(column))}


def ood_sets(rows: list[dict[str, Any]]) -> list[str]:
    """The OOD set names of the rows, ``pooled`` last (from their ``ood_<set>_auroc`` columns)."""
    names = list(
        dict.fromkeys(key[4:-6] for row in rows for key in row if key.startswith("ood_") and key.endswith("_auroc"))
    )
    return [name for name in names if name != POOLED] + [name for name in names if name == POOLED]


def pooled_ood_set(rows: list[dict[str, Any]]) -> str | None:
    """The OOD set of a task's headline column: ``pooled`` (every OOD family together), else the task's only OOD
    set (older MNIST-1D records: ``noise``), else ``None``."""
    names = ood_sets(rows)
    if POOLED in names:
        return POOLED
    return names[0] if len(names) == 1 else None


def missing_reason(group: list[dict[str, Any]], column: str) -> str:
    """Why ``column`` holds no finite value in any row of ``group`` (one task and row): the task has no such sets,
    the records are older than the field, the row is deterministic (mutual information), or the metric is undefined
    on every seed."""
    present = [row.get(column) for row in group if column in row and row.get(column) is not None]
    older = all(row.get("test_examples") is None for row in group)
    if column.startswith("shift_") and all(row.get("shift_accuracy") is None for row in group):
        return "no shift sets"
    if column.startswith("ood_") and not any(key.startswith("ood_") for row in group for key in row):
        return "no OOD sets"
    if column.startswith("ood_") and not present:
        return (
            "no pooled OOD set (the sets are in the per-set tables)"
            if column.startswith(f"ood_{POOLED}_")
            else "no such OOD set"
        )
    if column.endswith("_auroc_mi"):
        return NOT_RECORDED if older else "deterministic"
    if column in ("test_debiased_ce", "test_sweep_ece", "shift_debiased_ce") and older:
        return NOT_RECORDED
    if column == "temperature":
        return "no +ts fit"
    if column.startswith("fidelity_"):
        return "no KSVD layer"
    return "undefined on every seed"
