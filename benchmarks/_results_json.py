"""What ``gpu_check.py`` and ``gpu_grid.py`` share: their one JSON file of results, written whole after every step
(a section, a variant) and again when the script is stopped by Ctrl-C or SIGTERM (``timeout``, a job's time limit).

Not a script: each of them loads this file by its path, as a sibling (not an import: ``python benchmarks/<script>.py``
runs from a copy of the repository with nothing installed for it, and every loaded copy of a script gets its own copy
of this module). The standard library only: ``gpu_grid.py`` imports neither torch nor gpattn.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


class Stopped(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM (``timeout``, a job's time limit) inside :func:`kept_when_stopped`:
    handled as Ctrl-C is (nothing records it as one of its errors and goes on; the processes the script started are
    stopped), and the results so far are written."""


def _stop(signum, frame) -> None:
    raise Stopped(f"signal {signum}")


def write_results(results: dict, out: Path) -> None:
    """The results as JSON at ``out``, through a temporary file and a rename (a stop while writing leaves the previous
    file whole); ``os.devnull`` directly."""
    text = json.dumps(results, indent=2, default=str)
    if str(out) == os.devnull:
        out.write_text(text)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, out)


@contextlib.contextmanager
def kept_when_stopped(
    results: dict, out: Path, what: str, before_writing: Callable[[], None] | None = None
) -> Iterator[None]:
    """For the block, SIGTERM raises :class:`Stopped` in the main thread, as Ctrl-C raises ``KeyboardInterrupt`` (in
    another thread, where Python sets no signal handler, SIGTERM keeps its handler); the caller's handler is restored
    after the block. Either stop ends the block: ``results["stopped"]`` names it, ``before_writing()`` (if given)
    completes the results, they are written to ``out`` (:func:`write_results`) and a line says that ``what`` (e.g.
    ``"sections"``) so far are there; the script then goes on after the block (to its summary).
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if in_main_thread else None
    try:
        yield
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (Stopped)
        results["stopped"] = f"{type(error).__name__}: {error}"
        if before_writing is not None:
            before_writing()
        write_results(results, out)
        print(f"stopped ({results['stopped']}); the {what} so far are in {out}", flush=True)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
