"""CIFAR-10 / CIFAR-10-C loaders against tiny files written byte by byte in the published formats.

Every value is checked against what the test computed itself from the bytes it wrote: the pixel planes of a batch
row (1024 red, 1024 green, 1024 blue values, rows top to bottom) become ``(C, H, W)``, a CIFAR-10-C image
``(H, W, C)`` becomes ``(C, H, W)``, pixels are ``value / 255`` in float32, labels keep the batch order, severity
``s`` reads block ``s - 1``; the patches are compared with a hand loop. The failure modes a user meets (missing or
misplaced files, an archive not extracted, damaged pickles and ``.npy`` files, labels out of range, bad arguments)
must raise an error naming the file and the problem, never a bare pickle / NumPy traceback or another data set.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gpattn.data import (
    CIFAR10_C_CORRUPTIONS,
    CIFAR10_CLASSES,
    DataFileError,
    images_to_patches,
    load_cifar10,
    load_cifar10_c,
    patches_to_images,
)

TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
SIZES = {"data_batch_1": 2, "data_batch_2": 1, "data_batch_3": 3, "data_batch_4": 1, "data_batch_5": 2, "test_batch": 3}
M = 2  # images per CIFAR-10-C severity block


# --------------------------------------------------------------------------------------------------------- writers


class _Python2Pickler(pickle._Pickler):
    """Writes what Python 2's cPickle wrote (protocol 2): every ``str`` and ``bytes`` as a Python 2 byte string
    (``SHORT_BINSTRING`` / ``BINSTRING``), which Python 3 reads back as ``bytes`` with ``encoding="bytes"``."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_string(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = _save_py2_string
    dispatch[bytes] = _save_py2_string


