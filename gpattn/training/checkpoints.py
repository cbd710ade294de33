"""Checkpoints of the training loop: ``last.pt`` (every epoch) and ``best.pt`` (the lowest validation NLL so far),
paired by the manifest ``checkpoints.json`` (written by :mod:`gpattn.training.checkpoint_files`), read and checked here.

Both files are complete, resumable checkpoints of the epoch they were written at: a dict with the keys
:data:`CHECKPOINT_KEYS` (model, optimiser and schedule states, the epoch, both RNG states, the history, the best epoch
and its NLL, the :class:`~gpattn.training.TrainConfig` as a dict, and a content checksum), read with
``weights_only=True``.

**Integrity.** The content checksum (:func:`~gpattn.training.checkpoint_files.content_checksum`) and, when the
folder's manifest lists the file, its SHA-256 are checked on every read. A checkpoint is also checked against itself
(``len(history) == epoch``, epochs 1, 2, ..., ``best_epoch`` the epoch of the lowest validation NLL) and, on
resumption, ``best.pt`` against ``last.pt`` and the saved settings against the run's (:func:`check_resumable`).

A checkpoint that cannot be used raises :class:`~gpattn.training.CheckpointError` naming the file and the problem,
before anything is loaded.

Cost: SHA-256 over the serialised state (about 1 GB/s), once per file read.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .checkpoint_files import MANIFEST, content_checksum, read_manifest, recover, sha256
from .errors import CheckpointError

__all__ = [
    "CHECKPOINT_KEYS",
    "RESUMABLE_CHANGES",
    "RNG_KEYS",
    "WARNED_CHANGES",
    "WARNED_REASONS",
    "check_pair",
    "check_resumable",
    "check_rng_state",
    "check_schedule_state",
    "check_state_fits",
    "load_checkpoint",
    "model_description",
    "restore_rng_state",
    "restore_run",
    "rng_state",
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
#: Settings that may differ between an interrupted run and its resumption, since they change neither its objective,
#: data nor schedule (``epochs`` only when the schedule horizon stays the same and no completed epoch is cut): the
#: progress bar and the checkpoint folder change no number; those of :data:`WARNED_CHANGES` change the numbers the run
#: records (and are warned about).
RESUMABLE_CHANGES = (
    "epochs",
    "schedule_epochs",
    "progress",
    "checkpoint_dir",
    "eval_batch_size",
    "device",
    "threads",
)
#: Allowed changes that still make the resumed run differ from an uninterrupted one (warned about, with the reason of
#: :data:`WARNED_REASONS`): the evaluation batch size, the device and the torch thread count
WARNED_CHANGES = ("eval_batch_size", "device", "threads")
#: why each of :data:`WARNED_CHANGES` changes the numbers, as the warning says it
WARNED_REASONS = {
    "eval_batch_size": "the Monte Carlo samples of the validation are drawn batch by batch, so the recorded validation "
    "metrics and the best epoch may differ",
    "device": "other kernels and random number generators give other numbers",
    "threads": "torch splits its CPU reductions by threads",
}
#: settings added to :class:`~gpattn.training.TrainConfig` after checkpoints were first written, with the value that
#: every run before them had: a checkpoint without the setting resumes when the current value is that one
LATER_SETTINGS = {"patience": None, "mc_dropout": False, "cuda_graphs": False}
#: recorded facts of the run besides its TrainConfig, stored with the settings by later versions only: compared when
#: the checkpoint has them (``num_data``: the number of training examples, the ELBO's :math:`n`; ``num_val``: the
#: number of validation examples; ``model``: the model's :func:`model_description`)
LATER_RECORDS = ("num_data", "num_val", "model")
#: module attributes that are switches of the moment or of memory and speed, not the model's configuration (left out
#: of its description): the mode, sampling in eval mode, timm's and Hugging Face's gradient checkpointing, timm's
#: fused attention kernel (chosen by the environment and the torch version)
RUNTIME_ATTRIBUTES = ("training", "sample_in_eval", "grad_checkpointing", "gradient_checkpointing", "fused_attn")


def _plain(value: Any) -> Any:
    """``value`` as a plain Python value (NumPy scalars as Python ones, so that ``np.float64(0.1)`` and ``0.1`` read
    alike), or ``_NOT_PLAIN``."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        items = tuple(_plain(item) for item in value)
        return _NOT_PLAIN if any(item is _NOT_PLAIN for item in items) else items
    return _NOT_PLAIN


