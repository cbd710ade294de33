"""The typed run record: its JSON layout, the round trip through results.json, and the checks on reading."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from gpattn.comparison import (
    ClassificationMetrics,
    OODMetrics,
    ReliabilityBins,
    RunMetrics,
    RunRecord,
    ShiftMetrics,
    TemperatureScaled,
    TrainingSummary,
    read_records,
)

TEST = dict(accuracy=0.9, confidence=0.85, nll=0.3, ece=0.05, mce=0.2, brier=0.15, aurc=0.02, eaurc=0.01,
            auroc=0.8, fpr95=0.6)  # fmt: skip


def _record() -> RunRecord:
    return RunRecord(
        task="digits",
        attention="kep_svgp",
        seed=1,
        metrics=RunMetrics(
            test=ClassificationMetrics(**TEST),
            shift={"blur": {"1": ShiftMetrics(0.8, 0.5, 0.1, 0.3), "2": ShiftMetrics(0.7, math.nan, 0.2, 0.4)}},
            ood={"noise": OODMetrics(0.9, 0.85, 0.95, 0.4)},
        ),
        reliability=ReliabilityBins(confidence=[None, 0.55, 0.95], accuracy=[None, 0.5, 1.0], count=[0, 4, 6]),
        ood_scores={"in": [0.9, 0.8], "noise": [0.4]},
        spectra={"layer_2": [[3.0, 2.0], [1.5, 0.5]]},
        train=TrainingSummary(seconds=1.5, epochs=3, best_epoch=2, num_parameters=1234, ensemble=1),
    )


def _same(first: RunRecord, second: RunRecord) -> bool:
    # NaN != NaN: compare the JSON texts, where NaN is written as NaN
    return json.dumps(first.to_dict()) == json.dumps(second.to_dict())


def test_to_dict_is_the_documented_layout():
    data = _record().to_dict()
    fields = ["task", "attention", "seed", "metrics", "reliability", "ood_scores", "spectra", "train"]
    later = ["temperature_scaled", "fidelity", "per_example", "hyperparameters", "tuned"]
    assert list(data) == [*fields, *later, "undefined"]  # the record has NaNs
    assert list(data["metrics"]) == ["test", "shift", "ood"]
    added = ("classwise_ece", "debiased_ce", "sweep_ece")  # the fields with a default (NaN)
    assert {k: v for k, v in data["metrics"]["test"].items() if k not in added} == TEST
    assert list(data["metrics"]["test"])[-3:] == list(added)
    assert data["metrics"]["shift"]["blur"]["1"] == {
        "accuracy": 0.8, "nll": 0.5, "ece": 0.1, "brier": 0.3, "debiased_ce": None
    }  # fmt: skip
    assert data["undefined"]["metrics.test.sweep_ece"] == "nan: not in records written before it existed"
    assert (data["per_example"], data["hyperparameters"], data["tuned"]) == ({}, {}, False)
    assert data["metrics"]["ood"]["noise"]["aupr_max_prob"] == 0.95
    assert data["reliability"] == {"confidence": [None, 0.55, 0.95], "accuracy": [None, 0.5, 1.0], "count": [0, 4, 6]}
    assert data["train"] == {"seconds": 1.5, "epochs": 3, "best_epoch": 2, "num_parameters": 1234, "ensemble": 1,
                             "epochs_trained": None, "cuda_graphs": False}  # fmt: skip
    assert data["undefined"]["train.epochs_trained"] == "nan: not in records written before it existed"


def _refuse(token: str) -> float:
    raise ValueError(f"not strict JSON: {token}")


def test_to_dict_is_strict_json_with_a_reason_for_each_undefined_metric():
    import dataclasses

    record = _record()  # every metric defined but one (the fields added later default to NaN: set them)
    test = dataclasses.replace(record.metrics.test, classwise_ece=0.07, debiased_ce=0.04, sweep_ece=0.03)
    ood = {
        "noise": dataclasses.replace(record.metrics.ood["noise"], aupr_out_max_prob=0.9, auroc_mutual_information=0.8)
    }
    shift = {"blur": {key: dataclasses.replace(m, debiased_ce=0.1) for key, m in record.metrics.shift["blur"].items()}}
    metrics = dataclasses.replace(record.metrics, test=test, ood=ood, shift=shift)
    train = dataclasses.replace(record.train, epochs_trained=2.0)
    record = dataclasses.replace(record, metrics=metrics, train=train)
    data = record.to_dict()
    text = json.dumps(data, allow_nan=False)  # raises on NaN or Inf
    assert json.loads(text, parse_constant=_refuse) == data
    assert data["metrics"]["shift"]["blur"]["2"]["nll"] is None
    assert data["undefined"] == {"metrics.shift.blur.2.nll": "nan: not a finite number"}
    assert RunRecord.from_dict(data).to_dict() == data  # read back (null -> NaN) and written again: the same
    no_misclassification = RunRecord.from_dict({**data, "metrics": {"test": {**TEST, "auroc": math.nan}}}).to_dict()
    assert no_misclassification["undefined"]["metrics.test.auroc"].startswith("nan: needs both correct and wrong")
    deterministic = copy.deepcopy(data)
    deterministic["metrics"]["ood"]["noise"]["auroc_mutual_information"] = None
    reason = RunRecord.from_dict(deterministic).to_dict()["undefined"]["metrics.ood.noise.auroc_mutual_information"]
    assert reason.startswith("nan: deterministic: the row's predictions do not vary")


def test_json_round_trip_gives_the_same_record(tmp_path):
    record = _record()
    text = json.dumps(record.to_dict())
    again = RunRecord.from_dict(json.loads(text))
    assert _same(again, record)
    assert math.isnan(again.metrics.shift["blur"]["2"].nll) and again.reliability.confidence[0] is None
    assert isinstance(again.train.epochs, int) and isinstance(again.metrics.test.accuracy, float)
    (tmp_path / "results.json").write_text(json.dumps({"config": {}, "records": [record.to_dict()] * 2}))
    assert [_same(r, record) for r in read_records(tmp_path / "results.json")] == [True, True]


def test_optional_parts_may_be_absent():
    minimal = {"task": "pointer", "attention": "softmax", "seed": 0, "metrics": {"test": TEST}}
    record = RunRecord.from_dict(minimal)
    assert record.metrics.shift == {} and record.metrics.ood == {} and record.ood_scores == {} and record.spectra == {}
    assert record.reliability is None and record.train is None
    assert RunRecord.from_dict({**minimal, "reliability": None, "train": None}) == record
    nan_metric = RunRecord.from_dict({**minimal, "metrics": {"test": {**TEST, "auroc": None}}})  # JSON null is NaN
    assert math.isnan(nan_metric.metrics.test.auroc)


def test_temperature_scaled_and_fidelity_round_trip_and_old_records_read_back():
    record = _record()
    metrics = RunMetrics(
        test=ClassificationMetrics(**TEST, classwise_ece=0.03), ood={"noise": OODMetrics(0.9, 0.85, 0.95, 0.4, 0.7)}
    )
    bins = ReliabilityBins(confidence=[0.5], accuracy=[0.6], count=[3])
    full = dataclasses.replace(
        record,
        temperature_scaled=TemperatureScaled(temperature=1.7, metrics=metrics, reliability=bins),
        fidelity={"layer_2": {"relative_objective": [0.1, 0.2], "energy": [0.9, 0.95]}},
    )
    data = json.loads(json.dumps(full.to_dict()))
    assert data["temperature_scaled"]["temperature"] == 1.7
    assert data["temperature_scaled"]["metrics"]["ood"]["noise"]["aupr_out_max_prob"] == 0.7
    assert data["fidelity"]["layer_2"]["energy"] == [0.9, 0.95]
    again = RunRecord.from_dict(data)
    assert _same(again, full) and again.temperature_scaled == full.temperature_scaled
    # a record written before classwise_ece, aupr_out_max_prob, temperature_scaled and fidelity existed
    old = _record().to_dict()
    for key in ("temperature_scaled", "fidelity"):
        old.pop(key)
    old["metrics"]["test"].pop("classwise_ece")
    old["metrics"]["ood"]["noise"].pop("aupr_out_max_prob")
    read = RunRecord.from_dict(old)
    assert math.isnan(read.metrics.test.classwise_ece) and math.isnan(read.metrics.ood["noise"].aupr_out_max_prob)
    assert read.temperature_scaled is None and read.fidelity == {}
    with pytest.raises(ValueError, match=r"record.temperature_scaled.metrics: missing the entry 'test'"):
        RunRecord.from_dict({**data, "temperature_scaled": {"temperature": 1.0, "metrics": {}}})
    with pytest.raises(ValueError, match=r"record.fidelity.layer_2.energy: expected a list"):
        RunRecord.from_dict({**data, "fidelity": {"layer_2": {"energy": 0.9}}})


def test_per_example_hyperparameters_and_tuned_round_trip_and_old_records_read_back():
    examples = {"test_nll": [0.1, 2.3], "test_correct": [1.0, 0.0], "test_confidence": [0.9, 0.6]}
    scaled = TemperatureScaled(
        temperature=0.8,
        metrics=RunMetrics(test=ClassificationMetrics(**TEST, debiased_ce=0.02, sweep_ece=0.01)),
        per_example={**examples, "test_nll": [0.2, 2.0]},
    )
    hyperparameters = {"epochs": 60, "lr": 3e-3, "num_inducing": None, "dropout": 0.1}
    full = dataclasses.replace(
        _record(), per_example=examples, hyperparameters=hyperparameters, tuned=True, temperature_scaled=scaled
    )
    data = json.loads(json.dumps(full.to_dict(), allow_nan=False))
    assert data["per_example"] == examples and data["hyperparameters"] == hyperparameters and data["tuned"] is True
    assert data["temperature_scaled"]["per_example"]["test_nll"] == [0.2, 2.0]
    again = RunRecord.from_dict(data)
    assert _same(again, full) and again.temperature_scaled == full.temperature_scaled
    assert isinstance(again.hyperparameters["epochs"], int) and again.tuned is True
    # a record written before them: empty, False and NaN
    old = _record().to_dict()
    for key in ("per_example", "hyperparameters", "tuned"):
        old.pop(key)
    for entry in (old["metrics"]["test"], old["metrics"]["shift"]["blur"]["1"]):
        for name in ("debiased_ce", "sweep_ece"):
            entry.pop(name, None)
    old["metrics"]["ood"]["noise"].pop("auroc_mutual_information")
    old["temperature_scaled"] = {"temperature": 1.2, "metrics": {"test": TEST}}
    read = RunRecord.from_dict(old)
    assert (read.per_example, read.hyperparameters, read.tuned, read.temperature_scaled.per_example) == (
        {},
        {},
        False,
        {},
    )
    assert math.isnan(read.metrics.test.debiased_ce) and math.isnan(read.metrics.test.sweep_ece)
    assert math.isnan(read.metrics.shift["blur"]["1"].debiased_ce)
    assert math.isnan(read.metrics.ood["noise"].auroc_mutual_information)


def _broken(edit) -> dict:
    data = copy.deepcopy(_record().to_dict())
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("metrics"), r"record: missing entries \['metrics'\]"),
        (lambda d: d.update(colour="red"), r"unexpected entries \['colour'\]"),
        (lambda d: d["metrics"].pop("test"), r"record.metrics: missing the entry 'test'"),
        (lambda d: d["metrics"]["test"].pop("confidence"), r"record.metrics.test: missing entries \['confidence'\]"),
        (lambda d: d["metrics"]["test"].update(ece="low"), r"record.metrics.test.ece: expected a number, got 'low'"),
        (lambda d: d.update(seed="0"), r"record.seed: expected an integer, got '0'"),
        (lambda d: d.update(task=3), r"expected 'task' to be a string"),
        (lambda d: d["metrics"]["shift"]["blur"].update({"3": {"accuracy": 1.0}}), r"shift.blur.3: missing entries"),
        (lambda d: d["train"].update(epochs=2.5), r"record.train.epochs: expected an integer, got 2.5"),
        (lambda d: d["train"].update(cuda_graphs=1), r"record.train.cuda_graphs: expected true or false, got 1"),
        (lambda d: d["reliability"]["count"].pop(), r"differ in length \(ragged bins\)"),
        (lambda d: d.update(spectra={"layer_1": 3.0}), r"record.spectra.layer_1: expected a list"),
        (lambda d: d.update(ood_scores=[]), r"record.ood_scores: expected a dict, got list"),
        (lambda d: d.update(tuned=1), r"record: expected 'tuned' to be true or false, got 1"),
        (lambda d: d.update(hyperparameters={"lr": [1]}), r"record.hyperparameters.lr: expected a number, a string"),
        (lambda d: d.update(per_example={"test_nll": [1.0], "test_correct": []}), r"one value per test example"),
        (lambda d: d.update(per_example={"nll": [1.0]}), r"record.per_example: unexpected entries \['nll'\]"),
    ],
    ids=[
        "no-metrics",
        "unknown",
        "no-test",
        "no-confidence",
        "text",
        "seed",
        "task",
        "shift",
        "epochs",
        "graphs",
        "ragged",
        "spectra",
        "ood-scores",
        "tuned",
        "hyperparameters",
        "per-example-ragged",
        "per-example-name",
    ],  # fmt: skip
)
def test_malformed_records_are_refused_naming_the_entry(edit, match):
    with pytest.raises(ValueError, match=match):
        RunRecord.from_dict(_broken(edit))


def test_not_a_results_file(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="list of 'records'"):
        read_records(tmp_path / "results.json")


def test_epochs_trained_is_recorded_or_derived_where_the_loop_stops():
    """The report's epochs trained: the recorded mean; for an older single-model record, min(E, best + patience) (the
    loop stops there: tests/training/test_early_stopping.py), E without early stopping; NaN for an older ensemble."""
    from gpattn.comparison.report import epochs_trained

    base = _record()
    older = dataclasses.replace(base, hyperparameters={"patience": 15})
    assert epochs_trained(older) == 3.0  # min(3, 2 + 15)
    stopped = dataclasses.replace(
        base, train=dataclasses.replace(base.train, epochs=60, best_epoch=36), hyperparameters={"patience": 15}
    )
    assert epochs_trained(stopped) == 51.0
    assert epochs_trained(dataclasses.replace(stopped, hyperparameters={"patience": None})) == 60.0
    assert math.isnan(epochs_trained(base))  # no hyperparameters recorded: unknown
    ensemble = dataclasses.replace(stopped, train=dataclasses.replace(stopped.train, ensemble=5))
    assert math.isnan(epochs_trained(ensemble))
    recorded = dataclasses.replace(ensemble, train=dataclasses.replace(ensemble.train, epochs_trained=47.4))
    assert epochs_trained(recorded) == 47.4
    again = RunRecord.from_dict(json.loads(json.dumps(recorded.to_dict())))
    assert again.train.epochs_trained == 47.4


def test_the_use_of_cuda_graphs_round_trips_and_older_records_read_as_eager():
    record = _record()
    graphed = dataclasses.replace(record, train=dataclasses.replace(record.train, cuda_graphs=True))
    assert RunRecord.from_dict(graphed.to_dict()).train.cuda_graphs is True
    older = record.to_dict()
    del older["train"]["cuda_graphs"]  # a record written before the field existed
    assert RunRecord.from_dict(older).train.cuda_graphs is False


def test_flags_are_read_whether_or_not_annotations_are_strings():
    from dataclasses import make_dataclass

    from gpattn.comparison.json_values import read_fields

    flags = make_dataclass("Flags", [("graphed", bool), ("count", int), ("value", float)])  # types, not strings
    assert read_fields(flags, {"graphed": True, "count": 2, "value": 0.5}, "x") == flags(True, 2, 0.5)
    with pytest.raises(ValueError, match=r"x.graphed: expected true or false, got 1"):
        read_fields(flags, {"graphed": 1, "count": 2, "value": 0.5}, "x")
    with pytest.raises(ValueError, match=r"x.count: expected an integer, got 2.5"):
        read_fields(flags, {"graphed": True, "count": 2.5, "value": 0.5}, "x")


def test_infinities_read_back_as_infinities():
    """strict JSON writes an infinite metric as null with its reason ("inf: ..."): read back, it is that infinity
    again (not NaN), wherever it is; a NaN beside it stays NaN."""
    record = _record()
    test = dataclasses.replace(record.metrics.test, nll=math.inf, mce=-math.inf)
    record = dataclasses.replace(
        record,
        metrics=dataclasses.replace(record.metrics, test=test),
        ood_scores={"in": [0.5, math.inf], "noise": [-math.inf]},
        hyperparameters={"weight_decay": math.inf, "patience": None},
    )
    data = json.loads(json.dumps(record.to_dict(), allow_nan=False), parse_constant=_refuse)
    assert data["metrics"]["test"]["nll"] is None and data["undefined"]["metrics.test.nll"].startswith("inf: ")
    again = RunRecord.from_dict(data)
    assert (again.metrics.test.nll, again.metrics.test.mce) == (math.inf, -math.inf)
    assert again.ood_scores == {"in": [0.5, math.inf], "noise": [-math.inf]}
    assert again.hyperparameters == {"weight_decay": math.inf, "patience": None}
    assert math.isnan(again.metrics.shift["blur"]["2"].nll)  # a NaN is still a NaN
    assert again.to_dict() == record.to_dict()  # the same JSON, reasons included
    with pytest.raises(ValueError, match=r"record.undefined: expected a dict, got list"):
        RunRecord.from_dict({**data, "undefined": []})


def test_numpy_scalars_are_written_as_python_numbers():
    """A record built from NumPy numbers (a float32 metric, an int64 count, a NumPy NaN) is strict JSON data: the
    numbers as Python's, the NaN as null with its reason."""
    import numpy as np

    test = ClassificationMetrics(**{**TEST, "accuracy": np.float32(0.75), "auroc": np.float32("nan")})
    train = TrainingSummary(seconds=np.float64(1.5), epochs=np.int64(3), best_epoch=2, num_parameters=7, ensemble=1)
    bins = ReliabilityBins(confidence=[np.float32(0.5)], accuracy=[0.25], count=[np.int64(4)])
    record = RunRecord("digits", "softmax", np.int64(2), RunMetrics(test=test), reliability=bins, train=train)
    data = json.loads(json.dumps(record.to_dict(), allow_nan=False))
    assert (data["seed"], data["metrics"]["test"]["accuracy"], data["metrics"]["test"]["auroc"]) == (2, 0.75, None)
    assert data["undefined"]["metrics.test.auroc"].startswith("nan: needs both correct and wrong")
    assert data["train"]["epochs"] == 3
    assert data["reliability"] == {"confidence": [0.5], "accuracy": [0.25], "count": [4]}
    again = RunRecord.from_dict(data)
    assert type(again.seed) is int and type(again.train.epochs) is int and again.metrics.test.accuracy == 0.75


def test_read_records_names_the_file_and_the_record(tmp_path):
    path = tmp_path / "results.json"
    path.write_text('{"records": [')  # cut short
    with pytest.raises(ValueError, match=r"results.json: cannot be read as JSON \(Expecting value"):
        read_records(path)
    path.write_text(json.dumps({"records": [_record().to_dict(), {"task": "digits"}]}))
    with pytest.raises(ValueError, match=r"results.json, records\[1\]: record: missing entries \['attention'"):
        read_records(path)


def test_text_files_are_utf8_whatever_the_locale(tmp_path, monkeypatch):
    """table.md holds "±": written as UTF-8 also where the locale's encoding is ASCII (where it failed) or Latin-1."""
    import io

    from gpattn.comparison.records import write_text_atomically

    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: encoding or "ascii")  # an ASCII locale
    path = write_text_atomically(tmp_path / "table.md", "accuracy 91.0 ± 0.5, σ")
    assert path.read_bytes() == "accuracy 91.0 ± 0.5, σ".encode()
    assert [p.name for p in tmp_path.iterdir()] == ["table.md"]
