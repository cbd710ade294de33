"""How a comparison grid runs, at its edges (:mod:`gpattn.comparison.runner`, ``local_executor``, ``runs``,
``environment``, ``config`` and ``gpattn compare``): a run's identity (the settings that change its numbers, and only
those), ``--resume`` after a partial grid (exactly the missing runs, whatever the scheduling options), a run that
fails or diverges and a worker process that dies, a record interrupted in the middle of its write, records that do
not depend on the runs before them in a process, the environment block, and the options' errors.

Most tests replace :func:`~gpattn.comparison.train_and_evaluate` by an instant fake run (the scheduling is under
test); those that train use the pointer task, one epoch, two Monte Carlo samples, no fidelity (about a second a run).

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pickle
import sys
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest
import torch

import gpattn.comparison.runs as runs
from gpattn.cli import main
from gpattn.comparison import ClassificationMetrics, CompareConfig, RunMetrics, RunRecord
from gpattn.comparison.environment import code_version, environment_lines, run_environment
from gpattn.comparison.local_executor import LocalExecutor
from gpattn.comparison.runner import (
    RESULT_INDEPENDENT_FIELDS,
    RunFailedError,
    RunsInterrupted,
    execute_runs,
    result_settings,
    run_comparison,
    run_name,
)
from gpattn.training.errors import TrainingDivergedError

#: the smallest real grid: the pointer task, one epoch, two Monte Carlo samples, no fidelity, the shared settings
TINY = dict(tasks=("pointer",), pointer_epochs=1, eval_samples=2, fidelity_sequences=0, progress=False, tuned=False)


# -- helpers -----------------------------------------------------------------------------------------------------------
def _numbers(record: RunRecord) -> dict:
    """Everything of a record but the wall time (which depends on the machine's load)."""
    data = record.to_dict()
    data["train"].pop("seconds")
    return data


def _fake_record(task: str, attention: str, seed: int) -> RunRecord:
    """A record whose test accuracy encodes the seed (0.5 + seed / 100), so that a mixed-up run is seen."""
    test = ClassificationMetrics(**dict.fromkeys(ClassificationMetrics.__dataclass_fields__, 0.5))
    return RunRecord(task, attention, seed, RunMetrics(test=dataclasses.replace(test, accuracy=0.5 + seed / 100)))


class _FakeRuns:
    """Replaces ``runs.train_and_evaluate`` by an instant run; lists the runs started, and raises ``error`` at the
    ``fail_at``-th run (from 1)."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.started: list[str] = []
        self.fail_at, self.error = fail_at, error

    def __call__(self, config, task, attention, seed, **kwargs):
        self.started.append(run_name(task, attention, seed))
        if len(self.started) == self.fail_at:
            raise self.error
        return _fake_record(task, attention, seed)


@pytest.fixture
def fake(monkeypatch) -> _FakeRuns:
    runner = _FakeRuns()
    monkeypatch.setattr(runs, "train_and_evaluate", runner)
    return runner


def _stored(out: Path) -> list[str]:
    """The names of every entry of ``out/runs`` (temporary files included)."""
    return sorted(path.name for path in (out / "runs").iterdir())


# -- a run's identity: every setting that changes its numbers, none that does not ------------------------------------
def test_result_settings_hold_every_field_but_those_that_only_plan_schedule_or_show(tmp_path) -> None:
    """One field changed at a time: the settings a run is identified by change exactly for the fields not in
    RESULT_INDEPENDENT_FIELDS. Every CompareConfig field is listed (but the CUDA-only ones), so that a field added
    later is classified here too."""
    base = CompareConfig(attentions=("softmax",), seeds=(0,), **TINY)
    changed = {
        "attentions": ("kep_svgp",), "tasks": ("digits",), "seeds": (1,), "primary_seeds": (7,),
        "pointer_epochs": 2, "digits_epochs": 3, "mnist1d_epochs": 3, "batch_size": 32, "lr": 1e-3, "embed_dim": 16,
        "depth": 1, "num_heads": 1, "gp_layers": 2, "num_inducing": 4, "eval_samples": 3, "ensemble": 2, "beta": 0.5,
        "ksvd_weight": 0.5, "progress": True, "ece_bins": 7, "temperature_scaling": False, "mc_dropout": 0.2,
        "fidelity_sequences": 8, "threads": 2, "jobs": 2, "smoke_test": True, "compile": True, "tuned": True,
        "tuned_dir": str(tmp_path),
    }  # fmt: skip
    cuda_only = {"device", "cuda_graphs"}  # need a CUDA device
    assert set(changed) | cuda_only == {field.name for field in dataclasses.fields(CompareConfig)}
    settings = result_settings(base)
    for name, value in changed.items():
        if name == "gp_layers":  # at most depth
            other = dataclasses.replace(base, depth=2, gp_layers=2)
            reference = result_settings(dataclasses.replace(base, depth=2))
        elif name == "tuned_dir":  # read by a tuned comparison only (the untuned one: the next test)
            other = dataclasses.replace(base, tuned=True, tuned_dir=value)
            reference = result_settings(dataclasses.replace(base, tuned=True))
        else:
            other, reference = dataclasses.replace(base, **{name: value}), settings
        differs = result_settings(other) != reference
        assert differs == (name not in RESULT_INDEPENDENT_FIELDS), name
    assert "device" in settings and "cuda_graphs" not in settings  # cuda_graphs=False: as in earlier run files


def test_the_fields_left_out_of_a_runs_identity_do_not_change_its_numbers() -> None:
    """progress and smoke_test (and jobs: tests/comparison/test_runner.py) are left out of the identity: a real run
    with them changed gives the same record."""
    plain = run_comparison(CompareConfig(attentions=("softmax",), seeds=(0,), **TINY))
    shown = run_comparison(
        CompareConfig(attentions=("softmax",), seeds=(0,), **{**TINY, "progress": True}, smoke_test=True)
    )
    assert [_numbers(record) for record in shown] == [_numbers(record) for record in plain]


@pytest.mark.parametrize(
    ("name", "value"),
    [("ece_bins", 7), ("temperature_scaling", False), ("mc_dropout", 0.2), ("beta", 0.5), ("threads", 2),
     ("fidelity_sequences", 8), ("lr", 1e-3), ("compile", True)],
)  # fmt: skip
def test_resume_refuses_a_run_made_with_another_result_setting_and_names_it(name, value, tmp_path, fake) -> None:
    config = CompareConfig(attentions=("softmax",), seeds=(0,), **TINY)
    run_comparison(config, out=tmp_path)
    with pytest.raises(ValueError, match=rf"pointer-softmax-0\.json was made with other settings \({name}: stored"):
        run_comparison(dataclasses.replace(config, **{name: value}), out=tmp_path, resume=True)
    assert fake.started == ["pointer-softmax-0"]  # nothing trained by the refused call


def test_an_unread_tuned_dir_is_not_part_of_a_runs_identity(tmp_path, fake) -> None:
    folder = tmp_path / "tuned"
    folder.mkdir()
    config = CompareConfig(attentions=("softmax",), seeds=(0,), **TINY)  # tuned=False: the shared settings
    with_dir = dataclasses.replace(config, tuned_dir=str(folder))
    assert config.hyperparameters("pointer", "softmax") == with_dir.hyperparameters("pointer", "softmax")
    run_comparison(with_dir, out=tmp_path / "out")
    run_comparison(config, out=tmp_path / "out", resume=True)  # the same runs: read back
    assert fake.started == ["pointer-softmax-0"]


# -- --resume after a partial grid ------------------------------------------------------------------------------------
def test_resume_with_other_scheduling_options_and_a_larger_grid_trains_exactly_the_missing_runs(tmp_path, fake) -> None:
    """A grid cut at its third run, resumed with progress on and with a seed and a row more: the stored
    runs are read back (not trained again), each missing run trains once, and the records come in the plan's order
    with each run's own numbers."""
    first = CompareConfig(attentions=("softmax", "kep_svgp"), seeds=(0, 1), **TINY)
    fake.fail_at, fake.error = 3, KeyboardInterrupt()
    with pytest.raises(RunsInterrupted) as interrupted:
        run_comparison(first, out=tmp_path)
    assert (interrupted.value.finished, interrupted.value.total) == (2, 4)
    kept = fake.started[:2]
    assert _stored(tmp_path) == sorted(f"{name}.json" for name in kept)

    fake.started, fake.fail_at = [], None
    larger = CompareConfig(attentions=("softmax", "kep_svgp", "sgpa"), seeds=(0, 1, 2), **{**TINY, "progress": True})
    records = run_comparison(larger, out=tmp_path, resume=True)
    planned = [run_name(*run) for run in runs.plan_runs(larger)]
    assert sorted(fake.started) == sorted(set(planned) - set(kept)) and len(fake.started) == len(set(fake.started))
    assert [run_name(r.task, r.attention, r.seed) for r in records] == planned
    assert [r.metrics.test.accuracy for r in records] == [0.5 + r.seed / 100 for r in records]
    assert _stored(tmp_path) == sorted(f"{name}.json" for name in planned)


def test_a_temporary_file_left_by_a_killed_write_is_not_read_back_as_a_run(tmp_path, fake) -> None:
    """A kill between the write of a record's temporary file and its rename leaves ``.<name>.json.<pid>.<hex>.tmp``
    (half-written): ``--resume`` does not take it for the run, which trains again."""
    config = CompareConfig(attentions=("softmax",), seeds=(0, 1), **TINY)
    run_comparison(dataclasses.replace(config, seeds=(0,)), out=tmp_path)
    (tmp_path / "runs" / ".pointer-softmax-1.json.4242.deadbeef.tmp").write_text('{"format": "gpattn-run/1", "ide')
    records = run_comparison(config, out=tmp_path, resume=True)
    assert fake.started == ["pointer-softmax-0", "pointer-softmax-1"]
    assert [r.seed for r in records] == [0, 1]
    stored = json.loads((tmp_path / "runs" / "pointer-softmax-1.json").read_text())
    assert stored["record"] == records[1].to_dict()


# -- a record interrupted in the middle of its write ------------------------------------------------------------------
def test_ctrl_c_in_the_middle_of_a_records_write_leaves_no_partial_file_and_resume_finishes(
    tmp_path, fake, monkeypatch
) -> None:
    """Ctrl-C after half of the second record's text was written (before the rename): its file is absent (not
    half-written), no temporary file is left, the count says one of two finished, and --resume trains that run only."""
    config = CompareConfig(attentions=("softmax",), seeds=(0, 1), **TINY)
    real_fdopen, calls = os.fdopen, []

    class _HalfThenInterrupt:
        def __init__(self, stream) -> None:
            self.stream = stream

        def write(self, text: str) -> int:
            self.stream.write(text[: len(text) // 2])
            self.stream.flush()
            raise KeyboardInterrupt

        def __enter__(self):
            return self

        def __exit__(self, *exc_info) -> None:
            self.stream.close()

        def __getattr__(self, name):
            return getattr(self.stream, name)

    def fdopen(descriptor, *args, **kwargs):
        stream = real_fdopen(descriptor, *args, **kwargs)
        calls.append(descriptor)
        return _HalfThenInterrupt(stream) if len(calls) == 2 else stream

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(RunsInterrupted) as interrupted:
        run_comparison(config, out=tmp_path)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert (interrupted.value.finished, interrupted.value.total) == (1, 2)
    assert _stored(tmp_path) == ["pointer-softmax-0.json"]
    json.loads((tmp_path / "runs" / "pointer-softmax-0.json").read_text())  # complete
    records = run_comparison(config, out=tmp_path, resume=True)
    assert fake.started == ["pointer-softmax-0", "pointer-softmax-1", "pointer-softmax-1"]
    assert [r.metrics.test.accuracy for r in records] == [0.5, 0.51]


# -- a run that fails or diverges, a worker that dies -----------------------------------------------------------------
def test_a_diverged_run_is_named_with_its_cause_and_the_finished_runs_are_kept(tmp_path, monkeypatch) -> None:
    """The second run diverges: RunFailedError names it, chains the TrainingDivergedError (epoch and step kept), the
    first run's file is kept and nothing else is on disk; --resume trains the failed run and no other."""
    diverged = TrainingDivergedError("training diverged: the loss became NaN at epoch 1, step 3", 1, 3, 0)
    failing = _FakeRuns(fail_at=2, error=diverged)
    monkeypatch.setattr(runs, "train_and_evaluate", failing)
    config = CompareConfig(attentions=("softmax",), seeds=(0, 1, 2), **TINY)
    with pytest.raises(RunFailedError, match=r"^run pointer-softmax-1 failed: training diverged: the loss") as failed:
        run_comparison(config, out=tmp_path)
    assert failed.value.__cause__ is diverged
    assert _stored(tmp_path) == ["pointer-softmax-0.json"]
    again = _FakeRuns()
    monkeypatch.setattr(runs, "train_and_evaluate", again)
    assert [r.seed for r in run_comparison(config, out=tmp_path, resume=True)] == [0, 1, 2]
    assert again.started == ["pointer-softmax-1", "pointer-softmax-2"]


def test_a_divergence_crosses_a_process_boundary_with_its_epoch_and_step() -> None:
    """A worker process (or Ray task) hands its error back pickled: the message, epoch, step and best epoch survive."""
    error = TrainingDivergedError("diverged at epoch 3", epoch=3, step=7, best_epoch=2)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is TrainingDivergedError and str(back) == "diverged at epoch 3"
    assert (back.epoch, back.step, back.best_epoch) == (3, 7, 2)


class _WorkerDies(LocalExecutor):
    """``jobs=2`` whose pool loses a worker process: as ``concurrent.futures`` does then, every call submitted to it
    ends with ``BrokenProcessPool`` (the pool cannot tell which call's process died). A thread pool stands in for the
    processes, which would take seconds to start."""

    def _start_pool(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        queued, self._queued = self._queued, []
        for key, _fn, _args in queued:
            future = concurrent.futures.Future()
            future.set_exception(
                BrokenProcessPool(
                    "A process in the process pool was terminated abruptly while the future was running or pending."
                )
            )
            self._futures[future] = key


def test_a_dead_worker_names_every_run_it_stopped(tmp_path) -> None:
    config = CompareConfig(attentions=("softmax",), seeds=(0, 1), **TINY)
    planned = [("pointer", "softmax", 0), ("pointer", "softmax", 1)]
    with pytest.raises(RunFailedError) as failed:
        execute_runs(config, planned, out=tmp_path, executor=_WorkerDies(jobs=2))
    message = str(failed.value)
    assert message.startswith(
        "a worker process died with the runs pointer-softmax-0, pointer-softmax-1 in its pool (running or waiting "
        "there): A process in the process pool was terminated abruptly"
    ), message
    assert message.endswith("the same command with --resume continues from there"), message


def test_gpattn_compare_says_what_a_failed_run_kept_and_how_to_continue(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(runs, "train_and_evaluate", _FakeRuns(fail_at=2, error=RuntimeError("boom")))
    out = tmp_path / "c"
    argv = ["compare", "--tasks", "pointer", "--attentions", "softmax", "--seeds", "0", "1", "--untuned"]
    status = main([*argv, "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("gpattn compare: error: run pointer-softmax-1 failed: boom")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _stored(out) == ["pointer-softmax-0.json"]
    assert str(out / "runs") in err and "--resume" in err, err


# -- --jobs: a run's record does not depend on the runs before it in its process --------------------------------------
def test_a_runs_record_does_not_depend_on_the_runs_before_it_in_its_process() -> None:
    """A worker runs several runs one after the other, in an order that depends on the scheduling: the record of a
    run after an SGPA and a Laplace run (which fit and sample their own ways) equals the record of that run alone,
    and leaves the thread count as it found it."""
    config = CompareConfig(attentions=("softmax", "sgpa", "laplace"), seeds=(0,), **TINY)
    threads = torch.get_num_threads()
    alone = execute_runs(config, [("pointer", "softmax", 0)])
    after = execute_runs(config, [("pointer", "sgpa", 0), ("pointer", "laplace", 0), ("pointer", "softmax", 0)])
    assert _numbers(after[2]) == _numbers(alone[0])
    assert torch.get_num_threads() == threads


# -- the environment block --------------------------------------------------------------------------------------------
def test_the_environment_block_records_this_processs_versions_threads_and_code() -> None:
    import numpy as np

    environment = run_environment()
    assert environment["torch"] == torch.__version__ and environment["numpy"] == np.__version__
    assert environment["python"] == sys.version.split()[0]
    assert environment["threads"] == {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
    assert {key: environment[key] for key in ("gpattn", "git_commit")} == code_version()
    assert environment["machine"]["cores"] == os.cpu_count()
    json.dumps(environment, allow_nan=False)  # strict JSON, as results.json


def test_the_environment_block_records_the_cuda_version_and_the_gpu(monkeypatch) -> None:
    properties = type("Properties", (), {"name": "NVIDIA H200", "total_memory": 150 * 2**30, "major": 9, "minor": 0})
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    environment = run_environment()
    assert environment["cuda"] == {"cuda": "12.8", "cudnn": environment["cuda"]["cudnn"], "devices": ["NVIDIA H200"]}
    assert "* CUDA 12.8, cuDNN " in "\n".join(environment_lines(environment))
    assert "GPUs: NVIDIA H200" in "\n".join(environment_lines(environment))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine: no GPU entry, no line
    assert run_environment()["cuda"] is None and not any(
        "CUDA" in line for line in environment_lines(run_environment())
    )


# -- options -----------------------------------------------------------------------------------------------------------
def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as error:
        return error.code


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--seeds"], "argument --seeds: expected at least one argument"),
        (["--attentions"], "argument --attentions: expected at least one argument"),
        (["--tasks"], "argument --tasks: expected at least one argument"),
        (["--attentions", "softmax", "kep-svgp"], "argument --attentions: invalid choice: 'kep-svgp'"),
        (["--seeds", "0", "1", "0"], "distinct seeds, got [0, 1, 0]"),
        (["--jobs", "0"], "argument --jobs: expected the value to be a positive integer, got 0"),
        (["--threads", "-1"], "argument --threads: expected the value to be a positive integer, got -1"),
        (
            ["--seeds", str(2**64)],
            "argument --seeds: expected the value to be a non-negative integer at most 2**64 - 1",
        ),
        (["--ece-bins", "1.5"], "argument --ece-bins: expected the value to be a positive integer, got '1.5'"),
    ],
)
def test_bad_grid_options_are_named_and_nothing_runs(argv, fragment, tmp_path, capsys, fake) -> None:
    assert _status(["compare", "--tasks", "pointer", *argv, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err
    assert fake.started == [] and not (tmp_path / "c").exists()


@pytest.mark.parametrize("value", ["1.5", "0"])
def test_an_out_of_range_mc_dropout_names_the_option(value, tmp_path, capsys, fake) -> None:
    argv = ["compare", "--tasks", "pointer", "--attentions", "softmax_mc_dropout", "--mc-dropout", value]
    assert _status([*argv, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert fake.started == []
    assert "--mc-dropout" in err, err