_NOT_PLAIN = object()


def model_description(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """The configuration of ``model`` that its state dict does not show, as the checkpoints record it: for every
    submodule (by its name in ``named_modules``, ``""`` for the model), its type and the ``repr`` of each public
    attribute holding a plain value (a number, string, ``None`` or a tuple of them: a layer's ``num_heads``, a
    dropout rate ``p``, an attention's ``merge``), but the switches :data:`RUNTIME_ATTRIBUTES`. Two models of the
    same parameter names and shapes can differ here (e.g. 2 or 4 heads of width 16, another dropout rate), and a run
    resumed into the other one would silently continue another model. NumPy scalars are recorded as Python ones. A
    resumed run compares the modules and attributes both descriptions have (a later gpattn, torch or timm version may
    add some). O(number of submodules)."""
    description = {}
    for name, module in model.named_modules():
        entry = {"type": type(module).__qualname__}
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and key not in RUNTIME_ATTRIBUTES and (plain := _plain(value)) is not _NOT_PLAIN:
                entry[key] = repr(plain)
        description[name] = entry
    return description


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
    manifest = read_manifest(path.parent)
    entry = None if manifest is None else manifest["files"].get(path.name)
    if entry is not None:
        recover(path.parent)
    if not path.is_file():
        raise FileNotFoundError(f"there is no checkpoint {path} (train once with resume=False to write one)")
    data = path.read_bytes()
    if entry is not None and sha256(data) != entry["sha256"]:
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
            f"truncated by an interrupted copy) or not written by gpattn.training.train_model; delete it or "
            f"train with resume=False"
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"the checkpoint {path} holds a {type(checkpoint).__name__}, expected a dict")
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"the checkpoint {path} lacks the entries {missing} (expected the keys {list(CHECKPOINT_KEYS)}): it is "
            f"incomplete, written by an older gpattn or not written by gpattn.training.train_model"
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
    """Raise :class:`~gpattn.training.CheckpointError` unless ``best`` (read from ``best_path``) is the checkpoint of
    ``last``'s best epoch: its epoch is ``last["best_epoch"]``, its history is the first ``best_epoch`` entries of
    ``last``'s and its validation NLL is ``last["best_val_nll"]``."""
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

    A setting that changes the trained model or the recorded metrics (seed, learning rate, batch size, ..., the
    number of training or validation examples ``num_data``, ``num_val`` and the model's configuration ``model`` when
    the checkpoint records them; every setting but
    :data:`RESUMABLE_CHANGES`), a schedule horizon (``schedule_epochs or epochs``) other than the saved one, or
    ``epochs`` below the epoch already trained raises :class:`~gpattn.training.CheckpointError` naming what differs
    (for a run extended past a horizon that ended at ``min_lr=0``: that it cannot continue, its epochs would train
    at rate 0).

    :return: Descriptions of the allowed changes worth a warning, each with its reason (:data:`WARNED_CHANGES`: the
        evaluation batch size, the device, the thread count).
    """
    changed = [
        _describe_change(name, saved[name], value)
        for name, value in current.items()
        if name not in RESUMABLE_CHANGES and name in saved and _differs(name, saved[name], value)
    ]
    missing = [
        name
        for name in current
        if name not in saved and name not in RESUMABLE_CHANGES and name not in LATER_RECORDS
        and not (name in LATER_SETTINGS and current[name] == LATER_SETTINGS[name])
    ]  # fmt: skip
    saved_horizon = saved.get("schedule_epochs") or saved.get("epochs")
    horizon = current.get("schedule_epochs") or current["epochs"]
    if saved_horizon != horizon:
        changed.append(
            f"the schedule horizon ({saved_horizon} epochs in the checkpoint, {horizon} now; "
            f"{_horizon_advice(saved, saved_horizon, current['epochs'])})"
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
        f"{name} ({saved[name]!r} -> {current[name]!r}: {WARNED_REASONS[name]})"
        for name in WARNED_CHANGES
        if name in saved and name in current and saved[name] != current[name]
    ]


def _describe_change(name: str, saved: Any, value: Any) -> str:
    if name == "model" and isinstance(saved, dict) and isinstance(value, dict):
        return _describe_model_change(saved, value)
    if name == "num_val":
        return (
            f"the validation set ({saved!r} examples in the checkpoint, {value!r} now: the validation NLL that selects "
            "the best epoch would change; resume with the validation set of that run)"
        )
    if name == "num_data":
        return (
            f"the training set ({saved!r} examples in the checkpoint, {value!r} now: the ELBO's num_data and the "
            "steps per epoch would change; resume with the training set that trained it)"
        )
    return f"{name} ({saved!r} in the checkpoint, {value!r} now)"


def _differs(name: str, saved: Any, value: Any) -> bool:
    if name == "model" and isinstance(saved, dict) and isinstance(value, dict):
        return bool(_model_differences(saved, value))
    return saved != value


def _model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The differences of two :func:`model_description` s over the modules and attributes both have: a module present
    on one side only changes the parameter names, which the state dict check names; an attribute present on one side
    only is what a later gpattn, torch or timm version adds (or removes), not another configuration."""
    differences = []
    for module, old in saved.items():
        new = current.get(module)
        if not isinstance(old, dict) or not isinstance(new, dict):
            continue
        for key in old:
            if key in new and old[key] != new[key]:
                differences.append(
                    f"{module + '.' if module else ''}{key} ({old[key]} in the checkpoint, {new[key]} now)"
                )
    return differences


