"""The tuned configurations of the comparison: one reviewed JSON file per task, ``gpattn/comparison/tuned/<task>.json``
(package data), written by ``gpattn tune --write-tuned`` and read by ``gpattn compare``
(:meth:`~gpattn.comparison.CompareConfig.hyperparameters`).

A file holds, per tuned row, the :class:`TunedRow`: the hyperparameters ``gpattn compare`` applies, the trial
parameters they come from, the best validation NLL, the number of trials, the search space, and the study's record
(tuning seed, wall time, load, date, gpattn version and commit, machine)::

    {"format": 1, "task": "mnist1d", "rows": {"softmax": {"hyperparameters": {...}, "parameters": {...},
     "best_val_nll": 0.31, "best_trial": 12, "trials": 20, "search_space": {...}, "study": {...}}, ...}}

A row without an entry of its own uses the entry of the row named after its attention (``deep_ensemble`` and the
last-layer Laplace row: softmax's), or the shared settings when there is none (:func:`tuned_source`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..methods import Hyperparameters, get_method, method_names
from .records import write_json_atomically
from .tuning_space import TUNED_ROWS

__all__ = [
    "TUNED_DIRECTORY",
    "TUNED_FORMAT",
    "TunedRow",
    "check_same_budget",
    "read_tuned",
    "tuned_path",
    "tuned_source",
    "tuning_budget",
    "write_tuned",
]

#: The package's folder of tuned configurations (``<task>.json``).
TUNED_DIRECTORY = Path(__file__).resolve().parent / "tuned"
#: The version of the file layout.
TUNED_FORMAT = 1
_HYPERPARAMETERS = tuple(entry.name for entry in dataclasses.fields(Hyperparameters))


@dataclass(frozen=True)
class TunedRow:
    """One row's tuned configuration on one task (an entry of ``tuned/<task>.json``).

    :ivar hyperparameters: :class:`~gpattn.methods.Hyperparameters` name -> value: what ``gpattn compare`` applies
        (:meth:`~gpattn.methods.Hyperparameters.updated`), the epochs and patience of the tuning included.
    :ivar parameters: The best trial's parameters as searched (:func:`~gpattn.comparison.tuning_space.search_space`).
    :ivar best_val_nll: That trial's best validation NLL (the objective).
    :ivar best_trial: Its Optuna trial number.
    :ivar trials: Finished trials of the study.
    :ivar search_space: Parameter name -> ``{kind: [low, high]}`` or ``{"choice": [...]}``.
    :ivar study: The study's record: ``tuning_seed``, ``eval_samples`` (of the validation predictions), ``sampler``,
        ``wall_seconds`` (first trial's start to last trial's end), ``trial_seconds`` and ``trial_cpu_seconds``
        (summed over the finished trials), ``failed_trials``, ``jobs`` and ``threads`` (of the process that wrote it),
        ``load_average`` (mean 1-minute load at the trials' ends), ``date``, ``gpattn``, ``commit`` (of the process
        that wrote it), ``trial_codes`` (the code that ran the finished trials -> their number; more than one when
        ``--resume`` continued trials of other code; absent from files written before trials recorded it),
        ``machine``, ``label``.
    """

    hyperparameters: dict[str, Any]
    parameters: dict[str, Any]
    best_val_nll: float
    best_trial: int
    trials: int
    search_space: dict[str, Any]
    study: dict[str, Any]

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TunedRow:
        """The entry ``data`` read from a file; ``where`` names it in errors.

        :raises ValueError: A missing or extra key, a value of the wrong type, or a hyperparameter name that
            :class:`~gpattn.methods.Hyperparameters` does not have.
        """
        names = [entry.name for entry in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: expected an entry with the keys {names}, got {got}")
        for name in ("hyperparameters", "parameters", "search_space", "study"):
            if not isinstance(data[name], dict):
                raise ValueError(f"{where}: expected {name} to be a mapping, got {data[name]!r}")
        unknown = sorted(set(data["hyperparameters"]) - set(_HYPERPARAMETERS))
        if unknown:
            raise ValueError(f"{where}: unknown hyperparameters {unknown}; expected some of {list(_HYPERPARAMETERS)}")
        value = data["best_val_nll"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: expected best_val_nll to be a finite number, got {value!r}")
        for name, least, wanted in (("best_trial", 0, "a non-negative"), ("trials", 1, "a positive")):
            if isinstance(data[name], bool) or not isinstance(data[name], int) or data[name] < least:
                raise ValueError(f"{where}: expected {name} to be {wanted} integer, got {data[name]!r}")
        return cls(**{name: data[name] for name in names})

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON data (what :meth:`from_dict` reads)."""
        return dataclasses.asdict(self)


