"""The training loop: learning, determinism, bitwise resume, schedule, clipping, checkpoints, failures, ensembles."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gpattn.data import make_pointer_task
from gpattn.experiments import (
    CHECKPOINT_KEYS,
    NonFiniteLossError,
    TrainConfig,
    ensemble_probabilities,
    evaluate,
    train_ensemble,
    train_model,
    warmup_cosine_lr,
    warmup_cosine_schedule,
)
from gpattn.models import Transformer

VOCAB, LENGTH = 6, 6


@pytest.fixture(scope="module")
def data():
    return make_pointer_task(256, 64, 64, length=LENGTH, seed=0, vocab_size=VOCAB)


def _model(attention: str = "kep_svgp", depth: int = 1, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    sizes = {"num_inducing": 4} if attention == "kep_svgp" else {}
    return Transformer(
        2, embed_dim=16, depth=depth, num_heads=2, attention=attention, vocab_size=VOCAB, max_len=LENGTH, **sizes
    )


def _config(**overrides) -> TrainConfig:
    settings = {"epochs": 2, "batch_size": 64, "lr": 1e-2, "warmup_epochs": 1, "eval_samples": 2, "progress": False}
    return TrainConfig(**{**settings, **overrides})


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
    ],
)
def test_config_rejects_bad_values(overrides):
    with pytest.raises(ValueError, match="expected"):
        TrainConfig(**overrides)


# -- learning and determinism ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_loss_decreases_and_beats_chance(data, attention):
    model = _model(attention)
    config = _config(epochs=6, batch_size=16, lr=3e-2, weight_decay=0.0, eval_samples=4)
    result = train_model(model, data.train, data.val, config)
    losses = [record["loss"] for record in result.history]
    assert losses[-1] < 0.7 * losses[0], losses
    assert max(record["val_accuracy"] for record in result.history) > 0.75, result.history
    assert result.best_val_nll == min(record["val_nll"] for record in result.history)
    assert result.history[result.best_epoch - 1]["val_nll"] == result.best_val_nll
    assert not model.training
    accuracy = (evaluate(model, data.test, num_samples=4).argmax(-1) == data.test.labels).double().mean().item()
    assert accuracy > 0.7


def test_same_seed_gives_identical_runs(data):
    first, second, other = _model(), _model(), _model()
    one = train_model(first, data.train, data.val, _config())
    two = train_model(second, data.train, data.val, _config())
    three = train_model(other, data.train, data.val, _config(seed=1))
    assert _without_time(one.history) == _without_time(two.history)
    _assert_same_parameters(first, second)
    assert _without_time(one.history) != _without_time(three.history)


def test_image_datasets_without_mask_are_supported():
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
    result = train_model(model, dataset, dataset, _config(epochs=1, batch_size=8))
    assert len(result.history) == 1 and math.isfinite(result.history[0]["val_nll"])
    assert evaluate(model, dataset, num_samples=2, batch_size=5).shape == (32, 2)


# -- resume ----------------------------------------------------------------------------------------------------------
def test_staged_run_resumes_bitwise(data, tmp_path):
    reference = _model(depth=2)
    staged = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, _config(epochs=4, checkpoint_dir=tmp_path / "full"))

    train_model(staged, data.train, data.val, _config(epochs=2, schedule_epochs=4, checkpoint_dir=tmp_path / "staged"))
    resumed = train_model(staged, data.train, data.val, _config(epochs=4, checkpoint_dir=tmp_path / "staged"), True)

    assert _without_time(resumed.history) == _without_time(full.history)
    assert (resumed.best_epoch, resumed.best_val_nll) == (full.best_epoch, full.best_val_nll)
    _assert_same_parameters(staged, reference)  # the best states
    last = [torch.load(tmp_path / run / "last.pt", weights_only=True)["model"] for run in ("full", "staged")]
    assert all(torch.equal(last[0][name], last[1][name]) for name in last[0])


def test_interrupted_run_resumes_bitwise(data, tmp_path, faulty_elbo):
    config = _config(epochs=4, checkpoint_dir=tmp_path)
    reference = _model()
    interrupted = copy.deepcopy(reference)
    full = train_model(reference, data.train, data.val, _config(epochs=4))

    faulty_elbo.interrupt_at = 10  # 4 steps per epoch: during epoch 3
    with pytest.raises(KeyboardInterrupt):
        train_model(interrupted, data.train, data.val, config)
    faulty_elbo.interrupt_at = None
    assert torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 2

    resumed = train_model(interrupted, data.train, data.val, config, resume=True)
    assert _without_time(resumed.history) == _without_time(full.history)
    _assert_same_parameters(interrupted, reference)


def test_resuming_with_another_schedule_warns(data, tmp_path):
    model = _model()
    train_model(model, data.train, data.val, _config(epochs=1, checkpoint_dir=tmp_path))
    with pytest.warns(UserWarning, match="schedule horizon"):
        result = train_model(model, data.train, data.val, _config(epochs=2, checkpoint_dir=tmp_path), resume=True)
    assert [record["epoch"] for record in result.history] == [1, 2]


def test_resume_errors_name_the_problem(data, tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_model(model, data.train, data.val, _config(), resume=True)
    with pytest.raises(FileNotFoundError, match="last.pt"):
        train_model(model, data.train, data.val, _config(checkpoint_dir=tmp_path), resume=True)
    (tmp_path / "last.pt").write_bytes(b"\x00garbage, not a checkpoint\xff" * 10)
    with pytest.raises(RuntimeError, match="could not read the checkpoint .*last.pt"):
        train_model(model, data.train, data.val, _config(checkpoint_dir=tmp_path), resume=True)


# -- schedule and clipping -------------------------------------------------------------------------------------------
def _closed_form(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    return floor + (peak - floor) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))) / 2


def test_schedule_is_warmup_then_cosine():
    total, warmup, peak, floor = 20, 5, 0.1, 0.01
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = warmup_cosine_schedule(optimizer, total, warmup, floor)
    for step in range(total + 3):
        expected = _closed_form(step, total, warmup, peak, floor)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert warmup_cosine_lr(step, total, warmup, peak, floor) == pytest.approx(expected, rel=1e-12)
        optimizer.step()
        scheduler.step()
    assert _closed_form(warmup, total, warmup, peak, floor) == pytest.approx(peak)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(floor)


def test_history_records_the_scheduled_rates(data):
    config = _config(epochs=3, warmup_steps=3, min_lr=1e-3)  # 4 steps per epoch, 12 in all
    result = train_model(_model(), data.train, data.val, config)
    for record in result.history:
        last_step = 4 * record["epoch"] - 1
        assert record["lr"] == pytest.approx(_closed_form(last_step, 12, 3, config.lr, config.min_lr), rel=1e-12)


def test_gradients_are_clipped(data):
    norms = []

    def hook(optimizer, args, kwargs):
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])).item())

    handle = register_optimizer_step_pre_hook(hook)
    try:
        result = train_model(_model(), data.train, data.val, _config(grad_clip=0.05))
    finally:
        handle.remove()
    assert len(norms) == 8
    assert max(norms) <= 0.05 * (1 + 1e-5)
    assert min(record["grad_norm"] for record in result.history) > 0.05  # the clip was active


# -- checkpoints and failures ----------------------------------------------------------------------------------------
def test_checkpoints_hold_the_documented_keys(data, tmp_path):
    model = _model()
    result = train_model(model, data.train, data.val, _config(checkpoint_dir=tmp_path))
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


def test_non_finite_loss_stops_with_the_best_state(data, tmp_path, faulty_elbo):
    faulty_elbo.fail_at = 7  # epoch 2, step 3
    model = _model()
    with pytest.raises(NonFiniteLossError, match=r"epoch 2, step 3/4.*nll=nan.*kl=.*ksvd="):
        train_model(model, data.train, data.val, _config(epochs=3, checkpoint_dir=tmp_path))
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["epoch"] == 1
    assert not (tmp_path / "last.pt").exists() or torch.load(tmp_path / "last.pt", weights_only=True)["epoch"] == 1
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, best["model"][name]), name


# -- ensembles and output --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_ensemble_averages_member_probabilities(data, attention):
    members = train_ensemble(lambda k: _model(attention, seed=100 + k), data.train, data.val, _config(epochs=1), 2)
    models = [model for model, _ in members]
    assert len(members) == 2
    assert not all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))
    torch.manual_seed(5)
    probabilities = ensemble_probabilities(models, data.test, num_samples=3)
    torch.manual_seed(5)
    expected = torch.stack([evaluate(model, data.test, num_samples=3) for model in models]).mean(dim=0)
    assert probabilities.shape == (len(data.test), 2)
    torch.testing.assert_close(probabilities.sum(dim=-1), torch.ones(len(data.test)))
    assert torch.equal(probabilities, expected)


def test_progress_false_prints_nothing(data, capfd):
    train_model(_model(), data.train, data.val, _config(epochs=1, progress=False))
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""
