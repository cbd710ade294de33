"""Command line interface: ``gpattn compare`` (every attention on the toy task and digits), ``gpattn train`` (one
model, with checkpoints and ``--resume``) and ``gpattn regression`` (KEP-SVGP against the exact GP on the 1-D toy
data).

Exit status: 0 on success; 2 for a bad option (the message names it) before anything runs; 1 for a failure while
running (a diverged training, a damaged checkpoint, a folder that cannot be written, ...), printed as one line
``gpattn <command>: error: ...`` without a traceback; 130 after Ctrl-C (one line saying what was kept).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import __version__
from .validation import check_device, check_float, check_int

# Option types: a bad value exits with status 2 and "gpattn <command>: error: argument --x: <what was expected, what
# came>" before anything runs; the checks are gpattn.validation's.


def _option(kind: Callable[[str], Any], check: Callable[..., Any], **bounds: Any) -> Callable[[str], Any]:
    """An argparse type: the text converted by ``kind`` (or left as text when it does not convert) and checked by a
    :mod:`gpattn.validation` helper, whose message names what was expected and what came."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = text
        try:
            return check("the value", value, **bounds)
        except ValueError as error:  # InputTypeError is a ValueError too
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


_positive_int = _option(int, check_int, minimum=1)
_non_negative_int = _option(int, check_int, minimum=0)
_positive_float = _option(float, check_float, minimum=0.0, strict_minimum=True)
_non_negative_float = _option(float, check_float, minimum=0.0)


