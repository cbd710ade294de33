"""Loaders for CIFAR-10 and CIFAR-10-C files a user already has (nothing is downloaded).

* :func:`load_cifar10`: the "CIFAR-10 python version" (``cifar-10-python.tar.gz``, extracted): a folder with
  ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``, each a pickled dict; a batch holds
  ``b"data"`` ``uint8 (n, 3072)`` (per image the 1024 red, then green, then blue values, rows top to bottom) and
  ``b"labels"`` (n ints), the meta file ``b"label_names"``. ``root`` may be that folder or its parent holding
  ``cifar-10-batches-py``.
* :func:`load_cifar10_c`: CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019): a folder with ``<corruption>.npy``,
  ``uint8 (5 m, 32, 32, 3)`` = severities 1..5 stacked (``m = 10000``), and ``labels.npy`` (``5 m`` labels, the test
  labels repeated per severity). ``root`` may be that folder or its parent holding ``CIFAR-10-C``.

Both return :class:`~gpattn.data.ImageDataset` with ``float32 (n, 3, 32, 32)`` images in ``[0, 1]`` (the
layout of :class:`~gpattn.models.Transformer` with ``input="patches"``, see ``VIT_CIFAR_PRESET``) and int64 labels.

The batches are Python pickles: only load files from a source you trust.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from .image_dataset import ImageDataset

__all__ = ["CIFAR10_CLASSES", "CIFAR10_C_CORRUPTIONS", "load_cifar10", "load_cifar10_c"]

#: The ten CIFAR-10 class names, in label order.
CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
#: The corruptions of CIFAR-10-C (one ``<corruption>.npy`` file each), as ``load_cifar10_c`` accepts them.
CIFAR10_C_CORRUPTIONS: tuple[str, ...] = (
    # the 15 benchmark corruptions
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
    # the 4 extra (validation) corruptions shipped with the data set
    "speckle_noise",
    "gaussian_blur",
    "spatter",
    "saturate",
)
_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
_TEST_FILES = ("test_batch",)
_META_FILE = "batches.meta"


def _resolve(root: str | Path, subfolder: str, expected: list[str], what: str) -> Path:
    """``root`` or ``root / subfolder``, whichever holds all ``expected`` files; else a FileNotFoundError."""
    root = Path(root)
    for folder in (root, root / subfolder):
        if all((folder / name).is_file() for name in expected):
            return folder
    missing = [name for name in expected if not (root / name).is_file()]
    raise FileNotFoundError(
        f"{what}: expected the files {expected} in {str(root)!r} (or in {str(root / subfolder)!r}); missing "
        f"{missing}. Nothing is downloaded: point root at an extracted copy."
    )


def _unpickle(path: Path) -> dict:
    with path.open("rb") as handle:
        content = pickle.load(handle, encoding="bytes")
    if not isinstance(content, dict):
        raise ValueError(f"expected {path} to hold a pickled dict, got {type(content).__name__}")
    return content


def _get(content: dict, key: str, path: Path):
    for candidate in (key.encode(), key):
        if candidate in content:
            return content[candidate]
    raise ValueError(f"expected {path} to hold the key b{key!r}, found {sorted(map(repr, content))}")


def _to_float_images(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(torch.float32).div_(255.0)


def load_cifar10(root: str | Path, split: str = "train") -> ImageDataset:
    """Load CIFAR-10 from the python-pickle batches under ``root`` (no download).

    :param root: Folder with ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta`` (or its
        parent holding ``cifar-10-batches-py``).
    :param split: ``"train"`` (the five data batches, in order) or ``"test"`` (``test_batch``).
    :return: ``float32 (n, 3, 32, 32)`` images in ``[0, 1]`` and int64 labels; class names from ``batches.meta``.
    :raises FileNotFoundError: When a required file is missing (the message lists the expected files).
    :raises ValueError: For an unknown split or a batch of the wrong format.
    """
    if split not in ("train", "test"):
        raise ValueError(f'expected split "train" or "test", got {split!r}')
    batches = _TRAIN_FILES if split == "train" else _TEST_FILES
    folder = _resolve(root, "cifar-10-batches-py", [*batches, _META_FILE], f"CIFAR-10 ({split})")

    meta_path = folder / _META_FILE
    names = _get(_unpickle(meta_path), "label_names", meta_path)
    class_names = tuple(name.decode() if isinstance(name, bytes) else str(name) for name in names)

    images, labels = [], []
    for name in batches:
        path = folder / name
        content = _unpickle(path)
        data = np.asarray(_get(content, "data", path))
        batch_labels = np.asarray(_get(content, "labels", path), dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"expected b'data' in {path} to be uint8 (n, 3072), got {data.dtype} {data.shape}")
        if batch_labels.shape != (data.shape[0],):
            raise ValueError(f"expected {data.shape[0]} labels in {path}, got shape {batch_labels.shape}")
        if batch_labels.size and (batch_labels.min() < 0 or batch_labels.max() >= len(class_names)):
            raise ValueError(f"labels in {path} outside 0..{len(class_names) - 1}")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(batch_labels)
    return ImageDataset(
        _to_float_images(np.concatenate(images)),
        torch.from_numpy(np.concatenate(labels)),
        len(class_names),
        class_names,
        f"CIFAR-10 {split} split from {folder}",
    )


def load_cifar10_c(root: str | Path, corruption: str, severity: int) -> ImageDataset:
    """Load the images of one CIFAR-10-C corruption at one severity (no download).

    The ``.npy`` file is memory-mapped, so only the requested severity's block is read.

    :param root: Folder with ``<corruption>.npy`` and ``labels.npy`` (or its parent holding ``CIFAR-10-C``).
    :param corruption: One of ``CIFAR10_C_CORRUPTIONS``.
    :param severity: ``1 .. 5``; block ``severity - 1`` of the 5 stacked blocks (10000 images each in the real set).
    :return: ``float32 (m, 3, 32, 32)`` images in ``[0, 1]`` and int64 labels, CIFAR-10 class names.
    :raises FileNotFoundError: When a file is missing (the message lists the expected files).
    :raises ValueError: For an unknown corruption, a bad severity, or arrays of the wrong shape or type.
    """
    if corruption not in CIFAR10_C_CORRUPTIONS:
        raise ValueError(f"unknown CIFAR-10-C corruption {corruption!r}; expected one of {CIFAR10_C_CORRUPTIONS}")
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or not 1 <= severity <= 5:
        raise ValueError(f"expected an integer severity in 1..5, got {severity!r}")
    severity = int(severity)
    folder = _resolve(root, "CIFAR-10-C", [f"{corruption}.npy", "labels.npy"], f"CIFAR-10-C ({corruption})")

    data_path, labels_path = folder / f"{corruption}.npy", folder / "labels.npy"
    data = np.load(data_path, mmap_mode="r")
    all_labels = np.load(labels_path, mmap_mode="r")
    if data.dtype != np.uint8 or data.ndim != 4 or data.shape[1:] != (32, 32, 3) or data.shape[0] % 5:
        raise ValueError(
            f"expected {data_path} to be uint8 (5 m, 32, 32, 3) (5 severities stacked), got {data.dtype} {data.shape}"
        )
    if all_labels.shape != (data.shape[0],):
        raise ValueError(f"expected {labels_path} to hold {data.shape[0]} labels, got shape {all_labels.shape}")
    block = data.shape[0] // 5
    rows = slice((severity - 1) * block, severity * block)
    labels = np.asarray(all_labels[rows], dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= len(CIFAR10_CLASSES)):
        raise ValueError(f"labels in {labels_path} outside 0..{len(CIFAR10_CLASSES) - 1}")
    images = np.asarray(data[rows]).transpose(0, 3, 1, 2)  # (m, 32, 32, 3) -> (m, 3, 32, 32)
    return ImageDataset(
        _to_float_images(images),
        torch.from_numpy(labels),
        len(CIFAR10_CLASSES),
        CIFAR10_CLASSES,
        f"CIFAR-10-C {corruption} severity {severity} from {folder}",
    )
