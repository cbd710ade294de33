"""The errors of the training loop: a run that diverged, and a checkpoint that cannot be used."""

from __future__ import annotations

__all__ = ["CheckpointError", "NonFiniteLossError", "TrainingDivergedError"]


class TrainingDivergedError(RuntimeError):
    """Training diverged: the loss, the gradient norm, a parameter after an optimiser step, the forward pass or the
    validation predictions became NaN or infinite. Raised at the step where it happens; the model then holds the best
    finite state, and the checkpoints on disk are those of the last completed (finite) epoch.

    :ivar epoch: The epoch (from 1) in which training diverged (the iteration, for the toy regression fits of
        :func:`~gpattn.comparison.run_toy_regression`).
    :ivar step: The step of that epoch (from 1), or ``None`` when found after the epoch's steps (validation).
    :ivar best_epoch: The epoch whose state the model now holds (0: the initial state).
    """

    def __init__(self, message: str, epoch: int = 0, step: int | None = None, best_epoch: int = 0) -> None:
        super().__init__(message)
        self.epoch, self.step, self.best_epoch = epoch, step, best_epoch


#: The former name of :class:`TrainingDivergedError` (the same class).
NonFiniteLossError = TrainingDivergedError


class CheckpointError(ValueError, RuntimeError):
    """A checkpoint file cannot be used: unreadable (truncated, garbage, not a torch file), damaged (its content
    checksum or the manifest's SHA-256 differs), inconsistent (an epoch against its history, ``best.pt`` against
    ``last.pt``), incomplete (missing or malformed entries), written for another model (parameter names or shapes
    differ; dtypes too when a run resumes) or by a run with other settings. The message names the file and the
    problem. Both a ``ValueError`` and a ``RuntimeError``."""
