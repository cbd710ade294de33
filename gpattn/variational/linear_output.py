r"""The output of a kernel-eigen readout through linear maps, :math:`y = b + \sum_b S_b^\top A^b` with the
coefficients :math:`A^b = \Lambda^{-1} \sum_c u^b_c C^b_c` of the mean or a joint draw of :math:`q(u)`, as one
autograd function with a hand-written backward pass.

An attention layer's output is linear in its GP outputs :math:`F^b_c(x) = e^b(x) \Lambda^{-1} u^b_c`, so with a map
:math:`C^b` per branch (``(H, d_out, C)``) and the bias :math:`b` it is (docs/math.md section 3)

.. math::

    y = b + \sum_b e^b(X) A^b, \qquad A^b = \Lambda^{-1} \textstyle\sum_c u^b_c C^b_c, \qquad
    u = m + L \varepsilon \quad (\text{or } u = m),

with one ``(s, C)`` matrix :math:`A^b` per sequence (per draw), branch and head: the GP outputs are never formed.
Autograd through the draw, the branch selections, the divisions by :math:`\Lambda`, the per-branch products and the
output GEMM visits about sixty small operators, forward and backward. Here the forward pass is one batched GEMM for
every draw (:math:`L \varepsilon + m` over every head, output and branch), one scaling by :math:`\Lambda^{-1}`, one
contraction with the maps for both branches and every draw, and one output GEMM of inner dimension
:math:`K = \text{branches} \cdot H s` over the stacked scores :math:`S` (``(B, K, N)``,
:meth:`~gpattn.features.KernelEigenScores.columns`); the backward pass is the same few products:

.. math::

    \bar S = A \bar y^\top, \quad \bar A = S \bar y, \quad \bar b = \textstyle\sum \bar y, \quad
    \bar U = C \bar A^\top \Lambda^{-1}, \quad \bar m = \textstyle\sum_{\text{draws}} \bar U, \quad
    \bar L = \operatorname{tril}(\bar U \varepsilon^\top), \quad \bar C = (U \Lambda^{-1})^\top \bar A, \quad
    \bar\Lambda = -\textstyle\sum \bar U \circ U \Lambda^{-1},

the scores' gradient :math:`\bar S` in their own ``(B, K, N)`` layout (autograd through a transposed view would hand
it back transposed, and every elementwise pass over it downstream would read it with a stride of :math:`K`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._torch_compat import is_compiling
from ..fused import autocast_state, first_derivatives_only, restored_autocast


class LinearOutput(torch.autograd.Function):
    r""":math:`y = b + S^\top A` with the readout coefficients :math:`A` of ``branches`` branches (see the module
    docstring).

    Inputs:

    * ``columns`` :math:`S` ``(B, K, N)``: the stacked scores, :math:`K = \text{branches} \cdot H s` rows ordered
      (branch, head, direction); ``bias`` :math:`b`, broadcastable to ``(B, N, C)``;
    * ``mean`` :math:`m` ``(H, d_out, Q, s)``: the stacked :math:`q(u)` of ``Q`` branches (``Q = 1``: one :math:`q(u)`
      shared by every branch); or draws of :math:`u` made elsewhere, ``(H, d_out, Q, s, B)`` (with ``factor`` and
      ``noise`` ``None``);
    * ``factor`` the Cholesky parameter ``(H, d_out, Q, s, s)`` (its lower triangle :math:`L` is read) and ``noise``
      :math:`\varepsilon` ``(B, H, d_out, Q, s)``, one joint draw :math:`u = m + L \varepsilon` per sequence; or both
      ``None``: the mean :math:`u = m`;
    * ``singular_values`` :math:`\Lambda` ``(H, s)`` or ``(B, H, s)`` (a spectrum per sequence), or ``None``
      (whitened: no :math:`\Lambda^{-1}`); ``active``: ``None`` or a boolean of the shape of :math:`\Lambda`, false
      where a direction is numerically zero (its coefficients are zero);
    * ``maps`` :math:`C`: one map ``(H, d_out, C)`` for every branch, or one per branch ``(branches, H, d_out, C)``;
    * ``branches``: the number of branches read, ``Q`` or, with ``Q = 2``, 1 (the first branch alone).

    Output: ``(B, N, C)``.

    .. note:: Cost per head: O(d_out s^2 B) for the draws and O(branches d_out s B C) for the coefficients (B = 1 for
        the mean), forward and backward; O(N K C) per sequence for the output GEMM and twice that backward.
    """

    @staticmethod
    def forward(
        ctx,
        columns: Tensor,
        bias: Tensor,
        mean: Tensor,
        factor: Tensor | None,
        noise: Tensor | None,
        singular_values: Tensor | None,
        active: Tensor | None,
        maps: Tensor,
        branches: int,
    ) -> Tensor:
        ctx.autocast = autocast_state(columns.device.type)  # the backward pass runs its products in the same dtype
        stacked = mean.shape[2]
        drawn = mean.dim() == 5
        if factor is None:  # u = m (H, d_out, Q, s, 1), or draws given (H, d_out, Q, s, B)
            lower, draws = None, mean if drawn else mean.unsqueeze(-1)
        else:  # u = m + L eps for every sequence: one (s, s) x (s, B) product per head, output and branch
            lower = factor.tril()
            draws = torch.einsum("hdqij,bhdqj->hdqib", lower, noise).add_(mean.unsqueeze(-1))
        # the branches read: every branch from the one shared q(u), or the first `branches` of the stack
        if stacked == 1:
            draws = draws.expand(-1, -1, branches, -1, -1)
        elif branches < stacked:
            draws = draws[:, :, :branches]
        # U Lambda^{-1} (H, d_out, br, s, B): divided by Lambda ((H, s) or (B, H, s)), or times Lambda^{-1} with zeros
        # for the inactive directions (1 where whitened), or unscaled
        ctx.divides = singular_values is not None and active is None
        ctx.per_sequence = singular_values is not None and singular_values.dim() == 3
        inverse = None if ctx.divides else _inverse_scales(singular_values, active, mean.dtype)
        aligned = _aligned(singular_values if ctx.divides else inverse)  # as a factor of the draws, or None
        scaled = _scaled(draws, aligned, ctx.divides)
        # A = (U Lambda^{-1})^T C in the GEMM's own order (H, br, s, B, C), then one copy into the output GEMM's
        # (B or 1, K, C), K ordered (branch, head, direction)
        coefficients = torch.einsum(_PRODUCTS[maps.dim()][0], scaled, maps)
        coefficients = coefficients.permute(_TO_SEQUENCES[maps.dim()]).reshape(scaled.shape[-1], -1, maps.shape[-1])
        if coefficients.shape[0] != columns.shape[0]:  # one coefficient matrix for every sequence
            coefficients = coefficients.expand(columns.shape[0], -1, -1)
        output = torch.baddbmm(bias, columns.mT, coefficients)
        ctx.save_for_backward(columns, coefficients, lower, noise, scaled, aligned, maps)
        ctx.stacked, ctx.drawn, ctx.bias_shape = stacked, drawn, bias.shape
        return output

    @staticmethod
    @first_derivatives_only("LinearOutput")
    def backward(ctx, grad: Tensor):
        with restored_autocast(ctx.autocast):
            return _backward(ctx, grad)


def _backward(ctx, grad: Tensor) -> tuple:
    columns, coefficients, lower, noise, scaled, aligned, maps = ctx.saved_tensors
    needs = ctx.needs_input_grad
    heads, outputs, branches, rank, samples = scaled.shape  # B draws, or B sequences of their own Lambda
    # e.g. the expanded gradient of output.sum(): one copy, not one per sequence in bmm (while compiling, always: torch
    # 2.4's dynamo traces a backward pass in strict mode, where reading is_contiguous is a graph break)
    if is_compiling() or not grad.is_contiguous():
        grad = grad.contiguous()
    grad_bias = grad.sum_to_size(ctx.bias_shape) if needs[1] else None
    grad_columns = torch.bmm(coefficients, grad.mT) if needs[0] else None
    if not any(needs[2:]):
        return grad_columns, grad_bias, None, None, None, None, None, None, None
    grad_coefficients = torch.bmm(columns, grad)  # (B, K, C)
    if samples == 1:  # one coefficient matrix for every sequence
        grad_coefficients = grad_coefficients.sum(0, keepdim=True)
    # dA in the order of the forward GEMM's output, (H, br, s, B, C) or (br, H, s, B, C): one copy of a small tensor
    grad_coefficients = grad_coefficients.view(samples, branches, heads, rank, -1).permute(_TO_GEMM[maps.dim()])
    grad_coefficients = grad_coefficients.contiguous()
    _, maps_product, scaled_product = _PRODUCTS[maps.dim()]
    grad_maps = grad_mean = grad_factor = grad_singular_values = None
    if needs[7]:  # (U Lambda^{-1})^T dA, summed over the branches of a shared map
        grad_maps = torch.einsum(maps_product, scaled, grad_coefficients)
    if not (needs[2] or needs[3] or needs[5]):
        return grad_columns, grad_bias, None, None, None, None, None, grad_maps, None
    # dU = C dA^T Lambda^{-1} of every branch read: (H, d_out, branches, s, B)
    grad_draws = _scaled(torch.einsum(scaled_product, maps, grad_coefficients), aligned, ctx.divides)
    if needs[5]:  # d Lambda = -Lambda^{-2} sum (C dA^T) U = -sum dU (U Lambda^{-1}), (H, s) or per sequence (B, H, s)
        total = (grad_draws * scaled).sum((1, 2) if ctx.per_sequence else (1, 2, 4))
        grad_singular_values = (total.permute(2, 0, 1) if ctx.per_sequence else total).neg_()
    if needs[2] or needs[3]:  # summed over the branches that read one q(u)
        if ctx.stacked == 1:  # one q(u) read by every branch
            grad_draws = grad_draws.sum(2, keepdim=True)
        elif branches < ctx.stacked:  # branches not read get no gradient
            grad_draws = torch.cat([grad_draws, grad_draws.new_zeros(heads, outputs, 1, rank, samples)], dim=2)
        grad_mean = grad_draws if ctx.drawn else grad_draws.sum(-1)  # (H, d_out, Q, s[, B])
        if lower is not None and needs[3]:  # dL = tril(dU eps^T)
            grad_factor = torch.einsum("hdqib,bhdqj->hdqij", grad_draws, noise).tril()
    return grad_columns, grad_bias, grad_mean, grad_factor, None, grad_singular_values, None, grad_maps, None


# The products' einsums are written so that no operand is copied: torch.einsum lays a product out as (batch, free,
# summed) dimensions, the free ones in the order the output names them and the summed ones in the alphabetical order of
# their letters, and copies an operand whose dimensions then do not collapse into the GEMM's (six such copies per
# training step with joint draws before, each a kernel launch on a GPU). The coefficients keep the GEMM's own order,
# (H, br, s, B, C), and the one copy left per pass, into or out of the output GEMM's (B, K, C), is explicit. With one
# map per branch (merge="concat") the (branch, head) batch does not collapse and einsum copies.
_PRODUCTS = {  # maps' dimensions -> (coefficients, their maps' gradient, the scaled draws' gradient)
    3: ("hdqsb,hdc->hqsbc", "hdijk,hijkc->hdc", "hdc,hqsbc->hdqsb"),  # i, j, k: the summed (branch, s, B) in order
    4: ("hdqsb,qhdc->qhsbc", "hdqsb,qhsbc->qhdc", "qhdc,qhsbc->hdqsb"),
}
# from the GEMM's order (H, br, s, B, C) or (br, H, s, B, C) to (B, br, H, s, C) = (B, K, C), and back
_TO_SEQUENCES = {3: (3, 1, 0, 2, 4), 4: (3, 0, 1, 2, 4)}
_TO_GEMM = {3: (2, 1, 3, 0, 4), 4: (1, 2, 3, 0, 4)}


def _aligned(scales: Tensor | None) -> Tensor | None:
    # Lambda or Lambda^{-1} ((H, s), or (B, H, s) per sequence) aligned with the draws (H, d_out, branches, s, B or 1)
    if scales is None:
        return None
    if scales.dim() == 2:
        return scales.view(scales.shape[0], 1, 1, scales.shape[1], 1)
    return scales.permute(1, 2, 0).unflatten(0, (scales.shape[1], 1, 1))


def _scaled(draws: Tensor, aligned: Tensor | None, divides: bool) -> Tensor:
    # the draws (or their gradient) times Lambda^{-1}: divided by the aligned Lambda, or times the aligned Lambda^{-1}
    if aligned is None:
        return draws
    return draws / aligned if divides else draws * aligned


def _inverse_scales(singular_values: Tensor | None, active: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    # Lambda^{-1} (1 when whitened; 0 for an inactive direction), (H, s) or (B, H, s); None when nothing scales
    if singular_values is None and active is None:
        return None
    if singular_values is None:
        return active.to(dtype)
    inverse = singular_values.reciprocal()
    return inverse if active is None else torch.where(active, inverse, 0.0)
