r"""The per-token ("marginal") noise of a kernel-eigen readout mapped to a layer's output, as one autograd function with
a hand-written backward pass.

With marginal sampling (the official KEP-SVGP code's) every token :math:`n` and GP output :math:`c` of a head gets
independent noise of variance :math:`v_{nc} = \sum_q a^q_n S^q_c a^q_n{}^\top` (one term per :math:`q(u)` that the
summed branches read: the sum :math:`a = a^e + a^r` of a shared posterior, or one term per independent branch;
docs/math.md section 3), plus an optional extra variance (the residual :math:`k(x, x) - \|e(x)\|^2`), and the layer adds

.. math::

    \Delta y_n = \sum_{h, c} \sqrt{v_{hnc}}\, \xi_{hnc}\, C_{hc}, \qquad \xi \sim \mathcal N(0, I),

with the output map :math:`C` (``(H, d_out, C)``) shared by the summed branches. :math:`S_c = L_c L_c^\top` comes from
the Cholesky parameter, and the quadratic forms are taken in their symmetric form over the ``P = s(s+1)/2`` entries of
the upper triangle (:meth:`~gpattn.variational.KernelEigenReadout.token_noise_moments`):
:math:`v_{nc} = \sum_{i \leq j} (a_{ni} a_{nj}) \, w_{ij} S_{c,ij}`, :math:`w_{ij} = 2 - \delta_{ij}`. Autograd through
those steps visits about a hundred small operators per training step; here the forward pass is about fifteen and the
backward pass is

.. math::

    \bar z = C \bar y^\top, \quad \bar v = \frac{\bar z\, \xi}{2 \sqrt v} [v \geq \epsilon], \quad
    \bar S_{c,ij} = w_{ij} \textstyle\sum_n \bar v_{nc}\, a_{ni} a_{nj} \;(i \leq j), \quad
    \bar L = \operatorname{tril}((\bar S + \bar S^\top) L), \quad \bar C = z^\top \bar y,

    \bar a = (\bar\Pi \circ a G) F^\top + (\bar\Pi \circ a F) G^\top, \qquad
    \bar\Pi_{nP} = \textstyle\sum_c \bar v_{nc}\, w_P S_{c,P},

with :math:`\bar S` zero below the diagonal, :math:`F, G` the one-hot ``(s, P)`` selections of :math:`a_i` and
:math:`a_j`, and :math:`z = \sqrt v\, \xi`. The variance is floored at float32's epsilon (float64's in float64, also
under half-precision autocast) before the square root, as :meth:`~gpattn.variational.KernelEigenReadout.token_noise`
floors it (no gradient below the floor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..fused import autocast_state, first_derivatives_only, restored_autocast, wide_dtype


def _variance_floor(dtype: torch.dtype) -> float:
    """The floor of a per-token variance before its square root (below it the root's gradient is zero, so that it
    stays finite where the variance vanishes): float32's machine epsilon, also for a half-precision variance under
    autocast, whose own epsilon (``2^-7`` in bfloat16) would raise every standard deviation below 0.09 to 0.09;
    float64's in float64."""
    return torch.finfo(wide_dtype(dtype)).eps


