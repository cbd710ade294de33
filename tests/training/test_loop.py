"""The training loop: learning, determinism, bitwise resume (every attention), scheduled rates, clipping, checkpoints,
failures, model selection on the reported NLL, and the strategy hooks that data-parallel training plugs in."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpattn.attention import attention_names
from gpattn.data import make_pointer_task
from gpattn.metrics import accuracy, negative_log_likelihood
from gpattn.models import Transformer
from gpattn.training import (
    CHECKPOINT_KEYS,
    Callback,
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    TrainingDivergedError,
    TrainingStrategy,
    evaluate,
    load_checkpoint,
    train_model,
)


@pytest.fixture(scope="module")
def masked_data():
    # variable lengths: the padding mask travels through every path
    return make_pointer_task(128, 32, 32, length=6, seed=0, vocab_size=6, min_length=4)


def _without_time(history):
    return [{key: value for key, value in record.items() if key != "seconds"} for record in history]


def _assert_same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> None:
    one, two = first.state_dict(), second.state_dict()
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


# -- configuration ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {"epochs": 0},
        {"batch_size": 1.5},
        {"lr": 0.0},
        {"min_lr": 1.0, "lr": 0.1},
        {"grad_clip": -1.0},
        {"eval_samples": 0},
        {"device": "tpu"},
        {"warmup_steps": -1},
        {"beta": math.nan},
        {"seed": 2**64},  # beyond torch.manual_seed's 64-bit range: refused here, not at the first epoch
    ],
)
def test_config_rejects_bad_values(overrides):
    with pytest.raises(ValueError, match="expected"):
        TrainConfig(**overrides)


def test_numpy_settings_are_stored_as_python_numbers_and_their_checkpoints_resume(
    data, tmp_path, small_model, small_config
):
    # numpy.float64 subclasses float and numpy.int64 passes the integer check: stored as such, every checkpoint was
    # unreadable with weights_only=True (float64) or its writing failed ("cannot checksum a int64")
    np = pytest.importorskip("numpy")
    settings = dict(
        batch_size=np.int64(64),
        lr=np.float64(1e-2),
        min_lr=np.float32(0.0),
        weight_decay=np.float64(0.01),
        warmup_epochs=np.float64(1.0),
        grad_clip=np.float64(1.0),
        beta=np.float32(1.0),
        eval_samples=np.int32(2),
        eval_batch_size=np.int64(64),
        seed=np.int64(3),
        schedule_epochs=np.int64(2),
        patience=np.int16(5),
    )
    config = small_config(epochs=np.int64(1), checkpoint_dir=tmp_path, **settings)
    values = config.to_dict()
    for name in [*settings, "epochs"]:
        expected = int if isinstance(settings.get(name, np.int64(1)), np.integer) else float
        assert type(values[name]) is expected and type(getattr(config, name)) is expected, name
    assert values["lr"] == 1e-2 and values["seed"] == 3
    train_model(small_model(), data.train, data.val, config)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 1
    resumed = train_model(
        small_model(), data.train, data.val, small_config(epochs=np.int64(2), checkpoint_dir=tmp_path, **settings), True
    )
    assert [record["epoch"] for record in resumed.history] == [1, 2]
    assert load_checkpoint(tmp_path / "last.pt")["config"]["lr"] == 1e-2


def test_an_empty_checkpoint_dir_is_refused(tmp_path, monkeypatch, small_config):
    # Path("") is the current directory: best.pt and last.pt landed wherever the run was started
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^TrainConfig: expected checkpoint_dir to be a folder or None, got the emp"):
        small_config(checkpoint_dir="")
    assert small_config(checkpoint_dir=".").checkpoint_dir == "."  # the current directory, said explicitly
    assert list(tmp_path.iterdir()) == []


def test_a_schedule_shorter_than_the_run_needs_a_floor(data, small_model, small_config):
    # with min_lr=0 the epochs past the horizon trained at learning rate 0, changing nothing
    match = r"^TrainConfig: schedule_epochs=2 is below epochs=3 with min_lr=0: .* epochs 3\.\.3 would not change"
    with pytest.raises(ValueError, match=match):
        small_config(epochs=3, schedule_epochs=2)
    # with a floor, they train at min_lr (the cosine ends there and stays)
    result = train_model(small_model(), data.train, data.val, small_config(epochs=3, schedule_epochs=2, min_lr=1e-3))
    lrs = [record["lr"] for record in result.history]
    assert lrs[1] > 1e-3 and lrs[2] == pytest.approx(1e-3, rel=1e-12)


# -- learning and determinism ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_loss_decreases_and_beats_chance(data, attention, small_model, small_config):
    model = small_model(attention)
    config = small_config(epochs=6, batch_size=16, lr=3e-2, weight_decay=0.0, eval_samples=4)
    result = train_model(model, data.train, data.val, config)
    losses = [record["loss"] for record in result.history]
    assert losses[-1] < 0.7 * losses[0], losses
    assert max(record["val_accuracy"] for record in result.history) > 0.75, result.history
    assert result.best_val_nll == min(record["val_nll"] for record in result.history)
    assert result.history[result.best_epoch - 1]["val_nll"] == result.best_val_nll
    assert not model.training
    accuracy = (evaluate(model, data.test, num_samples=4).argmax(-1) == data.test.labels).double().mean().item()
    assert accuracy > 0.7


def test_same_seed_gives_identical_runs(data, small_model, small_config):
    first, second, other = small_model(), small_model(), small_model()
    one = train_model(first, data.train, data.val, small_config())
    two = train_model(second, data.train, data.val, small_config())
    three = train_model(other, data.train, data.val, small_config(seed=1))
    assert _without_time(one.history) == _without_time(two.history)
    _assert_same_parameters(first, second)
    assert _without_time(one.history) != _without_time(three.history)


def test_image_datasets_without_mask_are_supported(small_config):
    @dataclass
    class Images:
        images: torch.Tensor
        labels: torch.Tensor

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(32, 1, 4, 4, generator=generator)
    dataset = Images(images, (images.mean(dim=(1, 2, 3)) > 0).long())
    torch.manual_seed(0)
    model = Transformer(
        2,
        embed_dim=16,
        depth=1,
        num_heads=2,
        input="patches",
        image_size=4,
        patch_size=2,
        in_channels=1,
        num_inducing=4,
    )
    result = train_model(model, dataset, dataset, small_config(epochs=1, batch_size=8))
    assert len(result.history) == 1 and math.isfinite(result.history[0]["val_nll"])
    assert evaluate(model, dataset, num_samples=2, batch_size=5).shape == (32, 2)


# -- resume ----------------------------------------------------------------------------------------------------------
def test_staged_run_resumes_bitwise(data, tmp_path, small_model, small_config):
    reference = small_model(depth=2)
    staged = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, small_config(epochs=4, checkpoint_dir=tmp_path / "full"))

    train_model(
        staged, data.train, data.val, small_config(epochs=2, schedule_epochs=4, checkpoint_dir=tmp_path / "staged")
    )
    resumed = train_model(
        staged, data.train, data.val, small_config(epochs=4, checkpoint_dir=tmp_path / "staged"), True
    )

    assert _without_time(resumed.history) == _without_time(full.history)
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    _assert_same_parameters(staged, reference)  # the best states
    last = [torch.load(tmp_path / run / "last.pt", weights_only=True)["model"] for run in ("full", "staged")]
    assert all(torch.equal(last[0][name], last[1][name]) for name in last[0])


def test_interrupted_run_resumes_bitwise(data, tmp_path, faulty_elbo, small_model, small_config):
    config = small_config(epochs=4, checkpoint_dir=tmp_path)
    reference = small_model()
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, small_config(epochs=4))

    faulty_elbo.interrupt_at = 10  # 4 steps per epoch: during epoch 3
    with pytest.raises(KeyboardInterrupt):
        train_model(interrupted, data.train, data.val, config)
    faulty_elbo.interrupt_at = None
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 2

    resumed = train_model(interrupted, data.train, data.val, config, resume=True)
    assert _without_time(resumed.history) == _without_time(full.history)
    _assert_same_parameters(interrupted, reference)


def _assert_equal_nested(first, second, where: str = "") -> None:
    """Bitwise equality of nested dicts / lists of tensors and plain values (optimiser and checkpoint states)."""
    if isinstance(first, Tensor):
        assert isinstance(second, Tensor) and first.dtype == second.dtype and torch.equal(first, second), where
    elif isinstance(first, dict):
        assert isinstance(second, dict) and first.keys() == second.keys(), where
        for key in first:
            _assert_equal_nested(first[key], second[key], f"{where}/{key}")
    elif isinstance(first, (list, tuple)):
        assert isinstance(second, (list, tuple)) and len(first) == len(second), where
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            _assert_equal_nested(a, b, f"{where}[{index}]")
    elif isinstance(first, float) and math.isnan(first):
        assert isinstance(second, float) and math.isnan(second), where
    else:
        assert first == second, where


@pytest.mark.parametrize("name", attention_names())
def test_interrupted_run_resumes_bit_identically(make_transformer, masked_data, name, tmp_path, faulty_elbo):
    data = masked_data
    settings = dict(epochs=3, batch_size=48, lr=1e-2, warmup_epochs=1, eval_samples=2, progress=False)
    reference = make_transformer(name)
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, TrainConfig(**settings, checkpoint_dir=tmp_path / "full"))

    # 3 steps per epoch: the 8th loss is the second step of epoch 3, after two checkpoints
    faulty_elbo.interrupt_at = 8
    config = TrainConfig(**settings, checkpoint_dir=tmp_path / "staged")
    with pytest.raises(KeyboardInterrupt):
        train_model(interrupted, data.train, data.val, config)
    faulty_elbo.interrupt_at = None
    assert load_checkpoint(tmp_path / "staged" / "last.pt")["epoch"] == 2
    resumed = train_model(interrupted, data.train, data.val, config, resume=True)

    # metrics, selection and the final (best) parameters
    assert _without_time(resumed.history) == _without_time(full.history)
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    _assert_equal_nested(interrupted.state_dict(), reference.state_dict(), "best state")
    # the last state, the optimiser moments, the schedule and the RNG streams
    last = [load_checkpoint(tmp_path / run / "last.pt") for run in ("full", "staged")]
    for key in ("model", "optimizer", "scheduler", "rng", "epoch", "best_epoch", "best_val_nll"):
        _assert_equal_nested(last[0][key], last[1][key], key)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"seed": 1}, r"seed \(0 in the checkpoint, 1 now\)"),
        ({"lr": 1e-3}, r"lr \(0\.01 in the checkpoint, 0\.001 now\)"),
        ({"batch_size": 32}, r"batch_size \(64 in the checkpoint, 32 now\)"),
        ({"epochs": 3}, r"the schedule horizon \(2 epochs in the checkpoint, 3 now; set schedule_epochs=2"),
        ({"epochs": 1, "schedule_epochs": 2}, r"epochs \(1 now, but the checkpoint already holds epoch 2\)"),
    ],
    ids=["seed", "lr", "batch_size", "horizon", "fewer_epochs"],
)
def test_resuming_with_other_settings_is_an_error(data, tmp_path, small_model, small_config, changes, match):
    # the record of a resumed run would claim settings that did not train the model: refuse, naming what differs
    model = small_model()
    train_model(model, data.train, data.val, small_config(epochs=2, min_lr=1e-4, checkpoint_dir=tmp_path))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    config = small_config(**{"epochs": 2, "min_lr": 1e-4, "checkpoint_dir": tmp_path, **changes})
    with pytest.raises(CheckpointError, match=r"cannot resume from .*last\.pt with other settings.*" + match):
        train_model(model, data.train, data.val, config, resume=True)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    # what may change without a warning: the total (with the same horizon: past it, the run trains at min_lr > 0)
    # and the progress bar (the evaluation batch size warns: test_resuming_with_another_evaluation_batch_size_warns)
    same = small_config(epochs=3, schedule_epochs=2, min_lr=1e-4, progress=True, checkpoint_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train_model(model, data.train, data.val, same, resume=True)
    assert [record["epoch"] for record in result.history] == [1, 2, 3]


def test_resuming_with_another_evaluation_batch_size_warns(data, tmp_path, small_model, small_config):
    # the validation's Monte Carlo samples are drawn batch by batch: another evaluation batch size records other
    # validation numbers (and may select another best epoch) than the uninterrupted run, though it trains the same
    reference = small_model()
    uninterrupted = train_model(reference, data.train, data.val, small_config(eval_batch_size=16))
    model = small_model()
    staged = small_config(epochs=1, schedule_epochs=2, eval_batch_size=16, checkpoint_dir=tmp_path)
    train_model(model, data.train, data.val, staged)
    match = (
        r"resuming from .*last\.pt with changed settings, so the run will not match an uninterrupted one: "
        r"eval_batch_size \(16 -> 64: the Monte Carlo samples of the validation are drawn batch by batch, so the "
        r"recorded validation metrics and the best epoch may differ\)$"
    )
    with pytest.warns(UserWarning, match=match):
        resumed = train_model(
            model, data.train, data.val, small_config(eval_batch_size=64, checkpoint_dir=tmp_path), resume=True
        )
    first, second = _without_time(uninterrupted.history), _without_time(resumed.history)
    assert first[0] == second[0]  # the epoch trained before the interruption
    assert first[1]["loss"] == second[1]["loss"]  # the training numbers of epoch 2 are the same
    assert first[1]["val_nll"] != second[1]["val_nll"]  # its validation was sampled otherwise


def test_extending_a_run_whose_schedule_ended_at_zero_says_to_train_again(data, tmp_path, small_model, small_config):
    # the advice was "set schedule_epochs=1 to continue the same schedule": epochs at learning rate 0
    model = small_model()
    train_model(model, data.train, data.val, small_config(epochs=1, checkpoint_dir=tmp_path))
    match = (
        r"the schedule horizon \(1 epochs in the checkpoint, 2 now; its schedule ended at learning rate 0 \(min_lr=0\) "
        r"after epoch 1, so later epochs would not train; for a longer run train from scratch with resume=False"
    )
    with pytest.raises(CheckpointError, match=match) as caught:
        train_model(model, data.train, data.val, small_config(epochs=2, checkpoint_dir=tmp_path), resume=True)
    assert "set schedule_epochs=1" not in str(caught.value)
    with pytest.raises(ValueError, match="schedule_epochs=1 is below epochs=2 with min_lr=0"):
        small_config(epochs=2, schedule_epochs=1)


def test_resume_errors_name_the_problem(data, tmp_path, small_model, small_config):
    model = small_model()
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_model(model, data.train, data.val, small_config(), resume=True)
    with pytest.raises(FileNotFoundError, match="last.pt"):
        train_model(model, data.train, data.val, small_config(checkpoint_dir=tmp_path), resume=True)
    (tmp_path / "last.pt").write_bytes(b"\x00garbage, not a checkpoint\xff" * 10)
    with pytest.raises(RuntimeError, match="could not read the checkpoint .*last.pt"):
        train_model(model, data.train, data.val, small_config(checkpoint_dir=tmp_path), resume=True)


def test_resuming_with_another_thread_count_warns(data, tmp_path, small_model, small_config):
    # the numbers on the CPU depend on torch's thread count: the checkpoints store it, a resumed run says it changed
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        config = small_config(epochs=2, schedule_epochs=3, checkpoint_dir=tmp_path)
        train_model(small_model(), data.train, data.val, config)
        assert load_checkpoint(tmp_path / "last.pt")["config"]["threads"] == 1
        torch.set_num_threads(2)
        config = small_config(epochs=3, checkpoint_dir=tmp_path)
        match = r"changed settings, so the run will not match an uninterrupted one: threads \(1 -> 2: torch splits its"
        with pytest.warns(UserWarning, match=match):
            train_model(small_model(), data.train, data.val, config, resume=True)
    finally:
        torch.set_num_threads(previous)


def test_a_checkpoint_dir_that_is_a_file_is_a_clear_error(tmp_path, small_config):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"expected checkpoint_dir to be a folder \(created if missing\), got the exi"):
        small_config(checkpoint_dir=tmp_path / "file")


def test_a_full_disk_keeps_the_last_pair_and_says_so(data, tmp_path, small_model, small_config, monkeypatch):
    import errno
    import os

    real_fsync, calls = os.fsync, []

    def fill_up(descriptor):  # epoch 1 writes best.pt, last.pt and the manifest; epoch 2 meets a full disk
        calls.append(descriptor)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fill_up)
    with pytest.raises(OSError, match="cannot write the checkpoints of epoch 2 to .*No space left on device.*still ho"):
        train_model(small_model(), data.train, data.val, small_config(epochs=2, checkpoint_dir=tmp_path))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best.pt", "checkpoints.json", "last.pt"]
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1
    result = train_model(small_model(), data.train, data.val, small_config(epochs=2, checkpoint_dir=tmp_path), True)
    assert [record["epoch"] for record in result.history] == [1, 2]  # room again: the run goes on from epoch 1


def test_a_full_disk_in_the_first_epoch_says_to_train_again(data, tmp_path, small_model, small_config, monkeypatch):
    # the message said that the folder held no checkpoint, then to resume from it (FileNotFoundError)
    import errno
    import os

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", full)
        with pytest.raises(OSError) as caught:
            train_model(small_model(), data.train, data.val, small_config(checkpoint_dir=tmp_path))
    assert str(caught.value) == (
        f"[Errno 28] cannot write the checkpoints of epoch 1 to {tmp_path} (No space left on device); it holds no "
        "checkpoint of this run, so there is nothing to resume; make room and train again from the start "
        "(resume=False, or the same gpattn train command with --overwrite)"
    )
    assert list(tmp_path.iterdir()) == []
    # following the advice: the run from the start, the same as one that never met a full disk
    expected = train_model(small_model(), data.train, data.val, small_config())
    result = train_model(small_model(), data.train, data.val, small_config(checkpoint_dir=tmp_path))
    assert _without_time(result.history) == _without_time(expected.history)
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 2


# -- schedule and clipping -------------------------------------------------------------------------------------------
def _closed_form(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    return floor + (peak - floor) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))) / 2


def test_history_records_the_scheduled_rates(data, small_model, small_config):
    config = small_config(epochs=3, warmup_steps=3, min_lr=1e-3)  # 4 steps per epoch, 12 in all
    result = train_model(small_model(), data.train, data.val, config)
    for record in result.history:
        last_step = 4 * record["epoch"] - 1
        assert record["lr"] == pytest.approx(_closed_form(last_step, 12, 3, config.lr, config.min_lr), rel=1e-12)


def test_kl_annealing_raises_the_weight_linearly_then_holds_it(data, small_model, small_config, monkeypatch):
    """kl_anneal_epochs=1.5 with 4 steps an epoch: beta_t = beta min(1, (t + 1) / 6) at global step t; none when 0."""
    from gpattn.mlls import AttentionELBO

    seen = []
    original = AttentionELBO.forward

    def recording(self, *args, **kwargs):
        if self.training:
            seen.append(self.beta)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(AttentionELBO, "forward", recording)
    train_model(small_model(), data.train, data.val, small_config(epochs=3, beta=0.5, kl_anneal_epochs=1.5))
    assert seen == pytest.approx([0.5 * min(1.0, (step + 1) / 6) for step in range(12)], rel=1e-15)
    seen.clear()
    train_model(small_model(), data.train, data.val, small_config(epochs=1, beta=0.5))
    assert seen == [0.5] * 4
    # 2.2 epochs of 25 steps are 55 steps (2.2 * 25 = 55.00000000000001 in floats: it annealed over 56)
    seen.clear()
    few = make_pointer_task(25, 8, 8, length=6, seed=0, vocab_size=6)
    config = small_config(epochs=1, batch_size=1, beta=0.5, kl_anneal_epochs=2.2)
    train_model(small_model(), few.train, few.val, config)
    assert seen == pytest.approx([0.5 * (step + 1) / 55 for step in range(25)], rel=1e-15)


def test_gradients_are_clipped(data, small_model, small_config):
    norms = []

    def hook(optimizer, args, kwargs):
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])).item())

    handle = register_optimizer_step_pre_hook(hook)
    try:
        result = train_model(small_model(), data.train, data.val, small_config(grad_clip=0.05))
    finally:
        handle.remove()
    assert len(norms) == 8
    assert max(norms) <= 0.05 * (1 + 1e-5)
    assert min(record["grad_norm"] for record in result.history) > 0.05  # the clip was active


class _DeviceReads(TorchFunctionMode):
    """Counts the reads of tensor values into Python (each one synchronisation on a GPU) that gpattn's own code
    makes: ``(file name, function name) -> count`` (the reads of torch's code, e.g. the optimiser's CPU step
    counters, are not counted)."""

    READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__"})

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            caller = traceback.extract_stack(limit=2)[0]  # the code that calls the tensor's method (not torch's own)
            if f"{os.sep}gpattn{os.sep}" in caller.filename:
                self.counts[(os.path.basename(caller.filename), caller.name)] += 1
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_the_device_twice(data, small_model, small_config):
    # the loss parts in one read, the gradient norm and the largest parameter in another (before: eight reads, each a
    # synchronisation on a GPU), and the ELBO's target range in one; the validation makes none in the loop's code
    with _DeviceReads() as reads:
        result = train_model(small_model(), data.train, data.val, small_config())
    steps = 4 * len(result.history)
    assert sum(count for (file, _), count in reads.counts.items() if file == "loop.py") == 2 * steps
    assert reads.counts[("attention_elbo.py", "forward")] == steps


class _Operators(TorchDispatchMode):
    """Counts the operators dispatched to the kernels, but the reads of 0-dim CPU tensors into Python
    (``_local_scalar_dense``: AdamW's step counters, which launch nothing on a GPU either)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is not torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _optimiser_operators(step_of, model: torch.nn.Module) -> int:
    """The operators of one optimiser step on ``model``'s parameters with gradients of one, ``step_of(parameters)``
    making the optimiser."""
    optimizer = step_of(list(model.parameters()))
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with _Operators() as operators:
        optimizer.step()
    return operators.count


def test_the_optimiser_step_does_not_loop_over_the_parameters(data, small_model, small_config, monkeypatch):
    # AdamW's multi-tensor implementation on the CPU too: a step's operators do not grow with the number of parameter
    # tensors (torch's default there loops over them, about ten operators each, which the counter sees)
    counts = {}

    class Counted(torch.optim.AdamW):
        def step(self, closure=None):
            with _Operators() as operators:
                loss = super().step(closure)
            counts.setdefault(self.tensors, []).append(operators.count)
            return loss

        def __init__(self, params, **kwargs):
            params = list(params)
            super().__init__(params, **kwargs)
            self.tensors = len(params)

    monkeypatch.setattr(torch.optim, "AdamW", Counted)
    for depth in (1, 3):
        train_model(small_model(depth=depth), data.train, data.val, small_config(epochs=1))
    assert len(counts) == 2 and len(set(counts)) == 2  # two models with different numbers of parameter tensors
    # after the first step, which creates the moments (one tensor each)
    assert len({count for steps in counts.values() for count in steps[1:]}) == 1, counts
    # the counter sees a per-parameter loop: torch's CPU default grows with the tensors
    monkeypatch.undo()
    looped = [
        _optimiser_operators(lambda p: torch.optim.AdamW(p, foreach=False), small_model(depth=depth))
        for depth in (1, 3)
    ]
    assert looped[1] > looped[0] + 10 * (max(counts) - min(counts))


def test_a_float64_model_records_its_gradient_norms_in_float64(data, small_model, small_config):
    # the step's read of its gradient norm keeps the norm's dtype: every recorded value is the float64 norm itself
    norms, recorded = [], []

    def hook(optimizer, args, kwargs):
        gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gradients, 2.0))).item())

    class Steps(Callback):
        def on_step_end(self, context, epoch, step, values):
            recorded.append(values["grad_norm"])

    handle = register_optimizer_step_pre_hook(hook)
    try:
        config = small_config(grad_clip=None)  # the recorded norm is that of the gradients the optimiser steps with
        train_model(small_model().double(), data.train, data.val, config, callbacks=[Steps()])
    finally:
        handle.remove()
    assert len(recorded) == 8
    assert recorded == norms
    assert any(value != float(torch.tensor(value, dtype=torch.float32)) for value in recorded)  # not float32-rounded


