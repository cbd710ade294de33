"""``gpattn tune`` at its edges: the tuner's data never reaches the test split (an instrumented training call, and the
digits images of the tuner against the test images), the tuned configuration is the best validation trial (ties,
diverged and NaN trials) and is what ``gpattn compare`` applies, bit for bit, a study interrupted in the TPE phase and
resumed draws what the uninterrupted one draws, the start-up trials of the rows are paired, the search space has the
documented scales and every searched parameter reaches the model or its training, choices of every JSON type round-trip
through the study and the tuned file, and the refusals of studies, storages and tuned files.

Most tests run the studies without training (the objective is a closed form of the parameters, or the training call
is replaced); one tiny real tuning (the pointer task, 2 trials of one epoch per row) checks the whole chain.

The last group checks what the probe of these edges found wrong, now fixed: a row whose every trial diverged no
longer discards the other rows' configurations, a budget that the rows in ``OUT/tuned`` do not share and an in-memory
storage with several workers are refused before any trial, ``write_tuned`` refuses what ``read_tuned`` would, a
changed setting is named by its key, and an architecture label takes ASCII digits only."""

from __future__ import annotations

import json
import math
import re

import optuna
import pytest
import torch
from optuna.trial import TrialState
from scipy import stats

from gpattn.comparison import CompareConfig
from gpattn.comparison import tuning as tuning_module
from gpattn.comparison.runs import build_model, make_train_config
from gpattn.comparison.sealed_split import SealedSplit
from gpattn.comparison.studies import (
    StudyLock,
    claim_trial,
    fail_trial,
    finish_trial,
    in_memory,
    open_storage,
    prepare_study,
    summarize_study,
)
from gpattn.comparison.tune_config import TuneConfig
from gpattn.comparison.tuned_configuration import TunedRow, read_tuned, write_tuned
from gpattn.comparison.tuning import TuningDivergedError, study_name, tune
from gpattn.comparison.tuning_space import (
    ARCHITECTURES,
    TUNED_ROWS,
    SearchParameter,
    architecture_sizes,
    search_space,
)
from gpattn.data import load_digits_splits
from gpattn.methods import get_method

TINY = dict(tasks=("pointer",), trials=2, pointer_epochs=1, patience=1, eval_samples=2, progress=False)
#: the shared parameters, drawn first by every row
SHARED = ("lr", "weight_decay", "dropout", "architecture")
#: TPE's random start-up trials (Optuna's default ``n_startup_trials``)
STARTUP = 10


# -- helpers -----------------------------------------------------------------------------------------------------------
def _storage(folder, name: str = "study.db"):
    url = f"sqlite:///{folder / name}"
    return open_storage(url), StudyLock(url)


def _objective(parameters: dict) -> float:
    """A synthetic validation NLL of a trial's parameters (no training): lowest near lr = 10^-2.5, no dropout, width
    32."""
    width = architecture_sizes(parameters["architecture"])["embed_dim"]
    return (math.log10(parameters["lr"]) + 2.5) ** 2 + parameters["dropout"] + width / 640


def _run_study(storage, lock, name, space, trials, resume=False, stop_at=None) -> list[dict]:
    """One worker's loop of ``tune`` on the study ``name`` without training: claim, score by :func:`_objective`,
    finish; ``stop_at=k``: the k-th claimed trial is marked failed (an interrupted trial) and the worker stops.
    Returns the parameters of the finished trials in claim order."""
    prepare_study(storage, lock, name, {"trials": trials, "seed": 100}, resume)
    finished = []
    while (claimed := claim_trial(storage, lock, name, space, 100)) is not None:
        study, trial, parameters = claimed
        if len(finished) == stop_at:
            fail_trial(study, trial, lock, "interrupted")
            return finished
        finish_trial(study, trial, lock, _objective(parameters), {})
        finished.append(parameters)
    return finished


def _complete(storage, name: str) -> list[tuple[dict, float]]:
    study = optuna.load_study(study_name=name, storage=storage)
    return [(trial.params, trial.value) for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]


