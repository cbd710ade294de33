"""The machine and software a comparison's report was written on: the ``environment`` block of ``results.json``
(:func:`run_environment`), beside the settings that determine the numbers (``config``, threads included).

Float rounding, and with it the last digits of every number, depends on the CPU, the BLAS library and the number of
threads; the block records them so that a reader can tell whether two run folders could give the same digits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__

__all__ = ["code_label", "code_version", "cuda_environment", "environment_lines", "run_environment", "run_file_codes"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: the variables by which a calling git process (a hook) would point the label's git commands at another repository
#: (``git rev-parse --local-env-vars``)
_GIT_LOCATION_VARIABLES = frozenset(
    {
        "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_CONFIG", "GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT",
        "GIT_OBJECT_DIRECTORY", "GIT_DIR", "GIT_WORK_TREE", "GIT_IMPLICIT_WORK_TREE", "GIT_GRAFT_FILE",
        "GIT_INDEX_FILE", "GIT_NO_REPLACE_OBJECTS", "GIT_REPLACE_REF_BASE", "GIT_PREFIX", "GIT_INTERNAL_SUPER_PREFIX",
        "GIT_SHALLOW_FILE", "GIT_COMMON_DIR",
    }
)  # fmt: skip


def _cpu_model() -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``; elsewhere :func:`platform.processor`), ``"unknown"`` if
    neither says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or "unknown")


def _blas() -> str:
    """The BLAS/LAPACK torch was built with (``torch.__config__.show()``: its ``BLAS_INFO`` and ``LAPACK_INFO``)."""
    shown = torch.__config__.show()
    found = [f"{key}={value}" for key, value in re.findall(r"\b(BLAS_INFO|LAPACK_INFO)=([^,\s]+)", shown)]
    return ", ".join(found) or "not reported by torch.__config__.show()"


def _git_commit(root: Path = _PACKAGE_ROOT) -> str | None:
    """The commit of the source tree gpattn is imported from, or ``None`` outside a git checkout (an installed wheel)
    or without git. Uncommitted changes to tracked files add ``+dirty.`` and 12 hex digits of a SHA-256 over the
    changed paths and what each holds now (a file's contents, a symbolic link's target, a submodule's own label, or
    a deletion mark), so that two different uncommitted states have different labels and the same state the same one,
    whatever the user's git configuration; untracked files are not counted.

    .. note:: Cost: two ``git`` processes (tens of milliseconds), and reading the changed files.
    """
    if not (root / ".git").exists():
        return None
    # the checkout at root, not one that the variables of a calling git process (a hook) point to
    environment = {key: value for key, value in os.environ.items() if key not in _GIT_LOCATION_VARIABLES}

    def git(*arguments: str) -> bytes:
        # --no-optional-locks: status neither takes the index's lock nor rewrites it (a git run beside it is not
        # disturbed); -z: paths as they are, NUL-terminated
        command = ["git", "--no-optional-locks", *arguments]
        return subprocess.run(command, cwd=root, env=environment, capture_output=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        status = git(
            "status", "--porcelain=v1", "-z", "--no-renames", "--untracked-files=no", "--ignore-submodules=none"
        )
        changed = sorted(entry[3:] for entry in status.split(b"\0") if entry)  # "XY path"
        fingerprint = hashlib.sha256()
        for name in changed:
            for field in (name, _current_state(root / os.fsdecode(name))):
                fingerprint.update(len(field).to_bytes(8, "little") + field)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None
    return f"{commit}+dirty.{fingerprint.hexdigest()[:12]}" if changed else commit


def _current_state(path: Path) -> bytes:
    """What a changed path holds now, for :func:`_git_commit`'s hash."""
    if path.is_symlink():
        return b"link:" + os.fsencode(os.readlink(path))
    if path.is_dir():  # a submodule: its commit, with its own uncommitted changes
        return b"submodule:" + (_git_commit(path) or "").encode()
    if path.is_file():
        return b"file:" + path.read_bytes()
    return b"deleted"


@functools.lru_cache(maxsize=1)
def _code_version_of_this_process() -> tuple[str, str | None]:
    return __version__, _git_commit()


def code_version() -> dict[str, str | None]:
    """The code a run is made with: ``{"gpattn": version, "git_commit": commit or None}`` (see :func:`run_environment`;
    ``+dirty.<hash>`` marks uncommitted changes, one hash per state of them). Read once per process, at its first
    call (``gpattn compare`` makes it before its first run, ``gpattn train`` when it starts), so that files edited
    while a comparison runs do not change the label of the code it imported. Each run
    file stores it, so that ``--resume`` can say which stored runs another code made."""
    version, commit = _code_version_of_this_process()
    return {"gpattn": version, "git_commit": commit}


def code_label(code: Any) -> str:
    """A :func:`code_version` as one phrase for messages (``"gpattn 0.1.0, commit abc123"``), or ``"not recorded"``
    for a file written before files recorded it."""
    if not isinstance(code, dict):
        return "not recorded"
    return f"gpattn {code.get('gpattn', '?')}, commit {code.get('git_commit') or 'unknown'}"


