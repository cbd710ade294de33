"""Canonical multi-head softmax attention: the deterministic baseline (docs/math.md section 5)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fused import wide_dtype
from ..validation import _is_tracing, check_token_magnitude
from ._base import AttentionLayer

#: what overflows at large tokens, for the message of the magnitude guard
GROWTH = "the attention scores <q, k> grow like |x|^2"


class SoftmaxAttention(AttentionLayer):
    r"""Multi-head scaled dot-product attention (Vaswani et al. 2017), the softmax baseline.

    Per head :math:`h`, with :math:`Q = X W_q^h`, :math:`K = Z W_k^h`, :math:`V = Z W_v^h` of width
    :math:`p = C / H`,

    .. math::

        O^h = \operatorname{softmax}\Big(\frac{Q K^\top}{\sqrt{p}} + B\Big) V, \qquad
        \text{output} = \operatorname{dropout}\big([O^1, \dots, O^H] W_o\big),

    where the bias :math:`B` is :math:`-\infty` on masked keys (padding) or above the diagonal (``"causal"``).
    The softmax numerator is the exponential dot-product kernel
    :math:`\kappa(x, z) = \exp(\langle W_q x, W_k z\rangle / \sqrt{p})` of docs/math.md section 1, row-normalised.
    The computation is :func:`torch.nn.functional.scaled_dot_product_attention`, so fused kernels are used where
    PyTorch has them; the layer equals :class:`torch.nn.MultiheadAttention` with the same weights (up to where the
    dropout is applied: here on the output, as in every gpattn layer, rather than on the attention weights).

    Deterministic: ``kl_divergence()`` is zero and ``posterior`` has zero variance.

    The scores grow like :math:`|x|^2`: scores that overflow, or a NaN or an infinity in the heads' output, raise a
    ``ValueError`` when the tokens exceed :func:`~gpattn.validation.token_magnitude_limit` (1.8e16 in float32,
    1.3e151 in float64). The scores are checked, not only the output: PyTorch's fused CPU kernel can return zeros
    instead of NaN for overflowing scores (a row of them comes out as zeros, as a fully masked row does; seen with torch
    2.13 on an AMD EPYC processor, depending on the values). On the normal path the check is one fused reduction over
    the queries, keys and output and one synchronisation: no product :math:`\langle q, k \rangle` can overflow while
    :math:`p \max|Q| \max|K|` is below the largest value of the kernels' accumulation dtype (float32 for half
    precision); only past that bound are the products formed, a block of queries at a time, and checked. The guard
    sees the forward pass only: PyTorch's fused CPU backward already returns NaN gradients for :math:`W_q, W_k` once
    the scores reach about :math:`10^{32}` (tokens of about :math:`10^{16}` in float32, :math:`10^{150}` in float64),
    where the forward output is still finite and the explicit softmax gives the correct zero gradients of a saturated
    softmax; a training loop meets them as a divergence.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H` (must divide ``embed_dim``).
    :param dropout: Dropout on the output.

    .. note:: Cost per call: O(B N C^2) for the projections and O(B N M C) time for the scores; memory O(B H N M)
        for the materialised scores (less with fused kernels).
    """

    is_stochastic = False
    supports_graph_capture = True

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__(embed_dim, num_heads, dropout)
        self.q_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.k_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.v_proj = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        """Scaled dot-product attention of every head, concatenated and projected.

        :param x: Query tokens, shape ``(B, N, C)``.
        :param mask: ``None``, a boolean padding mask ``(B, M)`` (``True`` = real token) or ``"causal"``.
        :param context: Key tokens ``(B, M, C)`` for cross-attention, or ``None`` (self-attention).
        :return: Shape ``(B, N, C)``.
        """
        inputs = self._prepare(x, mask, context)
        queries = self.split_heads(self.q_proj(inputs.queries))  # shape: (B, H, N, p)
        keys = self.split_heads(self.k_proj(inputs.keys))  # shape: (B, H, M, p)
        values = self.split_heads(self.v_proj(inputs.keys))  # shape: (B, H, M, p)
        attn_mask = None
        if inputs.key_mask is not None:
            # True = may attend; broadcast over heads and queries: (B, M) -> (B, 1, 1, M) ~ (B, 1, N, M)
            attn_mask = inputs.key_mask[:, None, None, :]
        heads = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attn_mask, is_causal=inputs.causal, scale=1.0 / math.sqrt(self.head_dim)
        )  # shape: (B, H, N, p)
        if not _scores_within_range(queries, keys, heads, attn_mask, inputs.causal):
            check_token_magnitude((inputs.queries, inputs.keys), GROWTH, where=type(self).__name__)
        return self.project_out(heads)


#: the scores formed at a time by the check past the bound (a block of queries of every head of one sequence)
SCORE_BLOCK = 2**22


def _scores_within_range(queries: Tensor, keys: Tensor, heads: Tensor, mask: Tensor | None, causal: bool) -> bool:
    r"""Whether every product :math:`\langle q, k \rangle` a query attends with (formed before its scaling by
    :math:`1/\sqrt{p}`, as the fused kernels form it, and in float32 for half precision, the kernels' accumulation
    dtype) is finite, and the heads' output is (see :class:`SoftmaxAttention`): ``True`` while tracing or compiling and
    on ``meta`` (nothing to read)."""
    if _is_tracing() or heads.device.type == "meta":
        return True
    with torch.no_grad():
        largest = torch.stack(torch._foreach_norm([queries, keys, heads], math.inf))  # one pass
        largest_query, largest_key, largest_head = largest.tolist()  # one read
        if not math.isfinite(largest_head):
            return False
        wide = wide_dtype(queries.dtype)
        if queries.shape[-1] * largest_query * largest_key <= torch.finfo(wide).max:  # |<q, k>| <= p max|q| max|k|
            return True
        # past the bound: the products themselves, a block of queries of one sequence at a time, read once
        length, keys_length = queries.shape[-2], keys.shape[-2]
        block = max(1, SCORE_BLOCK // (queries.shape[1] * keys_length))
        finite = []
        for sequence in range(queries.shape[0]):
            sequence_keys = keys[sequence].to(wide).mT
            for start in range(0, length, block):
                products = queries[sequence, :, start : start + block].to(wide) @ sequence_keys
                if mask is not None:  # products with masked keys are never used
                    products = products.masked_fill(~mask[sequence], 0.0)
                if causal:  # nor those with later keys
                    rows = torch.arange(start, start + products.shape[-2], device=products.device)[:, None]
                    later = torch.arange(keys_length, device=products.device) > rows
                    products = products.masked_fill(later, 0.0)
                finite.append(torch.isfinite(products).all())
        return bool(torch.stack(finite).all())
