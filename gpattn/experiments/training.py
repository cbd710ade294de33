r"""Train classifiers with (GP) attention: AdamW, warm-up + cosine schedule, checkpoints, resume and ensembles.

:func:`train_model` minimises :class:`~gpattn.mlls.AttentionELBO` with AdamW. The learning rate rises linearly
during the warm-up and then follows a cosine down to ``min_lr`` (:func:`warmup_cosine_lr`, updated every
optimiser step); gradients are clipped by their global norm. After every epoch the model is evaluated on the
validation set with :math:`T` Monte Carlo samples (:func:`evaluate`), and the state with the lowest validation
NLL is kept (in memory and, with ``checkpoint_dir``, in ``best.pt``); it is loaded into the model at the end.

Determinism: a run is a function of ``config.seed`` and the model's initial parameters. The global torch RNG
(reparameterisation noise, dropout, Monte Carlo evaluation) is seeded with ``config.seed`` and the batch order comes
from a local ``torch.Generator`` seeded with it too; NumPy's global RNG is never used. Every epoch ends with a
checkpoint ``last.pt`` holding both RNG states, so a run resumed from it (``resume=True``) reproduces the
uninterrupted run bit for bit on the CPU.

:func:`train_ensemble` trains independent members with seeds ``config.seed + k``: Deep Ensembles when the
members use softmax attention, ensembles of KEP-SVGP Transformers when they use ``"kep_svgp"``;
:func:`ensemble_probabilities` averages the members' predictive probabilities.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from ..mlls import AttentionELBO
from ..models import predict_probabilities

__all__ = [
    "CHECKPOINT_KEYS",
    "CheckpointError",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "ensemble_probabilities",
    "evaluate",
    "load_checkpoint",
    "train_ensemble",
    "train_model",
    "warmup_cosine_lr",
    "warmup_cosine_schedule",
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
#: Config fields that may change between an interrupted run and its resumption without a warning.
_RESUMABLE_CHANGES = ("epochs", "schedule_epochs", "progress", "checkpoint_dir", "eval_batch_size")


class NonFiniteLossError(RuntimeError):
    """The training loss, the gradient norm, a parameter or the validation NLL became NaN or infinite; the model holds
    the best finite state and the checkpoints on disk are those of the last completed (finite) epoch."""


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint file cannot be used: unreadable (truncated, garbage, not a torch file), incomplete (missing or
    malformed entries) or written for another model (parameter names or shapes differ). The message names the file
    and the problem. Both a ``ValueError`` and a ``RuntimeError``."""


# -- configuration ---------------------------------------------------------------------------------------------------
def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected an integer {name} >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any, minimum: float, strict: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"expected a finite number {name}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"expected {name} {relation} {minimum}, got {value!r}")


