"""Checkpoints: atomic writes and RNG states; damaged checkpoints fail with a clear error naming the file and the
problem (never deep inside torch, never leaving a half-loaded model), and a non-finite loss, gradient or parameter stops
training with the last good checkpoint intact on disk."""

from __future__ import annotations

import math
import pickle
import random
import re
import shutil

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpattn.data import make_pointer_task
from gpattn.models import Transformer
from gpattn.training import (
    CHECKPOINT_KEYS,
    CheckpointError,
    NonFiniteLossError,
    TrainConfig,
    load_checkpoint,
    train_model,
)
from gpattn.training import checkpoint_files as files
from gpattn.training.checkpoint_files import MANIFEST, content_checksum, recover, save_checkpoint, save_run_checkpoints
from gpattn.training.checkpoints import check_pair, check_state_fits, model_description, restore_rng_state, rng_state

STEPS_PER_EPOCH = 2  # 96 training sequences, batches of 48


@pytest.fixture(scope="module")
def data():
    return make_pointer_task(96, 32, 16, length=6, seed=0, vocab_size=6)


def _config(directory, **overrides) -> TrainConfig:
    settings = dict(epochs=2, batch_size=48, lr=1e-2, eval_samples=2, progress=False, checkpoint_dir=directory)
    return TrainConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    """A directory with the ``last.pt`` and ``best.pt`` of a 2-epoch KEP-SVGP run, and its bytes."""
    directory = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)  # the architecture of _fresh_model
    model = Transformer(
        2, embed_dim=16, depth=1, num_heads=2, attention="kep_svgp", num_inducing=4, vocab_size=6, max_len=6
    )
    train_model(model, data.train, data.val, _config(directory))
    return directory, (directory / "last.pt").read_bytes()


def _fresh_model(make_transformer, **kwargs):
    return make_transformer("kep_svgp", depth=1, **kwargs)


def _copy_run(trained, destination, last_bytes: bytes | None = None, manifest: bool = False):
    """A copy of the trained run's ``best.pt`` and ``last.pt`` (replaced by ``last_bytes``), with or without the
    manifest ``checkpoints.json`` (without it, only the files' own checks apply)."""
    directory, original = trained
    destination.mkdir(exist_ok=True)
    (destination / "best.pt").write_bytes((directory / "best.pt").read_bytes())
    (destination / "last.pt").write_bytes(original if last_bytes is None else last_bytes)
    if manifest:
        shutil.copy(directory / MANIFEST, destination / MANIFEST)
    return destination


def _parameters(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _resume_fails(make_transformer, data, directory, match: str, epochs: int = 3, train=None):
    """Resume from ``directory`` (for ``epochs`` in all, on the training set ``train``, default ``data.train``): it
    must raise a CheckpointError matching ``match`` and leave the model and the global RNG untouched."""
    model = _fresh_model(make_transformer)
    before, rng = _parameters(model), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=match) as caught:
        train_model(model, data.train if train is None else train, data.val, _config(directory, epochs=epochs), True)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    return caught.value


# -- writing and RNG states ------------------------------------------------------------------------------------------
def test_save_is_atomic_and_round_trips(tmp_path):
    checkpoint = {"model": {"w": torch.arange(3.0)}, "epoch": 2}
    save_checkpoint(checkpoint, tmp_path / "last.pt")
    assert [path.name for path in tmp_path.iterdir()] == ["last.pt"]  # the temporary file was renamed
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert loaded["epoch"] == 2 and torch.equal(loaded["model"]["w"], torch.arange(3.0))


def test_rng_states_restore_the_streams():
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(3)
    torch.rand(5), torch.rand(2, generator=generator)  # advance both streams
    state = rng_state(generator, torch.device("cpu"))
    assert set(state) == {"torch", "batch_generator", "cuda"} and state["cuda"] is None
    expected = torch.rand(4), torch.randperm(10, generator=generator)
    torch.manual_seed(99)
    other = torch.Generator().manual_seed(1)
    restore_rng_state(state, other, torch.device("cpu"))
    again = torch.rand(4), torch.randperm(10, generator=other)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


