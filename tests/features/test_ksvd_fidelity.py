""":func:`~gpattn.features.ksvd_fidelity` against layers whose distance to the exact KSVD is known: exact features and a
layer set to its stationary point (zero), random weights (non-zero); float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.attention import KEPSVGPAttention, PrimalAttention
from gpattn.features import AmortizedAttentionFeatures, KSVDFidelity, ksvd_fidelity

DTYPE = torch.float64
C, H, RANK, LENGTH = 8, 2, 3, 6


def _tokens(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _assert_exact(fidelity: KSVDFidelity) -> None:
    for name in ("relative_objective", "singular_value_error"):
        torch.testing.assert_close(
            getattr(fidelity, name), torch.zeros_like(getattr(fidelity, name)), atol=1e-9, rtol=0
        )
    for name in ("left_cosine", "right_cosine"):
        torch.testing.assert_close(getattr(fidelity, name), torch.ones_like(getattr(fidelity, name)), atol=1e-9, rtol=0)
    assert fidelity.max_angle.max() < 1e-3  # degrees (arccos near 1 loses half the digits)


def test_exact_features_are_the_exact_ksvd():
    torch.manual_seed(0)
    layer = KEPSVGPAttention(C, H, num_inducing=RANK, features="exact").double()
    x = _tokens(3, LENGTH, C, seed=1)
    fidelity = ksvd_fidelity(layer, x)
    assert fidelity.left_cosine.shape == (3, H)
    _assert_exact(fidelity)
    # energy: the top-s share of ||K||_F^2, from an independent numpy SVD
    kernel = layer.features.kernel.forward(x.unsqueeze(1), x.unsqueeze(1)).detach().numpy()
    sigma = np.linalg.svd(kernel, compute_uv=False)
    expected = (sigma[..., :RANK] ** 2).sum(-1) / (sigma**2).sum(-1)
    np.testing.assert_allclose(fidelity.energy.numpy(), expected, atol=1e-12, rtol=0)


def test_a_layer_at_its_stationary_point_is_the_exact_ksvd():
    """Amortised maps solved so that A_e(Z)/M = H_r, A_r(X)/N = H_e and Lambda the singular values (possible for one
    sequence of N <= C tokens): zero objective, angles and error; random maps are not."""
    torch.manual_seed(2)
    features = AmortizedAttentionFeatures(C, H, RANK).double()
    x = _tokens(1, LENGTH, C, seed=3)
    before = ksvd_fidelity(features, x)
    assert before.relative_objective.min() > 1e-3 and before.max_angle.min() > 1.0
    assert before.singular_value_error.min() > 1e-2
    kernel = features.kernel.forward(x.unsqueeze(1), x.unsqueeze(1))[0].detach().numpy()
    tokens = x[0].numpy()
    with torch.no_grad():
        values = []
        for h in range(H):
            u, sigma, vt = np.linalg.svd(kernel[h])
            features.left_map[h] = torch.from_numpy(np.linalg.lstsq(tokens, LENGTH * vt[:RANK].T, rcond=None)[0])
            features.right_map[h] = torch.from_numpy(np.linalg.lstsq(tokens, LENGTH * u[:, :RANK], rcond=None)[0])
            values.append(sigma[:RANK])
        features.left_bias.zero_()
        features.right_bias.zero_()
        lam = torch.from_numpy(np.stack(values))
        features.raw_singular_values.copy_(features.raw_singular_values_constraint.inverse_transform(lam))
    _assert_exact(ksvd_fidelity(features, x))


def test_padding_compares_the_real_tokens_only():
    torch.manual_seed(4)
    layer = PrimalAttention(C, H, num_inducing=RANK).double()
    x = _tokens(2, LENGTH, C, seed=5)
    mask = torch.tensor([[True] * LENGTH, [True] * 4 + [False] * 2])
    padded = ksvd_fidelity(layer, x, key_mask=mask)
    alone = ksvd_fidelity(layer, x[1:, :4])  # the second sequence without its padding
    for name in ("relative_objective", "left_cosine", "right_cosine", "singular_value_error", "energy"):
        torch.testing.assert_close(getattr(padded, name)[1], getattr(alone, name)[0], atol=1e-9, rtol=0)
    summary = padded.summary()
    assert set(summary) == {
        "relative_objective",
        "left_cosine",
        "right_cosine",
        "max_angle",
        "singular_value_error",
        "energy",
    }
    assert all(isinstance(value, float) for value in summary.values())


def test_other_layers_are_refused():
    from gpattn.attention import SoftmaxAttention

    with pytest.raises(TypeError, match="AttentionKernelEigenFeatures"):
        ksvd_fidelity(SoftmaxAttention(C, H), _tokens(1, LENGTH, C, seed=6).float())
