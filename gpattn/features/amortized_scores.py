r"""The amortised kernel-eigen scores of self-attention as one autograd function with a hand-written backward pass.

For one sequence and head, with the unnormalised query and key feature columns :math:`P_q, P_k` (``(p, N)``), their
inverse norms :math:`\nu_q, \nu_k` (``(1, N)``), the amortised values :math:`a_e = A_e(X)^\top`,
:math:`a_r = A_r(X)^\top` (``(s, N)``), the token weights :math:`w` (:math:`1/|V|` on the visible tokens) and
:math:`c = \sqrt{\sigma_f}` (docs/math.md section 2):

.. math::

    W_e^\top = c\, (a_e \circ \nu_k w) P_k^\top, \qquad e^\top = c\, (W_e^\top P_q) \circ \nu_q, \qquad
    W_r^\top = c\, (a_r \circ \nu_q w) P_q^\top, \qquad r^\top = c\, (W_r^\top P_k) \circ \nu_k.

Autograd through these products visits every ``(p, N)`` tensor several times in the backward pass (the norms'
``pow``/``sum``/``rsqrt`` chain, two gradient contributions per feature matrix and their sum, copies of transposed
gradients). Written by hand, the gradient of each feature matrix is one GEMM of inner dimension :math:`2s` plus one
elementwise pass (the norms' term):

.. math::

    \bar P_q = [W_e,\; c\, \bar W_r] \begin{bmatrix} \bar\beta_e \\ a_r \circ \nu_q w \end{bmatrix}
        - P_q \circ \nu_q^3 \bar\nu_q,

with :math:`\bar\beta_e = c\, \bar e^\top \circ \nu_q`, :math:`\bar W_r` the total gradient of :math:`W_r^\top`
(transposed) and :math:`\bar\nu_q` the gradient of the inverse norms; :math:`\bar P_k` likewise. Both feature
matrices come from one projection GEMM and their gradients are written by one batched GEMM into the layout of that
GEMM's output, so the backward pass hands the projection one contiguous gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.cosine_feature_kernel import inverse_norms
from ..validation import all_finite

#: the norm below which a feature column is not normalised further (as torch.nn.functional.normalize)
NORM_FLOOR = 1e-12


def _inverse_norms(columns: Tensor) -> tuple[Tensor, Tensor]:
    """``1 / max(||column||, 1e-12)`` along ``-2`` and where the norm is above the floor (the gradient vanishes
    below it); overflowing squared norms take the rescaled path of
    :func:`~gpattn.kernels.cosine_feature_kernel.inverse_norms`."""
    norms = torch.linalg.vector_norm(columns, dim=-2, keepdim=True)  # one pass, no temporary
    if not torch.compiler.is_compiling() and not all_finite(norms):
        inverse = inverse_norms(columns, dim=-2)
        return inverse, inverse < 1.0 / NORM_FLOOR
    return norms.clamp_min(NORM_FLOOR).reciprocal(), norms > NORM_FLOOR


class AmortizedSelfScores(torch.autograd.Function):
    r"""Self-attention scores :math:`e^\top, r^\top` (``(B, H, s, N)``) and weights :math:`W_e^\top, W_r^\top`
    (``(B, H, s, p)``) from the stacked feature columns and values; see the module docstring for the algebra.

    Inputs: ``columns`` :math:`[P_q; P_k]` of shape ``(B, 2, H, p, N)`` (one projection GEMM's output), ``values``
    :math:`[a_e; a_r]` of shape ``(B, 2, H, s, N)``, ``token_weights`` ``(B or 1, 1, 1, 1, N)`` (no gradient) and
    ``root_scale`` :math:`c` of shape ``(H, 1, 1)``.

    .. note:: Cost: forward four batched GEMMs of O(N p s) and one pass over the feature columns for the norms;
        backward five GEMMs of O(N p s) (one of inner dimension 2s for both feature matrices) and one pass over the
        feature columns.
    """

    @staticmethod
    def forward(ctx, columns: Tensor, values: Tensor, token_weights: Tensor, root_scale: Tensor):
        query_columns, key_columns = columns.unbind(1)
        left_values, right_values = values.unbind(1)
        inverse, active = _inverse_norms(columns)  # (B, 2, H, 1, N)
        query_inverse, key_inverse = inverse.unbind(1)
        weights = token_weights.squeeze(1)  # (B, 1, 1, N)
        left_alpha = left_values * (key_inverse * weights)  # a_e nu_k w: (B, H, s, N)
        right_alpha = right_values * (query_inverse * weights)
        left_weights = root_scale * (left_alpha @ key_columns.mT)  # W_e^T: (B, H, s, p)
        right_weights = root_scale * (right_alpha @ query_columns.mT)
        left_beta = left_weights @ query_columns  # W_e^T P_q: (B, H, s, N)
        right_beta = right_weights @ key_columns
        left = left_beta * (root_scale * query_inverse)  # e^T
        right = right_beta * (root_scale * key_inverse)  # r^T
        ctx.save_for_backward(
            columns, values, token_weights, root_scale, inverse, active, left_weights, right_weights, left, right
        )
        return left, right, left_weights, right_weights

    @staticmethod
    def backward(ctx, grad_left, grad_right, grad_left_weights, grad_right_weights):
        columns, values, token_weights, root_scale, inverse, active, left_weights, right_weights, left, right = (
            ctx.saved_tensors
        )
        query_columns, key_columns = columns.unbind(1)
        left_values, right_values = values.unbind(1)
        query_inverse, key_inverse = inverse.unbind(1)
        weights = token_weights.squeeze(1)
        zeros_scores, zeros_weights = torch.zeros_like(left), torch.zeros_like(left_weights)
        grad_left = zeros_scores if grad_left is None else grad_left
        grad_right = zeros_scores if grad_right is None else grad_right
        grad_left_weights = zeros_weights if grad_left_weights is None else grad_left_weights
        grad_right_weights = zeros_weights if grad_right_weights is None else grad_right_weights
        # e^T = c beta_e nu_q: the gradients of beta_e, nu_q (partial) and c (partial)
        grad_left_beta = grad_left * (root_scale * query_inverse)
        grad_right_beta = grad_right * (root_scale * key_inverse)
        scaled_left, scaled_right = grad_left * left, grad_right * right  # c d/dc of the scores' last factor
        grad_query_inverse = scaled_left.sum(-2, keepdim=True) / query_inverse  # nu > 0: the norms are finite
        grad_key_inverse = scaled_right.sum(-2, keepdim=True) / key_inverse
        # beta_e = W_e^T P_q: the total gradient of W_e^T
        total_left_weights = grad_left_weights + grad_left_beta @ query_columns.mT
        total_right_weights = grad_right_weights + grad_right_beta @ key_columns.mT
        # W_e^T = c alpha_e P_k^T, alpha_e = a_e nu_k w
        grad_left_alpha = root_scale * (total_left_weights @ key_columns)  # (B, H, s, N)
        grad_right_alpha = root_scale * (total_right_weights @ query_columns)
        key_factor, query_factor = key_inverse * weights, query_inverse * weights
        grad_values = torch.stack([grad_left_alpha * key_factor, grad_right_alpha * query_factor], dim=1)
        grad_key_inverse = grad_key_inverse + (grad_left_alpha * left_values).sum(-2, keepdim=True) * weights
        grad_query_inverse = grad_query_inverse + (grad_right_alpha * right_values).sum(-2, keepdim=True) * weights
        grad_root_scale = None
        if ctx.needs_input_grad[3]:
            total = (
                scaled_left.sum((0, 2, 3))
                + scaled_right.sum((0, 2, 3))
                + (total_left_weights * left_weights).sum((0, 2, 3))
                + (total_right_weights * right_weights).sum((0, 2, 3))
            )
            grad_root_scale = (total / root_scale.flatten()).reshape(root_scale.shape)
        # the feature columns: one GEMM of inner dimension 2s per matrix, both matrices in one batched call,
        # written into the (B, 2, H, p, N) layout, plus the inverse norms' term -P nu^3 d nu
        left_operand = torch.stack(
            [
                torch.cat([left_weights.mT, root_scale * total_right_weights.mT], dim=-1),  # for P_q: (B, H, p, 2s)
                torch.cat([right_weights.mT, root_scale * total_left_weights.mT], dim=-1),  # for P_k
            ],
            dim=1,
        )
        right_operand = torch.stack(
            [
                torch.cat([grad_left_beta, right_values * query_factor], dim=-2),  # (B, H, 2s, N)
                torch.cat([grad_right_beta, left_values * key_factor], dim=-2),
            ],
            dim=1,
        )
        grad_inverse = torch.stack([grad_query_inverse, grad_key_inverse], dim=1)  # (B, 2, H, 1, N)
        norm_term = -inverse.pow(3) * grad_inverse * active.to(inverse.dtype)
        batch = columns.shape[0] * 2 * columns.shape[2]
        grad_columns = torch.baddbmm(
            (columns * norm_term).reshape(batch, *columns.shape[-2:]),
            left_operand.reshape(batch, *left_operand.shape[-2:]),
            right_operand.reshape(batch, *right_operand.shape[-2:]),
        ).view(columns.shape)
        return grad_columns, grad_values, None, grad_root_scale
