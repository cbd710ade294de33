"""The Optuna studies of ``gpattn tune``: their storage, an exact trial budget shared by any number of workers, seeded
sampling, and the summary of a finished study (:class:`~gpattn.comparison.tuned_configuration.TunedRow`).

**Storage.** Any Optuna RDB URL (:func:`open_storage`): an SQLite file (``sqlite:///<out>/study.db``, the default of
``gpattn tune``: no server), or a PostgreSQL/MySQL URL that workers on several machines share.

**Exact budget, no duplicates.** The process that creates a study queues exactly ``trials`` waiting trials (Optuna's
``enqueue_trial`` without fixed parameters); a worker only ever claims a waiting trial (its state set from WAITING to
RUNNING, which succeeds for one worker only) and never creates one, so a study ends with ``trials`` finished trials
whatever the number of workers. On SQLite the claim is not atomic between processes (Optuna's read-then-write of the
state races: measured here, three processes claimed 326 trials out of 300 queued), so every write of the workers of
one machine goes through a lock file beside the database (:class:`StudyLock`); a server database locks the row itself.
``--resume`` marks the trials left RUNNING by an interrupted run as failed and queues as many as are missing.

**Seeded sampling.** A trial's parameters are drawn by a TPE sampler seeded with ``seed * 1000 + k`` from the study's
finished trials, ``k`` its slot: the smallest number that no finished or running trial of the study holds when it is
claimed (:func:`claim_trial`; a failed trial gives its slot back), so that no two finished trials share a seed: with
one worker a study is a function of the seed (an interrupted and resumed study draws what the
uninterrupted one draws); with several workers the draws depend on the order in which trials finish. The seed does
not depend on the row and the shared parameters are drawn first, so the random start-up trials of the rows are paired
(the same learning rate, weight decay, dropout and architecture).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import math
import os
import platform
import signal
import time
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.trial import TrialState
from sqlalchemy.engine import make_url

from .. import __version__
from ..validation import InputTypeError
from .deferred_interrupts import interrupt_handler, signals_deferred
from .environment import code_label, code_version
from .tuned_configuration import TunedRow
from .tuning_space import SearchParameter, hyperparameter_values

__all__ = [
    "StorageError",
    "StudyDivergedError",
    "StudyLock",
    "TrialsFromOtherCodeWarning",
    "claim_trial",
    "fail_trial",
    "finish_trial",
    "in_memory",
    "open_storage",
    "prepare_study",
    "release_trials",
    "study_counts",
    "summarize_study",
    "trial_codes",
    "worker_name",
]

#: How long a process that joins a study made by another one waits for its settings (a server database, no lock).
JOIN_TIMEOUT = 60.0


class StorageError(RuntimeError):
    """A study storage that cannot be opened (a malformed or unreachable URL, a missing database driver)."""


class StudyDivergedError(ValueError):
    """Every trial of a finished study diverged: there is no configuration to choose (:func:`summarize_study`)."""


class StudyLock:
    """An exclusive lock (``fcntl.flock`` on ``<database>.lock``) around the study writes of the processes of one
    machine on an SQLite storage; a no-op for a server database, which locks the rows it updates.

    :param url: The storage URL.
    """

    def __init__(self, url: str) -> None:
        database = make_url(url).database if url.startswith("sqlite") else None
        self.path = None if database in (None, "", ":memory:") else Path(os.path.abspath(database + ".lock"))
        self.file = None

    def __enter__(self) -> StudyLock:
        if self.path is not None:
            if not self.path.parent.is_dir():
                raise FileNotFoundError(f"the folder {self.path.parent} of the SQLite database does not exist")
            self.file = open(self.path, "a")  # noqa: SIM115 (closed in __exit__)
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url`` (its tables created if it is new, under the :class:`StudyLock`, so that
    processes starting together do not race), checked by connecting to it.

    :raises StorageError: The URL is malformed, its database driver is missing or the database cannot be reached
        (the message is one line naming the URL).
    """
    try:
        with StudyLock(url):
            return optuna.storages.RDBStorage(url)
    except Exception as error:  # sqlalchemy's ArgumentError/OperationalError, a driver's ImportError, ...
        reason = " ".join(str(error).split("\n")[0].split()) or type(error).__name__
        raise StorageError(f"cannot open the study storage {shown_url(url)!r}: {reason}") from None


