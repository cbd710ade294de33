"""The command line interface."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from gpattn.cli import build_parser, main


def test_regression_command_writes_run_folder(tmp_path, capsys) -> None:
    code = main(
        [
            "regression",
            "--out",
            str(tmp_path),
            "--iterations",
            "3",
            "--pyro-iterations",
            "3",
            "--landmarks",
            "8",
            "--num-inducing",
            "4",
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "exact_gp" in printed and "kep_svgp_elbo" in printed
    assert json.loads((tmp_path / "results.json").read_text())["config"]["num_landmarks"] == 8
    assert (tmp_path / "posterior.png").stat().st_size > 10_000


def test_rank_larger_than_landmarks_is_an_error(tmp_path, capsys) -> None:
    assert main(["regression", "--out", str(tmp_path), "--num-inducing", "30", "--landmarks", "24"]) == 2
    assert "--num-inducing (30) must not exceed --landmarks (24)" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    "argument", [["--num-inducing", "0"], ["--iterations", "-1"], ["--lr", "0"], ["--num-inducing", "two"]]
)
def test_bad_numbers_are_rejected_by_the_parser(argument, capsys) -> None:
    with pytest.raises(SystemExit) as error:
        build_parser().parse_args(["regression", *argument])
    assert error.value.code == 2
    assert "error" in capsys.readouterr().err


def test_console_script_help() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "gpattn.cli", "regression", "--help"], capture_output=True, text=True, check=True
    )
    assert "--pyro-iterations" in completed.stdout and "--out" in completed.stdout


def test_train_resume_from_a_corrupted_checkpoint_is_a_clear_error(tmp_path, capsys) -> None:
    argv = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "1", "--out", str(tmp_path)]
    assert main([*argv, "--eval-samples", "2", "--no-progress"]) == 0  # a run with its run.json and checkpoints
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    assert main([*argv, "--eval-samples", "2", "--resume"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("gpattn train: error:") and "last.pt" in error and "Traceback" not in error


# -- output folders, one-line errors, Ctrl-C, --version (issues 14 and 17) ---------------------------------------------
TINY_COMPARE = [
    "compare",
    "--attentions",
    "softmax",
    "--tasks",
    "pointer",
    "--seeds",
    "0",
    "--pointer-epochs",
    "1",
    "--eval-samples",
    "2",
    "--no-progress",
]


def _refuse(token: str) -> float:
    raise ValueError(f"not strict JSON: {token}")


@pytest.fixture
def no_runs(monkeypatch):
    """Make every training fail loudly: what the test checks must happen before any run."""
    import gpattn.comparison as comparison
    import gpattn.comparison.runs as runs

    def must_not_run(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(runs, "train_and_evaluate", must_not_run)
    monkeypatch.setattr(comparison, "run_toy_regression", must_not_run)


@pytest.mark.parametrize("command", [["compare"], ["train"], ["regression"]])
def test_an_out_that_cannot_be_created_is_one_line_before_any_run(command, tmp_path, capsys, no_runs) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main([*command, "--out", str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpattn {command[0]}: error: --out {blocker / 'sub'}: cannot create or write the folder")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("command", [["compare"], ["train"], ["regression"]])
def test_an_existing_run_folder_is_refused_without_overwrite(command, tmp_path, capsys, no_runs) -> None:
    (tmp_path / "results.json").write_text("{}")
    assert main([*command, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"--out {tmp_path} already holds files (results.json): pass --overwrite" in err
    assert err.count("\n") == 1
    assert (tmp_path / "results.json").read_text() == "{}"


def test_overwrite_replaces_the_earlier_results_and_output_is_strict_json(tmp_path, capsys) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "digits-softmax-5.json").write_text("stale")
    (tmp_path / "results.json").write_text("stale")
    (tmp_path / "notes.txt").write_text("the user's")
    assert main([*TINY_COMPARE, "--out", str(tmp_path), "--overwrite"]) == 0
    assert not (tmp_path / "runs" / "digits-softmax-5.json").exists()  # no stale run mixed in
    assert (tmp_path / "notes.txt").read_text() == "the user's"  # only gpattn's own outputs are replaced
    results = json.loads((tmp_path / "results.json").read_text(), parse_constant=_refuse)
    assert results["config"]["threads"] == 1 and results["config"]["jobs"] == 1
    assert len(results["records"]) == 1
    table = (tmp_path / "table.md").read_text()
    assert "| softmax | 1 |" in table and "± 0.00" not in table  # one seed: n once per row, no made-up spread
    assert "Smoke test" not in table


@pytest.mark.parametrize("command", [["compare"], ["tune"], ["train"]])
def test_resume_and_overwrite_together_are_refused_before_anything_runs(command, tmp_path, capsys, no_runs) -> None:
    # --overwrite used to win silently over --resume's contract (continue, keep what is there), or the reverse
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(SystemExit) as error:
        main([*command, "--out", str(tmp_path), "--resume", "--overwrite"])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == f"gpattn {command[0]}: error: --resume and --overwrite exclude each other: --resume continues the "
        "run in --out, --overwrite replaces it\n"
    )
    assert (tmp_path / "results.json").read_text() == "{}"


def test_prepare_out_refuses_resume_with_overwrite(tmp_path) -> None:
    from gpattn.cli import prepare_out

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="resume and overwrite exclude each other"):
        with prepare_out(tmp_path, overwrite=True, resume=True, replaced=("results.json",)):
            pass
    assert (tmp_path / "results.json").read_text() == "{}"


def test_resume_of_a_folder_that_holds_nothing_warns_and_runs_everything(tmp_path) -> None:
    from gpattn.cli.options import NothingToResume

    out = tmp_path / "typo"
    expected = f"--resume: --out {out} holds no earlier run; everything runs from the start"
    with pytest.warns(NothingToResume, match=re.escape(expected)):
        assert main([*TINY_COMPARE, "--out", str(out), "--resume"]) == 0
    assert len(json.loads((out / "results.json").read_text())["records"]) == 1


def test_a_resume_with_fewer_rows_leaves_no_figure_of_the_missing_row(tmp_path, capsys) -> None:
    # the earlier run's kep_svgp drew spectra.png; the resumed run asks for softmax only: its results hold softmax
    kep = [*TINY_COMPARE[:2], "kep_svgp", *TINY_COMPARE[3:]]
    assert main([*kep, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "spectra.png").exists()
    capsys.readouterr()
    assert main([*TINY_COMPARE, "--out", str(tmp_path), "--resume"]) == 0
    assert not (tmp_path / "spectra.png").exists()
    assert "gpattn compare: note: removed spectra.png" in capsys.readouterr().err
    assert [record["attention"] for record in json.loads((tmp_path / "results.json").read_text())["records"]] == [
        "softmax"
    ]
    assert (tmp_path / "runs" / "pointer-kep_svgp-0.json").exists()  # the earlier run's record is kept


def test_a_resumed_run_removes_the_results_and_figures_it_did_not_write(tmp_path) -> None:
    # an earlier run with more rows left figures of rows that the resumed run's results do not hold
    from gpattn.cli.compare import run_folder_outputs
    from gpattn.cli.options import remove_stale_files

    (tmp_path / "runs").mkdir()
    record = tmp_path / "runs" / "pointer-kep_svgp-0.json"
    record.write_text("{}")
    for name in ("spectra.png", "fidelity.png", "reliability_pointer.png", "results.csv", "notes.txt"):
        (tmp_path / name).write_text("earlier")
    assert "spectra.png" in run_folder_outputs() and "notes.txt" not in run_folder_outputs()
    outputs = [name for name in run_folder_outputs() if name != "runs"]
    removed = remove_stale_files(tmp_path, outputs, [tmp_path / "results.csv", tmp_path / "reliability_pointer.png"])
    assert sorted(removed) == ["fidelity.png", "spectra.png"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "notes.txt",  # not gpattn's: kept
        "reliability_pointer.png",
        "results.csv",
        "runs",
    ]
    assert record.read_text() == "{}"  # the records are kept


def _unused_notes(rows, tasks=("pointer",), **options) -> list[str]:
    import argparse

    from gpattn.cli import build_parser
    from gpattn.cli.compare import _unused_options
    from gpattn.comparison import CompareConfig, plan_runs

    args = vars(build_parser().parse_args(["compare"]))  # every option at its default
    args.update(options)
    given = {name: value for name, value in options.items() if name in ("num_inducing", "mc_dropout", "tuned_dir")}
    config = CompareConfig(attentions=rows, tasks=tasks, seeds=(0,), tuned=not args["untuned"], **given)
    return _unused_options(config, plan_runs(config), argparse.Namespace(**args))


def test_num_inducing_for_rows_without_an_inducing_set_is_a_note() -> None:
    assert _unused_notes(("softmax", "cgpt"), num_inducing=4) == [
        "--num-inducing 4: no row of this comparison (cgpt, softmax) has an inducing set to size"
    ]
    assert _unused_notes(("softmax", "kep_svgp"), num_inducing=4) == []  # kep_svgp's rank is set by it
    assert _unused_notes(("deep_ensemble", "softmax_mc_dropout"), num_inducing=4) != []  # softmax rows, other names
    assert _unused_notes(("cgpt",)) == []


def test_options_that_reach_no_run_are_named_in_a_note(tmp_path) -> None:
    """An epochs option of a task not compared, --ksvd-weight or --mc-dropout without a row that uses it, and
    --tuned-dir under --untuned were ignored without a word."""
    assert _unused_notes(("softmax",), digits_epochs=5, mnist1d_epochs=3, pointer_epochs=2) == [
        "--digits-epochs 5: no run of this comparison is on digits (tasks: pointer)",
        "--mnist1d-epochs 3: no run of this comparison is on mnist1d (tasks: pointer)",
    ]
    assert _unused_notes(("softmax", "sgpa"), ksvd_weight=0.5, mc_dropout=0.2) == [
        "--ksvd-weight 0.5: no row of this comparison (sgpa, softmax) has a KSVD penalty to weight",
        "--mc-dropout 0.2: no row of this comparison (sgpa, softmax) predicts with dropout",
    ]
    assert _unused_notes(("primal", "softmax_mc_dropout"), ksvd_weight=0.5, mc_dropout=0.2) == []
    assert _unused_notes(("softmax",), tuned_dir=str(tmp_path), untuned=True) == [
        f"--tuned-dir {tmp_path}: not read, --untuned trains every row with the shared settings"
    ]
    assert _unused_notes(("softmax",), tuned_dir=str(tmp_path)) == []


def test_quick_is_labelled_a_smoke_test(tmp_path, capsys) -> None:
    argv = ["compare", "--quick", "--attentions", "softmax", "--tasks", "pointer", "--pointer-epochs", "1"]
    assert main([*argv, "--eval-samples", "2", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "**Smoke test (`--quick`)**: 1 seed and 1 epoch on pointer, to check" in (tmp_path / "table.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["config"]["smoke_test"] is True


@pytest.mark.parametrize(("option", "names"), [("--attentions", ["softmax", "softmax"]), ("--tasks", ["pointer"] * 2)])
def test_a_repeated_row_or_task_is_a_bad_option(option, names, tmp_path, capsys, no_runs) -> None:
    # it trained each run twice and wrote duplicate records (n doubled in table.md)
    assert main([*TINY_COMPARE, option, *names, "--out", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err == (
        f"gpattn compare: error: CompareConfig: expected distinct {option[2:]}, got {names!r} ({names[0]} more than "
        "once)\n"
    )
    assert not (tmp_path / "c").exists()


def test_full_with_seeds_trains_those_seeds_for_every_row(tmp_path, monkeypatch) -> None:
    """--full --seeds 5 failed on "expected distinct primary_seeds, ..." (an option that does not exist): the given
    seeds are those of every row, the primary pair's included (the preset's seeds 5-9 of the pair are dropped)."""
    import gpattn.comparison.runner as runner
    from gpattn.comparison import MAIN_TABLE_ROWS

    class Planned(Exception):
        pass

    planned = []

    def execute_runs(config, runs, **kwargs):
        planned.extend(runs)
        raise Planned

    monkeypatch.setattr(runner, "execute_runs", execute_runs)
    with pytest.raises(Planned):
        main(["compare", "--full", "--seeds", "5", "--no-progress", "--out", str(tmp_path / "f")])
    assert planned == [(task, row, 5) for task in ("mnist1d", "digits") for row in MAIN_TABLE_ROWS]


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (KeyboardInterrupt(), 130, "gpattn train: interrupted; no epoch had finished, so "),
        (RuntimeError("training diverged\nat step 3"), 1, "gpattn train: error: training diverged at step 3\n"),
        (ValueError("bad checkpoint"), 1, "gpattn train: error: bad checkpoint\n"),
        (PermissionError(13, "Permission denied", "/x/record.json"), 1, "gpattn train: error: [Errno 13]"),
    ],
)
def test_expected_failures_are_one_line(error, status, line, tmp_path, capsys, monkeypatch) -> None:
    import gpattn.comparison.runs as runs

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(runs, "train_and_evaluate", fail)
    assert main(["train", "--task", "pointer", "--epochs", "1", "--out", str(tmp_path / "t")]) == status
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1 and "Traceback" not in err


def test_compare_interrupted_says_what_was_kept(tmp_path, capsys, monkeypatch) -> None:
    import gpattn.comparison.runs as runs

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train_and_evaluate", interrupt)
    assert main([*TINY_COMPARE, "--out", str(tmp_path / "c")]) == 130
    err = capsys.readouterr().err
    assert err == (
        f"gpattn compare: interrupted; 0 of 1 runs finished, kept in {tmp_path / 'c' / 'runs'}; the same command with "
        "--resume continues\n"
    )


def test_compare_notes_the_shared_options_that_tuned_rows_do_not_use(tmp_path, capsys, monkeypatch) -> None:
    """A shared setting given on the command line that a run's tuned configuration sets instead is named in one note
    line before any run (with the rows it does not reach); --untuned, or an option no tuned row sets, gives none."""
    import gpattn.comparison.runs as runs

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train_and_evaluate", interrupt)
    argv = ["compare", "--tasks", "digits", "pointer", "--attentions", "softmax", "sgpa", "--seeds", "0"]
    argv += ["--digits-epochs", "2", "--pointer-epochs", "1", "--beta", "0.5", "--eval-samples", "2", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "gpattn compare: note: --digits-epochs 2 (not sgpa on digits, softmax on digits); --beta 0.5 (not sgpa on "
        "digits): these rows train with their tuned configuration, which sets that hyperparameter; --untuned trains "
        "every row with the shared settings"
    )
    # --mc-dropout reaches only the rows that predict with dropout (softmax's tuned dropout is not its business)
    assert main([*argv, "--mc-dropout", "0.2", "--out", str(tmp_path / "d")]) == 130
    assert "--mc-dropout 0.2 (not" not in capsys.readouterr().err  # (a note says that no row predicts with dropout)
    mc_dropout = [*argv[:6], "softmax_mc_dropout", *argv[7:], "--mc-dropout", "0.2", "--out", str(tmp_path / "e")]
    assert main(mc_dropout) == 130
    assert "; --mc-dropout 0.2 (not softmax_mc_dropout on digits):" in capsys.readouterr().err
    assert main([*argv, "--untuned", "--out", str(tmp_path / "b")]) == 130
    assert "note:" not in capsys.readouterr().err
    assert main([*argv[:9], "--pointer-epochs", "1", "--no-progress", "--out", str(tmp_path / "c")]) == 130
    assert "note:" not in capsys.readouterr().err  # the pointer task has no tuned configuration


def test_a_tuned_dir_without_the_tasks_file_is_named(tmp_path, capsys, monkeypatch) -> None:
    """An explicit --tuned-dir that lacks a task's file (a wrong folder, most likely) is refused by gpattn train (one
    task) and named in a note by gpattn compare (whose other tasks may have theirs); --untuned needs no file."""
    import shutil

    import gpattn.comparison.runs as runs
    from gpattn.comparison.tuned_configuration import tuned_path

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "train_and_evaluate", interrupt)
    folder = tmp_path / "tuned"
    folder.mkdir()
    assert main(["train", "--task", "digits", "--tuned-dir", str(folder), "--out", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == (
        f"gpattn train: error: --tuned-dir {folder} has no digits.json (the tuned configurations of digits); give the "
        "folder that holds it, or --untuned\n"
    )
    assert (
        main(["train", "--task", "digits", "--tuned-dir", str(folder), "--untuned", "--out", str(tmp_path / "u")])
        == 130
    )
    assert capsys.readouterr().err.startswith(
        f"gpattn train: note: --tuned-dir {folder}: not read, --untuned trains with the shared settings\n"
    )
    shutil.copy(tuned_path("digits"), folder / "digits.json")
    argv = ["compare", "--tasks", "digits", "pointer", "--attentions", "softmax", "--seeds", "0", "--no-progress"]
    assert main([*argv, "--tuned-dir", str(folder), "--out", str(tmp_path / "c")]) == 130
    assert (
        f"gpattn compare: note: --tuned-dir {folder} has no pointer.json: the runs of pointer train with the shared"
        in (capsys.readouterr().err)
    )
    assert main([*argv, "--out", str(tmp_path / "d")]) == 130  # the package's folder: no note
    assert "has no" not in capsys.readouterr().err


def test_gpattn_warnings_print_as_one_line_of_the_command(tmp_path) -> None:
    """While a command runs, a warning of gpattn's own classes prints as ``gpattn <command>: warning: <message>`` (one
    line, no file name or source line); others as Python formats them; the format is restored afterwards."""
    import warnings

    from gpattn.cli import _warning_line
    from gpattn.comparison.runner import RunsFromOtherCodeWarning

    default = warnings.formatwarning
    format_warning = _warning_line("gpattn train", default)
    text = format_warning(RunsFromOtherCodeWarning("a\nb  c"), RunsFromOtherCodeWarning, "/x/train.py", 7, "code")
    assert text == "gpattn train: warning: a b c\n"
    other = format_warning(UserWarning("u"), UserWarning, "/x/y.py", 3, "line")
    assert other == default(UserWarning("u"), UserWarning, "/x/y.py", 3, "line") and "/x/y.py:3" in other
    assert main(["train", "--task", "digits", "--tuned-dir", str(tmp_path)]) == 2  # a command that ran (and failed)
    assert warnings.formatwarning is default


def test_version() -> None:
    """``gpattn --version`` prints the version, and the command line's start imports neither scipy.stats nor
    matplotlib (about a second each; the statistics and the figures import them when they run): every command, and
    every worker process of ``--jobs``, pays for what the CLI imports."""
    from gpattn import __version__

    argv = [sys.executable, "-X", "importtime", "-m", "gpattn.cli", "--version"]
    completed = subprocess.run(argv, capture_output=True, text=True)
    assert completed.returncode == 0 and completed.stdout == f"gpattn {__version__}\n"
    imported = {line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if "|" in line}
    assert {"torch", "gpytorch", "gpattn.cli"} <= imported  # the trace is read
    heavy = sorted(name for name in imported if name.split(".")[0] == "matplotlib" or name.startswith("scipy.stats"))
    assert not heavy, heavy


def test_train_prints_one_line_per_epoch(tmp_path, capsys) -> None:
    argv = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "2", "--eval-samples", "2"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all("val accuracy 0." in line for line in lines)


def test_sigint_keeps_the_finished_runs_and_resume_finishes_the_rest(tmp_path) -> None:
    """A real Ctrl-C (SIGINT to the process group) during ``gpattn compare --jobs 2``, then ``--resume``."""
    import os
    import signal

    out = tmp_path / "c"
    argv = [sys.executable, "-m", "gpattn.cli", "compare", "--attentions", "softmax", "--tasks", "pointer"]
    # runs long enough (4 epochs, 6 of them) that the signal lands while runs remain, however late this process reads
    argv += ["--seeds", *map(str, range(6)), "--pointer-epochs", "4", "--eval-samples", "2", "--jobs", "2"]
    argv += ["--out", str(out)]  # progress on: one line per finished run on stderr (no bar: not a terminal)
    # SIGINT at its default in the child, also when this suite runs in a background job (which ignores SIGINT,
    # and a Python started with SIGINT ignored never raises KeyboardInterrupt)
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=restore)
    first = process.stderr.readline()
    assert first.startswith("[1/6] pointer-softmax-"), first
    os.killpg(process.pid, signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 130
    assert "Traceback" not in rest and rest.splitlines()[-1].startswith("gpattn compare: interrupted; ")
    finished = sorted(path.stem for path in (out / "runs").glob("*.json"))
    assert 1 <= len(finished) < 6
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {len(finished)} of 6 runs already finished" in resumed.stderr
    trained = [line.split()[1].rstrip(":") for line in resumed.stderr.splitlines() if line.startswith("[")]
    assert sorted(trained) == sorted({f"pointer-softmax-{seed}" for seed in range(6)} - set(finished))
    assert len(json.loads((out / "results.json").read_text())["records"]) == 6


def test_resume_with_other_settings_is_one_line(tmp_path, capsys) -> None:
    assert main([*TINY_COMPARE, "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main([*TINY_COMPARE, "--out", str(tmp_path), "--resume", "--eval-samples", "3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpattn compare: error: ") and "pointer-softmax-0.json was made with other settings" in err
    assert "eval_samples: stored 2, now 3" in err and err.count("\n") == 1


# -- run identity and settings of gpattn train, locks, full disks (issue 24, items 3 and 9) ----------------------------
TINY_TRAIN = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "1", "--eval-samples", "2"]


def test_train_resume_refuses_another_thread_count(tmp_path, capsys) -> None:
    out = tmp_path / "t"
    assert main([*TINY_TRAIN, "--no-progress", "--threads", "1", "--out", str(out)]) == 0
    stored = json.loads((out / "run.json").read_text())
    assert stored["identity"] == {"task": "pointer", "row": "softmax", "seed": 0}
    assert stored["settings"]["threads"] == 1 and stored["settings"]["pointer_epochs"] == 1
    capsys.readouterr()
    assert main([*TINY_TRAIN, "--no-progress", "--threads", "2", "--out", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpattn train: error: {out / 'run.json'} was made with other settings (threads: stored 1")
    assert err.count("\n") == 1


def test_train_resume_of_a_run_started_by_other_code_warns_and_records_it(tmp_path, capsys, monkeypatch) -> None:
    """--resume with the code that started the run says nothing; with other code (another version or commit, or a
    run.json from before run files recorded it) it warns, naming both, continues, and run.json lists the codes that
    continued it under "resumed_with"."""
    import warnings

    from gpattn.comparison import environment
    from gpattn.comparison.runner import RunsFromOtherCodeWarning

    out = tmp_path / "t"
    argv = [*TINY_TRAIN, "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    started = json.loads((out / "run.json").read_text())
    assert started["code"] == environment.code_version() and "resumed_with" not in started
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunsFromOtherCodeWarning)
        assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "run.json").read_text()) == started
    other = {"gpattn": "9.9", "git_commit": "abc123"}
    monkeypatch.setattr(environment, "code_version", lambda: other)
    with pytest.warns(RunsFromOtherCodeWarning) as caught:
        assert main([*argv, "--resume"]) == 0
    (message,) = [str(warning.message) for warning in caught]
    assert f"was started by other code ({environment.code_label(started['code'])}) than this call's (gpattn 9.9, " in (
        message
    )
    assert json.loads((out / "run.json").read_text()) == {**started, "resumed_with": [other]}
    content = {**started}
    del content["code"]  # a run file from before run files recorded their code
    (out / "run.json").write_text(json.dumps(content))
    with pytest.warns(RunsFromOtherCodeWarning, match=r"started by other code \(not recorded\)"):
        assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "run.json").read_text())["resumed_with"] == [other]


def test_train_resume_with_more_epochs_names_the_option_not_a_library_setting(tmp_path, capsys) -> None:
    out = tmp_path / "t"
    assert main([*TINY_TRAIN, "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    argv = [*TINY_TRAIN[:-4], "--epochs", "2", "--eval-samples", "2", "--no-progress", "--out", str(out), "--resume"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "pointer_epochs: stored 1, now 2" in err and "schedule_epochs" not in err
    assert "use the original options, or another --out" in err


def test_a_second_command_on_the_same_out_gets_one_line(tmp_path, capsys, no_runs) -> None:
    import os

    from gpattn.cli.options import prepare_out

    with prepare_out(tmp_path, overwrite=False, resume=False, replaced=()):  # the first command, still running
        assert main([*TINY_COMPARE, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"gpattn compare: error: --out {tmp_path} is in use by another gpattn command (process {os.getpid()}); wait "
        "until it ends, or choose another --out\n"
    )


def test_a_second_process_on_the_same_out_stops_at_once(tmp_path) -> None:
    """Two real processes: the second ``gpattn train`` on the first one's --out ends with one line, status 1."""
    out = tmp_path / "t"
    argv = [sys.executable, "-m", "gpattn.cli", *TINY_TRAIN[:-4], "--epochs", "50", "--out", str(out)]
    first = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stderr.readline().startswith("epoch 1/50")  # the first one holds the folder now
        second = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=120)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 1
    assert second.stderr == (
        f"gpattn train: error: --out {out} is in use by another gpattn command (process {first.pid}); wait until it "
        "ends, or choose another --out\n"
    )


