"""Structured algebra of the kernel-eigen strategies against dense references (float64)."""

from __future__ import annotations

import pytest
import torch
from linear_operator.operators import CholLinearOperator, DiagLinearOperator, TriangularLinearOperator

from gpattn.variational.structured_covariance import reparameterised_draw

DTYPE = torch.float64


@pytest.mark.parametrize("sample_shape", [(), (5,), (2, 3)], ids=["no-sample", "one-sample-dim", "two-sample-dims"])
def test_reparameterised_draw_is_m_plus_l_eps(sample_shape: tuple):
    torch.manual_seed(0)
    batch, size = (4, 2), 3
    root = torch.randn(*batch, size, size, dtype=DTYPE).tril() + 2 * torch.eye(size, dtype=DTYPE)
    mean = torch.randn(*batch, size, dtype=DTYPE)
    noise = torch.randn(*sample_shape, *batch, size, dtype=DTYPE)
    covariance = CholLinearOperator(TriangularLinearOperator(root))
    expected = mean + torch.einsum("...ij,...j->...i", root.expand(*sample_shape, *root.shape), noise)
    torch.testing.assert_close(reparameterised_draw(mean, covariance, noise), expected, rtol=1e-12, atol=1e-12)
    # a noise batch that broadcasts against the root (the per-element path)
    broadcast = torch.randn(*sample_shape, 1, batch[1], size, dtype=DTYPE)
    expected = mean + torch.einsum("...ij,...j->...i", root, broadcast)
    torch.testing.assert_close(reparameterised_draw(mean, covariance, broadcast), expected, rtol=1e-12, atol=1e-12)
    # mean field: a column scaling
    variances = torch.rand(*batch, size, dtype=DTYPE) + 0.1
    draw = reparameterised_draw(mean, DiagLinearOperator(variances), noise)
    torch.testing.assert_close(draw, mean + variances.sqrt() * noise, rtol=1e-12, atol=1e-12)