def test_the_history_records_the_hyperparameter_prior_part_of_the_loss(data):
    """A GPyTorch prior registered on the SVGP attention's lengthscales enters the loss as -(1/n) sum log p(theta):
    the history records that part (it left it out, reporting a loss half made of an unnamed term). One step of the
    whole training set: the epoch's prior is that of the initial lengthscales, by torch.distributions in float64."""
    from gpytorch.kernels import RBFKernel
    from gpytorch.priors import GammaPrior

    torch.manual_seed(0)
    model = Transformer(2, embed_dim=8, num_heads=2, attention="svgp", num_inducing=3, vocab_size=6, max_len=6)
    kernels = [module for module in model.modules() if isinstance(module, RBFKernel)]
    for kernel in kernels:
        kernel.register_prior("lengthscale_prior", GammaPrior(3.0, 6.0), lambda module: module.lengthscale)
    model.double()
    gamma = torch.distributions.Gamma(torch.tensor(3.0, dtype=torch.float64), torch.tensor(6.0, dtype=torch.float64))
    expected = -sum(gamma.log_prob(kernel.lengthscale.detach()).sum() for kernel in kernels).item() / len(data.train)
    config = TrainConfig(epochs=1, batch_size=len(data.train), eval_samples=1, progress=False)
    record = train_model(model, data.train, data.val, config).history[0]
    assert record["prior"] == pytest.approx(expected, rel=1e-12) and record["prior"] > 0.1
    parts = record["nll"] + record["kl"] + record["ksvd"] + record["prior"]
    assert record["loss"] == pytest.approx(parts, rel=1e-12)


