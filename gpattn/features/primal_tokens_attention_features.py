"""The official KEP-SVGP / Primal-Attention parametrisation of the attention features: weights from the input tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ksvd import ksvd_objective
from ..validation import check_int
from .kernel_eigen_scores import KernelEigenScores
from .learned_attention_features import Columns, LearnedAttentionFeatures

#: ``features="primal_tokens"`` uses at most ``PRIMAL_TOKENS_MULTIPLE * s`` evenly spaced tokens (the official code's
#: ``rank_multi = 10``)
PRIMAL_TOKENS_MULTIPLE = 10


class PrimalTokensAttentionFeatures(LearnedAttentionFeatures):
    r"""``features="primal_tokens"``: the parametrisation of the official KEP-SVGP and Primal-Attention code (the
    equivalence tests in ``tests/attention/test_paper_equivalence.py`` check it against a transcription of that code):

    .. math::

        W_{e|X} = \tilde X_h^\top \tilde W_e, \qquad W_{r|X} = \tilde X_h^\top \tilde W_r,

    where :math:`\tilde X_h \in \mathbb R^{N' \times C/H}` holds the head's channel block
    ``x[:, h C/H : (h+1) C/H]`` of :math:`N'` tokens of the layer's **input** (as the official code forms it: the
    tokens the attention receives, i.e. after the block's LayerNorm, with no projection and no normalisation; the
    official ``gen_weights`` reshapes the input channels into heads), and :math:`\tilde W_e, \tilde W_r \in
    \mathbb R^{N' \times s}` are learned per position (orthogonal initialisation, as there). :math:`N' =
    \min(\text{max\_len}, 10 s)`: with ``max_len <= 10 s`` all tokens (position ``i`` uses row ``i``; a sequence
    shorter than ``max_len`` uses the first rows, which equals padding it with masked tokens), else :math:`N' = 10 s`
    evenly spaced tokens ``linspace(0, N - 1, N')`` (truncated to integers) of the sequence. Hence the feature
    dimension must be the head width, :math:`p = C / H`. A padding mask zeroes the padded rows of :math:`\tilde X_h`
    (a gpattn extension: the official code has no masks); no causal mask (the weights would read future tokens),
    self-attention only. ``max_len`` (required) is the longest sequence.

    The KSVD penalty may take the official code's form (``ksvd_form="official"``, :meth:`official_objective`). The
    arguments are those of :class:`~gpattn.features.AttentionKernelEigenFeatures`.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> features = PrimalTokensAttentionFeatures(embed_dim=16, num_heads=2, num_inducing=3, max_len=9)
        >>> features.left_token_weights.shape  # W~_e: N' = min(max_len, 10 s) rows per head
        torch.Size([2, 9, 3])
        >>> features(torch.randn(4, 9, 16)).right_scores.shape
        torch.Size([4, 2, 9, 3])

    .. note:: Cost O(N' C s + N p s) per sequence and head.
    """

    mode = "primal_tokens"
    supports_cross_attention = False
    ksvd_forms = ("sum", "official")
    supported_calls = (
        "self-attention only, with or without a padding mask (no causal mask, no context): its weights read every "
        "token of the sequence"
    )

    def _build_weights(self, max_len: int | None) -> None:
        where, heads, rank, width = type(self).__name__, self.num_heads, self.num_inducing, self.kernel.feature_dim
        if self.embed_dim % heads or width != self.embed_dim // heads:
            raise ValueError(
                f"{where}: features='primal_tokens' forms W = X_h^T W~ from the head's block of C / H input channels, "
                f"so feature_dim must be embed_dim / num_heads = {self.embed_dim} / {heads}, got {width}"
            )
        if max_len is None:
            raise ValueError(f"{where}: features='primal_tokens' needs max_len (its longest sequence)")
        # W_e|X = X~^T W~ has rank <= min(N', C/H) whatever s is, as in the official code
        check_int("max_len (the longest sequence of features='primal_tokens')", max_len, where=where)
        positions = min(max_len, PRIMAL_TOKENS_MULTIPLE * rank)
        # the official initialisation: torch's orthogonal_ on (H, N', s), i.e. orthonormal flattened heads
        self.left_token_weights = torch.nn.Parameter(torch.nn.init.orthogonal_(torch.empty(heads, positions, rank)))
        if not self.tie_qk:
            self.right_token_weights = torch.nn.Parameter(
                torch.nn.init.orthogonal_(torch.empty(heads, positions, rank))
            )

    def sampled_positions(self, length: int) -> Tensor | None:
        r"""The positions of the :math:`N'` tokens that form :math:`\tilde X` in a sequence of ``length`` tokens, or
        ``None`` when all are used (``max_len <= 10 s``; then ``length <= max_len``).

        :return: ``linspace(0, length - 1, N')`` truncated to integers (the official code's even sampling), shape
            ``(N',)``.
        """
        positions = self.left_token_weights.shape[-2]
        if positions == self.max_len:
            return None
        return torch.linspace(0, length - 1, positions, device=self.left_token_weights.device).to(torch.long)

    def token_primal_weights(self, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r""":math:`W_{e|X} = \tilde X_h^\top \tilde W_e` and :math:`W_{r|X} = \tilde X_h^\top \tilde W_r` of every
        sequence and head (see the class docstring), each ``(B, H, C/H, s)``.

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
        r"""The official code's KSVD objective of one call, a scalar: :math:`J_{\mathrm{off}} = \tfrac12
        \operatorname{mean}_{b,h,i} e_i^\top \Lambda^{-1} e_i + \tfrac12 \operatorname{mean}_{b,h,j} r_j^\top
        \Lambda^{-1} r_j - \operatorname{Tr}(\operatorname{mean}_h \tilde W_e^\top \tilde W_r)` over the real tokens:
        means over tokens and the trace of the raw per-position weights, which ignores :math:`\tilde X^\top \tilde X`
        (see :func:`~gpattn.ksvd.ksvd_objective`, ``form="official"``)."""
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

    def _check_call(self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool) -> None:
        super()._check_call(queries, keys, key_mask, causal)
        length = queries.shape[-2]
        if length > self.max_len and self.sampled_positions(length) is None:
            raise ValueError(
                "features='primal_tokens' has one weight row per position: sequences of at most "
                f"max_len={self.max_len} tokens, got {length}"
            )

    def _weights(
        self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, columns: Columns
    ) -> tuple[Tensor, Tensor]:
        # W_{e|X} = X~_h^T W~_e (no sqrt(sigma): it sits in Phi_q)
        return self.token_primal_weights(queries, key_mask)

    def _official_objective(self, scores: KernelEigenScores, key_mask: Tensor | None) -> Tensor | None:
        return self.official_objective(scores, key_mask) if self.ksvd_form == "official" else None
