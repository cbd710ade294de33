"""Bad command-line options (issue 7): every case exits with status 2 and a message on stderr that names the option,
what was expected and what came, before any data is loaded or any model trained.

Option values are checked by argparse (``SystemExit(2)``); combinations of options are checked when the run's
config is built (``main`` returns 2). Either way nothing runs: the run functions are replaced by ones that fail.
"""

from __future__ import annotations

import pytest
import torch

from gpattn import cli


def _must_not_run(*args, **kwargs):
    raise AssertionError("a run started despite a bad option")


@pytest.fixture(autouse=True)
def _no_runs(monkeypatch):
    import gpattn.comparison as comparison
    import gpattn.comparison.runner as runner
    import gpattn.comparison.runs as runs

    monkeypatch.setattr(runner, "execute_runs", _must_not_run)
    monkeypatch.setattr(runs, "train_and_evaluate", _must_not_run)
    monkeypatch.setattr(comparison, "run_toy_regression", _must_not_run)


def exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as error:
        return error.code


CASES = [
    # (argv, fragments of the stderr message)
    ([], ["required", "command"]),
    (["fit"], ["invalid choice: 'fit'", "regression", "compare", "train"]),
    (["regression", "--num-inducing", "0"], ["--num-inducing", "expected the value to be a positive integer, got 0"]),
    (["regression", "--num-inducing", "two"], ["--num-inducing", "to be a positive integer, got 'two'"]),
    (["regression", "--num-inducing", "2.5"], ["--num-inducing", "to be a positive integer, got '2.5'"]),
    (["regression", "--landmarks", "-1"], ["--landmarks", "positive integer, got -1"]),
    (["regression", "--iterations", "0"], ["--iterations", "positive integer"]),
    (["regression", "--pyro-iterations", "-5"], ["--pyro-iterations", "positive integer"]),
    (["regression", "--lr", "0"], ["--lr", "expected the value to be a finite number > 0, got 0.0"]),
    (["regression", "--lr", "nan"], ["--lr", "finite number > 0, got nan"]),
    (["regression", "--lr", "inf"], ["--lr", "finite number > 0, got inf"]),
    (["regression", "--seed", "-1"], ["--seed", "non-negative integer, got -1"]),
    (["regression", "--seed", "abc"], ["--seed", "non-negative integer, got 'abc'"]),
    (
        ["regression", "--num-inducing", "30", "--landmarks", "24"],
        ["--num-inducing (30) must not exceed --landmarks (24)"],
    ),
    (["regression", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["train", "--attention", "nope"], ["--attention", "invalid choice: 'nope'", "kep_svgp"]),
    (["train", "--task", "mnist"], ["--task", "invalid choice: 'mnist'", "digits"]),
    (["train", "--epochs", "0"], ["--epochs", "positive integer, got 0"]),
    (["train", "--epochs", "-3"], ["--epochs", "positive integer, got -3"]),
    (["train", "--eval-samples", "0"], ["--eval-samples", "positive integer"]),
    (["train", "--num-inducing", "0"], ["--num-inducing", "positive integer"]),
    (["train", "--num-inducing", "17"], ["gpattn train: error:", "num_inducing (17)", "head width", "16"]),
    (["train", "--seed", "-2"], ["--seed", "non-negative integer"]),
    (  # a row without an inducing set: the option was ignored
        ["train", "--attention", "cgpt", "--num-inducing", "4", "--untuned"],
        ["gpattn train: error: --num-inducing: the cgpt attention has no inducing set to size"],
    ),
    (["train", "--attention", "softmax", "--num-inducing", "4"], ["--num-inducing: the softmax attention has no"]),
    (["train", "--device", "banana"], ["--device", "'cpu', 'cuda' or 'cuda:0', got 'banana'"]),
    (["train", "--device", "meta"], ["--device", "'cpu', 'cuda' or 'cuda:<index>', got 'meta'"]),
    (["compare", "--attentions", "softmax", "nope"], ["--attentions", "invalid choice: 'nope'"]),
    (["compare", "--tasks", "cifar"], ["--tasks", "invalid choice: 'cifar'"]),
    (["compare", "--seeds", "0", "0"], ["gpattn compare: error:", "distinct seeds", "[0, 0]"]),
    (["compare", "--seeds", "-1"], ["--seeds", "non-negative integer, got -1"]),
    (["compare", "--ensemble", "0"], ["--ensemble", "positive integer, got 0"]),
    (["compare", "--pointer-epochs", "0"], ["--pointer-epochs", "positive integer"]),
    (["compare", "--digits-epochs", "-1"], ["--digits-epochs", "positive integer"]),
    (["compare", "--eval-samples", "0"], ["--eval-samples", "positive integer"]),
    (["compare", "--num-inducing", "99"], ["gpattn compare: error:", "num_inducing (99)", "head width"]),
    (["compare", "--attentions", "softmax", "--num-inducing", "99", "--beta", "-1"], ["--beta", "finite number >= 0"]),
    (["compare", "--ksvd-weight", "nan"], ["--ksvd-weight", "finite number >= 0, got nan"]),
    (["compare", "--device", "cpux"], ["--device", "got 'cpux'"]),
    (["compare", "--tuned-dir", "no-such-folder"], ["--tuned-dir", "folder of the tuned configurations", "no-such"]),
    (["train", "--tuned-dir", "no-such-folder"], ["--tuned-dir", "folder of the tuned configurations", "no-such"]),
    (["compare", "--quick", "--ensemble", "-2"], ["--ensemble", "positive integer"]),
    # the options' names, not CompareConfig's fields ("cuda_graphs=True needs device='cuda'")
    (
        ["compare", "--cuda-graphs"],
        ["gpattn compare: error: argument --cuda-graphs: needs --device cuda, got --device cpu"],
    ),
    (["compare", "--compile", "--cuda-graphs"], ["argument --cuda-graphs: not allowed with argument --compile"]),
]


@pytest.mark.parametrize(("argv", "fragments"), CASES, ids=[" ".join(argv) or "<none>" for argv, _ in CASES])
def test_bad_options_exit_with_status_2(argv, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no run folder may appear anywhere
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "compare"])  # regression has no --device: it runs on the CPU
def test_cuda_when_absent(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert exit_code([command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "CUDA is not available" in err and "use 'cpu'" in err


@pytest.mark.parametrize("command", ["regression", "train", "compare"])
def test_out_must_not_be_a_file(command, capsys, tmp_path):
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    assert exit_code([command, "--out", str(existing)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "existing file" in err and str(existing) in err
    assert existing.read_text() == "{}"


def test_resume_without_checkpoint(capsys, tmp_path):
    assert exit_code(["train", "--out", str(tmp_path), "--resume"]) == 2
    assert "--resume needs" in capsys.readouterr().err


def test_good_options_still_reach_the_run(monkeypatch, tmp_path):
    """The checks do not reject the defaults: a valid command line gets as far as the (replaced) run."""
    for argv in (
        ["regression", "--out", str(tmp_path / "r")],
        ["train", "--out", str(tmp_path / "t"), "--device", "cpu", "--seed", "0"],
        [
            "compare",
            "--quick",
            "--out",
            str(tmp_path / "c"),
            "--beta",
            "0",
            "--ksvd-weight",
            "0.5",
            "--seeds",
            "0",
            "1",
        ],
        [
            "compare",
            "--out",
            str(tmp_path / "m"),
            "--attentions",
            "softmax_mc_dropout",
            "kep_svgp_paper",
            "--mc-dropout",
            "0.2",
        ],
        ["compare", "--out", str(tmp_path / "n"), "--tasks", "mnist1d", "--ece-bins", "10", "--no-temperature-scaling"],
    ):
        with pytest.raises(AssertionError, match="a run started"):
            cli.main(argv)
