"""``gpattn tune``: the search space of the protocol, the tuner never reads the test split, the same number of
trials for every row, resume runs only the missing trials, and several processes share one study without duplicates.

The studies run on the pointer task with one or two epochs per trial (a few seconds each).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
from optuna.trial import TrialState

from gpattn.comparison import load_task
from gpattn.comparison import tuning as tuning_module
from gpattn.comparison.environment import code_label, code_version
from gpattn.comparison.sealed_split import SealedSplit, tuning_data
from gpattn.comparison.studies import StudyLock, TrialsFromOtherCodeWarning, open_storage, prepare_study
from gpattn.comparison.tune_config import TuneConfig
from gpattn.comparison.tuning import TuningInterrupted, run_trial, study_name, tune
from gpattn.comparison.tuning_space import (
    ARCHITECTURES,
    PARAMETER_BUDGET,
    TUNED_ROWS,
    architecture_sizes,
    search_space,
)
from gpattn.methods import get_method
from gpattn.models import Transformer
from gpattn.validation import InputTypeError

ROWS = ("softmax", "kep_svgp")
TINY = dict(tasks=("pointer",), rows=ROWS, trials=3, pointer_epochs=1, patience=1, eval_samples=2, progress=False)
#: entries of a study's record that depend on the clock, the machine's load or the date
CLOCK = ("wall_seconds", "trial_seconds", "trial_cpu_seconds", "load_average", "date")


def _comparable(summaries):
    """The summaries without the clock-dependent entries of their study records."""
    out = {}
    for key, summary in summaries.items():
        study = {name: value for name, value in summary.study.items() if name not in CLOCK}
        out[key] = dataclasses.replace(summary, study=study)
    return out


def _trials(out: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    storage = optuna.storages.RDBStorage(f"sqlite:///{out / 'study.db'}")
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted tuning of :data:`ROWS` on the pointer task: ``(out, summaries)``."""
    out = tmp_path_factory.mktemp("tune")
    tuning_module._DATA.clear()
    return out, tune(TuneConfig(**TINY), out)


# -- the search space --------------------------------------------------------------------------------------------------
def _signal_softmax_parameters(width: int, depth: int) -> int:
    """Closed form of the parameter count of PROTOCOL.md's MNIST-1D model with softmax attention: a stem of two
    kernel-5 convolutions (1 -> w, w -> w) with biases, 20 position embeddings, per block two LayerNorms, the
    q/k/v/out projections and a 2w-wide MLP, the final LayerNorm and a 10-class head."""
    stem = (5 * width + width) + (5 * width * width + width)
    block = 2 * 2 * width + 4 * (width * width + width) + (2 * width * width + 2 * width) + (2 * width * width + width)
    return stem + 20 * width + depth * block + 2 * width + 10 * width + 10


def test_architectures_are_the_candidates_within_the_parameter_budget():
    grid = [(width, depth, heads) for width in (32, 48, 64) for depth in (1, 2, 3, 4) for heads in (2, 4)]
    within = []
    for width, depth, heads in grid:
        model = Transformer(
            10,
            embed_dim=width,
            depth=depth,
            num_heads=heads,
            attention="softmax",
            input="signal",
            input_dim=1,
            max_len=40,
        )
        count = sum(parameter.numel() for parameter in model.parameters())
        assert count == _signal_softmax_parameters(width, depth)
        if count <= PARAMETER_BUDGET:
            within.append(f"{width}x{depth}x{heads}")
    assert list(ARCHITECTURES) == within
    assert _signal_softmax_parameters(32, 2) == 23_466  # the protocol's base model (~23.5k)
    assert architecture_sizes("64x1x4") == {"embed_dim": 64, "depth": 1, "num_heads": 4}
    with pytest.raises(ValueError, match="'<width>x<depth>x<heads>'"):
        architecture_sizes("64x1")


