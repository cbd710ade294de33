"""Scheduling of the comparison (gpattn/comparison/runner.py): parallel runs give the same records as serial ones,
finished runs are written at once and read back on resume, interruptions and failures keep what finished."""

from __future__ import annotations

import json
import math
import warnings

import pytest

import gpattn.comparison.runs as runs
from gpattn.comparison import ClassificationMetrics, CompareConfig, RunMetrics, RunRecord
from gpattn.comparison.environment import run_file_codes
from gpattn.comparison.records import write_json_atomically
from gpattn.comparison.report import write_outputs
from gpattn.comparison.runner import (
    RunFailedError,
    RunsInterrupted,
    result_settings,
    run_comparison,
    run_name,
    settings_hash,
)

TINY = dict(attentions=("softmax", "kep_svgp"), tasks=("pointer",), pointer_epochs=1, eval_samples=2, progress=False)


def _numbers(record: RunRecord) -> dict:
    """Everything of a record but the wall time (which depends on the machine's load)."""
    data = record.to_dict()
    data["train"].pop("seconds")
    return data


def _refuse(token: str) -> float:
    raise ValueError(f"not strict JSON: {token}")


@pytest.fixture(scope="module")
def serial() -> list[RunRecord]:
    return run_comparison(CompareConfig(seeds=(0, 1), **TINY))


def test_parallel_jobs_give_the_serial_records(serial, tmp_path) -> None:
    parallel = run_comparison(CompareConfig(seeds=(0, 1), jobs=2, **TINY), out=tmp_path)
    assert [(r.task, r.attention, r.seed) for r in parallel] == [(r.task, r.attention, r.seed) for r in serial]
    assert [_numbers(r) for r in parallel] == [_numbers(r) for r in serial]
    # each run's record was written as it finished, with the settings that made it
    for record in parallel:
        stored = json.loads(
            (tmp_path / "runs" / f"{run_name(record.task, record.attention, record.seed)}.json").read_text()
        )
        assert stored["record"] == record.to_dict()
        assert stored["settings"]["threads"] == 1 and "jobs" not in stored["settings"]


