"""Tests of MNIST-1D: the standard split against ``mnist1d.make_dataset``, the validation carve, held-out classes, the
regenerated shifts (monotone and measurably harder), the shuffled variant and the noise OOD sequences."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from mnist1d.data import get_dataset_args, make_dataset
from sklearn.svm import SVC

import gpattn.data.mnist1d as mnist1d_module
from gpattn.data import (
    MNIST1D_NOISE_FAMILIES,
    MNIST1D_SHIFT_KINDS,
    MNIST1D_SHIFT_PARAMETERS,
    load_mnist1d,
    make_mnist1d_noise_ood,
    make_mnist1d_shifted_test_sets,
    make_mnist1d_shuffled_test_set,
    make_mnist1d_signals,
    mnist1d_noise_families,
    signals_to_tokens,
)
from gpattn.data.mnist1d import MNIST1D_SHIFT_ARGUMENTS
from gpattn.experiments import TrainConfig, evaluate, train_model
from gpattn.metrics import accuracy
from gpattn.models import Transformer


@pytest.fixture(scope="module")
def standard() -> dict:
    """``make_dataset`` with the default arguments, called here independently of gpattn (global RNGs restored)."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        return make_dataset(get_dataset_args())
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


@pytest.fixture(scope="module")
def svc(standard) -> SVC:
    """An RBF SVM trained on the standard training split (about 64 % test accuracy)."""
    return SVC(C=10.0).fit(standard["x"], standard["y"])


def _signals(dataset) -> np.ndarray:
    return dataset.tokens.reshape(len(dataset), -1).double().numpy()


def test_standard_split_matches_make_dataset_exactly(standard) -> None:
    splits = load_mnist1d(val_fraction=0.0, dtype=torch.float64)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (4000, 0, 1000)
    np.testing.assert_array_equal(_signals(splits.train), standard["x"])
    np.testing.assert_array_equal(splits.train.labels.numpy(), standard["y"])
    np.testing.assert_array_equal(_signals(splits.test), standard["x_test"])
    np.testing.assert_array_equal(splits.test.labels.numpy(), standard["y_test"])
    assert splits.ood_classes is None and splits.held_out_classes == ()
    # the float32 default is the same arrays cast once
    default = load_mnist1d(val_fraction=0.0)
    assert default.test.tokens.dtype == torch.float32
    torch.testing.assert_close(
        default.test.tokens.reshape(1000, 40), torch.from_numpy(standard["x_test"]).float(), rtol=0, atol=0
    )


@pytest.mark.parametrize("patch_size", [1, 4, 5, 8])
def test_tokens_are_consecutive_values(standard, patch_size: int) -> None:
    splits = load_mnist1d(val_fraction=0.0, patch_size=patch_size, dtype=torch.float64)
    tokens = splits.test.tokens
    assert tokens.shape == (1000, 40 // patch_size, patch_size)
    assert splits.test.input_dim == patch_size and splits.test.num_classes == 10 and splits.test.mask is None
    # token k holds positions k p .. k p + p - 1
    np.testing.assert_array_equal(tokens[:, 1, 0].numpy(), standard["x_test"][:, patch_size])


def test_validation_split_is_a_stratified_partition(standard) -> None:
    splits = load_mnist1d(seed=3, val_fraction=0.1, dtype=torch.float64)
    train, val = splits.train_indices, splits.val_indices
    assert len(np.intersect1d(train, val)) == 0
    np.testing.assert_array_equal(np.union1d(train, val), np.arange(4000))
    np.testing.assert_array_equal(_signals(splits.val), standard["x"][val])
    np.testing.assert_array_equal(_signals(splits.train), standard["x"][train])
    counts = np.bincount(standard["y"], minlength=10)
    np.testing.assert_array_equal(np.bincount(splits.val.labels.numpy(), minlength=10), np.round(0.1 * counts))
    # class sizes 398 396 411 394 394 402 401 404 402 398 -> 40 40 41 39 39 40 40 40 40 40 validation sequences
    assert len(splits.val) == 399


def test_seeds_are_reproducible() -> None:
    first, again, other = load_mnist1d(seed=1), load_mnist1d(seed=1), load_mnist1d(seed=2)
    np.testing.assert_array_equal(first.val_indices, again.val_indices)
    torch.testing.assert_close(first.train.tokens, again.train.tokens, rtol=0, atol=0)
    assert not np.array_equal(first.val_indices, other.val_indices)
    torch.testing.assert_close(first.test.tokens, other.test.tokens, rtol=0, atol=0)  # the test split never moves


def test_held_out_classes_are_absent_from_the_splits(standard) -> None:
    splits = load_mnist1d(held_out_classes=(8, 3), dtype=torch.float64)
    assert splits.held_out_classes == (8, 3)
    assert splits.label_map == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4, 6: 5, 7: 6, 9: 7}
    for dataset in (splits.train, splits.val, splits.test):
        assert dataset.num_classes == 8 and int(dataset.labels.max()) == 7
    # the digits behind every in-distribution sequence
    assert not np.isin(standard["y"][splits.train_indices], (8, 3)).any()
    assert not np.isin(standard["y"][splits.val_indices], (8, 3)).any()
    assert len(splits.train) + len(splits.val) == int((~np.isin(standard["y"], (8, 3))).sum())
    ood_rows = np.flatnonzero(np.isin(standard["y_test"], (8, 3)))
    np.testing.assert_array_equal(_signals(splits.ood_classes), standard["x_test"][ood_rows])
    # label k of the OOD set is held_out_classes[k]
    np.testing.assert_array_equal(np.array((8, 3))[splits.ood_classes.labels.numpy()], standard["y_test"][ood_rows])
    kept_rows = np.flatnonzero(~np.isin(standard["y_test"], (8, 3)))
    np.testing.assert_array_equal(_signals(splits.test), standard["x_test"][kept_rows])


