r"""The amortised kernel-eigen scores of self-attention and their KSVD objective as one autograd function with a
hand-written backward pass, from the tokens and the parameters.

For one sequence and head, with the lifted tokens :math:`G` and the tokens :math:`X`, the unnormalised query and key
feature columns :math:`P_q = W_q G^\top, P_k = W_k G^\top` (``(p, N)``), their inverse norms :math:`\nu_q, \nu_k`
(``(1, N)``), the amortised values :math:`a_e = A_e(X)^\top`, :math:`a_r = A_r(X)^\top` (``(s, N)``, affine maps of
the tokens), the token weights :math:`w` (:math:`1/|V|` on the visible tokens) and :math:`c = \sqrt{\sigma_f}`
(docs/math.md section 2):

.. math::

    W_e^\top = c\, (a_e \circ \nu_k w) P_k^\top, \qquad e^\top = c\, (W_e^\top P_q) \circ \nu_q, \qquad
    W_r^\top = c\, (a_r \circ \nu_q w) P_q^\top, \qquad r^\top = c\, (W_r^\top P_k) \circ \nu_k,

and the sum-form KSVD objective :math:`J = \tfrac12 \sum_k \lambda_k^{-1} S_k - \operatorname{Tr}(W_e^\top W_r)`
with the token sums :math:`S_k = \sum_i m_i e_{ik}^2 + \sum_j m_j r_{jk}^2` (:math:`m` the padding mask).

Autograd through these products visits every ``(p, N)`` tensor several times in the backward pass (the norms'
``pow``/``sum``/``rsqrt`` chain, two gradient contributions per feature matrix and their sum, copies of transposed
gradients), and every small tensor of the objective and the parameter stacks adds a node. Written by hand, the
gradient of each feature matrix is one GEMM of inner dimension :math:`2s` plus one elementwise pass (the norms'
term):

.. math::

    \bar P_q = [W_e,\; \bar W_r] \begin{bmatrix} \bar\beta_e \\ a_r \circ c \nu_q w \end{bmatrix}
        - P_q \circ \nu_q^3 \bar\nu_q,

with :math:`\bar\beta_e = c\, \bar e^\top \circ \nu_q`, :math:`\bar W_r` the total gradient of :math:`W_r^\top`
(transposed) and :math:`\bar\nu_q` the gradient of the inverse norms; :math:`\bar P_k` likewise. The objective's
gradient enters as :math:`\bar e_{ik} \mathrel{+}= \bar J m_i e_{ik} / \lambda_k` (one ``addcmul`` over the scores)
and :math:`\bar W_e^\top = -\bar J\, W_r^\top`, :math:`\bar W_r^\top = -\bar J\, W_e^\top` (one over the small
weights). Both feature matrices come from one projection GEMM and both value maps from another; their gradients are
written by one batched GEMM each into the layout of that GEMM's output, and the parameters' gradients are one batched
GEMM and one reduction each. The right operand :math:`[\bar\beta; a \circ c \nu w]` of the feature columns'
gradient GEMM is one buffer whose second half the forward pass fills.

The two sweeps between the projection GEMMs (the norms, weights, scores and token sums forward; the gradients of the
columns and values backward) are PyTorch code, the reference and the CPU path, or on CUDA Triton kernels
(:mod:`gpattn.fused.triton_scores`, decided by :func:`~gpattn.fused.triton_scores.runs_triton`). Under autocast the
products run in the autocast dtype (the backward pass under the forward's autocast) and the norms, the token sums,
:math:`J` and the small weights' gradients in float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._torch_compat import is_compiling, values_unreadable
from ..fused import autocast_state, first_derivatives_only, full_precision, restored_autocast, wide_dtype
from ..fused.triton_scores import runs_triton, scores_backward, scores_forward
from ..kernels.cosine_feature_kernel import inverse_norms
from ..validation import check_token_magnitude, within_bound
from .learned_attention_features import GRADIENT_GROWTH

#: the norm below which a feature column is not normalised further (as torch.nn.functional.normalize)
NORM_FLOOR = 1e-12
#: the rows of the feature columns squared and summed per pass when forming their norms
NORM_BLOCK = 8


def _inverse_norms(columns: Tensor, rescaled: bool) -> tuple[Tensor, Tensor]:
    """``1 / max(||column||, 1e-12)`` along ``-2`` and where the norm is above the floor (the gradient vanishes
    below it), with the squared norms (empty when ``rescaled``): ``rescaled`` takes the overflow-safe path of
    :func:`~gpattn.kernels.cosine_feature_kernel.inverse_norms` (for squared norms that overflow)."""
    if rescaled:
        inverse = inverse_norms(columns, dim=-2)
        return inverse, inverse < 1.0 / NORM_FLOOR, columns.new_zeros(())
    if is_compiling():  # fused by the compiler
        squared = (columns * columns).sum(-2, keepdim=True)
    else:
        # sum_p P_p^2 accumulated over blocks of NORM_BLOCK rows (a (NORM_BLOCK, N) temporary instead of a (p, N)
        # one: fresh large buffers cost page faults on CPU), reduced along the contiguous N: several times faster
        # on CPU than vector_norm over dim -2
        blocks = columns.split(NORM_BLOCK, dim=-2)
        wide = wide_dtype(columns.dtype)  # bfloat16 columns: accumulated in float32
        accumulated = (blocks[0] if blocks[0].dtype == wide else blocks[0].to(wide)).square()
        for block in blocks[1:]:
            if block.shape[-2] == accumulated.shape[-2]:
                accumulated.addcmul_(block, block)
            else:  # a shorter last block
                accumulated = accumulated.sum(-2, keepdim=True) + block.square().sum(-2, keepdim=True)
        squared = accumulated.sum(-2, keepdim=True)
    return squared.clamp_min(NORM_FLOOR**2).rsqrt(), squared > NORM_FLOOR**2, squared


def _torch_forward(ctx, columns, values, outputscale, token_weights, rescaled) -> tuple:
    # the PyTorch sweep of the forward pass: scores, paired weights [W_r^T; W_e^T], squared norms and the tensors its
    # backward pass reuses (the Triton kernels' reference)
    rank, length = values.shape[-2], values.shape[-1]
    inverse, active, squared = _inverse_norms(columns, rescaled)  # [nu_q; nu_k]: (B, 2, H, 1, N)
    scale = outputscale.sqrt().view(-1, 1, 1) * inverse  # c nu
    factor = scale * token_weights  # c nu w
    # alpha = a c nu w lives in the second half of a (2s, N) buffer: the backward pass writes the gradient of beta
    # into the first half and hands the buffer to its GEMM of inner dimension 2s without a concatenation
    compiling = is_compiling()
    if compiling:  # dynamo traces no out= into a strided view: the backward pass concatenates
        ctx.operand, alpha = None, values * factor
    else:
        ctx.operand = values.new_empty(*values.shape[:-2], 2 * rank, length)
        alpha = torch.mul(values, factor, out=ctx.operand[..., rank:, :])  # [a_r c nu_q w; a_e c nu_k w]
    paired = torch.einsum("...sn,...pn->...sp", alpha, columns)  # [W_r^T; W_e^T] = alpha columns^T: (B, 2, H, s, p)
    weights = paired.flip(1)  # [W_e^T; W_r^T], the weights of the scores [e; r]
    scores = weights @ columns  # [e^T; r^T] = c [W_e^T P_q; W_r^T P_k] nu
    # in place in eager mode only: under torch.compile, torch 2.11's dynamo gives every input of an autograd function
    # a zero gradient when the function returns a tensor it modified in place (not seen with torch 2.13)
    scores = scores * scale if compiling else scores.mul_(scale)
    # alpha is saved as the buffer's half (no version check: the backward pass writes the other half)
    sweep = (inverse, active, scale, factor, weights)
    return scores, paired, squared, (*sweep, *(() if ctx.operand is not None else (alpha,)))


class AmortizedSelfScores(torch.autograd.Function):
    r"""Self-attention scores :math:`[e^\top; r^\top]` (``(B, 2, H, s, N)``) and, on request, the KSVD objective
    :math:`J` (``(B, H)``) from the tokens and the parameters; see the module docstring for the algebra.

    Inputs:

    * ``lifted`` :math:`G` ``(B, N, D)``, the kernel's lift of the tokens, or ``None`` (no lift: :math:`G = X`; one
      tensor is never passed twice, which ``torch.compile`` cannot trace), and ``tokens`` :math:`X` ``(B, N, C)``;
    * ``query_weight``, ``key_weight`` :math:`W_q, W_k` ``(H, p, D)``; ``right_map``, ``left_map`` ``(H, C, s)`` and
      ``right_bias``, ``left_bias`` ``(H, s)``, the affine maps :math:`A_r, A_e`;
    * ``token_weights`` :math:`w`: a float (every token) or ``(B, 1, 1, 1, N)`` (no gradient);
    * ``outputscale`` :math:`\sigma_f` ``(H,)``;
    * ``singular_values`` :math:`\Lambda` ``(H, s)``, or ``None`` (no objective: the second output is empty);
    * ``square_mask``: ``None`` (every token in :math:`S`, :math:`m = 1`) or the padding mask :math:`m` as a float
      ``(B, 1, 1, 1, N)`` tensor of zeros and ones (no gradient);
    * ``rescaled``: form the norms by the overflow-safe (slower) path;
    * ``guard``: ``None``, or the layer's name for the magnitude guard's message: the backward pass then checks the
      gradients it returns (those of the tokens when they need one, else those of the projections' weights, through
      which every large gradient passes) and, when one is not finite, refuses tokens beyond
      :func:`~gpattn.validation.token_magnitude_limit` of power 5 (the gradients of the KSVD penalty grow like
      :math:`|x|^5`).

    Outputs: the scores ``(B, 2, H, s, N)`` (:math:`[e^\top; r^\top]`, their halves the two branches), :math:`J`
    ``(B, H)`` (empty without ``singular_values``) and a 0-dimensional magnitude for the caller's checks (one
    synchronisation per call; empty while compiling or capturing a CUDA graph): the sum of the squared norms, of the
    scores (without ``singular_values``) or of the token sums :math:`S_k` (with them) and of :math:`|J|`. It is not
    finite when a term is not (or the sum overflows): the caller then retries with ``rescaled=True``. With
    ``singular_values`` and without ``square_mask`` it is at least every squared score (to its rounding) and every
    :math:`|J|` (a floating-point sum of non-negative terms is at least each term), so that a magnitude at most
    :math:`b \geq 2` puts every score and every :math:`J` within :math:`b`. Every product runs over the ``B * 2 * H``
    contiguous blocks of the feature columns at once.

    .. note:: Cost: forward two projection GEMMs of O(N (C + D)(p + s)) per sequence and head, two batched GEMMs of
        O(N p s) per block, one pass over the feature columns for the norms and one reduction over the scores for
        the token sums; backward three batched GEMMs of O(N p s) per block (one of inner dimension 2s), one pass
        over the feature columns and four projection GEMMs (the parameters' and the tokens' gradients).
    """

    @staticmethod
    def forward(
        ctx,
        lifted: Tensor | None,
        tokens: Tensor,
        query_weight: Tensor,
        key_weight: Tensor,
        right_map: Tensor,
        left_map: Tensor,
        right_bias: Tensor,
        left_bias: Tensor,
        token_weights: Tensor | float,
        outputscale: Tensor,
        singular_values: Tensor | None = None,
        square_mask: Tensor | None = None,
        rescaled: bool = False,
        guard: str | None = None,
    ):
        batch, length, heads, rank = tokens.shape[0], tokens.shape[1], right_map.shape[0], right_map.shape[-1]
        ctx.autocast = autocast_state(tokens.device.type)  # the backward pass runs its products in the same dtype
        # [P_q; P_k] and [a_r; a_e] by one GEMM each over every head: (B, 2, H, p, N) and (B, 2, H, s, N)
        projection = torch.cat([query_weight, key_weight]).flatten(0, 1)  # (2 H p, D)
        token_columns = tokens.mT
        ctx.same_tokens = lifted is None
        lifted = tokens if lifted is None else lifted
        lifted_columns = token_columns if ctx.same_tokens else lifted.mT
        columns = torch.matmul(projection, lifted_columns).view(batch, 2, heads, -1, length)
        value_weight = torch.cat([right_map, left_map]).mT.reshape(2 * heads * rank, -1)  # (2 H s, C)
        value_bias = torch.cat([right_bias, left_bias]).view(-1, 1)
        values = torch.baddbmm(value_bias, value_weight.expand(batch, -1, -1), token_columns)
        values = values.view(batch, 2, heads, rank, length)
        ctx.triton = runs_triton(columns) and not rescaled
        if ctx.triton:  # one launch of B H programs: scores, weights, token sums, squared norms
            root_scale = outputscale.sqrt()
            with_sums = singular_values is not None
            scores, paired, sums, squared = scores_forward(
                columns, values, token_weights, square_mask, root_scale, with_sums, NORM_FLOOR**2
            )
            sweep = (root_scale,)
        else:
            scores, paired, squared, sweep = _torch_forward(ctx, columns, values, outputscale, token_weights, rescaled)
            sums = None
        objective = half_inverse = None
        # under autocast the products run in bfloat16 (or float16); J, a difference of sums that cancel near a
        # stationary point, and the small weights' gradients are formed in float32; a half-precision layer outside
        # autocast (its parameters half too) computes them in its own dtype, as its magnitude guard assumes
        wide = wide_dtype(scores.dtype) if ctx.autocast is not None else scores.dtype
        paired = paired if paired.dtype == wide else paired.to(wide)
        if sums is not None and sums.dtype != wide:  # the kernels' float32 token sums, for a half-precision layer
            sums = sums.to(wide)
        if singular_values is not None:
            with full_precision(ctx.autocast):
                if sums is None:  # the PyTorch sweep: the token sums here
                    wide_scores = scores if scores.dtype == wide else scores.to(wide)
                    if square_mask is None:  # sum_i e_ik^2: one reduction
                        sums = torch.linalg.vecdot(wide_scores, wide_scores)  # (B, 2, H, s): S_k sums the branches
                    else:  # sum_i m_i e_ik^2 over the real tokens
                        sums = torch.linalg.vecdot(wide_scores * square_mask, wide_scores)
                half_inverse = torch.div(0.5, singular_values)  # 1 / (2 lambda)
                coupling = paired.prod(1).sum((-2, -1))  # Tr(W_e^T W_r)
                weighted = torch.einsum("bqhs,hs->bh", sums, half_inverse)  # strides (1, B)
                if is_compiling():  # laid out as the gradient autograd hands back (contiguous): dynamo traces the
                    # backward pass with a gradient laid out as this output, and under dynamic shapes it read the
                    # batch size from the strides of (1, B). -c + w is w - c exactly, in the contiguous layout of c;
                    # a fresh tensor, not .contiguous() (an alias at B = 1: torch 2.11 then got the tokens' gradient
                    # wrong)
                    objective = coupling.neg() + weighted
                else:
                    objective = weighted - coupling  # an output: not in place
        if values_unreadable():  # nothing can be read
            magnitude = scores.new_empty(0)
        else:  # one number for the caller's checks (see the docstring)
            magnitude = squared.sum() + (scores.sum() if sums is None else sums.sum())
            if singular_values is not None:
                magnitude = magnitude.add_(torch.linalg.vector_norm(objective, 1, dtype=magnitude.dtype))
        ctx.square_mask, ctx.token_weights, ctx.guard = square_mask, token_weights, guard
        saved = (lifted, tokens, projection, value_weight, values, columns, outputscale, paired, scores, half_inverse)
        ctx.save_for_backward(*saved, sums, *sweep)
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros
        if objective is None:
            objective = scores.new_empty(0)
            ctx.mark_non_differentiable(objective, magnitude)  # one call: a second one replaces the first
        else:
            ctx.mark_non_differentiable(magnitude)
        return scores, objective, magnitude

    @staticmethod
    @first_derivatives_only("AmortizedSelfScores")
    def backward(ctx, grad_scores, grad_objective, grad_magnitude):
        with restored_autocast(ctx.autocast):
            return _backward(ctx, grad_scores, grad_objective)


def _backward(ctx, grad_scores, grad_objective):
    lifted, tokens, projection, value_weight, values, columns, outputscale, paired, scores, half_inverse, *rest = (
        ctx.saved_tensors
    )
    sums, *sweep = rest
    with_objective = grad_objective is not None and half_inverse is not None
    sums_factor = None
    if with_objective:  # dJ / (2 lambda): the gradient of the token sums S in J
        with full_precision(ctx.autocast):
            sums_factor = torch.einsum("bh,hs->bhs", grad_objective, half_inverse)
    if ctx.triton:
        grad_columns, grad_values, total_paired, score_sums = scores_backward(
            columns, values, scores, paired, grad_scores, grad_objective if with_objective else None, sums_factor,
            ctx.token_weights, ctx.square_mask, sweep[0], NORM_FLOOR**2,
        )  # fmt: skip
        score_total = score_sums.sum(0)
    else:
        grad_columns, grad_values, total_paired, score_total = _torch_backward(
            ctx, columns, values, paired, scores, sweep, grad_scores, grad_objective, sums_factor
        )
    large = _projection_gradients(ctx, lifted, tokens, projection, value_weight, grad_columns, grad_values)
    grad_outputscale = grad_singular_values = None
    with full_precision(ctx.autocast):
        if ctx.needs_input_grad[9]:  # d c = (sum (d e) e + sum dW W) / c over each head; d sigma_f = d c / (2 c)
            total_paired = total_paired if total_paired.dtype == paired.dtype else total_paired.to(paired.dtype)
            total = score_total + torch.einsum("bqhsp,bqhsp->h", total_paired, paired)
            grad_outputscale = total.div_(2.0 * outputscale)
        if ctx.needs_input_grad[10] and with_objective:  # dJ / d lambda_k = -S_k / (2 lambda_k^2)
            # two operands: torch.einsum searches a contraction path (opt_einsum) on every call with three
            grad_singular_values = torch.einsum("bhs,bqhs->hs", sums_factor, sums).mul_(half_inverse).mul_(-2.0)
    return *large, None, grad_outputscale, grad_singular_values, None, None, None


def _narrowed(factor: Tensor, dtype: torch.dtype) -> Tensor:
    r"""A float32 factor of a product written into a ``dtype`` buffer under autocast: rounded to bfloat16 first (same
    exponent range as float32: at most one more rounding; torch 2.1 has no CPU kernel that mixes bfloat16 and float32
    in one product), kept in float32 for float16 (whose range ends at 65504: rounded alone, a factor such as
    :math:`\nu^2` or :math:`\bar J / 2\lambda` would overflow; the product is formed in float32 and rounded once)."""
    return factor.to(dtype) if dtype == torch.bfloat16 and factor.dtype != dtype else factor


def _torch_backward(ctx, columns, values, paired, scores, sweep, grad_scores, grad_objective, sums_factor) -> tuple:
    # the PyTorch sweep of the backward pass: the gradients of the columns and the values, the total gradient of
    # [W_r^T; W_e^T] and the sum over every token of sum_k d beta_k e_k / (c nu) per head (the output scale's)
    inverse, active, scale, factor, weights, *compiled = sweep
    operand, square_mask = ctx.operand, ctx.square_mask
    batch, _, heads, rank, _ = scores.shape
    if weights.dtype != paired.dtype:  # under autocast: [W_e^T; W_r^T] in J's dtype, as paired
        weights = paired.flip(1)
    # eager (first derivatives only: first_derivatives_only refuses create_graph): the (s, N) gradients are written
    # into the first half of the forward pass's buffer, which then serves as the right operand of the columns' GEMM and
    # as scratch
    in_place = operand is not None
    if grad_scores is None:
        grad_scores = torch.zeros_like(scores)
    with_objective = sums_factor is not None
    # scores = c beta nu with beta = weights @ columns: d beta = (d scores + dJ m scores / lambda) c nu, the second
    # term from the token sums S of the squared scores in J
    if with_objective:
        if square_mask is not None and square_mask.dtype != scores.dtype:  # zeros and ones: exact in any dtype
            square_mask = square_mask.to(scores.dtype)
        masked = scores if square_mask is None else scores * square_mask
        sums_factor = sums_factor.view(batch, 1, heads, rank, 1)
        sums_factor = _narrowed(sums_factor, scores.dtype)
    if in_place:
        grad_beta = operand[..., :rank, :]  # [d beta_e; d beta_r]
        if with_objective:
            torch.addcmul(grad_scores, masked, sums_factor, value=2.0, out=grad_beta).mul_(scale)
        else:
            torch.mul(grad_scores, scale, out=grad_beta)
        right_operand = operand
    else:  # compiled: no writes into buffers
        total = torch.addcmul(grad_scores, masked, sums_factor, value=2.0) if with_objective else grad_scores
        grad_beta = total * scale
        alpha = compiled[0]
        right_operand = torch.cat([grad_beta, alpha], dim=-2)  # (B, 2, H, 2s, N)
    # the total gradient of [W_r^T; W_e^T] = alpha columns^T: through the scores, and -dJ [W_e^T; W_r^T] from the
    # trace Tr(W_e^T W_r)
    total_paired = torch.einsum("...sn,...pn->...sp", grad_beta, columns).flip(1)
    if with_objective:
        total_paired = torch.addcmul(total_paired, weights, grad_objective.view(batch, 1, heads, 1, 1), value=-1)
    grad_alpha = total_paired @ columns  # [d alpha_r; d alpha_e]
    # the feature columns: P_q gets W_e d beta_e + dW_r^T alpha_r, P_k gets W_r d beta_r + dW_e^T alpha_e, one
    # batched GEMM of inner dimension 2s over every block, plus the inverse norms' term -P nu^3 d nu below
    left_operand = torch.cat([weights, total_paired], dim=-2)  # (B, 2, H, 2s, p)
    grad_columns = torch.einsum("...kp,...kn->...pn", left_operand, right_operand)
    # d nu = sum_k (d e_k) e_k / nu + sum_k (d alpha_k) alpha_k / nu, with sum_k (d e_k) e_k = sum_k d beta_k e_k /
    # (c nu); in place, the products go into the buffer's first half (d beta is no longer needed)
    if in_place:
        score_part = grad_beta.mul_(scores).sum(-2, keepdim=True) / scale
        value_part = torch.mul(grad_alpha, values, out=grad_beta).sum(-2, keepdim=True)
        grad_values = grad_alpha.mul_(factor)
    else:
        score_part = (grad_beta * scores).sum(-2, keepdim=True) / scale
        value_part = (grad_alpha * values).sum(-2, keepdim=True)
        grad_values = grad_alpha * factor
    # the norms' term nu^3 d nu with d nu = (score_part + value_part c nu w) / nu (nu > 0: the norms are finite); no
    # gradient below the norm floor
    norm_term = torch.where(active, torch.addcmul(score_part, value_part, factor).mul_(inverse.square()), 0.0)
    grad_columns.addcmul_(columns, _narrowed(norm_term, grad_columns.dtype), value=-1.0)  # one pass over the columns
    return grad_columns, grad_values, total_paired, score_part.sum((0, 1, 3, 4))


def _projection_gradients(ctx, lifted, tokens, projection, value_weight, grad_columns, grad_values) -> tuple:
    # the gradients of the lifted tokens, the tokens and the six parameters of the two projection GEMMs: one GEMM
    # each, the parameters' summed over the sequences afterwards (one batched GEMM and one reduction: addbmm would run
    # one GEMM per sequence, each a parallel region that waits for its threads on a busy CPU), handed back as views
    # of the stacked gradients
    batch, _, heads, rank, _ = grad_values.shape
    needs = ctx.needs_input_grad
    grad_columns = grad_columns.view(batch, projection.shape[0], -1)  # (B, 2 H p, N)
    grad_bias = grad_values.sum((0, 4)) if needs[6] or needs[7] else None  # (2, H, s)
    grad_values = grad_values.view(batch, value_weight.shape[0], -1)  # (B, 2 H s, N)
    grad_lifted = grad_tokens = None
    if needs[0] or (ctx.same_tokens and needs[1]):
        grad_lifted = torch.matmul(grad_columns.mT, projection)
    if needs[1]:
        grad_tokens = torch.matmul(grad_values.mT, value_weight)
    if ctx.same_tokens and grad_lifted is not None:  # G = X: both gradients go to the tokens
        grad_tokens = grad_lifted if grad_tokens is None else grad_tokens.add_(grad_lifted)
        grad_lifted = None
    grad_query = grad_key = grad_right = grad_left = grad_right_bias = grad_left_bias = None
    grad_projection = grad_maps = None
    if needs[2] or needs[3]:
        grad_projection = torch.bmm(grad_columns, lifted).sum(0)  # (2 H p, D)
        grad_query, grad_key = grad_projection.view(2, heads, -1, lifted.shape[-1]).unbind(0)
    if needs[4] or needs[5]:
        grad_maps = torch.bmm(grad_values, tokens).sum(0).view(2, heads, rank, -1)  # (2, H, s, C)
        grad_right, grad_left = grad_maps.mT.contiguous().unbind(0)  # the maps' (H, C, s) layout
    if grad_bias is not None:
        grad_right_bias, grad_left_bias = grad_bias.unbind(0)
    if ctx.guard is not None:
        watched = (grad_tokens, grad_lifted) if grad_tokens is not None else (grad_projection, grad_maps)
        _check_gradients(watched, tokens, ctx.guard)
    return grad_lifted, grad_tokens, grad_query, grad_key, grad_right, grad_left, grad_right_bias, grad_left_bias


def _check_gradients(gradients: tuple[Tensor | None, ...], tokens: Tensor, where: str) -> None:
    # the magnitude guard of the backward pass: one reduction per gradient and one synchronisation while they are
    # finite; a sum that is not finite is settled by within_bound (finite entries whose sum overflows pass)
    total = None
    for gradient in gradients:
        if gradient is not None:
            total = gradient.sum() if total is None else total + gradient.sum()
    if total is not None and not math.isfinite(total.item()) and not within_bound(gradients):
        check_token_magnitude(tokens, GRADIENT_GROWTH, where, power=5)