def test_the_search_space_is_the_protocols():
    n = 3600
    shared = {
        "lr": {"log_uniform": [3e-4, 1e-2]},
        "weight_decay": {"log_uniform": [1e-4, 0.3]},
        "dropout": {"uniform": [0.0, 0.3]},
        "architecture": {"choice": list(ARCHITECTURES)},
    }
    beta, eta = {"beta": {"log_uniform": [1e-2, n]}}, {"ksvd_weight": {"log_uniform": [1e-2, 1e2]}}
    expected = {
        "softmax": shared,
        "softmax_mc_dropout": shared,
        "sgpa": {**shared, **beta, "kl_anneal_fraction": {"choice": [0.0, 0.25, 0.5]}},
        "kep_svgp": {**shared, **beta, **eta},
        "kep_svgp_paper": {**shared, **beta, **eta},
        "primal": {**shared, **eta},
        "primal_paper": {**shared, **eta},
    }
    assert set(TUNED_ROWS) == set(expected)
    for row, space in expected.items():
        assert {parameter.name: parameter.describe() for parameter in search_space(row, n)} == space, row
    # beta = 1 (the ELBO weight 1/n of CE + (beta / n) KL) and beta = n (the official per-batch weight) are inside
    kl_weight = search_space("kep_svgp", n)[4]
    assert kl_weight.contains(1.0) and kl_weight.contains(float(n)) and not kl_weight.contains(n + 1.0)


def test_beta_is_searched_only_where_the_layer_has_a_kl_term():
    """CGPT is stochastic but has no KL (``kl_divergence()`` is zero; its regulariser is ``cgp_weight``): beta was
    searched there, a dimension that changed nothing. SVGP's layer has one."""
    names = {row: [parameter.name for parameter in search_space(row, 100)] for row in ("cgpt", "svgp", "kep_svgp_sym")}
    assert "beta" not in names["cgpt"] and "beta" in names["svgp"] and "beta" in names["kep_svgp_sym"]


# -- the test split is never read --------------------------------------------------------------------------------------
def test_the_sealed_test_split_refuses_every_access():
    sealed = tuning_data(load_task("pointer")).test
    assert isinstance(sealed, SealedSplit)
    for access in (lambda: sealed.labels, lambda: len(sealed), lambda: sealed[0], lambda: list(sealed)):
        with pytest.raises(RuntimeError, match="never reads the test split"):
            access()
    data = tuning_data(load_task("digits", test_size=4))
    assert data.shifted == {} and data.ood == {} and len(data.train) == 866 and len(data.val) == 216


def test_permuted_test_labels_leave_the_tuning_bit_identical(reference, tmp_path, monkeypatch):
    def permuted(task, seed=0, test_size=None):
        data = load_task(task, seed)  # the whole test split, whatever the tuner asks for
        labels = data.test.labels[torch.randperm(len(data.test), generator=torch.Generator().manual_seed(1))]
        assert not torch.equal(labels, data.test.labels)
        return dataclasses.replace(data, test=dataclasses.replace(data.test, labels=labels))

    monkeypatch.setattr(tuning_module, "load_task", permuted)
    monkeypatch.setattr(tuning_module, "_DATA", {})
    summaries = tune(TuneConfig(**TINY), tmp_path)
    out, expected = reference
    assert _comparable(summaries) == _comparable(expected)
    for row in ROWS:
        first, second = _trials(out, study_name("pointer", row)), _trials(tmp_path, study_name("pointer", row))
        assert [(trial.params, trial.value) for trial in first] == [(trial.params, trial.value) for trial in second]


# -- the budget ----------------------------------------------------------------------------------------------------
def test_every_row_gets_the_same_number_of_trials(reference):
    out, summaries = reference
    for row in ROWS:
        trials = _trials(out, study_name("pointer", row))
        assert [trial.state for trial in trials] == [TrialState.COMPLETE] * 3
        assert summaries["pointer", row].trials == 3
        best = min(trials, key=lambda trial: trial.value)
        assert summaries["pointer", row].best_val_nll == best.value
        assert summaries["pointer", row].parameters == best.params
        records = sorted((out / "trials").glob(f"pointer-{row}-*.json"))
        assert len(records) == 3
        assert json.loads(records[0].read_text())["value"] == trials[0].value
    written = json.loads((out / "tuned" / "pointer.json").read_text())
    assert list(written["rows"]) == ["kep_svgp", "softmax"]  # the registry's order
    hyperparameters = written["rows"]["kep_svgp"]["hyperparameters"]
    assert hyperparameters["epochs"] == 1 and hyperparameters["patience"] == 1
    assert set(hyperparameters) == {"epochs", "patience", "lr", "weight_decay", "dropout", "beta", "ksvd_weight"} | {
        "embed_dim",
        "depth",
        "num_heads",
    }


