"""Primal-Attention (Chen, Tao, Tonin & Suykens, NeurIPS 2023): deterministic KSVD attention in the primal."""

from __future__ import annotations

import torch
from torch import Tensor

from ..features.attention_kernel_eigen_features import AttentionKernelEigenFeatures
from ..mlls import KSVDAddedLossTerm
from ._base import AttentionLayer


class PrimalAttention(AttentionLayer):
    r"""Primal-Attention: the KSVD projection scores of the attention kernel, concatenated and mapped per head,

    .. math::

        o(x_i) = W_o \begin{bmatrix} e(x_i) \\ r(x_i) \end{bmatrix}, \qquad W_o: \mathbb R^{2s} \to \mathbb R^{C/H},

    with :math:`e, r` from :class:`~gpattn.features.AttentionKernelEigenFeatures` (amortised by default, or the
    paper's ``"primal_tokens"``) and the penalty :math:`J^2` (the added loss term ``"ksvd_loss"``, weighed by
    :math:`\eta` in :class:`~gpattn.mlls.AttentionELBO`). Deterministic: ``kl_divergence()`` is zero. In
    cross-attention :math:`r` lives on the keys, so the queries use :math:`[e(x_i); 0]`.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param rank: :math:`s`.
    :param features: ``"amortized"`` or ``"primal_tokens"``.
    :param max_len: Sequence length of ``"primal_tokens"``.
    :param dropout: Output dropout.

    .. note:: Cost per head O(N C s + N p s): no :math:`N \times N` matrix.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        rank: int = 10,
        features: str = "amortized",
        max_len: int | None = None,
        dropout: float = 0.0,
    ):
        super().__init__(embed_dim, num_heads, dropout)
        if features not in ("amortized", "primal_tokens"):
            raise ValueError(f"expected features 'amortized' or 'primal_tokens', got {features!r}")
        self.features = AttentionKernelEigenFeatures(embed_dim, num_heads, rank, mode=features, max_len=max_len)
        self.rank = rank
        bound = (2 * rank) ** -0.5
        # per-head map [e; r] (2s) -> head width; shape (H, 2s, head_dim)
        self.output_weight = torch.nn.Parameter(torch.empty(num_heads, 2 * rank, self.head_dim).uniform_(-bound, bound))
        self.register_added_loss_term("ksvd_loss")

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        inputs = self._prepare(x, mask, context)
        scores = self.features.scores(
            inputs.queries, inputs.keys, inputs.key_mask, inputs.causal, objective=self.training, kernel_diag=False
        )
        if self.training:
            self.update_added_loss_term("ksvd_loss", KSVDAddedLossTerm(scores.objective, 1.0, num_averaged_dims=1))
        right = torch.zeros_like(scores.left) if inputs.is_cross else scores.right
        projections = torch.cat([scores.left, right], dim=-1)  # shape: (B, H, N, 2s)
        return self.project_out(projections @ self.output_weight.unsqueeze(0))
