"""Callbacks of the training loop: what a caller of :func:`~gpattn.training.train_model` is told while it runs.

Progress bars, per-epoch lines and anything else that watches a run are :class:`Callback` s passed as
``train_model(..., callbacks=[...])``; the loop never writes to a terminal itself, and nothing polls its checkpoint
files. The loop calls the hooks in the main process (rank 0 of a data-parallel run), in this order::

    on_train_begin
    on_epoch_begin, on_step_end (once per optimiser step), on_epoch_end      (once per epoch)
    on_train_end, or on_exception when the run stops by an exception

``on_epoch_end`` comes after the epoch's validation and checkpoint (``last.pt`` then holds that epoch), so a hook that
raises there, or anywhere, stops training with the checkpoints of the last completed epoch on disk: the loop calls
every callback's ``on_exception`` and re-raises the error, and ``resume=True`` continues the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config import TrainConfig, TrainResult

__all__ = ["Callback", "CallbackList", "TrainingContext"]


@dataclass(frozen=True)
class TrainingContext:
    """What every hook of a :class:`Callback` may read about the run it observes.

    :ivar model: The model being trained (not a data-parallel wrapper of it).
    :ivar config: The run's settings.
    :ivar steps_per_epoch: Optimiser steps per epoch.
    :ivar start_epoch: Epochs already trained when the call began (those restored by ``resume=True``; else 0).
    :ivar result: The result so far; the loop appends one entry per epoch to its ``history`` (and updates the best
        epoch) before ``on_epoch_end``.
    """

    model: torch.nn.Module
    config: TrainConfig
    steps_per_epoch: int
    start_epoch: int
    result: TrainResult


class Callback:
    """Hooks of :func:`~gpattn.training.train_model` (see the module docstring for their order). Every hook does
    nothing here: subclass and override the ones you need.

    A hook must not draw from the global torch RNG (a run's numbers depend on its seed only). An exception it raises
    stops training: the loop then calls every callback's :meth:`on_exception` and re-raises the error.
    """

    def on_train_begin(self, context: TrainingContext) -> None:
        """Called once before the first epoch of this call (after a resumed run's state is restored)."""

    def on_epoch_begin(self, context: TrainingContext, epoch: int) -> None:
        """Called before the first step of ``epoch`` (from 1)."""

    def on_step_end(self, context: TrainingContext, epoch: int, step: int, values: Mapping[str, float]) -> None:
        """Called after optimiser step ``step`` (from 1 to ``context.steps_per_epoch``) of ``epoch``.

        :param values: The step's loss parts ``loss``, ``nll``, ``kl``, ``ksvd``, ``prior`` (as in
            :class:`~gpattn.mlls.AttentionELBO`), the pre-clipping gradient norm ``grad_norm`` and the learning rate
            ``lr`` the step used (the values of this process's batch).
        """

    def on_epoch_end(self, context: TrainingContext, epoch: int, record: Mapping[str, float]) -> None:
        """Called after ``epoch``'s validation and checkpoint, with its entry of ``context.result.history``."""

    def on_train_end(self, context: TrainingContext) -> None:
        """Called once after the last epoch, when the model holds the selected (best) state in eval mode."""

    def on_exception(self, context: TrainingContext, error: BaseException) -> None:
        """Called when training stops by ``error`` (a divergence, Ctrl-C, an error of a hook, ...), before it is
        re-raised: e.g. to close what :meth:`on_epoch_begin` opened. An exception raised here does not replace
        ``error``: it is named in a note of ``error`` (Python 3.11+) and in a warning, and the other callbacks are
        still told."""


def check_callbacks(callbacks: Any, where: str) -> list[Callback]:
    """``callbacks`` (an iterable of :class:`Callback` s, as the ``callbacks`` argument of ``where`` takes them) as a
    list.

    :raises TypeError: For a single callback (not in a list), a non-iterable, or an item that is not a
        :class:`Callback`.
    """
    if isinstance(callbacks, Callback):
        raise TypeError(
            f"{where}: expected callbacks to be a list of Callbacks, got a single {type(callbacks).__name__}; pass "
            "callbacks=[callback]"
        )
    if isinstance(callbacks, (str, bytes, Mapping)) or not isinstance(callbacks, Iterable):
        raise TypeError(f"{where}: expected callbacks to be a list of Callbacks, got {type(callbacks).__name__}")
    callbacks = list(callbacks)
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise TypeError(
                f"{where}: expected callbacks[{index}] to be a Callback (gpattn.training.Callback), got "
                f"{type(callback).__name__}"
            )
    return callbacks


class CallbackList(Callback):
    """Several callbacks called in order, as one.

    :param callbacks: The callbacks.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"expected every callback to be a Callback, got {type(callback).__name__}")

    def on_train_begin(self, context: TrainingContext) -> None:
        for callback in self.callbacks:
            callback.on_train_begin(context)

    def on_epoch_begin(self, context: TrainingContext, epoch: int) -> None:
        for callback in self.callbacks:
            callback.on_epoch_begin(context, epoch)

    def on_step_end(self, context: TrainingContext, epoch: int, step: int, values: Mapping[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_step_end(context, epoch, step, values)

    def on_epoch_end(self, context: TrainingContext, epoch: int, record: Mapping[str, float]) -> None:
        for callback in self.callbacks:
            callback.on_epoch_end(context, epoch, record)

    def on_train_end(self, context: TrainingContext) -> None:
        for callback in self.callbacks:
            callback.on_train_end(context)

    def on_exception(self, context: TrainingContext, error: BaseException) -> None:
        # every callback is told, and the run's own error stays the one raised: a callback that fails here is named
        # in a note of that error (Python 3.11+) and in a warning, not raised in its place
        for callback in self.callbacks:
            try:
                callback.on_exception(context, error)
            except Exception as failure:  # noqa: BLE001 (any failure of a hook while the run's error propagates)
                message = f"{type(callback).__name__}.on_exception raised {type(failure).__name__}: {failure}"
                if hasattr(error, "add_note"):
                    error.add_note(message)
                warnings.warn(f"{message} (while training stopped by {type(error).__name__})", stacklevel=2)
