"""Checkpoints of the training loop: ``last.pt`` (every epoch) and ``best.pt`` (the lowest validation NLL so far).

Both are complete, resumable checkpoints of the epoch they were written at: a dict with the keys
:data:`CHECKPOINT_KEYS` (model, optimiser and schedule states, the epoch, both RNG states, the history, the best epoch
and its NLL, and the :class:`~gpattn.experiments.TrainConfig` as a dict). They are written atomically (to a temporary
file, then renamed), so an interruption never leaves a half-written file, and read with ``weights_only=True``.
A checkpoint that cannot be used raises :class:`CheckpointError` naming the file and the problem, before anything
is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CHECKPOINT_KEYS",
    "RNG_KEYS",
    "CheckpointError",
    "check_state_fits",
    "load_checkpoint",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
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
)
#: Keys of ``checkpoint["rng"]``: the global torch CPU RNG state, the batch-order generator's state and the CUDA
#: states (``None`` unless training on CUDA).
RNG_KEYS = ("torch", "batch_generator", "cuda")


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint file cannot be used: unreadable (truncated, garbage, not a torch file), incomplete (missing or
    malformed entries) or written for another model (parameter names or shapes differ). The message names the file
    and the problem. Both a ``ValueError`` and a ``RuntimeError``."""


def save_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` (a dict with the keys :data:`CHECKPOINT_KEYS`) to ``path`` atomically: to
    ``<path>.tmp`` first, then renamed, so that an interruption never leaves a half-written checkpoint."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(checkpoint, temporary)
    os.replace(temporary, path)


def _read(path: Path) -> dict[str, Any]:
    """The validated contents of a checkpoint file (entries present and of the right kinds); no model involved."""
    if not path.is_file():
        raise FileNotFoundError(f"there is no checkpoint {path} (train once with resume=False to write one)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a damaged file (UnpicklingError, RuntimeError, EOFError)
        detail = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"could not read the checkpoint {path} ({path.stat().st_size} bytes; {detail}): it is damaged (e.g. "
            f"truncated by an interrupted copy) or not written by gpattn.experiments.train_model; delete it or "
            f"train with resume=False"
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"the checkpoint {path} holds a {type(checkpoint).__name__}, expected a dict")
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"the checkpoint {path} lacks the entries {missing} (expected the keys {list(CHECKPOINT_KEYS)}): it is "
            f"incomplete or not written by gpattn.experiments.train_model"
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
    return checkpoint


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
    :raises CheckpointError: The file is unreadable (truncated, garbage), incomplete, malformed, or written for
        another model; the message names the file and the problem.
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