def shown_url(url: str) -> str:
    """A storage URL as messages show it: its password hidden (``postgresql://user:***@host/db``); a URL that
    SQLAlchemy cannot parse as it is."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 (malformed: nothing to hide that the parser could find)
        return url


def in_memory(url: str) -> bool:
    """Whether ``url`` is an SQLite database held in the memory of the process that opens it (``sqlite://``,
    ``sqlite:///:memory:``, a ``file::memory:`` or ``mode=memory`` URI): another process that opens the same URL gets
    an empty database of its own. A URL that SQLAlchemy cannot parse is not (:func:`open_storage` refuses it).

    Example:
        >>> in_memory("sqlite:///:memory:"), in_memory("sqlite://"), in_memory("sqlite:///study.db")
        (True, True, False)
    """
    try:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
    except Exception:  # noqa: BLE001 (malformed: open_storage says why)
        return False
    database = parsed.database or ""
    memory = database in ("", ":memory:") or database.startswith("file::memory:")
    return backend == "sqlite" and (memory or parsed.query.get("mode") == "memory")


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of the SQLite file ``path`` (built, not formatted: a ``?`` or ``%`` in a folder name is part
    of the path, not a query or an escape)."""
    return sqlalchemy.engine.URL.create("sqlite", database=str(path)).render_as_string()


#: The states of the trials that hold a sampling slot (a failed trial gives its slot back).
_HELD = (TrialState.COMPLETE, TrialState.RUNNING)


def _trials(storage: optuna.storages.RDBStorage, study_id: int, *states: TrialState) -> list:
    return storage.get_all_trials(study_id, deepcopy=False, states=states)


def study_counts(storage: optuna.storages.RDBStorage, name: str) -> dict[str, int]:
    """The number of trials of the study ``name`` by state: ``"complete"``, ``"running"``, ``"waiting"``,
    ``"fail"``."""
    study_id = storage.get_study_id_from_name(name)
    states = {"complete": TrialState.COMPLETE, "running": TrialState.RUNNING, "waiting": TrialState.WAITING}
    counts = {label: len(_trials(storage, study_id, state)) for label, state in states.items()}
    counts["fail"] = len(_trials(storage, study_id, TrialState.FAIL))
    return counts


def prepare_study(
    storage: optuna.storages.RDBStorage, lock: StudyLock, name: str, settings: dict[str, Any], resume: bool
) -> None:
    """Create the study ``name`` with ``settings["trials"]`` waiting trials, or join the existing one.

    A joined study must have been made with the same ``settings`` (JSON data: the trial budget, seed, search space,
    fixed hyperparameters, ...). With ``resume``, its RUNNING trials (left by an interrupted run) are marked failed
    and the missing trials queued again.

    :raises ValueError: The study exists with other settings (the message names each changed entry, a nested one by
        its dotted key: ``hyperparameters.epochs: stored 1, now 2``), or was not made by ``gpattn tune``.
    :raises InputTypeError: ``settings`` are not JSON data (e.g. a NumPy number): refused before the study is made.
    """
    try:  # as the storage will give them back (tuples as lists), checked before a study without settings is left
        settings = json.loads(json.dumps(settings, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise InputTypeError(f"prepare_study: expected the settings of {name!r} to be JSON data ({error})") from None
    # Ctrl-C waits for the new study's settings: a study left without them is refused by every later run
    with lock, interrupt_handler(signal.SIGINT), signals_deferred():
        try:
            study = optuna.create_study(study_name=name, storage=storage, direction="minimize")
        except DuplicatedStudyError:
            study = None
        if study is not None:
            for _ in range(settings["trials"]):
                study.enqueue_trial({})
            study.set_user_attr("settings", settings)  # last: a joining process waits for it
            return
    study = optuna.load_study(study_name=name, storage=storage)
    stored = _wait_for_settings(study, name)
    if stored != settings:
        details = "; ".join(f"{key}: stored {old}, now {new}" for key, old, new in _differences(stored, settings))
        raise ValueError(
            f"the study {name!r} was made with other settings ({details}); use the original options, or another "
            "--storage / --out"
        )
    if resume:
        with lock:
            study_id = storage.get_study_id_from_name(name)
            for trial in _trials(storage, study_id, TrialState.RUNNING):
                trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
                storage.set_trial_user_attr(trial_id, "failed", "interrupted (marked failed by --resume)")
                storage.set_trial_state_values(trial_id, TrialState.FAIL)
            held = len(_trials(storage, study_id, TrialState.COMPLETE, TrialState.WAITING))
            for _ in range(settings["trials"] - held):
                study.enqueue_trial({})


def _differences(stored: Any, now: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """The entries in which the settings ``stored`` and ``now`` differ, as ``(dotted key, stored, now)`` (values as
    ``repr``, ``absent`` for a missing key), nested mappings compared entry by entry (``hyperparameters.epochs``,
    ``search_space.beta``), keys sorted."""
    if not (isinstance(stored, dict) and isinstance(now, dict)):
        return [] if stored == now else [(prefix, repr(stored), repr(now))]
    differences = []
    for key in sorted(set(stored) | set(now), key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        if key not in stored or key not in now:
            shown = [repr(side[key]) if key in side else "absent" for side in (stored, now)]
            differences.append((name, *shown))
        else:
            differences += _differences(stored[key], now[key], name)
    return differences


def _wait_for_settings(study: optuna.Study, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + JOIN_TIMEOUT
    while "settings" not in study.user_attrs:
        if time.monotonic() > deadline:
            raise ValueError(
                f"the study {name!r} has no gpattn tune settings: it was not made by gpattn tune (or its making was "
                "cut short); use another --storage / --out"
            )
        time.sleep(0.5)
    return study.user_attrs["settings"]


def claim_trial(
    storage: optuna.storages.RDBStorage,
    lock: StudyLock,
    name: str,
    space: tuple[SearchParameter, ...],
    seed: int,
) -> tuple[optuna.Study, optuna.Trial, dict[str, Any]] | None:
    """Claim a waiting trial of the study ``name`` and draw its parameters (see the module docstring), or ``None``
    when none is waiting.

    :return: ``(study, trial, parameters)``: the study loaded with the trial's seeded TPE sampler, the RUNNING trial,
        and its parameters (name -> value, in the order of ``space``).
    """
    study_id = storage.get_study_id_from_name(name)
    with lock:
        for waiting in _trials(storage, study_id, TrialState.WAITING):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, waiting.number)
            try:
                if not storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                    continue  # another worker claimed it
            except UpdateFinishedTrialError:
                continue
            held = {trial.user_attrs.get("slot") for trial in _trials(storage, study_id, *_HELD)}
            slot = min(set(range(len(held) + 1)) - held)  # the first slot no finished or running trial holds
            storage.set_trial_user_attr(trial_id, "slot", slot)
            storage.set_trial_user_attr(trial_id, "worker", worker_name())
            # a fresh study object: its cache of trials is the storage's now
            sampler = optuna.samplers.TPESampler(seed=seed * 1000 + slot)
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
            trial = optuna.Trial(study, trial_id)
            return study, trial, {parameter.name: parameter.suggest(trial) for parameter in space}
    return None


def worker_name(pid: int | None = None) -> str:
    """``"<host>:<pid>"``: the worker that claims a trial (its ``worker`` user attribute), this process by default."""
    return f"{platform.node()}:{os.getpid() if pid is None else pid}"


def release_trials(
    storage: optuna.storages.RDBStorage, lock: StudyLock, names: list[str], workers: set[str], reason: str
) -> None:
    """Mark failed the RUNNING trials of the studies ``names`` claimed by ``workers`` (:func:`worker_name`), e.g. of
    worker processes that were stopped: ``--resume`` queues trials in their place."""
    with lock:
        for name in names:
            study_id = storage.get_study_id_from_name(name)
            for trial in _trials(storage, study_id, TrialState.RUNNING):
                if trial.user_attrs.get("worker") in workers:
                    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
                    storage.set_trial_user_attr(trial_id, "failed", reason)
                    storage.set_trial_state_values(trial_id, TrialState.FAIL)


def finish_trial(
    study: optuna.Study, trial: optuna.Trial, lock: StudyLock, value: float, attributes: dict[str, Any]
) -> float:
    """Record the finished ``trial``'s objective ``value`` (``inf`` for a diverged run; a NaN, which Optuna would
    record as a failed trial for ``--resume`` to run again, counts as diverged too) and its ``attributes`` (Optuna user
    attributes, JSON data).

    :return: The study's best value so far.
    """
    if math.isnan(value):
        value = math.inf
    with lock:
        for key, item in attributes.items():
            trial.set_user_attr(key, item)
        study.tell(trial, value)
    return min(frozen.value for frozen in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))


def fail_trial(study: optuna.Study, trial: optuna.Trial, lock: StudyLock, reason: str) -> None:
    """Mark ``trial`` failed (an error or Ctrl-C stopped it): ``--resume`` queues a trial in its place."""
    with lock:
        trial.set_user_attr("failed", reason)
        study.tell(trial, state=TrialState.FAIL)


class TrialsFromOtherCodeWarning(UserWarning):
    """``gpattn tune --resume`` continues studies whose finished trials another code ran (another gpattn version or
    git commit, or a trial recorded before trials recorded it): they are kept, and their values may differ from what
    this code gives. The tuned file's ``study`` record counts the trials of each code (``trial_codes``)."""


def trial_codes(storage: optuna.storages.RDBStorage, name: str) -> dict[str, int]:
    """The codes that ran the finished trials of the study ``name``: :func:`~gpattn.comparison.environment.code_label`
    -> number of trials (``"not recorded"`` for trials recorded before trials stored their code), the code of the
    most trials first."""
    study_id = storage.get_study_id_from_name(name)
    counts: dict[str, int] = {}
    for trial in _trials(storage, study_id, TrialState.COMPLETE):
        label = code_label(trial.user_attrs.get("code"))
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def summarize_study(
    storage: optuna.storages.RDBStorage,
    name: str,
    space: tuple[SearchParameter, ...],
    fixed: dict[str, Any],
    record: dict[str, Any],
) -> TunedRow | None:
    """The tuned configuration of the finished study ``name``, or ``None`` while fewer than its budget of trials
    have finished (others are still running or failed: ``--resume`` completes it).

    :param space: The study's search space.
    :param fixed: The hyperparameters every trial had (epochs, patience), recorded beside the best trial's.
    :param record: Entries of :attr:`~gpattn.comparison.tuned_configuration.TunedRow.study` known to the caller
        (seed, jobs, threads, label); the wall time, trial seconds, load average, date, versions and machine are
        added here.
    :raises StudyDivergedError: Every trial diverged (no configuration to choose).
    """
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(trials) < study.user_attrs["settings"]["trials"]:
        return None
    best = min(trials, key=lambda trial: (trial.value, trial.number))
    if not math.isfinite(best.value):
        raise StudyDivergedError(f"every trial of the study {name!r} diverged: no configuration to choose")
    started = min(trial.datetime_start for trial in trials)
    ended = max(trial.datetime_complete for trial in trials)
    loads = [trial.user_attrs["load_average"] for trial in trials if "load_average" in trial.user_attrs]
    record = {
        **record,
        "sampler": f"optuna {optuna.__version__} TPESampler(seed=tuning_seed * 1000 + slot)",
        "wall_seconds": round((ended - started).total_seconds(), 1),
        "trial_seconds": round(sum(trial.user_attrs.get("seconds", 0.0) for trial in trials), 1),
        "trial_cpu_seconds": round(sum(trial.user_attrs.get("cpu_seconds", 0.0) for trial in trials), 1),
        "failed_trials": len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,))),
        "load_average": round(sum(loads) / len(loads), 2) if loads else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpattn": __version__,
        "commit": code_version()["git_commit"],  # +dirty.<hash> with uncommitted changes, as in the run files
        "trial_codes": trial_codes(storage, name),  # more than one entry when --resume continued other code's trials
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
    }
    return TunedRow(
        hyperparameters={**fixed, **hyperparameter_values(best.params)},
        parameters=dict(best.params),
        best_val_nll=best.value,
        best_trial=best.number,
        trials=len(trials),
        search_space={parameter.name: parameter.describe() for parameter in space},
        study=record,
    )
