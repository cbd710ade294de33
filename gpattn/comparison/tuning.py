"""``gpattn tune``: a hyperparameter search per (task, row) with Optuna (:func:`tune`), on validation only.

Each (task, row) is one Optuna study (``<task>-<row>``, :mod:`gpattn.comparison.studies`) of exactly
``config.trials`` trials, the same for every row. A trial (:func:`run_trial`) draws the row's parameters from its
search space (:func:`~gpattn.comparison.tuning_space.search_space`), trains one model with the tuning seed under the
comparison's training loop (at most the task's epochs, early stopping on the validation NLL) and reports the run's
best validation NLL, the objective. The tuned configuration of a study is its best trial's
(:class:`~gpattn.comparison.tuned_configuration.TunedRow`), written to ``<out>/tuned/<task>.json``.

**The test split is never read.** The tuner's data (:func:`tuning_data`) has no shifted or OOD sets, and its test
split is a :class:`SealedSplit`, which raises on any access: a trial that touched it would fail.

**Workers.** ``config.jobs`` processes with ``config.threads`` torch threads each work through the studies in order,
sharing each study through its storage (or, with a Ray executor, this process claims the trials and each runs as a
Ray task, retried once if it fails); several ``gpattn tune`` processes (on one machine with the SQLite file, on
several with a server database) share a study the same way. Every finished trial is in the study at once, and its
record in ``<out>/trials/<task>-<row>-<number>.json``; Ctrl-C marks the trials in flight failed and keeps the others,
and ``resume=True`` runs only the missing ones.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import torch
from tqdm import tqdm

from ..attention import build_attention
from ..methods import get_method
from ..training import TrainingDivergedError, train_ensemble
from .deferred_interrupts import interrupt, interrupt_handler, signals_deferred
from .environment import code_label, code_version
from .local_executor import TaskFailedError, torch_threads
from .records import write_json_atomically
from .runs import build_model, check_model_arguments, layer_arguments, make_train_config
from .sealed_split import tuning_data
from .studies import (
    StudyDivergedError,
    StudyLock,
    TrialsFromOtherCodeWarning,
    claim_trial,
    fail_trial,
    finish_trial,
    in_memory,
    open_storage,
    prepare_study,
    release_trials,
    sqlite_url,
    study_counts,
    summarize_study,
    trial_codes,
    worker_name,
)
from .tasks import TaskData, load_task
from .tune_config import TuneConfig
from .tuned_configuration import TunedRow, check_same_budget, read_tuned, tuned_path, write_tuned
from .tuning_space import ARCHITECTURES, search_space

__all__ = [
    "TuningDivergedError",
    "TuningFailedError",
    "TuningInterrupted",
    "check_budget",
    "check_search_space",
    "check_storage",
    "run_trial",
    "study_name",
    "tune",
]


class TuningInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`tune`: ``finished`` of ``total`` trials are finished and kept in the studies."""

    def __init__(self, finished: int, total: int) -> None:
        super().__init__(f"{finished} of {total} trials finished")
        self.finished, self.total = finished, total


class TuningFailedError(RuntimeError):
    """A trial raised (other than by diverging): the message names the study, the trial and the error."""


class TuningDivergedError(ValueError):
    """Every trial of some studies diverged: their rows have no tuned configuration. Raised by :func:`tune` at the
    end, after the tuned configurations of the other rows were written.

    :ivar diverged: The ``(task, row)`` of those studies.
    :ivar summaries: What :func:`tune` would have returned, ``None`` for the diverged studies.
    """

    def __init__(
        self, message: str, diverged: list[tuple[str, str]], summaries: dict[tuple[str, str], TunedRow | None]
    ) -> None:
        super().__init__(message)
        self.diverged, self.summaries = diverged, summaries


def study_name(task: str, row: str) -> str:
    """``"<task>-<row>"``: the name of the study of ``row`` on ``task``."""
    return f"{task}-{row}"


