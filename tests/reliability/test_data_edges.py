"""The data sets, their shifts and OOD sets at their edges, against independent references: scikit-learn's
``load_digits`` (splits that are an exact partition of its images, OOD images that are exactly the held-out ones),
``mnist1d``'s own ``transform`` replayed by hand (regenerated sequences under every shift argument), NumPy's quantiles
(histogram-matched noise images), the affine dependence of ``mnist1d``'s transformation on its noise, shear and scale
arguments (severities monotone in the documented quantity), threads writing one disk-cache entry at once, and the
x axis of the shift curves.

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import functools
import json
import random
import threading
from collections import Counter

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from mnist1d.data import get_dataset_args, get_templates
from mnist1d.transform import transform
from sklearn.datasets import load_digits

from gpattn.data import (
    MNIST1D_SHIFT_PARAMETERS,
    SHIFT_KINDS,
    disk_cache,
    load_digits_splits,
    make_mnist1d_noise_ood,
    make_mnist1d_signals,
    make_noise_ood,
    make_pointer_task,
    make_successor_task,
    shift_images,
)
from gpattn.data.mnist1d import MNIST1D_SHIFT_ARGUMENTS
from gpattn.data.mnist1d_generator import standardisation
from gpattn.experiments import RunRecord
from gpattn.plotting import plot_shift_curves
from gpattn.validation import InputTypeError

#: The training value of every shift kind's generator argument (``mnist1d.data.get_dataset_args``).
TRAINING_VALUES = {kind: getattr(get_dataset_args(), name) for kind, name in MNIST1D_SHIFT_ARGUMENTS.items()}


@pytest.fixture(scope="module")
def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def _rows(images: torch.Tensor, digits: np.ndarray) -> Counter:
    """The multiset of (image bytes, digit) rows."""
    return Counter(
        (image.tobytes(), int(d)) for image, d in zip(images.reshape(len(digits), 8, 8).numpy(), digits, strict=True)
    )


# -- the digits: splits, held-out classes, shifts, noise images -------------------------------------------------------
@pytest.mark.parametrize(("held", "val_seed"), [((8, 9), None), ((5, 2), 7), ((), 3)])
def test_digit_splits_partition_sklearns_images_with_the_documented_sizes(sklearn_digits, held, val_seed) -> None:
    images, target = sklearn_digits
    splits = load_digits_splits(seed=4, val_fraction=0.15, test_fraction=0.25, held_out_classes=held, val_seed=val_seed)
    digit_of = np.array(sorted(splits.label_map, key=splits.label_map.get))  # label -> digit
    kept = ~np.isin(target, held)
    parts = (splits.train, splits.val, splits.test)
    # the three splits are an exact partition of sklearn's images of the kept digits (as a multiset of rows)
    union = sum((_rows(part.images, digit_of[part.labels.numpy()]) for part in parts), Counter())
    assert union == _rows(torch.from_numpy(images[kept]), target[kept])
    assert sum(len(part) for part in parts) == int(kept.sum())
    # per kept digit: round(0.25 n_c) test and round(0.15 n_c) validation images, the rest training
    for label, digit in enumerate(digit_of):
        n_c = int((target == digit).sum())
        sizes = [int((part.labels == label).sum()) for part in parts]
        assert sizes == [n_c - round(0.25 * n_c) - round(0.15 * n_c), round(0.15 * n_c), round(0.25 * n_c)]
    # the OOD set is every sklearn image of the held-out digits, label k = held[k], in sklearn's order
    if not held:
        assert splits.ood_classes is None
        return
    rows = np.flatnonzero(np.isin(target, held))
    np.testing.assert_array_equal(splits.ood_classes.images[:, 0].numpy(), images[rows])
    np.testing.assert_array_equal(np.array(held)[splits.ood_classes.labels.numpy()], target[rows])
    assert splits.ood_classes.class_names == tuple(map(str, held))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("kind", SHIFT_KINDS)
def test_shifts_keep_the_dtype_and_shape_also_of_images_smaller_than_the_blur_kernel(kind, dtype) -> None:
    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    shifted = shift_images(images, kind, 5, seed=1)
    assert shifted.dtype == dtype and shifted.shape == images.shape
    assert 0 <= shifted.min() and shifted.max() <= 1
    # a 2 x 2 image under the severity-5 blur (radius 5): replicate padding makes it a mean of the border pixels
    tiny = shift_images(torch.rand(2, 1, 2, 2, generator=torch.Generator().manual_seed(1)), kind, 5)
    assert tiny.shape == (2, 1, 2, 2) and torch.isfinite(tiny).all()


@pytest.mark.parametrize("image_size", [2, 8])
def test_noise_images_have_exactly_the_pooled_digit_quantiles(sklearn_digits, image_size) -> None:
    images, _ = sklearn_digits
    pixels = image_size * image_size
    levels = (np.arange(pixels) + 0.5) / pixels
    quantiles = np.quantile(images.reshape(-1), levels).astype(np.float32)  # independent: NumPy on sklearn's pixels
    ood = make_noise_ood(7, seed=5, image_size=image_size)
    assert ood.images.shape == (7, 1, image_size, image_size) and ood.labels.tolist() == [0, 1, 2, 0, 1, 2, 0]
    for image in ood.images:
        np.testing.assert_array_equal(np.sort(image.reshape(-1).numpy()), quantiles)


# -- MNIST-1D: regenerated sequences, shifts, noise OOD ---------------------------------------------------------------
@functools.cache
def _standard_moments() -> tuple[float, float]:
    """The raw mean and standard deviation of the 5000 sequences ``make_dataset`` draws (global generators seeded
    with 42, 500 of digit 0, then of digit 1, ...), by which it standardises them."""
    args, templates = get_dataset_args(), get_templates()
    state = np.random.get_state(), random.getstate()
    try:
        np.random.seed(42)
        random.seed(42)
        raw = np.stack([transform(templates["x"][d], templates["t"], args)[0] for d in range(10) for _ in range(500)])
    finally:
        np.random.set_state(state[0])
        random.setstate(state[1])
    return float(raw.mean()), float(raw.std())


def _replay(digits: np.ndarray, seed: int, **arguments) -> np.ndarray:
    """``mnist1d``'s transformation of the digit templates with the global generators seeded by hand, standardised as
    ``make_dataset`` standardises the standard set."""
    args, templates = get_dataset_args(), get_templates()
    for name, value in arguments.items():
        setattr(args, name, value)
    state = np.random.get_state(), random.getstate()
    try:
        np.random.seed(seed)
        random.seed(seed)
        raw = np.stack([transform(templates["x"][d], templates["t"], args)[0] for d in digits])
    finally:
        np.random.set_state(state[0])
        random.setstate(state[1])
    mean, std = _standard_moments()
    return (raw - mean) / std


def test_regenerated_sequences_replay_mnist1d_under_every_shift_argument() -> None:
    digits = np.array([3, 1, 4, 1, 5, 9, 2, 6])
    for kind, name in MNIST1D_SHIFT_ARGUMENTS.items():
        value = MNIST1D_SHIFT_PARAMETERS[kind][4]
        expected = _replay(digits, 7, **{name: value})
        np.testing.assert_array_equal(make_mnist1d_signals(digits, 7, **{name: value}), expected)
        # int32 digits from a tensor, through the disk cache: the same values (the key takes them as int64)
        cached = make_mnist1d_signals(torch.tensor(digits, dtype=torch.int32), 7, cache=True, **{name: value})
        np.testing.assert_array_equal(cached, expected)
    assert standardisation() == _standard_moments()  # std about 0.155, as the module docstring says


@pytest.mark.parametrize("kind", ["iid_noise", "correlated_noise", "shear", "scale"])
def test_shift_severities_move_the_sequences_monotonically_along_one_direction(kind) -> None:
    # with one seed every draw is the same whatever the argument, and mnist1d's transformation is affine in the noise
    # scales, the shear scale and the scale coefficient: s(v) = s(v_train) + (v - v_train) u, one direction u per
    # sequence, so the distance from the training distribution's draw grows with the severity exactly as v - v_train
    digits = np.arange(10)
    name, trained = MNIST1D_SHIFT_ARGUMENTS[kind], TRAINING_VALUES[kind]
    clean = make_mnist1d_signals(digits, 11, **{name: trained})
    directions = [
        (make_mnist1d_signals(digits, 11, **{name: value}) - clean) / (value - trained)
        for value in MNIST1D_SHIFT_PARAMETERS[kind]
    ]
    for direction in directions[1:]:
        np.testing.assert_allclose(direction, directions[0], rtol=0, atol=1e-12)
    assert np.linalg.norm(directions[0]) > 0
    if kind == "shear":  # the shear adds a linear ramp in position, nothing else
        assert np.abs(np.diff(directions[0], 2, axis=1)).max() < 1e-12


def test_mnist1d_noise_ood_families_in_float64() -> None:
    ood = make_mnist1d_noise_ood(7, seed=3, patch_size=8, dtype=torch.float64)
    assert ood.tokens.shape == (7, 5, 8) and ood.num_classes == 3 and ood.labels.tolist() == [0, 1, 2, 0, 1, 2, 0]
    signals = ood.tokens.reshape(7, 40).numpy()
    smooth = signals[ood.labels.numpy() == 2]  # standardised per sequence
    np.testing.assert_allclose(smooth.mean(axis=1), 0.0, atol=1e-12)
    np.testing.assert_allclose(smooth.std(axis=1), 1.0, rtol=1e-12)
    # the same seed in float32: the float64 values rounded once
    single = make_mnist1d_noise_ood(7, seed=3).tokens.reshape(7, 40)
    torch.testing.assert_close(single, ood.tokens.reshape(7, 40).float(), rtol=0, atol=0)


@pytest.mark.parametrize("make", ["signals", "noise_ood"])
def test_numpy_integer_seeds_of_the_mnist1d_generators_are_their_numbers(make) -> None:
    if make == "signals":
        np.testing.assert_array_equal(make_mnist1d_signals([1, 2], np.int64(7)), make_mnist1d_signals([1, 2], 7))
    else:
        torch.testing.assert_close(make_mnist1d_noise_ood(3, np.int64(2)).tokens, make_mnist1d_noise_ood(3, 2).tokens)


def test_mnist1d_noise_ood_takes_the_packages_seed_range() -> None:
    assert make_noise_ood(3, seed=2**64 - 1).images.shape == (3, 1, 8, 8)  # the digits' noise OOD set does
    ood = make_mnist1d_noise_ood(3, seed=2**64 - 1)
    assert len(ood) == 3 and not torch.equal(ood.tokens, make_mnist1d_noise_ood(3, seed=2**64 - 2).tokens)


# -- the disk cache: threads writing one entry at once ----------------------------------------------------------------
def test_threads_generating_one_entry_at_once_leave_one_whole_entry(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(disk_cache.CACHE_VARIABLE, str(tmp_path))
    start = threading.Barrier(4)
    calls = []

    def generate() -> dict[str, np.ndarray]:
        calls.append(1)
        start.wait(timeout=10)  # every thread generates before any has written
        return {"x": np.arange(12.0).reshape(3, 4), "y": np.array([1, 2, 3], dtype=np.int64)}

    results = [None] * 4

    def work(index: int) -> None:
        results[index] = disk_cache.cached_arrays("edges", {"n": 3}, generate, __file__)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert len(calls) == 4 and all(result is not None for result in results)
    assert [path.name for path in tmp_path.iterdir()] == [
        disk_cache.entry_path("edges", {"n": 3}, tmp_path, __file__).name
    ]
    again = disk_cache.cached_arrays("edges", {"n": 3}, lambda: pytest.fail("read, not generated"), __file__)
    for result in [*results, again]:
        np.testing.assert_array_equal(result["x"], np.arange(12.0).reshape(3, 4))
        assert result["y"].dtype == np.int64 and result["y"].tolist() == [1, 2, 3]


# -- the shift curves --------------------------------------------------------------------------------------------------
def test_shift_curves_put_numeric_severities_at_their_values_and_the_clean_set_at_zero() -> None:
    test = {k: 0.5 for k in ("accuracy", "nll", "ece", "mce", "brier", "aurc", "eaurc", "auroc", "fpr95", "confidence")}

    def level(accuracy: float) -> dict[str, float]:
        return {"accuracy": accuracy, "nll": 1.0, "ece": 0.1, "brier": 0.2}

    shift = {"noise": {"10": level(0.1), "2": level(0.3), "1": level(0.4), "0": level(0.9)}}  # "0": the clean set
    record = {"task": "t", "attention": "softmax", "seed": 0, "metrics": {"test": test, "shift": shift, "ood": {}}}
    matplotlib.use("Agg")  # no display needed
    try:
        axis = plot_shift_curves([RunRecord.from_dict(json.loads(json.dumps(record)))], ("accuracy",)).axes[0]
        line = axis.get_lines()[0]
        np.testing.assert_array_equal(line.get_xdata(), [0, 1, 2, 10])  # "10" after "2", at 10
        np.testing.assert_array_equal(line.get_ydata(), [0.5, 0.4, 0.3, 0.1])  # severity 0 is metrics.test
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["0", "1", "2", "10"]
    finally:
        plt.close("all")


@pytest.mark.parametrize(
    ("make", "arguments", "name"),
    [
        (make_pointer_task, {"n_train": 2.0}, "n_train"),
        (make_pointer_task, {"length": 8.5}, "length"),
        (make_pointer_task, {"vocab_size": "16"}, "vocab_size"),
        (make_pointer_task, {"min_length": 3.0}, "min_length"),
        (make_successor_task, {"num_symbols": 6.0}, "num_symbols"),
    ],
)
def test_toy_task_arguments_of_another_type_are_input_type_errors(make, arguments, name) -> None:
    """A size of another type is an InputTypeError (a TypeError and a ValueError), as the other data sets raise it;
    one out of range stays a plain ValueError."""
    sizes = {"n_train": 2, "n_val": 2, "n_test": 2}
    with pytest.raises(InputTypeError, match=name):
        make(**{**sizes, **arguments})
    with pytest.raises(ValueError, match="n_train") as refused:
        make(**{**sizes, "n_train": -1})
    assert not isinstance(refused.value, TypeError)
