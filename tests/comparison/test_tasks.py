"""The comparison's tasks: fixed splits, shifted and OOD sets, the Transformer input."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gpattn.comparison import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASKS, load_task, tasks
from gpattn.data import load_digits_splits
from gpattn.data.mnist1d import MNIST1D_SHIFT_KINDS, load_mnist1d


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
    splits = load_digits_splits(seed=0)
    assert torch.equal(task.test.images, splits.test.images) and task.num_classes == 8
    assert sorted(task.shifted) == sorted(
        (kind, s) for kind in ("blur", "gaussian_noise", "rotation") for s in range(1, 6)
    )
    assert all(torch.equal(shifted.labels, task.test.labels) for shifted in task.shifted.values())
    assert set(task.ood) == {"held_out", "noise"} and len(task.ood["noise"]) == len(task.test)
    assert set(task.ood["held_out"].class_names) == {"8", "9"}
    assert task.model_kwargs == {"input": "patches", "image_size": 8, "patch_size": 2, "in_channels": 1}


@functools.cache
def _loaded(task: str, test_size: int | None = None):
    # MNIST-1D's 25 shifted test sets take seconds to generate: once per test module, and on 100 sequences
    return load_task(task, test_size)


def test_mnist1d_task(monkeypatch):
    task = _loaded("mnist1d", 100)
    assert (len(task.train), len(task.val), len(task.test)) == (3601, 399, 100) and task.num_classes == 10
    # the standard data: the test split is make_dataset's x_test in order, as 10 tokens of 4 values
    from mnist1d.data import get_dataset_args, make_dataset

    standard = make_dataset(get_dataset_args())
    np.testing.assert_array_equal(
        task.test.tokens.reshape(100, 40).numpy(), standard["x_test"][:100].astype(np.float32)
    )
    np.testing.assert_array_equal(task.test.labels.numpy(), standard["y_test"][:100])
    splits = load_mnist1d(seed=0, val_fraction=0.1, patch_size=4)
    assert torch.equal(task.train.tokens, splits.train.tokens) and torch.equal(task.val.labels, splits.val.labels)
    assert task.model_kwargs == {"input": "vectors", "input_dim": 4, "max_len": 10}
    assert task.num_inducing == 5  # a KSVD rank below the 10 tokens
    expected = {(kind, s) for kind in MNIST1D_SHIFT_KINDS for s in range(1, 6)} | {("shuffled", 1)}
    assert set(task.shifted) == expected
    assert all(torch.equal(shifted.labels, task.test.labels) for shifted in task.shifted.values())
    shuffled = task.shifted[("shuffled", 1)].tokens.reshape(100, 40)
    # the same values per sequence, in another order
    torch.testing.assert_close(shuffled.sort(-1).values, task.test.tokens.reshape(100, 40).sort(-1).values)
    assert not torch.equal(shuffled, task.test.tokens.reshape(100, 40))
    assert set(task.ood) == {"noise"} and len(task.ood["noise"]) == 100
    assert task.ood["noise"].tokens.shape == (100, 10, 4)
    # without test_size: the whole standard test split (shift generation stubbed out: its sets are checked above)
    monkeypatch.setattr(tasks, "make_mnist1d_shifted_test_sets", lambda splits, seed: {})
    full = load_task("mnist1d")
    assert len(full.test) == len(full.ood["noise"]) == len(full.shifted[("shuffled", 1)]) == 1000
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
    assert all(len(dataset) == min(50, len(full.ood[name])) for name, dataset in small.ood.items())
    with pytest.raises(ValueError, match="test_size"):
        load_task(task, test_size=0)
