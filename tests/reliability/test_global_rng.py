"""The global random generators a user seeds once (torch's, NumPy's legacy ``np.random``, Python's ``random``): which
calls of the public API draw from them, reseed them or leave them changed, measured against what the docstrings say.

* Functions that take a ``seed`` draw from generators of their own: they leave all three global generators as they
  were, give the same result whatever the global state, and different results for different seeds.
* Constructors draw their initial weights from torch's generator (as ``torch.nn`` does) and never touch NumPy's or
  Python's; forward passes draw from torch's only when sampling.
* :func:`~gpattn.training.train_model` and :func:`~gpattn.training.train_ensemble` document that they seed torch's
  generator (the run is a function of ``config.seed``); they leave NumPy's and Python's alone.

Three tests here failed before their fixes: the toy regression fits reseeded torch's global generator, MNIST-1D's
sequences depended on NumPy's global bit generator, and ``random_stream`` queued its seed for CUDA's first use.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from gpattn.attention import attention_names, build_attention, sample_attention, select_arguments
from gpattn.comparison import (
    ToyRegressionConfig,
    fit_exact_gp,
    fit_pair_svgp,
    fit_pair_svgp_pyro,
    hierarchical_difference,
    paired_difference,
    random_stream,
    run_toy_regression,
    stream_seed,
)
from gpattn.data import (
    load_digits_splits,
    load_mnist1d,
    make_asymmetric_regression_1d,
    make_asymmetric_regression_2d,
    make_mnist1d_noise_ood,
    make_mnist1d_signals,
    make_noise_ood,
    make_pointer_task,
    make_shifted_test_sets,
    make_successor_task,
    shift_images,
)
from gpattn.features import ksvd_fidelity
from gpattn.kernels import FeatureLift
from gpattn.ksvd import kernel_svd
from gpattn.models import TemperatureScaling, Transformer, fit_temperature, monte_carlo_logits
from gpattn.training import TrainConfig, train_ensemble, train_model

GENERATORS = ("torch", "numpy", "random")


def _states() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The global generators whose state differs between two snapshots of :func:`_states`."""
    changed = [] if torch.equal(before["torch"], after["torch"]) else ["torch"]
    old, new = before["numpy"], after["numpy"]
    if not (old[0] == new[0] and np.array_equal(old[1], new[1]) and old[2:] == new[2:]):
        changed.append("numpy")
    return changed + ([] if before["random"] == after["random"] else ["random"])


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _restored_global_generators() -> Iterator[None]:
    """These tests seed the global generators: the caller's states (and NumPy's bit generator) come back after."""
    states, bit_generator = _states(), np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(bit_generator)
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["random"])


def _leaves(value: Any) -> list[torch.Tensor]:
    """The numbers in ``value`` (tensors, arrays, numbers, dataclasses, mappings, sequences), as float64 vectors."""
    if isinstance(value, torch.Tensor):
        return [value.detach().double().flatten()]
    if isinstance(value, np.ndarray):
        return [torch.as_tensor(value).double().flatten()]
    if isinstance(value, (bool, int, float)):
        return [torch.tensor([float(value)], dtype=torch.float64)]
    if isinstance(value, torch.nn.Module):
        return [state.double().flatten() for state in value.state_dict().values() if state.is_floating_point()]
    if dataclasses.is_dataclass(value):
        return [leaf for field in dataclasses.fields(value) for leaf in _leaves(getattr(value, field.name))]
    if isinstance(value, dict):
        return [leaf for key in sorted(value, key=str) for leaf in _leaves(value[key])]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return []


def _same(first: Any, second: Any) -> bool:
    left, right = _leaves(first), _leaves(second)
    assert left, "nothing to compare"
    return len(left) == len(right) and all(
        a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(left, right, strict=True)
    )