class _CountingRuns:
    """Replaces runs.train_and_evaluate: counts the runs, and raises ``error`` at run ``fail_at`` (from 1)."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None) -> None:
        self.original = runs.train_and_evaluate
        self.fail_at, self.error, self.started = fail_at, error, []

    def __call__(self, config, task, attention, seed, **kwargs):
        self.started.append(run_name(task, attention, seed))
        if len(self.started) == self.fail_at:
            raise self.error
        return self.original(config, task, attention, seed, **kwargs)


def test_interrupted_comparison_resumes_without_redoing_finished_runs(serial, tmp_path, monkeypatch) -> None:
    config = CompareConfig(seeds=(0, 1), **TINY)
    cut = _CountingRuns(fail_at=3, error=KeyboardInterrupt())
    monkeypatch.setattr(runs, "train_and_evaluate", cut)
    with pytest.raises(RunsInterrupted) as interrupted:
        run_comparison(config, out=tmp_path)
    assert (interrupted.value.finished, interrupted.value.total) == (2, 4)
    kept = sorted(path.stem for path in (tmp_path / "runs").glob("*.json"))
    assert kept == sorted(cut.started[:2])
    assert not list((tmp_path / "runs").glob(".*"))  # no temporary file left behind

    again = _CountingRuns()
    monkeypatch.setattr(runs, "train_and_evaluate", again)
    resumed = run_comparison(config, out=tmp_path, resume=True)
    every = {run_name("pointer", attention, seed) for attention in TINY["attentions"] for seed in (0, 1)}
    assert sorted(again.started) == sorted(every - set(cut.started[:2]))  # only the unfinished runs, once each
    assert [_numbers(r) for r in resumed] == [_numbers(r) for r in serial]


def test_resume_refuses_runs_made_with_other_settings(tmp_path) -> None:
    config = CompareConfig(seeds=(0,), **{**TINY, "attentions": ("softmax",)})
    run_comparison(config, out=tmp_path)
    other = CompareConfig(seeds=(0,), **{**TINY, "attentions": ("softmax",), "eval_samples": 3})
    with pytest.raises(ValueError, match=r"pointer-softmax-0\.json was made with other settings.*eval_samples"):
        run_comparison(other, out=tmp_path, resume=True)
    (tmp_path / "runs" / "pointer-softmax-0.json").write_text("{trunc")
    with pytest.raises(ValueError, match="cannot be read back"):
        run_comparison(config, out=tmp_path, resume=True)


def test_resume_warns_about_runs_made_by_other_code(tmp_path, monkeypatch) -> None:
    """Each run file stores the code that made it (gpattn version, git commit); --resume keeps such runs and says
    which, with both versions; runs of this code, and a first call, give no warning."""
    import gpattn.comparison.runner as runner
    from gpattn import __version__
    from gpattn.comparison.environment import code_version

    this = code_version()  # read once per process: the label the run files hold

    config = CompareConfig(seeds=(0, 1), **{**TINY, "attentions": ("softmax",)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", runner.RunsFromOtherCodeWarning)
        first = run_comparison(config, out=tmp_path)
        assert [_numbers(r) for r in run_comparison(config, out=tmp_path, resume=True)] == [_numbers(r) for r in first]
    files = {seed: tmp_path / "runs" / f"pointer-softmax-{seed}.json" for seed in (0, 1)}
    assert json.loads(files[0].read_text())["code"] == this
    content = json.loads(files[1].read_text())
    del content["code"]  # a run file written before run files recorded their code
    files[1].write_text(json.dumps(content))
    monkeypatch.setattr(runner, "code_version", lambda: {"gpattn": "9.9", "git_commit": "abc123"})
    monkeypatch.setattr(runs, "train_and_evaluate", _CountingRuns(fail_at=1, error=AssertionError("trained again")))
    with pytest.warns(runner.RunsFromOtherCodeWarning) as caught:
        resumed = run_comparison(config, out=tmp_path, resume=True)
    assert [_numbers(r) for r in resumed] == [_numbers(r) for r in first]  # kept, not trained again
    (message,) = [str(warning.message) for warning in caught]
    assert "2 of the 2 stored runs were made by other code than this call's (gpattn 9.9, commit abc123)" in message
    assert f"pointer-softmax-0 (gpattn {__version__}, commit {this['git_commit'] or 'unknown'})" in message
    assert "pointer-softmax-1 (not recorded)" in message
    # results.json lists the code of every stored run: two groups here, whatever the report's own code is
    write_outputs(resumed, config, tmp_path)
    codes = json.loads((tmp_path / "results.json").read_text())["codes"]
    assert codes == [{"code": this, "runs": ["pointer-softmax-0"]}, {"code": None, "runs": ["pointer-softmax-1"]}]
    write_outputs(resumed[1:], config, tmp_path)  # a report of seed 1 only: the other run files are not its runs
    codes = json.loads((tmp_path / "results.json").read_text())["codes"]
    assert codes == [{"code": None, "runs": ["pointer-softmax-1"]}]


def test_run_file_codes_groups_the_runs_by_code(tmp_path) -> None:
    """The code of the most runs first; a run file without one (or unreadable) under None; no run file: empty."""
    assert run_file_codes(tmp_path / "missing") == [] and run_file_codes(tmp_path) == []
    old, new = {"gpattn": "0.1", "git_commit": "a"}, {"gpattn": "0.2", "git_commit": "b"}
    for name, content in [("t-r-0", {"code": old}), ("t-r-1", {"code": new}), ("t-r-2", {"code": new}), ("t-r-3", {})]:
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    (tmp_path / "t-r-4.json").write_text("{trunc")
    assert run_file_codes(tmp_path) == [
        {"code": new, "runs": ["t-r-1", "t-r-2"]},
        {"code": None, "runs": ["t-r-3", "t-r-4"]},
        {"code": old, "runs": ["t-r-0"]},
    ]
    for seed in (0, 1):  # the runs of a report are found by their records' identities
        content = json.loads((tmp_path / f"t-r-{seed}.json").read_text())
        (tmp_path / f"t-r-{seed}.json").write_text(
            json.dumps({**content, "record": {"task": "t", "attention": "r", "seed": seed}})
        )
    assert run_file_codes(tmp_path, [("t", "r", 1), ("t", "other", 0)]) == [{"code": new, "runs": ["t-r-1"]}]


def test_a_failed_run_names_itself_and_keeps_the_finished_ones(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runs, "train_and_evaluate", _CountingRuns(fail_at=2, error=ValueError("boom")))
    with pytest.raises(RunFailedError, match=r"run pointer-\w+-\d failed: boom"):
        run_comparison(CompareConfig(seeds=(0, 1), **TINY), out=tmp_path)
    assert len(list((tmp_path / "runs").glob("*.json"))) == 1


def test_each_run_gets_the_data_of_its_seed_and_the_shared_sets_are_loaded_once(monkeypatch) -> None:
    seen = []

    def record_data(config, task, attention, seed, data=None, **kwargs):
        seen.append((task, seed, data))
        return RunRecord.from_dict({"task": task, "attention": attention, "seed": seed, "metrics": {"test": TEST}})

    monkeypatch.setattr(runs, "train_and_evaluate", record_data)
    config = CompareConfig(seeds=(0, 1), attentions=("softmax", "kep_svgp"), tasks=("digits",), progress=False)
    run_comparison(config)
    assert [(task, seed, data.seed) for task, seed, data in seen] == [
        ("digits", 0, 0), ("digits", 1, 1), ("digits", 0, 0), ("digits", 1, 1)
    ]  # fmt: skip
    assert seen[0][2] is seen[2][2] and seen[1][2] is seen[3][2]  # loaded once per (task, seed) ...
    assert seen[0][2].test is seen[1][2].test and seen[0][2].ood["noise"] is seen[1][2].ood["noise"]  # ... sharing
    assert not seen[0][2].val.images.equal(seen[1][2].val.images)


TEST = dict(accuracy=0.9, confidence=0.85, nll=0.3, ece=0.05, mce=0.2, brier=0.15, aurc=0.02, eaurc=0.01,
            auroc=0.8, fpr95=0.6)  # fmt: skip


def test_one_progress_line_per_finished_run(capsys) -> None:
    run_comparison(CompareConfig(seeds=(0,), **{**TINY, "attentions": ("softmax",), "progress": True}))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[1/1] pointer-softmax-0: ") and "test accuracy 0." in lines[0]


def test_settings_leave_out_what_does_not_change_the_numbers() -> None:
    base = result_settings(CompareConfig(**TINY, seeds=(0,)))
    assert base == result_settings(CompareConfig(**{**TINY, "progress": True}, seeds=(0, 1), jobs=2))
    assert base != result_settings(CompareConfig(**TINY, seeds=(0,), threads=2))


def test_atomic_json_is_strict_and_leaves_the_old_file_on_failure(tmp_path) -> None:
    path = write_json_atomically(tmp_path / "a.json", {"x": 1.5, "y": None})
    assert json.loads(path.read_text(), parse_constant=_refuse) == {"x": 1.5, "y": None}
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json_atomically(path, {"x": math.nan})
    assert json.loads(path.read_text()) == {"x": 1.5, "y": None}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_threads_and_jobs_are_validated() -> None:
    with pytest.raises(ValueError, match="threads"):
        CompareConfig(threads=0)
    with pytest.raises(ValueError, match="jobs"):
        CompareConfig(jobs=0)


# -- run identity (issue 24, item 1) and what a failed write keeps (item 9) -------------------------------------------
def _fake_record(task: str, attention: str, seed: int) -> RunRecord:
    test = ClassificationMetrics(**dict.fromkeys(ClassificationMetrics.__dataclass_fields__, 0.5))
    return RunRecord(task, attention, seed, RunMetrics(test=test))


class _FakeRuns:
    """Replaces runs.train_and_evaluate with an instant run whose record names the run; lists the runs started."""

    def __init__(self) -> None:
        self.started = []

    def __call__(self, config, task, attention, seed, **kwargs):
        self.started.append(run_name(task, attention, seed))
        return _fake_record(task, attention, seed)


def test_resume_refuses_a_run_file_copied_from_another_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runs, "train_and_evaluate", _FakeRuns())
    config = CompareConfig(seeds=(0,), **TINY)  # softmax and kep_svgp
    run_comparison(config, out=tmp_path)
    folder = tmp_path / "runs"
    stored = json.loads((folder / "pointer-softmax-0.json").read_text())
    assert stored["identity"] == {"task": "pointer", "row": "softmax", "seed": 0}
    assert stored["settings_sha256"] == settings_hash(result_settings(config)) == settings_hash(stored["settings"])
    # the probe: another run's file under this run's name is refused, naming the file and both runs
    (folder / "pointer-kep_svgp-0.json").write_text((folder / "pointer-softmax-0.json").read_text())
    message = r"pointer-kep_svgp-0\.json holds the run pointer-softmax-0 \(row: stored 'softmax', now 'kep_svgp'\), not"
    with pytest.raises(ValueError, match=message):
        run_comparison(config, out=tmp_path, resume=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda content: content["settings"].update(eval_samples=3), "do not match their stored SHA-256"),
        (lambda content: content["record"].update(seed=7), r"its record is of the run pointer-softmax-7, not pointer-"),
        (lambda content: content.pop("identity"), r"missing \['identity'\]"),
        (lambda content: content.update(identity=["pointer", "softmax", 0]), "holds the run"),
    ],
)
def test_resume_refuses_a_run_file_whose_content_was_edited(edit, message, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runs, "train_and_evaluate", _FakeRuns())
    config = CompareConfig(seeds=(0,), **{**TINY, "attentions": ("softmax",)})
    run_comparison(config, out=tmp_path)
    path = tmp_path / "runs" / "pointer-softmax-0.json"
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message) as refused:
        run_comparison(config, out=tmp_path, resume=True)
    assert str(path) in str(refused.value)


def test_an_unwritable_runs_folder_is_found_before_any_run(tmp_path, monkeypatch) -> None:
    import os

    fake = _FakeRuns()
    monkeypatch.setattr(runs, "train_and_evaluate", fake)
    (tmp_path / "runs").mkdir()
    real_open = os.open

    def refuse(path, *args, **kwargs):  # a folder without write permission (chmod does not bind root)
        if os.fspath(path).startswith(os.fspath(tmp_path / "runs")):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(OSError, match=r"cannot create or write the folder .*runs \(Permission denied\)"):
        run_comparison(CompareConfig(seeds=(0,), **TINY), out=tmp_path)
    assert fake.started == []


def test_a_full_disk_names_the_file_and_what_was_kept(tmp_path, monkeypatch) -> None:
    import errno
    import os

    monkeypatch.setattr(runs, "train_and_evaluate", _FakeRuns())
    config = CompareConfig(seeds=(0, 1), **{**TINY, "attentions": ("softmax",)})
    real_fsync, calls = os.fsync, []

    def fill_up(descriptor):  # the second record meets a full disk
        calls.append(descriptor)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fill_up)
    with pytest.raises(RunFailedError) as failed:
        run_comparison(config, out=tmp_path)
    message = str(failed.value)
    assert f"cannot write {tmp_path / 'runs' / 'pointer-softmax-1.json'} (No space left on device)" in message
    assert f"the 1 runs finished before it are kept in {tmp_path / 'runs'}" in message and "--resume" in message
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["pointer-softmax-0.json"]  # no temporary


def test_atomic_files_get_the_mode_of_new_files(tmp_path) -> None:
    import os

    umask = os.umask(0o022)
    try:
        path = write_json_atomically(tmp_path / "results.json", {"x": 1})
        other = tmp_path / "table.md"
        other.write_text("plain")
    finally:
        os.umask(umask)
    assert oct(path.stat().st_mode & 0o777) == oct(other.stat().st_mode & 0o777) == "0o644"


# -- the runs given, the executor's counts, and what a failure keeps ---------------------------------------------------
def test_execute_runs_checks_its_runs_before_any_run(tmp_path, monkeypatch) -> None:
    import numpy as np

    from gpattn.comparison.runner import execute_runs

    fake = _FakeRuns()
    monkeypatch.setattr(runs, "train_and_evaluate", fake)
    config = CompareConfig(seeds=(0,), **{**TINY, "attentions": ("softmax",)})
    refused = [
        ([("pointer", "softmax", 0)] * 2, r"expected every run once, got \['pointer-softmax-0'\] more than once"),
        ([("pointer", "softmax", True)], r"expected the seed of a run to be a non-negative integer, got True"),
        ([("pointer", "softmax", -1)], r"expected the seed of a run to be a non-negative integer, got -1"),
        (
            [("pointer", "softmax")],
            r"expected every run to be a \(task, row, seed\) triple, got \('pointer', 'softmax'\)",
        ),
        ([("nope", "softmax", 0)], r"expected the task of \('nope', 'softmax', 0\) to be one of \['pointer'"),
        ([("pointer", "nope", 0)], r"unknown comparison row 'nope'"),
        ("pointer-softmax-0", r"expected runs to be a sequence of \(task, row, seed\)"),
    ]
    for given, message in refused:
        with pytest.raises(ValueError, match=message):
            execute_runs(config, given, out=tmp_path)
    with pytest.raises(ValueError, match=r"resume=True reads the finished runs of out/runs, but out is None"):
        execute_runs(config, [("pointer", "softmax", 0)], resume=True)
    assert fake.started == [] and not list((tmp_path / "runs").glob("*.json"))
    # a NumPy seed is the run of that seed: trained, written (JSON) and read back on resume
    (record,) = execute_runs(config, [("pointer", "softmax", np.int64(1))], out=tmp_path)
    assert type(record.seed) is int and record.seed == 1
    stored = json.loads((tmp_path / "runs" / "pointer-softmax-1.json").read_text())
    assert stored["identity"] == {"task": "pointer", "row": "softmax", "seed": 1}
    assert execute_runs(config, [("pointer", "softmax", np.int64(1))], out=tmp_path, resume=True) == [record]
    assert fake.started == ["pointer-softmax-1"]


def test_local_executor_checks_its_counts() -> None:
    import numpy as np

    from gpattn.comparison.local_executor import LocalExecutor

    for name, value in [("jobs", True), ("jobs", 0), ("jobs", 2.5), ("threads", 0), ("threads", False)]:
        with pytest.raises(ValueError, match=rf"LocalExecutor: expected {name} to be a positive integer, got {value}"):
            LocalExecutor(**{name: value})
    executor = LocalExecutor(jobs=np.int64(4), threads=np.int32(1))
    assert (type(executor.jobs), executor.jobs, type(executor.threads)) == (int, 4, int)
    with pytest.raises(RuntimeError, match=r"next_result: no call is pending"):
        executor.next_result()
    with executor:  # more jobs than calls: the one call runs here, in this process
        executor.submit("one", abs, -3)
        assert executor.next_result() == ("one", 3) and executor.pending == 0


def _raise(message: str) -> None:
    raise ValueError(message)


def test_a_call_that_returned_comes_before_a_failure_beside_it(monkeypatch) -> None:
    """Calls of a pool that finished together: the result of the one that returned is handed back before the failure
    (which stops the comparison), so its record is written."""
    import concurrent.futures

    from gpattn.comparison import local_executor
    from gpattn.comparison.local_executor import LocalExecutor, TaskFailedError

    executor = LocalExecutor(jobs=2)
    with executor:
        executor._pool = concurrent.futures.ThreadPoolExecutor(2)  # a pool of threads in place of processes
        executor.submit("bad", _raise, "boom")
        executor.submit("good", abs, -2)
        futures = list(executor._futures)
        concurrent.futures.wait(futures)
        failed_first = sorted(futures, key=lambda future: future.exception() is None)

        def in_order(pending, **kwargs):  # as concurrent.futures.wait, the failure first among the finished
            return [future for future in failed_first if future in pending], set()

        monkeypatch.setattr(local_executor.concurrent.futures, "wait", in_order)
        assert executor.next_result() == ("good", 2)
        with pytest.raises(TaskFailedError, match="bad: boom"):
            executor.next_result()


def test_a_run_finished_in_a_worker_before_ctrl_c_is_kept(tmp_path) -> None:
    """Ctrl-C while a run has finished in a worker but not yet been handed back: its record is written before the
    calls in flight are stopped (it was lost with the workers)."""
    import concurrent.futures

    from gpattn.comparison.local_executor import LocalExecutor
    from gpattn.comparison.runner import execute_runs

    class _SignalAfterAFinish(LocalExecutor):
        # the first call finishes "in a worker" (a done future), then Ctrl-C reaches the waiting main process
        def next_result(self):
            key, fn, args = self._queued.pop(0)
            future = concurrent.futures.Future()
            future.set_result(fn(*args))
            self._futures[future] = key
            raise KeyboardInterrupt

    config = CompareConfig(seeds=(0, 1), **{**TINY, "attentions": ("softmax",)})
    runs_ = [("pointer", "softmax", 0), ("pointer", "softmax", 1)]
    with pytest.raises(RunsInterrupted) as interrupted:
        execute_runs(config, runs_, out=tmp_path, executor=_SignalAfterAFinish())
    assert (interrupted.value.finished, interrupted.value.total) == (1, 2)
    assert [path.stem for path in (tmp_path / "runs").glob("*.json")] == ["pointer-softmax-0"]
    assert LocalExecutor().finished_results() == []  # nothing submitted, nothing finished


def _sleep(seconds: float) -> float:
    import time

    time.sleep(seconds)
    return seconds


def test_a_stopped_pool_leaves_no_thread_running() -> None:
    """After Ctrl-C (here a raised KeyboardInterrupt) the pool's manager thread has ended when the executor's block
    has: left running, it closed its wake-up pipe while concurrent.futures' exit handler wrote to it, an OSError
    traceback at the interpreter's exit in about one Ctrl-C out of seven."""
    import concurrent.futures.process
    import threading

    from gpattn.comparison.local_executor import LocalExecutor

    with pytest.raises(KeyboardInterrupt), LocalExecutor(jobs=2) as executor:
        for seconds in (30.0, 30.0, 30.0):
            executor.submit(seconds, _sleep, seconds)
        executor._start_pool()
        (pool_manager,) = [
            thread
            for thread in threading.enumerate()
            if isinstance(thread, concurrent.futures.process._ExecutorManagerThread)
        ]
        raise KeyboardInterrupt
    assert not pool_manager.is_alive()
