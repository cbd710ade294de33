"""Shared helpers of the reliability tests: small models of every registered attention, one intra-op thread."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpattn.attention import AttentionLayer, attention_arguments, build_attention
from gpattn.models import Transformer

SIZE_ARGUMENTS = ("num_inducing",)
VOCAB, LENGTH = 6, 6


def small_sizes(name: str, size: int = 4) -> dict[str, int]:
    """``size`` for the rank / inducing-set arguments the layer registered as ``name`` takes."""
    return {key: size for key in SIZE_ARGUMENTS if key in attention_arguments(name)}


@pytest.fixture
def make_layer() -> Callable[..., AttentionLayer]:
    """``make_layer(name, embed_dim=16, num_heads=2, seed=0, **kwargs)``: a small registry layer, seeded."""

    def build(name: str, embed_dim: int = 16, num_heads: int = 2, seed: int = 0, **kwargs) -> AttentionLayer:
        torch.manual_seed(seed)
        return build_attention(name, embed_dim, num_heads, **{**small_sizes(name), **kwargs})

    return build


@pytest.fixture
def make_transformer() -> Callable[..., Transformer]:
    """``make_transformer(attention, seed=0, **kwargs)``: a tiny token classifier (2 classes, width 16, depth 2 with one
    GP block, vocabulary 6, length 6), seeded."""

    def build(attention: str, seed: int = 0, **kwargs) -> Transformer:
        torch.manual_seed(seed)
        settings = dict(embed_dim=16, depth=2, num_heads=2, vocab_size=VOCAB, max_len=LENGTH)
        return Transformer(2, attention=attention, **{**settings, **small_sizes(attention), **kwargs})

    return build
