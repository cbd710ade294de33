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
GEMM's output, so the backward pass hands the projection one contiguous gradient. The right operand
:math:`[\bar\beta; a \circ \nu w]` of that GEMM is one buffer whose second half the forward pass fills.

The KSVD objective (docs/math.md section 2) needs only the token sums :math:`S_k = \sum_i m_i e_{ik}^2 +
\sum_j m_j r_{jk}^2` (:math:`m` the padding mask) besides the small weights: the function returns the per-branch
sums from one reduction over the scores and adds their gradient :math:`2 \bar S_k m_i e_{ik}` to the scores'
gradient in one ``addcmul``, instead of squaring, weighting and summing transposed ``(N, s)`` views (and their
backward passes) outside.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.cosine_feature_kernel import inverse_norms
from ..validation import all_finite

#: the norm below which a feature column is not normalised further (as torch.nn.functional.normalize)
NORM_FLOOR = 1e-12
#: the rows of the feature columns squared and summed per pass when forming their norms
NORM_BLOCK = 4


def _inverse_norms(columns: Tensor) -> tuple[Tensor, Tensor]:
    """``1 / max(||column||, 1e-12)`` along ``-2`` and where the norm is above the floor (the gradient vanishes
    below it); overflowing squared norms take the rescaled path of
    :func:`~gpattn.kernels.cosine_feature_kernel.inverse_norms`."""
    if torch.compiler.is_compiling():  # fused by the compiler
        squared = (columns * columns).sum(-2, keepdim=True)
    else:
        # sum_p P_p^2 accumulated over blocks of NORM_BLOCK rows (a (NORM_BLOCK, N) temporary instead of a (p, N)
        # one: fresh large buffers cost page faults on CPU), reduced along the contiguous N: several times faster
        # on CPU than vector_norm over dim -2
        blocks = columns.split(NORM_BLOCK, dim=-2)
        accumulated = blocks[0].square()
        for block in blocks[1:]:
            if block.shape[-2] == accumulated.shape[-2]:
                accumulated.addcmul_(block, block)
            else:  # a shorter last block
                accumulated = accumulated.sum(-2, keepdim=True) + block.square().sum(-2, keepdim=True)
        squared = accumulated.sum(-2, keepdim=True)
    if not torch.compiler.is_compiling() and not all_finite(squared):
        inverse = inverse_norms(columns, dim=-2)
        return inverse, inverse < 1.0 / NORM_FLOOR
    return squared.clamp_min(NORM_FLOOR**2).rsqrt(), squared > NORM_FLOOR**2


