"""The disk cache of generated data: what it returns equals what it was given, bit for bit; its entries are keyed by
their arguments and the versions their values depend on; damaged entries, unwritable folders and ``off`` fall back
to generating; and MNIST-1D read from it equals MNIST-1D generated without it."""

from __future__ import annotations

import warnings

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
    first = cached_arrays("probe", {"n": 7}, generate)
    assert generate.calls == 1 and entry_path("probe", {"n": 7}, folder).is_file()
    second = cached_arrays("probe", {"n": 7}, generate)
    assert generate.calls == 1
    for name, value in Generator()().items():
        assert first[name].dtype == second[name].dtype == value.dtype
        assert first[name].tobytes() == second[name].tobytes() == value.tobytes()
    assert [path.name for path in folder.iterdir()] == [entry_path("probe", {"n": 7}, folder).name]  # no leftovers


def test_other_arguments_or_versions_make_other_entries(folder, monkeypatch):
    paths = {entry_path("probe", {"n": 7}, folder), entry_path("probe", {"n": 8}, folder)}
    paths.add(entry_path("other", {"n": 7}, folder))
    versions = disk_cache._versions()
    for changed in ("numpy", "scipy", "mnist1d", "format"):
        monkeypatch.setattr(disk_cache, "_versions", lambda changed=changed: {**versions, changed: "0"})
        paths.add(entry_path("probe", {"n": 7}, folder))
    assert len(paths) == 7
    monkeypatch.setattr(disk_cache, "_versions", lambda: dict(versions))
    assert entry_path("probe", {"n": 7}, folder) in paths  # and the same ones the same entry


@pytest.mark.parametrize("damage", [b"", b"not an npz file", None], ids=["empty", "garbage", "truncated"])
def test_a_damaged_entry_is_generated_again_and_replaced(folder, damage):
    cached_arrays("probe", {"n": 7}, Generator())
    path = entry_path("probe", {"n": 7}, folder)
    path.write_bytes(path.read_bytes()[:100] if damage is None else damage)
    generate = Generator()
    again = cached_arrays("probe", {"n": 7}, generate)
    assert generate.calls == 1 and again["x"].tobytes() == Generator()()["x"].tobytes()
    assert cached_arrays("probe", {"n": 7}, generate)["y"].tolist() == again["y"].tolist() and generate.calls == 1


def test_an_unwritable_folder_generates_every_time_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, str(blocker / "cache"))
    monkeypatch.setattr(disk_cache, "_warned", set())
    generate = Generator()
    with pytest.warns(RuntimeWarning, match="could not write its data cache"):
        values = cached_arrays("probe", {"n": 7}, generate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per folder and process
        cached_arrays("probe", {"n": 7}, generate)
    assert generate.calls == 2 and values["x"].tobytes() == Generator()()["x"].tobytes()


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, "off")
    assert cache_directory() is None
    generate = Generator()
    cached_arrays("probe", {"n": 7}, generate)
    cached_arrays("probe", {"n": 7}, generate)
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
    cold = make_mnist1d_signals(digits, seed=5, iid_noise_scale=0.3)  # generated, stored
    assert len(list(folder.glob("mnist1d-signals-*.npz"))) == 2  # these, and the standardisation's 5000 draws
    warm = make_mnist1d_signals(digits, seed=5, iid_noise_scale=0.3)
    translated = make_mnist1d_signals(digits, seed=5, max_translation=5)  # another entry
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, "off")
    plain = make_mnist1d_signals(digits, seed=5, iid_noise_scale=0.3)
    assert cold.tobytes() == warm.tobytes() == plain.tobytes()
    assert make_mnist1d_signals(digits, seed=5, max_translation=5).tobytes() == translated.tobytes()
    assert not np.array_equal(translated, plain)


def test_the_standard_mnist1d_set_from_the_cache_equals_make_datasets(folder, monkeypatch):
    import mnist1d.data

    generated = standard_dataset.__wrapped__(False)
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda args: pytest.fail("generated again"))
    read = standard_dataset.__wrapped__(False)
    assert set(read) == {"x", "y", "x_test", "y_test"}
    for name, value in generated.items():
        assert read[name].dtype == value.dtype and read[name].tobytes() == value.tobytes()
        assert not read[name].flags.writeable
