"""CompareConfig refuses settings that would run something other than what they name: no GP block (``gp_layers=0``),
truthy non-bools, a bare string for a list of names, a seed count for a list of seeds, a repeated row or task; it
stores numpy integers as Python ints, and ``full`` with other seeds runs them for every row."""

from __future__ import annotations

import numpy as np
import pytest

from gpattn.comparison import CompareConfig, plan_runs

POINTER = dict(tasks=("pointer",), seeds=(0,), progress=False, tuned=False)


@pytest.mark.parametrize("rows", [("kep_svgp", "sgpa"), ("softmax", "softmax_mc_dropout")])
def test_no_gp_block_is_refused(rows) -> None:
    # gp_layers=0 built a softmax Transformer under the GP row's name; the softmax rows gain nothing from it either
    with pytest.raises(ValueError, match=r"CompareConfig: expected gp_layers to be an integer in \[1, 2\], got 0"):
        CompareConfig(gp_layers=0, attentions=rows, **POINTER)
    config = CompareConfig(gp_layers=2, attentions=rows, **POINTER)
    assert len(plan_runs(config)) == len(rows)


@pytest.mark.parametrize("name", ["temperature_scaling", "compile", "progress", "smoke_test", "cuda_graphs", "tuned"])
@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_the_switches_must_be_bools(name, value) -> None:
    # "no" is truthy: it switched temperature scaling, compile or the progress lines on
    with pytest.raises(TypeError, match=rf"CompareConfig: expected {name} to be a bool, got {value!r}"):
        CompareConfig(**{**POINTER, name: value})


@pytest.mark.parametrize(("name", "value"), [("attentions", "softmax"), ("tasks", "pointer")])
def test_a_bare_string_is_not_a_list_of_names(name, value) -> None:
    message = rf"CompareConfig: expected {name} to be a sequence of names, got the string '{value}'"
    with pytest.raises(TypeError, match=message):
        CompareConfig(**{**POINTER, name: value})
    assert getattr(CompareConfig(**{**POINTER, name: [value]}), name) == (value,)


@pytest.mark.parametrize("name", ["seeds", "primary_seeds"])
def test_seeds_must_be_a_sequence_and_are_stored_as_python_ints(name) -> None:
    with pytest.raises(TypeError, match=rf"CompareConfig: expected {name} to be a sequence of integers, got 3"):
        CompareConfig(**{**POINTER, "seeds": (0,), name: 3})
    with pytest.raises(TypeError, match=rf"expected {name} to be a sequence of integers, got the string '01'"):
        CompareConfig(**{**POINTER, "seeds": (0,), name: "01"})
    seeds = np.arange(5, 7)
    config = CompareConfig(**{**POINTER, "seeds": (0,), name: seeds})
    assert getattr(config, name) == (5, 6) and all(type(seed) is int for seed in getattr(config, name))
    assert type(CompareConfig(**{**POINTER, "seeds": (0,), "batch_size": np.int64(8)}).batch_size) is int


def test_seeds_whose_ensemble_members_leave_torchs_range_are_refused_up_front() -> None:
    # member k of an ensemble of K with seed s trains with s * K + k (member_seed): with K = 2, the seed 2**63 gives
    # 2**64 + 1 for member 1, which torch.manual_seed refuses; a single model takes every 64-bit seed
    assert CompareConfig(**{**POINTER, "seeds": (2**64 - 1,)}).seeds == (2**64 - 1,)
    largest = (2**64 - 2) // 2
    assert CompareConfig(**{**POINTER, "seeds": (largest,), "ensemble": 2}).ensemble == 2
    with pytest.raises(ValueError, match=r"row 'kep_svgp': member 1 of an ensemble of 2 with seed 9223372036854775808"):
        CompareConfig(**{**POINTER, "seeds": (largest + 1,), "ensemble": 2})
    with pytest.raises(ValueError, match="row 'deep_ensemble': member 4 of an ensemble of 5"):  # an ensemble row
        CompareConfig(**{**POINTER, "attentions": ("deep_ensemble",), "seeds": (2**62,)})


@pytest.mark.parametrize(
    ("name", "values", "repeated"),
    [
        ("attentions", ("softmax", "kep_svgp", "softmax"), "softmax"),
        ("tasks", ("pointer", "digits", "pointer"), "pointer"),
    ],
)
def test_a_repeated_row_or_task_is_refused(name, values, repeated) -> None:
    # a repeated name trained its runs twice and wrote each record twice (n doubled in the table)
    message = rf"CompareConfig: expected distinct {name}, got \[.*\] \({repeated} more than once\)"
    with pytest.raises(ValueError, match=message):
        CompareConfig(**{**POINTER, name: values})
    config = CompareConfig(**{**POINTER, name: tuple(dict.fromkeys(values))})
    runs = plan_runs(config)
    assert len(getattr(config, name)) == 2 and len(set(runs)) == len(runs) == len(config.attentions) * len(config.tasks)


def test_full_with_seeds_trains_those_seeds_for_every_row() -> None:
    # --full --seeds 5 failed on "expected distinct primary_seeds, none of them among seeds [5]" (the preset's 5-9)
    full = CompareConfig.full()
    assert full.row_seeds("kep_svgp") == tuple(range(10)) and full.row_seeds("sgpa") == tuple(range(5))
    config = CompareConfig.full(seeds=(5,))
    assert config.primary_seeds == () and {config.row_seeds(row) for row in config.attentions} == {(5,)}
    config = CompareConfig.full(seeds=(10, 11), primary_seeds=(12,))  # both given: both kept
    assert config.row_seeds("softmax") == (10, 11, 12) and config.row_seeds("primal") == (10, 11)


def test_numpy_floats_are_stored_as_python_floats_and_a_row_name_gives_its_hyperparameters() -> None:
    # np.float32 beta, ksvd_weight and mc_dropout were kept: the run settings' JSON raised "Object of type float32 is
    # not JSON serializable"; hyperparameters("pointer", "softmax") raised "'str' object has no attribute 'predictive'"
    from gpattn.comparison.runner import result_settings
    from gpattn.methods import get_method

    names = ("lr", "beta", "ksvd_weight", "mc_dropout")
    config = CompareConfig(**POINTER, **{name: np.float32(0.25) for name in names})
    assert all(type(getattr(config, name)) is float and getattr(config, name) == 0.25 for name in names)
    assert {name: result_settings(config)[name] for name in names} == dict.fromkeys(names, 0.25)
    assert config.hyperparameters("pointer", "softmax_mc_dropout") == config.hyperparameters(
        "pointer", get_method("softmax_mc_dropout")
    )
    assert config.hyperparameters("pointer", "softmax_mc_dropout").dropout == 0.25