def test_train_interrupted_says_what_was_kept(tmp_path, capsys, monkeypatch) -> None:
    import gpattn.training.loop as loop

    original = loop._Loop._checkpoint

    def stop_after_the_first_epoch(self, improved):
        original(self, improved)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop._Loop, "_checkpoint", stop_after_the_first_epoch)
    out = tmp_path / "t"
    assert main([*TINY_TRAIN[:-4], "--epochs", "3", "--no-progress", "--out", str(out)]) == 130
    checkpoints = out / "checkpoints"
    assert capsys.readouterr().err == (
        f"gpattn train: interrupted; the checkpoints of epoch 1 of 3 are kept in {checkpoints}; the same command with "
        "--resume continues\n"
    )


def test_train_on_a_full_disk_names_the_files_and_what_was_kept(tmp_path, capsys, monkeypatch) -> None:
    import errno
    import os

    real_fsync, calls = os.fsync, []

    def fill_up(descriptor):  # the second epoch's checkpoints meet a full disk
        calls.append(descriptor)
        if len(calls) > 4:  # run.json, then epoch 1: best.pt, last.pt, the manifest
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fill_up)
    out = tmp_path / "t"
    assert main([*TINY_TRAIN[:-4], "--epochs", "2", "--no-progress", "--out", str(out)]) == 1
    checkpoints = out / "checkpoints"
    assert capsys.readouterr().err == (
        f"gpattn train: error: [Errno 28] cannot write the checkpoints of epoch 2 to {checkpoints} (No space left on "
        "device); it still holds the checkpoints of epoch 1, the last complete pair; make room and resume from it "
        "(resume=True, or --resume of gpattn train)\n"
    )
    assert sorted(path.name for path in checkpoints.iterdir()) == ["best.pt", "checkpoints.json", "last.pt"]


