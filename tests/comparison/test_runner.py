"""Scheduling of the comparison (gpattn/comparison/runner.py): parallel runs give the same records as serial ones,
finished runs are written at once and read back on resume, interruptions and failures keep what finished."""

from __future__ import annotations

import json
import math

import pytest

import gpattn.comparison.runs as runs
from gpattn.comparison import CompareConfig, RunRecord
from gpattn.comparison.records import write_json_atomically
from gpattn.comparison.runner import (
    RunFailedError,
    RunsInterrupted,
    result_settings,
    run_comparison,
    run_name,
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
