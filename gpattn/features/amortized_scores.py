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
    # (P * P).sum(-2) reduces along the contiguous N: several times faster on CPU than vector_norm over dim -2
    squared = (columns * columns).sum(-2, keepdim=True)
    if not torch.compiler.is_compiling() and not all_finite(squared):
        inverse = inverse_norms(columns, dim=-2)
        return inverse, inverse < 1.0 / NORM_FLOOR
    return squared.clamp_min(NORM_FLOOR**2).rsqrt(), squared > NORM_FLOOR**2


class AmortizedSelfScores(torch.autograd.Function):
    r"""Self-attention scores :math:`[e^\top; r^\top]` (``(B, 2, H, s, N)``) and weights :math:`[W_e^\top; W_r^\top]`
    (``(B, 2, H, s, p)``) from the stacked feature columns and values; see the module docstring for the algebra.

    Inputs: ``columns`` :math:`[P_q; P_k]` of shape ``(B, 2, H, p, N)`` (one projection GEMM's output), ``values``
    :math:`[a_r; a_e]` of shape ``(B, 2, H, s, N)`` (ordered as the feature matrices they multiply: :math:`a_r` with
    :math:`P_q`, :math:`a_e` with :math:`P_k`), ``token_weights`` ``(B or 1, 1, 1, 1, N)`` (no gradient) and
    ``root_scale`` :math:`c` of shape ``(H, 1, 1)``. Every product runs over the ``B * 2 * H`` contiguous blocks
    of ``columns`` at once: no copy of a feature matrix.

    .. note:: Cost: forward two batched GEMMs of O(N p s) per block and one pass over the feature columns for the
        norms; backward three batched GEMMs (one of inner dimension 2s) and one pass over the feature columns.
    """

    @staticmethod
    def forward(ctx, columns: Tensor, values: Tensor, token_weights: Tensor, root_scale: Tensor):
        inverse, active = _inverse_norms(columns)  # [nu_q; nu_k]: (B, 2, H, 1, N)
        alpha = values * (inverse * token_weights)  # [a_r nu_q w; a_e nu_k w]
        paired = root_scale * (alpha @ columns.mT)  # [W_r^T; W_e^T]: (B, 2, H, s, p)
        weights = paired.flip(1)  # [W_e^T; W_r^T], the weights of the scores [e; r]
        scores = (weights @ columns) * (root_scale * inverse)  # [e^T; r^T] = c [W_e^T P_q; W_r^T P_k] nu
        ctx.save_for_backward(columns, values, token_weights, root_scale, inverse, active, alpha, weights, scores)
        return scores, weights

    @staticmethod
    def backward(ctx, grad_scores, grad_weights):
        columns, values, token_weights, root_scale, inverse, active, alpha, weights, scores = ctx.saved_tensors
        grad_scores = torch.zeros_like(scores) if grad_scores is None else grad_scores
        grad_weights = torch.zeros_like(weights) if grad_weights is None else grad_weights
        # scores = c beta nu with beta = weights @ columns: the gradients of beta, nu (partial) and c (partial)
        grad_beta = grad_scores * (root_scale * inverse)  # [d beta_e; d beta_r]
        scaled = grad_scores * scores
        grad_inverse = scaled.sum(-2, keepdim=True) / inverse  # nu > 0: the norms are finite
        total_weights = grad_weights + grad_beta @ columns.mT  # the total gradient of [W_e^T; W_r^T]
        total_paired = total_weights.flip(1)  # ... of [W_r^T; W_e^T] = c alpha columns^T
        scaled_paired = root_scale * total_paired  # c folded into the small (s, p) factor
        grad_alpha = scaled_paired @ columns  # [d alpha_r; d alpha_e]
        factor = inverse * token_weights
        grad_values = grad_alpha * factor
        grad_inverse = grad_inverse + (grad_alpha * values).sum(-2, keepdim=True) * token_weights
        grad_root_scale = None
        if ctx.needs_input_grad[3]:
            total = scaled.sum((0, 1, 3, 4)) + (total_weights * weights).sum((0, 1, 3, 4))
            grad_root_scale = (total / root_scale.flatten()).reshape(root_scale.shape)
        # the feature columns: P_q gets W_e d beta_e + c dW_r^T alpha_r, P_k gets W_r d beta_r + c dW_e^T alpha_e,
        # one batched GEMM of inner dimension 2s over every block, plus the inverse norms' term -P nu^3 d nu
        left_operand = torch.cat([weights.mT, scaled_paired.mT], dim=-1)  # (B, 2, H, p, 2s)
        right_operand = torch.cat([grad_beta, alpha], dim=-2)  # (B, 2, H, 2s, N)
        norm_term = -inverse.pow(3) * grad_inverse * active.to(inverse.dtype)
        blocks = columns.shape[0] * columns.shape[1] * columns.shape[2]
        grad_columns = torch.bmm(
            left_operand.reshape(blocks, *left_operand.shape[-2:]),
            right_operand.view(blocks, *right_operand.shape[-2:]),
        ).view(columns.shape)
        grad_columns.addcmul_(columns, norm_term)  # in place: one pass over the feature columns
        return grad_columns, grad_values, None, grad_root_scale
