"""squared_distance against sums of squared differences (float64, and float32 at large offsets), and
first_real_token."""

from __future__ import annotations

import pytest
import torch

from gpattn.kernels import first_real_token, padding_filled, squared_distance

DTYPE = torch.float64


def direct(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """sum_k (a_ik - b_jk)^2 in float64: no cancellation beyond the differences themselves."""
    return (left.double()[..., :, None, :] - right.double()[..., None, :, :]).square().sum(-1)


def points(*shape: int, seed: int, dtype=DTYPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE).to(dtype)


def test_matches_the_differences_with_batch_dimensions():
    left, right = points(2, 3, 5, 4, seed=0), points(2, 1, 6, 4, seed=1)
    torch.testing.assert_close(squared_distance(left, right), direct(left, right), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(squared_distance(left, left, same=True), direct(left, left), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("dtype", "offset"), [(torch.float32, 1e6), (torch.float64, 1e12)])
def test_translation_invariant_at_large_offsets(dtype, offset):
    """Points O(1) apart at a common offset: the distances equal those at the origin (the plain expansion
    |a|^2 + |b|^2 - 2 a.b is off by about eps |offset|^2, i.e. by 6e4 in float32 at 1e6)."""
    base = points(7, 3, seed=2)
    shifted = (base + offset).to(dtype)  # exactly representable differences: shifted - offset is exact in float64
    exact = direct(shifted.double() - offset, shifted.double() - offset)
    distances = squared_distance(shifted[:4], shifted[4:])
    torch.testing.assert_close(
        distances.double(), exact[:4, 4:], rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0
    )


def test_same_gives_an_exact_zero_diagonal_at_any_scale():
    """The expansion's diagonal is off by about eps |a - c|^2: 1e4 for points 1e10 apart in float64."""
    spread = 1e10 * points(6, 16, seed=3)
    distances = squared_distance(spread, spread, same=True)
    assert torch.equal(distances.diagonal(), torch.zeros(6, dtype=DTYPE))
    off_diagonal = ~torch.eye(6, dtype=torch.bool)
    torch.testing.assert_close(distances[off_diagonal], direct(spread, spread)[off_diagonal], rtol=1e-12, atol=0)


def test_gradient_matches_the_differences():
    left = points(4, 3, seed=4).requires_grad_()
    right = points(5, 3, seed=5).requires_grad_()
    weights = points(4, 5, seed=6)
    (squared_distance(left, right) * weights).sum().backward()
    expected_left = 2 * ((left[:, None, :] - right[None]) * weights[..., None]).sum(1)
    torch.testing.assert_close(left.grad, expected_left.detach(), rtol=1e-12, atol=1e-12)
    same = points(4, 3, seed=7).requires_grad_()
    (squared_distance(same, same, same=True) * weights[:, :4]).sum().backward()
    symmetric = weights[:, :4] + weights[:, :4].T
    expected_same = 2 * ((same[:, None, :] - same[None]) * symmetric[..., None]).sum(1)
    torch.testing.assert_close(same.grad, expected_same.detach(), rtol=1e-12, atol=1e-12)


def test_first_real_token():
    tokens = points(3, 4, 2, seed=8)
    torch.testing.assert_close(first_real_token(tokens), tokens[:, :1])
    mask = torch.tensor([[True, True, False, False], [False, False, True, True], [False, True, False, True]])
    expected = torch.stack([tokens[0, 0], tokens[1, 2], tokens[2, 1]])[:, None]
    torch.testing.assert_close(first_real_token(tokens, mask), expected)


def test_padding_filled_puts_the_first_real_token_in_every_padded_place():
    tokens = points(3, 4, 2, seed=8)
    filled, first = padding_filled(tokens)
    assert filled is tokens and torch.equal(first, tokens[:, :1])
    mask = torch.tensor([[True, True, False, False], [False, False, True, True], [False, True, False, True]])
    filled, first = padding_filled(tokens, mask)
    assert torch.equal(first, first_real_token(tokens, mask))
    expected = tokens.clone()
    for b, row in enumerate(mask):
        for n, real in enumerate(row):
            if not real:
                expected[b, n] = first[b, 0]
    assert torch.equal(filled, expected)


def test_same_requires_right_to_be_left_and_points_of_one_dimension():
    """same=True read left only: with another right it returned left's self-distances, silently."""
    generator = torch.Generator().manual_seed(5)
    left = torch.randn(2, 6, 3, generator=generator, dtype=torch.float64)
    right = torch.randn(2, 6, 3, generator=generator, dtype=torch.float64)
    with pytest.raises(ValueError, match="squared_distance: same=True means right is left"):
        squared_distance(left, right, same=True)
    with pytest.raises(ValueError, match="squared_distance: expected left .* with the same p"):
        squared_distance(left, right[..., :2])
    torch.testing.assert_close(squared_distance(left, right), torch.cdist(left, right).square(), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        squared_distance(left, left, same=True), torch.cdist(left, left).square(), atol=1e-12, rtol=0
    )
