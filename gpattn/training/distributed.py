r"""Data-parallel training over several processes (``torch.distributed``, gloo backend, ``DistributedDataParallel``).

Launch with ``torchrun --standalone --nproc_per_node K -m gpattn.training.distributed --out DIR`` (or call
:func:`train_distributed` from a script started by ``torchrun``). Each process (rank :math:`r` of :math:`K`):

* draws the same permutation of the training set every epoch (a local ``torch.Generator`` seeded with
  ``config.seed``), pads it to a multiple of :math:`K` by repeating its first indices (as
  ``DistributedSampler`` does, so that every rank takes the same number of steps) and takes ``order[r::K]``;
* splits its shard into minibatches of ``config.batch_size`` sequences (``batch_size`` is **per rank**: an
  optimiser step sees :math:`K` ``batch_size`` sequences), so an epoch has ``ceil(ceil(n / K) / batch_size)`` steps;
* minimises :class:`~gpattn.mlls.AttentionELBO` with ``num_data = len(train)``; DDP averages the gradients over the
  ranks, i.e. the gradient of the mean cross-entropy over the global batch plus :math:`\beta / n` KL (identical on
  every rank) plus the mean of the ranks' KSVD terms;
* runs the loop of :func:`~gpattn.training.train_model` itself (AdamW, gradient clipping, the warm-up + cosine
  schedule) through a :class:`DataParallelStrategy`: gradients are all-reduced before clipping, so every rank clips
  identically and the replicas never diverge.

The global torch RNG (reparameterisation noise, dropout) is seeded with ``config.seed + r``, so the ranks draw
independent Monte Carlo samples. Rank 0 evaluates on ``val`` after every epoch and keeps the state with the lowest
validation NLL; a non-finite loss on any rank stops every rank, each then holding rank 0's best state so far (it is
broadcast). At the end the ranks check that their replicas still agree (parameter checksums, else ``RuntimeError``)
and rank 0's best state is broadcast so that every rank holds the same parameters, and rank 0 returns the
:class:`~gpattn.training.TrainResult` (the other ranks ``None``).
Checkpoints and resumption are not supported (``config.checkpoint_dir`` is ignored with a warning).

DDP notes: the GP attention layers compute their KL divergence and KSVD added loss terms inside ``forward`` and
:class:`~gpattn.mlls.AttentionELBO` reads them from the wrapped module after the forward pass. Every parameter
therefore gets a gradient in every step, through the logits or the KL / KSVD terms, and DDP runs with
``find_unused_parameters=False``. ``find_unused_parameters=True`` would be *wrong* here: DDP searches the graph
from the forward's **outputs** (the logits) only, would mark the parameters that reach the loss only through the KL
(e.g. a variational covariance) as unused and then fail with "Expected to mark a variable ready only once" when
their gradient arrives through the KL term.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import warnings
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ..attention import attention_names, select_arguments
from ..data import make_pointer_task
from ..models import Transformer
from .callbacks import Callback
from .config import TrainConfig, TrainResult
from .loop import train_model
from .strategy import TrainingStrategy

__all__ = ["DataParallelStrategy", "parameter_checksum", "shard_indices", "train_distributed"]


def shard_indices(order: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s shard ``padded[rank::world_size]`` of a permutation ``order``, padded to a multiple of
    ``world_size`` by repeating its first indices (every rank gets ``ceil(n / world_size)`` indices; the shards are
    disjoint when ``world_size`` divides ``n``).

    :param order: A permutation of the ``n`` training indices, shape ``(n,)``.
    :param rank: This process's rank, ``0 <= rank < world_size``.
    :param world_size: Number of processes.
    :return: The indices of this rank, shape ``(ceil(n / world_size),)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"expected 0 <= rank < world_size = {world_size}, got rank {rank}")
    padding = -order.shape[0] % world_size
    if padding:
        order = torch.cat([order, order.repeat(math.ceil(padding / order.shape[0]))[:padding]])
    return order[rank::world_size]


def parameter_checksum(model: torch.nn.Module) -> float:
    """Sum of the absolute values of every parameter (float64), a cheap fingerprint of a model's state."""
    return float(sum(parameter.detach().double().abs().sum().item() for parameter in model.parameters()))