def test_a_state_of_another_model_is_described(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])
    state = {f"{index}.{name}": torch.zeros(3) for index in range(4) for name in ("weight", "bias")}
    with pytest.raises(CheckpointError, match=r"x\.pt was written for another model configuration: shape mismatches"):
        check_state_fits(state, model, tmp_path / "x.pt")
    state = {"extra": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"missing \['0\.weight', .*\] and 3 more; unexpected \['extra'\]"):
        check_state_fits(state, model, tmp_path / "x.pt")
    check_state_fits(model.state_dict(), model, tmp_path / "x.pt")  # a fitting state passes


def test_resuming_into_a_model_of_another_dtype_is_refused(make_transformer, data, trained, tmp_path):
    # load_state_dict converts dtypes silently: a float32 run resumed in float64 trained on with other numbers than
    # the run recorded, and nothing said so
    directory = _copy_run(trained, tmp_path / "copy", manifest=True)
    model = _fresh_model(make_transformer).double()
    before, names = _parameters(model), list(model.state_dict())
    floating = [name for name, value in model.state_dict().items() if value.is_floating_point()]  # the others agree
    first = f"{names[0]}: torch.float32 in the file, torch.float64 in the model"
    match = (
        rf"the checkpoint .*last\.pt was written for a model of other dtypes: \['{re.escape(first)}', .*\] and "
        rf"{len(floating) - 5} more; convert the model to the file's dtypes before loading \(e\.g\. "
        r"model\.to\(torch\.float32\)\), or train with resume=False$"
    )
    with pytest.raises(CheckpointError, match=match):
        train_model(model, data.train, data.val, _config(directory), True)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())  # untouched
    assert all(model.state_dict()[name].dtype == torch.float64 for name in floating)
    # loading for evaluation converts, as load_state_dict does: the file's values in the model's dtype
    load_checkpoint(directory / "best.pt", model)
    stored = load_checkpoint(directory / "best.pt")["model"]
    assert all(model.state_dict()[name].dtype == torch.float64 for name in floating)
    assert all(torch.equal(model.state_dict()[name], stored[name].double()) for name in floating)
    # one buffer or parameter of another dtype is named alone
    state = model.float().state_dict()
    state[names[-1]] = state[names[-1]].half()
    message = (
        f"x.pt was written for a model of other dtypes: ['{names[-1]}: torch.float16 in the file, torch.float32 in"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        check_state_fits(state, model, tmp_path / "x.pt", dtypes=True)
    check_state_fits(state, model, tmp_path / "x.pt")  # names and shapes only


# -- damaged files ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda b: b[: len(b) // 2], r"could not read the checkpoint .*last\.pt .*damaged \(e\.g\. truncated"),
        (lambda b: b[:100], r"could not read the checkpoint .*last\.pt"),
        (lambda b: b"", r"could not read the checkpoint .*last\.pt \(0 bytes"),
        (lambda b: b"\x00garbage, not a checkpoint\xff" * 50, r"could not read the checkpoint .*last\.pt"),
        (lambda b: pickle.dumps({"model": {}}), r"could not read the checkpoint .*last\.pt"),  # not a torch zip file
    ],
    ids=["truncated_half", "truncated_header", "empty", "garbage", "plain_pickle"],
)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")  # torch, reading the plain pickle
def test_unreadable_checkpoints_raise_a_clear_error(make_transformer, data, trained, tmp_path, damage, match):
    directory = _copy_run(trained, tmp_path / "run", damage(trained[1]))
    error = _resume_fails(make_transformer, data, directory, match)
    assert "resume=False" in str(error)  # what to do about it
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory / "last.pt")


def _rewrite(trained, tmp_path, edit) -> object:
    """A copy of the run whose ``last.pt`` is ``edit(checkpoint)``, with a valid content checksum when it is a dict
    that has one (so that the structural checks are what rejects it)."""
    directory = _copy_run(trained, tmp_path / "run")
    checkpoint = edit(torch.load(directory / "last.pt", weights_only=True))
    if isinstance(checkpoint, dict) and "checksum" in checkpoint:
        checkpoint["checksum"] = content_checksum(checkpoint)
    torch.save(checkpoint, directory / "last.pt")
    return directory


