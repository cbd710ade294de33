r"""The training loop: AdamW, warm-up + cosine schedule, clipping, model selection on the validation NLL, checkpoints
and resume. Single-process, ensemble (:func:`~gpattn.experiments.train_ensemble`) and data-parallel
(:func:`~gpattn.experiments.distributed.train_distributed`) training all run this one loop.

:func:`train_model` minimises :class:`~gpattn.mlls.AttentionELBO` with AdamW. The learning rate rises linearly
during the warm-up and then follows a cosine down to ``min_lr`` (:func:`~gpattn.experiments.warmup_cosine_lr`,
updated every optimiser step); gradients are clipped by their global norm. After every epoch the model is evaluated on
the validation set with :math:`T` Monte Carlo samples (:func:`~gpattn.experiments.evaluate`), and the state with the
lowest validation NLL (:func:`~gpattn.metrics.negative_log_likelihood`, the NLL the comparison reports) is kept (in
memory and, with ``checkpoint_dir``, in ``best.pt``); it is loaded into the model at the end.

How the processes of a run cooperate is a :class:`TrainingStrategy`: the default is one process; data-parallel
training passes one that shards the batches, all-reduces the gradients and the epoch's loss sums, validates on rank 0
and broadcasts its best state. The loop itself is the same.

Determinism: a run is a function of ``config.seed`` and the model's initial parameters. The global torch RNG
(reparameterisation noise, dropout, Monte Carlo evaluation) is seeded with ``config.seed + rank`` (``config.seed`` in
a single process) and the batch order comes from a local ``torch.Generator`` seeded with ``config.seed``; NumPy's
global RNG is never used. Every epoch ends with a checkpoint ``last.pt`` holding both RNG states, so a run resumed
from it (``resume=True``) reproduces the uninterrupted run bit for bit on the CPU.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from ..mlls import AttentionELBO
from ..validation import all_finite, check_device, check_float, check_int, non_finite_parameters
from .checkpoints import (
    RESUMABLE_CHANGES,
    CheckpointError,
    check_pair,
    check_resumable,
    check_state_fits,
    load_checkpoint,
    recover,
    restore_rng_state,
    rng_state,
    save_run_checkpoints,
)
from .evaluation import batch_to_device, dataset_inputs, dataset_labels, evaluate, validation_metrics
from .schedule import warmup_cosine_schedule

__all__ = [
    "RESUMABLE_CHANGES",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "TrainingDivergedError",
    "TrainingStrategy",
    "train_model",
]

#: The device types the loop runs on.
DEVICE_TYPES = ("cpu", "cuda")
#: The per-epoch training averages of :attr:`TrainResult.history`.
LOSS_PARTS = ("loss", "nll", "kl", "ksvd", "grad_norm")


class TrainingDivergedError(RuntimeError):
    """Training diverged: the loss, the gradient norm, a parameter after an optimiser step, the forward pass or the
    validation predictions became NaN or infinite. Raised at the step where it happens; the model then holds the best
    finite state, and the checkpoints on disk are those of the last completed (finite) epoch.

    :ivar epoch: The epoch (from 1) in which training diverged (the iteration, for the toy regression fits of
        :func:`~gpattn.experiments.run_toy_regression`).
    :ivar step: The step of that epoch (from 1), or ``None`` when found after the epoch's steps (validation).
    :ivar best_epoch: The epoch whose state the model now holds (0: the initial state).
    """

    def __init__(self, message: str, epoch: int = 0, step: int | None = None, best_epoch: int = 0) -> None:
        super().__init__(message)
        self.epoch, self.step, self.best_epoch = epoch, step, best_epoch


#: The former name of :class:`TrainingDivergedError` (the same class).
NonFiniteLossError = TrainingDivergedError


@dataclass
class TrainConfig:
    """Settings of :func:`train_model` (validated on construction: a bad value raises ``ValueError``).

    :ivar epochs: Epochs to train (in total, counting those of a resumed run).
    :ivar batch_size: Training minibatch size (the last batch of an epoch may be smaller); per process in
        data-parallel training.
    :ivar lr: Peak learning rate of AdamW (reached at the end of the warm-up).
    :ivar weight_decay: AdamW's decoupled weight decay.
    :ivar warmup_epochs: Length of the linear warm-up in epochs (may be fractional).
    :ivar warmup_steps: Length of the warm-up in optimiser steps; overrides ``warmup_epochs`` when set.
    :ivar min_lr: Learning rate at the end of the cosine decay (``0 <= min_lr <= lr``).
    :ivar grad_clip: Maximum global gradient norm, or ``None`` for no clipping.
    :ivar beta: KL weight :math:`\\beta` of :class:`~gpattn.mlls.AttentionELBO`.
    :ivar kl_anneal_epochs: KL annealing: the weight rises linearly from :math:`\\beta / A` to :math:`\\beta` over the
        first :math:`A` optimiser steps (``kl_anneal_epochs`` epochs, may be fractional), :math:`\\beta_t = \\beta
        \\min(1, (t + 1) / A)` at global step :math:`t`; ``0`` (default) for none. SGPA's official recipe anneals its
        KL from 0 to 1 (docs/guide/papers.md); the validation NLL that selects the model does not depend on it.
    :ivar eval_samples: Monte Carlo samples :math:`T` of the validation predictions.
    :ivar eval_batch_size: Batch size of the validation predictions.
    :ivar seed: Seed of the global torch RNG and of the batch order.
    :ivar device: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"`` (available on this machine).
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
    kl_anneal_epochs: float = 0.0
    eval_samples: int = 10
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "cpu"
    progress: bool = True
    checkpoint_dir: str | Path | None = None
    schedule_epochs: int | None = None

    def __post_init__(self) -> None:
        where = "TrainConfig"
        for name in ("epochs", "batch_size", "eval_samples", "eval_batch_size"):
            check_int(name, getattr(self, name), where=where)
        for name in ("warmup_steps", "schedule_epochs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=0 if name == "warmup_steps" else 1, where=where)
        check_int("seed", self.seed, minimum=None, where=where)
        check_float("lr", self.lr, 0.0, strict_minimum=True, where=where)
        check_float("min_lr", self.min_lr, 0.0, self.lr, where=where)
        for name in ("weight_decay", "warmup_epochs", "beta", "kl_anneal_epochs"):
            check_float(name, getattr(self, name), 0.0, where=where)
        if self.grad_clip is not None:
            check_float("grad_clip", self.grad_clip, 0.0, strict_minimum=True, where=where)
        check_device("device", self.device, where=where, types=DEVICE_TYPES)
        if not isinstance(self.progress, bool):
            raise ValueError(f"{where}: expected progress to be a bool, got {self.progress!r}")
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"{where}: expected checkpoint_dir to be a path or None, got {self.checkpoint_dir!r}")

    @property
    def horizon_epochs(self) -> int:
        """Epochs of the cosine schedule: ``schedule_epochs`` or ``epochs``."""
        return self.epochs if self.schedule_epochs is None else self.schedule_epochs

    def schedule_steps(self, steps_per_epoch: int) -> tuple[int, int]:
        """``(total_steps, warmup_steps)`` of the schedule for ``steps_per_epoch`` optimiser steps per epoch."""
        total = self.horizon_epochs * steps_per_epoch
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_epochs * steps_per_epoch)
        return total, min(warmup, total)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (``checkpoint_dir`` as a string), as stored in the checkpoints."""
        values = asdict(self)
        values["checkpoint_dir"] = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        return values


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


class TrainingStrategy:
    """How the processes of one training run cooperate: the hooks :func:`train_model` calls. This base class is a
    single process (every hook is the identity); :class:`~gpattn.experiments.distributed.DataParallelStrategy`
    implements data-parallel training over a process group with the same loop.

    :ivar rank: This process's rank (0 in a single process); the main process (rank 0) validates, keeps the history
        and writes the checkpoints.
    :ivar world_size: Number of processes.
    """

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this process validates, records and checkpoints (rank 0)."""
        return self.rank == 0

    def device(self, config: TrainConfig) -> torch.device:
        """The device this process trains on."""
        return torch.device(config.device)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the loop calls for the training forward passes (the model itself, or a wrapper that
        synchronises the gradients); the model is already on :meth:`device`."""
        return model

    def shard(self, order: Tensor) -> Tensor:
        """This process's part of the epoch's permutation ``order`` of the ``n`` training indices, shape ``(n,)`` in
        a single process, ``(ceil(n / world_size),)`` in general."""
        return order

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process gets the same answer, so that all stop together)."""
        return flag

    def sum(self, values: list[float]) -> list[float]:
        """Elementwise sums of ``values`` over the processes."""
        return values

    def finish(self, model: torch.nn.Module, best_state: dict[str, Tensor]) -> None:
        """Called once after the last epoch, before ``best_state`` (name -> tensor of the model's state of that shape)
        is loaded into ``model`` (e.g. to check that the replicas agree and to broadcast the main process's best state
        into ``best_state``)."""


