"""The checkpoint files on disk: the content checksum, atomic writes, and the manifest ``checkpoints.json`` that
pairs ``best.pt`` and ``last.pt`` (reading and checking them: :mod:`gpattn.training.checkpoints`).

**Integrity.** ``checksum`` is the SHA-256 of the checkpoint's content (:func:`content_checksum`: every tensor's
dtype, shape and bytes and every plain value, in order), so a damaged file is either unreadable or fails the checksum;
it never loads different numbers.

**Atomic pairs.** :func:`save_run_checkpoints` writes the new files to ``<name>.tmp``, then commits them by replacing
``checkpoints.json`` (file names, SHA-256 of the bytes, epochs) atomically with :func:`os.replace`, then renames the
temporary files. A kill before the commit leaves the previous pair; a kill after it leaves a manifest whose files
are completed from the ``.tmp`` files on the next read (:func:`recover`). So ``best.pt`` and ``last.pt`` always
pair, and a file that does not match the manifest is an error.

Cost: SHA-256 over the serialised state (about 1 GB/s), once per file written or read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import CheckpointError

__all__ = [
    "MANIFEST",
    "content_checksum",
    "read_manifest",
    "recover",
    "save_checkpoint",
    "save_run_checkpoints",
    "sha256",
]

#: The manifest that pairs ``best.pt`` and ``last.pt`` (written last, atomically).
MANIFEST = "checkpoints.json"
#: Version of the manifest's format.
MANIFEST_FORMAT = "gpattn-checkpoints/1"


# -- content checksum ------------------------------------------------------------------------------------------------
def _feed(digest, value: Any) -> None:
    if isinstance(value, Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}:".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}:".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}:".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"cannot checksum a {type(value).__name__} in a checkpoint")


def content_checksum(checkpoint: dict[str, Any]) -> str:
    """SHA-256 (hex) of everything in ``checkpoint`` but its ``"checksum"`` entry: the keys in order, every tensor's
    dtype, shape and bytes, and every plain value's ``repr`` (exact for floats). Cost: one pass over the bytes."""
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in checkpoint.items() if key != "checksum"})
    return digest.hexdigest()


def sha256(data: bytes) -> str:
    """The SHA-256 (hex) of ``data``, as the manifest records it."""
    return hashlib.sha256(data).hexdigest()


def _serialise(checkpoint: dict[str, Any]) -> bytes:
    content = {key: value for key, value in checkpoint.items() if key != "checksum"}
    content["checksum"] = content_checksum(content)
    buffer = io.BytesIO()
    torch.save(content, buffer)
    return buffer.getvalue()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; os.replace is still atomic
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


# -- writing ---------------------------------------------------------------------------------------------------------
def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write one checkpoint (a dict with the keys :data:`~gpattn.training.CHECKPOINT_KEYS` but ``"checksum"``, which
    is computed here) to ``path`` atomically: to ``<path>.tmp`` first, synced, then renamed, so that an interruption
    never leaves a half-written file. The training loop writes its pair with :func:`save_run_checkpoints` instead."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    _write_synced(temporary, _serialise(checkpoint))
    os.replace(temporary, path)


def read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"could not read the checkpoint manifest {path}: {error}") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not all(isinstance(entry, dict) and isinstance(entry.get("sha256"), str) for entry in files.values())
    ):
        raise CheckpointError(
            f"the checkpoint manifest {path} is malformed (expected format {MANIFEST_FORMAT!r} with a SHA-256 per "
            f"file): it is damaged or not written by gpattn.training.train_model"
        )
    return manifest


def save_run_checkpoints(
    directory: str | os.PathLike, last: dict[str, Any], best: dict[str, Any] | None = None
) -> None:
    """Write ``last.pt`` (and ``best.pt`` when ``best`` is given) to ``directory`` as one atomic step: both files go
    to ``<name>.tmp`` (synced), then the manifest ``checkpoints.json`` naming their SHA-256 and epochs replaces the old
    one (the commit), then the files are renamed. A kill at any moment leaves a consistent pair: the previous one
    before the commit, the new one after it (completed by :func:`recover` on the next read). A write that fails before
    the commit (e.g. a full disk) removes its temporary files and raises the ``OSError``: the previous pair stands."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except CheckpointError:  # a damaged manifest of an earlier run: replaced by this one
        manifest = None
    # the entries of this run's earlier epochs (best.pt when it is not rewritten now); never those of a later epoch
    earlier = manifest is not None and isinstance(manifest.get("epoch"), int) and manifest["epoch"] < last["epoch"]
    previous = manifest["files"] if earlier else {}
    files = {name: entry for name, entry in previous.items() if best is None or name != "best.pt"}
    written = []
    content = {"format": MANIFEST_FORMAT, "epoch": last["epoch"], "best_epoch": last["best_epoch"], "files": files}
    try:
        for name, checkpoint in (("best.pt", best), ("last.pt", last)):
            if checkpoint is None:
                continue
            data = _serialise(checkpoint)
            written.append(name)
            _write_synced(directory / f"{name}.tmp", data)
            files[name] = {"sha256": sha256(data), "bytes": len(data), "epoch": checkpoint["epoch"]}
        _write_synced(directory / f"{MANIFEST}.tmp", json.dumps(content, indent=1).encode())
    except OSError:  # e.g. a full disk, before the commit: the previous pair stands; its space is given back
        for name in (*written, MANIFEST):
            with contextlib.suppress(OSError):
                (directory / f"{name}.tmp").unlink(missing_ok=True)
        raise
    os.replace(directory / f"{MANIFEST}.tmp", directory / MANIFEST)  # the commit
    _sync_directory(directory)
    for name in written:
        os.replace(directory / f"{name}.tmp", directory / name)
    _sync_directory(directory)


def recover(directory: str | os.PathLike) -> None:
    """Complete a write of :func:`save_run_checkpoints` that was committed (the manifest replaced) but interrupted
    before every file was renamed: a file that does not match the manifest while its ``.tmp`` does is replaced by
    it. Does nothing without a manifest or when the files match; never deletes anything."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return
    for name, entry in manifest["files"].items():
        path, temporary = directory / name, directory / f"{name}.tmp"
        if not temporary.is_file() or (path.is_file() and sha256(path.read_bytes()) == entry["sha256"]):
            continue
        if sha256(temporary.read_bytes()) == entry["sha256"]:
            os.replace(temporary, path)