# -- checkpoints and failures ----------------------------------------------------------------------------------------
def test_checkpoints_hold_the_documented_keys(data, tmp_path, small_model, small_config):
    model = small_model()
    result = train_model(model, data.train, data.val, small_config(checkpoint_dir=tmp_path))
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    for checkpoint in (last, best):
        assert set(checkpoint) == set(CHECKPOINT_KEYS)
        assert set(checkpoint["rng"]) == {"torch", "batch_generator", "cuda"}
        assert checkpoint["rng"]["cuda"] is None
    assert last["epoch"] == 2 and len(last["history"]) == 2
    assert best["epoch"] == result.best_epoch
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in best["model"].items())
    assert last["config"]["epochs"] == 2 and last["config"]["checkpoint_dir"] == str(tmp_path)


def test_non_finite_loss_stops_with_the_best_state(data, tmp_path, faulty_elbo, small_model, small_config):
    faulty_elbo.fail_at = 7  # epoch 2, step 3
    model = small_model()
    with pytest.raises(NonFiniteLossError, match=r"epoch 2, step 3/4.*nll=nan.*kl=.*ksvd="):
        train_model(model, data.train, data.val, small_config(epochs=3, checkpoint_dir=tmp_path))
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["epoch"] == 1
    assert not (tmp_path / "last.pt").exists() or torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 1
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, best["model"][name]), name