def _state_copy(model: torch.nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _describe(parts: dict[str, Tensor]) -> str:
    return ", ".join(f"{name}={value.item():.6g}" for name, value in parts.items())


def _resume(directory: Path, model, optimizer, scheduler, generator, config, device):
    """Load ``last.pt`` into the model, optimiser, schedule and RNGs (every file, the pair and the settings are
    checked before anything is loaded) and return ``(epoch, result so far, best state)``."""
    path, best_path = directory / "last.pt", directory / "best.pt"
    recover(directory)  # complete a committed write that a kill interrupted
    checkpoint = load_checkpoint(path)
    check_state_fits(checkpoint["model"], model, path)
    best_state = None
    if checkpoint["best_epoch"]:
        best = load_checkpoint(best_path)
        check_pair(checkpoint, best, path, best_path)
        best_state = best["model"]
        check_state_fits(best_state, model, best_path)
    changes = check_resumable(checkpoint["config"], config.to_dict(), checkpoint["epoch"], path)
    if changes:
        warnings.warn(
            f"resuming from {path} with changed settings {changes}: the run will not match an uninterrupted one",
            stacklevel=3,
        )
    try:  # the optimiser validates its groups before changing anything; the model fits (checked above)
        optimizer.load_state_dict(checkpoint["optimizer"])
        model.load_state_dict(checkpoint["model"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        restore_rng_state(checkpoint["rng"], generator, device)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        raise CheckpointError(f"the checkpoint {path} does not fit this model or optimiser: {error}") from error
    result = TrainResult(list(checkpoint["history"]), checkpoint["best_epoch"], checkpoint["best_val_nll"])
    best_state = _state_copy(model) if best_state is None else best_state
    return checkpoint["epoch"], result, {name: value.to(device) for name, value in best_state.items()}


def train_model(
    model: torch.nn.Module,
    train: Any,
    val: Any,
    config: TrainConfig,
    resume: bool = False,
    *,
    strategy: TrainingStrategy | None = None,
) -> TrainResult:
    """Train ``model`` on ``train`` with :class:`~gpattn.mlls.AttentionELBO` and AdamW, selecting on ``val``.

    Each epoch visits the training set in a random order (``ceil(n / batch_size)`` steps) and ends with an
    evaluation on ``val`` (:func:`~gpattn.experiments.evaluate` with ``config.eval_samples`` samples: accuracy and
    NLL), then the checkpoint ``last.pt`` (and ``best.pt`` when the validation NLL is the lowest so far; ties keep the
    earlier epoch). At the end the best state is loaded into the model, which is left in eval mode.

    :param model: Maps ``(inputs, mask=mask)`` to logits ``(B, C)`` and has ``kl_divergence()``
        (e.g. :class:`~gpattn.models.Transformer`). Moved to the strategy's device (``config.device``).
    :param train: Training set with ``.labels`` and ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param val: Validation set of the same kind.
    :param config: The settings.
    :param resume: Continue from ``config.checkpoint_dir / "last.pt"`` (model, optimiser, schedule, RNG states and
        history), training up to ``config.epochs`` in total. On the CPU the result equals the uninterrupted run's
        bit for bit, provided the settings (and the schedule horizon) are unchanged.
    :param strategy: How the processes of the run cooperate (default: one process, :class:`TrainingStrategy`).
    :return: The :class:`TrainResult` (on processes other than the main one: an empty history).
    :raises TrainingDivergedError: At the step where the loss, the gradient norm, a parameter after the optimiser step
        or the forward pass (a ``NaN or Inf`` error of a layer on finite inputs) becomes NaN or infinite, or when the
        validation predictions do; the message names the epoch and step. The model then holds the best state so far
        (the initial one before the first evaluation) and the checkpoints on disk stay those of the last completed
        epoch.
    :raises FileNotFoundError: ``resume=True`` without ``last.pt``.
    :raises CheckpointError: ``resume=True`` with a checkpoint that cannot be read, is damaged or inconsistent, does
        not pair with ``best.pt``, was written for another model or by a run with other settings (seed, learning rate,
        ..., a schedule horizon, or ``epochs`` below the epoch already trained; see
        :func:`~gpattn.experiments.checkpoints.check_resumable`) (the message names the file and what differs). The
        model is then left untouched.

    Example:
        >>> data = make_pointer_task(256, 64, 64, length=8, seed=0, vocab_size=8)  # gpattn.data
        >>> model = Transformer(2, embed_dim=16, depth=1, num_heads=2, vocab_size=8, max_len=8)  # gpattn.models
        >>> result = train_model(model, data.train, data.val, TrainConfig(epochs=2, progress=False))
        >>> result.best_epoch, result.best_val_nll  # the selected epoch and its validation NLL

    .. note:: Per epoch one forward and backward pass over the training set and ``eval_samples`` forward passes over
        the validation set; the checkpoints add two state copies (model, AdamW moments) written to disk with a
        SHA-256 each. The divergence guard adds one fused max-norm pass over the parameters per step
        (``torch._foreach_norm``) and one host synchronisation.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(config).__name__}")
    strategy = TrainingStrategy() if strategy is None else strategy
    if resume and config.checkpoint_dir is None:
        raise ValueError("resume=True needs config.checkpoint_dir (the directory holding last.pt), got None")
    device = strategy.device(config)
    train_inputs, train_mask = dataset_inputs(train)
    train_labels = dataset_labels(train)
    val_labels = dataset_labels(val)
    directory = None if config.checkpoint_dir is None else Path(config.checkpoint_dir)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)

    model.to(device)
    forward = strategy.wrap(model)
    num_data = train_labels.shape[0]
    steps_per_epoch = math.ceil(math.ceil(num_data / strategy.world_size) / config.batch_size)
    total_steps, warmup_steps = config.schedule_steps(steps_per_epoch)
    anneal_steps = math.ceil(config.kl_anneal_epochs * steps_per_epoch)
    # the loop checks the loss itself (below), to restore the last good state and report the step
    loss_fn = AttentionELBO(model, num_data=num_data, beta=config.beta, combine_terms=False, check_finite=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = warmup_cosine_schedule(optimizer, total_steps, warmup_steps, config.min_lr)
    generator = torch.Generator()
    if resume:
        start_epoch, result, best_state = _resume(directory, model, optimizer, scheduler, generator, config, device)
    else:
        torch.manual_seed(config.seed + strategy.rank)  # independent noise per process
        generator.manual_seed(config.seed)  # the same batch order on every process
        start_epoch, result, best_state = 0, TrainResult(), _state_copy(model)  # the fallback before any evaluation

    def fail(message: str, step: int | None = None, cause: BaseException | None = None) -> None:
        model.load_state_dict(best_state)
        model.eval()
        if directory is None:
            kept = ""
        elif epoch > 1:
            kept = f"; {directory / 'last.pt'} still holds epoch {epoch - 1}, the last good one"
        else:
            kept = f"; no checkpoint of this run was written to {directory}"
        raise TrainingDivergedError(
            f"training diverged: {message}; the model now holds the state of epoch {result.best_epoch}{kept} "
            f"(lower the learning rate or clip the gradients)",
            epoch,
            step,
            result.best_epoch,
        ) from cause

    parameters = [parameter for parameter in model.parameters() if parameter.is_floating_point()]

    def parameters_finite() -> bool:
        # one fused max-norm pass (NaN propagates) and one synchronisation, not one per parameter
        norms = torch._foreach_norm(parameters, math.inf) if parameters else []
        return not norms or bool(torch.isfinite(torch.stack([norm.float() for norm in norms])).all())

    max_norm = math.inf if config.grad_clip is None else config.grad_clip
    for epoch in range(start_epoch + 1, config.epochs + 1):
        started = time.perf_counter()
        model.train()
        totals = [0.0] * (len(LOSS_PARTS) + 1)  # the parts weighted by the batch sizes, and the sequence count
        order = strategy.shard(torch.randperm(num_data, generator=generator))
        show = config.progress and strategy.is_main
        bar = tqdm(
            total=steps_per_epoch, desc=f"epoch {epoch}/{config.epochs}", disable=None if show else True, leave=False
        )
        try:
            for step in range(steps_per_epoch):
                index = order[step * config.batch_size : (step + 1) * config.batch_size]
                inputs, mask = batch_to_device(train_inputs, train_mask, index, device)
                labels = train_labels[index].to(device)
                where = f"epoch {epoch}, step {step + 1}/{steps_per_epoch} (global step {scheduler.last_epoch + 1})"
                if anneal_steps:  # beta_t = beta min(1, (t + 1) / A), t the global step (restored on resume)
                    loss_fn.beta = config.beta * min(1.0, (scheduler.last_epoch + 1) / anneal_steps)
                try:
                    parts = loss_fn(forward(inputs, mask=mask), labels)
                except ValueError as error:
                    # the parameters are finite (checked after every step): a layer that finds NaN or Inf in its
                    # input when the batch is finite means the activations overflowed, i.e. training diverged
                    if "NaN or Inf" not in str(error) or not all_finite(inputs):
                        raise
                    fail(f"non-finite values in the forward pass at {where} ({error})", step + 1, error)
                # a non-finite loss on any process stops every process (one stopping alone would hang the others)
                if strategy.any(not torch.isfinite(parts["loss"])):
                    fail(f"non-finite training loss at {where}: {_describe(parts)}", step + 1)
                optimizer.zero_grad(set_to_none=True)
                parts["loss"].backward()  # a data-parallel wrapper all-reduces the gradients here
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not torch.isfinite(grad_norm):
                    fail(f"non-finite gradient norm {grad_norm.item()} at {where}: {_describe(parts)}", step + 1)
                optimizer.step()
                # a step can make a parameter non-finite with a finite loss and gradient (a NaN or Inf in the
                # optimiser's moments, a huge learning rate): stop here, before the next forward pass sees it
                if not parameters_finite():
                    broken = non_finite_parameters(model)[:5]
                    fail(f"non-finite parameters {broken} after the optimiser step at {where}", step + 1)
                last_lr = scheduler.get_last_lr()[0]  # the rate this step used
                scheduler.step()
                size = index.shape[0]
                values = [parts[name].item() for name in LOSS_PARTS[:-1]] + [grad_norm.item()]
                for position, value in enumerate(values):
                    totals[position] += value * size
                totals[-1] += size
                bar.set_postfix(
                    nll=f"{parts['nll'].item():.4f}", kl=f"{parts['kl'].item():.4f}", ksvd=f"{parts['ksvd'].item():.4f}"
                )
                bar.update()
        finally:
            bar.close()

        totals = strategy.sum(totals)
        probabilities = evaluate(model, val, config.eval_samples, config.eval_batch_size) if strategy.is_main else None
        if strategy.any(probabilities is not None and not all_finite(probabilities)):
            fail(f"non-finite validation predictions after epoch {epoch}")  # e.g. from the Monte Carlo samples
        if not strategy.is_main:
            continue
        val_accuracy, val_nll = validation_metrics(probabilities, val_labels)
        record = {"epoch": epoch, **{name: totals[i] / totals[-1] for i, name in enumerate(LOSS_PARTS)}}
        record.update(val_accuracy=val_accuracy, val_nll=val_nll, lr=last_lr, seconds=time.perf_counter() - started)
        result.history.append(record)
        improved = val_nll < result.best_val_nll
        if improved:
            result.best_epoch, result.best_val_nll = epoch, val_nll
            best_state = _state_copy(model)
        if directory is not None:  # last.pt (and best.pt) committed together by the manifest
            checkpoint = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "rng": rng_state(generator, device),
                "history": result.history,
                "best_epoch": result.best_epoch,
                "best_val_nll": result.best_val_nll,
                "config": config.to_dict(),
            }
            save_run_checkpoints(directory, checkpoint, checkpoint if improved else None)

    strategy.finish(model, best_state)
    model.load_state_dict(best_state)
    model.eval()
    return result