def _device(text: str) -> str:
    try:
        check_device("device", text, types=("cpu", "cuda"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _out_dir(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder (created if missing), got the existing file {text!r}")
    return text


class CommandError(Exception):
    """An expected failure of a command: printed as one line ``gpattn <command>: error: <message>``, exit status 1."""


THREADS_HELP = (
    "torch threads per run (default: %(default)s; these models are small, so one thread per run is the fastest as "
    "soon as runs go in parallel or the machine has other work; the numbers depend on the thread count, so "
    "results are reproducible at a given --threads)"
)


def _add_common(parser: argparse.ArgumentParser, resume: str | None) -> None:
    parser.add_argument("--threads", type=_positive_int, default=1, help=THREADS_HELP)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in OUT (without it, an OUT that holds files is refused"
        + (f"; --resume {resume})" if resume else ")"),
    )


def prepare_out(out: str | os.PathLike, *, overwrite: bool, resume: bool, replaced: tuple[str, ...]) -> Path:
    """Check the run folder ``out`` before anything runs: it is created if missing and must be writable; a folder
    that already holds files is refused unless ``resume`` (continue it) or ``overwrite`` (the entries ``replaced``,
    e.g. ``"results.json"``, ``"runs"``, are deleted first, so no stale result is mixed with new ones).

    :raises CommandError: The folder cannot be created or written, or holds an earlier run.
    """
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not resume:
        if not overwrite:
            held = sorted(path.name for path in out.iterdir())
            shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
            raise CommandError(
                f"--out {out} already holds files ({shown}): pass --overwrite to replace that run"
                + (", --resume to continue it" if "runs" in replaced or "checkpoints" in replaced else "")
                + ", or choose another --out"
            )
        for name in replaced:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise CommandError(f"--out {out}: cannot create or write the folder ({reason})") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpattn", description="Gaussian-process self-attention for GPyTorch.")
    parser.add_argument("--version", action="version", version=f"gpattn {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    regression = commands.add_parser(
        "regression",
        help="fit KEP-SVGP (VariationalELBO and Pyro SVI) and the exact GP on the 1-D asymmetric toy data",
        description="Fit KEP-SVGP by VariationalELBO and by Pyro SVI, and the exact GP with the same induced kernel, "
        "on the 1-D asymmetric toy regression set; print test RMSEs and write results.json and posterior.png.",
    )
    regression.add_argument(
        "--out", type=_out_dir, default="runs/regression", help="output folder (default: %(default)s)"
    )
    regression.add_argument(
        "--seed", type=_non_negative_int, default=0, help="data and initialisation seed (default: %(default)s)"
    )
    regression.add_argument("--num-inducing", type=_positive_int, default=16, help="KSVD rank s (default: %(default)s)")
    regression.add_argument(
        "--landmarks", type=_positive_int, default=24, help="number of fixed landmarks M (default: %(default)s)"
    )
    regression.add_argument(
        "--iterations", type=_positive_int, default=500, help="optimisation steps per fit (default: %(default)s)"
    )
    regression.add_argument(
        "--pyro-iterations", type=_positive_int, default=1500, help="Pyro SVI steps (default: %(default)s)"
    )
    regression.add_argument(
        "--lr", type=_positive_float, default=0.05, help="Adam learning rate (default: %(default)s)"
    )
    regression.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    _add_common(regression, resume=None)
    _add_compare(commands)
    _add_train(commands)
    return parser


def _add_train(commands) -> None:
    from .attention import attention_names
    from .experiments import TASKS, CompareConfig

    defaults = CompareConfig()
    train = commands.add_parser(
        "train",
        help="train and evaluate one model (checkpoints, --resume after an interruption)",
        description="Train one Transformer with the chosen attention on a task of the comparison, with best.pt / "
        "last.pt checkpoints in OUT/checkpoints, and write OUT/record.json (the same metrics as gpattn compare). "
        "After an interruption, the same command with --resume continues from last.pt and ends with the same "
        "numbers as an uninterrupted run (CPU). Prints one line per epoch on standard error.",
    )
    train.add_argument("--attention", choices=attention_names(), default="kep_svgp", help="default: %(default)s")
    train.add_argument("--task", choices=TASKS, default="digits", help="default: %(default)s")
    train.add_argument("--seed", type=_non_negative_int, default=0, help="default: %(default)s")
    train.add_argument("--epochs", type=_positive_int, default=None, help="default: the comparison's for the task")
    train.add_argument("--eval-samples", type=_positive_int, default=defaults.eval_samples, help="default: %(default)s")
    train.add_argument(
        "--num-inducing", type=_positive_int, default=None, help="inducing set size (default: the layer's own)"
    )
    train.add_argument(
        "--out", type=_out_dir, default=None, help="run folder (default: runs/train-<task>-<attention>-<seed>)"
    )
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/last.pt")
    train.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: %(default)s)")
    train.add_argument("--no-progress", action="store_true", help="print no line per epoch")
    _add_common(train, resume="continues it")


class _EpochLines:
    """Print one line per finished epoch of ``gpattn train`` (on any stream), read from the ``last.pt`` that the
    training loop writes at the end of every epoch, polled by a background thread."""

    def __init__(self, path: Path, epochs: int) -> None:
        self.path, self.epochs = path, epochs
        self.stop = threading.Event()
        self.shown = 0
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _EpochLines:
        self.seen = self._stamp()
        self.thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop.set()
        self.thread.join()
        if exc_info[0] is None:
            self._show()  # the last epoch, in case the thread has not seen it yet

    def _stamp(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None

    def _watch(self) -> None:
        while not self.stop.wait(0.25):
            stamp = self._stamp()
            if stamp is not None and stamp != self.seen:
                self.seen = stamp
                self._show()

    def _show(self) -> None:
        from .experiments.checkpoints import load_checkpoint

        try:
            history = load_checkpoint(self.path).get("history", [])
        except Exception:  # a progress line is not worth a failure (the file may be between writes)
            return
        for entry in history[self.shown :]:
            try:
                line = (
                    f"epoch {entry['epoch']}/{self.epochs}: loss {entry['loss']:.4f}, val accuracy "
                    f"{entry['val_accuracy']:.4f}, val nll {entry['val_nll']:.4f} ({entry['seconds']:.1f} s)"
                )
            except (KeyError, TypeError, ValueError):
                line = f"epoch {len(history)}/{self.epochs} done"
            print(line, file=sys.stderr, flush=True)
        self.shown = max(self.shown, len(history))


def _run_train(args: argparse.Namespace) -> int:
    from .experiments.compare import CompareConfig, make_train_config, train_and_evaluate
    from .experiments.records import write_json_atomically
    from .experiments.runner import torch_threads

    out = Path(args.out or f"runs/train-{args.task}-{args.attention}-{args.seed}")
    epochs = {} if args.epochs is None else {f"{args.task}_epochs": args.epochs}
    try:
        config = CompareConfig(
            attentions=(args.attention,),
            tasks=(args.task,),
            seeds=(args.seed,),
            eval_samples=args.eval_samples,
            num_inducing=args.num_inducing,
            device=args.device,
            progress=False,
            threads=args.threads,
            **epochs,
        )
    except ValueError as error:  # a combination of options (e.g. a rank above the head width)
        print(f"gpattn train: error: {error}", file=sys.stderr)
        return 2
    if args.resume and not (out / "checkpoints" / "last.pt").exists():
        print(f"gpattn train: error: --resume needs {out / 'checkpoints' / 'last.pt'}", file=sys.stderr)
        return 2
    prepare_out(out, overwrite=args.overwrite, resume=args.resume, replaced=("record.json", "checkpoints"))
    total = make_train_config(config, args.task, args.seed).epochs
    lines = nullcontext() if args.no_progress else _EpochLines(out / "checkpoints" / "last.pt", total)
    with torch_threads(args.threads), lines:
        record = train_and_evaluate(
            config, args.task, args.attention, args.seed, checkpoint_dir=out / "checkpoints", resume=args.resume
        )
    write_json_atomically(out / "record.json", record.to_dict())
    test = asdict(record.metrics.test)
    print(", ".join(f"{key} {value:.4f}" for key, value in test.items()))
    print(f"wrote {out / 'record.json'}")
    return 0


def _add_compare(commands) -> None:
    from .experiments import DEFAULT_ATTENTIONS, DEFAULT_TASKS, TASKS, CompareConfig, compare_rows

    defaults = CompareConfig()
    compare = commands.add_parser(
        "compare",
        help="train and evaluate the attentions on MNIST-1D and digits (shift, OOD, +ts rows, paired statistics)",
        description="Train a small Transformer per task, attention and seed under one training loop and evaluate "
        "accuracy, NLL, ECE (top-label and classwise), Brier, AURC, misclassification AUROC/FPR95, metrics under "
        "shift (severities 1-5) and OOD (AUROC, AUPR-In/Out), each model also temperature-scaled on the validation "
        "split (+ts rows), the KSVD fidelity of the KSVD layers, and KEP-SVGP minus every other row over paired "
        "seeds with 95 % t intervals. Prints one line per finished run on standard "
        "error and writes its record at once to OUT/runs/ (Ctrl-C keeps the finished runs, --resume trains the "
        "others); at the end writes results.json, results.csv, table.md and figures into OUT.",
    )
    compare.add_argument("--out", type=_out_dir, default=None, help="run folder (default: runs/compare-<date>-<time>)")
    compare.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test (labelled so in table.md): one seed, few epochs, to check that everything runs; the "
        "pointer task is not learned in this budget",
    )
    compare.add_argument(
        "--attentions",
        nargs="+",
        choices=compare_rows(),
        default=None,
        help=f"rows: registered attentions and softmax_mc_dropout (default: {' '.join(DEFAULT_ATTENTIONS)})",
    )
    compare.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=None,
        help=f"default: {' '.join(DEFAULT_TASKS)} (--quick: pointer digits)",
    )
    compare.add_argument(
        "--seeds", nargs="+", type=_non_negative_int, default=None, help=f"default: {list(defaults.seeds)}"
    )
    numbers = (
        ("pointer_epochs", _positive_int, "training epochs on the pointer task"),
        ("digits_epochs", _positive_int, "training epochs on digits"),
        ("mnist1d_epochs", _positive_int, "training epochs on MNIST-1D"),
        ("eval_samples", _positive_int, "Monte Carlo samples at evaluation"),
        ("ensemble", _positive_int, "members per model: Deep / KEP-SVGP ensembles when > 1"),
        ("num_inducing", _positive_int, "inducing set size: KSVD rank, SGPA/SVGP inducing points"),
        ("beta", _non_negative_float, "KL weight"),
        ("ksvd_weight", _non_negative_float, "KSVD weight eta"),
        ("ece_bins", _positive_int, "equal-width bins of the ECE and reliability diagrams"),
        ("mc_dropout", _non_negative_float, "dropout rate of the softmax_mc_dropout row"),
        ("fidelity_sequences", _non_negative_int, "test sequences for the KSVD fidelity (0: none)"),
    )
    for name, kind, text in numbers:
        flag = "--" + name.replace("_", "-")
        compare.add_argument(flag, type=kind, default=None, help=f"{text} (default: {getattr(defaults, name)})")
    compare.add_argument(
        "--no-temperature-scaling", action="store_true", help="leave out the temperature-scaled +ts rows"
    )
    compare.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: %(default)s)")
    compare.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="runs trained at the same time in worker processes (default: %(default)s; about cores / threads: 2 on a "
        "2-core machine). The results are identical whatever --jobs is, for a given --threads",
    )
    compare.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted comparison in OUT: the runs whose records are in OUT/runs are read back (they "
        "must have been made with the same settings), the others trained",
    )
    compare.add_argument("--no-progress", action="store_true", help="print no line per finished run and no live bar")
    _add_common(compare, resume="continues it")


