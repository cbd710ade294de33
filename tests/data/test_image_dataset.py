"""The generic image data set returned by every image loader."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gpattn.data
from gpattn.data import ImageDataset, load_digits_splits, make_noise_ood
from gpattn.data.image_dataset import ImageDataset as DefinedHere


def test_sizes_come_from_the_image_tensor() -> None:
    images = torch.rand(7, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    dataset = ImageDataset(images, labels, 3, ("a", "b", "c"), "random pixels")
    assert len(dataset) == 7
    assert dataset.in_channels == 3
    assert dataset.image_size == (4, 6)
    assert dataset.images is images and dataset.labels is labels


def test_is_frozen() -> None:
    dataset = ImageDataset(torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), 1, ("0",), "one image")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dataset.num_classes = 2


def test_is_the_class_every_image_loader_returns() -> None:
    assert gpattn.data.ImageDataset is DefinedHere
    splits = load_digits_splits(seed=0)
    assert all(type(d) is DefinedHere for d in (splits.train, splits.val, splits.test, splits.ood_classes))
    assert type(make_noise_ood(4, seed=0)) is DefinedHere
