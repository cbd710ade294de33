"""The toy directed sequence tasks: determinism, balance, masks, and that every label really encodes the direction."""

from __future__ import annotations

import pytest
import torch

from gpattn.data import SequenceDataset, SequenceSplits, make_pointer_task, make_successor_task

SIZES = (101, 40, 60)
MAKERS = [make_pointer_task, make_successor_task]


def _datasets(splits: SequenceSplits) -> list[SequenceDataset]:
    return [splits.train, splits.val, splits.test]


@pytest.mark.parametrize("make", MAKERS)
@pytest.mark.parametrize("min_length", [None, 3])
def test_deterministic_under_a_seed_without_the_global_rng(make, min_length):
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = make(*SIZES, length=10, seed=3, min_length=min_length)
    assert torch.equal(torch.get_rng_state(), state)
    second = make(*SIZES, length=10, seed=3, min_length=min_length)
    other = make(*SIZES, length=10, seed=4, min_length=min_length)
    for a, b, c in zip(_datasets(first), _datasets(second), _datasets(other), strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert (a.mask is None and b.mask is None) or torch.equal(a.mask, b.mask)
        assert not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("make", MAKERS)
def test_shapes_balance_and_masks(make):
    splits = make(*SIZES, length=10, seed=0, min_length=3)
    for dataset, size in zip(_datasets(splits), SIZES, strict=True):
        assert len(dataset) == size and dataset.tokens.shape == (size, 10)
        assert dataset.tokens.dtype == dataset.labels.dtype == torch.long
        assert dataset.num_classes == 2 and dataset.input_dim is None and dataset.description
        assert dataset.labels.sum() == size // 2  # balanced (an odd one out is a 0)
        assert dataset.mask.dtype == torch.bool and dataset.mask.shape == (size, 10)
        lengths = dataset.mask.sum(dim=1)
        assert lengths.min() >= 3 and lengths.max() <= 10 and len(lengths.unique()) > 3
        # a prefix mask: real tokens first, then padding 0, real tokens never 0
        assert torch.equal(dataset.mask, torch.arange(10) < lengths[:, None])
        assert (dataset.tokens[~dataset.mask] == 0).all() and (dataset.tokens[dataset.mask] > 0).all()
        assert dataset.tokens.max() < dataset.vocab_size


def test_fixed_length_has_no_mask():
    for dataset in _datasets(make_pointer_task(*SIZES, length=6, seed=0)):
        assert dataset.mask is None and (dataset.tokens > 0).all()
    assert make_successor_task(*SIZES, length=6, seed=0, min_length=None).train.mask is None


@pytest.mark.parametrize("min_length", [None, 2])
def test_pointer_label_is_the_order_of_a_and_b(min_length):
    for dataset in _datasets(make_pointer_task(*SIZES, length=8, seed=1, min_length=min_length)):
        tokens = dataset.tokens
        assert ((tokens == 1).sum(dim=1) == 1).all() and ((tokens == 2).sum(dim=1) == 1).all()
        position_a, position_b = (tokens == 1).long().argmax(dim=1), (tokens == 2).long().argmax(dim=1)
        assert torch.equal(dataset.labels, (position_a < position_b).long())
        distractors = tokens[tokens > 2]
        assert distractors.max() < dataset.vocab_size and len(distractors.unique()) == dataset.vocab_size - 3
    # the order is the only difference: the unordered position pairs look alike in both classes
    dataset = make_pointer_task(4000, 0, 0, length=8, seed=2).train
    first = torch.minimum((dataset.tokens == 1).long().argmax(1), (dataset.tokens == 2).long().argmax(1)).double()
    assert abs(first[dataset.labels == 1].mean() - first[dataset.labels == 0].mean()) < 0.15


@pytest.mark.parametrize("min_length", [None, 2, 5])
def test_successor_label_is_the_direction_of_the_one_adjacent_pair(min_length):
    num_symbols = 7
    splits = make_successor_task(*SIZES, length=9, seed=1, num_symbols=num_symbols, min_length=min_length)
    for dataset in _datasets(splits):
        assert dataset.vocab_size == num_symbols + 1
        mask = torch.ones_like(dataset.tokens, dtype=torch.bool) if dataset.mask is None else dataset.mask
        symbols = dataset.tokens - 1
        steps = (symbols[:, 1:] - symbols[:, :-1]) % num_symbols  # symbol p -> p + 1
        real_step = mask[:, 1:]
        forward = ((steps == 1) & real_step).sum(dim=1)
        backward = ((steps == num_symbols - 1) & real_step).sum(dim=1)
        assert ((forward + backward) == 1).all(), "exactly one adjacent related pair per sequence"
        assert torch.equal(dataset.labels, forward)
        assert not ((steps == 0) & real_step).any()
    # each symbol is equally frequent in both classes: no content shortcut
    dataset = make_successor_task(4000, 0, 0, length=9, seed=2, num_symbols=num_symbols).train
    for label in (0, 1):
        real = dataset.tokens[(dataset.labels == label)[:, None] & dataset.mask]
        frequencies = torch.bincount(real, minlength=num_symbols + 1)[1:].double() / real.numel()
        assert (frequencies - 1 / num_symbols).abs().max() < 0.01


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (make_pointer_task, {"length": 1}, "length"),
        (make_pointer_task, {"vocab_size": 3}, "vocab_size"),
        (make_pointer_task, {"min_length": 11}, "min_length"),
        (make_pointer_task, {"min_length": 1}, "min_length"),
        (make_successor_task, {"num_symbols": 4}, "num_symbols"),
        (make_successor_task, {"length": 3}, "min_length"),
        (make_successor_task, {"n_val": -1}, "n_val"),
    ],
)
def test_invalid_arguments(make, kwargs, match):
    arguments = {"n_train": 4, "n_val": 2, "n_test": 2, "length": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        make(**arguments)


@pytest.mark.parametrize(
    ("make", "where"), [(make_pointer_task, "make_pointer_task"), (make_successor_task, "make_successor_task")]
)
def test_seeds_up_to_the_largest_torch_generator_seed(make, where):
    # 2**64 used to reach torch.Generator.manual_seed: "Overflow when unpacking long long"
    with pytest.raises(ValueError, match=rf"{where}: expected seed to be a non-negative integer at most 2\*\*64 - 1"):
        make(4, 1, 1, seed=2**64)
    with pytest.raises(ValueError, match=rf"{where}: expected seed to be a non-negative integer, got -1"):
        make(4, 1, 1, seed=-1)
    largest = make(4, 1, 1, seed=2**64 - 1)  # the largest accepted seed works, reproducibly
    assert torch.equal(largest.train.tokens, make(4, 1, 1, seed=2**64 - 1).train.tokens)


@pytest.mark.parametrize("make", MAKERS)
def test_numpy_integers_are_accepted(make):
    # np.int64 sizes were refused with "expected a non-negative integer n_train, got np.int64(6)"
    import numpy as np

    extra = {"vocab_size": 8} if make is make_pointer_task else {"num_symbols": 7}
    plain = make(6, 2, 3, length=8, seed=3, min_length=4, **extra)
    numpy = make(
        np.int64(6),
        np.int32(2),
        np.int64(3),
        length=np.int64(8),
        seed=np.int64(3),
        min_length=np.int64(4),
        **{name: np.int64(value) for name, value in extra.items()},
    )
    for ours, theirs in zip(_datasets(numpy), _datasets(plain), strict=True):
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.mask, theirs.mask)
        assert type(ours.vocab_size) is int and ours.vocab_size == theirs.vocab_size
    with pytest.raises(ValueError, match="expected a non-negative integer n_train, got 1.5"):
        make(1.5, 0, 0)
