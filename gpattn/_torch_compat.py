"""The torch functions gpattn calls that are newer than the oldest torch it supports (2.1), with their fallbacks.

* :func:`is_compiling`: ``torch.compiler.is_compiling`` (torch 2.3+), else ``torch._dynamo.is_compiling``;
* :func:`is_capturing`: whether a CUDA graph is being captured (``torch.cuda.is_current_stream_capturing``, asked only
  once CUDA is initialised), or a warm-up step rehearses the capture (:func:`rehearsing_capture`);
  :func:`values_unreadable`: either, or compiling (no value can be read on the host);
* :func:`autocast_enabled` and :func:`autocast_dtype`: ``torch.is_autocast_enabled(device_type)`` and
  ``torch.get_autocast_dtype(device_type)`` (torch 2.4+), else the per-device functions of older releases (CPU and
  CUDA: autocast on another device type reads as disabled there);
* :func:`mha_fastpath_disabled`: ``torch.backends.mha.set_fastpath_enabled(False)`` for a block (torch 2.3+; older
  releases have no switch, and the block changes nothing there);
* :data:`COMPILES_ASSERTS`: whether a value check may be an asynchronous assertion inside a compiled region;
* :func:`compilable`: the ``apply`` of one of gpattn's autograd functions as ``torch.compile`` should meet it: as it
  is where dynamo traces those functions (torch 2.4+, tested on 2.4 and later), else run eagerly inside a compiled
  region (a graph break: correct, not fused). torch 2.1's dynamo fails on them (``InternalTorchDynamoError``).

The choice is made once, at import; each function costs one Python call on the normal path, and ``torch.compile``
traces them as constants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = [
    "autocast_dtype",
    "autocast_enabled",
    "compilable",
    "is_capturing",
    "is_compiling",
    "mha_fastpath_disabled",
    "rehearsing_capture",
    "values_unreadable",
]

#: torch 2.4+: the autocast functions take a device type
DEVICE_AUTOCAST = hasattr(torch, "get_autocast_dtype")
#: torch 2.3+: ``torch.compiler.is_compiling``
COMPILER_IS_COMPILING = hasattr(torch.compiler, "is_compiling")
#: torch 2.4+: dynamo traces gpattn's autograd functions (their ``ctx`` attributes, ``needs_input_grad``)
TRACES_FUNCTIONS = TorchVersion(torch.__version__) >= (2, 4)
#: torch 2.9+, not ROCm: inductor keeps ``torch._assert_async`` (a lowering to a device assertion: a compiled layer
#: raised on 2.9.0 and 2.13; the 2.8.0 wheel's source decomposes it to nothing, and a compiled layer on 2.4.1 let the
#: failing mask through; on ROCm inductor compiles Triton without device assertions), so a compiled region may check a
#: tensor's values without a data-dependent branch. On CUDA the assertions also need inductor's
#: ``assert_indirect_indexing`` (its default, True).
COMPILES_ASSERTS = TorchVersion(torch.__version__) >= (2, 9) and torch.version.hip is None

#: torch 2.3+: ``torch.backends.mha``, the switch of the fused multi-head-attention fast path (``None`` before)
try:
    from torch.backends import mha as _MHA
except ImportError:  # torch 2.1-2.2
    _MHA = None

#: torch 2.6+: ``torch.compiler.set_stance`` (``"force_eager"``: compiled functions run their Python code eagerly)
SETS_STANCE = hasattr(torch.compiler, "set_stance")

if not TRACES_FUNCTIONS:  # torch 2.1-2.3
    import torch._dynamo  # noqa: F401 (not imported by ``import torch`` there)


def is_compiling() -> bool:
    """Whether this call is being traced by ``torch.compile``: ``torch.compiler.is_compiling()``, or
    ``torch._dynamo.is_compiling()`` on torch 2.1 and 2.2 (looked up at the call: a test may replace either)."""
    if COMPILER_IS_COMPILING:
        return torch.compiler.is_compiling()
    return torch._dynamo.is_compiling()


#: set by :func:`rehearsing_capture`
_REHEARSING = False


def is_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (``torch.cuda.graph``,
    ``torch.cuda.make_graphed_callables``), or a warm-up step rehearses a capture (:func:`rehearsing_capture`): then no
    value may be read on the host (``.item()``, ``.tolist()``, ``bool(tensor)`` end a capture with an error) and a
    data-dependent branch would be frozen into the graph. Asked only once CUDA is initialised, so that a process that
    never uses CUDA (a CPU-only build, where the question raises, or a machine whose GPU it leaves alone) pays one
    attribute read. Both functions are looked up at the call (a test may replace either)."""
    return _REHEARSING or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def values_unreadable() -> bool:
    """Whether no value may be read on the host: while ``torch.compile`` traces (:func:`is_compiling`) or a CUDA graph
    is captured (:func:`is_capturing`). The value checks are then skipped, or made on the device."""
    return is_compiling() or is_capturing()


@contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """Inside the block torch's fused multi-head-attention fast path is off (the previous setting is restored after
    it, also on an error): an eval-mode :class:`torch.nn.TransformerEncoderLayer` or
    :class:`torch.nn.MultiheadAttention` without gradients then runs its modules one by one, dropout included. A
    process-wide switch, not thread-local; on torch 2.1-2.2, which have no switch, the block changes nothing."""
    if _MHA is None:
        yield
        return
    previous = _MHA.get_fastpath_enabled()
    _MHA.set_fastpath_enabled(False)
    try:
        yield
    finally:
        _MHA.set_fastpath_enabled(previous)


@contextmanager
def rehearsing_capture() -> Iterator[None]:
    """Inside the block :func:`is_capturing` answers ``True``: the last warm-up step before a capture runs the code
    the capture will record (the capture's branches, the kernels they launch and what they build once), and a stand-in
    graph on a CPU runs it too."""
    global _REHEARSING
    previous, _REHEARSING = _REHEARSING, True
    try:
        yield
    finally:
        _REHEARSING = previous


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is enabled on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    if DEVICE_AUTOCAST:
        return torch.is_autocast_enabled(device_type)
    if device_type == "cpu":
        return torch.is_autocast_cpu_enabled()
    return device_type == "cuda" and torch.is_autocast_enabled()


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype of autocast on ``device_type`` (read when :func:`autocast_enabled` says it is on)."""
    if DEVICE_AUTOCAST:
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def compilable(apply: Callable[..., Any]) -> Callable[..., Any]:
    """``apply`` (an autograd function's) itself on torch 2.4+, else the same call that ``torch.compile`` does not
    trace (``torch._dynamo.disable``: a graph break around it, the function run eagerly)."""
    return apply if TRACES_FUNCTIONS else torch._dynamo.disable(apply)


def recompile_limit_name() -> str:
    """The name of dynamo's limit of compiled graphs per function in ``torch._dynamo.config``: ``recompile_limit``,
    ``cache_size_limit`` before its rename (read at the call: importing the config loads dynamo)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def eager_calls() -> AbstractContextManager:
    """A block in which every ``torch.compile``'d function runs its Python code eagerly
    (``torch.compiler.set_stance("force_eager")``, torch 2.6+; no effect before): for a pass whose forward hooks must
    fire, since dynamo does not guard on hooks added to a module after a graph of its caller was compiled (the graph
    would run, and the hooks would not)."""
    return torch.compiler.set_stance("force_eager") if SETS_STANCE else nullcontext()
