"""The comparison's tasks: fixed splits, shifted and OOD sets, the Transformer input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.data import load_digits_splits
from gpattn.data.mnist1d import MNIST1D_SHIFT_KINDS, load_mnist1d
from gpattn.experiments import DEFAULT_TASKS, PUBLISHED_ACCURACIES, TASKS, load_task


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


def test_mnist1d_task():
    task = load_task("mnist1d")
    assert (len(task.train), len(task.val), len(task.test)) == (
        3601,
        399,
        1000,
    ) and task.num_classes == 10  # 10 % of each class, rounded
    # the standard data: the test split is make_dataset's x_test in order, as 10 tokens of 4 values
    from mnist1d.data import get_dataset_args, make_dataset

    standard = make_dataset(get_dataset_args())
    np.testing.assert_array_equal(task.test.tokens.reshape(1000, 40).numpy(), standard["x_test"].astype(np.float32))
    np.testing.assert_array_equal(task.test.labels.numpy(), standard["y_test"])
    splits = load_mnist1d(seed=0, val_fraction=0.1, patch_size=4)
    assert torch.equal(task.train.tokens, splits.train.tokens) and torch.equal(task.val.labels, splits.val.labels)
    assert task.model_kwargs == {"input": "vectors", "input_dim": 4, "max_len": 10}
    assert task.num_inducing == 5  # a KSVD rank below the 10 tokens
    expected = {(kind, s) for kind in MNIST1D_SHIFT_KINDS for s in range(1, 6)} | {("shuffled", 1)}
    assert set(task.shifted) == expected
    assert all(torch.equal(shifted.labels, task.test.labels) for shifted in task.shifted.values())
    shuffled = task.shifted[("shuffled", 1)].tokens.reshape(1000, 40)
    # the same values per sequence, in another order
    torch.testing.assert_close(shuffled.sort(-1).values, task.test.tokens.reshape(1000, 40).sort(-1).values)
    assert not torch.equal(shuffled, task.test.tokens.reshape(1000, 40))
    assert set(task.ood) == {"noise"} and len(task.ood["noise"]) == 1000
    assert task.ood["noise"].tokens.shape == (1000, 10, 4)


def test_published_accuracies_are_the_mnist1d_readme_numbers():
    assert PUBLISHED_ACCURACIES == {
        "mnist1d": {"logistic regression": 0.32, "MLP": 0.68, "CNN": 0.94, "GRU": 0.91, "human": 0.96}
    }


def test_unknown_task():
    assert TASKS == ("pointer", "digits", "mnist1d") and DEFAULT_TASKS == ("mnist1d", "digits")
    with pytest.raises(ValueError, match=r"expected task to be one of \['pointer', 'digits', 'mnist1d'\], got 'x'"):
        load_task("x")