def _fake_training(monkeypatch, score) -> list[tuple[str, dict]]:
    """Replace a trial's training in ``tune`` by ``score(row, parameters)`` (``None``: the run diverged); returns the
    list of ``(row, parameters)`` of the trials that were 'trained'."""
    calls = []

    def fake(config, data, row, parameters):
        calls.append((row, dict(parameters)))
        value = score(row, parameters)
        hyperparameters = config.trial_hyperparameters(data.name, get_method(row), parameters, data.defaults)
        return {
            "parameters": parameters,
            "hyperparameters": hyperparameters.to_dict(),
            "value": value,
            "diverged": "" if value is not None else "training diverged: injected",
            "best_epoch": 1,
            "epochs": 1,
            "history": [],
            "seconds": 0.0,
            "cpu_seconds": 0.0,
        }

    monkeypatch.setattr(tuning_module, "run_trial", fake)
    return calls


def _entry(**changes) -> TunedRow:
    values = dict(
        hyperparameters={"epochs": 1, "patience": 1, "lr": 1e-3, "embed_dim": 16, "depth": 1},
        parameters={"lr": 1e-3, "architecture": "16x1x2"},
        best_val_nll=0.5,
        best_trial=1,
        trials=2,
        search_space={"lr": {"log_uniform": [3e-4, 1e-2]}},
        study={"tuning_seed": 100, "eval_samples": 2},
    )
    return TunedRow(**{**values, **changes})


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """One tiny real tuning of softmax and SGPA on the pointer task, with every training call recorded:
    ``(out, summaries, training calls as (train split, validation split), the tuner's data)``."""
    out = tmp_path_factory.mktemp("tune")
    seen = []
    train = tuning_module.train_ensemble

    def spy(make_model, train_set, val_set, config, members):
        seen.append((train_set, val_set))
        return train(make_model, train_set, val_set, config, members)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning_module, "train_ensemble", spy)
        patch.setattr(tuning_module, "_DATA", {})
        summaries = tune(TuneConfig(rows=("softmax", "sgpa"), **TINY), out)
        data = tuning_module._data("pointer", 100)
    return out, summaries, seen, data


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """12-trial studies (two past TPE's 10 random start-up trials) of softmax and KEP-SVGP without training, one
    worker: ``(storage, {row: finished parameters in claim order})``."""
    storage, lock = _storage(tmp_path_factory.mktemp("studies"))
    drawn = {row: _run_study(storage, lock, row, search_space(row, 2048), 12) for row in ("softmax", "kep_svgp")}
    return storage, drawn


# -- the test split is never read --------------------------------------------------------------------------------------
def test_every_trial_trains_on_the_tuning_seeds_train_and_validation_splits_only(real_run):
    _, _, seen, data = real_run
    assert len(seen) == 4  # 2 rows x 2 trials, one model each
    assert all(train is data.train and val is data.val for train, val in seen)
    assert isinstance(data.test, SealedSplit) and data.shifted == {} and data.ood == {} and data.seed == 100


def test_the_digits_images_of_the_tuner_are_disjoint_from_the_test_images():
    # compare's digits test split is load_digits_splits(seed=0).test for every seed (load_task); the tuner draws its
    # training and validation splits with the tuning seed from the other images
    data = tuning_module._data("digits", 100)
    test = load_digits_splits(seed=0).test

    def images(dataset) -> set[bytes]:
        return {image.numpy().tobytes() for image in dataset.images}

    train, val, held = images(data.train), images(data.val), images(test)
    assert (len(train), len(val), len(held)) == (866, 216, 361)  # sklearn's digits have no duplicate image
    assert not train & held and not val & held and not train & val


