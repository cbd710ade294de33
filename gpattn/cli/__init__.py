"""Command line interface: ``gpattn compare`` (every row on MNIST-1D and digits), ``gpattn tune`` (every row's
hyperparameters on validation, with Optuna), ``gpattn train`` (one model, with checkpoints and ``--resume``),
``gpattn regression`` (KEP-SVGP against the exact GP on the 1-D toy data) and ``gpattn report`` (the headline,
tables and results page of run folders); one module per command.

Exit status: 0 on success; 2 for a bad option (the message names it) before anything runs; 1 for a failure while
running (a diverged training, a damaged checkpoint, a folder that cannot be written, ...), printed as one line
``gpattn <command>: error: ...`` without a traceback; 130 after Ctrl-C (one line saying what was kept).
"""

from __future__ import annotations

import argparse
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
