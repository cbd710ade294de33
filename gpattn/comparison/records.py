"""The typed result of one comparison run (:class:`RunRecord`), what ``results.json`` holds and the figures read.

A record is built by :func:`~gpattn.comparison.train_and_evaluate`, written with :meth:`RunRecord.to_dict` (plain
JSON: the layout below) and read back with :meth:`RunRecord.from_dict` or :func:`read_records`, which check it once
(types, required entries) so that no reader has to::

    {"task": "digits", "attention": "kep_svgp", "seed": 0,
     "metrics": {"test": {"accuracy": ..., "confidence": ..., "nll": ..., "ece": ..., "debiased_ce": ...,
                          "sweep_ece": ..., ...},
                 "shift": {"gaussian_noise": {"1": {"accuracy": ..., "nll": ..., "ece": ..., "brier": ...,
                                                    "debiased_ce": ...}, ...}},
                 "ood": {"held_out": {"auroc_max_prob": ..., "auroc_mutual_information": ..., ...},
                         "noise": {...}, "pooled": {...}}},
     "reliability": {"confidence": [...], "accuracy": [...], "count": [...]},  # per bin, test set
     "ood_scores": {"in": [...], "held_out": [...], "noise": [...]},          # max probabilities
     "per_example": {"test_nll": [...], "test_correct": [...], "test_confidence": [...]},  # test order
     "spectra": {"layer_2": [[sigma_1, sigma_2, ...], ...]},                  # one list per head
     "train": {"seconds": ..., "epochs": ..., "best_epoch": ..., "num_parameters": ..., "ensemble": ...,
               "epochs_trained": ..., "cuda_graphs": false},  # replayed from CUDA graphs (--cuda-graphs)
     "temperature_scaled": {"temperature": ..., "metrics": {...}, "reliability": {...},  # the "+ts" row
                            "per_example": {...}},
     "fidelity": {"layer_2": {"relative_objective": [...], "left_cosine": [...], ...}},  # one value per head
     "hyperparameters": {"epochs": ..., "lr": ..., ...},  # Hyperparameters.to_dict() of the run
     "tuned": false}

``task``, ``attention``, ``seed`` and ``metrics.test`` are required; ``shift``, ``ood``, ``ood_scores``,
``per_example``, ``spectra``, ``fidelity`` and ``hyperparameters`` may be empty (a task without shifted or OOD sets,
an attention without a learned spectrum or KSVD layer, a record written before they existed) and ``reliability``,
``train`` and ``temperature_scaled`` may be ``null`` (or missing, as in records written before they existed);
``tuned`` is ``false`` where missing, and a metric added after a record was written reads back as NaN. Every number
is a fraction, not a percent. The layout is strict JSON: a metric that is undefined for a run (NaN, e.g. the
misclassification AUROC when every test prediction is correct, or the mutual-information AUROC of a deterministic
row) is written as ``null`` and its reason goes into an ``"undefined"`` entry, dotted path -> reason::

     "undefined": {"metrics.test.auroc": "NaN: needs both correct and wrong test predictions (all were correct or all
                   wrong)"}

``null`` is read back as NaN (and as ``None`` in the reliability bins that are empty), or as the infinity its
``"undefined"`` reason names (``"inf: ..."``, ``"-inf: ..."``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .json_values import (
    as_integer,
    as_list,
    as_mapping,
    as_number,
    as_numbers,
    as_scalar,
    read_fields,
    restore_infinities,
    strict_json,
)

__all__ = [
    "PER_EXAMPLE_FIELDS",
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

#: The entries of :attr:`RunRecord.per_example` (and :attr:`TemperatureScaled.per_example`): one float per clean test
#: example each.
PER_EXAMPLE_FIELDS = ("test_nll", "test_correct", "test_confidence")


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
    :ivar debiased_ce: Debiased top-label :math:`\\ell_2` calibration error (Kumar et al. 2019;
        :func:`~gpattn.metrics.debiased_calibration_error` on as many equal-mass bins as the ECE has bins; NaN in
        records written before it existed).
    :ivar sweep_ece: Equal-mass sweep ECE, top label (Roelofs et al. 2022;
        :func:`~gpattn.metrics.sweep_calibration_error`; NaN in records written before it existed).
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
    debiased_ce: float = math.nan
    sweep_ece: float = math.nan


@dataclass(frozen=True)
class ShiftMetrics:
    """Metrics on one shifted test set (one kind, one severity): those of :class:`ClassificationMetrics` of the same
    names (``debiased_ce``: NaN in records written before it existed)."""

    accuracy: float
    nll: float
    ece: float
    brier: float
    debiased_ce: float = math.nan


@dataclass(frozen=True)
class OODMetrics:
    """Separation of the in-distribution test set (positive) from one OOD set.

    :ivar auroc_max_prob: AUROC of the maximum probability.
    :ivar auroc_entropy: AUROC of the negative entropy.
    :ivar aupr_max_prob: AUPR-In of the maximum probability (in-distribution positive).
    :ivar fpr95_max_prob: FPR of the OOD set at 95 % TPR of the test set.
    :ivar aupr_out_max_prob: AUPR-Out (OOD positive, ranked by minus the maximum probability; NaN in records written
        before it existed).
    :ivar auroc_mutual_information: AUROC of minus the mutual information between the prediction and the model
        sample (:func:`~gpattn.metrics.ood_auroc_mutual_information` on the run's Monte Carlo samples: members times
        samples); NaN for a row whose predictions do not vary (one deterministic sample), and in records written
        before it existed.
    """

    auroc_max_prob: float
    auroc_entropy: float
    aupr_max_prob: float
    fpr95_max_prob: float
    aupr_out_max_prob: float = math.nan
    auroc_mutual_information: float = math.nan


@dataclass(frozen=True)
class RunMetrics:
    """Every metric of a run.

    :ivar test: On the clean test set.
    :ivar shift: Shift kind -> severity (``"1"`` to ``"5"``, a string as in JSON) -> metrics; ``{}`` without shifts.
    :ivar ood: OOD set name (the task's families, e.g. ``"held_out"`` and ``"noise"``, then ``"pooled"``, all of them
        together) -> metrics; ``{}`` without OOD sets.
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

    :ivar seconds: Wall time of the training (every member of an ensemble) in the process that finished it: a run
        resumed from its checkpoints (``gpattn train --resume``) counts the part after the resume only (the epochs'
        own wall times are in the checkpoints' history).
    :ivar epochs: Epochs per member at most (the configured maximum; early stopping may end a member sooner).
    :ivar best_epoch: Epoch of the lowest validation NLL (of the first member).
    :ivar num_parameters: Parameters of the model (summed over the members).
    :ivar ensemble: Number of members (1: a single model).
    :ivar epochs_trained: Epochs trained, the mean over the members; NaN in records written before it existed.
    :ivar cuda_graphs: The training steps, the validation and the final evaluation were replayed from CUDA graphs
        (``gpattn compare --cuda-graphs`` on a row whose layers support capture; a row whose layers read values on
        the host, SGPA's, runs eagerly under that option); ``False`` in records written before it existed, whatever
        their settings.
    """

    seconds: float
    epochs: int
    best_epoch: int
    num_parameters: int
    ensemble: int
    epochs_trained: float = math.nan
    cuda_graphs: bool = False


@dataclass(frozen=True)
class TemperatureScaled:
    """The ``+ts`` variant of a run: the same trained model with its logits divided by a temperature fitted by NLL on
    the validation split (:func:`~gpattn.comparison.evaluate_models`).

    :ivar temperature: The fitted :math:`\\hat\\tau`.
    :ivar metrics: Test, shift and OOD metrics of the scaled predictions.
    :ivar reliability: The test set's reliability bins of the scaled predictions.
    :ivar per_example: The scaled predictions on every test example (:attr:`RunRecord.per_example`); ``{}`` in
        records written before it existed.
    """

    temperature: float
    metrics: RunMetrics
    reliability: ReliabilityBins | None = None
    per_example: dict[str, list[float]] = field(default_factory=dict)


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
    :ivar per_example: The prediction on every clean test example, in test order (:data:`PER_EXAMPLE_FIELDS`):
        ``"test_nll"`` (its negative log-likelihood, floored as :func:`~gpattn.metrics.negative_log_likelihood`,
        whose mean is ``metrics.test.nll``), ``"test_correct"`` (1.0 where the top class is the label, else 0.0) and
        ``"test_confidence"`` (the top-class probability); ``{}`` in records written before it existed.
    :ivar hyperparameters: The :meth:`~gpattn.methods.Hyperparameters.to_dict` of the run (tuned or default);
        ``{}`` in records written before it existed.
    :ivar tuned: Whether ``hyperparameters`` come from a tuned configuration (``False`` in records written before it
        existed).

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
    per_example: dict[str, list[float]] = field(default_factory=dict)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    tuned: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The record as plain, strict JSON data (nested dicts and lists), the layout of ``results.json``: every field
        of the dataclasses, a non-finite number as ``None`` with its reason under ``"undefined"``."""
        undefined: dict[str, str] = {}
        data = strict_json(dataclasses.asdict(self), "", undefined)
        if undefined:
            data["undefined"] = undefined
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        """Read a record from :meth:`to_dict`'s layout (e.g. one entry of ``results.json``'s ``"records"``).

        :raises ValueError: Naming the entry that is missing, unexpected or of the wrong type.
        """
        where = "record"
        data = as_mapping(data, where)
        missing = [key for key in ("task", "attention", "seed", "metrics") if key not in data]
        unknown = sorted(set(data) - {entry.name for entry in dataclasses.fields(cls)} - {"undefined"})
        if missing or unknown:
            raise ValueError(f"{where}: missing entries {missing}, unexpected entries {unknown}")
        undefined = as_mapping(data.get("undefined", {}), "record.undefined")
        if any(isinstance(reason, str) and reason.startswith(("inf:", "-inf:")) for reason in undefined.values()):
            data = restore_infinities({key: value for key, value in data.items() if key != "undefined"}, "", undefined)
        for key in ("task", "attention"):
            if not isinstance(data[key], str):
                raise ValueError(f"{where}: expected {key!r} to be a string, got {data[key]!r}")
        reliability = data.get("reliability")
        train = data.get("train")
        scaled = data.get("temperature_scaled")
        if scaled is not None:
            scaled = as_mapping(scaled, "record.temperature_scaled")
            scaled_bins = scaled.get("reliability")
            scaled = TemperatureScaled(
                temperature=as_number(scaled.get("temperature"), "record.temperature_scaled.temperature"),
                metrics=_run_metrics(scaled.get("metrics"), "record.temperature_scaled.metrics"),
                reliability=None if scaled_bins is None else _reliability(scaled_bins),
                per_example=_per_example(scaled.get("per_example", {}), "record.temperature_scaled.per_example"),
            )
        tuned = data.get("tuned", False)
        if not isinstance(tuned, bool):
            raise ValueError(f"{where}: expected 'tuned' to be true or false, got {tuned!r}")
        return cls(
            task=data["task"],
            attention=data["attention"],
            seed=as_integer(data["seed"], "record.seed"),
            metrics=_run_metrics(data["metrics"], "record.metrics"),
            reliability=None if reliability is None else _reliability(reliability),
            ood_scores={
                name: as_numbers(scores, f"record.ood_scores.{name}")
                for name, scores in as_mapping(data.get("ood_scores", {}), "record.ood_scores").items()
            },
            spectra={
                layer: [
                    as_numbers(head, f"record.spectra.{layer}") for head in as_list(heads, f"record.spectra.{layer}")
                ]
                for layer, heads in as_mapping(data.get("spectra", {}), "record.spectra").items()
            },
            train=None if train is None else read_fields(TrainingSummary, train, "record.train"),
            temperature_scaled=scaled,
            fidelity={
                layer: {
                    name: as_numbers(values, f"record.fidelity.{layer}.{name}")
                    for name, values in as_mapping(fields_, f"record.fidelity.{layer}").items()
                }
                for layer, fields_ in as_mapping(data.get("fidelity", {}), "record.fidelity").items()
            },
            per_example=_per_example(data.get("per_example", {}), "record.per_example"),
            hyperparameters={
                name: as_scalar(value, f"record.hyperparameters.{name}")
                for name, value in as_mapping(data.get("hyperparameters", {}), "record.hyperparameters").items()
            },
            tuned=tuned,
        )


def read_records(path: str | os.PathLike) -> list[RunRecord]:
    """The records of a ``results.json`` written by :func:`~gpattn.comparison.write_outputs` (or ``gpattn
    compare``), e.g. to redraw its figures with :func:`~gpattn.plotting.write_comparison_figures`.

    :param path: The ``results.json`` file.
    :return: Its records, in file order.
    :raises ValueError: Naming the file (and the record, by its index) that is not valid JSON or not a record.
    """
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:  # a damaged (e.g. truncated) file
        raise ValueError(f"{path}: cannot be read as JSON ({error})") from None
    if not isinstance(content, dict) or not isinstance(content.get("records"), list):
        raise ValueError(f"{path}: expected a results.json with a list of 'records'")
    records = []
    for index, record in enumerate(content["records"]):
        try:
            records.append(RunRecord.from_dict(record))
        except ValueError as error:
            raise ValueError(f"{path}, records[{index}]: {error}") from None
    return records


def _per_example(value: Any, where: str) -> dict[str, list[float]]:
    values = as_mapping(value, where)
    unknown = sorted(set(values) - set(PER_EXAMPLE_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unexpected entries {unknown}; expected some of {list(PER_EXAMPLE_FIELDS)}")
    lists = {name: as_numbers(values[name], f"{where}.{name}") for name in PER_EXAMPLE_FIELDS if name in values}
    if len({len(entries) for entries in lists.values()}) > 1:
        lengths = {name: len(entries) for name, entries in lists.items()}
        raise ValueError(f"{where}: expected one value per test example in every entry, got lengths {lengths}")
    return lists


def _run_metrics(value: Any, where: str) -> RunMetrics:
    metrics = as_mapping(value, where)
    if "test" not in metrics:
        raise ValueError(f"{where}: missing the entry 'test'")
    shift = as_mapping(metrics.get("shift", {}), f"{where}.shift")
    ood = as_mapping(metrics.get("ood", {}), f"{where}.ood")
    return RunMetrics(
        test=read_fields(ClassificationMetrics, metrics["test"], f"{where}.test"),
        shift={
            kind: {
                str(severity): read_fields(ShiftMetrics, values, f"{where}.shift.{kind}.{severity}")
                for severity, values in as_mapping(levels, f"{where}.shift.{kind}").items()
            }
            for kind, levels in shift.items()
        },
        ood={name: read_fields(OODMetrics, values, f"{where}.ood.{name}") for name, values in ood.items()},
    )


def _reliability(values: Any) -> ReliabilityBins:
    where = "record.reliability"
    values = as_mapping(values, where)
    bins = {name: as_list(values.get(name), f"{where}.{name}") for name in ("confidence", "accuracy", "count")}
    optional = {
        name: [None if value is None else as_number(value, f"{where}.{name}") for value in bins[name]]
        for name in ("confidence", "accuracy")
    }
    return ReliabilityBins(**optional, count=[as_integer(value, f"{where}.count") for value in bins["count"]])


# -- atomic files ----------------------------------------------------------------------------------------------------
def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and :func:`os.replace`: the
    file is either the complete new text or untouched (an interruption leaves no half-written file). The file gets
    the mode of any newly created file (``0o666`` less the process's umask, e.g. ``0o644``), as the figures and
    tables do.

    :raises OSError: The folder cannot be written (a full disk, no permission, ...): the error names ``path`` and says
        that it is unchanged; the temporary file is removed.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # os.open with 0o666 applies the umask, as open() does (tempfile.mkstemp would make the file 0o600)
        # UTF-8 whatever the locale (table.md holds "±"; an ASCII or Latin-1 locale would refuse it or mangle it)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
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
