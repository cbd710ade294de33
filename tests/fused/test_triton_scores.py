"""The Triton kernels of the fused amortised scores (gpattn.fused.triton_scores): the predicate that decides when they
run, and their interpreter cases (tests/fused/triton_interpreter_cases.py, against the PyTorch code) in a fresh
process with ``TRITON_INTERPRET=1``. Skipped where Triton is not installed (the ``gpu`` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch
from torch.torch_version import TorchVersion

from gpattn.fused import triton_scores

CASES = Path(__file__).with_name("triton_interpreter_cases.py")


def test_the_predicate(monkeypatch):
    """CUDA tensors of float32/bfloat16/float16 take the kernels (float64 stays on PyTorch's path on a GPU) up to
    TRITON_MAX_TOKENS tokens (longer ones when GPATTN_TRITON=1), CPU tensors only under the interpreter when asked for,
    nothing when GPATTN_TRITON=0 or without Triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(triton_scores.TRITON_VARIABLE, raising=False)

    def cuda(dtype, length=16):  # the predicate reads the device, the dtype and the number of tokens only
        return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(2, 2, 4, 8, length))

    monkeypatch.setattr(triton_scores, "triton", triton_scores.triton or object())  # as if installed
    assert all(triton_scores.runs_triton(cuda(dtype)) for dtype in (torch.float32, torch.bfloat16, torch.float16))
    assert not triton_scores.runs_triton(cuda(torch.float64))
    assert not triton_scores.runs_triton(torch.empty(1))  # CPU without the interpreter
    longest = triton_scores.TRITON_MAX_TOKENS
    assert triton_scores.runs_triton(cuda(torch.float32, longest))
    assert not triton_scores.runs_triton(cuda(torch.float32, longest + 1))  # long sequences: the PyTorch path
    monkeypatch.setenv(triton_scores.TRITON_VARIABLE, "0")
    assert not triton_scores.runs_triton(cuda(torch.float32))
    monkeypatch.setenv(triton_scores.TRITON_VARIABLE, "1")
    assert triton_scores.runs_triton(cuda(torch.float32, longest + 1))  # asked for: any length
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_scores.runs_triton(torch.empty(1, dtype=torch.float64))
    monkeypatch.setattr(triton_scores, "triton", None)  # not installed
    assert not triton_scores.runs_triton(cuda(torch.float32)) and not triton_scores.triton_available()


@pytest.mark.skipif(not triton_scores.triton_available(), reason="needs Triton")
def test_the_predicate_reads_triton_interpret_as_triton_does(monkeypatch):
    """TRITON_INTERPRET=false (or off, 0) leaves Triton's interpreter off: CUDA tensors take the compiled kernels and
    CPU tensors never do. Any value but "" and "0" counted as on before: the CUDA kernels were left unused, and with
    GPATTN_TRITON=1 compiled kernels were launched on CPU tensors."""
    monkeypatch.delenv(triton_scores.TRITON_VARIABLE, raising=False)
    cuda = SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(2, 2, 4, 8, 16))
    for value in ("false", "off", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert not triton_scores._interpreting() and triton_scores.runs_triton(cuda), value
        monkeypatch.setenv(triton_scores.TRITON_VARIABLE, "1")
        assert not triton_scores.runs_triton(torch.empty(1)), value  # CPU: no compiled kernels
        monkeypatch.delenv(triton_scores.TRITON_VARIABLE)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_scores._interpreting()
    if hasattr(triton_scores.triton, "knobs"):  # Triton >= 3.4 reads "true" as on too
        monkeypatch.setenv("TRITON_INTERPRET", "true")
        assert triton_scores._interpreting()


#: a loop over a kernel argument under the interpreter: Triton 3.6's interpreter (the Triton of torch 2.11) turns the
#: argument into a one-element NumPy array and the loop converts it with int(), which NumPy 2.4 refuses ("only
#: 0-dimensional arrays can be converted to Python scalars"); Triton 3.9 runs it with any NumPy. Compiled kernels are
#: not affected: this is the interpreter's own conversion.
LOOP_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def loop(x, n, B: tl.constexpr):
    total = tl.zeros((B,), dtype=tl.float32)
    for start in range(0, n, B):
        total += tl.load(x + start + tl.arange(0, B))
    tl.store(x + tl.arange(0, B), total)
loop[(1,)](torch.ones(32), 32, B=16)
"""


def _interpreter_failure(environment: dict[str, str], triton_version: str) -> str | None:
    """Why this Triton's interpreter cannot run a loop over a kernel argument with this NumPy, or ``None``."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", LOOP_PROBE], env=environment, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return None  # the cases then show what is wrong
    if probe.returncode == 0 or "0-dimensional arrays can be converted" not in probe.stderr:
        return None  # it runs (or fails otherwise, which the cases then show)
    return (
        f"Triton {triton_version}'s interpreter cannot run kernel loops with NumPy {numpy.__version__} (a "
        "one-element array converted by int(); Triton 3.9 can): the interpreter cases need NumPy < 2.4 or a newer "
        "Triton; compiled kernels are not affected"
    )


def test_kernels_under_the_interpreter():
    """The interpreter cases in a fresh process (about a minute on 2 cores)."""
    triton = pytest.importorskip("triton")
    if not triton_scores.triton_available():
        pytest.skip(f"Triton {triton.__version__} is older than the kernels' {triton_scores.TRITON_MINIMUM}")
    environment = {**os.environ, "TRITON_INTERPRET": "1", triton_scores.TRITON_VARIABLE: "1"}
    reason = _interpreter_failure(environment, triton.__version__)
    if reason is not None:
        pytest.skip(reason)
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(CASES)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
    # every case runs, but the float64 ones where this Triton has no float64 tl.dot (Triton 3.0; 3.9 has it)
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    older = TorchVersion(triton.__version__) < (3, 9)
    assert all(older and "has no float64 tl.dot" in line for line in skips), skips


def test_an_older_triton_is_left_unused():
    """Triton 2.x (brought by torch 2.1-2.3) is treated as absent: the PyTorch path runs, even where the interpreter
    and GPATTN_TRITON=1 would ask for the kernels. A fresh process imports gpattn with a stand-in Triton of each
    version."""
    script = """
import importlib, sys, types
import torch
for version in ("2.1.0", "3.0.0"):
    triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.__version__, triton.language = version, language
    sys.modules.update({"triton": triton, "triton.language": language})
    sys.modules.pop("gpattn.fused.triton_scores", None)
    module = importlib.import_module("gpattn.fused.triton_scores")
    print(version, module.triton_available(), module.runs_triton(torch.empty(1)))
"""
    environment = {**os.environ, "TRITON_INTERPRET": "1", triton_scores.TRITON_VARIABLE: "1"}
    command = [sys.executable, "-c", script]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["2.1.0 False False", "3.0.0 True True"], result.stdout
