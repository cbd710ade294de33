"""Kernel-eigen features of self-attention: per-sequence KSVD scores for every head."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels import CosineFeatureKernel, ExponentialDotProductKernel
from ..ksvd import kernel_svd, ksvd_objective
from ..ksvd.ksvd_objective import ksvd_objective_from_sums
from ..mlls import KSVDAddedLossTerm
from ..validation import all_finite, check_choice, check_float, check_int
from .amortized_scores import AmortizedSelfScores, StackedKernelEigenScores
from .kernel_eigen_features_base import KernelEigenFeaturesBase
from .kernel_eigen_scores import KernelEigenScores, numerically_nonzero
from .positional_weights import PositionalWeights
from .sequence_sums import prefix_mean_outer, unit_quadratic_form

MODES = ("amortized", "primal_tokens", "primal_features", "exact")
#: the learned modes with per-position weights (a maximum sequence length)
POSITIONAL_MODES = ("primal_tokens", "primal_features")
#: ``form`` of the KSVD penalty: the token-sum :math:`J` (docs/math.md section 2) or the official code's number
KSVD_FORMS = ("sum", "official")
#: ``features="primal_tokens"`` uses at most ``PRIMAL_TOKENS_MULTIPLE * s`` evenly spaced tokens (the official code's
#: ``rank_multi = 10``)
PRIMAL_TOKENS_MULTIPLE = 10
#: the attention layers' number of inducing variables (the KSVD rank s) when none is given: min(DEFAULT_NUM_INDUCING, p)
DEFAULT_NUM_INDUCING = 10
KERNELS = ("cosine", "exponential")


class AttentionKernelEigenFeatures(PositionalWeights, KernelEigenFeaturesBase):
    r"""Per-sequence KSVD scores of the attention kernel of every head (docs/math.md section 2).

    For queries :math:`X` (``N`` tokens) and keys :math:`Z` (``M`` tokens) of one sequence and one head, the scores
    are :math:`e(x) = \phi_q(x)^\top W_{e|X}`, :math:`r(z) = \phi_k(z)^\top W_{r|X}` with data-dependent weights
    :math:`W_{e|X}, W_{r|X} \in \mathbb R^{p \times s}` (learned modes) or the exact dual scores:

    * ``"amortized"`` (default; length-agnostic, mask-friendly; a gpattn variant): learned maps :math:`A_e, A_r:
      \mathbb R^C \to \mathbb R^s` estimate the singular vectors, :math:`W_{e|X} = \Phi_k^\top A_e(Z) / M`,
      :math:`W_{r|X} = \Phi_q^\top A_r(X) / N`, so :math:`e(x) = \kappa(x, Z) A_e(Z) / M` and
      :math:`r(z) = \kappa(X, z)^\top A_r(X) / N`, computed in the primal in O(N p s) without forming
      :math:`K`. Padding masks drop keys from the sums; a causal mask turns them into prefix means.
    * ``"primal_tokens"`` (the parametrisation of the official KEP-SVGP and Primal-Attention code; the equivalence
      tests in ``tests/attention/test_paper_equivalence.py`` check it against a transcription of that code):

      .. math::

          W_{e|X} = \tilde X_h^\top \tilde W_e, \qquad W_{r|X} = \tilde X_h^\top \tilde W_r,

      where :math:`\tilde X_h \in \mathbb R^{N' \times C/H}` holds the head's channel block
      ``x[:, h C/H : (h+1) C/H]`` of :math:`N'` tokens of the layer's **input** (as the official code forms it: the
      tokens the attention receives, i.e. after the block's LayerNorm, with no projection and no normalisation; the
      official ``gen_weights`` reshapes the input channels into heads), and :math:`\tilde W_e, \tilde W_r \in
      \mathbb R^{N' \times s}` are learned per position (orthogonal initialisation, as there). :math:`N' =
      \min(\text{max\_len}, 10 s)`: with ``max_len <= 10 s`` all tokens (position ``i`` uses row ``i``; a sequence
      shorter than ``max_len`` uses the first rows, which equals padding it with masked tokens), else :math:`N' = 10
      s` evenly spaced tokens ``linspace(0, N - 1, N')`` (truncated to integers) of the sequence. Hence the feature
      dimension must be the head width, :math:`p = C / H`. A padding mask zeroes the padded rows of
      :math:`\tilde X_h` (a gpattn extension: the official code has no masks); no causal mask (the weights would
      read future tokens), self-attention only. Cost O(N' C s + N p s).
    * ``"primal_features"`` (a gpattn variant, not the papers'): :math:`W_{e|X} = \Phi_k(\tilde X)^\top \tilde W_e`,
      :math:`W_{r|X} = \Phi_q(\tilde X)^\top \tilde W_r`: the kernel's normalised features of all ``max_len`` tokens
      instead of the raw input tokens, so that :math:`e(x) = \kappa(x, X) \tilde W_e` is the dual form with learned
      per-position singular vectors. Sequences of exactly ``max_len`` tokens, no masks, self-attention only.
    * ``"exact"``: the truncated SVD of the dense :math:`\kappa(X, Z)` of every sequence (masked rows and
      columns zeroed), :math:`e(X) = H_e \Lambda`, :math:`r(Z) = H_r \Lambda`, :math:`J = 0`. O(N M p + N M
      min(N, M)); no causal mask. The singular pairs are indexed by their rank and signed by the largest-magnitude
      entry of :math:`H_e`, so along a smooth path of inputs the features jump where two singular values cross or
      where that entry moves to another token (see docs/guide/papers.md).

    In the learned modes :math:`\Lambda` is a learned positive vector per head, and the KSVD penalty drives the scores
    towards a stationary point of the KSVD. Two forms (``ksvd_form``), see :func:`~gpattn.ksvd.ksvd_objective`:

    * ``"sum"`` (default): :math:`\eta \operatorname{mean}_b \sum_h J_{bh}^2` with the token-sum
      :math:`J_{bh} = \tfrac12 \sum_i e_i^\top \Lambda^{-1} e_i + \tfrac12 \sum_j r_j^\top \Lambda^{-1} r_j
      - \operatorname{Tr}(W_{e|X}^\top W_{r|X})` of every sequence and head over its real tokens (with a causal mask,
      on the causal scores: :math:`e_i, r_i` of the prefix :math:`j \le i`, and the trace averaged over the prefixes'
      weights);
    * ``"official"`` (``"primal_tokens"`` only): the official code's number :math:`\eta\, J_{\mathrm{off}}^2` with one
      :math:`J_{\mathrm{off}} = \tfrac12 \operatorname{mean}_{b,h,i} e_i^\top \Lambda^{-1} e_i + \tfrac12
      \operatorname{mean}_{b,h,j} r_j^\top \Lambda^{-1} r_j - \operatorname{Tr}(\operatorname{mean}_h \tilde W_e^\top
      \tilde W_r)` per layer and batch: means over tokens and the trace of the raw per-position weights (which
      ignores :math:`\tilde X^\top \tilde X`).

    :attr:`KernelEigenScores.objective` is always the sum-form :math:`J` per sequence and head.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s` (default :math:`\min(10, p)`: the cosine kernel has rank at most :math:`p`).
    :param mode: ``"amortized"``, ``"primal_tokens"``, ``"primal_features"`` or ``"exact"``.
    :param kernel: ``"cosine"`` (primal features :math:`\phi = W x / \|W x\|`) or ``"exponential"`` (exact mode
        only: the softmax numerator :math:`\exp(\langle W_q x, W_k z\rangle / \sqrt p)`).
    :param feature_dim: :math:`p` (default ``embed_dim // num_heads``; ``"primal_tokens"`` needs that value).
    :param tie_qk: :math:`W_q = W_k` (symmetric kernel; the two amortised maps, or per-position weights, are tied too).
    :param max_len: The longest sequence of ``"primal_tokens"`` / the sequence length of ``"primal_features"``.
    :param ksvd_weight: :math:`\eta \geq 0` of the KSVD penalty, the added loss term ``"ksvd_loss"`` refreshed by
        every training call (zero in exact mode, where :math:`J = 0`).
    :param ksvd_form: ``"sum"`` or ``"official"`` (see above).

    :raises ValueError: In the learned modes, when the scores of inputs of very large magnitude (about
        :math:`\sqrt{\text{finfo.max}}`, :math:`1.8 \cdot 10^{19}` in float32) are not finite: the weights
        :math:`W_{e|X}` grow like :math:`|x|` and the product with the unnormalised projections like :math:`|x|^2`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int | None = None,
        mode: str = "amortized",
        kernel: str = "cosine",
        feature_dim: int | None = None,
        tie_qk: bool = False,
        max_len: int | None = None,
        ksvd_weight: float = 1.0,
        ksvd_form: str = "sum",
    ):
        super().__init__()
        where = type(self).__name__
        check_choice("features", mode, MODES, where=where)
        check_choice("kernel", kernel, KERNELS, where=where)
        check_choice("ksvd_form", ksvd_form, KSVD_FORMS, where=where)
        if kernel == "exponential" and mode != "exact":
            raise ValueError(
                f"the exponential kernel has no finite primal features: use features='exact', not {mode!r}"
            )
        if ksvd_form == "official" and mode != "primal_tokens":
            raise ValueError(
                f"{where}: ksvd_form='official' reads the raw per-position weights of the official parametrisation: "
                f"it needs features='primal_tokens', not {mode!r}"
            )
        check_int("embed_dim", embed_dim, where=where)
        check_int("num_heads", num_heads, where=where)
        feature_dim = embed_dim // num_heads if feature_dim is None else feature_dim
        check_int("feature_dim", feature_dim, where=where)
        if mode == "primal_tokens" and (embed_dim % num_heads or feature_dim != embed_dim // num_heads):
            raise ValueError(
                f"{where}: features='primal_tokens' forms W = X_h^T W~ from the head's block of C / H input channels, "
                f"so feature_dim must be embed_dim / num_heads = {embed_dim} / {num_heads}, got {feature_dim}"
            )
        if num_inducing is None:  # the cosine kernel has rank <= p: the default fits every (embed_dim, num_heads)
            num_inducing = min(DEFAULT_NUM_INDUCING, feature_dim)
        check_int("num_inducing", num_inducing, where=where)
        if kernel == "cosine" and num_inducing > feature_dim:  # K = Phi_q Phi_k^T has rank <= p
            raise ValueError(
                f"num_inducing ({num_inducing}) must not exceed the feature dimension ({feature_dim}) of a cosine "
                "kernel"
            )
        if mode in POSITIONAL_MODES:
            if max_len is None:
                raise ValueError(f"{where}: features={mode!r} needs max_len (its fixed sequence length)")
            if mode == "primal_features":  # W~ (max_len x s) of rank s
                check_int(
                    "max_len (the sequence length of features='primal_features')", max_len, num_inducing, where=where
                )
            else:  # W_e|X = X~^T W~ has rank <= min(N', C/H) whatever s is, as in the official code
                check_int("max_len (the longest sequence of features='primal_tokens')", max_len, where=where)
        elif mode == "exact" and max_len is not None and check_int("max_len", max_len, where=where) < num_inducing:
            # the SVD of a sequence of at most max_len tokens has at most max_len singular values
            raise ValueError(
                f"{where}: num_inducing ({num_inducing}) exceeds the longest sequence, max_len={max_len}, of exact mode"
            )
        self.embed_dim, self.num_heads, self.num_inducing, self.mode = embed_dim, num_heads, num_inducing, mode
        self.tie_qk, self.max_len, self.ksvd_form = bool(tie_qk), max_len, ksvd_form
        self.ksvd_weight = check_float("ksvd_weight", ksvd_weight, 0.0, where=where)
        self.register_added_loss_term("ksvd_loss")
        heads = torch.Size([num_heads])
        if kernel == "cosine":
            self.kernel = CosineFeatureKernel(embed_dim, feature_dim, tie=tie_qk, batch_shape=heads)
        else:
            self.kernel = ExponentialDotProductKernel(embed_dim, feature_dim, tie=tie_qk, batch_shape=heads)
        self._sequence_singular_values: Tensor | None = None
        self._sequence_active: Tensor | None = None
        if mode == "exact":
            return
        bound = embed_dim**-0.5
        if mode == "amortized":
            # A_e, A_r: R^C -> R^s per head, as nn.Linear; shape (H, C, s) and (H, s)
            self.left_map = torch.nn.Parameter(torch.empty(num_heads, embed_dim, num_inducing).uniform_(-bound, bound))
            self.left_bias = torch.nn.Parameter(torch.zeros(num_heads, num_inducing))
            if not self.tie_qk:
                self.right_map = torch.nn.Parameter(
                    torch.empty(num_heads, embed_dim, num_inducing).uniform_(-bound, bound)
                )
                self.right_bias = torch.nn.Parameter(torch.zeros(num_heads, num_inducing))
        else:
            if mode == "primal_tokens":
                # the official initialisation: torch's orthogonal_ on (H, N', s), i.e. orthonormal flattened heads
                positions = min(max_len, PRIMAL_TOKENS_MULTIPLE * num_inducing)

                def initial() -> Tensor:
                    return torch.nn.init.orthogonal_(torch.empty(num_heads, positions, num_inducing))
            else:

                def initial() -> Tensor:
                    return torch.randn(num_heads, max_len, num_inducing) * max_len**-0.5

            self.left_token_weights = torch.nn.Parameter(initial())
            if not self.tie_qk:
                self.right_token_weights = torch.nn.Parameter(initial())
        # Lambda = softplus(0) = log 2 for every head at initialisation
        self._register_singular_values(torch.full((num_heads, num_inducing), math.log(2.0)))

    def _exact_singular_values(self) -> Tensor:
        # exact mode: Lambda belongs to each sequence; the prior of a strategy's KL reads the last call's
        if self._sequence_singular_values is None:
            raise RuntimeError(
                "with features='exact' the singular values belong to each sequence: call the features (or the "
                "layer) on a batch first"
            )
        return self._sequence_singular_values

    @property
    def active_inducing(self) -> Tensor | None:
        r"""With ``features="exact"``: which of the last call's directions are numerically nonzero, ``(B, H, s)``
        (see :func:`~gpattn.features.numerically_nonzero`); ``None`` for a learned :math:`\Lambda`."""
        return self._sequence_active if self.mode == "exact" else None

    def _value_columns(self, tokens: Tensor, side: str) -> Tensor:
        r"""The values :math:`a_j` of the weights :math:`W = \frac1n \sum_j \phi_j a_j^\top`, in column layout:
        :math:`A_e(Z)^\top` / :math:`A_r(X)^\top`, shape ``(B, H, s, n)`` (amortised), or the per-position
        :math:`\tilde W^\top`, shape ``(H, s, n)`` (``primal_features``)."""
        left = side == "left" or self.tie_qk
        if self.mode == "primal_features":
            weights = self.left_token_weights if left else self.right_token_weights
            return weights.mT
        weight, bias = (self.left_map, self.left_bias) if left else (self.right_map, self.right_bias)
        heads, width, rank = weight.shape
        # one GEMM (H s, C) x (C, n) per sequence for all heads
        stacked = weight.mT.reshape(heads * rank, width).expand(tokens.shape[0], -1, -1)
        values = torch.bmm(stacked, tokens.mT)  # shape: (B, H s, n), contiguous
        return values.unflatten(-2, (heads, rank)) + bias.unsqueeze(-1)

    def _token_weights(self, tokens: Tensor, mask: Tensor | None) -> Tensor | float:
        # the 1/|V| of the masked means over the visible tokens V (1 for primal_features): a float or (B, 1, 1, n)
        if self.mode == "primal_features":
            return 1.0
        if mask is None:
            return 1.0 / tokens.shape[-2]
        weights = mask.to(tokens.dtype)
        return (weights / weights.sum(-1, keepdim=True))[:, None, None, :]

    def forward(
        self,
        queries: Tensor,
        keys: Tensor | None = None,
        key_mask: Tensor | None = None,
        causal: bool = False,
        objective: bool = True,
        kernel_diag: bool = True,
    ) -> KernelEigenScores:
        r"""The features of a batch of sequences: :math:`e` at the queries, :math:`r` at the keys, :math:`\Lambda`.

        The inputs are the layer's checked tokens (the attention layers check them once per call).

        :param queries: ``(B, N, C)``.
        :param keys: ``(B, M, C)``, or ``None`` (self-attention: the queries).
        :param key_mask: ``(B, M)`` bool, ``True`` for real tokens (in self-attention it masks the queries too).
        :param causal: Prefix sums (self-attention, ``"amortized"`` only).
        :param objective: Compute :math:`J` (O(N p s); needed in training only).
        :param kernel_diag: Compute :math:`k_e(x, x)`, :math:`k_r(z, z)` (O(N p^2), or O(N p^2) memory per
            position when causal; needed for the residual only).
        :return: A :class:`~gpattn.features.KernelEigenScores` with scores of shape ``(B, H, N, s)`` and ``(B, H, M,
            s)``, :math:`\Lambda` of shape ``(H, s)`` (learned) or ``(B, H, s)`` (exact), :math:`J` of shape ``(B, H)``
            and the kernel diagonals ``(B, H, N)``, ``(B, H, M)``. In the learned modes the scores are transposed views
            of contiguous ``(B, H, s, N)`` tensors (column layout, as the features are computed).
        :raises ValueError: Scores that are not finite for inputs of very large magnitude (see the class docstring).

        .. note:: Learned modes, no causal mask: the features stay in the column layout of
            :meth:`~gpattn.kernels.CosineFeatureKernel.feature_columns` and their normalisation, the output scale and
            the padding mask are folded into the ``(s, n)`` values and the ``(p, s)`` weights, so the pass costs
            four GEMMs of O(N C p) or O(N C s), four batched products of O(N p s) and elementwise work on ``(N, s)``
            tensors only.
        """
        if keys is None:
            keys = queries
        self_attention = queries is keys
        query_mask = key_mask if self_attention else None
        if self.mode == "exact":
            return self._penalised(self._exact(queries, keys, key_mask, query_mask, causal, kernel_diag))
        if self.mode in POSITIONAL_MODES:
            self._check_positional_call(queries, key_mask, causal, self_attention)
        # the fused path (a hand-written backward pass) runs in the tokens' dtype: autocast takes the general one
        fused = self.mode == "amortized" and self_attention and not (causal or kernel_diag or self.tie_qk)
        if fused and not torch.is_autocast_enabled(queries.device.type):
            return self._penalised(self._fused_self_attention(queries, query_mask, objective))
        kernel = self.kernel
        query_columns, query_inverse = kernel.feature_columns(queries, "query")  # P_q (B, H, p, N), nu_q (B, H, 1, N)
        if self_attention and self.tie_qk:
            key_columns, key_inverse = query_columns, query_inverse
        else:
            key_columns, key_inverse = kernel.feature_columns(keys, "key")  # P_k (B, H, p, M), nu_k (B, H, 1, M)
        root_scale = kernel.outputscale.sqrt()[:, None, None]  # sqrt(sigma_f): (H, 1, 1)
        singular_values = self.singular_values
        objective_value = None
        if causal:  # the outputs use prefix means: one (p, s) matrix per position (amortised mode)
            left_values = self._value_columns(keys, "left")  # A_e(Z)^T: (B, H, s, M)
            right_values = self._value_columns(queries, "right")  # A_r(X)^T: (B, H, s, N)
            query_features = (query_columns * query_inverse * root_scale).mT  # Phi_q: (B, H, N, p)
            key_features = (key_columns * key_inverse * root_scale).mT
            left_prefix = prefix_mean_outer(key_features, left_values.mT)  # W_{e|X<=i}: (B, H, N, p, s)
            right_prefix = prefix_mean_outer(query_features, right_values.mT)
            left = (query_features.unsqueeze(-2) @ left_prefix).squeeze(-2)
            right = (key_features.unsqueeze(-2) @ right_prefix).squeeze(-2)
            if objective:  # J on the causal scores the outputs use; the trace averaged over the prefixes' weights
                objective_value = ksvd_objective(
                    left, right, left_prefix, right_prefix, singular_values.unsqueeze(0), weights_per_position=True
                )
        else:
            if self.mode == "primal_tokens":  # W_{e|X} = X~_h^T W~_e (no sqrt(sigma): it sits in Phi_q)
                left_weights, right_weights = self.token_primal_weights(queries, key_mask)
            else:
                left_values = self._value_columns(keys, "left")  # A_e(Z)^T: (B, H, s, M)
                right_values = self._value_columns(queries, "right")  # A_r(X)^T: (B, H, s, N)
                # W_{e|X}^T = A_e^T Phi_k / |V| = sqrt(sigma) A_e^T diag(nu_k / |V|) P_k^T: (B, H, s, p); W_{r|X}
                # likewise. (Products are arranged so that the long axis N is the columns of every output and operand:
                # batched GEMMs with an (N, s) output are several times slower on CPU, forward and backward.)
                left_weights = (
                    root_scale * ((left_values * key_inverse * self._token_weights(keys, key_mask)) @ key_columns.mT).mT
                )
                right_weights = (
                    root_scale
                    * ((right_values * query_inverse * self._token_weights(queries, query_mask)) @ query_columns.mT).mT
                )
            # e(X) = Phi_q W_e = sqrt(sigma) diag(nu_q) P_q^T W_e, built as its transpose (B, H, s, N); r(Z) likewise
            left = ((left_weights.mT @ query_columns) * (query_inverse * root_scale)).mT
            right = ((right_weights.mT @ key_columns) * (key_inverse * root_scale)).mT
            if objective:
                objective_value = ksvd_objective(
                    self._zero_masked(left, query_mask),
                    self._zero_masked(right, key_mask),
                    left_weights,
                    right_weights,
                    singular_values.unsqueeze(0),
                )
        if not (all_finite(left) and all_finite(right)):
            self._check_magnitude(queries, keys)
        left_diag = right_diag = None
        if kernel_diag:
            # k_e(x_i, x_i) = sum_j kappa(x_i, z_j)^2 = sigma^2 sum_j <unit q_i, unit k_j>^2; k_r likewise
            scale = kernel.outputscale.square()[:, None]  # shape: (H, 1)
            left_diag = scale * unit_quadratic_form(
                query_columns, query_inverse, key_columns, key_inverse, key_mask, causal
            )
            right_diag = scale * unit_quadratic_form(
                key_columns, key_inverse, query_columns, query_inverse, query_mask, causal
            )
        scores = KernelEigenScores(left, right, singular_values, objective_value, left_diag, right_diag)
        official = None
        if objective and self.ksvd_form == "official":
            official = self.official_objective(scores, key_mask)
        return self._penalised(scores, official)

    def _check_magnitude(self, queries: Tensor, keys: Tensor) -> None:
        # called when the learned scores are not finite: inputs of magnitude ~sqrt(finfo.max) overflow W^T P ~ |x|^2
        magnitude = float(max(queries.detach().abs().amax(), keys.detach().abs().amax()))
        limit = torch.finfo(queries.dtype).max ** 0.5
        if magnitude > limit / 1e3:
            raise ValueError(
                f"{type(self).__name__} (features={self.mode!r}): the input tokens reach |x| = {magnitude:.3g}, too "
                f"large for {queries.dtype}: the weights W_e|X grow like |x| and their product with the unnormalised "
                f"projections like |x|^2, which overflows beyond about sqrt(finfo.max) = {limit:.3g}; rescale the "
                "inputs (e.g. a LayerNorm before the layer) or use float64"
            )

    def _fused_self_attention(self, tokens: Tensor, mask: Tensor | None, objective: bool) -> KernelEigenScores:
        r"""The amortised self-attention scores by :class:`~gpattn.features.amortized_scores.AmortizedSelfScores`:
        one projection GEMM for :math:`[P_q; P_k]` (``(B, 2, H, p, N)``), one for the values :math:`[A_r(X)^\top;
        A_e(X)^\top]` and the scores' products with a hand-written backward pass (no padding-masked query is treated
        differently from the general path: the same :math:`1/|V|` weights). :math:`J` comes from the function's
        token sums of the squared scores (:func:`~gpattn.ksvd.ksvd_objective.ksvd_objective_from_sums`), and the
        scores are returned as a :class:`~gpattn.features.amortized_scores.StackedKernelEigenScores` whose
        ``(B, 2, H, s, N)`` tensor lets the layer map both branches with one GEMM."""
        kernel = self.kernel
        lifted = kernel.lift(tokens)
        batch, heads, rank = tokens.shape[0], self.num_heads, self.num_inducing
        projection = torch.stack([kernel.query_weight, kernel.key_projection])  # (2, H, p, D)
        columns = torch.bmm(projection.flatten(0, 2).expand(batch, -1, -1), lifted.mT)
        columns = columns.view(batch, 2, heads, -1, columns.shape[-1])  # [P_q; P_k]: (B, 2, H, p, N)
        maps = torch.stack([self.right_map, self.left_map]).mT  # (2, H, s, C)
        values = torch.bmm(maps.flatten(0, 2).expand(batch, -1, -1), tokens.mT)  # (B, 2 H s, N)
        # the bias added in place to the GEMM's own output (not to a view of it, whose in-place update would make
        # autograd copy the whole gradient)
        values = values.add_(torch.stack([self.right_bias, self.left_bias]).reshape(-1, 1))
        values = values.view(batch, 2, heads, rank, -1)  # [a_r; a_e]: (B, 2, H, s, N)
        weights = self._token_weights(tokens, mask)
        if torch.is_tensor(weights):
            weights = weights.unsqueeze(1)  # (B, 1, 1, 1, N)
        else:
            weights = torch.full((1, 1, 1, 1, 1), weights, dtype=columns.dtype, device=columns.device)
        root_scale = kernel.outputscale.sqrt()[:, None, None]
        square_mask = None if mask is None else mask[:, None, None, None, :].to(columns.dtype)
        scores, score_weights, squares = AmortizedSelfScores.apply(
            columns, values, weights, root_scale, objective, square_mask
        )
        if not torch.compiler.is_compiling() and not all_finite(scores):
            self._check_magnitude(tokens, tokens)
        singular_values = self.singular_values
        objective_value = None
        if objective:  # J from the fused pass's token sums of e^2 and r^2 (masked tokens left out) and Tr(W_e^T W_r)
            coupling = (score_weights[:, 0] * score_weights[:, 1]).sum((-2, -1))
            objective_value = ksvd_objective_from_sums(squares.sum(1), coupling, singular_values)
        left, right = scores.unbind(1)
        return StackedKernelEigenScores(left.mT, right.mT, singular_values, objective_value, stacked=scores)

    def _penalised(self, scores: KernelEigenScores, official: Tensor | None = None) -> KernelEigenScores:
        # a training call refreshes the KSVD penalty: eta J^2 averaged over the sequences and summed over the heads
        # (sum form), or eta J_off^2 (the official code's number)
        if self.training and scores.objective is not None:
            if official is not None:
                penalty = KSVDAddedLossTerm(official, self.ksvd_weight)
            else:
                penalty = KSVDAddedLossTerm(scores.objective, self.ksvd_weight, num_averaged_dims=1)
            # registered in __init__; a plain store (gpytorch's update_added_loss_term reads the previous entry, so
            # torch.compile would guard on it being None and recompile on the second step)
            self._added_loss_terms["ksvd_loss"] = penalty
        return scores

    @staticmethod
    def _zero_masked(scores: Tensor, mask: Tensor | None) -> Tensor:
        return scores if mask is None else scores * mask[:, None, :, None].to(scores.dtype)

    def _exact(
        self,
        queries: Tensor,
        keys: Tensor,
        key_mask: Tensor | None,
        query_mask: Tensor | None,
        causal: bool,
        kernel_diag: bool,
    ) -> KernelEigenScores:
        if causal:
            raise ValueError("features='exact' mixes every token through the SVD: it cannot be causal")
        matrix = self.kernel.forward(queries.unsqueeze(1), keys.unsqueeze(1))  # shape: (B, H, N, M)
        if key_mask is not None:
            matrix = matrix * key_mask[:, None, None, :].to(matrix.dtype)
        if query_mask is not None:
            matrix = matrix * query_mask[:, None, :, None].to(matrix.dtype)
        visible = min(
            queries.shape[-2] if query_mask is None else int(query_mask.sum(-1).min()),
            keys.shape[-2] if key_mask is None else int(key_mask.sum(-1).min()),
        )
        if self.num_inducing > visible:
            raise ValueError(
                f"num_inducing ({self.num_inducing}) exceeds the shortest sequence in the batch ({visible} tokens)"
            )
        svd = kernel_svd(matrix, self.num_inducing)
        left = svd.left * svd.singular_values.unsqueeze(-2)  # e(X) = K H_r = H_e Lambda
        right = svd.right * svd.singular_values.unsqueeze(-2)  # r(Z) = K^T H_e = H_r Lambda
        # a sequence whose kernel has rank < s has lambda_k = 0 (to rounding): such a direction is left out of both the
        # output and the KL (KernelEigenScores.active: zero interpolation column, unit prior) and its Lambda is set
        # to 1 so that nothing divides by it; the others are the exact decomposition's
        values = svd.singular_values
        active = numerically_nonzero(values, max(matrix.shape[-2:]))
        singular_values = torch.where(active, values, torch.ones_like(values))  # shape: (B, H, s)
        self._sequence_active = active
        self._sequence_singular_values = singular_values
        objective = torch.zeros(matrix.shape[:2], dtype=matrix.dtype, device=matrix.device)
        left_diag, right_diag = (matrix.pow(2).sum(-1), matrix.pow(2).sum(-2)) if kernel_diag else (None, None)
        return KernelEigenScores(left, right, singular_values, objective, left_diag, right_diag, active)