def _assert_holds(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_a_nan_in_restored_optimiser_moments_stops_at_that_step(data, tmp_path, small_model, small_config):
    # the first step after resuming meets a NaN in AdamW's first moment (as if restored from a bad state): the loss
    # and gradient are finite, the step makes one weight NaN; the old loop only noticed at the next forward pass
    # ("SoftmaxAttention: x contains NaN or Inf values") or at the end of the epoch
    model = small_model(depth=2)
    train_model(model, data.train, data.val, small_config(epochs=1, schedule_epochs=3, checkpoint_dir=tmp_path))
    last_bytes = (tmp_path / "last.pt").read_bytes()
    best = load_checkpoint(tmp_path / "best.pt")["model"]
    poisoned = []

    def poison(optimizer, args, kwargs):
        if not poisoned:
            next(iter(optimizer.state.values()))["exp_avg"].view(-1)[0] = math.nan
            poisoned.append(True)

    handle = register_optimizer_step_pre_hook(poison)
    try:
        with pytest.raises(TrainingDivergedError) as caught:
            train_model(model, data.train, data.val, small_config(epochs=3, checkpoint_dir=tmp_path), resume=True)
    finally:
        handle.remove()
    message = str(caught.value)
    assert message.startswith("training diverged: non-finite parameters [")
    assert "after the optimiser step at epoch 2, step 1/4 (global step 5)" in message
    assert f"{tmp_path / 'last.pt'} still holds epoch 1, the last good one" in message
    assert (caught.value.epoch, caught.value.step, caught.value.best_epoch) == (2, 1, 1)
    assert isinstance(caught.value, RuntimeError) and NonFiniteLossError is TrainingDivergedError
    _assert_holds(model, best)  # the last good (and best) state, not the NaN one
    assert (tmp_path / "last.pt").read_bytes() == last_bytes  # the last good checkpoint is untouched
    resumed = train_model(model, data.train, data.val, small_config(epochs=3, checkpoint_dir=tmp_path), resume=True)
    assert [record["epoch"] for record in resumed.history] == [1, 2, 3]  # and the run can go on from it


@pytest.mark.parametrize("attention", ["kep_svgp", "softmax"])
def test_a_huge_learning_rate_stops_with_the_initial_state(data, tmp_path, small_model, small_config, attention):
    model = small_model(attention)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    config = small_config(lr=1e6, grad_clip=None, warmup_epochs=0, checkpoint_dir=tmp_path)
    match = r"^training diverged: non-finite .* at epoch 1, step 2/4"
    with pytest.raises(TrainingDivergedError, match=match) as caught:
        train_model(model, data.train, data.val, config)
    assert caught.value.best_epoch == 0 and "no checkpoint of this run was written" in str(caught.value)
    _assert_holds(model, initial)
    assert not (tmp_path / "last.pt").exists()


def test_an_overflowing_forward_pass_is_divergence_but_bad_data_is_not(data, small_model, small_config):
    # finite parameters whose activations overflow: a layer's "NaN or Inf" input check fires inside the forward pass
    model = small_model()
    calls = []

    def overflow(module, args):
        calls.append(None)
        return (args[0] * math.inf, *args[1:]) if len(calls) == 3 and module.training else None

    handle = model.blocks[0].register_forward_pre_hook(overflow)
    try:
        with pytest.raises(TrainingDivergedError, match=r"non-finite values in the forward pass at epoch 1, step 3/4 "):
            train_model(model, data.train, data.val, small_config())
    finally:
        handle.remove()

    @dataclass
    class Images:
        images: torch.Tensor
        labels: torch.Tensor

    images = torch.randn(8, 1, 4, 4)
    images[5, 0, 1, 1] = math.nan  # a NaN in the data is the data's fault: the layer's ValueError stays
    images = Images(images, torch.zeros(8, dtype=torch.long))
    torch.manual_seed(0)
    patches = Transformer(
        2, embed_dim=16, depth=1, num_heads=2, input="patches", image_size=4, patch_size=2, in_channels=1
    )
    with pytest.raises(ValueError, match="NaN or Inf") as caught:
        train_model(patches, images, images, small_config(epochs=1, batch_size=8))
    assert not isinstance(caught.value, TrainingDivergedError)


def test_an_overflowing_validation_pass_is_divergence(data, tmp_path, small_model, small_config):
    # finite but huge parameters can overflow in the validation's forward pass: that was a raw ValueError, with the
    # model left non-finite in train mode; now as in a step: TrainingDivergedError, the best state restored
    model = small_model()
    initial = {name: value.clone() for name, value in model.state_dict().items()}

    def overflow(module, args):  # the validation runs in eval mode
        return None if module.training else (args[0] * math.inf, *args[1:])

    model.blocks[0].register_forward_pre_hook(overflow)
    match = r"^training diverged: non-finite values in the validation's forward pass after epoch 1 \(.*NaN or Inf"
    with pytest.raises(TrainingDivergedError, match=match) as caught:
        train_model(model, data.train, data.val, small_config(checkpoint_dir=tmp_path))
    error = caught.value
    assert (error.epoch, error.step, error.best_epoch) == (1, None, 0)
    assert isinstance(error.__cause__, ValueError) and "no checkpoint of this run was written" in str(error)
    _assert_holds(model, initial)
    assert not model.training and not (tmp_path / "last.pt").exists()


# -- output ----------------------------------------------------------------------------------------------------------
def test_progress_false_prints_nothing(data, capfd, small_model, small_config):
    train_model(small_model(), data.train, data.val, small_config(epochs=1, progress=False))
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


# -- model selection -------------------------------------------------------------------------------------------------
def test_selection_uses_the_reported_nll(data, small_model, small_config):
    # softmax attention is deterministic: the best state's validation predictions can be recomputed exactly
    model = small_model("softmax")
    result = train_model(model, data.train, data.val, small_config(epochs=3))
    probabilities = evaluate(model, data.val, num_samples=2)
    assert result.best_val_nll == negative_log_likelihood(probabilities, data.val.labels)
    best = result.history[result.best_epoch - 1]
    assert best["val_accuracy"] == accuracy(probabilities, data.val.labels)
    assert best["val_nll"] == min(record["val_nll"] for record in result.history)


# -- strategies ------------------------------------------------------------------------------------------------------
class RecordingStrategy(TrainingStrategy):
    """A single process that records the hooks the loop calls (and can pretend another process saw a NaN loss)."""

    def __init__(self, stop_at_call: int | None = None):
        self.calls: list[str] = []
        self.stop_at_call = stop_at_call

    def wrap(self, model):
        self.calls.append("wrap")
        return model

    def shard(self, order: Tensor) -> Tensor:
        self.calls.append("shard")
        return order

    def any(self, flag: bool) -> bool:
        self.calls.append("any")
        return flag or self.calls.count("any") == self.stop_at_call

    def sum(self, values):
        self.calls.append("sum")
        return values

    def finish(self, model, best_state):
        self.calls.append("finish")


def test_a_strategy_sees_every_hook_and_leaves_the_run_unchanged(data, small_model, small_config):
    reference, hooked = small_model(), small_model()
    expected = train_model(reference, data.train, data.val, small_config())
    strategy = RecordingStrategy()
    result = train_model(hooked, data.train, data.val, small_config(), strategy=strategy)
    assert _without_time(result.history) == _without_time(expected.history)
    _assert_same_parameters(hooked, reference)
    # 2 epochs of 4 steps: one stop vote per step and one on the validation predictions per epoch
    epoch = ["shard"] + ["any"] * 4 + ["sum", "any"]
    assert strategy.calls == ["wrap", *epoch, *epoch, "finish"]


def test_a_stop_vote_from_another_process_stops_this_one(data, small_model, small_config):
    model = small_model()
    # this process's loss is finite: the message says that another one stopped the run
    match = r"non-finite training loss or forward pass on another process at epoch 1, step 3/4 \(global step 3\); the"
    with pytest.raises(NonFiniteLossError, match=match):
        train_model(model, data.train, data.val, small_config(), strategy=RecordingStrategy(stop_at_call=3))
    assert not model.training  # the best state (the initial one) is back, in eval mode


def test_processes_other_than_the_main_one_neither_validate_nor_write(data, tmp_path, small_model, small_config):
    class SecondRank(TrainingStrategy):
        rank, world_size = 1, 2

    model, initial = small_model(), small_model()
    steps = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: steps.append(1))
    try:
        result = train_model(model, data.train, data.val, small_config(checkpoint_dir=tmp_path), strategy=SecondRank())
    finally:
        handle.remove()
    assert len(steps) == 2 * 2  # ceil(ceil(256 / 2) / 64) = 2 steps per epoch: the shard size sets the steps
    assert result.history == [] and result.best_epoch == 0
    assert not (tmp_path / "last.pt").exists() and not (tmp_path / "best.pt").exists()
    # the best state is the main process's (DataParallelStrategy.finish broadcasts it): alone, this one keeps its own
    _assert_same_parameters(model, initial)


