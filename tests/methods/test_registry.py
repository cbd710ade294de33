"""The rows of the comparison as data (gpattn/methods): the registry, the specs and how a run reads them."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle

import pytest
import torch

from gpattn.attention import AttentionLayer, SoftmaxAttention, attention_names, register_attention, unregister_attention
from gpattn.comparison import TASK_DEFAULTS, CompareConfig, plan_runs, read_tuned
from gpattn.methods import (
    METHODS,
    Hyperparameters,
    MethodSpec,
    Predictive,
    TrainingRecipe,
    get_method,
    method_names,
    register_method,
    resolve_method,
    unregister_method,
)
from gpattn.validation import InputTypeError


class EchoAttention(SoftmaxAttention):
    """Softmax attention under another name, registered by the fixture below."""


@pytest.fixture
def echo():
    register_attention("echo", EchoAttention)
    yield "echo"
    unregister_attention("echo")


# -- the registry ------------------------------------------------------------------------------------------------------
def test_every_registered_attention_is_a_row_then_the_other_rows():
    names = method_names()
    assert names[: len(attention_names())] == attention_names()
    assert names[len(attention_names()) :] == ["softmax_mc_dropout", "laplace", "deep_ensemble"]
    for name in attention_names():
        assert get_method(name).attention == name


def test_registering_an_attention_makes_it_a_row_with_the_defaults(echo):
    assert echo in method_names() and echo not in METHODS
    spec = get_method(echo)
    assert (spec.name, spec.attention, spec.attention_arguments, spec.model_arguments) == (echo, echo, {}, {})
    assert spec.recipe == TrainingRecipe() and spec.predictive == Predictive() and spec.temperature_scaled
    assert CompareConfig(attentions=(echo,)).attentions == (echo,)
    unregister_attention(echo)
    with pytest.raises(ValueError, match="unknown comparison row 'echo'"):
        get_method(echo)
    register_attention(echo, EchoAttention)  # for the fixture's teardown


def test_register_resolve_and_unregister_a_row():
    spec = MethodSpec("kep_s4", "kep_svgp", attention_arguments={"num_inducing": 4}, paper="a test")
    register_method(spec)
    try:
        assert method_names()[-1] == "kep_s4" and get_method("kep_s4") is spec
        assert resolve_method("kep_s4") is spec and resolve_method(spec) is spec
        with pytest.raises(ValueError, match="'kep_s4' is already registered"):
            register_method(spec)
    finally:
        unregister_method("kep_s4")
    assert "kep_s4" not in method_names()
    with pytest.raises(ValueError, match="'kep_s4' is not registered"):
        unregister_method("kep_s4")


def test_a_spec_refines_a_registered_attention_of_its_name(echo):
    register_method(MethodSpec(echo, echo, recipe=TrainingRecipe(kl_anneal_fraction=0.25)))
    try:
        assert method_names().count(echo) == 1  # one row, in the attention's place
        assert get_method(echo).recipe.kl_anneal_fraction == 0.25
    finally:
        unregister_method(echo)
    assert get_method(echo).recipe.kl_anneal_fraction == 0.0  # the attention is still a row, with the defaults


def test_unknown_names_and_attentions_are_clear_errors():
    with pytest.raises(ValueError) as error:
        get_method("nope")
    message = str(error.value)
    assert message.startswith("unknown comparison row 'nope'; expected one of [")
    assert all(repr(name) in message for name in method_names())
    with pytest.raises(TypeError, match="a string"):
        get_method(3)
    with pytest.raises(ValueError, match="uses the attention 'missing', which is not registered"):
        register_method(MethodSpec("ghost", "missing"))
    with pytest.raises(ValueError, match="uses the attention 'missing'"):
        resolve_method(MethodSpec("ghost", "missing"))
    with pytest.raises(TypeError, match="expected a MethodSpec"):
        register_method("softmax")
    with pytest.raises(ValueError, match=r"expected attentions to be one of \['kep_svgp', .*'deep_ensemble'\]"):
        CompareConfig(attentions=("nope",))


def test_the_built_in_rows():
    assert get_method("sgpa").recipe.kl_anneal_fraction == 0.5  # SGPA's official recipe
    assert all(get_method(name).recipe.kl_anneal_fraction == 0.0 for name in method_names() if name != "sgpa")
    dropout = get_method("softmax_mc_dropout")
    assert (dropout.attention, dropout.predictive.kind, dropout.predictive.mc_dropout) == (
        "softmax",
        "mc_dropout",
        True,
    )
    ensemble = get_method("deep_ensemble")
    assert (ensemble.attention, ensemble.predictive.members, ensemble.temperature_scaled) == ("softmax", 5, False)
    assert "Lakshminarayanan" in ensemble.paper and "Gal" in dropout.paper
    assert all(get_method(name).description for name in method_names())


# -- the specs ---------------------------------------------------------------------------------------------------------
def test_specs_are_frozen_and_validated():
    arguments = {"num_inducing": 4}
    spec = MethodSpec("kep_s4", "kep_svgp", attention_arguments=arguments)
    arguments["num_inducing"] = 8  # the spec holds its own copy
    assert spec.attention_arguments == {"num_inducing": 4}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.attention = "softmax"
    for bad, match in (
        ({"name": "two words"}, "name to be a non-empty string without spaces"),
        ({"attention": ""}, "attention to be a non-empty string"),
        ({"attention_arguments": [("num_inducing", 4)]}, "attention_arguments to map argument names"),
        ({"recipe": 0.5}, "recipe to be a TrainingRecipe"),
        ({"predictive": "mc_dropout"}, "predictive to be a Predictive"),
        ({"temperature_scaled": 1}, "temperature_scaled to be a bool"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            MethodSpec(**{"name": "row", "attention": "softmax", **bad})
    with pytest.raises(ValueError, match="kl_anneal_fraction"):
        TrainingRecipe(kl_anneal_fraction=1.5)
    with pytest.raises(ValueError, match="kind to be one of"):
        Predictive("probit")
    with pytest.raises(ValueError, match="members"):
        Predictive(members=0)
    assert TrainingRecipe(0.5).kl_anneal_epochs(40) == 20.0


def test_the_laplace_and_ensemble_rows_are_the_softmax_transformer_predicting_otherwise():
    laplace, ensemble, softmax = get_method("laplace"), get_method("deep_ensemble"), get_method("softmax")
    assert (laplace.attention, laplace.predictive, laplace.temperature_scaled) == (
        "softmax",
        Predictive("laplace"),
        True,
    )
    assert laplace.predictive.laplace and not laplace.predictive.mc_dropout and laplace.predictive.members == 1
    assert (ensemble.attention, ensemble.predictive.members, ensemble.temperature_scaled) == ("softmax", 5, False)
    config = CompareConfig()
    for task in ("digits", "mnist1d"):  # the same hyperparameters as the softmax row: the same trained model
        defaults = TASK_DEFAULTS[task]
        assert config.hyperparameters(task, laplace, defaults) == config.hyperparameters(task, softmax, defaults)


def test_hyperparameters_take_tuned_values_as_data():
    # the shared settings on digits (the package's tuned file would replace them: untuned)
    config = CompareConfig(num_inducing=None, mc_dropout=0.2, tuned=False)
    base = config.hyperparameters("digits", get_method("softmax"), {"num_inducing": 5})
    assert (base.epochs, base.lr, base.weight_decay, base.num_inducing, base.dropout) == (40, 3e-3, 0.01, 5, 0.0)
    # the shared settings' MC-dropout rate (the package's tuned file, which has its own, would replace it: untuned)
    assert config.hyperparameters("mnist1d", get_method("softmax_mc_dropout")).dropout == 0.2
    assert (
        CompareConfig(num_inducing=8).hyperparameters("digits", get_method("sgpa"), {"num_inducing": 5}).num_inducing
        == 8
    )
    # the task's defaults: MNIST-1D's base model (dropout 0.1 for every row, s = 5, 60 epochs), the shared settings
    # (the package's tuned file would replace them: untuned)
    mnist1d = CompareConfig(tuned=False).hyperparameters("mnist1d", get_method("kep_svgp"), TASK_DEFAULTS["mnist1d"])
    assert (mnist1d.epochs, mnist1d.dropout, mnist1d.num_inducing, mnist1d.embed_dim, mnist1d.depth) == (
        60,
        0.1,
        5,
        32,
        2,
    )
    assert (mnist1d.num_heads, mnist1d.lr, mnist1d.weight_decay, mnist1d.batch_size) == (2, 3e-3, 0.01, 64)
    assert CompareConfig.quick().hyperparameters("mnist1d", get_method("softmax")).epochs == 4  # --quick: few epochs
    assert not CompareConfig(tuned=False).is_tuned("mnist1d", get_method("kep_svgp"))
    assert not CompareConfig().is_tuned("pointer", get_method("kep_svgp"))  # no tuned file for the pointer task
    # the package's digits file: its values replace the shared ones, the rest (s) stays the task's
    entry = read_tuned("digits")["kep_svgp"].hyperparameters
    digits = CompareConfig().hyperparameters("digits", get_method("kep_svgp"), {"num_inducing": 5})
    assert CompareConfig().is_tuned("digits", get_method("kep_svgp")) and digits.num_inducing == 5
    assert {name: getattr(digits, name) for name in entry} == entry
    tuned = base.updated({"lr": 1e-3, "beta": 0.1, "epochs": 60})
    assert (tuned.lr, tuned.beta, tuned.epochs, tuned.depth) == (1e-3, 0.1, 60, base.depth)
    assert tuned.to_dict() == {**base.to_dict(), "lr": 1e-3, "beta": 0.1, "epochs": 60}
    with pytest.raises(ValueError, match=r"unknown names \['learning_rate'\]"):
        base.updated({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match="lr"):
        base.updated({"lr": -1.0})
    with pytest.raises(ValueError, match="dropout"):
        base.updated({"dropout": math.nan})


# -- CompareConfig reads the registry only -----------------------------------------------------------------------------
def test_compare_config_builds_no_layer_and_plan_runs_checks_them_once(monkeypatch):
    built = []
    original = AttentionLayer.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(AttentionLayer, "__init__", counting)
    rows = ("kep_svgp", "sgpa", "softmax", "softmax_mc_dropout", "deep_ensemble")
    # the shared settings (tuned files give each task's rows their own architectures, hence more distinct layers)
    config = CompareConfig(attentions=rows, num_inducing=8, tasks=("pointer", "digits"), tuned=False)
    assert built == []  # validated against the registry only
    state = torch.get_rng_state()
    runs = plan_runs(config)
    assert torch.equal(torch.get_rng_state(), state)
    # one layer per distinct (attention, arguments): the three softmax rows and both tasks share one check
    assert sorted(built) == ["KEPSVGPAttention", "SGPAAttention", "SoftmaxAttention"]
    assert runs == [(task, row, seed) for task in ("pointer", "digits") for row in rows for seed in range(5)]
    with pytest.raises(ValueError, match=r"the row 'kep_svgp': .*num_inducing \(99\).*head width"):
        plan_runs(dataclasses.replace(config, num_inducing=99))


def test_an_ensemble_row_is_not_ensembled_again():
    assert CompareConfig(attentions=("deep_ensemble",)).ensemble == 1
    assert CompareConfig(attentions=("softmax",), ensemble=3).ensemble == 3
    with pytest.raises(ValueError, match=r"\['deep_ensemble'\] are ensembles already"):
        CompareConfig(attentions=("softmax", "deep_ensemble"), ensemble=2)


def test_hyperparameters_are_validated():
    values = dict(epochs=1, lr=1e-3, weight_decay=0.0, batch_size=8, embed_dim=16, depth=2, num_heads=2, gp_layers=1,
                  num_inducing=None, beta=1.0, ksvd_weight=1.0, dropout=0.0)  # fmt: skip
    assert Hyperparameters(**values).gp_layers == 1
    for bad, match in (({"gp_layers": 3}, "gp_layers"), ({"embed_dim": 15}, "divisible"), ({"epochs": 0}, "epochs")):
        with pytest.raises(ValueError, match=match):
            Hyperparameters(**{**values, **bad})


def test_the_sgpa_row_states_its_kl_weighting_and_builds_it():
    """The comparison says which SGPA objective it runs (issue 24): the row's description names kl_weighting='elbo',
    and the layer the row builds has it."""
    from gpattn.attention import build_attention

    spec = get_method("sgpa")
    assert "kl_weighting='elbo'" in spec.description
    layer = build_attention(spec.attention, 16, 2, **spec.layer_arguments(num_inducing=4, ksvd_weight=1.0))
    assert layer.kl_weighting == "elbo"


# -- reliability: the values a spec holds, its state, and the errors of bad inputs ----------------------------------
_VALUES = dict(epochs=2, lr=1e-3, weight_decay=0.0, batch_size=8, embed_dim=16, depth=2, num_heads=2, gp_layers=1,
               num_inducing=None, beta=1.0, ksvd_weight=1.0, dropout=0.0)  # fmt: skip


def test_numbers_are_stored_as_python_numbers_for_json_and_hashing():
    """NumPy numbers and one-element tensors pass the checks; they are stored as the Python ``int``/``float`` the
    checks return, so that ``to_dict`` reaches the records' JSON and equal values hash equally."""
    numpy = pytest.importorskip("numpy")
    odd = {
        "epochs": numpy.int64(3),
        "lr": numpy.float32(0.5),
        "num_inducing": numpy.int32(4),
        "patience": numpy.int8(2),
    }
    hyperparameters = Hyperparameters(**{**_VALUES, **odd, "beta": torch.tensor(0.5), "kl_anneal_fraction": 1})
    values = hyperparameters.to_dict()
    assert json.loads(json.dumps(values)) == values
    names = ("epochs", "lr", "num_inducing", "patience", "beta", "kl_anneal_fraction")
    assert [type(values[name]) for name in names] == [int, float, int, int, float, float]
    assert type(hyperparameters.updated({"depth": numpy.int64(2)}).depth) is int
    recipe = TrainingRecipe(torch.tensor(0.5))
    assert type(recipe.kl_anneal_fraction) is float
    assert recipe == TrainingRecipe(torch.tensor(0.5)) and hash(recipe) == hash(TrainingRecipe(torch.tensor(0.5)))
    assert type(Predictive(members=numpy.int64(5)).members) is int