def test_train_interrupted_in_its_first_epoch_starts_again_with_the_same_command(tmp_path, capsys, monkeypatch) -> None:
    # the advice was "run the same command (without --resume)", which the left run.json and checkpoints/ refused
    import gpattn.training.loop as loop

    def interrupt(self, index, step):
        raise KeyboardInterrupt  # Ctrl-C in the first step

    argv = [*TINY_TRAIN, "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "reference")]) == 0  # an uninterrupted run
    reference = json.loads((tmp_path / "reference" / "record.json").read_text())
    capsys.readouterr()
    out = tmp_path / "t"
    with monkeypatch.context() as patch:
        patch.setattr(loop._Loop, "_step", interrupt)
        assert main([*argv, "--out", str(out)]) == 130
    assert capsys.readouterr().err == (
        "gpattn train: interrupted; no epoch had finished, so nothing was kept: the same command starts the run again\n"
    )
    assert sorted(path.name for path in out.iterdir()) == [".gpattn.lock"]
    assert main([*argv, "--out", str(out)]) == 0  # following the advice
    record = json.loads((out / "record.json").read_text())
    assert record["metrics"] == reference["metrics"] and record["metrics"]["test"]["nll"] > 0


def test_train_on_a_full_disk_in_its_first_epoch_says_to_start_again(tmp_path, capsys, monkeypatch) -> None:
    # the message said that the folder held no checkpoint, then to resume from it
    import errno
    import os

    real_fsync, calls = os.fsync, []

    def fill_up(descriptor):  # the first epoch's checkpoints meet a full disk
        calls.append(descriptor)
        if len(calls) > 1:  # run.json
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)

    out, argv = tmp_path / "t", [*TINY_TRAIN, "--no-progress"]
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", fill_up)
        assert main([*argv, "--out", str(out)]) == 1
    checkpoints = out / "checkpoints"
    assert capsys.readouterr().err == (
        f"gpattn train: error: [Errno 28] cannot write the checkpoints of epoch 1 to {checkpoints} (No space left on "
        "device); it holds no checkpoint of this run, so there is nothing to resume; make room and train again from "
        "the start (resume=False, or the same gpattn train command with --overwrite)\n"
    )
    assert list(checkpoints.iterdir()) == []
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0  # following the advice
    assert json.loads((out / "record.json").read_text())["metrics"]["test"]["nll"] > 0