def _python2_pickle(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    # Python 2's NumPy named its array constructor numpy.core.multiarray._reconstruct
    return buffer.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")


def _batch_dict(name: str, data: np.ndarray, labels, keys=bytes) -> dict:
    key = (lambda text: text.encode()) if keys is bytes else (lambda text: text)
    return {
        key("batch_label"): key(f"{name} of 5"),
        key("labels"): [int(label) for label in labels],
        key("data"): data,
        key("filenames"): [key(f"img_{i}.png") for i in range(len(labels))],
    }


def _meta_dict(keys=bytes) -> dict:
    key = (lambda text: text.encode()) if keys is bytes else (lambda text: text)
    return {
        key("num_cases_per_batch"): 10000,
        key("label_names"): [key(n) for n in CIFAR10_CLASSES],
        key("num_vis"): 3072,
    }


def _write_cifar10(folder: Path, style: str = "python3", seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The six batches and the meta file in ``folder``; ``style``: ``"python3"`` (bytes keys, pickle.dump),
    ``"python2"`` (cPickle's byte strings), ``"str_keys"`` (re-pickled with text keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    keys = str if style == "str_keys" else bytes
    dump = _python2_pickle if style == "python2" else (lambda obj: pickle.dumps(obj, protocol=2))
    written = {}
    for index, (name, n) in enumerate(SIZES.items()):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = (np.arange(n) + 3 * index) % 10  # distinct per batch: shows the order of the concatenation
        (folder / name).write_bytes(dump(_batch_dict(name, data, labels, keys)))
        written[name] = (data, labels)
    (folder / "batches.meta").write_bytes(dump(_meta_dict(keys)))
    return written


def _expected_from_rows(data: np.ndarray) -> np.ndarray:
    """A hand loop over the published layout: byte ``c * 1024 + i * 32 + j`` of a row is channel c, row i, column j."""
    out = np.empty((data.shape[0], 3, 32, 32), dtype=np.float32)
    for k in range(data.shape[0]):
        for c in range(3):
            for i in range(32):
                for j in range(32):
                    out[k, c, i, j] = np.float32(data[k, c * 1024 + i * 32 + j]) / np.float32(255)
    return out


def _write_cifar10_c(folder: Path, corruptions=("fog",), seed: int = 1) -> dict[str, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for corruption in corruptions:
        arrays[corruption] = rng.integers(0, 256, (5 * M, 32, 32, 3), dtype=np.uint8)
        np.save(folder / f"{corruption}.npy", arrays[corruption])
    arrays["labels"] = np.tile(np.array([7, 2], dtype=np.uint8), 5)
    arrays["labels"][::M] = np.arange(5, dtype=np.uint8)  # first label of block b is b: shows which block is read
    np.save(folder / "labels.npy", arrays["labels"])
    return arrays


@pytest.fixture
def cifar(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    return folder, _write_cifar10(folder)


@pytest.fixture
def cifar_c(tmp_path):
    folder = tmp_path / "CIFAR-10-C"
    return folder, _write_cifar10_c(folder)


# ------------------------------------------------------------------------------------------------------ the values


@pytest.mark.parametrize("as_type", [Path, str], ids=["Path", "str"])
def test_train_split_pixels_labels_and_order(cifar, as_type):
    folder, written = cifar
    train = load_cifar10(as_type(folder), "train")
    rows = np.concatenate([written[name][0] for name in TRAIN])
    labels = np.concatenate([written[name][1] for name in TRAIN])
    assert train.images.dtype == torch.float32 and train.images.shape == (9, 3, 32, 32)
    assert train.labels.dtype == torch.int64
    assert torch.equal(train.images, torch.from_numpy(_expected_from_rows(rows)))
    assert train.labels.tolist() == labels.tolist() == [0, 1, 3, 6, 7, 8, 9, 2, 3]
    assert train.class_names == CIFAR10_CLASSES and train.num_classes == 10 and len(train) == 9
    # one pixel by hand: image 3 (the first of data_batch_3), green plane, row 5, column 17
    assert train.images[3, 1, 5, 17].item() == pytest.approx(written["data_batch_3"][0][0, 1024 + 5 * 32 + 17] / 255)
    assert train.images.min() >= 0 and train.images.max() <= 1


def test_test_split_is_the_test_batch_only(cifar):
    folder, written = cifar
    test = load_cifar10(folder, "test")
    data, labels = written["test_batch"]
    assert torch.equal(test.images, torch.from_numpy(_expected_from_rows(data)))
    assert test.labels.tolist() == labels.tolist()


def test_pixel_scaling_hits_0_and_1_exactly(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar10(folder)
    data = np.zeros((2, 3072), dtype=np.uint8)
    data[0, :1024] = 255  # image 0 pure red
    data[1] = np.arange(3072) % 256
    (folder / "test_batch").write_bytes(pickle.dumps(_batch_dict("test_batch", data, [0, 9])))
    test = load_cifar10(folder, "test")
    assert torch.all(test.images[0, 0] == 1) and torch.all(test.images[0, 1:] == 0)
    # image 1, channel 2 row 3 column 4 is byte 2048 + 100 = 2148 -> 2148 % 256 = 100
    assert test.images[1, 2, 3, 4].item() == np.float32(100) / np.float32(255)


@pytest.mark.parametrize("style", ["python2", "str_keys"])
def test_other_pickle_styles_give_the_same_data(tmp_path, style):
    reference = load_cifar10(_write_parent(tmp_path / "ref"), "train")
    other_folder = tmp_path / style / "cifar-10-batches-py"
    _write_cifar10(other_folder, style=style)
    if style == "python2":  # really the byte-string opcodes of Python 2, and no Python 3 bytes encoding
        raw = (other_folder / "data_batch_1").read_bytes()
        assert pickle.SHORT_BINSTRING + bytes([4]) + b"data" in raw and b"_codecs" not in raw
    other = load_cifar10(other_folder, "train")
    assert torch.equal(other.images, reference.images) and torch.equal(other.labels, reference.labels)
    assert other.class_names == CIFAR10_CLASSES


def _write_parent(parent: Path) -> Path:
    _write_cifar10(parent / "cifar-10-batches-py")
    return parent


def test_parent_folder_is_accepted(cifar):
    folder, _ = cifar
    assert torch.equal(load_cifar10(folder.parent, "test").images, load_cifar10(folder, "test").images)


def test_tilde_in_the_path_is_expanded(tmp_path, monkeypatch):
    home = tmp_path / "home"
    _write_cifar10(home / "data" / "cifar-10-batches-py")
    _write_cifar10_c(home / "data" / "CIFAR-10-C")
    monkeypatch.setenv("HOME", str(home))
    assert Path("~/data").expanduser() == home / "data"
    assert len(load_cifar10("~/data", "test")) == 3
    assert len(load_cifar10_c("~/data", "fog", 1)) == M


@pytest.mark.parametrize("severity", [1, 2, 3, 4, 5])
def test_cifar10_c_reads_the_block_of_the_severity(cifar_c, severity):
    folder, arrays = cifar_c
    data = load_cifar10_c(folder, "fog", severity)
    block = arrays["fog"][(severity - 1) * M : severity * M]
    expected = np.empty((M, 3, 32, 32), dtype=np.float32)
    for k in range(M):
        for c in range(3):
            expected[k, c] = block[k, :, :, c].astype(np.float32) / np.float32(255)
    assert torch.equal(data.images, torch.from_numpy(expected))
    assert data.labels.dtype == torch.int64
    assert data.labels.tolist() == arrays["labels"][(severity - 1) * M : severity * M].tolist()
    assert data.labels[0].item() == severity - 1
    assert data.class_names == CIFAR10_CLASSES and data.num_classes == 10


def test_cifar10_c_fortran_order_and_big_endian_files_give_the_same_values(cifar_c, tmp_path):
    folder, arrays = cifar_c
    other = tmp_path / "other"
    other.mkdir()
    np.save(other / "fog.npy", np.asfortranarray(arrays["fog"]))
    np.save(other / "labels.npy", arrays["labels"].astype(">i8"))
    for severity in (1, 4):
        a, b = load_cifar10_c(folder, "fog", severity), load_cifar10_c(other, "fog", severity)
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_cifar10_c_parent_folder_and_numpy_integer_severity(cifar_c):
    folder, _ = cifar_c
    a = load_cifar10_c(folder.parent, "fog", np.int64(3))
    b = load_cifar10_c(str(folder), "fog", 3)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_patches_of_loaded_images_match_a_hand_reshape(cifar):
    folder, _ = cifar
    images = load_cifar10(folder, "test").images
    p = 4
    patches = images_to_patches(images, p)
    assert patches.shape == (3, 64, 3 * p * p)
    for k in range(images.shape[0]):
        for r in range(32 // p):
            for s in range(32 // p):
                hand = images[k, :, r * p : (r + 1) * p, s * p : (s + 1) * p].reshape(-1)  # (C, p, p) flattened
                assert torch.equal(patches[k, r * (32 // p) + s], hand)
    # the Conv2d(C, d, p, stride=p) embedding of the "patches" input equals a linear map of these vectors
    conv = torch.nn.Conv2d(3, 5, kernel_size=p, stride=p, bias=False)
    with torch.no_grad():
        by_conv = conv(images).flatten(2).transpose(1, 2)
        by_vectors = patches @ conv.weight.reshape(5, -1).T
    torch.testing.assert_close(by_vectors, by_conv, rtol=1e-5, atol=1e-5)
    assert torch.equal(patches_to_images(patches, 32, p, 3), images)


def test_a_file_changed_after_a_load_is_read_again(cifar, cifar_c):
    folder, written = cifar
    first = load_cifar10(folder, "test")
    data = np.full((1, 3072), 51, dtype=np.uint8)
    (folder / "test_batch").write_bytes(pickle.dumps(_batch_dict("test_batch", data, [4])))
    second = load_cifar10(folder, "test")
    assert len(first) == 3 and len(second) == 1 and second.labels.tolist() == [4]
    assert torch.all(second.images == np.float32(51) / np.float32(255))

    c_folder, arrays = cifar_c
    before = load_cifar10_c(c_folder, "fog", 2)
    np.save(c_folder / "fog.npy", 255 - arrays["fog"])
    after = load_cifar10_c(c_folder, "fog", 2)
    torch.testing.assert_close(after.images, 1 - before.images, rtol=0, atol=1e-6)


def test_no_disk_cache_entry_is_written_or_shared(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("GPATTN_CACHE_DIR", str(cache))
    a_folder, b_folder = tmp_path / "a" / "cifar-10-batches-py", tmp_path / "b" / "cifar-10-batches-py"
    _write_cifar10(a_folder, seed=0)
    _write_cifar10(b_folder, seed=1)
    a, b = load_cifar10(a_folder, "test"), load_cifar10(b_folder, "test")
    assert not torch.equal(a.images, b.images)  # two folders, two data sets
    assert not cache.exists() or not any(cache.iterdir())
    assert str(a_folder) in a.description and str(b_folder) in b.description


# ------------------------------------------------------------------------------------------- what a user gets wrong


def test_a_missing_batch_is_named(cifar):
    folder, _ = cifar
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError) as caught:
        load_cifar10(folder, "train")
    message = str(caught.value)
    assert "data_batch_3" in message.split("missing")[-1] and "data_batch_2" not in message.split("missing")[-1]
    assert load_cifar10(folder, "test").labels.numel() == 3  # the test split does not need it


def test_a_missing_batch_in_the_subfolder_is_named_when_root_is_the_parent(cifar):
    folder, _ = cifar
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError) as caught:
        load_cifar10(folder.parent, "train")
    missing = str(caught.value).split("missing")[-1]
    assert "data_batch_3" in missing and "data_batch_1" not in missing and "batches.meta" not in missing


def test_a_missing_labels_file_in_the_cifar10_c_subfolder_is_named_when_root_is_the_parent(cifar_c):
    folder, _ = cifar_c
    (folder / "labels.npy").unlink()
    with pytest.raises(FileNotFoundError) as caught:
        load_cifar10_c(folder.parent, "fog", 1)
    assert str(caught.value).endswith(
        f"missing from {str(folder)!r}: ['labels.npy']. Nothing is downloaded: point root at an extracted copy."
    )


def test_a_missing_batch_names_the_missing_files_for_cifar10_c(cifar_c):
    folder, _ = cifar_c
    with pytest.raises(FileNotFoundError, match=r"snow\.npy") as caught:
        load_cifar10_c(folder, "snow", 1)
    assert "labels.npy" not in str(caught.value).split("missing")[-1]
    (folder / "labels.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"labels\.npy"):
        load_cifar10_c(folder, "fog", 1)


@pytest.mark.parametrize("where", ["folder_with_tar", "tar_itself", "wrong_dataset", "nowhere"])
def test_a_wrong_folder_is_a_clear_file_not_found(tmp_path, cifar_c, where):
    tar = tmp_path / "downloads" / "cifar-10-python.tar.gz"
    tar.parent.mkdir()
    tar.write_bytes(b"\x1f\x8b\x08\x00 not extracted")
    root = {
        "folder_with_tar": tar.parent,
        "tar_itself": tar,
        "wrong_dataset": cifar_c[0],  # the CIFAR-10-C folder given to the CIFAR-10 loader
        "nowhere": tmp_path / "does-not-exist",
    }[where]
    with pytest.raises(FileNotFoundError) as caught:
        load_cifar10(root, "train")
    message = str(caught.value)
    assert str(root) in message and "data_batch_1" in message and "batches.meta" in message
    assert "extract" in message and "cifar-10-batches-py" in message


def test_cifar10_c_given_the_cifar10_folder_is_a_clear_file_not_found(cifar):
    with pytest.raises(FileNotFoundError, match=r"fog\.npy.*labels\.npy|labels\.npy.*fog\.npy"):
        load_cifar10_c(cifar[0], "fog", 1)


def _damage_truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _damage_garbage(path: Path) -> None:
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8).tobytes())


def _damage_int64_pixels(path: Path) -> None:
    data = np.zeros((1, 3072), dtype=np.int64)
    path.write_bytes(pickle.dumps(_batch_dict("x", data, [0])))


def _damage_hwc_rows(path: Path) -> None:  # images saved as (n, 32, 32, 3) instead of rows of 3072
    path.write_bytes(pickle.dumps(_batch_dict("x", np.zeros((1, 32, 32, 3), dtype=np.uint8), [0])))


def _damage_labels_count(path: Path) -> None:
    path.write_bytes(pickle.dumps(_batch_dict("x", np.zeros((2, 3072), dtype=np.uint8), [0])))


def _damage_no_labels(path: Path) -> None:
    path.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), dtype=np.uint8)}))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_damage_truncated, r"could not unpickle .*truncated"),
        (_damage_garbage, r"could not unpickle"),
        (_damage_int64_pixels, r"uint8 \(n, 3072\), got int64"),
        (_damage_hwc_rows, r"uint8 \(n, 3072\), got uint8 \(1, 32, 32, 3\)"),
        (_damage_labels_count, r"expected 2 labels"),
        (_damage_no_labels, r"key b'labels'"),
    ],
    ids=["truncated", "garbage", "int64_pixels", "hwc_rows", "labels_count", "no_labels"],
)
def test_a_damaged_batch_is_a_data_file_error_naming_it(cifar, damage, match):
    folder, _ = cifar
    damage(folder / "data_batch_4")
    with pytest.raises(DataFileError, match=match) as caught:
        load_cifar10(folder, "train")
    assert str(folder / "data_batch_4") in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_a_damaged_meta_file_is_named(cifar):
    folder, _ = cifar
    _damage_truncated(folder / "batches.meta")
    with pytest.raises(DataFileError, match=r"batches\.meta"):
        load_cifar10(folder, "test")


def test_a_pickle_with_foreign_code_is_refused_without_running_it(cifar, tmp_path):
    folder, _ = cifar
    marker = tmp_path / "ran"

    class _Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (folder / "test_batch").write_bytes(pickle.dumps({b"data": _Payload(), b"labels": [0]}, protocol=2))
    with pytest.raises(DataFileError, match=r"test_batch") as caught:
        load_cifar10(folder, "test")
    assert "which no CIFAR-10 batch holds" in str(caught.value) and not marker.exists()


@pytest.mark.parametrize(("labels", "first"), [([0, 10], "10 at row 1"), ([-1, 3], "-1 at row 0")])
def test_cifar10_labels_out_of_range_are_named(cifar, labels, first):
    folder, _ = cifar
    (folder / "data_batch_2").write_bytes(pickle.dumps(_batch_dict("x", np.zeros((2, 3072), dtype=np.uint8), labels)))
    with pytest.raises(DataFileError, match=rf"data_batch_2 outside 0\.\.9: 1 of them, the first {first}$"):
        load_cifar10(folder, "train")


def test_cifar10_c_labels_out_of_range_name_their_row_in_the_file(cifar_c):
    folder, _ = cifar_c
    labels = np.zeros(5 * M, dtype=np.int64)
    labels[2 * M + 1] = 12  # severity 3's second row
    np.save(folder / "labels.npy", labels)
    with pytest.raises(DataFileError, match=rf"outside 0\.\.9: 1 of them, the first 12 at row {2 * M + 1}$"):
        load_cifar10_c(folder, "fog", 3)


@pytest.mark.parametrize(
    ("name", "array", "match"),
    [
        ("fog.npy", np.zeros((5 * M, 3, 32, 32), dtype=np.uint8), r"uint8 \(5 m, 32, 32, 3\).*\(10, 3, 32, 32\)"),
        ("fog.npy", np.zeros((5 * M, 32, 32, 3), dtype=np.float32), r"got float32"),
        ("fog.npy", np.zeros((7, 32, 32, 3), dtype=np.uint8), r"5 severities stacked.*\(7, 32, 32, 3\)"),
        ("fog.npy", np.zeros((0, 32, 32, 3), dtype=np.uint8), r"holds no image"),
        ("labels.npy", np.zeros(M, dtype=np.int64), r"hold 10 labels, got shape \(2,\)"),
        ("labels.npy", np.zeros((5 * M, 1), dtype=np.int64), r"hold 10 labels, got shape \(10, 1\)"),
        ("labels.npy", np.full(5 * M, 1.5), r"float64.*expected integers"),
        ("labels.npy", np.full(5 * M, 10, dtype=np.uint8), r"outside 0\.\.9"),
    ],
    ids=["chw", "float_pixels", "not_5_blocks", "empty", "short_labels", "column_labels", "float_labels", "label_10"],
)
def test_cifar10_c_wrong_arrays_are_named(cifar_c, name, array, match):
    folder, _ = cifar_c
    np.save(folder / name, array)
    with pytest.raises(DataFileError, match=match) as caught:
        load_cifar10_c(folder, "fog", 2)
    assert str(folder / name) in str(caught.value)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "objects"])