# -- the chosen configuration ------------------------------------------------------------------------------------------
def test_the_tuned_file_holds_the_best_trial_and_compare_applies_exactly_what_it_trained_with(real_run):
    out, summaries, _, data = real_run
    written = read_tuned("pointer", out / "tuned")
    compare = CompareConfig(
        tasks=("pointer",), attentions=("softmax", "sgpa", "deep_ensemble"), tuned_dir=out / "tuned"
    )
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    for row in ("softmax", "sgpa"):
        trials = optuna.load_study(study_name=study_name("pointer", row), storage=storage).get_trials(deepcopy=False)
        assert [trial.state for trial in trials] == [TrialState.COMPLETE] * 2
        best = min(trials, key=lambda trial: (trial.value, trial.number))
        summary = summaries["pointer", row]
        assert (summary.best_trial, summary.best_val_nll, summary.parameters) == (best.number, best.value, best.params)
        assert written[row] == summary  # the file round-trips exactly (floats, the architecture label, the choice)
        record = json.loads((out / "trials" / f"pointer-{row}-{best.number}.json").read_text())
        assert record["value"] == best.value == min(entry["val_nll"] for entry in record["history"])
        assert record["parameters"] == best.params
        # gpattn compare trains the row with the very hyperparameters of its best trial
        applied = compare.hyperparameters("pointer", get_method(row), data.defaults).to_dict()
        assert applied == best.user_attrs["hyperparameters"] == record["hyperparameters"]
    sgpa = summaries["pointer", "sgpa"]
    assert sgpa.hyperparameters["kl_anneal_fraction"] == sgpa.parameters["kl_anneal_fraction"] in (0.0, 0.25, 0.5)
    # Deep Ensembles wrap softmax models: softmax's configuration
    assert compare.hyperparameters("pointer", "deep_ensemble", data.defaults) == compare.hyperparameters(
        "pointer", "softmax", data.defaults
    )


def test_ties_diverged_and_nan_trials_choose_the_first_best_finite_trial(tmp_path):
    storage, lock = _storage(tmp_path)
    space = (SearchParameter("lr", "log_uniform", 3e-4, 1e-2),)
    prepare_study(storage, lock, "s", {"trials": 5}, False)
    drawn = []
    for value in (math.inf, 0.5, float("nan"), 0.5, 0.75):  # diverged, best, NaN (counted as diverged), tie, worse
        study, trial, parameters = claim_trial(storage, lock, "s", space, 100)
        drawn.append(parameters)
        finish_trial(study, trial, lock, value, {})
    summary = summarize_study(storage, "s", space, {"epochs": 1}, {})
    assert (summary.best_trial, summary.best_val_nll, summary.parameters) == (1, 0.5, drawn[1])
    assert summary.hyperparameters == {"epochs": 1, **drawn[1]} and summary.trials == 5
    assert [value for _, value in _complete(storage, "s")] == [math.inf, 0.5, math.inf, 0.5, 0.75]

    prepare_study(storage, lock, "diverged", {"trials": 2}, False)
    for _ in range(2):
        study, trial, _ = claim_trial(storage, lock, "diverged", space, 100)
        finish_trial(study, trial, lock, math.inf, {})
    with pytest.raises(ValueError, match=r"every trial of the study 'diverged' diverged"):
        summarize_study(storage, "diverged", space, {}, {})


def test_a_study_with_a_trial_still_running_has_no_summary(tmp_path):
    storage, lock = _storage(tmp_path)
    space = (SearchParameter("lr", "log_uniform", 3e-4, 1e-2),)
    prepare_study(storage, lock, "s", {"trials": 2}, False)
    study, trial, _ = claim_trial(storage, lock, "s", space, 100)
    finish_trial(study, trial, lock, 0.5, {})
    claim_trial(storage, lock, "s", space, 100)  # claimed, not finished (another worker's, or an interrupted one)
    assert summarize_study(storage, "s", space, {}, {}) is None