def test_specs_are_hashable_read_only_and_travel_to_workers():
    """A spec is hashable (its argument mappings are left out of the hash), its arguments cannot be changed (also not
    through a row read from the registry), and pickling (worker processes, Ray) and copies give equal specs."""
    spec = MethodSpec("kep_s4", "kep_svgp", attention_arguments={"num_inducing": 4}, model_arguments={"depth": 3})
    assert hash(spec) == hash(MethodSpec("kep_s4", "kep_svgp", {"num_inducing": 4}, {"depth": 3}))
    assert len({spec, get_method("sgpa"), get_method("sgpa")}) == 2
    for change in (
        lambda arguments: arguments.__setitem__("num_inducing", 8),
        lambda arguments: arguments.update(num_inducing=8),
        lambda arguments: arguments.pop("num_inducing", None),
        lambda arguments: arguments.setdefault("ksvd_weight", 2.0),
        lambda arguments: arguments.clear(),
    ):
        for arguments in (spec.attention_arguments, get_method("sgpa").attention_arguments, spec.model_arguments):
            with pytest.raises(TypeError, match="read-only"):
                change(arguments)
    assert spec.attention_arguments == {"num_inducing": 4} and get_method("sgpa").attention_arguments == {}
    assert json.dumps(spec.attention_arguments) == '{"num_inducing": 4}'
    assert {**spec.attention_arguments, "ksvd_weight": 1.0} == {"num_inducing": 4, "ksvd_weight": 1.0}
    for copied in [pickle.loads(pickle.dumps(spec, protocol)) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)] + [
        copy.deepcopy(spec),
        copy.copy(spec),
        dataclasses.replace(spec),
    ]:
        assert copied == spec and hash(copied) == hash(spec)
        with pytest.raises(TypeError, match="read-only"):
            copied.attention_arguments["num_inducing"] = 8


