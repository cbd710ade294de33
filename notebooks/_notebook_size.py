"""Shared set-up of the gpattn notebooks: the size switch and quiet, reproducible defaults.

``GPATTN_NOTEBOOK_SIZE=full`` (default) runs the notebooks at the size whose results the text discusses;
``GPATTN_NOTEBOOK_SIZE=smoke`` shrinks data, steps, epochs and seeds so that every notebook runs in seconds (the test
suite executes them this way: ``tests/notebooks/test_notebooks.py``). ``GPATTN_NOTEBOOK_THREADS`` sets the number
of torch threads (default 1: the models are small, and one thread keeps runs reproducible and polite on shared
machines).
"""

from __future__ import annotations

import os
import warnings
from typing import TypeVar

SIZES = ("full", "smoke")
SIZE = os.environ.get("GPATTN_NOTEBOOK_SIZE", "full").strip().lower() or "full"
if SIZE not in SIZES:
    raise ValueError(f"expected GPATTN_NOTEBOOK_SIZE in {SIZES}, got {SIZE!r}")
SMOKE = SIZE == "smoke"

T = TypeVar("T")


def pick(full: T, smoke: T) -> T:
    """``full`` at full size, ``smoke`` at smoke size."""
    return smoke if SMOKE else full


def setup(seed: int = 0) -> None:
    """Seed torch, set the thread count and silence the one warning every notebook would otherwise print (tqdm's
    notebook progress bars need ipywidgets; gpattn's progress bars are off in the notebooks anyway)."""
    import torch

    warnings.filterwarnings("ignore", message="IProgress not found")
    torch.set_num_threads(int(os.environ.get("GPATTN_NOTEBOOK_THREADS", "1")))
    torch.manual_seed(seed)


def style() -> None:
    """Matplotlib defaults of the notebooks (call after ``%matplotlib inline``): modest resolution, small fonts."""
    import matplotlib

    matplotlib.rcParams.update(
        {"figure.dpi": 85, "savefig.dpi": 85, "font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8}
    )