def test_train_help_says_that_resume_checks_the_stored_settings(capsys) -> None:
    # the help said that --resume continued "with the settings stored in OUT/run.json", which it does not read
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--resume continue from OUT/checkpoints/last.pt; give the options that started the run: they are checked "
        "against the settings stored in OUT/run.json (another value is refused), not read from it"
    ) in text


def test_compare_on_a_full_disk_at_the_end_keeps_the_runs(tmp_path, capsys, monkeypatch) -> None:
    import errno

    import gpattn.comparison.report as report

    def full(*args, **kwargs):
        path = tmp_path / "results.json"
        raise OSError(errno.ENOSPC, f"cannot write {path} (No space left on device); it is unchanged")

    monkeypatch.setattr(report, "write_outputs", full)
    assert main([*TINY_COMPARE, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"gpattn compare: error: [Errno 28] cannot write {tmp_path / 'results.json'} (No space left on device); it is "
        f"unchanged; the 1 runs are kept in {tmp_path / 'runs'}: make room (or fix the folder) and run the same "
        "command with --resume to write the results\n"
    )
    assert main([*TINY_COMPARE, "--out", str(tmp_path), "--resume"]) == 1  # still full: nothing trained again


def test_compare_help_explains_its_defaults_and_the_paper_rows(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: None" not in text
    assert "(default: each layer's own: s = min(10, head width) for KEP-SVGP and Primal-Attention" in text
    assert "kep_svgp_paper / primal_paper are the papers' methods as their official code runs them" in text


def test_the_mps_note(tmp_path, monkeypatch) -> None:
    """Local worker processes sharing a GPU (--device cuda, --jobs > 1) get a note on CUDA MPS unless a daemon's pipe
    folder is set (CUDA_MPS_PIPE_DIRECTORY) or exists at the default place; one process, the CPU or Ray get none."""
    from gpattn.cli import options

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(options, "MPS_PIPE_DIRECTORY", str(tmp_path / "nvidia-mps"))
    note = options.mps_note("cuda", 8, "local")
    assert note.startswith("up to 8 worker processes share the GPU in time slices")
    assert "nvidia-cuda-mps-control -d" in note
    assert options.mps_note("cuda:1", 2, "local") is not None
    assert options.mps_note("cuda", 1, "local") is None
    assert options.mps_note("cpu", 8, "local") is None
    assert options.mps_note("cuda", 8, "ray") is None
    (tmp_path / "nvidia-mps").mkdir()  # a daemon's pipe folder at the default place
    assert options.mps_note("cuda", 8, "local") is None
    (tmp_path / "nvidia-mps").rmdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipes"))
    assert options.mps_note("cuda", 8, "local") is None


@pytest.mark.parametrize("command", ["compare", "tune"])
def test_compare_and_tune_print_the_mps_note(command, tmp_path, capsys, monkeypatch) -> None:
    """Both commands print the note before the run folder is made, asked with the workers they start at most (--jobs
    capped by the planned runs); a CUDA device cannot be asked for on a machine without one, so the note's inputs and
    its printing are checked here, its text above."""
    import importlib

    module = importlib.import_module(f"gpattn.cli.{command}")
    seen = []

    def note(device, workers, executor):
        seen.append((device, workers, executor))
        return "MARKER"

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # where the run folder would be made

    monkeypatch.setattr(module, "mps_note", note)
    monkeypatch.setattr(module, "prepare_out", stop)
    argv = [command, "--jobs", "4", "--out", str(tmp_path / "o")]
    if command == "compare":  # three runs: three workers at most
        argv += ["--tasks", "digits", "--attentions", "softmax", "--seeds", "0", "1", "2"]
    assert main(argv) == 130  # Ctrl-C's status
    assert seen == [("cpu", 3 if command == "compare" else 4, "local")]
    assert f"gpattn {command}: note: MARKER\n" in capsys.readouterr().err


def test_a_reader_that_goes_away_stops_the_output_not_the_command(tmp_path, monkeypatch) -> None:
    """``gpattn train ... 2>&1 | head -1``: the reader of standard output and error is gone after the first line of
    progress. The training stopped there with a BrokenPipeError (status 1, no record.json, and an error line nobody
    could read); now the rest of the output is dropped and the run ends as it would have, with its status."""
    import io
    import os

    streams = []
    for name in ("stdout", "stderr"):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line
        stream = io.TextIOWrapper(io.FileIO(write_end, "w"), line_buffering=True)
        streams.append(stream)
        monkeypatch.setattr(sys, name, stream)
    argv = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "1", "--eval-samples", "2"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "t" / "record.json").read_text())["attention"] == "softmax"
    for stream in streams:  # pointed at the null device: the interpreter's last flush raises nothing
        stream.write("more")
        stream.flush()
        stream.close()


