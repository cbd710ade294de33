"""A disk cache for generated data: arrays that take seconds to generate (MNIST-1D's sequences, drawn one by one
by ``mnist1d``'s Python transformations) are generated once per machine instead of once per process.

Each entry is one ``.npz`` file (NumPy arrays, no pickles) in :func:`cache_directory`, named by what it holds and
the SHA-256 of its key: the arguments of the generation and the versions of everything its values depend on
(``mnist1d``, NumPy, SciPy and the format of the entries), so that another version generates and stores its own
entry instead of reading one it would not have made. Entries are written atomically (a temporary file in the same
folder, then :func:`os.replace`): processes that generate the same entry at once each write a whole file, and a
reader never sees half of one. An entry that cannot be read (truncated, or not an ``.npz``) is generated again and
replaced; a folder that cannot be written leaves the data uncached, with one warning per process.

The folder is ``$GPATTN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/gpattn``, else ``~/.cache/gpattn``;
``GPATTN_CACHE_DIR=off`` turns the cache off. Deleting the folder, or any file in it, is always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CACHE_VARIABLE", "cache_directory", "cached_arrays"]

#: The environment variable naming the cache folder (``off``: no cache).
CACHE_VARIABLE = "GPATTN_CACHE_DIR"
#: The version of the entries' layout; raising it makes every entry of an older layout unused.
FORMAT = 1
_warned: set[str] = set()


def cache_directory() -> Path | None:
    """The folder of the cache (see the module's docstring), or ``None`` when ``$GPATTN_CACHE_DIR`` is ``off``."""
    configured = os.environ.get(CACHE_VARIABLE, "").strip()
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "gpattn"


def _versions() -> dict[str, str]:
    import scipy

    try:
        from importlib.metadata import version

        mnist1d = version("mnist1d")
    except Exception:  # noqa: BLE001 (not installed, or no metadata: the entry says so)
        mnist1d = "unknown"
    return {"format": str(FORMAT), "mnist1d": mnist1d, "numpy": np.__version__, "scipy": scipy.__version__}


def entry_path(name: str, key: Mapping[str, Any], directory: Path) -> Path:
    """The file of the entry ``name`` with ``key`` (JSON-serialisable) in ``directory``."""
    text = json.dumps({"key": key, "versions": _versions()}, sort_keys=True)
    return directory / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.npz"


def _read(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {name: stored[name] for name in stored.files}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # a damaged entry: generated again below
        return None


def _write(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".npz")
        try:
            with os.fdopen(handle, "wb") as file:
                np.savez(file, **arrays)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        if str(path.parent) not in _warned:
            _warned.add(str(path.parent))
            warnings.warn(
                f"gpattn could not write its data cache in {path.parent} ({error}); the data are generated in every "
                f"process. Set {CACHE_VARIABLE} to a writable folder, or to 'off'.",
                RuntimeWarning,
                stacklevel=4,
            )


def cached_arrays(
    name: str, key: Mapping[str, Any], generate: Callable[[], Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays of the entry ``name`` with ``key``: read from the cache, or ``generate()``-d and stored.

    :param name: What the entry holds (a file-name prefix, e.g. ``"mnist1d-signals"``).
    :param key: The arguments that determine the arrays (JSON-serialisable); the versions are added.
    :param generate: Makes the arrays (a mapping of names to NumPy arrays of numbers) when there is no entry.
    :return: The arrays, equal bit for bit to ``generate()``'s (``.npz`` stores them exactly).
    """
    directory = cache_directory()
    if directory is None:
        return dict(generate())
    path = entry_path(name, key, directory)
    stored = _read(path)
    if stored is not None:
        return stored
    arrays = {field: np.asarray(value) for field, value in generate().items()}
    _write(path, arrays)
    return arrays