def check_storage(storage: str | None, jobs: int, executor: Any = None) -> None:
    """Refuse a ``storage`` that the trial workers cannot share: an SQLite database in memory
    (:func:`~gpattn.comparison.studies.in_memory`, e.g. ``sqlite:///:memory:``) with ``jobs > 1`` local worker
    processes, each of which would open an empty database of its own. With ``jobs == 1`` or an ``executor`` (this
    process claims and records every trial) it is fine.

    :raises ValueError: Such a storage, naming it and both options.
    """
    if storage is not None and executor is None and jobs > 1 and in_memory(storage):
        raise ValueError(
            f"the storage {storage!r} (--storage) is an SQLite database in this process's memory, which "
            f"the {jobs} trial worker processes (--jobs {jobs}) cannot share: each would open an empty one; use an "
            "SQLite file (e.g. sqlite:///study.db, or no --storage: OUT/study.db) or --jobs 1"
        )


def check_budget(config: TuneConfig, directory: str | os.PathLike) -> None:
    """Refuse to tune the rows of ``config`` when the tuned files in ``directory`` (``OUT/tuned``) hold other rows
    tuned with another budget, which the rows would sit beside
    (:func:`~gpattn.comparison.tuned_configuration.check_same_budget`): checked before any trial, not when the file
    is written after them.

    :raises ValueError: Another budget (naming the file, both rows and the budgets), or a tuned file that cannot be
        read (:func:`~gpattn.comparison.tuned_configuration.read_tuned`).
    """
    for task in config.tasks:
        kept = {row: entry for row, entry in read_tuned(task, directory).items() if row not in config.rows}
        check_same_budget(dict.fromkeys(config.rows, config.budget(task)), kept, str(tuned_path(task, directory)))


def check_search_space(config: TuneConfig, task: str, data: TaskData) -> None:
    """Build the attention layer of every row of ``config`` in every architecture candidate once, before any trial
    (without touching the caller's RNG), so that no trial fails on a layer's arguments.

    :raises ValueError: A row's model arguments name one the Transformer does not take
        (:func:`~gpattn.comparison.runs.check_model_arguments`), or a layer refuses its arguments (the message names
        the row and the architecture).
    """
    for row in config.rows:
        method = get_method(row)
        check_model_arguments(method)
        for architecture in ARCHITECTURES:
            sizes = config.trial_hyperparameters(task, method, {"architecture": architecture}, data.defaults)
            with torch.random.fork_rng(devices=[]):
                try:
                    build_attention(
                        method.attention, sizes.embed_dim, sizes.num_heads, **layer_arguments(method, sizes)
                    )
                except (ValueError, TypeError) as error:
                    raise ValueError(
                        f"the row {row!r} on {task!r} with the architecture {architecture}: {error}"
                    ) from None