def test_bad_inputs_are_clear_type_and_value_errors():
    """Wrong types are InputTypeErrors (a TypeError and a ValueError) naming the argument, not raw Python errors."""
    for bad, match in (
        ({"name": 3}, "expected name to be a non-empty string"),
        ({"description": None}, "expected description to be a string"),
        ({"temperature_scaled": 1}, "temperature_scaled to be a bool"),
        ({"model_arguments": {1: 2}}, "model_arguments to map argument names"),
        ({"recipe": 0.5}, "recipe to be a TrainingRecipe"),
    ):
        with pytest.raises(InputTypeError, match=match):
            MethodSpec(**{"name": "row", "attention": "softmax", **bad})
    base = Hyperparameters(**_VALUES)
    for values in ("lr", [("lr", 1e-3)], {1: 2, "lr": 1e-3}, None):
        with pytest.raises(InputTypeError, match="expected values to map hyperparameter names"):
            base.updated(values)
    for recipe in (None, 0.5):
        with pytest.raises(InputTypeError, match="expected recipe to be a TrainingRecipe"):
            base.kl_anneal_epochs(recipe)
    with pytest.raises(ValueError, match="expected epochs to be a non-negative integer, got -4"):
        TrainingRecipe(0.5).kl_anneal_epochs(-4)
    with pytest.raises(InputTypeError, match="expected epochs"):
        TrainingRecipe(0.5).kl_anneal_epochs("4")
    for name in (["softmax"], 3):
        with pytest.raises(TypeError, match="a string"):
            unregister_method(name)


