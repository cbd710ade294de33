"""Shared fixtures of the training tests: a small pointer task, tiny models and short training settings."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpattn.data import make_pointer_task
from gpattn.models import Transformer
from gpattn.training import TrainConfig

VOCAB, LENGTH = 6, 6


@pytest.fixture(scope="module")
def data():
    """256 / 64 / 64 pointer sequences of length 6 (vocabulary 6): 4 steps an epoch in batches of 64."""
    return make_pointer_task(256, 64, 64, length=LENGTH, seed=0, vocab_size=VOCAB)


@pytest.fixture
def small_model() -> Callable[..., Transformer]:
    """``small_model(attention="kep_svgp", depth=1, seed=0)``: a width-16 two-head token classifier (KSVD rank 4 for
    KEP-SVGP), built right after ``torch.manual_seed(seed)`` (``seed=None``: under the current RNG state)."""

    def build(attention: str = "kep_svgp", depth: int = 1, seed: int | None = 0) -> Transformer:
        if seed is not None:
            torch.manual_seed(seed)
        sizes = {"num_inducing": 4} if attention == "kep_svgp" else {}
        return Transformer(
            2, embed_dim=16, depth=depth, num_heads=2, attention=attention, vocab_size=VOCAB, max_len=LENGTH, **sizes
        )

    return build


@pytest.fixture
def small_config() -> Callable[..., TrainConfig]:
    """``small_config(**overrides)``: 2 epochs in batches of 64 at lr 1e-2, one warm-up epoch, 2 Monte Carlo samples,
    no progress bar."""

    def build(**overrides) -> TrainConfig:
        settings = {"epochs": 2, "batch_size": 64, "lr": 1e-2, "warmup_epochs": 1, "eval_samples": 2, "progress": False}
        return TrainConfig(**{**settings, **overrides})

    return build
