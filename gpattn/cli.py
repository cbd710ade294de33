"""Command line interface: ``gpattn compare`` (every attention on the toy task and digits), ``gpattn train`` (one
model, with checkpoints and ``--resume``) and ``gpattn regression`` (KEP-SVGP against the exact GP on the 1-D toy
data)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# Option types: a bad value exits with status 2 and "gpattn <command>: error: argument --x: <what was expected, what
# came>" before anything runs.


def _number(text: str, kind: Callable[[str], float], wanted: str, accept: Callable[[float], bool]):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda value: value >= 1)


def _non_negative_int(text: str) -> int:
    return _number(text, int, "a non-negative integer", lambda value: value >= 0)


def _positive_float(text: str) -> float:
    return _number(text, float, "a finite number > 0", lambda value: math.isfinite(value) and value > 0)


def _non_negative_float(text: str) -> float:
    return _number(text, float, "a finite number >= 0", lambda value: math.isfinite(value) and value >= 0)


def _device(text: str) -> str:
    from .validation import check_device

    try:
        device = check_device("device", text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected 'cpu', 'cuda' or 'cuda:<index>', got {text!r}")
    return text


def _out_dir(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder (created if missing), got the existing file {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpattn", description="Gaussian-process self-attention for GPyTorch.")
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
    _add_compare(commands)
    _add_train(commands)
    return parser


def _add_train(commands) -> None:
    from .attention import attention_names
    from .experiments.compare import TASKS, CompareConfig

    defaults = CompareConfig()
    train = commands.add_parser(
        "train",
        help="train and evaluate one model (checkpoints, --resume after an interruption)",
        description="Train one Transformer with the chosen attention on a task of the comparison, with best.pt / "
        "last.pt checkpoints in OUT/checkpoints, and write OUT/record.json (the same metrics as gpattn compare). "
        "After an interruption, the same command with --resume continues from last.pt and ends with the same "
        "numbers as an uninterrupted run (CPU).",
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


def _run_train(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .experiments.compare import CompareConfig, train_and_evaluate

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
            **epochs,
        )
    except ValueError as error:  # a combination of options (e.g. a rank above the head width)
        print(f"gpattn train: error: {error}", file=sys.stderr)
        return 2
    if args.resume and not (out / "checkpoints" / "last.pt").exists():
        print(f"gpattn train: error: --resume needs {out / 'checkpoints' / 'last.pt'}", file=sys.stderr)
        return 2
    from .experiments.training import CheckpointError, NonFiniteLossError

    try:
        record = train_and_evaluate(
            config, args.task, args.attention, args.seed, checkpoint_dir=out / "checkpoints", resume=args.resume
        )
    except (CheckpointError, NonFiniteLossError) as error:  # a clear message, not a traceback
        print(f"gpattn train: error: {error}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "record.json").write_text(json.dumps(record, indent=1))
    test = record["metrics"]["test"]
    print(", ".join(f"{key} {value:.4f}" for key, value in test.items()))
    print(f"wrote {out / 'record.json'}")
    return 0


def _add_compare(commands) -> None:
    from .attention import attention_names
    from .experiments.compare import TASKS, CompareConfig

    defaults = CompareConfig()
    compare = commands.add_parser(
        "compare",
        help="train and evaluate every attention on the pointer toy task and digits (shift, OOD)",
        description="Train a small Transformer per task, attention and seed under one training loop and evaluate "
        "accuracy, NLL, ECE, Brier, AURC, misclassification AUROC/FPR95, digits under shift (noise, rotation, blur, "
        "severities 1-5) and OOD (held-out digits, structured noise). Writes results.json, results.csv, table.md and "
        "figures into the run folder.",
    )
    compare.add_argument("--out", type=_out_dir, default=None, help="run folder (default: runs/compare-<date>-<time>)")
    compare.add_argument("--quick", action="store_true", help="one seed, few epochs: a first look in under 2 minutes")
    compare.add_argument(
        "--attentions", nargs="+", choices=attention_names(), default=None, help="default: every registry entry"
    )
    compare.add_argument("--tasks", nargs="+", choices=TASKS, default=None, help="default: %(choices)s")
    compare.add_argument(
        "--seeds", nargs="+", type=_non_negative_int, default=None, help=f"default: {list(defaults.seeds)}"
    )
    numbers = (
        ("pointer_epochs", _positive_int, "training epochs on the pointer task"),
        ("digits_epochs", _positive_int, "training epochs on digits"),
        ("eval_samples", _positive_int, "Monte Carlo samples at evaluation"),
        ("ensemble", _positive_int, "members per model: Deep / KEP-SVGP ensembles when > 1"),
        ("num_inducing", _positive_int, "inducing set size: KSVD rank, SGPA/SVGP inducing points"),
        ("beta", _non_negative_float, "KL weight"),
        ("ksvd_weight", _non_negative_float, "KSVD weight eta"),
    )
    for name, kind, text in numbers:
        flag = "--" + name.replace("_", "-")
        compare.add_argument(flag, type=kind, default=None, help=f"{text} (default: {getattr(defaults, name)})")
    compare.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: %(default)s)")
    compare.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _run_compare(args: argparse.Namespace) -> int:
    import time

    from .experiments.compare import CompareConfig, markdown_table, run_comparison, write_outputs

    names = (
        "attentions",
        "tasks",
        "seeds",
        "pointer_epochs",
        "digits_epochs",
        "eval_samples",
        "ensemble",
        "num_inducing",
        "beta",
        "ksvd_weight",
    )
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    overrides.update(device=args.device, progress=not args.no_progress)
    try:
        config = CompareConfig.quick(**overrides) if args.quick else CompareConfig(**overrides)
    except ValueError as error:
        print(f"gpattn compare: error: {error}", file=sys.stderr)
        return 2
    out = args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"
    records = run_comparison(config)
    written = write_outputs(records, config, out)
    print(markdown_table(records))
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        return _run_compare(args)
    if args.command == "train":
        return _run_train(args)
    if args.command == "regression":
        from .experiments import ToyRegressionConfig, format_result, run_toy_regression

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
        result = run_toy_regression(config, out=args.out, progress=not args.no_progress)
        print(format_result(result))
        print(f"wrote {args.out}/results.json and {args.out}/posterior.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
