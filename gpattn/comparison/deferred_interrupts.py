"""Ctrl-C while tuning trials run, never in the middle of a study write: :func:`interrupt` raises
``KeyboardInterrupt`` at once, or at the end of a :func:`signals_deferred` block (a claim, a trial's result);
:func:`interrupt_handler` installs it for a signal inside a block."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["interrupt", "interrupt_handler", "signals_deferred"]

_STATE = {"depth": 0, "pending": False}  # per process: inside signals_deferred, and a signal came meanwhile


def interrupt(signum: int, frame: Any) -> None:
    """The handler of Ctrl-C (SIGINT) and of a worker's SIGTERM while trials run: ``KeyboardInterrupt``, at once or,
    inside :func:`signals_deferred`, at its end."""
    if _STATE["depth"]:
        _STATE["pending"] = True
    else:
        raise KeyboardInterrupt


@contextmanager
def signals_deferred() -> Iterator[None]:
    """A study write (a claim with its slot and owner, a trial's result) that :func:`interrupt` never cuts in half:
    the ``KeyboardInterrupt`` of a signal that comes meanwhile is raised after it. A trial claimed before it is then
    still running and marked failed by :func:`~gpattn.comparison.studies.release_trials`."""
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1
        if not _STATE["depth"] and _STATE["pending"]:
            _STATE["pending"] = False
            raise KeyboardInterrupt


@contextmanager
def interrupt_handler(signum: int) -> Iterator[None]:
    """:func:`interrupt` handles ``signum`` inside the block (in the main thread; elsewhere Python's handlers stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        signal.signal(signum, previous)
