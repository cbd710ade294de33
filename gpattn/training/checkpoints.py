"""Checkpoints of the training loop: ``last.pt`` (every epoch) and ``best.pt`` (the lowest validation NLL so far),
paired by the manifest ``checkpoints.json``.

Both files are complete, resumable checkpoints of the epoch they were written at: a dict with the keys
:data:`CHECKPOINT_KEYS` (model, optimiser and schedule states, the epoch, both RNG states, the history, the best epoch
and its NLL, the :class:`~gpattn.experiments.TrainConfig` as a dict, and a content checksum), read with
``weights_only=True``.

**Integrity.** ``checksum`` is the SHA-256 of the checkpoint's content (:func:`content_checksum`: every tensor's
dtype, shape and bytes and every plain value, in order), so a damaged file is either unreadable or fails the checksum;
it never loads different numbers. A checkpoint is also checked against itself (``len(history) == epoch``, epochs
1, 2, ..., ``best_epoch`` the epoch of the lowest validation NLL) and, on resumption, ``best.pt`` against ``last.pt``
and the saved settings against the run's (:func:`check_resumable`).

**Atomic pairs.** :func:`save_run_checkpoints` writes the new files to ``<name>.tmp``, then commits them by replacing
``checkpoints.json`` (file names, SHA-256 of the bytes, epochs) atomically with :func:`os.replace`, then renames the
temporary files. A kill before the commit leaves the previous pair; a kill after it leaves a manifest whose files
are completed from the ``.tmp`` files on the next read (:func:`recover`). So ``best.pt`` and ``last.pt`` always
pair, and a file that does not match the manifest is an error.

A checkpoint that cannot be used raises :class:`CheckpointError` naming the file and the problem, before anything
is loaded.

Cost: SHA-256 over the serialised state (about 1 GB/s), once per file written or read.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CHECKPOINT_KEYS",
    "MANIFEST",
    "RNG_KEYS",
    "CheckpointError",
    "check_pair",
    "check_resumable",
    "check_state_fits",
    "content_checksum",
    "load_checkpoint",
    "recover",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
    "save_run_checkpoints",
]

#: Keys of ``last.pt`` and ``best.pt`` (both are complete, resumable checkpoints of the epoch they were written at).
CHECKPOINT_KEYS = (
    "model",
    "optimizer",
    "scheduler",
    "epoch",
    "rng",
    "history",
    "best_epoch",
    "best_val_nll",
    "config",
    "checksum",
)
#: Keys of ``checkpoint["rng"]``: the global torch CPU RNG state, the batch-order generator's state and the CUDA
#: states (``None`` unless training on CUDA).
RNG_KEYS = ("torch", "batch_generator", "cuda")
#: The manifest that pairs ``best.pt`` and ``last.pt`` (written last, atomically).
MANIFEST = "checkpoints.json"
#: Version of the manifest's format.
MANIFEST_FORMAT = "gpattn-checkpoints/1"
#: Settings that may differ between an interrupted run and its resumption: they change neither the trained model
#: nor the recorded metrics (``epochs`` only when the schedule horizon stays the same and no completed epoch is cut).
RESUMABLE_CHANGES = ("epochs", "schedule_epochs", "progress", "checkpoint_dir", "eval_batch_size", "device")


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint file cannot be used: unreadable (truncated, garbage, not a torch file), damaged (its content
    checksum or the manifest's SHA-256 differs), inconsistent (an epoch against its history, ``best.pt`` against
    ``last.pt``), incomplete (missing or malformed entries), written for another model (parameter names or shapes
    differ) or by a run with other settings. The message names the file and the problem. Both a ``ValueError`` and a
    ``RuntimeError``."""


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