def test_signals_replay_the_standard_generator(standard) -> None:
    # make_dataset draws 500 sequences of digit 0, then of 1, ... with the global generators seeded with 42, then
    # shuffles the rows and standardises: the same draws, standardised with gpattn's constants, are the same rows
    replay = make_mnist1d_signals(np.repeat(np.arange(10), 500), seed=42)
    every_row = np.concatenate([standard["x"], standard["x_test"]])

    def sorted_rows(rows: np.ndarray) -> np.ndarray:
        return rows[np.lexsort(rows.T[::-1])]

    np.testing.assert_allclose(sorted_rows(replay), sorted_rows(every_row), rtol=0, atol=1e-12)


def test_global_random_generators_are_left_alone() -> None:
    np.random.seed(123)
    random.seed(123)
    expected = (np.random.rand(), random.random())
    np.random.seed(123)
    random.seed(123)
    load_mnist1d(seed=5)
    make_mnist1d_signals([0, 1, 2], seed=7, shear_scale=2.0)
    make_mnist1d_noise_ood(6, seed=1)
    assert (np.random.rand(), random.random()) == expected


def test_shift_parameters_grow_with_severity() -> None:
    defaults = get_dataset_args(as_dict=True)
    assert set(MNIST1D_SHIFT_KINDS) == set(MNIST1D_SHIFT_PARAMETERS) == set(MNIST1D_SHIFT_ARGUMENTS)
    for kind, values in MNIST1D_SHIFT_PARAMETERS.items():
        assert len(values) == 5
        assert defaults[MNIST1D_SHIFT_ARGUMENTS[kind]] < values[0], kind
        assert all(low < high for low, high in zip(values[:-1], values[1:], strict=True)), kind
    assert MNIST1D_SHIFT_PARAMETERS["translation"][-1] <= 72  # the dilated length
    assert MNIST1D_SHIFT_PARAMETERS["scale"][-1] < 2  # the scale factor 1 + c (u - 1/2) stays positive


def test_shifts_get_harder_with_severity(standard, svc) -> None:
    # the same 600 test digits regenerated without shift and at severities 1, 3, 5: the classifier's accuracy falls
    # (measured: 63 % without shift; at severity 5 39, 25, 28, 48, 41 % for the five kinds)
    digits = standard["y_test"][:600]
    clean = svc.score(make_mnist1d_signals(digits, seed=12), digits)
    assert abs(clean - svc.score(standard["x_test"][:600], digits)) < 0.04  # regenerated = the test distribution
    for kind, argument in MNIST1D_SHIFT_ARGUMENTS.items():
        scores = [clean] + [
            svc.score(
                make_mnist1d_signals(digits, seed=11, **{argument: MNIST1D_SHIFT_PARAMETERS[kind][s - 1]}), digits
            )
            for s in (1, 3, 5)
        ]
        assert all(later <= earlier + 0.02 for earlier, later in zip(scores[:-1], scores[1:], strict=True)), (
            kind,
            scores,
        )
        assert scores[-1] < clean - 0.1, (kind, scores)


