"""``gpattn compare``: every row on MNIST-1D and digits (shift, OOD, ``+ts`` rows, paired statistics)."""

from __future__ import annotations

import argparse
import sys
import time

from .options import (
    CommandError,
    add_common,
    add_executor,
    device,
    kept_on_interrupt,
    make_executor,
    missing_tuned_files,
    mps_note,
    non_negative_float,
    non_negative_int,
    open_unit_float,
    out_dir,
    positive_int,
    prepare_out,
    remove_stale_files,
    seed_number,
    tuned_dir,
)

__all__ = ["add_compare", "run_compare", "run_folder_outputs"]

#: the options that override a CompareConfig field of the same name
OVERRIDES = (
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


def add_compare(commands) -> None:
    """Add the ``compare`` command to the subparsers ``commands``."""
    from ..attention import attention_names
    from ..comparison import DEFAULT_ATTENTIONS, DEFAULT_TASKS, MAIN_TABLE_ROWS, TASKS, CompareConfig
    from ..methods import method_names

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
    compare.add_argument("--out", type=out_dir, default=None, help="run folder (default: runs/compare-<date>-<time>)")
    preset = compare.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test (labelled so in table.md): one seed, few epochs, to check that everything runs; the "
        "pointer task is not learned in this budget",
    )
    preset.add_argument(
        "--main",
        action="store_true",
        help="the protocol's main job (make main): the primary pair kep_svgp and softmax (and their +ts rows) on "
        "mnist1d, seeds 0-6 (a subset of the primary endpoint's 10 seeds that trains within 15 minutes on 2 cores; "
        "--full runs all 10), tuned configurations",
    )
    preset.add_argument(
        "--full",
        action="store_true",
        help="the protocol's full grid: every main-table row (" + " ".join(MAIN_TABLE_ROWS) + ") on mnist1d and "
        "digits, seeds 0-4, and seeds 5-9 for the primary pair (--seeds replaces both: every row on those seeds); the "
        "other options override a preset's settings",
    )
    others = " and ".join(name for name in method_names() if name not in attention_names())
    papers = " / ".join(name for name in attention_names() if name.endswith("_paper"))
    compare.add_argument(
        "--attentions",
        nargs="+",
        choices=method_names(),
        default=None,
        help=f"rows: registered attentions and {others} (default: {' '.join(DEFAULT_ATTENTIONS)}). kep_svgp and "
        f"primal are gpattn's variants of KEP-SVGP and Primal-Attention; {papers} are the papers' methods as their "
        "official code runs them (features='primal_tokens', the official KSVD number; the documentation's 'Faithful "
        "to the papers' page says what differs)",
    )
    compare.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=None,
        help=f"default: {' '.join(DEFAULT_TASKS)} (--quick: pointer digits; --main: mnist1d)",
    )
    compare.add_argument(
        "--seeds",
        nargs="+",
        type=seed_number,
        default=None,
        help=f"default: {list(defaults.seeds)} (--quick: [0]; --main: 0-6; --full: 0-4, and 5-9 for the primary pair)",
    )
    numbers = (
        ("pointer_epochs", positive_int, "training epochs on the pointer task"),
        ("digits_epochs", positive_int, "training epochs on digits"),
        ("mnist1d_epochs", positive_int, "training epochs on MNIST-1D"),
        ("eval_samples", positive_int, "Monte Carlo samples at evaluation"),
        ("ensemble", positive_int, "members per model: Deep / KEP-SVGP ensembles when > 1"),
        ("num_inducing", positive_int, "inducing set size: KSVD rank, SGPA/SVGP inducing points"),
        ("beta", non_negative_float, "KL weight"),
        ("ksvd_weight", non_negative_float, "KSVD weight eta"),
        ("ece_bins", positive_int, "equal-width bins of the ECE and reliability diagrams"),
        ("mc_dropout", open_unit_float, "dropout rate of the softmax_mc_dropout row, in (0, 1)"),
        ("fidelity_sequences", non_negative_int, "test sequences for the KSVD fidelity (0: none)"),
    )
    for name, kind, text in numbers:
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if default is None:  # num_inducing: each layer's own
            default = (
                "each layer's own: s = min(10, head width) for KEP-SVGP and Primal-Attention, 16 for SGPA, SVGP; on "
                "mnist1d the task's 5"
            )
        compare.add_argument(flag, type=kind, default=None, help=f"{text} (default: {default})")
    compare.add_argument(
        "--no-temperature-scaling", action="store_true", help="leave out the temperature-scaled +ts rows"
    )
    compare.add_argument(
        "--untuned",
        action="store_true",
        help="train every row with the shared settings above; by default a (task, row) with a tuned configuration "
        "(gpattn tune; the package's gpattn/comparison/tuned/<task>.json) uses it in their place (--quick: always "
        "the shared settings)",
    )
    compare.add_argument(
        "--tuned-dir",
        type=tuned_dir,
        default=None,
        help="the folder of the tuned configurations <task>.json (e.g. OUT/tuned of a gpattn tune run; default: the "
        "package's; a task without its file there trains with the shared settings, which a note says)",
    )
    compare.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default: %(default)s)")
    compare.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="runs trained at the same time in worker processes (default: %(default)s; about cores / threads: 2 on a "
        "2-core machine). The results are identical whatever --jobs is, for a given --threads",
    )
    add_executor(compare, "run")
    compiled = compare.add_mutually_exclusive_group()  # the compiled model's CUDA graphs cannot run inside a capture
    compiled.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every model's forward pass: CUDA graphs (reduce-overhead) on CUDA, the default mode on "
        "CPU, eager's random numbers (fallback_random); with torch 2.13 the numbers equal eager's up to float "
        "rounding (torch 2.11 draws other dropout masks); each input shape and mode compiles once per run (about a "
        "minute per run on a CPU); needs torch 2.6 or later",
    )
    compiled.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --device cuda: capture every full-size training step (forward and backward passes) as one CUDA "
        "graph and replay it, and the evaluation's passes too, for the rows whose layers support it (SGPA's, the "
        "symmetric SVGP's and CGPT's run eagerly; each record's train.cuda_graphs says which did); reproducible, but "
        "other random draws than the eager runs'; no compiler (see the attention guide)",
    )
    compare.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted comparison in OUT: the runs whose records are in OUT/runs are read back (they "
        "must have been made with the same settings), the others trained; the results and figures are written anew "
        "for the runs asked for (records of other runs in OUT/runs are kept, and left out)",
    )
    compare.add_argument("--no-progress", action="store_true", help="print no line per finished run and no live bar")
    add_common(compare, resume="continues it")


