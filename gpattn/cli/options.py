"""What the commands share: option types whose bad values exit with status 2 before anything runs, the run folder
check (:func:`prepare_out`), the errors a command prints as one line, and the common options.

A bad value exits with status 2 and ``gpattn <command>: error: argument --x: <what was expected, what came>``; the
checks are :mod:`gpattn.validation`'s. A command holds a lock on its run folder while it runs (:func:`prepare_out`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

from ..validation import check_device, check_float, check_int, check_seed

__all__ = [
    "LOCK_FILE",
    "RUN_FOLDER_MARKS",
    "NothingToResume",
    "CommandError",
    "CommandInterrupted",
    "kept_on_interrupt",
    "add_common",
    "add_executor",
    "bounded_int",
    "device",
    "make_executor",
    "missing_tuned_files",
    "mps_note",
    "non_negative_float",
    "non_negative_int",
    "open_unit_float",
    "out_dir",
    "positive_float",
    "positive_int",
    "tuned_dir",
    "prepare_out",
    "remove_stale_files",
    "seed_number",
]


def _option(kind: Callable[[str], Any], check: Callable[..., Any], **bounds: Any) -> Callable[[str], Any]:
    """An argparse type: the text converted by ``kind`` (or left as text when it does not convert) and checked by a
    :mod:`gpattn.validation` helper, whose message names what was expected and what came."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = text
        try:
            return check("the value", value, **bounds)
        except ValueError as error:  # InputTypeError is a ValueError too
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


positive_int = _option(int, check_int, minimum=1)
#: A seed of gpattn's generators, in [0, 2**64 - 1] (:func:`~gpattn.validation.check_seed`): refused as a bad option
#: (exit status 2) by the option's name, not later by the configuration as a failed run
seed_number = _option(int, check_seed)


def bounded_int(minimum: int, maximum: int) -> Callable[[str], Any]:
    """An argparse type: an integer in ``[minimum, maximum]``, named by the option in its message."""
    return _option(int, check_int, minimum=minimum, maximum=maximum)


non_negative_int = _option(int, check_int, minimum=0)
positive_float = _option(float, check_float, minimum=0.0, strict_minimum=True)
non_negative_float = _option(float, check_float, minimum=0.0)
#: A rate strictly between 0 and 1 (``--mc-dropout``: 0 would be no dropout at all, 1 drops everything).
open_unit_float = _option(float, check_float, minimum=0.0, maximum=1.0, strict_minimum=True, strict_maximum=True)


def device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:<index>``, available on this machine."""
    try:
        check_device("device", text, types=("cpu", "cuda"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def out_dir(text: str) -> str:
    """An argparse type: a folder path (created later if missing), not an existing file."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder (created if missing), got the existing file {text!r}")
    return text


