"""Scheduling of the comparison's runs: threads, parallel processes, progress lines, incremental records and resume.

:func:`~gpattn.comparison.run_comparison` hands its ``(task, attention, seed)`` runs to :func:`execute_runs`, which

* hands them to an executor: by default a :class:`~gpattn.comparison.local_executor.LocalExecutor`, which runs
  them one after the other in this process (``config.jobs == 1``) or in ``config.jobs`` worker processes (``spawn``
  start method), or a :class:`~gpattn.comparison.ray_executor.RayExecutor` (each run a Ray task, on this machine or a
  cluster), each run with ``torch.set_num_threads(config.threads)``. A run's numbers depend on its arguments and on
  the thread count only (torch's reductions are split differently with another thread count), so for a given
  ``threads`` the records are identical whatever ``jobs`` or the executor is. On CUDA every process running runs
  uses deterministic kernels (:func:`run_environment`), so that the workers sharing one GPU give the records of the
  runs made one by one;
* writes each finished run's record at once to ``<out>/runs/<task>-<attention>-<seed>.json`` (strict JSON, through
  a temporary file and :func:`os.replace`, so a file is either complete or absent), together with the run's identity
  (task, row, seed) and the settings that determine its numbers, with their SHA-256 (:func:`run_file_content`);
* with ``resume=True`` reads the finished runs back instead of training them again, after checking that each file is
  the run its name says, made with the same settings (:func:`read_run_file`), and warns
  (:class:`RunsFromOtherCodeWarning`) when some were made by other code (another gpattn version or git commit);
* prints one line per finished run (name, seconds, test accuracy) on standard error, and a live bar on a terminal.

The records come back to this process, which alone writes the run files. Ctrl-C stops the workers and raises
:class:`RunsInterrupted`; every run that finished is on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..methods import get_method
from ..validation import check_seed
from . import runs as run_module
from .config import CompareConfig
from .environment import code_label, code_version
from .local_executor import LocalExecutor, TaskFailedError, worker_environment
from .records import RunRecord, write_json_atomically
from .table_rows import ensemble_row
from .tasks import TASK_DEFAULTS, TaskData, load_task

__all__ = [
    "RESULT_INDEPENDENT_FIELDS",
    "RUN_FILE_FORMAT",
    "RunFailedError",
    "RunsFromOtherCodeWarning",
    "RunsInterrupted",
    "check_writable_folder",
    "execute_runs",
    "read_run_file",
    "run_environment",
    "result_entries",
    "result_settings",
    "run_comparison",
    "run_file_content",
    "run_name",
    "settings_hash",
]

#: CompareConfig fields that do not change a run's numbers: which runs there are, how they are scheduled and shown
RESULT_INDEPENDENT_FIELDS = ("attentions", "tasks", "seeds", "primary_seeds", "progress", "jobs", "smoke_test")
#: Fields added to :class:`CompareConfig` after run files were first written, with the value every earlier run had:
#: left out of :func:`result_settings` at that value, so that those runs are still read back by ``--resume``
LATER_FIELDS = {"cuda_graphs": False}
#: The format of a run file (``out/runs/<name>.json`` of ``gpattn compare``, ``OUT/run.json`` of ``gpattn train``)
RUN_FILE_FORMAT = "gpattn-run/1"


class RunsInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`execute_runs`: ``finished`` of ``total`` runs are done (on disk when an ``out`` folder
    was given); the same call with ``resume=True`` continues."""

    def __init__(self, finished: int, total: int) -> None:
        super().__init__(f"{finished} of {total} runs finished")
        self.finished, self.total = finished, total


class RunFailedError(RuntimeError):
    """One run raised: the message names the run and the original error (the finished runs are kept)."""


def _failure(error: TaskFailedError, kept: int, folder: Path | None) -> str:
    """The message of a failed run (or of a worker's death, which stops every run of its pool), and what is kept."""
    stopped = error.stopped
    if len(stopped) > 1:
        names = ", ".join(run_name(*run) for run in stopped)
        message = f"a worker process died with the runs {names} in its pool (running or waiting there): {error.cause}"
    else:
        message = f"run {run_name(*error.key)} failed: {error.cause}"
    if folder is None:
        return message
    finished = "the 1 run finished before is kept" if kept == 1 else f"the {kept} runs finished before are kept"
    return f"{message}; {finished} in {folder}, and the same command with --resume continues from there"


