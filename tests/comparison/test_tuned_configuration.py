"""The tuned configuration files and how ``gpattn compare`` uses them: a tuned file changes the hyperparameters of
the rows it covers (and of the rows that inherit them), ``--untuned`` does not, and malformed files are clear errors
before any run."""

from __future__ import annotations

import dataclasses
import json

import pytest

import gpattn.comparison.runner as runner_module
from gpattn.cli import main
from gpattn.comparison import CompareConfig, train_and_evaluate
from gpattn.comparison.tuned_configuration import (
    TUNED_DIRECTORY,
    TunedRow,
    check_same_budget,
    read_tuned,
    tuned_path,
    tuning_budget,
    write_tuned,
)
from gpattn.methods import get_method

TUNED = {"epochs": 1, "patience": 1, "lr": 1e-3, "weight_decay": 0.05, "dropout": 0.2, "embed_dim": 48, "depth": 1}


def _entry(**hyperparameters) -> TunedRow:
    return TunedRow(
        hyperparameters={**TUNED, **hyperparameters},
        parameters={"lr": 1e-3},
        best_val_nll=0.5,
        best_trial=3,
        trials=20,
        search_space={"lr": {"log_uniform": [3e-4, 1e-2]}},
        study={"tuning_seed": 100, "label": "test"},
    )


def test_a_tuned_configuration_without_a_gp_block_is_refused(tmp_path) -> None:
    # with gp_layers=0 every block is softmax attention: the GP row would train a softmax model under its name
    write_tuned("digits", {"kep_svgp": _entry(gp_layers=0)}, tmp_path)
    assert json.loads((tmp_path / "digits.json").read_text())["rows"]["kep_svgp"]["hyperparameters"]["gp_layers"] == 0
    with pytest.raises(ValueError, match=r"row 'kep_svgp'.*expected gp_layers >= 1 for the row 'kep_svgp' on digits"):
        CompareConfig(attentions=("kep_svgp",), tasks=("digits",), tuned_dir=str(tmp_path))
    untuned = CompareConfig(attentions=("kep_svgp",), tasks=("digits",), tuned_dir=str(tmp_path), tuned=False)
    assert untuned.hyperparameters("digits", get_method("kep_svgp")).gp_layers == 1


@pytest.fixture
def tuned_dir(tmp_path):
    write_tuned("digits", {"softmax": _entry(), "kep_svgp": _entry(beta=3.0, ksvd_weight=0.5)}, tmp_path)
    return tmp_path


def test_the_package_tuned_files_are_valid_and_equal_in_budget():
    # the protocol: the same budget (trials, seed, epochs, patience) for every tuned row of a task
    for path in TUNED_DIRECTORY.glob("*.json"):
        rows = read_tuned(path.stem)
        budgets = {json.dumps(tuning_budget(entry), sort_keys=True) for entry in rows.values()}
        assert len(budgets) == 1, (path, budgets)
    CompareConfig()  # reads and checks the package's files of the default tasks


def test_a_row_tuned_with_another_budget_is_not_merged_into_a_file(tuned_dir):
    # a file mixed rows tuned with 1 trial and 1 epoch beside rows with 3 trials and 4 epochs, all labelled "tuned"
    before = (tuned_dir / "digits.json").read_text()
    other = dataclasses.replace(_entry(), trials=3)
    with pytest.raises(ValueError, match=r"the row 'sgpa' is tuned with another budget than the row 'kep_svgp' .*"
                       r"trials 3 \(theirs 20\)"):  # fmt: skip
        write_tuned("digits", {"sgpa": other}, tuned_dir)
    longer = _entry(epochs=4)
    with pytest.raises(ValueError, match=r"epochs 4 \(theirs 1\)"):
        write_tuned("digits", {"sgpa": longer}, tuned_dir)
    with_samples = dataclasses.replace(_entry(), study={"tuning_seed": 100, "eval_samples": 3})
    write_tuned("digits", {"sgpa": with_samples}, tuned_dir)  # older entries lack eval_samples: not compared
    with pytest.raises(ValueError, match=r"eval_samples 5 \(theirs 3\)"):
        check_same_budget({"primal": {"eval_samples": 5}}, {"sgpa": with_samples}, "file")
    assert (tuned_dir / "digits.json").read_text() != before  # the agreeing row was written
    # replacing every row of the file with another budget is a new tuning: allowed
    write_tuned("digits", {row: other for row in read_tuned("digits", tuned_dir)}, tuned_dir)
    assert {entry.trials for entry in read_tuned("digits", tuned_dir).values()} == {3}