class DataParallelStrategy(TrainingStrategy):
    """The :class:`~gpattn.training.TrainingStrategy` of data-parallel training over the initialised default
    process group (see the module docstring): DDP-wrapped forward passes, sharded batches, loss sums and stop
    decisions all-reduced over the ranks, and at the end (or when training diverges) rank 0's best state broadcast,
    after a replica check at the end.

    .. note:: Per step one all-reduce of the gradients (DDP) and one of a stop flag; per epoch two small
        all-reduces; at the end one all-gather (the replica check); at the end or at a divergence one broadcast per
        state tensor and one of the best epoch.
    """

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DataParallelStrategy needs an initialised process group (see train_distributed)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def device(self, config: TrainConfig) -> torch.device:
        """``config.device``; on CUDA the GPU ``LOCAL_RANK`` (torchrun's) of this node."""
        device = torch.device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", device.index or 0)))
        return device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``DistributedDataParallel(model)``, which broadcasts rank 0's initial parameters to every rank."""
        # every parameter gets a gradient in every step (through the logits or the KL / KSVD terms): see the docstring
        return DistributedDataParallel(model, find_unused_parameters=False)

    def shard(self, order: Tensor) -> Tensor:
        """This rank's :func:`shard_indices` of the epoch's permutation: shape ``(n,)`` -> ``(ceil(n / K),)``."""
        return shard_indices(order, self.rank, self.world_size)

    def any(self, flag: bool) -> bool:
        """``flag`` all-reduced with a maximum over the ranks."""
        flags = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags.item())

    def sum(self, values: list[float]) -> list[float]:
        """``values`` all-reduced (summed) in float64."""
        totals = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(totals)
        return totals.tolist()

    def finish(self, model: torch.nn.Module, best_state: dict[str, Tensor]) -> None:
        """Check that the replicas still agree (DDP keeps them in sync; a mismatch means a rank trained on different
        gradients) and broadcast rank 0's best state into ``best_state`` on every rank, in place (same shapes)."""
        checksums = [None] * self.world_size
        dist.all_gather_object(checksums, parameter_checksum(model))
        if any(not math.isclose(value, checksums[0], rel_tol=1e-9, abs_tol=1e-9) for value in checksums):
            raise RuntimeError(f"the DDP replicas diverged during training: parameter checksums per rank {checksums}")
        self.share_best(best_state, 0)

    def share_best(self, best_state: dict[str, Tensor], best_epoch: int) -> int:
        """Broadcast rank 0's best state into ``best_state`` on every rank, in place (same shapes), and its best epoch
        (returned): one broadcast per state tensor and one of the epoch."""
        for value in best_state.values():
            dist.broadcast(value, src=0)
        epoch = torch.tensor([best_epoch], dtype=torch.int64)
        dist.broadcast(epoch, src=0)
        return int(epoch.item())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group() -> bool:
    """Initialise the gloo process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), or a single-process group without it; ``True`` when this call initialised it."""
    if dist.is_initialized():
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return True


