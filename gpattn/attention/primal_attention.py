"""Primal-Attention (Chen, Tao, Tonin & Suykens, NeurIPS 2023): deterministic KSVD attention in the primal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..features import ATTENTION_FEATURES, attention_feature_class, build_attention_features
from ._base import AttentionLayer


class PrimalAttention(AttentionLayer):
    r"""Primal-Attention: the KSVD projection scores of the attention kernel, concatenated and mapped per head,

    .. math::

        o(x_i) = W_o \begin{bmatrix} e(x_i) \\ r(x_i) \end{bmatrix}, \qquad W_o: \mathbb R^{2s} \to \mathbb R^{C/H},

    with :math:`e, r` from learned :class:`~gpattn.features.AttentionKernelEigenFeatures` (amortised by default,
    gpattn's variant; ``"primal_tokens"`` is the official code's :math:`W_{e|X} = \tilde X_h^\top \tilde W_e`,
    registry row ``"primal_paper"`` together with ``ksvd_form="official"``) and the penalty :math:`\eta J^2` (the
    features' added loss term ``"ksvd_loss"``, :math:`\eta` = ``ksvd_weight``). Deterministic: ``kl_divergence()`` is
    zero. In cross-attention :math:`r` lives on the keys, so the queries use :math:`[e(x_i); 0]`.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s`, the KSVD rank (default :math:`\min(10, p)`, :math:`p` the feature dimension).
    :param features: A mode with a learned spectrum: ``"amortized"``, ``"primal_tokens"`` or ``"primal_features"``
        (the layer accepts the calls its features support).
    :param max_len: Longest sequence of ``"primal_tokens"`` (sequence length of ``"primal_features"``).
    :param dropout: Output dropout.
    :param feature_dim: Kernel feature dimension :math:`p` (default: the head width); ``num_inducing <= feature_dim``.
    :param ksvd_weight: :math:`\eta \geq 0`, the weight of the KSVD penalty :math:`\eta J^2`.
    :param ksvd_form: ``"sum"`` or ``"official"`` (the official code's number, ``"primal_tokens"`` only; see
        :func:`~gpattn.ksvd.ksvd_objective`).
    :param feature_options: The feature mode's own options
        (:attr:`~gpattn.features.AttentionKernelEigenFeatures.options`), e.g. ``{"rank_multiple": 2, "padding":
        "included"}`` for ``"primal_tokens"`` as the official CoLA layer.

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
        ksvd_form: str = "sum",
        feature_options: Mapping[str, Any] | None = None,
    ):
        super().__init__(embed_dim, num_heads, dropout)
        if not attention_feature_class(features).learns_spectrum:  # the scores of a learned KSVD
            learned = [name for name, cls in ATTENTION_FEATURES.items() if cls.learns_spectrum]
            raise ValueError(f"{type(self).__name__}: expected features to be one of {learned}, got {features!r}")
        self.features = build_attention_features(
            embed_dim,
            num_heads,
            num_inducing,
            features,
            feature_dim=feature_dim,
            max_len=max_len,
            ksvd_weight=ksvd_weight,
            ksvd_form=ksvd_form,
            **dict(feature_options or {}),
        )
        self.supports_causal = self.features.supports_causal
        self.supports_cross_attention = self.features.supports_cross_attention
        self.supports_graph_capture = self.features.supports_graph_capture
        self.num_inducing = num_inducing = self.features.num_inducing  # the default resolved there: min(10, p)
        bound = (2 * num_inducing) ** -0.5
        # per-head map [e; r] (2s) -> head width; shape (H, 2s, head_dim)
        self.output_weight = torch.nn.Parameter(
            torch.empty(num_heads, 2 * num_inducing, self.head_dim).uniform_(-bound, bound)
        )

    def learned_spectrum(self) -> Tensor:
        """The learned KSVD singular values per head, shape ``(H, s)``."""
        return self.features.singular_values.detach()

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        inputs = self._prepare(x, mask, context)
        # the features refresh their KSVD penalty in training
        scores = self.features(
            inputs.queries, inputs.keys, inputs.key_mask, inputs.causal, objective=self.training, kernel_diag=False
        )
        # y = b + sum_h [e_h, r_h] W_h P_h^T: the per-head map and out_proj folded into (H, 2s, C) coefficients
        coefficients = self.output_weight @ self.head_projection()
        output = self.accumulate_heads(self.out_proj.bias, scores.left_scores, coefficients[:, : self.num_inducing])
        if not inputs.is_cross:  # r lives on the keys: cross-attention uses e alone
            output = self.accumulate_heads(output, scores.right_scores, coefficients[:, self.num_inducing :])
        return self.dropout(output)