def _moments_with_nan(checkpoint):
    state = checkpoint["optimizer"]["state"]
    state[0]["exp_avg"].view(-1)[0] = math.nan
    return checkpoint


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: {**c, "epoch": 9}, r"last\.pt is inconsistent: it claims epoch 9 but its history has 2 entries"),
        (
            lambda c: {**c, "history": [{**c["history"][0], "epoch": 2}, c["history"][1]]},
            r"last\.pt is inconsistent: its history's epochs are \[2, 2\], expected 1, 2, \.\.\., 2",
        ),
        (
            lambda c: {**c, "best_epoch": 1},
            r"last\.pt is inconsistent: its best_epoch 1 .* is not the epoch of the lowest validation NLL .*epoch 2",
        ),
        (_moments_with_nan, r"last\.pt is inconsistent: its optimiser state \['0/exp_avg'\] holds NaN or Inf"),
    ],
    ids=["epoch_beyond_history", "history_epochs", "best_epoch", "nan_moments"],
)
def test_inconsistent_checkpoints_raise(make_transformer, data, trained, tmp_path, edit, match):
    # a valid checksum, but the file contradicts itself: the old loop accepted "epoch 9" and trained nothing
    directory = _rewrite(trained, tmp_path, edit)
    _resume_fails(make_transformer, data, directory, match)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory / "last.pt")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: {key: c[key] for key in ("model", "epoch")}, r"last\.pt lacks the entries \['optimizer'"),
        (lambda c: c["model"], r"last\.pt lacks the entries"),  # a bare state dict
        (lambda c: torch.zeros(3), r"last\.pt holds a Tensor, expected a dict"),
        (lambda c: {**c, "epoch": "2"}, r"last\.pt is malformed: 'epoch' is '2'"),
        (lambda c: {**c, "rng": {"torch": c["rng"]["torch"]}}, r"last\.pt is malformed: 'rng' lacks"),
        (lambda c: {**c, "model": [1, 2]}, r"last\.pt is malformed: 'model' is not a state dict"),
    ],
    ids=["missing_keys", "bare_state_dict", "tensor", "bad_epoch", "bad_rng", "bad_model"],
)
def test_incomplete_or_malformed_checkpoints_raise(make_transformer, data, trained, tmp_path, edit, match):
    directory = _rewrite(trained, tmp_path, edit)
    _resume_fails(make_transformer, data, directory, match)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory / "last.pt")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda c: {**c, "scheduler": {"foo": 1}},
            r"last\.pt holds a malformed schedule state: its 'last_epoch' is None",
        ),
        (
            lambda c: {**c, "scheduler": {**c["scheduler"], "base_lrs": []}},
            r"last\.pt holds a malformed schedule state: its 'base_lrs' is \[\], expected a list of 1 learning rates",
        ),
        (
            lambda c: {**c, "rng": {**c["rng"], "torch": torch.zeros(3, dtype=torch.uint8)}},
            r"last\.pt holds an RNG state rng\['torch'\] that cannot be restored",
        ),
        (
            lambda c: {**c, "rng": {**c["rng"], "batch_generator": torch.zeros(3, dtype=torch.uint8)}},
            r"last\.pt holds an RNG state rng\['batch_generator'\] that cannot be restored",
        ),
    ],
    ids=["scheduler_garbage", "scheduler_groups", "torch_rng", "batch_rng"],
)
def test_a_bad_schedule_or_rng_state_leaves_the_model_untouched(make_transformer, data, trained, tmp_path, edit, match):
    # a valid checksum, but a state that fails to load: the model's tensors were overwritten before the schedule and
    # the RNGs failed, and the RNG's failure was called "does not fit this model or optimiser"
    directory = _rewrite(trained, tmp_path, edit)
    error = _resume_fails(make_transformer, data, directory, match, epochs=2)
    assert "does not fit this model" not in str(error)