# -- seeded sampling: pairing and resume -------------------------------------------------------------------------------
def test_the_start_up_trials_of_the_rows_share_their_shared_parameters(uninterrupted):
    _, drawn = uninterrupted
    softmax, kep_svgp = drawn["softmax"], drawn["kep_svgp"]
    assert len(softmax) == len(kep_svgp) == 12
    for slot in range(STARTUP):  # slot k of every row: the same lr, weight decay, dropout and architecture
        assert {name: softmax[slot][name] for name in SHARED} == {name: kep_svgp[slot][name] for name in SHARED}
    assert len({json.dumps(parameters, sort_keys=True) for parameters in softmax}) == 12  # no configuration twice
    # every drawn value, random or TPE's, lies in its dimension
    for row, trials in drawn.items():
        space = search_space(row, 2048)
        for parameters in trials:
            assert list(parameters) == [parameter.name for parameter in space]
            assert all(parameter.contains(parameters[parameter.name]) for parameter in space), parameters


@pytest.mark.parametrize("stop_at", [3, 10, 11])
def test_a_study_interrupted_in_the_tpe_phase_and_resumed_draws_what_the_uninterrupted_one_draws(
    uninterrupted, tmp_path, stop_at
):
    # the existing test covers 3 random start-up trials; here the interrupted trial and its replacement are TPE's
    reference, drawn = uninterrupted
    storage, lock = _storage(tmp_path)
    space = search_space("kep_svgp", 2048)
    _run_study(storage, lock, "kep_svgp", space, 12, stop_at=stop_at)
    _run_study(storage, lock, "kep_svgp", space, 12, resume=True)
    assert _complete(storage, "kep_svgp") == _complete(reference, "kep_svgp")
    states = [trial.state for trial in optuna.load_study(study_name="kep_svgp", storage=storage).trials]
    assert states.count(TrialState.COMPLETE) == 12 and states.count(TrialState.FAIL) == 1 and len(states) == 13


# -- the search space --------------------------------------------------------------------------------------------------
def test_the_float_dimensions_are_drawn_on_their_documented_scales():
    # Optuna's random sampler, which TPE's start-up trials use; 400 draws per dimension, a fixed seed
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    lr, _, dropout, _, beta, eta = search_space("kep_svgp", 3600)
    draws = {"lr": [], "dropout": [], "beta": [], "ksvd_weight": []}
    for _ in range(400):
        trial = study.ask()
        for parameter in (lr, dropout, beta, eta):
            draws[parameter.name].append(parameter.suggest(trial))
        study.tell(trial, 0.0)
    for parameter, (low, high) in ((lr, (3e-4, 1e-2)), (beta, (1e-2, 3600)), (eta, (1e-2, 1e2))):
        values = torch.tensor(draws[parameter.name], dtype=torch.float64)
        assert low <= values.min() and values.max() <= high
        logs = (values.log() - math.log(low)) / (math.log(high) - math.log(low))
        assert stats.kstest(logs.numpy(), "uniform").pvalue > 1e-3, parameter.name  # uniform in the logarithm
        linear = (values - low) / (high - low)
        assert stats.kstest(linear.numpy(), "uniform").pvalue < 1e-9, parameter.name  # not uniform in the value
    values = torch.tensor(draws["dropout"], dtype=torch.float64)
    assert 0.0 <= values.min() and values.max() <= 0.3
    assert stats.kstest((values / 0.3).numpy(), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("row", ["cgpt", "svgp", *TUNED_ROWS])
def test_every_searched_parameter_reaches_the_model_or_its_training(row):
    config = TuneConfig(rows=(row,), **TINY)
    method = get_method(row)
    space = {parameter.name for parameter in search_space(row, 100)}
    drawn = {"lr": 1.25e-3, "weight_decay": 0.0625, "dropout": 0.125, "architecture": "48x2x4", "beta": 7.5}
    drawn.update(ksvd_weight=3.25, kl_anneal_fraction=0.25)
    drawn = {name: value for name, value in drawn.items() if name in space}
    hyperparameters = config.trial_hyperparameters("pointer", method, drawn, {})
    model = build_model(method, hyperparameters, 8, {"input": "tokens", "vocab_size": 10, "max_len": 8})
    train = make_train_config(config.compare_config(), method, hyperparameters, 100)
    assert (train.lr, train.weight_decay, train.epochs, train.patience) == (1.25e-3, 0.0625, 1, 1)
    assert {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)} == {0.125}
    assert (model.embed_dim, len(model.blocks)) == (48, 2)
    assert {module.num_heads for module in model.modules() if hasattr(module, "num_heads")} == {4}
    weights = {float(module.ksvd_weight) for module in model.modules() if hasattr(module, "ksvd_weight")}
    assert weights == ({3.25} if "ksvd_weight" in space else set())
    assert train.beta == (7.5 if "beta" in space else config.compare_config().beta)
    if "kl_anneal_fraction" in space:
        assert train.kl_anneal_epochs == 0.25  # of the trial's one epoch
    assert train.mc_dropout == method.predictive.mc_dropout


