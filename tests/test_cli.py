"""The command line interface."""

from __future__ import annotations

import json
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
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.pt").write_bytes(b"not a checkpoint")
    argv = ["train", "--task", "pointer", "--attention", "softmax", "--epochs", "1", "--out", str(tmp_path)]
    assert main([*argv, "--resume"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("gpattn train: error:") and "last.pt" in error and "Traceback" not in error