def test_resuming_on_a_training_set_of_another_size_is_refused(make_transformer, data, trained, tmp_path):
    # 144 sequences make 3 steps an epoch, not 2: the schedule and the ELBO's num_data changed silently
    other = make_pointer_task(144, 32, 16, length=6, seed=0, vocab_size=6)
    directory = _copy_run(trained, tmp_path / "run")
    match = r"last\.pt with other settings .*the training set \(96 examples in the checkpoint, 144 now"
    _resume_fails(make_transformer, data, directory, match, epochs=2, train=other.train)
    # a checkpoint that predates the record of num_data: the schedule's step count tells
    (tmp_path / "old").mkdir()
    directory = _rewrite(trained, tmp_path / "old", lambda c: {**c, "config": _without(c["config"], "num_data")})
    match = (
        r"last\.pt does not fit this run: its schedule has taken 4 optimiser steps in 2 epochs, but this run takes 3"
    )
    _resume_fails(make_transformer, data, directory, match, epochs=2, train=other.train)
    result = train_model(_fresh_model(make_transformer), data.train, data.val, _config(directory), resume=True)
    assert [record["epoch"] for record in result.history] == [1, 2]  # and it resumes on its own training set


def test_resuming_on_a_validation_set_of_another_size_is_refused(make_transformer, data, trained, tmp_path):
    # 48 validation sequences instead of 32: the NLL that selects the best epoch changed silently mid-run
    other = make_pointer_task(96, 48, 16, length=6, seed=0, vocab_size=6)
    directory = _copy_run(trained, tmp_path / "run", manifest=True)
    model = _fresh_model(make_transformer)
    before = _parameters(model)
    match = r"last\.pt with other settings .*the validation set \(32 examples in the checkpoint, 48 now"
    with pytest.raises(CheckpointError, match=match):
        train_model(model, data.train, other.val, _config(directory, epochs=2), resume=True)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_schedule_state_of_another_step_count_is_refused(make_transformer, data, trained, tmp_path):
    directory = _rewrite(trained, tmp_path, lambda c: {**c, "scheduler": {**c["scheduler"], "last_epoch": 1000}})
    match = r"last\.pt does not fit this run: its schedule has taken 1000 optimiser steps in 2 epochs, .*\(4 in 2\)"
    _resume_fails(make_transformer, data, directory, match, epochs=2)


def _without(values: dict, name: str) -> dict:
    return {key: value for key, value in values.items() if key != name}


def test_a_checkpoint_older_than_a_setting_resumes_with_its_former_value(make_transformer, data, trained, tmp_path):
    # checkpoints written before patience, mc_dropout and cuda_graphs existed: every run then had patience=None (and no
    # MC-dropout validation, no graphs); such a run resumes with those values (it was refused for patience, "settings
    # ['patience'] missing from the checkpoint") and is refused with other ones
    older = ("patience", "mc_dropout", "cuda_graphs")
    edit = lambda c: {**c, "config": {key: value for key, value in c["config"].items() if key not in older}}  # noqa: E731
    directory = _rewrite(trained, tmp_path, edit)
    result = train_model(_fresh_model(make_transformer), data.train, data.val, _config(directory), True)
    assert result.history == torch.load(trained[0] / "last.pt", weights_only=True)["history"]
    (tmp_path / "other").mkdir()
    directory = _rewrite(trained, tmp_path / "other", edit)
    model = _fresh_model(make_transformer)
    with pytest.raises(CheckpointError, match=r"settings \['patience'\] missing from the checkpoint"):
        train_model(model, data.train, data.val, _config(directory, patience=1), True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embed_dim": 32}, r"another model configuration: .*shape mismatches .*in the file"),
        ({"attention": "softmax"}, r"another model configuration: missing \[.*unexpected \["),
        ({"depth": 2}, r"another model configuration: missing \['blocks\.0\.attention\.q_proj"),
        ({"num_inducing": 3}, r"another model configuration: shape mismatches"),
    ],
    ids=["width", "attention", "depth", "num_inducing"],
)
def test_checkpoint_of_another_configuration_raises(make_transformer, data, trained, kwargs, match):
    directory, _ = trained
    settings = {"depth": 1, **kwargs}
    attention = settings.pop("attention", "kep_svgp")
    model = make_transformer(attention, **settings)
    before = _parameters(model)
    with pytest.raises(CheckpointError, match=r"the checkpoint .*last\.pt was written for " + match.split(": ", 1)[0]):
        train_model(model, data.train, data.val, _config(directory, epochs=3), resume=True)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory / "last.pt", model)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_model_of_another_configuration_with_the_same_shapes_is_refused(make_transformer, data, trained, tmp_path):
    # dropout 0.1 instead of 0 (or 4 heads of width 16 instead of 2 for softmax attention) gives the same parameter
    # names and shapes: the resumed run silently continued another model than the one that wrote the checkpoint
    directory = _copy_run(trained, tmp_path / "run", manifest=True)
    model = _fresh_model(make_transformer, dropout=0.1)
    before = _parameters(model)
    match = (
        r"last\.pt with other settings .*the model's configuration \(embedding_dropout\.p \(0\.0 in the checkpoint, "
        r"0\.1 now\); blocks\.0\.attention\.dropout\.p"
    )
    with pytest.raises(CheckpointError, match=match):
        train_model(model, data.train, data.val, _config(directory, epochs=2), resume=True)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    # the same model resumes; so does a checkpoint written before the model's configuration was recorded
    result = train_model(_fresh_model(make_transformer), data.train, data.val, _config(directory), resume=True)
    assert result.best_epoch == torch.load(trained[0] / "last.pt", weights_only=True)["best_epoch"]
    (tmp_path / "old").mkdir()
    old = _rewrite(trained, tmp_path / "old", lambda c: {**c, "config": _without(c["config"], "model")})
    train_model(_fresh_model(make_transformer, dropout=0.1), data.train, data.val, _config(old), resume=True)


