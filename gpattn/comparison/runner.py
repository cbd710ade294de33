"""Scheduling of the comparison's runs: threads, parallel processes, progress lines, incremental records and resume.

:func:`~gpattn.comparison.run_comparison` hands its ``(task, attention, seed)`` runs to :func:`execute_runs`, which

* runs them one after the other in this process (``config.jobs == 1``) or in ``config.jobs`` worker processes
  (``spawn`` start method), each with ``torch.set_num_threads(config.threads)``. A run's numbers depend on its
  arguments and on the thread count only (torch's reductions are split differently with another thread count), so
  for a given ``threads`` the records are identical whatever ``jobs`` is. On CUDA every process running runs uses
  deterministic kernels (:func:`run_environment`), so that the workers sharing one GPU give the records of the runs
  made one by one;
* writes each finished run's record at once to ``<out>/runs/<task>-<attention>-<seed>.json`` (strict JSON, through
  a temporary file and :func:`os.replace`, so a file is either complete or absent), together with the settings that
  determine its numbers;
* with ``resume=True`` reads the finished runs back instead of training them again, after checking that they were
  made with the same settings;
* prints one line per finished run (name, seconds, test accuracy) on standard error, and a live bar on a terminal.

Ctrl-C stops the workers and raises :class:`RunsInterrupted`; every run that finished is on disk.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from . import runs as run_module
from .config import CompareConfig
from .records import RunRecord, write_json_atomically
from .tasks import TaskData, load_task

__all__ = [
    "RESULT_INDEPENDENT_FIELDS",
    "RunFailedError",
    "RunsInterrupted",
    "execute_runs",
    "run_comparison",
    "run_environment",
    "result_settings",
    "run_name",
]

#: CompareConfig fields that do not change a run's numbers: which runs there are, how they are scheduled and shown
RESULT_INDEPENDENT_FIELDS = ("attentions", "tasks", "seeds", "progress", "jobs", "smoke_test")


QUIET_TRACKER = "ignore:resource_tracker:UserWarning"


class RunsInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`execute_runs`: ``finished`` of ``total`` runs are done (on disk when an ``out`` folder
    was given); the same call with ``resume=True`` continues."""

    def __init__(self, finished: int, total: int) -> None:
        super().__init__(f"{finished} of {total} runs finished")
        self.finished, self.total = finished, total


class RunFailedError(RuntimeError):
    """One run raised: the message names the run and the original error (the finished runs are kept)."""


def run_name(task: str, attention: str, seed: int) -> str:
    """``"<task>-<attention>-<seed>"``: the name of a run in progress lines and of its record file."""
    return f"{task}-{attention}-{seed}"


def result_settings(config: CompareConfig) -> dict[str, Any]:
    """The settings of ``config`` that determine a run's numbers (every field but
    :data:`RESULT_INDEPENDENT_FIELDS`), as JSON data: what a stored run is checked against on resume."""
    settings = asdict(config)
    for name in RESULT_INDEPENDENT_FIELDS:
        settings.pop(name, None)
    return json.loads(json.dumps(settings))  # tuples -> lists, as read back from a file


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -- one run ---------------------------------------------------------------------------------------------------------
_DATA: dict[str, TaskData] = {}  # per process: each task's data is loaded once


def _run_one(config: CompareConfig, task: str, attention: str, seed: int) -> tuple[RunRecord, float]:
    if task not in _DATA:
        _DATA[task] = load_task(task)
    start = time.perf_counter()
    # looked up at call time: the function may be replaced (tests)
    record = run_module.train_and_evaluate(config, task, attention, seed, data=_DATA[task])
    return record, time.perf_counter() - start


def _start_worker(threads: int, device: str) -> None:
    # Ctrl-C goes to the whole process group: the parent alone handles it (and stops the workers), so that a worker
    # prints no traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    _deterministic_cuda(device)


def _deterministic_cuda(device: str) -> bool:
    """On a CUDA device: deterministic kernels (cuBLAS with a fixed workspace, set before the process's first cuBLAS
    call; PyTorch's deterministic algorithms, with a warning for an operator that has none) and the run's device made
    current, so that a run gives the same record in any process, alone or beside others on the GPU. The parent of the
    workers never touches CUDA (spawned workers start without its state). Returns whether it changed anything."""
    target = torch.device(device)
    if target.type != "cuda":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if target.index is not None:
        torch.cuda.set_device(target)
    return True


