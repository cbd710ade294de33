"""The image classification data set every image loader returns (the digits, their shifts and noise OOD images,
CIFAR-10 and CIFAR-10-C)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["ImageDataset"]


@dataclass(frozen=True)
class ImageDataset:
    """An image classification data set.

    Attributes:
        images: ``float32 (n, C, H, W)`` in ``[0, 1]``.
        labels: Class indices ``(n,)`` (int64), indices into ``class_names``.
        num_classes: Number of classes (``len(class_names)``).
        class_names: Name of every class index.
        description: Where the images come from.

    Example:
        >>> import torch
        >>> images = torch.rand(5, 3, 4, 6)
        >>> dataset = ImageDataset(images, torch.zeros(5, dtype=torch.long), 2, ("cat", "dog"), "random pixels")
        >>> len(dataset), dataset.in_channels, dataset.image_size
        (5, 3, (4, 6))
    """

    images: Tensor
    labels: Tensor
    num_classes: int
    class_names: tuple[str, ...]
    description: str

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def in_channels(self) -> int:
        """``C``, the second dimension of ``images``."""
        return self.images.shape[1]

    @property
    def image_size(self) -> tuple[int, int]:
        """``(H, W)``, the last two dimensions of ``images``."""
        return (self.images.shape[2], self.images.shape[3])
