"""Progress of a training run as callbacks: a live bar per epoch (:class:`ProgressBar`, what
``TrainConfig(progress=True)`` shows) and one line per finished epoch (:class:`EpochLog`, what ``gpattn train``
prints)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from tqdm import tqdm

from .callbacks import Callback, TrainingContext

__all__ = ["EpochLog", "ProgressBar"]


class ProgressBar(Callback):
    """A tqdm bar over the optimiser steps of every epoch (``epoch e/E``, with the step's NLL, KL and KSVD terms),
    removed when the epoch's steps are done. Shown only on a terminal (tqdm's ``disable=None``)."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_epoch_begin(self, context: TrainingContext, epoch: int) -> None:
        """Open the epoch's bar."""
        total = context.steps_per_epoch
        self.bar = tqdm(total=total, desc=f"epoch {epoch}/{context.config.epochs}", disable=None, leave=False)

    def on_step_end(self, context: TrainingContext, epoch: int, step: int, values: Mapping[str, float]) -> None:
        """Advance the bar; close it after the epoch's last step."""
        self.bar.set_postfix(nll=f"{values['nll']:.4f}", kl=f"{values['kl']:.4f}", ksvd=f"{values['ksvd']:.4f}")
        self.bar.update()
        if step == context.steps_per_epoch:
            self._close()

    def on_exception(self, context: TrainingContext, error: BaseException) -> None:
        """Close the bar of the interrupted epoch."""
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class EpochLog(Callback):
    """One line per finished epoch on ``stream``::

        epoch 3/10: loss 0.4321, val accuracy 0.8750, val nll 0.3456 (1.2 s)

    A resumed run first prints the lines of the epochs it restored (from the checkpoint's history).

    :param stream: Where the lines go (default: standard error, read when a line is printed).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def on_train_begin(self, context: TrainingContext) -> None:
        """Print the restored epochs of a resumed run."""
        for record in context.result.history:
            self._print(context, record)

    def on_epoch_end(self, context: TrainingContext, epoch: int, record: Mapping[str, float]) -> None:
        """Print the epoch's line."""
        self._print(context, record)

    def _print(self, context: TrainingContext, record: Mapping[str, float]) -> None:
        line = (
            f"epoch {record['epoch']}/{context.config.epochs}: loss {record['loss']:.4f}, val accuracy "
            f"{record['val_accuracy']:.4f}, val nll {record['val_nll']:.4f} ({record['seconds']:.1f} s)"
        )
        print(line, file=sys.stderr if self.stream is None else self.stream, flush=True)
