""":class:`~gpattn.attention.SoftmaxAttention` equals :class:`torch.nn.MultiheadAttention` with the same weights
(float64, 1e-10): self-attention, cross-attention, padding masks and causal masks."""

from __future__ import annotations

import pytest
import torch

from gpattn.attention import SoftmaxAttention

EMBED_DIM, NUM_HEADS = 12, 3


def _pair(seed: int = 0) -> tuple[SoftmaxAttention, torch.nn.MultiheadAttention]:
    torch.manual_seed(seed)
    layer = SoftmaxAttention(EMBED_DIM, NUM_HEADS).double().eval()
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]))
        reference.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        reference.out_proj.weight.copy_(layer.out_proj.weight)
        reference.out_proj.bias.copy_(layer.out_proj.bias)
    return layer, reference


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, length, EMBED_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _padding(batch: int, length: int) -> torch.Tensor:
    lengths = torch.arange(batch) % length + 1  # 1 .. length real tokens
    return torch.arange(length) < lengths[:, None]


def test_self_attention():
    layer, reference = _pair()
    x = _tokens(3, 7, 1)
    expected, _ = reference(x, x, x, need_weights=False)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-10)


def test_cross_attention():
    layer, reference = _pair()
    x, context = _tokens(3, 5, 1), _tokens(3, 9, 2)
    expected, _ = reference(x, context, context, need_weights=False)
    torch.testing.assert_close(layer(x, context=context), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_padding_mask(cross):
    layer, reference = _pair()
    x = _tokens(4, 6, 1)
    keys = _tokens(4, 8, 2) if cross else x
    mask = _padding(4, keys.shape[1])
    expected, _ = reference(x, keys, keys, key_padding_mask=~mask, need_weights=False)
    actual = layer(x, mask=mask, context=keys if cross else None)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)


def test_causal_mask():
    layer, reference = _pair()
    x = _tokens(2, 7, 1)
    future = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)  # True = may not attend
    expected, _ = reference(x, x, x, attn_mask=future, need_weights=False)
    torch.testing.assert_close(layer(x, mask="causal"), expected, rtol=0, atol=1e-10)


def test_deterministic_interface():
    layer, _ = _pair()
    x = _tokens(2, 4, 1)
    assert not layer.is_stochastic
    assert layer.kl_divergence().item() == 0.0
    mean, variance = layer.posterior(x)
    torch.testing.assert_close(mean, layer(x), rtol=0, atol=0)
    assert torch.count_nonzero(variance) == 0
