"""The typed result of one comparison run (:class:`RunRecord`), what ``results.json`` holds and the figures read.

A record is built by :func:`~gpattn.comparison.train_and_evaluate`, written with :meth:`RunRecord.to_dict` (plain
JSON: the layout below) and read back with :meth:`RunRecord.from_dict` or :func:`read_records`, which check it once
(types, required entries) so that no reader has to::

    {"task": "digits", "attention": "kep_svgp", "seed": 0,
     "metrics": {"test": {"accuracy": ..., "confidence": ..., "nll": ..., "ece": ..., ...},
                 "shift": {"gaussian_noise": {"1": {"accuracy": ..., "nll": ..., "ece": ..., "brier": ...}, ...}},
                 "ood": {"held_out": {"auroc_max_prob": ..., ...}, "noise": {...}}},
     "reliability": {"confidence": [...], "accuracy": [...], "count": [...]},  # per bin, test set
     "ood_scores": {"in": [...], "held_out": [...], "noise": [...]},          # max probabilities
     "spectra": {"layer_2": [[sigma_1, sigma_2, ...], ...]},                  # one list per head
     "train": {"seconds": ..., "epochs": ..., "best_epoch": ..., "num_parameters": ..., "ensemble": ...},
     "temperature_scaled": {"temperature": ..., "metrics": {...}, "reliability": {...}},  # the "+ts" row
     "fidelity": {"layer_2": {"relative_objective": [...], "left_cosine": [...], ...}}}  # one value per head

``task``, ``attention``, ``seed`` and ``metrics.test`` are required; ``shift``, ``ood``, ``ood_scores``,
``spectra`` and ``fidelity`` may be empty (a task without shifted or OOD sets, an attention without a learned spectrum
or KSVD layer) and ``reliability``, ``train`` and ``temperature_scaled`` may be ``null`` (or missing, as in records
written before they existed). Every number is a fraction, not a percent. The layout is strict
JSON: a metric that is undefined for a run (NaN, e.g. the misclassification AUROC when every test prediction is
correct) is written as ``null`` and its reason goes into an ``"undefined"`` entry, dotted path -> reason::

     "undefined": {"metrics.test.auroc": "NaN: needs both correct and wrong test predictions (all were correct or all
                   wrong)"}

``null`` is read back as NaN (and as ``None`` in the reliability bins that are empty).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ClassificationMetrics",
    "OODMetrics",
    "ReliabilityBins",
    "RunMetrics",
    "RunRecord",
    "ShiftMetrics",
    "TemperatureScaled",
    "TrainingSummary",
    "read_records",
    "write_json_atomically",
    "write_text_atomically",
]

Fields = TypeVar("Fields")


@dataclass(frozen=True)
class ClassificationMetrics:
    """Metrics of predictive probabilities on a labelled test set (:mod:`gpattn.metrics`).

    :ivar accuracy: Top-1 accuracy.
    :ivar confidence: Mean top-label probability (above ``accuracy``: over-confident).
    :ivar nll: Mean negative log-likelihood (nats; :func:`~gpattn.metrics.negative_log_likelihood`).
    :ivar ece: Expected calibration error (15 bins).
    :ivar mce: Maximum calibration error.
    :ivar brier: Brier score (sum over classes).
    :ivar aurc: Area under the risk-coverage curve.
    :ivar eaurc: Excess AURC.
    :ivar auroc: Misclassification AUROC of the top-label probability.
    :ivar fpr95: Misclassification FPR at 95% TPR.
    :ivar classwise_ece: Classwise ECE (Kull et al. 2019; the same bins; NaN in records written before it existed).
    """

    accuracy: float
    confidence: float
    nll: float
    ece: float
    mce: float
    brier: float
    aurc: float
    eaurc: float
    auroc: float
    fpr95: float
    classwise_ece: float = math.nan


@dataclass(frozen=True)
class ShiftMetrics:
    """Metrics on one shifted test set (one kind, one severity)."""

    accuracy: float
    nll: float
    ece: float
    brier: float


@dataclass(frozen=True)
class OODMetrics:
    """Separation of the in-distribution test set (positive) from one OOD set.

    :ivar auroc_max_prob: AUROC of the maximum probability.
    :ivar auroc_entropy: AUROC of the negative entropy.
    :ivar aupr_max_prob: AUPR-In of the maximum probability (in-distribution positive).
    :ivar fpr95_max_prob: FPR of the OOD set at 95 % TPR of the test set.
    :ivar aupr_out_max_prob: AUPR-Out (OOD positive, ranked by minus the maximum probability; NaN in records written
        before it existed).
    """

    auroc_max_prob: float
    auroc_entropy: float
    aupr_max_prob: float
    fpr95_max_prob: float
    aupr_out_max_prob: float = math.nan


@dataclass(frozen=True)
class RunMetrics:
    """Every metric of a run.

    :ivar test: On the clean test set.
    :ivar shift: Shift kind -> severity (``"1"`` to ``"5"``, a string as in JSON) -> metrics; ``{}`` without shifts.
    :ivar ood: OOD set name (``"held_out"``, ``"noise"``) -> metrics; ``{}`` without OOD sets.
    """

    test: ClassificationMetrics
    shift: dict[str, dict[str, ShiftMetrics]] = field(default_factory=dict)
    ood: dict[str, OODMetrics] = field(default_factory=dict)


@dataclass(frozen=True)
class ReliabilityBins:
    """The test set's reliability diagram (:func:`~gpattn.metrics.reliability_diagram_data`), one entry per bin.

    :ivar confidence: Mean confidence of each bin, ``None`` for an empty bin.
    :ivar accuracy: Accuracy of each bin, ``None`` for an empty bin.
    :ivar count: Number of test points in each bin.
    """

    confidence: list[float | None]
    accuracy: list[float | None]
    count: list[int]

    def __post_init__(self) -> None:
        lengths = {len(self.confidence), len(self.accuracy), len(self.count)}
        if len(lengths) != 1:
            raise ValueError(
                f"ReliabilityBins: confidence, accuracy and count differ in length (ragged bins): {lengths}"
            )


@dataclass(frozen=True)
class TrainingSummary:
    """How a run was trained.

    :ivar seconds: Wall time of the training (every member of an ensemble).
    :ivar epochs: Epochs per member.
    :ivar best_epoch: Epoch of the lowest validation NLL (of the first member).
    :ivar num_parameters: Parameters of the model (summed over the members).
    :ivar ensemble: Number of members (1: a single model).
    """

    seconds: float
    epochs: int
    best_epoch: int
    num_parameters: int
    ensemble: int


@dataclass(frozen=True)
class TemperatureScaled:
    """The ``+ts`` variant of a run: the same trained model with its logits divided by a temperature fitted by NLL on
    the validation split (:func:`~gpattn.comparison.evaluate_models`).

    :ivar temperature: The fitted :math:`\\hat\\tau`.
    :ivar metrics: Test, shift and OOD metrics of the scaled predictions.
    :ivar reliability: The test set's reliability bins of the scaled predictions.
    """

    temperature: float
    metrics: RunMetrics
    reliability: ReliabilityBins | None = None


@dataclass(frozen=True)
class RunRecord:
    """The result of one ``(task, attention, seed)`` run of the comparison (see the module docstring for its JSON).

    :ivar task: ``"pointer"`` or ``"digits"``.
    :ivar attention: Registry name, ``"<name>_ens<K>"`` for an ensemble of ``K`` members.
    :ivar seed: The run's seed.
    :ivar metrics: Test, shift and OOD metrics.
    :ivar reliability: The test set's reliability bins, or ``None``.
    :ivar ood_scores: Set name (``"in"`` for the test set) -> maximum probability of every input; ``{}`` without OOD.
    :ivar spectra: ``"layer_<l>"`` -> learned KSVD singular values, one descending list per head, for every layer
        with a learned spectrum (:meth:`~gpattn.attention.AttentionLayer.learned_spectrum`); ``{}`` for none.
    :ivar train: How the run was trained, or ``None``.
    :ivar temperature_scaled: The post-hoc temperature-scaled variant (table rows ``<attention>+ts``), or ``None``.
    :ivar fidelity: KSVD fidelity (:func:`~gpattn.features.ksvd_fidelity`) of every KSVD layer (KEP-SVGP,
        Primal-Attention) on test sequences: ``"layer_<l>"`` -> field of :class:`~gpattn.features.KSVDFidelity` ->
        one value per head (the mean over the sequences); ``{}`` for other attentions.

    A run folder's records are read back with :func:`read_records` (``read_records("runs/main/results.json")``).

    Example:
        >>> from gpattn.comparison import ClassificationMetrics, RunMetrics, RunRecord
        >>> test = ClassificationMetrics(**dict.fromkeys(ClassificationMetrics.__dataclass_fields__, 0.5))
        >>> record = RunRecord("digits", "softmax", 0, RunMetrics(test=test))
        >>> RunRecord.from_dict(record.to_dict()) == record  # strict JSON data and back
        True
    """

    task: str
    attention: str
    seed: int
    metrics: RunMetrics
    reliability: ReliabilityBins | None = None
    ood_scores: dict[str, list[float]] = field(default_factory=dict)
    spectra: dict[str, list[list[float]]] = field(default_factory=dict)
    train: TrainingSummary | None = None
    temperature_scaled: TemperatureScaled | None = None
    fidelity: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain, strict JSON data (nested dicts and lists), the layout of ``results.json``: every field
        of the dataclasses, a non-finite number as ``None`` with its reason under ``"undefined"``."""
        undefined: dict[str, str] = {}
        data = _strict(dataclasses.asdict(self), "", undefined)
        if undefined:
            data["undefined"] = undefined
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Read a record from :meth:`to_dict`'s layout (e.g. one entry of ``results.json``'s ``"records"``).

        :raises ValueError: Naming the entry that is missing, unexpected or of the wrong type.
        """
        where = "record"
        data = _mapping(data, where)
        missing = [key for key in ("task", "attention", "seed", "metrics") if key not in data]
        unknown = sorted(set(data) - {entry.name for entry in dataclasses.fields(cls)} - {"undefined"})
        if missing or unknown:
            raise ValueError(f"{where}: missing entries {missing}, unexpected entries {unknown}")
        for key in ("task", "attention"):
            if not isinstance(data[key], str):
                raise ValueError(f"{where}: expected {key!r} to be a string, got {data[key]!r}")
        reliability = data.get("reliability")
        train = data.get("train")
        scaled = data.get("temperature_scaled")
        if scaled is not None:
            scaled = _mapping(scaled, "record.temperature_scaled")
            scaled_bins = scaled.get("reliability")
            scaled = TemperatureScaled(
                temperature=_number(scaled.get("temperature"), "record.temperature_scaled.temperature"),
                metrics=_run_metrics(scaled.get("metrics"), "record.temperature_scaled.metrics"),
                reliability=None if scaled_bins is None else _reliability(scaled_bins),
            )
        return cls(
            task=data["task"],
            attention=data["attention"],
            seed=_integer(data["seed"], "record.seed"),
            metrics=_run_metrics(data["metrics"], "record.metrics"),
            reliability=None if reliability is None else _reliability(reliability),
            ood_scores={
                name: _numbers(scores, f"record.ood_scores.{name}")
                for name, scores in _mapping(data.get("ood_scores", {}), "record.ood_scores").items()
            },
            spectra={
                layer: [_numbers(head, f"record.spectra.{layer}") for head in _list(heads, f"record.spectra.{layer}")]
                for layer, heads in _mapping(data.get("spectra", {}), "record.spectra").items()
            },
            train=None if train is None else _fields(TrainingSummary, train, "record.train"),
            temperature_scaled=scaled,
            fidelity={
                layer: {
                    name: _numbers(values, f"record.fidelity.{layer}.{name}")
                    for name, values in _mapping(fields_, f"record.fidelity.{layer}").items()
                }
                for layer, fields_ in _mapping(data.get("fidelity", {}), "record.fidelity").items()
            },
        )


def read_records(path: str | os.PathLike) -> list[RunRecord]:
    """The records of a ``results.json`` written by :func:`~gpattn.comparison.write_outputs` (or ``gpattn
    compare``), e.g. to redraw its figures with :func:`~gpattn.plotting.write_comparison_figures`.

    :param path: The ``results.json`` file.
    :return: Its records, in file order.
    """
    content = json.loads(Path(path).read_text())
    if not isinstance(content, dict) or not isinstance(content.get("records"), list):
        raise ValueError(f"{path}: expected a results.json with a list of 'records'")
    return [RunRecord.from_dict(record) for record in content["records"]]


def _run_metrics(value: Any, where: str) -> RunMetrics:
    metrics = _mapping(value, where)
    if "test" not in metrics:
        raise ValueError(f"{where}: missing the entry 'test'")
    shift = _mapping(metrics.get("shift", {}), f"{where}.shift")
    ood = _mapping(metrics.get("ood", {}), f"{where}.ood")
    return RunMetrics(
        test=_fields(ClassificationMetrics, metrics["test"], f"{where}.test"),
        shift={
            kind: {
                str(severity): _fields(ShiftMetrics, values, f"{where}.shift.{kind}.{severity}")
                for severity, values in _mapping(levels, f"{where}.shift.{kind}").items()
            }
            for kind, levels in shift.items()
        },
        ood={name: _fields(OODMetrics, values, f"{where}.ood.{name}") for name, values in ood.items()},
    )


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
}


def _strict(value: Any, where: str, undefined: dict[str, str]) -> Any:
    """``value`` with every non-finite float replaced by ``None``, its dotted path and reason added to
    ``undefined``."""
    if isinstance(value, dict):
        return {key: _strict(item, f"{where}.{key}" if where else str(key), undefined) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item, f"{where}.{index}", undefined) for index, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        name = where.rsplit(".", 1)[-1]
        undefined[where] = f"{value}: {UNDEFINED_REASONS.get(name, 'not a finite number')}"
        return None
    return value


# -- reading JSON values ---------------------------------------------------------------------------------------------
def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a dict, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: expected a list, got {type(value).__name__}")
    return list(value)


def _number(value: Any, where: str) -> float:
    # JSON has no NaN of its own: None (null) stands for it
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _numbers(values: Any, where: str) -> list[float]:
    return [_number(value, where) for value in _list(values, where)]


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    return int(value)


def _fields(cls: type[Fields], values: Any, where: str) -> Fields:
    """A flat dataclass of numbers (int fields stay integers) from a dict with exactly its fields."""
    values = _mapping(values, where)
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
        convert = _integer if entry.type == "int" else _number
        converted[entry.name] = convert(value, f"{where}.{entry.name}")
    return cls(**converted)


def _reliability(values: Any) -> ReliabilityBins:
    where = "record.reliability"
    values = _mapping(values, where)
    bins = {name: _list(values.get(name), f"{where}.{name}") for name in ("confidence", "accuracy", "count")}
    optional = {
        name: [None if value is None else _number(value, f"{where}.{name}") for value in bins[name]]
        for name in ("confidence", "accuracy")
    }
    return ReliabilityBins(**optional, count=[_integer(value, f"{where}.count") for value in bins["count"]])


# -- atomic files ----------------------------------------------------------------------------------------------------
def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and :func:`os.replace`: the file is
    either the complete new text or untouched (an interruption leaves no half-written file). The file gets the mode
    of any newly created file (``0o666`` less the process's umask, e.g. ``0o644``), as the figures and tables do.

    :raises OSError: The folder cannot be written (a full disk, no permission, ...): the error names ``path`` and says
        that it is unchanged; the temporary file is removed.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # os.open with 0o666 applies the umask, as open() does (tempfile.mkstemp would make the file 0o600)
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # e.g. a read-only file system, where even unlink fails
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = error.strerror or str(error)
            raise OSError(error.errno, f"cannot write {path} ({reason}); it is unchanged") from error
        raise
    return path


def write_json_atomically(path: str | os.PathLike, content: Any) -> Path:
    """Write ``content`` as strict JSON (a ``NaN`` or an infinity is an error, never a bare token) to ``path``
    atomically (:func:`write_text_atomically`)."""
    return write_text_atomically(path, json.dumps(content, indent=1, allow_nan=False))