# -- functions with a seed: own generators only ------------------------------------------------------------------------
_IMAGES = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
_MATRIX = torch.rand(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
_FIDELITY_TOKENS = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _fidelity(seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):  # the layer's initial weights: the same in every call, the test's draw
        torch.manual_seed(0)
        layer = build_attention("kep_svgp", 8, 2, num_inducing=2).double()
    fidelity = ksvd_fidelity(layer, _FIDELITY_TOKENS, random_samples=3, seed=seed)
    return {field.name: getattr(fidelity, field.name) for field in dataclasses.fields(fidelity)}


def _streamed(seed: int) -> torch.Tensor:
    with random_stream(seed, "test"):
        return torch.randn(4)


SEEDED: dict[str, Callable[[int], Any]] = {
    "make_pointer_task": lambda seed: make_pointer_task(8, 4, 4, length=6, seed=seed, vocab_size=8),
    "make_successor_task": lambda seed: make_successor_task(8, 4, 4, length=6, seed=seed),
    "make_asymmetric_regression_1d": lambda seed: make_asymmetric_regression_1d(10, 10, seed=seed),
    "make_asymmetric_regression_2d": lambda seed: make_asymmetric_regression_2d(10, 10, seed=seed),
    "make_noise_ood": lambda seed: make_noise_ood(3, seed=seed).images,
    "shift_images": lambda seed: shift_images(_IMAGES, "gaussian_noise", 3, seed=seed),
    "shift_images_rotation": lambda seed: shift_images(_IMAGES, "rotation", 5, seed=seed),
    "make_shifted_test_sets": lambda seed: {
        key: value.images
        for key, value in make_shifted_test_sets(make_noise_ood(3), seed, ("gaussian_noise",), (2,)).items()
    },
    "load_digits_splits": lambda seed: load_digits_splits(seed=0, val_seed=seed).val.images,
    "make_mnist1d_signals": lambda seed: make_mnist1d_signals([0, 3, 7], seed=seed),
    "load_mnist1d": lambda seed: load_mnist1d(seed=seed).val.tokens,
    "make_mnist1d_noise_ood": lambda seed: make_mnist1d_noise_ood(4, seed=seed).tokens,
    "FeatureLift": lambda seed: FeatureLift("rff", 2, 8, seed=seed),
    "kernel_svd": lambda seed: kernel_svd(_MATRIX, 2, "randomized", oversampling=0, power_iterations=0, seed=seed),
    "ksvd_fidelity": _fidelity,
    "paired_difference": lambda seed: paired_difference(
        [1.0, 2.0, 3.0, 5.0], [1.5, 2.1, 3.3, 4.0], method="bootstrap", num_resamples=50, seed=seed
    ),
    "hierarchical_difference": lambda seed: hierarchical_difference(
        {0: [1.0, 2.0], 1: [2.0, 3.0], 2: [0.0, 5.0]},
        {0: [1.5, 2.5], 1: [2.0, 3.5], 2: [1.0, 1.0]},
        num_resamples=50,
        seed=seed,
    ),
    "random_stream": _streamed,
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_a_seed_argument_draws_from_its_own_generator(name: str) -> None:
    function = SEEDED[name]
    function(1)  # first calls fill caches and import lazily: what is measured is a call like any later one
    _seed_all(1)
    before = _states()
    first = function(1)
    assert _changed(before, _states()) == [], f"{name} changed the global generators"
    _seed_all(2)
    assert _same(function(1), first), f"{name}(seed=1) depends on the global generators"
    assert not _same(function(2), first), f"{name} gives the same result for the seeds 1 and 2"


def test_stream_seeds_depend_on_their_arguments_only() -> None:
    _seed_all(3)
    before = _states()
    assert stream_seed(0, "val") == stream_seed(0, "val") != stream_seed(1, "val")
    assert _changed(before, _states()) == []


# -- constructors and forward passes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", attention_names())
def test_layers_draw_from_torch_only_and_only_when_sampling(name: str) -> None:
    """A constructor draws its initial weights from torch's generator (as ``torch.nn`` does); a forward pass in eval
    mode draws nothing; a sampled one (``sample_attention``) draws from torch's alone."""
    _seed_all(4)
    before = _states()
    layer = build_attention(name, 8, 2, **select_arguments(name, num_inducing=2)).eval()
    assert _changed(before, _states()) in ([], ["torch"])
    tokens = torch.randn(2, 5, 8)
    before = _states()
    layer(tokens)
    assert _changed(before, _states()) == []  # the predictive mean: deterministic
    with sample_attention(layer):
        layer(tokens)
    assert _changed(before, _states()) == (["torch"] if layer.is_stochastic else [])


@pytest.mark.filterwarnings("ignore:fit_temperature:UserWarning")
def test_monte_carlo_and_temperature_scaling_of_a_deterministic_model_draw_nothing() -> None:
    torch.manual_seed(0)
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention="softmax", vocab_size=8, max_len=6)
    inputs, labels = torch.randint(1, 8, (6, 6)), torch.tensor([0, 1, 0, 1, 1, 0])
    _seed_all(5)
    before = _states()
    assert monte_carlo_logits(model, inputs, num_samples=3).shape == (1, 6, 2)  # run once: nothing to sample
    TemperatureScaling(model).fit(inputs, labels, num_samples=3)
    fit_temperature(torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.5]]), torch.tensor([0, 1, 1]))
    assert _changed(before, _states()) == []


def test_monte_carlo_samples_draw_from_torch_as_documented() -> None:
    """The global torch generator drives the samples (the docstring): reseeding it repeats them."""
    torch.manual_seed(0)
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention="kep_svgp", vocab_size=8, max_len=6)
    inputs = torch.randint(1, 8, (4, 6))
    _seed_all(6)
    before = _states()
    first = monte_carlo_logits(model, inputs, num_samples=3)
    assert _changed(before, _states()) == ["torch"]
    torch.manual_seed(6)
    torch.testing.assert_close(monte_carlo_logits(model, inputs, num_samples=3), first, rtol=0, atol=0)
    assert not torch.equal(first[0], first[1])  # the samples differ from one another