def test_choices_of_every_json_type_round_trip_through_the_study_and_the_tuned_file(tmp_path):
    storage, lock = _storage(tmp_path)
    space = (
        SearchParameter("num_inducing", "choice", choices=(None, 4, 7)),
        SearchParameter("kl_anneal_fraction", "choice", choices=(0.1 + 0.2, 1 / 3, 0.0)),
        SearchParameter("lr", "log_uniform", 1e-300, 1e-2),  # draws far below 1e-17: their repr has 17 digits
    )
    prepare_study(storage, lock, "s", {"trials": 6}, False)
    drawn = []
    while (claimed := claim_trial(storage, lock, "s", space, 100)) is not None:
        study, trial, parameters = claimed
        drawn.append(parameters)
        finish_trial(study, trial, lock, float(len(drawn) % 4), {})

    def typed(values: dict) -> list:
        return [(name, type(value), value) for name, value in values.items()]

    assert [typed(parameters) for parameters, _ in _complete(storage, "s")] == [typed(p) for p in drawn]
    assert {type(parameters["num_inducing"]) for parameters in drawn} <= {type(None), int}
    summary = summarize_study(storage, "s", space, {"epochs": 1}, {"tuning_seed": 100})
    write_tuned("pointer", {"softmax": summary}, tmp_path)
    back = read_tuned("pointer", tmp_path)["softmax"]
    assert back == summary and typed(back.parameters) == typed(summary.parameters)
    assert typed(back.hyperparameters) == typed(summary.hyperparameters)

    # bools and strings: a choice reads back as itself (True, not 1; 2, not True)
    prepare_study(storage, lock, "b", {"trials": 4}, False)
    flags = (SearchParameter("flag", "choice", choices=(True, False, "x", 2)),)
    drawn = []
    while (claimed := claim_trial(storage, lock, "b", flags, 100)) is not None:
        study, trial, parameters = claimed
        drawn.append(parameters)
        finish_trial(study, trial, lock, 0.0, {})
    assert [typed(parameters) for parameters, _ in _complete(storage, "b")] == [typed(p) for p in drawn]


def test_the_architecture_candidates_all_parse_and_the_shared_parameters_come_first():
    for row in TUNED_ROWS:
        names = [parameter.name for parameter in search_space(row, 100)]
        assert tuple(names[:4]) == SHARED, row  # drawn first: the pairing of the rows' start-up trials
    for label in ARCHITECTURES:
        sizes = architecture_sizes(label)
        assert f"{sizes['embed_dim']}x{sizes['depth']}x{sizes['num_heads']}" == label
        assert sizes["embed_dim"] % sizes["num_heads"] == 0 and sizes["embed_dim"] // sizes["num_heads"] >= 8


