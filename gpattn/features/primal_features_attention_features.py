"""Attention features with learned per-position singular vectors over the kernel's feature vectors (a gpattn
variant)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import check_int
from .learned_attention_features import LearnedAttentionFeatures


class PrimalFeaturesAttentionFeatures(LearnedAttentionFeatures):
    r"""``features="primal_features"`` (a gpattn variant, not the papers'): learned per-position weights
    :math:`\tilde W_e, \tilde W_r \in \mathbb R^{\text{max\_len} \times s}` over the kernel's normalised features of
    all tokens,

    .. math::

        W_{e|X} = \Phi_k(X)^\top \tilde W_e, \qquad W_{r|X} = \Phi_q(X)^\top \tilde W_r, \qquad
        e(x) = \kappa(x, X) \tilde W_e,

    the dual form with learned per-position singular vectors (where ``"primal_tokens"`` uses the raw input tokens).
    Sequences of exactly ``max_len`` tokens (required, at least ``num_inducing``), no masks, self-attention only. The
    arguments are those of :class:`~gpattn.features.AttentionKernelEigenFeatures`.

    Example:
        >>> features = PrimalFeaturesAttentionFeatures(embed_dim=16, num_heads=2, num_inducing=3, max_len=9)
        >>> features.supports_padding_mask, features.supports_cross_attention
        (False, False)
        >>> features(torch.randn(4, 9, 16)).left_scores.shape
        torch.Size([4, 2, 9, 3])

    .. note:: Cost O(N p s) per sequence and head.
    """

    mode = "primal_features"
    supports_cross_attention = False
    supports_padding_mask = False
    supported_calls = "plain self-attention only (no mask, no context): its weights read every token of the sequence"

    def _build_weights(self, max_len: int | None) -> None:
        where, heads, rank = type(self).__name__, self.num_heads, self.num_inducing
        if max_len is None:
            raise ValueError(f"{where}: features='primal_features' needs max_len (its fixed sequence length)")
        # W~ (max_len x s) of rank s
        check_int("max_len (the sequence length of features='primal_features')", max_len, rank, where=where)
        self.left_token_weights = torch.nn.Parameter(torch.randn(heads, max_len, rank) * max_len**-0.5)
        if not self.tie_qk:
            self.right_token_weights = torch.nn.Parameter(torch.randn(heads, max_len, rank) * max_len**-0.5)

    def _check_call(self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool) -> None:
        super()._check_call(queries, keys, key_mask, causal)
        if queries.shape[-2] != self.max_len:
            raise ValueError(
                f"features='primal_features' needs sequences of length max_len={self.max_len}, got {queries.shape[-2]}"
            )

    def _value_columns(self, tokens: Tensor, side: str) -> Tensor:
        r"""The per-position :math:`\tilde W^\top`, shape ``(H, s, n)``."""
        return (self.left_token_weights if side == "left" or self.tie_qk else self.right_token_weights).mT

    def _token_weights(self, tokens: Tensor, mask: Tensor | None) -> Tensor | float:
        return 1.0  # W = Phi^T W~: a sum over the positions, not a mean