def _sha256(data: bytes) -> str:
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
    """Write one checkpoint (a dict with the keys :data:`CHECKPOINT_KEYS` but ``"checksum"``, which is computed
    here) to ``path`` atomically: to ``<path>.tmp`` first, synced, then renamed, so that an interruption never leaves
    a half-written file. The training loop writes its pair with :func:`save_run_checkpoints` instead."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    _write_synced(temporary, _serialise(checkpoint))
    os.replace(temporary, path)


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
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
            f"file): it is damaged or not written by gpattn.experiments.train_model"
        )
    return manifest


def save_run_checkpoints(
    directory: str | os.PathLike, last: dict[str, Any], best: dict[str, Any] | None = None
) -> None:
    """Write ``last.pt`` (and ``best.pt`` when ``best`` is given) to ``directory`` as one atomic step: both files go
    to ``<name>.tmp`` (synced), then the manifest ``checkpoints.json`` naming their SHA-256 and epochs replaces the old
    one (the commit), then the files are renamed. A kill at any moment leaves a consistent pair: the previous one
    before the commit, the new one after it (completed by :func:`recover` on the next read)."""
    directory = Path(directory)
    try:
        manifest = _read_manifest(directory)
    except CheckpointError:  # a damaged manifest of an earlier run: replaced by this one
        manifest = None
    # the entries of this run's earlier epochs (best.pt when it is not rewritten now); never those of a later epoch
    earlier = manifest is not None and isinstance(manifest.get("epoch"), int) and manifest["epoch"] < last["epoch"]
    previous = manifest["files"] if earlier else {}
    files = {name: entry for name, entry in previous.items() if best is None or name != "best.pt"}
    written = []
    for name, checkpoint in (("best.pt", best), ("last.pt", last)):
        if checkpoint is None:
            continue
        data = _serialise(checkpoint)
        _write_synced(directory / f"{name}.tmp", data)
        files[name] = {"sha256": _sha256(data), "bytes": len(data), "epoch": checkpoint["epoch"]}
        written.append(name)
    content = {"format": MANIFEST_FORMAT, "epoch": last["epoch"], "best_epoch": last["best_epoch"], "files": files}
    _write_synced(directory / f"{MANIFEST}.tmp", json.dumps(content, indent=1).encode())
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
    manifest = _read_manifest(directory)
    if manifest is None:
        return
    for name, entry in manifest["files"].items():
        path, temporary = directory / name, directory / f"{name}.tmp"
        if not temporary.is_file() or (path.is_file() and _sha256(path.read_bytes()) == entry["sha256"]):
            continue
        if _sha256(temporary.read_bytes()) == entry["sha256"]:
            os.replace(temporary, path)


# -- reading ---------------------------------------------------------------------------------------------------------
def _check_history(checkpoint: dict[str, Any], path: Path) -> list[str]:
    """The problems of the epoch, history and best epoch against one another."""
    epoch, history, best_epoch = checkpoint["epoch"], checkpoint["history"], checkpoint["best_epoch"]
    if len(history) != epoch:
        return [f"it claims epoch {epoch} but its history has {len(history)} entries"]
    if not all(isinstance(record, dict) for record in history):
        return ["its history is not a list of dicts"]
    epochs = [record.get("epoch") for record in history]
    if epochs != list(range(1, epoch + 1)):
        return [f"its history's epochs are {epochs[:10]}, expected 1, 2, ..., {epoch}"]
    if epoch == 0:
        return []
    if not 1 <= best_epoch <= epoch:
        return [f"its best_epoch {best_epoch} is not one of the epochs 1..{epoch}"]
    nlls = [record.get("val_nll") for record in history]
    if not all(isinstance(value, float) and math.isfinite(value) for value in nlls):
        return ["its history's validation NLLs are not finite numbers"]
    lowest = min(range(epoch), key=lambda index: (nlls[index], index)) + 1  # ties keep the earlier epoch
    if best_epoch != lowest or checkpoint["best_val_nll"] != nlls[best_epoch - 1]:
        return [
            f"its best_epoch {best_epoch} (validation NLL {checkpoint['best_val_nll']!r}) is not the epoch of the "
            f"lowest validation NLL in its history (epoch {lowest}, {nlls[lowest - 1]!r})"
        ]
    return []


def _read(path: Path) -> dict[str, Any]:
    """The validated contents of a checkpoint file (entries present, of the right kinds, checksum and history
    consistent; matching the manifest of its directory when one lists it); no model involved."""
    manifest = _read_manifest(path.parent)
    entry = None if manifest is None else manifest["files"].get(path.name)
    if entry is not None:
        recover(path.parent)
    if not path.is_file():
        raise FileNotFoundError(f"there is no checkpoint {path} (train once with resume=False to write one)")
    data = path.read_bytes()
    if entry is not None and _sha256(data) != entry["sha256"]:
        raise CheckpointError(
            f"the checkpoint {path} does not match {path.parent / MANIFEST} (SHA-256 of its {len(data)} bytes differs "
            f"from the one recorded when epoch {entry.get('epoch')} was written): it was damaged or replaced after it "
            f"was written; delete the folder's checkpoints or train with resume=False"
        )
    try:
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a damaged file (UnpicklingError, RuntimeError, EOFError)
        detail = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"could not read the checkpoint {path} ({len(data)} bytes; {detail}): it is damaged (e.g. "
            f"truncated by an interrupted copy) or not written by gpattn.experiments.train_model; delete it or "
            f"train with resume=False"
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"the checkpoint {path} holds a {type(checkpoint).__name__}, expected a dict")
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"the checkpoint {path} lacks the entries {missing} (expected the keys {list(CHECKPOINT_KEYS)}): it is "
            f"incomplete, written by an older gpattn or not written by gpattn.experiments.train_model"
        )
    try:
        checksum = content_checksum(checkpoint)
    except TypeError as error:
        raise CheckpointError(f"the checkpoint {path} is malformed: {error}") from error
    if checksum != checkpoint["checksum"]:
        raise CheckpointError(
            f"the checkpoint {path} is damaged: the SHA-256 of its content is {checksum[:16]}..., the file records "
            f"{str(checkpoint['checksum'])[:16]}...; delete it or train with resume=False"
        )
    problems = []
    state = checkpoint["model"]
    if not isinstance(state, dict) or not all(isinstance(value, Tensor) for value in state.values()):
        problems.append("'model' is not a state dict of tensors")
    for key, kind in (("optimizer", dict), ("scheduler", dict), ("history", list), ("config", dict)):
        if not isinstance(checkpoint[key], kind):
            problems.append(f"{key!r} is a {type(checkpoint[key]).__name__}, not a {kind.__name__}")
    for key in ("epoch", "best_epoch"):
        if isinstance(checkpoint[key], bool) or not isinstance(checkpoint[key], int) or checkpoint[key] < 0:
            problems.append(f"{key!r} is {checkpoint[key]!r}, not a non-negative integer")
    rng = checkpoint["rng"]
    if not isinstance(rng, dict) or any(key not in rng for key in RNG_KEYS):
        problems.append(f"'rng' lacks the entries {list(RNG_KEYS)}")
    elif any(not isinstance(rng[key], Tensor) or rng[key].dtype != torch.uint8 for key in ("torch", "batch_generator")):
        problems.append("the RNG states are not byte tensors")
    if problems:
        raise CheckpointError(f"the checkpoint {path} is malformed: {'; '.join(problems)}")
    problems = _check_history(checkpoint, path)
    moments = checkpoint["optimizer"].get("state", {})
    broken = [
        f"{index}/{name}"
        for index, values in (moments.items() if isinstance(moments, dict) else ())
        if isinstance(values, dict)
        for name, value in values.items()
        if isinstance(value, Tensor) and value.is_floating_point() and not torch.isfinite(value).all()
    ]
    if broken:
        problems.append(f"its optimiser state {broken[:5]} holds NaN or Inf")
    if entry is not None and entry.get("epoch") != checkpoint["epoch"]:
        problems.append(f"it holds epoch {checkpoint['epoch']} but {MANIFEST} records epoch {entry.get('epoch')}")
    if problems:
        raise CheckpointError(f"the checkpoint {path} is inconsistent: {'; '.join(problems)}")
    return checkpoint


def check_pair(last: dict[str, Any], best: dict[str, Any], last_path: Path, best_path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``best`` (read from ``best_path``) is the checkpoint of ``last``'s best
    epoch: its epoch is ``last["best_epoch"]``, its history is the first ``best_epoch`` entries of ``last``'s and its
    validation NLL is ``last["best_val_nll"]``."""
    best_epoch = last["best_epoch"]
    if (
        best["epoch"] != best_epoch
        or best["history"] != last["history"][:best_epoch]
        or best["best_val_nll"] != last["best_val_nll"]
    ):
        raise CheckpointError(
            f"the checkpoints do not pair: {last_path} (epoch {last['epoch']}) names epoch {best_epoch} as the best, "
            f"but {best_path} holds epoch {best['epoch']} with another history or NLL (from another run, or a copy "
            f"of one file only?)"
        )