#: the shared settings a tuned configuration may set in their place: option name -> hyperparameter
TUNABLE_OPTIONS = {
    "pointer_epochs": "epochs",
    "digits_epochs": "epochs",
    "mnist1d_epochs": "epochs",
    "num_inducing": "num_inducing",
    "beta": "beta",
    "ksvd_weight": "ksvd_weight",
    "mc_dropout": "dropout",
}


def _tuned_note(config, runs, args: argparse.Namespace) -> str | None:
    """The note for shared settings given on the command line that some planned runs do not use, their tuned
    configuration setting that hyperparameter instead (documented, but easily missed), or ``None``."""
    from ..methods import get_method

    given = [name for name in TUNABLE_OPTIONS if getattr(args, name, None) is not None]
    rows: dict[str, set[str]] = {}  # option -> "task: row" of the runs it does not reach
    for task, row, _ in runs:
        entry = config.tuned_entry(task, row)
        for name in given:
            # an epochs option reaches its task's runs only, --mc-dropout the rows that predict with dropout only
            reaches = name == f"{task}_epochs" if name.endswith("_epochs") else True
            reaches = reaches and (name != "mc_dropout" or get_method(row).predictive.mc_dropout)
            if entry is not None and reaches and TUNABLE_OPTIONS[name] in entry.hyperparameters:
                rows.setdefault(name, set()).add(f"{row} on {task}")
    if not rows:
        return None
    parts = [
        f"--{name.replace('_', '-')} {getattr(args, name)} (not {', '.join(sorted(reached))})"
        for name, reached in rows.items()
    ]
    return (
        f"{'; '.join(parts)}: these rows train with their tuned configuration, which sets that hyperparameter; "
        "--untuned trains every row with the shared settings"
    )


def _unused_options(config, runs, args: argparse.Namespace) -> list[str]:
    """The notes for options given on the command line that reach no planned run (one each): an epochs option of a
    task not compared, ``--num-inducing`` / ``--ksvd-weight`` / ``--mc-dropout`` where no row has an inducing set /
    a KSVD penalty / dropout at prediction, ``--tuned-dir`` where every row trains with the shared settings."""
    from ..attention import attention_arguments
    from ..methods import get_method

    rows = sorted({row for _, row, _ in runs})
    shown = ", ".join(rows)
    notes = [
        f"--{task}-epochs {getattr(args, f'{task}_epochs')}: no run of this comparison is on {task} (tasks: "
        f"{' '.join(config.tasks)})"
        for task in ("pointer", "digits", "mnist1d")
        if getattr(args, f"{task}_epochs", None) is not None and task not in config.tasks
    ]
    layer_options = (("num_inducing", "has an inducing set to size"), ("ksvd_weight", "has a KSVD penalty to weight"))
    for name, what in layer_options:
        value = getattr(args, name, None)
        if value is not None and not any(name in attention_arguments(get_method(row).attention) for row in rows):
            notes.append(f"--{name.replace('_', '-')} {value}: no row of this comparison ({shown}) {what}")
    if args.mc_dropout is not None and not any(get_method(row).predictive.mc_dropout for row in rows):
        notes.append(f"--mc-dropout {args.mc_dropout}: no row of this comparison ({shown}) predicts with dropout")
    if args.tuned_dir is not None and not config.tuned:
        preset = "--untuned" if args.untuned else "--quick"
        notes.append(f"--tuned-dir {args.tuned_dir}: not read, {preset} trains every row with the shared settings")
    return notes