def test_the_model_description_reads_numpy_values_as_python_ones_and_leaves_speed_switches_out():
    """``np.float64(0.1)`` was recorded as ``np.float64(0.1)``: a run built with it and resumed with ``0.1`` was refused
    (and NumPy integers were left out of the description); timm's ``fused_attn`` (chosen by the environment) and the
    gradient-checkpointing switches are not the model's configuration."""
    layer = torch.nn.Dropout(0.1)
    numpy_layer = torch.nn.Dropout(0.1)
    numpy_layer.p, numpy_layer.heads, numpy_layer.fused_attn = np.float64(0.1), np.int64(4), True
    layer.heads, layer.grad_checkpointing = 4, True
    assert (
        model_description(numpy_layer)
        == model_description(layer)
        == {"": {"type": "Dropout", "heads": "4", "inplace": "False", "p": "0.1"}}
    )


def test_attributes_one_version_has_and_the_other_lacks_do_not_block_a_resume(
    make_transformer, data, trained, tmp_path
):
    """A later gpattn, torch or timm adds public attributes to its modules: a checkpoint of today must still resume
    under it (the CLI warns about another code version and goes on), and one of then under today's code."""

    def edit(checkpoint):
        model = {name: {**entry, "added_later": "1"} for name, entry in checkpoint["config"]["model"].items()}
        model["blocks.0.attention"].pop("merge")
        return {**checkpoint, "config": {**checkpoint["config"], "model": model}}

    directory = _rewrite(trained, tmp_path, edit)
    train_model(_fresh_model(make_transformer), data.train, data.val, _config(directory), resume=True)

    def changed(checkpoint):
        model = checkpoint["config"]["model"]
        model = {**model, "": {**model[""], "num_classes": "7"}}  # a setting both versions have
        return {**checkpoint, "config": {**checkpoint["config"], "model": model}}

    (tmp_path / "changed").mkdir()
    directory = _rewrite(trained, tmp_path / "changed", changed)
    with pytest.raises(
        CheckpointError, match=r"the model's configuration \(num_classes \(7 in the checkpoint, 2 now\)"
    ):
        train_model(_fresh_model(make_transformer), data.train, data.val, _config(directory), resume=True)


def test_damaged_best_checkpoint_is_named(make_transformer, data, trained, tmp_path):
    directory = _copy_run(trained, tmp_path / "run")
    (directory / "best.pt").write_bytes(b"\x00" * 64)
    _resume_fails(make_transformer, data, directory, r"could not read the checkpoint .*best\.pt")