def _describe_model_change(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """The differences of two :func:`model_description` s (at most five named)."""
    differences = _model_differences(saved, current)
    more = f" and {len(differences) - 5} more" if len(differences) > 5 else ""
    return (
        f"the model's configuration ({'; '.join(differences[:5])}{more}: resume into a model built as the one that "
        "wrote the checkpoint)"
    )


def _horizon_advice(saved: dict[str, Any], saved_horizon: Any, epochs: int) -> str:
    """What to do about a schedule horizon other than the saved one, for a resumed run of ``epochs`` epochs."""
    if not isinstance(saved_horizon, int):
        return "the checkpoint records no horizon"
    if epochs > saved_horizon and not saved.get("min_lr"):
        # a horizon below epochs with min_lr=0 trains at rate 0 (TrainConfig refuses it): no continuation exists
        return (
            f"its schedule ended at learning rate 0 (min_lr=0) after epoch {saved_horizon}, so later epochs would "
            "not train; for a longer run train from scratch with resume=False (in stages, set schedule_epochs to the "
            "planned total from the first stage)"
        )
    if epochs > saved_horizon:
        return (
            f"set schedule_epochs={saved_horizon} to continue the same schedule: the epochs after epoch "
            f"{saved_horizon} train at its floor min_lr={saved['min_lr']!r}"
        )
    return f"set schedule_epochs={saved_horizon} to continue the same schedule"


def check_state_fits(
    state: dict[str, Tensor], model: torch.nn.Module, path: str | os.PathLike, dtypes: bool = False
) -> None:
    """Raise :class:`~gpattn.training.CheckpointError` unless the state dict ``state`` (read from ``path``) has exactly
    the model's parameter and buffer names, with the model's shapes and, with ``dtypes`` (a resumed run), its dtypes:
    loading converts another dtype silently, which is what a model loaded for evaluation wants, but a resumed run would
    then train with other numbers than the run that wrote it. O(number of tensors)."""
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
    other = [name for name, value in expected.items() if state[name].dtype != value.dtype] if dtypes else []
    if other:
        listed = [f"{name}: {state[name].dtype} in the file, {expected[name].dtype} in the model" for name in other[:5]]
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        raise CheckpointError(
            f"the checkpoint {path} was written for a model of other dtypes: {listed}{more}; convert the model to "
            f"the file's dtypes before loading (e.g. model.to({state[other[0]].dtype})), or train with resume=False"
        )


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint written by :func:`~gpattn.training.train_model` (``last.pt`` or
    ``best.pt``) and, given a model, load its parameters into it.

    The model is checked first (every parameter and buffer name and shape must match) and left untouched when the
    checkpoint does not fit, so a failed load never leaves a half-loaded model. Tensors of another dtype are converted
    to the model's, as ``load_state_dict`` does (e.g. a float32 checkpoint into a float64 model for evaluation);
    resuming a run (``train_model(..., resume=True)``) refuses them instead.

    :param path: The checkpoint file.
    :param model: The model to load the ``"model"`` state into, or ``None`` to only read and validate.
    :return: The checkpoint, a dict with the keys :data:`CHECKPOINT_KEYS`.
    :raises TypeError: ``model`` is neither a ``torch.nn.Module`` nor ``None``.
    :raises FileNotFoundError: There is no such file.
    :raises CheckpointError: The file is unreadable (truncated, garbage), damaged (content checksum, or the SHA-256
        recorded in the folder's ``checkpoints.json``), inconsistent (epoch against history, best epoch against the
        validation NLLs, NaN in the optimiser moments), incomplete, malformed, or written for another model (other
        parameter names, shapes or dtypes); the message names the file and the problem.

    Cost: reading the file and one SHA-256 pass over its content.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_checkpoint: expected model to be a torch.nn.Module or None, got {type(model).__name__}")
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


def check_rng_state(state: dict[str, Any], device: torch.device, path: str | os.PathLike) -> None:
    """Raise :class:`~gpattn.training.CheckpointError` unless :func:`restore_rng_state` can set the RNG states
    ``state`` (read from ``path``) on ``device``: each is tried on a new generator, never on the global ones."""
    for key in ("torch", "batch_generator"):
        try:
            torch.Generator().set_state(state[key])
        except (RuntimeError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"the checkpoint {path} holds an RNG state rng[{key!r}] that cannot be restored ({error}): it is "
                "damaged or not written by gpattn.training.train_model; delete it or train with resume=False"
            ) from error
    states = state["cuda"]
    if device.type != "cuda" or states is None:
        return
    if not isinstance(states, (list, tuple)) or len(states) > torch.cuda.device_count():
        count = len(states) if isinstance(states, (list, tuple)) else type(states).__name__
        raise CheckpointError(
            f"the checkpoint {path} holds CUDA RNG states rng['cuda'] ({count}) that cannot be restored on this "
            f"machine's {torch.cuda.device_count()} CUDA device(s)"
        )
    for index, value in enumerate(states):
        try:
            torch.Generator(device=f"cuda:{index}").set_state(value)
        except (RuntimeError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"the checkpoint {path} holds a CUDA RNG state rng['cuda'][{index}] that cannot be restored ({error})"
            ) from error


def check_schedule_state(
    state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    steps_per_epoch: int | None,
    path: str | os.PathLike,
) -> None:
    """Raise :class:`~gpattn.training.CheckpointError` unless ``state``, the schedule state of the checkpoint
    ``path`` of epoch ``epoch``, can be loaded into ``scheduler`` (a ``LambdaLR`` of
    :func:`~gpattn.training.warmup_cosine_schedule`) and, given ``steps_per_epoch``, has taken the
    ``epoch * steps_per_epoch`` steps of this run (another number means another training set size, batch size or
    number of processes than the run that wrote it)."""
    groups = len(scheduler.optimizer.param_groups)
    problems = []
    last_epoch = state.get("last_epoch")
    if isinstance(last_epoch, bool) or not isinstance(last_epoch, int):
        problems.append(f"its 'last_epoch' is {last_epoch!r}, not an integer")
    lambdas = state.get("lr_lambdas")
    if not isinstance(lambdas, list) or len(lambdas) != groups or any(item is not None for item in lambdas):
        problems.append(f"its 'lr_lambdas' is {lambdas!r}, expected {[None] * groups}")
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key)
        if not isinstance(values, list) or len(values) != groups:
            problems.append(f"its {key!r} is {values!r}, expected a list of {groups} learning rates")
    if problems:
        raise CheckpointError(
            f"the checkpoint {path} holds a malformed schedule state: {'; '.join(problems)}: it is damaged or not "
            "written by gpattn.training.train_model; delete it or train with resume=False"
        )
    if steps_per_epoch is not None and last_epoch != epoch * steps_per_epoch:
        raise CheckpointError(
            f"the checkpoint {path} does not fit this run: its schedule has taken {last_epoch} optimiser steps in "
            f"{epoch} epochs, but this run takes {steps_per_epoch} steps an epoch ({epoch * steps_per_epoch} in "
            f"{epoch}): another training set size, batch size or number of processes than the run that wrote it? "
            "Resume with those of that run, or train with resume=False"
        )


