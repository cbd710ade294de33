"""Amortised attention features (gpattn's default): learned maps estimate the singular vectors of every sequence."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._torch_compat import compilable
from ..ksvd import ksvd_objective
from ..validation import all_finite, square_limit
from .amortized_scores import AmortizedSelfScores
from .kernel_eigen_scores import KernelEigenScores
from .learned_attention_features import Columns, LearnedAttentionFeatures
from .sequence_sums import prefix_mean_outer

# the fused scores as torch.compile should meet it (gpattn._torch_compat.compilable: a graph break on torch < 2.4)
_amortized_self_scores = compilable(AmortizedSelfScores.apply)


class AmortizedAttentionFeatures(LearnedAttentionFeatures):
    r"""``features="amortized"`` (gpattn's default; length-agnostic, mask-friendly): learned maps
    :math:`A_e, A_r: \mathbb R^C \to \mathbb R^s` (one affine map per head) estimate the singular vectors,

    .. math::

        W_{e|X} = \Phi_k^\top A_e(Z) / M, \qquad W_{r|X} = \Phi_q^\top A_r(X) / N, \qquad
        e(x) = \kappa(x, Z) A_e(Z) / M, \qquad r(z) = \kappa(X, z)^\top A_r(X) / N,

    computed in the primal in O(N p s) without forming :math:`K` (docs/math.md section 2). Padding masks drop keys from
    the sums; a causal mask turns them into prefix means (:math:`e_i, r_i` of the prefix :math:`j \le i`).
    Self- and cross-attention, padding and causal masks, any length. ``tie_qk`` ties the two maps. The arguments are
    those of :class:`~gpattn.features.AttentionKernelEigenFeatures` (cosine kernel, sum-form penalty).

    Self-attention without a causal mask and without kernel diagonals takes the fused path
    (:meth:`takes_paired_path`): one autograd function with a hand-written backward pass
    (:class:`~gpattn.features.amortized_scores.AmortizedSelfScores`) computes both branches as the halves of one
    ``(B, 2, H, s, N)`` tensor, :attr:`~gpattn.features.KernelEigenScores.stacked`; under autocast it runs its
    products in the autocast dtype and :math:`J` in float32.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> features = AmortizedAttentionFeatures(embed_dim=16, num_heads=2, num_inducing=3)
        >>> scores = features(torch.randn(4, 9, 16), kernel_diag=False)
        >>> scores.left_scores.shape, scores.columns().shape  # e (B, H, N, s), [e^T; r^T] (B, 2, H, s, N)
        (torch.Size([4, 2, 9, 3]), torch.Size([4, 2, 2, 3, 9]))
        >>> features.singular_values  # learned, log 2 at initialisation
        tensor([[0.6931, 0.6931, 0.6931],
                [0.6931, 0.6931, 0.6931]], grad_fn=<AddBackward0>)

    .. note:: Cost O(N C s + N p s) per sequence and head, O(N p s) memory per position more with a causal mask.
    """

    mode = "amortized"
    has_paired_path = True
    supports_causal = True
    supported_calls = "every call"

    def _build_weights(self, max_len: int | None) -> None:
        heads, width, rank = self.num_heads, self.embed_dim, self.num_inducing
        bound = width**-0.5
        # A_e, A_r: R^C -> R^s per head, as nn.Linear; shape (H, C, s) and (H, s)
        self.left_map = torch.nn.Parameter(torch.empty(heads, width, rank).uniform_(-bound, bound))
        self.left_bias = torch.nn.Parameter(torch.zeros(heads, rank))
        if not self.tie_qk:
            self.right_map = torch.nn.Parameter(torch.empty(heads, width, rank).uniform_(-bound, bound))
            self.right_bias = torch.nn.Parameter(torch.zeros(heads, rank))

    def _value_columns(self, tokens: Tensor, side: str) -> Tensor:
        r""":math:`A_e(Z)^\top` / :math:`A_r(X)^\top`, shape ``(B, H, s, n)``: one GEMM ``(H s, C) x (C, n)`` per
        sequence for all heads."""
        left = side == "left" or self.tie_qk
        weight, bias = (self.left_map, self.left_bias) if left else (self.right_map, self.right_bias)
        heads, width, rank = weight.shape
        stacked = weight.mT.reshape(heads * rank, width).expand(tokens.shape[0], -1, -1)
        values = torch.bmm(stacked, tokens.mT)  # shape: (B, H s, n), contiguous
        return values.unflatten(-2, (heads, rank)) + bias.unsqueeze(-1)

    def _causal_scores(
        self, tokens: Tensor, columns: Columns, singular_values: Tensor, objective: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        # the outputs use prefix means: one (p, s) matrix per position
        query_columns, query_inverse, key_columns, key_inverse, root_scale = columns
        left_values = self._value_columns(tokens, "left")  # A_e(Z)^T: (B, H, s, M)
        right_values = self._value_columns(tokens, "right")  # A_r(X)^T: (B, H, s, N)
        query_features = (query_columns * query_inverse * root_scale).mT  # Phi_q: (B, H, N, p)
        key_features = (key_columns * key_inverse * root_scale).mT
        left_prefix = prefix_mean_outer(key_features, left_values.mT)  # W_{e|X<=i}: (B, H, N, p, s)
        right_prefix = prefix_mean_outer(query_features, right_values.mT)
        left = (query_features.unsqueeze(-2) @ left_prefix).squeeze(-2)
        right = (key_features.unsqueeze(-2) @ right_prefix).squeeze(-2)
        objective_value = None
        if objective:  # J on the causal scores the outputs use; the trace averaged over the prefixes' weights
            objective_value = ksvd_objective(
                left, right, left_prefix, right_prefix, singular_values.unsqueeze(0), weights_per_position=True
            )
        return left, right, objective_value

    def _paired_self_attention(self, tokens: Tensor, mask: Tensor | None, objective: bool) -> KernelEigenScores:
        r"""The self-attention scores and :math:`J` by :class:`~gpattn.features.amortized_scores.AmortizedSelfScores`,
        one autograd function from the tokens and the parameters (two projection GEMMs, for :math:`[P_q; P_k]` of
        shape ``(B, 2, H, p, N)`` and the values :math:`[A_r(X)^\top; A_e(X)^\top]`, the scores' products and
        :math:`J` from their token sums, with a hand-written backward pass; a padding-masked query is treated as in
        the general path: the same :math:`1/|V|` weights). Both branches are the halves of the ``(B, 2, H, s, N)``
        tensor :attr:`~gpattn.features.KernelEigenScores.stacked`. The magnitude guard reads one number per call
        (one synchronisation): squared norms that overflow are formed again by the rescaled path, scores that do
        not are refused with :meth:`_check_magnitude`, and the check of the scores and :math:`J` against
        :func:`~gpattn.validation.square_limit` (:meth:`_check_scores`) runs only when that number does not already
        bound them (padding masks, no :math:`J`, large values). In training the backward pass checks the gradients
        itself (the ``guard`` of :class:`~gpattn.features.amortized_scores.AmortizedSelfScores`), with the message
        of the other paths' token guard."""
        kernel = self.kernel
        weights = self._token_weights(tokens, mask)
        if torch.is_tensor(weights):
            weights = weights.unsqueeze(1)  # (B, 1, 1, 1, N)
        square_mask = None if mask is None else mask[:, None, None, None, :].to(tokens.dtype)
        singular_values = self.singular_values
        parameters = (kernel.query_weight, kernel.key_projection, self.right_map, self.left_map)
        parameters += (self.right_bias, self.left_bias, weights, kernel.outputscale)
        lifted = kernel.lift(tokens)
        lifted = None if lifted is tokens else lifted
        arguments = (lifted, tokens, *parameters, singular_values if objective else None, square_mask)
        guard = self._where() if self._watches_gradients() else None
        scores, objective_value, magnitude = _amortized_self_scores(*arguments, False, guard)
        magnitude = float(magnitude) if magnitude.numel() else 0.0  # empty while compiling or capturing: no read
        if not math.isfinite(magnitude):
            scores, objective_value, _ = _amortized_self_scores(*arguments, True, guard)  # overflowing norms
            if not all_finite(scores):
                self._check_magnitude(tokens, tokens)
        left, right = scores.mT.unbind(1)  # e, r: (B, H, N, s) views
        objective_value = objective_value if objective else None
        result = KernelEigenScores(left, right, singular_values, objective_value, stacked=scores)
        # with J and no padding mask the magnitude is at least every squared score and every |J|
        if not (objective and mask is None and magnitude <= square_limit(tokens.dtype)):
            super()._check_scores(result, None, tokens, tokens)
        return result

    def _watched(self, queries: Tensor, keys: Tensor, causal: bool, kernel_diag: bool) -> tuple[Tensor, Tensor]:
        # the fused path's backward pass checks the gradients itself
        if self.takes_paired_path(queries, keys, causal, kernel_diag):
            return queries, keys
        return super()._watched(queries, keys, causal, kernel_diag)

    def _check_scores(self, scores: KernelEigenScores, official: Tensor | None, queries: Tensor, keys: Tensor) -> None:
        # the fused path (its scores stacked) checked its results itself (_paired_self_attention)
        if scores.stacked is None:
            super()._check_scores(scores, official, queries, keys)
