"""The runs of the comparison and ``gpattn compare`` (smoke-sized: the full run is the main job), including a new
attention registered from outside the package."""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import asdict

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
from gpattn.comparison.evaluation import evaluate_run
from gpattn.comparison.report import flat_rows, markdown_table
from gpattn.methods import MethodSpec, TrainingRecipe, get_method, method_names, register_method, unregister_method

TINY = dict(pointer_epochs=1, digits_epochs=1, eval_samples=2, seeds=(0,), progress=False)
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
        expected.add("classwise_ece")
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
        assert set(record.metrics.ood) == {"held_out", "noise"}
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


def test_table_and_rows(records) -> None:
    rows = flat_rows(records)
    assert rows[0]["test_accuracy"] == records[0].metrics.test.accuracy
    assert rows[4]["shift_accuracy"] == pytest.approx(  # rows: every run followed by its +ts row
        sum(v.accuracy for kind in records[2].metrics.shift.values() for v in kind.values()) / 15
    )
    table = markdown_table(records)
    main_table = table.split("Paired differences")[0]
    assert main_table.count("\n| digits |") == 4 and "ood_held_out_auroc" in table  # two rows and their +ts rows
    assert table.split("Paired differences")[1].count("\n| digits |") == 3  # kep_svgp against the three others
    percent = f"| {100 * records[0].metrics.test.accuracy:.2f} (n=1) |"  # one seed: the value and n, no "± 0.00"
    assert percent in table and "±" not in main_table.split("\n\n")[0]
    # the +ts row of each run follows it, with the fitted temperature
    assert rows[1]["attention"] == "kep_svgp+ts" and rows[1]["temperature"] == records[0].temperature_scaled.temperature
    assert rows[1]["test_nll"] == records[0].temperature_scaled.metrics.test.nll