def tuned_path(task: str, directory: str | os.PathLike | None = None) -> Path:
    """``<directory>/<task>.json``; ``directory=None``: the package's :data:`TUNED_DIRECTORY`."""
    return Path(TUNED_DIRECTORY if directory is None else directory) / f"{task}.json"


def read_tuned(task: str, directory: str | os.PathLike | None = None) -> dict[str, TunedRow]:
    """The tuned rows of ``task``: row -> :class:`TunedRow` from :func:`tuned_path`; ``{}`` when there is no file.

    :raises ValueError: A file that is not valid JSON, or not a tuned file of ``task`` (wrong format, task, or an
        unknown row, whose message lists the rows), a malformed entry (:meth:`TunedRow.from_dict`), or rows tuned
        with different budgets (:func:`check_same_budget`); the message names the file.
    """
    path = tuned_path(task, directory)
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read as a tuned configuration file ({error})") from None
    expected = {"format", "task", "rows"}
    if not isinstance(content, dict) or set(content) != expected:
        got = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise ValueError(f"{path}: expected a tuned configuration file with the keys {sorted(expected)}, got {got}")
    version = content["format"]
    if isinstance(version, bool) or not isinstance(version, int) or version != TUNED_FORMAT:  # true == 1.0 == 1
        raise ValueError(f"{path}: expected format {TUNED_FORMAT}, got {content['format']!r}")
    if content["task"] != task:
        raise ValueError(f"{path}: expected the tuned configurations of the task {task!r}, got {content['task']!r}")
    if not isinstance(content["rows"], dict):
        raise ValueError(f"{path}: expected rows to map row names to entries, got {content['rows']!r}")
    rows = {row: _checked_row(row, entry, path) for row, entry in content["rows"].items()}
    # a file edited by hand, or merged from several, could mix budgets: its rows would be compared unequally
    check_same_budget({row: tuning_budget(entry) for row, entry in rows.items()}, rows, str(path))
    return rows


def _checked_row(row: Any, entry: Any, path: Path) -> TunedRow:
    """The entry ``entry`` (JSON data) of the row ``row`` of the tuned file ``path``, checked as :func:`read_tuned`
    reads it and :func:`write_tuned` writes it.

    :raises ValueError: An unknown row (the message lists the rows) or a malformed entry (:meth:`TunedRow.from_dict`).
    """
    if row not in method_names():
        raise ValueError(f"{path}: unknown row {row!r}; expected rows of {method_names()}")
    return TunedRow.from_dict(entry, f"{path}, row {row!r}")


def tuning_budget(row: TunedRow) -> dict[str, Any]:
    """The budget ``row`` was tuned with: its ``trials``, ``tuning_seed``, the most ``epochs`` and the ``patience`` of
    a trial, and the validation's ``eval_samples`` (recorded since this check exists: absent from older entries)."""
    budget = {
        "trials": row.trials,
        "tuning_seed": row.study.get("tuning_seed"),
        "epochs": row.hyperparameters.get("epochs"),
        "patience": row.hyperparameters.get("patience"),
    }
    if "eval_samples" in row.study:
        budget["eval_samples"] = row.study["eval_samples"]
    return budget