def run_file_codes(
    folder: str | os.PathLike, records: Collection[tuple[str, str, int]] | None = None
) -> list[dict[str, Any]]:
    """The codes that made the run files in ``folder`` (a run folder's ``runs``: ``<task>-<row>-<seed>.json``, each
    storing its :func:`code_version` under ``"code"`` and its record), grouped, the code of the most runs first::

        [{"code": {"gpattn": "0.1.0", "git_commit": "..."}, "runs": ["digits-kep_svgp-0", ...]}, ...]

    One group unless ``--resume`` kept runs of other code; ``"code"`` is ``None`` for run files written before run
    files recorded it (or that cannot be read). Empty when the folder holds no such run file.

    :param folder: The folder of the run files.
    :param records: The ``(task, attention, seed)`` of the records to account for (those of a report; a file whose
        record is not among them, e.g. a run of other seeds in the same folder, is left out), or ``None``: every file.

    .. note:: Cost: reads every run file once.
    """
    wanted = None if records is None else set(records)
    groups: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob("*.json")):
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
            record = content.get("record") or {}
            identity = (record.get("task"), record.get("attention"), record.get("seed"))
            hash(identity)  # a damaged record (e.g. a list as its seed) is no run of ``records``
            code = content.get("code")
        except (OSError, ValueError, AttributeError, TypeError):
            identity, code = None, None
        if wanted is not None and identity not in wanted:
            continue
        code = code if isinstance(code, dict) else None
        group = groups.setdefault(json.dumps(code, sort_keys=True), {"code": code, "runs": []})
        group["runs"].append(path.stem)
    return sorted(groups.values(), key=lambda group: -len(group["runs"]))


def run_environment() -> dict[str, Any]:
    """The ``environment`` block of ``results.json``: this machine and the software the report is written with.

    Keys: ``machine`` (``platform``, ``cpu``, ``cores``: :func:`os.cpu_count`), ``python``, ``torch``, ``numpy``,
    ``blas`` (torch's BLAS/LAPACK build), ``threads`` (``torch.get_num_threads()`` and
    ``torch.get_num_interop_threads()`` of this process; each run's own count is ``config.threads``),
    ``parallel_info`` (``torch.__config__.parallel_info()``: OpenMP/MKL threads), ``cuda`` (:func:`cuda_environment`:
    the CUDA and cuDNN versions and the GPUs, ``None`` without a GPU), ``gpattn`` (its version) and ``git_commit``
    (``None`` outside a git checkout).

    .. note:: Cost: two ``git`` calls the first time in a process (well under a second); with a GPU, CUDA's
        initialisation in this process (the device names); no computation.
    """
    return {
        "machine": {"platform": platform.platform(), "cpu": _cpu_model(), "cores": os.cpu_count()},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "blas": _blas(),
        "threads": {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()},
        "parallel_info": torch.__config__.parallel_info().strip(),
        "cuda": cuda_environment(),
        **code_version(),
    }


def cuda_environment() -> dict[str, Any] | None:
    """The GPU side of the environment, on which a ``--device cuda`` run's digits depend: ``{"cuda": the CUDA version
    torch was built with, "cudnn": cuDNN's version (``None`` when absent), "devices": the name of every visible GPU}``,
    or ``None`` where no GPU is available (a CPU build, or no device)."""
    if not torch.cuda.is_available():
        return None
    try:
        cudnn = torch.backends.cudnn.version()
    except RuntimeError:  # a build whose cuDNN cannot be loaded
        cudnn = None
    devices = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    return {"cuda": torch.version.cuda, "cudnn": cudnn, "devices": devices}


def environment_lines(environment: dict[str, Any]) -> list[str]:
    """The block as markdown bullet lines (the ``parallel_info`` text left out: it is in ``results.json``)."""
    machine, threads = (environment.get(key) for key in ("machine", "threads"))
    machine, threads = (value if isinstance(value, dict) else {} for value in (machine, threads))
    return [
        f"* machine: {machine.get('platform', '?')}; CPU {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores",
        f"* python {environment.get('python', '?')}, torch {environment.get('torch', '?')}, numpy "
        f"{environment.get('numpy', '?')}; {environment.get('blas', '?')}",
        f"* threads of the process that wrote the report: {threads.get('intra_op', '?')} intra-op, "
        f"{threads.get('inter_op', '?')} inter-op",
        *_cuda_lines(environment.get("cuda")),
        f"* gpattn {environment.get('gpattn', '?')}, git commit {environment.get('git_commit') or 'unknown'}",
    ]


def _cuda_lines(cuda: Any) -> list[str]:
    # no line without a GPU (and none for an environment block written before the GPU was recorded)
    if not isinstance(cuda, dict):
        return []
    devices = cuda.get("devices") if isinstance(cuda.get("devices"), list) else []
    names = ", ".join(map(str, devices)) or "none visible"
    return [f"* CUDA {cuda.get('cuda', '?')}, cuDNN {cuda.get('cudnn') or 'none'}; GPUs: {names}"]