@dataclass
class TrainConfig:
    """Settings of :func:`train_model` (validated on construction: a bad value raises ``ValueError``).

    :ivar epochs: Epochs to train (in total, counting those of a resumed run).
    :ivar batch_size: Training minibatch size (the last batch of an epoch may be smaller).
    :ivar lr: Peak learning rate of AdamW (reached at the end of the warm-up).
    :ivar weight_decay: AdamW's decoupled weight decay.
    :ivar warmup_epochs: Length of the linear warm-up in epochs (may be fractional).
    :ivar warmup_steps: Length of the warm-up in optimiser steps; overrides ``warmup_epochs`` when set.
    :ivar min_lr: Learning rate at the end of the cosine decay (``0 <= min_lr <= lr``).
    :ivar grad_clip: Maximum global gradient norm, or ``None`` for no clipping.
    :ivar beta: KL weight :math:`\\beta` of :class:`~gpattn.mlls.AttentionELBO`.
    :ivar eval_samples: Monte Carlo samples :math:`T` of the validation predictions.
    :ivar eval_batch_size: Batch size of the validation predictions.
    :ivar seed: Seed of the global torch RNG and of the batch order.
    :ivar device: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``.
    :ivar progress: Show a tqdm bar per epoch (only on a terminal).
    :ivar checkpoint_dir: Directory of ``best.pt`` and ``last.pt`` (created if missing), or ``None`` (in memory).
    :ivar schedule_epochs: Horizon of the cosine schedule in epochs (default ``epochs``). Set it to the planned total
        when a run is deliberately split into stages (``epochs=2`` now, ``epochs=4, resume=True`` later), so that
        the staged run follows the same schedule as an uninterrupted one.
    """

    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_epochs: float = 1.0
    warmup_steps: int | None = None
    min_lr: float = 0.0
    grad_clip: float | None = 1.0
    beta: float = 1.0
    eval_samples: int = 10
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "cpu"
    progress: bool = True
    checkpoint_dir: str | Path | None = None
    schedule_epochs: int | None = None

    def __post_init__(self) -> None:
        _check_int("epochs", self.epochs, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_float("lr", self.lr, 0.0, strict=True)
        _check_float("weight_decay", self.weight_decay, 0.0, strict=False)
        _check_float("warmup_epochs", self.warmup_epochs, 0.0, strict=False)
        if self.warmup_steps is not None:
            _check_int("warmup_steps", self.warmup_steps, 0)
        _check_float("min_lr", self.min_lr, 0.0, strict=False)
        if self.min_lr > self.lr:
            raise ValueError(f"expected min_lr <= lr = {self.lr}, got {self.min_lr!r}")
        if self.grad_clip is not None:
            _check_float("grad_clip", self.grad_clip, 0.0, strict=True)
        _check_float("beta", self.beta, 0.0, strict=False)
        _check_int("eval_samples", self.eval_samples, 1)
        _check_int("eval_batch_size", self.eval_batch_size, 1)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"expected an integer seed, got {self.seed!r}")
        device = str(self.device)
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
            raise ValueError(f"expected device 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"expected a bool progress, got {self.progress!r}")
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"expected checkpoint_dir to be a path or None, got {self.checkpoint_dir!r}")
        if self.schedule_epochs is not None:
            _check_int("schedule_epochs", self.schedule_epochs, 1)

    @property
    def horizon_epochs(self) -> int:
        """Epochs of the cosine schedule: ``schedule_epochs`` or ``epochs``."""
        return self.epochs if self.schedule_epochs is None else self.schedule_epochs

    def schedule_steps(self, steps_per_epoch: int) -> tuple[int, int]:
        """``(total_steps, warmup_steps)`` of the schedule for ``steps_per_epoch`` optimiser steps per epoch."""
        total = self.horizon_epochs * steps_per_epoch
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_epochs * steps_per_epoch)
        return total, min(warmup, total)