def test_noise_shifts_raise_the_roughness_monotonically() -> None:
    # mean squared difference of neighbouring positions grows with the i.i.d. noise scale (a noise-free statistic of
    # the generator parameter, on 300 sequences)
    digits = np.arange(300) % 10

    def roughness(signals: np.ndarray) -> float:
        return float((np.diff(signals, axis=1) ** 2).mean())

    values = [roughness(make_mnist1d_signals(digits, seed=4, iid_noise_scale=v)) for v in (0.02, 0.04, 0.08, 0.15)]
    assert all(low < high for low, high in zip(values[:-1], values[1:], strict=True)), values


def test_shifted_test_sets_use_the_documented_parameters(monkeypatch) -> None:
    splits = load_mnist1d(held_out_classes=(0,))
    small = replace(splits, test=replace(splits.test, tokens=splits.test.tokens[:12], labels=splits.test.labels[:12]))
    calls = []
    original = mnist1d_module.make_mnist1d_signals

    def spy(digits, seed=0, *, cache=False, **arguments):
        assert cache is True  # every process of a comparison draws these sets alike: kept in the disk cache
        calls.append((np.asarray(digits).copy(), seed, arguments))
        return original(digits, seed, cache=cache, **arguments)

    monkeypatch.setattr(mnist1d_module, "make_mnist1d_signals", spy)
    shifted = make_mnist1d_shifted_test_sets(small, seed=0, severities=(2, 5))
    assert list(shifted) == [(kind, s) for kind in MNIST1D_SHIFT_KINDS for s in (2, 5)]
    expected_digits = small.test.labels.numpy() + 1  # digit 0 is held out: label k is digit k + 1
    for (kind, severity), (digits, _, arguments) in zip(shifted, calls, strict=True):
        np.testing.assert_array_equal(digits, expected_digits)
        assert arguments == {MNIST1D_SHIFT_ARGUMENTS[kind]: MNIST1D_SHIFT_PARAMETERS[kind][severity - 1]}
        dataset = shifted[(kind, severity)]
        assert dataset.tokens.shape == (12, 10, 4) and dataset.num_classes == 9
        torch.testing.assert_close(dataset.labels, small.test.labels, rtol=0, atol=0)
        assert str(MNIST1D_SHIFT_PARAMETERS[kind][severity - 1]) in dataset.description
    assert len({seed for _, seed, _ in calls}) == len(calls)  # one independent seed per set
    # each set owns its labels: an in-place edit of one leaves the test split and the other sets alone
    first_label = int(small.test.labels[0])
    shifted[("shear", 5)].labels[0] = first_label + 1
    assert int(small.test.labels[0]) == first_label and int(shifted[("shear", 2)].labels[0]) == first_label
    again = make_mnist1d_shifted_test_sets(small, seed=0, kinds=("shear",), severities=(5,))
    torch.testing.assert_close(again[("shear", 5)].tokens, shifted[("shear", 5)].tokens, rtol=0, atol=0)
    other = make_mnist1d_shifted_test_sets(small, seed=1, kinds=("shear",), severities=(5,))
    assert not torch.equal(other[("shear", 5)].tokens, shifted[("shear", 5)].tokens)


def test_shuffled_test_set_permutes_positions(svc) -> None:
    splits = load_mnist1d(held_out_classes=(9,), dtype=torch.float64)
    shuffled = make_mnist1d_shuffled_test_set(splits)
    torch.testing.assert_close(shuffled.labels, splits.test.labels, rtol=0, atol=0)
    assert shuffled.labels.data_ptr() != splits.test.labels.data_ptr()  # its own labels (an edit stays there)
    clean, permuted = _signals(splits.test), _signals(shuffled)
    # every shuffled column is one clean column, the same permutation for every sequence (to rounding: mnist1d
    # standardises the shuffled set separately, and with NumPy 1.26 its entries differ from the clean ones by 6e-17)
    matches = [np.flatnonzero(np.isclose(clean, permuted[:, [j]], rtol=0, atol=1e-12).all(axis=0)) for j in range(40)]
    assert all(len(match) == 1 for match in matches)
    permutation = [int(match[0]) for match in matches]
    assert sorted(permutation) == list(range(40)) and permutation != list(range(40))
    np.testing.assert_allclose(permuted, clean[:, permutation], rtol=0, atol=1e-12)
    # the spatial order carries the class: accuracy collapses towards chance
    digits = np.array([d for d in range(10) if d != 9])[shuffled.labels.numpy()]
    assert svc.score(permuted, digits) < svc.score(clean, digits) - 0.3


