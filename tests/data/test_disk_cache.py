"""The disk cache of generated data: what it returns equals what it was given, bit for bit; its entries are keyed by
their arguments and the versions their values depend on; damaged entries, unwritable folders and ``off`` fall back
to generating; and MNIST-1D read from it equals MNIST-1D generated without it."""

from __future__ import annotations

import os
import stat
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from gpattn.data import disk_cache
from gpattn.data.disk_cache import cache_directory, cached_arrays, entry_path
from gpattn.data.mnist1d_generator import make_mnist1d_signals, standard_dataset, standardisation


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


class Generator:
    """Counts its calls; its arrays cover the dtypes the cache stores (float64 with rounding-level bits, int64)."""

    def __init__(self, seed: int = 0):
        self.calls, self.seed = 0, seed

    def __call__(self) -> dict[str, np.ndarray]:
        self.calls += 1
        rng = np.random.default_rng(self.seed)
        return {"x": rng.standard_normal((7, 5)) / 3.0, "y": rng.integers(0, 10, 7)}


def test_an_entry_is_generated_once_and_read_back_bit_for_bit(folder):
    generate = Generator()
    first = cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 1 and entry_path("probe", {"n": 7}, folder, __file__).is_file()
    second = cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 1
    for name, value in Generator()().items():
        assert first[name].dtype == second[name].dtype == value.dtype
        assert first[name].tobytes() == second[name].tobytes() == value.tobytes()
    assert [path.name for path in folder.iterdir()] == [
        entry_path("probe", {"n": 7}, folder, __file__).name
    ]  # no leftovers


def test_other_arguments_or_versions_make_other_entries(folder, monkeypatch):
    paths = {entry_path("probe", {"n": 7}, folder, __file__), entry_path("probe", {"n": 8}, folder, __file__)}
    paths.add(entry_path("other", {"n": 7}, folder, __file__))
    versions = disk_cache._versions()
    for changed in ("numpy", "scipy", "mnist1d", "format"):
        monkeypatch.setattr(disk_cache, "_versions", lambda changed=changed: {**versions, changed: "0"})
        paths.add(entry_path("probe", {"n": 7}, folder, __file__))
    monkeypatch.setattr(disk_cache, "_versions", lambda: dict(versions))
    edited = folder.parent / "generator.py"  # other code that generates: its contents, not its name, count
    edited.write_text(Path(__file__).read_text() + "# edited\n")
    paths.add(entry_path("probe", {"n": 7}, folder, edited))
    assert len(paths) == 8
    copy = folder.parent / "copy.py"
    copy.write_bytes(Path(__file__).read_bytes())
    assert entry_path("probe", {"n": 7}, folder, copy) == entry_path("probe", {"n": 7}, folder, __file__) in paths


@pytest.mark.parametrize("damage", [b"", b"not an npz file", None], ids=["empty", "garbage", "truncated"])
def test_a_damaged_entry_is_generated_again_and_replaced(folder, damage):
    cached_arrays("probe", {"n": 7}, Generator(), __file__)
    path = entry_path("probe", {"n": 7}, folder, __file__)
    path.write_bytes(path.read_bytes()[:100] if damage is None else damage)
    generate = Generator()
    again = cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 1 and again["x"].tobytes() == Generator()()["x"].tobytes()
    assert (
        cached_arrays("probe", {"n": 7}, generate, __file__)["y"].tolist() == again["y"].tolist()
        and generate.calls == 1
    )


def _large() -> dict[str, np.ndarray]:
    # a member larger than zipfile's first read (4096 bytes), so that NumPy parses its header before the CRC is checked
    return {"x": np.arange(2000.0) / 3.0}


def _flag_members(raw: bytes, offset: int, value: int) -> bytes:
    # every member of the zip directory (signature PK\1\2) with the 2-byte field at ``offset`` or-ed with ``value``
    data, start = bytearray(raw), raw.find(b"PK\x01\x02")
    while start >= 0:
        field = int.from_bytes(data[start + offset : start + offset + 2], "little") | value
        data[start + offset : start + offset + 2] = field.to_bytes(2, "little")
        start = raw.find(b"PK\x01\x02", start + 1)
    return bytes(data)