# -- a diverged row, budgets, storages, tuned files, changed settings, labels ----------------------------------------
def test_a_row_whose_every_trial_diverged_does_not_discard_the_other_rows_configurations(tmp_path, monkeypatch):
    calls = _fake_training(monkeypatch, lambda row, parameters: None if row == "kep_svgp" else parameters["lr"])
    config = TuneConfig(rows=("softmax", "kep_svgp"), **TINY)
    with pytest.raises(TuningDivergedError, match=r"every trial of the study 'pointer-kep_svgp' diverged") as raised:
        tune(config, tmp_path)
    assert [row for row, _ in calls] == ["softmax", "softmax", "kep_svgp", "kep_svgp"]
    error = raised.value
    assert error.diverged == [("pointer", "kep_svgp")] and "\n" not in str(error)
    assert str(tmp_path / "tuned") in str(error) and "--seed" in str(error)  # where the others are, what to do
    softmax = error.summaries["pointer", "softmax"]
    assert error.summaries["pointer", "kep_svgp"] is None
    # softmax's configuration is its best trial, the one with the lowest (fake) validation NLL: its lr
    assert softmax.best_val_nll == min(parameters["lr"] for row, parameters in calls if row == "softmax")
    assert read_tuned("pointer", tmp_path / "tuned") == {"softmax": softmax}

    # --resume trains nothing, writes softmax's entry again and raises the same error
    calls.clear()
    with pytest.raises(TuningDivergedError) as again:
        tune(config, tmp_path, resume=True)
    assert calls == [] and str(again.value) == str(error)
    resumed = again.value.summaries["pointer", "softmax"]  # the same trial (its study record's date is today's)
    assert (resumed.best_trial, resumed.best_val_nll, resumed.parameters) == (
        softmax.best_trial,
        softmax.best_val_nll,
        softmax.parameters,
    )
    assert read_tuned("pointer", tmp_path / "tuned") == {"softmax": resumed}

    # no other row: nothing is written, and the message does not say otherwise
    with pytest.raises(TuningDivergedError) as alone:
        tune(TuneConfig(rows=("kep_svgp",), **TINY), tmp_path / "alone")
    assert "written" not in str(alone.value) and not (tmp_path / "alone" / "tuned").exists()


def test_a_resume_whose_rows_would_join_rows_of_another_budget_is_refused_before_any_trial(tmp_path, monkeypatch):
    calls = _fake_training(monkeypatch, lambda row, parameters: parameters["lr"])
    tune(TuneConfig(rows=("softmax",), **TINY), tmp_path)
    calls.clear()
    expected = (
        rf"{re.escape(str(tmp_path / 'tuned' / 'pointer.json'))}: the row 'kep_svgp' is tuned with another budget "
        r"than the row 'softmax' beside it: trials 3 \(theirs 2\)"
    )
    with pytest.raises(ValueError, match=expected):
        tune(TuneConfig(rows=("kep_svgp",), **{**TINY, "trials": 3}), tmp_path, resume=True)
    assert calls == []
    # refused before its study was made: the same budget then goes ahead
    assert optuna.get_all_study_names(f"sqlite:///{tmp_path / 'study.db'}") == ["pointer-softmax"]
    tune(TuneConfig(rows=("kep_svgp",), **TINY), tmp_path, resume=True)
    assert set(read_tuned("pointer", tmp_path / "tuned")) == {"softmax", "kep_svgp"}


def test_an_in_memory_storage_with_several_workers_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    def started(*args):
        raise AssertionError("worker processes started on an in-memory database they cannot see")

    monkeypatch.setattr(tuning_module, "_run_in_parallel", started)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"'sqlite:///:memory:' \(--storage\) .* \(--jobs 2\)"):
        tune(TuneConfig(rows=("softmax",), jobs=2, **TINY), out, storage="sqlite:///:memory:")
    assert not out.exists()
    # one worker (this process) uses it
    calls = _fake_training(monkeypatch, lambda row, parameters: parameters["lr"])
    summaries = tune(TuneConfig(rows=("softmax",), **TINY), out, storage="sqlite:///:memory:")
    assert len(calls) == 2 and summaries["pointer", "softmax"].trials == 2