class AmortizedSelfScores(torch.autograd.Function):
    r"""Self-attention scores :math:`[e^\top; r^\top]` (``(B, 2, H, s, N)``), weights :math:`[W_e^\top; W_r^\top]`
    (``(B, 2, H, s, p)``) and, for the KSVD objective, the token sums of the squared scores
    :math:`[\sum_i m_i e_{ik}^2; \sum_j m_j r_{jk}^2]` (``(B, 2, H, s)``) from the stacked feature columns and
    values; see the module docstring for the algebra.

    Inputs: ``columns`` :math:`[P_q; P_k]` of shape ``(B, 2, H, p, N)`` (one projection GEMM's output), ``values``
    :math:`[a_r; a_e]` of shape ``(B, 2, H, s, N)`` (ordered as the feature matrices they multiply: :math:`a_r` with
    :math:`P_q`, :math:`a_e` with :math:`P_k`), ``token_weights`` ``(B or 1, 1, 1, 1, N)`` (no gradient),
    ``root_scale`` :math:`c` of shape ``(H, 1, 1)``, ``squares`` (whether to form the sums; else the third output is
    empty) and ``square_mask``: ``None`` (every token, :math:`m = 1`) or the padding mask :math:`m` as a float
    ``(B, 1, 1, 1, N)`` tensor of zeros and ones (no gradient).
    Every product runs over the ``B * 2 * H`` contiguous blocks of ``columns`` at once: no copy of a feature matrix.

    The sums' gradient :math:`2 \bar S_k m_i e_{ik}` is added to the scores' gradient inside the backward pass (one
    ``addcmul`` over the scores), so the KSVD objective adds no pass of its own over ``(s, N)`` tensors, forward or
    backward, beyond the one reduction that forms the sums.

    .. note:: Cost: forward two batched GEMMs of O(N p s) per block, one pass over the feature columns for the
        norms and one reduction over the scores for the sums; backward three batched GEMMs (one of inner dimension
        2s) and one pass over the feature columns.
    """

    @staticmethod
    def forward(
        ctx,
        columns: Tensor,
        values: Tensor,
        token_weights: Tensor,
        root_scale: Tensor,
        squares: bool = False,
        square_mask: Tensor | None = None,
    ):
        inverse, active = _inverse_norms(columns)  # [nu_q; nu_k]: (B, 2, H, 1, N)
        rank = values.shape[-2]
        # alpha lives in the second half of a (2s, N) buffer: the backward pass writes the gradient of beta into the
        # first half and hands the buffer to its GEMM of inner dimension 2s without a concatenation
        factor = inverse * token_weights
        if torch.compiler.is_compiling():  # dynamo traces no out= into a strided view: the backward pass concatenates
            operand, alpha = None, values * factor
        else:
            operand = values.new_empty(*values.shape[:-2], 2 * rank, values.shape[-1])
            alpha = torch.mul(values, factor, out=operand[..., rank:, :])  # [a_r nu_q w; a_e nu_k w]
        paired = root_scale * (alpha @ columns.mT)  # [W_r^T; W_e^T]: (B, 2, H, s, p)
        weights = paired.flip(1)  # [W_e^T; W_r^T], the weights of the scores [e; r]
        scores = weights @ columns
        scores.mul_(root_scale * inverse)  # [e^T; r^T] = c [W_e^T P_q; W_r^T P_k] nu
        if not squares:
            sums = scores.new_empty(0)
        elif square_mask is None:  # sum_i e_ik^2: one reduction
            sums = torch.linalg.vector_norm(scores, dim=-1).square()
        else:  # sum_i m_i e_ik^2 over the real tokens
            sums = torch.linalg.vecdot(scores * square_mask, scores)
        ctx.operand, ctx.squares, ctx.square_mask = operand, squares, square_mask
        saved = (columns, values, token_weights, root_scale, inverse, active, weights, scores)
        # alpha is saved as the buffer's half (no version check: the backward pass writes the other half)
        ctx.save_for_backward(*saved, *(() if operand is not None else (alpha,)))
        if not squares:
            ctx.mark_non_differentiable(sums)
        return scores, weights, sums

    @staticmethod
    def backward(ctx, grad_scores, grad_weights, grad_squares):
        columns, values, token_weights, root_scale, inverse, active, weights, scores, *compiled = ctx.saved_tensors
        operand, square_mask = ctx.operand, ctx.square_mask
        rank = values.shape[-2]
        alpha = compiled[0] if operand is None else operand[..., rank:, :]
        # eager and not differentiable (no create_graph): the (s, N) gradients are written into the first half of
        # the forward pass's buffer, which then serves as the right operand of the columns' GEMM and as scratch
        in_place = operand is not None and not torch.is_grad_enabled()
        grad_weights = torch.zeros_like(weights) if grad_weights is None else grad_weights
        if grad_scores is None:
            grad_scores = torch.zeros_like(scores)
        # scores = c beta nu with beta = weights @ columns: d beta = (d scores + 2 m dS scores) c nu, the second term
        # from the token sums S of the squared scores
        scale = root_scale * inverse
        with_sums = grad_squares is not None and ctx.squares
        if with_sums:
            masked = scores if square_mask is None else scores * square_mask
            sums_factor = (2.0 * grad_squares).unsqueeze(-1)
        if in_place:
            grad_beta = operand[..., :rank, :]  # [d beta_e; d beta_r]
            if with_sums:
                torch.addcmul(grad_scores, masked, sums_factor, out=grad_beta).mul_(scale)
            else:
                torch.mul(grad_scores, scale, out=grad_beta)
            right_operand = operand
        else:  # compiled, or differentiable (create_graph): no writes into buffers
            total = torch.addcmul(grad_scores, masked, sums_factor) if with_sums else grad_scores
            grad_beta = total * scale
            right_operand = torch.cat([grad_beta, alpha], dim=-2)  # (B, 2, H, 2s, N)
        total_weights = grad_weights + grad_beta @ columns.mT  # the total gradient of [W_e^T; W_r^T]
        total_paired = total_weights.flip(1)  # ... of [W_r^T; W_e^T] = c alpha columns^T
        scaled_paired = root_scale * total_paired  # c folded into the small (s, p) factor
        grad_alpha = scaled_paired @ columns  # [d alpha_r; d alpha_e]
        # the feature columns: P_q gets W_e d beta_e + c dW_r^T alpha_r, P_k gets W_r d beta_r + c dW_e^T alpha_e,
        # one batched GEMM of inner dimension 2s over every block, plus the inverse norms' term -P nu^3 d nu below
        left_operand = torch.cat([weights.mT, scaled_paired.mT], dim=-1)  # (B, 2, H, p, 2s)
        blocks = columns.shape[0] * columns.shape[1] * columns.shape[2]
        grad_columns = torch.bmm(
            left_operand.reshape(blocks, *left_operand.shape[-2:]),
            right_operand.view(blocks, *right_operand.shape[-2:]),
        ).view(columns.shape)
        # d nu = sum_k (d e_k) e_k / nu + w sum_k (d alpha_k) a_k, with sum_k (d e_k) e_k = sum_k d beta_k e_k / (c nu);
        # in place, the products go into the buffer's first half (d beta is no longer needed)
        if in_place:
            score_part = grad_beta.mul_(scores).sum(-2, keepdim=True) / scale
            value_part = torch.mul(grad_alpha, values, out=grad_beta).sum(-2, keepdim=True)
            grad_values = grad_alpha.mul_(inverse * token_weights)
        else:
            score_part = (grad_beta * scores).sum(-2, keepdim=True) / scale
            value_part = (grad_alpha * values).sum(-2, keepdim=True)
            grad_values = grad_alpha * (inverse * token_weights)
        grad_inverse = score_part / inverse + value_part * token_weights  # nu > 0: the norms are finite
        grad_root_scale = None
        if ctx.needs_input_grad[3]:  # d c = sum (d e) e / c + sum dW W / c over each head
            total = score_part.sum((0, 1, 3, 4)) + (total_weights * weights).sum((0, 1, 3, 4))
            grad_root_scale = (total / root_scale.flatten()).reshape(root_scale.shape)
        norm_term = -inverse.pow(3) * grad_inverse * active.to(inverse.dtype)
        grad_columns.addcmul_(columns, norm_term)  # in place: one pass over the feature columns
        return grad_columns, grad_values, None, grad_root_scale, None, None
