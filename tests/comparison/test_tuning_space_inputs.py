"""The inputs of the tuning search space and of a row's model: :class:`SearchParameter` refuses bounds that are not
finite numbers (an infinity, a bool, a string), a non-string name and a string of choices, and takes NumPy numbers as
numbers; :func:`plan_runs` refuses a row whose model arguments the Transformer does not take, before any run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpattn.comparison import CompareConfig, SearchParameter, plan_runs
from gpattn.comparison.runs import build_model, check_model_arguments
from gpattn.methods import Hyperparameters, MethodSpec, get_method, method_names, register_method, unregister_method
from gpattn.validation import InputTypeError

POINTER = dict(tasks=("pointer",), seeds=(0,), progress=False, tuned=False)


# -- SearchParameter ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("low", "high", "bound"), [(0.0, math.inf, "high"), (-math.inf, 1.0, "low"), (-1, 1.0, "low")])
def test_an_infinite_or_negative_bound_is_refused_by_name(low, high, bound) -> None:
    # high=inf was accepted: a "uniform" range Optuna cannot sample
    with pytest.raises(ValueError, match=rf"SearchParameter 'dropout': expected {bound} to be a finite number >= 0"):
        SearchParameter("dropout", "uniform", low, high)


@pytest.mark.parametrize(("low", "high", "bound"), [(False, True, "low"), (0.0, True, "high"), (np.False_, 1.0, "low")])
def test_a_bool_bound_is_refused(low, high, bound) -> None:
    # SearchParameter("dropout", "uniform", False, True) was accepted as the range [0, 1]
    with pytest.raises(InputTypeError, match=rf"SearchParameter 'dropout': expected {bound} to be a finite number"):
        SearchParameter("dropout", "uniform", low, high)


@pytest.mark.parametrize(("low", "high", "bound"), [("a", 1.0, "low"), (0.0, "1", "high"), (None, 1.0, "low")])
def test_a_bound_that_is_not_a_number_names_it(low, high, bound) -> None:
    # a string raised a bare "TypeError: '<=' not supported between instances of 'int' and 'str'"
    with pytest.raises(InputTypeError, match=rf"SearchParameter 'lr': expected {bound} to be a finite number"):
        SearchParameter("lr", "log_uniform", low, high)


@pytest.mark.parametrize("name", [3, None, ("lr",)])
def test_the_name_must_be_a_string(name) -> None:
    with pytest.raises(InputTypeError, match=r"SearchParameter: expected name to be a non-empty string"):
        SearchParameter(name, "uniform", 0.0, 1.0)
    with pytest.raises(ValueError, match=r"SearchParameter: expected name to be a non-empty string, got ''"):
        SearchParameter("", "uniform", 0.0, 1.0)


def test_a_string_of_choices_is_refused() -> None:
    # choices="abc" was three one-letter choices
    with pytest.raises(InputTypeError, match=r"SearchParameter 'a': expected choices to be a tuple or list of values"):
        SearchParameter("a", "choice", choices="abc")
    listed = SearchParameter("a", "choice", choices=["32x1x2", "32x1x4"])
    assert listed.choices == ("32x1x2", "32x1x4") and hash(listed) == hash(listed)


def test_the_documented_ranges_are_kept() -> None:
    with pytest.raises(ValueError, match=r"SearchParameter 'lr': a log-uniform range needs low > 0, got 0"):
        SearchParameter("lr", "log_uniform", 0, 1.0)
    with pytest.raises(ValueError, match=r"SearchParameter 'lr': expected 0 <= low < high, got \[1.0, 1.0\]"):
        SearchParameter("lr", "uniform", 1.0, 1.0)
    with pytest.raises(ValueError, match=r"SearchParameter 'x': expected choices, got none"):
        SearchParameter("x", "choice")
    assert SearchParameter("beta", "log_uniform", 1e-2, 3600).describe() == {"log_uniform": [0.01, 3600]}


def test_numpy_bounds_are_stored_as_python_numbers() -> None:
    parameter = SearchParameter("beta", "log_uniform", np.float32(0.5), np.int64(3600))
    assert parameter.describe() == {"log_uniform": [0.5, 3600]}
    assert type(parameter.low) is float and type(parameter.high) is int


def test_contains_takes_numpy_numbers_and_not_bools() -> None:
    dropout = SearchParameter("dropout", "uniform", 0.0, 1.0)
    # np.float32(0.5) was outside [0, 1], True inside it
    assert dropout.contains(np.float32(0.5)) and dropout.contains(np.int64(1)) and dropout.contains(0)
    assert not dropout.contains(True) and not dropout.contains(np.True_) and not dropout.contains(np.float32(1.5))
    assert not dropout.contains("0.5") and not dropout.contains(None)
    fraction = SearchParameter("kl_anneal_fraction", "choice", choices=(0.0, 0.25, 0.5))
    assert fraction.contains(np.float64(0.25)) and fraction.contains(0)
    assert not fraction.contains(False) and not fraction.contains(np.array([0.0, 0.25]))
    switch = SearchParameter("switch", "choice", choices=(True, False))
    assert switch.contains(True) and switch.contains(np.False_) and not switch.contains(1)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(kind="choice", low=0.0, high=1.0, choices=(1, 2)), r"a choice takes no low or high, got \[0.0, 1.0\]"),
        (dict(kind="uniform", low=0.0, high=1.0, choices=(1, 2)), r"a uniform range takes no choices, got \(1, 2\)"),
    ],
)
def test_an_argument_the_kind_ignores_is_refused(arguments, message) -> None:
    # both were accepted and ignored: a choice sampled its choices, a range its bounds, whatever else was given
    with pytest.raises(ValueError, match=rf"SearchParameter 'x': {message}"):
        SearchParameter("x", **arguments)
    # an empty sequence of choices is no choice given, whatever its type
    assert (
        SearchParameter("x", "uniform", 0.0, 1.0, choices=[]).describe()
        == SearchParameter("x", "uniform", 0.0, 1.0).describe()
    )


def test_choices_are_json_scalars_and_numpy_ones_are_stored_as_python() -> None:
    # NumPy choices reached describe() (the studies' JSON settings, the tuned files) as NumPy scalars
    fraction = SearchParameter("kl_anneal_fraction", "choice", choices=(np.float64(0.25), np.int64(1), np.str_("a")))
    assert fraction.describe() == {"choice": [0.25, 1, "a"]}
    assert [type(choice) for choice in fraction.choices] == [float, int, str]
    assert SearchParameter("x", "choice", choices=(None, True, "a")).choices == (None, True, "a")
    with pytest.raises(InputTypeError, match=r"SearchParameter 'x': expected choices to be None, bools, numbers or "
                       r"strings, got \(1, 2\)"):  # fmt: skip
        SearchParameter("x", "choice", choices=((1, 2), 3))


# -- the model arguments of a row --------------------------------------------------------------------------------------
@pytest.fixture
def registered():
    """Register the specs given to it for one test, unregistered afterwards."""
    names = []

    def register(spec: MethodSpec) -> str:
        register_method(spec)
        names.append(spec.name)
        return spec.name

    yield register
    for name in names:
        unregister_method(name)


def test_an_unknown_model_argument_is_refused_before_any_run(registered) -> None:
    # "dept" passed plan_runs and failed inside the run, in the attention layer ("got unexpected arguments ['dept']")
    row = registered(MethodSpec("typo_row", "softmax", model_arguments={"dept": 4, "dropout": 0.1}))
    message = (
        r"the row 'typo_row' passes the model arguments \['dept'\], which the Transformer does not take .*; it takes "
        r"\['embed_dim', 'depth', .*'dropout'\] and the arguments of the attention 'softmax': \['dropout'\]"
    )
    with pytest.raises(ValueError, match=message):
        plan_runs(CompareConfig(attentions=(row,), **POINTER))


@pytest.mark.parametrize("name", ["num_classes", "attention"])
def test_a_model_argument_the_run_sets_is_refused(registered, name) -> None:
    row = registered(MethodSpec(f"sets_{name}", "softmax", model_arguments={name: "x"}))
    with pytest.raises(ValueError, match=rf"passes the model arguments \['{name}'\]"):
        plan_runs(CompareConfig(attentions=(row,), **POINTER))


def test_model_arguments_of_the_transformer_and_its_attention_pass(registered) -> None:
    row = registered(MethodSpec("wide_mlp", "sgpa", model_arguments={"mlp_ratio": 4.0, "kl_weighting": "official"}))
    assert plan_runs(CompareConfig(attentions=(row, "softmax"), **POINTER)) == [
        ("pointer", row, 0),
        ("pointer", "softmax", 0),
    ]


@pytest.mark.parametrize("row", method_names())
def test_every_built_in_row_has_known_model_arguments(row) -> None:
    check_model_arguments(get_method(row))


def test_gpattn_tune_refuses_an_unknown_model_argument_before_any_trial(registered) -> None:
    # gpattn tune never calls plan_runs: its check before the trials is check_search_space, which now checks them too
    from gpattn.comparison import tuning as tuning_module
    from gpattn.comparison.tune_config import TuneConfig

    row = registered(MethodSpec("tune_typo_row", "softmax", model_arguments={"dept": 4}))
    config = TuneConfig(tasks=("pointer",), rows=(row,))
    data = tuning_module._data("pointer", 100)
    with pytest.raises(ValueError, match=r"the row 'tune_typo_row' passes the model arguments \['dept'\]"):
        tuning_module.check_search_space(config, "pointer", data)


@pytest.mark.parametrize(
    "attention_arguments, model_arguments, twice",
    [({}, {"num_inducing": 4}, "num_inducing"), ({"ksvd_weight": 0.1}, {"ksvd_weight": 0.2}, "ksvd_weight")],
    ids=["a-shared-setting", "an-attention-argument"],
)
def test_a_layer_argument_given_as_a_model_argument_too_is_refused_before_any_run(
    registered, attention_arguments, model_arguments, twice
) -> None:
    # the layer got it from layer_arguments and from the Transformer's **attention_kwargs: build_model raised Python's
    # "got multiple values for keyword argument" inside the run
    spec = MethodSpec(f"twice_{twice}", "kep_svgp", attention_arguments, model_arguments)
    row = registered(spec)
    with pytest.raises(ValueError, match=rf"passes \['{twice}'\] as model arguments, but the run gives them"):
        plan_runs(CompareConfig(attentions=(row,), **POINTER))
    # what the check prevents: the run's model cannot be built
    with pytest.raises(TypeError, match="multiple values"):
        sizes = dict(epochs=1, lr=1e-3, weight_decay=0.0, batch_size=4, embed_dim=16, depth=1, num_heads=2)
        hyperparameters = Hyperparameters(**sizes, gp_layers=1, beta=1.0, ksvd_weight=0.1, dropout=0.0, num_inducing=5)
        build_model(spec, hyperparameters, 3, {"input": "tokens", "vocab_size": 8, "max_len": 8})


@pytest.mark.parametrize(
    ("choices", "first", "second"),
    [((1, 1), "1", "1"), ((0.5, 1, 1.0), "1", "1.0"), ((1, True), "1", "True"), (("a", None, False, 0), "False", "0")],
)
def test_choices_that_compare_equal_are_refused(choices, first, second) -> None:
    """Optuna finds a stored choice by ``==`` (``choices.index``): of ``(1, True)`` a trial that drew ``True`` read back
    as ``1``, and ``(1, 1)`` drew 1 twice as often; both were accepted."""
    import optuna

    with pytest.raises(
        ValueError, match=rf"SearchParameter 'x': expected distinct choices, got {first} and {second}, "
    ):
        SearchParameter("x", "choice", choices=choices)
    distribution = optuna.distributions.CategoricalDistribution((1, True))  # what the check prevents
    assert distribution.to_external_repr(distribution.to_internal_repr(True)) == 1
    assert SearchParameter("x", "choice", choices=(0, "1", None, True, 0.5)) is not None
