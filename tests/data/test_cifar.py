"""CIFAR-10 / CIFAR-10-C loaders on small files written in exactly the published formats."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from gpattn.data import CIFAR10_CLASSES, DataFileError, load_cifar10, load_cifar10_c

PER_BATCH = 10


def _write_batch(path, data, labels):
    with path.open("wb") as handle:
        pickle.dump({b"batch_label": b"test", b"labels": list(map(int, labels)), b"data": data}, handle)


@pytest.fixture()
def cifar_root(tmp_path):
    """A CIFAR-10 python folder with 5 training batches and a test batch of 10 images each."""
    rng = np.random.default_rng(0)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (PER_BATCH, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, PER_BATCH)
        _write_batch(root / name, data, labels)
        batches[name] = (data, labels)
    with (root / "batches.meta").open("wb") as handle:
        pickle.dump({b"label_names": [name.encode() for name in CIFAR10_CLASSES], b"num_vis": 3072}, handle)
    return root, batches


def test_cifar10_round_trip(cifar_root):
    root, batches = cifar_root
    train = load_cifar10(root, "train")
    assert train.images.shape == (5 * PER_BATCH, 3, 32, 32) and train.images.dtype == torch.float32
    assert train.labels.dtype == torch.int64 and train.class_names == CIFAR10_CLASSES and train.num_classes == 10
    data = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = np.concatenate([batches[f"data_batch_{i}"][1] for i in range(1, 6)])
    assert torch.equal(train.labels, torch.from_numpy(labels))
    assert torch.equal((train.images * 255).round().to(torch.uint8).reshape(-1, 3072), torch.from_numpy(data))
    assert train.images.min() >= 0 and train.images.max() <= 1
    # channel layout: the first 1024 bytes are the red plane, row by row
    first = batches["data_batch_1"][0][0]
    assert train.images[0, 0, 0, 1] == pytest.approx(first[1] / 255)
    assert train.images[0, 1, 2, 3] == pytest.approx(first[1024 + 2 * 32 + 3] / 255)
    assert train.images[0, 2, 31, 31] == pytest.approx(first[3071] / 255)

    test = load_cifar10(root, split="test")
    assert len(test) == PER_BATCH
    assert torch.equal(test.labels, torch.from_numpy(batches["test_batch"][1]))
    # the parent folder works too
    assert torch.equal(load_cifar10(root.parent, "test").images, test.images)


def test_cifar10_errors(cifar_root, tmp_path):
    root, _ = cifar_root
    with pytest.raises(ValueError, match="split"):
        load_cifar10(root, "validation")
    (root / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(root, "train")
    load_cifar10(root, "test")  # the test split does not need the training batches
    with pytest.raises(FileNotFoundError, match="batches.meta"):
        load_cifar10(tmp_path / "nowhere", "test")
    _write_batch(root / "test_batch", np.zeros((4, 100), dtype=np.uint8), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="3072"):
        load_cifar10(root, "test")
    _write_batch(root / "test_batch", np.zeros((4, 3072), dtype=np.uint8), [0, 1, 2])
    with pytest.raises(ValueError, match="labels"):
        load_cifar10(root, "test")


PER_SEVERITY = 4


@pytest.fixture()
def cifar_c_root(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "CIFAR-10-C"
    root.mkdir()
    data = rng.integers(0, 256, (5 * PER_SEVERITY, 32, 32, 3), dtype=np.uint8)
    labels = np.tile(rng.integers(0, 10, PER_SEVERITY), 5).astype(np.uint8)
    np.save(root / "gaussian_noise.npy", data)
    np.save(root / "labels.npy", labels)
    return root, data, labels


@pytest.mark.parametrize("severity", [1, 3, 5])
def test_cifar10_c_round_trip(cifar_c_root, severity):
    root, data, labels = cifar_c_root
    shifted = load_cifar10_c(root, "gaussian_noise", severity)
    rows = slice((severity - 1) * PER_SEVERITY, severity * PER_SEVERITY)
    assert shifted.images.shape == (PER_SEVERITY, 3, 32, 32) and shifted.images.dtype == torch.float32
    assert shifted.labels.dtype == torch.int64 and torch.equal(shifted.labels, torch.from_numpy(labels[rows]).long())
    expected = torch.from_numpy(data[rows]).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(shifted.images, expected, rtol=0, atol=0)
    assert shifted.class_names == CIFAR10_CLASSES
    assert torch.equal(load_cifar10_c(root.parent, "gaussian_noise", severity).images, shifted.images)


def test_cifar10_c_errors(cifar_c_root):
    root, data, _ = cifar_c_root
    for severity in (0, 6, 2.0, True):
        with pytest.raises(ValueError, match="severity"):
            load_cifar10_c(root, "gaussian_noise", severity)
    with pytest.raises(ValueError, match="corruption"):
        load_cifar10_c(root, "rotation", 1)
    with pytest.raises(FileNotFoundError, match="fog.npy"):
        load_cifar10_c(root, "fog", 1)
    np.save(root / "fog.npy", data[:, :16])  # wrong image size
    with pytest.raises(ValueError, match="32, 32, 3"):
        load_cifar10_c(root, "fog", 1)
    np.save(root / "fog.npy", data[:-1])  # not 5 stacked severities
    with pytest.raises(ValueError):
        load_cifar10_c(root, "fog", 1)
    np.save(root / "snow.npy", data.astype(np.float32))
    with pytest.raises(ValueError, match="uint8"):
        load_cifar10_c(root, "snow", 1)
    np.save(root / "labels.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="labels"):
        load_cifar10_c(root, "gaussian_noise", 1)


# -- damaged files (issue 14): every failure names the file and what is wrong ----------------------------------------
def _pickled_batch(labels=(0, 1, 2, 3), protocol: int = 2) -> bytes:
    data = np.arange(4 * 3072, dtype=np.int64).astype(np.uint8).reshape(4, 3072)
    return pickle.dumps({b"batch_label": b"test", b"labels": list(labels), b"data": data}, protocol=protocol)


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"test_batch is empty \(0 bytes\)"),
        (_pickled_batch()[:200], r"could not unpickle .*test_batch \(200 bytes; .*\): it is truncated"),
        (_pickled_batch()[:-1], r"could not unpickle .*test_batch \(\d+ bytes; .*\): it is truncated"),
        (b"\x80\x02garbage, not a pickle\xff" * 20, r"could not unpickle .*test_batch \(\d+ bytes; "),
        (b"PK\x03\x04 a zip, not a pickle", r"could not unpickle .*test_batch \(\d+ bytes; UnpicklingError"),
        (pickle.dumps([1, 2, 3]), r"expected .*test_batch to hold a pickled dict, got list"),
        (pickle.dumps({b"data": _Exploit()}), r"test_batch .*refers to builtins\.print, which no CIFAR-10 batch holds"),
    ],
    ids=["empty", "truncated", "last_byte_missing", "garbage", "zip", "list", "foreign_class"],
)
def test_cifar10_damaged_batches_name_the_file(cifar_root, content, match, capsys):
    root, _ = cifar_root
    (root / "test_batch").write_bytes(content)
    with pytest.raises(DataFileError, match=match) as caught:
        load_cifar10(root, "test")
    assert isinstance(caught.value, ValueError) and str(root / "test_batch") in str(caught.value)
    assert "must never run" not in capsys.readouterr().out


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_batches_of_every_pickle_protocol_load(cifar_root, protocol):
    # the published files are protocol-2 pickles; newer protocols build NumPy arrays through other functions
    root, _ = cifar_root
    (root / "test_batch").write_bytes(_pickled_batch(protocol=protocol))
    test = load_cifar10(root, "test")
    assert torch.equal(test.labels, torch.arange(4))
    expected = torch.arange(4 * 3072).remainder(256).to(torch.float32).div(255).reshape(4, 3, 32, 32)
    torch.testing.assert_close(test.images, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        ([0, 1.5, 2, 3], r"the labels b'labels' in .*test_batch are float64 \(e\.g\. 1\.5\), expected integers"),
        ([0.0, 1.0, 2.0, 3.0], r"are float64 \(e\.g\. 0\.0\), expected integers"),  # even integral values
        (np.array([0, 1, 2, 3], dtype=np.float32), r"are float32 .*expected integers"),
        (["0", "1", "2", "3"], r"are <U1 \(e\.g\. '0'\), expected integers"),
        ([0, 1, 2, 10], r"labels in .*test_batch outside 0\.\.9"),
    ],
    ids=["fractional", "integral_floats", "float32_array", "strings", "out_of_range"],
)
def test_cifar10_non_integer_labels_are_an_error(cifar_root, labels, match):
    root, _ = cifar_root
    data = np.zeros((4, 3072), dtype=np.uint8)
    with (root / "test_batch").open("wb") as handle:
        pickle.dump({b"labels": labels, b"data": data}, handle)
    with pytest.raises(DataFileError, match=match):
        load_cifar10(root, "test")


def test_cifar10_damaged_meta_file_is_named(cifar_root):
    root, _ = cifar_root
    (root / "batches.meta").write_bytes(b"")
    with pytest.raises(DataFileError, match=r"batches\.meta is empty"):
        load_cifar10(root, "test")


@pytest.mark.parametrize("name", ["gaussian_noise.npy", "labels.npy"])
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda b: b"", r"could not read .*\.npy \(0 bytes\) as a \.npy array \(.*\): it is empty, truncated"),
        (lambda b: b[:64], r"could not read .*\.npy \(64 bytes\) as a \.npy array"),
        (lambda b: b[: len(b) - 7], r"could not read .*\.npy \(\d+ bytes\) as a \.npy array"),
        (lambda b: b"\x93NUMPY garbage" + bytes(range(256)), r"could not read .*\.npy \(\d+ bytes\) as a \.npy"),
        (lambda b: pickle.dumps(np.zeros(3)), r"could not read .*\.npy .*as a \.npy array"),
    ],
    ids=["empty", "header_only", "truncated", "garbage", "pickle"],
)
def test_cifar10_c_damaged_npy_files_name_the_file(cifar_c_root, name, damage, match):
    root, _, _ = cifar_c_root
    path = root / name
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataFileError, match=match) as caught:
        load_cifar10_c(root, "gaussian_noise", 2)
    assert str(path) in str(caught.value)


def test_cifar10_c_without_images_is_named(cifar_c_root):
    root, _, _ = cifar_c_root
    np.save(root / "gaussian_noise.npy", np.zeros((0, 32, 32, 3), dtype=np.uint8))
    np.save(root / "labels.npy", np.zeros(0, dtype=np.int64))
    with pytest.raises(DataFileError, match=r"gaussian_noise\.npy holds no image \(shape \(0, 32, 32, 3\)\)"):
        load_cifar10_c(root, "gaussian_noise", 1)


def test_cifar10_c_float_labels_are_an_error(cifar_c_root):
    root, _, labels = cifar_c_root
    np.save(root / "labels.npy", labels.astype(np.float64) + 0.25)
    with pytest.raises(DataFileError, match=r"labels array in .*labels\.npy are float64 \(e\.g\. \d\.25\), expected"):
        load_cifar10_c(root, "gaussian_noise", 1)


@pytest.mark.parametrize(
    ("label_names", "match"),
    [
        (
            b"abc",
            r"expected b'label_names' in .*batches\.meta to be a non-empty list of class names .*got bytes b'abc'",
        ),
        ("abc", r"batches\.meta to be a non-empty list of class names .*got str 'abc'"),
        ([], r"batches\.meta to be a non-empty list of class names .*got list \[\]"),
        ([0, 1, 2], r"batches\.meta to be a non-empty list of class names .*got list \[0, 1, 2\]"),
        (None, r"batches\.meta to be a non-empty list of class names .*got NoneType None"),
    ],
    ids=["bytes", "str", "empty", "ints", "none"],
)
def test_cifar10_meta_file_without_a_list_of_names_is_named(cifar_root, label_names, match):
    # b"abc" used to give the class names ('97', '98', '99'), its character codes
    root, _ = cifar_root
    with (root / "batches.meta").open("wb") as handle:
        pickle.dump({b"label_names": label_names, b"num_vis": 3072}, handle)
    with pytest.raises(DataFileError, match=match) as caught:
        load_cifar10(root, "test")
    assert str(root / "batches.meta") in str(caught.value)


def test_cifar10_meta_file_names_may_be_text_or_an_array(cifar_root):
    root, _ = cifar_root
    for names in (list(CIFAR10_CLASSES), np.array([name.encode() for name in CIFAR10_CLASSES])):
        with (root / "batches.meta").open("wb") as handle:
            pickle.dump({b"label_names": names}, handle)
        assert load_cifar10(root, "test").class_names == CIFAR10_CLASSES


@pytest.mark.parametrize("split", ["train", "test"])
def test_cifar10_batches_without_images_are_named(cifar_root, split):
    # used to give an empty data set without complaint
    root, _ = cifar_root
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    for name in names:
        _write_batch(root / name, np.zeros((0, 3072), dtype=np.uint8), [])
    with pytest.raises(DataFileError, match=rf"the CIFAR-10 {split} batch(es)? .* no image") as caught:
        load_cifar10(root, split)
    assert all(str(root / name) in str(caught.value) for name in names)
    # one empty batch among others is fine: the images of the others
    _write_batch(root / names[0], np.zeros((2, 3072), dtype=np.uint8), [3, 4])
    assert load_cifar10(root, split).labels.tolist() == [3, 4]


def test_a_root_that_is_not_a_path_is_named():
    # Path(None) raised "expected str, bytes or os.PathLike object, not NoneType", naming no argument
    with pytest.raises(TypeError, match=r"CIFAR-10 \(train\): expected root to be a folder path .* got None"):
        load_cifar10(None)
    with pytest.raises(TypeError, match=r"CIFAR-10-C \(fog\): expected root to be a folder path .* got 5"):
        load_cifar10_c(5, "fog", 1)