def check_resumable(saved: dict[str, Any], current: dict[str, Any], epoch: int, path: Path) -> list[str]:
    """Check the settings ``current`` of a resumed run (``TrainConfig.to_dict()``) against ``saved``, those stored in
    the checkpoint ``path`` of epoch ``epoch``.

    A setting that changes the trained model or the recorded metrics (seed, learning rate, batch size, ...; every
    setting but :data:`RESUMABLE_CHANGES`), a schedule horizon (``schedule_epochs or epochs``) other than the saved
    one, or ``epochs`` below the epoch already trained raises :class:`CheckpointError` naming what differs.

    :return: Descriptions of the allowed changes worth a warning (the device).
    """
    changed = [
        f"{name} ({saved[name]!r} in the checkpoint, {value!r} now)"
        for name, value in current.items()
        if name not in RESUMABLE_CHANGES and name in saved and saved[name] != value
    ]
    missing = [name for name in current if name not in saved]
    saved_horizon = saved.get("schedule_epochs") or saved.get("epochs")
    horizon = current.get("schedule_epochs") or current["epochs"]
    if saved_horizon != horizon:
        changed.append(
            f"the schedule horizon ({saved_horizon} epochs in the checkpoint, {horizon} now; set schedule_epochs="
            f"{saved_horizon} to continue the same schedule)"
        )
    if current["epochs"] < epoch:
        changed.append(f"epochs ({current['epochs']} now, but the checkpoint already holds epoch {epoch})")
    if missing:
        changed.append(f"settings {missing} missing from the checkpoint")
    if changed:
        raise CheckpointError(
            f"cannot resume from {path} with other settings than the run that wrote it: {'; '.join(changed)}. The "
            f"resumed run would record settings that did not train the model; use the original settings, or train "
            f"from scratch with resume=False"
        )
    return [
        f"{name} ({saved[name]!r} -> {current[name]!r})"
        for name in ("device",)
        if name in saved and saved[name] != current[name]
    ]