def tuned_dir(text: str) -> str:
    """An argparse type: an existing folder (of tuned configurations ``<task>.json``)."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"expected the folder of the tuned configurations <task>.json (e.g. OUT/tuned of gpattn tune), got {text!r}"
        )
    return text


def missing_tuned_files(config: Any) -> list[str]:
    """The tasks of ``config`` (a :class:`~gpattn.comparison.CompareConfig`) without a file in its explicit
    ``tuned_dir``: their runs train with the shared settings (empty when the configuration is untuned or uses the
    package's folder)."""
    from ..comparison.tuned_configuration import tuned_path

    if not config.tuned or config.tuned_dir is None:
        return []
    return [task for task in config.tasks if not tuned_path(task, config.tuned_dir).is_file()]


#: where the CUDA driver looks for a Multi-Process Service control daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is not set
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_note(device: str, workers: int, executor: str) -> str | None:
    """The note for ``workers`` local worker processes that share one GPU without an MPS daemon, or ``None``.

    Processes that share a GPU run their kernels in time slices, one CUDA context at a time, unless a CUDA
    Multi-Process Service (MPS) control daemon runs, under which their kernels run on the GPU at once. The daemon is
    taken to run when ``CUDA_MPS_PIPE_DIRECTORY`` is set or the default pipe folder exists (a folder left by a daemon
    that has stopped silences the note too: it says how to go faster, nothing goes wrong without it). Starting a
    daemon is left to the user: it serves every process of the machine's GPUs, not only this command's. Ray's workers
    (``--executor ray``) get no note: where they run is the cluster's to say.

    :param workers: The worker processes at most: ``--jobs``, capped by the runs or trials planned.
    """
    if executor != "local" or workers < 2 or not device.startswith("cuda"):
        return None
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or os.path.isdir(MPS_PIPE_DIRECTORY):
        return None
    return (
        f"up to {workers} worker processes share the GPU in time slices; under a CUDA MPS daemon their kernels run "
        "at once, with the same results (gpattn compare --main --seeds 0 1 2 3 --jobs 8 on one H200: 1.4x faster): "
        "start one with nvidia-cuda-mps-control -d before the command, stop it with "
        "'echo quit | nvidia-cuda-mps-control' after"
    )


class CommandError(Exception):
    """An expected failure of a command: printed as one line ``gpattn <command>: error: <message>``, exit status 1."""


class CommandInterrupted(KeyboardInterrupt):
    """Ctrl-C, with the line that says what was kept."""


@contextmanager
def kept_on_interrupt(unit: str, where: object) -> Iterator[None]:
    """Turn Ctrl-C (a ``KeyboardInterrupt``) inside the block into :class:`CommandInterrupted` with the line
    ``interrupted; <finished> of <total> <unit> finished, kept in <where>; the same command with --resume continues``;
    the count where the interrupt carries ``finished`` and ``total`` (e.g.
    :class:`~gpattn.comparison.runner.RunsInterrupted`), left out where it does not (a plain ``KeyboardInterrupt``).

    :param unit: What was finished, plural (``"runs"``, ``"trials"``).
    :param where: Where the finished ones are kept (a folder, a file, a storage URL with its password hidden).
    """
    try:
        yield
    except KeyboardInterrupt as interrupt:
        finished = getattr(interrupt, "finished", None)
        done = "" if finished is None else f"{finished} of {interrupt.total} {unit} finished, "
        raise CommandInterrupted(
            f"interrupted; {done}kept in {where}; the same command with --resume continues"
        ) from None


THREADS_HELP = (
    "torch threads per run (default: %(default)s; these models are small, so one thread per run is the fastest as "
    "soon as runs go in parallel or the machine has other work; the numbers depend on the thread count, so "
    "results are reproducible at a given --threads)"
)


def add_common(parser: argparse.ArgumentParser, resume: str | None, threads_help: str = THREADS_HELP) -> None:
    """Add ``--threads`` (help ``threads_help``: a command that runs one thing at a time says so) and ``--overwrite``
    (whose help names what ``--resume`` does, when the command has one)."""
    parser.add_argument("--threads", type=positive_int, default=1, help=threads_help)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in OUT (without it, an OUT that holds files is refused"
        + (f"; --resume {resume}; not with --resume)" if resume else ")"),
    )


def add_executor(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--executor`` and ``--ray-address`` (``what``: the unit of work, e.g. ``"run"``)."""
    parser.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help=f"where each {what} trains: local (--jobs worker processes of this machine) or ray (each {what} a Ray "
        "task with --threads CPUs, and 1/--jobs of a GPU with --device cuda, retried once if it fails; the results "
        "come back here and are written here; needs pip install 'gpattn[ray]') (default: %(default)s)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="with --executor ray: the Ray cluster, host:port (its GCS, e.g. the head node's 10.0.0.1:6379), "
        "ray://host:10001 (Ray Client) or auto (RAY_ADDRESS, else the cluster started on this machine); checked "
        "before anything trains (default: a new local Ray instance of --jobs x --threads CPUs)",
    )


def make_executor(args: argparse.Namespace) -> Any:
    """The executor that ``--executor`` names: ``None`` for ``local`` (the command's own worker processes), or a
    :class:`~gpattn.comparison.ray_executor.RayExecutor` whose address was checked.

    :raises ValueError: ``--ray-address`` without ``--executor ray``, a malformed address, a device with an index.
    :raises ~gpattn.comparison.ray_executor.RayUnavailableError: Ray is missing, or nothing answers at the address.
    """
    if args.executor == "local":
        if args.ray_address is not None:
            raise ValueError("--ray-address needs --executor ray")
        return None
    from ..comparison.ray_executor import RayExecutor

    return RayExecutor(args.jobs, args.threads, args.device, args.ray_address)


def remove_stale_files(folder: Path, names: list[str], written: list[Path]) -> list[str]:
    """Delete the files ``names`` directly in ``folder`` that are not among the paths ``written`` (a command's own
    outputs from an earlier run that this one did not write again) and return the names deleted. A link goes, not its
    target; folders stay."""
    kept = {Path(path).absolute() for path in written}
    removed = []
    for name in names:
        path = folder / name
        if path.absolute() not in kept and (path.is_file() or path.is_symlink()):
            path.unlink()
            removed.append(name)
    return removed


class NothingToResume(UserWarning):
    """``--resume`` on a run folder that holds nothing (missing, or empty): the command starts from the beginning."""


#: The lock file that :func:`prepare_out` holds in a run folder while a command writes to it.
LOCK_FILE = ".gpattn.lock"
#: Entries that only one command writes into its run folder (``results.json`` is both compare's and regression's;
#: compare's per-task figures are left out, its ``runs`` and ``table.md`` mark it): a folder that holds one that the
#: command does not replace is another command's run, refused by :func:`prepare_out`. Each command's ``OUTPUTS`` (for
#: compare, ``run_folder_outputs()``) name what it writes; a test checks that this list is derived from them.
RUN_FOLDER_MARKS = (
    "runs", "table.md", "results.csv",  # compare
    "run.json", "record.json", "checkpoints",  # train
    "study.db", "study.db.lock", "trials", "tuned",  # tune
    "posterior.png",  # regression
)  # fmt: skip


@contextmanager
def prepare_out(
    out: str | os.PathLike,
    *,
    overwrite: bool,
    resume: bool,
    replaced: tuple[str, ...],
    resumes_from_out: bool = True,
) -> Iterator[Path]:
    """Check and lock the run folder ``out`` before anything runs, for the duration of the ``with`` block: it is
    created if missing and must be writable; :data:`LOCK_FILE` in it is locked (``fcntl.flock``, released when the
    block or the process ends, also after a kill), so that a second command on the same folder stops at once; a folder
    that already holds files is refused unless ``resume`` (continue it) or ``overwrite`` (the entries ``replaced``,
    e.g. ``"results.json"``, ``"runs"``, are deleted first, so no stale result is mixed with new ones); a folder that
    holds another command's run (one of :data:`RUN_FOLDER_MARKS` not among ``replaced``) is refused whatever the
    flags; ``resume`` on
    a folder that holds nothing warns (:class:`NothingToResume`) and goes on, unless ``resumes_from_out`` is false
    (what the command continues is kept elsewhere, e.g. ``gpattn tune --storage``).

    :raises ValueError: ``resume`` and ``overwrite`` together.

    :raises CommandError: The folder cannot be created or written, another gpattn command is writing to it, it
        holds an earlier run, or another command's run.
    """
    if resume and overwrite:
        raise ValueError(
            "resume and overwrite exclude each other: resume continues the run in out, overwrite replaces it"
        )
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
        lock = open(out / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the block)
    except OSError as error:
        reason = error.strerror or str(error)
        raise CommandError(f"--out {out}: cannot create or write the folder ({reason})") from None
    with lock:
        _lock(lock, out)
        held = sorted(path.name for path in out.iterdir() if path.name != LOCK_FILE)
        foreign = [name for name in held if name in RUN_FOLDER_MARKS and name not in replaced]
        if foreign:  # --overwrite would delete this command's entries only and mix the two runs' files
            raise CommandError(
                f"--out {out} holds the run of another gpattn command ({', '.join(foreign)}), which this command "
                "neither replaces nor continues: choose another --out"
            )
        # a mistyped folder would otherwise start everything again without a word
        if resume and resumes_from_out and not held:
            message = f"--resume: --out {out} holds no earlier run; everything runs from the start"
            warnings.warn(message, NothingToResume, stacklevel=3)  # the command's call of prepare_out
        if held and not resume:
            if not overwrite:
                shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
                raise CommandError(
                    f"--out {out} already holds files ({shown}): pass --overwrite to replace that run"
                    + (", --resume to continue it" if "runs" in replaced or "checkpoints" in replaced else "")
                    + ", or choose another --out"
                )
            for name in replaced:
                path = out / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
        yield out


def _lock(handle: IO[str], out: Path) -> None:
    """Lock the open lock file ``handle`` of ``out`` for this process (and write its id into it), or raise
    :class:`CommandError` naming the process that holds it."""
    if fcntl is None:  # no advisory locks on this platform (Windows): nothing to hold
        return
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        raise CommandError(
            f"--out {out} is in use by another gpattn command ({holder}); wait until it ends, or choose another --out"
        ) from None
    with contextlib.suppress(OSError):  # the holder's name is a courtesy: a full disk must not stop the command
        os.ftruncate(handle.fileno(), 0)
        os.pwrite(handle.fileno(), f"process {os.getpid()}".encode(), 0)
