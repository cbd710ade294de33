r"""Data-parallel training over several processes (``torch.distributed``, gloo backend, ``DistributedDataParallel``).

Launch with ``torchrun --standalone --nproc_per_node K -m gpattn.experiments.distributed --out DIR`` (or call
:func:`train_distributed` from a script started by ``torchrun``). Each process (rank :math:`r` of :math:`K`):

* draws the same permutation of the training set every epoch (a local ``torch.Generator`` seeded with
  ``config.seed``), pads it to a multiple of :math:`K` by repeating its first indices (as
  ``DistributedSampler`` does, so that every rank takes the same number of steps) and takes ``order[r::K]``;
* splits its shard into minibatches of ``config.batch_size`` sequences (``batch_size`` is **per rank**: an
  optimiser step sees :math:`K` ``batch_size`` sequences), so an epoch has ``ceil(ceil(n / K) / batch_size)`` steps;
* minimises :class:`~gpattn.mlls.AttentionELBO` with ``num_data = len(train)``; DDP averages the gradients over the
  ranks, i.e. the gradient of the mean cross-entropy over the global batch plus :math:`\beta / n` KL (identical on
  every rank) plus the mean of the ranks' KSVD terms;
* uses AdamW, gradient clipping and the warm-up + cosine schedule of :func:`~gpattn.experiments.train_model`
  (gradients are all-reduced before clipping, so every rank clips identically and the replicas never diverge).

The global torch RNG (reparameterisation noise, dropout) is seeded with ``config.seed + r``, so the ranks draw
independent Monte Carlo samples. Rank 0 evaluates on ``val`` after every epoch and keeps the state with the lowest
validation NLL; at the end the ranks check that their replicas still agree (parameter checksums, else
``RuntimeError``) and rank 0's best state is broadcast so that every rank holds the same parameters, and rank 0 returns
the :class:`~gpattn.experiments.TrainResult` (the other ranks ``None``). Checkpoints and resumption are not
supported (``config.checkpoint_dir`` is ignored with a warning).

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
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ..mlls import AttentionELBO
from .training import (
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    _batch,
    _inputs,
    _labels,
    _metrics,
    _state_copy,
    evaluate,
    warmup_cosine_schedule,
)

__all__ = ["parameter_checksum", "shard_indices", "train_distributed"]

_PARTS = ("loss", "nll", "kl", "ksvd", "grad_norm")


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


def _device(config: TrainConfig) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"config.device={config.device!r} but CUDA is not available; use device='cpu'")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", device.index or 0)))
    return device


def train_distributed(model: torch.nn.Module, train: Any, val: Any, config: TrainConfig) -> TrainResult | None:
    """Train ``model`` data-parallel over the processes of a ``torchrun`` launch (see the module's docstring).

    Initialises the gloo process group when it is not (from torchrun's environment, or as a single process
    without it) and destroys it at the end if it initialised it. Every rank must call this with the same data and
    config; the model's initial parameters are taken from rank 0 (DDP broadcasts them).

    :param model: Maps ``(inputs, mask=mask)`` to logits and has ``kl_divergence()``
        (e.g. :class:`~gpattn.models.Transformer`).
    :param train: Training set (as for :func:`~gpattn.experiments.train_model`).
    :param val: Validation set (evaluated on rank 0 only).
    :param config: The settings; ``batch_size`` is per rank, ``checkpoint_dir`` is ignored.
    :return: The :class:`~gpattn.experiments.TrainResult` on rank 0, ``None`` on the other ranks. Every rank's
        model holds the best state (of rank 0's validation) in eval mode.
    :raises NonFiniteLossError: On every rank, when a loss on some rank or the gradient norm is not finite.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"expected a TrainConfig, got {type(config).__name__}")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if config.checkpoint_dir is not None:
        warnings.warn("train_distributed ignores config.checkpoint_dir (no checkpoints)", stacklevel=2)
    train_inputs, train_mask = _inputs(train)
    train_labels = _labels(train)
    val_labels = _labels(val)
    device = _device(config)
    owns_group = _init_process_group()
    try:
        return _train(model, train_inputs, train_mask, train_labels, val, val_labels, config, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _train(model, train_inputs, train_mask, train_labels, val, val_labels, config, device) -> TrainResult | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model.to(device)
    # every parameter gets a gradient in every step (through the logits or the KL / KSVD terms): see the docstring
    ddp = DistributedDataParallel(model, find_unused_parameters=False)
    num_data = train_labels.shape[0]
    shard_size = math.ceil(num_data / world_size)
    steps_per_epoch = math.ceil(shard_size / config.batch_size)
    total_steps, warmup_steps = config.schedule_steps(steps_per_epoch)
    loss_fn = AttentionELBO(model, num_data=num_data, beta=config.beta, combine_terms=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = warmup_cosine_schedule(optimizer, total_steps, warmup_steps, config.min_lr)
    generator = torch.Generator().manual_seed(config.seed)  # the same batch order on every rank
    torch.manual_seed(config.seed + rank)  # independent noise per rank
    result = TrainResult()
    best_state = _state_copy(model)
    max_norm = math.inf if config.grad_clip is None else config.grad_clip

    for epoch in range(1, config.epochs + 1):
        started = time.perf_counter()
        model.train()
        totals = torch.zeros(len(_PARTS) + 1, dtype=torch.float64)  # weighted parts and the sequence count
        shard = shard_indices(torch.randperm(num_data, generator=generator), rank, world_size)
        for step in range(steps_per_epoch):
            index = shard[step * config.batch_size : (step + 1) * config.batch_size]
            inputs, mask = _batch(train_inputs, train_mask, index, device)
            labels = train_labels[index].to(device)
            parts = loss_fn(ddp(inputs, mask=mask), labels)
            optimizer.zero_grad(set_to_none=True)
            parts["loss"].backward()  # DDP averages the gradients over the ranks here
            # a non-finite loss on any rank stops every rank (raising on one rank alone would hang the others)
            bad = torch.tensor([0.0 if torch.isfinite(parts["loss"]) else 1.0])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if bad.item() or not torch.isfinite(grad_norm):
                model.load_state_dict(best_state)
                model.eval()
                raise NonFiniteLossError(
                    f"non-finite training loss or gradient norm (rank {rank}: loss {parts['loss'].item():.6g}, "
                    f"grad norm {grad_norm.item():.6g}) at epoch {epoch}, step {step + 1}/{steps_per_epoch}; the "
                    f"model now holds the state of epoch {result.best_epoch}"
                )
            optimizer.step()
            last_lr = scheduler.get_last_lr()[0]
            scheduler.step()
            size = index.shape[0]
            values = [parts[name].item() for name in _PARTS[:-1]] + [grad_norm.item()]
            totals += torch.tensor([value * size for value in values] + [size], dtype=torch.float64)
        dist.all_reduce(totals)  # sums over the ranks
        if rank == 0:
            probabilities = evaluate(model, val, config.eval_samples, config.eval_batch_size)
            val_accuracy, val_nll = _metrics(probabilities, val_labels)
            record = {"epoch": epoch, **{name: (totals[i] / totals[-1]).item() for i, name in enumerate(_PARTS)}}
            record.update(val_accuracy=val_accuracy, val_nll=val_nll, lr=last_lr, seconds=time.perf_counter() - started)
            result.history.append(record)
            if val_nll < result.best_val_nll:
                result.best_epoch, result.best_val_nll = epoch, val_nll
                best_state = _state_copy(model)

    # the replicas must still agree (DDP keeps them in sync); a mismatch means a rank trained on different gradients
    checksums = [None] * world_size
    dist.all_gather_object(checksums, parameter_checksum(model))
    if any(not math.isclose(value, checksums[0], rel_tol=1e-9, abs_tol=1e-9) for value in checksums):
        raise RuntimeError(f"the DDP replicas diverged during training: parameter checksums per rank {checksums}")
    # rank 0's best state to every rank
    for value in best_state.values():
        dist.broadcast(value, src=0)
    model.load_state_dict(best_state)
    model.eval()
    dist.barrier()
    return result if rank == 0 else None


# -- command line ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """``python -m gpattn.experiments.distributed --attention kep_svgp --epochs 2 --out DIR`` (under ``torchrun``):
    trains a tiny Transformer on a pointer task; rank 0 writes ``DIR/result.json`` and every rank its checksum
    ``DIR/rank<r>.json``."""
    from ..attention import attention_arguments
    from ..data import make_pointer_task
    from ..models import Transformer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--attention", default="kep_svgp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    length, vocab = 6, 6
    data = make_pointer_task(512, 128, 128, length=length, seed=0, vocab_size=vocab)
    torch.manual_seed(args.seed)
    sizes = {"rank": 4} if "rank" in attention_arguments(args.attention) else {}
    model = Transformer(
        2, embed_dim=16, depth=1, num_heads=2, attention=args.attention, vocab_size=vocab, max_len=length, **sizes
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