@pytest.mark.parametrize("split", ["train", "val"])
def test_labels_outside_the_models_classes_are_refused_before_training(data, small_model, small_config, split):
    # validation labels were refused only after the first epoch, by a metric that named no data set
    model = small_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    sets = {"train": data.train, "val": data.val}
    sets[split] = dataclasses.replace(sets[split], labels=sets[split].labels + 3)
    name = {"train": "training", "val": "validation"}[split]
    with pytest.raises(ValueError, match=rf"^train_model: the {name} labels must be class indices in \[0, 1\] \(the "):
        train_model(model, sets["train"], sets["val"], small_config())
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())  # nothing trained


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_labels_of_any_integer_dtype_train_as_int64(data, small_model, small_config, dtype):
    # int32 labels passed the checks, then failed inside torch's cross-entropy at the first step
    reference, model = small_model("softmax"), small_model("softmax")
    expected = train_model(reference, data.train, data.val, small_config(epochs=1))
    train, val = (dataclasses.replace(split, labels=split.labels.to(dtype)) for split in (data.train, data.val))
    result = train_model(model, train, val, small_config(epochs=1))
    assert _without_time(result.history) == _without_time(expected.history)  # the int64 run's numbers, bit for bit
    _assert_same_parameters(model, reference)


def _with(dataset, **changes):
    """A generic data set (tokens, mask, labels) of ``dataset`` with ``changes``."""
    fields = {
        "tokens": dataset.tokens,
        "mask": torch.ones_like(dataset.tokens, dtype=torch.bool),
        "labels": dataset.labels,
    }
    return SimpleNamespace(**{**fields, **changes})