def test_a_row_passing_an_argument_its_attention_does_not_take_is_refused_when_registered():
    """As register_attention refuses unknown defaults: a typo in a row's attention arguments is refused by
    register_method (and resolve_method), not when the first run builds the layer."""
    typo = MethodSpec("typo", "softmax", attention_arguments={"num_inducng": 4})
    with pytest.raises(
        ValueError, match=r"the comparison row 'typo' passes \['num_inducng'\] to the attention 'softmax'"
    ):
        register_method(typo)
    assert "typo" not in METHODS
    with pytest.raises(ValueError, match="passes"):
        resolve_method(typo)
    with pytest.raises(ValueError, match=r"passes \['num_heads'\]"):
        resolve_method(MethodSpec("heads", "kep_svgp", attention_arguments={"num_heads": 4}))
    assert resolve_method(MethodSpec("s4", "kep_svgp", attention_arguments={"num_inducing": 4})).name == "s4"


def test_a_row_name_with_a_path_separator_is_refused():
    """The records of a row's runs are files named ``<task>-<name>-<seed>.json``: a name with a path separator is
    refused when the spec is made, not when the first record is written after its training."""
    for name in ("my/row", "my\\row"):
        with pytest.raises(ValueError, match="expected name to be without path separators"):
            MethodSpec(name, "softmax")
    assert MethodSpec("ok", "softmax", attention_arguments={"dropout": 0.1}).name == "ok"
