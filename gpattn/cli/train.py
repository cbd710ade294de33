"""``gpattn train``: one model of a comparison task, with checkpoints, ``--resume`` and one line per epoch."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from .options import add_common, device, non_negative_int, out_dir, positive_int, prepare_out

__all__ = ["add_train", "run_train"]


def add_train(commands) -> None:
    """Add the ``train`` command to the subparsers ``commands``."""
    from ..attention import attention_names
    from ..comparison import TASKS, CompareConfig

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
    train.add_argument("--seed", type=non_negative_int, default=0, help="default: %(default)s")
    train.add_argument("--epochs", type=positive_int, default=None, help="default: the comparison's for the task")
    train.add_argument("--eval-samples", type=positive_int, default=defaults.eval_samples, help="default: %(default)s")
    train.add_argument(
        "--num-inducing", type=positive_int, default=None, help="inducing set size (default: the layer's own)"
    )
    train.add_argument(
        "--out", type=out_dir, default=None, help="run folder (default: runs/train-<task>-<attention>-<seed>)"
    )
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/last.pt")
    train.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default: %(default)s)")
    train.add_argument("--no-progress", action="store_true", help="print no line per epoch")
    add_common(train, resume="continues it")


def run_train(args: argparse.Namespace) -> int:
    """Run ``gpattn train``; returns the exit status."""
    from ..comparison import CompareConfig, plan_runs
    from ..comparison import runs as run_module
    from ..comparison.records import write_json_atomically
    from ..comparison.runner import torch_threads
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
            **epochs,
        )
        plan_runs(config)  # the layer's own checks (e.g. a rank above the head width), before any folder is made
    except ValueError as error:
        print(f"gpattn train: error: {error}", file=sys.stderr)
        return 2
    if args.resume and not (out / "checkpoints" / "last.pt").exists():
        print(f"gpattn train: error: --resume needs {out / 'checkpoints' / 'last.pt'}", file=sys.stderr)
        return 2
    prepare_out(out, overwrite=args.overwrite, resume=args.resume, replaced=("record.json", "checkpoints"))
    callbacks = [] if args.no_progress else [EpochLog()]  # one line per epoch on standard error
    with torch_threads(args.threads):
        record = run_module.train_and_evaluate(
            config,
            args.task,
            args.attention,
            args.seed,
            checkpoint_dir=out / "checkpoints",
            resume=args.resume,
            callbacks=callbacks,
        )
    write_json_atomically(out / "record.json", record.to_dict())
    test = asdict(record.metrics.test)
    print(", ".join(f"{key} {value:.4f}" for key, value in test.items()))
    print(f"wrote {out / 'record.json'}")
    return 0
