"""Separate random streams for the Monte Carlo draws of a run's evaluation.

Every data set a run evaluates (the validation split that the temperature is fitted on, the test split, each shifted
and each OOD set) draws its Monte Carlo samples (GP attention samples, dropout masks, Laplace draws) from a stream of
its own, seeded from the run's seed and the set's name alone (:func:`stream_seed`). So the temperature of a ``+ts``
row depends on the validation split and the seed only (not on how many test, shifted or OOD inputs were evaluated
before it), and the draws of one set do not depend on any other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..validation import check_int

__all__ = ["random_stream", "seeded_generators", "stream_seed"]


def stream_seed(seed: int, name: str) -> int:
    """The seed of the stream ``name`` (e.g. ``"val"``, ``"test"``, ``"shift/blur/3"``, ``"ood/noise"``) of a run
    with ``seed``: the first 63 bits of the SHA-256 of ``"<seed>/<name>"`` (distinct names give unrelated streams).

    Example:
        >>> stream_seed(0, "val") == stream_seed(0, "val") != stream_seed(0, "test")
        True
    """
    check_int("seed", seed, minimum=0, where="stream_seed")
    if not isinstance(name, str) or not name:
        raise ValueError(f"stream_seed: expected a non-empty stream name, got {name!r}")
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@contextmanager
def random_stream(seed: int, name: str) -> Iterator[None]:
    """Inside the block, the global torch generators (CPU and, once CUDA is in use, every CUDA device) are seeded
    with :func:`stream_seed` ``(seed, name)``; afterwards they are restored, so that the caller's draws continue as
    if the block had not run (:func:`seeded_generators`)."""
    with seeded_generators(stream_seed(seed, name)):
        yield


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """Inside the block, torch's global generators are seeded with ``seed``; afterwards they are restored. The CUDA
    generators are forked and seeded once CUDA is in use; before that only the CPU generator is seeded
    (``torch.manual_seed`` would queue ``seed`` for CUDA's first use, which would then start from it instead of the
    caller's seed)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        if devices:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield
