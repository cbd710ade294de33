"""``gpattn tune`` on the command line: the help states the defaults, the search space and the cost; bad options and
an unreachable storage are one line before any training; a run writes the tuned files; Ctrl-C says what was kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from collections import Counter

import optuna
import pytest

import gpattn.comparison.tuned_configuration as tuned_module
import gpattn.comparison.tuning as tuning_module
from gpattn.cli import main
from gpattn.comparison.tune_config import TuneConfig
from gpattn.comparison.tuning_space import ARCHITECTURES, TUNED_ROWS
from gpattn.methods import get_method

TINY = ["tune", "--tasks", "pointer", "--rows", "softmax", "--trials", "2", "--pointer-epochs", "1"]
TINY += ["--eval-samples", "2", "--no-progress"]


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a trial was trained")

    monkeypatch.setattr(tuning_module, "run_trial", refuse)


def test_help_states_the_defaults_the_search_space_and_the_cost():
    completed = subprocess.run(
        [sys.executable, "-m", "gpattn.cli", "tune", "--help"], capture_output=True, text=True, check=True
    )
    text = "".join(completed.stdout.split())  # argparse wraps lines, also at hyphens
    for stated in (
        "the same for every row (default: 20)",
        f"(default: {' '.join(TUNED_ROWS)})",
        "lr log-uniform [0.0003, 0.01]",
        "beta log-uniform [0.01, n] for sgpa, kep_svgp, kep_svgp_paper",
        " ".join(ARCHITECTURES),
        "patience 15",
        "Cost, measured with one torch thread per trial",
        "about 5 CPU-hours",
        "sqlite:///OUT/study.db",
    ):
        assert "".join(stated.split()) in text, stated


@pytest.mark.parametrize(
    "storage",
    ["postgresql+nonexistentdriver://nobody@127.0.0.1:1/none", "sqlite:////nonexistent-folder/study.db", "nonsense"],
)
def test_an_unreachable_storage_is_one_line_before_any_training(storage, tmp_path, capsys, no_training):
    assert main([*TINY, "--out", str(tmp_path), "--storage", storage]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"gpattn tune: error: cannot open the study storage {storage!r}: ")
    assert error.count("\n") == 1 and "Traceback" not in error


def test_a_storage_password_is_not_printed(tmp_path, capsys, no_training):
    # --help suggests postgresql://user:password@host/db: the password stays out of the message (and of logs)
    storage = "postgresql+nonexistentdriver://user:secret@127.0.0.1:1/db"
    assert main([*TINY, "--out", str(tmp_path), "--storage", storage]) == 1
    error = capsys.readouterr().err
    assert "secret" not in error and "'postgresql+nonexistentdriver://user:***@127.0.0.1:1/db'" in error


def test_a_refused_start_leaves_the_out_folder_for_the_corrected_command(tmp_path, capsys):
    # a study made with other settings refuses the start; the folder it would have written to stays empty, so the
    # corrected command is not refused as "already holds files (trials)"
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    assert main([*TINY, "--out", str(tmp_path / "first"), "--storage", storage]) == 0
    other = [("3" if index == TINY.index("--trials") + 1 else value) for index, value in enumerate(TINY)]
    capsys.readouterr()
    assert main([*other, "--out", str(tmp_path / "second"), "--storage", storage, "--resume"]) == 1
    assert "other settings" in capsys.readouterr().err
    assert not (tmp_path / "second" / "trials").exists()


def test_the_default_study_file_is_inside_an_out_folder_with_a_query_character(tmp_path):
    # the SQLite URL is built, not formatted: "q?x=1" is a folder name, not a URL query (it wrote tmp_path / "q")
    out = tmp_path / "q?x=1"
    assert main([*TINY, "--out", str(out)]) == 0
    assert (out / "study.db").is_file() and not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (["--rows", "nope"], "expected rows to be one of"),
        (["--rows", "deep_ensemble"], "uses the tuned configuration of the row 'softmax'"),
        (["--seed", "3"], "must not be an evaluation seed (0-9) nor a member seed of their ensembles (0-49), got 3"),
        (["--seed", "12"], "nor a member seed of their ensembles (0-49), got 12"),
        (["--seed", "5000000"], "argument --seed: expected the value to be an integer in [0, 4294967]"),
        (["--trials", "0"], "--trials: expected the value to be a positive integer"),
        (["--storage", ""], "--storage: expected an Optuna RDB URL, e.g. sqlite:///study.db, got ''"),  # the default
    ],
)
def test_bad_options_are_one_line_with_status_2(argument, message, tmp_path, capsys, no_training):
    try:
        status = main([*TINY, "--out", str(tmp_path), *argument])
    except SystemExit as exit:  # a value the parser refuses
        status = exit.code
    error = capsys.readouterr().err
    assert status == 2 and message in error and "Traceback" not in error
    assert not (tmp_path / "study.db").exists()


class _Reached(Exception):
    """The tuning was reached: what the test checks happened before it."""


@pytest.mark.parametrize("storage", [False, True])
def test_resume_of_an_empty_out_warns_unless_the_studies_are_in_a_storage(storage, tmp_path, monkeypatch):
    from gpattn.cli.options import NothingToResume

    def reached(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(tuning_module, "tune", reached)
    argv = [*TINY, "--out", str(tmp_path / "out"), "--resume"]
    if storage:  # the studies live in the storage: an empty OUT is the documented set-up, not a typo
        argv += ["--storage", f"sqlite:///{tmp_path / 'shared.db'}"]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(_Reached):
        warnings.simplefilter("always")
        main(argv)
    resumed = [warning for warning in caught if issubclass(warning.category, NothingToResume)]
    assert len(resumed) == (0 if storage else 1)


def test_write_tuned_with_another_budget_than_the_files_rows_is_refused_before_any_trial(
    tmp_path, capsys, monkeypatch, no_training
):
    # the package's file holds sgpa tuned with 3 trials of 4 epochs: softmax with 2 trials of 1 epoch would sit beside
    # it under "tuned"
    package = tmp_path / "package"
    monkeypatch.setattr(tuned_module, "TUNED_DIRECTORY", package)
    sgpa = tuned_module.TunedRow(
        hyperparameters={"epochs": 4, "patience": 2},
        parameters={},
        best_val_nll=0.5,
        best_trial=0,
        trials=3,
        search_space={},
        study={"tuning_seed": 100, "eval_samples": 2},
    )
    tuned_module.write_tuned("pointer", {"sgpa": sgpa}, package)
    status = main([*TINY, "--out", str(tmp_path / "run"), "--write-tuned"])
    error = capsys.readouterr().err
    assert status == 2 and "the row 'softmax' is tuned with another budget than the row 'sgpa'" in error
    assert "epochs 1 (theirs 4)" in error and "trials 2 (theirs 3)" in error and "patience" in error
    assert not (tmp_path / "run").exists()


def test_an_in_memory_storage_with_two_workers_is_a_bad_option(tmp_path, capsys, no_training):
    status = main([*TINY, "--out", str(tmp_path / "run"), "--storage", "sqlite:///:memory:", "--jobs", "2"])
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1, error
    assert error.startswith("gpattn tune: error: the storage 'sqlite:///:memory:' (--storage) is an SQLite database ")
    assert "(--jobs 2)" in error and not (tmp_path / "run").exists()


def test_a_row_whose_every_trial_diverged_keeps_the_other_rows_and_exits_1(tmp_path, capsys, monkeypatch):
    # kep_svgp diverges in every trial: softmax's configuration is written (also into the package), the command says
    # which study diverged in one line and exits 1; --resume does the same without training
    package = tmp_path / "package"
    monkeypatch.setattr(tuned_module, "TUNED_DIRECTORY", package)
    trained = []

    def fake(config, data, row, parameters):
        trained.append(row)
        hyperparameters = config.trial_hyperparameters(data.name, get_method(row), parameters, data.defaults)
        value = None if row == "kep_svgp" else parameters["lr"]
        record = {"parameters": parameters, "hyperparameters": hyperparameters.to_dict(), "value": value}
        record.update(diverged="" if value else "injected", best_epoch=1, epochs=1, history=[])
        return {**record, "seconds": 0.0, "cpu_seconds": 0.0}

    monkeypatch.setattr(tuning_module, "run_trial", fake)
    out = tmp_path / "run"
    argv = [*TINY, "--rows", "softmax", "kep_svgp", "--out", str(out), "--write-tuned"]
    for resume in ([], ["--resume"]):
        assert main([*argv, *resume]) == 1
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and captured.err.startswith(
            "gpattn tune: error: every trial of the study 'pointer-kep_svgp' diverged: no configuration to choose; "
            f"the other rows' tuned configurations are written to {out / 'tuned'}; "
        ), captured.err
        assert "pointer/softmax: best validation NLL" in captured.out
        assert "pointer/kep_svgp: every trial diverged, no configuration" in captured.out
        assert f"wrote {out / 'tuned' / 'pointer.json'}, {package / 'pointer.json'}" in captured.out
        for folder in (out / "tuned", package):
            rows = json.loads((folder / "pointer.json").read_text())["rows"]
            assert list(rows) == ["softmax"] and rows["softmax"]["trials"] == 2
    assert trained == ["softmax", "softmax", "kep_svgp", "kep_svgp"]  # the resume trained nothing


def test_a_run_writes_the_tuned_files_and_resume_adds_nothing(tmp_path, capsys, monkeypatch):
    package = tmp_path / "package"
    monkeypatch.setattr(tuned_module, "TUNED_DIRECTORY", package)
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--write-tuned", "--label", "a smoke run"]) == 0
    printed = capsys.readouterr().out
    assert "pointer/softmax: best validation NLL" in printed and "(trial " in printed and "of 2)" in printed
    written = json.loads((out / "tuned" / "pointer.json").read_text())
    assert written == json.loads((package / "pointer.json").read_text())
    entry = written["rows"]["softmax"]
    assert entry["trials"] == 2 and entry["study"]["label"] == "a smoke run" and entry["study"]["tuning_seed"] == 100
    # the budget read back from the row is the one the command's config states (the --write-tuned check compares them)
    budget = {"trials": 2, "tuning_seed": 100, "epochs": 1, "patience": 15, "eval_samples": 2}
    assert tuned_module.tuning_budget(tuned_module.TunedRow.from_dict(entry, "pointer.json")) == budget
    config = TuneConfig(tasks=("pointer",), rows=("softmax",), trials=2, pointer_epochs=1, eval_samples=2)
    assert config.budget("pointer") == budget
    assert sorted(path.name for path in (out / "trials").iterdir()) == [
        "pointer-softmax-0.json",
        "pointer-softmax-1.json",
    ]

    assert main([*TINY, "--out", str(out)]) == 1  # an earlier run is not replaced silently
    assert "already holds files" in capsys.readouterr().err

    monkeypatch.setattr(tuning_module, "run_trial", None)  # nothing is left to train
    assert main([*TINY, "--out", str(out), "--resume"]) == 0
    assert (
        json.loads((out / "tuned" / "pointer.json").read_text())["rows"]["softmax"]["best_val_nll"]
        == entry["best_val_nll"]
    )


def test_ctrl_c_keeps_the_finished_trials_and_says_how_to_continue(tmp_path, capsys, monkeypatch):
    calls = []
    real = tuning_module.run_trial

    def interrupted(*args):
        calls.append(None)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(tuning_module, "run_trial", interrupted)
    assert main([*TINY, "--out", str(tmp_path)]) == 130
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"gpattn tune: interrupted; 1 of 2 trials finished, kept in {tmp_path / 'study.db'}; the same command with "
        "--resume continues"
    )


def test_sigint_during_jobs_2_fails_the_trials_in_flight_and_resume_completes_the_budget(tmp_path):
    """A real Ctrl-C (SIGINT to the process group) while two trial workers run, then ``--resume``."""
    # trials of 4 epochs: the signal lands while trials remain, however late this process reads the first line
    argv = [sys.executable, "-m", "gpattn.cli", *TINY[:6], "6", "--pointer-epochs", "4", "--eval-samples", "2"]
    argv += ["--jobs", "2", "--out", str(tmp_path)]
    # SIGINT at its default in the child, also when this suite runs in a background job (which ignores SIGINT,
    # and a Python started with SIGINT ignored never raises KeyboardInterrupt)
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=restore)
    first = process.stderr.readline()
    assert first.startswith("[1/6] pointer/softmax trial "), first
    os.killpg(process.pid, signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 130
    assert "Traceback" not in rest and rest.splitlines()[-1].startswith("gpattn tune: interrupted; ")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    states = Counter(
        trial.state.name for trial in optuna.load_study(study_name="pointer-softmax", storage=storage).trials
    )
    assert states["RUNNING"] == 0 and 1 <= states["COMPLETE"] < 6  # the trials in flight were marked failed

    resumed = subprocess.run([*argv, "--resume", "--jobs", "1"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    trials = optuna.load_study(study_name="pointer-softmax", storage=storage).trials
    complete = [trial for trial in trials if trial.state.name == "COMPLETE"]
    assert len(complete) == 6 and {trial.state.name for trial in trials} <= {"COMPLETE", "FAIL"}
    assert len({json.dumps(trial.params, sort_keys=True) for trial in complete}) == 6  # no configuration twice


def test_a_failing_trial_with_two_workers_is_one_line_without_a_traceback(tmp_path):
    # the parent terminates the workers on a failure: the worker that reported it, exiting, raised KeyboardInterrupt
    # from its SIGTERM handler (a traceback beside the line); killing it instead could hang the other worker
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import gpattn.comparison.tuning as tuning\n"
        "original = tuning.run_trial\n"
        "def run_trial(config, data, row, parameters):\n"
        "    if row == 'sgpa':\n"
        "        raise RuntimeError('injected failure')\n"
        "    return original(config, data, row, parameters)\n"
        "tuning.run_trial = run_trial\n"
    )
    command = [sys.executable, "-m", "gpattn.cli", *TINY, "--rows", "softmax", "sgpa", "--jobs", "2"]
    command += ["--out", str(tmp_path / "run")]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=240)
    assert completed.returncode == 1, completed.stderr
    assert "trial 0 of pointer-sgpa failed: injected failure" in completed.stderr
    assert "Traceback" not in completed.stderr and "KeyboardInterrupt" not in completed.stderr, completed.stderr


def test_the_storage_help_says_overwrite_leaves_its_studies(capsys) -> None:
    # --overwrite deletes OUT's study.db, not the studies of an external --storage, which a new tuning joins
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--overwrite replaces OUT only: the studies of a --storage stay, and a new tuning with the same" in text