def test_cifar10_c_damaged_npy_is_named(cifar_c, damage):
    folder, arrays = cifar_c
    path = folder / "fog.npy"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:5000])
    elif damage == "garbage":
        path.write_bytes(b"not a numpy file at all" * 100)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        np.save(path, np.array([{"a": 1}] * 10, dtype=object), allow_pickle=True)
    with pytest.raises(DataFileError, match=r"fog\.npy") as caught:
        load_cifar10_c(folder, "fog", 1)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("severity", [0, 6, -1, 2.0, True, "3", None])
def test_a_bad_severity_is_named(cifar_c, severity):
    with pytest.raises(ValueError, match=r"severity in 1\.\.5, got"):
        load_cifar10_c(cifar_c[0], "fog", severity)


@pytest.mark.parametrize("corruption", ["Fog", "fog.npy", "gaussian-noise", "labels", ""])
def test_an_unknown_corruption_is_named(cifar_c, corruption):
    with pytest.raises(ValueError, match=r"unknown CIFAR-10-C corruption") as caught:
        load_cifar10_c(cifar_c[0], corruption, 1)
    assert repr(corruption) in str(caught.value) and "gaussian_noise" in str(caught.value)


def test_every_listed_corruption_loads(tmp_path):
    folder = tmp_path / "CIFAR-10-C"
    arrays = _write_cifar10_c(folder, corruptions=CIFAR10_C_CORRUPTIONS)
    assert len(CIFAR10_C_CORRUPTIONS) == 19 and len(set(CIFAR10_C_CORRUPTIONS)) == 19
    for corruption in CIFAR10_C_CORRUPTIONS:
        data = load_cifar10_c(folder, corruption, 5)
        expected = torch.from_numpy(arrays[corruption][4 * M :]).permute(0, 3, 1, 2).float() / 255
        assert torch.equal(data.images, expected)


@pytest.mark.parametrize("split", ["val", "Train", "training", None])
def test_a_bad_split_is_named(cifar, split):
    with pytest.raises(ValueError, match=r'split "train" or "test"'):
        load_cifar10(cifar[0], split)


@pytest.mark.parametrize("root", [None, 3, b"/tmp", ["a"]])
def test_a_root_that_is_not_a_path_is_a_type_error(root):
    with pytest.raises(TypeError, match=r"root"):
        load_cifar10(root, "train")
    with pytest.raises(TypeError, match=r"root"):
        load_cifar10_c(root, "fog", 1)