def restore_run(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
    config: dict[str, Any],
    device: torch.device,
    *,
    steps_per_epoch: int | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor] | None]:
    """Load ``directory / "last.pt"`` into the model, optimiser, schedule and RNGs of a resumed run. Everything that
    can fail is checked before anything is loaded: every file, the pair, the settings ``config`` (a
    ``TrainConfig.to_dict()`` with the run's recorded facts, :func:`check_resumable`), the schedule state (against
    ``steps_per_epoch``, the run's optimiser steps per epoch, when given: :func:`check_schedule_state`) and the RNG
    states (:func:`check_rng_state`).

    :return: The checkpoint of ``last.pt`` and the model state of ``best.pt`` (``None`` before any best epoch).
    :raises CheckpointError: A file cannot be used, the pair does not match, the settings differ, the schedule or RNG
        states cannot be restored or the schedule took another number of steps; the model, the optimiser, the
        schedule and the RNGs are then untouched.
    """
    directory = Path(directory)
    path, best_path = directory / "last.pt", directory / "best.pt"
    recover(directory)  # complete a committed write that a kill interrupted
    checkpoint = load_checkpoint(path)
    check_state_fits(checkpoint["model"], model, path, dtypes=True)
    best_state = None
    if checkpoint["best_epoch"]:
        if not best_path.exists():  # the pair is incomplete: not a fresh start (no last.pt), a damaged folder
            raise CheckpointError(
                f"{path} records a best epoch ({checkpoint['best_epoch']}) but its pair {best_path} is missing: the "
                "folder is incomplete (restore best.pt, or train again with resume=False)"
            )
        best = load_checkpoint(best_path)
        check_pair(checkpoint, best, path, best_path)
        best_state = best["model"]
        check_state_fits(best_state, model, best_path, dtypes=True)
    changes = check_resumable(checkpoint["config"], config, checkpoint["epoch"], path)
    check_schedule_state(checkpoint["scheduler"], scheduler, checkpoint["epoch"], steps_per_epoch, path)
    check_rng_state(checkpoint["rng"], device, path)
    try:  # the optimiser validates its groups before changing anything: it is loaded first
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        raise CheckpointError(
            f"the checkpoint {path} holds an optimiser state that does not fit this model ({type(error).__name__}: "
            f"{error})"
        ) from error
    if changes:
        warnings.warn(
            f"resuming from {path} with changed settings, so the run will not match an uninterrupted one: "
            f"{'; '.join(changes)}",
            stacklevel=4,  # the caller of train_model
        )
    # what is left cannot fail: the model state fits (names and shapes), the schedule and RNG states were checked
    model.load_state_dict(checkpoint["model"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    restore_rng_state(checkpoint["rng"], generator, device)
    return checkpoint, best_state
