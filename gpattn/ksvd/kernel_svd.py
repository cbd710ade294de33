"""Truncated singular value decomposition of an asymmetric kernel matrix."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

METHODS = ("exact", "randomized")


class KernelSVD(NamedTuple):
    r"""A rank-:math:`s` kernel SVD :math:`K \approx H_e \Lambda H_r^\top`.

    :ivar left: :math:`H_e`, orthonormal columns, shape ``(*batch, N, s)``.
    :ivar singular_values: :math:`\lambda_1 \geq \dots \geq \lambda_s \geq 0`, shape ``(*batch, s)``.
    :ivar right: :math:`H_r`, orthonormal columns, shape ``(*batch, M, s)``.
    """

    left: Tensor
    singular_values: Tensor
    right: Tensor


def _fix_signs(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor]:
    # Flip each singular pair so that the largest-magnitude entry of its left vector is positive.
    pivot = left.abs().argmax(dim=-2, keepdim=True)  # shape: (*batch, 1, s)
    signs = torch.sign(torch.gather(left, -2, pivot))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return left * signs, right * signs


def _randomized_svd(matrix: Tensor, rank: int, oversampling: int, power_iterations: int, seed: int) -> KernelSVD:
    # Halko, Martinsson & Tropp (2011), Algorithms 4.4 and 5.1, with QR re-orthonormalisation.
    num_rows, num_cols = matrix.shape[-2:]
    sketch_size = min(rank + oversampling, num_rows, num_cols)
    generator = torch.Generator().manual_seed(seed)
    test_matrix = torch.randn(*matrix.shape[:-2], num_cols, sketch_size, generator=generator, dtype=matrix.dtype)
    basis = torch.linalg.qr(matrix @ test_matrix.to(matrix.device)).Q  # shape: (*batch, N, k)
    for _ in range(power_iterations):
        basis = torch.linalg.qr(matrix.mT @ basis).Q
        basis = torch.linalg.qr(matrix @ basis).Q
    small_left, singular_values, small_right_h = torch.linalg.svd(basis.mT @ matrix, full_matrices=False)
    return KernelSVD(basis @ small_left[..., :rank], singular_values[..., :rank], small_right_h[..., :rank, :].mT)


def kernel_svd(
    matrix: Tensor,
    rank: int,
    method: str = "exact",
    oversampling: int = 10,
    power_iterations: int = 4,
    seed: int = 0,
) -> KernelSVD:
    r"""Top-:math:`s` singular triplets of a (batched, rectangular) kernel matrix.

    Returns :math:`H_e, \Lambda, H_r` with :math:`K H_r = H_e \Lambda` and :math:`K^\top H_e = H_r \Lambda`
    (exactly for ``method="exact"``; up to the randomised approximation otherwise), sorted decreasingly. The
    sign of each pair is fixed deterministically: the largest-magnitude entry of each left vector is positive.

    :param matrix: :math:`K`, shape ``(*batch, N, M)``.
    :param rank: :math:`s \leq \min(N, M)`.
    :param method: ``"exact"`` (``torch.linalg.svd``, O(N M min(N, M))) or ``"randomized"`` (a seeded
        randomised range finder with power iterations, O(N M (s + oversampling)) per pass).
    :param oversampling: Extra sketch columns of the randomised method.
    :param power_iterations: Subspace iterations of the randomised method.
    :param seed: Seed of the randomised sketch (the global RNG is not touched).
    :return: A :class:`KernelSVD`.

    .. note:: Gradients of an SVD are undefined where singular values repeat; differentiate through this
        function only where the top-:math:`s` spectrum is simple.
    """
    if not isinstance(matrix, Tensor):
        raise TypeError(f"expected matrix to be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.dim() < 2:
        raise ValueError(f"expected a matrix of shape (..., N, M), got {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        raise TypeError(f"expected a floating-point matrix, got {matrix.dtype}")
    num_rows, num_cols = matrix.shape[-2:]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(num_rows, num_cols):
        raise ValueError(f"expected an integer rank in [1, min(N, M)] = [1, {min(num_rows, num_cols)}], got {rank!r}")
    if method not in METHODS:
        raise ValueError(f"expected method in {METHODS}, got {method!r}")
    if not torch.isfinite(matrix).all():
        raise ValueError("kernel matrix contains NaN or Inf")
    if method == "exact":
        left, singular_values, right_h = torch.linalg.svd(matrix, full_matrices=False)
        result = KernelSVD(left[..., :rank], singular_values[..., :rank], right_h[..., :rank, :].mT)
    else:
        result = _randomized_svd(matrix, rank, oversampling, power_iterations, seed)
    left, right = _fix_signs(result.left, result.right)
    return KernelSVD(left, result.singular_values, right)