@contextmanager
def run_environment(config: CompareConfig) -> Iterator[None]:
    """The settings of the runs in this process, the previous ones restored after the block: ``config.threads``
    torch threads and, on CUDA, deterministic kernels (as in every worker process)."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with torch_threads(config.threads):
        changed = _deterministic_cuda(config.device)
        try:
            yield
        finally:
            if changed:
                torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# -- the records on disk ---------------------------------------------------------------------------------------------
def _stored_record(path: Path, settings: dict[str, Any]) -> RunRecord:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read back as a run record ({error}); delete it to run it again") from None
    if not isinstance(content, dict) or "record" not in content or "settings" not in content:
        raise ValueError(f"{path}: expected a run record with 'settings' and 'record' entries")
    stored = content["settings"]
    if stored != settings:
        changed = sorted(key for key in set(stored) | set(settings) if stored.get(key) != settings.get(key))
        details = ", ".join(f"{key}: stored {stored.get(key)!r}, now {settings.get(key)!r}" for key in changed)
        raise ValueError(
            f"{path} was made with other settings ({details}); --resume continues a run with the same settings: "
            "use the original options, or another --out"
        )
    try:
        return RunRecord.from_dict(content["record"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _line(done: int, total: int, name: str, seconds: float, record: RunRecord) -> str:
    return f"[{done}/{total}] {name}: {seconds:.1f} s, test accuracy {record.metrics.test.accuracy:.4f}"


def execute_runs(
    config: CompareConfig,
    runs: Sequence[tuple[str, str, int]],
    out: str | os.PathLike | None = None,
    resume: bool = False,
) -> list[RunRecord]:
    """Train and evaluate ``runs`` (``(task, attention, seed)`` triples) under ``config`` (its ``threads``, ``jobs``
    and ``progress`` included) and return their records in the order of ``runs``.

    :param out: Run folder: each finished record goes to ``out/runs/<name>.json`` at once (``None``: memory only).
    :param resume: Read the records already in ``out/runs`` instead of running them again.
    :raises RunsInterrupted: On Ctrl-C, after stopping the workers (the finished records are on disk).
    :raises RunFailedError: When a run raises (the other workers are stopped; the finished records are on disk).
    :raises ValueError: A stored record that was made with other settings, or cannot be read.
    """
    settings = result_settings(config)
    folder = None if out is None else Path(out) / "runs"
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    records: dict[tuple[str, str, int], RunRecord] = {}
    if resume and folder is not None:
        for run in runs:
            path = folder / f"{run_name(*run)}.json"
            if path.exists():
                records[run] = _stored_record(path, settings)
    pending = [run for run in runs if run not in records]
    total = len(runs)
    show = config.progress
    bar = tqdm(total=total, initial=len(records), desc="compare", file=sys.stderr, disable=None if show else True)

    def finish(run: tuple[str, str, int], record: RunRecord, seconds: float) -> None:
        records[run] = record
        if folder is not None:
            write_json_atomically(folder / f"{run_name(*run)}.json", {"settings": settings, "record": record.to_dict()})
        if show:
            tqdm.write(_line(len(records), total, run_name(*run), seconds, record), file=sys.stderr)
        bar.update()

    if show and len(records):
        tqdm.write(f"resuming: {len(records)} of {total} runs already finished in {folder}", file=sys.stderr)
    try:
        if config.jobs == 1 or len(pending) <= 1:
            with run_environment(config):
                for run in pending:
                    bar.set_postfix_str(run_name(*run))
                    try:
                        record, seconds = _run_one(config, *run)
                    except (KeyboardInterrupt, RunFailedError):
                        raise
                    except Exception as error:
                        raise RunFailedError(f"run {run_name(*run)} failed: {error}") from error
                    finish(run, record, seconds)
        else:
            _run_in_parallel(config, pending, finish)
    except KeyboardInterrupt:
        raise RunsInterrupted(len(records), total) from None
    finally:
        bar.close()
    return [records[run] for run in runs]


def _run_in_parallel(config: CompareConfig, pending: list[tuple[str, str, int]], finish) -> None:
    context = multiprocessing.get_context("spawn")
    # multiprocessing's resource tracker starts with this interpreter's -W options: after Ctrl-C it would warn about
    # the pool's locks of the stopped workers (which it then unlinks itself), a traceback-like message for nothing
    if QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_TRACKER)
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=min(config.jobs, len(pending)),
        mp_context=context,
        initializer=_start_worker,
        initargs=(config.threads, config.device),
    )
    futures = {executor.submit(_run_one, config, *run): run for run in pending}
    clean = False
    try:
        for future in concurrent.futures.as_completed(futures):
            run = futures[future]
            try:
                record, seconds = future.result()
            except Exception as error:
                raise RunFailedError(f"run {run_name(*run)} failed: {error}") from error
            finish(run, record, seconds)
        clean = True
    finally:
        if clean:
            executor.shutdown(wait=True)
        else:  # Ctrl-C or a failed run: stop the runs in flight, start no other
            processes = list((getattr(executor, "_processes", None) or {}).values())
            executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            for process in processes:
                process.join(timeout=10)
            executor.shutdown(wait=True)  # the pool, broken now, releases its queues (no leaked semaphore)


def run_comparison(config: CompareConfig, out: str | Path | None = None, resume: bool = False) -> list[RunRecord]:
    """Train and evaluate every (task, row, seed) and return one :class:`~gpattn.comparison.RunRecord` per run, in
    that nesting order (all numbers are fractions, not percent): the runs of
    :func:`~gpattn.comparison.plan_runs` (which first checks every layer's arguments), ``config.jobs`` at once in
    worker processes with ``config.threads`` torch threads each (:func:`execute_runs`).

    :param out: Run folder: each finished run's record is written at once to
        ``out/runs/<task>-<attention>-<seed>.json``.
    :param resume: Read the runs already finished in ``out/runs`` (made with the same settings) instead of training
        them again.
    :raises ~gpattn.comparison.runner.RunsInterrupted: On Ctrl-C (the finished runs are kept in ``out/runs``).
    """
    return execute_runs(config, run_module.plan_runs(config), out=out, resume=resume)