class MarginalNoiseOutput(torch.autograd.Function):
    r""":math:`\Delta y = \sum_{h, c} \sqrt{v_{hnc}}\, \xi_{hnc} C_{hc}` (see the module docstring).

    Inputs:

    * ``interps`` :math:`a` ``(Q, B, H, N, s)``: the interpolation terms of each :math:`q(u)` read;
    * ``factor`` the Cholesky parameter ``(H, d_out, Q, s, s)`` (its lower triangle :math:`L` is read);
    * ``extra`` ``None`` or a variance ``(B, H, d_out, N)`` added before the square root;
    * ``noise`` :math:`\xi` ``(B, H, d_out, N)``;
    * ``maps`` :math:`C` ``(H, d_out, C)``;
    * ``rows``, ``cols``, ``weights``, ``first``, ``second``: the upper triangle's indices, its weights and the one-hot
      ``(s, P)`` selections of :func:`~gpattn.variational.kernel_eigen_readout._triangle_selections`.

    Output: ``(B, N, C)``.

    .. note:: Cost per sequence and head: O(N s P) for the products, O(N P d_out) for the variances and O(N d_out C)
        for the map, forward and backward; O(d_out s^3) for :math:`S` and its gradient.
    """

    @staticmethod
    def forward(ctx, interps, factor, extra, noise, maps, rows, cols, weights, first, second) -> Tensor:
        ctx.autocast = autocast_state(interps.device.type)  # the backward pass runs in the same precision
        lower = factor.tril()
        packed = (lower @ lower.mT)[..., rows, cols] * weights  # w_ij S_ij over the upper triangle: (H, d, Q, P)
        packed = packed.permute(2, 0, 3, 1).unsqueeze(1)  # (Q, 1, H, P, d): GEMMs batched like the products
        left, right = interps @ first, interps @ second  # a_i, a_j: (Q, B, H, N, P)
        products = left * right
        variance = (products @ packed.to(products.dtype)).sum(0)  # (B, H, N, d): no copy of the products
        if extra is not None:
            variance = variance + extra.mT
        floor = _variance_floor(variance.dtype)
        root = variance.clamp_min(floor).sqrt()
        scaled = root * noise.mT  # (B, H, N, d)
        output = torch.einsum("bhnd,hdc->bnc", scaled, maps.to(scaled.dtype))
        saved = (lower, packed, left, right, products, variance, root, scaled, noise, maps)
        ctx.save_for_backward(*saved, rows, cols, weights, first, second)
        ctx.floor = floor
        return output

    @staticmethod
    @first_derivatives_only("MarginalNoiseOutput")
    def backward(ctx, grad: Tensor):
        with restored_autocast(ctx.autocast):
            return _backward(ctx, grad)


def _backward(ctx, grad: Tensor) -> tuple:
    lower, packed, left, right, products, variance, root, scaled, noise, maps, *triangle = ctx.saved_tensors
    rows, cols, weights, first, second = triangle
    needs = ctx.needs_input_grad
    grad = grad.to(scaled.dtype)
    grad_maps = torch.einsum("bhnd,bnc->hdc", scaled, grad).to(maps.dtype) if needs[4] else None
    if not (needs[0] or needs[1] or needs[2]):
        return None, None, None, None, grad_maps, None, None, None, None, None
    grad_scaled = torch.einsum("bnc,hdc->bhnd", grad, maps.to(grad.dtype))
    # d sqrt(v) / dv = 1 / (2 sqrt(v)) above the floor, 0 below it (clamp_min passes the gradient where v >= floor)
    grad_variance = torch.where(variance >= ctx.floor, grad_scaled * noise.mT / (2.0 * root), 0.0)  # (B, H, N, d)
    grad_extra = grad_variance.mT if needs[2] else None
    grad_interps = grad_factor = None
    if needs[0]:  # d a = (dP * a_j) first^T + (dP * a_i) second^T with dP = sum_c dv_c packed_c
        grad_products = grad_variance @ packed.mT.to(grad_variance.dtype)  # (Q, B, H, N, P)
        grad_interps = (grad_products * right) @ first.mT + (grad_products * left) @ second.mT
    if needs[1]:  # dS over the upper triangle, then S = L L^T: dL = tril((dS + dS^T) L)
        grad_packed = (products.mT @ grad_variance).sum(1)  # (Q, H, P, d)
        grad_packed = grad_packed.permute(1, 3, 0, 2).to(lower.dtype) * weights  # (H, d, Q, P)
        grad_covariance = lower.new_zeros(lower.shape)
        grad_covariance[..., rows, cols] = grad_packed
        grad_factor = ((grad_covariance + grad_covariance.mT) @ lower).tril()
    return grad_interps, grad_factor, grad_extra, None, grad_maps, None, None, None, None, None
