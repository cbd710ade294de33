"""Loaders for CIFAR-10 and CIFAR-10-C files a user already has (nothing is downloaded).

* :func:`load_cifar10`: the "CIFAR-10 python version" (``cifar-10-python.tar.gz``, extracted): a folder with
  ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``, each a pickled dict; a batch holds
  ``b"data"`` ``uint8 (n, 3072)`` (per image the 1024 red, then green, then blue values, rows top to bottom) and
  ``b"labels"`` (n ints), the meta file ``b"label_names"``. ``root`` may be that folder or its parent holding
  ``cifar-10-batches-py``.
* :func:`load_cifar10_c`: CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019): a folder with ``<corruption>.npy``,
  ``uint8 (5 m, 32, 32, 3)`` = severities 1..5 stacked (``m = 10000``), and ``labels.npy`` (``5 m`` labels, the test
  labels repeated per severity). ``root`` may be that folder or its parent holding ``CIFAR-10-C``.

A file that cannot be used (empty, truncated, not a pickle or ``.npy`` of the expected kind, labels that are not
integers or out of range, class names that are not a list of names, batches without a single image) raises
:class:`DataFileError` (a ``ValueError``) naming the file and what is wrong.

Both return :class:`~gpattn.data.ImageDataset` with ``float32 (n, 3, 32, 32)`` images in ``[0, 1]`` (the
layout of :class:`~gpattn.models.Transformer` with ``input="patches"``, see ``VIT_CIFAR_PRESET``) and int64 labels.

The batches are Python pickles, read by an unpickler that only builds dicts, lists, bytes, numbers and NumPy arrays
(any other class in the file is an error); still, only load files from a source you trust.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from .image_dataset import ImageDataset

__all__ = ["CIFAR10_CLASSES", "CIFAR10_C_CORRUPTIONS", "DataFileError", "load_cifar10", "load_cifar10_c"]

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


class DataFileError(ValueError):
    """A data file cannot be used: empty, truncated, not of the expected format, or holding values of the wrong kind
    (e.g. non-integer labels). The message names the file and what is wrong."""


#: The globals a CIFAR-10 python batch may refer to (NumPy arrays and scalars, Python 2 byte strings).
_PICKLE_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    *((f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no CIFAR-10 batch holds")
        return super().find_class(module, name)


def _describe(path: Path) -> str:
    try:
        return f"{path} ({path.stat().st_size} bytes)"
    except OSError:
        return str(path)


def _integer_labels(labels, path: Path, key: str) -> np.ndarray:
    """``labels`` as int64, or a :class:`DataFileError` when they are not integers (never truncated)."""
    try:
        raw = np.asarray(labels)
    except (ValueError, TypeError) as error:  # ragged or odd objects
        raise DataFileError(f"the labels {key} in {path} are not a flat list of integers ({error})") from error
    if raw.size and raw.dtype.kind not in "iu":
        flat = raw.reshape(-1)
        example = flat[0]
        if raw.dtype.kind == "f":  # the first fractional value, when there is one
            fractional = np.flatnonzero(np.isfinite(flat) & (flat != np.round(flat)))
            example = flat[fractional[0] if fractional.size else 0]
        example = example.item() if isinstance(example, np.generic) else example
        raise DataFileError(
            f"the labels {key} in {path} are {raw.dtype} (e.g. {example!r}), expected integers: non-integer labels "
            f"are never truncated silently"
        )
    return raw.astype(np.int64)


def _resolve(root: str | Path, subfolder: str, expected: list[str], what: str) -> Path:
    """``root`` or ``root / subfolder``, whichever holds all ``expected`` files; else a FileNotFoundError (a TypeError
    for a ``root`` that is not a path)."""
    if not isinstance(root, (str, os.PathLike)):  # Path(None) said "expected str, bytes or os.PathLike object"
        raise TypeError(f"{what}: expected root to be a folder path (str or pathlib.Path), got {root!r}")
    root = Path(root).expanduser()  # "~/data" is the user's folder, as the shell reads it
    folders = (root, root / subfolder)
    for folder in folders:
        if all((folder / name).is_file() for name in expected):
            return folder
    # the files missing from the folder that holds most of them (a partly extracted subfolder under the given parent
    # named every file as missing, which read as a wrong folder)
    found = max(folders, key=lambda folder: sum((folder / name).is_file() for name in expected))
    missing = [name for name in expected if not (found / name).is_file()]
    raise FileNotFoundError(
        f"{what}: expected the files {expected} in {str(root)!r} (or in {str(root / subfolder)!r}); missing from "
        f"{str(found)!r}: {missing}. Nothing is downloaded: point root at an extracted copy."
    )


def _check_label_range(labels: np.ndarray, classes: int, path: Path, offset: int = 0) -> None:
    """A :class:`DataFileError` naming the first label outside ``0..classes - 1`` (its value and its row, counted from
    ``offset`` in the file), if there is one. O(n)."""
    outside = np.flatnonzero((labels < 0) | (labels >= classes))
    if outside.size:
        first = int(outside[0])
        raise DataFileError(
            f"labels in {path} outside 0..{classes - 1}: {outside.size} of them, the first {int(labels[first])} at "
            f"row {offset + first}"
        )


def _unpickle(path: Path) -> dict:
    """The pickled dict in ``path`` (a CIFAR-10 batch or meta file), or a :class:`DataFileError` saying why not."""
    data = path.read_bytes()
    if not data:
        raise DataFileError(f"{path} is empty (0 bytes): expected a pickled CIFAR-10 batch; re-extract the archive")
    try:
        content = _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as error:  # EOFError (truncated), UnpicklingError (garbage), ValueError, ... of a damaged file
        detail = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        raise DataFileError(
            f"could not unpickle {path} ({len(data)} bytes; {detail}): it is truncated, damaged or not a CIFAR-10 "
            f"python batch; re-extract cifar-10-python.tar.gz"
        ) from error
    if not isinstance(content, dict):
        raise DataFileError(f"expected {path} to hold a pickled dict, got {type(content).__name__}")
    return content


def _load_npy(path: Path) -> np.ndarray:
    """The array in the ``.npy`` file ``path``, memory-mapped, or a :class:`DataFileError` saying why not."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as error:  # ValueError (empty, truncated, pickled objects), OSError, EOFError, ...
        detail = f"{type(error).__name__}: {error}".splitlines()[0] if str(error) else type(error).__name__
        raise DataFileError(
            f"could not read {_describe(path)} as a .npy array ({detail}): it is empty, truncated, damaged or not "
            f"a NumPy .npy file; re-extract CIFAR-10-C.tar"
        ) from error