@pytest.mark.parametrize(
    ("split", "changes", "error", "message"),
    [
        (
            "train",
            lambda d: {"mask": torch.ones(10, 6, dtype=torch.bool)},
            ValueError,
            "expected the .mask of the training set to have one row per input, got 10 rows (shape (10, 6)) for 256 "
            "inputs (shape (256, 6)); give the mask of these inputs",
        ),
        (
            "val",
            lambda d: {"mask": torch.ones(65, 6, dtype=torch.bool)},
            ValueError,
            "expected the .mask of the validation set to have one row per input, got 65 rows (shape (65, 6)) for 64 "
            "inputs (shape (64, 6)); give the mask of these inputs",
        ),
        (
            "train",
            lambda d: {"mask": [[True] * 6] * 256},
            TypeError,
            "expected the .mask of the training set to be a boolean tensor of shape (n, N) or None, got list",
        ),
        (
            "train",
            lambda d: {"labels": d.labels[:, None]},
            TypeError,
            "expected integer class labels .labels of shape (n,) in the training set, got a torch.int64 tensor of "
            "shape (256, 1); give one class index per input",
        ),
        (
            "val",
            lambda d: {"labels": d.labels.bool()},
            TypeError,
            "expected integer class labels .labels of shape (n,) in the validation set, got a torch.bool tensor of "
            "shape (64,); give one class index per input",
        ),
        (
            "val",
            lambda d: {"tokens": d.tokens[:0], "mask": None, "labels": d.labels[:0]},
            ValueError,
            "expected a non-empty validation set, got 0 labels for 0 inputs",
        ),
        (
            "train",
            lambda d: {"labels": d.labels[:-1]},
            ValueError,
            "expected as many labels as inputs in the training set, got 255 labels for 256 inputs",
        ),
    ],
    ids=["mask_rows", "val_mask_rows", "mask_list", "labels_2d", "labels_bool", "val_empty", "labels_short"],
)
def test_bad_data_sets_are_named_before_training(data, small_model, small_config, split, changes, error, message):
    # a mask of another row count raised a bare IndexError at the first step; 2-D labels were reported without their
    # shape or dtype; an empty validation set was "a non-empty data set"
    model = small_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    sets = {"train": _with(data.train), "val": _with(data.val)}
    sets[split] = _with(getattr(data, split), **changes(getattr(data, split)))
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        train_model(model, sets["train"], sets["val"], small_config())
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())  # nothing trained