def _run_compare(args: argparse.Namespace) -> int:
    import time

    from .experiments.compare import CompareConfig
    from .experiments.report import table_text, write_outputs
    from .experiments.runner import run_comparison
    from .plotting import write_comparison_figures

    names = (
        "attentions",
        "tasks",
        "seeds",
        "pointer_epochs",
        "digits_epochs",
        "mnist1d_epochs",
        "eval_samples",
        "ensemble",
        "num_inducing",
        "beta",
        "ksvd_weight",
        "ece_bins",
        "mc_dropout",
        "fidelity_sequences",
    )
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_temperature_scaling:
        overrides["temperature_scaling"] = False
    overrides.update(device=args.device, progress=not args.no_progress, threads=args.threads, jobs=args.jobs)
    try:
        config = CompareConfig.quick(**overrides) if args.quick else CompareConfig(**overrides)
    except ValueError as error:
        print(f"gpattn compare: error: {error}", file=sys.stderr)
        return 2
    out = prepare_out(
        args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}",
        overwrite=args.overwrite,
        resume=args.resume,
        replaced=("runs", "results.json", "results.csv", "table.md", *FIGURES),
    )
    start = time.perf_counter()
    try:
        records = run_comparison(config, out=out, resume=args.resume)
    except KeyboardInterrupt as interrupt:
        finished = getattr(interrupt, "finished", None)
        done = "" if finished is None else f"{finished} of {interrupt.total} runs finished, "
        raise CommandInterrupted(
            f"interrupted; {done}kept in {out / 'runs'}; the same command with --resume continues"
        ) from None
    written = write_outputs(records, config, out) + write_comparison_figures(records, out)
    print(table_text(records, config))
    print(f"{len(records)} runs in {time.perf_counter() - start:.0f} s (jobs {config.jobs}, threads {config.threads})")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


