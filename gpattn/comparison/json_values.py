"""JSON values of the comparison's records: strict JSON out (a non-finite number as ``null`` with its reason) and
checked values in (each error naming the entry), for :mod:`gpattn.comparison.records`."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "UNDEFINED_REASONS",
    "as_bool",
    "as_integer",
    "as_list",
    "as_mapping",
    "as_number",
    "as_numbers",
    "as_scalar",
    "read_fields",
    "restore_infinities",
    "strict_json",
]

Fields = TypeVar("Fields")


# -- writing strict JSON ---------------------------------------------------------------------------------------------
#: why a metric can be undefined (NaN), by field name; any other non-finite number is reported as such
UNDEFINED_REASONS = {
    "auroc": "needs both correct and wrong test predictions (all were correct or all wrong)",
    "fpr95": "needs both correct and wrong test predictions (all were correct or all wrong)",
    "eaurc": "needs both correct and wrong test predictions (all were correct or all wrong)",
    "auroc_max_prob": "needs both in-distribution and OOD inputs",
    "auroc_entropy": "needs both in-distribution and OOD inputs",
    "aupr_max_prob": "needs both in-distribution and OOD inputs",
    "aupr_out_max_prob": "needs both in-distribution and OOD inputs",
    "fpr95_max_prob": "needs both in-distribution and OOD inputs",
    "auroc_mutual_information": "deterministic: the row's predictions do not vary (one sample per input), so the "
    "mutual information is 0 for every input",
    "debiased_ce": "not in records written before it existed",
    "sweep_ece": "not in records written before it existed",
    "epochs_trained": "not in records written before it existed",
}


def strict_json(value: Any, where: str, undefined: dict[str, str]) -> Any:
    """``value`` with every non-finite float replaced by ``None``, its dotted path and reason added to
    ``undefined``, and every NumPy scalar (e.g. a ``numpy.float32`` metric, a ``numpy.int64`` count) as the Python
    number it holds (``json`` writes no NumPy scalar)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, dict):
        return {
            key: strict_json(item, f"{where}.{key}" if where else str(key), undefined) for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [strict_json(item, f"{where}.{index}", undefined) for index, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        name = where.rsplit(".", 1)[-1]
        undefined[where] = f"{value}: {UNDEFINED_REASONS.get(name, 'not a finite number')}"
        return None
    return value


def restore_infinities(value: Any, where: str, undefined: Mapping[str, Any]) -> Any:
    """The infinities of :func:`strict_json`'s output back: ``value`` with every ``None`` whose dotted path
    ``undefined`` (its reasons) gives as ``"inf: ..."`` or ``"-inf: ..."`` replaced by that infinity; any other
    ``None`` stays (read back as NaN)."""
    if isinstance(value, Mapping):
        return {
            key: restore_infinities(item, f"{where}.{key}" if where else str(key), undefined)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [restore_infinities(item, f"{where}.{index}", undefined) for index, item in enumerate(value)]
    reason = undefined.get(where) if value is None else None
    if isinstance(reason, str) and reason.split(":", 1)[0] in ("inf", "-inf"):
        return float(reason.split(":", 1)[0])
    return value


# -- reading JSON values ---------------------------------------------------------------------------------------------
def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a dict, got {type(value).__name__}")
    return value


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
    return list(value)


def as_number(value: Any, where: str) -> float:
    # JSON has no NaN of its own: None (null) stands for it
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return float(value)


def as_numbers(values: Any, where: str) -> list[float]:
    return [as_number(value, where) for value in as_list(values, where)]


def as_scalar(value: Any, where: str) -> Any:
    # a hyperparameter: a number, a string, a bool or null (None, e.g. num_inducing for the layers' own default)
    if value is None or isinstance(value, (bool, str, numbers.Real)):
        return value
    raise ValueError(f"{where}: expected a number, a string, true/false or null, got {value!r}")


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    return value


def as_integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    return int(value)


#: the reader of a dataclass field by its annotation: a string under ``from __future__ import annotations``, else the
#: type itself; any other annotation is read as a number
_FIELD_READERS = {"int": as_integer, int: as_integer, "bool": as_bool, bool: as_bool}


def read_fields(cls: type[Fields], values: Any, where: str) -> Fields:
    """A flat dataclass of numbers (int fields stay integers) and flags (bool fields) from a dict with exactly its
    fields."""
    values = as_mapping(values, where)
    names = [entry.name for entry in dataclasses.fields(cls)]
    # a field with a default (added after the first release) may be missing: records written before it read back
    optional = {entry.name for entry in dataclasses.fields(cls) if entry.default is not dataclasses.MISSING}
    missing = [name for name in names if name not in values and name not in optional]
    unknown = sorted(set(values) - set(names))
    if missing or unknown:
        raise ValueError(f"{where}: missing entries {missing}, unexpected entries {unknown}")
    converted = {}
    for entry in dataclasses.fields(cls):
        if entry.name not in values:
            continue
        value = values[entry.name]
        convert = _FIELD_READERS.get(entry.type, as_number)
        converted[entry.name] = convert(value, f"{where}.{entry.name}")
    return cls(**converted)