@pytest.mark.parametrize("split", ["training", "validation"])
def test_inputs_with_nan_or_inf_are_named_before_training(small_config, split):
    # a NaN in the last training batch was refused by the model only at that step, one in the validation set only
    # after the first epoch had trained: the model changed, no checkpoint, and the message named no data set
    @dataclass
    class Images:
        images: torch.Tensor
        labels: torch.Tensor

    generator = torch.Generator().manual_seed(0)
    sets = {
        name: Images(torch.randn(16, 1, 4, 4, generator=generator), torch.arange(16) % 2)
        for name in ("training", "validation")
    }
    sets[split].images[15, 0, 2, 3] = math.inf
    sets[split].images[14, 0, 0, 0] = math.nan
    torch.manual_seed(0)
    model = Transformer(
        2, embed_dim=16, depth=1, num_heads=2, input="patches", image_size=4, patch_size=2, in_channels=1
    )
    before = {name: value.clone() for name, value in model.state_dict().items()}
    steps = []

    class Steps(Callback):
        def on_step_end(self, context, epoch, step, values):
            steps.append(step)

    message = f"train_model: the {split} inputs hold NaN or Inf values (2 of 16 inputs); clean or drop them"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        train_model(model, sets["training"], sets["validation"], small_config(batch_size=4), callbacks=[Steps()])
    assert steps == []
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
