"""``gpattn regression``: KEP-SVGP (VariationalELBO and Pyro SVI) against the exact GP on the 1-D toy data."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .options import add_common, out_dir, positive_float, positive_int, prepare_out, seed_number

#: What ``gpattn regression`` writes into its run folder (replaced with ``--overwrite``)
OUTPUTS = ("results.json", "posterior.png")

__all__ = ["add_regression", "run_regression"]


def add_regression(commands) -> None:
    """Add the ``regression`` command to the subparsers ``commands``."""
    regression = commands.add_parser(
        "regression",
        help="fit KEP-SVGP (VariationalELBO and Pyro SVI) and the exact GP on the 1-D asymmetric toy data",
        description="Fit KEP-SVGP by VariationalELBO and by Pyro SVI, and the exact GP with the same induced kernel, "
        "on the 1-D asymmetric toy regression set; print test RMSEs and write results.json and posterior.png.",
    )
    regression.add_argument(
        "--out", type=out_dir, default="runs/regression", help="output folder (default: %(default)s)"
    )
    regression.add_argument(
        "--seed", type=seed_number, default=0, help="data and initialisation seed (default: %(default)s)"
    )
    regression.add_argument("--num-inducing", type=positive_int, default=16, help="KSVD rank s (default: %(default)s)")
    regression.add_argument(
        "--landmarks", type=positive_int, default=24, help="number of fixed landmarks M (default: %(default)s)"
    )
    regression.add_argument(
        "--iterations",
        type=positive_int,
        default=500,
        help="optimisation steps of the exact GP fit and of the VariationalELBO fit (default: %(default)s)",
    )
    regression.add_argument(
        "--pyro-iterations", type=positive_int, default=1500, help="Pyro SVI steps (default: %(default)s)"
    )
    regression.add_argument(
        "--lr",
        type=positive_float,
        default=0.05,
        help="Adam learning rate of the exact GP and of the VariationalELBO fit's hyperparameters; not of the Pyro "
        "SVI fit (default: %(default)s)",
    )
    regression.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    # the three fits run one after the other: no runs in parallel, which the shared help speaks of
    threads = "torch threads of the fits (default: %(default)s; the numbers depend on the thread count)"
    add_common(regression, resume=None, threads_help=threads)


def run_regression(args: argparse.Namespace) -> int:
    """Run ``gpattn regression``; returns the exit status."""
    from .. import comparison
    from ..comparison.environment import code_version
    from ..comparison.local_executor import torch_threads
    from ..comparison.records import write_text_atomically

    if args.num_inducing > args.landmarks:
        message = f"--num-inducing ({args.num_inducing}) must not exceed --landmarks ({args.landmarks})"
        print(f"gpattn regression: error: {message}", file=sys.stderr)
        return 2
    config = comparison.ToyRegressionConfig(
        seed=args.seed,
        num_landmarks=args.landmarks,
        num_inducing=args.num_inducing,
        iterations=args.iterations,
        pyro_iterations=args.pyro_iterations,
        lr=args.lr,
    )
    import matplotlib.pyplot as plt

    from ..plotting import plot_pair_posterior

    code = code_version()  # the code this process imported, read before the fit (as compare and train do)
    with prepare_out(args.out, overwrite=args.overwrite, resume=False, replaced=OUTPUTS) as out:
        with torch_threads(args.threads):
            result = comparison.run_toy_regression(config, progress=not args.no_progress)
        # the result, and what its last bits depend on besides its config: the thread count and the code
        content = {**json.loads(result.to_json()), "threads": args.threads, **code}
        write_text_atomically(out / "results.json", json.dumps(content, indent=2))
        models = result.models
        figure = plot_pair_posterior(
            models["kep_svgp_elbo"], result.data, exact_gp=models["exact_gp"], pyro_model=models.get("kep_svgp_pyro")
        )
        temporary = out / ".posterior.png.tmp"
        figure.savefig(temporary, dpi=120, bbox_inches="tight", format="png")
        plt.close(figure)
        os.replace(temporary, out / "posterior.png")
    print(comparison.format_result(result))
    print(f"wrote {out / 'results.json'} and {out / 'posterior.png'}")
    return 0