def train_distributed(
    model: torch.nn.Module, train: Any, val: Any, config: TrainConfig, *, callbacks: Iterable[Callback] = ()
) -> TrainResult | None:
    """Train ``model`` data-parallel over the processes of a ``torchrun`` launch (see the module's docstring).

    Initialises the gloo process group when it is not (from torchrun's environment, or as a single process
    without it) and destroys it at the end if it initialised it. Every rank must call this with the same data and
    config; the model's initial parameters are taken from rank 0 (DDP broadcasts them).

    :param model: Maps ``(inputs, mask=mask)`` to logits and has ``kl_divergence()``
        (e.g. :class:`~gpattn.models.Transformer`).
    :param train: Training set (as for :func:`~gpattn.training.train_model`).
    :param val: Validation set (evaluated on rank 0 only).
    :param config: The settings; ``batch_size`` is per rank, ``checkpoint_dir`` is ignored.
    :param callbacks: :class:`~gpattn.training.Callback` s, told about the run on rank 0.
    :return: The :class:`~gpattn.training.TrainResult` on rank 0, ``None`` on the other ranks. Every rank's
        model holds the best state (of rank 0's validation) in eval mode.
    :raises TrainingDivergedError: On every rank (``NonFiniteLossError`` is the same class), when a loss or a forward
        pass on some rank, the gradient norm, a parameter or the validation is not finite; every rank's model then
        holds rank 0's best state so far (the initial one before the first validation), in eval mode, and the error's
        ``best_epoch`` is its epoch.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(config).__name__}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if config.checkpoint_dir is not None:
        warnings.warn("train_distributed ignores config.checkpoint_dir (no checkpoints)", stacklevel=2)
        config = replace(config, checkpoint_dir=None)
    owns_group = _init_process_group()
    try:
        strategy = DataParallelStrategy()
        result = train_model(model, train, val, config, strategy=strategy, callbacks=callbacks)
        dist.barrier()
        return result if strategy.is_main else None
    finally:
        if owns_group:
            dist.destroy_process_group()


# -- command line ----------------------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    """``python -m gpattn.training.distributed --attention kep_svgp --epochs 2 --out DIR`` (under ``torchrun``):
    trains a tiny Transformer on a pointer task; rank 0 writes ``DIR/result.json`` and every rank its checksum
    ``DIR/rank<r>.json``."""
    parser = argparse.ArgumentParser(
        prog="python -m gpattn.training.distributed",
        description="Data-parallel training (DistributedDataParallel over gloo) of a tiny Transformer on a pointer "
        "task. Start it under torchrun, e.g. torchrun --standalone --nproc_per_node 2 -m "
        "gpattn.training.distributed --out DIR. Rank 0 writes DIR/result.json (history, best epoch, final "
        "validation accuracy) and every rank its parameter checksum DIR/rank<r>.json.",
    )
    positive = _positive_int
    parser.add_argument("--attention", choices=attention_names(), default="kep_svgp", help="default: %(default)s")
    parser.add_argument("--epochs", type=positive, default=2, help="default: %(default)s")
    parser.add_argument(
        "--batch-size", type=positive, default=32, help="sequences per rank and step (default: %(default)s)"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--eval-samples", type=positive, default=2, help="Monte Carlo samples at validation (default: %(default)s)"
    )
    parser.add_argument("--threads", type=positive, default=1, help="torch threads per rank (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    length, vocab = 6, 6
    data = make_pointer_task(512, 128, 128, length=length, seed=0, vocab_size=vocab)
    torch.manual_seed(args.seed)
    model = Transformer(
        2,
        embed_dim=16,
        depth=1,
        num_heads=2,
        attention=args.attention,
        vocab_size=vocab,
        max_len=length,
        **select_arguments(args.attention, num_inducing=4),
    )
    config = TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_epochs=1,
        eval_samples=args.eval_samples,
        seed=args.seed,
        progress=False,
    )
    owns_group = _init_process_group()
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        result = train_distributed(model, data.train, data.val, config)
        checksum = parameter_checksum(model)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "checksum": checksum}))
        if result is not None:
            payload = {
                "attention": args.attention,
                "world_size": world_size,
                "config": {key: value for key, value in asdict(config).items() if key != "checkpoint_dir"},
                "history": result.history,
                "best_epoch": result.best_epoch,
                "best_val_nll": result.best_val_nll,
                "final_val_accuracy": result.history[-1]["val_accuracy"],
                "checksum": checksum,
            }
            (args.out / "result.json").write_text(json.dumps(payload, indent=2))
        dist.barrier()
    finally:
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