def _best_of_epoch_one(trained) -> dict:
    """A self-consistent checkpoint of epoch 1 made from the run's last.pt (which names epoch 2 as the best)."""
    checkpoint = torch.load(trained[0] / "last.pt", weights_only=True)
    assert checkpoint["best_epoch"] == 2  # the fixture's run improves in epoch 2
    history = checkpoint["history"][:1]
    return {**checkpoint, "epoch": 1, "history": history, "best_epoch": 1, "best_val_nll": history[0]["val_nll"]}


def test_a_best_checkpoint_of_another_epoch_does_not_pair(make_transformer, data, trained, tmp_path):
    directory = _copy_run(trained, tmp_path / "run")
    save_checkpoint(_best_of_epoch_one(trained), directory / "best.pt")  # valid on its own
    load_checkpoint(directory / "best.pt")
    _resume_fails(
        make_transformer,
        data,
        directory,
        r"the checkpoints do not pair: .*last\.pt \(epoch 2\) names epoch 2 as the "
        r"best, but .*best\.pt holds epoch 1",
    )


def test_a_file_that_does_not_match_the_manifest_is_rejected(make_transformer, data, trained, tmp_path):
    directory = _copy_run(trained, tmp_path / "run", manifest=True)
    save_checkpoint(_best_of_epoch_one(trained), directory / "best.pt")  # valid on its own, not the committed one
    match = r"the checkpoint .*best\.pt does not match .*checkpoints\.json \(SHA-256 of its \d+ bytes differs"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(directory / "best.pt")
    _resume_fails(make_transformer, data, directory, match)


def test_a_changed_tensor_fails_the_content_checksum(make_transformer, data, trained, tmp_path):
    # the case: a few low bytes of one weight changed, the file otherwise intact (the old loop resumed from it)
    directory = _copy_run(trained, tmp_path / "run")
    checkpoint = torch.load(directory / "last.pt", weights_only=True)
    weight = checkpoint["model"]["head.weight"]
    weight.view(torch.int32).view(-1)[0] ^= 0x3  # the two lowest mantissa bits
    torch.save(checkpoint, directory / "last.pt")
    match = r"the checkpoint .*last\.pt is damaged: the SHA-256 of its content is [0-9a-f]{16}\.\.\., the file records"
    _resume_fails(make_transformer, data, directory, match)


def _equal_nested(first, second) -> bool:
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, dict):
        return (
            isinstance(second, dict)
            and list(first) == list(second)
            and all(_equal_nested(first[key], second[key]) for key in first)
        )
    if isinstance(first, (list, tuple)):
        return type(first) is type(second) and len(first) == len(second) and all(map(_equal_nested, first, second))
    return type(first) is type(second) and (first == second or (first != first and second != second))


def test_fault_injection_every_damaged_checkpoint_is_rejected_or_identical(trained, tmp_path, capsys):
    """Flip one byte (XOR with a random non-zero value) at each of 50 seeded random positions of a real last.pt, one
    damaged copy per position: every copy is rejected with a CheckpointError naming the file, or loads exactly the
    original content. Without the manifest (the file's own checks) and with it (also its SHA-256)."""
    directory, original = trained
    reference = load_checkpoint(directory / "last.pt")
    generator = random.Random(14)
    positions = generator.sample(range(len(original)), 50)
    tally = {"tried": 0, "rejected": 0, "identical": 0, "silently different": 0}
    for index, position in enumerate(positions):
        damaged = bytearray(original)
        damaged[position] ^= generator.randrange(1, 256)
        copy = _copy_run(trained, tmp_path / f"copy_{index}", bytes(damaged))
        tally["tried"] += 1
        try:
            loaded = load_checkpoint(copy / "last.pt")
        except CheckpointError as error:
            assert str(copy / "last.pt") in str(error)
            tally["rejected"] += 1
            continue
        tally["identical" if _equal_nested(loaded, reference) else "silently different"] += 1
        with_manifest = _copy_run(trained, tmp_path / f"manifest_{index}", bytes(damaged), manifest=True)
        with pytest.raises(CheckpointError, match=r"does not match .*checkpoints\.json"):
            load_checkpoint(with_manifest / "last.pt")  # harmless to the content, but not the committed file
    with capsys.disabled():
        print(f"\nfault injection on {directory / 'last.pt'} ({len(original)} bytes): {tally}")
    assert tally["tried"] == 50 and tally["silently different"] == 0
    assert tally["rejected"] + tally["identical"] == 50 and tally["rejected"] > 0


