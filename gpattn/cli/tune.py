"""``gpattn tune``: an Optuna study per (task, row) on validation, the tuned configurations ``gpattn compare`` uses."""

from __future__ import annotations

import argparse
import sys
import time

from ..comparison.studies import shown_url
from .options import (
    CommandError,
    add_common,
    add_executor,
    bounded_int,
    device,
    kept_on_interrupt,
    make_executor,
    mps_note,
    out_dir,
    positive_int,
    prepare_out,
)

__all__ = ["COST", "add_tune", "run_tune"]

#: What ``gpattn tune`` writes into its run folder (replaced with ``--overwrite``): the default SQLite studies and their
#: lock, one folder of trial runs, and the tuned configurations
OUTPUTS = ("study.db", "study.db.lock", "trials", "tuned")
#: What a trial costs, measured (``gpattn tune --help`` and docs/guide/tuning.md say the same).
COST = (
    "Cost, measured with one torch thread per trial (docs/guide/tuning.md): a trial trains at most 60 epochs on "
    "MNIST-1D, 60-140 CPU-seconds with the protocol's 40-value signal model (an epoch: softmax 1.0 s, KEP-SVGP 1.8 s, "
    "SGPA 2.3 s; 30-70 with the earlier 10-token model), at most 100 epochs on digits, 20-56 CPU-seconds; the default "
    "20 trials x 7 rows x 2 tasks is about 5 CPU-hours, about 2.6 hours of wall time with --jobs 2 on an idle "
    "2-core machine (early stopping shortens it)"
)
#: the options that set a TuneConfig field of the same name
FIELDS = (
    "tasks",
    "rows",
    "trials",
    "seed",
    "pointer_epochs",
    "digits_epochs",
    "mnist1d_epochs",
    "patience",
    "eval_samples",
    "label",
)


def add_tune(commands) -> None:
    """Add the ``tune`` command to the subparsers ``commands``."""
    from ..comparison.tasks import TASKS
    from ..comparison.tune_config import TuneConfig
    from ..comparison.tuning_space import TUNED_ROWS, search_space_text

    defaults = TuneConfig()
    tune = commands.add_parser(
        "tune",
        help="tune every row's hyperparameters on validation (Optuna), for gpattn compare",
        description="One Optuna study (TPE sampler, seeded) per task and row, the same number of trials for every "
        "row: each trial trains one model with the tuning seed and scores it by its best validation NLL (the test "
        "split is never read). The studies live in an SQLite file OUT/study.db (no server) or any Optuna RDB URL "
        "(--storage), which several gpattn tune processes or machines can share. Prints one line per finished "
        "trial on standard error; Ctrl-C keeps the finished trials and --resume runs the missing ones. At the end "
        "writes the tuned configurations (best trial, search space, study record) to OUT/tuned/<task>.json and, "
        "with --write-tuned, into the package, where gpattn compare reads them by default. Search space: "
        f"{search_space_text()}. {COST}.",
    )
    tune.add_argument("--out", type=out_dir, default=None, help="run folder (default: runs/tune-<date>-<time>)")
    tune.add_argument("--tasks", nargs="+", choices=TASKS, default=None, help=f"default: {' '.join(defaults.tasks)}")
    tune.add_argument(
        "--rows",
        nargs="+",
        default=None,
        help=f"rows to tune (default: {' '.join(TUNED_ROWS)}); deep_ensemble and the Laplace row use softmax's "
        "configuration, the +ts rows need none",
    )
    tune.add_argument(
        "--trials",
        type=positive_int,
        default=None,
        help=f"finished trials per study, the same for every row (default: {defaults.trials})",
    )
    tune.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="trial workers (processes with --threads torch threads each) sharing the studies (default: %(default)s; "
        "about cores / threads). The budget stays exactly --trials finished trials per study",
    )
    add_executor(tune, "trial")
    tune.add_argument(
        "--storage",
        type=_storage,
        default=None,
        help="an Optuna RDB URL holding the studies, e.g. postgresql://user:password@host/db to share them between "
        "machines (default: sqlite:///OUT/study.db); --overwrite replaces OUT only: the studies of a --storage stay, "
        "and a new tuning with the same settings joins them",
    )
    tune.add_argument(
        "--resume",
        action="store_true",
        help="continue the studies in OUT (or --storage): their interrupted trials are marked failed and only the "
        "missing trials run; the options must be the original ones",
    )
    tune.add_argument(
        "--write-tuned",
        action="store_true",
        help="also write the tuned configurations into the package (gpattn/comparison/tuned/<task>.json), which "
        "gpattn compare uses by default",
    )
    numbers = (
        (
            "seed",
            bounded_int(0, (2**32 - 1) // 1000),  # Optuna's sampler of trial slot k takes seed * 1000 + k < 2**32
            "tuning seed, at most 4294967, not an evaluation seed 0-9 nor their ensembles' member seeds 0-49",
        ),
        ("mnist1d_epochs", positive_int, "most epochs of a trial on MNIST-1D"),
        ("digits_epochs", positive_int, "most epochs of a trial on digits"),
        ("pointer_epochs", positive_int, "most epochs of a trial on the pointer task"),
        ("patience", positive_int, "early stopping: epochs without a lower validation NLL"),
        ("eval_samples", positive_int, "Monte Carlo samples of the validation predictions"),
    )
    for name, kind, text in numbers:
        flag = "--" + name.replace("_", "-")
        tune.add_argument(flag, type=kind, default=None, help=f"{text} (default: {getattr(defaults, name)})")
    tune.add_argument("--label", default=None, help="a note stored with the tuned configurations (e.g. 'smoke run')")
    tune.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default: %(default)s)")
    tune.add_argument("--no-progress", action="store_true", help="print no line per finished trial and no live bar")
    add_common(tune, resume="continues the studies")