def test_noise_ood_sequences() -> None:
    ood = make_mnist1d_noise_ood(30, seed=2, patch_size=5)
    assert ood.tokens.shape == (30, 8, 5) and ood.num_classes == len(MNIST1D_NOISE_FAMILIES) == 3
    np.testing.assert_array_equal(ood.labels.numpy(), np.arange(30) % 3)
    signals = _signals(ood)
    assert np.isfinite(signals).all()
    smooth = signals[2::3]
    np.testing.assert_allclose(smooth.mean(axis=1), 0.0, atol=1e-6)
    np.testing.assert_allclose(smooth.std(axis=1), 1.0, atol=1e-6)
    # on the standardised data's scale, not degenerate
    assert 0.2 < signals[:2].std() < 5.0
    torch.testing.assert_close(make_mnist1d_noise_ood(30, seed=2, patch_size=5).tokens, ood.tokens, rtol=0, atol=0)
    assert not torch.equal(make_mnist1d_noise_ood(30, seed=3, patch_size=5).tokens, ood.tokens)
    assert len(make_mnist1d_noise_ood(0)) == 0


def test_noise_ood_families() -> None:
    ood = make_mnist1d_noise_ood(31, seed=2, patch_size=1)
    families = mnist1d_noise_families(ood)
    assert list(families) == list(MNIST1D_NOISE_FAMILIES) == ["background", "random_template", "smooth_noise"]
    for label, (name, family) in enumerate(families.items()):
        rows = np.flatnonzero(np.arange(31) % 3 == label)  # sequence i is of family i mod 3, in order
        assert torch.equal(family.tokens, ood.tokens[rows]) and torch.equal(family.labels, ood.labels[rows])
        assert family.num_classes == 3 and family.description.endswith(f"family {name}")
    assert [len(family) for family in families.values()] == [11, 10, 10]
    assert list(mnist1d_noise_families(make_mnist1d_noise_ood(2, seed=2))) == ["background", "random_template"]
    with pytest.raises(TypeError, match="expected the SequenceDataset of make_mnist1d_noise_ood"):
        mnist1d_noise_families(load_mnist1d(patch_size=4).test)