def test_a_tuned_file_round_trips_and_keeps_the_other_rows(tuned_dir):
    rows = read_tuned("digits", tuned_dir)
    assert list(rows) == ["kep_svgp", "softmax"] and rows["softmax"] == _entry()
    write_tuned("digits", {"softmax": _entry(lr=2e-3)}, tuned_dir)
    again = read_tuned("digits", tuned_dir)
    assert again["softmax"].hyperparameters["lr"] == 2e-3 and again["kep_svgp"] == rows["kep_svgp"]
    assert read_tuned("mnist1d", tuned_dir) == {}


def test_a_tuned_file_changes_the_hyperparameters_compare_uses(tuned_dir):
    rows = ("softmax", "deep_ensemble", "kep_svgp", "sgpa")
    tuned = CompareConfig(attentions=rows, tasks=("digits",), tuned_dir=str(tuned_dir))
    untuned = CompareConfig(attentions=rows, tasks=("digits",), tuned_dir=str(tuned_dir), tuned=False)
    for row in ("softmax", "deep_ensemble"):  # deep_ensemble inherits softmax's configuration
        hyperparameters = tuned.hyperparameters("digits", get_method(row), {"num_inducing": 5})
        assert {name: getattr(hyperparameters, name) for name in TUNED} == TUNED
        assert hyperparameters.num_inducing == 5 and hyperparameters.batch_size == untuned.batch_size
    assert tuned.tuned_source("digits", "deep_ensemble") == "softmax" and tuned.is_tuned("digits", "deep_ensemble")
    kep = tuned.hyperparameters("digits", get_method("kep_svgp"))
    assert (kep.beta, kep.ksvd_weight, kep.embed_dim) == (3.0, 0.5, 48)
    # a row without an entry, and every row with tuned=False: the shared settings
    assert not tuned.is_tuned("digits", "sgpa") and tuned.tuned_source("digits", "sgpa") is None
    for row in rows:
        shared = untuned.hyperparameters("digits", get_method(row))
        assert (shared.lr, shared.epochs, shared.embed_dim, shared.patience) == (3e-3, 40, 32, None)
        assert not untuned.is_tuned("digits", row)
    assert CompareConfig.quick(tuned_dir=str(tuned_dir)).is_tuned("digits", "softmax") is False


def test_a_run_trains_with_the_tuned_configuration(tmp_path):
    write_tuned("pointer", {"softmax": _entry(epochs=1, embed_dim=16, depth=1)}, tmp_path)
    settings = dict(
        attentions=("softmax",), tasks=("pointer",), pointer_epochs=2, eval_samples=2, tuned_dir=str(tmp_path)
    )
    settings.update(fidelity_sequences=0, progress=False)
    tuned = train_and_evaluate(CompareConfig(**settings), "pointer", "softmax", 0)
    untuned = train_and_evaluate(CompareConfig(**settings, tuned=False), "pointer", "softmax", 0)
    assert tuned.train.epochs == 1 and untuned.train.epochs == 2
    assert tuned.train.num_parameters < untuned.train.num_parameters  # width 16, depth 1 against 32 x 2


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "cannot be read as a tuned configuration file"),
        (json.dumps({"format": 1, "task": "digits"}), "with the keys"),
        (json.dumps({"format": 2, "task": "digits", "rows": {}}), "expected format 1"),
        (json.dumps({"format": 1, "task": "mnist1d", "rows": {}}), "of the task 'digits', got 'mnist1d'"),
        (json.dumps({"format": 1, "task": "digits", "rows": {"nope": {}}}), "unknown row 'nope'; expected rows of"),
        ("ENTRY:" + json.dumps({**_entry().to_dict(), "trials": -1}), "trials to be a positive integer"),
        ("ENTRY:" + json.dumps({**_entry().to_dict(), "trials": 0}), "trials to be a positive integer"),
        (json.dumps({"format": True, "task": "digits", "rows": {}}), "expected format 1, got True"),
        (json.dumps({"format": 1.0, "task": "digits", "rows": {}}), "expected format 1, got 1.0"),
        ("ENTRY:" + json.dumps({**_entry().to_dict(), "best_val_nll": None}), "best_val_nll to be a finite number"),
        ("ENTRY:" + json.dumps({**_entry().to_dict(), "extra": 1}), "expected an entry with the keys"),
        ("HP:" + json.dumps({"learning_rate": 0.1}), r"unknown hyperparameters \['learning_rate'\]"),
        ("HP:" + json.dumps({"lr": -1.0}), "lr"),
        ("HP:" + json.dumps({"num_heads": 5}), "embed_dim .48. must be divisible by num_heads .5."),
    ],
)
def test_malformed_tuned_files_are_clear_errors_naming_the_file(tmp_path, content, match):
    if content.startswith(("ENTRY:", "HP:")):
        kind, payload = content.split(":", 1)
        entry = (
            json.loads(payload)
            if kind == "ENTRY"
            else {**_entry().to_dict(), "hyperparameters": {**TUNED, **json.loads(payload)}}
        )
        content = json.dumps({"format": 1, "task": "digits", "rows": {"softmax": entry}})
    tuned_path("digits", tmp_path).write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        CompareConfig(attentions=("softmax",), tasks=("digits",), tuned_dir=str(tmp_path))
    assert str(tuned_path("digits", tmp_path)) in str(error.value)
    CompareConfig(attentions=("softmax",), tasks=("digits",), tuned_dir=str(tmp_path), tuned=False)  # not read