def _get(content: dict, key: str, path: Path):
    for candidate in (key.encode(), key):
        if candidate in content:
            return content[candidate]
    raise DataFileError(f"expected {path} to hold the key b{key!r}, found {sorted(map(repr, content))}")


def _class_names(names, path: Path) -> tuple[str, ...]:
    """The ``b"label_names"`` of the meta file as strings: a non-empty list (or tuple, or 1-D string array) of
    byte or text strings, else a :class:`DataFileError` (a byte string alone would read as its character codes)."""
    if isinstance(names, np.ndarray) and names.ndim == 1 and names.dtype.kind in "SU":
        names = names.tolist()
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(name, (bytes, str)) for name in names):
        shown = repr(names)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise DataFileError(
            f"expected b'label_names' in {path} to be a non-empty list of class names (byte strings), got "
            f"{type(names).__name__} {shown}"
        )
    try:
        return tuple(name.decode() if isinstance(name, bytes) else name for name in names)
    except UnicodeDecodeError as error:
        raise DataFileError(f"the class names b'label_names' in {path} are not UTF-8 text ({error})") from error


def _to_float_images(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(torch.float32).div_(255.0)


def load_cifar10(root: str | Path, split: str = "train") -> ImageDataset:
    """Load CIFAR-10 from the python-pickle batches under ``root`` (no download).

    :param root: Folder with ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta`` (or its
        parent holding ``cifar-10-batches-py``).
    :param split: ``"train"`` (the five data batches, in order) or ``"test"`` (``test_batch``).
    :return: ``float32 (n, 3, 32, 32)`` images in ``[0, 1]`` and int64 labels; class names from ``batches.meta``.
    :raises FileNotFoundError: When a required file is missing (the message lists the expected files).
    :raises TypeError: For a ``root`` that is not a ``str`` or path-like.
    :raises ValueError: For an unknown split.
    :raises DataFileError: For a file that is empty, truncated, not a pickled batch, of the wrong format, or with
        labels that are not integers in ``0..9``, a meta file whose ``b"label_names"`` is not a non-empty list of
        names, or batches that hold no image at all (the message names the file or files).
    """
    if split not in ("train", "test"):
        raise ValueError(f'expected split "train" or "test", got {split!r}')
    batches = _TRAIN_FILES if split == "train" else _TEST_FILES
    folder = _resolve(root, "cifar-10-batches-py", [*batches, _META_FILE], f"CIFAR-10 ({split})")

    meta_path = folder / _META_FILE
    class_names = _class_names(_get(_unpickle(meta_path), "label_names", meta_path), meta_path)

    images, labels = [], []
    for name in batches:
        path = folder / name
        content = _unpickle(path)
        data = np.asarray(_get(content, "data", path))
        batch_labels = _integer_labels(_get(content, "labels", path), path, "b'labels'")
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise DataFileError(f"expected b'data' in {path} to be uint8 (n, 3072), got {data.dtype} {data.shape}")
        if batch_labels.shape != (data.shape[0],):
            raise DataFileError(f"expected {data.shape[0]} labels in {path}, got shape {batch_labels.shape}")
        _check_label_range(batch_labels, len(class_names), path)
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(batch_labels)
    if not sum(len(batch) for batch in images):
        paths = ", ".join(str(folder / name) for name in batches)
        what = f"batches {paths} hold" if len(batches) > 1 else f"batch {paths} holds"
        raise DataFileError(
            f"the CIFAR-10 {split} {what} no image (b'data' of shape (0, 3072)): expected at least one; re-extract "
            f"cifar-10-python.tar.gz"
        )
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
    :raises TypeError: For a ``root`` that is not a ``str`` or path-like.
    :raises ValueError: For an unknown corruption or a bad severity.
    :raises DataFileError: For a file that is empty, truncated or not a ``.npy`` array, arrays of the wrong shape or
        type or without a single image, or labels that are not integers in ``0..9`` (the message names the file).
    """
    if corruption not in CIFAR10_C_CORRUPTIONS:
        raise ValueError(f"unknown CIFAR-10-C corruption {corruption!r}; expected one of {CIFAR10_C_CORRUPTIONS}")
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or not 1 <= severity <= 5:
        raise ValueError(f"expected an integer severity in 1..5, got {severity!r}")
    severity = int(severity)
    folder = _resolve(root, "CIFAR-10-C", [f"{corruption}.npy", "labels.npy"], f"CIFAR-10-C ({corruption})")

    data_path, labels_path = folder / f"{corruption}.npy", folder / "labels.npy"
    data = _load_npy(data_path)
    all_labels = _load_npy(labels_path)
    if data.dtype != np.uint8 or data.ndim != 4 or data.shape[1:] != (32, 32, 3) or data.shape[0] % 5:
        raise DataFileError(
            f"expected {data_path} to be uint8 (5 m, 32, 32, 3) (5 severities stacked), got {data.dtype} {data.shape}"
        )
    if not data.shape[0]:  # as the CIFAR-10 batches: no image is a damaged file, not an empty data set
        raise DataFileError(f"{data_path} holds no image (shape {data.shape}): expected 5 m images, m at least 1")
    if all_labels.shape != (data.shape[0],):
        raise DataFileError(f"expected {labels_path} to hold {data.shape[0]} labels, got shape {all_labels.shape}")
    block = data.shape[0] // 5
    rows = slice((severity - 1) * block, severity * block)
    labels = _integer_labels(all_labels[rows], labels_path, "array")
    _check_label_range(labels, len(CIFAR10_CLASSES), labels_path, offset=rows.start)
    images = np.asarray(data[rows]).transpose(0, 3, 1, 2)  # (m, 32, 32, 3) -> (m, 3, 32, 32)
    return ImageDataset(
        _to_float_images(images),
        torch.from_numpy(labels),
        len(CIFAR10_CLASSES),
        CIFAR10_CLASSES,
        f"CIFAR-10-C {corruption} severity {severity} from {folder}",
    )
