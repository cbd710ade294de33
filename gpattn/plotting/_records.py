"""What the comparison figures share: the check of their records, the order and colour of the rows, seed statistics
and their text, and the atomic write of a figure."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..attention import attention_names
from ..comparison.records import RunRecord
from ..comparison.table_rows import TS_SUFFIX
from ..methods import method_names
from ..validation import InputTypeError

DPI = 110


def validate(records) -> list[RunRecord]:
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


def unique(values: Iterable) -> list:
    return list(dict.fromkeys(values))


def base_row(attention: str) -> str:
    """The row a ``+ts`` variant scales (``kep_svgp+ts`` -> ``kep_svgp``)."""
    return attention.removesuffix(TS_SUFFIX)


def attention_order(attentions: Iterable[str]) -> list[str]:
    """Registered attentions in registry order, then the others (e.g. ensembles ``<name>_ens<K>``) as they come; a
    ``+ts`` row right after its row."""
    present, registered = unique(attentions), attention_names()
    bases = [a for a in registered if a in map(base_row, present)]
    bases += [a for a in unique(map(base_row, present)) if a not in bases]
    return [name for base in bases for name in (base, base + TS_SUFFIX) if name in present]


#: The rows' colours: matplotlib's ten cycle colours, then ten more distinct from them (the row registry has more than
#: ten rows: with ten colours ``primal_paper`` and ``softmax_mc_dropout`` were drawn alike).
PALETTE = (
    *(f"C{index}" for index in range(10)),
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "black", "#e7ba52", "#ad494a", "#a55194", "#6b6ecf",
)  # fmt: skip


def row_colours(attentions: Iterable[str]) -> dict[str, str]:
    """The colour of every row of ``attentions`` (pass the rows of all the records, so that every figure of them gives
    a row the same colour), keyed by the row without its ``+ts`` suffix (which shares it): a row of the row registry
    (:func:`~gpattn.methods.method_names`) the :data:`PALETTE` entry of its registry position; any other row (an
    ensemble ``<row>_ens<K>``) the next entry that no registered row has, in the order the rows come, so that no two
    rows of a figure share a colour while the palette lasts."""
    registered = method_names()
    colours = {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(registered)}
    free = [entry for entry in PALETTE if entry not in colours.values()]
    chosen = {}
    for name in unique(map(base_row, attentions)):
        if name in colours:
            chosen[name] = colours[name]
        else:
            chosen[name] = free[len([n for n in chosen if n not in colours]) % len(free)] if free else PALETTE[0]
    return chosen


def colour(attention: str, colours: dict[str, str] | None = None) -> str:
    """The row's colour in every figure (its ``+ts`` row shares it): its entry of ``colours`` (:func:`row_colours`
    of the rows of all the records), by default :func:`row_colours` of the row alone."""
    attention = base_row(attention)
    if colours is None or attention not in colours:
        colours = row_colours([attention])
    return colours[attention]


def linestyle(attention: str) -> str:
    """Solid for a row as trained, dashed for its ``+ts`` row."""
    return "--" if attention.endswith(TS_SUFFIX) else "-"


def values_array(values: Iterable[float | None]) -> np.ndarray:
    """Floats with ``None`` (an empty reliability bin) as NaN."""
    return np.asarray([math.nan if value is None else value for value in values], dtype=np.float64)


def mean_std(values: Iterable[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and number of the finite values."""
    finite = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return math.nan, math.nan, 0
    std = float(finite.std(ddof=1)) if finite.size > 1 else 0.0
    return float(finite.mean()), std, int(finite.size)


def seeds_text(count: int) -> str:
    """``"1 seed"``, ``"5 seeds"``."""
    return f"{count} seed{'' if count == 1 else 's'}"


def spread_text(values: Iterable[float], scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """``"<mean> ± <std><unit> (<n> seeds)"``, or ``"<value><unit> (1 seed)"`` without a spread for one seed;
    ``"n/a"`` for none."""
    mean, std, count = mean_std(values)
    if count == 0:
        return "n/a"
    if count == 1:
        return f"{scale * mean:.{digits}f}{unit} (1 seed)"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f}{unit} ({seeds_text(count)})"


def grid(count: int, panel_width: float, panel_height: float, max_columns: int = 3):
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


def severity_key(severity: str):
    try:
        return (0, float(severity))
    except ValueError:
        return (1, severity)


def natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def panel_name(task: str, attention: str, tasks: Sequence[str]) -> str:
    return attention if len(tasks) == 1 else f"{task}: {attention}"


def task_records(records: list[RunRecord], task: str | None, select, what: str) -> tuple[str, list[RunRecord]]:
    """The records of ``task`` that ``select`` keeps; with ``task=None`` the only task that has such records.

    :raises ValueError: No record has the data, or several tasks do and ``task`` is ``None``.
    """
    selected = select(records)
    tasks = unique(r.task for r in selected)
    if task is None:
        if len(tasks) > 1:
            raise ValueError(f"records of several tasks have {what} ({', '.join(tasks)}): pass task=<one of them>")
        task = tasks[0] if tasks else None
    chosen = [r for r in selected if r.task == task]
    if not chosen:
        raise ValueError(f"no records with {what}" + (f" for task {task!r}" if task else ""))
    return task, chosen


def save(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as PNG (:data:`DPI`) through a temporary file and a rename (never half a figure), and close
    it."""
    temporary = path.parent / f".{path.name}.tmp"
    try:
        figure.savefig(temporary, dpi=DPI, format="png")
        os.replace(temporary, path)
    finally:
        plt.close(figure)
        temporary.unlink(missing_ok=True)
    return path