def check_same_budget(budgets: Mapping[str, Mapping[str, Any]], kept: Mapping[str, TunedRow], where: str) -> None:
    """Refuse rows whose tuning budget differs from that of the rows ``kept`` beside them in one tuned file (the
    protocol gives every row the same budget; a file mixing budgets would compare them unequally without saying so).
    Keys absent from either side are not compared.

    :param budgets: Row -> the budget it was (or is to be) tuned with (:func:`tuning_budget`).
    :param kept: The rows beside them in the file (those already there that stay; a row of ``budgets`` may be among
        them too: it is not compared with itself).
    :param where: The file, named in the message.
    :raises ValueError: A budget that differs, naming both.
    """
    for row, budget in budgets.items():
        for other, entry in kept.items():
            theirs = tuning_budget(entry)
            differences = {key: (budget[key], theirs[key]) for key in budget.keys() & theirs.keys()}
            differences = {key: pair for key, pair in differences.items() if pair[0] != pair[1]}
            if differences:
                shown = ", ".join(f"{key} {new} (theirs {old})" for key, (new, old) in sorted(differences.items()))
                raise ValueError(
                    f"{where}: the row {row!r} is tuned with another budget than the row {other!r} beside it: "
                    f"{shown}; every row of a tuned file has the same budget (docs/guide/tuning.md): tune the rows "
                    "with the same options, or write them to another folder"
                )


def write_tuned(task: str, rows: Mapping[str, TunedRow], directory: str | os.PathLike | None = None) -> Path:
    """Write the tuned ``rows`` of ``task`` to :func:`tuned_path` (atomically), keeping the entries of the other rows
    already in the file; rows are stored in the order of :func:`~gpattn.methods.method_names`.

    :return: The file's path.
    :raises ValueError: A row that :func:`read_tuned` would refuse (an unknown row, a malformed entry: an unknown
        hyperparameter, ``trials < 1``, a non-finite ``best_val_nll``, a value that is not JSON data), or a row tuned
        with another budget than the other rows written or kept in the file (:func:`check_same_budget`); checked
        before anything is written: the file is then left as it was.
    """
    path = tuned_path(task, directory)
    for row, entry in rows.items():
        if not isinstance(entry, TunedRow):
            raise ValueError(f"{path}: expected the row {row!r} to be a TunedRow, got {type(entry).__name__}")
        data = entry.to_dict()
        _checked_row(row, data, path)  # the checks of read_tuned, on the entry as given ...
        try:  # ... and as the file will hold it
            data = json.loads(json.dumps(data, allow_nan=False))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}, row {row!r}: expected an entry of JSON data, finite numbers ({error})") from None
        _checked_row(row, data, path)
    existing = read_tuned(task, directory)
    kept = {row: entry for row, entry in existing.items() if row not in rows}
    # the written rows among themselves too, not only against the kept ones
    check_same_budget(
        {row: tuning_budget(entry) for row, entry in rows.items()}, {**kept, **rows}, str(tuned_path(task, directory))
    )
    merged = {**existing, **rows}
    order = {name: index for index, name in enumerate(method_names())}
    ordered = {row: merged[row].to_dict() for row in sorted(merged, key=lambda row: order.get(row, len(order)))}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomically(path, {"format": TUNED_FORMAT, "task": task, "rows": ordered})


def tuned_source(row: str, tuned: Mapping[str, TunedRow]) -> str | None:
    """The row whose entry of ``tuned`` (a task's :func:`read_tuned`) the row ``row`` uses: its own, else, for a row
    that is not searched itself (:data:`~gpattn.comparison.tuning_space.TUNED_ROWS`: the ensembles and post-hoc
    wrappers), the one of the row named after its attention (``deep_ensemble`` -> ``softmax``), else ``None`` (the
    shared settings).

    Example:
        >>> tuned_source("deep_ensemble", {"softmax": None}), tuned_source("sgpa", {"softmax": None})
        ('softmax', None)
        >>> tuned_source("softmax_mc_dropout", {"softmax": None})  # searched on its own: not softmax's
    """
    if row in tuned:
        return row
    if row in TUNED_ROWS:  # a row with a search of its own (softmax_mc_dropout) never borrows another's result
        return None
    attention = get_method(row).attention
    return attention if attention in tuned else None