def run_name(task: str, attention: str, seed: int) -> str:
    """``"<task>-<attention>-<seed>"``: the name of a run in progress lines and of its record file."""
    return f"{task}-{attention}-{seed}"


def result_settings(config: CompareConfig) -> dict[str, Any]:
    """The settings of ``config`` that determine a run's numbers (:func:`result_entries` of its fields), as JSON
    data: what a stored run is checked against on resume."""
    return result_entries(asdict(config))


def result_entries(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a :class:`CompareConfig`'s settings (its fields as a mapping, or the ``config`` entry of a run
    folder's ``results.json``) that determine a run's numbers: every entry but :data:`RESULT_INDEPENDENT_FIELDS`, and
    those of :data:`LATER_FIELDS` at their earlier value (or missing, as in a folder written before they existed),
    and ``tuned_dir`` where ``tuned`` is false (the folder is then not read), as JSON data (tuples as lists). What
    ``--resume`` checks a stored run against, and ``gpattn report`` the folders it merges. O(entries)."""
    entries = {name: value for name, value in settings.items() if name not in RESULT_INDEPENDENT_FIELDS}
    if entries.get("tuned") is False:  # the shared settings: the tuned folder is not read
        entries.pop("tuned_dir", None)
    for name, earlier in LATER_FIELDS.items():
        if entries.get(name) == earlier:
            entries.pop(name)
    return json.loads(json.dumps(entries))  # tuples -> lists, as read back from a file


# -- one run ---------------------------------------------------------------------------------------------------------
# per process: each (task, seed)'s data is loaded once (its validation split depends on the seed; load_task caches the
# test, shifted and OOD sets, which do not, so that another seed loads its training and validation splits only)
_DATA: dict[tuple[str, int], TaskData] = {}


def _run_one(config: CompareConfig, task: str, attention: str, seed: int) -> tuple[RunRecord, float]:
    if (task, seed) not in _DATA:
        _DATA[(task, seed)] = load_task(task, seed)
    start = time.perf_counter()
    # looked up at call time: the function may be replaced (tests)
    record = run_module.train_and_evaluate(config, task, attention, seed, data=_DATA[(task, seed)])
    return record, time.perf_counter() - start


@contextmanager
def run_environment(config: CompareConfig) -> Iterator[None]:
    """The settings of the runs in this process, the previous ones restored after the block: ``config.threads``
    torch threads and, on CUDA, deterministic kernels (as in every worker process; :func:`worker_environment`)."""
    with worker_environment(config.threads, config.device):
        yield


# -- the records on disk ---------------------------------------------------------------------------------------------
def settings_hash(settings: dict[str, Any]) -> str:
    """The SHA-256 (hex) of ``settings`` as canonical JSON (sorted keys, no spaces): what a run file stores beside
    its settings, so that a settings entry edited by hand is found."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def run_file_content(
    run: tuple[str, str, int], settings: dict[str, Any], record: RunRecord | None = None
) -> dict[str, Any]:
    """The content of a run file: its format, the run's identity ``{"task", "row", "seed"}``, the settings that
    determine its numbers (:func:`result_settings`), their :func:`settings_hash`, the code that wrote it
    (:func:`~gpattn.comparison.environment.code_version`) and, once the run finished, its record
    (:meth:`~gpattn.comparison.RunRecord.to_dict`)::

        {"format": "gpattn-run/1", "identity": {"task": "digits", "row": "softmax", "seed": 0},
         "settings": {...}, "settings_sha256": "...", "code": {"gpattn": "...", "git_commit": "..."},
         "record": {...}}

    :param run: ``(task, row, seed)``.
    :param settings: :func:`result_settings` of the run's configuration.
    :param record: The finished run's record, or ``None`` (a run in progress: ``gpattn train`` writes its identity
        and settings before it trains, and its ``--resume`` adds ``"resumed_with"``, the codes that continued the run
        when they differ from the one that started it).
    """
    task, row, seed = run
    content = {
        "format": RUN_FILE_FORMAT,
        "identity": {"task": task, "row": row, "seed": seed},
        "settings": settings,
        "settings_sha256": settings_hash(settings),
        "code": code_version(),
    }
    if record is not None:
        content["record"] = record.to_dict()
    return content


def _differences(stored: dict[str, Any], current: dict[str, Any], label: str) -> str:
    changed = sorted(key for key in set(stored) | set(current) if stored.get(key) != current.get(key))
    return ", ".join(f"{key}: {label} {stored.get(key)!r}, now {current.get(key)!r}" for key in changed)


