r"""The KL of a Cholesky-parametrised :math:`q(u)` against a diagonal prior as one autograd function with a
hand-written backward pass.

With the variational mean :math:`m`, the lower triangle :math:`L` of the Cholesky parameter (the factor of
:math:`S = L L^\top`, as GPyTorch's ``CholeskyVariationalDistribution`` masks it) and the prior standard
deviations :math:`\sigma` (:math:`\lambda`, or 1 where whitened or inactive; docs/math.md section 3), per batch
element

.. math::

    \mathrm{KL} = \tfrac12 \sum_i \Big[\frac{n_i}{\sigma_i^2} - 1 + 2 \log \frac{\sigma_i}{|L_{ii}|}\Big],
    \qquad n_i = \sum_{j \le i} L_{ij}^2 + m_i^2,

and the gradients are closed forms of the same few tensors:

.. math::

    \bar m_i = \bar k\, \frac{m_i}{\sigma_i^2}, \qquad
    \bar L_{ij} = \bar k \Big(\frac{L_{ij}}{\sigma_i^2} - \frac{\delta_{ij}}{L_{ii}}\Big), \qquad
    \bar \sigma_i = \frac{\bar k}{\sigma_i} \Big(1 - \frac{n_i}{\sigma_i^2}\Big),

with :math:`\bar k` the gradient of the KL. Autograd through GPyTorch's distribution (the mask, the
``CholLinearOperator`` and its root) and the closed form of
:func:`~gpattn.variational.structured_covariance.diagonal_prior_kl` runs about eighty small operators per training
step, forward and backward; this function about twenty-five. The backward pass reuses the forward pass's
intermediates: first derivatives only (a second derivative is refused: :func:`~gpattn.fused.first_derivatives_only`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..fused import autocast_state, first_derivatives_only, full_precision


class CholeskyPriorKL(torch.autograd.Function):
    r""":math:`\mathrm{KL}(\mathcal N(m, L L^\top) \,\|\, \mathcal N(0, \operatorname{diag}(\sigma^2)))` per batch
    element (see the module docstring).

    Inputs: ``mean`` :math:`m` of shape ``(*batch, s)``; ``factor``, the Cholesky parameter of shape
    ``(*batch, s, s)`` (only its lower triangle is read; the upper one gets a zero gradient); ``scales``
    :math:`\sigma`, positive, broadcastable against ``(*batch, s)`` once ``singletons`` dimensions of size 1 are
    inserted in front of its last (e.g. :math:`\Lambda` of shape ``(H, s)`` against a :math:`q(u)` of batch
    ``(H, d_out, 2)`` with ``singletons=2``; a :math:`\Lambda` of shape ``(B, H, s)`` with a batch of its own in
    front); ``total``: sum over the batch. Output: shape ``(*batch)`` broadcast with :math:`\sigma`'s batch, or a
    scalar with ``total`` (the sum of those elements).

    .. note:: Cost O(s^2) per batch element, forward and backward.
    """

    @staticmethod
    def forward(ctx, mean: Tensor, factor: Tensor, scales: Tensor, total: bool = False, singletons: int = 0) -> Tensor:
        with full_precision(autocast_state(mean.device.type)):  # the parameters' dtype, also under autocast
            return _forward(ctx, mean, factor, scales, total, singletons)

    @staticmethod
    @first_derivatives_only("CholeskyPriorKL")
    def backward(ctx, grad: Tensor):
        mean, lower, scales, inverse, ratio, diagonal = ctx.saved_tensors
        grad = grad if ctx.total else grad.unsqueeze(-1)  # broadcast against (*batch, s)
        scale = grad * inverse  # dKL / sigma_i^2, (*batch, s)
        grad_mean = grad_factor = grad_scales = None
        if ctx.needs_input_grad[0]:
            grad_mean = mean * scale
        if ctx.needs_input_grad[1]:
            grad_factor = lower * scale.unsqueeze(-1)  # zero above the diagonal, as the lower triangle is
            grad_factor = grad_factor - torch.diag_embed(grad / diagonal)
        if ctx.needs_input_grad[2]:
            scaled = scale * scales
            grad_scales = torch.addcmul(scaled, scaled, ratio, value=-1.0)
            if ctx.inserted:  # summed over the inserted dimensions (and those in front), back to sigma's shape
                leading = grad_scales.dim() - len(ctx.scales_shape) - len(ctx.inserted)
                inserted = tuple(leading + dim for dim in ctx.inserted)
                grad_scales = grad_scales.sum(tuple(range(leading)) + inserted)
            if grad_scales.shape != ctx.scales_shape:  # broadcast dimensions of sigma
                grad_scales = grad_scales.sum_to_size(ctx.scales_shape)
        return grad_mean, grad_factor, grad_scales, None, None


def _forward(ctx, mean: Tensor, factor: Tensor, scales: Tensor, total: bool, singletons: int) -> Tensor:
    ctx.scales_shape, ctx.inserted = scales.shape, tuple(range(scales.dim() - 1, scales.dim() - 1 + singletons))
    if singletons:  # (*lead, s) -> (*lead, 1, ..., 1, s)
        scales = scales.view(*scales.shape[:-1], *(1,) * singletons, scales.shape[-1])
    lower = factor.tril()
    squares = torch.linalg.vecdot(lower, lower).addcmul_(mean, mean)  # n = sum_j L_ij^2 + m_i^2, (*batch, s)
    inverse = scales.pow(-2)
    ratio = squares * inverse  # n / sigma^2
    # n / (2 sigma^2) + log (sigma / |L_ii|), summed over i (and the batch), minus s / 2
    diagonal = lower.diagonal(dim1=-2, dim2=-1)  # L_ii, a view saved for the backward pass
    terms = torch.add((scales / diagonal).abs().log(), ratio, alpha=0.5)
    ctx.save_for_backward(mean, lower, scales, inverse, ratio, diagonal)
    ctx.total = total
    # the output is not formed in place: under torch.compile, torch 2.11's dynamo gives every input of an autograd
    # function a zero gradient when the function returns a tensor it modified in place (not seen with torch 2.13)
    # terms has the broadcast batch of m and sigma (sigma may carry a batch in front of q(u)'s, e.g. a spectrum per
    # sequence): -s/2 for each of its elements
    if total:
        return terms.sum() - 0.5 * terms.numel()
    return terms.sum(-1) - 0.5 * mean.shape[-1]
