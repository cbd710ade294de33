r"""Toy sequence classification tasks whose label depends on the *direction* of a relation between two tokens.

Both tasks put one related pair of tokens in every sequence and let the label say which way round it appears, so a
model that only knows *whether* two tokens are related, not which one comes first, is at chance:

* :func:`make_pointer_task`: one source token ``a`` and one target token ``b`` among distractors; label 1 iff ``a``
  comes before ``b`` (``a ... b``), label 0 for ``b ... a``.
* :func:`make_successor_task`: a hidden directed cycle ``succ(t) = t + 1 (mod V)`` on the symbols; every sequence
  holds exactly one adjacent related pair, label 1 iff it reads ``t, succ(t)`` (forward), label 0 for
  ``succ(t), t`` (backward).

Why a symmetric kernel struggles: attention with :math:`k(x, y) = k(y, x)` on token content gives the related pair
the same score whichever token comes first, so the direction has to be recovered from the positional embeddings
alone, whereas an asymmetric kernel :math:`\kappa(x, z) \neq \kappa(z, x)` can score "``a`` attends to a later
``b``" differently from its reverse.

Token id 0 is padding. With ``min_length`` set, sequence lengths are uniform on ``[min_length, length]``, padded
with 0 to ``length``, and ``mask`` (``True`` = real token) is returned. Classes are balanced within every split
(``n // 2`` of its ``n`` sequences have label 1). All randomness comes from a local ``torch.Generator`` seeded with
``seed`` (the global RNG is never touched); the splits are drawn one after the other from it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..validation import InputTypeError, check_seed

__all__ = ["SequenceDataset", "SequenceSplits", "make_pointer_task", "make_successor_task"]

PAD = 0


@dataclass(frozen=True)
class SequenceDataset:
    """A sequence classification data set.

    Attributes:
        tokens: Token ids ``(n, N)`` (int64, 0 = padding) or float vectors ``(n, N, d)``.
        labels: Class indices ``(n,)`` (int64).
        mask: ``None`` (every sequence has ``N`` real tokens) or a boolean ``(n, N)`` mask, ``True`` = real token.
        num_classes: Number of classes.
        vocab_size: Number of token ids including padding (``None`` for vector inputs).
        input_dim: Feature width ``d`` of vector inputs (``None`` for token ids).
        description: What the label means.
    """

    tokens: Tensor
    labels: Tensor
    mask: Tensor | None
    num_classes: int
    vocab_size: int | None
    input_dim: int | None
    description: str

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass(frozen=True)
class SequenceSplits:
    """Train, validation and test :class:`SequenceDataset` s of one task."""

    train: SequenceDataset
    val: SequenceDataset
    test: SequenceDataset


def _is_integer(value: object) -> bool:
    """A Python or NumPy integer (``numbers.Integral``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _error(value) -> type[ValueError]:
    # a value of another type is an InputTypeError (a TypeError and a ValueError), one out of range a ValueError, as
    # the other data sets' checks raise them
    return ValueError if _is_integer(value) else InputTypeError


def _check_sizes(
    n_train: int, n_val: int, n_test: int, length: int, min_length: int | None, shortest: int
) -> tuple[int, int, int, int, int | None]:
    """The sizes as Python ints, or a ``ValueError`` naming the argument."""
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if not _is_integer(value) or value < 0:
            raise _error(value)(f"expected a non-negative integer {name}, got {value!r}")
    if not _is_integer(length) or length < shortest:
        raise _error(length)(f"expected an integer length >= {shortest}, got {length!r}")
    if min_length is not None and (not _is_integer(min_length) or not shortest <= min_length <= length):
        raise _error(min_length)(
            f"expected min_length in [{shortest}, length={length}] or None (fixed length), got {min_length!r}"
        )
    return int(n_train), int(n_val), int(n_test), int(length), None if min_length is None else int(min_length)


def _balanced_labels(count: int, generator: torch.Generator) -> Tensor:
    """``count`` labels, ``count // 2`` ones and the rest zeros, in random order."""
    return (torch.arange(count) % 2)[torch.randperm(count, generator=generator)]


def _lengths(count: int, length: int, min_length: int | None, generator: torch.Generator) -> Tensor:
    if min_length is None:
        return torch.full((count,), length, dtype=torch.long)
    return torch.randint(min_length, length + 1, (count,), generator=generator)


def _make_splits(
    sizes: tuple[int, int, int],
    length: int,
    min_length: int | None,
    seed: int,
    draw: Callable[[Tensor, Tensor, torch.Generator], Tensor],
    vocab_size: int,
    description: str,
    where: str,
) -> SequenceSplits:
    """Draw each split's balanced labels and lengths, then ``draw(labels, lengths, generator) -> tokens (n, N)``
    (padding left to this function)."""
    generator = torch.Generator().manual_seed(check_seed("seed", seed, where=where))
    datasets = []
    for count in sizes:
        labels = _balanced_labels(count, generator)
        lengths = _lengths(count, length, min_length, generator)
        real = torch.arange(length) < lengths[:, None]  # shape: (n, N)
        tokens = torch.where(real, draw(labels, lengths, generator), PAD)
        datasets.append(
            SequenceDataset(tokens, labels, None if min_length is None else real, 2, vocab_size, None, description)
        )
    return SequenceSplits(*datasets)


def make_pointer_task(
    n_train: int,
    n_val: int,
    n_test: int,
    length: int = 12,
    seed: int = 0,
    *,
    vocab_size: int = 16,
    min_length: int | None = None,
) -> SequenceSplits:
    """Does the source token come before the target token? A directed relation between two positions.

    Vocabulary: 0 padding, 1 the source ``a``, 2 the target ``b``, ``3 .. vocab_size - 1`` distractors (uniform).
    Every sequence holds exactly one ``a`` and one ``b`` at two distinct real positions (uniform); label 1 iff the
    ``a`` is before the ``b``. The pair of positions has the same distribution in both classes, so only their order
    tells the classes apart.

    The three splits are drawn independently, so short sequences repeat across them when the space of sequences is
    small: with the comparison's lengths 4-8 and vocabulary 8 (``gpattn.comparison.load_task("pointer")``), 91 of its
    512 test sequences (72 of the 103 of length 4) and 46 of its 256 validation sequences equal a training sequence.
    A model can recall those: the pointer task checks that attentions learn a directed relation (``--quick``, the
    tests, notebook 03), not how they generalise or are calibrated.

    :param n_train: Training sequences.
    :param n_val: Validation sequences.
    :param n_test: Test sequences.
    :param length: Padded length ``N`` (at least 2).
    :param seed: Seed of the local generator, in ``[0, 2**64 - 1]``.
    :param vocab_size: Token ids including padding, ``a`` and ``b`` (at least 4).
    :param min_length: ``None`` for fixed-length sequences (``mask`` is ``None``), else the shortest length.
    :return: The three splits.
    """
    n_train, n_val, n_test, length, min_length = _check_sizes(n_train, n_val, n_test, length, min_length, shortest=2)
    if not _is_integer(vocab_size) or vocab_size < 4:
        raise _error(vocab_size)(f"expected an integer vocab_size >= 4 (pad, a, b, one distractor), got {vocab_size!r}")
    vocab_size = int(vocab_size)

    def draw(labels: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        count = labels.shape[0]
        tokens = torch.randint(3, vocab_size, (count, length), generator=generator)
        # two distinct real positions, uniform: the two smallest of i.i.d. uniform keys, padding keyed last
        keys = torch.rand(count, length, generator=generator).masked_fill(torch.arange(length) >= lengths[:, None], 2)
        first, second = keys.argsort(dim=1)[:, :2].sort(dim=1).values.unbind(dim=1)
        rows = torch.arange(count)
        tokens[rows, first] = torch.where(labels == 1, 1, 2)
        tokens[rows, second] = torch.where(labels == 1, 2, 1)
        return tokens

    description = "label 1 iff token 1 (a) comes before token 2 (b); one of each among distractors 3.."
    return _make_splits(
        (n_train, n_val, n_test), length, min_length, seed, draw, vocab_size, description, "make_pointer_task"
    )


def make_successor_task(
    n_train: int,
    n_val: int,
    n_test: int,
    length: int = 12,
    seed: int = 0,
    *,
    num_symbols: int = 10,
    min_length: int | None = 4,
) -> SequenceSplits:
    """Is the one adjacent related pair read forwards along a hidden directed cycle?

    Symbols ``t = 0 .. V - 1`` (``V`` = ``num_symbols``) have token ids ``t + 1`` (0 is padding, so
    ``vocab_size = V + 1``) and a hidden successor ``succ(t) = t + 1 mod V``. A sequence is a walk on the cycle: the
    first symbol is uniform and each next symbol is the previous plus a step, uniform on ``{2, .., V - 2}`` (never
    related, never a repeat), except at one uniform position ``i`` where the step is ``+1`` (label 1: the adjacent
    pair ``t, succ(t)``) or ``-1`` (label 0: ``succ(t), t``, the relation read backwards). So every sequence holds
    exactly one *adjacent* related pair; related tokens at non-adjacent positions are common in both classes and
    carry no information. Each symbol has the same marginal distribution in both classes.

    :param n_train: Training sequences.
    :param n_val: Validation sequences.
    :param n_test: Test sequences.
    :param length: Padded length ``N`` (at least 2).
    :param seed: Seed of the local generator, in ``[0, 2**64 - 1]``.
    :param num_symbols: ``V`` (at least 5, so that unrelated steps exist beside ``0, +1, -1``).
    :param min_length: The shortest length (variable lengths, padded, with a ``mask``; default 4), or ``None`` for
        fixed-length sequences without a mask.
    :return: The three splits.
    """
    n_train, n_val, n_test, length, min_length = _check_sizes(n_train, n_val, n_test, length, min_length, shortest=2)
    if not _is_integer(num_symbols) or num_symbols < 5:
        raise _error(num_symbols)(f"expected an integer num_symbols >= 5, got {num_symbols!r}")
    num_symbols = int(num_symbols)

    def draw(labels: Tensor, lengths: Tensor, generator: torch.Generator) -> Tensor:
        count = labels.shape[0]
        steps = torch.randint(2, num_symbols - 1, (count, length - 1), generator=generator)  # step p: p -> p + 1
        pair_step = (torch.rand(count, generator=generator) * (lengths - 1)).long()  # uniform on [0, L - 2]
        steps[torch.arange(count), pair_step] = torch.where(labels == 1, 1, -1)
        start = torch.randint(0, num_symbols, (count, 1), generator=generator)
        symbols = torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % num_symbols
        return symbols + 1

    description = f"label 1 iff the one adjacent pair (t, t+1 mod {num_symbols}) is forward; ids = symbol + 1"
    return _make_splits(
        (n_train, n_val, n_test), length, min_length, seed, draw, num_symbols + 1, description, "make_successor_task"
    )
