"""The exponential dot-product kernel (the numerator of softmax attention)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ..validation import InputTypeError
from .asymmetric_kernel import AsymmetricKernel

#: Tokens over which the squared kernel may be summed without overflow at the default clamp (see ``safe_max_logit``).
_SUMMED_TOKENS = 2**24


def safe_max_logit(dtype: torch.dtype) -> float:
    r"""The default clamp of :class:`ExponentialDotProductKernel` in ``dtype``:
    :math:`\tfrac12 (\log f_{\max} - \log 2^{24})` with :math:`f_{\max}` the largest finite value of ``dtype``, so that
    :math:`\exp(\ell)^2` summed over :math:`2^{24}` tokens (the induced kernels :math:`\kappa \kappa^\top`, the
    residual diagonals, :math:`K K^\top`) stays finite: about 36.0 in float32 and bfloat16, 346.6 in float64 (at least
    :math:`\tfrac14 \log f_{\max}`, 2.8 in float16, whose range allows little more)."""
    log_max = math.log(torch.finfo(dtype).max)
    return max(0.5 * (log_max - math.log(_SUMMED_TOKENS)), 0.25 * log_max)


class ExponentialDotProductKernel(AsymmetricKernel):
    r"""Exponential dot-product kernel.

    .. math::

        \kappa(x, z) = \sigma_f \exp\!\left(\min\Big(\frac{\langle W_q x, W_k z \rangle}{\sqrt p},\,
            \ell_{\max}\Big)\right).

    Its feature space is infinite-dimensional: dual path only. With ``tie=True`` (:math:`W_q = W_k`) the
    kernel is symmetric PSD.

    **Overflow.** :math:`\exp` overflows float32 at a logit of 88.7, and :math:`\kappa^2` (used by the induced
    kernels and residual diagonals) at 44.4. The logits are therefore clamped at :math:`\ell_{\max}` = ``max_logit``,
    by default :func:`safe_max_logit` of the computation's dtype (36.0 in float32 and bfloat16, 346.6 in float64), so
    that the matrix, its square and sums of its squares stay finite even for logits of 1e4. The clamp is inactive for
    reasonably scaled inputs; where it is active the kernel saturates at :math:`\sigma_f e^{\ell_{\max}}` and the
    gradient of a saturated logit is zero (the kernel is then constant in it). Unlike a softmax, the kernel is not
    normalised, so the maximum cannot be subtracted without changing its values.

    :param input_dim: Token dimension :math:`d`.
    :param feature_dim: Projection dimension :math:`p`.
    :param tie: Share :math:`W_q = W_k`.
    :param batch_shape: Batch of independent kernels.
    :param max_logit: The clamp :math:`\ell_{\max}` (a real number, ``inf`` for none), or ``None`` for
        :func:`safe_max_logit` of the dtype.
    :raises InputTypeError: For a ``max_logit`` that is not a real number (a string, a bool, a tensor).
    :raises ValueError: For a NaN ``max_logit`` or ``-inf`` (a kernel of zeros).

    .. note:: Cost O(N M p).
    """

    def __init__(
        self,
        input_dim: int,
        feature_dim: int,
        tie: bool = False,
        batch_shape: torch.Size = torch.Size(),
        max_logit: float | None = None,
    ):
        super().__init__(input_dim, tie=tie, batch_shape=batch_shape)
        if max_logit is not None:
            wanted = "a real number > -inf (inf: no clamp) or None"
            if isinstance(max_logit, bool) or not isinstance(max_logit, numbers.Real):
                raise InputTypeError(
                    f"ExponentialDotProductKernel: expected max_logit to be {wanted}, got {max_logit!r}"
                )
            if math.isnan(max_logit) or max_logit == -math.inf:  # -inf clamps every logit: exp(-inf) = 0
                raise ValueError(f"ExponentialDotProductKernel: expected max_logit to be {wanted}, got {max_logit!r}")
            max_logit = float(max_logit)
        self.max_logit = max_logit
        self._register_projections(feature_dim, input_dim)

    def logit_bound(self, dtype: torch.dtype) -> float:
        """The clamp :math:`\\ell_{\\max}` in ``dtype``: ``max_logit``, or :func:`safe_max_logit` of ``dtype``."""
        return safe_max_logit(dtype) if self.max_logit is None else self.max_logit

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        logits = (x @ self.query_weight.mT) @ (z @ self.key_projection.mT).mT / math.sqrt(self.feature_dim)
        return self._scale(torch.exp(logits.clamp(max=self.logit_bound(logits.dtype))))