def run_trial(config: TuneConfig, data: TaskData, row: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """Train one model of ``row`` on ``data`` (:func:`tuning_data`) with the trial's ``parameters`` and the tuning
    seed, as a comparison run trains it (:func:`~gpattn.comparison.build_model`,
    :func:`~gpattn.comparison.make_train_config`, :func:`~gpattn.training.train_ensemble`), with early stopping.

    :return: The trial's record (JSON data): ``value`` (the run's best validation NLL; ``None`` when training
        diverged, with the reason in ``diverged``), ``best_epoch``, ``epochs`` trained, the per-epoch ``history``
        (training loss, validation NLL and accuracy), the wall and CPU time of this process ``seconds`` and
        ``cpu_seconds``, ``parameters`` and the run's ``hyperparameters``.
    """
    method = get_method(row)
    hyperparameters = config.trial_hyperparameters(data.name, method, parameters, data.defaults)
    train_config = make_train_config(config.compare_config(), method, hyperparameters, config.seed)
    record: dict[str, Any] = {"parameters": parameters, "hyperparameters": hyperparameters.to_dict()}

    def make_model(member: int) -> torch.nn.Module:
        return build_model(method, hyperparameters, data.num_classes, data.model_kwargs)

    start, cpu = time.perf_counter(), time.process_time()
    try:
        [(_, result)] = train_ensemble(make_model, data.train, data.val, train_config, 1)
    except TrainingDivergedError as error:
        record.update(value=None, diverged=str(error), best_epoch=error.best_epoch, epochs=error.epoch, history=[])
    else:
        history = [
            {key: entry[key] for key in ("epoch", "loss", "val_nll", "val_accuracy")} for entry in result.history
        ]
        record.update(
            value=result.best_val_nll, diverged="", best_epoch=result.best_epoch, epochs=len(history), history=history
        )
    record.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
    return record


# -- the workers -------------------------------------------------------------------------------------------------------
_DATA: dict[tuple[str, int], TaskData] = {}  # per process: each task's tuning data is loaded once


def _data(task: str, seed: int) -> TaskData:
    """The tuning data of ``task``: its validation split drawn with the tuning ``seed``, the test split sealed."""
    if (task, seed) not in _DATA:
        # the first test sequence only (the shifted sets are then not generated), sealed at once
        _DATA[task, seed] = tuning_data(load_task(task, seed, test_size=1))
    return _DATA[task, seed]


def _work(
    config: TuneConfig,
    storage: Any,
    lock: StudyLock,
    out: Path | None,
    report: Callable[..., None],
    orphaned: Callable[[], bool] = lambda: False,
) -> None:
    """Claim and run trials of every study in order until none is waiting (or, in a worker process, until its parent
    is gone: ``orphaned()``)."""
    for task in config.tasks:
        data = _data(task, config.seed)
        for row in config.rows:
            name = study_name(task, row)
            space = search_space(row, len(data.train))
            while not orphaned():
                with signals_deferred():
                    claimed = claim_trial(storage, lock, name, space, config.seed)
                if claimed is None:
                    break
                study, trial, parameters = claimed
                try:
                    record = run_trial(config, data, row, parameters)
                except BaseException as error:
                    with signals_deferred():
                        fail_trial(study, trial, lock, f"{type(error).__name__}: {error}")
                    if isinstance(error, Exception):
                        raise TuningFailedError(f"trial {trial.number} of {name} failed: {error}") from error
                    raise
                _keep(study, trial, lock, out, (task, row), record, report)


def _keep(
    study: Any, trial: Any, lock: StudyLock, out: Path | None, run: tuple[str, str], record: dict, report: Callable
) -> None:
    """Record the finished ``trial`` of ``run = (task, row)`` in its study (value and attributes), write its record
    file and report it."""
    value = math.inf if record["value"] is None else record["value"]
    # the code of this (the claiming) process, as compare's run files store the driver's: a Ray node's installed
    # gpattn would label every trial "commit unknown", and one without the key would fail here after training
    record = {**record, "code": code_version()}
    attributes = {key: record[key] for key in ("hyperparameters", "best_epoch", "epochs", "diverged", "code")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    attributes.update(seconds=record["seconds"], cpu_seconds=record["cpu_seconds"], load_average=load)
    with signals_deferred():
        best = finish_trial(study, trial, lock, value, attributes)
    name = study.study_name
    if out is not None:
        write_json_atomically(out / "trials" / f"{name}-{trial.number}.json", {"study": name, **record})
    report(*run, trial.number, record, best)


def _remote_trial(config: TuneConfig, task: str, row: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A trial as an executor's task (in any process): :func:`run_trial` on the task's tuning data."""
    return run_trial(config, _data(task, config.seed), row, parameters)


def _run_on_executor(
    config: TuneConfig, executor: Any, storage: Any, lock: StudyLock, out: Path | None, report: Callable
) -> None:
    """Trials as an executor's tasks (:class:`~gpattn.comparison.ray_executor.RayExecutor`): this process claims
    each trial (so the workers never open the storage), keeps ``executor.capacity`` trials in flight, and records
    each finished one; a failed trial is marked failed and raises :class:`TuningFailedError`."""
    studies = iter([(task, row) for task in config.tasks for row in config.rows])
    current = next(studies, None)
    claimed: dict[int, tuple] = {}
    with executor:
        while True:
            while current is not None and executor.pending < executor.capacity:
                task, row = current
                space = search_space(row, len(_data(task, config.seed).train))
                with signals_deferred():
                    trial = claim_trial(storage, lock, study_name(task, row), space, config.seed)
                if trial is None:
                    current = next(studies, None)
                    continue
                claimed[trial[1].number, task, row] = trial
                executor.submit((trial[1].number, task, row), _remote_trial, config, task, row, trial[2])
            if not executor.pending:
                return
            try:
                key, record = executor.next_result()
            except TaskFailedError as error:
                study, trial, _ = claimed.pop(error.key)
                with signals_deferred():
                    fail_trial(study, trial, lock, f"{type(error.cause).__name__}: {error.cause}")
                raise TuningFailedError(f"trial {trial.number} of {study.study_name} failed: {error.cause}") from None
            study, trial, _ = claimed.pop(key)
            _keep(study, trial, lock, out, key[1:], record, report)


def _worker_main(config: TuneConfig, url: str, out: Path | None, messages: Any) -> None:
    """A worker process: Ctrl-C goes to the parent (which terminates the workers: SIGTERM stops the trial in
    flight, which is marked failed); a worker whose parent is gone claims no further trial."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, interrupt)
    torch.set_num_threads(config.threads)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    code_version()  # the label of the code this worker imported, read now (its trials record it), not after a trial
    parent = os.getppid()
    try:
        storage, lock = open_storage(url), StudyLock(url)
        _work(
            config,
            storage,
            lock,
            out,
            lambda *message: messages.put(("trial", *message)),
            lambda: os.getppid() != parent,
        )
    except KeyboardInterrupt:
        pass
    except BaseException as error:
        # the parent terminates the workers on this message: from now on this one, whose work is over, ignores it and
        # exits by itself (the handler raised KeyboardInterrupt in the middle of the exit, a traceback beside the
        # one-line error; killing it instead could leave the queue's shared write lock held, and the others hanging)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        messages.put(("error", str(error)))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        messages.put(("exit",))


def _run_in_parallel(
    config: TuneConfig, url: str, out: Path | None, report: Callable[..., None], storage: Any, lock: StudyLock
) -> None:
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    workers = [context.Process(target=_worker_main, args=(config, url, out, messages)) for _ in range(config.jobs)]
    for worker in workers:
        worker.start()
    running, clean = len(workers), False
    try:
        while running:
            try:
                message = messages.get(timeout=1.0)
            except queue.Empty:
                stopped = [worker.exitcode for worker in workers if worker.exitcode not in (None, 0)]
                if stopped:
                    raise TuningFailedError(f"a trial worker stopped with exit code {stopped[0]}") from None
                continue
            if message[0] == "trial":
                report(*message[1:])
            elif message[0] == "error":
                raise TuningFailedError(message[1])
            else:
                running -= 1
        clean = True
    finally:
        if not clean:  # Ctrl-C or a failed trial: stop the trials in flight
            for worker in workers:
                worker.terminate()
        for worker in workers:
            worker.join(timeout=30)
        messages.close()
        if not clean:
            _release(config, storage, lock, {worker_name(worker.pid) for worker in workers})


def _release(config: TuneConfig, storage: Any, lock: StudyLock, workers: set[str]) -> None:
    """Mark failed the trials that ``workers`` claimed and did not finish (stopped between a claim and the trial's
    end), so that ``--resume`` runs them again."""
    names = [study_name(task, row) for task in config.tasks for row in config.rows]
    release_trials(storage, lock, names, workers, "interrupted")


# -- the whole search --------------------------------------------------------------------------------------------------
def tune(
    config: TuneConfig,
    out: str | os.PathLike | None = None,
    storage: str | None = None,
    resume: bool = False,
    executor: Any = None,
) -> dict[tuple[str, str], TunedRow | None]:
    """Tune every row of ``config`` on every task: one Optuna study per (task, row) with ``config.trials`` trials.

    Before any training, the storage is checked (:func:`check_storage`) and opened, the rows' budget checked against
    the rows already in ``out/tuned`` (:func:`check_budget`), every study created or joined (its settings checked)
    and every row's layer built in every architecture (:func:`check_search_space`).

    A study whose every trial diverged has no configuration: the other rows' are written all the same, and
    :class:`TuningDivergedError` is raised at the end, naming it (``resume=True`` writes them and raises it again).

    :param config: The settings.
    :param out: Run folder: trial records in ``out/trials/``, the tuned configurations in ``out/tuned/<task>.json``,
        and by default the studies in ``out/study.db``.
    :param storage: An Optuna RDB URL (default ``sqlite:///<out>/study.db``).
    :param resume: Continue interrupted studies: their trials left running are marked failed and as many trials as
        are missing run.
    :param executor: ``None``: ``config.jobs`` local trial workers; or a
        :class:`~gpattn.comparison.ray_executor.RayExecutor`: each trial a Ray task (this process claims the trials
        and records them, the workers need no access to the storage).
    :return: ``(task, row)`` -> the tuned configuration, or ``None`` for a study whose trials are not all finished
        (trials still running in another process, or failed: ``resume=True`` completes it).
    :raises ~gpattn.comparison.studies.StorageError: The storage cannot be opened.
    :raises ValueError: A study exists with other settings, a layer refuses an architecture, an in-memory storage
        with ``config.jobs > 1`` workers (:func:`check_storage`), or rows of another budget in ``out/tuned``
        (:func:`check_budget`); all before any trial.
    :raises TuningInterrupted: On Ctrl-C (finished trials are kept).
    :raises TuningFailedError: A trial raised (the other trials are kept).
    :raises TuningDivergedError: Every trial of a study diverged (at the end: the other rows' configurations are
        written, and carried by the error).
    """
    if out is None and storage is None:
        raise ValueError("tune needs an out folder or a storage URL (the studies' storage), got neither")
    check_storage(storage, config.jobs, executor)
    out = None if out is None else Path(out)
    if out is not None:
        check_budget(config, out / "tuned")  # refused now, not after the trials (when the file is written)
        out.mkdir(parents=True, exist_ok=True)  # (trials/ once the studies are prepared: a refused start leaves none)
    code_version()  # read now, before any trial trains: the label of the code this process imported (kept for it)
    url = storage or sqlite_url(out / "study.db")
    database = open_storage(url)
    lock = StudyLock(url)
    studies = {}
    for task in config.tasks:
        data = _data(task, config.seed)
        check_search_space(config, task, data)
        for row in config.rows:
            base = config.trial_hyperparameters(task, get_method(row), {}, data.defaults)
            space = search_space(row, len(data.train))
            settings = {
                "task": task,
                "row": row,
                "trials": config.trials,
                "seed": config.seed,
                "threads": config.threads,
                "eval_samples": config.eval_samples,
                "device": config.device,
                "search_space": {parameter.name: parameter.describe() for parameter in space},
                "hyperparameters": base.to_dict(),
            }
            prepare_study(database, lock, study_name(task, row), settings, resume)
            studies[task, row] = space
    if out is not None:
        (out / "trials").mkdir(exist_ok=True)
    if resume:
        _warn_other_code(database, [study_name(*key) for key in studies])
    total = config.trials * len(studies)
    finished = sum(study_counts(database, study_name(*key))["complete"] for key in studies)
    bar = tqdm(total=total, initial=finished, desc="tune", file=sys.stderr, disable=None if config.progress else True)
    done = [finished]

    def report(task: str, row: str, number: int, record: dict[str, Any], best: float) -> None:
        done[0] += 1
        bar.update()
        if config.progress:
            value = "diverged" if record["value"] is None else f"{record['value']:.4f}"
            tqdm.write(
                f"[{done[0]}/{total}] {task}/{row} trial {number}: val NLL {value} (best {best:.4f}), "
                f"{record['epochs']} epochs, {record['seconds']:.1f} s",
                file=sys.stderr,
            )

    if config.progress and finished:
        tqdm.write(f"resuming: {finished} of {total} trials already finished", file=sys.stderr)
    try:
        if executor is not None:
            with interrupt_handler(signal.SIGINT):
                _run_on_executor(config, executor, database, lock, out, report)
        elif config.jobs == 1:
            with torch_threads(config.threads), interrupt_handler(signal.SIGINT):
                _work(config, database, lock, out, report)
        else:
            _run_in_parallel(config, url, out, report, database, lock)
    except KeyboardInterrupt:
        _release(config, database, lock, {worker_name()})
        raise TuningInterrupted(done[0], total) from None
    except TuningFailedError:
        _release(config, database, lock, {worker_name()})
        raise
    finally:
        bar.close()
    return _summaries(config, database, studies, out)


def _warn_other_code(database: Any, names: list[str]) -> None:
    """Warn (:class:`~gpattn.comparison.studies.TrialsFromOtherCodeWarning`) when finished trials of the studies
    ``names`` were run by other code than this process's."""
    current = code_label(code_version())
    other = {}
    for name in names:
        counts = {label: count for label, count in trial_codes(database, name).items() if label != current}
        if counts:
            other[name] = ", ".join(f"{count} by {label}" for label, count in counts.items())
    if other:
        shown = "; ".join(f"{name}: {text}" for name, text in other.items())
        warnings.warn(
            f"--resume: finished trials were run by other code than this call's ({current}): {shown}. They are kept "
            "(their values may differ from what this code gives) and counted in the tuned file's trial_codes; use "
            "another --out / --storage to tune every trial with this code",
            TrialsFromOtherCodeWarning,
            stacklevel=3,
        )


def _summaries(
    config: TuneConfig, database: Any, studies: dict[tuple[str, str], Any], out: Path | None
) -> dict[tuple[str, str], TunedRow | None]:
    record = {"tuning_seed": config.seed, "eval_samples": config.eval_samples, "jobs": config.jobs}
    record.update(threads=config.threads, label=config.label)
    summaries: dict[tuple[str, str], TunedRow | None] = {}
    diverged = []
    for (task, row), space in studies.items():
        fixed = config.fixed_hyperparameters(task)
        try:
            summaries[task, row] = summarize_study(database, study_name(task, row), space, fixed, record)
        except StudyDivergedError:  # no configuration for this row: the others' are written all the same
            summaries[task, row] = None
            diverged.append((task, row))
    if out is not None:
        for task in config.tasks:
            rows = {row: summaries[task, row] for row in config.rows if summaries[task, row] is not None}
            if rows:
                write_tuned(task, rows, out / "tuned")
    if diverged:
        names = ", ".join(repr(study_name(task, row)) for task, row in diverged)
        others = any(summary is not None for summary in summaries.values())
        written = (
            f"; the other rows' tuned configurations are written to {out / 'tuned'}"
            if out is not None and others
            else ""
        )
        raise TuningDivergedError(
            f"every trial of the {'study' if len(diverged) == 1 else 'studies'} {names} diverged: no configuration "
            f"to choose{written}; tune the rows again into another --out (or --storage) with other options (e.g. "
            "another --seed or more --trials), or leave the diverged rows out (--rows)",
            diverged,
            summaries,
        )
    return summaries
