"""How the processes of one training run cooperate: the hooks :func:`~gpattn.training.train_model` calls."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import TrainConfig

__all__ = ["TrainingStrategy"]


class TrainingStrategy:
    """How the processes of one training run cooperate: the hooks :func:`~gpattn.training.train_model` calls. This
    base class is a single process (every hook is the identity);
    :class:`~gpattn.training.distributed.DataParallelStrategy` implements data-parallel training over a process group
    with the same loop.

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

    def share_best(self, best_state: dict[str, Tensor], best_epoch: int) -> int:
        """Make every process hold the main process's best state and return its best epoch, before ``best_state``
        (name -> tensor of the model's state of that shape) is loaded into the model when training diverges (a
        data-parallel :meth:`finish` calls it at the end too). Only the main process selects, so the others hold the
        initial state and epoch 0 until then. Every process calls it at the same step. Here (one process): returns
        ``best_epoch``, at no cost."""
        return best_epoch

    def finish(self, model: torch.nn.Module, best_state: dict[str, Tensor]) -> None:
        """Called once after the last epoch, before ``best_state`` (name -> tensor of the model's state of that shape)
        is loaded into ``model`` (e.g. to check that the replicas agree and to broadcast the main process's best state
        into ``best_state``)."""