def _storage(text: str) -> str:
    """An argparse type: an Optuna RDB URL, not empty (which would have meant the default, sqlite:///OUT/study.db)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected an Optuna RDB URL, e.g. sqlite:///study.db, got {text!r}")
    return text


def run_tune(args: argparse.Namespace) -> int:
    """Run ``gpattn tune``; returns the exit status."""
    try:
        import optuna

        from ..comparison import tuning
    except ImportError as error:
        raise CommandError(f"gpattn tune needs Optuna ({error}): pip install 'gpattn[tune]'") from None
    from ..comparison.tune_config import TuneConfig
    from ..comparison.tuned_configuration import TUNED_DIRECTORY, check_same_budget, read_tuned, tuned_path, write_tuned

    settings = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    settings.update(device=args.device, threads=args.threads, jobs=args.jobs, progress=not args.no_progress)
    try:
        config = TuneConfig(**settings)
        if args.write_tuned:  # the package's files keep one budget per task: refused now, not after the trials
            for task in config.tasks:
                kept = {
                    row: entry for row, entry in read_tuned(task, TUNED_DIRECTORY).items() if row not in config.rows
                }
                budgets = dict.fromkeys(config.rows, config.budget(task))
                check_same_budget(budgets, kept, str(tuned_path(task, TUNED_DIRECTORY)))
        executor = make_executor(args)  # a Ray cluster's address checked, before any folder is made
        tuning.check_storage(args.storage, config.jobs, executor)  # one the workers can share
    except ValueError as error:
        print(f"gpattn tune: error: {error}", file=sys.stderr)
        return 2
    trials = config.trials * len(config.tasks) * len(config.rows)
    note = mps_note(config.device, min(config.jobs, trials), args.executor)
    if note:
        print(f"gpattn tune: note: {note}", file=sys.stderr)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with prepare_out(
        args.out or f"runs/tune-{time.strftime('%Y%m%d-%H%M%S')}",
        overwrite=args.overwrite,
        resume=args.resume,
        replaced=OUTPUTS,
        resumes_from_out=args.storage is None,  # with --storage the studies are there, not in OUT
    ) as out:
        start = time.perf_counter()
        kept = out / "study.db" if args.storage is None else shown_url(args.storage)
        diverged = None
        with kept_on_interrupt("trials", kept):
            try:
                summaries = tuning.tune(config, out, storage=args.storage, resume=args.resume, executor=executor)
            except tuning.TuningDivergedError as error:  # the other rows' configurations are kept (and written)
                summaries, diverged = error.summaries, error
        written = [
            tuned_path(task, out / "tuned") for task in config.tasks if tuned_path(task, out / "tuned").is_file()
        ]
        if args.write_tuned:
            for task in config.tasks:
                rows = {row: summaries[task, row] for row in config.rows if summaries[task, row] is not None}
                if rows:
                    written.append(write_tuned(task, rows, TUNED_DIRECTORY))
    for (task, row), summary in summaries.items():
        if diverged is not None and (task, row) in diverged.diverged:
            print(f"{task}/{row}: every trial diverged, no configuration")
        elif summary is None:
            print(f"{task}/{row}: not all trials finished (running in another process, or failed: --resume runs them)")
        else:
            print(
                f"{task}/{row}: best validation NLL {summary.best_val_nll:.4f} (trial {summary.best_trial} of "
                f"{summary.trials}), {summary.parameters}"
            )
    seconds = time.perf_counter() - start
    where = f"executor {args.executor}, jobs {config.jobs}, threads {config.threads}"
    print(f"{len(summaries)} studies in {seconds:.0f} s ({where})")
    if written:
        print("wrote " + ", ".join(str(path) for path in written))
    if diverged is not None:
        print(f"gpattn tune: error: {diverged}", file=sys.stderr)
        return 1
    return 0