@pytest.mark.parametrize(
    ("url", "memory"),
    [
        ("sqlite:///:memory:", True),
        ("sqlite://", True),
        ("sqlite:///file::memory:?cache=shared&uri=true", True),
        ("sqlite:///file:tuning?mode=memory&uri=true", True),
        ("sqlite:///study.db", False),
        ("sqlite:////tmp/:memory:.db", False),
        ("postgresql://user@host/db", False),
        ("nonsense", False),
    ],
)
def test_in_memory_recognises_the_sqlite_databases_private_to_a_process(url, memory):
    assert in_memory(url) is memory


def test_write_tuned_never_writes_a_file_that_read_tuned_refuses(tmp_path):
    write_tuned("pointer", {"softmax": _entry()}, tmp_path)
    before = (tmp_path / "pointer.json").read_bytes()
    refused = [
        ({"sofmax": _entry()}, r"unknown row 'sofmax'"),
        ({"sgpa": _entry(hyperparameters={"lrr": 1e-3})}, r"row 'sgpa': unknown hyperparameters \['lrr'\]"),
        ({"sgpa": _entry(trials=0)}, r"row 'sgpa': expected trials to be a positive integer, got 0"),
        ({"sgpa": _entry(best_val_nll=math.inf)}, r"row 'sgpa': expected best_val_nll to be a finite number, got inf"),
        (
            {"sgpa": _entry(study={"tuning_seed": 100, "eval_samples": 2, "load_average": math.nan})},
            r"row 'sgpa': .*JSON",
        ),
        ({"sgpa": _entry(), "softmax": "an entry"}, r"expected the row 'softmax' to be a TunedRow, got str"),
    ]
    for rows, message in refused:
        with pytest.raises(ValueError, match=message):
            write_tuned("pointer", rows, tmp_path)
        assert (tmp_path / "pointer.json").read_bytes() == before  # nothing written, the folder stays readable
    assert read_tuned("pointer", tmp_path) == {"softmax": _entry()}


def test_a_study_joined_with_other_epochs_names_the_changed_hyperparameter(tmp_path):
    storage, lock = _storage(tmp_path)
    hyperparameters = {"epochs": 1, "lr": 3e-3, "weight_decay": 0.01, "batch_size": 64, "patience": 1}
    space = {"lr": {"log_uniform": [3e-4, 1e-2]}, "beta": {"log_uniform": [0.01, 2048]}}
    settings = {"trials": 1, "hyperparameters": hyperparameters, "search_space": space}
    prepare_study(storage, lock, "s", settings, False)
    with pytest.raises(ValueError) as refused:
        prepare_study(storage, lock, "s", {**settings, "hyperparameters": {**hyperparameters, "epochs": 2}}, True)
    message = str(refused.value)
    assert "(hyperparameters.epochs: stored 1, now 2)" in message, message
    # a changed search space: the dimension and its bounds; an added or removed entry: "absent"
    beta = {"log_uniform": [0.01, 4096]}
    changed = {**settings, "search_space": {**space, "beta": beta}, "hyperparameters": {"epochs": 1}, "trials": 2}
    with pytest.raises(ValueError) as refused:
        prepare_study(storage, lock, "s", changed, True)
    assert (
        "(hyperparameters.batch_size: stored 64, now absent; hyperparameters.lr: stored 0.003, now absent; "
        "hyperparameters.patience: stored 1, now absent; hyperparameters.weight_decay: stored 0.01, now absent; "
        "search_space.beta.log_uniform: stored [0.01, 2048], now [0.01, 4096]; trials: stored 1, now 2)"
    ) in str(refused.value)


@pytest.mark.parametrize("label", ["³2x1x2", "٣2x1x2", "３2x1x2", "32x1x2\n", "+32x1x2"])
def test_an_architecture_label_with_non_ascii_digits_is_refused_with_the_documented_message(label):
    try:
        message = f"accepted as {architecture_sizes(label)}"
    except ValueError as error:
        message = str(error)
    assert message.startswith("expected an architecture '<width>x<depth>x<heads>'"), message