def check_state_fits(state: dict[str, Tensor], model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` unless the state dict ``state`` (read from ``path``) has exactly the model's
    parameter and buffer names, with the model's shapes."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    mismatched = [
        f"{name}: {tuple(state[name].shape)} in the file, {tuple(value.shape)} in the model"
        for name, value in expected.items()
        if name in state and state[name].shape != value.shape
    ]
    if missing or unexpected or mismatched:
        parts = [
            f"{label} {items[:5]}{f' and {len(items) - 5} more' if len(items) > 5 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatches", mismatched))
            if items
        ]
        raise CheckpointError(
            f"the checkpoint {path} was written for another model configuration: {'; '.join(parts)} (a different "
            f"attention, width, depth, inducing-set size or number of classes?)"
        )


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint written by :func:`~gpattn.experiments.train_model` (``last.pt`` or
    ``best.pt``) and, given a model, load its parameters into it.

    The model is checked first (every parameter and buffer name and shape must match) and left untouched when the
    checkpoint does not fit, so a failed load never leaves a half-loaded model.

    :param path: The checkpoint file.
    :param model: The model to load the ``"model"`` state into, or ``None`` to only read and validate.
    :return: The checkpoint, a dict with the keys :data:`CHECKPOINT_KEYS`.
    :raises FileNotFoundError: There is no such file.
    :raises CheckpointError: The file is unreadable (truncated, garbage), damaged (content checksum, or the SHA-256
        recorded in the folder's ``checkpoints.json``), inconsistent (epoch against history, best epoch against the
        validation NLLs, NaN in the optimiser moments), incomplete, malformed, or written for another model; the
        message names the file and the problem.

    Cost: reading the file and one SHA-256 pass over its content.
    """
    path = Path(path)
    checkpoint = _read(path)
    if model is not None:
        check_state_fits(checkpoint["model"], model, path)
        model.load_state_dict(checkpoint["model"])
    return checkpoint


def rng_state(generator: torch.Generator, device: torch.device) -> dict[str, Any]:
    """The RNG states a resumed run needs (:data:`RNG_KEYS`): the global torch CPU RNG, the batch-order
    ``generator`` and, when ``device`` is a CUDA device, every CUDA RNG."""
    return {
        "torch": torch.get_rng_state(),
        "batch_generator": generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
    }


def restore_rng_state(state: dict[str, Any], generator: torch.Generator, device: torch.device) -> None:
    """Set the RNG states saved by :func:`rng_state` (the CUDA states only on a CUDA ``device``)."""
    torch.set_rng_state(state["torch"])
    generator.set_state(state["batch_generator"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