def test_signals_to_tokens_round_trip() -> None:
    signals = torch.arange(24.0).reshape(2, 12)
    tokens = signals_to_tokens(signals, 3)
    assert tokens.shape == (2, 4, 3)
    torch.testing.assert_close(tokens[1, 2], torch.tensor([18.0, 19.0, 20.0]))
    torch.testing.assert_close(tokens.reshape(2, 12), signals)
    with pytest.raises(ValueError, match="divide"):
        signals_to_tokens(signals, 5)
    with pytest.raises(ValueError, match=r"\(n, L\)"):
        signals_to_tokens(signals[0], 3)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"patch_size": 3}, "patch_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"seed": -1}, "seed"),
        ({"held_out_classes": (10,)}, "held_out_classes"),
        ({"held_out_classes": (1, 1)}, "distinct"),
        ({"held_out_classes": tuple(range(9))}, "distinct"),
        ({"dtype": torch.int64}, "dtype"),
        ({"seed": 2**64}, "at most 2\\*\\*64 - 1"),  # the package's one seed range (it was unbounded here)
        ({"val_fraction": 0.9999}, r"leaves no training example of the digit\(s\) \[0, 1, 2"),
    ],
)
def test_load_mnist1d_bad_arguments(arguments: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_mnist1d(**arguments)


def test_generator_bad_arguments() -> None:
    with pytest.raises(ValueError, match="generator argument"):
        make_mnist1d_signals([1], padding=[1, 2])
    with pytest.raises(ValueError, match="scale_coeff"):
        make_mnist1d_signals([1], scale_coeff=2.5)
    with pytest.raises(ValueError, match="max_translation"):
        make_mnist1d_signals([1], max_translation=80)
    with pytest.raises(ValueError, match="integers"):
        make_mnist1d_signals([0.5])
    with pytest.raises(ValueError, match="0..9"):
        make_mnist1d_signals([10])
    splits = load_mnist1d()
    with pytest.raises(ValueError, match="kinds"):
        make_mnist1d_shifted_test_sets(splits, kinds=("rotation",))
    with pytest.raises(ValueError, match="severities"):
        make_mnist1d_shifted_test_sets(splits, severities=(6,))
    with pytest.raises(TypeError, match="MNIST1DSplits"):
        make_mnist1d_shifted_test_sets(splits.test)
    with pytest.raises(TypeError, match="MNIST1DSplits"):
        make_mnist1d_shuffled_test_set(splits.train)


def test_transformer_learns_mnist1d() -> None:
    # the tokens feed Transformer(input="vectors") and train_model as they are: a few epochs beat chance (10 %) by far
    splits = load_mnist1d(seed=0)
    torch.manual_seed(0)
    model = Transformer(
        10,
        embed_dim=32,
        depth=2,
        num_heads=4,
        attention="softmax",
        gp_layers=0,
        input="vectors",
        input_dim=4,
        max_len=10,
    )
    config = TrainConfig(epochs=4, batch_size=64, lr=3e-3, eval_samples=1, progress=False)
    result = train_model(model, splits.train, splits.val, config)
    assert result.history[-1]["val_accuracy"] > 0.35
    assert accuracy(evaluate(model, splits.test, num_samples=1), splits.test.labels) > 0.35


def test_public_names_survive_the_split_into_two_modules() -> None:
    """gpattn.data.mnist1d keeps every public name it had before the generator moved to
    gpattn.data.mnist1d_generator, each the object gpattn.data exports; both modules stay under 450 lines."""
    from pathlib import Path

    import gpattn.data as data_package

    names = {
        "MNIST1D_LENGTH",
        "MNIST1D_NOISE_FAMILIES",
        "MNIST1D_SHIFT_ARGUMENTS",
        "MNIST1D_SHIFT_KINDS",
        "MNIST1D_SHIFT_PARAMETERS",
        "MNIST1DSplits",
        "load_mnist1d",
        "make_mnist1d_noise_ood",
        "make_mnist1d_shifted_test_sets",
        "make_mnist1d_shuffled_test_set",
        "make_mnist1d_signals",
        "mnist1d_noise_families",
        "signals_to_tokens",
    }
    assert set(mnist1d_module.__all__) == names
    for name in names & set(data_package.__all__):
        assert getattr(data_package, name) is getattr(mnist1d_module, name), name
    for module in ("mnist1d.py", "mnist1d_generator.py"):
        lines = (Path(mnist1d_module.__file__).parent / module).read_text().count("\n")
        assert lines < 450, (module, lines)


def test_arguments_that_are_not_sequences_are_named(standard) -> None:
    # held_out_classes=8 raised "TypeError: 'int' object is not iterable"; kinds="shear" was iterated letter by letter
    # ("expected kinds to be one of [...], got 's'"); severities=3 raised "'int' object is not iterable"
    with pytest.raises(TypeError, match=r"expected held_out_classes to be a sequence of digits .* got 8$"):
        load_mnist1d(held_out_classes=8)
    from_tensor = load_mnist1d(held_out_classes=torch.tensor([3, 7]))  # was refused as "not digits in 0..9"
    assert from_tensor.held_out_classes == (3, 7) and len(from_tensor.ood_classes) == int(
        np.isin(standard["y_test"], (3, 7)).sum()
    )
    splits = load_mnist1d()
    with pytest.raises(TypeError, match=r"expected kinds to be a sequence, e.g. \('shear',\), got 'shear'"):
        make_mnist1d_shifted_test_sets(splits, kinds="shear")
    with pytest.raises(TypeError, match=r"expected severities to be a sequence, e.g. \(1, 3\), got 3"):
        make_mnist1d_shifted_test_sets(splits, severities=3)


def test_generator_arguments_given_as_one_element_tensors_are_their_numbers() -> None:
    # a tensor passed the checks and went to mnist1d as it was: corr_noise_scale=tensor(0.50004) read the cache entry
    # of tensor(0.5) (the key held the repr, rounded to 4 digits), shear_scale=tensor(...) failed inside mnist1d
    digits = np.arange(10)
    for name in ("corr_noise_scale", "shear_scale"):
        for value in (0.5, 0.50004):
            tensor = make_mnist1d_signals(digits, 3, cache=True, **{name: torch.tensor(value, dtype=torch.float64)})
            np.testing.assert_array_equal(tensor, make_mnist1d_signals(digits, 3, **{name: value}))
    with pytest.raises(TypeError, match="iid_noise_scale"):
        make_mnist1d_signals(digits, iid_noise_scale=torch.tensor([0.1, 0.2]))


def test_shuffled_test_set_of_a_cut_test_split_is_refused(standard) -> None:
    # with splits.test cut to 5 sequences the shuffled set had the 1000 standard sequences and 5 labels
    splits = load_mnist1d(held_out_classes=(8, 9))
    shuffled = make_mnist1d_shuffled_test_set(splits)
    kept = np.isin(standard["y_test"], range(8))
    assert len(shuffled) == len(shuffled.tokens) == int(kept.sum())
    cut = replace(splits, test=replace(splits.test, tokens=splits.test.tokens[:5], labels=splits.test.labels[:5]))
    with pytest.raises(ValueError, match=r"expected splits.test to be the standard test split .* got 5 sequences"):
        make_mnist1d_shuffled_test_set(cut)


def test_shifted_test_sets_take_the_seeds_of_the_package(standard) -> None:
    # seeds above 2**64 - 1 were taken here alone (every other seed of gpattn, the digits' shifts' too, refuses them)
    splits = load_mnist1d()
    with pytest.raises(ValueError, match=r"make_mnist1d_shifted_test_sets: expected seed .* at most 2\*\*64 - 1"):
        make_mnist1d_shifted_test_sets(splits, seed=2**64, kinds=("shear",), severities=(1,))


def test_signals_to_tokens_keeps_a_tensor_and_refuses_bools() -> None:
    # a tensor went through NumPy: one that requires grad (or on a GPU) was a RuntimeError; True / False read as 1 / 0
    signals = torch.arange(8.0, dtype=torch.float64).reshape(1, 8).requires_grad_()
    tokens = signals_to_tokens(signals, 4)
    assert tokens.dtype == torch.float32 and tokens.requires_grad
    tokens.sum().backward()
    torch.testing.assert_close(signals.grad, torch.ones(1, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="signals_to_tokens: expected real-valued signals, got torch.bool"):
        signals_to_tokens(np.ones((2, 4), dtype=bool), 2)


def test_signals_drawn_in_two_threads_at_once_are_those_of_their_seeds() -> None:
    # the threads interleaved their draws from NumPy's global generator: each got other sequences than its seed gives
    digits = np.arange(200) % 10
    alone = [make_mnist1d_signals(digits, seed) for seed in (1, 2)]
    together = [None, None]

    def draw(index: int) -> None:
        together[index] = make_mnist1d_signals(digits, index + 1)

    threads = [threading.Thread(target=draw, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(2):
        np.testing.assert_array_equal(together[index], alone[index])


def test_numpy_integer_patch_sizes_become_python_ints(standard) -> None:
    # np.int64(4) was kept as it was in MNIST1DSplits.patch_size and every input_dim; True was taken as 1 and failed
    # later without the function's name
    splits = load_mnist1d(patch_size=np.int64(4))
    assert type(splits.patch_size) is int and type(splits.test.input_dim) is int and splits.test.tokens.shape[2] == 4
    assert type(make_mnist1d_noise_ood(2, patch_size=np.int32(2)).input_dim) is int
    for where, make in (("load_mnist1d", load_mnist1d), ("make_mnist1d_noise_ood", partial(make_mnist1d_noise_ood, 2))):
        with pytest.raises(TypeError, match=f"{where}: expected patch_size to be a positive integer, got True"):
            make(patch_size=True)


def test_shifted_test_sets_take_iterators(standard) -> None:
    # a generator of kinds or severities was read up by the checks: no shifted set at all, silently
    splits = load_mnist1d()
    splits = replace(splits, test=replace(splits.test, tokens=splits.test.tokens[:6], labels=splits.test.labels[:6]))
    sets = make_mnist1d_shifted_test_sets(splits, kinds=iter(("shear", "scale")), severities=(s for s in (1, 2)))
    assert sorted(sets) == [("scale", 1), ("scale", 2), ("shear", 1), ("shear", 2)]
    again = make_mnist1d_shifted_test_sets(splits, kinds=("scale",), severities=(2,))
    assert torch.equal(sets[("scale", 2)].tokens, again[("scale", 2)].tokens)
