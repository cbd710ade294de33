"""Tests for the asymmetric toy regression data sets in :mod:`gpattn.data.toy_regression`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from gpattn.data.toy_regression import (
    RegressionData,
    _component,
    _shifted_rbf,
    make_asymmetric_regression_1d,
    make_asymmetric_regression_2d,
)

MAKERS: list[Callable[..., RegressionData]] = [make_asymmetric_regression_1d, make_asymmetric_regression_2d]
TENSOR_FIELDS = [f.name for f in dataclasses.fields(RegressionData) if f.type in ("Tensor", Tensor)]


def _interp_1d(grid: Tensor, values: Tensor, x: Tensor) -> Tensor:
    """Piecewise-linear interpolation of ``values`` on the equispaced sorted ``grid`` at ``x``, all 1-D."""
    idx = torch.searchsorted(grid, x).clamp(1, grid.numel() - 1)  # shape: (n,)
    left, right = grid[idx - 1], grid[idx]
    weight = (x - left) / (right - left)
    return (1 - weight) * values[idx - 1] + weight * values[idx]


def test_tensor_fields_are_found() -> None:
    assert set(TENSOR_FIELDS) == {
        "train_x", "train_y", "test_x", "test_y", "test_f", "grid_x", "grid_f", "grid_f_left", "grid_f_right", "shift",
    }  # fmt: skip


@pytest.mark.parametrize("make", MAKERS)
def test_same_seed_is_bitwise_identical(make: Callable[..., RegressionData]) -> None:
    first, second = make(seed=3), make(seed=3)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.description == second.description


@pytest.mark.parametrize("make", MAKERS)
def test_different_seed_differs(make: Callable[..., RegressionData]) -> None:
    first, second = make(seed=0), make(seed=1)
    for name in ("train_x", "train_y", "test_x", "test_f", "grid_f_left", "grid_f_right"):
        assert not torch.equal(getattr(first, name), getattr(second, name)), name
    assert torch.equal(first.grid_x, second.grid_x)


@pytest.mark.parametrize("make", MAKERS)
def test_global_rng_untouched(make: Callable[..., RegressionData]) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    make(seed=5)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    ("make", "dim", "n_grid"), [(make_asymmetric_regression_1d, 1, 400), (make_asymmetric_regression_2d, 2, 1600)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shapes_and_dtypes(make: Callable[..., RegressionData], dim: int, n_grid: int, dtype: torch.dtype) -> None:
    data = make(n_train=17, n_test=9, dtype=dtype)
    expected = {
        "train_x": (17, dim), "train_y": (17,), "test_x": (9, dim), "test_y": (9,), "test_f": (9,),
        "grid_x": (n_grid, dim), "grid_f": (n_grid,), "grid_f_left": (n_grid,), "grid_f_right": (n_grid,),
        "shift": (dim,),
    }  # fmt: skip
    for name, shape in expected.items():
        tensor = getattr(data, name)
        assert tensor.shape == shape, name
        assert tensor.dtype == dtype, name
    assert isinstance(data.noise_std, float) and isinstance(data.lengthscale, float)
    assert data.description.endswith(".") and data.description.count(". ") == 0


def test_default_dtype_is_float64() -> None:
    assert make_asymmetric_regression_1d().train_x.dtype == torch.float64
    assert make_asymmetric_regression_2d().grid_f.dtype == torch.float64


@pytest.mark.parametrize("make", MAKERS)
def test_float32_is_rounded_float64(make: Callable[..., RegressionData]) -> None:
    data64, data32 = make(seed=2), make(seed=2, dtype=torch.float32)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(data64, name).float(), getattr(data32, name)), name


def test_metadata_is_recorded() -> None:
    data = make_asymmetric_regression_2d(noise_std=0.25, shift=(0.1, 0.7), lengthscale=0.5)
    assert data.noise_std == 0.25 and data.lengthscale == 0.5
    assert torch.equal(data.shift, torch.tensor([0.1, 0.7], dtype=torch.float64))
    assert make_asymmetric_regression_1d(shift=-0.4).shift.tolist() == [-0.4]


@pytest.mark.parametrize("make", MAKERS)
def test_noiseless_targets_equal_f(make: Callable[..., RegressionData]) -> None:
    data = make(noise_std=0.0)
    assert torch.equal(data.test_y, data.test_f)


@pytest.mark.parametrize("make", MAKERS)
def test_noise_level_matches_noise_std(make: Callable[..., RegressionData]) -> None:
    data = make(n_test=5000, noise_std=0.3)
    residual_std = (data.test_y - data.test_f).std().item()
    assert residual_std == pytest.approx(0.3, rel=0.1)


def test_noise_does_not_change_f() -> None:
    clean, noisy = make_asymmetric_regression_1d(noise_std=0.0), make_asymmetric_regression_1d(noise_std=0.5)
    assert torch.equal(clean.test_f, noisy.test_f) and torch.equal(clean.train_x, noisy.train_x)
    assert torch.equal(clean.grid_f, noisy.grid_f)


def test_grid_interpolates_f_1d() -> None:
    data = make_asymmetric_regression_1d(n_train=5000, n_test=500, noise_std=0.2)
    grid = data.grid_x.squeeze(-1)
    # test_f is f at test_x, so interpolating the dense grid reproduces it.
    assert torch.allclose(_interp_1d(grid, data.grid_f, data.test_x.squeeze(-1)), data.test_f, atol=1e-2)
    # train_y is f at train_x plus noise of the requested level.
    train_f = _interp_1d(grid, data.grid_f, data.train_x.squeeze(-1))
    assert (data.train_y - train_f).std().item() == pytest.approx(0.2, rel=0.1)
    clean = make_asymmetric_regression_1d(n_train=5000, noise_std=0.0)
    assert torch.allclose(_interp_1d(grid, clean.grid_f, clean.train_x.squeeze(-1)), clean.train_y, atol=1e-2)


@pytest.mark.parametrize("make", MAKERS)
def test_grid_f_is_sum_of_branches(make: Callable[..., RegressionData]) -> None:
    data = make(seed=4)
    assert torch.allclose(data.grid_f, data.grid_f_left + data.grid_f_right, rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("make", MAKERS)
def test_f_is_of_order_one(make: Callable[..., RegressionData]) -> None:
    mean_squares = torch.tensor(
        [make(seed=seed, n_train=1, n_test=1).grid_f.pow(2).mean().item() for seed in range(40)]
    )
    # The weight scale makes the expected mean square over the grid one; 40 draws average it to within ~25%.
    assert 0.7 < mean_squares.mean().item() < 1.3
    assert (mean_squares > 0.0).all()
    for seed in range(3):
        assert 0.3 < make(seed=seed).grid_f.std().item() < 2.0


def test_grid_layout() -> None:
    grid_1d = make_asymmetric_regression_1d().grid_x.squeeze(-1)
    assert torch.equal(grid_1d, torch.linspace(-3.0, 3.0, 400, dtype=torch.float64))
    grid_2d = make_asymmetric_regression_2d().grid_x
    axis = torch.linspace(-2.0, 2.0, 40, dtype=torch.float64)
    # Row-major: the first coordinate varies slowest.
    assert torch.equal(grid_2d[:40, 0], torch.full((40,), -2.0, dtype=torch.float64))
    assert torch.equal(grid_2d[:40, 1], axis)
    assert torch.equal(grid_2d.reshape(40, 40, 2)[:, 0, 0], axis)


def test_inputs_lie_in_box() -> None:
    data_1d = make_asymmetric_regression_1d(n_train=2000, n_test=2000)
    for x in (data_1d.train_x, data_1d.test_x):
        assert x.min() >= -3.0 and x.max() <= 3.0
    data_2d = make_asymmetric_regression_2d(n_train=2000, n_test=2000)
    for x in (data_2d.train_x, data_2d.test_x):
        assert x.min() >= -2.0 and x.max() <= 2.0
        # Uniform in the square: every quadrant is populated.
        assert len({(bool(a), bool(b)) for a, b in (x > 0).tolist()}) == 4


def test_training_inputs_avoid_the_gap_1d() -> None:
    data = make_asymmetric_regression_1d(n_train=5000, n_test=500)
    train, test = data.train_x.squeeze(-1), data.test_x.squeeze(-1)
    assert not ((train >= 0.8) & (train <= 1.6)).any()
    assert ((test >= 0.8) & (test <= 1.6)).sum() > 30  # about 500 * 0.8 / 6 = 67 expected
    # Both sides of the gap are covered, with the density of a uniform draw on the 5.2-long union.
    assert (train > 1.6).float().mean().item() == pytest.approx(1.4 / 5.2, abs=0.03)
    assert torch.all(train[1:] >= train[:-1]) and torch.all(test.diff() >= 0)


def test_shifted_rbf_is_asymmetric() -> None:
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(7, 2, generator=gen, dtype=torch.float64), torch.randn(5, 2, generator=gen, dtype=torch.float64)
    shift = torch.tensor([0.5, -0.3], dtype=torch.float64)
    forward, backward = _shifted_rbf(x, z, shift, 0.4), _shifted_rbf(z, x, shift, 0.4)
    assert not torch.allclose(forward, backward.mT, atol=1e-3)
    # kappa(z, x) is the kernel with the shift reversed, and shift = 0 recovers the symmetric RBF.
    assert torch.allclose(backward.mT, _shifted_rbf(x, z, -shift, 0.4), atol=1e-14)
    zero = torch.zeros(2, dtype=torch.float64)
    assert torch.allclose(_shifted_rbf(x, z, zero, 0.4), _shifted_rbf(z, x, zero, 0.4).mT, atol=1e-14)
    assert _shifted_rbf(z + shift, z, shift, 0.4).diagonal().eq(1.0).all()


@pytest.mark.parametrize("shift", [(0.6,), (0.5, -0.3)])
def test_right_branch_is_left_branch_translated_by_twice_the_shift(shift: tuple[float, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    dim = len(shift)
    shift_t = torch.tensor(shift, dtype=torch.float64)
    sources = torch.rand(9, dim, generator=gen, dtype=torch.float64) * 4 - 2
    weights = torch.randn(9, generator=gen, dtype=torch.float64)
    x = torch.rand(50, dim, generator=gen, dtype=torch.float64) * 4 - 2
    right = _component(x, sources, weights, shift_t, 0.4, "right")
    left_translated = _component(x + 2 * shift_t, sources, weights, shift_t, 0.4, "left")
    assert torch.allclose(right, left_translated, atol=1e-12)
    assert not torch.allclose(right, _component(x, sources, weights, shift_t, 0.4, "left"), atol=1e-3)


def test_cross_correlation_lag_is_twice_the_shift_1d() -> None:
    shift, step = 0.6, 0.01
    grid = torch.arange(-8.0, 8.0 + step / 2, step, dtype=torch.float64).unsqueeze(-1)  # shape: (1601, 1)
    gen = torch.Generator().manual_seed(2)
    sources = torch.rand(12, 1, generator=gen, dtype=torch.float64) * 6 - 3
    weights = torch.randn(12, generator=gen, dtype=torch.float64)
    shift_t = torch.tensor([shift], dtype=torch.float64)
    left = _component(grid, sources, weights, shift_t, 0.35, "left")
    right = _component(grid, sources, weights, shift_t, 0.35, "right")
    max_lag = 200  # 2.0 in input units; both branches vanish near the ends of [-8, 8]
    lags = torch.arange(-max_lag, max_lag + 1)
    corr = torch.stack([(left * right.roll(int(lag))).sum() for lag in lags])
    # right(x) = left(x + 2 shift), so right shifted right by 2 shift lines up with left.
    assert lags[corr.argmax()].item() * step == pytest.approx(2 * shift, abs=step)


def test_component_rejects_unknown_side() -> None:
    with pytest.raises(ValueError, match="side must be 'left' or 'right', got 'up'"):
        _component(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.zeros(1), 1.0, "up")  # type: ignore[arg-type]


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_train": 0}, r"n_train must be an integer >= 1, got 0"),
        ({"n_test": -3}, r"n_test must be an integer >= 1, got -3"),
        ({"n_train": 2.0}, r"n_train must be an integer >= 1, got 2\.0"),
        ({"num_sources": 0}, r"num_sources must be an integer >= 1, got 0"),
        ({"noise_std": -0.1}, r"noise_std must be a finite number >= 0, got -0\.1"),
        ({"noise_std": float("nan")}, r"noise_std must be a finite number >= 0, got nan"),
        ({"lengthscale": 0.0}, r"lengthscale must be a finite number > 0, got 0\.0"),
        ({"dtype": torch.int64}, r"dtype must be a floating torch\.dtype .*got torch\.int64"),
        ({"dtype": torch.complex128}, r"dtype must be a floating torch\.dtype .*got torch\.complex128"),
    ],
)
def test_bad_arguments_raise(make: Callable[..., RegressionData], kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize("make", MAKERS)
def test_seeds_up_to_the_largest_torch_generator_seed(make: Callable[..., RegressionData]) -> None:
    # 2**64 used to reach torch.Generator.manual_seed: "Overflow when unpacking long long"
    with pytest.raises(
        ValueError, match=r"expected seed to be a non-negative integer at most 2\*\*64 - 1 .*got 18446744073709551616"
    ):
        make(n_train=2, n_test=2, seed=2**64)
    with pytest.raises(ValueError, match=r"expected seed to be a non-negative integer, got -1"):
        make(n_train=2, n_test=2, seed=-1)
    largest = make(n_train=2, n_test=2, seed=2**64 - 1)  # the largest accepted seed works
    assert torch.equal(largest.train_x, make(n_train=2, n_test=2, seed=2**64 - 1).train_x)
    assert torch.equal(make(n_train=2, n_test=2, seed=np.int64(3)).train_x, make(n_train=2, n_test=2, seed=3).train_x)


def test_bad_shift_raises() -> None:
    with pytest.raises(ValueError, match=r"shift must be 2 finite number\(s\), got \(0\.5,\)"):
        make_asymmetric_regression_2d(shift=(0.5,))
    with pytest.raises(ValueError, match=r"shift must be 1 finite number\(s\), got \(inf,\)"):
        make_asymmetric_regression_1d(shift=float("inf"))
    with pytest.raises(ValueError, match=r"puts every bump off the box"):
        make_asymmetric_regression_1d(shift=50.0)


def test_numpy_numbers_are_accepted_and_a_shift_of_the_wrong_kind_is_named() -> None:
    # np.int64 sizes and np.float32 scales were refused with "must be an integer >= 1, got np.int64(5)" and "must be a
    # finite number >= 0, got np.float32(0.1)"; a scalar 2-D shift or a string shift raised TypeError / ValueError
    # from float() instead of naming the shift
    plain = make_asymmetric_regression_1d(n_train=5, n_test=4, noise_std=0.25, shift=0.5, num_sources=3, seed=2)
    numpy = make_asymmetric_regression_1d(
        n_train=np.int64(5),
        n_test=np.int32(4),
        noise_std=np.float32(0.25),
        shift=np.float32(0.5),
        num_sources=np.int64(3),
        seed=np.uint8(2),
    )
    for field in ("train_x", "train_y", "test_y", "grid_f"):
        assert torch.equal(getattr(numpy, field), getattr(plain, field))
    assert numpy.noise_std == 0.25 and type(numpy.noise_std) is float
    two = make_asymmetric_regression_2d(n_train=np.int64(3), shift=np.array([0.5, -0.3]), lengthscale=np.float32(0.5))
    assert torch.equal(two.train_x, make_asymmetric_regression_2d(n_train=3, lengthscale=0.5).train_x)
    with pytest.raises(TypeError, match=r"shift must be 2 finite number\(s\), got 0.5"):
        make_asymmetric_regression_2d(shift=0.5)
    with pytest.raises(TypeError, match=r"shift must be 2 finite number\(s\), got 'ab'"):
        make_asymmetric_regression_2d(shift="ab")
    with pytest.raises(TypeError, match=r"shift must be 1 finite number\(s\), got \(\[0.5\],\)"):
        make_asymmetric_regression_1d(shift=[0.5])


def test_a_one_element_tensor_shift_is_its_number_1d() -> None:
    # the shift was taken, then the description's f"{shift:g}" raised "unsupported format string passed to
    # Tensor.__format__"
    plain = make_asymmetric_regression_1d(n_train=5, n_test=4, shift=0.5, num_sources=3)
    for shift in (torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64)):
        data = make_asymmetric_regression_1d(n_train=5, n_test=4, shift=shift, num_sources=3)
        assert torch.equal(data.train_y, plain.train_y) and data.description == plain.description
        assert "(shift 0.5," in data.description
