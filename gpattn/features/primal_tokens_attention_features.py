"""The official KEP-SVGP / Primal-Attention parametrisation of the attention features: weights from the input tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from ..fused import wide_dtype
from ..ksvd import ksvd_objective
from ..ksvd.ksvd_objective import ksvd_objective_from_sums, official_objective_from_sums
from ..validation import check_choice, check_int
from .kernel_eigen_scores import KernelEigenScores
from .learned_attention_features import Columns, LearnedAttentionFeatures

#: ``features="primal_tokens"`` uses at most ``rank_multiple * s`` evenly spaced tokens; the default is the official
#: CIFAR and IMDB layers' ``rank_multi = 10`` (the official CoLA layer uses 2)
PRIMAL_TOKENS_MULTIPLE = 10
#: how a padding mask enters the weights: ``"excluded"`` (gpattn) or ``"included"`` (the official CoLA layer)
PADDINGS = ("excluded", "included")


def evenly_spaced_positions(ends: Tensor, steps: int) -> Tensor:
    r"""``torch.linspace(0, end, steps, dtype=torch.long)`` for every ``end`` of ``ends`` at once, with the
    arithmetic of torch's kernel for integer outputs (double precision, from both ends towards the middle, truncated):

    .. math::

        p_i = \lfloor i\, \delta \rfloor \ (i < \lfloor S/2 \rfloor), \qquad
        p_i = \lfloor e - (S - 1 - i)\, \delta \rfloor \ \text{otherwise}, \qquad \delta = e / (S - 1),

    in floating point, so the same integers as the official code's ``linspace`` (exact rational arithmetic differs
    where :math:`(S - 1 - i)\, \delta` rounds above an integer).

    :param ends: The last positions :math:`e \geq 0`, shape ``(B,)``, integer.
    :param steps: :math:`S \geq 1`.
    :return: shape ``(B, S)``, on the device of ``ends`` (formed on the CPU where that device has no float64).

    .. note:: Cost O(B S).
    """
    if steps == 1:
        return ends.new_zeros(ends.shape[0], 1)
    device = ends.device if ends.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    end = ends.to(device, torch.float64)[:, None]
    index = torch.arange(steps, device=device, dtype=torch.float64)
    step = end / (steps - 1)
    values = torch.where(index < steps // 2, step * index, end - step * (steps - 1 - index))
    return values.long().to(ends.device)


class PrimalTokensAttentionFeatures(LearnedAttentionFeatures):
    r"""``features="primal_tokens"``: the parametrisation of the official KEP-SVGP and Primal-Attention code (the
    equivalence tests in ``tests/attention/test_paper_equivalence.py`` check it against float64 transcriptions of the
    official CIFAR and CoLA layers):

    .. math::

        W_{e|X} = \tilde X_h^\top \tilde W_e, \qquad W_{r|X} = \tilde X_h^\top \tilde W_r,

    where :math:`\tilde X_h \in \mathbb R^{N' \times C/H}` holds the head's channel block
    ``x[:, h C/H : (h+1) C/H]`` of :math:`N'` tokens of the layer's **input** (as the official code forms it: the
    tokens the attention receives, i.e. after the block's LayerNorm, with no projection and no normalisation; the
    official ``gen_weights`` reshapes the input channels into heads), and :math:`\tilde W_e, \tilde W_r \in
    \mathbb R^{N' \times s}` are learned per position (orthogonal initialisation, as there). :math:`N' =
    \min(\text{max\_len}, m s)` with :math:`m` = ``rank_multiple`` (the official ``rank_multi``): with
    ``max_len <= m s`` all tokens (position ``i`` uses row ``i``; a sequence shorter than ``max_len`` uses the first
    rows, which equals padding it with masked tokens), else :math:`N' = m s` evenly spaced tokens
    ``linspace(0, N - 1, N')`` (integer ``linspace``, as the official code) of the sequence. Hence the feature
    dimension must be the head width, :math:`p = C / H`. No causal mask (the weights would read future tokens),
    self-attention only. ``max_len`` (required) is the longest sequence.

    A padding mask (``padding``):

    * ``"excluded"`` (default): :math:`\tilde X` is formed from each sequence's real tokens only, in order, as if its
      padding were not there: the evenly spaced tokens are ``linspace(0, n - 1, N')`` of its :math:`n` real tokens
      (all its real tokens, row ``i`` for the ``i``-th, when ``max_len <= m s``). A real token's output does not depend
      on how much padding its batch has, and a sequence without padding gives the official numbers;
    * ``"included"``: the official CoLA layer (``inputs_mask``): :math:`\tilde X` samples the padded sequence as it
      is, padded tokens included (``linspace(0, N - 1, N')`` of the padded length :math:`N`), and the official KSVD
      number (:meth:`official_objective`) zeroes the padded tokens' scores, as the official code zeroes their
      projections before the normalisation, and averages over every position. The scores returned at padded positions
      are not zeroed (they are the padding's, whose outputs a caller ignores). A real token's output then depends on
      the padded length of its batch and on the padding tokens: use it to reproduce the official numbers
      (``rank_multiple=2`` for CoLA), not for new work.

    The KSVD penalty may take the official code's form (``ksvd_form="official"``, :meth:`official_objective`). The
    arguments are those of :class:`~gpattn.features.AttentionKernelEigenFeatures` and the options
    ``rank_multiple`` (a positive integer, default :data:`PRIMAL_TOKENS_MULTIPLE`) and ``padding`` (:data:`PADDINGS`).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> features = PrimalTokensAttentionFeatures(embed_dim=16, num_heads=2, num_inducing=3, max_len=9)
        >>> features.left_token_weights.shape  # W~_e: N' = min(max_len, 10 s) rows per head
        torch.Size([2, 9, 3])
        >>> features(torch.randn(4, 9, 16)).right_scores.shape
        torch.Size([4, 2, 9, 3])
        >>> cola = PrimalTokensAttentionFeatures(16, 2, 3, max_len=100, rank_multiple=2, padding="included")
        >>> cola.left_token_weights.shape  # the official CoLA layer: N' = 2 s rows
        torch.Size([2, 6, 3])

    .. note:: Cost O(N' C s + N p s) per sequence and head; a padding mask with ``padding="excluded"`` adds a sort of
        the mask, O(N log N), per sequence.
    """

    mode = "primal_tokens"
    has_paired_path = True
    supports_cross_attention = False
    ksvd_forms = ("sum", "official")
    options = ("rank_multiple", "padding")
    supported_calls = (
        "self-attention only, with or without a padding mask (no causal mask, no context): its weights read every "
        "token of the sequence"
    )

    def _build_weights(
        self, max_len: int | None, rank_multiple: int = PRIMAL_TOKENS_MULTIPLE, padding: str = "excluded"
    ) -> None:
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
        self.rank_multiple = check_int("rank_multiple (the official rank_multi)", rank_multiple, where=where)
        self.padding = check_choice("padding", padding, PADDINGS, where=where)
        positions = min(max_len, rank_multiple * rank)
        # the official initialisation: torch's orthogonal_ on (H, N', s), i.e. orthonormal flattened heads
        self.left_token_weights = torch.nn.Parameter(torch.nn.init.orthogonal_(torch.empty(heads, positions, rank)))
        if not self.tie_qk:
            self.right_token_weights = torch.nn.Parameter(
                torch.nn.init.orthogonal_(torch.empty(heads, positions, rank))
            )

    @property
    def samples_tokens(self) -> bool:
        r"""Whether :math:`\tilde X` holds :math:`N' = m s` evenly spaced tokens (``max_len > m s``) rather than one row
        per position."""
        return self.left_token_weights.shape[-2] != self.max_len

    def sampled_positions(self, length: int) -> Tensor | None:
        r"""The positions of the :math:`N'` tokens that form :math:`\tilde X` in a sequence of ``length`` tokens
        without padding, or ``None`` when all are used (``max_len <= m s``; then ``length <= max_len``).

        :return: ``linspace(0, length - 1, N')`` as integers (the official code's even sampling, ``dtype=int``),
            shape ``(N',)``.
        """
        if not self.samples_tokens:
            return None
        rows, device = self.left_token_weights.shape[-2], self.left_token_weights.device
        return torch.linspace(0, length - 1, rows, dtype=torch.long, device=device)

    def _real_token_positions(self, mask: Tensor) -> tuple[Tensor, Tensor]:
        r"""``padding="excluded"``: the positions of the tokens of :math:`\tilde X`, ``(B, N')`` (or ``(B, N)``, one row
        per position), read from each sequence's real tokens in order, and which of them are real tokens ``(B, N')``
        (a row past a sequence's real tokens, or of a sequence without any, reads nothing)."""
        counts = mask.sum(-1)  # shape: (B,)
        order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True)  # the real positions first, in order
        if not self.samples_tokens:  # row i <- the i-th real token
            return order, torch.arange(mask.shape[-1], device=mask.device) < counts[:, None]
        # linspace(0, n - 1, N') of each sequence's n real tokens, all at once (no loop over the distinct n, no sync)
        rows = evenly_spaced_positions(counts.clamp_min(1) - 1, self.left_token_weights.shape[-2])
        return order.gather(-1, rows), (counts > 0)[:, None].expand_as(rows)

    def token_primal_weights(self, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r""":math:`W_{e|X} = \tilde X_h^\top \tilde W_e` and :math:`W_{r|X} = \tilde X_h^\top \tilde W_r` of every
        sequence and head (see the class docstring), each ``(B, H, C/H, s)``.

        :param tokens: The layer's input tokens ``(B, N, C)``.
        :param mask: ``(B, N)`` bool padding mask, read as ``padding`` says, or ``None``.

        .. note:: Cost O(N' C s).
        """
        head_tokens, rows = self._head_tokens(tokens, mask)
        left = head_tokens @ self.left_token_weights[:, rows]
        right = left if self.tie_qk else head_tokens @ self.right_token_weights[:, rows]
        return left, right

    def _head_tokens(self, tokens: Tensor, mask: Tensor | None) -> tuple[Tensor, slice]:
        r""":math:`\tilde X_h^\top` of every sequence and head, ``(B, H, C/H, N')`` (see :meth:`token_primal_weights`),
        and the rows of :math:`\tilde W` it meets (the first ``N`` of ``max_len`` when every position has a row)."""
        length, width = tokens.shape[-2:]
        rows = slice(0, length) if not self.samples_tokens else slice(None)
        if mask is None or self.padding == "included":  # the tokens as they are (official)
            positions = self.sampled_positions(length)
            selected = tokens if positions is None else tokens[:, positions]
        else:  # each sequence's real tokens, in order
            positions, real = self._real_token_positions(mask)
            selected = tokens.gather(1, positions.unsqueeze(-1).expand(-1, -1, width))
            selected = selected * real.unsqueeze(-1).to(selected.dtype)
        # X~_h^T: the head's channel block, (B, H, C/H, N')
        return selected.mT.unflatten(1, (self.num_heads, width // self.num_heads)), rows

    def _paired_self_attention(self, tokens: Tensor, mask: Tensor | None, objective: bool) -> KernelEigenScores:
        r"""The self-attention scores with both branches as the halves of one tensor, the general path's numbers in
        about two thirds of its operators (forward and backward):

        .. math::

            [W_e; W_r] = \tilde X_h^\top [\tilde W_e; \tilde W_r], \qquad
            [e^\top; r^\top] = \sqrt{\sigma_f}\, ([W_e; W_r]^\top [P_q; P_k]) \circ [\nu_q; \nu_k],

        one batched GEMM each, with the feature columns of one projection GEMM
        (:meth:`~gpattn.kernels.CosineFeatureKernel.paired_feature_columns`); the scores are
        :attr:`~gpattn.features.KernelEigenScores.stacked` ``(B, 2, H, s, N)``. With ``objective``, one reduction
        gives the token sums :math:`S_k` of both branches over the real tokens
        (:attr:`~gpattn.features.KernelEigenScores.token_sums`), another the trace
        :math:`\operatorname{Tr}(W_e^\top W_r)` (both summed in float32 under autocast), and both forms of :math:`J`
        follow from them
        (:func:`~gpattn.ksvd.ksvd_objective.ksvd_objective_from_sums`, and :meth:`official_objective`)."""
        kernel = self.kernel
        columns, inverse = kernel.paired_feature_columns(tokens)  # [P_q; P_k] (B, 2, H, p, N), [nu_q; nu_k]
        head_tokens, rows = self._head_tokens(tokens, mask)  # X~_h^T: (B, H, p, N')
        raw = torch.stack([self.left_token_weights[:, rows], self.right_token_weights[:, rows]])  # (2, H, N', s)
        weights = head_tokens.unsqueeze(1) @ raw  # [W_e|X; W_r|X]: (B, 2, H, p, s)
        scale = inverse * kernel.outputscale.sqrt()[:, None, None]  # c nu: (B, 2, H, 1, N)
        stacked = (weights.mT @ columns) * scale  # [e^T; r^T]: (B, 2, H, s, N)
        left, right = stacked.mT.unbind(1)  # e, r: (B, H, N, s) views
        singular_values = self.singular_values
        objective_value = sums = None
        if objective:
            masked = stacked if mask is None else stacked * mask[:, None, None, None, :].to(stacked.dtype)
            sums = masked.square().sum((1, -1), dtype=wide_dtype(stacked.dtype))  # S_k of both branches: (B, H, s)
            coupling = (weights[:, 0] * weights[:, 1]).sum((-2, -1), dtype=sums.dtype)  # Tr(W_e^T W_r): (B, H)
            objective_value = ksvd_objective_from_sums(sums, coupling, singular_values)
        return KernelEigenScores(left, right, singular_values, objective_value, stacked=stacked, token_sums=sums)

    def official_objective(self, scores: KernelEigenScores, mask: Tensor | None = None) -> Tensor:
        r"""The official code's KSVD objective of one call, a scalar: :math:`J_{\mathrm{off}} = \tfrac12
        \operatorname{mean}_{b,h,i} e_i^\top \Lambda^{-1} e_i + \tfrac12 \operatorname{mean}_{b,h,j} r_j^\top
        \Lambda^{-1} r_j - \operatorname{Tr}(\operatorname{mean}_h \tilde W_e^\top \tilde W_r)`: means over tokens and
        the trace of the raw per-position weights, which ignores :math:`\tilde X^\top \tilde X` (see
        :func:`~gpattn.ksvd.ksvd_objective`, ``form="official"``). The means run over the real tokens
        (``padding="excluded"``) or, as in the official CoLA layer, over every position with the padded tokens' scores
        zero (``"included"``).

        :param scores: The features of one call (or their :meth:`~gpattn.features.KernelEigenScores.for_outputs`).
        :param mask: That call's padding mask (the means run over its real tokens), or ``None``.
        """
        right_raw = self.left_token_weights if self.tie_qk else self.right_token_weights
        if scores.token_sums is not None:  # the paired path's sums over the real tokens (zero beyond them)
            heads = self.num_heads  # (B, H, N, s) scores, or (B, H, 1, N, s) after for_outputs
            if mask is None or self.padding == "included":  # every position
                count = scores.left_scores.shape[0] * heads * scores.left_scores.shape[-2]
            else:
                count = mask.sum() * heads
            sums = scores.token_sums
            return official_objective_from_sums(sums, scores.singular_values, count, self.left_token_weights, right_raw)
        left, right = scores.left_scores, scores.right_scores
        if mask is not None and self.padding == "included":  # the official CoLA layer zeroes q and k there
            left, right, mask = self._zero_masked(left, mask), self._zero_masked(right, mask), None
        return ksvd_objective(
            left, right, self.left_token_weights, right_raw, scores.singular_values, form="official", mask=mask
        )

    def _check_call(self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool) -> None:
        super()._check_call(queries, keys, key_mask, causal)
        length = queries.shape[-2]
        if length > self.max_len and not self.samples_tokens:
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
