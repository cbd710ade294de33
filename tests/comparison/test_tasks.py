"""The comparison's tasks: the validation split drawn with the run's seed, fixed test, shifted and OOD sets (loaded
once per process), the Transformer input and the task's hyperparameters."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gpattn.comparison import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASK_DEFAULTS, TASKS, load_task, tasks
from gpattn.data import load_digits_splits
from gpattn.data.mnist1d import MNIST1D_NOISE_FAMILIES, MNIST1D_SHIFT_KINDS, load_mnist1d
from gpattn.models import Transformer


def test_pointer_task():
    task = load_task("pointer")
    assert (len(task.train), len(task.val), len(task.test)) == (2048, 256, 512)
    assert task.num_classes == 2 and task.shifted == {} and task.ood == {}
    assert task.model_kwargs == {"input": "tokens", "vocab_size": 8, "max_len": 8}
    lengths = task.train.mask.sum(-1)
    assert lengths.min() == 4 and lengths.max() == 8
    assert torch.equal(load_task("pointer").train.tokens, task.train.tokens)  # fixed seeds


def test_digits_task():
    task = load_task("digits")
    splits = load_digits_splits(seed=0, val_seed=0)
    assert torch.equal(task.test.images, splits.test.images) and task.num_classes == 8
    assert torch.equal(task.val.images, splits.val.images) and torch.equal(task.train.labels, splits.train.labels)
    assert task.seed == 0 and task.defaults == {} and task.num_inducing is None
    assert sorted(task.shifted) == sorted(
        (kind, s) for kind in ("blur", "gaussian_noise", "rotation") for s in range(1, 6)
    )
    assert all(torch.equal(shifted.labels, task.test.labels) for shifted in task.shifted.values())
    assert set(task.ood) == {"held_out", "noise"} and len(task.ood["noise"]) == len(task.test)
    assert set(task.ood["held_out"].class_names) == {"8", "9"}
    assert task.model_kwargs == {"input": "patches", "image_size": 8, "patch_size": 2, "in_channels": 1}


@functools.cache
def _loaded(task: str, test_size: int | None = None, seed: int = 0):
    # MNIST-1D's 25 shifted test sets take seconds to generate: once per test module, and on 100 sequences
    return load_task(task, seed, test_size)


@pytest.mark.parametrize("task", ["digits", "mnist1d"])
def test_the_validation_split_varies_with_the_seed_and_nothing_else_does(task):
    size = 100 if task == "mnist1d" else None
    first, second = _loaded(task, size, 0), _loaded(task, size, 1)
    assert (first.seed, second.seed) == (0, 1)
    assert not torch.equal(_inputs(first.val), _inputs(second.val))
    assert len(first.val) == len(second.val) and torch.equal(
        first.val.labels.bincount(), second.val.labels.bincount()
    )  # stratified: as many of every class
    # the training and validation splits share out the same examples
    pooled = [torch.cat([_inputs(t.train), _inputs(t.val)]).flatten(1) for t in (first, second)]
    assert torch.equal(*(p[torch.from_numpy(np.lexsort(p.numpy().T[::-1]))] for p in pooled))
    # the test, shifted and OOD sets are those of every seed: the very same objects (built once per process)
    assert second.test is first.test
    assert second.shifted.keys() == first.shifted.keys()
    assert all(second.shifted[key] is first.shifted[key] for key in first.shifted)
    assert all(second.ood[name] is first.ood[name] for name in first.ood)
    with pytest.raises(ValueError, match="seed"):
        load_task(task, -1)
    with pytest.raises(ValueError, match=r"at most 2\*\*64 - 1"):  # one seed range for every task
        load_task(task, 2**64)


def _inputs(dataset):
    return dataset.tokens if hasattr(dataset, "tokens") else dataset.images


def test_another_seed_generates_no_shifted_set_again(monkeypatch):
    _loaded("mnist1d", 100, 0)

    def refuse(*args, **kwargs):
        raise AssertionError("the shifted sets were generated again")

    monkeypatch.setattr(tasks, "make_mnist1d_shifted_test_sets", refuse)
    assert len(load_task("mnist1d", 5, test_size=100).shifted) == 26


def test_mnist1d_task(monkeypatch):
    task = _loaded("mnist1d", 100)
    assert (len(task.train), len(task.val), len(task.test)) == (3601, 399, 100) and task.num_classes == 10
    # the standard data: the test split is make_dataset's x_test in order, as signals of 40 values
    from mnist1d.data import get_dataset_args, make_dataset

    standard = make_dataset(get_dataset_args())
    assert task.test.tokens.shape == (100, 40, 1)
    np.testing.assert_array_equal(task.test.tokens[..., 0].numpy(), standard["x_test"][:100].astype(np.float32))
    np.testing.assert_array_equal(task.test.labels.numpy(), standard["y_test"][:100])
    splits = load_mnist1d(seed=0, val_fraction=0.1, patch_size=1)
    assert torch.equal(task.train.tokens, splits.train.tokens) and torch.equal(task.val.labels, splits.val.labels)
    # the convolutional stem of the protocol: kernel 5, stride 2, 2 layers -> 20 tokens
    assert task.model_kwargs == {"input": "signal", "input_dim": 1, "max_len": 40}
    model = Transformer(10, embed_dim=32, depth=2, num_heads=2, attention="softmax", **task.model_kwargs)
    assert model.max_len == 20 and model(task.test.tokens[:3]).shape == (3, 10)
    assert task.defaults == TASK_DEFAULTS["mnist1d"] == {"dropout": 0.1, "num_inducing": 5}
    assert task.num_inducing == 5  # a KSVD rank well below the 20 tokens
    expected = {(kind, s) for kind in MNIST1D_SHIFT_KINDS for s in range(1, 6)} | {("shuffled", 1)}
    assert set(task.shifted) == expected
    assert all(torch.equal(shifted.labels, task.test.labels) for shifted in task.shifted.values())
    shuffled = task.shifted[("shuffled", 1)].tokens.reshape(100, 40)
    # the same values per sequence, in another order
    torch.testing.assert_close(shuffled.sort(-1).values, task.test.tokens.reshape(100, 40).sort(-1).values)
    assert not torch.equal(shuffled, task.test.tokens.reshape(100, 40))
    # OOD: the noise sequences, one set per family (sequence i of the 100 is of family i mod 3)
    assert list(task.ood) == list(MNIST1D_NOISE_FAMILIES)
    assert [len(family) for family in task.ood.values()] == [34, 33, 33]
    assert all(torch.all(family.labels == k) for k, family in enumerate(task.ood.values()))
    assert all(family.tokens.shape[1:] == (40, 1) for family in task.ood.values())
    # without test_size: the whole standard test split (shift generation stubbed out: its sets are checked above)
    monkeypatch.setattr(tasks, "make_mnist1d_shifted_test_sets", lambda splits, seed: {})
    tasks._fixed_sets.cache_clear()  # the stub's sets must not stay in the process's cache
    try:
        full = load_task("mnist1d")
    finally:
        tasks._fixed_sets.cache_clear()
    assert len(full.test) == sum(map(len, full.ood.values())) == len(full.shifted[("shuffled", 1)]) == 1000
    np.testing.assert_array_equal(full.test.labels.numpy(), standard["y_test"])


def test_published_accuracies_are_the_mnist1d_readme_numbers():
    assert PUBLISHED_ACCURACIES == {
        "mnist1d": {"logistic regression": 0.32, "MLP": 0.68, "CNN": 0.94, "GRU": 0.91, "human": 0.96}
    }


def test_unknown_task():
    assert TASKS == ("pointer", "digits", "mnist1d") and DEFAULT_TASKS == ("mnist1d", "digits")
    with pytest.raises(ValueError, match=r"expected task to be one of \['pointer', 'digits', 'mnist1d'\], got 'x'"):
        load_task("x")


@pytest.mark.parametrize("task", TASKS)
def test_test_size_keeps_the_first_test_sequences(task):
    small, full = load_task(task, test_size=50), _loaded(task, None if task != "mnist1d" else 100)
    assert small.test is not full.test and small.seed == full.seed == 0
    assert len(small.test) == 50 and torch.equal(small.train.labels, full.train.labels)
    assert torch.equal(small.test.labels, full.test.labels[:50])
    for key, dataset in small.shifted.items():
        assert len(dataset) == 50 and torch.equal(dataset.labels, small.test.labels)
        if task == "mnist1d" and key[0] != "shuffled":  # regenerated from the first 50 digits, another draw
            continue
        inputs = getattr(dataset, "tokens", None)
        expected = getattr(full.shifted[key], "tokens", None)
        if inputs is None:
            inputs, expected = dataset.images, full.shifted[key].images
        assert torch.equal(inputs, expected[:50])
    if task == "mnist1d":  # the families of 50 noise sequences
        assert [len(dataset) for dataset in small.ood.values()] == [17, 17, 16]
    else:
        assert all(len(dataset) == min(50, len(full.ood[name])) for name, dataset in small.ood.items())
    with pytest.raises(ValueError, match="test_size"):
        load_task(task, test_size=0)


def test_a_numpy_seed_is_stored_as_a_python_int():
    # load_task("pointer", np.int64(3)).seed stayed a NumPy integer (TaskData.seed reaches the records)
    task = load_task("pointer", np.int64(3), np.int64(4))
    assert type(task.seed) is int and task.seed == 3 and len(task.test) == 4
