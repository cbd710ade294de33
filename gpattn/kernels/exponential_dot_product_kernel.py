"""The exponential dot-product kernel (the numerator of softmax attention)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .asymmetric_kernel import AsymmetricKernel


class ExponentialDotProductKernel(AsymmetricKernel):
    r"""Exponential dot-product kernel.

    .. math::

        \kappa(x, z) = \sigma_f \exp\!\left(\frac{\langle W_q x, W_k z \rangle}{\sqrt p}\right).

    Its feature space is infinite-dimensional: dual path only. With ``tie=True`` (:math:`W_q = W_k`) the
    kernel is symmetric PSD. The logits are clamped at ``max_logit`` (default 80) so that the matrix stays
    finite in float32; the clamp is inactive for any reasonably scaled input.

    :param input_dim: Token dimension :math:`d`.
    :param feature_dim: Projection dimension :math:`p`.
    :param tie: Share :math:`W_q = W_k`.
    :param batch_shape: Batch of independent kernels.

    .. note:: Cost O(N M p).
    """

    def __init__(
        self,
        input_dim: int,
        feature_dim: int,
        tie: bool = False,
        batch_shape: torch.Size = torch.Size(),
        max_logit: float = 80.0,
    ):
        super().__init__(input_dim, tie=tie, batch_shape=batch_shape)
        self.max_logit = float(max_logit)
        self._register_projections(feature_dim, input_dim)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        logits = (x @ self.query_weight.mT) @ (z @ self.key_projection.mT).mT / math.sqrt(self.feature_dim)
        return self._scale(torch.exp(logits.clamp(max=self.max_logit)))