@pytest.mark.parametrize(
    ("command", "entries", "flag"),
    [
        (["regression"], ["results.json", "runs", "table.md"], "--overwrite"),  # deleted compare's results.json
        (["compare"], ["run.json", "checkpoints"], "--overwrite"),  # mixed the two runs' files
        (["train"], ["results.json", "runs"], "--overwrite"),
        (["compare"], ["study.db", "trials"], "--resume"),  # trained every run into tune's folder, without a word
    ],
)
def test_another_commands_run_folder_is_refused_whatever_the_flags(command, entries, flag, tmp_path, capsys, no_runs):
    for name in entries:
        (tmp_path / name).write_text("kept")
    assert main([*command, "--out", str(tmp_path), flag]) == 1
    foreign = ", ".join(sorted(name for name in entries if name != "results.json"))
    assert capsys.readouterr().err == (
        f"gpattn {command[0]}: error: --out {tmp_path} holds the run of another gpattn command ({foreign}), which this "
        "command neither replaces nor continues: choose another --out\n"
    )
    assert all((tmp_path / name).read_text() == "kept" for name in entries)


def test_the_run_folder_marks_are_the_outputs_that_one_command_alone_writes() -> None:
    """:data:`RUN_FOLDER_MARKS` restates what each command writes: an output of one command missing from it lets
    another command's ``--overwrite`` mix the two runs' files, and a mark no command writes (a renamed output) guards
    nothing. Compare's per-task figures are the one exception (its ``runs`` and ``table.md`` mark its folders)."""
    from gpattn.cli import compare, regression, train, tune
    from gpattn.cli.options import RUN_FOLDER_MARKS
    from gpattn.comparison.tasks import TASKS
    from gpattn.plotting import comparison_figure_names

    outputs = {
        "compare": set(compare.run_folder_outputs()) - set(comparison_figure_names(TASKS)),
        "train": {train.RUN_FILE, *train.OUTPUTS},
        "tune": set(tune.OUTPUTS),
        "regression": set(regression.OUTPUTS),
    }
    writers = {
        name: [command for command, written in outputs.items() if name in written]
        for name in set().union(*outputs.values())
    }
    assert sorted(RUN_FOLDER_MARKS) == sorted(name for name, commands in writers.items() if len(commands) == 1)
    assert writers["results.json"] == ["compare", "regression"]
    assert all(outputs[command] & set(RUN_FOLDER_MARKS) for command in outputs)


