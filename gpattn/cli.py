"""Command line interface: ``gpattn regression`` (more commands arrive with the attention layers)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpattn", description="Gaussian-process self-attention for GPyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    regression = commands.add_parser(
        "regression",
        help="fit KEP-SVGP (VariationalELBO and Pyro SVI) and the exact GP on the 1-D asymmetric toy data",
        description="Fit KEP-SVGP by VariationalELBO and by Pyro SVI, and the exact GP with the same induced kernel, "
        "on the 1-D asymmetric toy regression set; print test RMSEs and write results.json and posterior.png.",
    )
    regression.add_argument("--out", default="runs/regression", help="output folder (default: %(default)s)")
    regression.add_argument("--seed", type=int, default=0, help="data and initialisation seed (default: %(default)s)")
    regression.add_argument("--rank", type=_positive_int, default=16, help="KSVD rank s (default: %(default)s)")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "regression":
        from .experiments import ToyRegressionConfig, format_result, run_toy_regression

        if args.rank > args.landmarks:
            message = f"--rank ({args.rank}) must not exceed --landmarks ({args.landmarks})"
            print(f"gpattn regression: error: {message}", file=sys.stderr)
            return 2
        config = ToyRegressionConfig(
            seed=args.seed,
            num_landmarks=args.landmarks,
            rank=args.rank,
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
