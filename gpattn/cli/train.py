"""``gpattn train``: one model of a comparison task, with checkpoints, ``--resume`` and one line per epoch."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from .options import (
    CommandError,
    CommandInterrupted,
    add_common,
    device,
    missing_tuned_files,
    out_dir,
    positive_int,
    prepare_out,
    seed_number,
    tuned_dir,
)

__all__ = ["OUTPUTS", "RUN_FILE", "add_train", "run_train"]

#: The run's identity and settings (:func:`~gpattn.comparison.runner.run_file_content`), written before it trains and
#: checked by ``--resume``
RUN_FILE = "run.json"
#: What ``gpattn train`` writes besides :data:`RUN_FILE` (replaced with ``--overwrite``)
OUTPUTS = ("record.json", "checkpoints")


def add_train(commands) -> None:
    """Add the ``train`` command to the subparsers ``commands``."""
    from ..attention import attention_names
    from ..comparison import TASKS, CompareConfig

    defaults = CompareConfig()
    train = commands.add_parser(
        "train",
        help="train and evaluate one model (checkpoints, --resume after an interruption)",
        description="Train one Transformer with the chosen attention on a task of the comparison, with best.pt / "
        "last.pt checkpoints in OUT/checkpoints, and write OUT/record.json (the same metrics as gpattn compare); "
        "OUT/run.json holds the run's identity, every setting that changes its numbers (--threads included) and the "
        "code (gpattn version, git commit). After an interruption, the same command with --resume continues from "
        "last.pt (refusing other settings; warning when other code started the run, which run.json then lists under "
        '"resumed_with") and ends with the same numbers as an uninterrupted run (CPU). Prints one line per epoch on '
        "standard error.",
    )
    train.add_argument("--attention", choices=attention_names(), default="kep_svgp", help="default: %(default)s")
    train.add_argument("--task", choices=TASKS, default="digits", help="default: %(default)s")
    train.add_argument("--seed", type=seed_number, default=0, help="default: %(default)s")
    train.add_argument(
        "--epochs",
        type=positive_int,
        default=None,
        help="default: the comparison's for the task, or the tuned configuration's (which refuses another value; see "
        "--untuned)",
    )
    train.add_argument("--eval-samples", type=positive_int, default=defaults.eval_samples, help="default: %(default)s")
    train.add_argument(
        "--num-inducing",
        type=positive_int,
        default=None,
        help="inducing set size (default: the task's, 5 on mnist1d, else the layer's own)",
    )
    train.add_argument(
        "--out", type=out_dir, default=None, help="run folder (default: runs/train-<task>-<attention>-<seed>)"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoints/last.pt; give the options that started the run: they are checked "
        "against the settings stored in OUT/run.json (another value is refused), not read from it",
    )
    train.add_argument(
        "--untuned",
        action="store_true",
        help="train with the shared settings (these options and the comparison's defaults: learning rate, "
        "architecture, dropout, ...); by default a (task, attention) with a tuned configuration (gpattn tune; the "
        "package's gpattn/comparison/tuned/<task>.json) trains with it, as in gpattn compare, and another --epochs or "
        "--num-inducing than it sets is refused",
    )
    train.add_argument(
        "--tuned-dir",
        type=tuned_dir,
        default=None,
        help="the folder of the tuned configurations <task>.json (default: the package's); it must hold the task's",
    )
    train.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default: %(default)s)")
    train.add_argument("--no-progress", action="store_true", help="print no line per epoch")
    add_common(train, resume="continues it")


def run_train(args: argparse.Namespace) -> int:
    """Run ``gpattn train``; returns the exit status."""
    from ..attention import attention_arguments
    from ..comparison import CompareConfig, plan_runs
    from ..comparison import runs as run_module
    from ..comparison.local_executor import torch_threads
    from ..comparison.records import write_json_atomically
    from ..comparison.runner import read_run_file, result_settings, run_file_content, run_hyperparameters
    from ..training import EpochLog

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
            tuned=not args.untuned,
            tuned_dir=args.tuned_dir,
            **epochs,
        )
        plan_runs(config)  # the layer's own checks (e.g. a rank above the head width), before any folder is made
        if args.num_inducing is not None and "num_inducing" not in attention_arguments(args.attention):
            raise ValueError(f"--num-inducing: the {args.attention} attention has no inducing set to size")
        if missing_tuned_files(config):  # an explicit folder without the task's file: a wrong folder, most likely
            raise ValueError(
                f"--tuned-dir {args.tuned_dir} has no {args.task}.json (the tuned configurations of {args.task}); "
                "give the folder that holds it, or --untuned"
            )
        if not args.resume:  # a resumed run is checked against the settings stored when it started
            _check_tuned_options(config, args)
    except ValueError as error:
        print(f"gpattn train: error: {error}", file=sys.stderr)
        return 2
    if args.untuned and args.tuned_dir is not None:
        print(
            f"gpattn train: note: --tuned-dir {args.tuned_dir}: not read, --untuned trains with the shared settings",
            file=sys.stderr,
        )
    if args.resume and not (out / "checkpoints" / "last.pt").exists():
        print(f"gpattn train: error: --resume needs {out / 'checkpoints' / 'last.pt'}", file=sys.stderr)
        return 2
    run, settings = (args.task, args.attention, args.seed), result_settings(config)
    with prepare_out(out, overwrite=args.overwrite, resume=args.resume, replaced=(RUN_FILE, *OUTPUTS)) as out:
        if args.resume:  # the same run, with every setting that changes its numbers (threads included)
            if not (out / RUN_FILE).exists():
                raise CommandError(
                    f"--resume needs {out / RUN_FILE} (the run's identity and settings, written when it started) to "
                    "check that it continues the same run; start it again with --overwrite"
                )
            read_run_file(out / RUN_FILE, run, settings, record=False)
            _check_hyperparameters(out / RUN_FILE, config, args)
            _note_other_code(out / RUN_FILE)
        else:  # with the hyperparameters, which a tuned file (not the settings) may set and change
            content = run_file_content(run, settings)
            content["hyperparameters"] = run_hyperparameters(config, args.task, args.attention)
            write_json_atomically(out / RUN_FILE, content)
        callbacks = [] if args.no_progress else [EpochLog()]  # one line per epoch on standard error
        checkpoints = out / "checkpoints"
        try:
            with torch_threads(args.threads):
                record = run_module.train_and_evaluate(
                    config, *run, checkpoint_dir=checkpoints, resume=args.resume, callbacks=callbacks
                )
        except KeyboardInterrupt:
            kept = _kept(checkpoints, config, args.task, args.attention, forget=None if args.resume else out / RUN_FILE)
            raise CommandInterrupted(f"interrupted; {kept}") from None
        try:
            write_json_atomically(out / "record.json", record.to_dict())
        except OSError as error:
            raise CommandError(
                f"{error}; the trained model's checkpoints are kept in {checkpoints}: make room (or fix the folder) "
                "and run the same command with --resume, which evaluates them again without training"
            ) from error
    test = asdict(record.metrics.test)
    print(", ".join(f"{key} {value:.4f}" for key, value in test.items()))
    print(f"wrote {out / 'record.json'}")
    return 0


def _check_hyperparameters(path: Path, config, args: argparse.Namespace) -> None:
    """Refuse ``--resume`` when the run would train with other hyperparameters than it started with: a tuned file
    (``--tuned-dir``, or the package's) written again in between changes them without changing the settings. A run
    file written before the hyperparameters were stored is not checked here (the checkpoints' own check remains).

    :raises CommandError: Naming each changed hyperparameter, the tuned file and ``--overwrite``.
    """
    import json

    from ..comparison.runner import run_hyperparameters
    from ..comparison.tuned_configuration import tuned_path

    stored = json.loads(path.read_text(encoding="utf-8")).get("hyperparameters")
    current = json.loads(json.dumps(run_hyperparameters(config, args.task, args.attention)))  # as read back
    if not isinstance(stored, dict) or stored == current:
        return
    changed = sorted(key for key in set(stored) | set(current) if stored.get(key) != current.get(key))
    shown = ", ".join(f"{key}: started with {stored.get(key)!r}, now {current.get(key)!r}" for key in changed)
    tuned = config.tuned_entry(args.task, args.attention) is not None
    source = str(tuned_path(args.task, config.tuned_dir)) if tuned else "the shared settings"
    raise CommandError(
        f"--resume would train with other hyperparameters than the run started with ({shown}; now from {source}): "
        "resume with the tuned file the run started with, or start the run again with --overwrite"
    )


def _check_tuned_options(config, args: argparse.Namespace) -> None:
    """Refuse ``--epochs`` and ``--num-inducing`` other than a tuned configuration's where the run trains with one that
    sets them (they would be ignored; ``--untuned`` trains with them). Not for ``--resume``, whose run is checked
    against the settings it started with.

    :raises ValueError: Naming the options, the tuned values and the file.
    """
    from ..comparison.tuned_configuration import tuned_path

    entry = config.tuned_entry(args.task, args.attention)
    if entry is None:
        return
    given = {"epochs": ("--epochs", args.epochs), "num_inducing": ("--num-inducing", args.num_inducing)}
    ignored = {  # a value equal to the tuned one changes nothing
        key: f"{flag} {value}"
        for key, (flag, value) in given.items()
        if value is not None and key in entry.hyperparameters and value != entry.hyperparameters[key]
    }
    if not ignored:
        return
    tuned = ", ".join(f"{key} {entry.hyperparameters[key]}" for key in ignored)
    raise ValueError(
        f"{args.attention} on {args.task} trains with its tuned configuration of "
        f"{tuned_path(args.task, args.tuned_dir)}, which sets {tuned}: {' and '.join(ignored.values())} would be "
        "ignored; add --untuned to train with the shared settings and these options"
    )


def _note_other_code(path: Path) -> None:
    """``--resume`` of a run that another code started (another gpattn version or git commit than this process's, or
    a run file from before run files recorded it): warn (``RunsFromOtherCodeWarning``), naming both, and add this
    code to the run file's ``"resumed_with"`` list, so that the file keeps every code the run was trained with."""
    from ..comparison.environment import code_label, code_version
    from ..comparison.records import write_json_atomically
    from ..comparison.runner import RunsFromOtherCodeWarning

    content = json.loads(path.read_text(encoding="utf-8"))  # read and checked by read_run_file just before
    stored, current = content.get("code"), code_version()
    if stored == current:
        return
    warnings.warn(
        f"--resume: {path} was started by other code ({code_label(stored)}) than this call's ({code_label(current)}):"
        " the run continues from its checkpoint with this code, so its numbers come from both and may differ from an "
        'uninterrupted run of either; this code is added to the file\'s "resumed_with"',
        RunsFromOtherCodeWarning,
        stacklevel=2,
    )
    content["resumed_with"] = [*content.get("resumed_with", []), current]
    write_json_atomically(path, content)


def _kept(checkpoints: Path, config, task: str, row: str, forget: Path | None = None) -> str:
    """What an interrupted ``gpattn train`` leaves: the epoch of its last checkpoints, read from their manifest. When
    no epoch finished there is nothing to resume: given ``forget``, the run file of a run that did not ``--resume``
    (the folder then holds nothing of an earlier run), that file and the checkpoint folder (no committed checkpoint in
    it) are removed, so that the same command starts the run again; else the advice is ``--overwrite``."""
    from ..comparison.runner import run_hyperparameters
    from ..training import CheckpointError
    from ..training.checkpoint_files import MANIFEST, read_manifest

    try:
        manifest = read_manifest(checkpoints)
    except CheckpointError:
        manifest = None
    if manifest is None or not isinstance(manifest.get("epoch"), int):
        if (checkpoints / "last.pt").exists() and not (checkpoints / MANIFEST).exists():  # written before manifests
            return f"the checkpoints in {checkpoints} are kept; the same command with --resume continues"
        if forget is not None and not (checkpoints / MANIFEST).exists():
            try:
                if checkpoints.exists():
                    shutil.rmtree(checkpoints)
                forget.unlink(missing_ok=True)
            except OSError:
                pass  # what is left is replaced by --overwrite
            else:
                return "no epoch had finished, so nothing was kept: the same command starts the run again"
        return (
            f"no epoch had finished, so {checkpoints} holds no checkpoint: the same command with --overwrite (not "
            "--resume) starts the run again"
        )
    epochs = run_hyperparameters(config, task, row)["epochs"]  # the tuned configuration's, or the shared setting
    return (
        f"the checkpoints of epoch {manifest['epoch']} of {epochs} are kept in {checkpoints}; the same command with "
        "--resume continues"
    )
