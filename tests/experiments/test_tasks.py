"""The comparison's tasks: fixed splits, shifted and OOD sets, the Transformer input."""

from __future__ import annotations

import pytest
import torch

from gpattn.data import load_digits_splits
from gpattn.experiments import TASKS, load_task


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


def test_unknown_task():
    assert TASKS == ("pointer", "digits")
    with pytest.raises(ValueError, match=r"expected task to be one of \['pointer', 'digits'\], got 'cifar'"):
        load_task("cifar")