def test_resume_runs_only_the_missing_trials(reference, tmp_path, monkeypatch):
    calls = []

    def interrupted(config, data, row, parameters):
        calls.append(row)
        if len(calls) == 5:  # the second trial of kep_svgp
            raise KeyboardInterrupt
        return run_trial(config, data, row, parameters)

    monkeypatch.setattr(tuning_module, "run_trial", interrupted)
    with pytest.raises(TuningInterrupted) as stopped:
        tune(TuneConfig(**TINY), tmp_path)
    assert (stopped.value.finished, stopped.value.total) == (4, 6)
    states = [trial.state for trial in _trials(tmp_path, study_name("pointer", "kep_svgp"))]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]

    calls.clear()
    summaries = tune(TuneConfig(**TINY), tmp_path, resume=True)
    assert calls == ["kep_svgp", "kep_svgp"]  # the waiting trial and the failed one's replacement
    # one worker: the resumed studies drew and scored what the uninterrupted ones did (under other trial numbers)
    out, expected = reference
    for row in ROWS:
        resumed, uninterrupted = (
            [(trial.params, trial.value) for trial in _trials(folder, study_name("pointer", row)) if trial.value]
            for folder in (tmp_path, out)
        )
        assert resumed == uninterrupted, row
        first, second = summaries["pointer", row], expected["pointer", row]
        assert (first.parameters, first.best_val_nll, first.trials) == (second.parameters, second.best_val_nll, 3)
        assert first.hyperparameters == second.hyperparameters
    assert summaries["pointer", "kep_svgp"].study["failed_trials"] == 1


def test_a_study_with_other_settings_is_refused(reference, tmp_path):
    out, _ = reference
    copy = tmp_path / "study.db"
    copy.write_bytes((out / "study.db").read_bytes())
    with pytest.raises(ValueError, match=r"trials: stored 3, now 4"):
        tune(TuneConfig(**{**TINY, "trials": 4}), tmp_path, resume=True)


def test_resume_warns_of_trials_run_by_other_code_and_counts_each_code(reference, tmp_path, monkeypatch):
    out, expected = reference
    here = code_label(code_version())
    assert expected["pointer", "kep_svgp"].study["trial_codes"] == {here: 3}
    (tmp_path / "study.db").write_bytes((out / "study.db").read_bytes())
    assert tune(TuneConfig(**TINY), tmp_path, resume=True)["pointer", "softmax"].study["trial_codes"] == {here: 3}

    other = {"gpattn": "0.0.1", "git_commit": "0123abc"}
    monkeypatch.setattr(tuning_module, "code_version", lambda: other)
    with pytest.warns(TrialsFromOtherCodeWarning, match=rf"pointer-softmax: 3 by {re.escape(here)}; pointer-kep_svgp"):
        summaries = tune(TuneConfig(**{**TINY, "trials": 3}), tmp_path, resume=True)
    assert summaries["pointer", "softmax"].study["trial_codes"] == {here: 3}
    # each trial's record file names the code of the process that ran the study
    assert json.loads((out / "trials" / "pointer-softmax-0.json").read_text())["code"] == code_version()


def test_a_diverged_trial_scores_infinity_and_says_why():
    data = tuning_data(load_task("pointer"))
    config = TuneConfig(**TINY)
    record = run_trial(config, data, "softmax", {"lr": 1e9, "architecture": "32x1x2"})
    assert record["value"] is None and "diverged" in record["diverged"]
    good = run_trial(config, data, "softmax", {"lr": 1e-3, "architecture": "32x1x2"})
    assert math.isfinite(good["value"]) and good["diverged"] == "" and good["epochs"] == 1