# -- training: seeds torch's generator (documented), leaves NumPy's and Python's alone ---------------------------------
def _tiny_model(member: int = 0) -> Transformer:
    return Transformer(2, embed_dim=8, depth=1, num_heads=2, attention="kep_svgp", vocab_size=8, max_len=6)


@pytest.mark.parametrize("ensemble", [False, True])
def test_training_is_a_function_of_its_seed_and_leaves_numpy_and_random_alone(ensemble: bool) -> None:
    data = make_pointer_task(16, 8, 8, length=6, seed=0, vocab_size=8)
    config = TrainConfig(epochs=1, seed=3, batch_size=8, eval_samples=1, progress=False)

    def run(global_seed: int) -> list[torch.Tensor]:
        _seed_all(global_seed)
        before = _states()
        if ensemble:
            members = train_ensemble(_tiny_model, data.train, data.val, config, 2)
        else:
            torch.manual_seed(0)  # the initial weights, the caller's part
            members = [(model := _tiny_model(), train_model(model, data.train, data.val, config))]
        assert _changed(before, _states()) == ["torch"]  # seeded with config.seed, as documented
        return [leaf for model, _ in members for leaf in _leaves(model)]

    first, second = run(7), run(8)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# -- known defects -----------------------------------------------------------------------------------------------------
TOY = ToyRegressionConfig(seed=5, iterations=1, pyro_iterations=1, pyro_particles=1, num_landmarks=6, num_inducing=4)
FITS = {"fit_exact_gp": fit_exact_gp, "fit_pair_svgp": fit_pair_svgp, "fit_pair_svgp_pyro": fit_pair_svgp_pyro}


@pytest.mark.parametrize("name", list(FITS))
def test_toy_regression_fits_do_not_depend_on_the_global_generators(name: str) -> None:
    data = make_asymmetric_regression_1d(20, 20, seed=0)
    _seed_all(1)
    first, _ = FITS[name](data, TOY, progress=False)
    _seed_all(2)
    second, _ = FITS[name](data, TOY, progress=False)
    assert _same(first, second)


@pytest.mark.parametrize("name", [*FITS, "run_toy_regression"])
def test_toy_regression_leaves_the_global_torch_generator_alone(name: str) -> None:
    data = make_asymmetric_regression_1d(20, 20, seed=0)
    _seed_all(1)
    before = _states()
    if name == "run_toy_regression":
        run_toy_regression(TOY, progress=False)
    else:
        FITS[name](data, TOY, progress=False)
    assert _changed(before, _states()) == []


def test_a_users_other_bit_generator_gets_its_whole_state_back() -> None:
    """Swapping NumPy's global bit generator for MT19937 and back cleared the user's cached Gaussian: the next
    ``standard_normal()`` differed from the one without the generation in between."""
    np.random.set_bit_generator(np.random.PCG64(0))
    np.random.standard_normal()  # a pair drawn: one cached
    state = np.random.get_state(legacy=False)
    expected = np.random.standard_normal()
    np.random.set_state(state)
    make_mnist1d_signals([1, 2], seed=3, cache=False)
    assert isinstance(np.random.get_bit_generator(), np.random.PCG64)
    assert np.random.standard_normal() == expected


def test_mnist1d_sequences_do_not_depend_on_the_global_bit_generator() -> None:
    reference = make_mnist1d_signals([0, 3, 7], seed=2)  # the standardisation is computed (and cached) first
    np.random.set_bit_generator(np.random.PCG64(5))
    with warnings.catch_warnings():  # NumPy: get_state(legacy=True) of another bit generator than MT19937
        warnings.simplefilter("ignore", RuntimeWarning)
        other = make_mnist1d_signals([0, 3, 7], seed=2)
    np.testing.assert_array_equal(other, reference)


def _queued_cuda_seed() -> int:
    """The seed that torch will give the CUDA generators when CUDA initialises (torch.manual_seed queues it while
    CUDA is not initialised); read from torch's lazy seed tracker, a private structure (skipped where it differs)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = getattr(tracker, "manual_seed_all_cb", None)
    callback = queued[0] if isinstance(queued, tuple) and queued else None
    names = getattr(getattr(callback, "__code__", None), "co_freevars", ())
    if "seed" not in names or torch.cuda.is_initialized():
        pytest.skip("torch queues CUDA seeds otherwise here, or CUDA is initialised")
    return callback.__closure__[names.index("seed")].cell_contents


def test_random_stream_leaves_the_queued_cuda_seed_alone() -> None:
    torch.manual_seed(1)
    assert _queued_cuda_seed() == 1
    with random_stream(0, "val"):
        torch.randn(2)
    assert _queued_cuda_seed() == 1
