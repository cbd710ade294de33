#!/usr/bin/env python
"""Execute the teaching notebooks from their sources and write them, with their outputs, beside the sources.

Each notebook has one source, ``notebooks/NN_name.py`` (jupytext percent format: ``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell), paired with ``notebooks/NN_name.ipynb``, which carries the outputs of a full-size
run. Edit the ``.py`` (or the ``.ipynb`` in Jupyter with jupytext installed, which keeps the pair in sync), then, from
the repository root::

    make notebooks                                                       # all notebooks, at full size
    make notebooks NOTEBOOKS=notebooks/02_kernel_eigen_svgp_regression.py  # one notebook
    .venv/bin/python scripts/execute_notebooks.py --size smoke           # a quick check; writes nothing

The kernel runs *this* interpreter (a kernelspec written to a temporary folder, so that no other ``python3`` kernel on
the machine is picked up) in the notebook's folder, with ``GPATTN_NOTEBOOK_SIZE`` set (read by
``notebooks/_notebook_size.py``). ``tests/notebooks/test_notebooks.py`` runs every source at smoke size through
:func:`execute`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
SOURCE_PATTERN = "[0-9][0-9]_*.py"  # helpers such as _notebook_size.py do not match
KERNEL_NAME = "gpattn-notebooks"
SIZES = ("full", "smoke")


def notebook_sources(folder: Path = NOTEBOOK_DIR) -> list[Path]:
    """The notebook sources in ``folder``, in order."""
    return sorted(folder.glob(SOURCE_PATTERN))


def read_source(path: str | Path) -> nbformat.NotebookNode:
    """The notebook of the percent-format source ``path``, without outputs; cell ids are numbered (``cell-00``, ...) so
    that re-executions diff cleanly."""
    notebook = jupytext.read(path, fmt="py:percent")
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"
    return notebook


def execute(notebook: nbformat.NotebookNode, cwd: str | Path, size: str = "full", timeout: int = 900) -> float:
    """Execute ``notebook`` in place with a kernel of this interpreter, in ``cwd``, with ``GPATTN_NOTEBOOK_SIZE``
    set to ``size``; raise :class:`nbclient.exceptions.CellExecutionError` on the first failing cell.

    :param timeout: Seconds allowed per cell.
    :return: Wall time in seconds, kernel start-up included.
    """
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    if size not in SIZES:
        raise ValueError(f"expected size in {SIZES}, got {size!r}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpattn-kernels-") as kernel_dirs:
        write_kernel_spec(Path(kernel_dirs) / KERNEL_NAME)  # a kernelspec for sys.executable
        manager = AsyncKernelManager(
            kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_dirs])
        )
        client = NotebookClient(
            notebook, km=manager, timeout=timeout, record_timing=False, resources={"metadata": {"path": str(cwd)}}
        )
        client.execute(env={**os.environ, "GPATTN_NOTEBOOK_SIZE": size, "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", type=Path, help="notebook sources (default: every notebooks/NN_*.py)")
    parser.add_argument("--size", choices=SIZES, default="full", help="full: write the .ipynb; smoke: only check")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    args = parser.parse_args(argv)
    sources = args.sources or notebook_sources()
    for source in sources:
        if not source.match(SOURCE_PATTERN) or not source.is_file():
            parser.error(f"expected a notebook source notebooks/NN_name.py, got {source}")
    for source in sources:
        notebook = read_source(source)
        seconds = execute(notebook, source.parent, args.size, args.timeout)
        if args.size == "full":
            jupytext.write(notebook, source.with_suffix(".ipynb"), fmt="ipynb")
        written = f"wrote {source.with_suffix('.ipynb').name}" if args.size == "full" else "not written"
        print(f"{source.name}: executed at {args.size} size in {seconds:.1f} s ({written})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