def run_folder_outputs() -> tuple[str, ...]:
    """Every entry ``gpattn compare`` can write into a run folder, derived from the writers (what ``--overwrite``
    deletes first): ``runs/``, :data:`~gpattn.comparison.report.OUTPUT_FILES` and every figure of every task
    (:func:`~gpattn.plotting.comparison_figure_names`, with the figure names of earlier versions)."""
    from ..comparison.report import OUTPUT_FILES
    from ..comparison.tasks import TASKS
    from ..plotting import comparison_figure_names

    return ("runs", *OUTPUT_FILES, *comparison_figure_names(TASKS))


def run_compare(args: argparse.Namespace) -> int:
    """Run ``gpattn compare``; returns the exit status."""
    from ..comparison import CompareConfig, plan_runs
    from ..comparison.report import table_text, write_outputs
    from ..comparison.runner import execute_runs
    from ..plotting import write_comparison_figures

    overrides = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    if args.no_temperature_scaling:
        overrides["temperature_scaling"] = False
    if args.untuned:
        overrides["tuned"] = False
    if args.tuned_dir is not None:
        overrides["tuned_dir"] = args.tuned_dir
    overrides.update(device=args.device, progress=not args.no_progress, threads=args.threads, jobs=args.jobs)
    overrides.update(compile=args.compile, cuda_graphs=args.cuda_graphs)
    if args.cuda_graphs and not args.device.startswith("cuda"):  # the option's name, not CompareConfig's field
        print(
            f"gpattn compare: error: argument --cuda-graphs: needs --device cuda, got --device {args.device}",
            file=sys.stderr,
        )
        return 2
    try:
        presets = ((args.quick, CompareConfig.quick), (args.main, CompareConfig.main), (args.full, CompareConfig.full))
        config = next((make for chosen, make in presets if chosen), CompareConfig)(**overrides)
        runs = plan_runs(config)  # every layer's own checks, once, before any folder is made or run started
        executor = make_executor(args)  # a Ray cluster's address checked, before any folder is made
    except ValueError as error:
        print(f"gpattn compare: error: {error}", file=sys.stderr)
        return 2
    notes = (_tuned_note(config, runs, args), *_unused_options(config, runs, args))
    for note in (*notes, mps_note(config.device, min(config.jobs, len(runs)), args.executor)):
        if note:
            print(f"gpattn compare: note: {note}", file=sys.stderr)
    missing = missing_tuned_files(config)
    if missing:
        print(
            f"gpattn compare: note: --tuned-dir {config.tuned_dir} has no {', '.join(f'{t}.json' for t in missing)}: "
            f"the runs of {' and '.join(missing)} train with the shared settings",
            file=sys.stderr,
        )
    with prepare_out(
        args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}",
        overwrite=args.overwrite,
        resume=args.resume,
        replaced=run_folder_outputs(),
    ) as out:
        start = time.perf_counter()
        with kept_on_interrupt("runs", out / "runs"):
            records = execute_runs(config, runs, out=out, resume=args.resume, executor=executor)
        try:
            written = write_outputs(records, config, out) + write_comparison_figures(records, out)
        except OSError as error:
            raise CommandError(
                f"{error}; the {len(records)} runs are kept in {out / 'runs'}: make room (or fix the folder) and run "
                "the same command with --resume to write the results"
            ) from error
        # a resumed run with fewer rows or tasks than the one before: no figure of a row its results do not hold
        removed = remove_stale_files(out, [name for name in run_folder_outputs() if name != "runs"], written)
        if removed:
            print(
                f"gpattn compare: note: removed {', '.join(removed)} from {out}: results and figures of an earlier "
                "run that this one did not write",
                file=sys.stderr,
            )
    print(table_text(records, config))
    where = f"executor {args.executor}, jobs {config.jobs}, threads {config.threads}"
    print(f"{len(records)} runs in {time.perf_counter() - start:.0f} s ({where})")
    print("wrote " + ", ".join(str(path) for path in written))
    return 0