# -- workers and processes sharing a study -------------------------------------------------------------------------
def test_two_tune_processes_on_one_sqlite_study_finish_the_budget_without_duplicates(tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    argv = [sys.executable, "-m", "gpattn.cli", "tune", "--tasks", "pointer", "--rows", "softmax", "--trials", "6"]
    argv += ["--pointer-epochs", "1", "--eval-samples", "2", "--storage", storage, "--no-progress"]
    processes = [
        subprocess.Popen([*argv, "--out", str(tmp_path / name), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, extra in (("a", ["--jobs", "2"]), ("b", []))
    ]
    for process in processes:
        _, error = process.communicate(timeout=600)
        assert process.returncode == 0, error.decode()[-2000:]
    study = optuna.load_study(study_name="pointer-softmax", storage=storage)
    trials = study.get_trials(deepcopy=False)
    assert [trial.state for trial in trials] == [TrialState.COMPLETE] * 6  # exactly the budget, nothing else
    numbers = [int(path.stem.rsplit("-", 1)[1]) for name in "ab" for path in (tmp_path / name / "trials").glob("*")]
    assert sorted(numbers) == list(range(6))  # each trial ran once, in one of the processes
    assert len({json.dumps(trial.params, sort_keys=True) for trial in trials}) == 6


def test_mnist1d_trials_use_the_tuning_seeds_validation_split_and_the_tasks_defaults():
    data = tuning_module._data("mnist1d", 100)
    assert data.seed == 100 and not torch.equal(data.val.labels, load_task("mnist1d", 0).val.labels)
    config = TuneConfig(tasks=("mnist1d",))
    tuning_module.check_search_space(config, "mnist1d", data)  # every row's layer in every architecture
    hyperparameters = config.trial_hyperparameters("mnist1d", get_method("kep_svgp"), {"lr": 1e-3}, data.defaults)
    assert (hyperparameters.num_inducing, hyperparameters.epochs, hyperparameters.patience) == (5, 60, 15)


# -- settings of the wrong type ----------------------------------------------------------------------------------------
def test_numpy_integer_settings_are_stored_as_python_ints():
    # np.int64 trials reached the study's settings: tune raised "Object of type int64 is not JSON serializable" after
    # creating the study, which every later run then refused ("has no gpattn tune settings")
    names = ("trials", "seed", "pointer_epochs", "patience", "eval_samples", "threads", "jobs")
    config = TuneConfig(**{**TINY, **{name: np.int64(value) for name, value in (*TINY.items(), ("seed", 101))
                                      if name in names}})  # fmt: skip
    assert all(type(getattr(config, name)) is int for name in names)
    assert json.loads(json.dumps(config.budget("pointer"))) == {
        "trials": 3, "tuning_seed": 101, "epochs": 1, "patience": 1, "eval_samples": 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tasks": "pointer"}, "expected tasks to be a sequence of names, got the string 'pointer'"),
        ({"rows": "softmax"}, "expected rows to be a sequence of names, got the string 'softmax'"),
        ({"rows": None}, "expected rows to be a sequence of names, got None"),
        ({"progress": "no"}, "expected progress to be a bool"),
    ],
)
def test_tune_config_refuses_a_bare_string_or_a_non_bool_by_name(settings, message):
    # tasks="pointer" was the tasks 'p', 'o', ... ("expected tasks to be one of [...], got 'p'"); rows=None a bare
    # "'NoneType' object is not iterable"
    with pytest.raises(InputTypeError, match=rf"TuneConfig: {message}"):
        TuneConfig(**{**TINY, **settings})


def test_a_study_is_not_made_with_settings_that_are_not_json(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage, lock = open_storage(url), StudyLock(url)
    with pytest.raises(InputTypeError, match=r"prepare_study: expected the settings of 'pointer-softmax' to be JSON"):
        prepare_study(storage, lock, "pointer-softmax", {"trials": 2, "seed": np.int64(100)}, False)
    assert optuna.get_all_study_names(storage) == []  # nothing left that a later run would refuse


def test_ctrl_c_while_a_study_is_made_waits_for_its_settings(tmp_path, monkeypatch):
    # Ctrl-C between the queued trials and the settings left a study that every later run refused
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage, lock = open_storage(url), StudyLock(url)
    enqueue = optuna.Study.enqueue_trial

    def interrupted(study, *args, **kwargs):
        enqueue(study, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(optuna.Study, "enqueue_trial", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_study(storage, lock, "pointer-softmax", {"trials": 2}, False)
    study = optuna.load_study(study_name="pointer-softmax", storage=storage)
    assert study.user_attrs["settings"] == {"trials": 2} and len(study.get_trials()) == 2
    prepare_study(storage, lock, "pointer-softmax", {"trials": 2}, True)  # joined, not refused


def test_a_nan_trial_value_counts_as_diverged() -> None:
    """Optuna's ``tell`` records a NaN value as a failed trial (with a warning): ``finish_trial`` then took the
    ``min()`` of no finished trial (ValueError after the trial had trained) and ``--resume`` would have run it again."""
    from gpattn.comparison.studies import finish_trial

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    lock = StudyLock("sqlite:///:memory:")
    assert finish_trial(study, study.ask(), lock, float("nan"), {"diverged": "nan"}) == math.inf
    assert finish_trial(study, study.ask(), lock, 0.5, {}) == 0.5
    assert [(trial.state, trial.value) for trial in study.trials] == [
        (TrialState.COMPLETE, math.inf),
        (TrialState.COMPLETE, 0.5),
    ]
