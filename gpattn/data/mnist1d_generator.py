"""MNIST-1D's generator (the PyPI package ``mnist1d``) driven reproducibly: the standard data set, sequences
regenerated from the digit templates under chosen generator arguments, the standardisation, and signals cut into
tokens. :mod:`gpattn.data.mnist1d` builds the splits, the shifted test sets and the OOD sets on it (its module
docstring describes the generator and the shifts).

Every function that draws from ``mnist1d``'s transformations, which use NumPy's and ``random``'s global generators,
runs inside :func:`seeded_global_rngs` and leaves the caller's global state as it was.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..validation import InputTypeError, check_choice, check_float, check_int
from .disk_cache import cached_arrays
from .toy_sequences import SequenceDataset

__all__ = ["MNIST1D_LENGTH", "MNIST1D_SHIFT_ARGUMENTS", "make_mnist1d_signals", "signals_to_tokens"]

#: Length of every MNIST-1D sequence (``final_seq_length``).
MNIST1D_LENGTH = 40
#: The generator argument of ``mnist1d.data.get_dataset_args`` that each shift kind raises.
MNIST1D_SHIFT_ARGUMENTS: dict[str, str] = {
    "iid_noise": "iid_noise_scale",
    "correlated_noise": "corr_noise_scale",
    "shear": "shear_scale",
    "translation": "max_translation",
    "scale": "scale_coeff",
}
#: The patch sizes (values per token) that divide the sequence length.
PATCH_SIZES = tuple(p for p in range(1, MNIST1D_LENGTH + 1) if MNIST1D_LENGTH % p == 0)
#: The number of digit templates (classes).
NUM_DIGITS = 10


#: Held while the global generators are seeded: two threads drawing at once interleaved their draws, so that each got
#: other sequences than its seed gives (and the disk cache kept them).
_GLOBAL_RNG_LOCK = threading.RLock()


@contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """Seed NumPy's and ``random``'s global generators (which ``mnist1d`` draws from) and restore them afterwards; one
    thread at a time (other code that draws from the global generators meanwhile still changes the draws)."""
    with _GLOBAL_RNG_LOCK:
        # mnist1d's sequences are those of NumPy's default MT19937: a user's np.random.set_bit_generator(PCG64(...))
        # would give other sequences for the same seed (and the disk cache would keep them under the same key)
        bit_generator = np.random.get_bit_generator()
        own = not isinstance(bit_generator, np.random.MT19937)
        if own:  # its whole state (a cached Gaussian too) comes back after
            user_state = np.random.get_state(legacy=False)
            np.random.set_bit_generator(np.random.MT19937())
        numpy_state, python_state = np.random.get_state(), random.getstate()
        np.random.seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)
            if own:
                np.random.set_bit_generator(bit_generator)
                np.random.set_state(user_state)


def dataset_args(**overrides: Any) -> Any:
    from mnist1d.data import get_dataset_args

    args = get_dataset_args()
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@lru_cache(maxsize=2)
def standard_dataset(shuffle_seq: bool = False) -> dict[str, np.ndarray]:
    """``make_dataset`` with the default arguments (``shuffle_seq`` aside); read-only arrays, cached in the process
    and on disk (:mod:`gpattn.data.disk_cache`)."""
    from mnist1d.data import make_dataset

    def generate() -> dict[str, np.ndarray]:
        with seeded_global_rngs(0):  # make_dataset seeds the global generators itself; this restores them afterwards
            dataset = make_dataset(dataset_args(shuffle_seq=shuffle_seq))
        return {key: np.asarray(dataset[key]) for key in ("x", "y", "x_test", "y_test")}

    arrays = cached_arrays("mnist1d-standard", {"shuffle_seq": shuffle_seq}, generate, __file__)
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


def raw_signals(digits: np.ndarray, seed: int, overrides: dict[str, Any], cache: bool = False) -> np.ndarray:
    """Unstandardised sequences ``(n, 40)`` of the given digits from ``mnist1d``'s transformation, seeded; with
    ``cache``, kept in the disk cache (:mod:`gpattn.data.disk_cache`: about 0.25 ms of Python per sequence to
    generate)."""
    from mnist1d.data import get_templates
    from mnist1d.transform import transform

    if len(digits) == 0:
        return np.empty((0, MNIST1D_LENGTH))

    def generate() -> dict[str, np.ndarray]:
        args = dataset_args(**overrides)
        templates = get_templates()
        with seeded_global_rngs(seed):
            return {"x": np.stack([transform(templates["x"][digit], templates["t"], args)[0] for digit in digits])}

    if not cache:
        return generate()["x"]
    labels = np.ascontiguousarray(digits, dtype=np.int64).tobytes()
    key = {"digits": hashlib.sha256(labels).hexdigest(), "count": len(digits), "seed": int(seed)}
    key["overrides"] = {name: repr(value) for name, value in overrides.items()}  # 5 and 5.0 apart, as the draws
    return cached_arrays("mnist1d-signals", key, generate, __file__)["x"]


@lru_cache(maxsize=1)
def standardisation() -> tuple[float, float]:
    """Mean and standard deviation of the raw standard data set, by which ``make_dataset`` standardises it.

    ``make_dataset`` draws ``num_samples / 10`` sequences of digit 0, then of digit 1, ... from the global generators
    seeded with 42 and standardises all 5000 together; replaying the same draws gives its raw values.
    """
    args = dataset_args()
    per_class = args.num_samples // NUM_DIGITS
    raw = raw_signals(np.repeat(np.arange(NUM_DIGITS), per_class), args.seed, {}, cache=True)
    return float(raw.mean()), float(raw.std())


def check_dtype(dtype: Any, where: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputTypeError(f"{where}: expected dtype to be a floating torch.dtype, got {dtype!r}")
    return dtype


def signals_to_tokens(signals: np.ndarray | Tensor, patch_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Cut signals ``(n, L)`` into ``L / p`` tokens of ``p`` consecutive values.

    :param signals: ``(n, L)`` (NumPy or torch) real numbers.
    :param patch_size: :math:`p`, dividing ``L``.
    :param dtype: Floating dtype of the tokens.
    :return: Tokens ``(n, L / p, p)`` (a tensor stays on its device, in its autograd graph); ``tokens.reshape(n, L)``
        is the input.
    """
    check_dtype(dtype, "signals_to_tokens")
    # a tensor as it is: through NumPy, a CUDA tensor or one that requires grad was a RuntimeError
    values = signals if isinstance(signals, Tensor) else torch.as_tensor(np.asarray(signals))
    if values.dtype == torch.bool or values.is_complex():  # True / False read as 1 / 0
        raise InputTypeError(f"signals_to_tokens: expected real-valued signals, got {values.dtype}")
    values = values.to(dtype)
    if values.dim() != 2:
        raise ValueError(f"expected signals of shape (n, L), got {tuple(values.shape)}")
    p = check_int("patch_size", patch_size)
    if values.shape[1] % p:
        raise ValueError(f"expected patch_size to divide the signal length {values.shape[1]}, got {p}")
    return values.reshape(values.shape[0], values.shape[1] // p, p)


def sequence_dataset(
    signals: np.ndarray, labels: np.ndarray, num_classes: int, patch_size: int, dtype: torch.dtype, text: str
) -> SequenceDataset:
    return SequenceDataset(
        signals_to_tokens(signals, patch_size, dtype),
        torch.tensor(labels, dtype=torch.int64),  # a copy: sets made from one split's labels do not share them
        None,
        num_classes,
        None,
        patch_size,
        f"{text}; tokens of {patch_size} consecutive values",
    )


def make_mnist1d_signals(
    digits: Sequence[int] | np.ndarray | Tensor, seed: int = 0, *, cache: bool = False, **generator_arguments: Any
):
    """Fresh MNIST-1D sequences of the given digits from ``mnist1d``'s generator, standardised as the standard set.

    :param digits: The digit (template) of every sequence, ``(n,)`` in ``0..9``.
    :param seed: Seed of the generator's draws.
    :param cache: Keep the sequences in the disk cache (:mod:`gpattn.data.disk_cache`), for sets that many processes
        draw alike (the shifted test sets do); off by default, so that fresh draws (a new seed per call) do not fill
        the disk.
    :param generator_arguments: Values replacing the defaults of ``get_dataset_args`` among
        ``MNIST1D_SHIFT_ARGUMENTS.values()`` (e.g. ``iid_noise_scale=0.3``); none gives draws from the training
        distribution.
    :return: ``float64`` NumPy array ``(n, 40)``.
    """
    # a Python int: random.seed refuses NumPy's integers
    seed = check_int("seed", seed, minimum=0, maximum=2**32 - 1, where="make_mnist1d_signals")
    if not isinstance(cache, bool):
        raise InputTypeError(f"make_mnist1d_signals: expected cache to be True or False, got {cache!r}")
    values = np.asarray(digits.cpu() if isinstance(digits, Tensor) else digits)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise InputTypeError(f"expected digits to be integers of shape (n,), got {values.dtype} {values.shape}")
    if values.size and (values.min() < 0 or values.max() >= NUM_DIGITS):
        raise ValueError(f"expected digits in 0..9, got values in [{values.min()}, {values.max()}]")
    # the checked values as Python numbers: a one-element tensor passed the checks, then failed in mnist1d or, its repr
    # rounded to 4 digits in the cache key, read the entry of another value
    overrides = {}
    for name, value in generator_arguments.items():
        check_choice("generator argument", name, tuple(MNIST1D_SHIFT_ARGUMENTS.values()), where="make_mnist1d_signals")
        if name == "max_translation":
            overrides[name] = check_int(name, value, minimum=1, maximum=72, where="make_mnist1d_signals")
        else:
            maximum = 2.0 if name == "scale_coeff" else None
            overrides[name] = check_float(name, value, 0.0, maximum, where="make_mnist1d_signals")
    mean, std = standardisation()
    return (raw_signals(values, seed, overrides, cache=cache) - mean) / std
