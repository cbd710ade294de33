"""Fixtures shared across test modules (the suite runs with ``--import-mode=importlib``: modules cannot import
each other)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpattn.training.loop as loop_module
from gpattn._torch_compat import is_capturing
from gpattn.attention import select_arguments
from gpattn.data import disk_cache
from gpattn.mlls import AttentionELBO
from gpattn.models import Transformer


def pytest_configure(config: pytest.Config) -> None:
    """The suite's data cache (:mod:`gpattn.data.disk_cache`): a fresh folder per run, made by the main process
    before pytest-xdist starts its workers (which inherit the variable, and share the folder; a worker that does not
    inherit it makes its own), so that the tests neither read nor fill the user's cache; ``GPATTN_CACHE_DIR`` set by
    the caller is kept."""
    if disk_cache.CACHE_VARIABLE not in os.environ:
        os.environ[disk_cache.CACHE_VARIABLE] = tempfile.mkdtemp(prefix="gpattn-test-cache-")
        config._gpattn_cache = os.environ[disk_cache.CACHE_VARIABLE]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_gpattn_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(disk_cache.CACHE_VARIABLE, None)


#: The files that take longest (tens of seconds each on 2 cores), started first: pytest-xdist hands out whole files
#: (``--dist loadfile``) in collection order, so one of them collected last kept one worker busy while the other idled.
#: The CLI files stay where they are: their Ctrl-C tests, run at the start beside two of these, once printed a
#: traceback from the interpreter's exit (a race not yet understood).
LONGEST_FILES = (
    "models/test_toy_training.py",
    "reliability/test_soak.py",
    "notebooks/test_notebooks.py",
    "benchmarks/test_gpu_check.py",
    "benchmarks/test_gpu_grid.py",
    "comparison/test_tuning.py",
    "docs/test_docs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the tests of :data:`LONGEST_FILES` to the front (in that order; the others keep theirs)."""
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        try:
            name = Path(item.path).relative_to(tests).as_posix()
        except ValueError:
            return len(LONGEST_FILES)
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread for the whole suite: its matrices are small, and on a busy 2-core machine OpenMP
    spin-waiting makes two-thread runs up to ten times slower (subprocesses, e.g. notebooks and torchrun, keep
    their own settings)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def faulty_elbo(monkeypatch):
    """Swap the training loop's :class:`~gpattn.mlls.AttentionELBO` for a subclass that fails on request, and return
    that class: set ``interrupt_at`` to raise ``KeyboardInterrupt`` (a Ctrl-C) at that call of a loss object, or
    ``fail_at`` to make that call return NaN loss parts (calls counted from 1). Both ``None`` (the default): the plain
    loss."""

    class FaultyELBO(AttentionELBO):
        interrupt_at: int | None = None
        fail_at: int | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0

        def forward(self, logits, targets):
            self.calls += 1
            if self.calls == self.interrupt_at:
                raise KeyboardInterrupt
            parts = super().forward(logits, targets)
            if self.calls == self.fail_at:
                parts = {name: value * math.nan for name, value in parts.items()}
            return parts

    monkeypatch.setattr(loop_module, "AttentionELBO", FaultyELBO)
    return FaultyELBO


@pytest.fixture
def make_transformer() -> Callable[..., Transformer]:
    """``make_transformer(attention, seed=0, **kwargs)``: a tiny token classifier (2 classes, width 16, depth 2 with one
    GP block, vocabulary 6, length 6, inducing sets of 4 where the attention has one), seeded."""

    def build(attention: str, seed: int = 0, **kwargs) -> Transformer:
        torch.manual_seed(seed)
        settings = dict(embed_dim=16, depth=2, num_heads=2, vocab_size=6, max_len=6)
        return Transformer(
            2, attention=attention, **{**settings, **select_arguments(attention, num_inducing=4), **kwargs}
        )

    return build


#: the benchmark scripts (not a package: each is loaded from its file)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark() -> Callable[[str, str], ModuleType]:
    """``load_benchmark(script, name)``: a fresh module of ``benchmarks/<script>.py`` under the module name ``name``
    (each test file its own, so that one file's monkeypatching never reaches another's)."""

    def load(script: str, name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


# -- CUDA graphs, simulated on the CPU ---------------------------------------------------------------------------------
#: the tensor methods that read a value on the host (one synchronisation each on a GPU, an error while captured)
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


class _SynchronisingOperators(TorchDispatchMode):
    """Records the operators whose result's size or value a GPU must hand to the host (``nonzero``, boolean-mask
    indexing, ``torch.equal``, ...), which no captured pass may run; the tensor methods' reads come through
    ``_local_scalar_dense``."""

    SYNCHRONISING = ("_local_scalar_dense", "nonzero", "equal", "masked_select", "is_nonzero", "unique", "_unique2")

    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCHRONISING:
            self.reads.append(f"aten.{name}")
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1] if index is not None
        ):
            self.reads.append(f"aten.{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counted_reads():
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        with _SynchronisingOperators(reads):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture
def counted_reads() -> Callable[[], contextlib.AbstractContextManager[list[str]]]:
    """``with counted_reads() as reads:``: the host reads made inside the block, in order: the tensor methods that
    read a value (:data:`HOST_READS`) and the operators that synchronise with a GPU (``aten.nonzero``, boolean-mask
    indexing, ...)."""
    return _counted_reads


@contextlib.contextmanager
def _simulated_capture(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_initialized", lambda: True)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert is_capturing()
        yield
    assert not is_capturing()


@pytest.fixture
def simulated_capture(monkeypatch) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``with simulated_capture():``: inside the block gpattn's :func:`~gpattn._torch_compat.is_capturing` answers
    ``True``, as it does while a CUDA graph is captured (``torch.cuda.is_initialized`` and
    ``is_current_stream_capturing`` patched)."""
    return functools.partial(_simulated_capture, monkeypatch)
