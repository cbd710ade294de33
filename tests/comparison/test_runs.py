"""The runs of the comparison and ``gpattn compare`` (smoke-sized: the full run is the main job), including a new
attention registered from outside the package."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.attention import AttentionLayer, SoftmaxAttention, attention_names, register_attention, unregister_attention
from gpattn.cli import main
from gpattn.comparison import (
    CompareConfig,
    RunRecord,
    build_model,
    layer_arguments,
    learned_spectra,
    load_task,
    make_train_config,
    plan_runs,
    read_records,
    run_comparison,
    train_and_evaluate,
)
from gpattn.comparison.evaluation import evaluate_models, evaluate_run
from gpattn.comparison.tuned_configuration import tuned_path
from gpattn.methods import MethodSpec, TrainingRecipe, get_method, method_names, register_method, unregister_method
from gpattn.models import LastLayerLaplace
from gpattn.training import train_ensemble

# the shared settings: these tests check how runs are made and recorded at one epoch (a tuned configuration, e.g.
# digits', fixes its own epochs and architecture)
TINY = dict(pointer_epochs=1, digits_epochs=1, eval_samples=2, seeds=(0,), progress=False, tuned=False)
BOTH = ("pointer", "digits")


def _model(config: CompareConfig, row: str, num_classes: int, model_kwargs: dict, task: str = "digits"):
    """The model of a run of ``row`` on ``task`` (as :func:`train_and_evaluate` builds it)."""
    method = get_method(row)
    return build_model(method, config.hyperparameters(task, method), num_classes, model_kwargs)


@pytest.fixture(scope="module")
def records() -> list[RunRecord]:
    return run_comparison(CompareConfig(attentions=("kep_svgp", "softmax"), tasks=BOTH, **TINY))


def test_one_record_per_task_attention_seed(records) -> None:
    assert [(r.task, r.attention, r.seed) for r in records] == [
        ("pointer", "kep_svgp", 0),
        ("pointer", "softmax", 0),
        ("digits", "kep_svgp", 0),
        ("digits", "softmax", 0),
    ]
    for record in records:
        test = asdict(record.metrics.test)
        expected = {"accuracy", "confidence", "nll", "ece", "mce", "brier", "aurc", "eaurc", "auroc", "fpr95"}
        expected.update({"classwise_ece", "debiased_ce", "sweep_ece"})
        assert set(test) == expected
        assert 0.0 <= test["accuracy"] <= 1.0 and test["nll"] > 0
        reliability = record.reliability
        assert sum(reliability.count) == (512 if record.task == "pointer" else 361)
        # the mean confidence is the count-weighted mean of the reliability bins' confidences
        weighted = sum(c * n for c, n in zip(reliability.confidence, reliability.count, strict=True) if n)
        assert test["confidence"] == pytest.approx(weighted / sum(reliability.count), rel=1e-6)


def test_digits_records_hold_shift_ood_and_spectra(records) -> None:
    digits = [r for r in records if r.task == "digits"]
    for record in digits:
        shift = record.metrics.shift
        assert set(shift) == {"gaussian_noise", "rotation", "blur"}
        assert all(set(levels) == {"1", "2", "3", "4", "5"} for levels in shift.values())
        assert list(record.metrics.ood) == ["held_out", "noise", "pooled"]
        ood = record.metrics.ood["held_out"]
        # the stored AUROC is the metric of the stored scores (max probability), recomputed independently here
        scores_in, scores_out = record.ood_scores["in"], record.ood_scores["held_out"]
        pairs = [(a > b) + 0.5 * (a == b) for a in scores_in for b in scores_out]
        assert ood.auroc_max_prob == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    kep = next(r for r in digits if r.attention == "kep_svgp")
    assert len(kep.spectra["layer_2"]) == 2 and len(kep.spectra["layer_2"][0]) == 10  # 2 heads, s = min(10, p = 16)
    assert next(r for r in digits if r.attention == "softmax").spectra == {}
    assert all(r.metrics.shift == {} and r.ood_scores == {} for r in records if r.task == "pointer")


def test_same_config_same_numbers(records) -> None:
    again = run_comparison(CompareConfig(attentions=("kep_svgp", "softmax"), tasks=BOTH, **TINY))
    assert [r.metrics for r in again] == [r.metrics for r in records]


def test_ece_agrees_with_the_stored_reliability_bins(records) -> None:
    # ECE = sum_b (n_b / n) |acc_b - conf_b|, recomputed from the reliability data stored beside it
    for record in records:
        bins = record.reliability
        total = sum(bins.count)
        gaps = [
            count / total * abs(accuracy - confidence)
            for count, accuracy, confidence in zip(bins.count, bins.accuracy, bins.confidence, strict=True)
            if count
        ]
        assert record.metrics.test.ece == pytest.approx(sum(gaps), abs=1e-12)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="expected attentions"):
        CompareConfig(attentions=("nope",))
    with pytest.raises(ValueError, match="expected tasks"):
        CompareConfig(tasks=("cifar",))
    with pytest.raises(ValueError, match="distinct seeds"):
        CompareConfig(seeds=(1, 1))
    with pytest.raises(ValueError, match="mc_dropout"):
        CompareConfig(mc_dropout=0.0)
    with pytest.raises(ValueError, match="ece_bins"):
        CompareConfig(ece_bins=0)


def test_cli_compare_writes_the_run_folder(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "compare",
            "--out",
            str(out),
            "--attentions",
            "softmax",
            "primal",
            "--tasks",
            "pointer",
            "digits",
            "--seeds",
            "0",
            "--pointer-epochs",
            "1",
            "--digits-epochs",
            "1",
            "--eval-samples",
            "2",
            "--no-progress",
            "--untuned",  # one epoch: digits' tuned configurations fix their own
        ]
    )
    assert code == 0
    names = {path.name for path in out.iterdir()}
    assert {
        "results.json",
        "results.csv",
        "table.md",
        "reliability_digits.png",
        "shift_digits.png",
        "ood_histograms_digits.png",
    } <= names
    assert "spectra.png" in names  # primal has learned singular values
    saved = json.loads((out / "results.json").read_text(), parse_constant=_refuse)  # strict JSON: no NaN token
    assert saved["config"]["attentions"] == ["softmax", "primal"] and len(saved["records"]) == 4
    with (out / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 8  # each run and its +ts row
    assert "### pointer" in (printed := capsys.readouterr().out) and "| primal | 1 |" in printed


def _refuse(token: str) -> float:
    raise ValueError(f"results.json is not strict JSON: {token}")


def test_the_protocol_presets_plan_the_declared_grid() -> None:
    """make main: the primary pair on MNIST-1D, seeds 0-6 (a subset of the endpoint's 10); --full: every main-table row
    on both tasks, seeds 0-4, and 5-9 for the primary pair (the rows of the primary endpoint, without their +ts
    suffix)."""
    from gpattn.comparison import MAIN_TABLE_ROWS, PRIMARY_ROWS

    assert PRIMARY_ROWS == ("kep_svgp", "softmax")  # derived from the declared primary endpoint
    main_runs = plan_runs(CompareConfig.main())
    assert main_runs == [("mnist1d", row, seed) for row in PRIMARY_ROWS for seed in range(7)]
    full_runs = plan_runs(CompareConfig.full())
    expected = [
        (task, row, seed)
        for task in ("mnist1d", "digits")
        for row in MAIN_TABLE_ROWS
        for seed in range(10 if row in PRIMARY_ROWS else 5)
    ]
    assert full_runs == expected and len(full_runs) == 2 * (2 * 10 + 7 * 5)
    assert CompareConfig.full(tasks=("digits",)).tasks == ("digits",)  # options override a preset
    with pytest.raises(ValueError, match="none of them among seeds"):
        CompareConfig(seeds=(0, 1), primary_seeds=(1, 2))
    with pytest.raises(ValueError, match="primary_seeds"):
        CompareConfig(primary_seeds=(-1,))


def test_a_run_trains_as_its_tuning_trials_did() -> None:
    """A tuned configuration's early stopping and KL-annealing fraction reach the run's TrainConfig (the trials were
    scored under them); the shared settings train every epoch with the row's own annealing (SGPA: half the run)."""
    from gpattn.comparison.tasks import TASK_DEFAULTS

    method = get_method("sgpa")
    shared = CompareConfig(tuned=False).hyperparameters("mnist1d", method, TASK_DEFAULTS["mnist1d"])
    untuned = make_train_config(CompareConfig(), method, shared, seed=3)
    assert untuned.patience is None and untuned.epochs == 60
    assert untuned.kl_anneal_epochs == pytest.approx(method.recipe.kl_anneal_fraction * 60)
    tuned = make_train_config(CompareConfig(), method, shared.updated({"patience": 15, "kl_anneal_fraction": 0.25}), 3)
    assert tuned.patience == 15 and tuned.kl_anneal_epochs == pytest.approx(15.0) and tuned.seed == 3
    assert not tuned.mc_dropout  # validated in eval mode, as it is tested
    # the MC-dropout row is validated (selected, stopped early, tuned) on its MC-dropout predictive
    dropout_row = get_method("softmax_mc_dropout")
    dropout_shared = CompareConfig(tuned=False).hyperparameters("mnist1d", dropout_row, TASK_DEFAULTS["mnist1d"])
    assert make_train_config(CompareConfig(), dropout_row, dropout_shared, seed=3).mc_dropout
    assert not make_train_config(CompareConfig(), get_method("softmax"), dropout_shared, seed=3).mc_dropout


def test_cli_compare_rejects_bad_values(capsys) -> None:
    assert main(["compare", "--seeds", "1", "1", "--no-progress"]) == 2
    assert "distinct seeds" in capsys.readouterr().err


def test_cli_train_resume_after_an_interruption_gives_the_same_numbers(tmp_path, faulty_elbo, capsys) -> None:
    arguments = ["train", "--task", "digits", "--attention", "kep_svgp", "--epochs", "4", "--eval-samples", "2"]
    arguments.append("--untuned")  # the shared settings and 4 epochs (a tuned row refuses --epochs)
    assert main([*arguments, "--out", str(tmp_path / "full")]) == 0
    full = json.loads((tmp_path / "full" / "record.json").read_text())

    faulty_elbo.interrupt_at = 30  # digits: 866 images / 64 = 14 steps per epoch, so this is inside epoch 3
    assert main([*arguments, "--out", str(tmp_path / "cut")]) == 130  # Ctrl-C: one line, exit status 130
    checkpoints = tmp_path / "cut" / "checkpoints"
    assert capsys.readouterr().err.endswith(  # what was kept, and how to go on
        f"gpattn train: interrupted; the checkpoints of epoch 2 of 4 are kept in {checkpoints}; the same command with "
        "--resume continues\n"
    )
    faulty_elbo.interrupt_at = None
    assert not (tmp_path / "cut" / "record.json").exists()
    assert main([*arguments, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    resumed = json.loads((tmp_path / "cut" / "record.json").read_text())
    assert resumed["metrics"] == full["metrics"]
    assert resumed["spectra"] == full["spectra"]
    assert RunRecord.from_dict(resumed).train.best_epoch == RunRecord.from_dict(full).train.best_epoch


def test_cli_train_of_a_tuned_row_refuses_the_options_its_configuration_sets(tmp_path, faulty_elbo, capsys) -> None:
    """A (task, attention) with a tuned configuration trains with it, as in gpattn compare: --epochs, which it sets,
    is refused with one line (nothing written) instead of being ignored; --untuned trains with the shared settings and
    --epochs; an interrupted tuned run counts its epochs against the tuned configuration's."""
    tuned = json.loads(Path(tuned_path("digits")).read_text())["rows"]["softmax"]["hyperparameters"]
    arguments = ["train", "--task", "digits", "--attention", "softmax", "--eval-samples", "2", "--no-progress"]
    assert main([*arguments, "--epochs", "2", "--out", str(tmp_path / "refused")]) == 2
    assert capsys.readouterr().err == (
        f"gpattn train: error: softmax on digits trains with its tuned configuration of {tuned_path('digits')}, which "
        f"sets epochs {tuned['epochs']}: --epochs 2 would be ignored; add --untuned to train with the shared settings "
        "and these options\n"
    )
    assert not (tmp_path / "refused").exists()
    assert main([*arguments, "--epochs", "2", "--untuned", "--out", str(tmp_path / "shared")]) == 0
    record = json.loads((tmp_path / "shared" / "record.json").read_text())
    assert record["tuned"] is False and record["train"]["epochs"] == 2 and record["hyperparameters"]["epochs"] == 2
    faulty_elbo.interrupt_at = 30  # 866 images / 64 = 14 steps per epoch: inside epoch 3
    # the tuned value itself is accepted (it changes nothing)
    assert main([*arguments, "--epochs", str(tuned["epochs"]), "--out", str(tmp_path / "tuned")]) == 130
    assert f"the checkpoints of epoch 2 of {tuned['epochs']} are kept in" in capsys.readouterr().err


def test_cli_train_resume_of_a_tuned_run_started_with_an_ignored_epochs(tmp_path, faulty_elbo, capsys, monkeypatch):
    """A tuned run started before --epochs was refused stored the ignored value in run.json; the same command with
    --resume continues it (the run is checked against its stored settings, not refused as a new one)."""
    import gpattn.cli.train as train_command

    arguments = ["train", "--task", "digits", "--attention", "softmax", "--eval-samples", "2", "--no-progress"]
    arguments += ["--epochs", "3", "--out", str(tmp_path / "t")]
    with monkeypatch.context() as patch:  # the code before: no refusal
        patch.setattr(train_command, "_check_tuned_options", lambda config, args: None)
        faulty_elbo.interrupt_at = 30  # inside epoch 3
        assert main(arguments) == 130
    assert json.loads((tmp_path / "t" / "run.json").read_text())["settings"]["digits_epochs"] == 3
    capsys.readouterr()
    assert main(arguments) == 2  # a new run with that value is refused
    faulty_elbo.interrupt_at = 30  # the resumed run stops again, two epochs further: it was accepted
    assert main([*arguments, "--resume"]) == 130
    assert "the checkpoints of epoch 4 of 100 are kept in" in capsys.readouterr().err


def test_cli_train_resume_without_checkpoint_is_an_error(tmp_path, capsys) -> None:
    assert main(["train", "--task", "pointer", "--out", str(tmp_path), "--resume"]) == 2
    assert "--resume needs" in capsys.readouterr().err


def test_ensemble_record_averages_member_probabilities() -> None:
    config = CompareConfig(attentions=("softmax",), tasks=("digits",), **TINY)
    data = load_task("digits")
    members = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        members.append(_model(config, "softmax", data.num_classes, data.model_kwargs).eval())
    metrics, _, _ = evaluate_run(members, data, num_samples=2)
    with torch.no_grad():  # softmax attention is deterministic: the ensemble is the mean of the members' softmax
        probabilities = torch.stack([m(data.test.images).softmax(-1) for m in members]).mean(0).double()
    picked = probabilities.gather(1, data.test.labels.unsqueeze(1)).squeeze(1)
    assert metrics.test.nll == pytest.approx(-picked.log().mean().item(), rel=1e-6)
    expected_accuracy = (probabilities.argmax(-1) == data.test.labels).double().mean().item()
    assert metrics.test.accuracy == pytest.approx(expected_accuracy, abs=1e-12)


def test_compare_with_ensembles_names_and_sizes_the_records() -> None:
    single = run_comparison(CompareConfig(attentions=("softmax",), tasks=("pointer",), **TINY))[0]
    ensemble = run_comparison(CompareConfig(attentions=("softmax",), tasks=("pointer",), ensemble=2, **TINY))[0]
    assert ensemble.attention == "softmax_ens2" and ensemble.train.ensemble == 2
    assert ensemble.train.num_parameters == 2 * single.train.num_parameters
    with pytest.raises(ValueError, match="ensemble size"):
        CompareConfig(ensemble=0)


# -- the runner's contract -------------------------------------------------------------------------------------------
def test_a_run_depends_on_its_arguments_only() -> None:
    config = CompareConfig(attentions=("kep_svgp",), tasks=("pointer",), **TINY)
    torch.manual_seed(123)
    first = train_and_evaluate(config, "pointer", "kep_svgp", 3)
    torch.manual_seed(456)  # another global RNG state before the call
    second = train_and_evaluate(config, "pointer", "kep_svgp", 3)
    assert first.metrics == second.metrics and first.spectra == second.spectra
    assert first.train.best_epoch == second.train.best_epoch


def test_size_arguments_come_from_the_registry() -> None:
    config = CompareConfig(num_inducing=8, ksvd_weight=0.5, attentions=method_names())
    state = torch.get_rng_state()
    plan_runs(config)  # every layer is built once to check the size ...
    assert torch.equal(torch.get_rng_state(), state)  # ... without touching the caller's RNG
    assert config.attention_arguments("softmax") == {}
    assert config.attention_arguments("sgpa") == {"num_inducing": 8}
    assert config.attention_arguments("kep_svgp") == {"num_inducing": 8, "ksvd_weight": 0.5}
    default = CompareConfig()
    assert default.num_inducing is None and default.attention_arguments("sgpa") == {}  # the layer's own default
    method = get_method("kep_svgp")  # a run's arguments: the same, from its hyperparameters
    # (on the pointer task, which has no tuned file: a tuned configuration brings its own KSVD weight)
    assert layer_arguments(method, config.hyperparameters("pointer", method)) == config.attention_arguments("kep_svgp")
    model = _model(config, "sgpa", 2, {"input": "tokens", "vocab_size": 5, "max_len": 4})
    assert model.attention_layers()[-1].num_inducing == 8


def test_learned_spectra_are_the_layers_singular_values_in_descending_order() -> None:
    torch.manual_seed(0)
    config = CompareConfig(attentions=("primal",), num_inducing=4, **TINY)
    model = _model(config, "primal", 2, {"input": "tokens", "vocab_size": 5, "max_len": 4})
    spectra = learned_spectra(model)
    assert list(spectra) == ["layer_2"]  # the first block is softmax attention, without a spectrum
    values = model.attention_layers()[1].features.singular_values.detach()
    assert spectra["layer_2"] == [sorted(head.tolist(), reverse=True) for head in values]


# -- a new attention is one file plus one registry line ---------------------------------------------------------------
class UniformAttention(AttentionLayer):
    """Every query attends uniformly to the real keys; a learned per-head "spectrum" of ``num_inducing`` values stands
    in for the KSVD singular values. Defined here, outside the package, and registered by the fixture below."""

    supports_causal = False

    def __init__(self, embed_dim: int, num_heads: int, num_inducing: int = 3, dropout: float = 0.0):
        super().__init__(embed_dim, num_heads, dropout)
        self.num_inducing = num_inducing
        self.v_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.spectrum = torch.nn.Parameter(torch.linspace(1.0, 2.0, num_inducing).repeat(num_heads, 1))

    def forward(self, x: Tensor, mask=None, context=None) -> Tensor:
        inputs = self._prepare(x, mask, context)
        values = self.v_proj(inputs.keys)  # shape: (B, M, C)
        weights = torch.ones(values.shape[:2], dtype=values.dtype, device=values.device)
        if inputs.key_mask is not None:
            weights = weights * inputs.key_mask
        pooled = (weights.unsqueeze(-1) * values).sum(1, keepdim=True) / weights.sum(1)[:, None, None]
        scale = self.spectrum.mean()  # so that the spectrum is learned
        return self.dropout(self.out_proj(scale * pooled.expand(-1, inputs.queries.shape[1], -1)))

    def learned_spectrum(self) -> Tensor:
        return self.spectrum.detach()


@pytest.fixture
def uniform_attention():
    register_attention("uniform", UniformAttention)  # the one registry line
    yield "uniform"
    unregister_attention("uniform")


def test_a_registered_attention_runs_through_gpattn_compare(uniform_attention, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["compare", "--quick", "--attentions", uniform_attention, "--tasks", "pointer", "--num-inducing", "5"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| uniform | 1 |" in printed and (out / "table.md").read_text() in printed
    saved = json.loads((out / "results.json").read_text(), parse_constant=_refuse)  # strict JSON: no NaN token
    assert saved["config"]["attentions"] == ["uniform"] and saved["config"]["num_inducing"] == 5
    (record,) = read_records(out / "results.json")
    assert (record.task, record.attention, record.seed) == ("pointer", "uniform", 0)
    assert 0.0 <= record.metrics.test.accuracy <= 1.0 and record.train.epochs == 2
    assert record.train.epochs_trained == 2.0  # no early stopping in --quick: every epoch
    # the size argument reached the layer: 2 heads of 5 values, learned, in descending order
    assert [len(head) for head in record.spectra["layer_2"]] == [5, 5]
    assert all(head == sorted(head, reverse=True) for head in record.spectra["layer_2"])
    assert record.spectra["layer_2"][0] != [2.0, 1.75, 1.5, 1.25, 1.0]
    for name in ("reliability_pointer.png", "spectra.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 10_000


# -- the baselines' rows (the table's statistics: tests/comparison/test_report.py) -------------------------------------
def test_mc_dropout_row_trains_softmax_with_dropout_and_samples_it() -> None:
    config = CompareConfig(attentions=("softmax_mc_dropout",), tasks=("digits",), mc_dropout=0.2, **TINY)
    data = load_task("digits")
    model = _model(config, "softmax_mc_dropout", data.num_classes, data.model_kwargs)
    rates = {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)}
    assert rates == {0.2} and all(isinstance(layer, SoftmaxAttention) for layer in model.attention_layers())
    record = train_and_evaluate(config, "digits", "softmax_mc_dropout", 0, data=data)
    assert record.attention == "softmax_mc_dropout" and record.temperature_scaled is not None
    # evaluated with dropout on: another Monte Carlo seed gives other probabilities
    again = train_and_evaluate(
        dataclasses.replace(config, eval_samples=3), "digits", "softmax_mc_dropout", 0, data=data
    )
    assert again.metrics.test.nll != record.metrics.test.nll
    assert "softmax_mc_dropout" in method_names() and "softmax_mc_dropout" not in attention_names()


def test_ksvd_rows_record_their_fidelity_and_mnist1d_uses_rank_5() -> None:
    from gpattn.comparison.tasks import TaskData

    digits = load_task("digits")
    small = TaskData("digits", digits.train, digits.val, digits.test, digits.model_kwargs, defaults={"num_inducing": 5})
    config = CompareConfig(attentions=("kep_svgp",), fidelity_sequences=16, tasks=("digits",), **TINY)
    record = train_and_evaluate(config, "digits", "kep_svgp", 0, data=small)
    assert [len(head) for head in record.spectra["layer_2"]] == [5, 5]  # the task's rank reached the layer
    fidelity = record.fidelity["layer_2"]
    # trained, initial and chance-level fields (each one: tests/comparison/test_fidelity.py)
    assert {"relative_objective", "kernel_error", "initial_kernel_error", "random_left_cosine"} <= set(fidelity)
    assert all(len(heads) == 2 for heads in fidelity.values())
    assert all(0.0 < value <= 1.0 + 1e-9 for value in fidelity["energy"])
    assert train_and_evaluate(config, "digits", "softmax", 0, data=small).fidelity == {}


def test_a_record_holds_its_hyperparameters_and_every_test_example(records) -> None:
    config = CompareConfig(attentions=("kep_svgp", "softmax"), tasks=BOTH, **TINY)
    for record in records:
        method = get_method(record.attention)
        expected = config.hyperparameters(record.task, method, load_task(record.task).defaults)
        assert record.hyperparameters == expected.to_dict() and record.tuned is False
        assert record.hyperparameters["epochs"] == 1 and record.train.epochs == 1
        for variant in (record, record.temperature_scaled):
            examples = variant.per_example
            assert [len(values) for values in examples.values()] == [len(load_task(record.task).test)] * 3
            assert float(np.mean(examples["test_nll"])) == variant.metrics.test.nll  # exactly, also read back:
        again = RunRecord.from_dict(json.loads(json.dumps(record.to_dict())))
        assert float(np.mean(again.per_example["test_nll"])) == record.metrics.test.nll


def test_a_run_reads_the_data_of_its_own_seed() -> None:
    config = CompareConfig(attentions=("softmax",), tasks=("digits",), **TINY)
    with pytest.raises(ValueError, match=r"validation seed 0, but the run is 'digits' with seed 1; load them with"):
        train_and_evaluate(config, "digits", "softmax", 1, data=load_task("digits", 0))
    with pytest.raises(ValueError, match=r"task 'pointer'"):
        train_and_evaluate(config, "digits", "softmax", 0, data=load_task("pointer", 0))


def test_the_laplace_row_is_the_softmax_model_with_a_laplace_predictive() -> None:
    config = CompareConfig(attentions=("laplace", "softmax"), tasks=("digits",), **{**TINY, "digits_epochs": 3})
    data = load_task("digits")
    laplace = train_and_evaluate(config, "digits", "laplace", 0, data=data)
    softmax = train_and_evaluate(config, "digits", "softmax", 0, data=data)
    assert (laplace.attention, laplace.hyperparameters) == ("laplace", softmax.hyperparameters)
    assert laplace.train.best_epoch == softmax.train.best_epoch  # the same trained Transformer ...
    # ... with a last-layer Laplace fitted on the training split, evaluated on the run's streams: by hand
    method = get_method("softmax")
    hyperparameters = config.hyperparameters("digits", method, data.defaults)
    train_config = make_train_config(config, method, hyperparameters, 0)
    ((model, _),) = train_ensemble(
        lambda k: build_model(method, hyperparameters, data.num_classes, data.model_kwargs),
        data.train,
        data.val,
        train_config,
        1,
    )
    predictor = LastLayerLaplace(model).fit(data.train.images, data.train.labels)
    expected = evaluate_models(predictor, data, config.eval_samples, seed=0)
    assert (
        laplace.metrics == expected.metrics
        and laplace.temperature_scaled.metrics == expected.temperature_scaled.metrics
    )
    assert evaluate_models(model, data, config.eval_samples, seed=0).metrics == softmax.metrics
    # its Monte Carlo samples vary: the mutual information is defined (NaN for the deterministic softmax row)
    assert all(0.0 < ood.auroc_mutual_information < 1.0 for ood in laplace.metrics.ood.values())
    assert all(math.isnan(ood.auroc_mutual_information) for ood in softmax.metrics.ood.values())
    assert laplace.metrics.test.nll != softmax.metrics.test.nll


def test_every_row_of_the_main_table_runs_through_gpattn_compare(tmp_path) -> None:
    rows = ["softmax", "softmax_mc_dropout", "deep_ensemble", "laplace", "sgpa", "kep_svgp", "kep_svgp_paper",
            "primal", "primal_paper"]  # fmt: skip
    argv = ["compare", "--quick", "--tasks", "pointer", "--pointer-epochs", "1", "--eval-samples", "2"]
    assert main([*argv, "--attentions", *rows, "--no-progress", "--out", str(tmp_path)]) == 0
    records = read_records(tmp_path / "results.json")
    assert [record.attention for record in records] == rows
    assert [record.temperature_scaled is None for record in records] == [row == "deep_ensemble" for row in rows]
    assert all(0.0 <= record.metrics.test.accuracy <= 1.0 and record.hyperparameters for record in records)


def test_each_run_trains_with_its_rows_kl_recipe():
    """SGPA anneals its KL over the first half of the run (its official recipe); the other rows do not."""
    rows = ("sgpa", "kep_svgp", "softmax_mc_dropout")  # the shared settings (digits' tuned file has its own)
    config = CompareConfig(tasks=("digits",), attentions=rows, seeds=(0,), tuned=False)

    def anneal_epochs(row: str) -> float:
        method = get_method(row)
        return make_train_config(config, method, config.hyperparameters("digits", method), 0).kl_anneal_epochs

    assert anneal_epochs("sgpa") == 0.5 * config.digits_epochs
    for row in ("kep_svgp", "softmax_mc_dropout"):
        assert anneal_epochs(row) == 0.0


# -- rows as data: a registered row, Deep Ensembles --------------------------------------------------------------------
def test_a_registered_row_runs_with_its_own_arguments_and_recipe(tmp_path, capsys) -> None:
    register_method(MethodSpec("kep_s4", "kep_svgp", {"num_inducing": 4}, recipe=TrainingRecipe(0.5)))
    try:
        argv = ["compare", "--quick", "--attentions", "kep_s4", "--tasks", "pointer", "--pointer-epochs", "1"]
        assert main([*argv, "--eval-samples", "2", "--no-progress", "--out", str(tmp_path)]) == 0
        (record,) = read_records(tmp_path / "results.json")
        assert record.attention == "kep_s4" and [len(head) for head in record.spectra["layer_2"]] == [4, 4]
        config = CompareConfig(attentions=("kep_s4",), num_inducing=8)  # the row's own size wins over the shared one
        method = get_method("kep_s4")
        assert layer_arguments(method, config.hyperparameters("pointer", method))["num_inducing"] == 4
        assert make_train_config(config, method, config.hyperparameters("pointer", method), 0).kl_anneal_epochs == 4.0
    finally:
        unregister_method("kep_s4")


def test_deep_ensemble_row_is_five_softmax_members_without_a_ts_row() -> None:
    config = CompareConfig(attentions=("deep_ensemble",), tasks=("pointer",), **TINY)
    data = load_task("pointer")
    record = train_and_evaluate(config, "pointer", "deep_ensemble", 0, data=data)
    assert record.attention == "deep_ensemble" and record.train.ensemble == 5 and record.temperature_scaled is None
    # the same five members (seeds 5 s + k) as softmax with --ensemble 5, which also adds the +ts variant
    ensemble = dataclasses.replace(config, attentions=("softmax",), ensemble=5)
    same = train_and_evaluate(ensemble, "pointer", "softmax", 0, data=data)
    assert same.attention == "softmax_ens5" and same.temperature_scaled is not None
    assert record.metrics == same.metrics and record.train.num_parameters == same.train.num_parameters
    single = train_and_evaluate(
        dataclasses.replace(config, attentions=("softmax",)), "pointer", "softmax", 0, data=data
    )
    assert record.train.num_parameters == 5 * single.train.num_parameters
