"""Data-parallel runs that diverge, started by ``test_distributed.py`` under torchrun with two ranks: what each rank's
model holds afterwards. Usage: ``torchrun --standalone --nproc_per_node 2 ddp_divergence.py OUT``; every rank writes
``OUT/rank<r>.json``.

The reference is rank 0's state after epoch 1, from a data-parallel run of one epoch with the same settings (the same
schedule horizon, so the same rates): the best state the diverged runs must end with, on every rank. Two divergences
in the first step of epoch 2: a NaN loss on both ranks, and a forward pass that overflows on rank 1 only.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from gpattn.data import make_pointer_task
from gpattn.models import Transformer
from gpattn.training import TrainConfig, TrainingDivergedError
from gpattn.training.distributed import _init_process_group, parameter_checksum, train_distributed

#: 96 training sequences, 48 a rank, batches of 16: three steps an epoch; the fourth training pass is epoch 2, step 1
STEPS_PER_EPOCH = 3


def _diverge(model: torch.nn.Module, case: str, rank: int) -> None:
    """Make the first step of epoch 2 diverge: ``"nan_loss"`` on every rank, ``"overflow_on_rank_1"`` a layer's
    ``NaN or Inf`` error (what an overflowing attention layer raises) on rank 1 only."""
    passes = [0]

    def hook(module, args, output):
        if not module.training:
            return output
        passes[0] += 1
        if passes[0] == STEPS_PER_EPOCH + 1:
            if case == "nan_loss":
                return output * math.nan
            if rank == 1:
                raise ValueError("SimulatedLayer: NaN or Inf in the activations")
        return output

    model.head.register_forward_hook(hook)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    _init_process_group()
    rank = dist.get_rank()
    data = make_pointer_task(96, 40, 40, length=6, seed=0, vocab_size=6)
    config = TrainConfig(epochs=3, batch_size=16, lr=1e-2, warmup_epochs=1, eval_samples=2, progress=False)
    torch.manual_seed(0)
    initial = Transformer(2, embed_dim=16, depth=1, num_heads=2, attention="softmax", vocab_size=6, max_len=6)
    reference = copy.deepcopy(initial)
    train_distributed(reference, data.train, data.val, replace(config, epochs=1, schedule_epochs=3))
    expected = reference.state_dict()
    report = {"reference_checksum": parameter_checksum(reference), "initial_checksum": parameter_checksum(initial)}
    for case in ("nan_loss", "overflow_on_rank_1"):
        model = copy.deepcopy(initial)
        _diverge(model, case, rank)
        try:
            train_distributed(model, data.train, data.val, config)
            caught = None
        except TrainingDivergedError as error:
            caught = error
        state = model.state_dict()
        report[case] = {
            "diverged": caught is not None,
            "epoch": None if caught is None else caught.epoch,
            "best_epoch": None if caught is None else caught.best_epoch,
            "message": None if caught is None else str(caught),
            "holds_reference": all(torch.equal(state[name], value) for name, value in expected.items()),
            "checksum": parameter_checksum(model),
            "training": model.training,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
