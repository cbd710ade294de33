"""Data-parallel training (gpattn.training.distributed): two gloo processes under torchrun, and one in-process."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpattn.data import make_pointer_task
from gpattn.models import Transformer
from gpattn.training import TrainConfig, train_model
from gpattn.training.distributed import (
    DataParallelStrategy,
    parameter_checksum,
    shard_indices,
    train_distributed,
)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this build of PyTorch",
)


def _torchrun(attention: str, out) -> subprocess.CompletedProcess:
    return _launch(["-m", "gpattn.training.distributed", "--attention", attention, "--epochs", "2", "--out", str(out)])


def _launch(program: list[str]) -> subprocess.CompletedProcess:
    """``program`` (a script or ``-m module`` and its arguments) started by torchrun on two ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *program]
    # A worker process aborted now and then (SIGABRT, "terminate called without an active exception", within two
    # seconds of the launch, before gpattn's imports had finished) while the full suite loaded the 2-core machine,
    # e.g. beside the Ray tests: a launch whose worker died of that signal is made again, at most twice. Any other
    # failure (an exception, a wrong result) fails at once.
    for _ in range(3):
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        aborted = "(SIGABRT)" in completed.stderr and "terminate called without an active exception" in completed.stderr
        if completed.returncode == 0 or not aborted:
            break
        warnings.warn(f"a torchrun worker aborted; launching again:\n{completed.stderr[-1500:]}", stacklevel=2)
        time.sleep(2.0)
    return completed


@pytest.fixture(scope="module", params=["kep_svgp", "softmax"])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ddp_{request.param}")
    return _torchrun(request.param, out), out


def test_torchrun_two_ranks(launched):
    completed, out = launched
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2
    history = result["history"]
    assert [record["epoch"] for record in history] == [1, 2]
    assert history[-1]["loss"] < history[0]["loss"]
    assert math.isfinite(result["final_val_accuracy"]) and 0.0 <= result["final_val_accuracy"] <= 1.0
    assert math.isfinite(result["checksum"])


def test_ranks_end_with_identical_parameters(launched):
    completed, out = launched
    assert completed.returncode == 0, completed.stderr[-3000:]
    checksums = [json.loads((out / f"rank{rank}.json").read_text())["checksum"] for rank in range(2)]
    assert checksums[0] == checksums[1]
    assert checksums[0] == json.loads((out / "result.json").read_text())["checksum"]


def test_a_divergence_leaves_every_rank_with_rank_0s_best_state(tmp_path):
    """Two ranks diverge in the first step of epoch 2 (a NaN loss on both; a forward pass that overflows on rank 1
    only): every rank's model holds rank 0's state after epoch 1 (the best one), bit for bit, as an uninterrupted
    one-epoch run of the same schedule ends with it, and every rank's error names epoch 1. Before, rank 1 kept its
    initial parameters and named epoch 0."""
    script = Path(__file__).with_name("ddp_divergence.py")
    completed = _launch([str(script), str(tmp_path)])
    assert completed.returncode == 0, f"torchrun failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    where = "epoch 2, step 1/3 (global step 4)"
    expected_messages = {
        ("nan_loss", 0): f"training diverged: non-finite training loss at {where}: nll=nan",
        ("nan_loss", 1): f"training diverged: non-finite training loss at {where}: nll=nan",
        ("overflow_on_rank_1", 0): f"training diverged: non-finite training loss or forward pass on another process "
        f"at {where}; the model now holds the state of epoch 1",
        ("overflow_on_rank_1", 1): f"training diverged: non-finite values in the forward pass at {where} "
        "(SimulatedLayer: NaN or Inf in the activations)",
    }
    for rank, report in enumerate(reports):
        assert report["reference_checksum"] == reports[0]["reference_checksum"] != report["initial_checksum"]
        for case in ("nan_loss", "overflow_on_rank_1"):
            outcome = report[case]
            assert outcome["diverged"] and outcome["epoch"] == 2 and outcome["best_epoch"] == 1, (rank, case, outcome)
            assert outcome["message"].startswith(expected_messages[case, rank]), (rank, case, outcome["message"])
            assert "the model now holds the state of epoch 1" in outcome["message"]
            assert outcome["holds_reference"], (rank, case)
            assert outcome["checksum"] == report["reference_checksum"] and outcome["training"] is False


def test_shards_are_disjoint_and_padded():
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    shards = [shard_indices(order, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(10))
    odd = [shard_indices(order[:9], rank, 2) for rank in range(2)]
    assert [len(shard) for shard in odd] == [5, 5]  # padded with the permutation's first index
    assert set(torch.cat(odd).tolist()) == set(order[:9].tolist())
    with pytest.raises(ValueError, match="rank"):
        shard_indices(order, 2, 2)


def test_single_process_matches_train_model():
    """Without torchrun's environment a one-process group is used, and the run equals train_model's bit for bit."""
    data = make_pointer_task(128, 32, 32, length=6, seed=0, vocab_size=6)
    torch.manual_seed(0)
    reference = Transformer(
        2, embed_dim=16, depth=1, num_heads=2, attention="kep_svgp", vocab_size=6, max_len=6, num_inducing=4
    )
    model = copy.deepcopy(reference)
    config = TrainConfig(epochs=2, batch_size=32, lr=1e-2, eval_samples=2, progress=False)
    expected = train_model(reference, data.train, data.val, config)
    result = train_distributed(model, data.train, data.val, config)
    assert not dist.is_initialized()  # the group it created is destroyed

    def strip(history):
        return [{key: value for key, value in record.items() if key != "seconds"} for record in history]

    assert strip(result.history) == strip(expected.history)
    assert result.best_epoch == expected.best_epoch
    assert parameter_checksum(model) == parameter_checksum(reference)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_strategy_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised process group"):
        DataParallelStrategy()
