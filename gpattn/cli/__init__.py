"""Command line interface: ``gpattn compare`` (every row on MNIST-1D and digits), ``gpattn tune`` (every row's
hyperparameters on validation, with Optuna), ``gpattn train`` (one model, with checkpoints and ``--resume``),
``gpattn regression`` (KEP-SVGP against the exact GP on the 1-D toy data) and ``gpattn report`` (the headline,
tables and results page of run folders); one module per command.

Exit status: 0 on success; 2 for a bad option (the message names it) before anything runs; 1 for a failure while
running (a diverged training, a damaged checkpoint, a folder that cannot be written, ...), printed as one line
``gpattn <command>: error: ...`` without a traceback; 130 after Ctrl-C (one line saying what was kept). A reader of
standard output or error that goes away early (``gpattn report RUN | head -1``, ``gpattn train ... 2>&1 | head``)
stops only the output: the rest of it is dropped, the command still trains and writes its files, and its exit status
is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Sequence

from .. import __version__
from .compare import add_compare, run_compare
from .options import CommandError, CommandInterrupted, prepare_out
from .regression import add_regression, run_regression
from .report import add_report, run_report
from .train import add_train, run_train
from .tune import add_tune, run_tune

__all__ = ["CommandError", "build_parser", "main", "prepare_out"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``gpattn`` and its commands."""
    parser = argparse.ArgumentParser(prog="gpattn", description="Gaussian-process self-attention for GPyTorch.")
    parser.add_argument("--version", action="version", version=f"gpattn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_regression(commands)
    add_compare(commands)
    add_tune(commands)
    add_train(commands)
    add_report(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpattn`` with ``argv`` (default: the process's arguments) and return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "resume", False) and getattr(args, "overwrite", False):  # a bad option: before anything runs
        parser.exit(
            2,
            f"gpattn {args.command}: error: --resume and --overwrite exclude each other: --resume continues the run "
            "in --out, --overwrite replaces it\n",
        )
    runners = {
        "compare": run_compare,
        "tune": run_tune,
        "train": run_train,
        "regression": run_regression,
        "report": run_report,
    }
    run = runners[args.command]
    prefix = f"gpattn {args.command}"
    default_format = warnings.formatwarning
    warnings.formatwarning = _warning_line(prefix, default_format)  # gpattn's warnings as one line each
    streams = sys.stdout, sys.stderr
    # a closed stream (``1>&-``, pythonw) is None, to which print writes nothing: left as it is
    sys.stdout, sys.stderr = (None if stream is None else _ReaderOptional(stream) for stream in streams)
    try:
        return run(args)
    except KeyboardInterrupt as interrupt:
        message = str(interrupt) if isinstance(interrupt, CommandInterrupted) else "interrupted"
        print(f"{prefix}: {message}", file=sys.stderr)
        return 130
    except CommandError as error:
        print(f"{prefix}: error: {error}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as error:  # CheckpointError, TrainingDivergedError, ... too
        print(f"{prefix}: error: {_one_line(error)}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = default_format
        try:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, full disk, None: the status
                    stream.flush()  # stays the command's
        finally:
            sys.stdout, sys.stderr = streams


class _ReaderOptional:
    """A command's standard output or error whose reader may go away early (a pipe into ``head``): from then on what
    is written is dropped, instead of a ``BrokenPipeError`` that would stop the command (a training, after its first
    line of progress) or fail its error message in turn. The stream's file descriptor is pointed at the null device
    then, so that the interpreter's last flush of what is still buffered raises nothing either."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.reader_gone = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError):  # a stream without a file descriptor: nothing buffered to flush there
            pass

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ... of the stream
        return getattr(self.stream, name)


def _warning_line(prefix: str, default_format):
    """``warnings.formatwarning`` for a command: a warning of gpattn's own classes as ``<prefix>: warning: <message>``
    (no file name and source line), any other as Python formats it."""

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__module__.startswith("gpattn."):
            return f"{prefix}: warning: {' '.join(str(message).split())}\n"
        return default_format(message, category, filename, lineno, line)

    return format_warning


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in text:
        text += f": {error.filename}"
    return text