def read_run_file(
    path: str | os.PathLike,
    run: tuple[str, str, int],
    settings: dict[str, Any],
    *,
    record: bool = True,
    hyperparameters: dict[str, Any] | None = None,
) -> RunRecord | None:
    """Read a run file (:func:`run_file_content`) back for ``--resume``, after checking that it is the run ``run``
    made with ``settings``: its identity is ``run`` (a file copied or renamed from another run's is refused), its
    record's task, row and seed are that identity (``<row>_ens<K>`` for an ensemble), its settings match their stored
    hash (not edited) and equal ``settings``, and the hyperparameters its record stores are ``hyperparameters`` (the
    settings do not hold a tuned configuration's values, which live in a file that may change between two calls;
    records written before they stored hyperparameters are not checked).

    :param path: The file (``out/runs/<task>-<row>-<seed>.json``, or ``OUT/run.json`` of ``gpattn train``).
    :param run: ``(task, row, seed)``: the run the caller expects (the one the file name says).
    :param settings: :func:`result_settings` of the current configuration.
    :param record: Expect a finished run's record (``False``: a file written before training, without one).
    :param hyperparameters: The :meth:`~gpattn.methods.Hyperparameters.to_dict` the run would train with now, or
        ``None`` (not checked).
    :return: The stored :class:`~gpattn.comparison.RunRecord`, or ``None`` with ``record=False``.
    :raises ValueError: Naming the file and what disagrees (and what to do).
    """
    path = Path(path)
    task, row, seed = run
    expected = {"task": task, "row": row, "seed": seed}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read back as a run file ({error}); delete it to run it again") from None
    entries = ("format", "identity", "settings", "settings_sha256") + (("record",) if record else ())
    if not isinstance(content, dict) or any(key not in content for key in entries):
        missing = [key for key in entries if not isinstance(content, dict) or key not in content]
        raise ValueError(
            f"{path}: expected a run file with the entries {list(entries)}, missing {missing} (written by an older "
            "gpattn, or not by gpattn); delete it to run it again"
        )
    if content["format"] != RUN_FILE_FORMAT:
        raise ValueError(f"{path}: expected the format {RUN_FILE_FORMAT!r}, got {content['format']!r}")
    identity = content["identity"]
    if identity != expected:
        if isinstance(identity, dict):
            stored_run = run_name(*(identity.get(key) for key in expected))
            shown = f"{stored_run} ({_differences(identity, expected, 'stored')})"
        else:
            shown = repr(identity)
        raise ValueError(
            f"{path} holds the run {shown}, not {run_name(*run)}: a run file is only read back as its own run (one "
            "copied or renamed from another run is refused); resume with that run's options, or delete the file to "
            "run this one again"
        )
    stored = content["settings"]
    if not isinstance(stored, dict) or settings_hash(stored) != content["settings_sha256"]:
        raise ValueError(
            f"{path}: its settings do not match their stored SHA-256 (edited after the run was written); delete it "
            "to run it again"
        )
    stored = result_entries(stored)  # (a file written before an entry was left out holds it)
    if stored != settings:
        raise ValueError(
            f"{path} was made with other settings ({_differences(stored, settings, 'stored')}); --resume continues a "
            "run with the same settings: use the original options, or another --out"
        )
    if not record:
        return None
    try:
        result = RunRecord.from_dict(content["record"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    ensemble = settings.get("ensemble", 1)
    attention = ensemble_row(row, ensemble)  # as train_and_evaluate names it
    if (result.task, result.attention, result.seed) != (task, attention, seed):
        raise ValueError(
            f"{path}: its record is of the run {run_name(result.task, result.attention, result.seed)}, not "
            f"{run_name(task, attention, seed)} (the file was edited); delete it to run it again"
        )
    if hyperparameters is not None and result.hyperparameters and result.hyperparameters != hyperparameters:
        changed = _differences(result.hyperparameters, hyperparameters, "stored")
        raise ValueError(
            f"{path} was trained with other hyperparameters ({changed}): "
            "the tuned configuration changed since (gpattn/comparison/tuned/<task>.json, or the --tuned-dir folder); "
            "use another --out, or delete the file to run it again"
        )
    return result


def run_hyperparameters(config: CompareConfig, task: str, row: str) -> dict[str, Any]:
    """The hyperparameters a run of ``row`` on ``task`` trains with under ``config`` (tuned or shared), as its record
    stores them."""
    return config.hyperparameters(task, get_method(row), TASK_DEFAULTS[task]).to_dict()


def check_writable_folder(folder: str | os.PathLike) -> Path:
    """Create ``folder`` (and its parents) if missing and check that a file can be written in it, before any run
    trains: a folder that cannot hold the records is found at once, not after the first run.

    :raises OSError: Naming the folder and the reason (the message of a one-line error).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(error.errno, f"cannot create or write the folder {folder} ({reason})") from None
    return folder


def _line(done: int, total: int, name: str, seconds: float, record: RunRecord) -> str:
    return f"[{done}/{total}] {name}: {seconds:.1f} s, test accuracy {record.metrics.test.accuracy:.4f}"


class RunsFromOtherCodeWarning(UserWarning):
    """``--resume`` read back runs that another code made (another gpattn version or git commit, or a run file written
    before run files recorded it): their numbers are kept, and may differ from what this code would give. ``gpattn
    train --resume`` warns likewise when it continues a run that another code started."""


def _other_code(paths: dict[tuple[str, str, int], Path]) -> str | None:
    """The warning's text when some of the stored runs ``paths`` were made by other code than this process's, else
    ``None``."""
    current = code_version()
    other = {}
    for run, path in paths.items():
        stored = json.loads(path.read_text(encoding="utf-8")).get("code")
        if stored != current:
            other[run_name(*run)] = code_label(stored)
    if not other:
        return None
    shown = ", ".join(f"{name} ({label})" for name, label in list(other.items())[:5])
    more = f" and {len(other) - 5} more" if len(other) > 5 else ""
    return (
        f"--resume: {len(other)} of the {len(paths)} stored runs were made by other code than this call's "
        f"({code_label(current)}): {shown}{more}. Their numbers are kept, and may differ from what this code gives; "
        "use another --out (or delete their files) to train every run with this code"
    )


def _checked_runs(runs: Sequence[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """``runs`` as ``(task, row, seed)`` triples of a task, a registered row and a Python int (a NumPy integer seed
    converted: the run file stores it as JSON), each once: checked before any run trains."""
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Sequence):
        raise ValueError(f"execute_runs: expected runs to be a sequence of (task, row, seed), got {runs!r}")
    checked = []
    for run in runs:
        if not isinstance(run, (tuple, list)) or len(run) != 3 or not all(isinstance(name, str) for name in run[:2]):
            raise ValueError(f"execute_runs: expected every run to be a (task, row, seed) triple, got {run!r}")
        if run[0] not in TASK_DEFAULTS:
            raise ValueError(f"execute_runs: expected the task of {run!r} to be one of {list(TASK_DEFAULTS)}")
        get_method(run[1])  # an unknown row: a ValueError naming it and the registered ones
        checked.append((run[0], run[1], check_seed("the seed of a run", run[2], where="execute_runs")))
    repeated = sorted(run_name(*run) for run, count in Counter(checked).items() if count > 1)
    if repeated:
        raise ValueError(f"execute_runs: expected every run once, got {repeated} more than once")
    return checked


def execute_runs(
    config: CompareConfig,
    runs: Sequence[tuple[str, str, int]],
    out: str | os.PathLike | None = None,
    resume: bool = False,
    executor: Any = None,
) -> list[RunRecord]:
    """Train and evaluate ``runs`` (``(task, attention, seed)`` triples) under ``config`` (its ``threads``, ``jobs``
    and ``progress`` included) and return their records in the order of ``runs``.

    :param out: Run folder: each finished record goes to ``out/runs/<name>.json`` at once (``None``: memory only).
    :param resume: Read the records already in ``out/runs`` instead of running them again (needs ``out``).
    :param executor: Where the runs execute: a :class:`~gpattn.comparison.local_executor.LocalExecutor` (default:
        ``config.jobs`` processes of this machine) or a :class:`~gpattn.comparison.ray_executor.RayExecutor` (each
        run a Ray task). The records are written here, by this process, whichever it is.
    :raises RunsInterrupted: On Ctrl-C, after stopping the workers (the finished records are on disk).
    :raises RunFailedError: When a run raises (on Ray: twice, the task is retried once), or its record cannot be
        written (the runs in flight are stopped; the finished records are on disk).
    :raises OSError: ``out/runs`` cannot be created or written (checked before any run).
    :raises ValueError: A stored run file that cannot be read, is not the run its name says (copied or renamed from
        another run), or was made with other settings (:func:`read_run_file`); a run of ``runs`` that is not a
        ``(task, row, seed)`` triple (a known task, a registered row, a non-negative integer seed, not a
        bool) or that comes twice; ``resume`` without ``out``.
    :warns RunsFromOtherCodeWarning: Stored runs made by other code (gpattn version or git commit) than this call's.
    """
    runs = _checked_runs(runs)
    if resume and out is None:
        raise ValueError("execute_runs: resume=True reads the finished runs of out/runs, but out is None; give out")
    settings = result_settings(config)
    code_version()  # read now, before any run trains: the label of the code this process imported (kept for it)
    folder = None if out is None else Path(out) / "runs"
    if folder is not None:
        check_writable_folder(folder)
    records: dict[tuple[str, str, int], RunRecord] = {}
    if resume and folder is not None:
        stored = {run: folder / f"{run_name(*run)}.json" for run in runs}
        stored = {run: path for run, path in stored.items() if path.exists()}
        for run, path in stored.items():
            expected = run_hyperparameters(config, run[0], run[1])
            records[run] = read_run_file(path, run, settings, hyperparameters=expected)
        message = _other_code(stored)
        if message is not None:
            warnings.warn(message, RunsFromOtherCodeWarning, stacklevel=2)
    pending = [run for run in runs if run not in records]
    total = len(runs)
    show = config.progress
    bar = tqdm(total=total, initial=len(records), desc="compare", file=sys.stderr, disable=None if show else True)

    def finish(run: tuple[str, str, int], record: RunRecord, seconds: float) -> None:
        if folder is not None:
            try:
                write_json_atomically(folder / f"{run_name(*run)}.json", run_file_content(run, settings, record))
            except OSError as error:
                raise RunFailedError(
                    f"run {run_name(*run)} finished but its record could not be written: {error}; the "
                    f"{len(records)} runs finished before it are kept in {folder}; make room (or fix the folder) and "
                    "run the same command with --resume"
                ) from error
        records[run] = record
        if show:
            tqdm.write(_line(len(records), total, run_name(*run), seconds, record), file=sys.stderr)
        bar.update()

    if show and len(records):
        tqdm.write(f"resuming: {len(records)} of {total} runs already finished in {folder}", file=sys.stderr)
    if executor is None:
        executor = LocalExecutor(config.jobs, config.threads, config.device)
    try:
        with executor:
            for run in pending:
                executor.submit(run, _run_one, config, *run)
            try:
                while executor.pending:
                    try:
                        run, (record, seconds) = executor.next_result()
                    except TaskFailedError as error:
                        raise RunFailedError(_failure(error, len(records), folder)) from error.cause
                    finish(run, record, seconds)
            except KeyboardInterrupt:
                # runs that finished in a worker before the signal but were not handed back yet: kept, not lost
                for run, (record, seconds) in getattr(executor, "finished_results", list)():
                    finish(run, record, seconds)
                raise
    except KeyboardInterrupt:
        raise RunsInterrupted(len(records), total) from None
    finally:
        bar.close()
    return [records[run] for run in runs]


def run_comparison(
    config: CompareConfig, out: str | Path | None = None, resume: bool = False, executor: Any = None
) -> list[RunRecord]:
    """Train and evaluate every (task, row, seed) and return one :class:`~gpattn.comparison.RunRecord` per run, in
    that nesting order (all numbers are fractions, not percent): the runs of
    :func:`~gpattn.comparison.plan_runs` (which first checks every layer's arguments), ``config.jobs`` at once in
    worker processes with ``config.threads`` torch threads each (:func:`execute_runs`).

    :param out: Run folder: each finished run's record is written at once to
        ``out/runs/<task>-<attention>-<seed>.json``.
    :param resume: Read the runs already finished in ``out/runs`` (made with the same settings) instead of training
        them again (needs ``out``).
    :param executor: Where the runs execute (:func:`execute_runs`; default: ``config.jobs`` local processes).
    :raises ~gpattn.comparison.runner.RunsInterrupted: On Ctrl-C (the finished runs are kept in ``out/runs``).
    """
    return execute_runs(config, run_module.plan_runs(config), out=out, resume=resume, executor=executor)