@dataclass
class TrainResult:
    """What :func:`train_model` returns.

    :ivar history: One dict per epoch: ``epoch`` (from 1), the training loss parts averaged over the epoch's
        sequences ``loss``, ``nll``, ``kl``, ``ksvd`` (weighted as in :class:`~gpattn.mlls.AttentionELBO`), the mean
        pre-clipping gradient norm ``grad_norm``, ``val_accuracy``, ``val_nll``, the learning rate of the epoch's
        last step ``lr`` and the wall time ``seconds``.
    :ivar best_epoch: Epoch of the lowest validation NLL (its state is the model's after training).
    :ivar best_val_nll: That NLL.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int = 0
    best_val_nll: float = math.inf


# -- data ------------------------------------------------------------------------------------------------------------
def _inputs(dataset: Any) -> tuple[Tensor, Tensor | None]:
    """``(inputs, mask or None)`` of a data set: ``.tokens`` and ``.mask`` (:class:`~gpattn.data.SequenceDataset`),
    ``.images`` (no mask) or a generic ``.inputs`` (and ``.mask`` if present)."""
    for name in ("tokens", "images", "inputs"):
        inputs = getattr(dataset, name, None)
        if isinstance(inputs, Tensor):
            return inputs, None if name == "images" else getattr(dataset, "mask", None)
    raise TypeError(
        f"expected a data set with a tensor attribute .tokens, .images or .inputs (and .labels), "
        f"got {type(dataset).__name__}"
    )


def _labels(dataset: Any) -> Tensor:
    labels = getattr(dataset, "labels", None)
    inputs, _ = _inputs(dataset)
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.is_floating_point():
        raise TypeError(f"expected integer class labels .labels of shape (n,), got {type(labels).__name__}")
    if labels.shape[0] != inputs.shape[0] or labels.shape[0] == 0:
        raise ValueError(
            f"expected a non-empty data set with as many labels as inputs, got {labels.shape[0]} labels for "
            f"{inputs.shape[0]} inputs"
        )
    return labels


def _model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _batch(inputs: Tensor, mask: Tensor | None, index: Tensor, device: torch.device):
    return inputs[index].to(device), None if mask is None else mask[index].to(device)


# -- schedule --------------------------------------------------------------------------------------------------------
def warmup_cosine_lr(step: int, total_steps: int, warmup_steps: int, lr: float, min_lr: float = 0.0) -> float:
    r"""The learning rate of optimiser step ``step`` (from 0): linear warm-up, then cosine decay to ``min_lr``.

    With :math:`W` = ``warmup_steps`` and :math:`S` = ``total_steps``,

    .. math::

        \eta_s = \begin{cases}
            \eta \, \frac{s + 1}{W + 1} & s < W, \\
            \eta_{\min} + \frac{\eta - \eta_{\min}}{2} \big(1 + \cos(\pi \min(1, \frac{s - W}{\max(1, S - W)}))\big)
            & s \geq W,
        \end{cases}

    so the warm-up never uses a zero rate, the peak :math:`\eta` is reached at step :math:`W` and :math:`\eta_{\min}`
    at step :math:`S` (after the last step), where it stays.
    """
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, min_lr: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`warmup_cosine_lr` (``scheduler.step()`` once per optimiser step); the peak of
    every parameter group is its initial ``lr`` and ``min_lr`` is relative to the first group's."""
    _check_int("total_steps", total_steps, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    peak = optimizer.param_groups[0]["lr"]
    ratio = min_lr / peak

    def factor(step: int) -> float:
        return warmup_cosine_lr(step, total_steps, warmup_steps, 1.0, ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -- evaluation ------------------------------------------------------------------------------------------------------
def evaluate(model: torch.nn.Module, dataset: Any, num_samples: int = 10, batch_size: int = 256) -> Tensor:
    """Monte Carlo predictive probabilities of ``model`` on a data set, by batches of
    :func:`~gpattn.models.predict_probabilities` (eval mode, ``num_samples`` samples, no gradients; the global torch RNG
    drives the samples).

    :param model: Maps ``(inputs, mask=mask)`` to logits.
    :param dataset: Has ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param num_samples: :math:`T`.
    :param batch_size: Sequences per forward pass.
    :return: Probabilities, shape ``(n, C)``, on the CPU.
    """
    _check_int("batch_size", batch_size, 1)
    inputs, mask = _inputs(dataset)
    device = _model_device(model)
    parts = []
    for start in range(0, inputs.shape[0], batch_size):
        index = torch.arange(start, min(start + batch_size, inputs.shape[0]))
        batch_inputs, batch_mask = _batch(inputs, mask, index, device)
        parts.append(predict_probabilities(model, batch_inputs, mask=batch_mask, num_samples=num_samples).cpu())
    return torch.cat(parts)


def _metrics(probabilities: Tensor, labels: Tensor) -> tuple[float, float]:
    """Accuracy and mean negative log predictive probability."""
    accuracy = (probabilities.argmax(dim=-1) == labels).double().mean().item()
    picked = probabilities.double().gather(1, labels.unsqueeze(1)).squeeze(1)
    nll = -picked.clamp_min(torch.finfo(torch.float64).tiny).log().mean().item()
    return accuracy, nll


# -- checkpoints -----------------------------------------------------------------------------------------------------
def _state_copy(model: torch.nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _save(payload: dict[str, Any], path: Path) -> None:
    # write then rename, so that an interruption never leaves a half-written checkpoint
    temporary = path.with_name(path.name + ".tmp")
    torch.save(payload, temporary)
    os.replace(temporary, path)


def _read_checkpoint(path: Path) -> dict[str, Any]:
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


def _check_fits(state: dict[str, Tensor], model: torch.nn.Module, path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``state`` has exactly the model's entries with the model's shapes."""
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
            f"attention, width, depth, rank or number of classes?)"
        )


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Read and validate a checkpoint written by :func:`train_model` (``last.pt`` or ``best.pt``) and, given a model,
    load its parameters into it.

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
    checkpoint = _read_checkpoint(path)
    if model is not None:
        _check_fits(checkpoint["model"], model, path)
        model.load_state_dict(checkpoint["model"])
    return checkpoint


def _rng_state(generator: torch.Generator, device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "batch_generator": generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
    }


def _set_rng_state(state: dict[str, Any], generator: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["batch_generator"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _config_dict(config: TrainConfig) -> dict[str, Any]:
    values = asdict(config)
    values["checkpoint_dir"] = None if config.checkpoint_dir is None else str(config.checkpoint_dir)
    return values


def _warn_on_changes(saved: dict[str, Any], config: TrainConfig, path: Path) -> None:
    current = _config_dict(config)
    changed = [
        name for name in current if name not in _RESUMABLE_CHANGES and name in saved and saved[name] != current[name]
    ]
    saved_horizon = saved.get("schedule_epochs") or saved.get("epochs")
    if saved_horizon != config.horizon_epochs:
        changed.append(f"schedule horizon ({saved_horizon} -> {config.horizon_epochs} epochs)")
    if changed:
        warnings.warn(
            f"resuming from {path} with changed settings {changed}: the run will not match an uninterrupted one "
            f"(set schedule_epochs to the planned total when training in stages)",
            stacklevel=3,
        )


# -- training --------------------------------------------------------------------------------------------------------
def _describe(parts: dict[str, Tensor]) -> str:
    return ", ".join(f"{name}={value.item():.6g}" for name, value in parts.items())


def train_model(model: torch.nn.Module, train: Any, val: Any, config: TrainConfig, resume: bool = False) -> TrainResult:
    """Train ``model`` on ``train`` with :class:`~gpattn.mlls.AttentionELBO` and AdamW, selecting on ``val``.

    Each epoch visits the training set in a random order (``ceil(n / batch_size)`` steps) and ends with an
    evaluation on ``val`` (:func:`evaluate` with ``config.eval_samples`` samples: accuracy and NLL), then the
    checkpoint ``last.pt`` (and ``best.pt`` when the validation NLL is the lowest so far; ties keep the earlier
    epoch). At the end the best state is loaded into the model, which is left in eval mode.

    :param model: Maps ``(inputs, mask=mask)`` to logits ``(B, C)`` and has ``kl_divergence()``
        (e.g. :class:`~gpattn.models.Transformer`). Moved to ``config.device``.
    :param train: Training set with ``.labels`` and ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param val: Validation set of the same kind.
    :param config: The settings.
    :param resume: Continue from ``config.checkpoint_dir / "last.pt"`` (model, optimiser, schedule, RNG states and
        history), training up to ``config.epochs`` in total. On the CPU the result equals the uninterrupted run's
        bit for bit, provided the settings (and the schedule horizon) are unchanged.
    :return: The :class:`TrainResult`.
    :raises NonFiniteLossError: When a loss or gradient norm, a parameter after an epoch or the validation NLL is NaN
        or infinite; the model then holds the best state so far (the initial one before the first evaluation) and the
        checkpoints on disk stay those of the last completed epoch.
    :raises FileNotFoundError: ``resume=True`` without ``last.pt``.
    :raises CheckpointError: ``resume=True`` with a checkpoint that cannot be read, is incomplete or was written for
        another model (see :func:`load_checkpoint`; the message names the file). The model is then left untouched.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(config).__name__}")
    if resume and config.checkpoint_dir is None:
        raise ValueError("resume=True needs config.checkpoint_dir (the directory holding last.pt), got None")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config.device={config.device!r} but CUDA is not available; use device='cpu'")
    train_inputs, train_mask = _inputs(train)
    train_labels = _labels(train)
    val_labels = _labels(val)
    directory = None if config.checkpoint_dir is None else Path(config.checkpoint_dir)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)

    model.to(device)
    num_data = train_labels.shape[0]
    steps_per_epoch = math.ceil(num_data / config.batch_size)
    total_steps, warmup_steps = config.schedule_steps(steps_per_epoch)
    loss_fn = AttentionELBO(model, num_data=num_data, beta=config.beta, combine_terms=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = warmup_cosine_schedule(optimizer, total_steps, warmup_steps, config.min_lr)
    generator = torch.Generator()
    result = TrainResult()
    start_epoch = 0

    if resume:
        path = directory / "last.pt"
        if not path.is_file():
            raise FileNotFoundError(f"resume=True but there is no checkpoint {path} (train once with resume=False)")
        checkpoint = _read_checkpoint(path)
        _check_fits(checkpoint["model"], model, path)
        best_path = directory / "best.pt"
        best_state = None
        if checkpoint["best_epoch"]:
            best_state = _read_checkpoint(best_path)["model"]
            _check_fits(best_state, model, best_path)
        _warn_on_changes(checkpoint["config"], config, path)
        try:  # the optimiser validates its groups before changing anything; the model fits (checked above)
            optimizer.load_state_dict(checkpoint["optimizer"])
            model.load_state_dict(checkpoint["model"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            _set_rng_state(checkpoint["rng"], generator, device)
        except (RuntimeError, KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"the checkpoint {path} does not fit this model or optimiser: {error}") from error
        start_epoch = checkpoint["epoch"]
        result = TrainResult(list(checkpoint["history"]), checkpoint["best_epoch"], checkpoint["best_val_nll"])
        best_state = _state_copy(model) if best_state is None else best_state
        best_state = {name: value.to(device) for name, value in best_state.items()}
    else:
        torch.manual_seed(config.seed)
        generator.manual_seed(config.seed)
        best_state = _state_copy(model)  # the fallback before the first evaluation

    def fail(message: str) -> None:
        model.load_state_dict(best_state)
        model.eval()
        if directory is None:
            kept = ""
        elif epoch > 1:
            kept = f"; {directory / 'last.pt'} still holds epoch {epoch - 1}, the last good one"
        else:
            kept = f"; no checkpoint of this run was written to {directory}"
        raise NonFiniteLossError(f"{message}; the model now holds the state of epoch {result.best_epoch}{kept}")

    max_norm = math.inf if config.grad_clip is None else config.grad_clip
    for epoch in range(start_epoch + 1, config.epochs + 1):
        started = time.perf_counter()
        model.train()
        totals = dict.fromkeys(("loss", "nll", "kl", "ksvd", "grad_norm"), 0.0)
        order = torch.randperm(num_data, generator=generator)
        bar = tqdm(
            total=steps_per_epoch,
            desc=f"epoch {epoch}/{config.epochs}",
            disable=None if config.progress else True,
            leave=False,
        )
        try:
            for step in range(steps_per_epoch):
                index = order[step * config.batch_size : (step + 1) * config.batch_size]
                inputs, mask = _batch(train_inputs, train_mask, index, device)
                labels = train_labels[index].to(device)
                parts = loss_fn(model(inputs, mask=mask), labels)
                where = f"epoch {epoch}, step {step + 1}/{steps_per_epoch} (global step {scheduler.last_epoch + 1})"
                if not torch.isfinite(parts["loss"]):
                    fail(f"non-finite training loss at {where}: {_describe(parts)}")
                optimizer.zero_grad(set_to_none=True)
                parts["loss"].backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not torch.isfinite(grad_norm):
                    fail(f"non-finite gradient norm {grad_norm.item()} at {where}: {_describe(parts)}")
                optimizer.step()
                last_lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                size = index.shape[0]
                for name in ("loss", "nll", "kl", "ksvd"):
                    totals[name] += parts[name].item() * size
                totals["grad_norm"] += grad_norm.item() * size
                bar.set_postfix(
                    nll=f"{parts['nll'].item():.4f}", kl=f"{parts['kl'].item():.4f}", ksvd=f"{parts['ksvd'].item():.4f}"
                )
                bar.update()
        finally:
            bar.close()

        # an optimiser step can make a parameter non-finite without a non-finite loss or gradient (the last step of an
        # epoch in particular): never evaluate or checkpoint such a state
        broken = [name for name, parameter in model.named_parameters() if not torch.isfinite(parameter).all()]
        if broken:
            fail(f"non-finite parameters {broken[:5]} after epoch {epoch}")
        val_accuracy, val_nll = _metrics(evaluate(model, val, config.eval_samples, config.eval_batch_size), val_labels)
        if not math.isfinite(val_nll):
            fail(f"non-finite validation NLL {val_nll} after epoch {epoch}")
        record = {"epoch": epoch, **{name: value / num_data for name, value in totals.items()}}
        record.update(
            val_accuracy=val_accuracy,
            val_nll=val_nll,
            lr=last_lr,
            seconds=time.perf_counter() - started,
        )
        result.history.append(record)
        improved = val_nll < result.best_val_nll
        if improved:
            result.best_epoch, result.best_val_nll = epoch, val_nll
            best_state = _state_copy(model)
        if directory is not None:
            payload = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "rng": _rng_state(generator, device),
                "history": result.history,
                "best_epoch": result.best_epoch,
                "best_val_nll": result.best_val_nll,
                "config": _config_dict(config),
            }
            if improved:
                _save(payload, directory / "best.pt")
            _save(payload, directory / "last.pt")

    model.load_state_dict(best_state)
    model.eval()
    return result


# -- ensembles -------------------------------------------------------------------------------------------------------
def train_ensemble(
    make_model: Callable[[int], torch.nn.Module],
    train: Any,
    val: Any,
    config: TrainConfig,
    size: int,
    resume: bool = False,
) -> list[tuple[torch.nn.Module, TrainResult]]:
    """Train ``size`` independent members (Deep Ensembles with softmax attention, KEP-SVGP ensembles with
    ``"kep_svgp"``).

    Member ``k`` is built by ``make_model(k)`` right after ``torch.manual_seed(config.seed + k)`` (so its
    initialisation is seeded too) and trained by :func:`train_model` with ``seed=config.seed + k`` and, with a
    ``checkpoint_dir``, its own subdirectory ``member_<k>``.

    :return: ``[(model, result), ...]`` in member order.
    """
    _check_int("size", size, 1)
    members = []
    for k in range(size):
        directory = None if config.checkpoint_dir is None else Path(config.checkpoint_dir) / f"member_{k}"
        member_config = replace(config, seed=config.seed + k, checkpoint_dir=directory)
        torch.manual_seed(member_config.seed)
        model = make_model(k)
        members.append((model, train_model(model, train, val, member_config, resume=resume)))
    return members


def ensemble_probabilities(
    models: Sequence[torch.nn.Module], dataset: Any, num_samples: int = 10, batch_size: int = 256
) -> Tensor:
    """The ensemble's predictive probabilities: the mean over members of :func:`evaluate` (members in order, each
    drawing its Monte Carlo samples from the global torch RNG), shape ``(n, C)``."""
    models = list(models)
    if not models:
        raise ValueError("expected at least one model in the ensemble, got none")
    return torch.stack([evaluate(model, dataset, num_samples, batch_size) for model in models]).mean(dim=0)
