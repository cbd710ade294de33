"""``gpattn train``, ``gpattn regression`` and ``gpattn report`` end to end, run in-process through
:func:`gpattn.cli.main`: the help against the real defaults, the exit statuses (0 success, 1 a failure while running, 2
a bad option, 130 Ctrl-C) with one-line errors, the run folders (complete, readable back, ``--overwrite`` and
``--resume`` honoured), a resumed ``gpattn train`` against an uninterrupted one, the toy regression's numbers against
a dense float64 exact-GP posterior formed in NumPy, its seeds, and ``gpattn report`` over damaged folders.

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch

from gpattn.cli import build_parser, main

TINY_TRAIN = ["train", "--task", "pointer", "--eval-samples", "2", "--no-progress"]
TINY_REGRESSION = ["regression", "--iterations", "3", "--pyro-iterations", "3", "--landmarks", "8"]
TINY_REGRESSION += ["--num-inducing", "4", "--no-progress"]


def _status(argv: list[str]) -> int:
    """The exit status of ``gpattn argv``, whether ``main`` returns it or argparse raises ``SystemExit``."""
    try:
        return main(argv)
    except SystemExit as error:
        return error.code


def _without_wall_time(record: dict) -> dict:
    """A run record without its training wall time (the one entry that differs between two runs of one setting)."""
    return {**record, "train": {key: value for key, value in record["train"].items() if key != "seconds"}}


def _refuse(token: str) -> None:
    raise ValueError(f"not strict JSON: {token}")


def _one_error_line(err: str, command: str) -> None:
    assert err.startswith(f"gpattn {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def compare_folder(tmp_path_factory) -> Path:
    """A finished ``gpattn compare`` folder: softmax on pointer, seed 0, 1 epoch (about 1.5 s)."""
    out = tmp_path_factory.mktemp("compare") / "c"
    argv = ["compare", "--attentions", "softmax", "--tasks", "pointer", "--seeds", "0", "--pointer-epochs", "1"]
    assert main([*argv, "--eval-samples", "2", "--no-progress", "--out", str(out)]) == 0
    return out


# -- the help says what the commands do ------------------------------------------------------------------------------
def test_the_defaults_shown_by_the_help_are_the_real_ones(capsys) -> None:
    from gpattn.comparison import CompareConfig, ToyRegressionConfig
    from gpattn.comparison.tasks import TASK_DEFAULTS

    parser = build_parser()
    regression = vars(parser.parse_args(["regression"]))
    library = ToyRegressionConfig()
    assert (regression["seed"], regression["num_inducing"], regression["landmarks"]) == (
        library.seed,
        library.num_inducing,
        library.num_landmarks,
    )
    assert (regression["iterations"], regression["pyro_iterations"], regression["lr"]) == (
        library.iterations,
        library.pyro_iterations,
        library.lr,
    )
    train = vars(parser.parse_args(["train"]))
    assert train["eval_samples"] == CompareConfig().eval_samples and train["threads"] == 1
    helps = {}
    for command in ("regression", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        helps[command] = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]  # past the usage
    for option, value in [("--iterations", 500), ("--pyro-iterations", 1500), ("--lr", 0.05), ("--landmarks", 24)]:
        entry = f"{option} {option[2:].upper().replace('-', '_')} "
        assert f"(default: {value})" in helps["regression"].split(entry, 1)[1].split(" --", 1)[0], option
    assert f"--eval-samples EVAL_SAMPLES default: {CompareConfig().eval_samples}" in helps["train"]
    assert "5 on mnist1d" in helps["train"] and TASK_DEFAULTS["mnist1d"]["num_inducing"] == 5
    assert "pointer" not in [task for task, values in TASK_DEFAULTS.items() if "num_inducing" in values]


def test_train_default_out_is_the_one_the_help_names(tmp_path, capsys, monkeypatch) -> None:
    # "run folder (default: runs/train-<task>-<attention>-<seed>)", relative to the working folder
    import gpattn.comparison.runs as runs

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runs, "train_and_evaluate", interrupt)
    assert main([*TINY_TRAIN, "--attention", "softmax", "--seed", "3", "--epochs", "1"]) == 130
    assert (tmp_path / "runs" / "train-pointer-softmax-3").is_dir()
    assert capsys.readouterr().err.startswith("gpattn train: interrupted; no epoch had finished")


# -- gpattn train: resume, re-runs, the record ------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_train_resumed_after_an_interruption_ends_with_the_uninterrupted_record(
    attention, tmp_path, capsys, monkeypatch
):
    # Ctrl-C after epoch 2 of 3 (its checkpoints written), then the same command with --resume: the record equals an
    # uninterrupted run's in every entry but the wall time (metrics, per-example predictions, history, spectra...)
    import gpattn.training.loop as loop

    argv = [*TINY_TRAIN, "--attention", attention, "--epochs", "3"]
    original_step, original_checkpoint, steps, seen = loop._Loop._step, loop._Loop._checkpoint, [], []

    def counted_step(self, *args, **kwargs):
        steps.append(1)
        return original_step(self, *args, **kwargs)

    def stop_after_epoch_two(self, improved):
        original_checkpoint(self, improved)
        seen.append(improved)
        if len(seen) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop._Loop, "_step", counted_step)
    assert main([*argv, "--out", str(tmp_path / "reference")]) == 0
    reference = json.loads((tmp_path / "reference" / "record.json").read_text())
    steps_per_epoch, _ = divmod(len(steps), 3)
    assert steps_per_epoch > 0 and len(steps) == 3 * steps_per_epoch
    out = tmp_path / "resumed"
    with monkeypatch.context() as patch:
        patch.setattr(loop._Loop, "_checkpoint", stop_after_epoch_two)
        assert main([*argv, "--out", str(out)]) == 130
    assert not (out / "record.json").exists()
    steps.clear()
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert len(steps) == steps_per_epoch  # it continued from the checkpoint of epoch 2, not from the start
    resumed = json.loads((out / "record.json").read_text())
    assert _without_wall_time(resumed) == _without_wall_time(reference)
    assert resumed["train"]["epochs_trained"] == 3 and resumed["metrics"]["test"]["nll"] > 0


def test_train_interrupted_in_its_evaluation_resumes_to_the_same_record(tmp_path, capsys, monkeypatch) -> None:
    # Ctrl-C after the last epoch, while the test sets are evaluated: every epoch is kept, --resume only evaluates
    import gpattn.comparison.runs as runs

    argv = [*TINY_TRAIN, "--attention", "kep_svgp", "--epochs", "2"]
    assert main([*argv, "--out", str(tmp_path / "reference")]) == 0
    reference = json.loads((tmp_path / "reference" / "record.json").read_text())

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "t"
    with monkeypatch.context() as patch:
        patch.setattr(runs, "evaluate_models", interrupt)
        capsys.readouterr()
        assert main([*argv, "--out", str(out)]) == 130
    assert capsys.readouterr().err == (
        f"gpattn train: interrupted; the checkpoints of epoch 2 of 2 are kept in {out / 'checkpoints'}; the same "
        "command with --resume continues\n"
    )
    import gpattn.training.loop as loop

    def no_step(self, *args, **kwargs):
        raise AssertionError("a finished run trained again")

    monkeypatch.setattr(loop._Loop, "_step", no_step)
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert _without_wall_time(json.loads((out / "record.json").read_text())) == _without_wall_time(reference)


def test_train_record_is_the_record_of_the_same_run_of_compare(compare_folder, tmp_path) -> None:
    # the help: "write OUT/record.json (the same metrics as gpattn compare)"
    out = tmp_path / "t"
    assert main([*TINY_TRAIN, "--attention", "softmax", "--epochs", "1", "--out", str(out)]) == 0
    record = json.loads((out / "record.json").read_text())
    stored = json.loads((compare_folder / "runs" / "pointer-softmax-0.json").read_text())
    assert _without_wall_time(record) == _without_wall_time(stored["record"])
    run_file = json.loads((out / "run.json").read_text())
    assert run_file["identity"] == stored["identity"] and run_file["settings"] == stored["settings"]
    # a second --resume of the finished run evaluates its checkpoints again and writes the same record
    assert main([*TINY_TRAIN, "--attention", "softmax", "--epochs", "1", "--out", str(out), "--resume"]) == 0
    assert _without_wall_time(json.loads((out / "record.json").read_text())) == _without_wall_time(record)


def test_train_rerun_is_refused_and_overwrite_replaces_only_its_outputs(tmp_path, capsys) -> None:
    out = tmp_path / "t"
    argv = [*TINY_TRAIN, "--attention", "softmax", "--epochs", "1", "--out", str(out)]
    assert main(argv) == 0
    first = json.loads((out / "record.json").read_text())
    (out / "notes.txt").write_text("the user's")
    capsys.readouterr()
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        f"gpattn train: error: --out {out} already holds files (checkpoints, notes.txt, record.json, run.json): pass "
        "--overwrite to replace that run, --resume to continue it, or choose another --out\n"
    )
    assert json.loads((out / "record.json").read_text()) == first
    assert main([*argv, "--overwrite"]) == 0
    assert sorted(path.name for path in out.iterdir()) == [
        ".gpattn.lock",
        "checkpoints",
        "notes.txt",
        "record.json",
        "run.json",
    ]
    assert (out / "notes.txt").read_text() == "the user's"
    assert _without_wall_time(json.loads((out / "record.json").read_text())) == _without_wall_time(first)


@pytest.fixture(scope="module")
def finished_train(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "t"
    assert main([*TINY_TRAIN, "--attention", "softmax", "--epochs", "1", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda content: "not json", "run.json: cannot be read back as a run file"),
        (lambda content: "[]", "run.json: expected a run file with the entries"),
        (lambda content: json.dumps({**content, "identity": 5}), "run.json holds the run 5, not pointer-softmax-0"),
        (lambda content: json.dumps({**content, "settings": [1]}), "do not match their stored SHA-256"),
        (lambda content: json.dumps({**content, "format": [1]}), "expected the format 'gpattn-run/1', got [1]"),
        (None, "--resume needs"),  # run.json deleted
    ],
    ids=["garbage", "list", "identity", "settings", "format", "missing"],
)
def test_train_resume_from_a_damaged_run_file_is_one_line(damage, fragment, finished_train, tmp_path, capsys) -> None:
    out = tmp_path / "t"
    shutil.copytree(finished_train, out)
    content = json.loads((out / "run.json").read_text())
    if damage is None:
        (out / "run.json").unlink()
    else:
        (out / "run.json").write_text(damage(content))
    checkpoints = sorted(path.name for path in (out / "checkpoints").iterdir())
    capsys.readouterr()
    assert main([*TINY_TRAIN, "--attention", "softmax", "--epochs", "1", "--out", str(out), "--resume"]) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "train")
    assert fragment in err
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == checkpoints  # nothing deleted


def test_train_resume_after_the_tuned_configuration_changed_names_the_command_options(tmp_path, capsys, monkeypatch):
    import gpattn.training.loop as loop
    from gpattn.comparison.tuned_configuration import tuned_path

    folder = tmp_path / "tuned"
    folder.mkdir()
    entry = json.loads(tuned_path("digits").read_text())["rows"]["softmax"]
    entry = {**entry, "hyperparameters": {"epochs": 3, "lr": 0.003}, "parameters": {"lr": 0.003}}
    (folder / "pointer.json").write_text(json.dumps({"format": 1, "task": "pointer", "rows": {"softmax": entry}}))
    argv = [*TINY_TRAIN, "--attention", "softmax", "--tuned-dir", str(folder), "--out", str(tmp_path / "t")]
    original = loop._Loop._checkpoint

    def stop(self, improved):
        original(self, improved)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(loop._Loop, "_checkpoint", stop)
        assert main(argv) == 130
    entry["hyperparameters"]["epochs"] = 4  # e.g. gpattn tune wrote the folder again
    (folder / "pointer.json").write_text(json.dumps({"format": 1, "task": "pointer", "rows": {"softmax": entry}}))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "train")
    assert "pointer.json" in err and "--overwrite" in err, err
    assert "resume=False" not in err and "schedule_epochs" not in err, err


# -- gpattn regression -----------------------------------------------------------------------------------------------
def test_regression_is_reproducible_and_leaves_the_global_state_alone(tmp_path, capsys) -> None:
    # two calls with one seed write the same results.json (but the wall times); another seed other numbers; the
    # torch generator and Pyro's parameter store are as they were; the files are complete and strict JSON
    from gpattn.comparison import ToyRegressionConfig, run_toy_regression

    store = pyro.get_param_store()
    store.clear()
    pyro.param("callers", torch.tensor([1.5, 2.5]))
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    saved = {}
    for name, seed in [("a", "0"), ("b", "0"), ("c", "1")]:
        assert main([*TINY_REGRESSION, "--seed", seed, "--out", str(tmp_path / name)]) == 0
        saved[name] = json.loads((tmp_path / name / "results.json").read_text(), parse_constant=_refuse)
        assert (tmp_path / name / "posterior.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == [
            ".gpattn.lock",
            "posterior.png",
            "results.json",
        ]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert list(store.keys()) == ["callers"] and torch.equal(pyro.param("callers").detach(), torch.tensor([1.5, 2.5]))
    for name in saved:
        assert set(saved[name]["seconds"]) == {"exact_gp", "kep_svgp_elbo", "kep_svgp_pyro"}
        saved[name].pop("seconds")
    assert saved["a"] == saved["b"] and saved["a"]["config"]["seed"] == 0
    assert saved["c"]["rmse"]["exact_gp"] != saved["a"]["rmse"]["exact_gp"]
    # the library call with the same settings gives the numbers the command wrote
    config = ToyRegressionConfig(num_landmarks=8, num_inducing=4, iterations=3, pyro_iterations=3)
    result = run_toy_regression(config, progress=False)
    assert result.rmse == saved["a"]["rmse"] and result.learned == saved["a"]["learned"]
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'c' / 'results.json'} and {tmp_path / 'c' / 'posterior.png'}" in printed


def test_the_exact_gp_numbers_against_a_dense_float64_posterior() -> None:
    # The exact GP's reported test RMSEs (against y and against the noiseless f) and its learned hyperparameters
    # against the posterior formed in NumPy from the kernel's definition: k = k_e + k_r with
    # k_e(x, y) = kappa(x, Z) kappa(y, Z)^T, k_r(x, y) = kappa(Z, x)^T kappa(Z, y), kappa the shifted RBF; the posterior
    # mean K*x (Kxx + s^2 I)^-1 y and variance diag(K** - K*x (Kxx + s^2 I)^-1 Kx*) over all 200 training points.
    from gpattn.comparison import ToyRegressionConfig, run_toy_regression

    config = ToyRegressionConfig(num_landmarks=10, num_inducing=6, iterations=15, pyro_iterations=2)
    result = run_toy_regression(config, progress=False)
    data, model = result.data, result.models["exact_gp"]
    kernel = model.covar_module.kernel
    learned = result.learned["exact_gp"]
    shift, scale, outputscale = learned["shift"], learned["lengthscale"], learned["outputscale"]
    noise = learned["noise_std"] ** 2
    assert shift == kernel.shift.item() and scale == kernel.lengthscale.item()
    assert noise == pytest.approx(model.likelihood.noise.item(), rel=1e-14)
    landmarks = np.linspace(data.grid_x.min().item(), data.grid_x.max().item(), config.num_landmarks)

    def kappa(x: np.ndarray, z: np.ndarray) -> np.ndarray:
        return outputscale * np.exp(-0.5 * ((x[:, None] - z[None, :] - shift) / scale) ** 2)

    def induced(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return kappa(x, landmarks) @ kappa(y, landmarks).T + kappa(landmarks, x).T @ kappa(landmarks, y)

    x, y = data.train_x[:, 0].numpy(), data.train_y.numpy()
    test = data.test_x[:, 0].numpy()
    gram = induced(x, x) + noise * np.eye(x.shape[0])
    cross = induced(test, x)
    mean = cross @ np.linalg.solve(gram, y)
    variance = np.diag(induced(test, test)) - np.einsum("ij,ji->i", cross, np.linalg.solve(gram, cross.T))
    rmse = float(np.sqrt(np.mean((mean - data.test_y.numpy()) ** 2)))
    rmse_f = float(np.sqrt(np.mean((mean - data.test_f.numpy()) ** 2)))
    assert result.rmse["exact_gp"] == pytest.approx(rmse, rel=1e-9)
    assert result.rmse_noiseless["exact_gp"] == pytest.approx(rmse_f, rel=1e-9)
    assert rmse < 0.5 * float(np.sqrt(np.mean(data.test_y.numpy() ** 2)))  # it fits: well below the zero predictor
    with torch.no_grad():
        predictive = model(data.test_x)
    np.testing.assert_allclose(predictive.variance.numpy(), variance, rtol=1e-6, atol=1e-10)


def test_regression_divergence_is_one_line_and_leaves_no_result(tmp_path, capsys) -> None:
    out = tmp_path / "g"
    argv = [*TINY_REGRESSION, "--lr", "1000", "--iterations", "5", "--pyro-iterations", "2", "--out", str(out)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "regression")
    assert "exact GP: the fit diverged at iteration 2/5 (learning rate 1000)" in err and "--lr" in err
    assert sorted(path.name for path in out.iterdir()) == [".gpattn.lock"]  # the same command may run again
    assert main([*TINY_REGRESSION, "--out", str(out)]) == 0


def test_regression_rerun_is_refused_and_overwrite_keeps_the_users_files(tmp_path, capsys) -> None:
    out = tmp_path / "g"
    assert main([*TINY_REGRESSION, "--out", str(out)]) == 0
    first = json.loads((out / "results.json").read_text())
    (out / "notes.txt").write_text("the user's")
    capsys.readouterr()
    assert main([*TINY_REGRESSION, "--seed", "1", "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"gpattn regression: error: --out {out} already holds files (notes.txt, posterior.png, results.json): pass "
        "--overwrite to replace that run, or choose another --out\n"
    )
    assert json.loads((out / "results.json").read_text()) == first
    assert _status([*TINY_REGRESSION, "--out", str(out), "--resume"]) == 2  # regression has no --resume
    assert main([*TINY_REGRESSION, "--seed", "1", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 1
    assert (out / "notes.txt").read_text() == "the user's"


def test_regression_seed_beyond_64_bits_is_a_bad_option(tmp_path, capsys, monkeypatch) -> None:
    import gpattn.comparison as comparison

    def must_not_run(*args, **kwargs):
        raise AssertionError("a fit ran")

    monkeypatch.setattr(comparison, "run_toy_regression", must_not_run)
    assert _status(["regression", "--seed", str(2**64), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "18446744073709551616" in err and "Traceback" not in err
    assert not (tmp_path / "g").exists()


def test_regression_results_record_the_thread_count(tmp_path) -> None:
    assert main([*TINY_REGRESSION, "--threads", "2", "--out", str(tmp_path / "g")]) == 0
    saved = json.loads((tmp_path / "g" / "results.json").read_text())
    assert saved.get("threads", saved["config"].get("threads")) == 2


# -- gpattn report over damaged folders -----------------------------------------------------------------------------
def _edit(path: Path, change) -> None:
    content = json.loads(path.read_text())
    replaced = change(content)
    path.write_text(replaced if isinstance(replaced, str) else json.dumps(content))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: json.dumps(c)[:100], "results.json: cannot be read as a run folder's results.json (Unterminated"),
        (lambda c: "\ufeff{", "results.json: cannot be read as a run folder's results.json"),
        (lambda c: "[1]", "results.json: expected a results.json with a list of 'records'"),
        (lambda c: c.__setitem__("records", {}), "expected a results.json with a list of 'records'"),
        (lambda c: c.__setitem__("config", [1]), "expected 'config' to be an object, got a list"),
        (lambda c: c["records"].__setitem__(0, 5), "record 1 (not an object but a number)"),
        (lambda c: c["records"][0].pop("metrics"), "record 1 (task pointer, row softmax, seed 0): record: missing"),
        (lambda c: c["records"][0]["metrics"]["test"].__setitem__("nll", "x"), "record.metrics.test.nll: expected"),
        (lambda c: c["records"][0].__setitem__("seed", "zero"), "record.seed: expected an integer, got 'zero'"),
        (lambda c: c.__setitem__("records", []), "no records in"),
    ],
    ids="truncated bom list records-dict config-list record-number no-metrics metric-text seed-text no-records".split(),
)
def test_report_of_a_damaged_results_file_is_one_line(change, fragment, compare_folder, tmp_path, capsys) -> None:
    folder = tmp_path / "c"
    shutil.copytree(compare_folder, folder)
    _edit(folder / "results.json", change)
    assert main(["report", str(folder)]) == 1
    captured = capsys.readouterr()
    _one_error_line(captured.err, "report")
    assert fragment in captured.err and captured.out == ""


def test_report_reads_only_results_json_and_refuses_other_commands_folders(compare_folder, tmp_path, capsys):
    # extra files, and runs/ or the figures missing, change nothing: the report is that of results.json
    assert main(["report", str(compare_folder)]) == 0
    reference = capsys.readouterr().out
    assert "## Full tables" in reference and "| softmax | 1 |" in reference
    folder = tmp_path / "c"
    shutil.copytree(compare_folder, folder)
    shutil.rmtree(folder / "runs")
    (folder / "spectra.png").unlink(missing_ok=True)
    (folder / "extra.json").write_text("{not json")
    assert main(["report", str(folder)]) == 0
    assert capsys.readouterr().out == reference
    # a train folder (no results.json) is a bad option; a regression folder's results.json has no records
    train = tmp_path / "t"
    train.mkdir()
    (train / "record.json").write_text("{}")
    assert _status(["report", str(train)]) == 2
    assert f"argument RUN: expected a run folder of gpattn compare (with results.json), got '{train}'" in (
        capsys.readouterr().err
    )
    regression = tmp_path / "g"
    regression.mkdir()
    (regression / "results.json").write_text(json.dumps({"config": {}, "rmse": {"exact_gp": 0.1}}))
    assert main(["report", str(regression)]) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "report")
    assert "expected a results.json with a list of 'records'" in err


def test_report_page_in_a_new_folder_and_under_a_file(compare_folder, tmp_path, capsys) -> None:
    page = tmp_path / "new" / "deeper" / "results.md"
    assert main(["report", str(compare_folder), "--page", str(page)]) == 0
    assert page.read_text().startswith("#") and (page.parent / "results_figures").is_dir()
    assert f"wrote {page} and " in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["report", str(compare_folder), "--page", str(blocker / "results.md")]) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "report")
    assert "Not a directory" in err and str(blocker) in err
    assert blocker.read_text() == "x"


@pytest.mark.parametrize(
    ("command", "seed", "expected"),
    [
        (["train", "--task", "pointer", "--attention", "softmax"], 2**64, "a non-negative integer at most 2**64 - 1"),
        # the tuning seed's samplers take seed * 1000 + slot below 2**32
        (["tune"], 4294968, "an integer in [0, 4294967]"),
    ],
)
def test_a_seed_out_of_range_is_a_bad_option_of_train_and_tune(command, seed, expected, tmp_path, capsys) -> None:
    assert _status([*command, "--seed", str(seed), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert f"argument --seed: expected the value to be {expected}" in err, err
    assert "Traceback" not in err and not (tmp_path / "g").exists()
