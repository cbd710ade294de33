"""Primal-Attention (Chen, Tao, Tonin & Suykens, NeurIPS 2023): deterministic KSVD attention in the primal."""

from __future__ import annotations

import torch
from torch import Tensor

from ..features.attention_kernel_eigen_features import AttentionKernelEigenFeatures
from ..mlls import KSVDAddedLossTerm
from ..validation import check_float
from ._base import AttentionLayer


class PrimalAttention(AttentionLayer):
    r"""Primal-Attention: the KSVD projection scores of the attention kernel, concatenated and mapped per head,

    .. math::

        o(x_i) = W_o \begin{bmatrix} e(x_i) \\ r(x_i) \end{bmatrix}, \qquad W_o: \mathbb R^{2s} \to \mathbb R^{C/H},

    with :math:`e, r` from :class:`~gpattn.features.AttentionKernelEigenFeatures` (amortised by default, or the
    paper's ``"primal_tokens"``) and the penalty :math:`J^2` (the added loss term ``"ksvd_loss"``, weighed by
    :math:`\eta` = ``ksvd_weight``). Deterministic: ``kl_divergence()`` is zero. In
    cross-attention :math:`r` lives on the keys, so the queries use :math:`[e(x_i); 0]`.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s`, the KSVD rank (default :math:`\min(10, p)`, :math:`p` the feature dimension).
    :param features: ``"amortized"`` or ``"primal_tokens"``.
    :param max_len: Sequence length of ``"primal_tokens"``.
    :param dropout: Output dropout.
    :param feature_dim: Kernel feature dimension :math:`p` (default: the head width); ``num_inducing <= feature_dim``.
    :param ksvd_weight: :math:`\eta \geq 0`, the weight of the KSVD penalty :math:`\eta J^2`.

    .. note:: Cost per head O(N C s + N p s): no :math:`N \times N` matrix.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int | None = None,
        features: str = "amortized",
        max_len: int | None = None,
        dropout: float = 0.0,
        feature_dim: int | None = None,
        ksvd_weight: float = 1.0,
    ):
        super().__init__(embed_dim, num_heads, dropout)
        self.ksvd_weight = check_float("ksvd_weight", ksvd_weight, 0.0, where=type(self).__name__)
        if features not in ("amortized", "primal_tokens"):
            raise ValueError(f"expected features 'amortized' or 'primal_tokens', got {features!r}")
        self.features = AttentionKernelEigenFeatures(
            embed_dim, num_heads, num_inducing, mode=features, feature_dim=feature_dim, max_len=max_len
        )
        self.num_inducing = num_inducing = self.features.num_inducing  # the default resolved there: min(10, p)
        bound = (2 * num_inducing) ** -0.5
        # per-head map [e; r] (2s) -> head width; shape (H, 2s, head_dim)
        self.output_weight = torch.nn.Parameter(
            torch.empty(num_heads, 2 * num_inducing, self.head_dim).uniform_(-bound, bound)
        )
        self.register_added_loss_term("ksvd_loss")

    def learned_spectrum(self) -> Tensor | None:
        """The learned KSVD singular values per head, shape ``(H, s)``."""
        return self.features.singular_values.detach()

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        inputs = self._prepare(x, mask, context)
        scores = self.features.scores(
            inputs.queries, inputs.keys, inputs.key_mask, inputs.causal, objective=self.training, kernel_diag=False
        )
        if self.training:
            self.update_added_loss_term(
                "ksvd_loss", KSVDAddedLossTerm(scores.objective, self.ksvd_weight, num_averaged_dims=1)
            )
        # y = b + sum_h [e_h, r_h] W_h P_h^T: the per-head map and out_proj folded into (H, 2s, C) coefficients
        coefficients = self.output_weight @ self.head_projection()
        output = self.accumulate_heads(self.out_proj.bias, scores.left, coefficients[:, : self.num_inducing])
        if not inputs.is_cross:  # r lives on the keys: cross-attention uses e alone
            output = self.accumulate_heads(output, scores.right, coefficients[:, self.num_inducing :])
        return self.dropout(output)