@pytest.mark.parametrize(
    "damage, error",
    [
        (lambda raw: _flag_members(raw, 8, 0x1), "RuntimeError"),  # members flagged encrypted
        (lambda raw: _flag_members(raw, 6, 0xFF), "NotImplementedError"),  # an unknown zip version (25.5)
        (lambda raw: raw.replace(b", }", b",  ", 1), "TokenError"),  # a .npy header with its brace unclosed
    ],
    ids=["encrypted", "zip-version", "npy-header"],
)
def test_an_entry_damaged_in_its_zip_directory_or_npy_header_is_generated_again(folder, damage, error):
    # these damages raised RuntimeError, NotImplementedError and tokenize.TokenError out of cached_arrays (only
    # OSError, ValueError, EOFError and BadZipFile were taken for a damaged entry) instead of generating again
    cached_arrays("probe", {"n": 8}, _large, __file__)
    path = entry_path("probe", {"n": 8}, folder, __file__)
    path.write_bytes(damage(path.read_bytes()))
    try:  # what NumPy itself raises on the damaged entry
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as stored:
            {name: stored[name] for name in stored.files}
        raised = None
    except Exception as caught:  # noqa: BLE001
        raised = type(caught).__name__
    assert raised == error
    calls = []
    again = cached_arrays("probe", {"n": 8}, lambda: calls.append(1) or _large(), __file__)
    assert calls == [1] and again["x"].tobytes() == _large()["x"].tobytes()
    assert cached_arrays("probe", {"n": 8}, lambda: calls.append(1) or _large(), __file__)["x"].tobytes() == (
        _large()["x"].tobytes()
    )
    assert calls == [1]  # the entry was replaced


def _rewrite(path: Path, change) -> None:
    # the entry rewritten as a valid .npz whose arrays (checksum included) are change(arrays)
    with np.load(path) as stored:
        arrays = {name: stored[name] for name in stored.files}
    with open(path, "wb") as file:
        np.savez(file, **change(arrays))


@pytest.mark.parametrize(
    "change",
    [
        lambda arrays: {**arrays, "y": np.roll(arrays["y"], 1)},  # labels shifted by one row
        lambda arrays: {**arrays, "x": arrays["x"].astype(np.float32)},  # another dtype
        lambda arrays: {name: value for name, value in arrays.items() if name != "y"},  # an array missing
        lambda arrays: {name: value for name, value in arrays.items() if name != "__sha256__"},  # no checksum
    ],
    ids=["shifted", "dtype", "missing", "unchecked"],
)
def test_a_readable_entry_that_does_not_match_its_checksum_is_generated_again(folder, change):
    # a valid .npz with other arrays than were stored (an older or shared entry, an edit) was returned as it was
    cached_arrays("probe", {"n": 7}, Generator(), __file__)
    path = entry_path("probe", {"n": 7}, folder, __file__)
    _rewrite(path, change)
    generate = Generator()
    again = cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 1
    assert {name: value.tobytes() for name, value in again.items()} == {
        name: value.tobytes() for name, value in Generator()().items()
    }
    assert cached_arrays("probe", {"n": 7}, generate, __file__)["y"].tolist() == again["y"].tolist()
    assert generate.calls == 1  # the entry was replaced


def test_a_damaged_entry_leaves_no_open_file(folder, monkeypatch):
    # numpy.load(path) leaves the file it opened open when the zip is damaged (a ResourceWarning): the cache opens it
    cached_arrays("probe", {"n": 7}, Generator(), __file__)
    opened = []

    def damaged(file, **kwargs):
        opened.append(file)
        raise zipfile.BadZipFile("damaged")

    monkeypatch.setattr(disk_cache.np, "load", damaged)
    generate = Generator()
    cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 1 and len(opened) == 1 and opened[0].closed