class CommandInterrupted(KeyboardInterrupt):
    """Ctrl-C, with the line that says what was kept."""


#: the figures gpattn compare writes (replaced with --overwrite)
FIGURES = (
    "reliability_pointer.png",
    "reliability_digits.png",
    "shift.png",
    "ood_histograms.png",
    "spectra.png",
)


def _run_regression(args: argparse.Namespace) -> int:
    from .experiments import ToyRegressionConfig, format_result, run_toy_regression
    from .experiments.records import write_text_atomically
    from .experiments.runner import torch_threads

    if args.num_inducing > args.landmarks:
        message = f"--num-inducing ({args.num_inducing}) must not exceed --landmarks ({args.landmarks})"
        print(f"gpattn regression: error: {message}", file=sys.stderr)
        return 2
    config = ToyRegressionConfig(
        seed=args.seed,
        num_landmarks=args.landmarks,
        num_inducing=args.num_inducing,
        iterations=args.iterations,
        pyro_iterations=args.pyro_iterations,
        lr=args.lr,
    )
    out = prepare_out(args.out, overwrite=args.overwrite, resume=False, replaced=("results.json", "posterior.png"))
    import matplotlib.pyplot as plt

    from .plotting import plot_pair_posterior

    with torch_threads(args.threads):
        result = run_toy_regression(config, progress=not args.no_progress)
    write_text_atomically(out / "results.json", result.to_json())
    models = result.models
    figure = plot_pair_posterior(
        models["kep_svgp_elbo"], result.data, exact_gp=models["exact_gp"], pyro_model=models.get("kep_svgp_pyro")
    )
    temporary = out / ".posterior.png.tmp"
    figure.savefig(temporary, dpi=120, bbox_inches="tight", format="png")
    plt.close(figure)
    os.replace(temporary, out / "posterior.png")
    print(format_result(result))
    print(f"wrote {out / 'results.json'} and {out / 'posterior.png'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpattn`` with ``argv`` (default: the process's arguments) and return the exit status."""
    args = build_parser().parse_args(argv)
    run = {"compare": _run_compare, "train": _run_train, "regression": _run_regression}[args.command]
    prefix = f"gpattn {args.command}"
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


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in text:
        text += f": {error.filename}"
    return text


if __name__ == "__main__":
    raise SystemExit(main())