@pytest.mark.parametrize("name", ["stdout", "stderr"])
def test_a_closed_stream_is_left_alone_and_the_streams_are_restored(name, tmp_path, monkeypatch) -> None:
    """``gpattn ... 1>&-`` (or ``2>&-``, or pythonw): Python's stream is None, to which print writes nothing. The
    wrapper wrapped None, the first print raised AttributeError, the final flush raised again and the wrapper stayed
    installed for the rest of the process."""
    monkeypatch.setattr(sys, name, None)
    other = sys.stderr if name == "stdout" else sys.stdout
    argv = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "1", "--eval-samples", "2"]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "t" / "record.json").read_text())["attention"] == "softmax"
    assert getattr(sys, name) is None and (sys.stderr if name == "stdout" else sys.stdout) is other


def test_the_threads_help_of_regression_speaks_of_its_fits_not_of_parallel_runs(capsys) -> None:
    # regression runs its three fits one after the other: the shared help's "as soon as runs go in parallel" was false
    helps = {}
    for command in ("regression", "compare"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert "--threads THREADS torch threads of the fits (default: 1;" in helps["regression"]
    assert "parallel" not in helps["regression"].split("--threads THREADS", 1)[1].split("--overwrite", 1)[0]
    assert "as soon as runs go in parallel" in helps["compare"]