def test_compare_untuned_and_tuned_dir_reach_the_config(tuned_dir, tmp_path, monkeypatch):
    seen = []

    def stop(config, runs, out=None, resume=False, executor=None):
        seen.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_module, "execute_runs", stop)
    argv = ["compare", "--tasks", "digits", "--attentions", "softmax", "--seeds", "0", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--tuned-dir", str(tuned_dir)]) == 130
    assert main([*argv, "--out", str(tmp_path / "b"), "--tuned-dir", str(tuned_dir), "--untuned"]) == 130
    assert seen[0].is_tuned("digits", "softmax") and seen[0].hyperparameters("digits", get_method("softmax")).lr == 1e-3
    assert not seen[1].is_tuned("digits", "softmax")
    with pytest.raises(SystemExit) as refused:  # not a folder: the option's own error (status 2) before anything runs
        main([*argv, "--out", str(tmp_path / "c"), "--tuned-dir", str(tmp_path / "missing")])
    assert refused.value.code == 2 and len(seen) == 2


def test_resume_refuses_a_run_trained_before_its_tuned_configuration_changed(tmp_path):
    """The run settings name the tuned folder, not the values in it: a run file whose record stores other
    hyperparameters than the tuned file gives now is refused on --resume (instead of being reused silently)."""
    from gpattn.comparison import run_comparison

    folder = tmp_path / "tuned"
    write_tuned("pointer", {"softmax": _entry(epochs=1, embed_dim=16, depth=1)}, folder)
    settings = dict(attentions=("softmax",), tasks=("pointer",), seeds=(0,), eval_samples=2, fidelity_sequences=0,
                    progress=False, tuned_dir=str(folder))  # fmt: skip
    out = tmp_path / "out"
    (first,) = run_comparison(CompareConfig(**settings), out=out)
    (again,) = run_comparison(CompareConfig(**settings), out=out, resume=True)  # unchanged: read back
    assert again.to_dict() == first.to_dict()
    write_tuned("pointer", {"softmax": _entry(epochs=1, embed_dim=16, depth=1, lr=2e-3)}, folder)
    changed = CompareConfig(**settings)  # a later gpattn compare --resume reads the tuned file again
    with pytest.raises(ValueError, match=r"pointer-softmax-0\.json was trained with other hyperparameters \(lr: "):
        run_comparison(changed, out=out, resume=True)


def test_rows_with_different_budgets_are_neither_written_together_nor_read(tmp_path):
    # write_tuned compared the written rows with the kept ones only: two new rows of 20 and 3 trials made one file,
    # and a file mixing budgets (hand-edited, merged) was read and applied by compare as one tuning
    fewer = dataclasses.replace(_entry(), trials=3)
    with pytest.raises(ValueError, match=r"the row 'softmax' is tuned with another budget than the row 'kep_svgp' "
                       r"beside it: trials 20 \(theirs 3\)"):  # fmt: skip
        write_tuned("digits", {"softmax": _entry(), "kep_svgp": fewer}, tmp_path)
    assert not tuned_path("digits", tmp_path).exists()
    rows = {"softmax": _entry().to_dict(), "kep_svgp": fewer.to_dict()}
    tuned_path("digits", tmp_path).write_text(json.dumps({"format": 1, "task": "digits", "rows": rows}))
    with pytest.raises(ValueError, match=r"digits\.json: the row 'softmax' is tuned with another budget"):
        CompareConfig(attentions=("softmax",), tasks=("digits",), tuned_dir=str(tmp_path))
    write_tuned("digits", {"softmax": fewer, "kep_svgp": fewer}, tmp_path / "same")  # one budget: written
    assert {entry.trials for entry in read_tuned("digits", tmp_path / "same").values()} == {3}


def test_a_tuned_file_is_read_as_utf8_whatever_the_locale(tmp_path, monkeypatch) -> None:
    """A tuned file edited by hand with a non-ASCII label (raw UTF-8, not a JSON escape) is read as written also where
    the locale's encoding is ASCII (where it was refused as undecodable)."""
    import io

    path = write_tuned("digits", {"softmax": _entry()}, tmp_path)
    content = json.loads(path.read_text(encoding="utf-8"))
    content["rows"]["softmax"]["study"]["label"] = "σ-run"
    path.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: encoding or "ascii")  # an ASCII locale
    assert read_tuned("digits", tmp_path)["softmax"].study["label"] == "σ-run"