def test_an_unwritable_folder_generates_every_time_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, str(blocker / "cache"))
    monkeypatch.setattr(disk_cache, "_warned", set())
    generate = Generator()
    with pytest.warns(RuntimeWarning, match="could not write its data cache"):
        values = cached_arrays("probe", {"n": 7}, generate, __file__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per folder and process
        cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 2 and values["x"].tobytes() == Generator()()["x"].tobytes()


def test_without_a_home_folder_there_is_no_cache_and_one_warning(monkeypatch):
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(disk_cache.CACHE_VARIABLE, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    monkeypatch.setattr(disk_cache, "_warned", set())
    generate = Generator()
    with pytest.warns(RuntimeWarning, match="keeps no data cache: Could not determine home directory"):
        assert cache_directory() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_arrays("probe", {"n": 7}, generate, __file__)["y"].tolist() == Generator()()["y"].tolist()
    assert generate.calls == 1


def test_a_generator_whose_source_cannot_be_read_is_not_cached(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "_warned", set())
    generate = Generator()
    missing = tmp_path / "archive.zip" / "generator.py"
    with pytest.warns(RuntimeWarning, match="keeps no data cache for probe: cannot read"):
        values = cached_arrays("probe", {"n": 7}, generate, missing)
    assert values["x"].tobytes() == Generator()()["x"].tobytes() and not folder.exists()


def test_entries_get_the_mode_the_umask_gives(folder):
    mask = os.umask(0o022)
    try:
        cached_arrays("probe", {"n": 7}, Generator(), __file__)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(entry_path("probe", {"n": 7}, folder, __file__).stat().st_mode) == 0o644


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, "off")
    assert cache_directory() is None
    generate = Generator()
    cached_arrays("probe", {"n": 7}, generate, __file__)
    cached_arrays("probe", {"n": 7}, generate, __file__)
    assert generate.calls == 2
    monkeypatch.delenv(disk_cache.CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "gpattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_directory() == tmp_path / "home" / ".cache" / "gpattn"
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, "~/elsewhere")
    assert cache_directory() == tmp_path / "home" / "elsewhere"


def test_mnist1d_from_the_cache_equals_mnist1d_generated_without_it(folder, monkeypatch):
    digits = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    standardisation.cache_clear()  # its draws come from the cache folder too (in this test, this one)
    assert make_mnist1d_signals(digits, seed=5).shape == (8, 40)
    assert len(list(folder.glob("*.npz"))) == 1  # the standardisation's 5000 draws; fresh draws are not kept
    calls = {
        "plain": {"seed": 5, "iid_noise_scale": 0.3},
        "seed": {"seed": 6, "iid_noise_scale": 0.3},
        "translated": {"seed": 5, "max_translation": 5},
    }
    cold = {label: make_mnist1d_signals(digits, cache=True, **call) for label, call in calls.items()}
    reordered = make_mnist1d_signals(digits[::-1], cache=True, **calls["plain"])
    assert len(list(folder.glob("mnist1d-signals-*.npz"))) == 5
    generator = sys.modules["mnist1d.transform"]  # the module (the package's attribute is the function)
    monkeypatch.setattr(generator, "transform", lambda *args: pytest.fail("generated again"))
    warm = {label: make_mnist1d_signals(digits, cache=True, **call) for label, call in calls.items()}
    assert make_mnist1d_signals(digits[::-1], cache=True, **calls["plain"]).tobytes() == reordered.tobytes()
    monkeypatch.undo()
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, "off")
    for label, call in calls.items():  # each read back bit for bit, each its own entry
        assert warm[label].tobytes() == cold[label].tobytes() == make_mnist1d_signals(digits, **call).tobytes()
    assert make_mnist1d_signals(digits[::-1], **calls["plain"]).tobytes() == reordered.tobytes()
    assert not np.array_equal(cold["seed"], cold["plain"]) and not np.array_equal(cold["translated"], cold["plain"])
    assert not np.array_equal(reordered, cold["plain"])
    with pytest.raises(TypeError, match="expected cache to be True or False, got 1"):
        make_mnist1d_signals(digits, cache=1)


def test_the_standard_mnist1d_set_from_the_cache_equals_make_datasets(folder, monkeypatch):
    import mnist1d.data

    generated = standard_dataset.__wrapped__(False)
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda args: pytest.fail("generated again"))
    read = standard_dataset.__wrapped__(False)
    assert set(read) == {"x", "y", "x_test", "y_test"}
    for name, value in generated.items():
        assert read[name].dtype == value.dtype and read[name].tobytes() == value.tobytes()
        assert not read[name].flags.writeable
