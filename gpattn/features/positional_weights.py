"""The per-position parametrisations of the attention features (``features="primal_tokens"``, the official KEP-SVGP /
Primal-Attention weights :math:`W_{e|X} = \tilde X_h^\top \tilde W_e`, and ``"primal_features"``): which tokens form
:math:`\tilde X`, the weights, the official KSVD number and the calls these modes accept. A mixin of
:class:`~gpattn.features.AttentionKernelEigenFeatures` (it reads ``mode``, ``max_len``, ``tie_qk`` and the
per-position weights ``left_token_weights`` / ``right_token_weights``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ksvd import ksvd_objective
from .kernel_eigen_scores import KernelEigenScores


class PositionalWeights:
    """The per-position modes of :class:`~gpattn.features.AttentionKernelEigenFeatures` (see the module docstring)."""

    def sampled_positions(self, length: int) -> Tensor | None:
        r"""``"primal_tokens"``: the positions of the :math:`N'` tokens that form :math:`\tilde X` in a sequence of
        ``length`` tokens, or ``None`` when all are used (``max_len <= 10 s``; then ``length <= max_len``).

        :return: ``linspace(0, length - 1, N')`` truncated to integers (the official code's even sampling), shape
            ``(N',)``.
        """
        positions = self.left_token_weights.shape[-2]
        if positions == self.max_len:
            return None
        return torch.linspace(0, length - 1, positions, device=self.left_token_weights.device).to(torch.long)

    def token_primal_weights(self, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r"""``"primal_tokens"``: :math:`W_{e|X} = \tilde X_h^\top \tilde W_e` and :math:`W_{r|X} = \tilde X_h^\top
        \tilde W_r` of every sequence and head (see the class docstring), each ``(B, H, C/H, s)``.

        :param tokens: The layer's input tokens ``(B, N, C)``.
        :param mask: ``(B, N)`` bool padding mask (padded rows of :math:`\tilde X` are zeroed), or ``None``.

        .. note:: Cost O(N' C s).
        """
        batch, length, width = tokens.shape
        positions = self.sampled_positions(length)
        if positions is None:  # all tokens, position i <-> row i
            selected, rows = tokens, slice(0, length)
        else:
            selected, rows = tokens[:, positions], slice(None)
            mask = None if mask is None else mask[:, positions]
        if mask is not None:
            selected = selected * mask.unsqueeze(-1).to(selected.dtype)
        # X~_h^T: the head's channel block, (B, H, C/H, N')
        head_tokens = selected.mT.unflatten(1, (self.num_heads, width // self.num_heads))
        left = head_tokens @ self.left_token_weights[:, rows]
        right = left if self.tie_qk else head_tokens @ self.right_token_weights[:, rows]
        return left, right

    def official_objective(self, scores: KernelEigenScores, mask: Tensor | None = None) -> Tensor:
        r"""The official code's KSVD objective of one call (``"primal_tokens"``), a scalar:
        :math:`J_{\mathrm{off}} = \tfrac12 \operatorname{mean}_{b,h,i} e_i^\top \Lambda^{-1} e_i + \tfrac12
        \operatorname{mean}_{b,h,j} r_j^\top \Lambda^{-1} r_j - \operatorname{Tr}(\operatorname{mean}_h \tilde W_e^\top
        \tilde W_r)` over the real tokens (see :func:`~gpattn.ksvd.ksvd_objective`, ``form="official"``)."""
        if self.mode != "primal_tokens":
            raise ValueError(f"the official KSVD objective needs features='primal_tokens', not {self.mode!r}")
        right_raw = self.left_token_weights if self.tie_qk else self.right_token_weights
        return ksvd_objective(
            scores.left_scores,
            scores.right_scores,
            self.left_token_weights,
            right_raw,
            scores.singular_values,
            form="official",
            mask=mask,
        )

    def _check_positional_call(self, queries: Tensor, key_mask: Tensor | None, causal: bool, self_attention: bool):
        mode, length = self.mode, queries.shape[-2]
        if causal or not self_attention or (mode == "primal_features" and key_mask is not None):
            allowed = "self-attention with a padding mask" if mode == "primal_tokens" else "plain self-attention"
            raise ValueError(
                f"features={mode!r} supports {allowed} only (no causal mask, no context): its weights read every "
                "token of the sequence"
            )
        if mode == "primal_features" and length != self.max_len:
            raise ValueError(
                f"features='primal_features' needs sequences of length max_len={self.max_len}, got {length}"
            )
        if mode == "primal_tokens" and length > self.max_len and self.sampled_positions(length) is None:
            raise ValueError(
                "features='primal_tokens' has one weight row per position: sequences of at most "
                f"max_len={self.max_len} tokens, got {length}"
            )
