"""``gpattn report``: the headline and tables of one or more run folders, the results page generated from them, and
the check that the primary verdict holds in another run (e.g. one that differs only in float rounding)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import CommandError, remove_stale_files

__all__ = ["add_report", "run_report"]


def _folder(text: str) -> str:
    if not (Path(text) / "results.json").is_file():
        raise argparse.ArgumentTypeError(f"expected a run folder of gpattn compare (with results.json), got {text!r}")
    return text


def add_report(commands) -> None:
    """Add the ``report`` command to the subparsers ``commands``."""
    report = commands.add_parser(
        "report",
        help="the headline and tables of run folders; the results page; the primary verdict's robustness check",
        description="Read the results.json of one or more run folders of gpattn compare (their records merged: a run "
        "held by several folders must be the same in each) and print the headline of the declared endpoints and the "
        "full tables. --page writes the results page (markdown, every number from the records) and its figures "
        "beside it, in <page stem>_figures/ (figures there that the page does not show are removed). --same-verdict "
        "compares the primary verdict with that of each other run "
        "folder (e.g. the same run with --threads 2, or another seed block) and exits with status 1 when it differs "
        "or cannot be checked (a run without the primary pair); it then prints the check's lines in place of the "
        "headline and tables, and with --page the checks are a section of the page.",
    )
    report.add_argument("runs", nargs="+", type=_folder, metavar="RUN", help="run folders (with results.json)")
    report.add_argument(
        "--page",
        type=_page,
        default=None,
        help="write the results page there, a markdown file (e.g. docs/guide/results.md; an earlier page there is "
        "replaced)",
    )
    report.add_argument(
        "--same-verdict",
        nargs="+",
        type=_folder,
        default=None,
        metavar="OTHER",
        help="run folders whose primary verdict must each be the same: exit status 0 when it holds for every one, 1 "
        "otherwise; printed in place of the headline and tables, or with --page a section of the page",
    )


def _page(text: str) -> Path:
    """An argparse type: the results page's path, a file name ending in ``.md`` that is not a folder (its figures go
    into ``<stem>_figures/`` beside it, so two pages of one stem would share them)."""
    path = Path(text)
    if not text or path.suffix != ".md" or path.stem in ("", "."):
        raise argparse.ArgumentTypeError(f"expected a markdown file name ending in .md, got {text!r}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a markdown file, got the folder {text!r}")
    return path


def run_report(args: argparse.Namespace) -> int:
    """Run ``gpattn report``; returns the exit status."""
    from ..comparison.headline import headline_text
    from ..comparison.records import write_text_atomically
    from ..comparison.report import markdown_table
    from ..comparison.results_page import compare_verdicts, read_run_folders, results_page
    from ..comparison.tasks import TASKS
    from ..plotting import comparison_figure_names, write_comparison_figures

    runs = read_run_folders(args.runs)
    if not runs.records:
        raise CommandError(f"no records in {', '.join(args.runs)}")
    checks, status = [], 0
    for folder in args.same_verdict or ():
        other = read_run_folders([folder])
        holds, lines = compare_verdicts(runs, other)
        print("\n".join(lines))
        checks.append((other, lines))
        status = status if holds else 1
    if args.page is None:
        if not checks:
            headline = headline_text(runs.records, ece_bins=runs.ece_bins)
            print(headline + "\n## Full tables\n\n" + markdown_table(runs.records, runs.ece_bins))
        return status
    figures_dir = args.page.parent / f"{args.page.stem}_figures"
    figures = write_comparison_figures(runs.records, figures_dir)
    page = results_page(runs, [f"{figures_dir.name}/{path.name}" for path in figures], checks)
    write_text_atomically(args.page, page)
    # an earlier page's figures that this page does not show (e.g. of a task its runs do not have)
    removed = remove_stale_files(figures_dir, comparison_figure_names(TASKS), figures)
    print(f"wrote {args.page} and {len(figures)} figures in {figures_dir}")
    if removed:
        print(
            f"gpattn report: note: removed {', '.join(removed)} from {figures_dir}: figures this page does not show",
            file=sys.stderr,
        )
    return status
