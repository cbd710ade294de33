r"""MNIST-1D (Greydanus, "Scaling down deep learning", 2020, arXiv 2011.14439) as token sequences, with distribution
shifts regenerated from the data set's own generator, its spatially shuffled variant, and OOD sequences.

The data come from the PyPI package ``mnist1d``, which generates them locally: ``mnist1d.data.make_dataset`` with the
default ``getdataset_args()`` (5000 sequences, seed 42) gives the standard split of 4000 training and 1000 test
sequences of length 40, identical to the published pickle. Nothing is downloaded (``get_dataset``, which downloads,
is never called). Each sequence is one of ten 12-point digit templates, padded with 36 to 60 zeros, dilated to 72
points, scaled by a factor uniform on :math:`1 \pm` ``scale_coeff`` / 2, translated circularly by an integer uniform
on ``[0, max_translation)``, its zero background filled with correlated noise (``corr_noise_scale`` times white noise
smoothed by a Gaussian of 2 samples), plus i.i.d. noise (std ``iid_noise_scale``), sheared by a linear ramp of slope
uniform on :math:`\pm` ``shear_scale`` / 2 and subsampled to 40 points; the whole set is then standardised by its
global mean and standard deviation.
The calls into ``mnist1d`` (the standard data set, regenerated sequences, the standardisation, tokens) live in
:mod:`gpattn.data.mnist1d_generator`; this module builds the splits and the test sets on them.

* :func:`load_mnist1d`: train / validation / test as :class:`~gpattn.data.SequenceDataset` s of float tokens. The
  test split is the standard 1000 sequences; the validation split is carved from the standard 4000 training
  sequences, stratified by class and seeded. Each length-40 signal becomes :math:`40 / p` tokens of :math:`p`
  consecutive values (``patch_size`` :math:`p`, default 4: 10 tokens of width 4, so that the attention layers see
  sequences of length 10, as a ViT sees patches; a softmax Transformer of 2 blocks of width 32 trained for 20 epochs
  reached 75 / 82 / 75 % test accuracy with p = 2 / 4 / 8), for :class:`~gpattn.models.Transformer` with
  ``input="vectors"``, ``input_dim=p`` and ``max_len=40 / p``. ``tokens.reshape(n, 40)`` gives the signals back.
  Classes held out (``held_out_classes``, none by default, so that accuracies compare with the published ones) form
  a semantic OOD set.
* :func:`make_mnist1d_shifted_test_sets`: covariate shift at severities 1 to 5, by *regenerating* every test
  sequence (same class) with one generator parameter raised above its training value (``MNIST1D_SHIFT_PARAMETERS``;
  the training value is the default of ``mnist1d.data.getdataset_args``):

  ====================  =========================  =======  =====  =====  =====  =====  =====
  kind                  generator argument         default    1      2      3      4      5
  ====================  =========================  =======  =====  =====  =====  =====  =====
  ``iid_noise``         ``iid_noise_scale``         0.02    0.04   0.06   0.08   0.11   0.15
  ``correlated_noise``  ``corr_noise_scale``        0.25    0.30   0.35   0.40   0.50   0.65
  ``shear``             ``shear_scale``             0.75    1.25   1.75   2.50   3.25   4.25
  ``translation``       ``max_translation``         48      52     56     60     66     72
  ``scale``             ``scale_coeff``             0.4     0.6    0.9    1.2    1.5    1.8
  ====================  =========================  =======  =====  =====  =====  =====  =====

  The noise scales are on the generator's raw scale (the templates have standard deviation 1/6; the standardisation
  divides by about 0.155). Training shifts stay below 48 of the 72 dilated positions, so a larger ``max_translation``
  puts digits where no training digit is, and from about 55 on (a digit spans 12 to 18 positions) wraps them around
  the end of the sequence. ``scale_coeff`` stays below 2, so the scale factor stays positive. The regenerated
  sequences are standardised with the mean and standard deviation of the standard data set (not their own, which
  would undo part of the shift). On the full test split an RBF support vector machine trained on the clean training
  split (64 % clean test accuracy, 65 % on the test split regenerated without shift) falls to 55/44/42/52/49 % at
  severity 3 and to 39/25/30/46/45 % at severity 5 (``iid_noise``, ``correlated_noise``, ``shear``,
  ``translation``, ``scale``).
* :func:`make_mnist1d_shuffled_test_set`: the spatially shuffled variant, the test split of ``make_dataset`` with
  ``shuffle_seq=True`` (one fixed permutation of the 40 positions, shared by all sequences): a separate shift that
  keeps every value and destroys the spatial order.
* :func:`make_mnist1d_noise_ood`: sequences without a digit (see there), and :func:`mnist1d_noise_families`:
  them by family, one OOD set each.

Randomness: the validation split uses a local ``numpy.random.Generator``; the regenerated sequences use ``mnist1d``'s
own transformations, which draw from NumPy's global generator, so they run with that generator seeded and restore
its state (and the ``random`` module's, which ``mnist1d`` seeds too) afterwards: the caller's global RNGs are left
as they were.

.. note:: ``make_dataset`` costs about 2 s (5000 sequences); regenerating sequences costs about 0.25-0.5 ms each
    on an idle core, so the 25 default shifted test sets of 1000 sequences take several seconds. Both are kept in
    the disk cache (:mod:`gpattn.data.disk_cache`; ``GPATTN_CACHE_DIR=off`` turns it off): a process reads what
    another generated, bit for bit. Still, generate them once per comparison, not per trained model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..validation import InputTypeError, check_choice, check_digits, check_float, check_int, check_seed, check_sequence
from .mnist1d_generator import (
    MNIST1D_LENGTH,
    MNIST1D_SHIFT_ARGUMENTS,
    NUM_DIGITS,
    PATCH_SIZES,
    check_dtype,
    dataset_args,
    make_mnist1d_signals,
    seeded_global_rngs,
    sequence_dataset,
    signals_to_tokens,
    standard_dataset,
    standardisation,
)
from .toy_sequences import SequenceDataset

__all__ = [
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
]

#: The shift kinds of :func:`make_mnist1d_shifted_test_sets`, in the order of the comparison's figures.
MNIST1D_SHIFT_KINDS: tuple[str, ...] = tuple(MNIST1D_SHIFT_ARGUMENTS)
#: Value of each kind's generator argument at severities 1 to 5 (the training values are 0.02, 0.25, 0.75, 48, 0.4).
MNIST1D_SHIFT_PARAMETERS: dict[str, tuple[float, ...]] = {
    "iid_noise": (0.04, 0.06, 0.08, 0.11, 0.15),
    "correlated_noise": (0.30, 0.35, 0.40, 0.50, 0.65),
    "shear": (1.25, 1.75, 2.50, 3.25, 4.25),
    "translation": (52, 56, 60, 66, 72),
    "scale": (0.6, 0.9, 1.2, 1.5, 1.8),
}
#: The families of :func:`make_mnist1d_noise_ood`, indexed by its labels.
MNIST1D_NOISE_FAMILIES: tuple[str, ...] = ("background", "random_template", "smooth_noise")


@dataclass(frozen=True)
class MNIST1DSplits:
    """Train, validation and test splits of MNIST-1D as token sequences, and the held-out classes as an OOD set.

    Attributes:
        train: Training split: float tokens ``(n, 40 / p, p)``, labels ``(n,)`` (in-distribution classes only).
        val: Validation split, carved from the standard training sequences.
        test: The standard test split (its in-distribution classes).
        ood_classes: The standard test sequences of the held-out classes (label ``k`` is digit
            ``held_out_classes[k]``), or ``None`` when no class is held out.
        held_out_classes: The held-out digits, ``()`` when none.
        label_map: Digit -> in-distribution label, for the kept digits.
        patch_size: Values per token :math:`p`.
        train_indices: Rows of the standard 4000 training sequences (``make_dataset(...)["x"]``) in ``train``.
        val_indices: Rows of the standard training sequences in ``val``.
    """

    train: SequenceDataset
    val: SequenceDataset
    test: SequenceDataset
    ood_classes: SequenceDataset | None
    held_out_classes: tuple[int, ...]
    label_map: dict[int, int]
    patch_size: int
    train_indices: np.ndarray
    val_indices: np.ndarray


def load_mnist1d(
    seed: int = 0,
    val_fraction: float = 0.1,
    patch_size: int = 4,
    held_out_classes: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> MNIST1DSplits:
    """The standard MNIST-1D split (``mnist1d.data.make_dataset(getdataset_args())``) as token sequences.

    The test split is the standard ``x_test`` / ``y_test`` in their order; the standard training sequences are split
    by class: within every kept digit the rows are permuted by ``numpy.random.default_rng(seed)`` and the first
    ``round(val_fraction n_c)`` go to validation; both splits keep the standard order. With ``val_fraction=0`` the
    training split is exactly ``x`` / ``y``. Held-out digits are removed from the three splits, the kept digits are
    re-indexed ``0 .. K-1`` in increasing order (``label_map``), and the held-out test sequences form ``ood_classes``.

    :param seed: Seed of the validation split (the data themselves are always the standard ones, seed 42).
    :param val_fraction: Fraction of every kept class of the training sequences for validation, in ``[0, 1)``.
    :param patch_size: Values per token :math:`p`, a divisor of 40 (default 4: 10 tokens of width 4).
    :param held_out_classes: Digits to hold out as OOD, e.g. ``(8, 9)``; ``None`` (default) for all ten classes.
    :param dtype: Floating dtype of the tokens (``torch.float64`` keeps ``make_dataset``'s values bit for bit).
    :return: The splits, the OOD set of held-out classes and the bookkeeping.
    """
    check_seed("seed", seed, where="load_mnist1d")
    check_float("val_fraction", val_fraction, 0.0, 1.0, strict_maximum=True, where="load_mnist1d")
    # a Python int (a NumPy one reached MNIST1DSplits.patch_size and input_dim; True passed as 1)
    patch_size = check_int("patch_size", patch_size, where="load_mnist1d")
    check_choice("patch_size", patch_size, PATCH_SIZES, where="load_mnist1d")
    check_dtype(dtype, "load_mnist1d")
    held = check_digits("held_out_classes", held_out_classes)
    if len(set(held)) != len(held) or len(held) > NUM_DIGITS - 2:
        raise ValueError(f"expected at most 8 distinct held-out digits (2 classes must remain), got {held!r}")

    data = standard_dataset()
    kept = [c for c in range(NUM_DIGITS) if c not in held]
    label_map = {digit: index for index, digit in enumerate(kept)}
    lookup = np.full(NUM_DIGITS, -1, dtype=np.int64)
    lookup[kept] = np.arange(len(kept))
    rng = np.random.default_rng(seed)
    val_parts = []
    for digit in kept:
        members = rng.permutation(np.flatnonzero(data["y"] == digit))
        val_parts.append(members[: round(val_fraction * len(members))])
    val_indices = np.sort(np.concatenate(val_parts))
    train_indices = np.setdiff1d(np.flatnonzero(np.isin(data["y"], kept)), val_indices)
    missing = sorted(set(kept) - set(np.unique(data["y"][train_indices]).tolist()))
    if missing:  # a large fraction rounds whole classes away
        raise ValueError(
            f"load_mnist1d: val_fraction={val_fraction} leaves no training example of the digit(s) {missing}; use a "
            "smaller fraction"
        )
    test_rows = np.flatnonzero(np.isin(data["y_test"], kept))

    held_text = f", digits {', '.join(map(str, held))} held out" if held else ""
    source = f"MNIST-1D (mnist1d.make_dataset, default arguments){held_text}"
    train, val = (
        sequence_dataset(
            data["x"][rows], lookup[data["y"][rows]], len(kept), patch_size, dtype, f"{source}, {name} (seed {seed})"
        )
        for name, rows in (("train", train_indices), ("validation", val_indices))
    )
    test = sequence_dataset(
        data["x_test"][test_rows], lookup[data["y_test"][test_rows]], len(kept), patch_size, dtype, f"{source}, test"
    )
    ood = None
    if held:
        rows = np.flatnonzero(np.isin(data["y_test"], held))
        ood_lookup = np.full(NUM_DIGITS, -1, dtype=np.int64)
        ood_lookup[list(held)] = np.arange(len(held))
        ood = sequence_dataset(
            data["x_test"][rows],
            ood_lookup[data["y_test"][rows]],
            len(held),
            patch_size,
            dtype,
            f"MNIST-1D test sequences of the held-out digits {held} (semantic OOD); label k is digit {held}[k]",
        )
    return MNIST1DSplits(train, val, test, ood, held, label_map, patch_size, train_indices, val_indices)


def _sub_seed(*entropy: int) -> int:
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def _test_digits(splits: MNIST1DSplits) -> np.ndarray:
    if not isinstance(splits, MNIST1DSplits):
        raise InputTypeError(f"expected splits from load_mnist1d (MNIST1DSplits), got {type(splits).__name__}")
    digit_of = {label: digit for digit, label in splits.label_map.items()}
    return np.array([digit_of[int(label)] for label in splits.test.labels], dtype=np.int64)


def make_mnist1d_shifted_test_sets(
    splits: MNIST1DSplits,
    seed: int = 0,
    kinds: Sequence[str] = MNIST1D_SHIFT_KINDS,
    severities: Sequence[int] = (1, 2, 3, 4, 5),
) -> dict[tuple[str, int], SequenceDataset]:
    """The test split regenerated under covariate shift: every test sequence is drawn anew from its digit's template
    with one generator argument raised to ``MNIST1D_SHIFT_PARAMETERS[kind][severity - 1]`` (table in the module
    docstring), the others at their training values.

    Labels, class count and patch size are those of ``splits.test``. Each (kind, severity) draws from its own seed,
    derived from ``seed``, the kind and the severity by ``numpy.random.SeedSequence``.

    :param splits: From :func:`load_mnist1d`.
    :param seed: Base seed, in ``[0, 2**64 - 1]`` (use one fixed seed for every trained model, so that all are tested
        on the same sets).
    :param kinds: Shift kinds (default all of ``MNIST1D_SHIFT_KINDS``).
    :param severities: Severities in ``1 .. 5``.
    :return: ``{(kind, severity): SequenceDataset}``.
    """
    digits = _test_digits(splits)
    check_seed("seed", seed, where="make_mnist1d_shifted_test_sets")  # the range of every seed of gpattn
    check_sequence("kinds", kinds, "('shear',)", where="make_mnist1d_shifted_test_sets")
    check_sequence("severities", severities, "(1, 3)", where="make_mnist1d_shifted_test_sets")
    kinds, severities = tuple(kinds), tuple(severities)  # iterators: the loops below read them more than once
    for kind in kinds:
        check_choice("kinds", kind, MNIST1D_SHIFT_KINDS, where="make_mnist1d_shifted_test_sets")
    for severity in severities:
        check_int("severities", severity, minimum=1, maximum=5, where="make_mnist1d_shifted_test_sets")
    test = splits.test
    shifted = {}
    for kind in kinds:
        argument = MNIST1D_SHIFT_ARGUMENTS[kind]
        for severity in severities:
            value = MNIST1D_SHIFT_PARAMETERS[kind][severity - 1]
            sub_seed = _sub_seed(seed, MNIST1D_SHIFT_KINDS.index(kind), severity)
            signals = make_mnist1d_signals(digits, sub_seed, cache=True, **{argument: value})
            shifted[(kind, severity)] = sequence_dataset(
                signals,
                test.labels.numpy(),
                test.num_classes,
                splits.patch_size,
                test.tokens.dtype,
                f"MNIST-1D test split regenerated with {argument}={value} (shift {kind}, severity {severity})",
            )
    return shifted


def make_mnist1d_shuffled_test_set(splits: MNIST1DSplits) -> SequenceDataset:
    """The spatially shuffled variant of the test split: ``make_dataset`` with ``shuffle_seq=True`` (its one fixed
    permutation of the 40 positions), restricted to the in-distribution classes in the order of ``splits.test``.

    :param splits: From :func:`load_mnist1d`.
    :return: The same sequences as ``splits.test`` with their positions permuted, same labels.
    """
    digits = _test_digits(splits)
    data = standard_dataset(shuffle_seq=True)
    kept = np.isin(data["y_test"], sorted(splits.label_map))
    if not np.array_equal(data["y_test"][kept], digits):  # a cut or reordered test split: tokens and labels apart
        raise ValueError(
            f"make_mnist1d_shuffled_test_set: expected splits.test to be the standard test split of load_mnist1d "
            f"({int(kept.sum())} sequences of the kept digits, in their order), got {len(splits.test)} sequences whose "
            f"labels differ; shuffle first, then cut both alike"
        )
    return sequence_dataset(
        data["x_test"][kept],
        splits.test.labels.numpy(),
        splits.test.num_classes,
        splits.patch_size,
        splits.test.tokens.dtype,
        "MNIST-1D test split, spatially shuffled (make_dataset with shuffle_seq=True)",
    )


def make_mnist1d_noise_ood(
    n: int, seed: int = 0, patch_size: int = 4, dtype: torch.dtype = torch.float32
) -> SequenceDataset:
    """Sequences without a digit, standardised as the standard set. Sequence ``i`` belongs to family ``i mod 3``
    (its label, indexing ``MNIST1D_NOISE_FAMILIES``):

    * ``background``: the generator's output for a flat template (all zeros): the same padding, scaling,
      translation, correlated and i.i.d. noise and shear as the digits, but nothing to classify;
    * ``random_template``: the generator's output for a random 12-point template (a Gaussian random walk, normalised
      as ``mnist1d`` normalises its digit templates: zero mean, unit standard deviation, starting at 0, divided by
      6): an unseen shape under the training distribution's transformations;
    * ``smooth_noise``: white noise smoothed by a Gaussian of standard deviation uniform on ``[1, 3]`` positions,
      scaled to zero mean and unit standard deviation per sequence (the standardised data's scale).

    :param n: Number of sequences.
    :param seed: Seed, in ``[0, 2**64 - 1]``.
    :param patch_size: Values per token, as in :func:`load_mnist1d`.
    :param dtype: Floating dtype of the tokens.
    :return: ``SequenceDataset`` of ``n`` sequences, 3 classes (the families).
    """
    from mnist1d.data import get_templates
    from mnist1d.transform import transform
    from scipy.ndimage import gaussian_filter1d

    check_int("n", n, minimum=0, where="make_mnist1d_noise_ood")
    seed = check_seed("seed", seed, where="make_mnist1d_noise_ood")  # a Python int (random.seed refuses NumPy's)
    # a Python int (a NumPy one reached MNIST1DSplits.patch_size and input_dim; True passed as 1)
    patch_size = check_int("patch_size", patch_size, where="make_mnist1d_noise_ood")
    check_choice("patch_size", patch_size, PATCH_SIZES, where="make_mnist1d_noise_ood")
    check_dtype(dtype, "make_mnist1d_noise_ood")
    mean, std = standardisation()
    args = dataset_args()
    time_axis = get_templates()["t"]
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(MNIST1D_NOISE_FAMILIES)
    signals = np.empty((n, MNIST1D_LENGTH))
    # NumPy's global generator takes 32-bit seeds: a larger one is folded into one (those below keep their draws)
    with seeded_global_rngs(seed if seed < 2**32 else _sub_seed(seed)):
        for i, family in enumerate(labels):
            if family == 2:
                noise = gaussian_filter1d(rng.standard_normal(MNIST1D_LENGTH), rng.uniform(1.0, 3.0), mode="wrap")
                signals[i] = (noise - noise.mean()) / noise.std()
                continue
            template = np.zeros(len(time_axis))
            if family == 1:
                walk = np.cumsum(rng.standard_normal(len(time_axis)))
                walk = (walk - walk.mean()) / walk.std()
                template = (walk - walk[0]) / 6.0
            signals[i] = (transform(template, time_axis, args)[0] - mean) / std
    return sequence_dataset(
        signals,
        labels,
        len(MNIST1D_NOISE_FAMILIES),
        patch_size,
        dtype,
        f"MNIST-1D-like sequences without a digit (background, random template, smooth noise), seed {seed}; "
        f"label k is family MNIST1D_NOISE_FAMILIES[k]",
    )


def mnist1d_noise_families(ood: SequenceDataset) -> dict[str, SequenceDataset]:
    """The sequences of :func:`make_mnist1d_noise_ood` split by family, one OOD set per family.

    :param ood: From :func:`make_mnist1d_noise_ood` (its label is the family's index in ``MNIST1D_NOISE_FAMILIES``).
    :return: ``MNIST1D_NOISE_FAMILIES[k]`` -> the sequences of label ``k``, in their order (every label keeps its
        value ``k``, so that the families pooled again are the labels of ``ood``); a family without a sequence (fewer
        than 3 sequences) is left out.
    """
    if not isinstance(ood, SequenceDataset) or ood.num_classes != len(MNIST1D_NOISE_FAMILIES):
        raise InputTypeError(
            f"expected the SequenceDataset of make_mnist1d_noise_ood ({len(MNIST1D_NOISE_FAMILIES)} families), got "
            f"{type(ood).__name__}"
        )
    families = {}
    for label, name in enumerate(MNIST1D_NOISE_FAMILIES):
        rows = ood.labels == label
        if rows.any():
            families[name] = dataclasses.replace(
                ood, tokens=ood.tokens[rows], labels=ood.labels[rows], description=f"{ood.description}; family {name}"
            )
    return families