def test_table_shows_n_for_every_mean_and_std(records) -> None:
    import dataclasses

    first = records[0]
    second = dataclasses.replace(first, seed=1)
    undefined = dataclasses.replace(first.metrics.test, auroc=float("nan"))
    third = dataclasses.replace(first, seed=2, metrics=dataclasses.replace(first.metrics, test=undefined))
    lines = markdown_table([first, second, third]).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| {first.task} | {first.attention} |"))
    cells = dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")), strict=True))
    accuracy = 100 * first.metrics.test.accuracy
    assert cells["accuracy"] == f"{accuracy:.2f} ± 0.00 (n=3)"  # three equal values: a real zero spread, with its n
    assert cells["auroc"] == f"{100 * first.metrics.test.auroc:.2f} ± 0.00 (n=2)"  # undefined on one of three seeds


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
        ]
    )
    assert code == 0
    names = {path.name for path in out.iterdir()}
    assert {
        "results.json",
        "results.csv",
        "table.md",
        "reliability_digits.png",
        "shift.png",
        "ood_histograms.png",
    } <= names
    assert "spectra.png" in names  # primal has learned singular values
    saved = json.loads((out / "results.json").read_text(), parse_constant=_refuse)  # strict JSON: no NaN token
    assert saved["config"]["attentions"] == ["softmax", "primal"] and len(saved["records"]) == 4
    with (out / "results.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 8  # each run and its +ts row
    assert "| pointer | primal |" in capsys.readouterr().out


def _refuse(token: str) -> float:
    raise ValueError(f"results.json is not strict JSON: {token}")


def test_cli_compare_rejects_bad_values(capsys) -> None:
    assert main(["compare", "--seeds", "1", "1", "--no-progress"]) == 2
    assert "distinct seeds" in capsys.readouterr().err


def test_cli_train_resume_after_an_interruption_gives_the_same_numbers(tmp_path, faulty_elbo, capsys) -> None:
    arguments = ["train", "--task", "digits", "--attention", "kep_svgp", "--epochs", "4", "--eval-samples", "2"]
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
    assert layer_arguments(method, config.hyperparameters("digits", method)) == config.attention_arguments("kep_svgp")
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
    assert "| pointer | uniform |" in printed and (out / "table.md").read_text() in printed
    saved = json.loads((out / "results.json").read_text(), parse_constant=_refuse)  # strict JSON: no NaN token
    assert saved["config"]["attentions"] == ["uniform"] and saved["config"]["num_inducing"] == 5
    (record,) = read_records(out / "results.json")
    assert (record.task, record.attention, record.seed) == ("pointer", "uniform", 0)
    assert 0.0 <= record.metrics.test.accuracy <= 1.0 and record.train.epochs == 2
    # the size argument reached the layer: 2 heads of 5 values, learned, in descending order
    assert [len(head) for head in record.spectra["layer_2"]] == [5, 5]
    assert all(head == sorted(head, reverse=True) for head in record.spectra["layer_2"])
    assert record.spectra["layer_2"][0] != [2.0, 1.75, 1.5, 1.25, 1.0]
    for name in ("reliability_pointer.png", "spectra.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 10_000


# -- the table's statistics, the baselines' rows ----------------------------------------------------------------------
def test_format_difference_is_the_paired_t_interval() -> None:
    from scipy import stats

    from gpattn.comparison.report import format_difference

    reference = {0: 0.90, 1: 0.85, 2: 0.88, 3: 0.91, 4: 0.87}
    other = {0: 0.80, 1: 0.82, 2: 0.79, 3: 0.85, 4: 0.81}
    differences = [reference[s] - other[s] for s in reference]
    interval = stats.ttest_rel(list(reference.values()), list(other.values())).confidence_interval(0.95)
    mean = sum(differences) / 5
    assert format_difference(reference, other, True) == (
        f"{100 * mean:+.2f} [{100 * interval.low:+.2f}, {100 * interval.high:+.2f}] *"
    )
    noisy = {0: 0.95, 1: 0.70, 2: 0.90, 3: 0.80, 4: 0.90}  # differences of both signs: not significant
    assert not format_difference(reference, noisy, True).endswith("*")
    four = {seed: value for seed, value in reference.items() if seed < 4}
    assert format_difference(four, other, False).endswith("(n = 4 < 5, no interval)")
    assert format_difference({7: 1.0}, other, False) == "-"


def test_table_has_published_numbers_and_paired_differences() -> None:
    def record(attention: str, seed: int, accuracy: float) -> RunRecord:
        test = dict(accuracy=accuracy, confidence=0.8, nll=0.5, ece=0.1, mce=0.2, brier=0.3, aurc=0.1, eaurc=0.05,
                    auroc=0.7, fpr95=0.5, classwise_ece=0.02)  # fmt: skip
        return RunRecord.from_dict({"task": "mnist1d", "attention": attention, "seed": seed, "metrics": {"test": test}})

    records = [record(name, seed, 0.8 + 0.01 * seed + (0.05 if name == "kep_svgp" else 0.0))
               for name in ("kep_svgp", "softmax") for seed in range(5)]  # fmt: skip
    table = markdown_table(records)
    assert "| mnist1d | CNN | 94 |" in table and "| mnist1d | human | 96 |" in table
    assert "Published reference numbers" in table and "not measured here" in table
    # kep_svgp is 5 points better on every seed: the difference +5.00 with a zero-width interval, significant
    assert "| mnist1d | softmax | 5 | +5.00 [+5.00, +5.00] * |" in table
    assert "| mnist1d | kep_svgp | 5 | 87.00 ± 1.58 (n=5) |" in table
    short = markdown_table(records[:3] + records[5:8])
    assert "(n = 3 < 5, no interval)" in short and "[+" not in short


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
    small = TaskData("mnist1d", digits.train, digits.val, digits.test, digits.model_kwargs, num_inducing=5)
    config = CompareConfig(attentions=("kep_svgp",), fidelity_sequences=16, tasks=("digits",), **TINY)
    record = train_and_evaluate(config, "digits", "kep_svgp", 0, data=small)
    assert [len(head) for head in record.spectra["layer_2"]] == [5, 5]  # the task's rank reached the layer
    fidelity = record.fidelity["layer_2"]
    assert set(fidelity) == {"relative_objective", "left_cosine", "right_cosine", "max_angle",
                             "singular_value_error", "energy"}  # fmt: skip
    assert all(len(heads) == 2 for heads in fidelity.values())
    assert all(0.0 < value <= 1.0 + 1e-9 for value in fidelity["energy"])
    assert train_and_evaluate(config, "digits", "softmax", 0, data=small).fidelity == {}


def test_each_run_trains_with_its_rows_kl_recipe():
    """SGPA anneals its KL over the first half of the run (its official recipe); the other rows do not."""
    config = CompareConfig(tasks=("digits",), attentions=("sgpa", "kep_svgp", "softmax_mc_dropout"), seeds=(0,))

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
