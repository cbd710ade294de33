"""Shared helpers of the reliability tests: small layers of every registered attention (``make_transformer`` is in
``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpattn.attention import AttentionLayer, build_attention, select_arguments


@pytest.fixture
def make_layer() -> Callable[..., AttentionLayer]:
    """``make_layer(name, embed_dim=16, num_heads=2, seed=0, **kwargs)``: a small registry layer (inducing sets of 4
    where it has one), seeded."""

    def build(name: str, embed_dim: int = 16, num_heads: int = 2, seed: int = 0, **kwargs) -> AttentionLayer:
        torch.manual_seed(seed)
        return build_attention(name, embed_dim, num_heads, **{**select_arguments(name, num_inducing=4), **kwargs})

    return build