# -- atomic pairs ----------------------------------------------------------------------------------------------------
def _synthetic(epoch: int, nlls: list[float]) -> dict:
    """A small self-consistent checkpoint of ``epoch`` with validation NLLs ``nlls[:epoch]``."""
    history = [{"epoch": index + 1, "val_nll": nll} for index, nll in enumerate(nlls[:epoch])]
    best = min(range(epoch), key=lambda index: (nlls[index], index)) + 1
    states = {"torch": torch.zeros(4, dtype=torch.uint8), "batch_generator": torch.ones(4, dtype=torch.uint8)}
    return {
        "model": {"w": torch.full((3,), float(epoch))},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {},
        "epoch": epoch,
        "rng": {**states, "cuda": None},
        "history": history,
        "best_epoch": best,
        "best_val_nll": nlls[best - 1],
        "config": {},
    }


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("nlls", [[1.0, 0.5], [0.5, 1.0]], ids=["improved", "not_improved"])
def test_a_kill_at_any_moment_leaves_a_consistent_pair(tmp_path, monkeypatch, nlls):
    # every file operation of the epoch-2 write (writing a .tmp file, or a rename) is the moment of the kill in turn,
    # a write also half done: afterwards best.pt and last.pt always pair, of epoch 1 before the manifest's commit and
    # of epoch 2 after it
    write, replace = files._write_synced, files.os.replace
    moment = 0
    while True:
        moment += 1
        directory = tmp_path / f"kill_{moment}"
        directory.mkdir()
        save_run_checkpoints(directory, _synthetic(1, nlls), _synthetic(1, nlls))
        operations = []

        def killing_write(path, data, operations=operations, moment=moment):
            operations.append(f"write {path.name}")
            if len(operations) == moment:
                write(path, data[: len(data) // 2])
                raise _Killed
            write(path, data)

        def killing_replace(source, target, operations=operations, moment=moment):
            operations.append(f"replace {source.name}")
            if len(operations) == moment:
                raise _Killed
            replace(source, target)

        monkeypatch.setattr(files, "_write_synced", killing_write)
        monkeypatch.setattr(files.os, "replace", killing_replace)
        killed = False
        try:
            last = _synthetic(2, nlls)
            save_run_checkpoints(directory, last, last if last["best_epoch"] == 2 else None)
        except _Killed:
            killed = True
        finally:
            monkeypatch.undo()
        committed = f"replace {MANIFEST}.tmp" in operations[: moment - 1]
        recover(directory)
        last, best = load_checkpoint(directory / "last.pt"), load_checkpoint(directory / "best.pt")
        check_pair(last, best, directory / "last.pt", directory / "best.pt")
        assert last["epoch"] == (2 if committed or not killed else 1), operations
        if not killed:
            break
    assert moment == len(operations) + 1 >= 5  # every operation was a kill point once


def test_load_checkpoint_reads_and_loads_a_good_file(make_transformer, trained):
    directory, _ = trained
    checkpoint = load_checkpoint(directory / "best.pt")
    assert set(checkpoint) == set(CHECKPOINT_KEYS)
    model = _fresh_model(make_transformer, seed=3)
    load_checkpoint(directory / "best.pt", model)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in checkpoint["model"].items())
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(directory / "missing.pt")
    # a model that is no module (e.g. the state dict itself): was an AttributeError on .state_dict
    with pytest.raises(
        TypeError, match=r"^load_checkpoint: expected model to be a torch\.nn\.Module or None, got OrderedDict"
    ):
        load_checkpoint(directory / "best.pt", model.state_dict())


# -- non-finite values stop training with the last good checkpoint ---------------------------------------------------
def _assert_last_good_checkpoint(make_transformer, data, directory, epoch: int) -> None:
    """``last.pt`` holds ``epoch`` with finite parameters, loads into a fresh model and resumes to the end."""
    checkpoint = load_checkpoint(directory / "last.pt")
    assert checkpoint["epoch"] == epoch and len(checkpoint["history"]) == epoch
    model = _fresh_model(make_transformer)
    parameters = dict(model.named_parameters())  # buffers may be infinite by design (constraint upper bounds)
    assert all(torch.isfinite(value).all() for name, value in checkpoint["model"].items() if name in parameters)
    load_checkpoint(directory / "last.pt", model)
    result = train_model(model, data.train, data.val, _config(directory, epochs=3), resume=True)
    assert [record["epoch"] for record in result.history] == [1, 2, 3]
    assert all(math.isfinite(record["loss"]) for record in result.history)


def test_non_finite_loss_keeps_the_last_good_checkpoint(make_transformer, data, tmp_path, faulty_elbo):
    faulty_elbo.fail_at = 2 * STEPS_PER_EPOCH + 2  # epoch 3, step 2
    model = _fresh_model(make_transformer)
    message = r"non-finite training loss at epoch 3, step 2/2 .*last\.pt still holds epoch 2, the last good one"
    with pytest.raises(NonFiniteLossError, match=message):
        train_model(model, data.train, data.val, _config(tmp_path, epochs=3))
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    faulty_elbo.fail_at = None
    _assert_last_good_checkpoint(make_transformer, data, tmp_path, epoch=2)


def test_non_finite_gradient_keeps_the_last_good_checkpoint(make_transformer, data, tmp_path):
    model = _fresh_model(make_transformer)
    calls = {"count": 0}

    def poison(gradient):  # the second step of epoch 2 gets a NaN gradient, its loss stays finite
        calls["count"] += 1
        return gradient * math.nan if calls["count"] == STEPS_PER_EPOCH + 2 else gradient

    handle = model.head.weight.register_hook(poison)
    try:
        with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm nan at epoch 2, step 2/2 .*epoch 1"):
            train_model(model, data.train, data.val, _config(tmp_path, epochs=3))
    finally:
        handle.remove()
    _assert_last_good_checkpoint(make_transformer, data, tmp_path, epoch=1)


def test_non_finite_parameter_stops_at_its_step(make_transformer, data, tmp_path):
    # the last optimiser step of epoch 2 makes a parameter infinite without a non-finite loss or gradient: the old
    # loop would have evaluated and written it to last.pt; the per-step check stops at that step
    model = _fresh_model(make_transformer)
    steps = {"count": 0}

    def poison(optimizer, args, kwargs):
        steps["count"] += 1
        if steps["count"] == 2 * STEPS_PER_EPOCH:
            with torch.no_grad():
                model.head.bias.fill_(math.inf)

    handle = register_optimizer_step_post_hook(poison)
    try:
        match = r"non-finite parameters \['head\.bias'\] after the optimiser step at epoch 2, step 2/2"
        with pytest.raises(NonFiniteLossError, match=match):
            train_model(model, data.train, data.val, _config(tmp_path, epochs=3))
    finally:
        handle.remove()
    assert torch.isfinite(model.head.bias).all()  # the best (epoch 1) state is back
    _assert_last_good_checkpoint(make_transformer, data, tmp_path, epoch=1)


def test_a_new_run_replaces_a_stale_or_damaged_manifest(tmp_path):
    # a fresh run in a folder of a longer earlier run (manifest at epoch 3) or with a damaged manifest: its own
    # epochs are committed, and an unchanged best.pt keeps its entry from this run's earlier epoch
    nlls = [1.0, 0.5, 0.2]
    save_run_checkpoints(tmp_path, _synthetic(3, nlls), _synthetic(3, nlls))
    for damage in (False, True):
        if damage:
            (tmp_path / MANIFEST).write_text("{not json")
        save_run_checkpoints(tmp_path, _synthetic(1, [0.9, 1.0]), _synthetic(1, [0.9, 1.0]))
        save_run_checkpoints(tmp_path, _synthetic(2, [0.9, 1.0]))  # not improved: best.pt stays epoch 1
        last, best = load_checkpoint(tmp_path / "last.pt"), load_checkpoint(tmp_path / "best.pt")
        check_pair(last, best, tmp_path / "last.pt", tmp_path / "best.pt")
        assert (last["epoch"], best["epoch"]) == (2, 1)
