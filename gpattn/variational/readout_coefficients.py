r"""The coefficients of a kernel-eigen readout, :math:`\Lambda^{-1} \sum_c u_c C_c` for the mean or a joint draw of
:math:`q(u)`, as one autograd function with a hand-written backward pass.

An attention layer's output is linear in its GP outputs :math:`F^b_c(x) = e^b(x) \Lambda^{-1} u^b_c`, so with a map
:math:`C^b` per branch (``(H, d_out, C)``) it is :math:`\sum_b e^b(x) A^b` with the coefficients (docs/math.md
section 3)

.. math::

    A^b = \Lambda^{-1} \textstyle\sum_c u^b_c C^b_c, \qquad u = m + L \varepsilon \quad (\text{or } u = m),

one ``(s, C)`` matrix per sequence (per draw), branch and head. Autograd through the draw, the branch selections,
the divisions by :math:`\Lambda` and the per-branch products visits about fifty small operators, forward and
backward; here the forward pass is one batched GEMM for every draw (:math:`L \varepsilon + m` over every head,
output and branch), one scaling by :math:`\Lambda^{-1}` and one GEMM per head over both branches and every draw,
and the backward pass

.. math::

    \bar U = C \bar A^\top \Lambda^{-1}, \quad \bar m = \textstyle\sum_b \bar U_b, \quad
    \bar L = \operatorname{tril}(\bar U \varepsilon^\top), \quad \bar C = (U \Lambda^{-1})^\top \bar A, \quad
    \bar\Lambda = -\Lambda^{-2} \textstyle\sum (\bar U \Lambda \circ U \Lambda^{-1}),

the same few products. Its result is laid out for one output GEMM with the stacked scores
(:meth:`~gpattn.features.KernelEigenScores.columns`): ``(B, branches H s, C)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ReadoutCoefficients(torch.autograd.Function):
    r"""The coefficients :math:`A^b = \Lambda^{-1} \sum_c u^b_c C^b_c` of ``branches`` branches of a readout (see the
    module docstring).

    Inputs:

    * ``mean`` :math:`m` ``(H, d_out, Q, s)``: the stacked :math:`q(u)` of ``Q`` branches (``Q = 1``: one :math:`q(u)`
      shared by every branch); or draws of :math:`u` made elsewhere, ``(H, d_out, Q, s, B)`` (with ``factor`` and
      ``noise`` ``None``);
    * ``factor`` the Cholesky parameter ``(H, d_out, Q, s, s)`` (its lower triangle :math:`L` is read) and ``noise``
      :math:`\varepsilon` ``(B, H, d_out, Q, s)``, one joint draw :math:`u = m + L \varepsilon` per sequence; or both
      ``None``: the mean :math:`u = m`;
    * ``singular_values`` :math:`\Lambda` ``(H, s)`` or ``(B, H, s)`` (a spectrum per sequence), or ``None``
      (whitened: no :math:`\Lambda^{-1}`); ``active``: ``None`` or a boolean of the shape of :math:`\Lambda`, false
      where a direction is numerically zero (its coefficients are zero);
    * ``maps`` :math:`C` ``(K, H, d_out, C)``: one map for every branch (``K = 1``) or one per branch;
    * ``branches``: the number of branches read, ``Q`` or, with ``Q = 2``, 1 (the first branch alone).

    Output: ``(B or 1, branches H s, C)``, rows ordered (branch, head, direction); batch 1 for the mean with one
    :math:`\Lambda`.

    .. note:: Cost per head: O(d_out s^2 B) for the draws and O(branches d_out s B C) for the coefficients (B = 1 for
        the mean), forward and backward; O(d_out s^2) memory besides the result.
    """

    @staticmethod
    def forward(
        ctx,
        mean: Tensor,
        factor: Tensor | None,
        noise: Tensor | None,
        singular_values: Tensor | None,
        active: Tensor | None,
        maps: Tensor,
        branches: int,
    ) -> Tensor:
        heads, outputs, stacked, rank = mean.shape[:4]
        ctx.drawn = mean.dim() == 5
        if factor is None:  # u = m (H, d_out, Q, s, 1), or draws given (H, d_out, Q, s, B)
            lower, draws = None, mean if ctx.drawn else mean.unsqueeze(-1)
        else:  # u = m + L eps for every sequence: one GEMM (s, s) x (s, B) per head, output and branch
            lower = factor.tril()
            blocks = heads * outputs * stacked
            columns = noise.view(-1, blocks, rank).permute(1, 2, 0)  # eps: (blocks, s, B)
            draws = torch.baddbmm(mean.reshape(blocks, rank, 1), lower.view(blocks, rank, rank), columns)
            draws = draws.view(heads, outputs, stacked, rank, -1)
        # the branches read: every branch from the one shared q(u), or the first `branches` of the stack
        selected = draws.expand(-1, -1, branches, -1, -1) if stacked == 1 else draws[:, :, :branches]
        inverse = _inverse_scales(singular_values, active, mean.dtype)  # Lambda^{-1}: (H, 1, 1, s, 1 or B), or None
        scaled = selected if inverse is None else selected * inverse  # (H, d_out, branches, s, B)
        samples = scaled.shape[-1]
        # per head: (branches, s B, d_out) x (d_out, C); a map per branch or one broadcast over the branches
        left = scaled.reshape(heads, outputs, branches, rank * samples).permute(0, 2, 3, 1)
        right = maps.movedim(0, 1)  # (H, K, d_out, C)
        coefficients = torch.matmul(left, right)  # (H, branches, s B, C)
        ctx.save_for_backward(lower, noise, selected, inverse, left, right, singular_values)
        ctx.stacked = stacked
        width = coefficients.shape[-1]
        coefficients = coefficients.view(heads, branches, rank, samples, width).permute(3, 1, 0, 2, 4)
        return coefficients.reshape(samples, branches * heads * rank, width)

    @staticmethod
    def backward(ctx, grad: Tensor):
        lower, noise, selected, inverse, left, right, singular_values = ctx.saved_tensors
        heads, outputs, branches, rank, samples = selected.shape
        grad = grad.view(samples, branches, heads, rank, -1).permute(2, 1, 3, 0, 4)  # (H, branches, s, B, C)
        grad = grad.reshape(heads, branches, rank * samples, -1)
        grad_mean = grad_factor = grad_singular_values = grad_maps = None
        if ctx.needs_input_grad[5]:  # (U Lambda^{-1})^T dA, summed over the branches of a shared map
            grad_maps = (left.mT @ grad).sum_to_size(right.shape).movedim(1, 0)
        grad_scaled = (grad @ right.mT).permute(0, 3, 1, 2).view(heads, outputs, branches, rank, samples)
        if inverse is not None and ctx.needs_input_grad[3]:  # d Lambda = -Lambda^{-2} d(Lambda^{-1})
            grad_inverse = (grad_scaled * selected).sum_to_size(inverse.shape)
            grad_singular_values = _scales_layout(-grad_inverse * inverse.square(), singular_values)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_draws = grad_scaled if inverse is None else grad_scaled * inverse
            if ctx.stacked == 1:  # one q(u) read by every branch
                grad_draws = grad_draws.sum(2, keepdim=True)
            elif branches < ctx.stacked:  # branches not read get no gradient
                grad_draws = torch.cat([grad_draws, grad_draws.new_zeros(heads, outputs, 1, rank, samples)], dim=2)
            grad_mean = grad_draws if ctx.drawn else grad_draws.sum(-1)  # (H, d_out, Q, s[, B])
            if lower is not None and ctx.needs_input_grad[1]:  # dL = tril(dU eps^T)
                blocks = heads * outputs * ctx.stacked
                noise = noise.view(samples, blocks, rank).transpose(0, 1)  # (blocks, B, s)
                grad_factor = torch.bmm(grad_draws.reshape(blocks, rank, samples), noise).tril().view(lower.shape)
        return grad_mean, grad_factor, None, grad_singular_values, None, grad_maps, None


def _inverse_scales(singular_values: Tensor | None, active: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    # Lambda^{-1} (1 when whitened; 0 for an inactive direction) in the layout of the draws, (H, 1, 1, s, 1) or
    # (H, 1, 1, s, B); None when there is nothing to scale
    if singular_values is None and active is None:
        return None
    if singular_values is None:
        inverse = active.to(dtype)
    else:
        inverse = singular_values.reciprocal()
        if active is not None:
            inverse = torch.where(active, inverse, 0.0)
    if inverse.dim() == 2:  # (H, s)
        return inverse[:, None, None, :, None]
    return inverse.permute(1, 2, 0)[:, None, None]  # (B, H, s) -> (H, 1, 1, s, B)


def _scales_layout(gradient: Tensor, singular_values: Tensor) -> Tensor:
    # a gradient in the layout of _inverse_scales back to the shape of the singular values
    if singular_values.dim() == 2:
        return gradient.reshape(singular_values.shape)
    return gradient.reshape(gradient.shape[0], gradient.shape[3], -1).permute(2, 0, 1)
